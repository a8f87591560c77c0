"""Model forwards: agreement with Hugging Face transformers' eager forward (float32, CPU), decode
steps against prefill, and the swappable decode-step attention against the kernel references of
hisparse.dsa / hisparse.quest / hisparse.nsa."""
import pytest
import torch

from hisparse.models.config import config_from_dict
from hisparse.models.layers import rope_inv_freq
from hisparse.models.loading import build_model, load_model
from hisparse.models.tiny import TINY_CONFIGS, randomize_, write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

HF_CLASSES = {"deepseek_v32": "DeepseekV32", "glm_moe_dsa": "GlmMoeDsa", "llama": "Llama", "qwen3": "Qwen3"}
PROMPT, TOTAL = 11, 27  # prefill 11 tokens, then decode up to 27
TOLERANCE = 1e-4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one thread is many times faster than two on the shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def hf_checkpoint(family: str, path, seed: int):
    """A tiny transformers model with random weights, saved by transformers itself."""
    prefix = HF_CLASSES[family]
    if not hasattr(transformers, f"{prefix}ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no {prefix}ForCausalLM")
    kwargs = {k: v for k, v in TINY_CONFIGS[family].items() if k != "model_type"}
    kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])  # DeepSeek's default is 128
    config = getattr(transformers, f"{prefix}Config")(**kwargs, max_position_embeddings=256)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")._from_config(config, attn_implementation="eager").eval()
    randomize_(model, seed)
    model.save_pretrained(path)
    return model


def decode_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of positions PROMPT-1 .. TOTAL-1: the prefill's last, then one decode step per token."""
    state = model.new_state(ids.shape[0], ids.shape[1])
    out = [model.prefill(ids[:, :PROMPT], state)[:, -1]]
    out += [model.decode(ids[:, t], state) for t in range(PROMPT, ids.shape[1] - 1)]
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("family", list(HF_CLASSES))
def test_logits_agree_with_transformers(family, tmp_path):
    hf = hf_checkpoint(family, tmp_path, seed=3)
    ours = load_model(tmp_path)
    if family in ("llama", "qwen3"):
        ours.sparse_attention.token_budget = TOTAL + 16  # Quest with a budget covering the whole context
    ids = torch.randint(0, 97, (2, TOTAL), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(ours(ids), ref) < TOLERANCE
    assert rel_err(decode_logits(ours, ids), ref[:, PROMPT - 1: -1]) < TOLERANCE


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_selection_changes_the_logits(family, tmp_path):
    """index_topk (8) < context (27): a dense model would not agree, so the agreement above checks
    the selection itself."""
    hf_checkpoint(family, tmp_path, seed=3)
    ours = load_model(tmp_path)
    ids = torch.randint(0, 97, (2, TOTAL), generator=torch.Generator().manual_seed(4))
    sparse = ours(ids)
    for layer in ours.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.topk = TOTAL
    assert rel_err(ours(ids), sparse) > 1e-2


NSA_SMALL = dict(compress_block_size=8, compress_block_stride=4, selection_block_size=16, num_selected_blocks=4,
                 sliding_window=24)


@pytest.mark.parametrize("family,overrides,total,budget", [
    ("deepseek_v32", {}, 45, None), ("glm_moe_dsa", {}, 45, None), ("llama", {}, 61, 32),
    ("qwen3", {"quest_page_size": 4}, 61, 16), ("nsa", NSA_SMALL, 113, None)],
    ids=["deepseek_v32", "glm_moe_dsa", "llama-budget32", "qwen3-page4-budget16", "nsa-small-blocks"])
def test_decode_steps_match_prefill(family, overrides, total, budget, tmp_path):
    """Sparse decode (Quest with a budget below the context) equals, for DSA and NSA, the prefill
    of the same tokens; for Quest it stays close to dense attention and differs from it."""
    model = load_model(write_tiny_checkpoint(family, tmp_path, seed=5, **overrides))
    if budget is not None:
        model.sparse_attention.token_budget = budget
    ids = torch.randint(0, 97, (2, total), generator=torch.Generator().manual_seed(6))
    full = model(ids)
    state = model.new_state(2, total)
    model.prefill(ids[:, :PROMPT], state)
    steps = torch.stack([model.decode(ids[:, t], state) for t in range(PROMPT, total)], dim=1)
    err = rel_err(steps, full[:, PROMPT:])
    if family in ("llama", "qwen3"):
        assert 1e-5 < err < 0.5  # Quest attends only to the budget's pages
    else:
        assert err < TOLERANCE


def test_quest_single_page_context_selects_the_current_page(tmp_path):
    model = load_model(write_tiny_checkpoint("llama", tmp_path, seed=7))
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(8))
    state = model.new_state(1, 9)
    model.prefill(ids[:, :5], state)
    q = torch.randn(1, 4, 16)
    selection = model.sparse_attention.select(2, q, state.layers[2], 5, 16)
    assert selection[..., 0].tolist() == [[0, 0]] and (selection[..., 1:] == -1).all()


@pytest.mark.parametrize("params", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}], ids=["llama3", "yarn"])
def test_rope_tables_match_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=8, head_dim=64,
                                      max_position_embeddings=163840, rope_parameters=dict(params))
    ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    got, scale = rope_inv_freq(params, 64)
    assert torch.allclose(got, ref, rtol=1e-6, atol=0) and scale == pytest.approx(ref_scale, rel=1e-12)

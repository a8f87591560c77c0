"""Model forwards: agreement with Hugging Face transformers' eager forward (float32, CPU), decode
steps against prefill, and the swappable decode-step attention against the kernel references of
hisparse.dsa / hisparse.quest / hisparse.nsa."""
import pytest
import torch

from hisparse.models.base import stack_states
from hisparse.models.config import config_from_dict
from hisparse.models.layers import rope_inv_freq
from hisparse.models.loading import build_model, load_model
from hisparse.models.tiny import TINY_CONFIGS, randomize_, write_tiny_checkpoint

try:
    import transformers
except ImportError:
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed")

HF_CLASSES = {"deepseek_v32": "DeepseekV32", "glm_moe_dsa": "GlmMoeDsa", "llama": "Llama", "qwen3": "Qwen3"}
PROMPT, TOTAL = 11, 27  # prefill 11 tokens, then decode up to 27
TOLERANCE = 1e-4
FAMILIES_ALL = ["deepseek_v32", "glm_moe_dsa", "llama", "qwen3", "nsa"]


@pytest.fixture(autouse=True, scope="module")
def _single_thread(one_thread):
    yield


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


@needs_transformers
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


@needs_transformers
@pytest.mark.parametrize("family", list(HF_CLASSES))
def test_transformers_reads_our_tiny_checkpoints(family, tmp_path):
    if not hasattr(transformers, f"{HF_CLASSES[family]}ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} lacks {family}")
    ours = load_model(write_tiny_checkpoint(family, tmp_path, seed=14))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(0, 97, (1, 19), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) < TOLERANCE


@needs_transformers
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
    ("qwen3", {"quest_page_size": 4}, 61, 16), ("nsa", NSA_SMALL, 113, None),
    ("nsa", dict(NSA_SMALL, num_hidden_layers=3, selection_group=2), 113, None)],
    ids=["deepseek_v32", "glm_moe_dsa", "llama-budget32", "qwen3-page4-budget16", "nsa-small-blocks",
         "nsa-shared-selection"])
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


@pytest.mark.parametrize("family,overrides", [("glm_moe_dsa", {}), ("qwen3", {}), ("nsa", NSA_SMALL),
                                              ("nsa", dict(NSA_SMALL, num_hidden_layers=3, selection_group=2))],
                         ids=["glm_moe_dsa", "qwen3", "nsa", "nsa-shared-selection"])
def test_chunked_prefill_equals_one_shot(family, overrides, tmp_path):
    """113 tokens (8 NSA selection blocks, more than the 4 selected: a real choice) in chunks of 7."""
    model = load_model(write_tiny_checkpoint(family, tmp_path, seed=9, **overrides))
    ids = torch.randint(0, 97, (2, 113), generator=torch.Generator().manual_seed(10))
    chunked = model.prefill(ids, model.new_state(2, 113), chunk_size=7)
    assert rel_err(chunked, model(ids)) < TOLERANCE


@pytest.mark.parametrize("family", FAMILIES_ALL)
def test_rows_of_different_lengths_decode_as_alone(family, tmp_path):
    """Prompts of 11 and 17 tokens prefilled apart, stacked, decoded together: each row's logits are
    those of its sequence decoded alone (lengths per row, no shared host-side position)."""
    model = load_model(write_tiny_checkpoint(family, tmp_path, seed=16, **(NSA_SMALL if family == "nsa" else {})))
    if family in ("llama", "qwen3"):
        model.sparse_attention.token_budget = 32
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(17))
    prompts, capacity = (11, 17), 48
    alone, states = [], []
    for row, prompt in enumerate(prompts):
        state = model.new_state(1, capacity)
        model.prefill(ids[row:row + 1, :prompt], state)
        states.append(stack_states([state]))  # a copy to decode with the other row
        alone.append(torch.cat([model.decode(ids[row:row + 1, t], state) for t in range(prompt, prompt + 20)]))
    together = stack_states(states)
    steps = [model.decode(torch.stack([ids[0, 11 + i], ids[1, 17 + i]]), together) for i in range(20)]
    assert together.lengths.tolist() == [31, 37]
    assert rel_err(torch.stack(steps, dim=1), torch.stack(alone)) < TOLERANCE


def test_quest_single_page_context_selects_the_current_page(tmp_path):
    model = load_model(write_tiny_checkpoint("llama", tmp_path, seed=7))
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(8))
    state = model.new_state(1, 9)
    model.prefill(ids[:, :5], state)
    q = torch.randn(1, 4, 16)
    selection = model.sparse_attention.select(2, q, state.layers[2], torch.tensor([5]), 16)
    assert selection[..., 0].tolist() == [[0, 0]] and (selection[..., 1:] == -1).all()


@needs_transformers
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


# The swappable decode-step attention against the kernel references it must be swappable with.

def test_dsa_decode_step_matches_kernel_references():
    from hisparse.dsa.reference import (
        MlaKV,
        TorchDsaAttention,
        indexer_scores_ref,
        sparse_mla_decode_ref,
        topk_select_ref,
    )
    g = torch.Generator().manual_seed(11)
    n, length, capacity, heads, dc, dr, topk, scale = 3, 61, 64, 5, 32, 16, 16, 0.3
    kv = MlaKV(latent=torch.randn(n, capacity, dc + dr, generator=g),
               index_keys=torch.randn(n, capacity, 24, generator=g))
    index_q, index_w = torch.randn(n, 4, 24, generator=g), torch.randn(n, 4, generator=g)
    backend = TorchDsaAttention()
    lengths = torch.full((n,), length)
    selection = backend.select(0, index_q, index_w, kv, lengths, topk, scale)
    ref_scores = indexer_scores_ref(index_q, index_w * scale, kv.index_keys, lengths)
    assert torch.equal(selection, topk_select_ref(ref_scores, lengths, topk).long())
    q_latent, q_rope = torch.randn(n, heads, dc, generator=g), torch.randn(n, heads, dr, generator=g)
    selection[1, 9:] = -1  # padded entries are skipped
    out = backend.attend(0, q_latent, q_rope, kv, lengths, selection, scale)
    rows = torch.where(selection >= 0, selection + capacity * torch.arange(n)[:, None], -1)
    ref, _ = sparse_mla_decode_ref(torch.cat([q_latent, q_rope], -1), kv.latent.reshape(n * capacity, -1), rows,
                                   scale, d_v=dc)
    assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("length,budget", [(61, 32), (16, 64), (5, 32)], ids=["L61-budget32", "L16-budget64", "L5"])
def test_quest_decode_step_matches_kernel_references(length, budget):
    from hisparse.quest.ops import pages_from_tokens, quest_metadata_from_keys, resident_rows
    from hisparse.quest.reference import (
        PagedKV,
        TorchQuestAttention,
        quest_attention_ref,
        quest_page_scores_ref,
        quest_select_pages_ref,
    )
    g = torch.Generator().manual_seed(12)
    n, hkv, group, d, capacity, page = 2, 2, 3, 8, 64, 16
    keys, values = torch.randn(n, hkv, capacity, d, generator=g), torch.randn(n, hkv, capacity, d, generator=g)
    kv = PagedKV(torch.zeros_like(keys), torch.zeros_like(values), torch.zeros(n, hkv, 4, d), torch.zeros(n, hkv, 4, d))
    kv.write(torch.arange(length).expand(n, -1), keys[:, :, :length], values[:, :, :length], page)
    lengths = torch.full((n,), length, dtype=torch.int32)
    kmin, kmax = quest_metadata_from_keys(keys[:, :, :length], lengths, 4)
    pages = -(-length // page)
    assert torch.equal(kv.page_min[:, :, :pages], kmin[:, :, :pages])
    assert torch.equal(kv.page_max[:, :, :pages], kmax[:, :, :pages])
    q = torch.randn(n, hkv * group, d, generator=g)
    backend = TorchQuestAttention(budget)
    selection = backend.select(2, q, kv, lengths.long(), page)
    ref_selection = quest_select_pages_ref(quest_page_scores_ref(q, kmin, kmax, lengths), lengths, budget)
    assert torch.equal(selection, ref_selection.long())
    out = backend.attend(2, q, kv, lengths.long(), selection, page, d ** -0.5)
    ref = quest_attention_ref(q, pages_from_tokens(keys, values, 4), resident_rows(ref_selection, 4),
                              ref_selection, lengths)
    assert rel_err(out, ref) < 1e-6


def test_nsa_decode_step_matches_kernel_references():
    from hisparse.nsa.ops import nsa_block_rows, nsa_window_ring
    from hisparse.nsa.reference import nsa_compress_ref, nsa_decode_ref
    g = torch.Generator().manual_seed(13)
    model = build_model(config_from_dict(TINY_CONFIGS["nsa"]))  # the paper's block sizes, as the kernels
    randomize_(model, 13)
    attention = model.model.layers[0].self_attn
    n, length, d = 2, 1111, attention.head_dim  # > 16 blocks of 64: the selection is a real choice
    kv = attention.new_kv(n, length, "cpu", torch.float32)
    kv.keys.copy_(torch.randn(kv.keys.shape, generator=g))
    kv.values.copy_(torch.randn(kv.values.shape, generator=g))
    with torch.no_grad():
        attention._compress(kv, 0, length)
    q, gates = torch.randn(n, attention.n_heads, d, generator=g), torch.rand(n, attention.n_heads, 3, generator=g)
    lengths = torch.full((n,), length)
    out, blocks = model.sparse_attention.decode(0, q, gates, kv, lengths)
    ck, cv = nsa_compress_ref(kv.keys, kv.values, attention.compress_k.weight.T, attention.compress_v.weight.T)
    assert rel_err(kv.compressed_keys, ck) < 1e-6 and rel_err(kv.compressed_values, cv) < 1e-6
    win_k, win_v = nsa_window_ring(kv.keys, kv.values, lengths.int())
    ref, ref_blocks = nsa_decode_ref(q, ck, cv, nsa_block_rows(kv.keys, kv.values), win_k, win_v, lengths.int(),
                                     gates, n_units=-(-length // 64))
    assert rel_err(out, ref) < 1e-5
    _, probs = model.sparse_attention.compressed(0, q.view(n, attention.n_kv_heads, -1, d), kv, lengths)
    assert torch.equal(model.sparse_attention.select(0, probs, lengths, -(-length // 64)), ref_blocks.long())
    assert torch.equal(blocks, ref_blocks.long())
    # a selection given back (as a layer sharing its anchor's gets it) is used as it is
    again, same = model.sparse_attention.decode(0, q, gates, kv, lengths, blocks=blocks)
    assert torch.equal(again, out) and same is blocks
    other = torch.full_like(blocks, -1)
    other[..., :3] = torch.tensor([0, 1, 2])
    assert not torch.equal(model.sparse_attention.decode(0, q, gates, kv, lengths, blocks=other)[0], out)

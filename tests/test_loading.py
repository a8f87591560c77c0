"""Checkpoint loading: round trips of every family, sharding, fused experts, dtypes, and clear errors
(naming the tensor, the key or the model_type) raised before any tensor data is read."""
import io
import json
import math
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import hisparse.models.loading as loading
from hisparse.make_tiny import main as make_tiny
from hisparse.models.config import ConfigWarning, config_from_dict, read_config
from hisparse.models.loading import build_model, load_model
from hisparse.models.tiny import TINY_CONFIGS, randomize_, save_checkpoint, write_tiny_checkpoint
from hisparse.progress import Progress

FAMILIES = sorted(TINY_CONFIGS)


@pytest.fixture(autouse=True, scope="module")
def _single_thread(one_thread):
    yield


def random_model(family: str, seed: int = 0, **overrides):
    model = build_model(config_from_dict(dict(TINY_CONFIGS[family], **overrides)))
    randomize_(model, seed)
    return model


def assert_same_weights(loaded, model):
    expected = model.state_dict()
    got = loaded.state_dict()
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("shards", [1, 3], ids=["one-file", "3-shards"])
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip(family, shards, tmp_path):
    model = random_model(family, seed=1)
    save_checkpoint(model, tmp_path, shards=shards)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shards > 1)
    loaded = load_model(tmp_path)
    assert_same_weights(loaded, model)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    assert torch.equal(loaded(ids), model(ids))


def test_fused_expert_tensors_load_as_well(tmp_path):
    model = random_model("deepseek_v32", seed=3)
    write_tiny_checkpoint("deepseek_v32", tmp_path)
    save_file(dict(model.state_dict()), tmp_path / "model.safetensors")
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(tmp_path / "model.safetensors")
    assert_same_weights(load_model(tmp_path), model)


def test_tied_embeddings_need_no_lm_head(tmp_path):
    model = random_model("llama", seed=4, tie_word_embeddings=True)
    save_checkpoint(model, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert_same_weights(loaded, model)


def test_bfloat16_keeps_routing_and_indexer_weights_in_float32(tmp_path):
    loaded = load_model(write_tiny_checkpoint("glm_moe_dsa", tmp_path), dtype=torch.bfloat16)
    dtypes = {name: t.dtype for name, t in loaded.state_dict().items()}
    assert dtypes["model.layers.1.mlp.gate.weight"] == torch.float32
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32
    assert dtypes["model.layers.0.self_attn.indexer.weights_proj.weight"] == torch.float32
    assert dtypes["model.layers.1.mlp.experts.gate_up_proj"] == torch.bfloat16
    assert dtypes["model.layers.0.self_attn.kv_b_proj.weight"] == torch.bfloat16
    logits = loaded(torch.tensor([[3, 1, 4, 1, 5]]))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


@pytest.fixture
def tensor_reads(monkeypatch):
    """Counts tensors read through safetensors by the loader."""
    reads = []
    real_open = loading.safe_open

    class CountingOpen:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_tensor(self, name):
            reads.append(name)
            return self.inner.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(loading, "safe_open", CountingOpen)
    return reads


def retype(name, dtype):
    return lambda tensors: tensors.update({name: tensors[name].to(dtype)})


BAD_TENSORS = {
    "missing": (lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"),
                r"lacks tensors: \['model\.layers\.1\.self_attn\.kv_b_proj\.weight'\]"),
    "missing-expert": (lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"),
                       r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"),
    "misshaped": (lambda t: t.update({"model.layers.0.self_attn.q_b_proj.weight": torch.zeros(160, 47)}),
                  r"tensor model\.layers\.0\.self_attn\.q_b_proj\.weight .* shape \[160, 47\], expected \[160, 48\]"),
    "unexpected": (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)}),
                   r"unexpected tensors .*'model\.layers\.0\.self_attn\.q_proj\.weight'"),
    "fp8-scales": (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.zeros(1, 1)}),
                   r"FP8 block-quantized"),
    "int-weight": (retype("model.layers.0.self_attn.q_b_proj.weight", torch.int16),
                   r"q_b_proj\.weight in model\.safetensors has dtype I16, expected a floating point dtype"),
    "bool-embedding": (retype("model.embed_tokens.weight", torch.bool),
                       r"model\.embed_tokens\.weight in model\.safetensors has dtype BOOL"),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_bad_tensors_are_named_before_anything_is_read(case, tmp_path, tensor_reads):
    edit, message = BAD_TENSORS[case]
    write_tiny_checkpoint("deepseek_v32", tmp_path)
    rewrite(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path)
    assert tensor_reads == []


def test_the_counting_fixture_sees_reads(tmp_path, tensor_reads):
    load_model(write_tiny_checkpoint("llama", tmp_path))
    assert "model.norm.weight" in tensor_reads


def test_multi_token_prediction_layers_are_ignored(tmp_path):
    """DeepSeek checkpoints carry an extra layer (index num_hidden_layers) for multi-token prediction."""
    write_tiny_checkpoint("deepseek_v32", tmp_path)
    rewrite(tmp_path, lambda t: t.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128)}))
    load_model(tmp_path)


@pytest.mark.parametrize("family,extra", [("llama", "1, 2"), ("deepseek_v32", "2")])
def test_layers_beyond_the_config_are_refused(family, extra, tmp_path):
    """Only DSA's multi-token-prediction layer (here layer 1) may follow the last decoder layer."""
    write_tiny_checkpoint(family, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("mlp_layer_types", "indexer_types", "quest_dense_layers")}
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, num_hidden_layers=1)))
    with pytest.raises(ValueError, match=rf"unexpected tensors .*; layers \[{extra}\] are beyond config\.json's "
                                         r"num_hidden_layers 1"):
        load_model(tmp_path)


def test_duplicate_tensor_across_shards_is_named(tmp_path):
    write_tiny_checkpoint("nsa", tmp_path, shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    second = sorted(set(index["weight_map"].values()))[1]
    tensors = load_file(tmp_path / second)
    tensors["model.norm.weight"] = torch.ones(64)
    save_file(tensors, tmp_path / second)
    with pytest.raises(ValueError, match=r"tensor model\.norm\.weight is in both"):
        load_model(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    write_tiny_checkpoint("qwen3", tmp_path, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"shard files that do not exist: \['model-00002-of-00002\.safetensors'\]"):
        load_model(tmp_path)


def test_unreadable_files_are_named(tmp_path):
    write_tiny_checkpoint("qwen3", tmp_path / "html", shards=2)
    (tmp_path / "html" / "model-00002-of-00002.safetensors").write_text("<!DOCTYPE html><html>Not found</html>")
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors is not a readable safetensors file"):
        load_model(tmp_path / "html")
    write_tiny_checkpoint("qwen3", tmp_path / "index", shards=2)
    (tmp_path / "index" / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json must hold .*'weight_map'"):
        load_model(tmp_path / "index")


@pytest.mark.parametrize("value,dtype,message", [
    (float("nan"), torch.float32, r"tensor model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight in "
                                  r"model\.safetensors holds 1 non-finite values \(nan at \[5, 7\]\)"),
    (float("-inf"), torch.float32, r"holds 1 non-finite values \(-inf at \[5, 7\]\): expected finite weights"),
    (1e38, torch.float16, r"experts\.3\.down_proj\.weight in model\.safetensors holds values up to 1e\+38, past "
                          r"the range of float16"),
], ids=["nan", "inf", "past-float16"])
def test_non_finite_weights_are_named_at_load(value, dtype, message, tmp_path):
    """A NaN or infinite weight (stored so, or overflowing the dtype it is loaded in) used to load and run
    to NaN logits and greedy token 0 without a word."""
    write_tiny_checkpoint("deepseek_v32", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.experts.3.down_proj.weight"][5, 7] = value
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path, dtype=dtype)


def test_load_model_tells_a_progress_of_each_file_it_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "PROGRESS_EVERY_S", 0.0)        # a line per file, however fast
    save_checkpoint(random_model("llama"), tmp_path, shards=3)
    lines = io.StringIO()
    load_model(tmp_path, progress=Progress(lines))
    read = [re.fullmatch(r"\[ *\d+\.\d s\] reading (\S+) \((\d) of 3 files\)", line).groups()
            for line in lines.getvalue().splitlines()]
    assert sorted(name for name, _ in read) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [i for _, i in read] == ["1", "2", "3"]


def test_pickled_weights_are_refused(tmp_path, monkeypatch):
    write_tiny_checkpoint("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({"model.norm.weight": torch.ones(64)}, tmp_path / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        load_model(tmp_path)


@pytest.mark.parametrize("edit,message", [
    ({"model_type": "mistral"}, r"unsupported model_type 'mistral'"),
    ({"model_type": None}, r"unsupported model_type None"),
    ({"hidden_size": None}, r"lacks required keys \['hidden_size'\]"),
    ({"num_key_value_heads": 3}, r"num_attention_heads 4 must be a multiple of num_key_value_heads 3"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, r"rope_type 'longrope' is not supported"),
    ({"num_attention_heads": 0, "head_dim": None}, r"num_attention_heads must be a positive int, found 0"),
], ids=["unknown-type", "no-type", "missing-key", "bad-gqa", "bad-act", "bad-rope", "no-heads"])
def test_bad_config_is_named(edit, message, tmp_path):
    write_tiny_checkpoint("llama", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(edit)
    raw = {k: v for k, v in raw.items() if v is not None or k == "model_type"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path)


@pytest.mark.parametrize("edit,message", [
    ({"indexer_types": ["full", "shared"]}, r"indexer_types must list 3 values"),
    ({"indexer_types": ["shared", "full", "full"]}, r"indexer_types\[0\] must be 'full'"),
    ({"model_type": "deepseek_v32", "indexer_types": ["full", "shared", "full"]}, r"deepseek_v32 has no shared"),
    ({"n_group": 3}, r"n_routed_experts 4 must be a multiple of n_group 3"),
], ids=["short-indexer-types", "shared-first", "shared-in-v32", "bad-groups"])
def test_bad_dsa_config_is_named(edit, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict(dict(TINY_CONFIGS["glm_moe_dsa"], **edit))


@pytest.mark.parametrize("edit,message", [
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok 5 must be at most n_routed_experts 4, and at most the 2 "),
    ({"num_experts_per_tok": 3}, r"num_experts_per_tok 3 must be at most .* the 2 experts of the topk_group 1 groups"),
    ({"topk_group": 3}, r"config topk_group 3 must be at most n_group 2"),
    ({"n_group": 4, "topk_group": 2}, r"n_routed_experts 4 over n_group 4 leaves 1 expert per group"),
    ({"routed_scaling_factor": 1e30}, r"config routed_scaling_factor 1e\+30 must be at most 100"),
    ({"routed_scaling_factor": float("inf")}, r"config routed_scaling_factor must be a positive number, found inf"),
], ids=["top-k>experts", "top-k>routed-groups", "topk-group>groups", "one-expert-groups", "scaling-1e30", "scaling-inf"])
def test_moe_routing_fields_are_checked_against_each_other(edit, message, tmp_path):
    """A top-k past its pool used to load and then fail inside the first forward ("selected index k out of
    range"), and a scaling factor of 1e30 overflowed to logits of zero without a word."""
    edit_config(write_tiny_checkpoint("deepseek_v32", tmp_path), edit)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path)


def test_routing_fields_of_a_model_without_moe_layers_are_not_read():
    config = config_from_dict(dict(TINY_CONFIGS["deepseek_v32"], first_k_dense_replace=3, num_experts_per_tok=9))
    assert config.mlp_layer_types == ["dense"] * 3


@pytest.mark.parametrize("keys,expected", [
    ({"index_topk_freq": 2, "index_skip_topk_offset": 1, "num_hidden_layers": 5},
     ["full", "shared", "full", "shared", "full"]),
    ({"index_topk_pattern": "FFS", "num_hidden_layers": 3}, ["full", "full", "shared"]),
    ({"num_hidden_layers": 3}, ["full", "full", "full"]),
], ids=["freq2-offset1", "pattern", "default"])
def test_glm_shared_indexer_keys_as_transformers(keys, expected):
    """The expected lists are those transformers' GlmMoeDsaConfig builds from the same keys."""
    raw = {k: v for k, v in TINY_CONFIGS["glm_moe_dsa"].items() if k != "indexer_types"}
    assert config_from_dict(dict(raw, **keys)).indexer_types == expected


def test_legacy_rope_keys_are_read(tmp_path):
    write_tiny_checkpoint("deepseek_v32", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["rope_parameters"]
    raw["rope_theta"] = 5000.0
    raw["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                           "mscale": 1.0, "mscale_all_dim": 1.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    params = read_config(tmp_path).rope_parameters
    assert params["rope_type"] == "yarn" and params["rope_theta"] == 5000.0 and params["factor"] == 4.0
    model = load_model(tmp_path)
    mscale = 0.1 * math.log(4.0) + 1
    assert model.model.layers[0].self_attn.scaling == pytest.approx(40 ** -0.5 * mscale ** 2)


def test_make_tiny_cli(tmp_path, capsys):
    make_tiny(["--family", "nsa", "--out", str(tmp_path / "nsa"), "--shards", "2"])
    out, err = capsys.readouterr()
    assert "wrote a tiny nsa checkpoint" in out
    assert re.fullmatch(r"\[ *\d+\.\d s\] building a random nsa model \(seed 0\), writing 2 safetensors files\n", err)
    assert load_model(tmp_path / "nsa").config.model_type == "nsa"
    with pytest.raises(SystemExit):
        make_tiny(["--family", "mistral", "--out", str(tmp_path / "x")])
    before = {p.name: p.read_bytes() for p in (tmp_path / "nsa").iterdir()}
    with pytest.raises(SystemExit):                       # an existing checkpoint is not overwritten
        make_tiny(["--family", "llama", "--out", str(tmp_path / "nsa")])
    assert "already holds files" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "nsa").iterdir()} == before
    make_tiny(["--family", "llama", "--out", str(tmp_path / "nsa"), "--force"])   # no stale shards left
    assert load_model(tmp_path / "nsa").config.model_type == "llama"


@pytest.mark.parametrize("prefix", ["DeepseekV32", "GlmMoeDsa", "Llama", "Qwen3"])
def test_real_size_names_and_shapes_equal_transformers(prefix):
    """At the real models' sizes (the transformers config defaults: DeepSeek-V3.2, GLM-5, Llama-2-7B,
    Qwen3-8B), built on the meta device: our parameters are transformers' parameters, name for name
    and shape for shape, and our config reads the config.json transformers writes without a warning."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, f"{prefix}ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no {prefix}ForCausalLM")
    hf_config = getattr(transformers, f"{prefix}Config")()
    with torch.device("meta"):
        hf = getattr(transformers, f"{prefix}ForCausalLM")._from_config(hf_config)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConfigWarning)       # every key transformers writes is known
            ours = build_model(config_from_dict(json.loads(hf_config.to_json_string())))
    expected = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in ours.state_dict().items()} == expected


# -- config.json keys: unknown keys reported, model-changing values checked (issue #37) ----------

def edit_config(path, edits=None, drop=()):
    """Rewrite `path`'s config.json with `edits` applied and the keys in `drop` removed."""
    raw = json.loads((path / "config.json").read_text())
    raw.update(edits or {})
    raw = {k: v for k, v in raw.items() if k not in drop}
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_a_misspelled_key_warns_with_the_nearest_known_key(tmp_path):
    """`rope_thetaa` used to be dropped without a word (the default theta then gives other tokens)."""
    edit_config(write_tiny_checkpoint("llama", tmp_path), {"rope_thetaa": 500000.0, "frobnicate": 1})
    with pytest.warns(ConfigWarning) as caught:
        model = load_model(tmp_path)
    (warning,) = [w for w in caught if issubclass(w.category, ConfigWarning)]
    message = str(warning.message)
    assert "'rope_thetaa' (did you mean 'rope_theta'?)" in message
    assert "'frobnicate'" in message and "'frobnicate' (did you mean" not in message
    assert model.config.rope_parameters["rope_theta"] == 10000.0        # reported, not guessed


def test_a_misspelled_rope_parameter_warns(tmp_path):
    edit_config(write_tiny_checkpoint("llama", tmp_path),
                {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                     "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "hihg_freq_factor": 2.0}})
    with pytest.warns(ConfigWarning, match=r"'hihg_freq_factor' \(did you mean 'high_freq_factor'\?\)"):
        load_model(tmp_path)


HF_METADATA = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", "dtype": "bfloat16",
               "transformers_version": "5.24.0", "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": None,
               "use_cache": True, "initializer_range": 0.02, "attention_dropout": 0.0, "max_position_embeddings": 4096,
               "pretraining_tp": 1, "_name_or_path": "meta-llama/Llama-2-7b-hf"}


@pytest.mark.parametrize("family,extra", [
    ("llama", HF_METADATA),
    ("qwen3", dict(HF_METADATA, use_sliding_window=False, sliding_window=None, max_window_layers=28,
                   layer_types=["full_attention"] * 3)),
    ("deepseek_v32", dict(HF_METADATA, num_key_value_heads=4, qk_head_dim=40, head_dim=16, mlp_bias=False,
                          scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, ep_size=1,
                          aux_loss_alpha=0.001, seq_aux=True, output_router_logits=False, rope_interleave=True,
                          indexer_rope_interleave=False, layer_types=["indexed_attention"] * 3,
                          quantization_config={"quant_method": "fp8"})),
    ("glm_moe_dsa", dict(HF_METADATA, indexer_rope_interleave=True, index_topk_freq=1, scoring_func="sigmoid")),
    ("nsa", HF_METADATA),
], ids=["llama", "qwen3", "deepseek_v32", "glm_moe_dsa", "nsa"])
def test_keys_real_configs_carry_do_not_warn(family, extra, tmp_path):
    edit_config(write_tiny_checkpoint(family, tmp_path), extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(tmp_path)


@pytest.mark.parametrize("family,edits,message", [
    ("deepseek_v32", {"scoring_func": "softmax"}, r"scoring_func 'softmax' .* expected 'sigmoid'"),
    ("deepseek_v32", {"topk_method": "greedy"}, r"topk_method 'greedy' .* expected 'noaux_tc'"),
    ("deepseek_v32", {"indexer_rope_interleave": True}, r"indexer_rope_interleave True .* expected False"),
    ("glm_moe_dsa", {"indexer_rope_interleave": False}, r"indexer_rope_interleave False .* expected True"),
    ("deepseek_v32", {"qk_head_dim": 64}, r"qk_head_dim 64 .* expected 40"),
    ("qwen3", {"use_sliding_window": True}, r"use_sliding_window True .* expected False"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     r"layer_types \['full_attention', 'sliding_attention', 'full_attention'\] .* expected \['full_attention'"),
    ("llama", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0\.5 .* expected 1"),
], ids=["scoring", "topk-method", "v32-interleaved-indexer", "glm-half-split-indexer", "qk-head-dim",
        "sliding-window", "sliding-layers", "partial-rotary"])
def test_model_changing_values_we_do_not_implement_are_refused(family, edits, message, tmp_path):
    edit_config(write_tiny_checkpoint(family, tmp_path), edits)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path)


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}


def without(params, key):
    return {k: v for k, v in params.items() if k != key}


@pytest.mark.parametrize("family,edits,drop,message", [
    ("llama", {"rms_norm_eps": "1e-6"}, (), r"config rms_norm_eps must be a positive number, found '1e-6'"),
    ("nsa", {"rms_norm_eps": 0}, (), r"config rms_norm_eps must be a positive number, found 0"),
    ("deepseek_v32", {"routed_scaling_factor": "2.5"}, (),
     r"config routed_scaling_factor must be a positive number, found '2\.5'"),
    ("deepseek_v32", {"norm_topk_prob": "false"}, (), r"config norm_topk_prob must be true or false, found 'false'"),
    ("llama", {"tie_word_embeddings": 1}, (), r"config tie_word_embeddings must be true or false, found 1"),
    ("llama", {"rope_theta": "10000"}, ("rope_parameters",),
     r"rope_theta must be a positive number, found '10000'"),
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": "1e6"}}, (),
     r"rope_theta must be a positive number, found '1e6'"),
    ("llama", {"rope_scaling": without(YARN, "factor")}, ("rope_parameters",),
     r"config rope_scaling of rope_type 'yarn' lacks 'factor'"),
    ("deepseek_v32", {"rope_scaling": dict(YARN, factor="4")}, ("rope_parameters",),
     r"factor must be a positive number, found '4'"),
    ("llama", {"rope_scaling": without(LLAMA3, "factor")}, ("rope_parameters",),
     r"config rope_scaling of rope_type 'llama3' lacks 'factor'"),
    ("llama", {"rope_parameters": dict(LLAMA3, rope_theta=5e5, low_freq_factor=None)}, (),
     r"low_freq_factor must be a positive number, found None"),
    ("llama", {"rope_parameters": dict(LLAMA3, rope_theta=5e5, low_freq_factor=4.0)}, (),
     r"low_freq_factor 4\.0 must be smaller than high_freq_factor 4\.0"),
    ("llama", {"rope_scaling": without(YARN, "original_max_position_embeddings")}, ("rope_parameters",),
     r"lacks 'original_max_position_embeddings' .*max_position_embeddings"),
    ("deepseek_v32", {"rope_scaling": dict(YARN, beta_fast="32")}, ("rope_parameters",),
     r"beta_fast must be a number or null, found '32'"),
    ("llama", {"rope_scaling": "yarn"}, ("rope_parameters",), r"config rope_scaling must be a JSON object"),
    ("llama", {"quest_dense_layers": -1}, (),
     r"config quest_dense_layers must be an int from 0 to num_hidden_layers 3, found -1"),
    ("llama", {"quest_dense_layers": 4}, (),
     r"config quest_dense_layers must be an int from 0 to num_hidden_layers 3, found 4"),
    ("qwen3", {"quest_dense_layers": True}, (), r"config quest_dense_layers must be an int .*found True"),
    ("glm_moe_dsa", {"index_topk_freq": "2"}, ("indexer_types",), r"config index_topk_freq must be an int"),
    ("glm_moe_dsa", {"index_topk_pattern": "FXF"}, ("indexer_types",),
     r"config index_topk_pattern must be a string of 'F' and 'S'"),
    ("llama", {"model_type": ["llama"]}, (), r"unsupported model_type \['llama'\]"),
], ids=["str-eps", "zero-eps", "str-scaling", "str-bool", "int-bool", "str-theta", "str-theta-in-params",
        "yarn-no-factor", "yarn-str-factor", "llama3-no-factor", "llama3-null-low", "llama3-low=high",
        "yarn-no-original-len", "yarn-str-beta", "str-rope-scaling", "negative-dense-layers", "dense-layers>layers",
        "bool-dense-layers", "str-glm-freq", "bad-glm-pattern", "list-model-type"])
def test_bad_config_values_are_named_at_load(family, edits, drop, message, tmp_path):
    """A wrong type or a missing rope key used to load and then fail (TypeError, KeyError) inside the first
    forward, or to be read two ways (a negative quest_dense_layers); now load_model names it."""
    edit_config(write_tiny_checkpoint(family, tmp_path), edits, drop)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path)


def test_rope_defaults_as_transformers(tmp_path):
    """A `rope_parameters` without rope_theta takes the top-level rope_theta; a yarn or llama3 one without
    original_max_position_embeddings takes max_position_embeddings (transformers' standardization)."""
    edit_config(write_tiny_checkpoint("llama", tmp_path), {
        "rope_theta": 5e5, "max_position_embeddings": 256,
        "rope_parameters": without(dict(LLAMA3, rope_type="llama3"), "original_max_position_embeddings")})
    params = read_config(tmp_path).rope_parameters
    assert params["rope_theta"] == 5e5 and params["original_max_position_embeddings"] == 256
    assert torch.isfinite(load_model(tmp_path)(torch.tensor([[1, 2, 3]]))).all()


def test_quest_dense_layers_default_fits_the_layer_count():
    """Without the key, the first 2 layers stay dense, or every layer of a model of fewer."""
    assert config_from_dict(dict(TINY_CONFIGS["llama"])).quest_dense_layers == 2
    assert config_from_dict(dict(TINY_CONFIGS["llama"], num_hidden_layers=1)).quest_dense_layers == 1
    assert config_from_dict(dict(TINY_CONFIGS["llama"], quest_dense_layers=3)).quest_dense_layers == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_pinned_key_names_are_those_checked(family):
    from hisparse.models.config import PINNED_KEYS, _pinned_keys
    config = config_from_dict(dict(TINY_CONFIGS[family]))
    assert set(_pinned_keys(config)) == PINNED_KEYS[type(config).__name__]

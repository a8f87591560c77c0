"""Model configurations read from a checkpoint's `config.json`, one dataclass per family.

Field names are those of the Hugging Face configs (`DeepseekV32Config`, `GlmMoeDsaConfig`,
`LlamaConfig`, `Qwen3Config`) so a real `config.json` reads as is. The NSA config is our own; its keys
are documented in `hisparse/nsa/README.md`. Every other key of a `config.json` is one of:
- read into a field: the older `rope_theta` + `rope_scaling` (and `max_position_embeddings`, the default
  of `original_max_position_embeddings`, as transformers), GLM-5's `index_topk_*` shared-indexer keys;
- `IGNORED_KEYS` / `FAMILY_IGNORED_KEYS`: keys real Hugging Face configs carry that do not change what
  the model computes (metadata, token ids, training-only settings, values transformers derives itself);
- pinned (`_pinned_keys`): keys that do change the model, which HiSparse implements at one value only;
  any other value is refused (ValueError), never ignored;
- unknown: reported with a `ConfigWarning` naming each key and the nearest known key (a misspelled key
  leaves its field's default in force), then ignored.
Values are type-checked at load (`ValueError` naming the key, the value and what is expected), so a
bad one never reaches a forward pass.
"""
import dataclasses
import difflib
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROPE_TYPES = ("default", "llama3", "yarn")
# rope_parameters keys read per rope_type (as transformers' rope validation), and those required
ROPE_KEYS = {"default": ("rope_theta",),
             "llama3": ("rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
                        "high_freq_factor"),
             "yarn": ("rope_theta", "factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                      "beta_slow", "mscale", "mscale_all_dim", "truncate")}
ROPE_REQUIRED = {"default": (), "llama3": ROPE_KEYS["llama3"][1:],
                 "yarn": ("factor", "original_max_position_embeddings")}

# Keys real Hugging Face config.json files carry that do not change what the model computes: read and
# dropped without a word. A key that changes the model belongs in `_pinned_keys` instead.
IGNORED_KEYS = frozenset({
    # metadata
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    # special token ids: the tokenizer's business (eos_token_id is a field: generation stops there)
    "bos_token_id", "pad_token_id",
    # training and caching settings, no effect on an inference forward
    "use_cache", "initializer_range", "attention_dropout", "output_router_logits", "router_aux_loss_coef",
    "aux_loss_alpha", "seq_aux", "ep_size",
    # transformers 4 Llama's tensor-parallel slicing of its linear layers: the same products
    "pretraining_tp",
    # a quantized checkpoint is refused by its tensors (names, dtypes), whatever this says
    "quantization_config",
})
FAMILY_IGNORED_KEYS = {
    # MLA: every head's keys and values come from the one shared latent (transformers keeps the key for
    # its cache); transformers sets head_dim to qk_rope_head_dim whatever the file says
    "DsaConfig": frozenset({"num_key_value_heads", "head_dim"}),
    # read by transformers' Qwen3 only with use_sliding_window, which is pinned to false
    "LlamaConfig": frozenset({"sliding_window", "max_window_layers"}),
    "NsaConfig": frozenset(),
}
# keys read besides the fields (the older rope keys, GLM-5's shared-indexer keys)
READ_KEYS = frozenset({"rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings"})
GLM_INDEXER_KEYS = frozenset({"index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"})
# The most routed_scaling_factor may be. Real checkpoints use 1 to 2.83 (DeepSeek-V3 and GLM-5 2.5, Kimi-K2
# 2.827); it multiplies the routed experts' output added to the residual stream, so 100 is already far past
# any trained model, and one like 1e30 overflows without an error (logits of 0, inf or NaN; token 0).
ROUTED_SCALING_MAX = 100.0


class ConfigWarning(UserWarning):
    """A config.json key that HiSparse does not read: a misspelling, or a key of another model."""


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(name: str, value, positive: bool = True, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_number(value) or not math.isfinite(value) or (positive and value <= 0):
        kind = "a positive number" if positive else "a number"
        raise ValueError(f"config {name} must be {kind}{' or null' if optional else ''}, found {value!r}")


def _check_bools(config, names) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise ValueError(f"config {name} must be true or false, found {value!r}")


def _check_rope(params, source: str = "rope_parameters") -> None:
    """`params` (normalized: `rope_type` set, no `type`) holds what its rope_type needs, of the right types.
    `source` is the key the values came from, for the messages."""
    if not isinstance(params, dict):
        raise ValueError(f"config {source} must be a JSON object (dict), found {params!r}")
    kind = params.get("rope_type")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type {kind!r} is not supported; expected one of {ROPE_TYPES}")
    missing = [k for k in ROPE_REQUIRED[kind] if k not in params]
    if missing:
        extra = (" (nor does config.json give max_position_embeddings, its default)"
                 if "original_max_position_embeddings" in missing else "")
        raise ValueError(f"config {source} of rope_type {kind!r} lacks {', '.join(map(repr, missing))}{extra}")
    _check_number(f"{source}.rope_theta", params.get("rope_theta"))
    for key in ROPE_REQUIRED[kind]:
        _check_number(f"{source}.{key}", params[key])
    if kind == "llama3" and not params["low_freq_factor"] < params["high_freq_factor"]:
        raise ValueError(f"config {source}.low_freq_factor {params['low_freq_factor']!r} must be smaller than "
                         f"high_freq_factor {params['high_freq_factor']!r}")
    if kind == "yarn":
        for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            _check_number(f"{source}.{key}", params.get(key), positive=False, optional=True)
        if not isinstance(params.get("truncate", True), bool):
            raise ValueError(f"config {source}.truncate must be true or false, found {params['truncate']!r}")
    if params.get("partial_rotary_factor", 1) != 1:
        raise ValueError(f"config {source}.partial_rotary_factor {params['partial_rotary_factor']!r} is not "
                         f"supported; expected 1 (RoPE on the whole rotary head dim)")


def _rope_source(raw: dict) -> tuple[str, object]:
    """Where the RoPE parameters come from: `rope_parameters` (transformers 5) or the older `rope_scaling`."""
    if raw.get("rope_parameters") is not None:
        return "rope_parameters", raw["rope_parameters"]
    return "rope_scaling", raw.get("rope_scaling") or {}


def _rope_parameters(raw: dict) -> dict:
    """`rope_parameters` (transformers 5) or the older `rope_theta` + `rope_scaling` keys, standardized as
    transformers does: `rope_type` (or its older name `type`, default "default"); rope_theta from the
    top-level key when the dict has none (default 10000); for llama3 and yarn,
    original_max_position_embeddings from max_position_embeddings when the dict has none."""
    source, params = _rope_source(raw)
    if not isinstance(params, dict):
        raise ValueError(f"config {source} must be a JSON object (dict), found {params!r}")
    params = dict(params)
    kind = params.pop("type", "default")
    params["rope_type"] = params.get("rope_type", kind)
    if "rope_theta" not in params:
        if "rope_theta" in raw:
            _check_number("rope_theta", raw["rope_theta"])
        params["rope_theta"] = raw.get("rope_theta", 10000.0)
    if params["rope_type"] in ("llama3", "yarn") and "original_max_position_embeddings" not in params:
        if raw.get("max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = raw["max_position_embeddings"]
    _check_rope(params, source)
    return params


def _check_eos(config) -> None:
    """eos_token_id: null, an id or a list of ids, each in the vocabulary."""
    eos, vocab = config.eos_token_id, config.vocab_size
    if isinstance(vocab, bool) or not isinstance(vocab, int):
        return                                          # _check_positive names the bad vocab_size
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab for i in ids):
        raise ValueError(f"config eos_token_id must be null, a token id or a list of token ids in [0, "
                         f"{vocab}), found {eos!r}")


def _check_positive(config, names, zero_allowed=False):
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if zero_allowed else 1):
            kind = "a non-negative" if zero_allowed else "a positive"
            raise ValueError(f"config {name} must be {kind} int, found {value!r}")


@dataclass(slots=True)
class DsaConfig:
    """MLA + lightning indexer: `deepseek_v32`, and `glm_moe_dsa` with shared-indexer layers."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    # multi-token-prediction layers, stored after the last decoder layer; we load none of them
    num_nextn_predict_layers: int = 1
    mlp_layer_types: list[str] | None = None
    indexer_types: list[str] | None = None
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    eos_token_id: int | list[int] | None = None     # where generation stops (hisparse.sampling.eos_token_ids)

    def __post_init__(self):
        _check_eos(self)
        if self.model_type not in ("deepseek_v32", "glm_moe_dsa"):
            raise ValueError(f"DsaConfig got model_type {self.model_type!r}")
        _check_positive(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                               "qk_nope_head_dim", "v_head_dim", "index_topk", "index_head_dim", "index_n_heads",
                               "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group",
                               "topk_group"))
        _check_positive(self, ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"),
                        zero_allowed=True)
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; expected 'silu'")
        _check_number("rms_norm_eps", self.rms_norm_eps)
        _check_number("routed_scaling_factor", self.routed_scaling_factor)
        _check_bools(self, ("norm_topk_prob", "attention_bias", "tie_word_embeddings"))
        _check_rope(self.rope_parameters)
        n = self.num_hidden_layers
        if self.mlp_layer_types is None:
            dense = min(self.first_k_dense_replace, n)
            self.mlp_layer_types = ["dense"] * dense + ["sparse"] * (n - dense)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * n
        for name, allowed in (("mlp_layer_types", ("dense", "sparse")), ("indexer_types", ("full", "shared"))):
            values = getattr(self, name)
            if not isinstance(values, list) or len(values) != n or any(v not in allowed for v in values):
                raise ValueError(f"config {name} must list {n} values from {allowed}, found {values}")
        if self.indexer_types[0] != "full":
            raise ValueError(f"indexer_types[0] must be 'full' (a shared layer needs an anchor), found "
                             f"{self.indexer_types[0]!r}")
        if self.model_type == "deepseek_v32" and "shared" in self.indexer_types:
            raise ValueError("deepseek_v32 has no shared indexer layers; indexer_types is a glm_moe_dsa key")
        if self.qk_rope_head_dim % 2 or self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and at most "
                             f"index_head_dim {self.index_head_dim}")
        if "sparse" in self.mlp_layer_types:
            self._check_routing()

    def _check_routing(self) -> None:
        """The router's fields against each other (moe.TopkRouter): each a top-k over what the one before
        leaves, so a k past its pool would fail inside the first forward ("selected index k out of range")."""
        experts, groups = self.n_routed_experts, self.n_group
        if experts % groups:
            raise ValueError(f"n_routed_experts {experts} must be a multiple of n_group {groups}")
        if experts // groups < 2:
            raise ValueError(f"n_routed_experts {experts} over n_group {groups} leaves {experts // groups} expert per "
                             f"group: expected at least 2 (a group scores by its two best experts)")
        if self.topk_group > groups:
            raise ValueError(f"config topk_group {self.topk_group} must be at most n_group {groups}")
        reachable = self.topk_group * (experts // groups)
        if self.num_experts_per_tok > reachable:
            raise ValueError(f"config num_experts_per_tok {self.num_experts_per_tok} must be at most n_routed_experts "
                             f"{experts}, and at most the {reachable} experts of the topk_group {self.topk_group} "
                             f"groups a token is routed to")
        if not self.routed_scaling_factor <= ROUTED_SCALING_MAX:
            raise ValueError(f"config routed_scaling_factor {self.routed_scaling_factor!r} must be at most "
                             f"{ROUTED_SCALING_MAX:g} (real checkpoints use 1 to 3)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(slots=True)
class LlamaConfig:
    """`llama` and `qwen3` (q/k RMSNorm per head); Quest decoding on every layer but the first ones."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    eos_token_id: int | list[int] | None = None     # where generation stops (hisparse.sampling.eos_token_ids)
    quest_page_size: int = 16
    # the first layers decode densely; None (the key absent): 2, or every layer of a model of fewer
    quest_dense_layers: int | None = None
    # HiSparse's own key: Quest layers in groups of this many consecutive layers (from the first Quest
    # layer) share one selection, the group's first layer's (its anchor), as glm_moe_dsa's shared
    # indexer layers do; 1 (the default, as in Quest) gives every layer its own.
    quest_selection_group: int = 1

    def __post_init__(self):
        _check_eos(self)
        if self.model_type not in ("llama", "qwen3"):
            raise ValueError(f"LlamaConfig got model_type {self.model_type!r}")
        _check_positive(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "quest_page_size", "quest_selection_group"))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        _check_positive(self, ("num_key_value_heads", "head_dim"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; expected 'silu'")
        _check_number("rms_norm_eps", self.rms_norm_eps)
        _check_bools(self, ("attention_bias", "mlp_bias", "tie_word_embeddings"))
        _check_rope(self.rope_parameters)
        n, dense = self.num_hidden_layers, self.quest_dense_layers
        if dense is None:
            self.quest_dense_layers = dense = min(2, n)
        if not isinstance(dense, int) or isinstance(dense, bool) or not 0 <= dense <= n:
            raise ValueError(f"config quest_dense_layers must be an int from 0 to num_hidden_layers {n}, "
                             f"found {dense!r}")

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    def selection_anchor(self, layer: int) -> int:
        """The layer whose Quest selection `layer` uses: itself on a dense layer or a group's first."""
        if layer < self.quest_dense_layers:
            return layer
        return layer - (layer - self.quest_dense_layers) % self.quest_selection_group


@dataclass(slots=True)
class NsaConfig:
    """Llama-style GQA model with Native Sparse Attention in every layer (our own format)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    compress_block_size: int = 32
    compress_block_stride: int = 16
    selection_block_size: int = 64
    num_selected_blocks: int = 16
    sliding_window: int = 512
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    eos_token_id: int | list[int] | None = None     # where generation stops (hisparse.sampling.eos_token_ids)
    # layers in groups of this many consecutive layers share one block selection, the group's first
    # layer's (its anchor), as glm_moe_dsa's shared indexer layers do; 1 (the default, as in NSA) gives
    # every layer its own. Each layer keeps its own compressed and window branches.
    selection_group: int = 1

    def __post_init__(self):
        _check_eos(self)
        if self.model_type != "nsa":
            raise ValueError(f"NsaConfig got model_type {self.model_type!r}")
        _check_positive(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "head_dim", "compress_block_size",
                               "compress_block_stride", "selection_block_size", "num_selected_blocks",
                               "sliding_window", "selection_group"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        stride = self.compress_block_stride
        if self.compress_block_size % stride or self.selection_block_size % stride:
            raise ValueError(f"compress_block_size {self.compress_block_size} and selection_block_size "
                             f"{self.selection_block_size} must be multiples of compress_block_stride {stride}")
        _check_number("rms_norm_eps", self.rms_norm_eps)
        _check_bools(self, ("tie_word_embeddings",))
        _check_rope(self.rope_parameters)
        if self.num_selected_blocks < 3:
            raise ValueError(f"num_selected_blocks must be >= 3 (first block and 2 recent ones are forced), "
                             f"found {self.num_selected_blocks}")

    def selection_anchor(self, layer: int) -> int:
        """The layer whose block selection `layer` uses: the first of its group."""
        return layer - layer % self.selection_group


CONFIG_CLASSES = {"deepseek_v32": DsaConfig, "glm_moe_dsa": DsaConfig, "llama": LlamaConfig,
                  "qwen3": LlamaConfig, "nsa": NsaConfig}
ModelConfig = DsaConfig | LlamaConfig | NsaConfig


def _glm_indexer_types(raw: dict) -> list[str]:
    """GLM-5's older keys for shared indexers, expanded as transformers' GlmMoeDsaConfig does."""
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            if set(pattern) - {"F", "S"}:
                raise ValueError(f"config index_topk_pattern must be a string of 'F' and 'S' (full, shared), "
                                 f"one per layer, found {pattern!r}")
            return [{"F": "full", "S": "shared"}[c] for c in pattern]
        if not isinstance(pattern, list):
            raise ValueError(f"config index_topk_pattern must be a string of 'F' and 'S' or a list, found {pattern!r}")
        return list(pattern)
    freq, offset = raw.get("index_topk_freq", 1), raw.get("index_skip_topk_offset", 2)
    for name, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"config {name} must be an int, found {value!r}")
    freq = max(freq, 1)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(raw["num_hidden_layers"])]


def _pinned_keys(config: ModelConfig) -> dict[str, tuple[object, str]]:
    """Keys that change the model, which HiSparse implements at one value only: key -> (that value, why).
    A config.json may carry them (real ones do), at that value or null; any other value is refused."""
    n = config.num_hidden_layers
    pinned = {"partial_rotary_factor": (1, "RoPE on the whole rotary head dim")}
    if isinstance(config, DsaConfig):
        glm = config.model_type == "glm_moe_dsa"
        pinned.update({
            "scoring_func": ("sigmoid", "DeepSeek-V3's sigmoid router"),
            "topk_method": ("noaux_tc", "group-limited top-k on bias-corrected scores"),
            "moe_layer_freq": (1, "mlp_layer_types / first_k_dense_replace place the MoE layers"),
            "mlp_bias": (False, "no MLP biases"),
            "rope_interleave": (True, "MLA's RoPE on interleaved pairs"),
            "indexer_rope_interleave": (glm, f"the indexer's RoPE is {'interleaved' if glm else 'half-split'} for "
                                             f"{config.model_type}, as in transformers"),
            "qk_head_dim": (config.qk_head_dim, "qk_nope_head_dim + qk_rope_head_dim"),
            "layer_types": (["indexed_attention"] * n, "every layer DSA attention"),
        })
    elif isinstance(config, LlamaConfig):
        pinned.update({
            "use_sliding_window": (False, "no sliding-window attention"),
            "layer_types": (["full_attention"] * n, "no sliding-window attention"),
        })
    return pinned


# the keys of `_pinned_keys`, per config class
PINNED_KEYS = {"DsaConfig": frozenset({"partial_rotary_factor", "scoring_func", "topk_method", "moe_layer_freq",
                                       "mlp_bias", "rope_interleave", "indexer_rope_interleave", "qk_head_dim",
                                       "layer_types"}),
               "LlamaConfig": frozenset({"partial_rotary_factor", "use_sliding_window", "layer_types"}),
               "NsaConfig": frozenset({"partial_rotary_factor"})}


def _known_keys(cls, model_type: str) -> frozenset:
    name = cls.__name__
    known = {f.name for f in dataclasses.fields(cls)} | READ_KEYS | IGNORED_KEYS | FAMILY_IGNORED_KEYS[name]
    known |= PINNED_KEYS[name]
    if model_type == "glm_moe_dsa":
        known |= GLM_INDEXER_KEYS
    return frozenset(known)


def _warn_unknown_keys(raw: dict, cls, model_type: str) -> None:
    """One ConfigWarning naming every key HiSparse does not read (top-level, and in the RoPE dict) and the
    nearest known key where one is close."""
    def named(prefix, key, candidates):
        close = difflib.get_close_matches(str(key), sorted(candidates), n=1)
        return f"{prefix}{key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")

    known = _known_keys(cls, model_type)
    unknown = [named("", k, known) for k in sorted(raw, key=str) if k not in known]
    source, params = _rope_source(raw)
    if isinstance(params, dict):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind in ROPE_TYPES:
            rope_known = set(ROPE_KEYS[kind]) | {"rope_type", "type", "partial_rotary_factor"}
            all_rope = {k for keys in ROPE_KEYS.values() for k in keys}
            for key in sorted(params, key=str):
                if key not in rope_known:
                    hint = (f" (not read for rope_type {kind!r})" if key in all_rope else "")
                    unknown.append(named(f"{source} key ", key, rope_known) + hint)
    if unknown:
        warnings.warn(f"config.json for model_type {model_type!r} has keys HiSparse does not read, ignored (a "
                      f"misspelled key leaves its default in force): {', '.join(unknown)}", ConfigWarning, stacklevel=3)


def config_from_dict(raw: dict) -> ModelConfig:
    """The config of a `config.json` dict: unknown keys warned about (ConfigWarning), bad values refused."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_CLASSES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(CONFIG_CLASSES)}")
    cls = CONFIG_CLASSES[model_type]
    _warn_unknown_keys(raw, cls, model_type)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in raw.items() if k in names}
    values["rope_parameters"] = _rope_parameters(raw)
    # a bad num_hidden_layers is named by the config class's own checks
    layers = raw.get("num_hidden_layers")
    if model_type == "glm_moe_dsa" and raw.get("indexer_types") is None and isinstance(layers, int):
        values["indexer_types"] = _glm_indexer_types(raw)
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"config.json for model_type {model_type!r} lacks required keys {missing}")
    config = cls(**values)
    for key, (expected, why) in _pinned_keys(config).items():
        if raw.get(key) is not None and raw[key] != expected:       # null: transformers' default, this one
            raise ValueError(f"config {key} {raw[key]!r} is not supported for model_type {model_type!r}: "
                             f"expected {expected!r} ({why})")
    return config


def config_to_dict(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)


def read_config(checkpoint_dir: str | Path) -> ModelConfig:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in checkpoint directory {checkpoint_dir}")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, found {type(raw).__name__}")
    return config_from_dict(raw)

"""Model configurations read from a checkpoint's `config.json`, one dataclass per family.

Field names are those of the Hugging Face configs (`DeepseekV32Config`, `GlmMoeDsaConfig`,
`LlamaConfig`, `Qwen3Config`) so a real `config.json` reads as is; keys we do not use are ignored.
The NSA config is our own; its keys are documented in `hisparse/nsa/README.md`.
"""
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

ROPE_TYPES = ("default", "llama3", "yarn")


def _rope_parameters(raw: dict) -> dict:
    """`rope_parameters` (transformers 5) or the older `rope_theta` + `rope_scaling` keys."""
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.pop("type", params.get("rope_type", "default"))
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported; expected one of {ROPE_TYPES}")
    return params


def _check_positive(config, names, zero_allowed=False):
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < (0 if zero_allowed else 1):
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

    def __post_init__(self):
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
        if "sparse" in self.mlp_layer_types and self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts {self.n_routed_experts} must be a multiple of n_group {self.n_group}")

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
    quest_page_size: int = 16
    quest_dense_layers: int = 2
    # HiSparse's own key: Quest layers in groups of this many consecutive layers (from the first Quest
    # layer) share one selection, the group's first layer's (its anchor), as glm_moe_dsa's shared
    # indexer layers do; 1 (the default, as in Quest) gives every layer its own.
    quest_selection_group: int = 1

    def __post_init__(self):
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
    # layers in groups of this many consecutive layers share one block selection, the group's first
    # layer's (its anchor), as glm_moe_dsa's shared indexer layers do; 1 (the default, as in NSA) gives
    # every layer its own. Each layer keeps its own compressed and window branches.
    selection_group: int = 1

    def __post_init__(self):
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
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(raw.get("index_topk_freq", 1), 1)
    offset = raw.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(raw["num_hidden_layers"])]


def config_from_dict(raw: dict) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in CONFIG_CLASSES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(CONFIG_CLASSES)}")
    cls = CONFIG_CLASSES[model_type]
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
    return cls(**values)


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

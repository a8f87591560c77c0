"""Small random checkpoints of every family, in the Hugging Face layout `load_model` reads
(`config.json`, safetensors, per-expert MoE names, an index file when sharded), with a tokenizer
and chat template on request (`hisparse.text.train_tiny_tokenizer`)."""
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from hisparse.models.config import config_from_dict, config_to_dict
from hisparse.models.loading import build_model, checkpoint_layout

_DSA = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24,
            v_head_dim=20, index_topk=8, index_head_dim=32, index_n_heads=8, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1)
_LLAMA = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16)
TINY_CONFIGS = {
    "deepseek_v32": dict(_DSA, model_type="deepseek_v32"),
    "glm_moe_dsa": dict(_DSA, model_type="glm_moe_dsa", indexer_types=["full", "shared", "full"]),
    "llama": dict(_LLAMA, model_type="llama"),
    "qwen3": dict(_LLAMA, model_type="qwen3"),
    "nsa": dict(_LLAMA, model_type="nsa", num_hidden_layers=2),
}
TOKENIZER_VOCAB = 512     # a tiny checkpoint with a tokenizer: 256 bytes, 3 special tokens, 253 merges


def randomize_(model: torch.nn.Module, seed: int, on_device: bool = False) -> None:
    """Weights at a scale that keeps activations O(1): matrices ~ N(0, 1/fan_in), norm weights
    ~ 1 + N(0, 0.1^2), biases and the router's correction bias ~ N(0, 0.1^2).

    The noise comes from a CPU generator, so a seed gives the same weights on every device, unless
    `on_device`: then it is drawn where the weights are (other values, same distribution), which
    for DeepSeek's hidden size (31 G parameters) takes seconds on a GPU instead of minutes."""
    device = next(model.parameters()).device if on_device else torch.device("cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            noise = torch.randn(tensor.shape, generator=generator, device=device)
            if tensor.dim() >= 2:
                tensor.copy_(noise / math.sqrt(tensor.shape[-1]))
            elif "norm" in name and name.endswith("weight"):
                tensor.copy_(1 + 0.1 * noise)
            else:
                tensor.copy_(0.1 * noise)


def tensor_count(family: str, **overrides) -> int:
    """Tensors of a tiny `family` checkpoint (config keys overridable): the most shards it can fill.
    Built on the meta device, so nothing is allocated."""
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(TINY_CONFIGS)}")
    with torch.device("meta"):
        return len(checkpoint_layout(build_model(config_from_dict(dict(TINY_CONFIGS[family], **overrides)))))


def save_checkpoint(model, out_dir: str | Path, shards: int = 1) -> Path:
    """Write `model` as config.json + safetensors under the Hugging Face names, in `shards` files (at
    most one per tensor: checked before anything is written)."""
    layout = checkpoint_layout(model)
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= len(layout):
        raise ValueError(f"shards = {shards!r}: the checkpoint holds {len(layout)} tensors: expected an int from 1 "
                         f"to {len(layout)} (a shard holds at least one)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = model.state_dict()
    tensors = {name: params[param][index].contiguous().clone() for name, (param, index, _) in layout.items()}
    raw = {k: v for k, v in config_to_dict(model.config).items() if v is not None}
    if raw["model_type"] in ("deepseek_v32", "glm_moe_dsa"):
        raw["num_key_value_heads"] = raw["num_attention_heads"]  # for transformers (its default is 128)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return out
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def write_tiny_checkpoint(family: str, out_dir: str | Path, seed: int = 0, shards: int = 1, tokenizer: bool = False,
                          **overrides) -> Path:
    """A random checkpoint of `family` (a key of TINY_CONFIGS), config keys overridable. tokenizer:
    a byte-level BPE and chat template beside the weights, the vocabulary TOKENIZER_VOCAB ids (unless
    vocab_size is given), its end-of-sequence id in config.json and generation_config.json."""
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(TINY_CONFIGS)}")
    if tokenizer:
        overrides.setdefault("vocab_size", TOKENIZER_VOCAB)
    model = build_model(config_from_dict(dict(TINY_CONFIGS[family], **overrides)))
    randomize_(model, seed)
    out = save_checkpoint(model, out_dir, shards)
    if tokenizer:
        from hisparse.text import train_tiny_tokenizer
        eos = train_tiny_tokenizer(out, overrides["vocab_size"])
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(dict(config, eos_token_id=eos), indent=2) + "\n")
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2) + "\n")
    return out

"""Load a Hugging Face style checkpoint: `config.json` plus `*.safetensors` (sharded with
`model.safetensors.index.json`). Parameter names are the Hugging Face ones; the only mapping is
per-expert MoE weights onto the fused expert tensors. Every name and shape is checked before any
tensor is read, and the model is returned only when all of it loaded: nothing half-built, nothing
unpickled.
"""
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hisparse.dsa.model import DsaModel
from hisparse.models.base import CausalLM
from hisparse.models.config import DsaConfig, ModelConfig, read_config
from hisparse.models.layers import Rotary
from hisparse.nsa.model import NsaModel
from hisparse.progress import PROGRESS_EVERY_S, Progress
from hisparse.quest.model import QuestModel

_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


# model_type -> the family's model class (this module sits above the families, which import the
# package's shared pieces: so hisparse/models/__init__.py does not import it)
MODEL_CLASSES: dict[str, type[CausalLM]] = {"deepseek_v32": DsaModel, "glm_moe_dsa": DsaModel,
                                            "llama": QuestModel, "qwen3": QuestModel, "nsa": NsaModel}


def build_model(config: ModelConfig) -> CausalLM:
    return MODEL_CLASSES[config.model_type](config)


def checkpoint_layout(model: CausalLM, fused: frozenset = frozenset()) -> dict[str, tuple[str, tuple, tuple]]:
    """Checkpoint tensor name -> (model parameter name, index into that parameter, shape). Expert
    weights are per expert, as transformers saves them, unless their fused name is in `fused`."""
    layout = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        match = _EXPERT.match(name)
        if match is None or name in fused:
            layout[name] = (name, (), tuple(tensor.shape))
            continue
        prefix, kind = match.groups()
        experts, rows, cols = tensor.shape
        for e in range(experts):
            if kind == "down_proj":
                layout[f"{prefix}.{e}.down_proj.weight"] = (name, (e,), (rows, cols))
            else:
                half = rows // 2
                layout[f"{prefix}.{e}.gate_proj.weight"] = (name, (e, slice(0, half)), (half, cols))
                layout[f"{prefix}.{e}.up_proj.weight"] = (name, (e, slice(half, rows)), (half, cols))
    return layout


def _index_shards(index: Path) -> list[str]:
    try:
        raw = json.loads(index.read_text())
    except ValueError as e:
        raise ValueError(f"{index} is not valid JSON: {e}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
        raise ValueError(f"{index} must hold a JSON object whose 'weight_map' maps tensor names to shard "
                         f"file names")
    return sorted(set(weight_map.values()))


def checkpoint_files(checkpoint_dir: Path) -> list[Path]:
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = _index_shards(index)
        missing = [s for s in shards if not (checkpoint_dir / s).is_file()]
        if missing:
            raise ValueError(f"{index} names shard files that do not exist: {missing}")
        return [checkpoint_dir / s for s in shards]
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in checkpoint directory {checkpoint_dir}")
    return files


def _is_ignored(name: str, config: ModelConfig) -> bool:
    """Tensors real checkpoints carry that we do not model: the DSA families' multi-token-prediction
    layers (model.layers.{n} .. {n + num_nextn_predict_layers - 1}, n = num_hidden_layers, as
    transformers ignores them) and stale rotary tables."""
    layer = _LAYER.match(name)
    if layer is not None and isinstance(config, DsaConfig):
        n = config.num_hidden_layers
        if n <= int(layer.group(1)) < n + config.num_nextn_predict_layers:
            return True
    return name.endswith("rotary_emb.inv_freq")


def _read_headers(files: list[Path]) -> tuple[dict[str, Path], dict[str, tuple[int, ...]], dict[str, str]]:
    """Where each tensor is, its shape and its safetensors dtype ("BF16", "I16", ...)."""
    where, shapes, dtypes = {}, {}, {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name in where:
                        raise ValueError(f"tensor {name} is in both {where[name].name} and {path.name}")
                    header = f.get_slice(name)
                    where[name], shapes[name], dtypes[name] = path, tuple(header.get_shape()), header.get_dtype()
        except SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
    return where, shapes, dtypes


def _check_names_and_shapes(where: dict, shapes: dict, dtypes: dict, layout: dict, config: ModelConfig) -> None:
    if any(name.endswith("weight_scale_inv") for name in where):
        raise ValueError("FP8 block-quantized checkpoints (tensors named *.weight_scale_inv) are not supported; "
                         "convert to bf16 first")
    unexpected = sorted(n for n in where if n not in layout and not _is_ignored(n, config))
    if unexpected:
        layers = config.num_hidden_layers
        extra = sorted({int(m.group(1)) for m in map(_LAYER.match, unexpected) if m and int(m.group(1)) >= layers})
        hint = f"; layers {extra} are beyond config.json's num_hidden_layers {layers}" if extra else ""
        raise ValueError(f"unexpected tensors for model_type {config.model_type!r}: {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} in all){hint}")
    missing = sorted(n for n in layout if n not in where)
    if missing:
        raise ValueError(f"checkpoint lacks tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                         f"({len(missing)} in all)")
    for name, (_, _, shape) in layout.items():
        if shapes[name] != shape:
            raise ValueError(f"tensor {name} in {where[name].name} has shape {list(shapes[name])}, "
                             f"expected {list(shape)} from config.json")
        # every parameter is floating point; ints or bools would be cast to meaningless weights
        if not dtypes[name].startswith(("F", "BF")):
            raise ValueError(f"tensor {name} in {where[name].name} has dtype {dtypes[name]}, "
                             f"expected a floating point dtype (F32, F16, BF16, ...)")


def _check_finite(name: str, path: Path, stored: torch.Tensor, loaded: torch.Tensor) -> None:
    """ValueError where a weight, as loaded, is NaN or infinite (it would run to NaN logits, greedy token 0):
    stored so, or past the range of the dtype it was loaded in."""
    if torch.isfinite(loaded).all():
        return
    bad = ~torch.isfinite(stored)
    if not bad.any():
        largest = stored.abs().max().item()
        raise ValueError(f"tensor {name} in {path.name} holds values up to {largest:.3g}, past the range of "
                         f"{str(loaded.dtype).removeprefix('torch.')}: expected a dtype that holds them (float32, "
                         f"bfloat16)")
    at = tuple(int(i) for i in torch.nonzero(bad)[0])
    raise ValueError(f"tensor {name} in {path.name} holds {int(bad.sum())} non-finite values ({stored[at].item()} "
                     f"at {list(at)}): expected finite weights")


def check_checkpoint(checkpoint_dir: str | Path) -> tuple[ModelConfig, CausalLM, dict, dict]:
    """A checkpoint's config.json and tensor headers checked against each other without reading a
    weight (names, shapes, dtypes; ValueError naming what is wrong): (config, the model on the meta
    device, tensor name -> its file, the checkpoint's layout)."""
    checkpoint_dir = Path(checkpoint_dir)
    config = read_config(checkpoint_dir)
    with torch.device("meta"):
        model = build_model(config)
    where, shapes, dtypes = _read_headers(checkpoint_files(checkpoint_dir))
    layout = checkpoint_layout(model, fused=frozenset(where))
    _check_names_and_shapes(where, shapes, dtypes, layout, config)
    return config, model, where, layout


def load_model(checkpoint_dir: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", progress: Progress | None = None) -> CausalLM:
    """The model of `checkpoint_dir` with its weights, in `dtype` (routing and indexer head weights
    stay float32, as in transformers), on `device`, in eval mode. config.json is checked first
    (`read_config`): a bad value raises ValueError naming the key, a key HiSparse does not read is
    reported with a `ConfigWarning` (hisparse.models.config); so is each weight as it is read, a NaN or
    infinite one (stored so, or past `dtype`'s range) raising ValueError naming the tensor.
    progress: a `hisparse.progress.Progress` told of each file read (a line every few seconds)."""
    config, model, where, layout = check_checkpoint(checkpoint_dir)
    targets = {}
    for name, tensor in model.state_dict().items():
        keep = any(part in name for part in getattr(model, "keep_in_float32", ()))
        targets[name] = torch.empty(tensor.shape, dtype=torch.float32 if keep else dtype, device=device)
    by_file: dict[Path, list[str]] = {}
    for name in layout:
        by_file.setdefault(where[name], []).append(name)
    for i, (path, names) in enumerate(by_file.items()):
        if progress is not None:
            progress(f"reading {path.name} ({i + 1} of {len(by_file)} files)", every=PROGRESS_EVERY_S)
        with safe_open(path, framework="pt") as f:
            for name in names:
                param, index, _ = layout[name]
                stored = f.get_tensor(name)
                targets[param][index] = stored.to(device)
                _check_finite(name, path, stored, targets[param][index])
    if config.tie_word_embeddings:
        targets["lm_head.weight"] = targets["model.embed_tokens.weight"]
    model.load_state_dict(targets, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, Rotary):
            module.materialize(torch.device(device))
    return model.eval()

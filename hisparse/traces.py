"""Selection traces: what every stream selected at every decode step, as data (DESIGN section 2).

A trace holds `selections`, int32 [steps, layers, batch, k] (DSA: one selection per request and
layer) or [steps, layers, batch, kv_heads, k] (NSA, Quest: one per KV head), unit ids in selection
order with -1 padding, plus metadata:
- `family`: "dsa", "nsa", "quest" or "synthetic"; `unit_size`: tokens per unit (1, 16, 64...).
- `context` int64 [batch]: prompt length in tokens. At decode step t request b holds
  context[b] + t + 1 tokens (the prompt, the t earlier decode tokens and the newest one), so its valid
  unit ids are 0 .. ceil((context[b] + t + 1) / unit_size) - 1.
- `layer_anchor` int64 [layers]: the layer whose selection each layer uses (itself for a layer that
  runs its own indexer, an earlier anchor for a shared layer); a shared layer's selections must equal
  its anchor's.
- `source`: free text saying what made the trace (a model and prompt, or a generator config).

Files are safetensors (tensors `selections`, `context`, `layer_anchor`; the rest in the header's
string metadata), so reading one executes no code. `load_trace` validates everything and raises a
ValueError naming the file and what is wrong. A decode loop records with `TraceWriter`:

    writer = TraceWriter("dsa", unit_size=1, context=[100_000], layer_anchor=None)
    for step in ...: writer.add_step(selections)   # [layers, batch, (kv_heads,) k], torch or numpy
    writer.save("trace.safetensors")
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

FAMILIES = ("dsa", "nsa", "quest", "synthetic")
FORMAT = "hisparse-trace"
VERSION = "1"


@dataclass
class Trace:
    """Selections of every stream at every decode step, with their metadata (module docstring)."""
    selections: np.ndarray    # int32 [steps, layers, batch, (kv_heads,) k]
    family: str
    unit_size: int
    context: np.ndarray       # int64 [batch]
    layer_anchor: np.ndarray  # int64 [layers]
    source: str = ""

    def __post_init__(self):
        self.selections = np.asarray(self.selections)
        self.context = np.asarray(self.context)
        self.layer_anchor = np.asarray(self.layer_anchor)
        validate(self)

    def __repr__(self) -> str:
        more = "..." if self.batch > 4 else ""
        return (f"Trace({self.family}, unit_size={self.unit_size}, "
                f"selections {tuple(self.selections.shape)}, context {self.context.tolist()[:4]}{more})")

    @property
    def steps(self) -> int:
        return self.selections.shape[0]

    @property
    def layers(self) -> int:
        return self.selections.shape[1]

    @property
    def batch(self) -> int:
        return self.selections.shape[2]

    @property
    def kv_heads(self) -> int | None:
        """KV heads per layer where selection is per head, None where one selection serves all."""
        return self.selections.shape[3] if self.selections.ndim == 5 else None

    @property
    def k(self) -> int:
        return self.selections.shape[-1]

    def units_available(self) -> np.ndarray:
        """int64 [steps, batch]: how many units request b holds at decode step t."""
        tokens = self.context[None, :] + np.arange(self.steps)[:, None] + 1
        return -(-tokens // self.unit_size)

    def streams(self) -> tuple[np.ndarray, np.ndarray]:
        """Selections per stream, sel int32 [steps, S, k], and stream_layer int64 [S].

        Streams are ordered (layer, request, KV head), the layout of one step's selections.
        """
        sel = self.selections.reshape(self.steps, -1, self.k)
        per_layer = sel.shape[1] // self.layers
        return sel, np.repeat(np.arange(self.layers), per_layer)


def _fail(where: str, msg: str) -> None:
    raise ValueError(f"{where}: {msg}")


def validate(trace: Trace, where: str = "trace") -> None:
    """Check shapes, dtypes, metadata and every unit id of `trace`; raise ValueError on the first fault."""
    sel, ctx, anchor = trace.selections, trace.context, trace.layer_anchor
    if sel.ndim not in (4, 5):
        _fail(where, f"selections must be [steps, layers, batch, k] or [steps, layers, batch, kv_heads, "
                     f"k], got {sel.ndim} dims {tuple(sel.shape)}")
    if sel.dtype != np.int32:
        _fail(where, f"selections must be int32, got {sel.dtype}")
    if min(sel.shape) == 0:
        _fail(where, f"selections has an empty dimension: shape {tuple(sel.shape)}")
    if trace.family not in FAMILIES:
        _fail(where, f"family {trace.family!r} is not one of {FAMILIES}")
    size = trace.unit_size
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        _fail(where, f"unit_size must be a positive integer, got {trace.unit_size!r}")
    steps, layers, batch = sel.shape[:3]
    if ctx.shape != (batch,) or not np.issubdtype(ctx.dtype, np.integer):
        _fail(where, f"context must be integers [batch] = [{batch}], got {ctx.dtype} {tuple(ctx.shape)}")
    if (ctx < 0).any():
        _fail(where, f"context lengths must be >= 0, got {ctx[ctx < 0][0]} for request "
                     f"{int(np.argmax(ctx < 0))}")
    if anchor.shape != (layers,) or not np.issubdtype(anchor.dtype, np.integer):
        _fail(where, f"layer_anchor must be integers [layers] = [{layers}], got {anchor.dtype} "
                     f"{tuple(anchor.shape)}")
    for layer, a in enumerate(anchor.tolist()):
        if not 0 <= a <= layer or anchor[a] != a:
            _fail(where, f"layer {layer} has anchor {a}: expected an anchor layer (one whose anchor is "
                         f"itself) at or before it")
    _check_ids(trace, where)
    for layer in np.flatnonzero(anchor != np.arange(layers)):
        differs = (sel[:, layer] != sel[:, anchor[layer]]).reshape(steps, -1).any(axis=1)
        if differs.any():
            _fail(where, f"layer {layer} shares layer {anchor[layer]}'s selection but differs from it "
                         f"at step {int(np.argmax(differs))}")


def _check_ids(trace: Trace, where: str) -> None:
    """Unit ids in [-1, units available), no unit twice in one selection."""
    sel = trace.selections
    avail = trace.units_available()                               # [steps, batch]
    limit = avail.reshape(avail.shape[0], 1, avail.shape[1], *([1] * (sel.ndim - 3)))
    bad = (sel < -1) | (sel >= limit)
    if bad.any():
        idx = np.unravel_index(int(np.argmax(bad)), sel.shape)
        step, request = int(idx[0]), int(idx[2])
        _fail(where, f"unit id {sel[idx]} at [step, layer, request, ...] = {tuple(int(i) for i in idx[:-1])} "
                     f"is out of range: expected -1 (padding) or 0..{int(avail[step, request]) - 1} "
                     f"(context {int(trace.context[request])} + step {step} + 1 tokens, unit size "
                     f"{trace.unit_size})")
    ordered = np.sort(sel, axis=-1)
    dup = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if dup.any():
        idx = np.unravel_index(int(np.argmax(dup)), dup.shape)
        _fail(where, f"unit {ordered[idx]} appears twice in the selection at [step, layer, request, ...] = "
                     f"{tuple(int(i) for i in idx[:-1])}: a selection holds unique ids")


def save_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write `trace` as a safetensors file (validated again, so a bad trace never reaches disk)."""
    validate(trace)
    tensors = {"selections": np.ascontiguousarray(trace.selections),
               "context": trace.context.astype(np.int64),
               "layer_anchor": trace.layer_anchor.astype(np.int64)}
    meta = {"format": FORMAT, "version": VERSION, "family": trace.family,
            "unit_size": str(int(trace.unit_size)), "k": str(trace.k),
            "per_head": str(trace.kv_heads is not None).lower(), "source": trace.source}
    save_file(tensors, os.fspath(path), metadata=meta)


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace file; ValueError naming the file and the fault if it is malformed."""
    where = f"trace file {os.fspath(path)}"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where} does not exist")
    try:
        with safe_open(os.fspath(path), framework="np") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            missing = {"selections", "context", "layer_anchor"} - names
            if missing:
                _fail(where, f"lacks the tensors {sorted(missing)} (it has {sorted(names)})")
            tensors = {name: f.get_tensor(name) for name in ("selections", "context", "layer_anchor")}
    except SafetensorError as err:
        raise ValueError(f"{where} is not a readable safetensors file: {err}") from None
    if meta.get("format") != FORMAT:
        _fail(where, f"metadata format is {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        _fail(where, f"trace format version {meta.get('version')!r} is not supported (expected {VERSION!r})")
    for key in ("family", "unit_size", "k", "per_head"):
        if key not in meta:
            _fail(where, f"metadata lacks {key!r} (it has {sorted(meta)})")
    # ASCII digits only: str.isdigit() also accepts "²", which int() refuses
    if not all(meta[key].isascii() and meta[key].isdigit() for key in ("unit_size", "k")):
        _fail(where, f"metadata unit_size and k must be integers, got {meta['unit_size']!r}, {meta['k']!r}")
    sel = tensors["selections"]
    if sel.ndim not in (4, 5):
        _fail(where, f"selections must be [steps, layers, batch, (kv_heads,) k], got {sel.ndim} dims "
                     f"{tuple(sel.shape)}")
    if int(meta["k"]) != sel.shape[-1]:
        _fail(where, f"metadata says k={meta['k']} but selections end in {sel.shape[-1]}")
    if meta["per_head"] not in ("true", "false"):          # 'yes' read as false, silently
        _fail(where, f"metadata per_head {meta['per_head']!r}: expected 'true' or 'false'")
    per_head = meta["per_head"] == "true"
    if per_head != (sel.ndim == 5):
        _fail(where, f"metadata per_head={meta['per_head']} but selections have {sel.ndim} dims "
                     f"{tuple(sel.shape)} (5 with KV heads, 4 without)")
    trace = Trace.__new__(Trace)
    trace.selections, trace.family, trace.unit_size = sel, meta["family"], int(meta["unit_size"])
    trace.context, trace.layer_anchor = tensors["context"], tensors["layer_anchor"]
    trace.source = meta.get("source", "")
    validate(trace, where)
    return trace


def _int64(name: str, values, expected: str) -> np.ndarray:
    """`values` (a list, numpy or torch) as int64, or a ValueError naming them: floats and bools would
    be cast to integers without a word, integers beyond int64 wrapped."""
    array = np.asarray(values.cpu() if hasattr(values, "cpu") else values)
    shown = array.ravel()[:8].tolist()
    shown = f"{shown}{' ...' if array.size > 8 else ''}"
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} {shown} holds {array.dtype} values: expected {expected}")
    if array.size and array.dtype == np.uint64 and array.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} {shown} holds {array.max()}, beyond int64: expected {expected}")
    return array.astype(np.int64)


class TraceWriter:
    """Collects one decode step at a time and writes a trace file.

    `add_step(selections)` takes [layers, batch, k] or [layers, batch, kv_heads, k] integer ids
    (torch tensors are copied to the host: a sync, fine for recording runs). Shapes, and ids fitting
    int32 (a wider one would wrap, 2**32 - 1 to -1), are checked per step; context and layer_anchor
    must be integers (floats and bools are refused, not truncated); ids against the context, anchors
    and metadata are checked when the trace is built (`trace()` or `save()`).
    """

    def __init__(self, family: str, unit_size: int, context, layer_anchor=None, source: str = ""):
        self.family, self.unit_size, self.source = family, unit_size, source
        self.context = _int64("context", context, "integer token counts, one per request")
        self.layer_anchor = None if layer_anchor is None else _int64("layer_anchor", layer_anchor,
                                                                     "integer layer indices, one per layer")
        self._steps: list[np.ndarray] = []

    def add_step(self, selections) -> None:
        step = np.asarray(selections.cpu() if hasattr(selections, "cpu") else selections)
        if not np.issubdtype(step.dtype, np.integer):
            raise ValueError(f"selections must be integer unit ids, got {step.dtype}")
        if step.ndim not in (3, 4):
            raise ValueError(f"a step's selections must be [layers, batch, k] or [layers, batch, kv_heads, "
                             f"k], got shape {tuple(step.shape)}")
        if step.shape[1] != len(self.context):
            raise ValueError(f"a step's selections have batch {step.shape[1]}, the writer's context "
                             f"lists {len(self.context)} requests")
        if self._steps and step.shape != self._steps[0].shape:
            raise ValueError(f"step {len(self._steps)} has shape {tuple(step.shape)}, earlier steps "
                             f"{tuple(self._steps[0].shape)}")
        info = np.iinfo(np.int32)
        wide = None if np.can_cast(step.dtype, np.int32) else (step < info.min) | (step > info.max)
        if wide is not None and wide.any():      # it would wrap in int32 (2**32 - 1 to -1, padding)
            idx = np.unravel_index(int(np.argmax(wide)), step.shape)
            raise ValueError(f"step {len(self._steps)}: unit id {step[idx]} at [layer, request, ...] = "
                             f"{tuple(int(i) for i in idx[:-1])} does not fit int32: expected -1 (padding) or an "
                             f"id in 0..{info.max}")
        self._steps.append(step.astype(np.int32))

    def trace(self) -> Trace:
        if not self._steps:
            raise ValueError("no steps recorded: call add_step before building the trace")
        layers = self._steps[0].shape[0]
        anchor = np.arange(layers) if self.layer_anchor is None else self.layer_anchor
        return Trace(np.stack(self._steps), self.family, self.unit_size, self.context, anchor, self.source)

    def save(self, path: str | os.PathLike) -> None:
        save_trace(self.trace(), path)


def with_anchors(trace: Trace, layer_anchor) -> Trace:
    """The trace as a model whose layer l reuses layer layer_anchor[l]'s selection would see it:
    each shared layer's selections replaced by its anchor's."""
    anchor = np.asarray(layer_anchor)
    if anchor.shape != (trace.layers,) or not np.issubdtype(anchor.dtype, np.integer):
        raise ValueError(f"layer_anchor must list the anchor (an integer) of each of the trace's {trace.layers} "
                         f"layers, got {anchor.tolist()}")
    if ((anchor < 0) | (anchor >= trace.layers)).any():
        raise ValueError(f"layer_anchor {anchor.tolist()} names layers outside 0..{trace.layers - 1}")
    anchor = anchor.astype(np.int64)
    return Trace(trace.selections[:, anchor], trace.family, trace.unit_size, trace.context, anchor, trace.source)

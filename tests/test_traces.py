"""Trace format: round trips through TraceWriter and the file, and malformed files rejected clearly."""
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from hisparse.traces import Trace, TraceWriter, load_trace, save_trace, with_anchors


def _random_steps(rng, steps, layers, batch, heads, k, context):
    """int32 [steps, layers, batch, (heads,) k] of valid unique ids with scattered -1 padding."""
    shape = (layers, batch) + ((heads,) if heads else ())
    out = np.full((steps, *shape, k), -1, dtype=np.int32)
    for t in range(steps):
        for idx in np.ndindex(*shape):
            b = idx[1]
            ids = rng.choice(context[b] + t + 1, size=k, replace=False)
            ids[rng.random(k) < 0.2] = -1
            out[(t, *idx)] = ids
    return out


@pytest.mark.parametrize("heads", [None, 3], ids=["dsa-no-heads", "nsa-3-kv-heads"])
def test_writer_save_load_round_trip(tmp_path, heads):
    rng = np.random.default_rng(0)
    context = [40, 27]
    steps = _random_steps(rng, steps=5, layers=3, batch=2, heads=heads, k=7, context=context)
    writer = TraceWriter("nsa" if heads else "dsa", unit_size=1, context=context, layer_anchor=[0, 1, 2],
                         source="unit test")
    for t, step in enumerate(steps):
        writer.add_step(torch.from_numpy(step) if t % 2 else step)   # torch and numpy both accepted
    writer.save(tmp_path / "t.safetensors")
    trace = load_trace(tmp_path / "t.safetensors")
    np.testing.assert_array_equal(trace.selections, steps)
    assert trace.selections.dtype == np.int32
    assert (trace.family, trace.unit_size, trace.k, trace.kv_heads, trace.source) == \
        ("nsa" if heads else "dsa", 1, 7, heads, "unit test")
    np.testing.assert_array_equal(trace.context, context)
    sel, stream_layer = trace.streams()
    per_layer = 2 * (heads or 1)
    assert sel.shape == (5, 3 * per_layer, 7)
    np.testing.assert_array_equal(stream_layer, np.repeat([0, 1, 2], per_layer))
    last = (1, 1, 2) if heads else (1, 1)        # layer 1, request 1, (KV head 2)
    stream = np.ravel_multi_index(last, steps.shape[1:-1])
    np.testing.assert_array_equal(sel[:, stream], steps[(slice(None), *last)])


def test_units_available_follow_unit_size():
    sel = np.full((3, 1, 1, 2), -1, dtype=np.int32)
    trace = Trace(sel, "quest", 16, np.array([31]), np.array([0]))
    # 31 + t + 1 tokens in 16-token pages: 32 -> 2 pages, 33 -> 3, 34 -> 3
    np.testing.assert_array_equal(trace.units_available()[:, 0], [2, 3, 3])


def _good():
    """A valid trace's tensors and metadata: 2 steps, layers [anchor, shared, anchor], 1 request."""
    sel = np.array([[[0, 1]], [[0, 1]], [[2, -1]]], dtype=np.int32)          # [layers, batch, k]
    tensors = {"selections": np.stack([sel, sel[:, :, ::-1].copy()]),
               "context": np.array([3], dtype=np.int64), "layer_anchor": np.array([0, 0, 2], dtype=np.int64)}
    meta = {"format": "hisparse-trace", "version": "1", "family": "dsa", "unit_size": "1", "k": "2",
            "per_head": "false", "source": ""}
    return tensors, meta


def _set(tensors, name, index, value):
    tensors[name] = tensors[name].copy()
    tensors[name][index] = value


MALFORMED = [
    ("missing-anchor", lambda t, m: t.pop("layer_anchor"), "lacks the tensors ['layer_anchor']"),
    ("wrong-format", lambda t, m: m.update(format="other"), "metadata format is 'other'"),
    ("future-version", lambda t, m: m.update(version="9"), "version '9' is not supported"),
    ("no-family", lambda t, m: m.pop("family"), "metadata lacks 'family'"),
    ("unknown-family", lambda t, m: m.update(family="moba"), "family 'moba' is not one of"),
    ("k-mismatch", lambda t, m: m.update(k="3"), "metadata says k=3 but selections end in 2"),
    ("per-head-mismatch", lambda t, m: m.update(per_head="true"), "metadata per_head=true"),
    ("per-head-yes", lambda t, m: m.update(per_head="yes"), "metadata per_head 'yes': expected 'true' or 'false'"),
    ("per-head-python-bool", lambda t, m: m.update(per_head="False"),
     "metadata per_head 'False': expected 'true' or 'false'"),
    ("float-ids", lambda t, m: t.update(selections=t["selections"].astype(np.float32)), "must be int32"),
    ("3-dims", lambda t, m: t.update(selections=t["selections"][:, 0]), "got 3 dims"),
    ("0-dims", lambda t, m: t.update(selections=np.array(0, dtype=np.int32)), "got 0 dims"),
    ("unicode-digit-unit-size", lambda t, m: m.update(unit_size="²"), "unit_size and k must be integers"),
    ("id-too-large", lambda t, m: _set(t, "selections", (0, 2, 0, 0), 4),
     "unit id 4 at [step, layer, request, ...] = (0, 2, 0) is out of range: expected -1 (padding) or 0..3"),
    ("id-below-minus-1", lambda t, m: _set(t, "selections", (1, 2, 0, 1), -5), "unit id -5"),
    ("duplicate-id", lambda t, m: _set(t, "selections", (1, 2, 0, 0), 2), "unit 2 appears twice"),
    ("shared-layer-differs", lambda t, m: _set(t, "selections", (1, 1, 0, 0), 3),
     "layer 1 shares layer 0's selection but differs from it at step 1"),
    ("anchor-ahead", lambda t, m: t.update(layer_anchor=np.array([0, 2, 2])), "layer 1 has anchor 2"),
    ("context-shape", lambda t, m: t.update(context=np.array([3, 3])),
     "context must be integers [batch] = [1]"),
]


@pytest.mark.parametrize("mutate, message", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_file_is_rejected_with_a_clear_error(tmp_path, mutate, message):
    tensors, meta = _good()
    good_path = tmp_path / "good.safetensors"
    save_file(tensors, str(good_path), metadata=meta)
    load_trace(good_path)                                   # the unmodified file is valid
    mutate(tensors, meta)
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError) as err:
        load_trace(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "trace.npz"
    np.savez(path, selections=np.zeros((1, 1, 1, 1), dtype=np.int32))
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        load_trace(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_trace(tmp_path / "missing.safetensors")


def test_save_refuses_an_invalid_trace(tmp_path):
    tensors, _ = _good()
    trace = Trace(tensors["selections"], "dsa", 1, tensors["context"], tensors["layer_anchor"])
    trace.selections[0, 0, 0, 0] = 99
    with pytest.raises(ValueError, match="unit id 99"):
        save_trace(trace, tmp_path / "t.safetensors")
    assert not (tmp_path / "t.safetensors").exists()


def test_bad_anchors_and_unit_size_are_refused():
    tensors, _ = _good()
    trace = Trace(tensors["selections"], "dsa", 1, tensors["context"], tensors["layer_anchor"])
    with pytest.raises(ValueError, match=r"layer_anchor \[0, 5, 2\] names layers outside 0..2"):
        with_anchors(trace, [0, 5, 2])
    with pytest.raises(ValueError, match="unit_size must be a positive integer, got True"):
        Trace(tensors["selections"], "dsa", True, tensors["context"], tensors["layer_anchor"])


def test_writer_rejects_inconsistent_steps():
    writer = TraceWriter("dsa", unit_size=1, context=[10, 10])
    with pytest.raises(ValueError, match="no steps recorded"):
        writer.trace()
    with pytest.raises(ValueError, match="batch 3, the writer's context lists 2 requests"):
        writer.add_step(np.zeros((2, 3, 4), dtype=np.int32))
    writer.add_step(np.zeros((2, 2, 4), dtype=np.int32) - 1)
    with pytest.raises(ValueError, match=r"step 1 has shape \(2, 2, 5\), earlier steps \(2, 2, 4\)"):
        writer.add_step(np.zeros((2, 2, 5), dtype=np.int32))
    with pytest.raises(ValueError, match="must be integer unit ids"):
        writer.add_step(np.zeros((2, 2, 4), dtype=np.float32))


@pytest.mark.parametrize("step", [np.array([[[2**32 - 1, 0]]]), np.array([[[2**31, 0]]], dtype=np.uint64),
                                  torch.tensor([[[-(2**31) - 1, 0]]])], ids=["wraps-to-padding", "uint64", "torch"])
def test_writer_refuses_unit_ids_beyond_int32_instead_of_wrapping(step):
    """2**32 - 1 cast to int32 is -1, padding: an id the trace would drop without a word."""
    writer = TraceWriter("dsa", unit_size=1, context=[10])
    with pytest.raises(ValueError, match=rf"step 0: unit id {int(step[0, 0, 0])} at \[layer, request, \.\.\.\] = \(0, 0\) "
                                         r"does not fit int32: expected -1 \(padding\) or an id in 0\.\.2147483647"):
        writer.add_step(step)
    assert not writer._steps, "a refused step is not recorded"
    writer.add_step(np.array([[[2**31 - 1, -1]]], dtype=np.int64))      # the largest int32 id is kept as it is
    assert writer._steps[0].tolist() == [[[2**31 - 1, -1]]]


@pytest.mark.parametrize("kwargs,message", [
    (dict(context=[10.5, 3]), r"context \[10\.5, 3\.0\] holds float64 values: expected integer "
                              r"token counts"),
    (dict(context=[10.0, 3.0]), r"context \[10\.0, 3\.0\] holds float64 values: expected integer"),
    (dict(context=[True, False]), r"context \[True, False\] holds bool values: expected integer"),
    (dict(context=[4, 3], layer_anchor=[0, 0.5]),
     r"layer_anchor \[0\.0, 0\.5\] holds float64 values: expected integer layer indices"),
    (dict(context=[4, 3], layer_anchor=torch.tensor([0.0, 1.0])),
     r"layer_anchor \[0\.0, 1\.0\] holds float32 values: expected integer layer indices"),
], ids=["context-fraction", "context-whole-floats", "context-bools", "anchor-floats", "anchor-torch-floats"])
def test_writer_refuses_float_contexts_and_anchors_instead_of_truncating(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TraceWriter("dsa", unit_size=1, **kwargs)
    writer = TraceWriter("dsa", unit_size=1, context=np.array([4, 3], dtype=np.int32), layer_anchor=torch.tensor([0, 0]))
    assert writer.context.dtype == writer.layer_anchor.dtype == np.int64

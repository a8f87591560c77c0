"""Replacement-policy simulator over selection traces, on the CPU, vectorised over streams.

Input everywhere: `sel` int [steps, S, k], the selection of each of S independent streams per decode
step (unique unit ids, -1 pads), e.g. `Trace.streams()`. Every selected unit must be resident after
its step (B >= k slots per stream); the policies differ only in the victims of the misses:
- "lru": exactly the resolve kernel's LRU (DESIGN section 3): hits are never victims; misses, in
  selection order, take the least recently used non-hit slots in LRU order (empty slots first, lowest
  index first); then the order is untouched slots, newly filled misses, hits. Slots match the kernel.
- "fifo": the oldest-filled non-hit slots; a hit does not refresh a slot.
- "random": uniformly random non-hit slots (empty slots first).
- "belady": the offline optimum: the resident unit (not selected this step) whose next selection is
  farthest in the future; units never selected again first.
- "last": the cache holds exactly the previous step's selection (B = k).
The first step starts from an empty cache, so its selected units are all misses.

Also trace statistics: step gaps between reuses of a unit, consecutive-step and adjacent-layer overlap.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hisparse.host_pool import as_int

POLICIES = ("lru", "fifo", "random", "belady", "last")
_HIT_KEY = np.int64(1) << 62       # never a victim
_EMPTY_KEY = -(np.int64(1) << 62)  # + slot index: empty slots first, lowest index first


@dataclass
class SimResult:
    """Per-step, per-stream counts of one simulation."""
    misses: np.ndarray           # int64 [steps, S]
    accesses: np.ndarray         # int64 [steps, S]: selected units (padding excluded)
    slots: np.ndarray | None     # int32 [steps, S, k] slot of each selected unit (-1 pads), if kept
    missed: np.ndarray | None = None  # bool [steps, S, k] whether each selected unit missed, if kept

    def miss_rate(self, stream_weights=None) -> float:
        """Misses over accesses, streams weighted by `stream_weights` [S] (default: all 1)."""
        w = np.ones(self.misses.shape[1]) if stream_weights is None else np.asarray(stream_weights, float)
        return float((self.misses.sum(0) * w).sum() / (self.accesses.sum(0) * w).sum())

    def per_step(self) -> np.ndarray:
        """float64 [steps]: miss rate of each step over all streams."""
        return self.misses.sum(1) / np.maximum(self.accesses.sum(1), 1)

    def per_stream(self) -> np.ndarray:
        """float64 [S]: miss rate of each stream over all steps."""
        return self.misses.sum(0) / np.maximum(self.accesses.sum(0), 1)

    def per_layer(self, stream_layer) -> np.ndarray:
        """float64 [layers]: miss rate of each layer, given the layer of every stream [S]."""
        stream_layer = np.asarray(stream_layer)
        return (np.bincount(stream_layer, self.misses.sum(0))
                / np.maximum(np.bincount(stream_layer, self.accesses.sum(0)), 1))


def _check_sel(sel: np.ndarray) -> np.ndarray:
    sel = np.asarray(sel)
    if sel.ndim != 3 or not np.issubdtype(sel.dtype, np.integer):
        raise ValueError(f"selections must be integers [steps, streams, k], got {sel.dtype} {sel.shape}")
    if sel.size == 0:
        raise ValueError(f"selections are empty: shape {sel.shape}, expected at least one step, one stream "
                         f"and k >= 1")
    if (sel < -1).any():
        raise ValueError(f"unit ids must be >= -1 (-1 pads), got {sel.min()}")
    ordered = np.sort(sel, axis=2)
    dup = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if dup.any():
        step, stream, i = np.unravel_index(int(np.argmax(dup)), dup.shape)
        raise ValueError(f"unit {ordered[step, stream, i]} appears twice in the selection of step {step}, "
                         f"stream {stream}: a selection holds unique ids")
    return sel.astype(np.int64)


def _id_bound(sel: np.ndarray) -> int:
    """Columns of a per-unit table: at least 1, so an all-padding selection indexes it safely."""
    return max(int(sel.max()), 0) + 1


def simulate(sel, policy: str, cache_slots: int | None = None, *, seed: int = 0,
             keep_slots: bool = False) -> SimResult:
    """Run `policy` with `cache_slots` slots per stream over sel [steps, S, k] (module docstring).

    `cache_slots` (B >= k) is required except for "last", where it may be omitted or equal k.
    `seed` drives "random" only. `keep_slots` records each selected unit's slot and hit or miss.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    sel = _check_sel(sel)
    k = sel.shape[2]
    if cache_slots is not None:       # numpy would cut 4.5 to 4 or fail inside; True is not 1 slot
        cache_slots = as_int(cache_slots, f"cache_slots must be an int (B >= k = {k} slots per stream)")
    if policy == "last":
        if cache_slots not in (None, k):
            raise ValueError(f"policy 'last' keeps exactly one selection: cache_slots must be k={k} or "
                             f"None, got {cache_slots}")
        if keep_slots:
            raise ValueError("policy 'last' has no slot numbering: keep_slots is not available")
        return _simulate_last(sel)
    if cache_slots is None or cache_slots < k:
        raise ValueError(f"cache_slots B={cache_slots} is smaller than the selection size k={k}: the "
                         f"cache must hold one whole selection (B >= k)")
    return _simulate_slots(sel, policy, cache_slots, np.random.default_rng(seed), keep_slots)


def simulate_trace(trace, policy: str, cache_slots: int | None = None, *, seed: int = 0) -> SimResult:
    """`simulate` over a Trace's streams ordered (layer, request, KV head). Only anchor layers are
    simulated: a shared layer's cache moves in lockstep with its anchor's (DESIGN section 4), so it
    gets its anchor's counts."""
    sel, _ = trace.streams()
    per_layer = sel.shape[1] // trace.layers
    anchors = np.flatnonzero(trace.layer_anchor == np.arange(trace.layers))
    own = sel.reshape(trace.steps, trace.layers, per_layer, -1)[:, anchors].reshape(trace.steps, -1, trace.k)
    res = simulate(own, policy, cache_slots, seed=seed)
    position = np.searchsorted(anchors, trace.layer_anchor)
    def expand(a: np.ndarray) -> np.ndarray:
        return a.reshape(trace.steps, len(anchors), per_layer)[:, position].reshape(trace.steps, -1)
    return SimResult(expand(res.misses), expand(res.accesses), None)


def _simulate_last(sel: np.ndarray) -> SimResult:
    steps, streams, _ = sel.shape
    seen_at = np.full((streams, _id_bound(sel)), -2, dtype=np.int64)
    rows = np.broadcast_to(np.arange(streams)[:, None], sel.shape[1:])
    misses = np.zeros((steps, streams), dtype=np.int64)
    for t in range(steps):
        s, valid = sel[t], sel[t] >= 0
        misses[t] = (valid & (seen_at[rows, s.clip(0)] != t - 1)).sum(1)
        seen_at[rows[valid], s[valid]] = t
    return SimResult(misses, (sel >= 0).sum(2), None)


def next_use(sel: np.ndarray) -> np.ndarray:
    """int64 [steps, S, k]: the next step selecting the same unit in the same stream (steps if never)."""
    steps, streams, _ = sel.shape
    upcoming = np.full((streams, _id_bound(sel)), steps, dtype=np.int64)
    rows = np.broadcast_to(np.arange(streams)[:, None], sel.shape[1:])
    out = np.full(sel.shape, steps, dtype=np.int64)
    for t in range(steps - 1, -1, -1):
        s, valid = sel[t], sel[t] >= 0
        out[t][valid] = upcoming[rows[valid], s[valid]]
        upcoming[rows[valid], s[valid]] = t
    return out


def _simulate_slots(sel, policy, cache_slots, rng, keep_slots) -> SimResult:
    steps, streams, k = sel.shape
    slot_unit = np.full((streams, cache_slots), -1, dtype=np.int64)
    unit_slot = np.full((streams, _id_bound(sel)), -1, dtype=np.int64)
    key = _EMPTY_KEY + np.broadcast_to(np.arange(cache_slots), (streams, cache_slots)).copy()
    rows = np.broadcast_to(np.arange(streams)[:, None], (streams, k))
    order = np.broadcast_to(np.arange(k), (streams, k))
    upcoming = next_use(sel) if policy == "belady" else None
    misses = np.zeros((steps, streams), dtype=np.int64)
    slots_out = np.full(sel.shape, -1, dtype=np.int32) if keep_slots else None
    missed = np.zeros(sel.shape, dtype=bool) if keep_slots else None
    for t in range(steps):
        s, valid = sel[t], sel[t] >= 0
        slot = np.where(valid, unit_slot[rows, s.clip(0)], -1)
        hit, miss = slot >= 0, valid & (slot < 0)
        misses[t] = miss.sum(1)
        if policy == "random":
            key = np.where(slot_unit >= 0, rng.integers(0, _HIT_KEY, size=key.shape), key)
        choose = key.copy()
        choose[rows[hit], slot[hit]] = _HIT_KEY
        most = int(misses[t].max())
        if most:
            cand = np.argpartition(choose, most - 1, axis=1)[:, :most]            # [S, most]
            cand = np.take_along_axis(cand, np.argsort(np.take_along_axis(choose, cand, 1), 1), 1)
            rank = (np.cumsum(miss, axis=1) - 1).clip(0, most - 1)
            slot = np.where(miss, np.take_along_axis(cand, rank, 1), slot)
            r, v, u = rows[miss], slot[miss], s[miss]
            old = slot_unit[r, v]
            unit_slot[r[old >= 0], old[old >= 0]] = -1
            slot_unit[r, v] = u
            unit_slot[r, u] = v
        stamp = 2 * t * k + order                                    # [S, k] selection order
        if policy == "lru":                                          # misses, then hits, are newest
            key[rows[miss], slot[miss]] = stamp[miss]
            key[rows[hit], slot[hit]] = stamp[hit] + k
        elif policy == "fifo":                                       # only a fill moves a slot
            key[rows[miss], slot[miss]] = stamp[miss]
        elif policy == "belady":
            key[rows[valid], slot[valid]] = -upcoming[t][valid]
        if keep_slots:
            slots_out[t], missed[t] = slot, miss
    return SimResult(misses, (sel >= 0).sum(2), slots_out, missed)


# ----------------------------------------------------------------------------------------------
# trace statistics


def reuse_gaps(sel) -> np.ndarray:
    """int64 [steps]: histogram of accesses by the step gap since the same stream last selected the
    unit; entry 0 counts first touches. A gap of 1 is a unit kept from the previous step."""
    sel = _check_sel(sel)
    steps, streams, _ = sel.shape
    last = np.full((streams, _id_bound(sel)), -1, dtype=np.int64)
    rows = np.broadcast_to(np.arange(streams)[:, None], sel.shape[1:])
    counts = np.zeros(steps, dtype=np.int64)
    for t in range(steps):
        s, valid = sel[t], sel[t] >= 0
        prev = last[rows[valid], s[valid]]
        counts += np.bincount(np.where(prev >= 0, t - prev, 0), minlength=steps)
        last[rows[valid], s[valid]] = t
    return counts


def gap_quantiles(counts: np.ndarray, quantiles) -> np.ndarray:
    """Quantiles (in steps) of the reuse gaps in a `reuse_gaps` histogram, first touches excluded."""
    cdf = np.cumsum(counts[1:]) / max(counts[1:].sum(), 1)
    return np.searchsorted(cdf, np.asarray(quantiles)) + 1


def intersection_size(a, b) -> np.ndarray:
    """int64 [...]: how many ids two selections a, b [..., k] (unique ids, -1 pads) have in common."""
    both = np.sort(np.concatenate([a, b], axis=-1), axis=-1)
    return ((both[..., 1:] == both[..., :-1]) & (both[..., 1:] >= 0)).sum(-1)


def consecutive_overlap(sel) -> np.ndarray:
    """float64 [steps - 1, S]: share of each step's selection that the previous step also selected."""
    sel = _check_sel(sel)
    return intersection_size(sel[1:], sel[:-1]) / np.maximum((sel[1:] >= 0).sum(-1), 1)


def adjacent_layer_overlap(selections) -> np.ndarray:
    """float64 [steps, layers - 1, ...]: share of layer l+1's selection that layer l also selected,
    for trace selections [steps, layers, batch, (kv_heads,) k]."""
    sel = np.asarray(selections)
    return intersection_size(sel[:, 1:], sel[:, :-1]) / np.maximum((sel[:, 1:] >= 0).sum(-1), 1)

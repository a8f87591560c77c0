"""What the decode loop needs from a model family, and the pieces the per-KV-head families share.

`Engine` (hisparse/engine.py) runs every family through one `FamilyRuntime`: DSA
(hisparse/dsa_runtime.py), Quest (quest_runtime.py) and NSA (nsa_runtime.py). A runtime knows its
family's selection size, how prefilled (or random) KV becomes each layer's decode state in a mode
(resident pool, or host pool + hot cache), which sparse-attention object the model calls, how its
streams grow, and how to count hits, misses and GPU bytes. The engine keeps the loop itself:
prefill, decode steps, CUDA graph, timing, traces.

Quest and NSA select per KV head with a unit of several tokens (a 16-token page, a 64-token block):
one stream per (request, layer, KV head), rows `[2, T, D]` (the unit's keys, then its values). The
newest unit grows every step and is rewritten whole (`HierarchicalKVCache.write_newest_token`, one
launch, no host sync), so a cached copy is never stale; `advance_unit_streams` records on the host
which streams gain a unit.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from hisparse.cache import HierarchicalKVCache
from hisparse.models.base import DecodeState

KV_MODES = ("resident", "hisparse", "noio")
# When a decode step's newest rows reach the host pool in the hierarchical modes: "layer", as each
# layer writes its row (zero-copy stores, one launch per layer, which also writes the reserved slot
# and any cached copy); "step", all layers' rows in one launch after the last layer, from the
# reserved slots (the layers' launches then write the device only). Either way every row is on the
# host before the next step's resolve can fetch it.
HOST_WRITES = ("layer", "step")

Rows = Callable[[int, int], tuple]     # rows(request, layer) -> that request's prefilled KV of the layer


class FamilyRuntime(Protocol):
    family: str                # "DSA", "Quest", "NSA" (for messages)
    selection_size: int        # k: units each stream selects per step (the cache needs B >= k)
    selection_name: str        # where k comes from, e.g. "index_topk" (for messages)
    anchors: list[int]         # the layer whose selection each layer uses
    shared_layers: bool        # layers may replay an anchor's miss plan (layer-wise prefetch applies)
    traces: bool               # selections can be recorded and replayed (one [layers, B, k] per step)
    host_writes: tuple[str, ...]   # when a step's newest rows may reach the host pool (HOST_WRITES)
    host_write: str            # the one in use, set by the engine
    early_resolve: bool        # resolve on a side stream from the selection on (set by the engine)

    def random_rows(self, prompts: list[torch.Tensor], device: torch.device) -> Rows:
        """Random KV rows for prompts of these lengths (prefill="random": timing only)."""

    def prefilled_rows(self, states: list[DecodeState]) -> Rows:
        """The KV rows of requests prefilled one by one by the model (one state each)."""

    def new_cache(self, batch: int, capacity: int, cache_slots: int) -> HierarchicalKVCache:
        """The hierarchical cache of `batch` requests of up to `capacity` tokens."""

    def gather_layers(self, mode: str, cache: HierarchicalKVCache | None, rows: Rows, lengths: torch.Tensor,
                      capacity: int, prefetch: bool) -> list:
        """Every layer's batch decode state in `mode` (cache is None in resident mode)."""

    def attention(self, mode: str, layers: list, check_values: bool, prefetch: bool):
        """The object to put in `model.sparse_attention` for decoding over `layers`."""

    def advance_streams(self, cache: HierarchicalKVCache, layers: list, positions: list[int]) -> None:
        """Before a decode step writing position positions[n] of each request n: record new units."""

    def counts(self, cache: HierarchicalKVCache, layers: list) -> tuple[int, int]:
        """(hits, misses) of every resolve so far."""

    def kv_bytes(self, layers: list, cache: HierarchicalKVCache | None) -> float:
        """GPU bytes of the KV state of the whole batch."""


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def cache_bytes(cache: HierarchicalKVCache | None) -> int:
    """GPU bytes of a cache: the hot slots plus the LRU state and unit -> slot maps."""
    return 0 if cache is None else nbytes(cache.slots, *vars(cache.state).values())


def open_unit_streams(cache: HierarchicalKVCache, units: torch.Tensor, capacity_units: int) -> list[int]:
    """One stream per KV head of one request, each holding its rows: units [HKV, n, 2, T, D]."""
    streams = []
    for head_units in units:
        stream = cache.open_stream(capacity_units)
        cache.append(stream, head_units.reshape(head_units.shape[0], -1))
        streams.append(stream)
    return streams


def advance_unit_streams(cache: HierarchicalKVCache, host_streams: list[list[list[int]]], positions: list[int],
                         unit_tokens: int) -> None:
    """A position that opens a unit gives each of its request's streams one more unit.
    host_streams[layer][n]: the streams (one per KV head) of request n in each hierarchical layer."""
    opening = [n for n, pos in enumerate(positions) if pos % unit_tokens == 0]
    streams = [s for layer in host_streams for n in opening for s in layer[n]]
    if streams:
        cache.advance(streams, 1)


def stream_counts(cache: HierarchicalKVCache, streams: list[torch.Tensor]) -> tuple[int, int]:
    """(hits, misses) summed over these streams (device tensors of stream ids)."""
    if not streams:
        return 0, 0
    total = cache.stats[torch.cat([s.view(-1) for s in streams]).long()].sum(0)
    return int(total[0]), int(total[1])


def prefetch_shared(plan, shared: list, side: torch.cuda.Stream, max_programs: int) -> None:
    """Layer-wise prefetch (DESIGN section 4): right after an anchor layer's resolve, replay its miss
    `plan` into each of its `shared` layers' caches (states with `cache`, `streams` in the anchor's
    row order and a `prefetched` event) on the side stream, recording each layer's event after its
    copy, so each shared layer waits for its own copy only."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for kv in shared:
            kv.cache.replay_plan(plan, kv.streams.view(-1), max_programs)
            kv.prefetched.record(side)

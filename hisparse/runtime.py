"""What the decode loop needs from a model family, and the pieces the per-KV-head families share.

`Engine` (hisparse/engine.py) runs every family through one `FamilyRuntime`: DSA
(hisparse/dsa/runtime.py), Quest (hisparse/quest/runtime.py) and NSA (hisparse/nsa/runtime.py). A runtime knows its
family's selection size, how prefilled (or random) KV becomes each layer's decode state in a mode
(resident pool, or host pool + hot cache), which sparse-attention object the model calls, how its
streams grow, and how to count hits, misses and GPU bytes. The engine keeps the loop itself:
prefill, decode steps, CUDA graph, timing, traces.

Quest and NSA select per KV head with a unit of several tokens (a 16-token page, a 64-token block):
one stream per (request, layer, KV head), rows `[2, T, D]` (the unit's keys, then its values). The
newest unit grows every step: each token goes into its row in the host pool, the reserved slot and
any cached copy alike (`HierarchicalKVCache.write_newest_token`, one launch, no host sync inside a
captured step), so a cached copy is never stale; `advance_unit_streams` records on the host which
streams gain a unit.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from hisparse.cache import HierarchicalKVCache
from hisparse.models.base import DecodeState
from hisparse.resolve import ResolveResult

KV_MODES = ("resident", "hisparse", "noio")
# The prefetch copy's width in programs, per family: a copy from pinned host memory needs few programs
# to keep PCIe busy, and more crowd out the layers it overlaps with (results/prefetch.csv).
PREFETCH_PROGRAMS_PER_FAMILY = {"DSA": 4, "NSA": 32, "Quest": 32}

# Decode-step graphs this process captured (Engine, Server). From a process's 4th PyTorch graph
# capture on, every graph replays slower (measured: results/notes/graphs.md).
graph_captures = 0


def count_graph_capture() -> int:
    """Count one decode-step graph capture; at the process's 4th, warn (once) that every graph's
    replays are now slower (results/notes/graphs.md), so timings past it do not compare with earlier ones."""
    global graph_captures
    graph_captures += 1
    if graph_captures == 4:
        warnings.warn("this process has captured its 4th decode-step CUDA graph: every graph's replays "
                      "are slower from here on (results/notes/graphs.md), so time runs in fresh processes "
                      "(experiments.sweep --runs-per-process 3)", RuntimeWarning, stacklevel=3)
    return graph_captures


def prefetch_width(family: str, programs: int | None = None) -> int:
    """The prefetch copy's width for `family` ("DSA", "NSA" or "Quest", any case): `programs` where
    given (an int >= 1), else the family's measured default."""
    names = {name.lower(): name for name in PREFETCH_PROGRAMS_PER_FAMILY}
    if family.lower() not in names:
        raise ValueError(f"family {family!r}: expected one of {tuple(PREFETCH_PROGRAMS_PER_FAMILY)}")
    if programs is None:
        return PREFETCH_PROGRAMS_PER_FAMILY[names[family.lower()]]
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"prefetch_programs must be an int >= 1 (programs of the prefetch copy), got {programs!r}")
    return programs


Rows = Callable[[int, int], tuple]     # rows(request, layer) -> that request's prefilled KV of the layer


class FamilyRuntime(Protocol):
    family: str                # "DSA", "Quest", "NSA" (for messages)
    selection_size: int        # k: units each stream selects per step (the cache needs B >= k)
    selection_name: str        # where k comes from, e.g. "index_topk" (for messages)
    anchors: list[int]         # the layer whose selection each layer uses
    shared_layers: bool        # layers may replay an anchor's miss plan (layer-wise prefetch applies)
    unit_size: int             # tokens per unit (a trace's unit_size)
    kv_heads: int | None       # selections per request and layer: one per KV head, or None for one in all
    dense_layers: int          # the first layers, which attend densely and select nothing (a trace's rows: -1)
    workspace_in_runs: bool    # hybrid serving: a hierarchical prefill's workspace sits in runs of the cache's
                               # spare streams (DSA), or beside the cache in every mode (Quest, NSA)

    def random_rows(self, prompts: list[torch.Tensor], device: torch.device) -> Rows:
        """Random KV rows for prompts of these lengths (prefill="random": timing only)."""

    def prefilled_rows(self, states: list[DecodeState]) -> Rows:
        """The KV rows of requests prefilled one by one by the model (one state each)."""

    def new_cache(self, batch: int, capacity: int, cache_slots: int) -> HierarchicalKVCache:
        """The hierarchical cache of `batch` requests of up to `capacity` tokens."""

    def gather_layers(self, mode: str, cache: HierarchicalKVCache | None, rows: Rows, lengths: torch.Tensor,
                      capacity: int, prefetch: bool, host_tokens: int | None = None) -> list:
        """Every layer's batch decode state in `mode` (cache is None in resident mode), each request
        holding up to `capacity` tokens on the GPU; host_tokens: each stream's host region, in tokens
        (default the capacity)."""

    def stream_regions(self, tokens: int) -> list[int]:
        """The host region (units) of each stream one request of `tokens` tokens opens."""

    def attention(self, mode: str, layers: list, check_values: bool, prefetch: bool,
                  prefetch_programs: int | None = None):
        """The object to put in `model.sparse_attention` for decoding over `layers`."""

    def advance_streams(self, cache: HierarchicalKVCache, layers: list, positions: list[int]) -> None:
        """Before a decode step writing position positions[n] of each request n: record new units."""

    def counts(self, cache: HierarchicalKVCache, layers: list) -> tuple[int, int]:
        """(hits, misses) of every resolve so far."""

    def kv_bytes(self, layers: list, cache: HierarchicalKVCache | None) -> float:
        """GPU bytes of the KV state of the whole batch."""

    # -- what the serving engine (hisparse/serving/) uses besides the above --
    row_bytes: int             # bytes of one host-pool row (a unit of one stream)
    row_dtype: torch.dtype     # the dtype rows are stored in (uint8 for DSA's FP8 rows)
    prefill_beside_decode: bool   # a prefill may run beside decode steps (an empty lane's decode write
                                  # lands where no request reads); serving's prefill_overlap needs it
    hybrid_trash_row: bool     # hybrid serving: non-resident lanes' decode write goes to a trash row of the cache
    shares_prefixes: bool      # lane_prefill takes shared_pages: streams opened on a cached prefix (serving.sharing)
    prefill_depends_on_chunks: bool   # its prefill's rows change when the chunk boundaries move (NSA's)
    row_token_dims: tuple      # each `prefilled_rows` part's token (or block) dimension: a prefix's pieces join there

    def new_state(self, batch: int, capacity: int) -> DecodeState:
        """The empty state a prefill writes into (DSA's holds its kv_dtype's rows)."""

    def prefix_rows(self, rows: tuple, start: int, end: int, first: int = 0) -> tuple:
        """Prefix sharing: the parts of tokens start .. end - 1 (page boundaries) of one layer's
        `prefilled_rows` `rows` that begin at token `first`; those of [0, start) and of [start, end),
        joined along `row_token_dims`, are those of a prefix of `end` tokens."""

    def shared_page_parts(self, layer: int) -> tuple:
        """Prefix sharing (shares_prefixes): the `prefilled_rows` parts of `layer` that its streams'
        host pages hold (DSA: the latents; Quest's Quest layers and NSA: keys and values), by index."""

    def shared_rows(self, cache: HierarchicalKVCache, pages: list[list[int]]) -> dict[int, tuple]:
        """Prefix sharing: layer -> its `shared_page_parts` (the others None) of a prefix, read from the
        host pages of each of a request's streams (`pages`, in `LaneStates.streams` order)."""

    def lane_prefill(self, mode: str, cache: HierarchicalKVCache | None, layers: list, lane: int, prompt: int,
                     host_tokens: int, runs: list[int] | None = None, **placement) -> LanePrefill:
        """A prefill of `prompt` tokens straight into serving lane `lane` of `layers` (hybrid: `runs`
        keeps it resident in those runs of the cache's streams; DSA also takes `workspace_runs`), its
        streams opened on `shared_pages` (per stream: a cached prefix's host pages) where given."""

    def lane_workspace_bytes(self, mode: str, tokens: int) -> int:
        """GPU bytes a `lane_prefill` of `tokens` holds beside the lanes."""

    def serving_lanes(self, layers: list, mask: torch.Tensor) -> LaneStates:
        """The lanes' view of a serving batch's layer states; every layer that keeps an empty lane's
        decode write from landing where a request reads is bound to `mask` [lanes] bool."""

    def run_streams(self, cache: HierarchicalKVCache, capacity: int) -> int:
        """Hybrid: streams of one run holding `capacity` tokens of one stream's units."""

    def runs_per_request(self) -> int:
        """Hybrid: runs a resident request takes (DSA one a layer; Quest, NSA one a layer and KV head)."""

    def take_runs(self, cache: HierarchicalKVCache, capacity: int) -> list[int] | None:
        """Hybrid: the first stream of each of a request's runs, all taken, or None (nothing taken)."""

    def demote(self, cache: HierarchicalKVCache, layers: list, lane: int, length: int, host_tokens: int,
               runs: list[int]) -> None:
        """Hybrid: move a resident lane's `length` tokens from its runs to new streams with host regions."""


def page_rows_of(cache: HierarchicalKVCache, pages: list[int]) -> torch.Tensor:
    """The host rows (int64) of host pages `pages`, in order: each page's `cache.page_rows` rows."""
    first = torch.tensor(pages, dtype=torch.int64)[:, None] * cache.page_rows
    return (first + torch.arange(cache.page_rows)).flatten()


def read_pages(cache: HierarchicalKVCache, pages: list[int]) -> torch.Tensor:
    """The rows of host pages `pages`, in order, gathered into one host tensor: pinned where the pool
    is, so that a prefix's rows go into a prefill workspace at the host link's rate."""
    rows = cache.host.rows
    index = page_rows_of(cache, pages)
    out = torch.empty((len(index), *rows.shape[1:]), dtype=rows.dtype, pin_memory=rows.is_pinned())
    return torch.index_select(rows, 0, index, out=out)


def token_slices(rows: tuple, dims: tuple, start: int, end: int) -> tuple:
    """Each part of `rows` (None stays None) sliced to start .. end - 1 along its dimension in `dims`."""
    return tuple(None if t is None else t.narrow(d, start, end - start) for t, d in zip(rows, dims, strict=True))


class LanePrefill(Protocol):
    """One request's prefill into a serving lane (`FamilyRuntime.lane_prefill`)."""

    state: DecodeState         # what the model's prefill runs on
    runs: list[int] | None     # hybrid: the runs it is resident in (None: hierarchical or not hybrid)
    workspace_bytes: int       # GPU bytes it holds beside the lanes and the cache

    def chunk_done(self, start: int, end: int) -> None:
        """Prompt tokens start .. end - 1 are prefilled: their units to the lane, the host pool or the runs."""

    def adopt(self, rows: Rows, prompt: int) -> None:
        """The whole prompt prefilled elsewhere (`prefilled_rows` of its state, on the host): placed
        as `chunk_done(0, prompt)` would place the same prefill's output (a handoff)."""

    def join(self) -> None:
        """The prompt is done: the lane reads what was written (a workspace in runs goes back)."""

    def cancel(self) -> None:
        """It will not join: its streams, regions and runs go back."""


class LaneStates:
    """A serving batch's layer states as lanes (`FamilyRuntime.serving_lanes`): `hierarchical` the
    states whose rows are in the cache (streams [lanes, ...] and host_streams per lane, -1 / [] for an
    empty lane; hybrid's `resident` flags and `resident_step`), of which `owned` resolve their own
    selection (not a shared layer's, whose streams move in lockstep with its anchor's)."""

    def __init__(self, hierarchical: list):
        self.hierarchical = hierarchical
        self.owned = [kv for kv in hierarchical if kv.anchor_layer is None]

    def streams(self, lane: int, owned: bool = False) -> list[int]:
        """The cache streams lane `lane` holds (every layer's, or the owned layers' only)."""
        return [s for kv in (self.owned if owned else self.hierarchical) for s in _ids(kv.host_streams[lane])]

    def clear(self, lane: int) -> None:
        """An empty lane: -1 streams (closed by the caller) and not resident, in every hierarchical layer."""
        for kv in self.hierarchical:
            kv.streams.view(len(kv.host_streams), -1)[lane] = -1
            kv.host_streams[lane] = [] if isinstance(kv.host_streams[lane], list) else -1
            if kv.resident is not None:
                kv.resident[lane] = False

    def track_residency(self, device: torch.device) -> None:
        """Hybrid: every lane's resident flag, all hierarchical until one is admitted resident."""
        for kv in self.hierarchical:
            kv.resident = torch.zeros(len(kv.host_streams), dtype=torch.bool, device=device)

    def set_resident_step(self, resident_step: bool) -> None:
        """Hybrid: the next step's lanes holding a request are all resident (it skips the resolve)."""
        for kv in self.hierarchical:
            kv.resident_step = resident_step


def _ids(streams) -> list[int]:
    """A lane's host streams (DSA: one id; Quest, NSA: one per KV head) without an empty lane's -1."""
    ids = streams if isinstance(streams, list) else [streams]
    return [s for s in ids if s >= 0]


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def cache_bytes(cache: HierarchicalKVCache | None) -> int:
    """GPU bytes of a cache: the hot slots (and run-only streams) plus the LRU state and unit -> slot maps."""
    return 0 if cache is None else nbytes(cache.gpu_rows, *cache.state.tensors())


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


def prefetch_shared(plan, shared: list, side: torch.cuda.Stream, max_programs: int,
                    check_values: bool | None = None) -> None:
    """Layer-wise prefetch (DESIGN section 4): right after an anchor layer's resolve, replay its miss
    `plan` into each of its `shared` layers' caches (states with `cache`, `streams` in the anchor's
    row order and a `prefetched` event) on the side stream, recording each layer's event after its
    copy, so each shared layer waits for its own copy only. check_values: as `replay_plan`'s (a
    check reads the plan on the host, so the host waits for the anchor's resolve)."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for kv in shared:
            kv.cache.replay_plan(plan, kv.streams.view(-1), max_programs, check_values=check_values)
            kv.prefetched.record(side)


def write_resident_unit(pool: torch.Tensor, pos: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        unit_tokens: int, units_per_head: int) -> None:
    """A per-KV-head family's decode write into a resident layer (Quest's pages, NSA's blocks): the
    token at position pos [N] into its unit's row of pool [N * HKV * units_per_head, 2, unit_tokens,
    D], key and value [N, HKV, D] at the token's offset in the unit."""
    n, hkv, _ = key.shape
    heads = torch.arange(n * hkv, device=pos.device).view(n, hkv)
    rows = heads * units_per_head + (pos // unit_tokens)[:, None]               # [N, HKV]
    offset = (pos % unit_tokens)[:, None].expand(n, hkv)
    pool[rows, 0, offset] = key
    pool[rows, 1, offset] = value


def run_rows(cache: HierarchicalKVCache, first: int) -> torch.Tensor:
    """The rows [streams * (B + 1), E] of the run `cache.take_runs` returned as `first` (a view of
    `cache.gpu_rows`, where attention reads them)."""
    base = int(cache.row_base(torch.tensor([first]))[0])
    return cache.gpu_rows[base:base + cache.run_length(first) * (cache.cache_slots + 1)]


def write_run_token(pool: torch.Tensor, row_base: torch.Tensor, resident: torch.Tensor, pos: torch.Tensor,
                    key: torch.Tensor, value: torch.Tensor, unit_tokens: int) -> None:
    """Hybrid serving's decode write of a lane kept resident in runs of the cache's streams (Quest's
    pages, NSA's blocks): the token at position pos [N] into row row_base [N, HKV] + pos // unit_tokens
    of pool [rows, 2, unit_tokens, D] (`cache.slots` as rows), key and value [N, HKV, D] at its offset,
    for the lanes resident [N] marks. No host sync (capturable): the other lanes write the first
    resident lane's token to its place too (the old value there when no lane is resident), so no two
    writes of one launch meet at one place with different values."""
    n, hkv, _ = key.shape
    keep = resident[:, None].expand(n, hkv)
    rows = torch.where(keep, row_base + (pos // unit_tokens)[:, None], 0)               # [N, HKV]
    offset = (pos % unit_tokens)[:, None].expand(n, hkv)
    # the first resident lane (lane 0 if none), as a [1] tensor: a 0-d index would be read on the host
    donor = resident.to(torch.int32).argmax().view(1)
    rows, offset = torch.where(keep, rows, rows[donor]), torch.where(keep, offset, offset[donor])
    for part, new in ((0, key), (1, value)):
        at_donor = torch.where(resident[donor, None, None], new[donor],
                               pool[rows[donor], part, offset[donor]])                      # [1, HKV, D]
        pool[rows, part, offset] = torch.where(keep[..., None], new, at_donor)


def write_newest_unit(kv, pos: torch.Tensor, key: torch.Tensor, value: torch.Tensor, unit_tokens: int) -> None:
    """A per-KV-head family's decode write into a hierarchical layer `kv` (Quest's HierQuestKV, NSA's
    HierNsaKV): the token into the newest unit's row in host pool, reserved slot and cached copy
    (write-through). A shared layer's copy sits where its anchor's slot map says; with prefetch it
    first waits for its copy, so the write-through lands after it."""
    if kv.prefetched is not None:
        torch.cuda.current_stream().wait_event(kv.prefetched)
    anchors = None if kv.anchor_streams is None else kv.anchor_streams.reshape(-1)
    kv.cache.write_newest_token(kv.streams.reshape(-1), pos, key, value, unit_tokens, anchors)


class UnitResolver:
    """The hot-cache side of a family's sparse attention (DSA, Quest, NSA): an anchor layer's
    selection [N, k] (N streams: a request's, or a request's KV head's) resolved to slots of its
    streams, copying its misses unless the mode is noio (counters in `cache.stats`); a layer sharing
    that selection does no resolve work and replays the anchor's miss plan into its own streams, in
    line, or with `prefetch` on a GPU on the side stream right after the anchor's resolve
    (`prefetch_shared`). shared: anchor layer -> its shared layers' states. check_values: validate
    selections against stream lengths before each resolve (a host sync; off inside a captured CUDA
    graph). prefetch_programs: the prefetch copy's width (default: the family's)."""

    family: str        # "DSA", "NSA" or "Quest" (each subclass's): the prefetch copy's default width

    def __init__(self, mode: str, check_values: bool, prefetch: bool, shared: dict[int, list] | None,
                 prefetch_programs: int | None = None):
        if mode not in KV_MODES:
            raise ValueError(f"mode must be one of {KV_MODES}, got {mode!r}")
        self.mode, self.check_values = mode, check_values
        self.shared = shared or {}
        self.prefetch_programs = prefetch_width(self.family, prefetch_programs)
        self.side = torch.cuda.Stream() if prefetch and torch.cuda.is_available() else None
        self._plans: dict[int, ResolveResult] = {}      # anchor layer -> its resolve results, refilled per step
        # selections from a trace instead of the model's, [layers, N, (HKV,) k] int32, filled by the
        # caller before each step; and what each layer attended over in the last step
        self.replay_sel: torch.Tensor | None = None
        self.recorded: dict[int, torch.Tensor] = {}
        # serving (hisparse.serving): which rows hold a request, [N] bool on the device, refilled
        # before each step; an empty row attends nothing in every mode, so it computes the same
        # values whether the mode is resident or hierarchical (and cannot disturb the others)
        self.lanes: torch.Tensor | None = None

    def lane_masked(self, selection: torch.Tensor) -> torch.Tensor:
        """selection [N, ...] with -1 throughout the rows of empty serving lanes (as it is without lanes)."""
        if self.lanes is None:
            return selection
        keep = self.lanes.view(-1, *([1] * (selection.dim() - 1)))
        return torch.where(keep, selection, torch.full_like(selection, -1))

    def recorded_step(self, layers: int) -> torch.Tensor:
        """The last step's selections of every layer, [layers, N, (HKV,) k] int32 (a trace's step):
        -1 throughout for a layer that selected nothing (a dense layer)."""
        if not self.recorded:
            raise ValueError("no layer selected anything this step (every layer is dense): nothing to record")
        some = next(iter(self.recorded.values()))
        return torch.stack([self.recorded.get(i, torch.full_like(some, -1)) for i in range(layers)])

    def unit_rows(self, layer_idx: int, kv, selection: torch.Tensor) -> torch.Tensor:
        """Rows [N, HKV, k] int32 of `kv.cache.slots` viewed as rows holding selection [N, HKV, k]
        (the per-KV-head families)."""
        n, hkv, k = selection.shape
        flat = kv.streams.view(-1)
        return kv.cache.slot_rows(flat, self._slots(layer_idx, kv, selection.reshape(n * hkv, k))).view(n, hkv, k)

    def _plan_buffers(self, layer_idx: int, selection: torch.Tensor) -> ResolveResult:
        """The anchor layer's resolve result buffers, made once on the calling stream and refilled
        every step (static addresses for a graph; nothing allocated on a side stream). A step's
        resolve rewrites them only after the last step's readers: in line, or on a stream that
        waited for them."""
        plan = self._plans.get(layer_idx)
        n, k = selection.shape
        if plan is None or plan.slots.shape != (n, k):
            plan = self._plans[layer_idx] = ResolveResult.empty(n, k, selection.device)
        return plan

    def _slots(self, layer_idx: int, kv, selection: torch.Tensor) -> torch.Tensor:
        """Slots [N, k] of selection [N, k] in this layer's streams: resolved (an anchor), or the
        anchor's, whose plan the layer's own copies replay (a shared layer, in lockstep)."""
        copy = self.mode != "noio"
        if kv.anchor_layer is not None:                 # shared: in lockstep with the anchor
            plan = self._plans[kv.anchor_layer]
            if copy and kv.prefetched is None:
                kv.cache.replay_plan(plan, kv.streams.view(-1), check_values=self.check_values)
            return plan.slots
        # a state whose step write is one whole row per stream (DSA's) leaves it in `newest` for the
        # resolve to write (one launch fewer per layer); the per-KV-head families write their tokens
        newest = getattr(kv, "newest", None)
        plan = kv.cache.resolve(kv.streams.view(-1), selection, mode="normal" if copy else "noio",
                                check_values=self.check_values, out=self._plan_buffers(layer_idx, selection),
                                newest=newest)
        if newest is not None:
            kv.newest = None                            # written (kept if the resolve refused the call)
        if copy and self.side is not None and self.shared.get(layer_idx):   # no fork without copies to make
            prefetch_shared(plan, self.shared[layer_idx], self.side, self.prefetch_programs, self.check_values)
        return plan.slots


def gather_in_lockstep(anchors: list[int], gather: Callable[[int], object], hier_type: type, mode: str,
                       prefetch: bool) -> list:
    """Each layer's decode state, gather(layer); a hierarchical one (`hier_type`) of a layer sharing
    another's selection (anchors[layer] != layer) is put in lockstep with its anchor: `anchor_layer`,
    `anchor_streams` and, with prefetch in hisparse mode on a GPU, the event its copy records."""
    layers = []
    for i, anchor in enumerate(anchors):
        kv = gather(i)
        if anchor != i and isinstance(kv, hier_type):
            kv.anchor_layer, kv.anchor_streams = anchor, layers[anchor].streams
            if prefetch and mode == "hisparse" and kv.streams.is_cuda:
                kv.prefetched = torch.cuda.Event()
        layers.append(kv)
    return layers


def shared_states(layers: list, hier_type: type) -> dict[int, list]:
    """anchor layer -> the states of the layers sharing its selection (hierarchical modes)."""
    shared = {}
    for kv in layers:
        if isinstance(kv, hier_type) and kv.anchor_layer is not None:
            shared.setdefault(kv.anchor_layer, []).append(kv)
    return shared

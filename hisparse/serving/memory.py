"""What fits: the lanes, the host pool's regions and the GPU and host budgets.

GPU bytes in use = lanes x lane bytes + the cache's unit -> slot map (4 bytes per host row; with
prefix sharing's page table, per row of every lane's streams at max_context, shared pages counted in
each) + the prefill workspace. A lane holds one request of up to `max_context` tokens: that many tokens of KV
in mode resident; in hisparse and noio the B + 1 slots of each of its streams with their cache state
and the family's always-resident parts (DSA's indexer keys, Quest's page bounds, NSA's compressed
blocks and window), while the request's rows take a host region of exactly its own length. Every
family prefills into the lane, so the workspace is what the prefill's attention needs beyond it
(`FamilyRuntime.lane_workspace_bytes` at max_context). Activations are outside the budget.

Hybrid keeps a request resident in runs of the cache's streams while they are free, and demotes
resident lanes (the latest admitted first) when a hierarchical one needs the streams; placement is
planned on a copy of the stream map with the cache's own rule, so the check and the placement agree.
"""
from __future__ import annotations

import math

import torch

from hisparse.cache import HierarchicalKVCache, lowest_runs
from hisparse.host_pool import as_int
from hisparse.runtime import FamilyRuntime, cache_bytes, nbytes
from hisparse.serving.request import Request
from hisparse.serving.sharing import PAGE_TOKENS

GIB = 2 ** 30
# modes resident, noio and hybrid with a prefix cache and a host budget: the share of it the index's host
# copies may take, a pool the rest (mode hisparse shares the pool's pages instead)
COPY_SHARE = 0.25


def empty_layers(runtime: FamilyRuntime, kv_mode: str, lanes: int, cache, max_context: int, prefetch: bool,
                 device: torch.device) -> list:
    """Every layer's state for `lanes` empty lanes: zeros, and -1 streams (closed at once)."""
    one = [torch.zeros(1, dtype=torch.int64)] * lanes
    random = runtime.random_rows(one, device)

    def zero_rows(b: int, layer: int):
        return tuple(None if t is None else torch.zeros_like(t) for t in random(b, layer))

    lengths = torch.ones(lanes, dtype=torch.int64, device=device)
    layers = runtime.gather_layers(kv_mode, cache, zero_rows, lengths, max_context, prefetch, host_tokens=1)
    lane_states = runtime.serving_lanes(layers, torch.zeros(lanes, dtype=torch.bool, device=device))
    for lane in range(lanes):
        for s in lane_states.streams(lane):
            cache.close_stream(s)
        lane_states.clear(lane)
    return layers


def _positive_gib(value, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive, finite number of GiB, got {value!r}")
    return value


class LaneMemory:
    """The lanes and the cache a server's budgets hold, and whether a request fits now.

    kv_budget_gib: GPU memory for KV (lanes, cache, prefill workspace); host_budget_gib: the host
    pool (default: every lane at max_context); max_batch: the most lanes; lanes: exactly this many
    (a replay's; the budgets are then not applied)."""

    def __init__(self, runtime: FamilyRuntime, mode: str, cache_slots: int | None, max_context: int,
                 kv_budget_gib: float | None, host_budget_gib: float | None, max_batch: int, lanes: int | None,
                 prefetch: bool, device: torch.device, prefix_cache: bool = False):
        self.runtime, self.mode, self.max_context, self.device = runtime, mode, max_context, device
        # prefix sharing: mode hisparse shares host pages (a page table); elsewhere the index keeps copies
        # (a page of PAGE_TOKENS tokens: DSA 64 rows of a token, Quest 4 of 16, NSA 1 of 64)
        self.page_rows = PAGE_TOKENS // runtime.unit_size if prefix_cache and mode == "hisparse" and \
            runtime.shares_prefixes else None
        self.sharing = None              # a `sharing.PrefixSharing`, set by the server (it needs the lanes)
        self.host_bytes, self.peak_host_rows = [], 0        # a run's host record (`record_host`)
        self.hybrid = mode == "hybrid"
        self.kv_mode = "hisparse" if self.hybrid else mode     # what the runtime's states and attention are
        self.prefetch = prefetch
        k = runtime.selection_size
        if mode != "resident":
            if cache_slots is None:
                raise ValueError(f"mode {mode!r} needs cache_slots (B >= k = {k})")
            cache_slots = as_int(cache_slots, f"cache_slots must be an int (B >= k = {k})", k)
        self.cache_slots = cache_slots
        self.streams_per_request = len(runtime.stream_regions(max_context))
        copy_budget = self.host_budget_given = host_budget_gib
        if host_budget_gib is not None and prefix_cache and not self.page_rows:
            # the index's copies and a pool share the one host budget (resident's copies take the same share:
            # the copy modes' indexes then evolve alike, so a schedule replays from one into another)
            copy_budget = _positive_gib(host_budget_gib, "host_budget_gib") * COPY_SHARE
            host_budget_gib -= copy_budget
        if host_budget_gib is not None and mode == "resident":
            host_budget_gib = None                   # resident keeps nothing on the host but a prefix cache's copies
        self.lane_bytes = self._lane_bytes()
        self.workspace_bytes = runtime.lane_workspace_bytes(mode, max_context)
        if lanes is None:
            if kv_budget_gib is None:
                raise ValueError("a server needs kv_budget_gib (GPU memory for KV, GiB), or lanes")
            self.kv_budget = int(_positive_gib(kv_budget_gib, "kv_budget_gib") * GIB)
            host_rows = self._host_rows(host_budget_gib, max_batch)
            fits = (self.kv_budget - self.workspace_bytes - 4 * host_rows) // self.lane_bytes
            if fits < 1:
                raise ValueError(f"kv_budget_gib={kv_budget_gib} holds no lane: one lane takes "
                                 f"{self.lane_bytes / GIB:.3f} GiB at max_context={max_context}, beside the "
                                 f"prefill workspace's {self.workspace_bytes / GIB:.3f} GiB and the cache's slot map "
                                 f"{4 * host_rows / GIB:.3f} GiB")
            if self.page_rows:         # the slot map covers every lane's streams whole, over shared pages too
                while fits > 1 and fits * self.lane_bytes + self.workspace_bytes + 4 * self._map_rows(fits, host_rows) \
                        > self.kv_budget:
                    fits -= 1
            self.lanes = int(min(fits, max_batch))
            self.gpu_lanes, self.max_batch = int(fits), max_batch
            if host_budget_gib is None and mode != "resident":
                host_rows = self._host_rows(None, self.lanes)
        else:
            self.lanes = as_int(lanes, "lanes must be an int >= 1", 1)
            self.kv_budget = self.gpu_lanes = self.max_batch = None
            host_rows = self._host_rows(host_budget_gib, self.lanes)
        # requests of max_context the host pool holds at once, where a host budget sizes it
        self.host_requests = None if mode == "resident" or host_budget_gib is None else \
            host_rows // sum(self.runtime.stream_regions(max_context))
        self.cache = None if mode == "resident" else self._make_cache(host_rows)
        self.copy_budget = self._copy_budget(copy_budget) if prefix_cache and not self.page_rows else 0
        # hybrid: lane -> its runs while resident; a count of lane changes; the last request no plan placed
        self.lane_runs: dict[int, list[int]] = {}
        self.lanes_changed, self._no_plan = 0, None

    # -- sizes ---------------------------------------------------------------------------------

    def caps(self) -> dict[str, int]:
        """What bounds the running batch, by name: the lanes the GPU budget holds ("GPU budget"), the most
        lanes asked for ("max lanes": max_batch, which a sweep lowers to its clients or max_concurrency),
        and where a host budget sizes the pool, the requests of max_context it holds at once ("host RAM";
        hybrid's resident requests hold none of it). Empty for a server of given lanes."""
        if self.gpu_lanes is None:
            return {}
        caps = {"GPU budget": self.gpu_lanes, "max lanes": self.max_batch}
        if self.host_requests is not None:
            caps["host RAM"] = self.host_requests
        return caps

    def _host_rows(self, host_budget_gib: float | None, lanes: int) -> int:
        """Rows of the host pool: the host budget's, or every lane at max_context."""
        if self.mode == "resident":
            return 0
        if host_budget_gib is None:
            regions = self.runtime.stream_regions(self.max_context)
            page = self.page_rows or 1
            return lanes * sum(-(-r // page) * page for r in regions)
        rows = int(_positive_gib(host_budget_gib, "host_budget_gib") * GIB // self.runtime.row_bytes)
        if rows < 1:
            share = "" if host_budget_gib == self.host_budget_given else f"; the pool's share {host_budget_gib:.3g} GiB"
            raise ValueError(f"host_budget_gib={self.host_budget_given} holds no host pool row (one is "
                             f"{self.runtime.row_bytes} bytes{share})")
        return rows

    def _copy_budget(self, host_budget_gib: float | None) -> int:
        """Bytes a prefix index's host copies may take (`sharing.CopyPages`; not where it shares host
        pages): `host_budget_gib`, COPY_SHARE of the server's; by default what a host pool of every lane
        at max_context holds."""
        if host_budget_gib is not None:
            return int(_positive_gib(host_budget_gib, "host_budget_gib") * GIB)
        return self.lanes * sum(self.runtime.stream_regions(self.max_context)) * self.runtime.row_bytes

    def _map_rows(self, lanes: int, host_rows: int) -> int:
        """With a page table: the slot map's rows, every lane's streams at max_context in whole pages
        (and at least the host rows)."""
        pages = sum(-(-r // self.page_rows) for r in self.runtime.stream_regions(self.max_context))
        return max(lanes * pages * self.page_rows, host_rows)

    def _cache(self, streams: int, host_rows: int, **kw) -> HierarchicalKVCache:
        rt = self.runtime
        return HierarchicalKVCache(max_streams=streams, cache_slots=self.cache_slots, host_rows=host_rows,
                                   row_elems=rt.row_bytes // rt.row_dtype.itemsize, dtype=rt.row_dtype,
                                   device=self.device, **kw)

    def _lane_bytes(self) -> int:
        """GPU bytes of one lane: measured on a one-lane state, built and dropped (slots and cache
        state per stream; not the slot map)."""
        cache = None
        if self.mode != "resident":
            cache = self._cache(self.streams_per_request, self.streams_per_request, pin=False)
        layers = empty_layers(self.runtime, self.kv_mode, 1, cache, self.max_context, self.prefetch, self.device)
        state = self.runtime.kv_bytes(layers, None)
        if cache is None:
            return int(state)
        return int(state + cache_bytes(cache) - nbytes(cache.state.unit_slot))

    def stream_bytes(self) -> int:
        """GPU bytes of one more stream of the cache: its B + 1 slots and its cache state."""
        one = self._cache(1, 1, pin=False)
        return int(cache_bytes(one) - nbytes(one.state.unit_slot))

    def _make_cache(self, host_rows: int) -> HierarchicalKVCache:
        streams = self.lanes * self.streams_per_request
        # DSA hybrid: a row past the streams' for the decode write of the lanes not resident, so no
        # write lands in a run a prefill may be filling beside the step
        trash = self.hybrid and self.runtime.hybrid_trash_row
        if self.hybrid:
            # the budget the lanes leave goes to more streams: a resident request's rows sit in runs of
            # them, and so does a hierarchical prefill's workspace where the runtime puts it there (then
            # the workspace's budget is spare too; given lanes=, that alone: the memory hisparse holds)
            kept = 0 if self.runtime.workspace_in_runs else self.workspace_bytes
            spare = self.workspace_bytes - kept if self.kv_budget is None else \
                self.kv_budget - 4 * host_rows - self.lanes * self.lane_bytes - kept
            streams += max(0, (spare - trash * self.runtime.row_bytes) // self.stream_bytes())
        if self.page_rows:
            host_rows -= host_rows % self.page_rows
            if host_rows < self.page_rows:
                raise ValueError(f"the host pool holds {host_rows} rows, under one page of {self.page_rows}: raise "
                                 f"host_budget_gib")
            return self._cache(streams, host_rows, page_rows=self.page_rows,
                               map_rows=self._map_rows(self.lanes, host_rows))
        return self._cache(streams, host_rows, trash_row=trash)

    def gpu_bytes(self, layers: list, extra: int = 0) -> int:
        """Budgeted GPU bytes in use: the lanes' state, the cache, the workspace in use (`extra`)."""
        return int(self.runtime.kv_bytes(layers, self.cache)) + extra

    def host_rows_in_use(self) -> int:
        return 0 if self.cache is None else self.cache.host.capacity - self.cache.host.free_rows

    def record_host(self, now: float, start: bool = False) -> None:
        """Host bytes in use now (the pool's rows and what a prefix cache keeps beside them) onto
        `host_bytes`, (seconds, bytes), where they changed; `peak_host_rows` the pool's high mark.
        start: a run starts, both afresh."""
        rows = self.host_rows_in_use()
        used = rows * self.runtime.row_bytes + (0 if self.sharing is None else self.sharing.host_bytes())
        if start:
            self.host_bytes, self.peak_host_rows = [], 0
        self.peak_host_rows = max(self.peak_host_rows, rows)
        if not self.host_bytes or used != self.host_bytes[-1][1]:
            self.host_bytes.append((now, used))

    # -- requests ------------------------------------------------------------------------------

    def check(self, prompt: int, need: int) -> None:
        """ValueError if a request of `prompt` tokens, `need` in all, could never be placed."""
        if self.cache is not None:
            page = self.page_rows or 1                   # (with a page table every stream takes whole pages)
            rows = sum(-(-r // page) * page for r in self.runtime.stream_regions(need))
            if rows > self.cache.host.capacity:
                raise ValueError(f"a request of {need} tokens needs {rows} host pool rows; the pool holds "
                                 f"{self.cache.host.capacity} (raise host_budget_gib)")
        if self.hybrid:                   # an empty server places it resident, or hierarchical with its workspace
            runs, total = self.runtime.runs_per_request(), self.cache.max_streams
            resident = self.runtime.run_streams(self.cache, self.max_context) * runs
            hierarchical = self.streams_per_request + self._workspace_streams(prompt) * runs
            if min(resident, hierarchical) > total:
                raise ValueError(f"a prompt of {prompt} tokens needs {hierarchical} of the cache's streams "
                                 f"in hybrid mode (its own and its prefill workspace's; resident: {resident}); "
                                 f"the cache has {total} (raise kv_budget_gib)")

    def admissible(self, request: Request, lane_request: list[Request | None]) -> bool:
        """Whether a request's streams and host regions (hybrid: its placement) fit now."""
        if self.cache is None:
            return True
        if self.hybrid:
            return self.plan(request, lane_request) is not None
        regions = self.runtime.stream_regions(len(request.prompt) + request.max_new_tokens)
        if self.sharing is not None and self.page_rows:
            return self.sharing.admissible(regions, request.prompt)
        return self.cache.fits(regions)

    def release(self, lane: int, streams: list[int]) -> None:
        """A lane's request left: its streams closed and (hybrid) its runs given back."""
        for s in streams:
            self.cache.close_stream(s)
        for first in self.lane_runs.pop(lane, []):
            self.cache.release_run(first)
        self.lanes_changed += 1

    # -- hybrid: resident while the rows fit, hierarchical otherwise -------------------------------

    def _workspace_streams(self, prompt: int) -> int:
        """Streams of each of the runs_per_request runs a hierarchical prefill of `prompt` tokens takes
        for its workspace (0 where the workspace sits beside the cache)."""
        return self.runtime.run_streams(self.cache, prompt) if self.runtime.workspace_in_runs else 0

    def plan(self, request: Request, lane_request: list[Request | None]) -> tuple[str, list[int]] | None:
        """Where a request would go now: ("resident", []) when its runs are free, ("hierarchical",
        the resident lanes to demote first, in order) when, after those demotions, its workspace's runs
        (where it takes runs) and its own streams are free and the host pool holds the demoted
        requests' regions and then its own; None when nothing would place it. Planned on a copy of the
        cache's stream map with the cache's own rule (`lowest_runs`), so `place` then places it
        exactly so. A request not placeable is remembered until a lane changes (the queue's head asks
        every iteration)."""
        key = (request.rid, self.lanes_changed)
        if self._no_plan == key:
            return None
        cache, count = self.cache, self.runtime.runs_per_request()
        run, work = self.runtime.run_streams(cache, self.max_context), self._workspace_streams(len(request.prompt))
        taken = cache.taken_streams()
        if lowest_runs(set(taken), cache.max_streams, run, count) is not None:
            return "resident", []
        regions = self.runtime.stream_regions(len(request.prompt) + request.max_new_tokens)
        demoted, sizes = [], []
        for lane in [None, *self._demotion_order(lane_request)]:
            if lane is not None:                # its runs back and its streams opened, run by run
                for first in self.lane_runs[lane]:
                    taken.difference_update(range(first, first + run))
                    taken.add(next(i for i in range(cache.max_streams) if i not in taken))
                r = lane_request[lane]
                demoted.append(lane)
                sizes += self.runtime.stream_regions(len(r.prompt) + r.max_new_tokens)
            trial = set(taken)
            if (work == 0 or lowest_runs(trial, cache.max_streams, work, count) is not None) \
                    and cache.max_streams - len(trial) >= self.streams_per_request:
                if cache.fits(sizes + regions):
                    return "hierarchical", demoted
                break                           # more demotions would need more host rows still
        self._no_plan = key
        return None

    def _demotion_order(self, lane_request: list[Request | None]) -> list[int]:
        """Resident lanes, the latest admitted first."""
        return sorted(self.lane_runs, key=lambda lane: -lane_request[lane].rid)

    def place(self, request: Request, lane_request: list[Request | None], layers: list) -> tuple[dict, int]:
        """Place a request about to prefill as `plan` says: ({"runs": its resident runs}, 0), or its
        demotions made, ({"workspace_runs": its workspace's runs} or {} where the workspace sits
        beside the cache, the number of lanes demoted)."""
        plan = self.plan(request, lane_request)
        if plan is None:
            raise RuntimeError(f"request {request.rid} was admitted with no room to place it (a replayed "
                               f"schedule from a server with more memory?)")
        kind, demoted = plan
        if kind == "resident":
            return {"runs": self.runtime.take_runs(self.cache, self.max_context)}, 0
        for lane in demoted:
            r = lane_request[lane]
            self.runtime.demote(self.cache, layers, lane, r.length, len(r.prompt) + r.max_new_tokens,
                                self.lane_runs[lane])
            del self.lane_runs[lane]
        self.lanes_changed += 1
        if not self.runtime.workspace_in_runs:
            return {}, len(demoted)
        return {"workspace_runs": self.runtime.take_runs(self.cache, len(request.prompt))}, len(demoted)

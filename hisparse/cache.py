"""The hierarchical KV cache: a host pool of every row plus B GPU slots per stream.

A stream is one independent cache: (request, layer) for DSA, (request, layer, KV head) where the
selection is per KV head. Callers map their requests onto streams; this class knows only streams.

    cache = HierarchicalKVCache(max_streams=64, cache_slots=4096, host_rows=64 * 131072,
                                row_elems=576, dtype=torch.bfloat16, device="cuda")
    sid = cache.open_stream(capacity=131072)     # host region for 131072 units
    cache.append(sid, rows)                      # rows [n, 576]: the next n units of the stream
    res = cache.resolve(streams, sel)            # slots of the selected units, in selection order
    rows = cache.slot_rows(streams, res.slots)   # [N, k] rows of cache.slots.view(-1, E)

With `page_rows=P` the host rows are pages of P rows reached through a page table, so streams that
extend one prefix share its pages (counted, read-only while shared):

    pages = cache.stream_pages(sid)[:2]          # the host pages of a stream's first 2 * P units
    other = cache.open_stream(capacity=131072, shared_pages=pages)   # starts with those 2 * P units
"""
from __future__ import annotations

import torch

from hisparse.host_pages import StreamRegions
from hisparse.host_pool import HostPool, as_int
from hisparse.resolve import (
    MAX_SLOTS,
    CacheState,
    ResolveResult,
    check_fetch_inputs,
    check_resolve_inputs,
    fetch_rows,
    host_rows_of,
    resolve,
    write_rows,
    write_unit_token,
)
from hisparse.resolve_ref import resolve_ref

MODES = ("normal", "noio")


def _check_integer(name: str, t: torch.Tensor) -> None:
    """Unit ids as integers: a float would be truncated silently on the way to int64."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")


def _check_listed_once(what: str, streams: list[int], why: str) -> None:
    """ValueError naming the first stream listed more than once in `streams` (-1s already left out)."""
    seen: set[int] = set()
    for s in streams:
        if s in seen:
            raise ValueError(f"{what}: stream {s} is listed twice: {why}")
        seen.add(s)


def _values_checked(check_values: bool | None, streams: torch.Tensor) -> bool:
    """Whether a write checks its values (a host sync): as asked, else unless a CUDA graph is being
    captured on the current stream (where a sync is not allowed, and the step's first, eager run
    has checked the same calls). A cache off the GPU never asks CUDA (which would make a context)."""
    if check_values is not None:
        return check_values
    return not (streams.is_cuda and torch.cuda.is_current_stream_capturing())


def lowest_runs(taken: set[int], max_streams: int, streams: int, count: int) -> list[int] | None:
    """First ids of the `count` lowest runs of `streams` free contiguous ids in 0 .. max_streams - 1 not
    in `taken` (each run the lowest that fits beside the ones before it), added to `taken`; None (and
    `taken` unchanged) when they do not all fit. One pass: a run found lowest-first leaves no free
    gap of `streams` ids before its end."""
    firsts, length = [], 0
    for s in range(max_streams):
        length = 0 if s in taken else length + 1
        if length == streams:
            firsts.append(s - streams + 1)
            length = 0
            if len(firsts) == count:
                taken.update(i for first in firsts for i in range(first, first + streams))
                return firsts
    return None


class HierarchicalKVCache:
    def __init__(self, max_streams: int, cache_slots: int, host_rows: int, row_elems: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                 pin: bool | None = None, run_only_streams: int = 0, trash_row: bool = False,
                 page_rows: int | None = None, map_rows: int | None = None):
        """max_streams streams with cache state (what `open_stream` opens), then `run_only_streams` more
        that hold rows only, with no cache state (the fixed-batch engine's hybrid mode keeps its
        resident requests' latents in a run of them, `take_runs`, and pays no LRU state for them);
        stream ids 0 .. max_streams + run_only_streams - 1 in all. trash_row: one more row of
        `gpu_rows` past every stream's (`self.trash_row`, in no stream or run), where a launch that
        writes every lane sends the writes of the lanes that have nothing to write (hybrid serving).
        page_rows: P (a power of two dividing host_rows) for host rows in counted pages through a page
        table, which `open_stream(shared_pages=)` shares; None: no table, each stream one contiguous
        host region. map_rows: the slot map's rows (V, whole pages; default host_rows), what the
        streams' capacities add up to (with shared prefixes, more than the host rows they store); it
        costs 4 + 4 / P GPU bytes a row."""
        run_only_streams = as_int(run_only_streams, "run_only_streams must be an int >= 0 (streams without "
                                  "cache state, for runs)", minimum=0)
        max_streams = as_int(max_streams, "max_streams must be a positive int (streams)" if not run_only_streams
                             else "max_streams must be an int >= 0 (streams with cache state)",
                             minimum=0 if run_only_streams else 1)
        cache_slots = as_int(cache_slots, "cache_slots must be a positive int (B, GPU slots per stream)", minimum=1)
        host_rows = as_int(host_rows, "host_rows must be a positive int (host pool rows)", minimum=1)
        row_elems = as_int(row_elems, "row_elems must be a positive int (elements per row)", minimum=1)
        if cache_slots > MAX_SLOTS:
            raise ValueError(f"cache_slots B={cache_slots} exceeds the supported {MAX_SLOTS}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"a cache on {self.device} needs a CUDA GPU, and none is here: pass device='cpu' (the "
                             f"Triton kernels then run in the interpreter)")
        self.cache_slots = cache_slots
        if page_rows is not None:
            page_rows = as_int(page_rows, "page_rows must be a positive int (host rows a page) or None", minimum=1)
        map_rows = host_rows if map_rows is None else \
            as_int(map_rows, "map_rows must be a positive int (rows of the slot map)", minimum=1)
        if page_rows is None and map_rows != host_rows:
            raise ValueError(f"map_rows={map_rows} differs from host_rows={host_rows}: without a page table the "
                             f"slot map's rows are the host rows (pass page_rows)")
        if page_rows is not None and map_rows % page_rows:
            raise ValueError(f"map_rows={map_rows}: expected whole pages of page_rows={page_rows}")
        self.host = HostPool(host_rows, row_elems, dtype, page_rows=page_rows or 1,
                             pin=(self.device.type == "cuda") if pin is None else pin)
        # every stream's rows, [(S + run-only streams) * (B+1), E]; `slots`, its first S streams as
        # [S, B+1, E]: B LRU slots, then the reserved slot for the newest token
        rows = (max_streams + run_only_streams) * (cache_slots + 1)
        self.gpu_rows = torch.zeros(rows + int(bool(trash_row)), row_elems, dtype=dtype, device=self.device)
        self.trash_row: int | None = rows if trash_row else None
        self.slots = self.gpu_rows[:max_streams * (cache_slots + 1)].view(max_streams, cache_slots + 1, row_elems)
        self.state = CacheState.empty(max_streams, cache_slots, map_rows, self.device, page_rows=page_rows)
        self.regions = StreamRegions(self.host, None if page_rows is None else self.state.pages.page_of, map_rows)
        self.stream_len = [0] * max_streams
        self.stream_capacity = [0] * max_streams
        self.stream_base = [0] * max_streams     # each open stream's first map row, as state.host_base on the host
        self._open: set[int] = set()
        self._runs: dict[int, int] = {}         # first stream id -> streams, of each run (`take_runs`)

    # -- streams -----------------------------------------------------------------------------

    @property
    def max_streams(self) -> int:
        """Stream ids, the run-only ones included."""
        return (self.gpu_rows.shape[0] - (self.trash_row is not None)) // (self.cache_slots + 1)

    @property
    def state_streams(self) -> int:
        """Streams with cache state: the ids `open_stream` may give (the first ones)."""
        return self.slots.shape[0]

    @property
    def reserved_slot(self) -> int:
        return self.cache_slots

    @property
    def stats(self) -> torch.Tensor:
        """[S, 2] int64 cumulative hits, misses per stream (on the device; reading it syncs)."""
        return self.state.stats

    @property
    def page_rows(self) -> int | None:
        """Host rows (units) a page, or None without a page table."""
        return None if self.state.pages is None else self.state.pages.page_rows

    def open_stream(self, capacity: int, shared_pages: list[int] = ()) -> int:
        """Take a free stream with room for `capacity` units. shared_pages (a page table's cache only):
        host pages, held already (another stream's `stream_pages`, or an index's), that become its
        first len(shared_pages) * P units, recorded (its length starts there; the next `append`
        writes the reserved slot); each gains a holder and stays read-only while shared. The rest
        are private pages. Nothing changes on failure."""
        capacity = as_int(capacity, "a stream's capacity must be a positive int (units)", minimum=1)
        shared_pages = [as_int(p, "shared pages must be ints (host pages)") for p in shared_pages]
        taken = self._taken()
        free = [s for s in range(self.state_streams) if s not in taken]
        if not free:
            raise RuntimeError(f"all {self.state_streams} streams with cache state are open or in runs; close one "
                               f"or raise max_streams")
        base = self.regions.open(capacity, shared_pages)
        stream = free[0]
        self.state.reset_stream(stream, base, self.host.pages_for(capacity) * self.host.page_rows)
        prefix = len(shared_pages) * self.host.page_rows
        self.stream_len[stream], self.stream_capacity[stream], self.stream_base[stream] = prefix, capacity, base
        self._open.add(stream)
        return stream

    def close_stream(self, stream: int) -> None:
        """Free the stream and give back its host rows (a shared page: one holder fewer)."""
        stream = self._check_open(stream)
        self.regions.close(self.stream_base[stream])
        self._open.remove(stream)
        self.stream_len[stream] = self.stream_capacity[stream] = 0

    def stream_pages(self, stream: int) -> list[int]:
        """The host pages of an open stream, in unit order (page i holds units i * P .. i * P + P - 1)."""
        stream = self._check_open(stream, "stream_pages")
        if self.state.pages is None:
            raise ValueError("stream_pages: this cache has no page table (make it with page_rows=P)")
        return self.regions.pages(self.stream_base[stream])

    def share_pages(self, pages: list[int]) -> None:
        """One more holder of each page (e.g. a prefix index keeping a finished request's prefix)."""
        self.host.share(pages)

    def release_pages(self, pages: list[int]) -> list[int]:
        """One holder fewer of each page; returns the pages now free."""
        return self.host.release_pages(pages)

    def fits(self, capacities: list[int], shared: list[int] | None = None) -> bool:
        """Whether streams of these capacities (units), opened in this order with shared[i] shared
        pages each (default none), would all fit the host pool and the slot map now."""
        return self.regions.fits(capacities, shared)

    def host_rows(self, streams: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
        """Host rows (int64, on the host) of units [...] of streams [...] (broadcast), through the page
        table: where `host.rows` holds them (for tests, notebooks and checks)."""
        base = self.state.host_base.cpu()[streams.cpu().long()]
        return host_rows_of(self.state.pages, base + units.cpu().long())

    def _taken(self) -> set[int]:
        """Stream ids open or inside a run."""
        return self._open | {s for first, n in self._runs.items() for s in range(first, first + n)}

    def free_streams(self) -> int:
        """Stream ids neither open nor inside a run."""
        return self.max_streams - len(self._taken())

    def taken_streams(self) -> set[int]:
        """Stream ids open or inside a run (a copy: what `lowest_runs` plans against)."""
        return self._taken()

    def take_runs(self, streams: int, count: int = 1) -> list[int] | None:
        """Reserve `count` runs of `streams` contiguous free stream ids each, as GPU rows: run r is rows
        row_base(first) .. row_base(first) + streams * (B + 1) - 1 of `gpu_rows`, for a caller
        that stores a whole sequence on the GPU (a resident request in hybrid serving) and indexes it
        itself. A run has no host region and no cache state; the resolve never sees it. Returns the
        first ids (the lowest runs that fit, `lowest_runs`), or None when they do not all fit (nothing
        is taken then)."""
        streams = as_int(streams, "a run's length must be a positive int (streams)", minimum=1)
        count = as_int(count, "count must be a positive int (runs)", minimum=1)
        firsts = lowest_runs(self._taken(), self.max_streams, streams, count)
        if firsts is None:
            return None
        for first in firsts:
            self._runs[first] = streams
        return firsts

    def run_length(self, first: int) -> int:
        """Streams of the run `take_runs` returned as `first`."""
        if first not in self._runs:
            raise ValueError(f"no run starts at stream {first} (runs start at {sorted(self._runs)[:8]})")
        return self._runs[first]

    def release_run(self, first: int) -> None:
        """Give back the run `take_runs` returned as `first`."""
        first = as_int(first, "a run is named by its first stream id (an int)")
        if first not in self._runs:
            raise ValueError(f"no run starts at stream {first} (runs start at {sorted(self._runs)[:8]})")
        del self._runs[first]

    def _check_open(self, stream: int, what: str = "") -> int:
        """`stream` as an int, if it is an open stream's id (`what`: the call, for the message)."""
        stream = as_int(stream, "a stream id must be an int")
        if stream not in self._open:
            raise ValueError(f"{what + ': ' if what else ''}stream {stream} is not open (open streams: "
                             f"{sorted(self._open)[:8]}...)")
        return stream

    def _check_newest_units(self, what: str, streams: torch.Tensor, units: torch.Tensor,
                            map_streams: torch.Tensor | None = None) -> None:
        """Before a write that has no host sync of its own: every stream open (or -1, skipped) and
        listed at most once, every unit one the stream has recorded (`advance`), every map
        stream open. Reads the values on the host."""
        if streams.dim() != 1 or units.shape != streams.shape:
            raise ValueError(f"{what}: streams and units must be [N] each, got {tuple(streams.shape)} and "
                             f"{tuple(units.shape)}")
        _check_integer("streams", streams)
        streams = streams.tolist()                                           # on the host, once
        live = [(s, u) for s, u in zip(streams, units.tolist()) if s != -1]
        for s, u in live:
            self._check_open(s, what)
            if not 0 <= u < self.stream_len[s]:
                raise ValueError(f"{what}: unit {u} of stream {s} is outside its recorded units 0.."
                                 f"{self.stream_len[s] - 1} (record it with `advance` first)")
        _check_listed_once(what, [s for s, _ in live], "each may take one row a call")
        for s, u in live:                                         # a shared page is read-only
            (_, row, _), = self.regions.host_rows(self.stream_base[s], u, 1)
            try:
                self.host.check_writable(row, 1)
            except ValueError as exc:
                raise ValueError(f"{what}: unit {u} of stream {s}: {exc}") from None
        if map_streams is not None:
            if tuple(map_streams.shape) != (len(streams),):
                raise ValueError(f"{what}: map_streams must be [N]=[{len(streams)}], got "
                                 f"{tuple(map_streams.shape)}")
            for (s, u), m in zip(zip(streams, units.tolist()), map_streams.tolist()):
                if s == -1 or m == -1:
                    continue
                if m not in self._open:
                    raise ValueError(f"{what}: map stream {m} is not open (expected -1 or an open stream)")
                if u >= self.stream_len[m]:     # else the row would land in a slot of another unit's map
                    raise ValueError(f"{what}: unit {u} of stream {s} is past its map stream {m}'s recorded "
                                     f"units 0..{self.stream_len[m] - 1} (is {s} in lockstep with {m}?)")

    # -- writes ------------------------------------------------------------------------------

    def append(self, stream: int, rows: torch.Tensor) -> None:
        """Append units to a stream: rows [n, E] become units len .. len + n - 1 in the host pool.

        The last appended row is also written to the reserved newest-token slot. Raises before
        writing anything when the stream's region would overflow.
        """
        stream = self._check_open(stream)
        if rows.dim() != 2 or rows.shape[0] == 0:
            raise ValueError(f"rows must be [n >= 1, E], got shape {tuple(rows.shape)}")
        n, length, capacity = rows.shape[0], self.stream_len[stream], self.stream_capacity[stream]
        if length + n > capacity:
            raise ValueError(f"stream {stream} holds {length} of {capacity} units; appending {n} "
                             f"would exceed its host region")
        runs = self.regions.host_rows(self.stream_base[stream], length, n)
        for _, row, count in runs:                               # none on a shared page, before any write
            self.host.check_writable(row, count)
        for unit, row, count in runs:      # no device read: a prefill piece stages here
            self.host.write(row, rows[unit - length:unit - length + count])
        self.slots[stream, self.reserved_slot] = rows[-1]
        self.stream_len[stream] = length + n

    def write_unit(self, stream: int, unit: int, row: torch.Tensor) -> None:
        """Overwrite one existing unit (a page or block that grew): host pool, and write-through to
        its cached copy, so a stale row is never read. Not for a stream in lockstep with an anchor's
        (a shared layer's): its copy is placed by the anchor's map, which this does not read; the
        decode loop writes those with `write_newest(..., map_streams=)`."""
        stream = self._check_open(stream)
        unit = as_int(unit, "unit must be an int (a unit of the stream)")
        if not 0 <= unit < self.stream_len[stream]:
            raise ValueError(f"unit {unit} of stream {stream} does not exist (length "
                             f"{self.stream_len[stream]})")
        base = self.stream_base[stream]
        (_, host_row, _), = self.regions.host_rows(base, unit, 1)
        self.host.write(host_row, row[None])
        slot = int(self.state.unit_slot[base + unit])
        if slot >= 0:
            self.slots[stream, slot] = row
        if unit == self.stream_len[stream] - 1:
            self.slots[stream, self.reserved_slot] = row

    def write_newest(self, streams: torch.Tensor, units: torch.Tensor, rows: torch.Tensor,
                     map_streams: torch.Tensor | None = None, check_values: bool | None = None) -> None:
        """The decode step's write, on the device (capturable: no host sync while a CUDA graph is
        captured or with check_values=False): rows [N, E] become
        unit units[n] of stream streams[n] (int32, -1 skips) in the host pool, in the reserved slot,
        and in the unit's cached copy if it has one. The caller records the new units on the host
        first (`advance`, which checks capacity); the units must lie inside the streams' regions.
        map_streams: the streams whose slot maps place the rows (a shared layer's anchor streams).
        check_values: check streams and units on the host first (a sync); default: unless a CUDA
        graph is being captured."""
        _check_integer("units", units)
        if _values_checked(check_values, streams):
            self._check_newest_units("write_newest", streams, units, map_streams)
        write_rows(streams, units.to(torch.int64), rows, self.state.host_base, self.state.unit_slot,
                   self.host.rows, self.slots, to_reserved=True, map_streams=map_streams, pages=self.state.pages)

    def write_newest_token(self, streams: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           unit_tokens: int, map_streams: torch.Tensor | None = None,
                           check_values: bool | None = None) -> None:
        """The decode step's write when a unit holds `unit_tokens` tokens (rows [2, T, D]): token
        pos[n]'s keys and values [N, HKV, D] join the newest unit of streams [N * HKV] (-1 skips), in
        the host pool, the reserved slot and any cached copy (the token alone; the whole row, zeros but
        for the token, when it opens the unit). One launch; no host sync while a CUDA graph is captured
        or with check_values=False. The caller records opened units first (`advance`). map_streams,
        check_values: as in `write_newest`."""
        unit_tokens = as_int(unit_tokens, "unit_tokens must be a positive int (tokens a unit)", minimum=1)
        _check_integer("pos", pos)
        if _values_checked(check_values, streams):
            if pos.dim() != 1 or pos.numel() == 0 or streams.dim() != 1 or streams.numel() % pos.numel():
                raise ValueError(f"write_newest_token: pos must be [N] and streams [N * HKV], got "
                                 f"{tuple(pos.shape)} and {tuple(streams.shape)}")
            pos_h = pos.cpu().long()
            if bool((pos_h < 0).any()):
                raise ValueError(f"write_newest_token: token positions must be >= 0, got {pos_h.tolist()[:8]}")
            units = (pos_h // unit_tokens).repeat_interleave(streams.numel() // pos.numel())
            self._check_newest_units("write_newest_token", streams.cpu(), units,
                                     None if map_streams is None else map_streams.cpu())
        write_unit_token(streams, pos, keys, values, self.state.host_base, self.state.unit_slot, self.host.rows,
                         self.slots, unit_tokens, map_streams, pages=self.state.pages)

    def replay_plan(self, plan: ResolveResult, streams: torch.Tensor, max_programs: int | None = None,
                    check_values: bool | None = None) -> None:
        """Copy an anchor's miss plan into other streams (a shared layer's, in lockstep with the
        anchor): each planned unit's row from their host regions into the same slots (no host sync
        while a CUDA graph is captured or with check_values=False). max_programs: see `fetch_rows` (a
        side-stream copy leaves SMs to the compute). check_values: every stream open (or -1) and holding
        the planned units, read on the host first; default: unless a CUDA graph is being captured."""
        check_fetch_inputs(plan.plan_unit, plan.plan_slot, plan.counts, streams, self.host.rows, self.slots)
        if _values_checked(check_values, streams):
            counts, units, slots = plan.counts[:, 1].tolist(), plan.plan_unit.cpu(), plan.plan_slot.cpu()
            streams_h = streams.tolist()
            _check_listed_once("replay_plan", [s for s in streams_h if s != -1],
                               "two copies would write the same slots")
            for row, (stream, n) in enumerate(zip(streams_h, counts)):
                if stream == -1:
                    continue
                self._check_open(stream, "replay_plan")
                if not 0 <= n <= units.shape[1]:
                    raise ValueError(f"replay_plan: row {row} counts {n} planned units, expected 0..{units.shape[1]}")
                planned, into = units[row, :n], slots[row, :n]
                if n and int(planned.max()) >= self.stream_len[stream]:
                    raise ValueError(f"replay_plan: row {row} plans unit {int(planned.max())}, past stream {stream}'s "
                                     f"{self.stream_len[stream]} units (is it in lockstep with the plan's anchor?)")
                if n and int(planned.min()) < 0:
                    raise ValueError(f"replay_plan: row {row} plans unit {int(planned.min())}, expected units >= 0")
                if n and not (0 <= int(into.min()) and int(into.max()) < self.cache_slots):
                    bad = into[(into < 0) | (into >= self.cache_slots)][0]
                    raise ValueError(f"replay_plan: row {row} plans slot {int(bad)}, expected "
                                     f"0..{self.cache_slots - 1} (was the plan made by a cache of another size?)")
        fetch_rows(plan.plan_unit, plan.plan_slot, plan.counts, streams, self.state.host_base,
                   self.host.rows, self.slots, max_programs, pages=self.state.pages)

    def advance(self, streams: list[int], n: int = 1) -> None:
        """Record on the host that each stream gets `n` more units (written by `write_newest` or by
        `resolve(newest=...)`); a stream listed twice gets 2n. Nothing changes on failure."""
        n = as_int(n, "n must be an int >= 0 (units per stream)", minimum=0)
        added: dict[int, int] = {}
        for s in streams:
            s = self._check_open(s)
            added[s] = added.get(s, 0) + n
        for s, more in added.items():
            if self.stream_len[s] + more > self.stream_capacity[s]:
                raise ValueError(f"stream {s} holds {self.stream_len[s]} of {self.stream_capacity[s]} units; "
                                 f"{more} more would exceed its host region")
        for s, more in added.items():
            self.stream_len[s] += more

    # -- resolve -----------------------------------------------------------------------------

    def resolve(self, streams: torch.Tensor, sel: torch.Tensor, mode: str = "normal",
                check_values: bool = True, newest: tuple[torch.Tensor, torch.Tensor] | None = None,
                **kwargs) -> ResolveResult:
        """Slots of the selected units (in selection order), fetching misses from the host pool.

        streams [N] int32 (-1 = padded row), sel [N, k] int32 (-1 pads). mode "noio" is the oracle
        that does everything but the copy. `check_values` validates ids (and `newest` units) against
        stream lengths (a host sync; turn it off inside captured decode steps). `newest` = (units [N],
        any integer dtype, rows [N, E]): each row's newest unit, written in the same launch (see `resolve`).
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if newest is not None:                                     # any integer units, as write_newest
            if not (isinstance(newest, (tuple, list)) and len(newest) == 2):
                raise ValueError(f"newest must be (units [N], rows [N, E]), got {type(newest).__name__}")
            _check_integer("units", newest[0])
            newest = newest[0].to(torch.int64), newest[1]
        if check_values:
            check_resolve_inputs(self.state, streams, sel)           # shapes and layouts first
            closed = [s for s in streams.tolist() if 0 <= s < self.max_streams and s not in self._open]
            if closed:
                raise ValueError(f"stream {closed[0]} is not open")
            kwargs["stream_len"] = torch.tensor(self.stream_len)     # the values, checked by `resolve`
            if newest is not None and self.state.pages is not None:  # and none on a shared page
                self._check_newest_units("resolve newest", streams.cpu(), newest[0].cpu())
        return resolve(self.state, streams, sel, self.host.rows, self.slots, fetch=(mode == "normal"),
                       newest=newest, **kwargs)

    def resolve_ref(self, streams: torch.Tensor, sel: torch.Tensor, mode: str = "normal",
                    newest: tuple[torch.Tensor, torch.Tensor] | None = None) -> ResolveResult:
        """The torch reference of `resolve`, on this cache's state (for tests and notebooks)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        check_resolve_inputs(self.state, streams, sel, torch.tensor(self.stream_len))
        if newest is not None:                       # as `resolve` checks them, with check_values
            _check_integer("units", newest[0])
            self._check_newest_units("resolve_ref newest", streams.cpu(), newest[0].cpu().long())
        return resolve_ref(self.state, streams, sel, self.host.rows, self.slots, fetch=(mode == "normal"),
                           newest=newest)

    def row_base(self, streams: torch.Tensor) -> torch.Tensor:
        """Row of each stream's slot 0 in `self.gpu_rows` (`slots.view(-1, E)` and the run-only streams
        after it): streams [N] -> [N] int64."""
        return streams.long() * (self.cache_slots + 1)

    def slot_rows(self, streams: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Row numbers into `self.slots.view(-1, E)` for attention kernels: stream * (B+1) + slot.

        streams [N] (-1 pads), slots [N, k] (-1 pads) -> [N, k] int32, -1 where either pads.
        """
        rows = self.row_base(streams)[:, None] + slots.long()
        return torch.where((slots >= 0) & (streams[:, None] >= 0), rows, -1).to(torch.int32)

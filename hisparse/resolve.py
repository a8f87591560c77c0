"""Resolve launchers (DESIGN section 3); their torch reference is hisparse/resolve_ref.py.

State of the cache, shared by the kernel and the reference (S streams, B slots, R host rows):
- `lru [S, B]` int32: the slot ids of each stream, least recently used first. Empty slots sit at the
  front in index order, which is how "empty slots count as least recently used, lowest index first"
  holds without a special case.
- `lru_unit [S, B]` int32: the unit held by the slot at each position of `lru`, -1 empty. Kept in
  LRU order rather than slot order, so the kernel reads and rewrites it contiguously, beside `lru`.
- `unit_slot [V]` int32: for each map row, the slot holding its unit, -1 if not cached. Indexed by
  map row (host_base[stream] + unit: each stream has a region of V map rows), so it is one dense map
  for all streams: 4 bytes per unit.
- `pages` (a `PageTable`, or None): where a map row's bytes are in the host pool. None: map row ==
  host row (each stream one contiguous region of the pool). Else map row v is host row
  page_of[v // P] * P + v % P (P rows a page, a power of two), so streams extending one prefix read
  its pages, shared; only the copies that touch host rows (fetch, the writes) look it up.
- `stats [S, 2]` int64: cumulative hits and misses per stream.
- `slot_mark [S, B]`, `epoch [S]` int32: kernel bookkeeping. A slot hit in a call is marked with
  that call's epoch, so the marks never need clearing.

One call resolves a batch of N rows (stream, selection of k units) and returns the slot of every
selected unit in selection order, this call's counts, and the miss plan: the (unit, slot) pairs of
the misses, in selection order.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton

from kernels_triton.resolve import _fetch_rows_kernel, _resolve_kernel, _write_rows_kernel, _write_unit_token_kernel

MAX_SLOTS = 1 << 20  # B's bound (a stream's LRU order lives on chip, in one program)
MAX_K = (1 << 15) - 1  # the kernel packs hit and miss ranks into one int32 scan (16 + 15 bits)
# A copy capped below this many programs (`fetch_rows`' max_programs) grows its tiles to keep as many
# rows in flight (`copy_tile`): larger tiles hid more of the shared layers' copies (results/prefetch.csv).
CAPPED_COPY_TILES = 32


@dataclass
class PageTable:
    """Map rows -> host rows in pages of `page_rows` (P, a power of two): map row v is host row
    page_of[v // P] * P + v % P. An identity table is the unpaged layout."""
    page_of: torch.Tensor     # [V / P] int32 host page of each page of map rows
    page_rows: int

    def __post_init__(self):
        _expect(isinstance(self.page_rows, int) and self.page_rows >= 1 and self.page_rows & (self.page_rows - 1) == 0,
                f"page_rows={self.page_rows!r}: expected a power of two (rows a page)")
        _expect(self.page_of.dim() == 1 and self.page_of.dtype == torch.int32 and self.page_of.is_contiguous(),
                f"page_of must be a contiguous int32 [V / P], got {self.page_of.dtype} {tuple(self.page_of.shape)}")

    @classmethod
    def identity(cls, map_rows: int, page_rows: int, device) -> "PageTable":
        _expect(map_rows % page_rows == 0, f"{map_rows} map rows are not whole pages of {page_rows} rows")
        return cls(torch.arange(map_rows // page_rows, dtype=torch.int32, device=device), page_rows)

    @property
    def shift(self) -> int:
        return self.page_rows.bit_length() - 1

    def host_rows(self, map_rows: torch.Tensor) -> torch.Tensor:
        """Host rows of map rows (int64, any shape; torch: for references, tests and notebooks)."""
        map_rows = map_rows.long()
        return self.page_of.to(map_rows.device)[map_rows // self.page_rows].long() * self.page_rows \
            + map_rows % self.page_rows

    def clone(self) -> "PageTable":
        return PageTable(self.page_of.clone(), self.page_rows)


def host_rows_of(pages: "PageTable | None", map_rows: torch.Tensor) -> torch.Tensor:
    """Host rows of map rows: through `pages`, or the map rows themselves without a table."""
    return map_rows.long() if pages is None else pages.host_rows(map_rows)


def _page_args(pages: "PageTable | None", placeholder: torch.Tensor, device) -> tuple[torch.Tensor, dict]:
    """The page table's pointer and constexprs for a launch (without a table: a pointer never read)."""
    if pages is None:
        return placeholder, dict(PAGED=False, PAGE_SHIFT=0)
    _expect(pages.page_of.device == device, f"the page table is on {pages.page_of.device}, the cache on {device}")
    return pages.page_of, dict(PAGED=True, PAGE_SHIFT=pages.shift)


@dataclass
class CacheState:
    """The device-side state one resolve reads and updates (see the module docstring)."""
    lru: torch.Tensor         # [S, B] int32
    lru_unit: torch.Tensor    # [S, B] int32
    unit_slot: torch.Tensor   # [R] int32
    host_base: torch.Tensor   # [S] int64
    stats: torch.Tensor       # [S, 2] int64
    slot_mark: torch.Tensor   # [S, B] int32
    epoch: torch.Tensor       # [S] int32
    pages: PageTable | None = None   # map rows -> host rows (None: the same)

    @classmethod
    def empty(cls, num_streams: int, cache_slots: int, host_rows: int, device,
              page_rows: int | None = None) -> "CacheState":
        """`host_rows`: the map rows (V); with `page_rows`, an identity page table over them."""
        return cls(
            lru=torch.arange(cache_slots, dtype=torch.int32, device=device).repeat(num_streams, 1),
            lru_unit=torch.full((num_streams, cache_slots), -1, dtype=torch.int32, device=device),
            unit_slot=torch.full((host_rows,), -1, dtype=torch.int32, device=device),
            host_base=torch.zeros(num_streams, dtype=torch.int64, device=device),
            stats=torch.zeros(num_streams, 2, dtype=torch.int64, device=device),
            slot_mark=torch.zeros(num_streams, cache_slots, dtype=torch.int32, device=device),
            epoch=torch.zeros(num_streams, dtype=torch.int32, device=device),
            pages=None if page_rows is None else PageTable.identity(host_rows, page_rows, device),
        )

    def clone(self) -> "CacheState":
        return CacheState(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).clone()
                             for f in fields(self)})

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state (the page table's included): what it holds on the device."""
        values = [getattr(self, f.name) for f in fields(self)]
        return [v.page_of if isinstance(v, PageTable) else v for v in values if v is not None]

    def equal(self, other: "CacheState") -> bool:
        """Bit for bit the same state (on any devices)."""
        mine, theirs = self.tensors(), other.tensors()
        return len(mine) == len(theirs) and all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(mine, theirs))

    def reset_stream(self, stream: int, host_base: int, capacity: int) -> None:
        """Empty one stream's slots and point it at a region of `capacity` map rows."""
        self.lru[stream] = torch.arange(self.lru.shape[1], dtype=torch.int32, device=self.lru.device)
        self.lru_unit[stream] = -1
        self.unit_slot[host_base:host_base + capacity] = -1
        self.host_base[stream] = host_base
        self.stats[stream] = 0
        self.slot_mark[stream] = 0
        self.epoch[stream] = 0


@dataclass
class ResolveResult:
    slots: torch.Tensor       # [N, k] int32 slot of each selected unit, -1 where the selection pads
    counts: torch.Tensor      # [N, 2] int32 hits, misses of this call
    plan_unit: torch.Tensor   # [N, k] int32 missed units, plan order (first counts[:, 1] valid)
    plan_slot: torch.Tensor   # [N, k] int32 their victim slots

    @staticmethod
    def shapes(n: int, k: int) -> tuple[tuple[int, int], ...]:
        """The fields' shapes, in field order, for n rows of k selected units."""
        return (n, k), (n, 2), (n, k), (n, k)

    @classmethod
    def empty(cls, n: int, k: int, device) -> "ResolveResult":
        """Uninitialised result buffers (int32) for n rows of k selected units."""
        return cls(*(torch.empty(shape, dtype=torch.int32, device=device) for shape in cls.shapes(n, k)))

    @property
    def hits(self) -> torch.Tensor:
        return self.counts[:, 0]

    @property
    def misses(self) -> torch.Tensor:
        return self.counts[:, 1]

    def plan(self, row: int) -> list[tuple[int, int]]:
        """The (unit, slot) pairs fetched for batch row `row` (host sync; for tests and notebooks)."""
        n = int(self.counts[row, 1])
        return list(zip(self.plan_unit[row, :n].tolist(), self.plan_slot[row, :n].tolist()))


# ----------------------------------------------------------------------------------------------
# checks


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_resolve_inputs(state: CacheState, streams: torch.Tensor, sel: torch.Tensor,
                         stream_len: torch.Tensor | None = None) -> None:
    """Everything that can be wrong with a resolve call, checked before any launch.

    Shapes, dtypes, devices and layouts always; with `stream_len` ([S], on any device) also the
    values: stream ids in range and unique, unit ids in [-1, length), no duplicates in a selection.
    The value checks read the inputs on the host, so the decode loop does them once per request
    rather than inside a captured step.
    """
    num_streams, cache_slots = state.lru.shape
    _expect(sel.dim() == 2, f"selection must be [batch, k], got shape {tuple(sel.shape)}")
    n, k = sel.shape
    _expect(k >= 1, f"a selection needs k >= 1 units, got shape {tuple(sel.shape)}")
    _expect(cache_slots >= k, f"cache_slots B={cache_slots} is smaller than the selection size k={k}: "
                              f"the cache must hold one whole selection (B >= k)")
    _expect(cache_slots <= MAX_SLOTS, f"cache_slots B={cache_slots} exceeds the supported {MAX_SLOTS}")
    _expect(k <= MAX_K, f"selection size k={k} exceeds the supported {MAX_K}")
    _expect(streams.shape == (n,), f"streams must be [batch]=[{n}], got shape {tuple(streams.shape)}")
    for name, t in (("selection", sel), ("streams", streams)):
        _expect(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
        _expect(t.device == state.lru.device, f"{name} is on {t.device}, the cache on {state.lru.device}")
        _expect(t.is_contiguous(), f"{name} must be contiguous (strides {t.stride()})")
    if stream_len is None:
        return
    _expect(tuple(stream_len.shape) == (num_streams,), f"stream_len must be [S]=[{num_streams}] (one length a "
                                                       f"stream), got shape {tuple(stream_len.shape)}")
    streams_h, sel_h, len_h = streams.cpu().long(), sel.cpu().long(), stream_len.cpu().long()
    live = streams_h >= 0
    bad = streams_h[(streams_h < -1) | (streams_h >= num_streams)]
    _expect(bad.numel() == 0, f"stream id {bad[0].item() if bad.numel() else ''} out of range: expected "
                              f"-1 (padding) or 0..{num_streams - 1}")
    uniq, cnt = torch.unique(streams_h[live], return_counts=True)
    _expect(bool((cnt == 1).all()), f"stream {int(uniq[cnt > 1][0]) if (cnt > 1).any() else ''} appears twice in "
                                    f"one resolve call: each stream may be resolved once per call")
    lengths = torch.where(live, len_h[streams_h.clamp(min=0)], 0)
    for row in range(n):
        s = sel_h[row]
        if not live[row]:
            _expect(bool((s == -1).all()), f"row {row} is padding (stream -1) but selects units "
                                           f"{s[s != -1][:4].tolist()}")
            continue
        bad = s[(s < -1) | (s >= lengths[row])]
        _expect(bad.numel() == 0, f"row {row} (stream {int(streams_h[row])}) selects unit {bad[:1].tolist()} "
                                  f"out of range: expected -1 or 0..{int(lengths[row]) - 1}")
        valid = s[s >= 0]
        uniq, cnt = torch.unique(valid, return_counts=True)
        _expect(bool((cnt == 1).all()), f"row {row} (stream {int(streams_h[row])}) selects unit "
                                        f"{uniq[cnt > 1][:1].tolist()} more than once")


def _check_rows(host: torch.Tensor, cache: torch.Tensor) -> None:
    _expect(host.dim() == 2, f"host pool must be [rows, row_elems], got {tuple(host.shape)}")
    _expect(cache.dim() == 3, f"cache must be [streams, slots, row_elems], got {tuple(cache.shape)}")
    _expect(host.shape[1] == cache.shape[2], f"host rows have {host.shape[1]} elements, cache rows "
                                             f"{cache.shape[2]}")
    _expect(host.dtype == cache.dtype, f"host pool dtype {host.dtype} differs from cache dtype {cache.dtype}")
    _expect(host.is_contiguous() and cache.is_contiguous(), "host pool and cache must be contiguous")
    if cache.is_cuda:
        _expect(host.is_pinned() or host.is_cuda, "on a GPU the host pool must be pinned host memory "
                                                  "(zero-copy reads) or device memory")


def check_new_rows(streams: torch.Tensor, units: torch.Tensor, rows: torch.Tensor, host: torch.Tensor) -> None:
    """rows [M, E] in the host pool's dtype, stored as unit units[m] (int64) of stream streams[m] (int32)."""
    _expect(rows.dim() == 2 and rows.shape[1] == host.shape[1] and rows.dtype == host.dtype,
            f"rows must be [M, {host.shape[1]}] {host.dtype}, got {tuple(rows.shape)} {rows.dtype}")
    _expect(streams.shape == units.shape == rows.shape[:1], f"streams {tuple(streams.shape)} and units "
            f"{tuple(units.shape)} must be [M] = [{rows.shape[0]}]")
    _expect(streams.dtype == torch.int32 and units.dtype == torch.int64,
            f"streams must be int32 and units int64, got {streams.dtype} and {units.dtype}")


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """View rows as the widest integer words their size allows, so the copy moves whole words."""
    row_bytes = rows.shape[-1] * rows.element_size()
    for dtype in (torch.int32, torch.int16, torch.uint8):
        if row_bytes % dtype.itemsize == 0:
            return rows.view(dtype)
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------------------------
# launchers


def resolve(state: CacheState, streams: torch.Tensor, sel: torch.Tensor, host: torch.Tensor,
            cache: torch.Tensor, *, fetch: bool = True,
            stream_len: torch.Tensor | None = None, out: ResolveResult | None = None,
            num_warps: int | None = None, packed_scan: bool | None = None,
            newest: tuple[torch.Tensor, torch.Tensor] | None = None) -> ResolveResult:
    """Resolve one selection per row: hits, exact-LRU victims, miss fetch, slots in selection order.

    streams [N] int32 (-1 = padded row), sel [N, k] int32 (-1 pads). host [R, E] is the host pool,
    cache [S, B+1, E] the device slots (slot B is the reserved newest-token slot, never a victim).
    `fetch=False` is the no-IO oracle: every step but the byte copy. Pass `stream_len` to check the
    values too (a host sync); `out` reuses result buffers, so a captured CUDA graph sees static
    addresses and allocates nothing. `newest` = (units [N] int64, rows [N, E] on the device): the
    decode step's write of each row's newest unit, done in the same launch with the same result as
    `write_rows(streams, units, rows, ..., to_reserved=True)` just before the call (host pool,
    reserved slot, and the unit's cached copy if it has one), so the selection may hold that unit.
    Its units are checked against the streams' lengths with `stream_len` only: without, a unit
    outside its stream's region writes there, as with `write_rows`.
    `num_warps` and `packed_scan` are tuning knobs (same results). `packed_scan` ranks the free slots
    with one scan over half as many elements, both halves of the LRU order packed in one int32 (fewer
    instructions, and faster: results/notes/resolve.md). Its halves count in 16 bits, so the default
    (None) uses it wherever B <= 32768 and the single scan above; True insists on it.
    """
    check_resolve_inputs(state, streams, sel, stream_len)
    _check_rows(host, cache)
    if newest is not None:
        check_new_rows(streams, *newest, host)
        _expect(all(t.device == cache.device for t in newest), f"newest rows and units must be on the cache's "
                f"device {cache.device}, got {newest[0].device} and {newest[1].device}")
        if stream_len is not None:
            live = streams.cpu() >= 0
            units, lengths = newest[0].cpu()[live], stream_len.cpu().long()[streams.cpu()[live].long()]
            bad = ((units < 0) | (units >= lengths)).nonzero().flatten()
            _expect(bad.numel() == 0, f"newest unit {units[bad[:1]].tolist()} of stream "
                    f"{streams.cpu()[live][bad[:1]].tolist()} out of range: expected 0..length-1 (record it "
                    f"with `advance` first)")
    n, k = sel.shape
    cache_slots = state.lru.shape[1]
    _expect(cache.shape[:2] == (state.lru.shape[0], cache_slots + 1),
            f"cache must be [streams, B+1, E] = [{state.lru.shape[0]}, {cache_slots + 1}, E], "
            f"got {tuple(cache.shape)}")
    if state.pages is None:
        _expect(state.unit_slot.numel() >= host.shape[0], f"the slot map has {state.unit_slot.numel()} entries "
                f"for a host pool of {host.shape[0]} rows")
    else:
        _expect(state.pages.page_of.numel() * state.pages.page_rows == state.unit_slot.numel(),
                f"the page table covers {state.pages.page_of.numel()} pages of {state.pages.page_rows} rows, the "
                f"slot map {state.unit_slot.numel()} map rows")
    shapes = ResolveResult.shapes(n, k)
    if out is None:
        out = ResolveResult.empty(n, k, sel.device)
    for name, t, shape in zip(("slots", "counts", "plan_unit", "plan_slot"),
                              (out.slots, out.counts, out.plan_unit, out.plan_slot), shapes):
        _expect(t.shape == shape and t.dtype == torch.int32 and t.device == sel.device and t.is_contiguous(),
                f"out.{name} must be a contiguous int32 {list(shape)} on {sel.device}, got "
                f"{t.dtype} {list(t.shape)} on {t.device}")
    k_pad, b_pad = triton.next_power_of_2(k), max(2, triton.next_power_of_2(cache_slots))
    if packed_scan is None:
        packed_scan = b_pad <= 1 << 15
    _expect(not packed_scan or b_pad <= 1 << 15, f"packed_scan counts half of B={cache_slots} slots in 16 bits: "
                                                 f"expected B <= {1 << 15}")
    host_w, cache_w = as_words(host), as_words(cache)
    # without newest rows their pointers are placeholders the kernel never reads
    new_units, new_rows = newest if newest is not None else (state.host_base, cache_w)
    new_rows = as_words(new_rows.contiguous())
    row_words = host_w.shape[1] if newest is not None else 1     # no kernel per row size without rows
    # the table only where a host row is written: a kernel per paging only with newest rows
    page_ptr, paged = _page_args(state.pages if newest is not None else None, state.unit_slot, cache.device)
    _resolve_kernel[(n,)](
        sel, streams, state.host_base, state.lru_unit, state.lru, state.unit_slot, state.slot_mark,
        state.epoch, out.slots, out.plan_unit, out.plan_slot, out.counts, state.stats,
        new_units.contiguous(), new_rows, host_w, cache_w, page_ptr,
        k, cache_slots, K_PAD=k_pad, B_PAD=b_pad, EVEN=k == k_pad and cache_slots == b_pad,
        PACKED_SCAN=packed_scan, WRITE_NEWEST=newest is not None, ROW_WORDS=row_words,
        BLOCK_W=min(triton.next_power_of_2(row_words), 1024),
        num_warps=num_warps or (8 if b_pad >= 2048 else 4), **paged,
    )
    if fetch:
        fetch_rows(out.plan_unit, out.plan_slot, out.counts, streams, state.host_base, host, cache,
                   pages=state.pages)
    return out


def check_fetch_inputs(plan_unit, plan_slot, counts, streams, host, cache) -> None:
    """Shapes, dtypes, devices and layouts of a `fetch_rows` call (its values are the caller's)."""
    _check_rows(host, cache)
    _expect(plan_unit.dim() == 2, f"plan_unit must be [N, k], got shape {tuple(plan_unit.shape)}")
    n, k = plan_unit.shape
    _expect(plan_slot.shape == (n, k) and counts.shape == (n, 2) and streams.shape == (n,),
            f"a plan of {n} rows needs plan_slot [{n}, {k}], counts [{n}, 2] and streams [{n}]; got "
            f"{list(plan_slot.shape)}, {list(counts.shape)} and {list(streams.shape)}")
    for name, t in (("plan_unit", plan_unit), ("plan_slot", plan_slot), ("counts", counts), ("streams", streams)):
        _expect(t.dtype == torch.int32 and t.is_contiguous() and t.device == cache.device,
                f"{name} must be a contiguous int32 tensor on {cache.device}, got {t.dtype} on {t.device} "
                f"(contiguous: {t.is_contiguous()})")


def fetch_rows(plan_unit, plan_slot, counts, streams, host_base, host, cache,
               max_programs: int | None = None, pages: PageTable | None = None) -> None:
    """Copy the planned rows host -> cache: map row (host_base[streams[i]] + unit), the host row
    `pages` maps it to (without a table: that row), to slot of streams[i].

    Also replays an anchor layer's plan into a shared layer: pass the shared layer's streams.
    max_programs caps the copy's programs (each then loops over several chunks, and below N rows
    over several rows), so a copy on a side stream leaves multiprocessors to the kernels it should
    overlap with: a copy that takes more than it needs to keep PCIe busy holds them while it waits
    on the host's reads. A capped copy of fewer than CAPPED_COPY_TILES programs takes larger tiles,
    so as many rows stay in flight.
    """
    check_fetch_inputs(plan_unit, plan_slot, counts, streams, host, cache)
    n, k = plan_unit.shape
    host_w, cache_w = as_words(host), as_words(cache)
    row_words = host_w.shape[1]
    if max_programs is not None:
        _expect(isinstance(max_programs, int) and max_programs >= 1,
                f"max_programs={max_programs!r}: expected a positive int (or None, uncapped)")
    block_w, chunk, num_warps = copy_tile(row_words, max_programs)
    rows_at_once, per_row = n, triton.cdiv(k, chunk)
    if max_programs is not None:
        rows_at_once = max(1, min(n, max_programs))
        per_row = max(1, min(per_row, max_programs // rows_at_once))
    grid = (rows_at_once, per_row)
    page_ptr, paged = _page_args(pages, host_base, cache.device)
    _fetch_rows_kernel[grid](
        plan_unit, plan_slot, counts, streams, host_base, host_w, cache_w, page_ptr, n, k, cache.shape[1],
        ROW_WORDS=row_words, CHUNK=chunk, BLOCK_W=block_w, num_warps=num_warps, **paged,
    )


def copy_tile(row_words: int, max_programs: int | None = None) -> tuple[int, int, int]:
    """The copy's shape for rows of `row_words` words: (BLOCK_W, the words of a row one slice moves;
    CHUNK, the rows a program moves per step; num_warps). The base tile holds 4096 words. A copy capped
    at p < CAPPED_COPY_TILES programs takes tiles up to CAPPED_COPY_TILES // p times larger (a power of
    two), so that it keeps as many rows in flight as CAPPED_COPY_TILES programs of the base tile would:
    PCIe stays as busy while fewer multiprocessors are held (DSA's 4 programs move 64 rows a step). At
    most 64 rows and 32768 words of whole rows a step: for sm_90 under Triton 3.6, 64 DSA rows (288
    words) take 242 registers a thread and 16 NSA rows (8192 words) spill."""
    block_w = min(triton.next_power_of_2(row_words), 1024)
    chunk = max(1, min(32, 4096 // block_w))
    if max_programs is None or max_programs >= CAPPED_COPY_TILES:
        return block_w, chunk, 4
    padded_row = triton.cdiv(row_words, block_w) * block_w          # the words a row's slices span
    grow = min(CAPPED_COPY_TILES // max_programs, 64 // chunk, 32768 // (chunk * padded_row))
    grow = 1 << (max(1, grow).bit_length() - 1)                     # a power of two, at least 1
    return block_w, chunk * grow, 8 if grow > 1 else 4


def write_rows(streams: torch.Tensor, units: torch.Tensor, rows: torch.Tensor, host_base: torch.Tensor,
               unit_slot: torch.Tensor, host: torch.Tensor, cache: torch.Tensor, to_reserved: bool,
               map_streams: torch.Tensor | None = None, pages: PageTable | None = None) -> None:
    """Store rows [M, E] (device) as unit units[m] of stream streams[m]: into the host pool, into the
    cached copy if the unit is cached, and with `to_reserved` into the stream's reserved slot (at
    most one row per stream then). streams [M] int32 (-1 skips), units [M] int64. No host sync.
    map_streams [M] int32: whose unit -> slot map says where the unit is cached (default: streams;
    a shared layer, moving in lockstep with its anchor, passes the anchor's streams). pages: where the
    map rows are in the host pool (None: map row == host row)."""
    _check_rows(host, cache)
    check_new_rows(streams, units, rows, host)
    map_streams = streams if map_streams is None else map_streams
    _expect(map_streams.shape == streams.shape and map_streams.dtype == torch.int32,
            f"map_streams must be int32 {tuple(streams.shape)}, got {map_streams.dtype} {tuple(map_streams.shape)}")
    rows_w = as_words(rows.contiguous())
    row_words = rows_w.shape[1]
    page_ptr, paged = _page_args(pages, host_base, cache.device)
    _write_rows_kernel[(rows.shape[0],)](
        rows_w, streams.contiguous(), map_streams.contiguous(), units.contiguous(), host_base, unit_slot,
        as_words(host),
        as_words(cache), page_ptr, cache.shape[1], ROW_WORDS=row_words,
        BLOCK_W=min(triton.next_power_of_2(row_words), 1024), TO_RESERVED=to_reserved, **paged,
    )


def check_unit_token(streams, pos, keys, values, host, cache, unit_tokens: int, map_streams) -> None:
    _check_rows(host, cache)
    _expect(keys.dim() == 3 and values.shape == keys.shape, f"keys and values must be [N, HKV, D] of one "
            f"shape, got {tuple(keys.shape)} and {tuple(values.shape)}")
    n, hkv, d = keys.shape
    _expect(keys.dtype == values.dtype == host.dtype and keys.stride(2) == values.stride(2) == 1,
            f"keys and values must be {host.dtype} with unit stride in D, got {keys.dtype} and {values.dtype}")
    _expect(host.shape[1] == 2 * unit_tokens * d, f"a unit of {unit_tokens} tokens of D={d} is a row of "
            f"{2 * unit_tokens * d} elements, the host pool's rows have {host.shape[1]}")
    _expect(streams.shape == (n * hkv,) and streams.dtype == torch.int32 and streams.is_contiguous(),
            f"streams must be contiguous int32 [N * HKV] = [{n * hkv}], got {streams.dtype} {tuple(streams.shape)}")
    _expect(pos.shape == (n,) and pos.dtype == torch.int64, f"pos must be int64 [N] = [{n}], got {pos.dtype} "
            f"{tuple(pos.shape)}")
    _expect(map_streams is None or (map_streams.shape == streams.shape and map_streams.dtype == torch.int32
                                    and map_streams.device == streams.device),
            f"map_streams must be int32 {tuple(streams.shape)} on {streams.device}, got "
            f"{None if map_streams is None else (map_streams.dtype, tuple(map_streams.shape), map_streams.device)}")


def write_unit_token(streams: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     host_base: torch.Tensor, unit_slot: torch.Tensor, host: torch.Tensor, cache: torch.Tensor,
                     unit_tokens: int, map_streams: torch.Tensor | None = None,
                     pages: PageTable | None = None) -> None:
    """The decode step's write for units of `unit_tokens` tokens (Quest pages, NSA blocks), one launch,
    no host sync: token pos[n]'s keys and values [N, HKV, D] join the newest unit of streams
    [N * HKV] (request-major, -1 skips), a row [2, T, D], in the host pool, the reserved slot and the
    unit's cached copy if any. These three hold the same bytes, so the token is stored alone, at its
    offset; a token that opens a unit (offset 0) writes the whole row, zeros but for the token. keys
    and values must already be in the rows' dtype (unit stride in D) and pos int64: nothing is
    converted on the way. map_streams [N * HKV] int32: whose unit -> slot map places the cached copy
    (default: streams; a shared layer in lockstep with its anchor passes the anchor's streams; -1: no
    write-through). pages: where the map rows are in the host pool (None: map row == host row). See
    `hisparse.resolve_ref.write_unit_token_ref`."""
    check_unit_token(streams, pos, keys, values, host, cache, unit_tokens, map_streams)
    map_streams = streams if map_streams is None else map_streams
    n, hkv, d = keys.shape
    page_ptr, paged = _page_args(pages, host_base, cache.device)
    _write_unit_token_kernel[(n * hkv,)](
        keys, values, streams, map_streams.contiguous(), pos.contiguous(), host_base, unit_slot, host, cache,
        page_ptr, keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), hkv, cache.shape[1],
        D=d, T=unit_tokens, BLOCK=min(triton.next_power_of_2(2 * unit_tokens * d), 1024),
        BLOCK_D=triton.next_power_of_2(d), **paged,
    )

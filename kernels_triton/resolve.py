"""Resolve: hit detection, exact-LRU victim choice and miss fetch for the hierarchical KV cache.

Two kernels, launched back to back (both capture into a CUDA graph: static shapes, device-side counts):
- `_resolve_kernel`, one program per stream: looks every selected unit up, picks victims, updates the
  LRU order and the unit <-> slot maps, writes the slot of each selected unit and the miss plan.
- `_fetch_rows_kernel`, one program per (stream, chunk of the miss plan), or fewer when capped: copies
  the missed rows from the host pool (a pinned host pointer, read zero-copy) into their victim slots.
  The same kernel replays an anchor's miss plan into a shared layer's cache (layer-wise prefetch).
And the decode step's writes, from the device: `_write_rows_kernel` stores new rows (DSA's newest
token) into the host pool, write-through to a cached copy, and optionally into the reserved slot (the
resolve does the same for one row per stream with WRITE_NEWEST, saving a launch);
`_write_unit_token_kernel` adds one token to the newest unit of several tokens (Quest's page, NSA's
block) the same three ways: the token alone, or a whole row when it opens a unit.

The semantics are DESIGN section 3; `hisparse.resolve_ref.resolve_ref` is the same algorithm in torch.
"""
import triton
import triton.language as tl


@triton.jit
def _selection_ranks(m_hit, m_miss):
    """Ranks of the hits and of the misses in selection order ([K_PAD] each, from 0), and their counts.
    One scan for both: hits count in the low 16 bits, misses in the high ones (K < 2**16)."""
    ranks = tl.cumsum(m_hit.to(tl.int32) | (m_miss.to(tl.int32) << 16), 0)
    totals = tl.max(ranks, 0)
    return (ranks & 0xFFFF) - 1, (ranks >> 16) - 1, totals & 0xFFFF, totals >> 16


@triton.jit
def _free_slot_ranks(m_free, PACKED: tl.constexpr):
    """Rank (from 0) of each free slot among the free ones, in LRU order ([B_PAD], B_PAD >= 2).
    PACKED: one scan for both halves of the padded LRU order (positions [0, B_PAD/2) count in the low
    16 bits, [B_PAD/2, B_PAD) in the high ones, so B_PAD <= 2**15): the scan's cost is per element a
    thread holds, and in this layout the halves are a register apart."""
    B_PAD: tl.constexpr = m_free.shape[0]
    if PACKED:
        lo, hi = tl.split(tl.trans(tl.reshape(m_free.to(tl.int32), [2, B_PAD // 2])))
        packed = tl.cumsum(lo | (hi << 16), 0)
        lo_total = tl.max(packed, 0) & 0xFFFF
        free_count = tl.join(packed & 0xFFFF, lo_total + (packed >> 16))            # [B_PAD // 2, 2]
        return tl.reshape(tl.trans(free_count), [B_PAD]) - 1
    else:
        return tl.cumsum(m_free.to(tl.int32), 0) - 1


@triton.jit
def _host_row(page_ptr, v, PAGED: tl.constexpr, PAGE_SHIFT: tl.constexpr):
    """The host row of map row(s) `v` (int64, every one inside the page table: callers pass masked-off
    lanes as a row of their stream): through the page table with PAGED, else `v` itself."""
    if PAGED:
        page = tl.load(page_ptr + (v >> PAGE_SHIFT)).to(tl.int64)
        return (page << PAGE_SHIFT) | (v & ((1 << PAGE_SHIFT) - 1))
    else:
        return v


@triton.jit
def _put_row(src, p_host, p_cached, p_reserved, slot, ROW_WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
             TO_RESERVED: tl.constexpr):
    """Store the row at `src` (ROW_WORDS words, on the device) into the host pool row `p_host`, the
    unit's cached copy `p_cached` where `slot` >= 0 (write-through: a cached copy never goes stale)
    and the reserved slot `p_reserved`."""
    for w in tl.static_range(0, ROW_WORDS, BLOCK_W):
        o_w = w + tl.arange(0, BLOCK_W)
        m_w = o_w < ROW_WORDS
        b_row = tl.load(src + o_w, mask=m_w)                                              # [BLOCK_W]
        tl.store(p_host + o_w, b_row, mask=m_w)
        # a vector mask: the interpreter does not combine scalar and vector masks
        tl.store(p_cached + o_w, b_row, mask=m_w & ((o_w * 0 + slot) >= 0))
        if TO_RESERVED:
            tl.store(p_reserved + o_w, b_row, mask=m_w)


# K and B unspecialised (Triton specialises integers divisible by 16): the selection and LRU rows then
# load one element per thread, the layout their scattered accesses take anyway, so no tensor changes
# layout through shared memory (fewer barriers, and faster: results/notes/resolve.md).
@triton.jit(do_not_specialize=["K", "B"])
def _resolve_kernel(
    sel_ptr,         # [N, K] int32 selected unit ids, -1 pads
    stream_ptr,      # [N] int32 stream of each row, -1 for a padded batch row
    host_base_ptr,   # [S] int64 host row of unit 0 of each stream
    lru_unit_ptr,    # [S, B] int32 unit held by the slot at each LRU position, -1 empty
    lru_ptr,         # [S, B] int32 slot ids, least recently used first
    unit_slot_ptr,   # [R] int32 slot of each host row's unit if cached, else -1
    mark_ptr,        # [S, B] int32 epoch of the last call in which each slot hit
    epoch_ptr,       # [S] int32 calls so far per stream
    slot_out_ptr,    # [N, K] int32 out: slot of each selected unit, -1 where sel is -1
    plan_unit_ptr,   # [N, K] int32 out: missed units, in miss order
    plan_slot_ptr,   # [N, K] int32 out: the victim slot of each planned unit
    counts_ptr,      # [N, 2] int32 out: hits, misses of this call
    stats_ptr,       # [S, 2] int64 cumulative hits, misses per stream
    new_unit_ptr,    # [N] int64 the unit each row's newest row becomes (WRITE_NEWEST; else unused)
    new_row_ptr,     # [N, ROW_WORDS] the newest rows, on the device (WRITE_NEWEST)
    host_ptr,        # [R, ROW_WORDS] host pool rows (WRITE_NEWEST)
    cache_ptr,       # [S, B + 1, ROW_WORDS] device cache rows, slot B the reserved one (WRITE_NEWEST)
    page_ptr,        # [V / 2**PAGE_SHIFT] int32 host page of each page of map rows (PAGED)
    K, B,
    K_PAD: tl.constexpr, B_PAD: tl.constexpr, EVEN: tl.constexpr = False,
    PACKED_SCAN: tl.constexpr = False,
    WRITE_NEWEST: tl.constexpr = False, ROW_WORDS: tl.constexpr = 1, BLOCK_W: tl.constexpr = 1,
    PAGED: tl.constexpr = False, PAGE_SHIFT: tl.constexpr = 0,
):
    # The time is the warps' instruction chains (one program per stream), and every vector element
    # costs instructions in each warp: so no per-element mask for padded rows (they branch off) nor,
    # with EVEN, for k and B in range; 32-bit offsets from per-stream pointers; one store where two
    # disjoint masks write the same array.
    i_n = tl.program_id(0).to(tl.int64)
    stream = tl.load(stream_ptr + i_n)
    o_k = tl.arange(0, K_PAD)
    o_b = tl.arange(0, B_PAD)
    m_k = o_k < K
    m_b = o_b < B
    if EVEN:          # K == K_PAD and B == B_PAD: no element is out of range
        m_k = tl.full([K_PAD], 1, dtype=tl.int1)
        m_b = tl.full([B_PAD], 1, dtype=tl.int1)
    if stream < 0:
        # a padded batch row reads and writes no stream state: slots -1, no hits, no misses
        tl.store(slot_out_ptr + i_n * K + o_k, tl.full([K_PAD], -1, dtype=tl.int32), mask=m_k)
        tl.store(counts_ptr + i_n * 2 + tl.arange(0, 2), tl.zeros([2], dtype=tl.int32))
    else:
        i_s = stream.to(tl.int64)
        p_lru = lru_ptr + i_s * B
        p_lru_unit = lru_unit_ptr + i_s * B
        p_mark = mark_ptr + i_s * B
        host_base = tl.load(host_base_ptr + i_s)
        p_map = unit_slot_ptr + host_base                         # the stream's unit -> slot map

        # -- independent loads first, so their latencies overlap
        if WRITE_NEWEST:
            # the step's newest row joins the stream as `write_rows` before this call would put it
            # (one launch fewer per layer): its cached copy, if any, is the one the map names before
            # this call. The row itself is read and stored last, so that no wait on it holds up the
            # chain below; its host row is written before any fetch reads it (the next launch).
            new_unit = tl.load(new_unit_ptr + i_n)
            new_slot = tl.load(p_map + new_unit)
        epoch = tl.load(epoch_ptr + i_s) + 1
        b_sel = tl.load(sel_ptr + i_n * K + o_k, mask=m_k, other=-1)                  # [K_PAD]
        b_order = tl.load(p_lru + o_b, mask=m_b, other=0)                              # [B_PAD] slots
        b_order_unit = tl.load(p_lru_unit + o_b, mask=m_b, other=-1)                   # [B_PAD]

        # -- hits: look each selected unit up in the stream's unit -> slot map
        m_sel = b_sel >= 0
        b_hit_slot = tl.load(p_map + b_sel, mask=m_sel, other=-1)
        m_hit = b_hit_slot >= 0
        m_miss = m_sel & (b_hit_slot < 0)
        hit_rank, miss_rank, n_hit, n_miss = _selection_ranks(m_hit, m_miss)

        # -- mark hit slots with this call's epoch (before the branch below, so that the stores need not
        # wait for the hit count's reduction across the warps)
        tl.store(p_mark + b_hit_slot, tl.zeros([K_PAD], dtype=tl.int32) + epoch, mask=m_hit)
        # -- the rank of each slot that may be a victim among those (in LRU order), -1 for the others. The
        # branches yield the ranks alone: a [B_PAD] mask through their merge would be packed into bits
        # and out again
        if n_hit > 0:
            # read the marks in LRU order
            tl.debug_barrier()
            b_order_hit = tl.load(p_mark + b_order, mask=m_b, other=0) == epoch
            m_free = m_b & ~b_order_hit
            free_rank = tl.where(m_free, _free_slot_ranks(m_free, PACKED_SCAN), -1)
        else:
            # no hit: every slot is free and ranks as its LRU position, so the marks' barrier, gather
            # and scan are skipped (a cold cache's first call, or a selection that misses everywhere)
            free_rank = tl.where(m_b, o_b, -1)
            # every warp's loads of the LRU order (above) before any warp rewrites it (below), as the
            # other branch's barrier orders them: at a small k no reduction's barrier comes between
            tl.debug_barrier()
        m_free = free_rank >= 0
        m_victim = m_free & (free_rank < n_miss)
        # -- evicted units leave the unit -> slot map (missed units enter it below; the two sets are
        # disjoint, and every read of the map is behind us). Scattered stores that depend on nothing
        # to come: issued here, they drain while the LRU order is rewritten and read back, rather
        # than queueing with the missed units' stores at the end
        tl.store(p_map + b_order_unit, tl.full([B_PAD], -1, dtype=tl.int32), mask=m_victim & (b_order_unit >= 0))

        # -- new LRU order: untouched (old order), misses (selection order), hits (selection order).
        # Miss m takes the m-th least recently used free slot, which lands at n_untouched + m of the
        # new order: the free slots move in one store (stable compaction, no sort), the victims are
        # read back by miss rank. The units follow their slots; every store is contiguous in its ranks.
        n_untouched = B - n_hit - n_miss
        new_pos = tl.where(m_victim, n_untouched + free_rank, free_rank - n_miss)       # [B_PAD]
        tl.store(p_lru + new_pos, b_order, mask=m_free)
        tl.store(p_lru_unit + new_pos, b_order_unit, mask=m_free & ~m_victim)
        tl.store(p_lru + n_untouched + n_miss + hit_rank, b_hit_slot, mask=m_hit)
        tl.store(p_lru_unit + n_untouched + tl.where(m_hit, n_miss + hit_rank, miss_rank), b_sel, mask=m_sel)
        tl.debug_barrier()
        b_victim = tl.load(p_lru + n_untouched + miss_rank, mask=m_miss, other=-1)    # [K_PAD]
        tl.store(slot_out_ptr + i_n * K + o_k, tl.where(m_hit, b_hit_slot, b_victim), mask=m_k)

        # -- missed units enter the unit -> slot map
        tl.store(p_map + b_sel, b_victim, mask=m_miss)

        # -- miss plan: (unit, slot) pairs in miss order
        tl.store(plan_unit_ptr + i_n * K + miss_rank, b_sel, mask=m_miss)
        tl.store(plan_slot_ptr + i_n * K + miss_rank, b_victim, mask=m_miss)

        # -- counters stay on the device: this call's, and the stream's running totals
        tl.store(counts_ptr + i_n * 2, n_hit)
        tl.store(counts_ptr + i_n * 2 + 1, n_miss)
        tl.store(epoch_ptr + i_s, epoch)
        # relaxed atomics whose result is unused compile to fire-and-forget reductions (RED); the
        # default acq_rel ordering would add a block barrier and a GPU-wide fence around each
        tl.atomic_add(stats_ptr + i_s * 2, n_hit.to(tl.int64), sem="relaxed")
        tl.atomic_add(stats_ptr + i_s * 2 + 1, n_miss.to(tl.int64), sem="relaxed")

        if WRITE_NEWEST:
            # a slot this call took from the newest unit gets its row too, as it would have before the
            # call: a fetch then overwrites it (noio leaves it)
            first_slot = i_s * (B + 1)                                    # int64 offsets throughout
            new_host_row = _host_row(page_ptr, host_base + new_unit, PAGED, PAGE_SHIFT)
            _put_row(new_row_ptr + i_n * ROW_WORDS, host_ptr + new_host_row * ROW_WORDS,
                     cache_ptr + (first_slot + tl.maximum(new_slot, 0)) * ROW_WORDS,
                     cache_ptr + (first_slot + B) * ROW_WORDS, new_slot, ROW_WORDS, BLOCK_W, True)


# Variants tried and not kept: results/notes/resolve.md.


@triton.jit
def _fetch_rows_kernel(
    plan_unit_ptr,   # [N, K] int32 units to fetch (first n of each row)
    plan_slot_ptr,   # [N, K] int32 their destination slots
    counts_ptr,      # [N, 2] int32: counts[:, 1] = number of planned rows
    stream_ptr,      # [N] int32 destination stream, -1 = nothing to do
    host_base_ptr,   # [S] int64 host row of unit 0 of each stream
    host_ptr,        # [R, ROW_WORDS] host pool rows (pinned host memory on a GPU machine)
    cache_ptr,       # [S, SLOTS, ROW_WORDS] device cache rows
    page_ptr,        # [V / 2**PAGE_SHIFT] int32 host page of each page of map rows (PAGED)
    N, K, SLOTS,
    ROW_WORDS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_W: tl.constexpr,
    PAGED: tl.constexpr = False, PAGE_SHIFT: tl.constexpr = 0,
):
    # grid (G, P): program (g, c) copies chunks c, c + P, c + 2P, ... of the plans of rows g, g + G,
    # g + 2G, ... (G = N but for a capped copy, whose programs then take several rows each)
    i_c = tl.program_id(1)
    n_progs = tl.num_programs(1)
    for row in range(tl.program_id(0), N, tl.num_programs(0)):
        i_n = tl.cast(row, tl.int64)
        stream = tl.load(stream_ptr + i_n)
        n_plan = tl.load(counts_ptr + i_n * 2 + 1)
        n_plan = tl.where(stream >= 0, n_plan, 0)
        i_s = tl.maximum(stream, 0).to(tl.int64)
        for start in range(i_c * CHUNK, n_plan, n_progs * CHUNK):
            o_m = start + tl.arange(0, CHUNK)
            m_m = o_m < n_plan
            b_unit = tl.load(plan_unit_ptr + i_n * K + o_m, mask=m_m, other=0).to(tl.int64)
            b_slot = tl.load(plan_slot_ptr + i_n * K + o_m, mask=m_m, other=0).to(tl.int64)
            b_map_row = tl.load(host_base_ptr + i_s) + b_unit                          # [CHUNK]
            src = _host_row(page_ptr, b_map_row, PAGED, PAGE_SHIFT) * ROW_WORDS    # [CHUNK]
            dst = (i_s * SLOTS + b_slot) * ROW_WORDS                                   # [CHUNK]
            for w in tl.static_range(0, ROW_WORDS, BLOCK_W):
                o_w = w + tl.arange(0, BLOCK_W)
                m = m_m[:, None] & (o_w < ROW_WORDS)[None, :]
                b_row = tl.load(host_ptr + src[:, None] + o_w[None, :], mask=m)       # [CHUNK, BLOCK_W]
                tl.store(cache_ptr + dst[:, None] + o_w[None, :], b_row, mask=m)


@triton.jit
def _write_rows_kernel(
    src_ptr,         # [M, ROW_WORDS] new rows (on the device)
    stream_ptr,      # [M] int32 stream of each row, -1 = skip
    map_stream_ptr,  # [M] int32 stream whose unit -> slot map places the row (a shared layer's anchor)
    unit_ptr,        # [M] int64 unit index of each row within its stream
    host_base_ptr,   # [S] int64 host row of unit 0 of each stream
    unit_slot_ptr,   # [R] int32 slot of each host row's unit if cached, else -1
    host_ptr,        # [R, ROW_WORDS] host pool rows (pinned host memory on a GPU machine)
    cache_ptr,       # [S, SLOTS, ROW_WORDS] device cache rows; slot SLOTS - 1 is the reserved one
    page_ptr,        # [V / 2**PAGE_SHIFT] int32 host page of each page of map rows (PAGED)
    SLOTS,
    ROW_WORDS: tl.constexpr, BLOCK_W: tl.constexpr, TO_RESERVED: tl.constexpr,
    PAGED: tl.constexpr = False, PAGE_SHIFT: tl.constexpr = 0,
):
    i_m = tl.program_id(0).to(tl.int64)
    stream = tl.load(stream_ptr + i_m)
    if stream >= 0:
        i_s = stream.to(tl.int64)
        unit = tl.load(unit_ptr + i_m).to(tl.int64)
        host_row = _host_row(page_ptr, tl.load(host_base_ptr + i_s) + unit, PAGED, PAGE_SHIFT)
        map_stream = tl.load(map_stream_ptr + i_m)          # -1: no write-through
        map_base = tl.load(host_base_ptr + tl.maximum(map_stream, 0).to(tl.int64))
        slot = tl.load(unit_slot_ptr + map_base + unit, mask=map_stream >= 0, other=-1)
        p_cached = cache_ptr + (i_s * SLOTS + tl.maximum(slot, 0)) * ROW_WORDS
        p_reserved = cache_ptr + (i_s * SLOTS + SLOTS - 1) * ROW_WORDS
        _put_row(src_ptr + i_m * ROW_WORDS, host_ptr + host_row * ROW_WORDS, p_cached, p_reserved, slot,
                 ROW_WORDS, BLOCK_W, TO_RESERVED)


@triton.jit
def _write_unit_token_kernel(
    key_ptr,         # [N, HKV, D] the step's key per (request, KV head), in the rows' dtype
    value_ptr,       # [N, HKV, D] its value
    stream_ptr,      # [N * HKV] int32 stream of each (request, KV head), -1 = skip
    map_stream_ptr,  # [N * HKV] int32 the stream whose unit -> slot map places it (a shared layer's
                     # anchor); -1: no write-through
    pos_ptr,         # [N] int64 the token's position in its request
    host_base_ptr,   # [S] int64 host row of unit 0 of each stream
    unit_slot_ptr,   # [R] int32 slot of each host row's unit if cached, else -1
    host_ptr,        # [R, 2 * T * D] host pool rows (pinned host memory on a GPU machine)
    cache_ptr,       # [S, SLOTS, 2 * T * D] device cache rows; slot SLOTS - 1 is the reserved one
    page_ptr,        # [V / 2**PAGE_SHIFT] int32 host page of each page of map rows (PAGED)
    stride_kn, stride_kh, stride_vn, stride_vh, HKV, SLOTS,
    D: tl.constexpr, T: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr = False, PAGE_SHIFT: tl.constexpr = 0,
):
    """Add one token to the newest unit of T tokens of each stream, in its three places.

    A unit is one row [2, T, D]: its T keys, then its T values. The newest unit lives in the host
    pool, in the reserved slot, and in a cached slot if it has one (write-through, so no stale copy
    is ever read); the map stream's unit -> slot map says where that copy is (the stream's own, or
    for a shared layer in lockstep with its anchor, the anchor's). The three hold the same bytes
    (prefill's `append` writes host row and reserved slot alike, a fetch copies the host row), so a
    token continuing a unit is stored alone, key and value at its offset: 2 * D elements over PCIe,
    not the 2 * T * D of the whole row (an NSA block of 64 tokens: 32x less). A token at offset 0
    opens a unit: its whole row is written, zeros but for the token, as the places may hold an older
    unit's bytes. Program m handles stream m of request m // HKV.
    """
    ROW: tl.constexpr = 2 * T * D
    i_m = tl.program_id(0).to(tl.int64)
    stream = tl.load(stream_ptr + i_m)
    if stream >= 0:
        i_s = stream.to(tl.int64)
        i_n, i_h = i_m // HKV, i_m % HKV
        pos = tl.load(pos_ptr + i_n)
        offset = pos % T
        host_row = _host_row(page_ptr, tl.load(host_base_ptr + i_s) + pos // T, PAGED, PAGE_SHIFT)
        map_stream = tl.load(map_stream_ptr + i_m)
        map_base = tl.load(host_base_ptr + tl.maximum(map_stream, 0).to(tl.int64))
        slot = tl.load(unit_slot_ptr + map_base + pos // T, mask=map_stream >= 0, other=-1)
        p_host = host_ptr + host_row * ROW
        p_reserved = cache_ptr + (i_s * SLOTS + SLOTS - 1) * ROW
        p_cached = cache_ptr + (i_s * SLOTS + tl.maximum(slot, 0)) * ROW
        p_key = key_ptr + i_n * stride_kn + i_h * stride_kh
        p_value = value_ptr + i_n * stride_vn + i_h * stride_vh
        if offset == 0:
            for w in range(0, ROW, BLOCK):
                o = w + tl.arange(0, BLOCK)
                m_o = o < ROW
                # vector masks throughout: the interpreter does not combine scalar and vector masks
                is_value = o >= T * D
                m_tok = m_o & ((o // D) % T == 0)
                b_key = tl.load(p_key + o % D, mask=m_tok & ~is_value, other=0.0)
                b_value = tl.load(p_value + o % D, mask=m_tok & is_value, other=0.0)
                b_row = tl.where(is_value, b_value, b_key)                   # [BLOCK], zeros off the token
                tl.store(p_host + o, b_row, mask=m_o)
                tl.store(p_reserved + o, b_row, mask=m_o)
                tl.store(p_cached + o, b_row, mask=m_o & ((o * 0 + slot) >= 0))
        else:
            o = tl.arange(0, BLOCK_D)
            m_d = o < D
            b_key = tl.load(p_key + o, mask=m_d)                              # [BLOCK_D]
            b_value = tl.load(p_value + o, mask=m_d)
            o_key = offset * D + o
            o_value = T * D + o_key
            m_cached = m_d & ((o * 0 + slot) >= 0)
            tl.store(p_host + o_key, b_key, mask=m_d)
            tl.store(p_host + o_value, b_value, mask=m_d)
            tl.store(p_reserved + o_key, b_key, mask=m_d)
            tl.store(p_reserved + o_value, b_value, mask=m_d)
            tl.store(p_cached + o_key, b_key, mask=m_cached)
            tl.store(p_cached + o_value, b_value, mask=m_cached)

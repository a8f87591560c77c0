"""Resolve kernel vs torch reference: slots, LRU state, counters, miss plans and fetched bytes."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hisparse.cache import HierarchicalKVCache
from hisparse.host_pool import HostPool
from hisparse.resolve import CacheState, ResolveResult, fetch_rows, resolve

POISON = -7


def make_pair(num_streams, cache_slots, row_elems, dtype, device, lengths, seed, page_rows=None):
    """Two caches with identical streams and host rows: one for the kernel, one for the reference.
    With page_rows, host rows by pages: every other page held elsewhere, so each stream's pages are
    scattered (its host rows are not its map rows)."""
    gen = torch.Generator().manual_seed(seed)
    p = page_rows or 1
    host_rows = 2 * sum(-(-(n + 8) // p) * p for n in lengths) + 64 * p
    caches = [HierarchicalKVCache(num_streams, cache_slots, host_rows=host_rows, row_elems=row_elems, dtype=dtype,
                                  device=device, page_rows=page_rows) for _ in range(2)]
    data = [torch.randn(n, row_elems, generator=gen).to(dtype) for n in lengths]
    for cache in caches:
        cache.slots.fill_(float("nan") if dtype.is_floating_point else POISON)
        if page_rows:
            held = cache.host.alloc_pages(host_rows // p)
            cache.host.release_pages(held[1::2])
        for rows in data:
            cache.append(cache.open_stream(capacity=len(rows) + 8), rows.to(device))
    return caches


def next_selection(prev, lengths, k, gen, reuse=0.6, pad=0.15):
    """A selection per stream: part reused from the previous step (hits), part fresh, some -1."""
    rows = []
    for i, n in enumerate(lengths):
        old = prev[i][prev[i] >= 0] if prev is not None else torch.empty(0, dtype=torch.int32)
        keep = old[torch.rand(len(old), generator=gen) < reuse]
        fresh = torch.randperm(n, generator=gen).to(torch.int32)
        fresh = fresh[~torch.isin(fresh, keep)]
        n_valid = min(n, k) - int(torch.rand(1, generator=gen) < pad) * int(torch.randint(0, k, (1,), generator=gen))
        units = torch.cat([keep, fresh])[:max(n_valid, 0)]
        units = units[torch.randperm(len(units), generator=gen)]
        row = torch.full((k,), -1, dtype=torch.int32)
        pos = torch.randperm(k, generator=gen)[:len(units)].sort().values
        row[pos] = units
        rows.append(row)
    return torch.stack(rows)


def assert_same_state(a: HierarchicalKVCache, b: HierarchicalKVCache):
    for name in ("lru", "lru_unit", "unit_slot", "stats"):
        assert torch.equal(getattr(a.state, name).cpu(), getattr(b.state, name).cpu()), name


def assert_maps_agree(cache: HierarchicalKVCache):
    """The two maps describe one placement, whatever the kernel and the reference agree on: the LRU
    order is a permutation of the slots, each cached unit appears once, and unit_slot sends every
    unit in lru_unit to the slot at the same LRU position (and no other unit to any slot)."""
    state = cache.state
    lru, lru_unit, unit_slot = state.lru.cpu(), state.lru_unit.cpu(), state.unit_slot.cpu()
    cached_rows = []
    for stream in range(lru.shape[0]):
        assert sorted(lru[stream].tolist()) == list(range(lru.shape[1])), f"stream {stream}"
        held = lru_unit[stream] >= 0
        rows = int(state.host_base[stream]) + lru_unit[stream][held].long()
        assert torch.equal(unit_slot[rows], lru[stream][held]), f"stream {stream}"
        cached_rows += rows.tolist()
    assert len(set(cached_rows)) == len(cached_rows) == int((unit_slot >= 0).sum())


def assert_slots_hold_units(cache: HierarchicalKVCache, streams, sel, slots):
    """Every returned slot holds, bit for bit, the host row of its unit."""
    for row in range(sel.shape[0]):
        s = int(streams[row])
        valid = sel[row] >= 0
        if s < 0:
            assert not valid.any() and (slots[row] == -1).all()
            continue
        assert torch.equal(slots[row][~valid].cpu(), torch.full_like(slots[row][~valid].cpu(), -1))
        want = cache.host.rows[cache.host_rows(torch.tensor(s), sel[row][valid])]
        got = cache.slots[s, slots[row][valid].long()].cpu()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


CASES = [
    pytest.param(3, 8, 8, 5, torch.float16, 40, None, id="S3-k8-B8-E5fp16"),       # B == k, 10-byte rows
    pytest.param(4, 8, 13, 27, torch.float32, 60, None, id="S4-k8-B13-E27fp32"),   # odd B and row size
    pytest.param(5, 16, 32, 12, torch.float16, 40, None, id="S5-k16-B32-E12fp16"),
    pytest.param(2, 5, 11, 3, torch.float32, 60, None, id="S2-k5-B11-E3fp32"),     # k, B not powers of 2
    pytest.param(4, 8, 13, 27, torch.float32, 30, 4, id="S4-k8-B13-E27fp32-P4"),   # host rows by scattered pages
    pytest.param(3, 8, 8, 5, torch.float16, 20, 1, id="S3-k8-B8-E5fp16-P1"),
]


@pytest.mark.parametrize("num_streams,k,cache_slots,row_elems,dtype,steps,page_rows", CASES)
def test_kernel_matches_reference(num_streams, k, cache_slots, row_elems, dtype, steps, page_rows, device):
    gen = torch.Generator().manual_seed(1000 + k * cache_slots)
    lengths = [int(x) for x in torch.randint(k, 4 * cache_slots, (num_streams,), generator=gen)]
    kern, ref = make_pair(num_streams, cache_slots, row_elems, dtype, device, lengths, seed=k, page_rows=page_rows)
    if page_rows:                      # the table is not the identity: the copies must read through it
        assert not torch.equal(kern.host_rows(torch.tensor(0), torch.arange(lengths[0])), kern.stream_base[0] +
                               torch.arange(lengths[0]))
    sel = None
    for step in range(steps):
        sel = next_selection(sel, lengths, k, gen)
        # a padded batch row (stream -1) and a shuffled stream order in every call
        order = torch.randperm(num_streams, generator=gen)
        streams = torch.cat([order, torch.tensor([-1])]).to(torch.int32)
        batch_sel = torch.cat([sel[order], torch.full((1, k), -1, dtype=torch.int32)])
        out = ResolveResult(*(torch.full(shape, POISON, dtype=torch.int32, device=device)
                              for shape in ((num_streams + 1, k), (num_streams + 1, 2),
                                            (num_streams + 1, k), (num_streams + 1, k))))
        # the free slots ranked by the default (the packed scan at these B), the packed scan insisted
        # on, and the single scan, in turn
        got = kern.resolve(streams.to(device), batch_sel.to(device), out=out,
                           packed_scan=(None, True, False)[step % 3])
        want = ref.resolve_ref(streams.to(device), batch_sel.to(device))
        assert torch.equal(got.slots.cpu(), want.slots), f"step {step}"
        assert torch.equal(got.counts.cpu(), want.counts), f"step {step}"
        for row in range(num_streams + 1):
            assert got.plan(row) == want.plan(row), f"step {step} row {row}"
        assert_same_state(kern, ref)
        assert_maps_agree(kern)
        assert_slots_hold_units(kern, streams, batch_sel, got.slots)
    hits, misses = kern.stats.sum(0).tolist()
    assert hits > 0 and misses > 0, "the selections must exercise both hits and misses"


def test_noio_updates_state_but_copies_nothing(device):
    gen = torch.Generator().manual_seed(7)
    lengths = [50, 33]
    normal, noio = make_pair(2, 12, 6, torch.float32, device, lengths, seed=3)
    sel = None
    for _ in range(10):
        sel = next_selection(sel, lengths, 8, gen)
        streams = torch.tensor([0, 1], dtype=torch.int32, device=device)
        a = normal.resolve(streams, sel.to(device))
        b = noio.resolve(streams, sel.to(device), mode="noio")
        assert torch.equal(a.slots, b.slots) and torch.equal(a.counts, b.counts)
    assert_same_state(normal, noio)
    assert noio.slots[:, :-1].isnan().all(), "no-IO mode must not write any slot"


def test_plan_order(device):
    cache, _ = make_pair(1, 8, 4, torch.float32, device, [30], seed=5)
    sel = torch.tensor([[17, 3, 25, -1, 9]], dtype=torch.int32, device=device)
    res = cache.resolve(torch.tensor([0], dtype=torch.int32, device=device), sel)
    # misses take the empty slots lowest index first, and the plan lists them in selection order
    assert res.plan(0) == [(17, 0), (3, 1), (25, 2), (9, 3)]
    assert_slots_hold_units(cache, [0], sel, res.slots)


def test_lru_order_after_a_step(device):
    """DESIGN section 3's new LRU order, worked by hand: untouched, then misses, then hits."""
    cache, _ = make_pair(1, 4, 2, torch.float32, device, [20], seed=1)
    s0 = torch.tensor([0], dtype=torch.int32, device=device)
    cache.resolve(s0, torch.tensor([[5, 6, 7]], dtype=torch.int32, device=device))   # slots 0,1,2
    assert cache.state.lru[0].tolist() == [3, 0, 1, 2]
    res = cache.resolve(s0, torch.tensor([[9, 6, 8]], dtype=torch.int32, device=device))
    # hit: 6 in slot 1; misses 9, 8 take the LRU free slots 3 (empty) then 0 (unit 5)
    assert res.slots.tolist() == [[3, 1, 0]]
    assert cache.state.lru[0].tolist() == [2, 3, 0, 1]
    assert cache.state.lru_unit[0].tolist() == [7, 9, 8, 6]           # the units of slots 2, 3, 0, 1
    assert res.counts.tolist() == [[1, 2]]


@pytest.mark.parametrize("packed_scan", [True, False], ids=["packed-scan", "single-scan"])
def test_call_without_hits_on_a_warm_cache(packed_scan, device):
    """A call in which no selected unit hits skips the marks and the free-slot scan (every slot is a
    candidate victim, ranked by its LRU position): the result must still be exact LRU, and a stream
    of the same call that does hit must take the full path beside it."""
    kern, ref = make_pair(2, 6, 4, torch.float32, device, [30, 30], seed=11)
    streams = torch.tensor([0, 1], dtype=torch.int32, device=device)
    warm = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]], dtype=torch.int32, device=device)
    for cache in (kern, ref):
        cache.resolve(streams, warm)             # slots 0-3 hold units 1-4; LRU [4, 5, 0, 1, 2, 3]
    # stream 0 misses everywhere (and pads); stream 1 hits unit 3
    sel = torch.tensor([[20, -1, 21, 22], [3, 23, -1, 24]], dtype=torch.int32, device=device)
    got = kern.resolve(streams, sel, packed_scan=packed_scan)
    want = ref.resolve_ref(streams, sel)
    assert got.counts.tolist() == [[0, 3], [1, 2]]
    # stream 0: the three least recently used slots (4 and 5 empty, then 0, unit 1's) in selection order
    assert got.slots.tolist()[0] == [4, -1, 5, 0]
    assert kern.state.lru[0].tolist() == [1, 2, 3, 4, 5, 0]
    assert kern.state.lru_unit[0].tolist() == [2, 3, 4, 20, 21, 22]
    assert torch.equal(got.slots.cpu(), want.slots)
    assert got.plan(0) == want.plan(0) and got.plan(1) == want.plan(1)
    assert_same_state(kern, ref)
    assert_maps_agree(kern)
    assert_slots_hold_units(kern, streams, sel, got.slots)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's check; on a GPU "
                    "test_fetch_past_2_31_words_on_gpu below makes it")
def test_32bit_address_overflow_is_avoided():
    """Host rows past 2**31 words: offsets must be computed in 64 bits. The pool is a sparse,
    memory-mapped file, so 8 GiB of address space costs no memory. In a subprocess, since an
    overflowing kernel would crash the interpreter rather than fail an assert."""
    script = textwrap.dedent("""
        import os, tempfile, torch
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from hisparse.cache import HierarchicalKVCache
        E, R = 1024, (1 << 21) + 64          # 4 KiB rows: row 2**21 starts at word 2**31
        cache = HierarchicalKVCache(2, 8, host_rows=R, row_elems=E, dtype=torch.float32, device="cpu")
        with tempfile.NamedTemporaryFile() as f:
            f.truncate(R * E * 4)
            cache.host.rows = torch.from_file(f.name, shared=True, size=R * E, dtype=torch.float32).view(R, E)
            cache.open_stream(1 << 21)
            far = cache.open_stream(64)
            rows = torch.randn(40, E)
            cache.append(far, rows)
            sel = torch.tensor([[3, 39, 0, 17]], dtype=torch.int32)
            res = cache.resolve(torch.tensor([far], dtype=torch.int32), sel)
            assert torch.equal(cache.slots[far, res.slots[0].long()], rows[sel[0].long()])
            # the newest row written by the resolve lands there too: unit 39 (cached) rewritten
            new = torch.randn(1, E)
            cache.resolve(torch.tensor([far], dtype=torch.int32), sel, mode="noio", newest=(torch.tensor([39]), new))
            assert torch.equal(cache.host.rows[int(cache.state.host_base[far]) + 39], new[0])
            assert torch.equal(cache.slots[far, int(res.slots[0, 1])], new[0])
        print("fetched-past-2**31-ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "fetched-past-2**31-ok" in done.stdout, done.stderr[-2000:]


# -- input checks: each bad call raises before any launch and changes nothing -----------------

def _small_cache(device, cache_slots=8):
    cache = HierarchicalKVCache(3, cache_slots, host_rows=200, row_elems=4, dtype=torch.float32, device=device)
    for n in (20, 30):
        cache.append(cache.open_stream(capacity=40), torch.randn(n, 4).to(device))
    return cache


def _i32(x, device):
    return torch.tensor(x, dtype=torch.int32, device=device)


@pytest.mark.parametrize("streams,sel,match", [
    pytest.param([0], [[1, 2, 3, 4, 5, 6, 7, 8, 9]], r"cache_slots B=8 is smaller than .* k=9", id="B-lt-k"),
    pytest.param([0], [[1, 20, 3]], r"selects unit \[20\] out of range: expected -1 or 0..19", id="unit-too-large"),
    pytest.param([0], [[1, -2, 3]], r"selects unit \[-2\] out of range", id="unit-below-minus-one"),
    pytest.param([1], [[4, 7, 4]], r"selects unit \[4\] more than once", id="duplicate-unit"),
    pytest.param([0, 0], [[1], [2]], r"stream 0 appears twice", id="duplicate-stream"),
    pytest.param([5], [[1]], r"stream id 5 out of range", id="stream-out-of-range"),
    pytest.param([-1], [[3]], r"row 0 is padding \(stream -1\) but selects units \[3\]", id="padding-selects"),
    pytest.param([2], [[1]], r"stream 2 is not open", id="closed-stream"),
])
def test_bad_values_rejected_before_launch(streams, sel, match, device):
    cache = _small_cache(device)
    before = cache.state.clone()
    with pytest.raises(ValueError, match=match):
        cache.resolve(_i32(streams, device), _i32(sel, device))
    for name in ("lru", "lru_unit", "unit_slot", "stats"):
        assert torch.equal(getattr(before, name), getattr(cache.state, name))


def test_bad_layouts_rejected(device):
    cache = _small_cache(device)
    streams = _i32([0, 1], device)
    sel = _i32([[1, 2], [3, 4]], device)
    with pytest.raises(ValueError, match="selection must be int32, got torch.int64"):
        cache.resolve(streams, sel.long())
    with pytest.raises(ValueError, match=r"streams must be \[batch\]=\[2\]"):
        cache.resolve(streams[:1], sel)
    with pytest.raises(ValueError, match="selection must be contiguous"):
        cache.resolve(streams, sel.t())
    with pytest.raises(ValueError, match=r"selection must be \[batch, k\]"):
        cache.resolve(streams, sel[0])
    with pytest.raises(ValueError, match="mode must be one of"):
        cache.resolve(streams, sel, mode="fast")
    with pytest.raises(ValueError, match="host pool dtype torch.float32 differs"):
        resolve(cache.state, streams, sel, cache.host.rows, cache.slots.half())


# -- host pool and streams ---------------------------------------------------------------------

def test_append_past_capacity_keeps_stored_rows(device):
    cache = HierarchicalKVCache(2, 4, host_rows=64, row_elems=3, dtype=torch.float32, device=device)
    s = cache.open_stream(capacity=10)
    rows = torch.randn(8, 3)
    cache.append(s, rows.to(device))
    before = cache.host.rows.clone()
    with pytest.raises(ValueError, match="stream 0 holds 8 of 10 units; appending 3 would exceed"):
        cache.append(s, torch.randn(3, 3).to(device))
    assert torch.equal(before.view(torch.int32), cache.host.rows.view(torch.int32))   # bitwise: rows may hold NaN
    assert cache.stream_len[s] == 8
    assert torch.equal(cache.slots[s, cache.reserved_slot].cpu(), rows[-1])


def test_stream_bookkeeping_reads_nothing_from_the_device(device):
    """append and close_stream find a stream's host region from the host's own record (a prefill
    piece stages its chunk with append on a side stream: a device read there would wait for the
    piece): no `aten._local_scalar_dense` among their ops; the rows land where state.host_base
    says (write_unit's too), and a closed stream's region is reused."""
    from engine_checks import host_reads
    cache = HierarchicalKVCache(3, 4, host_rows=64, row_elems=3, dtype=torch.float32, device=device)
    first, second = cache.open_stream(capacity=10), cache.open_stream(capacity=12)
    rows = torch.randn(5, 3).to(device)
    with host_reads() as reads:
        cache.append(second, rows)
        cache.close_stream(first)
    assert not reads, reads
    cache.write_unit(second, 2, rows[0])           # (it reads the unit's slot on the device)
    base = int(cache.state.host_base[second])
    assert base == cache.stream_base[second]
    assert torch.equal(cache.host.rows[base:base + 5].cpu(), torch.cat([rows[:2], rows[:1], rows[3:]]).cpu())
    assert cache.open_stream(capacity=10) == first and cache.stream_base[first] == int(cache.state.host_base[first])


def test_appends_refuse_another_dtype_and_non_integer_ids(device):
    """Rows of another dtype are refused, not cast (a cast stores other bits than the caller's), and
    stream, unit and row ids must be ints: nothing is written either way."""
    cache = _small_cache(device)          # float32 rows; streams 0 and 1: 20 and 30 units
    host, lengths = cache.host.rows.clone(), list(cache.stream_len)
    for dtype in (torch.bfloat16, torch.float64, torch.int64):
        with pytest.raises(ValueError, match=f"rows to write must be torch.float32, the pool's dtype, got {dtype}"):
            cache.append(0, torch.ones(2, 4, dtype=dtype, device=device))
        with pytest.raises(ValueError, match="the pool's dtype"):
            cache.write_unit(1, 3, torch.ones(4, dtype=dtype, device=device))
    for stream in (True, 1.0, "0"):
        with pytest.raises(ValueError, match="a stream id must be an int"):
            cache.append(stream, torch.ones(1, 4, device=device))
    with pytest.raises(ValueError, match="unit must be an int"):
        cache.write_unit(0, 1.5, torch.ones(4, device=device))
    for row in (1.5, True):
        with pytest.raises(ValueError, match="first_row must be an int"):
            cache.host.write(row, torch.ones(1, 4))
    assert torch.equal(host.view(torch.int32), cache.host.rows.view(torch.int32)) and cache.stream_len == lengths
    cache.append(torch.tensor(0), torch.ones(1, 4, device=device))      # a 0-d integer tensor is an int
    assert cache.stream_len[0] == 21


def test_bad_calls_on_streams_change_nothing(device):
    """advance, open_stream, append, the device writes, replay_plan and resolve_ref refuse bad input
    with a message naming it, and leave the stored state as it was."""
    cache = _small_cache(device)          # streams 0 and 1: 20 and 30 of 40 units
    cache.advance([0], 19)
    lengths, free = list(cache.stream_len), cache.host.free_rows
    with pytest.raises(ValueError, match="stream 0 holds 39 of 40 units; 2 more would exceed"):
        cache.advance([1, 0, 0], 1)       # listed twice: two units (each alone would fit)
    for n in (-1, 0.5, True):
        with pytest.raises(ValueError, match=r"n must be an int >= 0 \(units per stream\), got"):
            cache.advance([1], n)
    for capacity in (2.5, 0, "3"):
        with pytest.raises(ValueError, match="a stream's capacity must be a positive int"):
            cache.open_stream(capacity)
    with pytest.raises(ValueError, match=r"rows must be \[n >= 1, E\], got shape \(0, 4\)"):
        cache.append(0, torch.empty(0, 4, device=device))
    assert (cache.stream_len, cache.host.free_rows) == (lengths, free)
    host = cache.host.rows.clone()
    with pytest.raises(ValueError, match="units must be an integer tensor, got torch.float32"):
        cache.write_newest(_i32([1], device), torch.tensor([1.7], device=device), torch.ones(1, 4, device=device))
    plan = cache.resolve(_i32([0, 1], device), _i32([[1, 2], [3, 4]], device))
    with pytest.raises(ValueError, match="streams must be a contiguous int32 tensor"):
        cache.replay_plan(plan, _i32([1, 1, 0], device)[::2])
    with pytest.raises(ValueError, match="counts must be a contiguous int32 tensor"):
        cache.replay_plan(ResolveResult(plan.slots, plan.counts.float(), plan.plan_unit, plan.plan_slot),
                          _i32([0, 1], device))
    assert torch.equal(host.view(torch.int32), cache.host.rows.view(torch.int32))
    state = cache.state.clone()
    with pytest.raises(ValueError, match=r"mode must be one of \('normal', 'noio'\), got 'Normal'"):
        cache.resolve_ref(_i32([0], device), _i32([[5]], device), mode="Normal")
    with pytest.raises(ValueError, match=r"streams must be \[batch\]=\[1\], got shape \(1, 1\)"):
        cache.resolve(_i32([[0]], device), _i32([[5]], device))
    with pytest.raises(ValueError, match=r"a selection needs k >= 1 units"):
        cache.resolve(_i32([0], device), torch.empty(1, 0, dtype=torch.int32, device=device))
    for name in ("lru", "lru_unit", "unit_slot", "stats"):
        assert torch.equal(getattr(state, name), getattr(cache.state, name))
    with pytest.raises(ValueError, match="cache_slots B=2097152 exceeds the supported 1048576"):
        HierarchicalKVCache(1, 1 << 21, host_rows=4, row_elems=2, device=device)
    big = CacheState.empty(1, 40000, 8, device)
    with pytest.raises(ValueError, match=r"packed_scan counts half of B=40000 slots in 16 bits: expected B <= 32768"):
        resolve(big, _i32([0], device), _i32([[1]], device), torch.zeros(8, 2, device=device),
                torch.zeros(1, 40001, 2, device=device), fetch=False, packed_scan=True)
    assert (big.lru_unit == -1).all() and (big.epoch == 0).all(), "a refused call launches nothing"
    got = resolve(big, _i32([0], device), _i32([[1]], device), torch.zeros(8, 2, device=device),
                  torch.zeros(1, 40001, 2, device=device), fetch=False)     # the default: the single scan there
    assert got.counts.tolist() == [[0, 1]] and big.epoch.tolist() == [1]
    assert big.lru_unit[0, -1].item() == 1 and big.unit_slot[1].item() == got.slots.item()


def test_device_writes_check_their_values_and_change_nothing_when_refused(device):
    """write_newest, write_newest_token, replay_plan and resolve_ref(newest=) check streams
    and units on the host (outside a graph capture) before launching: a unit the stream has not recorded, a closed or
    out-of-range stream, a stream listed twice, a negative position. Nothing stored changes; with
    check_values=False the same call goes through (the caller's promise, as inside a captured step)."""
    cache = _small_cache(device)          # streams 0 and 1: 20 and 30 of 40 units, stream 2 closed
    row = torch.ones(1, 4, device=device)
    plan = cache.resolve(_i32([0, 1], device), _i32([[1, 2], [25, 4]], device))    # unit 25: past stream 0
    host, slots, state = cache.host.rows.clone(), cache.slots.clone(), cache.state.clone()
    refused = [
        (lambda: cache.replay_plan(plan, _i32([1, 0], device)), "replay_plan: row 1 plans unit 25, past stream 0's 20"),
        (lambda: cache.write_newest(_i32([0], device), _i32([20], device), row),
         r"write_newest: unit 20 of stream 0 is outside its recorded units 0..19 \(record it with `advance`"),
        (lambda: cache.write_newest(_i32([1], device), _i32([-1], device), row), "unit -1 of stream 1"),
        (lambda: cache.write_newest(_i32([2], device), _i32([0], device), row), "write_newest: stream 2 is not open"),
        (lambda: cache.write_newest(_i32([7], device), _i32([0], device), row), "stream 7 is not open"),
        (lambda: cache.write_newest(_i32([0, 0], device), _i32([3, 4], device), row.expand(2, 4).contiguous()),
         "write_newest: stream 0 is listed twice"),
        (lambda: cache.write_newest(_i32([0], device), _i32([3], device), row, map_streams=_i32([2], device)),
         "map stream 2 is not open"),
        (lambda: cache.write_newest(_i32([1], device), _i32([25], device), row, map_streams=_i32([0], device)),
         r"unit 25 of stream 1 is past its map stream 0's recorded units 0..19"),     # would hit another map
        (lambda: cache.write_newest_token(_i32([0], device), torch.tensor([-2], device=device),
                                          torch.ones(1, 1, 1, device=device), torch.ones(1, 1, 1, device=device), 2),
         "token positions must be >= 0"),
        (lambda: cache.write_newest_token(_i32([1], device), torch.tensor([90], device=device),
                                          torch.ones(1, 1, 1, device=device), torch.ones(1, 1, 1, device=device), 2),
         "write_newest_token: unit 45 of stream 1"),
        (lambda: cache.write_newest_token(_i32([1], device), torch.tensor([9], device=device),
                                          torch.ones(1, 1, 1, device=device), torch.ones(1, 1, 1, device=device), 2.0),
         "unit_tokens must be a positive int"),
        (lambda: cache.replay_plan(plan, _i32([0, 2], device)), "replay_plan: stream 2 is not open"),
        (lambda: cache.replay_plan(plan, _i32([0], device)), r"a plan of 2 rows needs .* streams \[2\]"),
        (lambda: cache.replay_plan(plan, _i32([1, 1], device)), "replay_plan: stream 1 is listed twice"),
        (lambda: cache.replay_plan(ResolveResult(plan.slots, plan.counts, plan.plan_unit, plan.plan_slot + 8),
                                   _i32([0, 1], device)), r"row 0 plans slot 8, expected 0..7 \(was the plan made"),
        (lambda: cache.replay_plan(ResolveResult(plan.slots, plan.counts, plan.plan_unit - 3, plan.plan_slot),
                                   _i32([0, 1], device)), "row 0 plans unit -2, expected units >= 0"),
        (lambda: cache.resolve_ref(_i32([0, -1], device), _i32([[1, 2], [-1, -1]], device),
                                   newest=(torch.tensor([45, 0], device=device), row.expand(2, 4).contiguous())),
         "resolve_ref newest: unit 45 of stream 0"),
    ]
    for call, message in refused:
        with pytest.raises(ValueError, match=message):
            call()
    assert torch.equal(host.view(torch.int32), cache.host.rows.view(torch.int32))
    assert torch.equal(slots.view(torch.int32), cache.slots.view(torch.int32))
    assert state.equal(cache.state)
    with pytest.raises(ValueError, match=r"stream_len must be \[S\]=\[3\] \(one length a stream\), got shape \(1,\)"):
        resolve(cache.state, _i32([0], device), _i32([[1, 2]], device), cache.host.rows, cache.slots,
                stream_len=torch.tensor([20]))
    cache.write_newest(_i32([0], device), _i32([19], device), 2 * row)         # a recorded unit: written
    assert torch.equal(cache.host.rows[19].to(device), 2 * row[0])
    cache.write_newest(_i32([0], device), _i32([20], device), 3 * row, check_values=False)   # unchecked
    assert torch.equal(cache.host.rows[20].to(device), 3 * row[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without a GPU")
def test_a_cache_on_cuda_without_a_gpu_says_to_pass_device_cpu():
    with pytest.raises(ValueError, match="a cache on cuda needs a CUDA GPU, and none is here: pass device='cpu'"):
        HierarchicalKVCache(2, 4, host_rows=16, row_elems=8)


def test_host_regions_are_contiguous_and_reused():
    cache = HierarchicalKVCache(4, 4, host_rows=100, row_elems=2, dtype=torch.float32, device="cpu")
    a, b, c = (cache.open_stream(capacity=30) for _ in range(3))
    assert [int(cache.state.host_base[s]) for s in (a, b, c)] == [0, 30, 60]
    with pytest.raises(MemoryError, match="cannot fit a region of 20 rows: 10 of 100 rows are free"):
        cache.open_stream(capacity=20)
    cache.close_stream(a)
    cache.close_stream(b)
    d = cache.open_stream(capacity=55)       # the two freed regions merged into one of 60 rows
    assert int(cache.state.host_base[d]) == 0
    with pytest.raises(ValueError, match="stream 1 is not open"):
        cache.append(b, torch.zeros(1, 2))


def test_reopened_stream_starts_empty(device):
    cache = _small_cache(device)
    sel = _i32([[1, 2, 3]], device)
    cache.resolve(_i32([0], device), sel)
    cache.close_stream(0)
    s = cache.open_stream(capacity=40)
    cache.append(s, torch.randn(20, 4).to(device))
    res = cache.resolve(_i32([s], device), sel)
    assert res.counts.tolist() == [[0, 3]], "a reopened stream must not see the old stream's units"


def test_write_unit_writes_through_to_cached_copy(device):
    cache = _small_cache(device)
    s0 = _i32([0], device)
    res = cache.resolve(s0, _i32([[4, 19]], device))
    new = torch.randn(4)
    cache.write_unit(0, 4, new.to(device))
    assert torch.equal(cache.slots[0, int(res.slots[0, 0])].cpu(), new)
    res2 = cache.resolve(s0, _i32([[4]], device))
    assert res2.counts.tolist() == [[1, 0]]
    assert torch.equal(cache.slots[0, int(res2.slots[0, 0])].cpu(), new)


@pytest.mark.parametrize("max_programs", [1, 2, 5])
def test_fetch_with_few_programs_copies_every_planned_row(device, max_programs):
    """A capped copy moves the same rows as a full one: with fewer programs than rows each program
    takes several rows (1 and 2 programs for 3 rows), and each loops over several chunks of a row;
    a padded row (stream -1) copies nothing."""
    from hisparse.resolve import fetch_rows
    gen = torch.Generator().manual_seed(11)
    lengths = [300, 120, 200]
    cache, _ = make_pair(3, 96, 8, torch.float16, device, lengths, seed=9)
    sel = next_selection(None, lengths, 96, gen, pad=0.0)
    streams = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    res = cache.resolve(streams, sel.to(device), mode="noio")
    assert int(res.misses.min()) > 64, "the plan must span several chunks"
    # the middle row padded (stream -1): its plan is skipped, and its stream's slots stay poisoned
    padded = torch.tensor([0, -1, 2], dtype=torch.int32, device=device)
    fetch_rows(res.plan_unit, res.plan_slot, res.counts, padded, cache.state.host_base, cache.host.rows,
               cache.slots, max_programs=max_programs)
    assert cache.slots[1, :-1].isnan().all()          # the last slot, reserved, holds the newest row
    keep = [0, 2]
    assert_slots_hold_units(cache, streams[keep], sel.to(device)[keep], res.slots[keep])
    fetch_rows(res.plan_unit, res.plan_slot, res.counts, streams, cache.state.host_base, cache.host.rows,
               cache.slots, max_programs=max_programs)
    assert_slots_hold_units(cache, streams, sel.to(device), res.slots)


def test_copy_tile_grows_a_narrow_copys_tiles_within_bounds():
    """A capped copy's tile: DSA's prefetch width (4 programs) moves 8x the base tile's rows, as
    measured on the H200; larger rows grow less (Quest's 8 KB pages) or not at all (NSA's 32 KB
    blocks, which would spill); every tile is a power of two of rows, at most 64 rows or 32768 words
    of whole rows, and a copy at CAPPED_COPY_TILES programs or more keeps the base tile."""
    from hisparse.resolve import CAPPED_COPY_TILES, copy_tile
    assert copy_tile(288) == (512, 8, 4)                  # DSA's 1152-byte rows, uncapped: 4096-word tiles
    assert copy_tile(288, 4) == (512, 64, 8)
    assert copy_tile(288, 16) == (512, 16, 8)
    assert copy_tile(2048, 4) == (1024, 16, 8)
    assert copy_tile(8192, 4) == (1024, 4, 4)
    for row_words in (1, 7, 8, 100, 288, 1000, 2048, 3000, 8192):
        block_w, base, _ = copy_tile(row_words)
        padded_row = -(-row_words // block_w) * block_w
        for programs in range(1, 3 * CAPPED_COPY_TILES):
            got_w, chunk, warps = copy_tile(row_words, programs)
            assert got_w == block_w and chunk & (chunk - 1) == 0 and chunk >= base, (row_words, programs)
            assert chunk == base or (chunk <= 64 and chunk * padded_row <= 32768 and warps == 8), (row_words, programs)
            if programs >= CAPPED_COPY_TILES:
                assert (chunk, warps) == (base, 4)


def test_fetch_rejects_a_cap_of_no_programs(device):
    from hisparse.resolve import fetch_rows
    cache, _ = make_pair(1, 8, 4, torch.float32, device, [10], seed=1)
    streams = _i32([0], device)
    res = cache.resolve(streams, _i32([[1, 2]], device), mode="noio")
    with pytest.raises(ValueError, match="max_programs=0: expected a positive int"):
        fetch_rows(res.plan_unit, res.plan_slot, res.counts, streams, cache.state.host_base, cache.host.rows,
                   cache.slots, max_programs=0)


def test_limits_and_result_buffers_are_checked(device):
    cache = _small_cache(device, cache_slots=1 << 15)
    with pytest.raises(ValueError, match="selection size k=32768 exceeds the supported 32767"):
        resolve(cache.state, _i32([0], device), torch.full((1, 1 << 15), -1, dtype=torch.int32, device=device),
                cache.host.rows, cache.slots)
    small = _small_cache(device)
    out = ResolveResult(*(torch.empty(s, dtype=torch.int32, device=device) for s in ((1, 2), (1, 2), (1, 2), (1, 3))))
    with pytest.raises(ValueError, match=r"out.plan_slot must be a contiguous int32 \[1, 2\]"):
        small.resolve(_i32([0], device), _i32([[1, 2]], device), out=out)


def test_write_without_a_map_stream_skips_write_through(device):
    """map_streams = -1: the row goes to the host pool and the reserved slot only."""
    from hisparse.resolve import write_rows
    cache = _small_cache(device)
    res = cache.resolve(_i32([0], device), _i32([[4]], device))
    row = torch.randn(1, 4).to(device)
    write_rows(_i32([0], device), torch.tensor([4], device=device), row, cache.state.host_base,
               cache.state.unit_slot, cache.host.rows, cache.slots, to_reserved=True,
               map_streams=_i32([-1], device))
    assert torch.equal(cache.host.rows[4], row[0].cpu())
    assert torch.equal(cache.slots[0, cache.reserved_slot].cpu(), row[0].cpu())
    assert not torch.equal(cache.slots[0, int(res.slots[0, 0])].cpu(), row[0].cpu())


def write_unit_token_both(streams, pos, keys, values, host_base, unit_slot, host, cache, t, device,
                          map_streams=None):
    """Run the kernel (on `device`) and its torch reference on copies of host and cache; assert they
    wrote the same bytes; return the reference's (host, cache)."""
    from hisparse.resolve import write_unit_token
    from hisparse.resolve_ref import write_unit_token_ref
    want_host, want_cache = host.clone(), cache.clone()
    write_unit_token_ref(streams, pos, keys, values, host_base, unit_slot, want_host, want_cache, t, map_streams)
    got_host, got_cache = host.to(device), cache.to(device)
    write_unit_token(streams.to(device), pos.to(device), keys.to(device), values.to(device), host_base.to(device),
                     unit_slot.to(device), got_host, got_cache, t,
                     None if map_streams is None else map_streams.to(device))
    assert torch.equal(got_host.cpu(), want_host) and torch.equal(got_cache.cpu(), want_cache)
    return want_host, want_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_unit_token_matches_reference(dtype, device):
    """Adding the step's token to each stream's newest unit: opening a unit, continuing one, cached
    and uncached units, a skipped stream; the kernel and its torch reference write the same bytes."""
    gen = torch.Generator().manual_seed(5)
    n, hkv, d, t, slots, units = 3, 2, 5, 4, 6, 10                  # T = 4 tokens per unit
    streams = torch.tensor([0, 1, 2, -1, 4, 5], dtype=torch.int32)  # request r's heads: streams 2r, 2r + 1
    pos = torch.tensor([8, 13, 6], dtype=torch.int64)              # units 2, 3, 1 at offsets 0 (opens), 1, 2
    host_base = torch.arange(6, dtype=torch.int64) * units
    unit_slot = torch.full((6 * units,), -1, dtype=torch.int32)
    unit_slot[int(host_base[2]) + 3] = 3                           # request 1, head 0: its unit in slot 3
    unit_slot[int(host_base[5]) + 1] = 0                           # request 2, head 1: in slot 0
    host = torch.randn(6 * units, 2 * t * d, generator=gen).to(dtype)
    cache = torch.randn(6, slots + 1, 2 * t * d, generator=gen).to(dtype)
    keys = torch.randn(n, hkv, d, generator=gen).to(dtype)
    values = torch.randn(n, hkv, d, generator=gen).to(dtype)
    want_host, want_cache = write_unit_token_both(streams, pos, keys, values, host_base, unit_slot, host, cache,
                                                  t, device)
    # what the reference did, by hand. Request 0, head 0 (stream 0): a fresh unit 2 holding the token,
    # zeros elsewhere, in the host pool and the reserved slot alike
    row = want_host[int(host_base[0]) + 2].view(2, t, d)
    assert torch.equal(row[0, 0], keys[0, 0]) and torch.equal(row[1, 0], values[0, 0])
    assert (row[:, 1:] == 0).all() and torch.equal(want_cache[0, -1], want_host[int(host_base[0]) + 2])
    # request 1, head 0 (stream 2): unit 3 continued at offset 1 in each of its three places (host row,
    # reserved slot, the copy in slot 3), the token alone: the rest of each place keeps its own bytes
    for got, before in ((want_host[int(host_base[2]) + 3], host[int(host_base[2]) + 3]),
                        (want_cache[2, -1], cache[2, -1]), (want_cache[2, 3], cache[2, 3])):
        got, before = got.view(2, t, d), before.view(2, t, d)
        assert torch.equal(got[0, 1], keys[1, 0]) and torch.equal(got[1, 1], values[1, 0])
        assert torch.equal(got[:, 0], before[:, 0]) and torch.equal(got[:, 2:], before[:, 2:])
    assert torch.equal(want_cache[5, 0].view(2, t, d)[0, 2], keys[2, 1])      # request 2, head 1: slot 0
    assert torch.equal(want_host[30:40], host[30:40]) and torch.equal(want_cache[3], cache[3])   # skipped


def test_write_unit_token_through_an_anchors_slot_map(device):
    """A shared layer's stream 2 writes through to where its anchor stream 0 caches the unit, not where
    its own map says; stream 3, mapped to -1, writes no cached copy at all (as write_rows): the same
    bytes as the reference, and the rows land there."""
    gen = torch.Generator().manual_seed(7)
    n, hkv, d, t, units = 1, 2, 4, 2, 5
    streams, anchors = torch.tensor([2, 3], dtype=torch.int32), torch.tensor([0, -1], dtype=torch.int32)
    pos = torch.tensor([7], dtype=torch.int64)                     # unit 3, offset 1
    host_base = torch.arange(4, dtype=torch.int64) * units
    unit_slot = torch.full((4 * units,), -1, dtype=torch.int32)
    unit_slot[int(host_base[0]) + 3] = 2                           # the anchor's head 0 caches unit 3 in slot 2
    unit_slot[int(host_base[2]) + 3] = 0                           # the shared stream's own (stale) map: slot 0
    unit_slot[int(host_base[3]) + 3] = 1     # stream 3's own map, and the last stream's: -1 must read neither
    host = torch.randn(4 * units, 2 * t * d, generator=gen)
    cache = torch.randn(4, 4, 2 * t * d, generator=gen)
    keys, values = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
    want_host, want_cache = write_unit_token_both(streams, pos, keys, values, host_base, unit_slot, host, cache,
                                                  t, device, map_streams=anchors)
    def token(row):                                                # unit 3's offset 1: key and value
        row = row.view(2, t, d)
        return row[0, 1], row[1, 1]

    assert torch.equal(token(want_cache[2, 2])[1], values[0, 0]), "through the anchor's map"
    assert torch.equal(want_cache[2, 0], cache[2, 0]), "not through the stream's own"
    assert torch.equal(want_cache[3, :3], cache[3, :3]), "map stream -1: no write-through, whatever the maps say"
    for place in (want_host[int(host_base[3]) + 3], want_cache[3, 3]):
        assert torch.equal(token(place)[0], keys[0, 1]), "but the host row and reserved slot"
    assert torch.equal(want_cache[:2], cache[:2]), "the anchor's own slots untouched"
    from hisparse.resolve import write_unit_token
    with pytest.raises(ValueError, match="map_streams must be int32"):
        write_unit_token(streams, pos, keys, values, host_base, unit_slot, host, cache, t, anchors.long())


def test_write_unit_token_long_rows_and_strided_inputs(device):
    """Rows longer than one kernel block (2 x 8 x 96 = 1536 elements: a second, partly masked pass) and
    keys and values with different strides (a transposed view): the same bytes as the reference."""
    gen = torch.Generator().manual_seed(6)
    n, hkv, d, t, units = 2, 3, 96, 8, 4
    streams = torch.arange(n * hkv, dtype=torch.int32).flip(0).contiguous()
    pos = torch.tensor([16, 29], dtype=torch.int64)                # opens unit 2; offset 5 of unit 3
    host_base = torch.arange(n * hkv, dtype=torch.int64) * units
    unit_slot = torch.full((n * hkv * units,), -1, dtype=torch.int32)
    unit_slot[int(host_base[1]) + 3] = 1
    host = torch.randn(n * hkv * units, 2 * t * d, generator=gen)
    cache = torch.randn(n * hkv, 3, 2 * t * d, generator=gen)
    keys = torch.randn(n, hkv, d, generator=gen)
    values = torch.randn(hkv, n, d, generator=gen).transpose(0, 1)  # strides differ from the keys'
    want_host, want_cache = write_unit_token_both(streams, pos, keys, values, host_base, unit_slot, host, cache,
                                                  t, device)
    for place in (want_host[int(host_base[1]) + 3], want_cache[1, 1]):   # stream 1 = request 1, head 1
        assert torch.equal(place.view(2, t, d)[1, 5], values[1, 1])
    opened = want_host[int(host_base[5]) + 2].view(2, t, d)             # stream 5 = request 0, head 0
    assert torch.equal(opened[0, 0], keys[0, 0]) and (opened[:, 1:] == 0).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_host_pool_pinning_without_a_gpu_is_refused_clearly():
    with pytest.raises(RuntimeError, match="pinning a host pool needs a CUDA GPU; pass pin=False"):
        HostPool(16, 8, torch.float32, pin=True)
    assert HostPool(16, 8, torch.float32).rows.shape == (16, 8)      # unpinned by default here


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_streams=2.5), r"max_streams must be a positive int \(streams\), got 2\.5"),
    (dict(max_streams=0), r"max_streams must be a positive int \(streams\), got 0"),
    (dict(cache_slots=True), r"cache_slots must be a positive int \(B, GPU slots per stream\), got True"),
    (dict(cache_slots=4.0), r"cache_slots must be a positive int \(B, GPU slots per stream\), got 4\.0"),
    (dict(host_rows=16.5), r"host_rows must be a positive int \(host pool rows\), got 16\.5"),
    (dict(row_elems=False), r"row_elems must be a positive int \(elements per row\), got False"),
], ids=["streams-float", "streams-0", "slots-bool", "slots-float", "host-rows-float", "row-elems-bool"])
def test_cache_sizes_must_be_ints(kwargs, message):
    """Not a crash inside torch (2.5 streams), nor True taken as 1 slot."""
    with pytest.raises(ValueError, match=message):
        HierarchicalKVCache(**dict(dict(max_streams=2, cache_slots=4, host_rows=16, row_elems=3), **kwargs),
                            dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"capacity_rows must be a positive int \(host pool rows\), got 16\.5"):
        HostPool(16.5, 8, torch.float32, pin=False)
    cache = HierarchicalKVCache(torch.tensor(2), torch.tensor(4, dtype=torch.int32), host_rows=16, row_elems=3,
                                dtype=torch.float32, device="cpu")
    assert (cache.max_streams, cache.cache_slots) == (2, 4) and type(cache.cache_slots) is int


@pytest.mark.parametrize("mode", ["normal", "noio"])
def test_resolve_with_newest_rows_is_write_then_resolve(mode, device):
    """resolve(newest=...) writes each stream's newest row in the same launch; the result is
    `write_newest` followed by `resolve`, and the reference's, bit for bit: slots, plans, state, host
    pool and every cache slot. The newest unit is a new one (a token just decoded, often selected at
    once: a miss fetched from the host row the same call wrote) or an existing one that may be cached
    (a page that grew: its cached copy is written through, then hit or evicted)."""
    gen = torch.Generator().manual_seed(11)
    num_streams, k, cache_slots, row_elems, steps = 4, 8, 13, 6, 24
    lengths = [int(x) for x in torch.randint(k, 40, (num_streams,), generator=gen)]
    data = [torch.randn(n, row_elems, generator=gen) for n in lengths]
    fused, split, ref = (HierarchicalKVCache(num_streams, cache_slots, host_rows=sum(lengths) + num_streams * steps,
                                             row_elems=row_elems, dtype=torch.float32, device=device)
                         for _ in range(3))
    for cache in (fused, split, ref):
        cache.slots.fill_(float("nan"))
        for rows in data:
            cache.append(cache.open_stream(capacity=len(rows) + steps), rows.to(device))
    sel = None
    for step in range(steps):
        grow = torch.rand(num_streams, generator=gen) < 0.7
        for cache in (fused, split, ref):
            cache.advance([s for s in range(num_streams) if grow[s]])
        lengths = fused.stream_len[:num_streams]
        units = [n - 1 if grow[s] else int(torch.randint(0, n, (1,), generator=gen)) for s, n in enumerate(lengths)]
        sel = next_selection(sel, lengths, k, gen)
        for s, unit in enumerate(units):
            if unit not in sel[s].tolist() and torch.rand(1, generator=gen) < 0.6:
                sel[s, int(torch.randint(0, k, (1,), generator=gen))] = unit
        order = torch.randperm(num_streams, generator=gen)
        streams = torch.cat([order, torch.tensor([-1])]).to(torch.int32)            # and a padded row
        batch_sel = torch.cat([sel[order], torch.full((1, k), -1, dtype=torch.int32)])
        new_units = torch.tensor([units[s] for s in order] + [0])
        new_rows = torch.randn(num_streams + 1, row_elems, generator=gen)
        newest = (new_units.to(device), new_rows.to(device))
        got = fused.resolve(streams.to(device), batch_sel.to(device), mode=mode, newest=newest)
        split.write_newest(streams.to(device), *newest)
        want = split.resolve(streams.to(device), batch_sel.to(device), mode=mode)
        ref_out = ref.resolve_ref(streams.to(device), batch_sel.to(device), mode=mode, newest=newest)
        for other in (want, ref_out):
            assert torch.equal(got.slots.cpu(), other.slots.cpu()), f"step {step}"
            assert torch.equal(got.counts.cpu(), other.counts.cpu()), f"step {step}"
            assert all(got.plan(r) == other.plan(r) for r in range(num_streams + 1)), f"step {step}"
        for other in (split, ref):
            assert_same_state(fused, other)
            for s, n in enumerate(lengths):              # the written rows (the rest were never set)
                region = slice(int(fused.state.host_base[s]), int(fused.state.host_base[s]) + n)
                assert torch.equal(fused.host.rows[region].view(torch.int32),
                                   other.host.rows[region].view(torch.int32)), f"step {step}"
            assert torch.equal(fused.slots.cpu().view(torch.int32), other.slots.cpu().view(torch.int32)), f"step {step}"
        for row, s in enumerate(streams.tolist()[:-1]):
            base = int(fused.state.host_base[s])
            assert torch.equal(fused.host.rows[base + units[s]], new_rows[row])
            assert torch.equal(fused.slots[s, fused.reserved_slot].cpu(), new_rows[row])
        if mode == "normal":
            assert_slots_hold_units(fused, streams, batch_sel, got.slots)
    assert fused.stats.sum(0).tolist()[1] > 0


def test_resolve_rejects_bad_newest_rows_before_launch(device):
    """Bad newest rows or units: a clear error, and nothing stored or resolved changes."""
    cache = _small_cache(device)
    cache.resolve(_i32([0], device), _i32([[4, 1]], device))
    host, slots, state = cache.host.rows.clone(), cache.slots.clone(), cache.state.clone()
    row, unit = torch.randn(1, 4).to(device), torch.tensor([3], device=device)
    cases = [((unit, torch.randn(1, 5).to(device)), r"rows must be \[M, 4\]"),
             ((unit, row.double()), r"rows must be \[M, 4\] torch.float32"),
             ((torch.tensor([3, 4], device=device), row), r"must be \[M\] = \[1\]"),
             ((torch.tensor([cache.stream_len[0]], device=device), row), "newest unit .* out of range"),
             ((torch.tensor([-1], device=device), row), "newest unit .* out of range"),
             ((unit.float(), row), "units must be an integer tensor"),
             ((unit,), r"newest must be \(units \[N\], rows \[N, E\]\)")]
    for newest, match in cases:
        with pytest.raises(ValueError, match=match):
            cache.resolve(_i32([0], device), _i32([[2, 1]], device), newest=newest)
    with pytest.raises(ValueError, match="units int64"):      # the launcher; the cache converts integers
        resolve(cache.state, _i32([0], device), _i32([[2, 1]], device), cache.host.rows, cache.slots,
                newest=(unit.to(torch.int32), row))
    # bits, not values: unwritten host rows and slots may hold NaN
    assert torch.equal(cache.host.rows.view(torch.int32), host.view(torch.int32))
    assert torch.equal(cache.slots.view(torch.int32), slots.view(torch.int32))
    for name in ("lru", "lru_unit", "unit_slot", "stats", "epoch"):
        assert torch.equal(getattr(cache.state, name), getattr(state, name)), name


@pytest.mark.parametrize("mode", ["normal", "noio"])
def test_newest_row_of_a_cached_unit_that_is_hit_or_evicted(mode, device):
    """The cases a new token never meets but a rewritten unit does (a page that grew), pinned down:
    the newest unit cached at slot 0 and evicted by this call's misses, then cached and hit. As
    `write_newest` then `resolve` would leave them: the evicted slot holds the new row in noio and
    the fetched unit's row otherwise; the hit slot holds the new row."""
    caches = [HierarchicalKVCache(1, 4, host_rows=32, row_elems=3, dtype=torch.float32, device=device)
              for _ in range(2)]
    data = torch.randn(20, 3)
    for cache in caches:
        cache.append(cache.open_stream(capacity=20), data.to(device))
        cache.resolve(_i32([0], device), _i32([[0, 1, 2, 3]], device))   # unit u in slot u, LRU order 0..3
    fused, split = caches
    s0 = _i32([0], device)
    for unit, sel, slot in ((0, [[4, 5, -1, -1]], 0),     # unit 0 not selected: its slot 0 is the first victim
                            (2, [[2, 6, -1, -1]], 2)):    # unit 2 selected: a hit in slot 2
        new = torch.randn(1, 3).to(device)
        got = fused.resolve(s0, _i32(sel, device), mode=mode, newest=(_i32([unit], device), new))  # int32: converted
        split.write_newest(s0, torch.tensor([unit], device=device), new)
        want = split.resolve(s0, _i32(sel, device), mode=mode)
        assert torch.equal(got.slots, want.slots) and got.plan(0) == want.plan(0)
        assert_same_state(fused, split)
        assert torch.equal(fused.slots.view(torch.int32), split.slots.view(torch.int32))
        assert torch.equal(fused.host.rows[unit], new[0].cpu())
        assert torch.equal(fused.slots[0, fused.reserved_slot], new[0])
        if unit == 0:
            assert int(got.slots[0, 0]) == slot, "unit 4 takes the slot unit 0 left"
            held = new[0] if mode == "noio" else data[4].to(device)
            assert torch.equal(fused.slots[0, slot], held)
        else:
            assert int(got.slots[0, 0]) == slot and torch.equal(fused.slots[0, slot], new[0])


# -- on a GPU --------------------------------------------------------------------------------------
# Resolve on the GPU at real sizes: k = 2048, B = 4096, batch 64, 1152-byte rows (576 bf16),
# eagerly and inside a CUDA graph captured once and replayed with changing selections. The
# reference runs on the CPU on a copy of the same state.

N, K, B, E, CONTEXT = 64, 2048, 4096, 576, 16384


def selections(gen, steps):
    """Each step keeps ~70% of the previous selection and draws the rest fresh; some rows pad."""
    sel = torch.stack([torch.randperm(CONTEXT, generator=gen)[:K] for _ in range(N)])
    out = []
    for _ in range(steps):
        fresh = torch.randint(0, CONTEXT, (N, K), generator=gen)
        replace = torch.rand(N, K, generator=gen) < 0.3
        cand = torch.where(replace, fresh, sel)
        rows = []
        for r in range(N):   # keep unique ids, in a new order, then pad some rows
            u = torch.unique(cand[r])
            u = u[torch.randperm(len(u), generator=gen)]
            row = torch.full((K,), -1, dtype=torch.int64)
            n = len(u) if r % 5 else len(u) // 2
            row[:n] = u[:n]
            rows.append(row)
        sel = torch.stack(rows)
        out.append(sel.to(torch.int32))
    return out


def build(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(N, CONTEXT, E, generator=gen).to(torch.bfloat16)
    cache = HierarchicalKVCache(N, B, host_rows=N * CONTEXT, row_elems=E, dtype=torch.bfloat16, device=device)
    for r in range(N):
        cache.append(cache.open_stream(CONTEXT), data[r])
    return cache


def check_step(gpu, cpu, streams, sel, res):
    want = cpu.resolve_ref(streams.cpu(), sel.cpu(), mode="noio")
    assert torch.equal(res.slots.cpu(), want.slots)
    assert torch.equal(res.counts.cpu(), want.counts)
    for name in ("lru", "lru_unit", "unit_slot", "stats"):
        assert torch.equal(getattr(gpu.state, name).cpu(), getattr(cpu.state, name)), name
    # every slot holds the host row of its unit, bit for bit
    valid = sel >= 0
    s_idx = streams[:, None].long().expand_as(sel)[valid]
    got = gpu.slots[s_idx, res.slots[valid].long()]
    host_rows = gpu.state.host_base[s_idx] + sel[valid].long()
    want_rows = gpu.host.rows[host_rows.cpu()].to(got.device)
    assert torch.equal(got.view(torch.int16), want_rows.view(torch.int16))


VARIANTS = {"packed_scan": dict(), "single_scan": dict(packed_scan=False)}     # the default at B=4096: packed


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resolve_matches_reference_eager_and_graph(variant):
    opts = VARIANTS[variant]
    device = torch.device("cuda")
    gpu = build(device)
    cpu = HierarchicalKVCache(N, B, host_rows=N * CONTEXT, row_elems=E, dtype=torch.bfloat16, device="cpu",
                              pin=False)
    for r in range(N):
        cpu.open_stream(CONTEXT)
        cpu.stream_len[r] = CONTEXT
    gen = torch.Generator().manual_seed(1)
    streams = torch.randperm(N, generator=gen).to(torch.int32).to(device)
    steps = selections(gen, 12)

    for sel in steps[:4]:                                   # eager, with value checks
        res = gpu.resolve(streams, sel.to(device), **opts)
        check_step(gpu, cpu, streams, sel.to(device), res)

    static_sel = steps[4].to(device).clone()
    out = ResolveResult(*(torch.full(s, -7, dtype=torch.int32, device=device)
                          for s in ((N, K), (N, 2), (N, K), (N, K))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu.resolve(streams, static_sel, check_values=False, out=out, **opts)
    for sel in steps[4:]:                                   # replayed with changing selections
        static_sel.copy_(sel.to(device))
        graph.replay()
        torch.cuda.synchronize()
        check_step(gpu, cpu, streams, static_sel, out)
    hits, misses = gpu.stats.sum(0).tolist()
    assert hits > 0 and misses > 0


@pytest.mark.gpu
def test_fetch_past_2_31_words_on_gpu():
    """A 9 GiB pinned pool of 40 KiB rows: host offsets past 2**31 words must not wrap."""
    device = torch.device("cuda")
    e = 20480                                                # 40960-byte rows, 10240 int32 words
    far_rows = (1 << 31) // (e // 2) + 64
    cache = HierarchicalKVCache(2, 8, host_rows=far_rows + 64, row_elems=e, dtype=torch.bfloat16, device=device)
    cache.open_stream(far_rows)
    far = cache.open_stream(64)
    rows = torch.randn(40, e).to(torch.bfloat16)
    cache.append(far, rows)
    sel = torch.tensor([[3, 39, 0, 17]], dtype=torch.int32, device=device)
    res = cache.resolve(torch.tensor([far], dtype=torch.int32, device=device), sel)
    assert torch.equal(cache.slots[far, res.slots[0].long()].cpu(), rows[sel[0].long().cpu()])
    # the newest row written by the resolve lands there too: unit 39 (cached) rewritten
    new = torch.randn(1, e).to(torch.bfloat16)
    cache.resolve(torch.tensor([far], dtype=torch.int32, device=device), sel, mode="noio",
                  newest=(torch.tensor([39], device=device), new.to(device)))
    torch.cuda.synchronize()
    assert torch.equal(cache.host.rows[int(cache.state.host_base[far]) + 39], new[0])
    assert torch.equal(cache.slots[far, int(res.slots[0, 1])].cpu(), new[0])


@pytest.mark.gpu
def test_host_pool_is_pinned_and_read_zero_copy_and_unpinned_when_dropped():
    """The pool is page-locked by cudaHostRegister (no power-of-two rounding, an odd size here), read
    zero-copy by the kernels, and unregistered when the pool goes."""
    pool = HostPool(3 * 1000 + 7, 576, torch.bfloat16)       # an odd size: 3.5 MB, not a power of two
    assert pool.rows.is_pinned()
    new = torch.randn(pool.capacity, 576, device="cuda").to(torch.bfloat16)
    pool.write(0, new)
    torch.cuda.synchronize()
    cache = torch.empty(1, 2, 576, dtype=torch.bfloat16, device="cuda")
    plan = torch.tensor([[pool.capacity - 1]], dtype=torch.int32, device="cuda")
    fetch_rows(plan, torch.zeros_like(plan), torch.tensor([[0, 1]], dtype=torch.int32, device="cuda"),
               torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda"),
               pool.rows, cache)
    assert torch.equal(cache[0, 0], new[-1])
    host_rows = pool.rows
    del pool
    assert not host_rows.is_pinned(), "the pool's memory must be unregistered with the pool"

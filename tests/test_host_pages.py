"""Host rows by pages: the page table in the kernels (against their references and against the rows
where the table says the bytes are), reference counts, read-only shared pages, and a cache whose
streams share prefixes under churn."""
import random
import zlib

import numpy as np
import pytest
import torch

from hisparse.cache import HierarchicalKVCache
from hisparse.host_pages import FreeRuns, PageRefs
from hisparse.host_pool import HostPool
from hisparse.resolve import CacheState, PageTable, fetch_rows, resolve, write_rows, write_unit_token
from hisparse.resolve_ref import resolve_ref, write_unit_token_ref


def _i32(rows, device):
    return torch.tensor(rows, dtype=torch.int32, device=device)


def shuffled_state(num_streams, cache_slots, units, page_rows, device, seed, share_first=0):
    """Cache state of `num_streams` streams of `units` map rows each over a page table that sends map
    pages to host pages in a random order; with `share_first`, every stream's first pages are stream
    0's host pages (a shared prefix). Returns (state, host pages used)."""
    gen = torch.Generator().manual_seed(seed)
    per = units // page_rows
    state = CacheState.empty(num_streams, cache_slots, num_streams * units, device, page_rows=page_rows)
    page_of = torch.randperm(num_streams * per, generator=gen).to(torch.int32)
    for s in range(1, num_streams):
        page_of[s * per:s * per + share_first] = page_of[:share_first]
    state.pages.page_of.copy_(page_of)
    state.host_base.copy_(torch.arange(num_streams) * units)
    return state


@pytest.mark.parametrize("page_rows,share_first", [(4, 0), (4, 2), (1, 0), (8, 1)],
                         ids=["P4", "P4-shared2", "P1", "P8-shared1"])
def test_resolve_through_a_shuffled_page_table_matches_reference_and_fetches_mapped_rows(page_rows, share_first,
                                                                                           device):
    """Kernel and reference agree bit for bit (slots, state, cache slots), and every selected unit's
    slot holds the host row the page table maps it to, not the row at its map row; with a shared
    prefix, streams fetch the same host rows for their first pages."""
    gen = torch.Generator().manual_seed(page_rows * 10 + share_first)
    num_streams, k, cache_slots, units, row_elems = 3, 6, 11, 32, 5
    state = shuffled_state(num_streams, cache_slots, units, page_rows, device, seed=3, share_first=share_first)
    assert not torch.equal(state.pages.page_of.cpu(), torch.arange(state.pages.page_of.numel(), dtype=torch.int32))
    ref_state = CacheState(*(t.cpu().clone() for t in state.tensors()[:-1]), pages=PageTable(state.pages.page_of.cpu(),
                                                                                       page_rows))
    host = torch.randn(num_streams * units, row_elems, generator=gen).to(device)   # on a GPU: device memory
    ref_host = host.cpu().clone()
    cache = torch.full((num_streams, cache_slots + 1, row_elems), float("nan"), device=device)
    ref_cache = cache.cpu().clone()
    streams = _i32([2, -1, 0, 1], device)
    for step in range(12):
        sel = torch.full((4, k), -1, dtype=torch.int32)
        for row, s in enumerate(streams.tolist()):
            if s >= 0:
                sel[row] = torch.randperm(units, generator=gen)[:k].to(torch.int32)
        newest = None
        if step % 3 == 1:              # the newest rows through the table too (WRITE_NEWEST)
            new_units = torch.tensor([units - 1 - step, 0, units - 2, units - 3], dtype=torch.int64)
            newest = (new_units, torch.randn(4, row_elems, generator=gen))
        got = resolve(state, streams, sel.to(device), host, cache,
                      newest=None if newest is None else (newest[0].to(device), newest[1].to(device)))
        want = resolve_ref(ref_state, streams.cpu(), sel, ref_host, ref_cache, newest=newest)
        assert torch.equal(got.slots.cpu(), want.slots) and torch.equal(got.counts.cpu(), want.counts), step
        assert [got.plan(row) for row in range(4)] == [want.plan(row) for row in range(4)], step
        for name in ("lru", "lru_unit", "unit_slot", "stats"):
            assert torch.equal(getattr(state, name).cpu(), getattr(ref_state, name)), (step, name)
        assert torch.equal(cache.cpu().view(torch.int32), ref_cache.view(torch.int32)), step   # bitwise: NaN poison
        assert torch.equal(host.cpu(), ref_host), step
        for row, s in enumerate(streams.tolist()):
            if s < 0:
                continue
            host_rows = state.pages.host_rows(state.host_base.cpu()[s] + sel[row].long())
            assert torch.equal(cache[s, got.slots[row].long()].cpu(), ref_host[host_rows]), (step, row)
    if share_first:                       # the shared prefix's map rows name the same host rows
        prefix = torch.arange(share_first * page_rows)
        assert torch.equal(state.pages.host_rows(prefix), state.pages.host_rows(units + prefix))


def test_fetch_and_writes_follow_the_page_table(device):
    """fetch_rows (a plan replay), write_rows and write_unit_token read and write the mapped host
    rows; write_unit_token equals its reference with a table."""
    gen = torch.Generator().manual_seed(7)
    num_streams, cache_slots, units, p, t, d = 2, 4, 16, 4, 2, 3
    state = shuffled_state(num_streams, cache_slots, units, p, device, seed=5)
    pages = state.pages
    host = torch.randn(num_streams * units, 2 * t * d, generator=gen).to(device)
    cache = torch.zeros(num_streams, cache_slots + 1, 2 * t * d, device=device)
    plan_unit, plan_slot = _i32([[5, 14, 0], [9, 0, 0]], device), _i32([[2, 0, 3], [1, 0, 0]], device)
    fetch_rows(plan_unit, plan_slot, _i32([[0, 3], [0, 1]], device), _i32([1, 0], device), state.host_base, host,
               cache, pages=pages)
    for stream, unit, slot in ((1, 5, 2), (1, 14, 0), (1, 0, 3), (0, 9, 1)):
        assert torch.equal(cache[stream, slot].cpu(), host.cpu()[pages.host_rows(torch.tensor(stream * units + unit))])
    rows = torch.randn(2, 2 * t * d, generator=gen)
    write_rows(_i32([0, 1], device), torch.tensor([6, 11], device=device), rows.to(device), state.host_base,
               state.unit_slot, host, cache, to_reserved=True, pages=pages)
    for i, (stream, unit) in enumerate(((0, 6), (1, 11))):
        assert int(pages.host_rows(torch.tensor(stream * units + unit))) != stream * units + unit
        assert torch.equal(host.cpu()[pages.host_rows(torch.tensor(stream * units + unit))], rows[i])
    keys, values = torch.randn(1, 2, d, generator=gen), torch.randn(1, 2, d, generator=gen)
    pos = torch.tensor([7], dtype=torch.int64)                      # unit 3, offset 1
    state.unit_slot[int(state.host_base[1]) + 3] = 2                # stream 1 caches unit 3 in slot 2
    want_host, want_cache = host.cpu().clone(), cache.cpu().clone()
    write_unit_token_ref(_i32([0, 1], "cpu"), pos, keys, values, state.host_base.cpu(), state.unit_slot.cpu(),
                         want_host, want_cache, t, pages=PageTable(pages.page_of.cpu(), p))
    write_unit_token(_i32([0, 1], device), pos.to(device), keys.to(device), values.to(device), state.host_base,
                     state.unit_slot, host, cache, t, pages=pages)
    assert torch.equal(host.cpu(), want_host) and torch.equal(cache.cpu(), want_cache)
    row = host.cpu()[pages.host_rows(torch.tensor(units + 3))].view(2, t, d)
    assert torch.equal(row[0, 1], keys[0, 1]) and torch.equal(row[1, 1], values[0, 1])
    cached = cache[1, 2].cpu().view(2, t, d)                         # and write-through to its cached copy
    assert torch.equal(cached[0, 1], keys[0, 1]) and torch.equal(cached[1, 1], values[0, 1])


def test_page_refs_count_holders_and_free_at_zero():
    refs = PageRefs(8)
    a = refs.alloc(3)
    assert a == [(0, 3)] and refs.free == 5
    refs.share([0, 1])
    refs.share([1])
    assert [refs.refcount(p) for p in range(4)] == [2, 3, 1, 0]
    assert refs.release([1, 1]) == [] and refs.refcount(1) == 1
    assert refs.release([0, 1, 2]) == [1, 2] and refs.refcount(0) == 1 and refs.free == 7
    for bad, message in (([3], "share: page 3 is free"), ([9], "page 9 is outside the pool's pages 0..7")):
        with pytest.raises(ValueError, match=message):
            refs.share(bad)
    with pytest.raises(ValueError, match=r"page 0 is released more times than it is held \(1\)"):
        refs.release([0, 0])
    assert refs.refcount(0) == 1 and refs.free == 7                  # the refused calls changed nothing
    assert refs.release([0]) == [0] and refs.free_runs.runs == [(0, 8)]


def test_private_pages_are_contiguous_where_they_fit_else_the_lowest_free():
    pool = HostPool(16 * 4, 3, torch.float32, pin=False, page_rows=4)
    first = pool.alloc_pages(10)
    assert first == list(range(10))
    pool.release_pages([1, 3, 4])                                   # free: 1, 3-4, 10-15
    assert pool.alloc_pages(2) == [3, 4]                            # the first run that holds 2
    assert pool.alloc_pages(7) == [1, 10, 11, 12, 13, 14, 15]       # no run of 7: the lowest free pages
    with pytest.raises(MemoryError, match="cannot fit 1 pages of 4 rows: 0 of 16 pages are free"):
        pool.alloc_pages(1)
    with pytest.raises(ValueError, match="page_rows=3: expected a power of two that divides the pool's 64 rows"):
        HostPool(64, 3, torch.float32, pin=False, page_rows=3)
    runs = FreeRuns(10)
    assert runs.take_any(4) == [(0, 4)] and runs.take_run(7) is None and runs.fits_runs([6]) and not runs.fits_runs([7])


def test_a_shared_page_is_read_only():
    """HostPool.write refuses rows on a page held twice, before writing any of them; once one holder
    lets go, its last holder may write it again."""
    pool = HostPool(8 * 2, 3, torch.float32, pin=False, page_rows=2)
    pages = pool.alloc_pages(3)
    pool.write(0, torch.ones(6, 3))                                  # private: written once
    pool.share([pages[1]])
    before = pool.rows.clone()
    with pytest.raises(ValueError, match=r"rows 1\.\.4 reach page 1 \(rows 2\.\.3\), held 2 times: a shared "
                                         r"page is read-only"):
        pool.write(1, torch.zeros(4, 3))
    pool.write(4, torch.full((2, 3), 5.0))                           # page 2: private still
    assert torch.equal(pool.rows[:4], before[:4])
    pool.release_pages([pages[1]])
    pool.write(2, torch.zeros(2, 3))


def paged_cache(device, streams=6, host_pages=24, p=4, map_pages=48, **kw):
    return HierarchicalKVCache(streams, 4, host_rows=host_pages * p, row_elems=3, dtype=torch.float32,
                               device=device, page_rows=p, map_rows=map_pages * p, **kw)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (rows never written hold whatever bits, NaN among them, which torch.equal calls unequal)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_stream_opened_on_shared_pages_starts_with_the_prefix_and_refuses_writes_into_it(device):
    cache = paged_cache(device)
    a = cache.open_stream(capacity=13)                               # 4 pages of 4 rows
    rows = torch.randn(10, 3)
    cache.append(a, rows.to(device))
    prefix = cache.stream_pages(a)[:2]
    b = cache.open_stream(capacity=20, shared_pages=prefix)
    assert cache.stream_len[b] == 8 and cache.stream_pages(b)[:2] == prefix
    assert [cache.host.refcount(p) for p in cache.stream_pages(a)] == [2, 2, 1, 1]
    assert torch.equal(cache.host.rows[cache.host_rows(torch.tensor(b), torch.arange(8))], rows[:8])
    # a's page 2 (units 8, 9 of 8..11) shared while a fills it: a's next append is refused, nothing written
    before = cache.host.rows.clone()
    c = cache.open_stream(capacity=16, shared_pages=cache.stream_pages(a)[:3])
    with pytest.raises(ValueError, match=r"rows .* reach page \d+ .* held 2 times: a shared page is read-only"):
        cache.append(a, torch.zeros(1, 3).to(device))
    assert same_bytes(cache.host.rows, before) and cache.stream_len[a] == 10
    cache.close_stream(c)                                            # private again: a fills it
    cache.append(a, torch.randn(2, 3).to(device))
    cache.append(b, torch.randn(3, 3).to(device))                    # b's own units: its own pages
    # the resolve fetches b's shared units from a's rows
    res = cache.resolve(_i32([b], device), _i32([[0, 7, 9]], device))
    assert torch.equal(cache.slots[b, res.slots[0].long()].cpu(), cache.host.rows[cache.host_rows(
        torch.tensor(b), torch.tensor([0, 7, 9]))])
    before = cache.host.rows.clone()
    with pytest.raises(ValueError, match="write_newest: unit 7 of stream 1: rows .* held 2 times: a shared page is "
                                         "read-only"):
        cache.write_newest(_i32([b], device), torch.tensor([7], device=device), torch.zeros(1, 3, device=device))
    with pytest.raises(ValueError, match="held 2 times: a shared page is read-only"):
        cache.write_unit(a, 3, torch.zeros(3, device=device))
    assert same_bytes(cache.host.rows, before)
    for s in (a, b):
        cache.close_stream(s)
    assert cache.host.free_rows == cache.host.capacity and int(cache.host.pages.count.sum()) == 0
    assert cache.regions.map_runs.runs == [(0, 48)]


def test_read_pages_gathers_a_prefix_in_page_order_pinned_where_the_pool_is(device):
    """`read_pages`: the rows of the pages given, in that order (a prefix's rows for its adoption),
    in one host tensor, pinned where the pool is pinned (a GPU's), so the H2D copy runs at line rate."""
    from hisparse.runtime import read_pages
    cache = paged_cache(device)
    cache.host.rows.copy_(torch.arange(cache.host.rows.numel(), dtype=torch.float32).view_as(cache.host.rows))
    rows = read_pages(cache, [5, 2, 7])
    want = torch.cat([cache.host.rows[p * 4:(p + 1) * 4] for p in (5, 2, 7)])
    assert same_bytes(rows, want) and rows.device.type == "cpu"
    assert rows.is_pinned() == cache.host.rows.is_pinned() == (device.type == "cuda")


def test_open_stream_fails_cleanly_and_fits_counts_pages(device):
    cache = paged_cache(device, host_pages=6, map_pages=10)
    a = cache.open_stream(capacity=16)                               # 4 host pages, 4 map pages
    assert cache.fits([8]) and not cache.fits([12]) and cache.fits([12], shared=[2])
    assert not cache.fits([16, 12], shared=[4, 4])                   # 7 map pages for 6 free
    free, counts = cache.host.free_rows, cache.host.pages.count.copy()
    with pytest.raises(MemoryError, match="cannot fit 3 pages of 4 rows: 2 of 6 pages are free"):
        cache.open_stream(capacity=12)
    with pytest.raises(ValueError, match="share: page 5 is free"):
        cache.open_stream(capacity=12, shared_pages=[0, 5])
    with pytest.raises(MemoryError, match="the slot map cannot fit a stream of 7 pages"):
        cache.open_stream(capacity=28, shared_pages=cache.stream_pages(a))
    with pytest.raises(ValueError, match="sharing pages needs a page table"):
        HierarchicalKVCache(2, 4, host_rows=16, row_elems=3, dtype=torch.float32, device=device).open_stream(
            4, shared_pages=[0])
    assert cache.host.free_rows == free and np.array_equal(cache.host.pages.count, counts)
    assert cache.regions.map_runs.runs == [(4, 6)] and cache.free_streams() == cache.max_streams - 1
    b = cache.open_stream(capacity=12, shared_pages=cache.stream_pages(a)[:1])   # 2 private pages: fits
    assert cache.host.free_rows == 0 and cache.stream_len[b] == 4


def checksum(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes())


def test_streams_sharing_prefixes_under_churn_leak_nothing_and_never_change_a_shared_page():
    """Hundreds of streams opened on random prefixes of others' pages (and of an index's: pages kept
    past their streams), appended to, resolved, closed in random order: every count equals the
    holders counted independently, every shared page's bytes keep their checksum while shared, every
    resolve returns each unit's own bytes, and once streams and index let go the pool is all free."""
    rng, gen, device, p = random.Random(0), torch.Generator().manual_seed(0), torch.device("cpu"), 2
    cache = paged_cache(device, streams=6, host_pages=16, p=p, map_pages=28)
    content: dict[int, list[torch.Tensor]] = {}                     # stream -> its units' rows
    index: dict[int, torch.Tensor] = {}                             # page an index holds -> its row bytes
    sums: dict[int, int] = {}                                       # shared page -> checksum while shared
    opened_shared, most_holders, refused = 0, 0, 0
    for op in range(300):
        open_ = sorted(cache._open)
        choice = rng.random()
        if open_ and (choice < 0.3 or cache.free_streams() == 0):
            s = rng.choice(open_)
            cache.close_stream(s)
            del content[s]
        elif open_ and choice < 0.45:                                # an index keeps a full prefix page
            s = rng.choice(open_)
            full = cache.stream_len[s] // p
            if full:
                page = cache.stream_pages(s)[rng.randrange(full)]
                if page not in index:
                    cache.share_pages([page])
                    index[page] = cache.host.rows[page * p:(page + 1) * p].clone()
        elif index and choice < 0.5:
            page = rng.choice(sorted(index))
            cache.release_pages([page])
            del index[page]
        else:
            capacity = rng.randint(1, 12)
            donors = [s for s in open_ if cache.stream_len[s] >= p]
            shared, rows = [], []
            if donors and rng.random() < 0.7:
                donor = rng.choice(donors)
                n = rng.randint(1, min(cache.stream_len[donor] // p, capacity // p or 1))
                if n * p <= capacity:
                    shared, rows = cache.stream_pages(donor)[:n], content[donor][:n * p]
            if not cache.fits([capacity], shared=[len(shared)]):
                with pytest.raises(MemoryError):
                    cache.open_stream(capacity, shared_pages=shared)
                refused += 1
                continue
            s = cache.open_stream(capacity, shared_pages=shared)
            opened_shared += bool(shared)
            content[s] = list(rows)
            more = rng.randint(0, capacity - cache.stream_len[s])
            if more:
                new = torch.randn(more, 3, generator=gen)
                cache.append(s, new)
                content[s] += list(new)
        # counts: one per stream page and per index page
        holders = np.zeros(cache.host.pages.pages, dtype=np.int32)
        for s in cache._open:
            np.add.at(holders, cache.stream_pages(s), 1)
        np.add.at(holders, list(index), 1)
        assert np.array_equal(holders, cache.host.pages.count), op
        most_holders = max(most_holders, int(holders.max()))
        for page in np.flatnonzero(holders > 1).tolist():           # shared: its bytes never change
            now = checksum(cache.host.rows[page * p:(page + 1) * p])
            assert sums.setdefault(page, now) == now, (op, page)
        sums = {page: c for page, c in sums.items() if holders[page] > 1}
        for page, rows in index.items():
            assert torch.equal(cache.host.rows[page * p:(page + 1) * p], rows), (op, page)
        live = [s for s in sorted(cache._open) if cache.stream_len[s]]
        if live and op % 10 == 0:                                     # each unit's own bytes, fetched
            sel = torch.full((len(live), 3), -1, dtype=torch.int32)
            for row, s in enumerate(live):
                units = rng.sample(range(cache.stream_len[s]), min(3, cache.stream_len[s]))
                sel[row, :len(units)] = torch.tensor(units, dtype=torch.int32)
            res = cache.resolve(torch.tensor(live, dtype=torch.int32), sel)
            for row, s in enumerate(live):
                for i, unit in enumerate(sel[row].tolist()):
                    if unit >= 0:
                        assert torch.equal(cache.slots[s, int(res.slots[row, i])], content[s][unit]), (op, s, unit)
    assert opened_shared >= 50 and most_holders >= 3 and refused >= 5, (opened_shared, most_holders, refused)
    for s in sorted(cache._open):
        cache.close_stream(s)
    assert cache.host.free_rows < cache.host.capacity or not index
    cache.release_pages(sorted(index))
    assert int(cache.host.pages.count.sum()) == 0 and cache.host.free_rows == cache.host.capacity
    assert cache.host.pages.free_runs.runs == [(0, 16)] and cache.regions.map_runs.runs == [(0, 28)]


def test_bench_resolve_pages_times_each_point_three_ways(tmp_path):
    """`bench_resolve --pages`: every point through no table, an identity and a shuffled one, the same
    selections (so the same miss rate) each way."""
    import pandas as pd

    from benchmarks.bench_resolve import PAGE_TABLES, main
    main(["--quick", "--pages", "4", "--reps", "1", "--out", str(tmp_path)])
    rows = pd.read_csv(tmp_path / "resolve_pages.csv")
    assert set(rows.page_table) == set(PAGE_TABLES) and set(rows.page_rows) == {4}
    misses = rows[rows.metric == "miss_rate"].groupby(["batch", "target_miss"]).value
    assert (misses.nunique() == 1).all() and len(misses) == 2
    assert (rows[rows.metric == "total_us"].value > 0).all()

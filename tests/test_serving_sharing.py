"""Prefix sharing (`Server(prefix_cache=True)`, hisparse.serving.sharing): a request whose prompt
extends a cached one gets the prefix's rows (hisparse: its streams open on the shared host pages;
resident, noio, hybrid: the index's host copies) and prefills only the rest, bitwise as the same
request prefilled whole in place with the same chunk boundaries, every family in modes resident,
hisparse, hybrid (both placements) and DSA's noio; the pages and copies all come back once the index is
cleared, the copies within the host budget (tiny models, interpreter)."""
import pytest
import torch
from test_serving import QUICK, SETTINGS, tiny
from test_serving_hybrid import HYBRID, hybrid_server, model_of

from hisparse.serving import Request, Server
from hisparse.serving.memory import COPY_SHARE
from hisparse.serving.sharing import PAGE_TOKENS

MAX_CONTEXT = 3 * PAGE_TOKENS


def server(prefix_cache: bool, **kw) -> Server:
    return Server(tiny("deepseek_v32"), "hisparse", cache_slots=16, max_context=MAX_CONTEXT, kv_budget_gib=0.05,
                  max_batch=2, prefill_chunk=PAGE_TOKENS, keep_logits=True, prefix_cache=prefix_cache, **QUICK, **kw)


def prompts(seed: int = 5, rest: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt of two pages and a bit, and one that shares its two pages and goes on differently for
    `rest` tokens."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(0, 97, (2 * PAGE_TOKENS + 3,), generator=gen)
    return first, torch.cat([first[:2 * PAGE_TOKENS], torch.randint(0, 97, (rest,), generator=gen)])


@pytest.mark.parametrize("index_dtype", ["bf16", "fp8"])
def test_a_request_extending_a_cached_prompt_prefills_only_the_rest_bitwise_as_in_place(index_dtype):
    a, b = prompts()
    shared = server(True, index_dtype=index_dtype)
    shared.serve([Request(a, 3)])
    run = shared.serve([Request(b, 4)])
    alone = server(False, index_dtype=index_dtype).serve([Request(b, 4)])
    assert [it.prefilled for it in run.schedule.iterations if it.prefilled] == [11], "prefilled more than the rest"
    got, want = run.requests[0], alone.requests[0]
    assert got.tokens == want.tokens
    for step, (x, y) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert torch.equal(x, y), f"token {step}: logits differ"
    summary = run.summary()                              # the run's own counts
    assert summary["prefix_hit_tokens"] == 2 * PAGE_TOKENS and summary["prefix_prompt_tokens"] == len(b)
    assert summary["prefill_tokens"] == 11 and summary["prefix_cached_pages"] == 2 * shared.streams_per_request


def test_shared_pages_are_stored_once_read_only_and_all_come_back():
    a, b = prompts(7)
    srv = server(True)
    pool = srv.cache.host
    srv.serve([Request(a, 2)])
    layers = srv.streams_per_request
    cached = srv.sharing.index.stats()["cached_pages"]
    assert cached == 2 * layers and pool.capacity - pool.free_rows == cached * PAGE_TOKENS   # only the index's
    pages = [p for p in range(pool.capacity // PAGE_TOKENS) if pool.refcount(p)]
    before = pool.rows.view(torch.int32)[torch.tensor(pages)[:, None] * PAGE_TOKENS
                                         + torch.arange(PAGE_TOKENS)].clone()
    srv.open()
    req = srv.submit(Request(b, 3))
    while not req.done:
        srv.step()
        if req.lane is not None and srv.lane_request[req.lane] is req:      # decoding: its streams hold the pages
            assert all(pool.refcount(p) == 2 for p in pages)
    srv.close()
    after = pool.rows.view(torch.int32)[torch.tensor(pages)[:, None] * PAGE_TOKENS + torch.arange(PAGE_TOKENS)]
    assert torch.equal(before, after), "a shared page changed"
    assert all(pool.refcount(p) == 1 for p in pages)
    srv.sharing.index.clear()
    assert pool.free_rows == pool.capacity and srv.cache.free_streams() == srv.cache.max_streams


def test_an_admission_that_does_not_fit_evicts_cached_prefixes_first():
    """A host pool of one request's pages: the next request fits once the first's cached pages go."""
    a, _ = prompts(9)
    other = torch.randint(0, 97, (len(a),), generator=torch.Generator().manual_seed(1))
    row_bytes, layers = server(True).runtime.row_bytes, server(True).streams_per_request
    srv = server(True, host_budget_gib=layers * 3 * PAGE_TOKENS * row_bytes / 2**30)     # 3 pages a stream
    assert srv.cache.host.capacity == layers * 3 * PAGE_TOKENS
    srv.serve([Request(a, 2)])
    assert srv.sharing.index.stats()["cached_pages"] == 2 * layers
    run = srv.serve([Request(other, 2)])
    assert len(run.requests[0].tokens) == 2
    assert srv.sharing.index.match(a.tolist())[0] == 0, "the first prompt's pages were not evicted"
    assert srv.sharing.index.match(other.tolist())[0] == 2 * PAGE_TOKENS


# every family and mode: (family, mode, hybrid's placement of the request extending the cached prompt);
# Quest in hybrid as llama-shared, as tests/test_serving_hybrid.py runs it
PLACES = [(family, mode, place) for family in ("deepseek_v32", "glm_moe_dsa", "llama", "nsa")
          for mode, place in (("resident", None), ("hisparse", None), ("hybrid", "resident"),
                              ("hybrid", "hierarchical"))] + \
    [("deepseek_v32", "noio", None),           # timing's mode (no copies: wrong outputs, the same in place)
     ("llama-shared", "hisparse", None)]       # a Quest layer in lockstep with another: streams of its own


def family_server(family: str, mode: str, prefix_cache: bool, **extra) -> Server:
    """A server of tiny(family) (or model_of's "llama-shared", Quest layers in lockstep) in `mode`."""
    kw = dict(SETTINGS["llama" if family == "llama-shared" else family], prefill_chunk=PAGE_TOKENS, keep_logits=True,
              prefix_cache=prefix_cache, **QUICK)
    kw.update(extra)
    if mode == "hybrid":
        name = "llama-shared" if family.startswith("llama") else family
        settings, _, max_context = HYBRID[name]
        kw.update(settings)
        return hybrid_server(model_of(name), 1, max(max_context, MAX_CONTEXT), **kw)
    if mode == "resident":
        kw.pop("cache_slots")
    return Server(model_of(family), mode, max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=2, **kw)


def break_runs(srv: Server) -> list[int]:
    """Hybrid: one stream of every run a resident request would need taken (every free stream
    taken, then all but each run-th given back), so the next request goes hierarchical; the ones kept."""
    run, taken = srv.runtime.run_streams(srv.cache, srv.max_context), []
    while (first := srv.cache.take_runs(1)) is not None:
        taken += first
    for stream in [s for s in taken if s % run != run - 1]:
        srv.cache.release_run(stream)
    return [s for s in taken if s % run == run - 1]


@pytest.mark.parametrize("family,mode,place", PLACES, ids=[f"{f}-{m}" + (f"-{p}" if p else "") for f, m, p in PLACES])
def test_every_family_and_mode_serves_a_cached_prefix_bitwise_as_in_place_and_gives_it_all_back(family, mode, place):
    """The prompt's two cached pages adopted (hisparse: shared host pages; else host copies), the
    rest prefilled (11 tokens; NSA 20: its compressed block of tokens 112 .. 143, which straddles the
    prefix's end, is the rest's to make): bitwise the tokens and logits of the same request prefilled
    in place in chunks of 64; hybrid with the request resident and hierarchical. Afterwards, the index
    cleared, every host row, stream and copy is back."""
    rest = 20 if family == "nsa" else 11
    a, b = prompts(rest=rest)
    new = 2 if family == "nsa" else 3
    shared, in_place = family_server(family, mode, True), family_server(family, mode, False)
    shared.serve([Request(a, 2)])
    assert shared.sharing.paged == (mode == "hisparse")
    if shared.sharing.paged:                # the host pool holds the index's pages alone: stored once
        pool, cached = shared.cache.host, shared.sharing.index.stats()["cached_pages"]
        assert cached == 2 * shared.streams_per_request and pool.capacity - pool.free_rows == cached * pool.page_rows
    if mode == "noio":                      # its slots read what the first request left there
        in_place.serve([Request(a, 2)])
    held = [break_runs(srv) for srv in (shared, in_place)] if place == "hierarchical" else [[], []]
    run, alone = shared.serve([Request(b, new)]), in_place.serve([Request(b, new)])
    assert [it.prefilled for it in run.schedule.iterations if it.prefilled] == [rest], "prefilled more than the rest"
    got, want = run.requests[0], alone.requests[0]
    assert got.tokens == want.tokens and len(got.tokens) == new
    for step, (x, y) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert torch.equal(x, y), f"{family} {mode}: token {step}: logits differ"
    assert run.summary()["prefix_hit_tokens"] == 2 * PAGE_TOKENS
    if mode == "hybrid":
        assert run.summary()["resident_admissions"] == alone.summary()["resident_admissions"] == (place == "resident")
    for stream in held[0]:
        shared.cache.release_run(stream)
    copies = shared.sharing.allocator if not shared.sharing.paged else None
    assert copies is None or copies.used > 0
    assert shared.sharing.index.clear() > 0
    if shared.cache is not None:
        assert shared.cache.host.free_rows == shared.cache.host.capacity
        assert shared.cache.free_streams() == shared.cache.max_streams
    assert copies is None or (copies.used == 0 and not copies.count and not copies.bytes)


def test_host_copies_stay_within_the_host_budget_evicting_the_least_recently_used_first():
    """Mode resident (host copies, COPY_SHARE of its host budget): copies of two pages hold one prompt's
    two pages; the next prompt's evict them; three quarters of that hold one page; every byte comes back
    at clear."""
    a, _ = prompts(9)
    other = torch.randint(0, 97, (len(a),), generator=torch.Generator().manual_seed(1))
    probe = family_server("deepseek_v32", "resident", True)
    probe.serve([Request(a, 2)])
    two_pages = probe.sharing.allocator.used
    assert probe.sharing.index.stats()["cached_pages"] == 2 and two_pages > 0

    def resident(budget: int) -> Server:
        return Server(tiny("deepseek_v32"), "resident", max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=2,
                      prefill_chunk=PAGE_TOKENS, prefix_cache=True, host_budget_gib=budget / COPY_SHARE / 2**30,
                      **QUICK)
    srv = resident(two_pages)
    copies = srv.sharing.allocator
    srv.serve([Request(a, 2)])
    assert copies.used == two_pages
    srv.serve([Request(other, 2)])
    assert srv.sharing.index.peek(a.tolist()) == 0 and srv.sharing.index.peek(other.tolist()) == 2 * PAGE_TOKENS
    assert copies.used == two_pages
    small = resident(3 * two_pages // 4)
    small.serve([Request(a, 2)])
    assert small.sharing.index.peek(a.tolist()) == PAGE_TOKENS and small.sharing.allocator.used == two_pages // 2
    for server_ in (srv, small):
        server_.sharing.index.clear()
        assert server_.sharing.allocator.used == 0 and not server_.sharing.allocator.count


@pytest.mark.parametrize("mode", ["noio", "hybrid"])
def test_host_copies_and_the_pool_share_one_host_budget(mode):
    """noio and hybrid keep copies beside a host pool: the two together stay within host_budget_gib (the
    copies COPY_SHARE of it); without a prefix cache the pool has it all."""
    budget = 0.01
    shared, alone = (family_server("llama", mode, cached, host_budget_gib=budget) for cached in (True, False))
    pool_bytes = shared.cache.host.capacity * shared.runtime.row_bytes
    assert shared.memory.copy_budget == int(budget * COPY_SHARE * 2**30)
    assert pool_bytes + shared.memory.copy_budget <= budget * 2**30
    assert alone.cache.host.capacity * alone.runtime.row_bytes > pool_bytes > 0 and alone.memory.copy_budget == 0


@pytest.mark.parametrize("mode", ["hisparse", "resident", "hybrid"])
def test_a_one_token_request_caches_its_prompt_and_gives_its_lane_back(mode):
    """max_tokens 1 (an eval's scoring request): the prompt is cached at its join, the request leaves
    at once, and the next prompt extending it is served from the cache, as the in-place run."""
    a, b = prompts()
    srv = family_server("deepseek_v32", mode, True)
    run = srv.serve([Request(a, 1)])
    assert len(run.requests[0].tokens) == 1 and srv.lane_request == [None] * len(srv.lane_request)
    assert srv.sharing.index.peek(b.tolist()) == 2 * PAGE_TOKENS
    second = srv.serve([Request(b, 3)])
    shared = second.requests[0]
    assert second.prefix["prefix_hit_tokens"] == 2 * PAGE_TOKENS
    alone = family_server("deepseek_v32", mode, False).serve([Request(b, 3)]).requests[0]
    assert shared.tokens == alone.tokens
    srv.sharing.index.clear()
    if srv.cache is not None:
        assert srv.cache.free_streams() == srv.cache.max_streams and srv.cache.host.free_rows == srv.cache.host.capacity


def test_a_schedule_with_evicted_copies_replays_from_resident_into_hybrid_and_noio():
    """The copy modes' indexes take the same budget (COPY_SHARE of host_budget_gib), so under a budget
    that evicts, resident's schedule (a cached, evicted by another prompt, not found again) replays
    in hybrid and noio with the same hits, and in hybrid with the same tokens and logits."""
    a, b = prompts(9)
    other = torch.randint(0, 97, (len(a),), generator=torch.Generator().manual_seed(1))
    probe = family_server("deepseek_v32", "resident", True)
    probe.serve([Request(a, 2)])
    budget = probe.sharing.allocator.used / COPY_SHARE / 2**30            # copies: a's two pages
    reqs = lambda: [Request(p, 3) for p in (a, other, b)]                  # noqa: E731
    srv = family_server("deepseek_v32", "resident", True, host_budget_gib=budget)
    run = srv.serve(reqs(), clients=1)
    assert run.prefix["prefix_hit_tokens"] == 0           # other's pages evicted a's before b came
    for mode in ("hybrid", "noio"):
        again = Server(model_of("deepseek_v32"), mode, max_context=MAX_CONTEXT, lanes=srv.lanes, host_budget_gib=budget,
                       **SETTINGS["deepseek_v32"], prefill_chunk=PAGE_TOKENS, keep_logits=True, prefix_cache=True,
                       **QUICK).serve(reqs(), replay=run.schedule)
        assert again.prefix == run.prefix, mode
        if mode == "hybrid":           # (noio's outputs are not exact: it skips the copies)
            for x, y in zip(run.requests, again.requests, strict=True):
                assert x.tokens == y.tokens and all(torch.equal(p, q) for p, q in zip(x.logits, y.logits))


@pytest.mark.parametrize("mode", ["hisparse", "hybrid"])
def test_a_one_token_request_whose_join_fails_gives_everything_back(mode):
    """Nothing cancels a finished request, so a failed join of one whose first token ended it gives its
    prefill back itself: no stream, host row or run held, nothing prefilling, and the next request served."""
    a, b = prompts()
    srv = family_server("deepseek_v32", mode, True)
    streams, rows = srv.cache.free_streams(), srv.cache.host.free_rows
    srv.open()
    join = srv.runner.join
    srv.runner.join = lambda job: (_ for _ in ()).throw(RuntimeError("join failed"))
    r = srv.submit(Request(a, 1))
    with pytest.raises(RuntimeError, match="join failed"):
        for _ in range(20):
            srv.step()
    srv.runner.join = join
    assert r.done and srv.prefilling is None and not srv.busy and r.lane is None
    assert srv.cache.free_streams() == streams and srv.cache.host.free_rows == rows
    after = srv.submit(Request(b, 2))
    while not after.done:
        srv.step()
    srv.close()
    assert len(after.tokens) == 2 and srv.cache.free_streams() == streams


def test_prefix_cache_is_refused_on_a_disaggregated_server():
    with pytest.raises(ValueError, match="disaggregated=True with prefix_cache=True: every prompt comes prefilled"):
        server(True, disaggregated=True)


@pytest.mark.parametrize("family,mode,count", [("deepseek_v32", "hisparse", 24), ("llama", "hisparse", 12),
                                                ("nsa", "hisparse", 10), ("llama", "resident", 8),
                                                ("llama", "hybrid", 8)])
def test_a_churn_of_shared_prefixes_cancellations_and_evictions_leaks_nothing_and_keeps_shared_pages(family, mode,
                                                                                                      count):
    """`count` requests over three cached prompts' pages (random tails), some cancelled on the way; in
    mode hisparse a host pool that forces evictions, and while a page is shared its bytes never change
    (checksummed every step); afterwards every count is back to the index's, and to zero (every page,
    copy and stream back) once the index is cleared."""
    gen = torch.Generator().manual_seed(11)
    probe = family_server(family, mode, True)
    if probe.sharing.paged:               # 7 pages a stream
        probe = family_server(family, mode, True, host_budget_gib=probe.streams_per_request * 7 * probe.cache.page_rows
                              * probe.runtime.row_bytes / 2**30)
    srv, rows = probe, probe.cache.page_rows if probe.sharing.paged else 0
    pool = srv.cache.host if srv.cache is not None else None
    bases = [torch.randint(0, 97, (2 * PAGE_TOKENS,), generator=gen) for _ in range(3)]
    reqs = [Request(torch.cat([bases[int(torch.randint(3, (1,), generator=gen))],
                               torch.randint(0, 97, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen)]),
                    int(torch.randint(1, 4, (1,), generator=gen))) for _ in range(count)]
    cancel_at = {i for i in range(count) if torch.rand(1, generator=gen) < 0.25} | {1}
    sums: dict[int, torch.Tensor] = {}
    seen: set[int] = set()                  # pages found shared

    def check_shared() -> None:
        counts = pool.pages.count if rows else []
        for page in range(len(counts)):
            bits = pool.rows.view(torch.int32)[page * rows:(page + 1) * rows]
            if counts[page] > 1:
                seen.add(page)
                assert torch.equal(sums.setdefault(page, bits.clone()), bits), f"shared page {page} changed"
            else:
                sums.pop(page, None)
    srv.open()
    for r in reqs:
        srv.submit(r)
    steps = 0
    while srv.busy:
        srv.step()
        check_shared()
        steps += 1
        for i in cancel_at:
            if steps == 3 + i and not reqs[i].done:
                srv.cancel(reqs[i])
    run = srv.close()
    assert run.prefix["prefix_hit_tokens"] > 0 and len(run.cancelled) >= 1 and (seen or not rows)
    assert all(r.done for r in reqs if not r.cancelled)
    cached = srv.sharing.index.stats()["cached_pages"]
    if rows:
        assert int((pool.pages.count > 0).sum()) == cached == int(pool.pages.count.sum())     # the index's alone
    srv.sharing.index.clear()
    if pool is not None:
        assert pool.free_rows == pool.capacity and srv.cache.free_streams() == srv.cache.max_streams
    if rows:
        assert int(pool.pages.count.sum()) == 0
    else:
        assert srv.sharing.allocator.used == 0 and not srv.sharing.allocator.count


def test_over_http_a_second_prompt_extending_the_first_is_counted_on_metrics():
    """The HTTP server with prefix sharing: the second completion extends the first's two pages;
    /metrics (read with prometheus_client's parser) counts its hit and the tokens prefilled."""
    import asyncio

    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families
    from test_serve_http import Running
    a, b = prompts(13)
    running = Running(server(True))

    async def go() -> str:
        async with aiohttp.ClientSession() as s:
            for p in (a, b):
                async with s.post(f"{running.url}/v1/completions", json={"prompt": p.tolist(), "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
            async with s.get(f"{running.url}/metrics") as r:
                return await r.text()
    try:
        text = asyncio.run(go())
    finally:
        running.shut_down()
    value = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert value["hisparse_prefix_hit_tokens"] == 2 * PAGE_TOKENS
    assert value["hisparse_prefill_tokens"] == len(a) + len(b) - 2 * PAGE_TOKENS
    assert value["hisparse_prefix_cached_pages"] == 2 * running.server.streams_per_request
    assert running.final["host_rows_in_use"] == 0, "the cached pages outlived the server"


@pytest.mark.parametrize("shared", [PAGE_TOKENS, 2 * PAGE_TOKENS])
@pytest.mark.parametrize("family,mode", [("nsa", "hisparse"), ("nsa", "resident"), ("deepseek_v32", "hisparse")])
def test_a_hit_is_cut_to_whole_chunks_where_the_prefill_depends_on_them(family, mode, shared):
    """NSA's prefill gives other rows when its chunk boundaries move, so with prefill_chunk 128 a hit
    is cut to whole chunks (64 cached tokens: none taken; 128: all), and the request is bitwise the same
    one prefilled in place from token 0; DSA's prefill is chunk-free, so its hit is the whole pages."""
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(0, 97, (shared + 40,), generator=gen)
    second = torch.cat([first[:shared], torch.randint(0, 97, (20,), generator=gen)])
    cached = family_server(family, mode, True, prefill_chunk=2 * PAGE_TOKENS)
    cached.serve([Request(first, 2)])
    run = cached.serve([Request(second, 3)])
    alone = family_server(family, mode, False, prefill_chunk=2 * PAGE_TOKENS).serve([Request(second, 3)])
    chunk = 2 * PAGE_TOKENS if family == "nsa" else PAGE_TOKENS
    assert run.prefix["prefix_hit_tokens"] == shared - shared % chunk
    got, want = run.requests[0], alone.requests[0]
    assert got.tokens == want.tokens and all(torch.equal(a, b) for a, b in zip(got.logits, want.logits, strict=True))


def test_a_failed_take_or_insert_leaks_nothing_and_leaves_the_others_serving():
    """A host allocation failing in `take` (an admission) gives the hybrid placement's runs back; one
    failing in `insert` (the join) leaves the request running in its lane, so cancelling it lets
    everything go while another request decodes on."""
    srv = family_server("deepseek_v32", "hybrid", True)
    first, second = prompts()
    srv.serve([Request(first, 2)])
    free = srv.cache.free_streams()
    take = srv.sharing.take
    srv.sharing.take = lambda prompt: (_ for _ in ()).throw(RuntimeError("host allocation failed"))
    srv.open()
    r = srv.submit(Request(second, 2))
    with pytest.raises(RuntimeError, match="host allocation failed"):
        while not r.done:
            srv.step()
    srv.sharing.take = take
    srv.cancel(r)
    srv.close()
    assert srv.cache.free_streams() == free and srv.sharing.stats()["prefix_prompt_tokens"] == 0

    srv = family_server("deepseek_v32", "hisparse", True)
    srv.open()
    other = srv.submit(Request(torch.randint(0, 97, (20,)), 40))
    while srv.lane_request[0] is not other:
        srv.step()
    insert = srv.sharing.insert
    srv.sharing.insert = lambda *args: (_ for _ in ()).throw(RuntimeError("host allocation failed"))
    r = srv.submit(Request(first, 3))
    with pytest.raises(RuntimeError, match="host allocation failed"):
        while not r.done:
            srv.step()
    srv.sharing.insert = insert
    assert srv.lane_request[r.lane] is r              # joined: a running request, not a half-joined one
    srv.cancel(r)
    while not other.done:
        srv.step()
    srv.close()
    srv.sharing.index.clear()
    assert srv.cache.free_streams() == srv.cache.max_streams and srv.cache.host.free_rows == srv.cache.host.capacity


def test_an_admission_evicts_nothing_where_evicting_cannot_make_its_room():
    """A request that does not fit while running requests hold the pool leaves the cached prefixes
    alone (evicting them would not admit it)."""
    import test_serving_sharing as module
    gen = torch.Generator().manual_seed(1)
    probe = family_server("deepseek_v32", "hisparse", True)
    budget = probe.streams_per_request * 6 * PAGE_TOKENS * probe.runtime.row_bytes / 2 ** 30   # 6 pages a stream
    saved, module.MAX_CONTEXT = module.MAX_CONTEXT, 5 * PAGE_TOKENS
    try:
        srv = family_server("deepseek_v32", "hisparse", True, host_budget_gib=budget)
    finally:
        module.MAX_CONTEXT = saved
    srv.serve([Request(torch.randint(0, 97, (PAGE_TOKENS + 3,), generator=gen), 2)])
    assert srv.sharing.index.stats()["cached_pages"] > 0
    srv.open()
    x = srv.submit(Request(torch.randint(0, 97, (200,), generator=gen), 56))
    while srv.lane_request[0] is not x:
        srv.step()
    cached = srv.sharing.index.stats()["cached_pages"]       # the first prompt's and x's (x holds its own)
    y = srv.submit(Request(torch.randint(0, 97, (150,), generator=gen), 40))
    srv.step()
    assert y.lane is None and srv.sharing.index.stats()["cached_pages"] == cached
    while srv.busy:
        srv.step()
    srv.close()
    assert y.done

"""Hybrid serving (DSA, Quest, NSA): a request is resident in runs of the cache's streams while they are
free and hierarchical otherwise, demoted when a hierarchical one needs the streams; resident and
hierarchical lanes decode in one step, and every token and logit is bitwise the resident run's under
the same schedule (tiny models, interpreter)."""
import functools

import pytest
import torch
from test_serving import DEVICE, MAX_CONTEXT, QUICK, fresh, requests, tiny

from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import TINY_CONFIGS, randomize_
from hisparse.serving import GIB, Request, Server

# per family: B (and Quest's token budget, k = 3 pages), the resident requests' room beyond the
# lanes' streams, max_context. DSA: B = 48, a run of 3 streams a layer, room for one more; its
# prefill workspace becomes streams too. Quest: B = 4, a run of 2 streams a KV head (9 pages), no
# room beyond the lanes' (its workspace stays beside the cache): the second request is
# hierarchical, the third demotes. NSA: B = k = 4 blocks, so a run of 2 streams needs a max_context
# over 5 blocks (the requests stay short; its decode step is the interpreter's slowest: at most 4
# new tokens). Quest runs as llama-shared alone: its first Quest layer selects its own pages as a
# plain llama's does, and qwen3 differs from llama in its projections, not in what hybrid does
HYBRID = {"deepseek_v32": (dict(cache_slots=48), 1, MAX_CONTEXT), "glm_moe_dsa": (dict(cache_slots=48), 1, MAX_CONTEXT),
          "llama-shared": (dict(cache_slots=4, token_budget=48), 0, MAX_CONTEXT),
          "nsa": (dict(cache_slots=4), 0, 384)}


@functools.cache
def model_of(family: str):
    """tiny(family); "llama-shared": 2 dense and 2 Quest layers, the second in lockstep with the first
    (quest_selection_group 2: it replays the first's miss plan, with no resolve of its own)."""
    if family != "llama-shared":
        return tiny(family)
    model = build_model(config_from_dict(dict(TINY_CONFIGS["llama"], num_hidden_layers=4, quest_selection_group=2)))
    model = model.to(DEVICE).float()
    randomize_(model, 5)
    return model


def hybrid_server(model, extra_runs: int, max_context: int = MAX_CONTEXT, prefix_cache: bool = False, **kw) -> Server:
    """Three lanes and room for `extra_runs` resident requests beyond the lanes' own streams and the
    prefill workspace's (which hybrid also turns into streams where the family puts it in runs)."""
    probe = Server(model, "hisparse", max_context=max_context, kv_budget_gib=1.0, max_batch=3, **kw)
    runs = probe.runtime.run_streams(probe.cache, max_context) * probe.streams_per_request
    budget = (probe.workspace_bytes + 4 * probe.cache.host.capacity + 3 * probe.lane_bytes
              + extra_runs * runs * probe.memory.stream_bytes())
    server = Server(model, "hybrid", max_context=max_context, kv_budget_gib=budget / GIB, max_batch=3,
                    prefix_cache=prefix_cache, **kw)
    assert server.gpu_bytes() <= server.kv_budget          # the streams it made fit the budget exactly
    return server


@pytest.mark.parametrize("family", list(HYBRID))
def test_hybrid_mixes_resident_and_hierarchical_lanes_bitwise_as_resident(family, graph=False):
    """Three lanes and the streams of `HYBRID`: requests are admitted resident, one is demoted
    mid-run when a hierarchical one needs its streams, and steps decode both kinds together
    (glm_moe_dsa, llama-shared: with layers sharing their anchor's selection); resident replaying the
    schedule gives every token and logit bitwise, through the steps whose lanes are all resident (no
    resolve) and the others; every run, stream and host row is given back."""
    model = model_of(family)
    settings, extra_runs, max_context = HYBRID[family]
    kw = dict(settings, prefill_chunk=24, keep_logits=True, graph=graph, **({} if graph else QUICK))
    server = hybrid_server(model, extra_runs=extra_runs, max_context=max_context, **kw)
    assert server.lanes == 3
    mixed = []
    decode = server._decode_step

    def watched(*warm_up):
        if warm_up:                     # warm_up's steps, each kind forced
            return decode(*warm_up)
        kinds = {bool(server.layers[-1].resident[lane]) for lane, r in enumerate(server.lane_request)
                 if r is not None}
        mixed.append(kinds == {True, False})
        logits = decode()
        assert server.runner.resident_step == (kinds == {True}), kinds          # the all-resident step exactly then
        return logits

    server._decode_step = watched
    reqs = requests(seed=4, n=5)
    if family == "nsa":
        reqs = [Request(r.prompt, min(r.max_new_tokens, 4)) for r in reqs]
    run = server.serve(reqs, clients=3)
    summary = run.summary()
    assert summary["resident_admissions"] >= 2 and summary["demotions"] >= 1, summary
    assert any(mixed), "no step decoded resident and hierarchical lanes together: the test checks no mix"
    assert 0 < summary["resident_steps"] < len(mixed), summary     # all-resident steps and others, both checked
    assert run.peak_gpu_bytes <= server.kv_budget
    again = Server(model, "resident", lanes=run.schedule.lanes, max_context=max_context, **kw).serve(
        fresh(reqs), clients=3, replay=run.schedule)
    for a, b in zip(run.requests, again.requests):
        assert a.tokens == b.tokens and len(a.tokens) == a.max_new_tokens, f"request {a.rid}"
        for step, (x, y) in enumerate(zip(a.logits, b.logits)):
            assert torch.equal(x, y), f"{family}: request {a.rid}, token {step}: logits differ"
    assert server.cache.free_streams() == server.cache.max_streams      # every run and stream given back
    assert server.cache.host.free_rows == server.cache.host.capacity
    assert not any(kv.resident.any() for kv in server.runner.lane_states.hierarchical), "an empty lane left marked resident"


def test_hybrid_without_spare_room_demotes_when_a_second_request_comes():
    """No budget beyond what hisparse would hold (lanes and workspace): a request alone is resident in
    those streams, and the next one demotes it (the lanes are then what hisparse would run)."""
    model = tiny("deepseek_v32")
    kw = dict(cache_slots=48, prefill_chunk=24, **QUICK)
    server = hybrid_server(model, extra_runs=0, **kw)
    assert server.cache.max_streams == 3 * server.streams_per_request + server.workspace_bytes // server.memory.stream_bytes()
    run = server.serve(requests(seed=5, n=3), clients=3)
    assert run.summary()["resident_admissions"] == 1 and run.summary()["demotions"] == 1, run.summary()
    assert all(len(r.tokens) == r.max_new_tokens for r in run.requests)
    assert server.cache.free_streams() == server.cache.max_streams
    with pytest.raises(ValueError, match="prefetch applies to mode 'hisparse'"):
        Server(model, "hybrid", prefetch=True, max_context=MAX_CONTEXT, kv_budget_gib=0.05, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(HYBRID))
def test_graphed_hybrid_is_bitwise_as_resident(family):
    """The same on a GPU, every decode step a replay of one captured graph: residency, demotion and
    the lanes' kinds change only the static buffers between replays."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    test_hybrid_mixes_resident_and_hierarchical_lanes_bitwise_as_resident(family, graph=True)


def test_runs_of_streams_are_taken_whole_and_skipped_by_open_stream():
    """take_runs: the lowest runs of free contiguous streams, all of them or none; open_stream never
    hands out a stream inside a run; released runs are free again."""
    from hisparse.cache import HierarchicalKVCache
    cache = HierarchicalKVCache(max_streams=10, cache_slots=4, host_rows=64, row_elems=2, dtype=torch.float32,
                                device="cpu")
    a = cache.open_stream(4)                                    # stream 0
    [run] = cache.take_runs(3)
    assert (a, run, cache.run_length(run)) == (0, 1, 3)
    assert cache.open_stream(4) == 4 and cache.free_streams() == 5
    assert cache.take_runs(2, count=3) is None and cache.free_streams() == 5      # 5..9 hold two runs of 2
    assert cache.take_runs(2, count=2) == [5, 7] and cache.free_streams() == 1
    assert cache.take_runs(4) is None
    assert cache.open_stream(4) == 9 and cache.free_streams() == 0
    with pytest.raises(RuntimeError, match="open or in runs"):
        cache.open_stream(4)
    cache.release_run(run)
    assert cache.open_stream(4) == 1 and cache.free_streams() == 2
    with pytest.raises(ValueError, match="no run starts at stream 2"):
        cache.release_run(2)
    with pytest.raises(ValueError, match="a run's length must be a positive int"):
        cache.take_runs(0)


def test_a_request_hybrid_could_never_place_is_refused_at_submit():
    """A budget of exactly one hisparse lane: the prompt's workspace, rounded up to whole streams a
    layer, and its own streams do not fit the cache hybrid makes of it; refused when submitted (it
    would wait forever), naming the streams it needs and what the cache has."""
    model = tiny("deepseek_v32")
    kw = dict(cache_slots=8, max_context=64, **QUICK)
    probe = Server(model, "hisparse", kv_budget_gib=1.0, max_batch=1, **kw)
    budget = probe.workspace_bytes + 4 * probe.cache.host.capacity + probe.lane_bytes
    server = Server(model, "hybrid", kv_budget_gib=budget / GIB, max_batch=1, **kw)
    server.open()
    with pytest.raises(ValueError, match=r"a prompt of 58 tokens needs 16 of the cache's streams in hybrid mode .*"
                                         r"the cache has 15 \(raise kv_budget_gib\)"):
        server.submit(Request(torch.arange(58) % 97, 2))
    assert not server.busy
    server.close()


def test_write_run_token_writes_resident_lanes_only_and_reads_nothing_on_the_host():
    """Hybrid's decode write for Quest / NSA lanes resident in runs: the resident lanes' key and value at
    their row and offset; the other lanes write the first resident lane's token to its own place
    (so the pool changes only there); and no op reads a device value on the host (a CUDA graph
    capture refuses `aten._local_scalar_dense`, e.g. from indexing with a 0-d tensor)."""
    from engine_checks import host_reads

    from hisparse.runtime import write_run_token

    gen = torch.Generator().manual_seed(5)
    rows, hkv, unit, d = 12, 2, 4, 3
    for resident in ([False, True, False, True], [False, False, False, False], [True, False, False, False]):
        pool = torch.randn(rows, 2, unit, d, generator=gen)
        row_base = torch.tensor([[0, 1], [2, 4], [6, 7], [8, 10]])
        res = torch.tensor(resident)
        pos = torch.tensor([1, 5, 2, 6])
        key, value = torch.randn(4, hkv, d, generator=gen), torch.randn(4, hkv, d, generator=gen)
        expected = pool.clone()
        for lane in range(4):
            if resident[lane]:
                for h in range(hkv):
                    r = row_base[lane, h] + pos[lane] // unit
                    expected[r, 0, pos[lane] % unit], expected[r, 1, pos[lane] % unit] = key[lane, h], value[lane, h]
        with host_reads() as reads:
            write_run_token(pool, row_base, res, pos, key, value, unit)
        assert torch.equal(pool, expected), resident
        assert not reads, reads

"""The serving scheduler: requests joining and leaving one batch give bitwise the same tokens and
logits in resident and hierarchical modes under one schedule, agree with each request run alone,
stay within the memory budgets, and impossible requests are refused (tiny models, interpreter)."""
import functools
import random

import pytest
import torch

from hisparse.engine import Engine
from hisparse.host_pool import HostPool
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import TINY_CONFIGS, randomize_
from hisparse.serving import GIB, Request, Schedule, Server, percentile

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# per family: B, and Quest's token budget (k = 3 pages); few layers and the eager prefill keep the
# interpreter quick (both modes prefill alike: the kernels' prefill has its own tests)
SETTINGS = {"deepseek_v32": dict(cache_slots=16), "glm_moe_dsa": dict(cache_slots=8),
            "llama": dict(cache_slots=4, token_budget=48), "nsa": dict(cache_slots=8)}
QUICK = dict(prefill="reference")
MAX_CONTEXT = 140


# NSA: one layer, k = 4 selected blocks (B = 2k above) and a 64-token window (its interpreter decode step is the
# slowest, and costs with k and the window: tests/test_engine_nsa.py's shape)
NSA = {"num_hidden_layers": 1, "num_selected_blocks": 4, "sliding_window": 64}


@functools.cache
def tiny(family: str):
    # llama: 2 dense + 1 Quest; NSA: the checks are per layer
    overrides = {"deepseek_v32": {"num_hidden_layers": 2}, "nsa": NSA}.get(family, {})
    model = build_model(config_from_dict(dict(TINY_CONFIGS[family], **overrides))).to(DEVICE).float()
    randomize_(model, 5)
    return model


SHAPES = ((37, 6), (5, 5), (66, 4), (12, 1), (20, 3))   # (prompt, new tokens): under a unit, across a block, one token


def requests(seed: int, n: int = 4, vocab: int = 97) -> list[Request]:
    """The first n of SHAPES, with random prompts."""
    gen = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(0, vocab, (length,), generator=gen), new) for length, new in SHAPES[:n]]


def fresh(reqs: list[Request]) -> list[Request]:
    return [Request(r.prompt.clone(), r.max_new_tokens, r.arrival) for r in reqs]


@pytest.mark.parametrize("family", list(SETTINGS))
def test_resident_replay_of_a_hierarchical_schedule_is_bitwise(family):
    """hisparse chooses (3 lanes, chunks of 24 prompt tokens, a closed loop of 3 clients: requests
    join and leave beside each other); resident replays its schedule: every token and logit equal."""
    model = tiny(family)
    kw = dict(SETTINGS[family], max_context=MAX_CONTEXT, prefill_chunk=24, keep_logits=True, **QUICK)
    reqs = requests(seed=len(family))
    if family == "nsa":            # its decode step is the interpreter's slowest: fewer tokens
        reqs = [Request(r.prompt, min(r.max_new_tokens, 3)) for r in reqs]
    run = Server(model, "hisparse", kv_budget_gib=0.05, max_batch=3, **kw).serve(reqs, clients=3)
    assert max(run.running_batch) >= 2, "no two requests ever shared a step: the test checks nothing of churn"
    again = Server(model, "resident", lanes=run.schedule.lanes, **kw).serve(fresh(reqs), clients=3,
                                                                            replay=run.schedule)
    for a, b in zip(run.requests, again.requests):
        assert a.tokens == b.tokens and len(a.tokens) == a.max_new_tokens, f"request {a.rid}"
        assert len(a.logits) == len(b.logits) == a.max_new_tokens
        for step, (x, y) in enumerate(zip(a.logits, b.logits)):
            assert torch.equal(x, y), f"{family}: request {a.rid}, token {step}: logits differ"


@pytest.mark.parametrize("family", ["deepseek_v32", "llama"])
def test_each_request_agrees_with_its_run_alone(family):
    """Greedy tokens equal Engine.generate's for the prompt alone (the same prefill chunks); logits
    within float32 noise: a batch of other lengths beside it may reorder no sum here, but the MoE's
    expert loop groups rows by expert, so equality is not promised."""
    model, kw = tiny(family), SETTINGS[family]
    reqs = requests(seed=11, n=3)
    run = Server(model, "hisparse", max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=2, prefill_chunk=32,
                 keep_logits=True, **QUICK, **kw).serve(reqs)
    engine = Engine(model, "resident", chunk_size=32, **QUICK, **{k: v for k, v in kw.items() if k == "token_budget"})
    for r in run.requests:
        alone = engine.generate([r.prompt], new_tokens=r.max_new_tokens)
        assert r.tokens == alone.tokens[0].tolist(), f"request {r.rid}"
        for x, y in zip(r.logits, alone.logits):
            torch.testing.assert_close(x, y[0], rtol=1e-4, atol=1e-4)


def test_budgets_are_never_exceeded_and_the_host_budget_queues():
    """The GPU bytes the server holds (lanes, cache, workspace, measured on its tensors) stay within
    kv_budget_gib, and the host rows in use within host_budget_gib; a host pool that holds two
    requests' rows runs at most two requests at once, though four lanes fit the GPU."""
    model, kw = tiny("deepseek_v32"), SETTINGS["deepseek_v32"]
    row = 48 * 4                                      # float32 latent row: 32 + 16 values
    host_gib = 140 * row / GIB                        # 140 rows: two requests of 33 tokens in two layers
    host = Server(model, "hisparse", max_context=MAX_CONTEXT, kv_budget_gib=0.05, host_budget_gib=host_gib,
                  max_batch=4, **QUICK, **kw)
    assert host.lanes == 4
    gen = torch.Generator().manual_seed(3)
    run = host.serve([Request(torch.randint(0, 97, (30,), generator=gen), 3) for _ in range(4)], clients=4)
    assert max(run.running_batch) == 2
    assert run.peak_host_rows <= 140
    assert run.peak_gpu_bytes <= host.kv_budget
    assert all(len(r.tokens) == r.max_new_tokens for r in run.requests)
    lane_budget = (2 * host.lane_bytes + host.workspace_bytes + 4 * host.cache.host.capacity) / GIB
    tight = Server(model, "hisparse", max_context=MAX_CONTEXT, kv_budget_gib=lane_budget, host_budget_gib=host_gib,
                   max_batch=8, **kw)
    assert tight.lanes == 2
    assert tight.gpu_bytes() + tight.workspace_bytes <= tight.kv_budget
    resident = Server(model, "resident", max_context=MAX_CONTEXT, kv_budget_gib=lane_budget, max_batch=8, **QUICK)
    run = resident.serve(requests(seed=3, n=3))
    assert run.peak_gpu_bytes <= resident.kv_budget
    assert resident.gpu_bytes() == resident.lanes * resident.lane_bytes


def test_host_pool_keeps_its_capacity_under_churn():
    """Hundreds of regions of random lengths allocated and freed in random order: `fits` agrees with
    `alloc` throughout, and once everything is freed the pool holds one region of its whole capacity."""
    pool = HostPool(10_000, 4, dtype=torch.float32, pin=False)
    rng = random.Random(0)
    held = []
    for _ in range(600):
        if held and (rng.random() < 0.45 or pool.free_rows < 50):
            pool.release(held.pop(rng.randrange(len(held))))
            continue
        size = rng.randint(1, 900)
        fits = pool.fits([size])
        try:
            held.append(pool.alloc(size))
            assert fits
        except MemoryError:
            assert not fits
    for start in held:
        pool.release(start)
    assert pool.free_rows == pool.capacity and pool.fits([pool.capacity])
    assert pool.alloc(pool.capacity) == 0


def test_server_churn_frees_every_stream():
    """After a run every stream is closed and every host row free: a later run admits the longest request."""
    model, kw = tiny("llama"), SETTINGS["llama"]
    server = Server(model, "hisparse", max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=2, **QUICK, **kw)
    server.serve(requests(seed=4, n=3), clients=2)
    assert not server.cache._open and server.cache.host.free_rows == server.cache.host.capacity
    assert all(r is None for r in server.lane_request)
    longest = Request(torch.zeros(MAX_CONTEXT - 1, dtype=torch.int64), 1)
    assert server.serve([longest]).requests[0].tokens


def test_impossible_requests_are_refused_before_anything_runs():
    model, kw = tiny("deepseek_v32"), SETTINGS["deepseek_v32"]
    server = Server(model, "hisparse", max_context=64, kv_budget_gib=0.05, host_budget_gib=100 * 48 * 4 / GIB,
                    max_batch=2, **kw)
    with pytest.raises(ValueError, match="needs 66 tokens, over the server's max_context=64"):
        server.serve([Request(torch.zeros(60, dtype=torch.int64), 6)])
    with pytest.raises(ValueError, match="host pool rows; the pool holds 100"):
        server.serve([Request(torch.zeros(50, dtype=torch.int64), 4)])
    with pytest.raises(ValueError, match="token id 97 out of range"):
        server.serve([Request(torch.tensor([1, 97]), 2)])
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        server.serve([Request(torch.tensor([1, 2]), 0)])
    with pytest.raises(ValueError, match="the schedule ran 3 lanes, this server has 2"):
        server.serve([Request(torch.tensor([1, 2]), 2)], replay=Schedule(3))
    assert not server.cache._open and server.cache.host.free_rows == server.cache.host.capacity
    with pytest.raises(ValueError, match="holds no lane"):
        Server(model, "resident", max_context=64, kv_budget_gib=1e-6)
    with pytest.raises(ValueError, match="needs cache_slots"):
        Server(model, "hisparse", max_context=64, kv_budget_gib=0.05)
    with pytest.raises(ValueError, match="kv_budget_gib must be a positive, finite number"):
        Server(model, "resident", max_context=64, kv_budget_gib="1")


def test_summary_metrics():
    reqs = [Request(torch.tensor([1]), 3, arrival=0.0), Request(torch.tensor([1]), 1, arrival=1.0)]
    reqs[0].token_times, reqs[0].prefill_start, reqs[0].tokens = [0.5, 0.7, 1.3], 0.1, [1, 2, 3]
    reqs[1].token_times, reqs[1].prefill_start, reqs[1].tokens = [1.5], 1.2, [4]
    from hisparse.serving import ServingRun
    out = ServingRun(reqs, Schedule(1), 2.0, [1, 1], 0, 0).summary()
    assert out["output_tokens"] == 4 and out["tokens_per_s"] == pytest.approx(4 / 1.5)
    assert out["ttft_ms_p50"] == pytest.approx(500.0) and out["tpot_ms_p50"] == pytest.approx(400.0)
    assert out["itl_ms_p50"] == pytest.approx(400.0) and out["itl_ms_p99"] == pytest.approx(200 + 0.99 * 400)
    assert out["queue_ms_p99"] == pytest.approx(100 + 0.99 * 100)
    assert percentile([], 50) != percentile([], 50)          # nan


def test_a_runs_host_rows_peak_counts_the_rows_in_use_at_its_start_and_until_its_end():
    from hisparse.serving import ServingRun
    run = ServingRun([], Schedule(1), 4.0, [], 0, 128, host_bytes=[(0.0, 0), (1.0, 64), (2.0, 128), (3.0, 64)])
    assert run.host_bytes_peak(1.5, 1.9) == 64 and run.host_bytes_peak(0.5, 2.0) == 128
    assert run.host_bytes_peak(2.5, 9.0) == 128 and run.host_bytes_peak(0.0, 0.5) == 0 and run.host_bytes_peak() == 128


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(SETTINGS))
def test_graphed_serving_replay_is_bitwise(family):
    """On a GPU with every decode step a replay of one captured graph: the lanes' buffers rewritten
    between replays as requests join and leave, resident replaying hisparse's schedule bitwise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = tiny(family)
    kw = dict(SETTINGS[family], max_context=MAX_CONTEXT, prefill_chunk=24, keep_logits=True, graph=True)
    reqs = requests(seed=7, n=5)
    run = Server(model, "hisparse", kv_budget_gib=0.05, max_batch=3, **kw).serve(reqs, clients=3)
    assert max(run.running_batch) >= 2
    again = Server(model, "resident", lanes=run.schedule.lanes, **kw).serve(fresh(reqs), clients=3,
                                                                            replay=run.schedule)
    for a, b in zip(run.requests, again.requests):
        assert a.tokens == b.tokens, f"request {a.rid}"
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), f"request {a.rid}"


def test_cancel_finds_the_request_itself_among_waiting_ones():
    """Requests are compared as objects: cancelling a running request while two others wait (their
    prompts of one length, so an equality check would compare tensors) frees its lane, and the
    waiting ones then run."""
    model, kw = tiny("deepseek_v32"), dict(SETTINGS["deepseek_v32"], **QUICK)
    server = Server(model, "hisparse", max_context=64, kv_budget_gib=0.05, max_batch=1, **kw)
    server.open()
    first = server.submit(Request(torch.arange(10), 5, arrival=float("nan")))
    waiting = [server.submit(Request(torch.arange(12) + i, 2, arrival=float("nan"))) for i in range(2)]
    server.step()
    assert server.running == [first] and server.waiting == waiting
    server.cancel(first)
    while server.busy:
        server.step()
    run = server.close()
    assert [r.rid for r in run.requests] == [w.rid for w in waiting]
    assert all(len(r.tokens) == 2 for r in run.requests)


def test_step_by_step_with_a_cancelled_request():
    """open / submit / step / cancel / close: a request cancelled mid-decode frees its lane, streams
    and host rows at once; the others finish with the tokens they get in a run without it."""
    model, kw = tiny("deepseek_v32"), dict(SETTINGS["deepseek_v32"], **QUICK)
    server = Server(model, "hisparse", max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=2, **kw)
    reqs = requests(seed=9, n=2)
    seen = []
    server.open()
    kept = server.submit(Request(reqs[0].prompt, reqs[0].max_new_tokens, arrival=float("nan")))
    gone = server.submit(Request(reqs[1].prompt, 5, arrival=float("nan"), on_token=lambda r, t: seen.append(t)))
    while len(gone.tokens) < 2:
        server.step()
    rows_in_use = server.cache.host.capacity - server.cache.host.free_rows
    server.cancel(gone)
    assert gone.lane is None and server.cache.host.capacity - server.cache.host.free_rows < rows_in_use
    while server.busy:
        server.step()
    run = server.close()
    assert seen == gone.tokens and len(gone.tokens) < 5
    assert [r.rid for r in run.requests] == [kept.rid] and len(kept.tokens) == kept.max_new_tokens
    assert not server.cache._open and server.cache.host.free_rows == server.cache.host.capacity
    alone = Server(model, "hisparse", max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=2, **kw)
    assert alone.serve([Request(reqs[0].prompt, reqs[0].max_new_tokens)]).requests[0].tokens == kept.tokens


def test_requests_replay_their_own_selections():
    """Each request replays its own trace (a synthetic draw of its own seed): hisparse and resident
    under one schedule stay bitwise; a request that brings a trace to a server built without one is
    refused."""
    from hisparse.synthetic import batch_workload, preset
    model, kw = tiny("deepseek_v32"), dict(SETTINGS["deepseek_v32"], **QUICK, keep_logits=True)
    gen = torch.Generator().manual_seed(2)
    reqs = [Request(torch.randint(0, 97, (n,), generator=gen), new) for n, new in ((37, 5), (40, 4), (66, 3))]
    k, layers = model.config.index_topk, model.config.num_hidden_layers
    draws = torch.from_numpy(batch_workload(preset("tiny", context=37, steps=6, k=k, layers=layers, sinks=1, window=2),
                                            3, seed=0).selections.copy())          # [steps, layers, 3, k]
    assert not torch.equal(draws[:, :, 0], draws[:, :, 1])
    for i, r in enumerate(reqs):
        r.selections = draws[:, :, i]
    server = Server(model, "hisparse", max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=3,
                    selections=draws[:, :, 0], **kw)
    run = server.serve(reqs, clients=3)
    again = [Request(r.prompt, r.max_new_tokens, selections=r.selections) for r in reqs]
    resident = Server(model, "resident", max_context=MAX_CONTEXT, lanes=run.schedule.lanes, selections=draws[:, :, 0], **kw)
    for a, b in zip(run.requests, resident.serve(again, clients=3, replay=run.schedule).requests):
        assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    with pytest.raises(ValueError, match="build the server with selections="):
        Server(model, "resident", max_context=MAX_CONTEXT, kv_budget_gib=0.05, **kw).serve(
            [Request(reqs[0].prompt, 2, selections=draws[:, :, 0])])


def test_a_schedule_replays_step_by_step_and_an_empty_run_summarises():
    """open(replay) / submit / step until not busy: the replayed run ends (its admitted requests leave
    the queue) with the recorded run's tokens; a run of no requests gives a summary of zeros and nans."""
    model, kw = tiny("deepseek_v32"), dict(SETTINGS["deepseek_v32"], **QUICK, max_context=MAX_CONTEXT)
    reqs = requests(seed=6, n=3)
    run = Server(model, "hisparse", kv_budget_gib=0.05, max_batch=2, **kw).serve(reqs)
    again = Server(model, "resident", lanes=run.schedule.lanes, **kw)
    again.open(replay=run.schedule)
    for r in run.requests:
        again.submit(Request(r.prompt, r.max_new_tokens))
    while again.busy:
        again.step()
    replayed = again.close()
    assert [r.tokens for r in replayed.requests] == [r.tokens for r in run.requests]
    empty = Server(model, "resident", lanes=1, **kw).serve([]).summary()
    assert empty["requests"] == 0 and empty["output_tokens"] == 0

"""Prefill overlapping decode (DSA): an empty lane's decode write lands where no request reads (its
last position; hybrid's resident write on the cache's trash row), so a prefill into that lane may run
beside the step; with `prefill_overlap` the prefill runs a few layers an iteration between decode
steps, and every token and logit stays bitwise the resident replay's (tiny models, interpreter)."""
import dataclasses

import pytest
import torch
from test_serving import MAX_CONTEXT, QUICK, SETTINGS, fresh, requests, tiny
from test_serving_hybrid import hybrid_server

from hisparse.engine import Engine
from hisparse.serving import Request, Server

PATTERN = 7777.0            # no value a tiny model's step computes


def _serve_one_in_lane_0(server: Server, steps: int, fill) -> None:
    """One request decoding in lane 0, the others empty: `fill()` once it decodes, then `steps` steps."""
    server.open()
    request = server.submit(Request(torch.arange(9) % 97, steps + 2, arrival=float("nan")))
    server.step()                                    # prefilled (one chunk), joined, first decode step
    assert request.lane == 0 and len(request.tokens) == 2
    fill()
    for _ in range(steps):
        server.step()
    while server.busy:
        server.step()
    server.close()


def test_an_empty_lanes_decode_write_lands_on_its_last_position_only():
    """Lanes 1 and 2 empty beside a decoding request: their indexer keys (and resident latents) below
    position capacity - 1 keep the values put there, bit for bit, and position capacity - 1 is what
    the step wrote (a read-modify-write at position 0, the old way, would leave it as filled)."""
    model = tiny("deepseek_v32")
    for mode in ("resident", "hisparse"):
        server = Server(model, mode, lanes=3, max_context=MAX_CONTEXT, **SETTINGS["deepseek_v32"], **QUICK)
        pools = [t for kv in server.layers for t in (kv.index_keys, kv.latent) if t is not None]
        assert len(pools) == (4 if mode == "resident" else 2)         # 2 layers: keys (and latents)

        def fill():
            for pool in pools:
                pool[1:].fill_(PATTERN)
        _serve_one_in_lane_0(server, 3, fill)
        for pool in pools:
            assert pool.shape[1] == MAX_CONTEXT
            assert torch.equal(pool[1:, :-1], torch.full_like(pool[1:, :-1], PATTERN)), mode
            assert (pool[1:, -1] != PATTERN).all(), f"{mode}: an empty lane's step wrote nothing at capacity - 1"


def test_hybrid_writes_of_lanes_not_resident_go_to_the_trash_row():
    """Hybrid, one request resident in lane 0 and two empty lanes: between steps the only rows of
    `cache.gpu_rows` that change are the resident lane's newest token's, one a layer, and the trash
    row past every stream's (a write to row 0, the old way, could land in a run being prefilled)."""
    server = hybrid_server(tiny("deepseek_v32"), extra_runs=1, cache_slots=48, prefill_chunk=24, **QUICK)
    cache = server.cache
    assert cache.trash_row == cache.max_streams * (cache.cache_slots + 1) == cache.gpu_rows.shape[0] - 1
    changed = []
    decode = server._decode_step

    def watched(*warm_up):
        if warm_up:
            return decode(*warm_up)
        request = server.lane_request[0]
        cache.gpu_rows[cache.trash_row] = PATTERN      # the empty lanes write the same values every step
        before = cache.gpu_rows.clone()
        logits = decode()
        rows = (cache.gpu_rows != before).any(-1).nonzero()[:, 0].tolist()
        want = sorted(int(kv.row_base[0]) + request.length for kv in server.layers) + [cache.trash_row]
        changed.append((rows, want))
        return logits

    server._decode_step = watched

    def fill():
        assert server.layers[0].resident[0] and not server.layers[0].resident[1:].any()
        cache.gpu_rows.fill_(PATTERN)
    _serve_one_in_lane_0(server, 3, fill)
    assert len(changed) >= 3
    for rows, want in changed[1:]:                 # (the first step's rows were not filled yet)
        assert rows == want


def _drain(pieces) -> tuple[int, torch.Tensor]:
    """Run a prefill_pieces generator to its end: (pieces run, its logits)."""
    count = 0
    while True:
        count += 1
        try:
            next(pieces)
        except StopIteration as done:
            return count, done.value


def test_prefill_pieces_are_bitwise_the_prefill():
    """glm_moe_dsa (3 layers, one sharing its anchor's selection), two chunks: one layer a piece (3
    pieces a chunk) or two (2 pieces) leaves the logits and the state bitwise as `prefill` does."""
    model = tiny("glm_moe_dsa")
    prompt = torch.randint(0, 97, (1, 29), generator=torch.Generator().manual_seed(1))
    whole = model.new_state(1, 40)
    want = [model.prefill(part, whole, last_logits=True) for part in prompt.split(17, dim=1)]
    layers = model.config.num_hidden_layers
    for per in (1, 2, layers):
        state = model.new_state(1, 40)
        for part, logits in zip(prompt.split(17, dim=1), want):
            count, got = _drain(model.prefill_pieces(part, state, per, last_logits=True))
            assert count == -(-layers // per) and torch.equal(got, logits), per
        assert torch.equal(state.lengths, whole.lengths) and state.max_length == whole.max_length == 29
        for a, b in zip(state.layers, whole.layers):
            assert torch.equal(a.latent, b.latent)
            assert (a.index_keys is None) == (b.index_keys is None)
            assert a.index_keys is None or torch.equal(a.index_keys, b.index_keys)


def random_requests(seed: int, n: int = 6) -> list[Request]:
    """n requests of random prompts (1 to 3 chunks of 24), new tokens (1 to 9) and arrivals (0 to 0.1 s)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(5, 70, (1,), generator=gen))
        new = int(torch.randint(1, 10, (1,), generator=gen))
        arrival = float(torch.rand(1, generator=gen)) * 0.1
        out.append(Request(torch.randint(0, 97, (length,), generator=gen), new, arrival=arrival))
    return out


def overlapped(run) -> int:
    """Iterations of a run that ran a decode step and a prefill piece of part of the layers."""
    return sum(1 for it in run.schedule.iterations if it.decoded and it.prefilled and it.layers != (0, LAYERS[0]))


LAYERS = [0]


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_overlapped_prefill_replayed_by_resident_is_bitwise(family, graph=False, prefill_sms=None):
    """hisparse with prefill_overlap (one layer a piece, chunks of 24: prompts of one to three chunks,
    random arrivals) records its schedule; resident without overlap replays it, every piece in its
    iteration: every token and logit equal, and the joins came between decode steps."""
    model = tiny(family)
    LAYERS[0] = model.config.num_hidden_layers
    kw = dict(SETTINGS[family], max_context=MAX_CONTEXT, prefill_chunk=24, keep_logits=True, graph=graph,
              **({} if graph else QUICK))
    reqs = random_requests(seed=len(family))
    server = Server(model, "hisparse", kv_budget_gib=0.05, max_batch=3, prefill_overlap=True, prefill_layers=1,
                    prefill_sms=prefill_sms, **kw)
    assert (server.runner.green is not None) == (prefill_sms is not None and graph)    # graph: on a GPU
    run = server.serve(reqs)
    assert max(run.running_batch) >= 2, "no two requests ever shared a step"
    assert overlapped(run) >= 4, "no decode step ran beside a prefill piece: the test checks no overlap"
    assert any(len(r.prompt) > 48 for r in run.requests)               # a prompt of three chunks
    pieces = [it.layers for it in run.schedule.iterations if it.prefilled]
    assert set(pieces) == {(i, i + 1) for i in range(LAYERS[0])}
    again = Server(model, "resident", lanes=run.schedule.lanes, **kw).serve(fresh(reqs), replay=run.schedule)
    assert [it for it in again.schedule.iterations] == run.schedule.iterations
    for a, b in zip(run.requests, again.requests):
        assert a.tokens == b.tokens and len(a.tokens) == a.max_new_tokens, f"request {a.rid}"
        assert len(a.logits) == len(b.logits) == a.max_new_tokens
        for step, (x, y) in enumerate(zip(a.logits, b.logits)):
            assert torch.equal(x, y), f"{family}: request {a.rid}, token {step}: logits differ"
    assert not server.cache._open and server.cache.host.free_rows == server.cache.host.capacity


def test_an_overlapping_server_replays_a_schedule_without_overlap_bitwise():
    """The other way round: hisparse without overlap (whole chunks, each request joining right after
    its last one) records; resident with prefill_overlap replays it (its earlier chunks after the
    decode step, the last one before it, as the schedule joins): every token and logit equal."""
    model = tiny("deepseek_v32")
    kw = dict(SETTINGS["deepseek_v32"], max_context=MAX_CONTEXT, prefill_chunk=24, keep_logits=True, **QUICK)
    gen = torch.Generator().manual_seed(5)
    reqs = [Request(torch.randint(0, 97, (n,), generator=gen), new) for n, new in ((30, 6), (66, 5), (50, 4), (20, 3))]
    run = Server(model, "hisparse", kv_budget_gib=0.05, max_batch=3, **kw).serve(reqs, clients=3)
    assert all(it.layers in (None, (0, 2)) for it in run.schedule.iterations)
    assert sum(it.prefilled > 0 and it.decoded and not it.joined for it in run.schedule.iterations) >= 2
    again = Server(model, "resident", lanes=run.schedule.lanes, prefill_overlap=True, **kw).serve(
        fresh(reqs), clients=3, replay=run.schedule)
    for a, b in zip(run.requests, again.requests):
        assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), f"request {a.rid}"


def test_overlapped_requests_agree_with_each_run_alone():
    """Greedy tokens equal Engine.generate's for each prompt alone (chunks of 24 there too), with
    the prefill in pieces of two layers beside the other requests' decode steps (as
    test_serving's solo check: the MoE's grouping by expert promises tokens, not logits' bits)."""
    model, kw = tiny("deepseek_v32"), SETTINGS["deepseek_v32"]
    reqs = random_requests(seed=21, n=4)
    run = Server(model, "hisparse", max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=3, prefill_chunk=24,
                 prefill_overlap=True, prefill_layers=1, keep_logits=True, **QUICK, **kw).serve(reqs, clients=3)
    assert overlapped(run) >= 2
    engine = Engine(model, "resident", chunk_size=24, **QUICK)
    for r in run.requests:
        alone = engine.generate([r.prompt], new_tokens=r.max_new_tokens)
        assert r.tokens == alone.tokens[0].tolist(), f"request {r.rid}"
        for x, y in zip(r.logits, alone.logits):
            torch.testing.assert_close(x, y[0], rtol=1e-4, atol=1e-4)


def test_bad_overlap_options_are_refused():
    model, kw = tiny("deepseek_v32"), dict(SETTINGS["deepseek_v32"], max_context=64, lanes=2)
    with pytest.raises(ValueError, match="prefill_overlap must be True or False, got 'yes'"):
        Server(model, "hisparse", prefill_overlap="yes", **kw)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="prefill_layers must be an int >= 1"):
            Server(model, "hisparse", prefill_overlap=True, prefill_layers=bad, **kw)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="prefill_sms must be an int >= 1"):
            Server(model, "hisparse", prefill_overlap=True, prefill_sms=bad, **kw)
    with pytest.raises(ValueError, match="prefill_sms=8 confines the prefill pieces of prefill_overlap=True"):
        Server(model, "hisparse", prefill_sms=8, **kw)
    off_gpu = Server(model, "hisparse", prefill_overlap=True, prefill_sms=8, **kw)
    assert off_gpu.prefill_sms == 8 and off_gpu.runner.side is None and off_gpu.runner.green is None   # pieces run inline
    with pytest.raises(ValueError, match="prefill_overlap=True is built for DSA models.*Quest"):
        Server(tiny("llama"), "hisparse", lanes=2, max_context=64, cache_slots=4, token_budget=48,
               prefill_overlap=True)
    with pytest.raises(ValueError, match="layers_per_piece must be an int >= 1, got 0"):
        next(model.prefill_pieces(torch.zeros(1, 3, dtype=torch.int64), model.new_state(1, 3), 0))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_graphed_overlapped_prefill_is_bitwise_as_resident(family):
    """On a GPU: decode steps replayed from one graph on the higher-priority stream, prefill pieces on
    the side stream beside them, one in flight (the kernels' prefill), resident replaying the schedule
    bitwise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    test_overlapped_prefill_replayed_by_resident_is_bitwise(family, graph=True)


@pytest.mark.gpu
def test_pieces_in_a_green_context_are_bitwise_as_resident():
    """On a GPU with prefill_sms: the pieces' side stream in a CUDA green context of 16 SMs, the
    graphed steps on the rest; resident replaying the schedule bitwise (the kernels' grids do not
    depend on where their blocks run). A context of every SM is refused before anything runs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hisparse.serving import side_stream
    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).multi_processor_count
    with pytest.raises(ValueError, match=f"prefill_sms={total}: this GPU has {total} SMs"):
        side_stream(device, total)
    test_overlapped_prefill_replayed_by_resident_is_bitwise("deepseek_v32", graph=True, prefill_sms=16)


def test_hybrid_with_overlap_is_bitwise_as_resident():
    """DSA hybrid (room for one resident request beyond the lanes) with prefill_overlap: requests
    resident in runs and hierarchical, one demoted, prefills in pieces beside the decode steps;
    resident replaying the schedule gives every token and logit bitwise."""
    model = tiny("deepseek_v32")
    kw = dict(cache_slots=48, prefill_chunk=24, keep_logits=True, **QUICK)
    server = hybrid_server(model, extra_runs=1, prefill_overlap=True, prefill_layers=1, **kw)
    reqs = requests(seed=4, n=5)                   # as test_serving_hybrid's, which demote
    run = server.serve(reqs, clients=3)
    summary = run.summary()
    assert summary["resident_admissions"] >= 1 and summary["demotions"] >= 1, summary
    assert sum(it.decoded and it.layers == (0, 1) for it in run.schedule.iterations) >= 2
    again = Server(model, "resident", lanes=run.schedule.lanes, max_context=MAX_CONTEXT, **kw).serve(
        fresh(reqs), clients=3, replay=run.schedule)
    for a, b in zip(run.requests, again.requests):
        assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), f"request {a.rid}"
    assert server.cache.free_streams() == server.cache.max_streams


class _Event:
    """An event as `_Prefill.piece_done` holds one: `query()` says whether its piece is done."""
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _one_decoding_one_arriving(first_out: int, second_prompt: int):
    """An open overlapping server (one-layer pieces, chunks of 24) with a first request decoding and a
    second of `second_prompt` tokens just submitted: (server, first, second)."""
    server = Server(tiny("deepseek_v32"), "hisparse", kv_budget_gib=0.05, max_batch=2, prefill_overlap=True,
                    prefill_layers=1, max_context=MAX_CONTEXT, prefill_chunk=24, **SETTINGS["deepseek_v32"], **QUICK)
    server.open()
    first = server.submit(Request(torch.arange(9) % 97, first_out, arrival=float("nan")))
    while not first.tokens:
        server.step()
    return server, first, server.submit(Request(torch.arange(second_prompt) % 89, 3, arrival=float("nan")))


def next_piece(server, job, plan):
    return server.runner.next_piece(job, plan, server.scheduler, bool(server.running))


def test_an_iteration_launches_no_piece_while_the_previous_one_runs():
    """One piece in flight (a GPU's side stream): while the latest piece's event is not done, the
    iteration's piece is None, the decode step runs, the schedule records an iteration without a
    piece; once it is done the next piece follows where the last ended. With nothing decoding the
    server waits for the piece instead. A replayed schedule runs its pieces whatever the event says."""
    server, first, second = _one_decoding_one_arriving(6, 40)
    server.step()                                       # admits the second, its first piece (layer 0)
    job = server._prefilling
    assert job is not None and job.request is second and job.layer == 1
    job.piece_done = _Event(False)
    tokens = len(first.tokens)
    server.step()
    assert job.layer == 1 and len(first.tokens) == tokens + 1     # no piece, the step ran
    assert not server.schedule.iterations[-1].prefilled and server.schedule.iterations[-1].decoded
    assert next_piece(server, job, None) is None
    job.piece_done = _Event(True)
    assert next_piece(server, job, None) == (24, 1, 2)
    job.piece_done = _Event(False)
    plan = dataclasses.replace(server.schedule.iterations[-1], prefilled=24, layers=(1, 2))
    assert next_piece(server, job, plan) == (24, 1, 2)            # a replay follows its schedule
    while first.lane is not None:                      # the first request leaves
        job.piece_done = None
        server.step()
    job.piece_done = _Event(False)
    assert not server.running and next_piece(server, job, None) is not None   # nothing decodes: it waits
    assert job.piece_done.done
    job.piece_done = None
    while server.busy:
        server.step()
    server.close()
    assert len(second.tokens) == 3


def test_a_finished_prompt_joins_once_its_last_piece_is_done():
    """Overlap on a GPU: a prompt whose last piece still runs (its `finished` event not done) does not
    join while lanes decode (the step runs, the schedule records no join); once the event is done,
    or with no lane decoding, it joins."""
    server, first, second = _one_decoding_one_arriving(8, 20)
    while server._prefilling is None or not server._prefilling.complete:
        server.step()
    job = server._prefilling
    assert server.runner.may_join(job, bool(server.running))   # no event (no side stream): at once
    job.finished = _Event(False)
    tokens = len(first.tokens)
    server.step()
    assert server._prefilling is job and not second.tokens and len(first.tokens) == tokens + 1
    assert not server.schedule.iterations[-1].joined
    job.finished = _Event(True)
    assert server.runner.may_join(job, bool(server.running))
    job.finished = None                                 # (joining would wait on it on the main stream)
    server.step()
    assert server._prefilling is None and second.tokens and server.schedule.iterations[-1].joined
    while server.busy:
        server.step()
    server.close()
    idle = Server(server.model, "hisparse", kv_budget_gib=0.05, max_batch=2, prefill_overlap=True,
                  max_context=MAX_CONTEXT, **SETTINGS["deepseek_v32"], **QUICK)
    assert not idle.running and idle.runner.may_join(type(job)(request=second, lane_prefill=None, finished=_Event(False)),
                                                 bool(idle.running))

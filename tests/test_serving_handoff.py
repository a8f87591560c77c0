"""Disaggregated decode: a request handed off with its prompt prefilled elsewhere (`Handoff`) decodes
bitwise as the same request prefilled in place, in resident, hisparse and hybrid modes, every family;
its TTFT counts from its arrival at the decode server; a prefill worker in a process of its own
makes the same handoff; a handoff that does not fit the request is refused before anything is
placed (tiny models, interpreter)."""
import pytest
import torch
from test_serving import MAX_CONTEXT, QUICK, SETTINGS, fresh, requests, tiny
from test_serving_hybrid import HYBRID, hybrid_server, model_of

from hisparse.serving import Request, Server
from hisparse.serving.handoff import PrefillProcess, PrefillWorker, handed_off_schedule

FAMILIES = ["deepseek_v32", "glm_moe_dsa", "llama", "nsa"]


def workload(family: str) -> list[Request]:
    reqs = requests(seed=11, n=5)
    return [Request(r.prompt, min(r.max_new_tokens, 3)) for r in reqs] if family == "nsa" else reqs


def server(family: str, mode: str, **extra) -> Server:
    kw = dict(SETTINGS[family], prefill_chunk=24, keep_logits=True, **QUICK, **extra)
    if mode == "hybrid":
        settings, extra_runs, max_context = HYBRID["llama-shared" if family == "llama" else family]
        kw.update(settings)
        return hybrid_server(model_of("llama-shared" if family == "llama" else family), extra_runs=extra_runs,
                             max_context=max_context, **kw)
    if mode == "resident":
        kw.pop("cache_slots")
    return Server(tiny(family), mode, max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=3, **kw)


def handed_off(srv: Server, reqs: list[Request]) -> list[Request]:
    budget = srv.runtime.token_budget if srv.runtime.family == "Quest" else None
    worker = PrefillWorker(srv.model, prefill_chunk=srv.prefill_chunk, prefill="reference", token_budget=budget)
    out = fresh(reqs)
    for r in out:
        r.handoff = worker.prefill(r.prompt)
    return out


@pytest.mark.parametrize("mode", ["resident", "hisparse", "hybrid"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_handed_off_request_decodes_bitwise_as_one_prefilled_in_place(family, mode):
    reqs = workload(family)
    local = server(family, mode)
    run = local.serve(reqs, clients=3)
    decode = server(family, mode)      # the same batches at every decode step: the same logits
    again = decode.serve(handed_off(decode, reqs), clients=3, replay=handed_off_schedule(run.schedule))
    assert not any(it.prefilled for it in again.schedule.iterations), "the decode server prefilled"
    for a, b in zip(run.requests, again.requests, strict=True):
        assert a.tokens == b.tokens and len(a.tokens) == a.max_new_tokens, f"request {a.rid}"
        for step, (x, y) in enumerate(zip(a.logits, b.logits, strict=True)):
            assert torch.equal(x, y), f"{family} {mode}: request {a.rid}, token {step}: logits differ"
    if decode.cache is not None:                        # everything given back
        assert decode.cache.free_streams() == decode.cache.max_streams
        assert decode.cache.host.free_rows == decode.cache.host.capacity
    if mode == "hybrid":
        summary = again.summary()
        assert summary["resident_admissions"] >= 1, summary


def test_handoffs_meet_an_overlapping_servers_batches():
    """In place with prefill beside decode (a join and the next admission in one iteration): the
    handoff schedule admits each request where it joined, and every logit is the same."""
    reqs = workload("deepseek_v32")
    run = server("deepseek_v32", "hisparse", prefill_overlap=True, prefill_layers=1).serve(reqs, clients=3)
    assert any(it.joined and it.admitted >= 0 for it in run.schedule.iterations), "no join beside an admission"
    decode = server("deepseek_v32", "hisparse")
    again = decode.serve(handed_off(decode, reqs), clients=3, replay=handed_off_schedule(run.schedule))
    for a, b in zip(run.requests, again.requests, strict=True):
        assert a.tokens == b.tokens
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True)), f"request {a.rid}"


def test_a_handoff_that_fails_to_place_gives_everything_back_and_stays_queued(monkeypatch):
    import hisparse.dsa.runtime as dsa_runtime
    srv = server("deepseek_v32", "hisparse")
    req = handed_off(srv, workload("deepseek_v32")[:1])[0]

    def broken(self, rows, prompt):
        raise RuntimeError("the transfer broke")
    monkeypatch.setattr(dsa_runtime.LanePrefill, "adopt", broken)
    srv.open()
    req.arrival = float("nan")
    srv.submit(req)
    with pytest.raises(RuntimeError, match="the transfer broke"):
        srv.step()
    assert srv.waiting == [req] and req.lane is None and srv.prefilling is None
    assert srv.cache.free_streams() == srv.cache.max_streams
    assert srv.cache.host.free_rows == srv.cache.host.capacity
    assert srv.close("cancel").cancelled == [req]


def test_a_handoff_made_alike_is_required():
    srv = server("deepseek_v32", "hisparse")
    req = handed_off(srv, workload("deepseek_v32")[:1])[0]
    req.handoff.rows = [tuple(None if t is None else t.double() for t in layer) for layer in req.handoff.rows]
    with pytest.raises(ValueError, match=r"the handoff's layer 0 rows are \[\(torch.float64, .*\(dtype, dims\); this "
                                         r"server's prefill makes \[\(torch.float32, .*other kv_dtype / index_dtype"):
        srv.serve([req])
    fp8 = server("deepseek_v32", "hisparse", index_dtype="fp8")      # bf16 indexer keys where FP8 ones go
    with pytest.raises(ValueError, match=r"the handoff's layer 0 rows are .*None\] \(dtype, dims\); this server's "
                                         r"prefill makes \[.*torch.float8_e4m3fn"):
        fp8.serve([handed_off(srv, workload("deepseek_v32")[:1])[0]])


def test_ttft_counts_from_arrival_at_the_decode_server_and_the_prefill_is_reported_apart():
    srv = server("deepseek_v32", "hisparse")
    reqs = handed_off(srv, workload("deepseek_v32")[:2])
    run = srv.serve(reqs, clients=1)
    for r in run.requests:
        assert r.handoff.prefill_s > 0 and r.ttft >= 0
        assert r.token_times[0] >= r.arrival and r.prefill_start >= r.arrival
    # the decode server admits and joins it in one iteration: its first token before any decode step
    first = run.schedule.iterations[0]
    assert first.admitted == 0 and first.joined and first.prefilled == 0


def test_a_handoff_that_does_not_fit_its_request_is_refused_at_submit():
    srv = server("llama", "hisparse")
    req = handed_off(srv, workload("llama")[:1])[0]
    srv.open()
    wrong = Request(req.prompt[:-1].clone(), 2, arrival=float("nan"))
    wrong.handoff = req.handoff
    with pytest.raises(ValueError, match=r"the handoff holds a prompt of 37 tokens over 3 layers; the "
                                         r"request's prompt has 36 tokens"):
        srv.submit(wrong)
    assert not srv.busy and srv.cache.host.free_rows == srv.cache.host.capacity
    srv.close()


def test_a_cancelled_handed_off_request_gives_everything_back():
    srv = server("nsa", "hisparse")
    reqs = handed_off(srv, workload("nsa")[:2])
    srv.open()
    for r in reqs:
        r.arrival = float("nan")
        srv.submit(r)
    srv.step()
    assert reqs[0].lane is not None and reqs[0].tokens
    srv.cancel(reqs[0])
    while srv.busy:
        srv.step()
    srv.close()
    assert len(reqs[1].tokens) == reqs[1].max_new_tokens
    assert srv.cache.free_streams() == srv.cache.max_streams
    assert srv.cache.host.free_rows == srv.cache.host.capacity


def build_tiny_llama():
    """The tests' tiny llama, built in the worker process (spawned: it imports this module)."""
    return tiny("llama")


def test_a_prefill_worker_process_hands_off_the_same_rows():
    """The worker in a process of its own: its handoff's rows and logits equal the in-process
    worker's, and the request decodes as the in-place one."""
    model = tiny("llama")
    budget = SETTINGS["llama"]["token_budget"]
    prompt = workload("llama")[0].prompt
    local = PrefillWorker(model, prefill_chunk=24, prefill="reference", token_budget=budget).prefill(prompt)
    process = PrefillProcess(build_tiny_llama, prefill_chunk=24, prefill="reference", token_budget=budget)
    try:
        process.submit("first", prompt)
        key, remote = process.get(timeout=300)
    finally:
        process.close()
    assert key == "first" and not process.process.is_alive()
    assert torch.equal(remote.logits, local.logits)
    made_shared = PrefillWorker(model, prefill_chunk=24, prefill="reference", token_budget=budget, shared=True)
    handoff = made_shared.prefill(prompt)           # what the process makes: born shared, not pinned then copied
    tensors = [handoff.logits] + [t for layer in handoff.rows for t in layer if t is not None]
    assert all(t.is_shared() and not t.is_pinned() for t in tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors[1:], [t for layer in local.rows for t in layer
                                                               if t is not None], strict=True))
    for mine, theirs in zip(local.rows, remote.rows, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v32", "llama"])
def test_graphed_handoffs_decode_bitwise_as_in_place(family):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reqs = workload(family)
    run = server(family, "hisparse", graph=True).serve(reqs, clients=3)
    decode = server(family, "hisparse", graph=True)
    again = decode.serve(handed_off(decode, reqs), clients=3, replay=handed_off_schedule(run.schedule))
    for a, b in zip(run.requests, again.requests, strict=True):
        assert a.tokens == b.tokens
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True)), f"request {a.rid}"



@pytest.mark.parametrize("mode", ["resident", "hisparse"])
def test_a_disaggregated_server_prefills_off_its_clock_and_decodes_bitwise_as_in_place(mode):
    """disaggregated=True (a decode instance emulated on one device): each prompt is prefilled at its
    admission, whole, with the clock stopped; the same batches give the same logits as in place."""
    import time
    reqs = workload("deepseek_v32")
    run = server("deepseek_v32", mode).serve(reqs, clients=3)
    decode = server("deepseek_v32", mode, disaggregated=True)
    again = decode.serve(fresh(reqs), clients=3, replay=handed_off_schedule(run.schedule))
    for a, b in zip(run.requests, again.requests, strict=True):
        assert a.tokens == b.tokens
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True)), f"request {a.rid}"
    start = time.perf_counter()
    free = decode.serve(fresh(reqs), clients=3)                 # its own schedule
    wall = time.perf_counter() - start
    assert not any(it.prefilled for it in free.schedule.iterations), "a prefill piece ran on the clock"
    assert all(r.prefill_s > 0 for r in free.requests)
    assert free.wall_s < wall - 0.9 * sum(r.prefill_s for r in free.requests), "the prefills were on the clock"
    assert free.summary()["prefill_elsewhere_ms_p50"] > 0
    assert [r.tokens for r in free.requests] == [r.tokens for r in run.requests]


def test_a_disaggregated_server_refuses_a_schedule_with_prefill_pieces():
    reqs = workload("deepseek_v32")[:2]
    run = server("deepseek_v32", "hisparse").serve(reqs, clients=2)
    with pytest.raises(ValueError, match=r"replay handed_off_schedule\(run.schedule\), not a schedule with prefill"):
        server("deepseek_v32", "hisparse", disaggregated=True).serve(fresh(reqs), clients=2, replay=run.schedule)


def test_disaggregated_refuses_prefill_overlap():
    with pytest.raises(ValueError, match="disaggregated=True prefills elsewhere"):
        server("deepseek_v32", "hisparse", disaggregated=True, prefill_overlap=True)


@pytest.mark.parametrize("mode", ["resident", "hisparse", "hybrid"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_handed_off_is_prefilled_on_from_its_length_bitwise_as_in_place(family, mode):
    """A handoff of the prompt's first 48 tokens (two chunks of 24, as the server chunks them): the
    server prefills the rest from token 48 and decodes bitwise as the same request prefilled whole in
    place (alone, so the batches are the same)."""
    req = next(r for r in workload(family) if len(r.prompt) > 48)
    local = server(family, mode).serve(fresh([req]))
    decode = server(family, mode)
    budget = decode.runtime.token_budget if decode.runtime.family == "Quest" else None
    worker = PrefillWorker(decode.model, prefill_chunk=24, prefill="reference", token_budget=budget)
    again = fresh([req])
    again[0].handoff = worker.prefill(req.prompt[:48])
    run = decode.serve(again)
    assert [it.prefilled for it in run.schedule.iterations if it.prefilled] == \
        [it.prefilled for it in local.schedule.iterations if it.prefilled][2:], "not prefilled on from token 48"
    a, b = local.requests[0], run.requests[0]
    assert a.tokens == b.tokens
    for step, (x, y) in enumerate(zip(a.logits, b.logits, strict=True)):
        assert torch.equal(x, y), f"{family} {mode}: token {step}: logits differ"
    if decode.cache is not None:
        assert decode.cache.host.free_rows == decode.cache.host.capacity


def test_a_handoff_of_other_tokens_is_refused():
    srv = server("deepseek_v32", "hisparse")
    req = fresh(workload("deepseek_v32")[:1])[0]
    worker = PrefillWorker(srv.model, prefill_chunk=24, prefill="reference")
    req.handoff = worker.prefill((req.prompt[:24] + 1) % 97)
    with pytest.raises(ValueError, match="are not the first 24 of the request's prompt"):
        srv.serve([req])


def test_a_handoff_with_fp8_indexer_keys_decodes_bitwise_as_in_place():
    """index_dtype "fp8" on both sides: the handoff carries the keys' e4m3 values and their scales."""
    req = next(r for r in workload("deepseek_v32") if len(r.prompt) > 48)
    local = server("deepseek_v32", "hisparse", index_dtype="fp8").serve(fresh([req]))
    decode = server("deepseek_v32", "hisparse", index_dtype="fp8")
    worker = PrefillWorker(decode.model, prefill_chunk=24, prefill="reference", index_dtype="fp8")
    again = fresh([req])
    again[0].handoff = worker.prefill(req.prompt)
    assert again[0].handoff.rows[0][1].dtype == torch.float8_e4m3fn and again[0].handoff.rows[0][2] is not None
    run = decode.serve(again)
    a, b = local.requests[0], run.requests[0]
    assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))

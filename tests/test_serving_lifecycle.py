"""The Server's life cycle and its numbers, as a hostile caller would try them: every call out of
order is a clear error naming the state and what to call first; a request object is submitted once;
close() with requests unfinished refuses, cancels or finishes them, as asked, and says which;
arrivals and budgets must be finite; after every refused call no lane, stream or host row is held (tiny DSA model, interpreter)."""
import math

import pytest
import torch
from test_serving import MAX_CONTEXT, QUICK, SETTINGS, requests, tiny

from hisparse.serving import Request, Server


def server(**kw) -> Server:
    return Server(tiny("deepseek_v32"), "hisparse", max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=2,
                  prefill_chunk=24, **SETTINGS["deepseek_v32"], **QUICK, **kw)


def assert_nothing_held(srv: Server) -> None:
    cache = srv.cache
    assert all(r is None for r in srv.lane_request) and srv.prefilling is None
    assert cache.free_streams() == cache.max_streams
    assert cache.host.free_rows == cache.host.capacity
    assert not any(srv.runner.sampler.uses), "a lane kept a request's sampling settings"


def test_calls_before_open_name_the_state_and_what_to_call_first():
    srv = server()
    for call, args in (("submit", (Request(torch.arange(5), 2),)), ("step", ()), ("close", ()),
                       ("cancel", (Request(torch.arange(5), 2),))):
        with pytest.raises(RuntimeError, match=rf"{call}\(\) on a server with no open run: call open\(\) first"):
            getattr(srv, call)(*args)
    assert_nothing_held(srv)


def test_open_twice_refuses_rather_than_dropping_what_is_queued():
    srv = server()
    srv.open()
    queued = srv.submit(Request(torch.arange(30) % 97, 3, arrival=math.nan))
    with pytest.raises(RuntimeError, match=r"open\(\) while a run is open \(1 queued, 0 prefilling, 0 running\)"):
        srv.open()
    while srv.busy:
        srv.step()
    assert len(queued.tokens) == 3
    srv.close()
    assert_nothing_held(srv)


@pytest.mark.parametrize("unfinished", ["refuse", "cancel", "finish"])
def test_close_with_requests_unfinished_does_what_it_is_told(unfinished):
    srv = server()
    srv.open()
    reqs = [srv.submit(Request(p.prompt, p.max_new_tokens, arrival=math.nan)) for p in requests(seed=2, n=3)]
    srv.step()                                    # one prefilling or running, the others queued
    if unfinished == "refuse":
        with pytest.raises(RuntimeError, match=r"close\(\) with requests unfinished \(2 queued, .*close\('cancel'\)"):
            srv.close()
        assert srv.is_open and srv.busy
        unfinished = "cancel"
    run = srv.close(unfinished)
    assert not srv.is_open
    if unfinished == "cancel":
        assert run.cancelled and all(r.cancelled for r in run.cancelled) and not set(map(id, run.cancelled)) & \
            set(map(id, run.requests))
    else:
        assert not run.cancelled and all(len(r.tokens) == r.max_new_tokens for r in reqs)
    assert_nothing_held(srv)
    with pytest.raises(ValueError, match="unfinished='later': expected 'refuse', 'cancel' or 'finish'"):
        srv.open()
        srv.close("later")
    srv.close()


def test_a_request_object_is_submitted_once():
    srv = server()
    srv.open()
    r = srv.submit(Request(torch.arange(20) % 97, 2, arrival=math.nan))
    srv.step()
    with pytest.raises(ValueError, match=r"this Request was already submitted in this run \(rid 0\)"):
        srv.submit(r)
    while srv.busy:
        srv.step()
    srv.close()
    assert_nothing_held(srv)
    twice = Request(torch.arange(20) % 97, 2)
    with pytest.raises(ValueError, match=r"serve\(\) got one Request object twice \(at 0 and 2\)"):
        srv.serve([twice, Request(torch.arange(9), 2), twice])
    assert not srv.is_open
    assert_nothing_held(srv)


@pytest.mark.parametrize("arrival", [math.inf, -math.inf, "soon", None, True])
def test_an_arrival_must_be_a_finite_number_or_now(arrival):
    srv = server()
    srv.open()
    with pytest.raises(ValueError, match=r"arrival=.*: expected a finite number of seconds after open\(\)"):
        srv.submit(Request(torch.arange(10), 2, arrival=arrival))
    assert not srv.busy
    srv.close()
    with pytest.raises(ValueError, match="arrival="):
        srv.serve([Request(torch.arange(10), 2, arrival=arrival)])
    assert_nothing_held(srv)


@pytest.mark.parametrize("name", ["kv_budget_gib", "host_budget_gib"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0])
def test_budgets_must_be_positive_and_finite(name, bad):
    kw = dict(max_context=MAX_CONTEXT, max_batch=2, **SETTINGS["deepseek_v32"], **QUICK)
    kw.setdefault("kv_budget_gib", 0.05)
    kw[name] = bad
    with pytest.raises(ValueError, match=rf"{name} must be a positive, finite number of GiB, got {bad!r}"):
        Server(tiny("deepseek_v32"), "hisparse", **kw)


def test_a_host_budget_under_one_row_names_the_option():
    with pytest.raises(ValueError, match=r"host_budget_gib=1e-12 holds no host pool row \(one is \d+ bytes\)"):
        server(host_budget_gib=1e-12)


def test_the_models_attention_comes_back_after_close_and_after_a_failed_serve():
    srv = server()
    own = srv.model.sparse_attention
    srv.serve(requests(seed=4, n=2))
    assert srv.model.sparse_attention is own

    def broken(request, token):
        raise RuntimeError("the client's callback broke")
    reqs = requests(seed=4, n=2)
    reqs[0].on_token = broken
    with pytest.raises(RuntimeError, match="callback broke"):
        srv.serve(reqs)
    assert srv.model.sparse_attention is own and not srv.is_open
    assert_nothing_held(srv)


def test_cancel_leaves_a_finished_request_and_another_runs_alone():
    srv = server()
    srv.open()
    done = srv.submit(Request(torch.arange(12) % 97, 1, arrival=math.nan))
    while srv.busy:
        srv.step()
    srv.cancel(done)                                    # a client that leaves after its last token
    srv.cancel(Request(torch.arange(5), 2))             # never submitted here
    run = srv.close()
    assert run.requests == [done] and not done.cancelled and not run.cancelled

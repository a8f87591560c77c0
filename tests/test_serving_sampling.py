"""Sampling and token-level stops in the serving loop (tiny DSA model, interpreter): a seeded request
samples the same tokens twice, beside other requests or alone, and in resident and hisparse modes
(bitwise logits); eos, stop_token_ids, min_tokens and a callback's stop end a request with its
finish_reason and free its lane, streams and host rows in the very step; logprobs are the raw
logits'; bad settings are refused at submit with nothing held."""
import math

import pytest
import torch
from test_serving import MAX_CONTEXT, QUICK, SETTINGS, tiny
from test_serving_lifecycle import assert_nothing_held

from hisparse.engine import Engine
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import TINY_CONFIGS, randomize_
from hisparse.sampling import SamplingParams
from hisparse.serving import Request, Server

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SAMPLED = SamplingParams(temperature=1.3, top_p=0.95, top_k=40, seed=2024)


def server(mode: str = "hisparse", model=None, **kw) -> Server:
    settings = dict(SETTINGS["deepseek_v32"], **QUICK)
    if mode == "resident":
        settings.pop("cache_slots")
    return Server(model or tiny("deepseek_v32"), mode, max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=3,
                  prefill_chunk=24, **settings, **kw)


def prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(0, 97, (length,), generator=torch.Generator().manual_seed(seed))


def test_a_seed_gives_the_same_tokens_twice_alone_or_beside_others_and_in_every_mode():
    def ours():
        return Request(prompt(1, 30), 6, sampling=SAMPLED)
    alone = server().serve([ours()])
    run = server(keep_logits=True).serve([Request(prompt(2, 20), 5, sampling=SamplingParams(temperature=1.0, seed=9)),
                                          ours(), Request(prompt(3, 12), 4)], clients=3)
    assert max(run.running_batch) >= 2, "no two requests shared a step"
    again = server("resident", keep_logits=True, lanes=run.schedule.lanes).serve(
        [Request(r.prompt, r.max_new_tokens, sampling=r.sampling) for r in run.requests], clients=3,
        replay=run.schedule)
    greedy = server().serve([Request(prompt(1, 30), 6)]).requests[0].tokens
    tokens = alone.requests[0].tokens
    assert tokens != greedy, "sampling at temperature 1.3 gave the greedy tokens: the test checks nothing"
    assert server().serve([ours()]).requests[0].tokens == tokens
    assert run.requests[1].tokens == tokens
    for a, b in zip(run.requests, again.requests):
        assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), f"request {a.rid}"
    assert all(r.finish_reason == "length" for r in run.requests)


def test_a_request_without_a_seed_gets_one_recorded_that_replays_it():
    r = server().serve([Request(prompt(4, 16), 4, sampling=SamplingParams(temperature=1.0))]).requests[0]
    assert isinstance(r.sampling.seed, int)
    assert server().serve([Request(prompt(4, 16), 4, sampling=r.sampling)]).requests[0].tokens == r.tokens


def test_engine_generate_samples_as_the_server_does():
    reqs = server().serve([Request(prompt(5, 25), 5, sampling=SAMPLED)]).requests
    out = Engine(tiny("deepseek_v32"), "resident", **QUICK).generate([prompt(5, 25)], 5, sampling=SAMPLED)
    assert out.tokens[0].tolist() == reqs[0].tokens and out.finish_reasons == ["length"]


@pytest.fixture(scope="module")
def greedy_tokens():
    return server().serve([Request(prompt(6, 22), 8)]).requests[0].tokens


def with_eos(eos):
    model = build_model(config_from_dict(dict(TINY_CONFIGS["deepseek_v32"], num_hidden_layers=2,
                                              eos_token_id=eos))).to(DEVICE).float()
    randomize_(model, 5)                # the weights of tiny("deepseek_v32")
    return model


def serve_one(srv: Server, request: Request) -> tuple[Request, int]:
    """Serve one request step by step; (it, the step it finished in), checking nothing is held after it."""
    srv.open()
    srv.submit(request)
    steps = 0
    while srv.busy:
        steps += 1
        if request in srv.step():
            assert request.lane is None and request.done
            assert_nothing_held(srv)              # freed in the step that finished it
    srv.close()
    return request, steps


def test_eos_stops_a_request_and_frees_it_at_once_unless_ignored(greedy_tokens):
    eos = greedy_tokens[3]
    first = greedy_tokens.index(eos)
    srv = server(model=with_eos([eos, 96] if eos != 96 else [eos]))
    r, _ = serve_one(srv, Request(prompt(6, 22), 8))
    assert r.tokens == greedy_tokens[:first + 1] and r.finish_reason == "stop"
    r, _ = serve_one(srv, Request(prompt(6, 22), 8, sampling=SamplingParams(ignore_eos=True)))
    assert r.tokens == greedy_tokens and r.finish_reason == "length"
    out = Engine(srv.model, "resident", **QUICK).generate([prompt(6, 22)], 8)
    assert out.tokens[0].tolist() == greedy_tokens[:first + 1] + [-1] * (7 - first) and out.finish_reasons == ["stop"]


def test_stop_token_ids_wait_for_min_tokens(greedy_tokens):
    stop = greedy_tokens[2]
    first = greedy_tokens.index(stop)
    r, _ = serve_one(server(), Request(prompt(6, 22), 8, sampling=SamplingParams(stop_token_ids=(stop,))))
    assert r.tokens == greedy_tokens[:first + 1] and r.finish_reason == "stop"
    later = [n for n, t in enumerate(greedy_tokens) if t == stop and n > first]
    r, _ = serve_one(server(), Request(prompt(6, 22), 8, sampling=SamplingParams(stop_token_ids=(stop,),
                                                                                  min_tokens=first + 2)))
    want = greedy_tokens[:later[0] + 1] if later else greedy_tokens
    assert r.tokens == want and r.finish_reason == ("stop" if later else "length")


def test_a_stop_on_the_first_token_never_takes_a_lane(greedy_tokens):
    r, steps = serve_one(server(), Request(prompt(6, 22), 8, sampling=SamplingParams(
        stop_token_ids=(greedy_tokens[0],))))
    assert r.tokens == greedy_tokens[:1] and r.finish_reason == "stop"


def test_a_callback_stop_frees_the_request_in_that_step(greedy_tokens):
    def on_token(request, token):
        if len(request.tokens) == 3:
            request.finish_reason = "stop"            # as a matched stop string does
    r, _ = serve_one(server(), Request(prompt(6, 22), 8, on_token=on_token))
    assert r.tokens == greedy_tokens[:3] and r.finish_reason == "stop"


def test_logprobs_are_the_log_softmax_of_the_logits_the_token_came_from():
    srv = server(keep_logits=True)
    r = srv.serve([Request(prompt(7, 18), 4, sampling=SamplingParams(temperature=0.9, seed=3, logprobs=5))]).requests[0]
    assert len(r.token_logprobs) == len(r.tokens) == 4
    for token, logits, (chosen, top) in zip(r.tokens, r.logits, r.token_logprobs):
        logp = torch.log_softmax(logits, -1)
        assert chosen == pytest.approx(float(logp[token]), abs=1e-5)
        assert [i for i, _ in top] == logp.topk(5).indices.tolist()


@pytest.mark.parametrize("settings", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=98), dict(logprobs=21),
                                      dict(logit_bias={100: 1.0}), dict(stop_token_ids=(97,))])
def test_bad_settings_are_refused_at_submit_with_nothing_held(settings):
    srv = server()
    srv.open()
    field = next(iter(settings))
    with pytest.raises(ValueError, match=rf"^{field}"):
        srv.submit(Request(prompt(8, 10), 3, arrival=math.nan, sampling=SamplingParams(**settings)))
    assert not srv.busy
    srv.close()
    assert_nothing_held(srv)


@pytest.mark.gpu
def test_the_graphed_sampler_gives_the_eager_tokens():
    """On a GPU: graph=True (the step's graph, then the sampler's) samples what the eager server samples."""
    reqs = lambda: [Request(prompt(9, 30), 6, sampling=SAMPLED), Request(prompt(10, 20), 5),  # noqa: E731
                    Request(prompt(11, 12), 4, sampling=SamplingParams(temperature=0.7, min_p=0.1, seed=4))]
    eager = server().serve(reqs(), clients=3)
    graphed = server(graph=True, lanes=eager.schedule.lanes).serve(reqs(), clients=3, replay=eager.schedule)
    assert [r.tokens for r in graphed.requests] == [r.tokens for r in eager.requests]

"""bench_serving's random dataset (hisparse.serving.workload.RandomWorkload): the counts it promises
(prompts, lengths within the range ratio, arrivals at the rate), one seed one workload, bad values
refused by name; the study's own loads unchanged; max_concurrency held in an in-process run. The
shared-prefix loads: multi-turn conversations (each turn's prompt extends the last) and a shared
document (one document, many questions), and their selections drawn per request."""
import math
import re

import pytest
import torch

from hisparse.serving import Server, benchmark_summary, format_summary, timing_summary
from hisparse.serving.workload import (MultiTurnWorkload, RandomWorkload, SharedDocumentWorkload, attach_selections,
                                     serving_requests)


@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.01], ids=["ratio1", "ratio0.5", "ratio0.01"])
def test_counts_and_lengths_within_the_range_ratio(ratio):
    w = RandomWorkload(input_len=113, output_len=27, num_prompts=61, range_ratio=ratio, request_rate=3.0, seed=5)
    reqs = w.requests(vocab=97)
    assert len(reqs) == 61
    for r in reqs:
        assert max(1, int(113 * ratio)) <= len(r.prompt) <= 113 and r.prompt.dtype == torch.int64
        assert max(1, int(27 * ratio)) <= r.max_new_tokens <= 27
        assert 0 <= int(r.prompt.min()) and int(r.prompt.max()) < 97
    lengths = {len(r.prompt) for r in reqs}
    assert lengths == {113} if ratio == 1.0 else len(lengths) > 10     # drawn, not one value


def test_lengths_are_uniform_over_the_range():
    """Uniform over [len * ratio, len]: both ends reached, the mean near the middle."""
    inputs, outputs = RandomWorkload(100, 10, 4000, range_ratio=0.5, seed=1).lengths()
    assert min(inputs) == 50 and max(inputs) == 100 and abs(sum(inputs) / 4000 - 75) < 1.0
    assert min(outputs) == 5 and max(outputs) == 10 and abs(sum(outputs) / 4000 - 7.5) < 0.15


@pytest.mark.parametrize("rate", [0.5, 4.0, 250.0])
def test_arrivals_are_poisson_at_the_rate(rate):
    """Exponential gaps of mean 1 / rate: over 20 seeds of 200 arrivals (4000 gaps, standard error
    1 / (rate * sqrt(4000)) of the mean), the mean gap within 5 standard errors of 1 / rate; the
    gaps' coefficient of variation near 1 (an exponential's); arrivals increasing from after 0."""
    gaps = []
    for seed in range(20):
        arrivals = RandomWorkload(8, 2, 200, request_rate=rate, seed=seed).arrivals()
        assert arrivals[0] > 0 and all(b > a for a, b in zip(arrivals, arrivals[1:]))
        gaps += [b - a for a, b in zip([0.0, *arrivals], arrivals)]
    mean = sum(gaps) / len(gaps)
    assert abs(mean - 1 / rate) < 5 / (rate * math.sqrt(len(gaps)))
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1))
    assert 0.9 < sd / mean < 1.1


def test_an_infinite_rate_sends_every_request_at_once():
    w = RandomWorkload(8, 2, 17)
    assert w.request_rate == math.inf and w.arrivals() == [0.0] * 17
    assert [r.arrival for r in w.requests(50)] == [0.0] * 17


def test_one_seed_one_workload_another_seed_another():
    def drawn(seed):
        reqs = RandomWorkload(40, 6, 12, range_ratio=0.3, request_rate=2.0, seed=seed).requests(1000)
        return [(r.prompt.tolist(), r.max_new_tokens, r.arrival) for r in reqs]
    assert drawn(3) == drawn(3)
    other = drawn(4)
    assert other != drawn(3)
    assert [a for *_, a in other] != [a for *_, a in drawn(3)]
    assert [p for p, *_ in other] != [p for p, *_ in drawn(3)]


def test_the_study_loads_are_its_special_cases():
    """serving_requests (the sweep's concurrency and rates loads) is RandomWorkload at seed 0 with
    fixed lengths: the same prompts as before it existed (seeded per request 1000 + i), Poisson
    arrivals from generator seed 0; a closed loop's arrivals all 0."""
    point = {"concurrency": None, "rate": 0.7, "input_len": 9, "output_len": 5}
    reqs, clients = serving_requests({"requests": 6}, point, 100)
    assert clients is None and len(reqs) == 6
    gaps = torch.empty(6).exponential_(generator=torch.Generator().manual_seed(0))
    assert [r.arrival for r in reqs] == (gaps.cumsum(0) / 0.7).tolist()
    for i, r in enumerate(reqs):
        assert torch.equal(r.prompt, torch.randint(0, 100, (9,), generator=torch.Generator().manual_seed(1000 + i)))
        assert r.max_new_tokens == 5
    reqs, clients = serving_requests({"requests_per_client": 2}, dict(point, concurrency=3, rate=None), 100)
    assert clients == 3 and len(reqs) == 6 and {r.arrival for r in reqs} == {0.0}


@pytest.mark.parametrize("field,value,message", [
    ("input_len", 0, r"input_len = 0: expected a positive integer"),
    ("output_len", 2.5, r"output_len = 2.5: expected a positive integer"),
    ("num_prompts", True, r"num_prompts = True: expected a positive integer"),
    ("range_ratio", 0.0, r"range_ratio = 0.0: expected a number in \(0, 1\]"),
    ("range_ratio", 1.5, r"range_ratio = 1.5: expected a number in \(0, 1\]"),
    ("request_rate", 0, r"request_rate = 0: expected a positive number of requests/s, or inf"),
    ("request_rate", math.nan, r"request_rate = nan: expected a positive number"),
    ("max_concurrency", 0, r"max_concurrency = 0: expected a positive integer, or None"),
    ("seed", -1, r"seed = -1: expected an integer in \[0, 2147483647\]"),
])
def test_bad_values_are_refused_naming_the_field(field, value, message):
    kw = dict(input_len=8, output_len=2, num_prompts=3)
    with pytest.raises(ValueError, match=message):
        RandomWorkload(**{**kw, field: value})


def test_the_benchmark_summary_counts_and_prints_its_figures():
    """Throughputs over the span from the first start to the last token; mean, median, p99 in ms;
    the same span and output tokens as timing_summary's; every figure in the printed block."""
    class Timed:
        def __init__(self, start, times):
            self.start, self.token_times = start, times
        ttft, tpot, latency = (property(lambda s: s.token_times[0] - s.start),
                               property(lambda s: (s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1)
                                        if len(s.token_times) > 1 else None),
                               property(lambda s: s.token_times[-1] - s.start))
    done = [Timed(0.0, [0.1, 0.2, 0.4]), Timed(0.1, [0.3, 0.5])]
    s = benchmark_summary(done, 0.0, input_tokens=30)
    assert s["requests"] == 2 and s["output_tokens"] == 5 and s["duration_s"] == pytest.approx(0.5)
    assert s["request_throughput"] == pytest.approx(4.0) and s["input_throughput"] == pytest.approx(60.0)
    assert s["output_throughput"] == pytest.approx(timing_summary(done, 0.0)["tokens_per_s"])
    assert s["ttft_ms_mean"] == pytest.approx(150.0) and s["ttft_ms_median"] == pytest.approx(150.0)
    assert s["itl_ms_mean"] == pytest.approx(500 / 3) and s["latency_ms_p99"] == pytest.approx(400.0)
    block = format_summary(s, request_rate=math.inf, max_concurrency=4)
    assert block.splitlines()[0].startswith("=") and "Serving benchmark result" in block.splitlines()[0]
    for label, value in [("Request rate (req/s)", "inf"), ("Max concurrency", "4"), ("Completed requests", "2"),
                         ("Request throughput (req/s)", "4.00"), ("Output token throughput (tok/s)", "10.00"),
                         ("Mean TTFT (ms)", "150.00"), ("P99 E2E latency (ms)", "400.00")]:
        assert re.search(rf"^{re.escape(label)}: +{re.escape(value)}$", block, re.M), label


def test_max_concurrency_is_never_exceeded_in_process():
    """A tiny model served 7 requests arriving at once with max_concurrency 2 (and 3 lanes free for
    more): after every iteration at most 2 are out (waiting, prefilling or running), every request
    finishes with its drawn output length, and each is sent no earlier than its arrival."""
    from test_serving import MAX_CONTEXT, QUICK, tiny
    model = tiny("deepseek_v32")
    w = RandomWorkload(input_len=30, output_len=4, num_prompts=7, range_ratio=0.5, max_concurrency=2, seed=2)
    reqs = w.requests(model.config.vocab_size)
    server = Server(model, "hisparse", cache_slots=16, max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=3,
                    prefill_chunk=24, **QUICK)
    out, step = [], server.step

    def counted():
        finished = step()
        out.append(len(server.running) + (server.prefilling is not None) + len(server.waiting))
        return finished
    server.step = counted
    run = server.serve(reqs, max_concurrency=w.max_concurrency)
    assert max(out) == 2 and len(out) > 7
    assert [len(r.tokens) for r in run.requests] == [r.max_new_tokens for r in reqs]
    assert all(r.prefill_start >= r.arrival for r in run.requests)
    with pytest.raises(ValueError, match=r"max_concurrency = 2 caps an open loop.*clients = 2"):
        server.serve(reqs, clients=2, max_concurrency=2)
    with pytest.raises(ValueError, match=r"max_concurrency must be an int >= 1, got 0"):
        server.serve(reqs, max_concurrency=0)


def test_multi_turn_counts_lengths_and_each_turn_extends_the_last():
    """3 conversations of 4 turns, turn-major: each prompt is the previous turn's prompt plus
    answer_len + user_len new tokens; conversations differ; one client per conversation."""
    w = MultiTurnWorkload(conversations=3, turns=4, first_len=27, user_len=5, answer_len=7, seed=3)
    reqs = w.requests(vocab=61)
    assert len(reqs) == 12 and w.clients() == 3 and {r.arrival for r in reqs} == {0.0}
    assert w.max_context() == 27 + 3 * 12 + 7
    for t in range(4):
        for c in range(3):
            r = reqs[t * 3 + c]
            assert len(r.prompt) == w.prompt_len(t) == 27 + 12 * t and r.max_new_tokens == 7
            assert r.prompt.dtype == torch.int64 and 0 <= int(r.prompt.min()) and int(r.prompt.max()) < 61
            if t:
                prev = reqs[(t - 1) * 3 + c].prompt
                assert torch.equal(r.prompt[:len(prev)], prev)
    firsts = [reqs[c].prompt for c in range(3)]
    assert not torch.equal(firsts[0], firsts[1]) and not torch.equal(firsts[1], firsts[2])
    again = MultiTurnWorkload(conversations=3, turns=4, first_len=27, user_len=5, answer_len=7, seed=3).requests(61)
    assert all(torch.equal(a.prompt, b.prompt) for a, b in zip(reqs, again))
    other = MultiTurnWorkload(conversations=3, turns=4, first_len=27, user_len=5, answer_len=7, seed=4).requests(61)
    assert not torch.equal(other[0].prompt, reqs[0].prompt)


def test_multi_turn_at_a_rate_arrives_poisson_in_turn_order():
    w = MultiTurnWorkload(conversations=2, turns=3, first_len=8, user_len=2, answer_len=3, request_rate=5.0, seed=1)
    reqs = w.requests(50)
    assert w.clients() is None
    assert [r.arrival for r in reqs] == RandomWorkload(8, 3, 6, request_rate=5.0, seed=1).arrivals()


def test_shared_document_counts_lengths_and_one_document():
    w = SharedDocumentWorkload(document_len=113, questions=9, question_len=6, answer_len=4, request_rate=2.0, seed=7)
    reqs = w.requests(vocab=97)
    assert len(reqs) == 9 and w.max_context() == 113 + 6 + 4 and w.clients() is None
    document = reqs[0].prompt[:113]
    for r in reqs:
        assert len(r.prompt) == 119 and r.max_new_tokens == 4 and torch.equal(r.prompt[:113], document)
    assert len({tuple(r.prompt[113:].tolist()) for r in reqs}) == 9          # the questions differ
    assert [r.arrival for r in reqs] == RandomWorkload(8, 3, 9, request_rate=2.0, seed=7).arrivals()
    assert {r.arrival for r in SharedDocumentWorkload(10, 3, 2, 2).requests(10)} == {0.0}


@pytest.mark.parametrize("make,message", [
    (lambda: MultiTurnWorkload(0, 2, 8, 2, 2), r"conversations = 0: expected a positive integer"),
    (lambda: MultiTurnWorkload(2, 2, 8, 2, 2.5), r"answer_len = 2.5: expected a positive integer"),
    (lambda: MultiTurnWorkload(2, 2, 8, 2, 2, think_time=-1.0), r"think_time = -1.0: expected seconds >= 0"),
    (lambda: MultiTurnWorkload(2, 2, 8, 2, 2, request_rate=0), r"request_rate = 0: expected a positive number"),
    (lambda: SharedDocumentWorkload(8, 0, 2, 2), r"questions = 0: expected a positive integer"),
    (lambda: SharedDocumentWorkload(8, 2, 2, 2, max_concurrency=0), r"max_concurrency = 0: expected a positive"),
    (lambda: SharedDocumentWorkload(8, 2, 2, 2, seed=-2), r"seed = -2: expected an integer in"),
], ids=["conversations", "answer_len", "think_time", "rate", "questions", "max_concurrency", "seed"])
def test_shared_prefix_workloads_refuse_bad_values_naming_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_attached_selections_are_drawn_per_request_at_its_own_length():
    """Each request gets its own draw for its prompt length: the j-th request of a length is drawn
    as request_draws' j-th at that length (a conversation's turns: the same seed at each context)."""
    from hisparse.models.tiny import TINY_CONFIGS
    from hisparse.models.config import config_from_dict
    from hisparse.synthetic import request_draws
    config = config_from_dict(dict(TINY_CONFIGS["deepseek_v32"]))
    w = MultiTurnWorkload(conversations=2, turns=2, first_len=100, user_len=4, answer_len=3)
    reqs = w.requests(config.vocab_size)
    attach_selections(reqs, "tiny", config)
    for t, length in enumerate((100, 107)):
        draws = request_draws("tiny", config, length, 3, 2)
        for c in range(2):
            sel = reqs[t * 2 + c].selections
            assert sel.shape == (2, config.num_hidden_layers, config.index_topk) and torch.equal(sel, draws[c])
    assert not torch.equal(reqs[0].selections, reqs[1].selections)


def test_a_closed_loop_waits_each_turns_think_time():
    """MultiTurnWorkload's think_time: a conversation's next turn arrives that long after its previous
    turn's last token (the driver's closed loop, `Request.think_time`)."""
    from test_serving import QUICK, tiny

    from hisparse.serving import Server
    from hisparse.serving.workload import MultiTurnWorkload
    load = MultiTurnWorkload(conversations=1, turns=2, first_len=8, user_len=2, answer_len=2, think_time=0.3)
    reqs = load.requests(97)
    assert [r.think_time for r in reqs] == [0.0, 0.3]
    srv = Server(tiny("deepseek_v32"), "resident", max_context=32, kv_budget_gib=0.01, max_batch=1, **QUICK)
    run = srv.serve(reqs, clients=load.clients())
    first, second = run.requests
    assert second.arrival == pytest.approx(first.token_times[-1] + 0.3)
    assert second.token_times[0] >= second.arrival

"""The HTTP endpoint (python -m hisparse.serve) on 127.0.0.1 with a tiny model, driven by an aiohttp
client: its tokens are Engine.generate's for each prompt alone, streamed one by one; bad requests
get a 4xx naming the field while the others are served; a client that leaves mid-stream and a
shutdown free every stream and host row; the load client writes transport=http rows."""
import asyncio
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import aiohttp
import pandas as pd
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_serving import SETTINGS, tiny

from hisparse.engine import Engine
from hisparse.models.tiny import write_tiny_checkpoint
from hisparse.serve import bench, protocol, worker
from hisparse.serve.__main__ import main as serve_main
from hisparse.serve.app import Service, describe, serve
from hisparse.serve.metrics import CONTENT_TYPE_LATEST, LATENCY_BUCKETS
from hisparse.serve.worker import ReplayWorkload, ServerThread
from hisparse.serving import GIB, Request, Server
from hisparse.synthetic import request_draws

FAMILY = "deepseek_v32"          # 2 layers (tiny()), k = 8 tokens, 97 ids
VOCAB = 97
CHUNK = 32                       # prefill chunk of the server and the engine alike
MAX_CONTEXT = 96
HOST_ROWS = 160                  # the hisparse server's pool: 2 layers x 80 tokens, so 81+ tokens never fit
ROW_BYTES = 48 * 4               # a float32 DSA latent row: 32 + 16 values
A, B, C = list(range(3, 40)), [5, 9, 11, 2, 80], list(range(90, 60, -1))


class Running:
    """A Service served on 127.0.0.1 (a free port) by an event loop in a thread of its own, as the
    command serves it."""

    def __init__(self, server: Server, shutdown_timeout: float = 5.0, workload: ReplayWorkload | None = None,
                 tokenizer=None):
        self.server = server
        self.worker = ServerThread(server, workload)
        self.worker.start()
        self.service = Service(self.worker, describe(server, "tiny", 0.05, None,
                                                        "model" if workload is None else workload.name, tokenizer),
                               tokenizer)
        self.final = None
        ready = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            self.stop = asyncio.Event()

            def on_ready(port: int) -> None:
                self.url = f"http://127.0.0.1:{port}"
                ready.set()
            self.final = self.loop.run_until_complete(
                serve(self.service, "127.0.0.1", 0, self.stop, shutdown_timeout, on_ready))
            self.loop.close()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(30), "the HTTP server did not start"

    def shut_down(self) -> dict:
        """What SIGINT / SIGTERM do: drain, close, stop listening; the final snapshot."""
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.stop.set)
            self.thread.join(60)
        return self.final


def new_server(mode: str, max_context: int = MAX_CONTEXT, host_rows: int | None = HOST_ROWS) -> Server:
    if mode == "resident":
        return Server(tiny(FAMILY), "resident", max_context=max_context, kv_budget_gib=0.05, max_batch=3,
                      prefill_chunk=CHUNK, prefill="reference")
    host = None if host_rows is None else host_rows * ROW_BYTES / GIB      # None: every lane at max_context
    return Server(tiny(FAMILY), mode, max_context=max_context, kv_budget_gib=0.05, max_batch=3, prefill_chunk=CHUNK,
                  prefill="reference", host_budget_gib=host, **SETTINGS[FAMILY])


@pytest.fixture(scope="module")
def resident():
    running = Running(new_server("resident"))
    yield running
    running.shut_down()


@pytest.fixture(scope="module")
def hisparse():
    running = Running(new_server("hisparse"))
    yield running
    running.shut_down()


@functools.cache
def alone(prompt: tuple, n: int) -> list[int]:
    """Engine.generate's tokens for the prompt alone (resident, the same prefill chunks)."""
    engine = Engine(tiny(FAMILY), "resident", chunk_size=CHUNK, prefill="reference")
    import torch
    return engine.generate([torch.tensor(prompt)], new_tokens=n).tokens[0].tolist()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 50))


async def post(session, url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(f"{url}/v1/completions", data=data) as response:
        return response.status, await response.json()


async def events(response) -> list:
    """The parsed `data:` events of a stream, "[DONE]" as that string."""
    out = []
    async for line in response.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def scrape(session, url: str) -> dict:
    """GET /metrics parsed by prometheus_client: {family name: its family}."""
    async with session.get(f"{url}/metrics") as response:
        assert response.status == 200 and response.headers["Content-Type"] == CONTENT_TYPE_LATEST
        return {family.name: family for family in text_string_to_metric_families(await response.text())}


async def metrics(session, url: str) -> dict:
    """The unlabelled samples of /metrics as {sample name: value} (a counter's is name_total)."""
    return {s.name: s.value for family in (await scrape(session, url)).values() for s in family.samples
            if not s.labels}


def test_concurrent_completions_equal_each_prompt_alone(resident):
    """Three requests at once and one of two prompts: every choice is Engine.generate's tokens for
    its prompt alone, in the OpenAI completions shape."""
    asks = [([A], 4), ([B], 3), ([C], 5), ([B, A], 3)]

    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(post(s, resident.url, {"prompt": p[0] if len(p) == 1 else p,
                                                                 "max_tokens": n}) for p, n in asks))
    answers = run(go())
    for (prompts, n), (status, body) in zip(asks, answers):
        assert status == 200, body
        assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
        assert [c["index"] for c in body["choices"]] == list(range(len(prompts)))
        for prompt, c in zip(prompts, body["choices"]):
            assert c["token_ids"] == alone(tuple(prompt), n), f"prompt of {len(prompt)} tokens"
            assert c["text"] == " ".join(map(str, c["token_ids"])) and c["finish_reason"] == "length"
        total = sum(len(p) for p in prompts)
        assert body["usage"] == {"prompt_tokens": total, "completion_tokens": n * len(prompts),
                                 "total_tokens": total + n * len(prompts)}


def test_streaming_yields_the_tokens_one_by_one(resident):
    async def go():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": C, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
            async with s.post(f"{resident.url}/v1/completions", json=body) as response:
                assert response.status == 200 and response.content_type == "text/event-stream"
                return await events(response)
    got = run(go())
    assert got[-1] == "[DONE]"
    tokens = got[:-2]
    assert [len(e["choices"][0]["token_ids"]) for e in tokens] == [1] * 4
    assert [e["choices"][0]["token_ids"][0] for e in tokens] == alone(tuple(C), 4)
    assert [e["choices"][0]["text"] for e in tokens] == [str(e["choices"][0]["token_ids"][0]) for e in tokens]
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None, None, None, "length"]
    assert got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 4


BAD = [  # (body, param, words the message must hold)
    (b'{"prompt": [1, 2', None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    ({"max_tokens": 2}, "prompt", "missing prompt"),
    ({"prompt": "hello"}, "prompt", "no tokenizer"),
    ({"prompt": ["hello", "you"]}, "prompt", "text prompts cannot be read"),
    ({"prompt": []}, "prompt", "non-empty"),
    ({"prompt": [1, 2.5]}, "prompt", "2.5"),
    ({"prompt": [1, True]}, "prompt", "True"),
    ({"prompt": [[1, 2], [3, "x"]]}, "prompt", "prompt 1"),
    ({"prompt": [1, VOCAB]}, "prompt", f"0 <= id < {VOCAB}"),
    ({"prompt": [-1]}, "prompt", "outside the vocabulary"),
    ({"prompt": list(range(90)), "max_tokens": 10}, "prompt", "max_context=96"),
    ({"prompt": [1], "max_tokens": 0}, "max_tokens", "integer >= 1"),
    ({"prompt": [1], "max_tokens": "3"}, "max_tokens", "'3'"),
    ({"prompt": [1], "stream": "yes"}, "stream", "true or false"),
    ({"prompt": [1], "temperature": -1}, "temperature", "temperature=-1"),
    ({"prompt": [1], "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": [1], "n": 2}, "n", "n 1"),
    ({"prompt": [1], "best_of": 2}, "best_of", "best_of"),
    ({"prompt": [1], "logprobs": 21}, "logprobs", "[0, 20]"),
    ({"prompt": [1], "stop": ["x"]}, "stop", "no tokenizer"),
    ({"prompt": [1], "echo": True}, "echo", "no tokenizer"),
    ({"prompt": [1], "frobnicate": 1}, "frobnicate", "unsupported parameter"),
]


def test_each_bad_request_gets_a_4xx_naming_the_field_and_the_next_is_served(resident, monkeypatch):
    """And the idle server thread starts a new run every few requests (so a long-lived server does not
    keep every finished request): a good request after each bad one still gets its tokens."""
    monkeypatch.setattr(worker, "RECYCLE_AFTER", 4)

    async def go():
        async with aiohttp.ClientSession() as s:
            for body, param, words in BAD:
                status, answer = await post(s, resident.url, body)
                assert status == 400, (body, answer)
                error = answer["error"]
                assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
                assert words in error["message"], (body, error["message"])
                status, good = await post(s, resident.url, {"prompt": B, "max_tokens": 1})   # prefill only: quick
                assert status == 200 and good["choices"][0]["token_ids"] == alone(tuple(B), 1), body
            assert (await metrics(s, resident.url))["hisparse_requests_refused_total"] >= len(BAD)
            await post(s, resident.url, {"prompt": B, "max_tokens": 1})
        return resident.server.requests[:]
    assert len(run(go())) <= 4 < len(BAD)


def test_a_prompt_over_the_host_budget_is_refused(hisparse):
    async def go():
        async with aiohttp.ClientSession() as s:
            status, answer = await post(s, hisparse.url, {"prompt": list(range(80)), "max_tokens": 4})
            assert status == 400 and answer["error"]["param"] == "prompt"
            assert "host_budget_gib" in answer["error"]["message"], answer
    run(go())


def test_a_client_leaving_mid_stream_frees_its_memory(hisparse):
    """/metrics shows the request's host rows while it streams, none once the client has gone; the
    server goes on serving."""
    async def go():
        async with aiohttp.ClientSession() as s:
            before = await metrics(s, hisparse.url)
            body = {"prompt": B, "max_tokens": 70, "stream": True}        # 150 of the 160 host rows; long on a GPU too
            response = await s.post(f"{hisparse.url}/v1/completions", json=body)
            seen = 0
            async for line in response.content:
                seen += line.startswith(b"data: ")
                if seen == 2:
                    break
            during = await metrics(s, hisparse.url)
            response.close()                                 # the client goes away
            for _ in range(200):
                after = await metrics(s, hisparse.url)
                if after["hisparse_requests_in_flight"] == 0:
                    break
                await asyncio.sleep(0.1)
            status, good = await post(s, hisparse.url, {"prompt": B, "max_tokens": 2})
            return before, during, after, status, good
    before, during, after, status, good = run(go())
    assert during["hisparse_requests_running"] == 1 and during["hisparse_host_rows_in_use"] > 0
    assert after["hisparse_requests_in_flight"] == after["hisparse_requests_running"] == 0
    assert after["hisparse_host_rows_in_use"] == after["hisparse_host_bytes_in_use"] == 0
    assert after["hisparse_requests_cancelled_total"] == before["hisparse_requests_cancelled_total"] + 1
    assert after["hisparse_host_rows_capacity"] == HOST_ROWS
    assert status == 200 and good["choices"][0]["token_ids"] == alone(tuple(B), 2)


METRICS = {   # every metric /metrics had before prometheus_client (a counter's family drops _total), and the latencies
    "counter": ["hisparse_requests_served", "hisparse_requests_cancelled", "hisparse_requests_failed",
                "hisparse_requests_refused", "hisparse_prompt_tokens", "hisparse_generation_tokens",
                "hisparse_cache_hits", "hisparse_cache_misses"],
    "gauge": ["hisparse_requests_running", "hisparse_requests_waiting", "hisparse_requests_in_flight", "hisparse_lanes",
              "hisparse_gpu_kv_bytes", "hisparse_gpu_kv_budget_bytes", "hisparse_host_rows_in_use",
              "hisparse_host_rows_capacity", "hisparse_host_bytes_in_use", "hisparse_host_bytes_capacity",
              "hisparse_draining"],
    "histogram": ["hisparse_time_to_first_token_seconds", "hisparse_inter_token_latency_seconds",
                  "hisparse_time_per_output_token_seconds"],
}


def test_metrics_count_the_requests_served_and_their_latencies():
    """A server of its own (its own registry, beside the module's servers in this process): after
    five prompts (two in one request, one streamed) and a refusal, the counters are those requests'
    and tokens'; TTFT has one observation per prompt with a first token, ITL one per later token,
    TPOT one per prompt of two tokens or more, each sum and bucket what the server's token times give."""
    running = Running(new_server("resident"))
    asks = [{"prompt": A, "max_tokens": 4}, {"prompt": [B, C], "max_tokens": 3}, {"prompt": B, "max_tokens": 1}]
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                idle = await metrics(s, running.url)
                answers = await asyncio.gather(*(post(s, running.url, body) for body in asks))
                body = {"prompt": C, "max_tokens": 2, "stream": True}
                async with s.post(f"{running.url}/v1/completions", json=body) as response:
                    streamed = await events(response)
                refused, _ = await post(s, running.url, {"prompt": [1], "max_tokens": 0})
                return idle, answers, streamed, refused, await scrape(s, running.url)
        idle, answers, streamed, refused, families = run(go())
        requests = running.server.requests[:]
    finally:
        running.shut_down()
    assert [status for status, _ in answers] == [200] * 3 and streamed[-1] == "[DONE]" and refused == 400
    for kind, names in METRICS.items():
        assert {name: families[name].type for name in names} == dict.fromkeys(names, kind)
    assert all(v == 0 for name, v in idle.items() if name.endswith(("_total", "_count", "_sum"))), idle
    value = {s.name: s.value for family in families.values() for s in family.samples if not s.labels}
    tokens = [len(r.tokens) for r in requests]
    assert len(requests) == 5 and tokens == [4, 3, 3, 1, 2]            # a request here is a prompt
    assert value["hisparse_requests_served_total"] == 5 and value["hisparse_requests_refused_total"] == 1
    assert value["hisparse_requests_cancelled_total"] == value["hisparse_requests_failed_total"] == 0
    assert value["hisparse_prompt_tokens_total"] == 2 * len(B) + 2 * len(C) + len(A)
    assert value["hisparse_generation_tokens_total"] == sum(tokens) == 13
    assert value["hisparse_requests_in_flight"] == value["hisparse_requests_running"] == 0
    assert value["hisparse_lanes"] == running.server.lanes and value["hisparse_draining"] == 0
    assert value["hisparse_gpu_kv_budget_bytes"] == running.server.kv_budget
    ttft = [r.ttft for r in requests]
    itl = [b - a for r in requests for a, b in zip(r.token_times, r.token_times[1:])]
    tpot = [r.tpot for r in requests if r.tpot is not None]
    assert value["hisparse_time_to_first_token_seconds_count"] == 5
    assert value["hisparse_inter_token_latency_seconds_count"] == value["hisparse_generation_tokens_total"] - 5 == 8
    assert value["hisparse_time_per_output_token_seconds_count"] == 4
    for name, observed in (("hisparse_time_to_first_token_seconds", ttft), ("hisparse_inter_token_latency_seconds", itl),
                           ("hisparse_time_per_output_token_seconds", tpot)):
        assert value[f"{name}_sum"] == pytest.approx(sum(observed), rel=1e-9, abs=1e-12), name
        buckets = {float(s.labels["le"]): s.value for s in families[name].samples if s.name == f"{name}_bucket"}
        assert list(buckets) == [*LATENCY_BUCKETS, float("inf")], name
        assert buckets == {le: sum(x <= le for x in observed) for le in buckets}, name


def test_shutdown_lets_a_running_request_finish_and_frees_everything():
    """SIGINT / SIGTERM's drain: a stream in flight gets every token and [DONE], then no stream,
    lane or host row is held and the command stops listening."""
    running = Running(new_server("hisparse"), shutdown_timeout=30.0)

    async def go():
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as s:
            stream = await s.post(f"{running.url}/v1/completions", json={"prompt": B, "max_tokens": 8, "stream": True})
            first = await stream.content.readline()
            shutdown = loop.run_in_executor(None, running.shut_down)
            rest = await events(stream)
            return first, rest, await shutdown
    first, rest, final = run(go())
    tokens = [json.loads(first[6:])["choices"][0]["token_ids"][0]] + [e["choices"][0]["token_ids"][0]
                                                                      for e in rest[:-1]]
    assert rest[-1] == "[DONE]" and tokens == alone(tuple(B), 8)
    assert final["served"] == 1 and final["failed"] == 0
    assert_nothing_held(running, final)


def test_shutdown_refuses_new_requests_and_cancels_what_outlasts_its_timeout():
    """A stream of 990 tokens outlasts a drain of 0.5 s: it ends with an error event (no [DONE]);
    meanwhile new requests and /health get 503; at the end nothing is held."""
    running = Running(new_server("hisparse", max_context=1000, host_rows=None), shutdown_timeout=0.5)

    async def go():
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as s:
            stream = await s.post(f"{running.url}/v1/completions", json={"prompt": B, "max_tokens": 990,
                                                                         "stream": True})
            assert (await stream.content.readline()).startswith(b"data: ")
            shutdown = loop.run_in_executor(None, running.shut_down)
            await asyncio.sleep(0.1)
            refused = await post(s, running.url, {"prompt": B, "max_tokens": 1})
            async with s.get(f"{running.url}/health") as health:
                health_status = health.status
            return refused, health_status, await events(stream), await shutdown
    (refused_status, refused), health_status, rest, final = run(go())
    assert refused_status == 503 and "shutting down" in refused["error"]["message"]
    assert health_status == 503
    assert rest and "error" in rest[-1] and "[DONE]" not in rest, rest[-3:]
    assert "shut down" in rest[-1]["error"]["message"]
    assert final["failed"] == 1
    assert_nothing_held(running, final)


def assert_nothing_held(running: Running, final: dict) -> None:
    assert final["in_flight"] == final["running"] == final["waiting"] == final["host_rows_in_use"] == 0
    server = running.server
    assert not server.cache._open and server.cache.host.free_rows == server.cache.host.capacity
    assert all(r is None for r in server.lane_request) and not server.busy
    assert not running.thread.is_alive() and not running.worker._thread.is_alive()


def test_load_client_writes_http_rows(resident, tmp_path):
    rc = bench.main(["--url", resident.url, "--concurrency", "2", "--requests-per-client", "1", "--input-len", "12",
                     "--output-len", "3", "--out", str(tmp_path)])
    assert rc == 0
    rows = pd.read_csv(tmp_path / "serving.csv")
    assert set(rows.transport) == {"http"} and set(rows["mode"]) == {"resident"}
    value = dict(zip(rows.metric, rows.value))
    assert value["requests"] == 2 and value["output_tokens"] == 6 and value["failed_requests"] == 0
    for metric in ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p90", "latency_ms_p50"):
        assert value[metric] > 0, metric
    assert rows.concurrency.unique().tolist() == [2] and rows.input_len.unique().tolist() == [12]
    for column in ("family", "k", "unit_bytes", "layers", "hidden", "kv_budget_gib", "prefill_chunk", "gpu", "commit"):
        assert column in rows and rows[column].notna().all(), column


def test_load_client_speaks_the_random_dataset(resident, tmp_path, capsys):
    """--dataset random: num_prompts requests of the drawn lengths (RandomWorkload's), every one
    served; the rows carry the workload's columns and the dialect's figures; the summary block is
    printed for each rate."""
    from hisparse.serving.workload import RandomWorkload
    argv = ["--url", resident.url, "--dataset", "random", "--random-input-len", "12", "--random-output-len", "4",
            "--random-range-ratio", "0.5", "--num-prompts", "5", "--request-rate", "inf,50", "--max-concurrency",
            "2", "--seed", "3", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    rows = pd.read_csv(tmp_path / "serving.csv")
    assert sorted(rows.request_rate.unique()) == [50.0, float("inf")]
    for column, value in (("num_prompts", 5), ("range_ratio", 0.5), ("max_concurrency", 2), ("seed", 3),
                          ("input_len", 12), ("output_len", 4)):
        assert rows[column].unique().tolist() == [value], column
    assert rows.concurrency.isna().all() and rows.rate.isna().all() and set(rows.transport) == {"http"}
    drawn = RandomWorkload(12, 4, 5, 0.5, 50.0, 2, 3).requests(VOCAB)
    for _, one in rows.groupby("request_rate"):
        value = dict(zip(one.metric, one.value))
        assert value["requests"] == 5 and value["failed_requests"] == 0
        assert value["output_tokens"] == sum(r.max_new_tokens for r in drawn)
        assert value["input_throughput"] > value["request_throughput"] > 0 and value["ttft_ms_mean"] > 0
    printed = capsys.readouterr().out
    assert printed.count("Serving benchmark result") == 2 and "Max concurrency:" in printed
    assert re.search(r"^Request rate \(req/s\): +inf$", printed, re.M)
    assert re.search(r"^Completed requests: +5$", printed, re.M)


def test_the_load_client_holds_max_concurrency_and_sends_at_the_arrivals(monkeypatch):
    """open_loop with a cap: never more than that many streams out at once, none sent before its
    arrival, each with its own output length; without one, all at once."""
    out, most, sent = 0, [0], {}

    async def fake(session, url, prompt, max_tokens, chat=False):
        nonlocal out
        out += 1
        most[0] = max(most[0], out)
        sent[prompt[0]] = (time.perf_counter(), max_tokens)
        await asyncio.sleep(0.02)
        out -= 1
        return bench.Timing(sent[prompt[0]][0], [time.perf_counter()])
    monkeypatch.setattr(bench, "stream_completion", fake)
    arrivals = [0.0, 0.0, 0.0, 0.01, 0.05, 0.05]
    start = time.perf_counter()
    asyncio.run(bench.open_loop(None, "", [[i] for i in range(6)], [1, 2, 3, 4, 5, 6], arrivals, 2))
    assert most[0] == 2 and all(sent[i][0] - start >= arrivals[i] for i in range(6))
    assert [sent[i][1] for i in range(6)] == [1, 2, 3, 4, 5, 6]
    most[0] = 0
    asyncio.run(bench.open_loop(None, "", [[i] for i in range(6)], 3, [0.0] * 6))
    assert most[0] == 6


def test_the_load_client_refuses_another_datasets_options(capsys):
    for argv, message in ((["--dataset", "random", "--rate", "1"], "--rate belongs to --dataset study"),
                          (["--request-rate", "inf", "--concurrency", "2"], "--request-rate belongs to --dataset random"),
                          ([], "give one of --concurrency (closed loop) and --rate (open loop)"),
                          (["--dataset", "random", "--random-range-ratio", "0"], "expected a number in (0, 1]"),
                          (["--dataset", "random", "--request-rate", "0,inf"], "expected a positive float (or inf)"),
                          (["--dataset", "random", "--seed", "-2"], "--seed: expected an integer in [0, ")):
        assert bench.main(argv) == 2
        assert message in capsys.readouterr().err, argv


def test_a_replayed_workload_gives_each_request_its_draw_and_refuses_other_shapes():
    """--workload: after one uncounted warm-up request of the workload's shape, the n-th request
    replays draw n (its tokens are an in-process run's with that draw); a prompt of another length,
    or more tokens than the draws cover, gets a 400 naming the field."""
    model = tiny(FAMILY)
    draws = request_draws("tiny", model.config, 40, 4, 2)             # 2 draws of [3 steps, layers, k]
    workload = ReplayWorkload("tiny", 40, 4, draws)

    def server() -> Server:
        return Server(model, "hisparse", max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=3, prefill_chunk=CHUNK,
                      prefill="reference", selections=draws[0], **SETTINGS[FAMILY])
    prompts = [list(range(1, 41)), list(range(50, 90))]
    in_process = server().serve([Request(torch.tensor(p), 4, selections=draws[i]) for i, p in enumerate(prompts)])
    mixed = server().serve([Request(torch.tensor(prompts[0]), 4, selections=draws[1])])
    assert mixed.requests[0].tokens != in_process.requests[0].tokens, "the draws do not matter here: no check"
    running = Running(server(), workload=workload)
    try:
        async def go():
            async with aiohttp.ClientSession() as session:
                got = [await post(session, running.url, {"prompt": p, "max_tokens": 4}) for p in prompts]
                short = await post(session, running.url, {"prompt": prompts[0][:-1], "max_tokens": 4})
                long = await post(session, running.url, {"prompt": prompts[0], "max_tokens": 5})
                return got, short, long
        got, short, long = run(go())
        assert [g[1]["choices"][0]["token_ids"] for g in got] == [r.tokens for r in in_process.requests]
        assert short[0] == 400 and short[1]["error"]["param"] == "prompt" and "exactly 40 tokens" in short[1]["error"]["message"]
        assert long[0] == 400 and long[1]["error"]["param"] == "max_tokens"
        assert running.service.info["hisparse"]["workload"] == "tiny"
        assert len(running.server.requests) == 3, "no untimed warm-up request of the workload's shape first"
        assert running.worker.snapshot().result(10)["served"] == 2      # the warm-up is not counted
    finally:
        running.shut_down()


def test_the_command_serves_a_model_already_built():
    """main(model=...) (benchmarks/serving_http.sh: the sweep's study model, no checkpoint): the
    server is built around that model and named as given; without either, --model is required."""
    from hisparse.serve.__main__ import build_parser, build_server
    ap = build_parser()
    server, name, workload = build_server(ap, ap.parse_args(["--max-context", "64", "--kv-budget-gib", "0.01"]),
                                          tiny(FAMILY), "dsa")
    assert server.model is tiny(FAMILY) and name == "dsa" and workload is None and server.max_context == 64
    with pytest.raises(SystemExit):
        build_server(ap, ap.parse_args([]))
    from hisparse.models.config import config_from_dict
    from hisparse.models.loading import build_model
    from hisparse.models.tiny import TINY_CONFIGS
    fp8 = build_model(config_from_dict(dict(TINY_CONFIGS[FAMILY], kv_lora_rank=512, qk_rope_head_dim=64,
                                            index_head_dim=64, num_hidden_layers=1))).float()
    server, _, _ = build_server(ap, ap.parse_args(["--max-context", "64", "--kv-budget-gib", "0.01",
                                                   "--kv-dtype", "fp8"]), fp8, "dsa-fp8")
    info = describe(server, "dsa-fp8", 0.01, None)["hisparse"]
    point_columns = bench.point_columns
    assert server.kv_dtype == "fp8" and info["kv_dtype"] == "fp8" and info["unit_bytes"] == 656
    assert info["attention_kernel"] == "triton" and info["prefill_overlap"] is False
    assert "prefill_overlap" not in point_columns({"id": "dsa-fp8", "hisparse": info}, 8, 2, 1, None)
    described = {"id": "dsa-fp8", "hisparse": info}                 # as the sweep: only a closed loop's, not 2
    assert point_columns(described, 8, 2, 4, None, 3)["requests_per_client"] == 3
    assert all("requests_per_client" not in point_columns(described, 8, 2, *load)
               for load in ((4, None, 2), (4, None, None), (None, 0.5, 3)))
    server, _, _ = build_server(ap, ap.parse_args(["--max-context", "64", "--kv-budget-gib", "0.01",
                                                   "--prefill-overlap", "--prefill-layers", "2", "--prefill-sms", "8"]),
                                 tiny(FAMILY), "dsa")
    assert server.prefill_overlap and server.prefill_layers == 2 and server.prefill_sms == 8
    info = describe(server, "dsa", 0.01, None)
    point = point_columns(info, 8, 2, 1, None)
    assert point["prefill_overlap"] is True and point["prefill_layers"] == 2     # not the sweep's 4-layer pieces
    assert point["prefill_sms"] == 8
    server, _, _ = build_server(ap, ap.parse_args(["--max-context", "64", "--kv-budget-gib", "0.01",
                                                   "--prefill-overlap"]), tiny(FAMILY), "dsa")
    assert server.prefill_layers == 4 and "prefill_layers" not in point_columns(describe(server, "dsa", 0.01, None),
                                                                                8, 2, 1, None)
    assert "prefill_sms" not in point_columns(describe(server, "dsa", 0.01, None), 8, 2, 1, None)
    for alone in (["--prefill-layers", "2"], ["--prefill-sms", "8"]):
        with pytest.raises(SystemExit):
            build_server(ap, ap.parse_args(alone), tiny(FAMILY), "dsa")
    plain = point_columns(describe(server, "dsa", 0.01, None), 8, 2, 1, None)   # FP8 keys, sharing: the rows say so
    assert not {"index_dtype", "prefix_cache", "disaggregated"} & set(plain)
    server, _, _ = build_server(ap, ap.parse_args(["--max-context", "150", "--kv-budget-gib", "0.01", "--mode",
                                                   "hisparse", "--cache-slots", "16", "--index-dtype", "fp8",
                                                   "--prefix-cache"]), tiny(FAMILY), "dsa")
    info = describe(server, "dsa", 0.01, None)
    point = point_columns(dict(info, hisparse=dict(info["hisparse"], prefill_devices=["cuda:1"])), 8, 2, 1, None)
    assert point["index_dtype"] == "fp8" and point["prefix_cache"] is True and point["disaggregated"] is True


def test_the_command_refuses_prefill_overlap_for_a_quest_model(tmp_path, capsys):
    llama = write_tiny_checkpoint("llama", tmp_path / "llama")
    assert serve_main(["--model", str(llama), "--mode", "hisparse", "--cache-slots", "8", "--prefill-overlap"]) == 2
    assert "prefill_overlap=True is built for DSA models" in capsys.readouterr().err


def test_the_command_checks_its_workload_options(tmp_path, capsys):
    checkpoint = str(tmp_path / "unused")
    for argv, message in ((["--workload-input-len", "8"], "--workload-input-len: only with --workload"),
                          (["--workload", "nope"], "unknown preset 'nope'"),
                          (["--workload", "tiny", "--workload-input-len", "8"], "needs --workload-input-len and"),
                          (["--workload", "tiny", "--workload-input-len", "4000", "--workload-output-len", "200"],
                           "exceed --max-context 4096")):
        assert serve_main(["--model", checkpoint, *argv]) == 2
        assert message in capsys.readouterr().err, argv
    llama = write_tiny_checkpoint("llama", tmp_path / "llama")
    assert serve_main(["--model", str(llama), "--kv-dtype", "fp8"]) == 2
    assert "--kv-dtype: fp8 rows are DSA's" in capsys.readouterr().err


def test_the_command_serves_and_exits_cleanly_on_sigterm(tmp_path, capsys):
    """--help and a bad --model in-process; then the real command on a free port: a completion,
    SIGTERM, exit 0 with every host row free."""
    assert serve_main(["--help"]) == 0
    assert "--shutdown-timeout" in capsys.readouterr().out
    assert serve_main(["--model", str(tmp_path / "nowhere")]) == 2
    assert "no config.json" in capsys.readouterr().err
    checkpoint = write_tiny_checkpoint(FAMILY, tmp_path / "tiny", num_hidden_layers=2)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "hisparse.serve", "--model", str(checkpoint), "--port", "0",
                             "--mode", "hisparse", "--cache-slots", "16", "--max-context", "64", "--max-batch", "2",
                             "--prefill", "reference"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = None
        for line in proc.stderr:
            if match := re.search(r"on http://127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
                break
        assert port, "the command never said where it listens"
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                         data=json.dumps({"prompt": B, "max_tokens": 2}).encode())
        with urllib.request.urlopen(request, timeout=30) as response:
            assert len(json.loads(response.read())["choices"][0]["token_ids"]) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        tail = proc.stderr.read()
        assert "1 requests served" in tail and re.search(r"host rows in use 0 of \d+", tail), tail
        assert re.search(r"hisparse\.serve\.access: 127\.0\.0\.1 POST /v1/completions 200 5\+2 tokens", tail), tail
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

# -- issue #63 item 7: no request gets a 500, nulls are absent, JSON errors everywhere, startup refusals

async def answer(session, method: str, url: str, **kw) -> tuple[int, str, dict | None]:
    """(status, Content-Type, the JSON body or None)."""
    async with session.request(method, url, **kw) as response:
        text = await response.text()
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        return response.status, response.content_type, body


def assert_error(got, status: int, param, words: str, code=None) -> None:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    got_status, content_type, body = got
    assert got_status == status and content_type == "application/json", got
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param and error["code"] == code, error
    assert words in error["message"], error


def test_null_is_absent_for_every_optional_field(resident):
    """What OpenAI clients send for "not given" (null), and the neutral values, are served."""
    optional = ["model", "max_tokens", "stream", "stream_options", "temperature", "top_p", "n", "best_of",
                "presence_penalty", "frequency_penalty", "logprobs", "echo", "stop", "suffix", "logit_bias",
                "ignore_eos", "seed", "user"]
    neutral = {"model": "tiny", "temperature": 0, "top_p": 1, "n": 1, "best_of": 1, "presence_penalty": 0,
               "frequency_penalty": 0.0, "echo": False, "stop": [], "seed": 7, "user": "me", "stream": False}

    async def go():
        async with aiohttp.ClientSession() as s:
            nulls = await post(s, resident.url, {"prompt": B, "max_tokens": None, **dict.fromkeys(optional)})
            neutrals = await post(s, resident.url, {"prompt": B, "max_tokens": 1, **neutral})
            return nulls, neutrals
    (status, nulls), (neutral_status, neutrals) = run(go())
    assert status == 200, nulls
    assert nulls["choices"][0]["token_ids"] == alone(tuple(B), 16)          # max_tokens null: the default, 16
    assert neutral_status == 200 and neutrals["choices"][0]["token_ids"] == alone(tuple(B), 1), neutrals


def test_model_seed_and_user_of_the_wrong_type_get_a_400(resident):
    bad = [({"model": 5}, "model", "string"), ({"seed": "x"}, "seed", "an int"), ({"seed": 1.5}, "seed", "an int"),
           ({"user": {}}, "user", "string"), ({"temperature": "hot"}, "temperature", "finite number")]

    async def go():
        async with aiohttp.ClientSession() as s:
            return [await answer(s, "POST", f"{resident.url}/v1/completions", json={"prompt": [1], **body})
                    for body, _, _ in bad]
    for got, (body, param, words) in zip(run(go()), bad):
        assert_error(got, 400, param, words)


def test_a_wrong_model_name_gets_a_404_model_not_found(resident):
    async def go():
        async with aiohttp.ClientSession() as s:
            return await answer(s, "POST", f"{resident.url}/v1/completions",
                                json={"model": "gpt-3.5-turbo-instruct", "prompt": [1]})
    assert_error(run(go()), 404, "model", "'gpt-3.5-turbo-instruct'", code="model_not_found")


def test_the_official_openai_client_is_served(resident):
    """openai.OpenAI against the server: token-id prompts, a stream, and NotFoundError for a wrong model."""
    import openai
    client = openai.OpenAI(base_url=f"{resident.url}/v1", api_key="x", max_retries=0, timeout=30)
    done = client.completions.create(model="tiny", prompt=[A, B], max_tokens=2)
    assert [c.token_ids for c in done.choices] == [alone(tuple(A), 2), alone(tuple(B), 2)]   # extra fields kept
    assert done.usage.completion_tokens == 4 and done.model == "tiny"
    streamed = [chunk.choices[0].text for chunk in client.completions.create(model="tiny", prompt=B, max_tokens=2,
                                                                             stream=True, temperature=None)]
    assert streamed == [str(t) for t in alone(tuple(B), 2)]
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as wrong:
        client.completions.create(model="davinci", prompt=[[1, 2, 3]], max_tokens=2)
    assert wrong.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2, temperature=-0.7)
    assert bad.value.param == "temperature"


def test_a_body_nested_too_deep_gets_a_400(resident):
    """A body nested 100,000 deep, or a prompt 5,000 deep, is malformed: a 400, not a 500."""
    deep_prompt = b'{"prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}"

    async def go():
        async with aiohttp.ClientSession() as s:
            return [await answer(s, "POST", f"{resident.url}/v1/completions", data=body)
                    for body in (b"[" * 100_000 + b"]" * 100_000, deep_prompt)]
    for got in run(go()):
        assert_error(got, 400, None, "nested")


def test_a_body_that_is_not_the_gzip_it_claims_gets_a_400(resident):
    async def go():
        async with aiohttp.ClientSession() as s:
            bad = await answer(s, "POST", f"{resident.url}/v1/completions", data=b'{"prompt": [1]}',
                               headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
            import gzip
            good = await answer(s, "POST", f"{resident.url}/v1/completions",
                                data=gzip.compress(json.dumps({"prompt": B, "max_tokens": 1}).encode()),
                                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
            return bad, good
    bad, good = run(go())
    assert_error(bad, 400, None, "Content-Encoding")
    assert good[0] == 200 and good[2]["choices"][0]["token_ids"] == alone(tuple(B), 1)


def test_a_body_in_a_coding_the_server_does_not_read_gets_a_json_415_naming_it(resident):
    """br and zstd (aiohttp answered them with a plain-text 400 before any handler ran), and an
    unknown one: OpenAI's error shape naming the coding; deflate, raw or zlib, is read; a gzip bomb
    past the body limit is a 413; the connection serves the next request."""
    import zlib

    from hisparse.serve.body import MAX_BODY_BYTES
    body = json.dumps({"prompt": B, "max_tokens": 1}).encode()
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw_deflate = raw_deflate.compress(body) + raw_deflate.flush()
    bomb = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    bomb = bomb.compress(b" " * (MAX_BODY_BYTES + 1)) + bomb.flush()

    async def go():
        async with aiohttp.ClientSession() as s:
            url = f"{resident.url}/v1/completions"
            refused = []
            for coding in ("br", "zstd", "gzip, br", "x-foo"):
                async with s.post(url, data=b'{"prompt": [1]}', headers={"Content-Encoding": coding}) as response:
                    refused.append((coding, response.status, response.content_type, await response.json(),
                                    response.headers.get("Accept-Encoding")))
            read = [await answer(s, "POST", url, data=data, headers={"Content-Encoding": "deflate"})
                    for data in (zlib.compress(body), raw_deflate)]
            big = await answer(s, "POST", url, data=bomb, headers={"Content-Encoding": "gzip"})
            return refused, read, big
    refused, read, big = run(go())
    for coding, status, content_type, got, accepted in refused:
        assert_error((status, content_type, got), 415, None, repr(coding.split(", ")[-1]))
        assert accepted == "gzip, deflate, identity"
    for status, _, got in read:
        assert status == 200 and got["choices"][0]["token_ids"] == alone(tuple(B), 1)
    assert_error(big, 413, None, "decoded from gzip")


def test_unknown_paths_and_methods_get_json_errors(resident):
    async def go():
        async with aiohttp.ClientSession() as s:
            return [await answer(s, "POST", f"{resident.url}/v1/chat/completions",
                                 json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
                    await answer(s, "GET", f"{resident.url}/v1/nowhere"),
                    await answer(s, "GET", f"{resident.url}/v1/completions"),
                    await answer(s, "DELETE", f"{resident.url}/health")]
    chat, nowhere, get, delete = run(go())
    assert_error(chat, 400, "messages", "no tokenizer")
    assert_error(nowhere, 404, None, "/v1/nowhere")
    assert_error(get, 405, None, "POST")
    assert_error(delete, 405, None, "GET")


def test_too_many_prompts_are_refused_and_metrics_stays_responsive(resident):
    """A request of 20,000 prompts gets a 400 stating the cap, and /metrics and /health answer
    meanwhile (it once held /metrics for 36 s)."""
    async def go():
        async with aiohttp.ClientSession() as s:
            big = asyncio.ensure_future(answer(s, "POST", f"{resident.url}/v1/completions",
                                               json={"prompt": [[1]] * 20_000, "max_tokens": 1}))
            await asyncio.sleep(0.3)
            loop = asyncio.get_running_loop()
            start = loop.time()
            await asyncio.wait_for(metrics(s, resident.url), 5)
            await asyncio.wait_for(answer(s, "GET", f"{resident.url}/health"), 5)
            return loop.time() - start, await big
    waited, big = run(go())
    assert waited < 3, f"/metrics and /health took {waited:.1f} s beside a big request"
    assert_error(big, 400, "prompt", "at most 256 prompts")


def test_a_big_body_is_checked_off_the_event_loop(resident, monkeypatch):
    """A body's checks run in a worker thread, not on the event loop (there they held /metrics and
    /health for about 0.1 s per 1M tokens); a prompt over max_context is refused before its ids
    are read one by one."""
    from hisparse.serve import app
    threads, checked = [], []
    parse, is_int = app.parse_completion, protocol._is_int

    def recording(*args, **kw):
        threads.append(threading.current_thread())
        return parse(*args, **kw)

    def counting(value):
        checked.append(value)
        return is_int(value)
    monkeypatch.setattr(app, "parse_completion", recording)
    monkeypatch.setattr(protocol, "_is_int", counting)

    async def go():
        async with aiohttp.ClientSession() as s:
            return await answer(s, "POST", f"{resident.url}/v1/completions",
                                json={"prompt": [7] * 1_000_000, "max_tokens": 1})
    assert_error(run(go()), 400, "prompt", "max_context=96")
    assert threads and resident.thread not in threads, "checked on the event loop's thread"
    assert len(checked) < 1000, f"{len(checked)} ids read one by one for a prompt refused by its length"


def test_each_request_gets_an_access_log_line(resident, caplog):
    """One line per request at INFO on hisparse.serve.access: method, path, status, tokens, time."""
    async def go():
        async with aiohttp.ClientSession() as s:
            await post(s, resident.url, {"prompt": B, "max_tokens": 2})
            await post(s, resident.url, {"prompt": [1], "max_tokens": 0})
            await answer(s, "GET", f"{resident.url}/health")
    with caplog.at_level("INFO", logger="hisparse.serve.access"):
        run(go())
        for _ in range(100):                 # a line is written once its answer has gone: maybe after the client has it
            lines = [r.getMessage() for r in caplog.records if r.name == "hisparse.serve.access"]
            if len(lines) >= 3:
                break
            time.sleep(0.02)
    assert len(lines) == 3, lines
    assert re.fullmatch(rf"127\.0\.0\.1 POST /v1/completions 200 {len(B)}\+2 tokens \d+\.\d{{3}} s", lines[0]), lines
    assert re.fullmatch(r"127\.0\.0\.1 POST /v1/completions 400 - \d+\.\d{3} s", lines[1]), lines
    assert re.fullmatch(r"127\.0\.0\.1 GET /health 200 - \d+\.\d{3} s", lines[2]), lines


def test_the_command_refuses_sizes_the_machine_cannot_hold(tmp_path, capsys):
    """Refused at start-up, naming the option and both numbers, before anything is allocated: a
    --max-context whose one lane outgrows the device, a host pool larger than the host, and a
    --host-budget-gib that holds no request."""
    checkpoint = str(write_tiny_checkpoint(FAMILY, tmp_path / "tiny", num_hidden_layers=2))
    base = ["--model", checkpoint, "--prefill", "reference", "--port", "0"]
    for argv, words in ((["--max-context", "10000000000", "--kv-budget-gib", "100000"], "--max-context"),
                        (["--mode", "hisparse", "--cache-slots", "16", "--host-budget-gib", "100000"],
                         "--host-budget-gib"),
                        (["--mode", "hisparse", "--cache-slots", "16", "--host-budget-gib", "1e-12"],
                         "--host-budget-gib")):
        assert serve_main(base + argv) == 2, argv
        err = capsys.readouterr().err
        assert f"argument {words}" in err and "Traceback" not in err and "host_rows" not in err, err
        assert len(re.findall(r"\d+(\.\d+)? ?[KMGT]?i?B", err)) >= 2, err       # what it needs, what there is

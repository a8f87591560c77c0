"""python -m hisparse.serve.bench: the serving study's loads over HTTP, against a running
`python -m hisparse.serve`, with rows into results/serving.csv marked transport=http.

    python -m hisparse.serve.bench --url http://127.0.0.1:8000 --concurrency 2,8 --requests-per-client 4 \\
        --input-len 1024 --output-len 64
    python -m hisparse.serve.bench --url http://127.0.0.1:8000 --rate 0.5 --requests 32 --input-len 1024 --output-len 64

Closed loop (--concurrency C): C clients, each sending its next request when its last one
finished (request i by client i % C). Open loop (--rate R): N requests at Poisson arrivals of R
per second. The prompts and arrivals are the in-process study's (`hisparse.serving.workload`:
random prompts seeded per request, arrivals seeded), so a row here sits beside its in-process
twin. Every request streams; per request, TTFT is send to the first token event, TPOT the mean gap
between its token events, latency send to the last; tokens/s is every output token over the span
from the first send to the last token. The model, mode, cache slots and budgets come from the
server's GET /v1/models, so the rows carry the columns of the in-process rows.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from hisparse.generate import positive_int
from hisparse.serving import PREFILL_LAYERS, TokenTimeline, timing_summary
from hisparse.serving.workload import REQUESTS_PER_CLIENT, serving_requests

UNITS = {"tokens_per_s": "tokens/s", "requests": "requests", "output_tokens": "tokens", "lanes": "requests",
         "failed_requests": "requests", "wall_s": "s"}


@dataclass
class Timing(TokenTimeline):
    """One request as the client saw it: send time and each token event's time (perf_counter s)."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def start(self) -> float:
        return self.sent


async def stream_completion(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> Timing:
    """POST one streaming completion; the time of every token event, or the error that ended it."""
    timing = Timing(time.perf_counter())
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                timing.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return timing
            done = False
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    timing.error = event["error"]["message"]
                    return timing
                timing.token_times.append(time.perf_counter())
                timing.tokens += event["choices"][0]["token_ids"]
            if not done:
                timing.error = "the stream ended without [DONE]"
    except aiohttp.ClientError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


async def closed_loop(session, url: str, prompts: list[list[int]], max_tokens: int, clients: int) -> list[Timing]:
    """Request i by client i % clients, each client's next as soon as its last one finished."""
    timings: list[Timing | None] = [None] * len(prompts)

    async def client(c: int) -> None:
        for i in range(c, len(prompts), clients):
            timings[i] = await stream_completion(session, url, prompts[i], max_tokens)
    await asyncio.gather(*(client(c) for c in range(clients)))
    return timings


async def open_loop(session, url: str, prompts: list[list[int]], max_tokens: int, arrivals: list[float]) -> list[Timing]:
    """Request i sent at `arrivals[i]` seconds after the start, whatever is still running."""
    start = time.perf_counter()

    async def send(i: int) -> Timing:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        return await stream_completion(session, url, prompts[i], max_tokens)
    return list(await asyncio.gather(*(send(i) for i in range(len(prompts)))))


def summarize(timings: list[Timing]) -> dict[str, float]:
    """run_serving's metric names over the requests that succeeded (queueing is not visible over HTTP)."""
    ok = [t for t in timings if t.error is None and t.token_times]
    out = timing_summary(ok, min((t.sent for t in timings), default=0.0), itl=False)
    out["failed_requests"] = len(timings) - len(ok)
    return out


def point_columns(info: dict, input_len: int, output_len: int, concurrency: int | None, rate: float | None,
                  requests_per_client: int | None = None) -> dict:
    """The columns of an in-process serving row, from the server's description (a closed loop's
    requests_per_client where it is not the sweep's default, as the sweep's rows)."""
    s = info["hisparse"]
    point = {"bench": "serving", "family": s["family"], "mode": s["mode"], "batch": None, "context": input_len,
             "k": s["k"], "cache_slots": s["cache_slots"], "unit_bytes": s["unit_bytes"], "workload": s["workload"],
             "model": info["id"], "layers": s["layers"], "hidden": s["hidden"], "input_len": input_len,
             "output_len": output_len, "concurrency": concurrency, "rate": rate, "kv_budget_gib": s["kv_budget_gib"],
             "host_budget_gib": s["host_budget_gib"], "graph": s["graph"], "prefill_chunk": s["prefill_chunk"],
             "decode_backend": s["decode_backend"], "attention_kernel": s["attention_kernel"], "transport": "http"}
    if "token_budget" in s:
        point["token_budget"] = s["token_budget"]
    if s.get("kv_dtype", "bf16") != "bf16":          # as the sweep's rows: bf16 leaves it empty
        point["kv_dtype"] = s["kv_dtype"]
    if concurrency is not None and requests_per_client not in (None, REQUESTS_PER_CLIENT):
        point["requests_per_client"] = requests_per_client
    if s.get("prefill_overlap"):                     # as the sweep's rows: without overlap leaves it empty
        point["prefill_overlap"] = True
        if s.get("prefill_layers", PREFILL_LAYERS) != PREFILL_LAYERS:   # the sweep's pieces are the default's
            point["prefill_layers"] = s["prefill_layers"]
        if s.get("prefill_sms") is not None:
            point["prefill_sms"] = s["prefill_sms"]
    return point


def rows(point: dict, summary: dict, lanes: int, wall_s: float) -> list[dict]:
    out = [dict(point, metric=m, value=v, unit=UNITS.get(m, "ms")) for m, v in summary.items()]
    out += [dict(point, metric="lanes", value=lanes, unit="requests"),
            dict(point, metric="wall_s", value=wall_s, unit="s")]
    return out


def workload(load: tuple[str, float], input_len: int, output_len: int, vocab: int, requests_per_client: int,
             requests: int) -> tuple[list[list[int]], list[float]]:
    """The in-process study's prompts and arrivals for this load (the same seeds)."""
    key, level = load
    point = {"concurrency": level if key == "concurrency" else None, "rate": level if key == "rate" else None,
             "input_len": input_len, "output_len": output_len}
    reqs, _ = serving_requests({"requests_per_client": requests_per_client, "requests": requests}, point, vocab)
    return [r.prompt.tolist() for r in reqs], [r.arrival for r in reqs]


async def fetch_info(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/v1/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]


async def run_load(url: str, load: tuple[str, float], args: argparse.Namespace, info: dict) -> list[dict]:
    """One load level: every request streamed, its rows."""
    vocab = args.vocab or info["hisparse"]["vocab_size"]
    prompts, arrivals = workload(load, args.input_len, args.output_len, vocab, args.requests_per_client, args.requests)
    connector = aiohttp.TCPConnector(limit=0)            # no pool limit: C clients are C connections
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if load[0] == "concurrency":
            timings = await closed_loop(session, url, prompts, args.output_len, int(load[1]))
        else:
            timings = await open_loop(session, url, prompts, args.output_len, arrivals)
    wall = time.perf_counter() - start
    for i, t in enumerate(timings):
        if t.error is not None:
            print(f"request {i} failed: {t.error}", file=sys.stderr)
    summary = summarize(timings)
    point = point_columns(info, args.input_len, args.output_len, *(
        (int(load[1]), None) if load[0] == "concurrency" else (None, load[1])), args.requests_per_client)
    print(f"{point['mode']} {load[0]}={load[1]:g}: {summary['requests']} requests, "
          f"{summary['tokens_per_s']:.2f} tokens/s, TTFT p50 {summary['ttft_ms_p50']:.1f} ms, "
          f"TPOT p50 {summary['tpot_ms_p50']:.1f} ms, {summary['failed_requests']} failed", flush=True)
    return rows(point, summary, info["hisparse"]["lanes"], wall)


def _positive_list(kind):
    def parse(text: str):
        try:
            values = [kind(part) for part in text.split(",")]
        except ValueError:
            values = []
        if not values or not all(v > 0 and v != float("inf") for v in values):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__} or a comma-separated list of "
                                             f"them, got {text!r}")
        return values
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hisparse.serve.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000",
                    help="the server, as python -m hisparse.serve prints it (default http://127.0.0.1:8000)")
    load = ap.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=_positive_list(int), metavar="C[,C...]",
                      help="closed loop: this many clients (a list: one run per level)")
    load.add_argument("--rate", type=_positive_list(float), metavar="R[,R...]",
                      help="open loop: Poisson arrivals at R requests/s (a list: one run per rate)")
    ap.add_argument("--requests-per-client", type=positive_int, default=2, metavar="N",
                    help="closed loop: requests each client sends (default 2, as the sweep's: the rows then "
                         "pair with its in-process ones)")
    ap.add_argument("--requests", type=positive_int, default=16, metavar="N",
                    help="open loop: requests per rate (default 16)")
    ap.add_argument("--input-len", type=positive_int, default=1024, metavar="L",
                    help="prompt tokens of every request (default 1024)")
    ap.add_argument("--output-len", type=positive_int, default=64, metavar="M",
                    help="tokens each request generates, its first from the prefill (default 64)")
    ap.add_argument("--vocab", type=positive_int, default=None, metavar="V",
                    help="draw prompt ids below V (default: the server's vocabulary)")
    ap.add_argument("--timeout", type=_positive_list(float), default=[600.0], metavar="S",
                    help="seconds a stream may stay silent before the request counts as failed (default 600)")
    ap.add_argument("--out", default="results", help="folder of serving.csv (default results)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    args.timeout = args.timeout[0]
    from hisparse.results import append_rows, check_out_folder
    check_out_folder(ap, args.out)
    url = args.url.rstrip("/")
    loads = [("concurrency", c) for c in args.concurrency or []] + [("rate", r) for r in args.rate or []]
    return asyncio.run(_main(url, loads, args, append_rows))


async def _main(url: str, loads: list, args: argparse.Namespace, append_rows) -> int:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            info = await fetch_info(session, url)
    except (TimeoutError, aiohttp.ClientError, KeyError, IndexError, ValueError) as exc:
        print(f"error: --url {url}: no hisparse server answers GET /v1/models there ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    need, max_context = args.input_len + args.output_len, info["hisparse"]["max_context"]
    if need > max_context:
        print(f"error: --input-len {args.input_len} plus --output-len {args.output_len} is {need} tokens, over the "
              f"server's max_context={max_context}", file=sys.stderr)
        return 2
    path = Path(args.out) / "serving.csv"
    failed = 0
    for load in loads:
        new = await run_load(url, load, args, info)
        append_rows(path, new)
        failed += next(r["value"] for r in new if r["metric"] == "failed_requests")
    print(f"rows -> {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m hisparse.serve.bench: the serving study's loads over HTTP, against a running
`python -m hisparse.serve`, with rows into serving.csv marked transport=http.

    python -m hisparse.serve.bench --url http://127.0.0.1:8000 --concurrency 2,8 --requests-per-client 4 \\
        --input-len 1024 --output-len 64
    python -m hisparse.serve.bench --url http://127.0.0.1:8000 --rate 0.5 --requests 32 --input-len 1024 --output-len 64
    python -m hisparse.serve.bench --dataset random --random-input-len 1024 --random-output-len 128 \\
        --random-range-ratio 0.5 --num-prompts 64 --request-rate 1,2,4,inf --max-concurrency 8 --seed 1

--dataset study (the default), the in-process study's loads: a closed loop (--concurrency C: C
clients, each sending its next request when its last one finished, request i by client i % C) or an
open loop (--rate R: N requests at Poisson arrivals of R per second), prompts and arrivals the
sweep's own (`hisparse.serving.workload`), so a row here sits beside its in-process twin.
--dataset random, the serving benchmarks' dialect (`sglang.bench_serving`, `vllm bench serve`):
--num-prompts requests whose prompt and output lengths are drawn uniformly from [len * ratio, len],
sent at Poisson arrivals of --request-rate per second (inf: all at once), at most --max-concurrency
of them out at a time (a request waits for a free one), all drawn from --seed
(`RandomWorkload`, as the sweep's request_rate studies draw it); one run per rate.

--prompt-format text sends each prompt as text (its random ids decoded by the server's tokenizer,
or --tokenizer's) to /v1/completions, chat as one user message to /v1/chat/completions; the input
tokens counted are then the server's (its usage), and the rows say prompt_format.

Every request streams (ignore_eos: each runs to its length); per request, TTFT is send to the first
token event, TPOT the mean gap between its token events, ITL each gap, latency send to the last;
throughputs count over the span from the first send to the last token. Each run prints the
dialect's summary block (requests/s, input and output tokens/s, mean, median and p99 of TTFT, TPOT,
ITL and end-to-end latency). The
model, mode, cache slots and budgets come from the server's GET /v1/models, so the rows carry the
columns of the in-process rows (and, for --dataset random, the workload's: request_rate,
num_prompts, range_ratio, max_concurrency, seed).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from hisparse.generate import positive_int
from hisparse.results import DEFAULT_OUT, OUT_HELP, append_rows, check_out_folder
from hisparse.serving import PREFILL_LAYERS, TokenTimeline, benchmark_summary, format_summary, timing_summary
from hisparse.serving.request import DIALECT_METRICS
from hisparse.serving.workload import MAX_SEED, REQUESTS_PER_CLIENT, RandomWorkload, serving_requests

UNITS = {"tokens_per_s": "tokens/s", "requests": "requests", "output_tokens": "tokens", "lanes": "requests",
         "failed_requests": "requests", "wall_s": "s", "request_throughput": "requests/s",
         "input_throughput": "tokens/s"}
DATASETS = ("study", "random")
PROMPT_FORMATS = ("ids", "text", "chat")


@dataclass
class Timing(TokenTimeline):
    """One request as the client saw it: send time and each token event's time (perf_counter s)."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    prompt_tokens: int | None = None     # the server's count (its usage chunk)

    @property
    def start(self) -> float:
        return self.sent


async def stream_completion(session: aiohttp.ClientSession, url: str, prompt: list[int] | str, max_tokens: int,
                            chat: bool = False) -> Timing:
    """POST one streaming completion (token ids or text; chat: the text as one user message to
    /v1/chat/completions); the time of every token event, or the error that ended it."""
    timing = Timing(time.perf_counter())
    body = {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "ignore_eos": True}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    try:
        async with session.post(f"{url}/v1/{'chat/' if chat else ''}completions", json=body) as response:
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
                if event.get("usage"):
                    timing.prompt_tokens = event["usage"]["prompt_tokens"]
                ids = [t for c in event["choices"] for t in c.get("token_ids") or []]   # chat's role chunk: none
                if ids:
                    timing.token_times.append(time.perf_counter())
                    timing.tokens += ids
            if not done:
                timing.error = "the stream ended without [DONE]"
    except aiohttp.ClientError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


async def closed_loop(session, url: str, prompts: list, max_tokens: int, clients: int, chat: bool = False
                      ) -> list[Timing]:
    """Request i by client i % clients, each client's next as soon as its last one finished."""
    timings: list[Timing | None] = [None] * len(prompts)

    async def client(c: int) -> None:
        for i in range(c, len(prompts), clients):
            timings[i] = await stream_completion(session, url, prompts[i], max_tokens, chat)
    await asyncio.gather(*(client(c) for c in range(clients)))
    return timings


async def open_loop(session, url: str, prompts: list, max_tokens: int | list[int], arrivals: list[float],
                    max_concurrency: int | None = None, chat: bool = False) -> list[Timing]:
    """Request i (max_tokens[i] out, or max_tokens for each) sent at `arrivals[i]` seconds after the
    start, whatever is still running; with max_concurrency, once fewer than that many are out."""
    start = time.perf_counter()
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else contextlib.nullcontext()
    out = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)

    async def send(i: int) -> Timing:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        async with limit:
            return await stream_completion(session, url, prompts[i], out[i], chat)
    return list(await asyncio.gather(*(send(i) for i in range(len(prompts)))))


def summarize(timings: list[Timing], input_tokens: int | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """run_serving's metric names over the requests that succeeded (queueing is not visible over
    HTTP) and the failed count; and the dialect's summary (`benchmark_summary`) of them."""
    ok = [t for t in timings if t.error is None and t.token_times]
    first = min((t.sent for t in timings), default=0.0)
    out = timing_summary(ok, first, itl=False)
    out["failed_requests"] = len(timings) - len(ok)
    return out, benchmark_summary(ok, first, input_tokens)


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
    for key in ("kv_dtype", "index_dtype"):           # as the sweep's rows: bf16 leaves it empty
        if s.get(key, "bf16") != "bf16":
            point[key] = s[key]
    if s.get("prefix_cache"):                         # as the sweep's rows: True or empty
        point["prefix_cache"] = True
    if s.get("prefill_devices"):                      # prefill worker processes: the decode server's own rows
        point["disaggregated"] = True
    if concurrency is not None and requests_per_client not in (None, REQUESTS_PER_CLIENT):
        point["requests_per_client"] = requests_per_client
    if s.get("prefill_overlap"):                     # as the sweep's rows: without overlap leaves it empty
        point["prefill_overlap"] = True
        if s.get("prefill_layers", PREFILL_LAYERS) != PREFILL_LAYERS:   # the sweep's pieces are the default's
            point["prefill_layers"] = s["prefill_layers"]
        if s.get("prefill_sms") is not None:
            point["prefill_sms"] = s["prefill_sms"]
    return point


def dialect_columns(w: RandomWorkload) -> dict:
    """The columns a request_rate point adds (as the sweep's): its workload's parameters."""
    return {"request_rate": w.request_rate, "num_prompts": w.num_prompts, "range_ratio": w.range_ratio,
            "max_concurrency": w.max_concurrency, "seed": w.seed}


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


def random_workload(args: argparse.Namespace, rate: float) -> RandomWorkload:
    return RandomWorkload(args.random_input_len, args.random_output_len, args.num_prompts, args.random_range_ratio,
                          rate, args.max_concurrency, args.seed)


async def fetch_info(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/v1/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]


async def run_load(url: str, load: tuple[str, float], args: argparse.Namespace, info: dict) -> list[dict]:
    """One load level: every request streamed, its rows; the dialect's summary block printed."""
    vocab = args.vocab or info["hisparse"]["vocab_size"]
    key, level = load
    dialect = random_workload(args, level) if key == "request_rate" else None
    if dialect is not None:
        reqs = dialect.requests(vocab)
        prompts, max_tokens, arrivals = [r.prompt.tolist() for r in reqs], [r.max_new_tokens for r in reqs], \
            [r.arrival for r in reqs]
    else:
        prompts, arrivals = workload(load, args.input_len, args.output_len, vocab, args.requests_per_client,
                                     args.requests)
        max_tokens = args.output_len
    sent, chat = prompts, args.prompt_format == "chat"
    if args.prompt_format != "ids":
        sent = [args.tokenizer.decode(ids) for ids in prompts]
    connector = aiohttp.TCPConnector(limit=0)            # no pool limit: C clients are C connections
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if key == "concurrency":
            timings = await closed_loop(session, url, sent, max_tokens, int(level), chat)
        else:
            timings = await open_loop(session, url, sent, max_tokens, arrivals,
                                      dialect.max_concurrency if dialect is not None else None, chat)
    wall = time.perf_counter() - start
    for i, t in enumerate(timings):
        if t.error is not None:
            print(f"request {i} failed: {t.error}", file=sys.stderr)
    ok_input = sum(len(p) if t.prompt_tokens is None else t.prompt_tokens
                   for p, t in zip(prompts, timings) if t.error is None and t.token_times)
    summary, dialect_summary = summarize(timings, ok_input)
    if dialect is not None:
        point = dict(point_columns(info, dialect.input_len, dialect.output_len, None, None), **dialect_columns(dialect))
        summary.update({m: dialect_summary[m] for m in DIALECT_METRICS})
    else:
        point = point_columns(info, args.input_len, args.output_len, *(
            (int(level), None) if key == "concurrency" else (None, level)), args.requests_per_client)
    if args.prompt_format != "ids":
        point["prompt_format"] = args.prompt_format
    print(f"{point['mode']} {key}={level:g}: {summary['requests']} requests, "
          f"{summary['tokens_per_s']:.2f} tokens/s, TTFT p50 {summary['ttft_ms_p50']:.1f} ms, "
          f"TPOT p50 {summary['tpot_ms_p50']:.1f} ms, {summary['failed_requests']} failed", flush=True)
    print(format_summary(dialect_summary, level if key != "concurrency" else None,
                         dialect.max_concurrency if dialect is not None else int(level) if key == "concurrency"
                         else None, summary["failed_requests"]), flush=True)
    return rows(point, summary, info["hisparse"]["lanes"], wall)


def _positive_list(kind, inf: bool = False):
    def parse(text: str):
        try:
            values = [kind(part) for part in text.split(",")]
        except ValueError:
            values = []
        if not values or not all(v > 0 and (inf or v != math.inf) and not math.isnan(v) for v in values):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}{' (or inf)' if inf else ''} or a "
                                             f"comma-separated list of them, got {text!r}")
        return values
    return parse


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] (lengths are drawn from [len * ratio, len]), "
                                         f"got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {MAX_SEED}], got {text!r}")
    return value


# each dataset's own options (dest: flag), and their defaults, filled in once the dataset is known
STUDY_OPTIONS = {"concurrency": ("--concurrency", None), "rate": ("--rate", None),
                 "requests_per_client": ("--requests-per-client", REQUESTS_PER_CLIENT), "requests": ("--requests", 16),
                 "input_len": ("--input-len", 1024), "output_len": ("--output-len", 64)}
RANDOM_OPTIONS = {"random_input_len": ("--random-input-len", 1024), "random_output_len": ("--random-output-len", 128),
                  "random_range_ratio": ("--random-range-ratio", 1.0), "num_prompts": ("--num-prompts", 16),
                  "request_rate": ("--request-rate", [math.inf]), "max_concurrency": ("--max-concurrency", None),
                  "seed": ("--seed", 0)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hisparse.serve.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000",
                    help="the server, as python -m hisparse.serve prints it (default http://127.0.0.1:8000)")
    ap.add_argument("--dataset", choices=DATASETS, default="study",
                    help="study (default): the sweep's loads, --concurrency or --rate; random: bench_serving's "
                         "random dataset, the --random-*, --num-prompts, --request-rate, --max-concurrency and "
                         "--seed options")
    study = ap.add_argument_group("--dataset study: the in-process study's loads (one of --concurrency, --rate)")
    study.add_argument("--concurrency", type=_positive_list(int), metavar="C[,C...]",
                       help="closed loop: this many clients (a list: one run per level)")
    study.add_argument("--rate", type=_positive_list(float), metavar="R[,R...]",
                       help="open loop: Poisson arrivals at R requests/s (a list: one run per rate)")
    study.add_argument("--requests-per-client", type=positive_int, metavar="N",
                       help=f"closed loop: requests each client sends (default {REQUESTS_PER_CLIENT}, as the sweep's: "
                            f"the rows then pair with its in-process ones)")
    study.add_argument("--requests", type=positive_int, metavar="N", help="open loop: requests per rate (default 16)")
    study.add_argument("--input-len", type=positive_int, metavar="L",
                       help="prompt tokens of every request (default 1024)")
    study.add_argument("--output-len", type=positive_int, metavar="M",
                       help="tokens each request generates, its first from the prefill (default 64)")
    random = ap.add_argument_group("--dataset random: bench_serving's random dataset")
    random.add_argument("--random-input-len", type=positive_int, metavar="L",
                        help="the longest prompt: lengths uniform over [L * ratio, L] (default 1024)")
    random.add_argument("--random-output-len", type=positive_int, metavar="M",
                        help="the most tokens a request generates: uniform over [M * ratio, M] (default 128)")
    random.add_argument("--random-range-ratio", type=_ratio, metavar="RATIO",
                        help="the shortest length as a fraction of the longest, in (0, 1] (default 1.0: every "
                             "request L in, M out)")
    random.add_argument("--num-prompts", type=positive_int, metavar="N", help="requests per rate (default 16)")
    random.add_argument("--request-rate", type=_positive_list(float, inf=True), metavar="R[,R...]",
                        help="Poisson arrivals at R requests/s, inf: every request at once (default inf; a list: "
                             "one run per rate, the open-loop rate sweep)")
    random.add_argument("--max-concurrency", type=positive_int, metavar="C",
                        help="at most C requests out at once; a request due while C are out waits for one to end "
                             "(default: no cap)")
    random.add_argument("--seed", type=_seed, metavar="S", help="the seed of lengths, prompts and arrivals (default 0)")
    ap.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="ids",
                    help="ids (default): prompts as token ids; text: decoded into text; chat: that text as a user "
                         "message to /v1/chat/completions (text and chat need the server's tokenizer)")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="with --prompt-format text or chat: the tokenizer folder to decode prompts with (default: "
                         "the one the server names in GET /v1/models)")
    ap.add_argument("--vocab", type=positive_int, default=None, metavar="V",
                    help="draw prompt ids below V (default: the server's vocabulary)")
    ap.add_argument("--timeout", type=_positive_list(float), default=[600.0], metavar="S",
                    help="seconds a stream may stay silent before the request counts as failed (default 600)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    return ap


def check_dataset(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Before anything runs: the dataset's own options only, one load for --dataset study; then
    every option left unset gets its default."""
    mine, other = (STUDY_OPTIONS, RANDOM_OPTIONS) if args.dataset == "study" else (RANDOM_OPTIONS, STUDY_OPTIONS)
    stray = [flag for dest, (flag, _) in other.items() if getattr(args, dest) is not None]
    if stray:
        ap.error(f"{stray[0]} belongs to --dataset {'random' if args.dataset == 'study' else 'study'}, not "
                 f"--dataset {args.dataset}")
    if args.dataset == "study" and (args.concurrency is None) == (args.rate is None):
        ap.error("--dataset study: give one of --concurrency (closed loop) and --rate (open loop)")
    for dest, (_, default) in mine.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
        check_dataset(ap, args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    args.timeout = args.timeout[0]
    check_out_folder(ap, args.out)
    url = args.url.rstrip("/")
    if args.dataset == "random":
        loads = [("request_rate", r) for r in args.request_rate]
    else:
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
    if args.prompt_format != "ids":
        folder = args.tokenizer or info["hisparse"].get("tokenizer")
        if folder is None or (args.prompt_format == "chat" and not info["hisparse"].get("chat")):
            print(f"error: --prompt-format {args.prompt_format}: the server at {url} has no "
                  f"{'tokenizer' if folder is None else 'chat template'}", file=sys.stderr)
            return 2
        from hisparse.text import load_tokenizer
        try:
            args.tokenizer = load_tokenizer(folder)
        except ValueError as exc:
            print(f"error: --tokenizer: {exc}", file=sys.stderr)
            return 2
        if args.tokenizer is None:
            print(f"error: --tokenizer: no tokenizer in {folder!r}", file=sys.stderr)
            return 2
    lengths = (("--input-len", args.input_len), ("--output-len", args.output_len)) if args.dataset == "study" else \
        (("--random-input-len", args.random_input_len), ("--random-output-len", args.random_output_len))
    need, max_context = lengths[0][1] + lengths[1][1], info["hisparse"]["max_context"]
    if need > max_context:
        print(f"error: {lengths[0][0]} {lengths[0][1]} plus {lengths[1][0]} {lengths[1][1]} is {need} tokens, over "
              f"the server's max_context={max_context}", file=sys.stderr)
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

"""A request, what a run records of it, and the run's summaries: TTFT, TPOT, ITL and latency
percentiles (`timing_summary`, the rows' metrics), and the serving benchmarks' figures
(`benchmark_summary`, printed by `format_summary`).

The timings are host times in seconds after the run's start: a request's `arrival`, and one entry
of `token_times` per token, taken after the decode step's tokens were read on the host. The HTTP
load client (`hisparse.serve.bench`) times its requests the same way and summarises them with
`timing_summary` too.
"""
from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass, field

import torch

from hisparse.engine import check_prompts
from hisparse.host_pool import as_int
from hisparse.sampling import SamplingParams, stop_reason


class TokenTimeline:
    """ttft, tpot and latency of something with a `start` and `token_times` (seconds)."""

    start: float
    token_times: list[float]

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time between its tokens (None for a single token)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.start


@dataclass(eq=False)          # requests are compared as objects (queues remove this one, not an equal one)
class Request(TokenTimeline):
    """One request: prompt token ids, how many tokens to generate, when it arrives (seconds after the
    run starts; a closed loop sets it when the client's previous request finishes)."""

    prompt: torch.Tensor
    max_new_tokens: int
    arrival: float = 0.0
    rid: int = -1                                  # set by the server: index in the run's requests
    client: int | None = None
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)    # seconds after the run's start
    logits: list[torch.Tensor] = field(default_factory=list)  # [V] float32 per token, with keep_logits
    prefill_start: float | None = None
    prefill_s: float | None = None      # a prompt prefilled elsewhere (handoff, disaggregated): that prefill's time
    hits: int = 0
    misses: int = 0
    lane: int | None = None
    cancelled: bool = False
    selections: torch.Tensor | None = None   # int32 [steps, layers, ..., k]: replayed instead of the indexer's
    on_token: object | None = None      # called as on_token(request, token) for each new token (streaming)
    handoff: object | None = None       # a `handoff.Handoff`: its prompt prefilled elsewhere, adopted at admission
    think_time: float = 0.0             # a closed loop's client sends it this long after its previous one finished
    sampling: SamplingParams = field(default_factory=SamplingParams)   # greedy to max_new_tokens by default
    finish_reason: str | None = None    # "stop" (eos, a stop id or string) or "length"; set when it ends
    token_logprobs: list = field(default_factory=list)   # per token with sampling.logprobs: (logprob, [(id, logprob)] top N)

    @property
    def start(self) -> float:
        return self.arrival

    def start_run(self, rid: int) -> None:
        """Submitted to a run as its request `rid`: what a run leaves on it (tokens, times, lane...) cleared."""
        self.rid, self.tokens, self.token_times, self.logits, self.token_logprobs = rid, [], [], [], []
        self.prefill_start = self.prefill_s = self.lane = self.finish_reason = None
        self.cancelled = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or len(self.tokens) >= self.max_new_tokens

    @property
    def length(self) -> int:
        """Tokens the request's KV holds before its next decode step (prompt and every token but the last)."""
        return len(self.prompt) + len(self.tokens) - 1

    @property
    def queued(self) -> float:
        return self.prefill_start - self.arrival


def check_request(request: Request, vocab: int, max_context: int) -> None:
    """ValueError naming the field, before anything is allocated: the prompt (integer ids in the
    vocabulary), max_new_tokens, the arrival (seconds since the run's open, finite, or nan: now),
    their total within max_context, the sampling settings (`SamplingParams.check`). The prompt ends on
    the host, as int64; a sampling request without a seed gets one drawn here (recorded in its
    `sampling`, so the run can be replayed)."""
    if not isinstance(request.sampling, SamplingParams):
        raise ValueError(f"sampling={request.sampling!r}: expected a hisparse.sampling.SamplingParams")
    request.sampling.check(vocab)
    prompt = check_prompts([request.prompt])[0]
    request.prompt = prompt.cpu()
    request.max_new_tokens = as_int(request.max_new_tokens, "max_new_tokens must be an int >= 1", 1)
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        bad = int(prompt[(prompt < 0) | (prompt >= vocab)][0])
        raise ValueError(f"token id {bad} out of range: the vocabulary has {vocab} ids")
    arrival = request.arrival
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or math.isinf(arrival):
        raise ValueError(f"arrival={arrival!r}: expected a finite number of seconds after open(), or math.nan "
                         f"for now")
    think = request.think_time
    if isinstance(think, bool) or not isinstance(think, (int, float)) or not 0 <= think < math.inf:
        raise ValueError(f"think_time={think!r}: expected seconds >= 0, finite")
    need = len(prompt) + request.max_new_tokens
    if need > max_context:
        raise ValueError(f"a prompt of {len(prompt)} tokens plus {request.max_new_tokens} new ones needs {need} "
                         f"tokens, over the server's max_context={max_context}")
    if request.sampling.seed is None and not request.sampling.greedy:
        request.sampling = dataclasses.replace(request.sampling, seed=secrets.randbits(63))


def emit(request: Request, token: int, t: float, logits: torch.Tensor | None, logprob,
         eos: frozenset[int]) -> None:
    """A new token of the request at host time t: kept with its logits [V] (unless None) and logprobs
    entry (unless None); its finish_reason set if the token ends it (`stop_reason`: eos ids, stop
    ids, max_new_tokens); then its on_token(request, token), which may set finish_reason "stop" too
    (a stop string). A request whose finish_reason is set is done: the server frees it at once."""
    request.tokens.append(token)
    request.token_times.append(t)
    if logprob is not None:
        request.token_logprobs.append(logprob)
    if logits is not None:
        request.logits.append(logits.float().cpu())
    request.finish_reason = stop_reason(request.sampling, request.tokens, request.max_new_tokens, eos)
    if request.on_token is not None:
        request.on_token(request, token)


@dataclass
class Iteration:
    """What one iteration did (a schedule's entry): the request admitted (its rid) or -1, the prompt
    tokens of the chunk its prefill piece belongs to (0: none), and whether it ran a decode step.
    layers: the piece, layers lo .. hi - 1 of that chunk (the whole chunk without prefill_overlap);
    joined: the prefilled request joined its lane, its first token out, before the decode step."""

    admitted: int
    prefilled: int
    decoded: bool
    layers: tuple[int, int] | None = None
    joined: bool = False


@dataclass
class Schedule:
    lanes: int
    iterations: list[Iteration] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation, nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def timing_summary(done: list[TokenTimeline], first_start: float, itl: bool = True) -> dict[str, float]:
    """Requests, output tokens, tokens/s over the span from `first_start` to the last token, and the
    50th, 90th and 99th percentiles (ms) of TTFT, TPOT, ITL (every gap between two tokens of a request,
    over all requests: a prefill chunk's stall shows in its tail) and end-to-end latency."""
    out = {"requests": len(done), "output_tokens": sum(len(r.token_times) for r in done)}
    span = max((r.token_times[-1] for r in done), default=0.0) - first_start
    out["tokens_per_s"] = out["output_tokens"] / span if done and span > 0 else math.nan
    series = {"ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done if r.tpot is not None]}
    if itl:
        series["itl"] = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    series["latency"] = [r.latency for r in done]
    for name, values in series.items():
        for q in (50, 90, 99):
            out[f"{name}_ms_p{q}"] = percentile(values, q) * 1e3
    return out


# the figures of `benchmark_summary` that a request_rate point's rows add to `timing_summary`'s
DIALECT_METRICS = ("request_throughput", "input_throughput", "ttft_ms_mean", "tpot_ms_mean", "itl_ms_mean",
                   "latency_ms_mean")


def benchmark_summary(done: list[TokenTimeline], first_start: float,
                      input_tokens: int | None = None) -> dict[str, float]:
    """What the serving benchmarks' dialect (`sglang.bench_serving`, `vllm bench serve`) reports:
    completed requests, the duration (`first_start` to the last token, as `timing_summary`'s span),
    input and output tokens and their throughputs (input: nan where `input_tokens` is not given),
    requests/s, and the mean, median and 99th percentile (ms) of TTFT, TPOT, ITL and end-to-end
    latency (`latency`, as `timing_summary` names it)."""
    duration = max((r.token_times[-1] for r in done), default=0.0) - first_start
    per_s = (lambda n: n / duration) if done and duration > 0 else (lambda n: math.nan)
    output_tokens = sum(len(r.token_times) for r in done)
    out = {"requests": len(done), "duration_s": duration if done else math.nan,
           "input_tokens": math.nan if input_tokens is None else input_tokens, "output_tokens": output_tokens,
           "request_throughput": per_s(len(done)),
           "input_throughput": math.nan if input_tokens is None else per_s(input_tokens),
           "output_throughput": per_s(output_tokens)}
    series = {"ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done if r.tpot is not None],
              "itl": [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])],
              "latency": [r.latency for r in done]}
    for name, values in series.items():
        out[f"{name}_ms_mean"] = sum(values) / len(values) * 1e3 if values else math.nan
        out[f"{name}_ms_median"] = percentile(values, 50) * 1e3
        out[f"{name}_ms_p99"] = percentile(values, 99) * 1e3
    return out


def format_summary(summary: dict[str, float], request_rate: float | None = None,
                   max_concurrency: int | None = None, failed: int | None = None) -> str:
    """`benchmark_summary`'s figures as the block bench_serving prints at the end of a run."""
    def line(label: str, value) -> str:
        text = value if isinstance(value, str) else f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label + ':':<42}{text:>10}"

    def rule(title: str = "", fill: str = "-") -> str:
        return f" {title} ".center(52, fill) if title else fill * 52
    lines = [rule("Serving benchmark result", "="),
             line("Request rate (req/s)", "not set" if request_rate is None else f"{request_rate:g}"),
             line("Max concurrency", "not set" if max_concurrency is None else str(max_concurrency)),
             line("Completed requests", summary["requests"])]
    if failed is not None:
        lines.append(line("Failed requests", failed))
    lines += [line("Duration (s)", summary["duration_s"]),
              line("Input tokens", "n/a" if math.isnan(summary["input_tokens"]) else int(summary["input_tokens"])),
              line("Output tokens", summary["output_tokens"]),
              line("Request throughput (req/s)", summary["request_throughput"]),
              line("Input token throughput (tok/s)", summary["input_throughput"]),
              line("Output token throughput (tok/s)", summary["output_throughput"])]
    for name, title in (("ttft", "Time to first token"), ("tpot", "Time per output token (after the first)"),
                        ("itl", "Inter-token latency"), ("latency", "End-to-end latency")):
        short = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "latency": "E2E latency"}[name]
        lines.append(rule(title))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            lines.append(line(f"{label} {short} (ms)", summary[f"{name}_ms_{stat}"]))
    lines.append(rule(fill="="))
    return "\n".join(lines)


@dataclass
class ServingRun:
    requests: list[Request]
    schedule: Schedule
    wall_s: float
    running_batch: list[int]          # active lanes at each decode step
    peak_gpu_bytes: int               # the most the KV state, cache and workspace held (budgeted bytes)
    peak_host_rows: int               # the most host pool rows in use
    hybrid: dict[str, int] | None = None   # mode hybrid: requests admitted resident, demotions, and
                                           # decode steps whose lanes were all resident
    cancelled: list[Request] = field(default_factory=list)   # cancelled, by a client or by close("cancel")
    prefix: dict[str, float] | None = None   # prefix sharing's counts (`PrefixSharing.run_stats`)
    host_bytes: list[tuple[float, int]] = field(default_factory=list)   # (seconds since the start, host
            # bytes in use: the pool's rows and a prefix cache's copies) at the open and after each change

    def host_bytes_peak(self, start: float = 0.0, end: float = math.inf) -> int:
        """The most host bytes in use from `start` to `end` (seconds since the run's start): the value
        in effect at `start` and every one recorded until `end`."""
        before = [n for t, n in self.host_bytes if t <= start]
        during = [n for t, n in self.host_bytes if start < t <= end]
        return max(before[-1:] + during, default=0)

    def summary(self) -> dict[str, float]:
        """`timing_summary` of the requests, their queueing percentiles (ms), the running batch's
        mean and max, hybrid's counts and prefix sharing's."""
        reqs = self.requests
        out = timing_summary(reqs, min((r.arrival for r in reqs), default=0.0))
        for q in (50, 90, 99):
            out[f"queue_ms_p{q}"] = percentile([r.queued for r in reqs], q) * 1e3
        elsewhere = [r.prefill_s for r in reqs if r.prefill_s is not None]
        if elsewhere:                     # prefilled off this server's clock: their own time, apart
            out["prefill_elsewhere_ms_p50"] = percentile(elsewhere, 50) * 1e3
        out["running_batch_mean"] = sum(self.running_batch) / max(1, len(self.running_batch))
        out["running_batch_max"] = max(self.running_batch, default=0)
        if self.hybrid is not None:
            out.update(self.hybrid)
        if self.prefix is not None:
            out.update(self.prefix)
        return out

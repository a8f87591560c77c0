"""The serving study's requests, one definition for the in-process study (experiments.sweep) and
the HTTP load client (hisparse.serve.bench), so a row from one sits beside its twin from the other.

`RandomWorkload` is the `random` dataset of the serving benchmarks' common dialect
(`sglang.bench_serving`, `vllm bench serve`): num_prompts requests whose prompt and output lengths
are drawn uniformly from [len * range_ratio, len], random prompt ids, Poisson arrivals at
request_rate per second (inf: every request at 0), at most max_concurrency in flight (the driver's
cap: `hisparse.serving.scheduler.drive`), all of it from one seed. The study's own loads are special
cases of it (`serving_requests`): a closed loop's clients (arrivals set as each client's previous
request finishes) or an open loop's Poisson arrivals, fixed lengths, seed 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hisparse.serving.request import Request

REQUESTS_PER_CLIENT = 2            # a closed loop's default: requests each client sends
MAX_SEED = 2**31 - 1
LENGTHS_STREAM, PROMPT_STREAM = 1, 1000     # arrivals: stream 0; request i's prompt: stream 1000 + i


def _generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one stream of a seed's draws (seed 0: the stream number itself, as the
    study's draws were seeded before seeds existed). The CPU generator keeps 32 bits of its seed, so
    the seed is spread over them by an odd multiplier rather than shifted above them."""
    return torch.Generator().manual_seed((stream + seed * 0x9E3779B1) % 2**32)


@dataclass(slots=True)
class RandomWorkload:
    """bench_serving's random dataset: see the module docstring. Validated on construction (a
    ValueError naming the field and what it expects)."""

    input_len: int
    output_len: int
    num_prompts: int
    range_ratio: float = 1.0
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("input_len", "output_len", "num_prompts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}: expected a positive integer")
        r = self.range_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"range_ratio = {r!r}: expected a number in (0, 1] (lengths are drawn from "
                             f"[len * range_ratio, len])")
        rate = self.request_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or math.isnan(rate) or rate <= 0:
            raise ValueError(f"request_rate = {rate!r}: expected a positive number of requests/s, or inf (every "
                             f"request at once)")
        cap = self.max_concurrency
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_concurrency = {cap!r}: expected a positive integer, or None (no cap)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed = {self.seed!r}: expected an integer in [0, {MAX_SEED}]")

    def lengths(self) -> tuple[list[int], list[int]]:
        """Each request's prompt and output length, uniform over [len * range_ratio, len] (at least 1)."""
        gen = _generator(self.seed, LENGTHS_STREAM)
        out = []
        for top in (self.input_len, self.output_len):
            low = max(1, int(top * self.range_ratio))
            out.append(torch.randint(low, top + 1, (self.num_prompts,), generator=gen).tolist())
        return out[0], out[1]

    def arrivals(self) -> list[float]:
        """Seconds after the start: exponential gaps of mean 1 / request_rate (inf: all 0)."""
        if math.isinf(self.request_rate):
            return [0.0] * self.num_prompts
        gaps = torch.empty(self.num_prompts).exponential_(generator=_generator(self.seed, 0))
        return (gaps.cumsum(0) / self.request_rate).tolist()

    def requests(self, vocab: int) -> list[Request]:
        """The requests: prompt ids below `vocab` (each request's from its own generator), output
        lengths and arrivals as drawn."""
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"vocab = {vocab!r}: expected a positive integer")
        inputs, outputs = self.lengths()
        reqs = []
        for i, (n_in, n_out, arrival) in enumerate(zip(inputs, outputs, self.arrivals(), strict=True)):
            prompt = torch.randint(0, vocab, (n_in,), generator=_generator(self.seed, PROMPT_STREAM + i))
            reqs.append(Request(prompt, n_out, arrival=arrival))
        return reqs


def serving_request_count(study: dict, point: dict) -> int:
    """Requests of a serving point: requests_per_client per client, `requests` (open loop), or
    num_prompts (a request_rate point)."""
    if point.get("request_rate") is not None:
        return point["num_prompts"]
    closed = point["concurrency"] is not None
    return point["concurrency"] * study["requests_per_client"] if closed else study["requests"]


def point_workload(study: dict, point: dict) -> RandomWorkload:
    """The point's workload: a request_rate point's own, or the study's loads as one (fixed lengths,
    seed 0; a closed loop's arrivals all 0, set by its clients as they go)."""
    if point.get("request_rate") is not None:
        return RandomWorkload(point["input_len"], point["output_len"], point["num_prompts"], point["range_ratio"],
                              point["request_rate"], point["max_concurrency"], point["seed"])
    closed = point["concurrency"] is not None
    return RandomWorkload(point["input_len"], point["output_len"], serving_request_count(study, point),
                          request_rate=math.inf if closed else point["rate"])


def serving_requests(study: dict, point: dict, vocab: int) -> tuple[list[Request], int | None]:
    """The point's requests (`point_workload`) and its client count (None: each at its arrival)."""
    return point_workload(study, point).requests(vocab), point["concurrency"]

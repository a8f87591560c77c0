"""The server's Prometheus metrics (GET /metrics), kept by prometheus_client in a registry of their
own per server thread, so several apps live in one process (the tests) without sharing counts.

Counters and latency histograms are updated on the server thread, as tokens come out and
requests leave; refusals on the event loop (prometheus_client's metrics are thread-safe). Gauges are
set from a server thread snapshot when /metrics is read. Latencies are the server's clock, in seconds:
TTFT from a prompt's submission to its first token, ITL between consecutive tokens of a prompt,
TPOT a prompt's mean gap, observed when it leaves with two tokens or more. A "request" here is one
prompt of a completion.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hisparse.serving import Request

__all__ = ["CONTENT_TYPE_LATEST", "LATENCY_BUCKETS", "Metrics"]

# 1 ms (a decode step of a small batch) to 60 s (the first token of a long prompt behind a queue)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 60.0)

GAUGES = {   # name: (help, its value in a server thread snapshot with "draining" added)
    "hisparse_requests_running": ("requests decoding in a lane", lambda s: s["running"]),
    "hisparse_requests_waiting": ("requests queued, not yet admitted", lambda s: s["waiting"]),
    "hisparse_requests_in_flight": ("requests submitted, not finished (queued, prefilling, decoding)",
                                    lambda s: s["in_flight"]),
    "hisparse_lanes": ("rows of the decode batch (the most requests decoding at once)", lambda s: s["lanes"]),
    "hisparse_gpu_kv_bytes": ("budgeted GPU bytes in use: lanes, cache, prefill workspace in use",
                              lambda s: s["gpu_bytes"]),
    "hisparse_gpu_kv_budget_bytes": ("the GPU budget for KV (NaN: sized by lanes, not a budget)",
                                     lambda s: float("nan") if s["kv_budget_bytes"] is None else s["kv_budget_bytes"]),
    "hisparse_host_rows_in_use": ("host pool rows held by requests", lambda s: s["host_rows_in_use"]),
    "hisparse_host_rows_capacity": ("host pool rows (0 in resident mode)", lambda s: s["host_rows_capacity"]),
    "hisparse_host_bytes_in_use": ("host pool bytes held by requests",
                                   lambda s: s["host_rows_in_use"] * s["host_row_bytes"]),
    "hisparse_host_bytes_capacity": ("host pool bytes", lambda s: s["host_rows_capacity"] * s["host_row_bytes"]),
    "hisparse_draining": ("1 while shutting down (new requests refused)", lambda s: int(s["draining"])),
    "hisparse_prefix_hit_tokens": ("prompt tokens found in the prefix cache, not prefilled (--prefix-cache)",
                                   lambda s: s["prefix"].get("prefix_hit_tokens", 0)),
    "hisparse_prefill_tokens": ("prompt tokens prefilled (admitted prompts less their cached prefixes; "
                                "--prefix-cache)", lambda s: s["prefix"].get("prefill_tokens", 0)),
    "hisparse_prefix_cached_pages": ("pages the prefix cache holds (--prefix-cache; hisparse: a host page a "
                                     "stream, else a page of tokens)",
                                     lambda s: s["prefix"].get("prefix_cached_pages", 0)),
}


class Metrics:
    """One server's metrics in `registry`; `exposition` is the body of GET /metrics."""

    def __init__(self):
        self.registry = registry = CollectorRegistry()

        def counter(name: str, text: str) -> Counter:          # exposed as name_total
            return Counter(name, text, registry=registry)

        def latency(name: str, text: str) -> Histogram:
            return Histogram(name, text, buckets=LATENCY_BUCKETS, registry=registry)
        self.outcomes = {"served": counter("hisparse_requests_served", "requests that got all their tokens"),
                         "cancelled": counter("hisparse_requests_cancelled",
                                              "requests cancelled (their client went away)"),
                         "failed": counter("hisparse_requests_failed",
                                           "requests stopped by the server (shutdown, a failed step)")}
        self.refused = counter("hisparse_requests_refused", "completion requests answered 4xx")
        self.prompt_tokens = counter("hisparse_prompt_tokens", "prompt tokens of requests that left")
        self.generation_tokens = counter("hisparse_generation_tokens", "tokens generated for requests that left")
        self.hits = counter("hisparse_cache_hits", "GPU cache hits of requests that left (hierarchical modes)")
        self.misses = counter("hisparse_cache_misses", "GPU cache misses of requests that left (hierarchical modes)")
        self.ttft = latency("hisparse_time_to_first_token_seconds", "from a request's submission to its first token")
        self.itl = latency("hisparse_inter_token_latency_seconds", "between consecutive tokens of a request")
        self.tpot = latency("hisparse_time_per_output_token_seconds",
                            "a request's mean gap between its tokens, when it leaves with two or more")
        self.gauges = {name: Gauge(name, text, registry=registry) for name, (text, _) in GAUGES.items()}

    def token(self, request: Request) -> None:
        """Its newest token came out (server thread)."""
        times = request.token_times
        if len(times) == 1:
            self.ttft.observe(request.ttft)
        else:
            self.itl.observe(times[-1] - times[-2])

    def left(self, request: Request, outcome: str) -> None:
        """It left the server: "served", "cancelled" or "failed" (server thread)."""
        self.outcomes[outcome].inc()
        self.prompt_tokens.inc(len(request.prompt))
        self.generation_tokens.inc(len(request.tokens))
        self.hits.inc(request.hits)
        self.misses.inc(request.misses)
        if request.tpot is not None:
            self.tpot.observe(request.tpot)

    def exposition(self, snapshot: dict, draining: bool) -> bytes:
        """The gauges set from `snapshot`, then every metric in Prometheus' text format (event loop)."""
        values = dict(snapshot, draining=draining)
        for name, (_, value) in GAUGES.items():
            self.gauges[name].set(value(values))
        return generate_latest(self.registry)

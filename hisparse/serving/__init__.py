"""Serving: requests join and leave one decode batch, admitted by what fits the memory budgets.

    request.py    a request, its timings, a run's schedule and summary
    scheduler.py  the queues, admission order, the prefill chunk budget (plain Python)
    memory.py     lanes, host pool regions, GPU and host budgets: what fits (hybrid's placement too)
    runner.py     the device: the lanes' buffers, the decode step and its graph, prefill pieces
    server.py     the loop and the public API: open, submit, step, cancel, close, serve
    options.py    a server's options checked before anything is built
    workload.py   the serving study's requests (in-process and over HTTP alike), bench_serving's random dataset
    handoff.py    prompts (or their prefixes) prefilled elsewhere (a prefill worker, in process or its own), adopted
    prefix.py     the prefix index: cached whole-page prefixes, LRU eviction
    sharing.py    prefix sharing: a server's index over its host pages, used at admission and the join
"""
from hisparse.serving.memory import GIB, LaneMemory
from hisparse.serving.request import (Iteration, Request, Schedule, ServingRun, TokenTimeline, benchmark_summary,
                                      format_summary, percentile, timing_summary)
from hisparse.serving.runner import Runner, side_stream
from hisparse.serving.scheduler import Scheduler
from hisparse.serving.server import PREFILL_LAYERS, SERVING_MODES, Server

__all__ = ["GIB", "PREFILL_LAYERS", "SERVING_MODES", "Iteration", "LaneMemory", "Request", "Runner", "Schedule",
           "Scheduler", "Server", "ServingRun", "TokenTimeline", "benchmark_summary", "format_summary", "percentile",
           "side_stream", "timing_summary"]

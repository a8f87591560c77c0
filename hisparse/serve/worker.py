"""The serving engine in a thread of its own: the model is not thread-safe, so one thread owns
the `Server` and does everything with it (submit, step, cancel, read its sizes); other threads
send it commands through a queue and get `concurrent.futures.Future`s back.

Each submitted prompt has a sink: `sink.token(index, request, token)` for every new token (inside
the request's `on_token`: setting `request.finish_reason` there ends it, as a stop string does) and
`sink.end(index, request, error)` once (error None: it finished; else why it stopped), both called
on the server thread, so a sink hands them on (the HTTP app: `outputs.Sink`). The same thread
counts them into `metrics` (the server's Prometheus metrics, `metrics.Metrics`).
"""
from __future__ import annotations

import itertools
import math
import queue
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import torch

from hisparse.sampling import SamplingParams
from hisparse.serve.metrics import Metrics
from hisparse.serve.prefill import PrefillPool
from hisparse.serving import Request, Server

RECYCLE_AFTER = 1024    # requests a run keeps (Server.requests) before an idle server starts a new run
POLL_S = 0.005          # how often an idle server thread looks for handoffs while prompts are being prefilled


class PromptRefused(ValueError):
    """The server can never serve prompt `index` (too long for max_context or the host pool, or
    outside the replayed workload's shape); `param` names the request field at fault."""

    def __init__(self, index: int, message: str, param: str = "prompt"):
        super().__init__(message)
        self.index, self.param = index, param


@dataclass
class ReplayWorkload:
    """Synthetic selections the requests replay instead of the model's own (`hisparse.synthetic.
    request_draws`): the n-th request submitted replays draw n % len(draws) of `draws`, each int32
    [output_len - 1, layers, k], drawn for prompts of exactly input_len tokens, so a request
    must have that prompt length and at most output_len tokens out."""

    name: str
    input_len: int
    output_len: int
    draws: list[torch.Tensor]

    def refusal(self, prompt_len: int, max_new_tokens: int) -> tuple[str, str] | None:
        """(field, why) if a request of this shape cannot replay the draws, else None."""
        if prompt_len != self.input_len:
            return "prompt", (f"a prompt of {prompt_len} tokens: this server replays workload {self.name!r}, drawn for "
                              f"prompts of exactly {self.input_len} tokens")
        if max_new_tokens > self.output_len:
            return "max_tokens", (f"max_tokens {max_new_tokens}: workload {self.name!r} was drawn for at most "
                                  f"{self.output_len} tokens out")
        return None


class ServerStopped(RuntimeError):
    """The server thread no longer takes commands (shut down)."""


@dataclass
class _Job:
    request: Request
    sink: object
    index: int
    prefill_key: int | None = None    # disaggregated: its prompt's key at the prefill pool (never reused)


class ServerThread:
    """Runs `server` step by step in one thread: `start()` opens it (warm-up included), `stop()`
    cancels what is left and closes it. With `prefill` (disaggregated) each prompt goes to a prefill
    worker first and the request is submitted with its handoff (arrival: when that came)."""

    def __init__(self, server: Server, workload: ReplayWorkload | None = None, prefill: PrefillPool | None = None):
        self.server, self.workload, self.prefill = server, workload, prefill
        self._awaiting: dict[int, Request] = {}         # prefill key -> a request whose prompt a prefill worker holds
        self._prefill_keys = itertools.count()          # a late answer for a cancelled prompt never meets another
        self._replays = 0                               # requests given a draw of the workload so far
        self.counters = {"served": 0, "cancelled": 0, "failed": 0, "prompt_tokens": 0, "generated_tokens": 0,
                         "hits": 0, "misses": 0}
        self.metrics = Metrics()                        # the same counts, latencies and sizes for GET /metrics
        self.final_snapshot: dict | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[int, _Job] = {}                 # id(request) -> its job, while in flight
        self._ready: Future = Future()
        self._stopping = False                          # set by stop(), on the caller's thread
        self._done = False
        self._thread = threading.Thread(target=self._run, name="hisparse-server", daemon=True)

    # -- the caller's side (any thread) --------------------------------------------------------

    def start(self) -> None:
        """Start the thread and wait until the server is open (its kernels warmed up)."""
        self._thread.start()
        self._ready.result()

    def submit(self, prompts: list[list[int]], max_new_tokens: int, sink,
               sampling: SamplingParams | None = None) -> Future:
        """Queue every prompt or none (each with these sampling settings, greedy by default): the
        future's result is the list of Requests, or PromptRefused."""
        return self._call(self._submit, prompts, max_new_tokens, sink, sampling or SamplingParams())

    def cancel(self, requests: list[Request]) -> Future:
        """Cancel the requests still in flight (their memory freed at once)."""
        return self._call(self._cancel, requests, "cancelled")

    def snapshot(self) -> Future:
        """The server's sizes and the counters, as `_snapshot` reads them between two steps."""
        if self._done:
            done = Future()
            done.set_result(self.final_snapshot)
            return done
        return self._call(self._snapshot)

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def stop(self, timeout: float | None = None) -> dict:
        """Cancel every request left, close the server, end the thread: the final snapshot."""
        if not self._done:
            future = self._call(self._stop)
            self._stopping = True
            future.result(timeout)
        self._thread.join(timeout)
        return self.final_snapshot

    def _call(self, fn, *args) -> Future:
        if self._stopping or self._done:
            raise ServerStopped("the server is shutting down")
        future = Future()
        self._commands.put((future, fn, args))
        return future

    # -- the server thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.server.device.type == "cuda":    # a new thread starts on cuda:0, whatever the model's GPU
                torch.cuda.set_device(self.server.device)
            self.server.open()
            if self.workload is not None:
                self._warm_up(self.workload)
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller, who raises it
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)
        while not self._done:
            if not self.server.busy and len(self.server.requests) >= RECYCLE_AFTER:
                self.server.close()          # idle: a new run, so finished requests are not kept forever
                self.server.open()
            self._run_commands(block=not self.server.busy, timeout=POLL_S if self._awaiting else None)
            if self._awaiting and not self._done:
                self._take_handoffs()
            if self.server.busy and not self._done:
                self._step()
        self._refuse_late_commands()

    def _warm_up(self, workload: ReplayWorkload) -> None:
        """One untimed request of the workload's shape before serving (uncounted, no draw used): a
        process's first long prompt compiles kernels (seconds at 16K), which would land in the
        first client's TTFT."""
        warm = Request(torch.zeros(workload.input_len, dtype=torch.int64), min(2, workload.output_len),
                       selections=workload.draws[0])
        self.server.submit(warm)
        while self.server.busy:
            self.server.step()

    def _refuse_late_commands(self) -> None:
        """Commands queued while stop() ran: refused, so no caller waits on them forever."""
        while True:
            try:
                future, _, _ = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(ServerStopped("the server is shutting down"))

    def _run_commands(self, block: bool, timeout: float | None = None) -> None:
        while True:
            try:
                future, fn, args = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            if self._done:                    # stopped: what is left is refused (_refuse_late_commands)
                self._commands.put((future, fn, args))
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - the command's caller gets it from its future
                future.set_exception(exc)

    def _step(self) -> None:
        try:
            finished = self.server.step()
        except Exception as exc:  # noqa: BLE001 - a bug, no request's fault: fail those in flight, keep serving
            traceback.print_exc()
            on_server = [job.request for job in self._jobs.values() if job.prefill_key not in self._awaiting]
            self._cancel(on_server, f"the scheduler's step failed: {exc!r}")
            return
        for request in finished:
            job = self._jobs.pop(id(request), None)
            if job is not None:
                self._count(request, "served")
                job.sink.end(job.index, request, None)

    def _submit(self, prompts: list[list[int]], max_new_tokens: int, sink, sampling: SamplingParams) -> list[Request]:
        requests = [Request(torch.tensor(ids, dtype=torch.int64), max_new_tokens, arrival=math.nan,
                            on_token=partial(self._on_token, sink, i), sampling=sampling)
                    for i, ids in enumerate(prompts)]
        for i, request in enumerate(requests):        # all checked before any is queued
            if self.workload is not None and (why := self.workload.refusal(len(request.prompt), max_new_tokens)):
                raise PromptRefused(i, why[1], why[0])
            try:
                self.server.check_request(request)
            except ValueError as exc:
                raise PromptRefused(i, str(exc)) from None
        for i, request in enumerate(requests):
            if self.workload is not None:
                draws = self.workload.draws
                request.selections = draws[self._replays % len(draws)]
                self._replays += 1
            job = self._jobs[id(request)] = _Job(request, sink, i)
            if self.prefill is not None:
                job.prefill_key = next(self._prefill_keys)
                self._awaiting[job.prefill_key] = request
                self.prefill.send(job.prefill_key, request.prompt)
            else:
                self.server.submit(request)
        return requests

    def _take_handoffs(self) -> None:
        """Submit each request whose handoff came (arriving now); fail those whose worker failed."""
        for key, result in self.prefill.poll():
            request = self._awaiting.pop(key, None)
            if request is None:
                continue                      # cancelled while it was prefilled
            if isinstance(result, str):
                self._fail(request, result)
                continue
            request.handoff = result
            try:
                self.server.submit(request)
            except ValueError as exc:         # a handoff unlike this server's (a worker built otherwise)
                self._fail(request, f"the handoff of this prompt was refused: {exc}")

    def _fail(self, request: Request, why: str) -> None:
        job = self._jobs.pop(id(request))
        request.handoff = None
        self._count(request, "failed")
        job.sink.end(job.index, request, why)

    def _cancel(self, requests: list[Request], why: str) -> int:
        cancelled = 0
        for request in requests:
            job = self._jobs.pop(id(request), None)
            if job is None:
                continue                      # finished already
            if request.done:                  # it finished in a step that then failed: served
                self._count(request, "served")
                job.sink.end(job.index, request, None)
                continue
            if self._awaiting.pop(job.prefill_key, None) is not None:
                self.prefill.forget(job.prefill_key)      # not on the server yet
            else:
                self.server.cancel(request)
            self._count(request, "cancelled" if why == "cancelled" else "failed")
            job.sink.end(job.index, request, why)
            cancelled += 1
        return cancelled

    def _count(self, request: Request, outcome: str) -> None:
        request.handoff = None                # its rows (shared memory) go back; the lane holds them now
        c = self.counters
        c[outcome] += 1
        c["prompt_tokens"] += len(request.prompt)
        c["generated_tokens"] += len(request.tokens)
        c["hits"] += request.hits             # set when the request left its lane (0 if it never decoded)
        c["misses"] += request.misses
        self.metrics.left(request, outcome)

    def _on_token(self, sink, index: int, request: Request, token: int) -> None:
        self.metrics.token(request)
        sink.token(index, request, token)

    def _stop(self) -> dict:
        self._cancel([job.request for job in self._jobs.values()], "the server shut down before it finished")
        self.server.close()
        if self.server.sharing is not None:         # the cached prefixes' pages go back with the server
            self.server.sharing.index.clear()
        self.final_snapshot = self._snapshot()
        self._done = True
        return self.final_snapshot

    def _snapshot(self) -> dict:
        s = self.server
        running, waiting = len(s.running), len(s.waiting)
        snap = dict(self.counters, running=running, waiting=waiting, in_flight=len(self._jobs), lanes=s.lanes,
                    gpu_bytes=s.gpu_bytes(), kv_budget_bytes=s.kv_budget, host_rows_capacity=0, host_rows_in_use=0,
                    host_row_bytes=0)
        if s.cache is not None:
            host = s.cache.host
            snap.update(host_rows_capacity=host.capacity, host_rows_in_use=host.capacity - host.free_rows,
                        host_row_bytes=host.row_bytes)
        snap["prefix"] = s.sharing.stats() if s.sharing is not None else {}
        return snap

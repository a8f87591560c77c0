"""The disaggregated server's prefill side: one `PrefillProcess` per prefill device, driven by the
server thread (`worker.ServerThread`), which sends each new prompt to the least loaded worker (ties
in turn) and submits the request, its `Handoff` attached, when the answer comes.

A worker that dies (its process gone, or unable to rebuild an answer) fails the prompts it held,
each with an error naming it, and is started again if it had been serving (one that never built
its model is not: that would fail the same way). `close` stops every worker: asked, then killed
after a timeout, and reaped.
"""
from __future__ import annotations

import queue
from collections.abc import Callable

import torch

from hisparse.serving.handoff import Handoff, PrefillProcess


class PrefillPool:
    """`builders`: (device, picklable build_model()) per worker; `worker_kw`: the decode server's
    prefill settings (`PrefillWorker`'s keywords)."""

    def __init__(self, builders: list[tuple[str, Callable]], **worker_kw):
        if not builders:
            raise ValueError("a prefill pool needs at least one (device, build_model) worker")
        self.builders, self.worker_kw = builders, worker_kw
        self.workers = [self._start(i) for i in range(len(builders))]
        self.held: list[set] = [set() for _ in builders]    # keys each worker has not answered yet
        self.restarts = 0
        self.closed = False
        self._turn = 0

    def _start(self, i: int) -> PrefillProcess:
        device, build_model = self.builders[i]
        return PrefillProcess(build_model, device=device, **self.worker_kw)

    def name(self, i: int) -> str:
        return f"prefill worker {i} ({self.builders[i][0]}, pid {self.workers[i].pid})"

    def wait_ready(self, timeout: float) -> None:
        """Every worker's model built; RuntimeError naming the first that failed (all are closed then)."""
        for i, worker in enumerate(self.workers):
            try:
                worker.wait_ready(timeout)
            except RuntimeError as exc:
                self.close(timeout=5)
                raise RuntimeError(f"{self.name(i)}: {exc}") from None

    def send(self, key, prompt: torch.Tensor) -> int:
        """Queue the prompt on the least loaded live worker (ties in turn): its index."""
        n = len(self.workers)
        order = [(self._turn + j) % n for j in range(n)]
        i = min(order, key=lambda w: (not self.workers[w].alive, len(self.held[w])))
        self._turn = (i + 1) % n
        self.held[i].add(key)
        self.workers[i].submit(key, prompt)
        return i

    def poll(self) -> list[tuple[object, Handoff | str]]:
        """What has come since the last poll: (key, Handoff) or (key, why it failed, naming the worker)."""
        answers = []
        for i, worker in enumerate(self.workers):
            try:
                got = worker.poll()
            except (OSError, EOFError, RuntimeError, queue.Empty) as exc:   # it died while its answer crossed
                got, broken = [], f"its answer could not be read ({exc!r})"
            else:
                broken = None if worker.alive else f"its process exited with code {worker.process.exitcode}"
            for key, result in got:
                if key in self.held[i]:
                    self.held[i].discard(key)
                    answers.append((key, result if isinstance(result, Handoff) else
                                    f"{self.name(i)} failed on this prompt: {result.strip().splitlines()[-1]}"))
            if broken is not None:
                answers += [(key, f"{self.name(i)} died before it handed this prompt off: {broken}")
                            for key in self.held[i]]
                self.held[i].clear()
                self._replace(i)
        return answers

    def _replace(self, i: int) -> None:
        dead = self.workers[i]
        dead.close(timeout=0)
        if not self.closed and dead.ready:
            self.workers[i] = self._start(i)
            self.restarts += 1

    def forget(self, key) -> None:
        """A cancelled prompt: its answer, when it comes, is dropped."""
        for held in self.held:
            held.discard(key)

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def close(self, timeout: float = 10.0) -> None:
        self.closed = True
        for worker in self.workers:
            worker.close(timeout)

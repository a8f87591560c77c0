"""A prompt prefilled elsewhere, handed to a decode server: the disaggregated setting.

A prefill worker runs the model's prefill of a prompt on its own state and hands off what the
decode server needs: the prompt's KV rows per layer as the family's prefill state holds them
(`FamilyRuntime.prefilled_rows`: DSA's latents and indexer keys, Quest's keys and values, NSA's
keys, values and compressed blocks), on the host, and the last prompt token's logits (the first
token). The decode server admits the request as any other and places the rows where its own
prefill would have put them (`LanePrefill.adopt`: the host pool, the lane, hybrid's runs), then it
decodes; TTFT counts from its arrival there, the prefill's own time is `Handoff.prefill_s`.

The transfer is the `Handoff` object: in process it is passed as is; `PrefillProcess` runs the worker
in a process of its own and its tensors cross in shared memory (torch.multiprocessing). A cross-host
transfer library (NIXL, Mooncake) would replace that queue: it moves `rows` into pinned host memory
of the decode server (ideally the request's host pool region) and signals the handoff's arrival.
"""
from __future__ import annotations

import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from hisparse.engine import check_prompts, family_runtime
from hisparse.serving.request import Iteration, Schedule


@dataclass
class Handoff:
    prompt_len: int
    rows: list[tuple]          # per layer: the family's prefilled rows of the prompt (host tensors)
    logits: torch.Tensor       # [V]: the last prompt token's (its argmax is the first token)
    prefill_s: float = 0.0     # the prefill's own time on its worker
    tokens: torch.Tensor | None = None   # [prompt_len] the ids it prefilled (a prefix of the request's prompt)

    def check(self, prompt: torch.Tensor, runtime, vocab: int) -> None:
        """ValueError unless this hands off `prompt` (int64 ids) or a prefix of it (`tokens`, where
        kept) in the rows a prefill of `runtime`'s (the decode server's: its family, kv_dtype and
        index_dtype) makes: per layer the same parts, dtypes and dimensions; logits over `vocab` ids."""
        state = runtime.new_state(1, 1)                                   # what this server's prefill makes
        layers = len(state.layers)
        if not 0 < self.prompt_len <= len(prompt) or len(self.rows) != layers:
            raise ValueError(f"the handoff holds a prompt of {self.prompt_len} tokens over {len(self.rows)} layers; "
                             f"the request's prompt has {len(prompt)} tokens, the model {layers} layers")
        if self.tokens is not None and not torch.equal(self.tokens.cpu(), prompt[:self.prompt_len]):
            raise ValueError(f"the handoff's {self.prompt_len} tokens are not the first {self.prompt_len} of the "
                             f"request's prompt")
        if self.logits is not None and self.logits.numel() != vocab:
            raise ValueError(f"the handoff's logits are over {self.logits.numel()} ids; this server's model has {vocab}")
        own = runtime.prefilled_rows([state])
        for layer in range(layers):
            want = [None if t is None else (t.dtype, t.dim()) for t in own(0, layer)]
            got = [None if t is None else (t.dtype, t.dim()) for t in self.rows[layer]]
            if got != want:
                raise ValueError(f"the handoff's layer {layer} rows are {got} (dtype, dims); this server's "
                                 f"prefill makes {want}: a worker built with other kv_dtype / index_dtype?")

    def layer_rows(self, request: int, layer: int) -> tuple:
        """`FamilyRuntime.prefilled_rows`'s form, for `LanePrefill.adopt` (one request: `request` is 0)."""
        return self.rows[layer]


def handed_off_schedule(schedule: Schedule) -> Schedule:
    """The schedule a decode server replays so that handed-off requests meet, at every decode step,
    the batches they met prefilled in place: each is admitted where it joined, no piece runs."""
    admitted = {}
    iterations = []
    for it in schedule.iterations:
        if it.admitted >= 0:
            admitted[len(iterations)] = it.admitted
        iterations.append(Iteration(-1, 0, it.decoded, None, False))
        if it.joined:                     # one prefill at a time: the one joining is the earliest admitted
            iterations[-1].admitted, iterations[-1].joined = admitted.pop(min(admitted)), True
    return Schedule(schedule.lanes, iterations)


class PrefillWorker:
    """Prefills prompts on `model` into handoffs, with the decode server's chunking and kernels so the
    rows are bitwise what its own prefill would make (prefill_chunk, prefill "model" or "reference",
    decode_backend, kv_dtype, index_dtype, token_budget as `Server`'s). shared: the handoff's tensors are
    made in shared memory, as a worker process hands them off (pinning them there would be lost: a
    queue moves a tensor that is not shared yet into a new shared segment, one more copy)."""

    def __init__(self, model, prefill_chunk: int = 8192, prefill: str = "model", decode_backend: str = "auto",
                 kv_dtype: str = "bf16", token_budget: int | None = None, index_dtype: str = "bf16",
                 shared: bool = False):
        if prefill not in ("model", "reference"):
            raise ValueError(f"prefill must be 'model' or 'reference', got {prefill!r}")
        self.model, self.prefill_chunk, self.fast, self.backend = model, prefill_chunk, prefill == "model", decode_backend
        self.runtime = family_runtime(model, token_budget, decode_backend, kv_dtype, index_dtype)
        self.device, self.shared = model.model.embed_tokens.weight.device, shared

    def prefill(self, prompt: torch.Tensor) -> Handoff:
        prompt = check_prompts([prompt])[0]
        start = time.perf_counter()
        state = self.runtime.new_state(1, len(prompt))
        logits = self.model.prefill(prompt[None].to(self.device), state, chunk_size=self.prefill_chunk,
                                    fast=self.fast, last_logits=True, backend=self.backend)
        rows = self.runtime.prefilled_rows([state])
        host = [tuple(None if t is None else to_host(t, self.shared) for t in rows(0, i))
                for i in range(self.model.config.num_hidden_layers)]
        return Handoff(len(prompt), host, to_host(logits[0, -1], self.shared), time.perf_counter() - start,
                       prompt.cpu())


def to_host(t: torch.Tensor, shared: bool = False) -> torch.Tensor:
    """A host copy, made in one copy: pinned where a GPU may read it, or (shared) in shared memory, for
    another process."""
    if shared:
        out = torch.empty(t.shape, dtype=t.dtype).share_memory_()
    else:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    return out.copy_(t.detach())


READY = ("hisparse-prefill", "ready")     # a worker's first answer: its model is built


class PrefillProcess:
    """A `PrefillWorker` in a process of its own (spawned): `build_model()` (picklable, e.g. a
    module-level function or functools.partial of `load_model`) makes its model there, on `device`
    (made the process's current CUDA device); prompts go in with `submit(key, prompt)`, `get()`
    returns (key, Handoff) or raises the worker's error, `poll()` takes what has come without waiting.

    Tensors cross in shared memory by torch.multiprocessing's sharing strategy, file_descriptor on
    Linux (`SHARING`): each segment is unlinked as it is made and lives while a process holds a
    tensor of it, so nothing is left in /dev/shm once the handoffs are dropped (file_system would
    leave torch_* files there). The worker ignores SIGINT (a terminal's Ctrl-C reaches the whole
    process group: the decode server closes it) and exits when its parent is gone."""

    def __init__(self, build_model: Callable, device: str | None = None, **worker_kw):
        if mp.get_sharing_strategy() != SHARING:
            raise ValueError(f"torch.multiprocessing's sharing strategy is {mp.get_sharing_strategy()!r}; a prefill "
                             f"process hands off through {SHARING!r}, which leaves no file in /dev/shm")
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.device, self.ready = device, False
        self.process = ctx.Process(target=_serve, args=(build_model, device, worker_kw, self.inbox, self.outbox,
                                                        os.getpid()), name="hisparse-prefill", daemon=True)
        self.process.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def submit(self, key, prompt: torch.Tensor) -> None:
        self.inbox.put((key, prompt))

    def wait_ready(self, timeout: float) -> None:
        """Wait until its model is built; RuntimeError with the worker's error, or if it died or took too long."""
        deadline = time.monotonic() + timeout
        while not self.ready:
            if not self.alive and self.outbox.empty():
                raise RuntimeError(f"the prefill worker (pid {self.pid}) exited with code {self.process.exitcode} "
                                   f"before its model was built")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the prefill worker (pid {self.pid}) did not build its model in {timeout:g} s")
            try:
                key, result = self._next(timeout=0.2)
            except queue.Empty:
                continue
            raise RuntimeError(f"the prefill worker could not build its model: {result}" if key is None else
                               f"the prefill worker answered {key!r} before it was ready")

    def get(self, timeout: float | None = None) -> tuple[object, Handoff]:
        key, result = self._next(timeout)
        if isinstance(result, str):
            raise RuntimeError(f"the prefill worker failed on {key!r}: {result}")
        return key, result

    def poll(self) -> list[tuple[object, Handoff | str]]:
        """Every (key, Handoff or the worker's error text) that has come, without waiting."""
        answers = []
        while True:
            try:
                answers.append(self._next(timeout=0))
            except queue.Empty:
                return answers

    def _next(self, timeout: float | None) -> tuple[object, Handoff | str]:
        while True:
            key, result = self.outbox.get(timeout=timeout)
            if key != READY:
                return key, result
            self.ready = True

    def close(self, timeout: float = 30.0) -> None:
        """Ask it to stop, wait up to `timeout` s, then kill it; it is reaped (no zombie) either way."""
        if self.process.is_alive():
            self.inbox.put(None)
            self.process.join(timeout=timeout)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        for q in (self.inbox, self.outbox):
            q.cancel_join_thread()          # a dead reader: what is left unsent must not hold this process's exit
            q.close()


SHARING = "file_descriptor"


def _serve(build_model: Callable, device: str | None, worker_kw: dict, inbox, outbox, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device))     # Triton launches on the current device
        worker = PrefillWorker(build_model(), shared=True, **worker_kw)
    except BaseException:
        outbox.put((None, traceback.format_exc(limit=3)))
        return
    outbox.put((READY, None))
    while True:
        try:
            item = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:      # the decode server died: no orphan left behind
                return
            continue
        if item is None:
            return
        key, prompt = item
        try:
            outbox.put((key, worker.prefill(prompt)))
        except Exception:
            outbox.put((key, traceback.format_exc(limit=3)))

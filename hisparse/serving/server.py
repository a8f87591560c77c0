"""The serving loop: requests join and leave one decode batch, admitted by what fits the budgets.

    server = Server(model, "hisparse", cache_slots=4096, max_context=40960, kv_budget_gib=24, graph=True)
    run = server.serve(requests, clients=8)     # closed loop; clients=None: each request's arrival
    server.open(); server.submit(Request(prompt, 64, arrival=math.nan)); server.step(); server.close()

Each iteration (`step`): join a prompt finished earlier; admit the head of the queue when nothing
is prefilling (`Scheduler`, `LaneMemory`); one prefill piece (`Runner.run_piece`); one decode step
of every lane, its tokens read on the host (TTFT and TPOT are host times after that read); requests
done leave. A run records its schedule; `serve(replay=...)` runs it in another mode with the same
lanes, so every request meets the same batch at every step: tokens and logits are then bitwise equal.
"""
from __future__ import annotations

import math
import time

import torch

from hisparse.engine import family_runtime
from hisparse.runtime import KV_MODES, prefetch_width
from hisparse.serving.memory import LaneMemory
from hisparse.sampling import eos_token_ids
from hisparse.serving.request import Iteration, Request, Schedule, ServingRun, check_request, emit
from hisparse.serving.options import check_options, check_overlap
from hisparse.serving.runner import PrefillJob, Runner
from hisparse.serving.scheduler import Scheduler, drive, free_lane
from hisparse.serving.sharing import PrefixSharing

# hybrid (every family): a request resident while its rows fit beside the others in runs of the cache's
# streams, hierarchical otherwise; a resident one is demoted when a hierarchical one needs the room
SERVING_MODES = (*KV_MODES, "hybrid")
PREFILL_LAYERS = 4          # layers of a prefill piece with prefill_overlap, by default
HYBRID_COUNTS = ("resident_admissions", "demotions", "resident_steps")     # hybrid's, in a run's summary


class Server:
    """A continuous-batching server over one model (see the module docstring).

    mode: resident, hisparse, noio or hybrid. cache_slots: B (hierarchical and hybrid modes).
    max_context: the most tokens a request may hold (prompt + max new tokens). kv_budget_gib,
    host_budget_gib, max_batch, lanes: what the lanes and the cache hold (`LaneMemory`).
    prefill_chunk: prompt tokens per iteration. graph: decode steps in one CUDA graph. prefill:
    "model" (the family's kernels) or "reference" (eager). keep_logits: every token's logits on each
    request. selections: int32 [steps, layers, ..., k], a trace each request replays from its first
    decode step instead of the indexer's, unless it brings its own (`Request.selections`).
    token_budget (Quest), decode_backend, kv_dtype, index_dtype (DSA; "fp8" rows, keys), prefetch,
    prefetch_programs: as `Engine`'s. prefill_overlap (families whose runtime has
    `prefill_beside_decode`: DSA): each iteration launches the decode step, then `prefill_layers`
    layers of the current chunk on a side CUDA stream (inline after the step without a GPU).
    prefill_sms: that side stream in a CUDA green context of this many SMs (None: every SM).
    disaggregated: a decode instance of a prefill/decode-disaggregated deployment, emulated: a prompt is
    prefilled at its admission with the clock stopped (`Request.prefill_s`), as if its KV had landed.
    prefix_cache: prompts' whole pages prefilled once and kept; one extending them prefills the rest (`sharing.py`)."""

    def __init__(self, model, mode: str = "resident", cache_slots: int | None = None, max_context: int = 4096,
                 kv_budget_gib: float | None = None, host_budget_gib: float | None = None, max_batch: int = 256,
                 lanes: int | None = None, prefill_chunk: int = 8192, graph: bool = False, prefill: str = "model",
                 keep_logits: bool = False, token_budget: int | None = None, decode_backend: str = "auto",
                 prefetch: bool = False, prefetch_programs: int | None = None,
                 selections: torch.Tensor | None = None, kv_dtype: str = "bf16", prefill_overlap: bool = False,
                 prefill_layers: int = PREFILL_LAYERS, prefill_sms: int | None = None, index_dtype: str = "bf16",
                 disaggregated: bool = False, prefix_cache: bool = False):
        weight = model.model.embed_tokens.weight
        max_context, self.prefill_chunk, max_batch = check_options(
            mode, SERVING_MODES, prefill, prefetch, disaggregated, prefill_overlap, graph and not weight.is_cuda,
            max_context, prefill_chunk, max_batch, prefix_cache)
        self.model, self.mode, self.graph, self.keep_logits = model, mode, graph, keep_logits
        self.eos = eos_token_ids(model.config)      # a request stops at these unless its sampling ignores eos
        self.device = weight.device
        self.runtime = runtime = family_runtime(model, token_budget, decode_backend, kv_dtype, index_dtype)
        self.prefill_layers, prefill_sms = check_overlap(runtime, prefill_overlap, prefill_layers, prefill_sms)
        self.prefill_overlap, self.prefill_sms, self.disaggregated = prefill_overlap, prefill_sms, disaggregated
        self.hybrid = mode == "hybrid"
        self.decode_backend, self.prefetch, self.kv_dtype = decode_backend, prefetch, kv_dtype
        self.prefetch_programs = prefetch_width(runtime.family, prefetch_programs)
        self.memory = LaneMemory(runtime, mode, cache_slots, max_context, kv_budget_gib, host_budget_gib, max_batch,
                                 lanes, prefetch, self.device, prefix_cache)
        self.runner = Runner(model, runtime, self.memory, graph, prefill == "model", decode_backend, prefetch,
                             self.prefetch_programs, selections, prefill_overlap, prefill_sms, disaggregated)
        self.sharing = self.memory.sharing = PrefixSharing(self.memory, self.prefill_chunk) if prefix_cache else None
        count = model.config.num_hidden_layers
        self.scheduler = Scheduler(self.prefill_chunk, self.prefill_layers if prefill_overlap else count, count)
        self.lane_request: list[Request | None] = [None] * self.lanes
        self._reserved: int | None = None        # the lane of the request being prefilled
        self._prefilling: PrefillJob | None = None
        self._planned = None                     # a replayed schedule's iterations
        self.requests, self._open = [], False       # the run's requests by rid; a run open (open .. close)
        self.hybrid_counts = dict.fromkeys(HYBRID_COUNTS, 0)                    # (reset by open)

    # what the memory holds, as a server's caller reads it
    lanes = property(lambda self: self.memory.lanes)
    cache = property(lambda self: self.memory.cache)
    cache_slots = property(lambda self: self.memory.cache_slots)
    max_context = property(lambda self: self.memory.max_context)
    kv_budget = property(lambda self: self.memory.kv_budget)
    lane_bytes = property(lambda self: self.memory.lane_bytes)
    workspace_bytes = property(lambda self: self.memory.workspace_bytes)
    lane_caps = property(lambda self: self.memory.caps())
    streams_per_request = property(lambda self: self.memory.streams_per_request)
    layers = property(lambda self: self.runner.layers)

    def gpu_bytes(self, extra: int = 0) -> int:
        """Budgeted GPU bytes in use now: the lanes' state, the cache, the workspace in use (`extra`)."""
        return self.memory.gpu_bytes(self.runner.layers, extra)

    def _note_peak(self, extra: int = 0) -> None:
        self.peak_gpu = max(self.peak_gpu, self.gpu_bytes(extra))
    # CUDA graphs this server captured (one; hybrid two): results/notes/graphs.md on a process's 4th
    graphs_captured = property(lambda self: len(self.runner.steps) if self.graph else 0)

    # -- requests ----------------------------------------------------------------------------

    def check_request(self, request: Request) -> None:
        """ValueError if the request could never be served: bad ids, or more than the server holds."""
        check_request(request, self.model.config.vocab_size, self.max_context)
        self.runner.check_trace(request)
        self.memory.check(len(request.prompt), len(request.prompt) + request.max_new_tokens)
        if request.handoff is not None:                      # its prompt prefilled elsewhere
            request.handoff.check(request.prompt, self.runtime, self.model.config.vocab_size)

    def _admissible(self, request: Request) -> bool:
        return free_lane(self.lane_request, self._reserved) is not None and \
            self.memory.admissible(request, self.lane_request)

    # -- a run: open, submit, step, close (serve drives them for a list of requests) ---------------

    def open(self, replay: Schedule | None = None) -> None:
        """Start a run: kernels warmed up, the clock at 0, the server's attention in the model (until
        `close`). replay: follow that schedule (the same lanes) instead of choosing."""
        if replay is not None and replay.lanes != self.lanes:
            raise ValueError(f"the schedule ran {replay.lanes} lanes, this server has {self.lanes}: build it with "
                             f"lanes={replay.lanes}")
        if self._open:
            raise RuntimeError(f"open() while a run is open ({self._unfinished()}): close() it first")
        self.runner.warm_up()
        self._previous_attention, self.model.sparse_attention = self.model.sparse_attention, self.runner.attention
        self.requests, self._prefilling = [], None      # every request submitted in this run, by rid; none prefilling
        self.scheduler.pending, self.scheduler.waiting = [], []
        self._planned = iter(replay.iterations) if replay is not None else None
        self.schedule = Schedule(self.lanes)
        self.running_batch: list[int] = []
        self.peak_gpu = self.gpu_bytes()
        self.memory.record_host(0.0, start=True)      # the host bytes in use as they change
        self.hybrid_counts = dict.fromkeys(HYBRID_COUNTS, 0)
        self._start, self._open = time.perf_counter(), True

    def now(self) -> float:
        """Seconds since `open`."""
        return time.perf_counter() - self._start

    def submit(self, request: Request) -> Request:
        """Queue a request (ValueError, and nothing queued, if it could never be served). Its
        arrival: as set, relative to `open`; math.nan (the default for a new Request is 0.0) means now.
        A Request object is submitted once a run (its state is the run's)."""
        self._require_open("submit")
        if any(r is request for r in self.requests):
            raise ValueError(f"this Request was already submitted in this run (rid {request.rid}): submit a new one")
        self.check_request(request)
        request.start_run(len(self.requests))
        if math.isnan(request.arrival):
            request.arrival = self.now()
        self.requests.append(request)
        self.scheduler.add(request)
        return request

    is_open = property(lambda self: self._open)                   # a run is open (open() .. close())
    waiting = property(lambda self: self.scheduler.waiting)       # arrived, not admitted (first come first served)

    running = property(lambda self: [r for r in self.lane_request if r is not None])     # the requests in lanes

    prefilling = property(lambda self: None if self._prefilling is None else self._prefilling.request)

    busy = property(lambda self: bool(self.scheduler.waiting or self.scheduler.pending or self._prefilling
                                      or self.running))          # any request queued, being prefilled or decoding

    def next_arrival(self) -> float | None:
        """When the next submitted request arrives (seconds since `open`), None if none is due."""
        return self.scheduler.next_arrival()

    def cancel(self, request: Request) -> None:
        """Stop a request wherever it is (a client that went away): its lane, streams and host regions
        are freed at once. Not while replaying a schedule."""
        self._require_open("cancel")
        if self._planned is not None:
            raise RuntimeError("a replayed schedule cannot lose a request")
        if request.done or not any(r is request for r in self.requests):
            return                                        # finished, or not this run's: nothing to stop
        request.cancelled = True
        if self.scheduler.remove(request):
            return
        if self._prefilling is not None and self._prefilling.request is request:
            self._drop_prefill()
        elif request.lane is not None and self.lane_request[request.lane] is request:
            self._leave(request)

    def _drop_prefill(self) -> None:
        """The prompt being prefilled will not join (or its join failed): its lane, streams and runs go back."""
        lane, job = self._prefilling.request.lane, self._prefilling
        self.runner.stop_prefill()
        job.lane_prefill.cancel()
        self.memory.lane_runs.pop(lane, None)          # (a failed join may have set them and the lane's streams)
        self.runner.clear_lane(lane)
        self._prefilling, self._reserved, job.request.lane = None, None, None
        self.memory.lanes_changed += 1

    def step(self) -> list[Request]:
        """One iteration (see the module docstring); returns the requests that finished in it. On
        their way each request's `on_token(request, token)`, if set, is called for every new token."""
        self._require_open("step")
        t = self.now()
        self.scheduler.arrive(t)
        finished = []
        step = Iteration(-1, 0, False)
        plan = None
        if self._planned is not None:
            plan = next(self._planned, None)
            if plan is None:
                raise ValueError("the replayed schedule ended before every request finished")
        job = self._prefilling
        # a prompt done in an earlier iteration (overlap: its last piece ran beside the last decode step;
        # while that piece still runs and lanes decode, the join waits: reading its first token would)
        if job is not None and job.complete and (plan.joined if plan is not None
                                                 else self.runner.may_join(job, bool(self.running))):
            self._join_prefill(job, step, finished)
        if plan is not None:
            if plan.admitted >= 0:
                request = self.requests[plan.admitted]
                self.scheduler.remove(request)                   # admitted as recorded, wherever it waits
                self._prefilling = self._start_prefill(request, t)
                step.admitted = request.rid
        elif self._prefilling is None:
            request = self.scheduler.admit(self._admissible)
            if request is not None:
                self._prefilling = self._start_prefill(request, t)
                step.admitted = request.rid
        job = self._prefilling
        if job is not None and ((job.request.handoff is not None and job.complete) or self.disaggregated) and \
                (plan.joined if plan is not None else True):   # a whole handoff, adopted as it was admitted,
            if not job.complete:                             # or the prompt at once, off the clock
                self._start += self.runner.prefill_whole(job, self.scheduler)
            self._join_prefill(job, step, finished)
            job = None
        piece = self.runner.next_piece(job, plan, self.scheduler, bool(self.running))
        # without overlap (or where the schedule joins the request after this very piece) the piece
        # runs before the decode step, as one chunk of every layer does; an overlapping server runs
        # every piece on its side stream even so (the join then waits on it), so no tensor of a chunk
        # is made on one stream and used on the other
        overlapped = piece is not None and self.prefill_overlap and not (plan is not None and plan.joined
                                                                         and not step.joined)
        if piece is not None:
            step.prefilled, step.layers = piece[0], piece[1:]
        if piece is not None and not overlapped:
            self.runner.run_piece(job, *piece, after=self.runner.main_event() if self.prefill_overlap else None)
            self._note_peak(job.held)
            if job.complete and (plan.joined if plan is not None else True):
                self._join_prefill(job, step, finished)
            elif plan is not None and plan.joined and not step.joined:
                raise ValueError(f"the replayed schedule joins request {job.request.rid} before its prompt is done")
        elif plan is not None and plan.joined and not step.joined:
            raise ValueError("the replayed schedule joins a request that is not being prefilled")
        active = self.running
        decoding = plan.decoded if plan is not None else bool(active)
        # the side stream sees what the main one did before the step (the lane's setup), not the step
        before = self.runner.main_event() if overlapped else None
        if decoding:
            logits = self._decode_step()
        if overlapped:
            self.runner.run_piece(job, *piece, after=before)
            self._note_peak(job.held)
        if decoding:
            tokens, logprobs = self.runner.next_tokens(logits, self.lane_request)   # the step's one host sync
            t = self.now()
            self.running_batch.append(len(active))
            step.decoded = True
            for lane, r in enumerate(self.lane_request):
                if r is None:
                    continue
                self._emit(r, int(tokens[lane]), logprobs[lane], t, logits[lane])
                if r.done:
                    self._leave(r)
                    finished.append(r)
        self.memory.record_host(self.now())
        self._note_peak()
        if step.admitted >= 0 or step.prefilled or step.decoded or step.joined:
            self.schedule.iterations.append(step)
        return finished

    def close(self, unfinished: str = "refuse") -> ServingRun:
        """End the run: the model's own attention back. Requests still queued or running: "refuse"
        (a RuntimeError, the run still open), "cancel" them (the run lists them in `cancelled`) or
        "finish" them (served to the end first)."""
        self._require_open("close")
        if unfinished not in ("refuse", "cancel", "finish"):
            raise ValueError(f"unfinished={unfinished!r}: expected 'refuse', 'cancel' or 'finish'")
        if self.busy and unfinished == "refuse":
            raise RuntimeError(f"close() with requests unfinished ({self._unfinished()}): close('cancel') cancels "
                               f"them, close('finish') serves them to the end")
        while self.busy and unfinished == "finish":
            self.step()
            if not (self._prefilling or self.running or self.waiting) and self.next_arrival() is not None:
                time.sleep(max(0.0, min(self.next_arrival() - self.now(), 0.05)))   # idle until then
        self._planned = None
        try:
            for r in [r for r in self.requests if r.lane is not None or self.scheduler.queued(r)]:
                self.cancel(r)
        finally:
            self.model.sparse_attention, self._open = self._previous_attention, False
        return ServingRun([r for r in self.requests if not r.cancelled], self.schedule, self.now(),
                          self.running_batch, self.peak_gpu, self.memory.peak_host_rows,
                          dict(self.hybrid_counts) if self.hybrid else None,
                          [r for r in self.requests if r.cancelled], self.sharing and self.sharing.run_stats(),
                          self.memory.host_bytes)

    def _require_open(self, call: str) -> None:
        if not self._open:
            raise RuntimeError(f"{call}() on a server with no open run: call open() first (serve() opens and closes one)")

    def _unfinished(self) -> str:
        queued = len(self.scheduler.waiting) + len(self.scheduler.pending)
        return f"{queued} queued, {int(self._prefilling is not None)} prefilling, {len(self.running)} running"

    def serve(self, requests: list[Request], clients: int | None = None, replay: Schedule | None = None,
              progress: bool = False, max_concurrency: int | None = None) -> ServingRun:
        """Serve `requests` to the end; the run lists them in their order (rids: order of submission).
        clients: a closed loop of that many clients, request i sent by client i % clients as soon as
        its previous one finished; None: each at its `arrival`, at most max_concurrency out at once
        (`drive`). replay: run that schedule (the same lanes). progress: a line on stderr every 10 s."""
        return drive(self, requests, clients, replay, progress, max_concurrency)

    # -- inside an iteration -----------------------------------------------------------------------

    def _decode_step(self) -> torch.Tensor:
        """The runner's step over the lanes; hybrid's all-resident kind when every request's lane is resident."""
        resident_step = self.hybrid and all(r is None or lane in self.memory.lane_runs
                                            for lane, r in enumerate(self.lane_request))
        self.hybrid_counts["resident_steps"] += resident_step
        return self.runner.decode_step(self.lane_request, resident_step)

    def _start_prefill(self, request: Request, t: float) -> PrefillJob:
        request.prefill_start = t
        request.lane = self._reserved = free_lane(self.lane_request, self._reserved)   # reserved (still masked)
        if request.lane is None:
            raise ValueError(f"the replayed schedule admits request {request.rid} with every lane taken")
        try:
            placement = {}
            if self.hybrid:
                placement, demoted = self.memory.place(request, self.lane_request, self.layers)
                self.hybrid_counts["demotions"] += demoted
            job = self.runner.start_prefill(request, placement)
            if request.handoff is not None:
                self.runner.adopt(job)
                request.prefill_s = request.handoff.prefill_s
            return job
        except BaseException:             # (out of memory, say) the lane goes back, the request to the queue's head
            self._reserved = request.lane = None
            self.scheduler.waiting.insert(0, request)
            raise

    def _join_prefill(self, job: PrefillJob, step: Iteration, finished: list[Request]) -> None:
        """The prompt done: its first token out, the request in its lane (a one-token one until cached)."""
        self.runner.wait_prefill(job)
        request = job.request
        self._emit(request, *self.runner.first_token(request, job.last_logits), t=self.now(), logits=job.last_logits)
        self.hybrid_counts["resident_admissions"] += int(job.lane_prefill.runs is not None and not request.done)
        try:
            prefilled = self.runner.join(job)
        except BaseException:
            if request.done:                   # nothing cancels a finished request: its prefill goes back here
                self._drop_prefill()
            raise
        self.lane_request[request.lane] = request
        self.memory.lanes_changed += 1
        self._note_peak(job.held)
        self._prefilling, self._reserved = None, None
        step.joined = True
        try:                 # its prompt's whole pages cached, once it holds its lane
            if self.sharing is not None:
                self.sharing.insert(request.prompt, prefilled, self.runner.lane_states.streams(request.lane))
        finally:
            if request.done:             # that was its only token (or it stopped there): it leaves at once
                self._leave(request)
                finished.append(request)

    def _leave(self, request: Request) -> None:
        """Free a finished request's lane: its counters read, its streams and host regions released."""
        lane = request.lane
        if self.cache is not None:
            counts = self.runner.lane_counts(lane)
            if counts is not None:
                request.hits, request.misses = counts
            self.memory.release(lane, self.runner.lane_states.streams(lane))
        else:
            self.memory.lanes_changed += 1
        self.runner.clear_lane(lane)
        self.lane_request[lane] = None
        request.lane = None

    def _emit(self, request: Request, token: int, logprob, t: float, logits: torch.Tensor) -> None:
        emit(request, token, t, logits if self.keep_logits else None, logprob, self.eos)

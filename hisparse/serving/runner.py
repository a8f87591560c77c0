"""The device side of an iteration: the lanes' static buffers, the decode step (one CUDA graph), and
a prefill's pieces, in line or on a side stream beside the steps.

Every decode step has one shape: the lanes' tokens, lengths, the lane mask and stream ids are
static buffers rewritten between replays, so one graph is captured once (hybrid: a second for the
steps whose lanes are all resident). One padded graph rather than one per batch bucket: from a
process's 4th PyTorch graph capture on, every graph replays slower (results/notes/graphs.md).

With prefill beside decode, a piece (a few layers of a chunk, `CausalLM.prefill_pieces`) runs on
a side stream that waited only on what the main stream did before the step; a graphed step replays
on a higher-priority stream. A piece never reads from the GPU, so launching it never waits; one
piece is in flight at a time (a non-blocking event query), and a finished prompt joins once its last
piece is done.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hisparse.models.base import DecodeState
from hisparse.runtime import FamilyRuntime, LanePrefill, count_graph_capture
from hisparse.sampling import LaneSampling, token_logprobs
from hisparse.serving.memory import LaneMemory, empty_layers
from hisparse.serving.request import Request


@dataclass
class PrefillJob:
    """A request being prefilled into its lane."""

    request: Request
    lane_prefill: LanePrefill         # the family's prefill into the lane; its state is the workspace
    done: int = 0                     # prompt tokens prefilled (whole chunks)
    last_logits: torch.Tensor | None = None
    pieces: object | None = None      # the chunk under way: its prefill_pieces generator (one layer a next())
    chunk: int = 0                    # its tokens
    layer: int = 0                    # its layers done
    held: int = 0                     # workspace bytes held
    complete: bool = False            # every chunk done: the request joins at the next chance
    finished: object | None = None    # overlap on a GPU: the event its last piece recorded on the side stream
    piece_done: object | None = None  # overlap on a GPU: the event its latest piece recorded there


class Runner:
    """The lanes on the device and what runs on them. selections: int32 [steps, layers, ..., k], the
    trace a request replays instead of the indexer's unless it brings its own."""

    def __init__(self, model, runtime: FamilyRuntime, memory: LaneMemory, graph: bool, fast: bool,
                 decode_backend: str, prefetch: bool, prefetch_programs: int, selections: torch.Tensor | None,
                 prefill_overlap: bool, prefill_sms: int | None, disaggregated: bool = False):
        self.model, self.runtime, self.memory = model, runtime, memory
        self.disaggregated = disaggregated      # prompts prefilled off the clock: a schedule's pieces cannot run
        self.graph, self.fast, self.decode_backend = graph, fast, decode_backend
        self.device, lanes = memory.device, memory.lanes
        # the side stream the prefill pieces run on beside the decode steps (and its green context with
        # prefill_sms, kept as long as the stream), and the higher-priority stream graphed steps replay
        # on: a graph's kernels take the priority of the stream it is launched into
        self.side, self.green = (side_stream(self.device, prefill_sms) if prefill_overlap
                                 and self.device.type == "cuda" else (None, None))
        self.urgent = torch.cuda.Stream(self.device, priority=-1) if self.side is not None and graph else None
        self.layers = empty_layers(runtime, memory.kv_mode, lanes, memory.cache, memory.max_context, prefetch,
                                   self.device)
        self.state = DecodeState(self.layers, memory.max_context,
                                 torch.zeros(lanes, dtype=torch.int64, device=self.device))
        self.attention = runtime.attention(memory.kv_mode, self.layers, check_values=not graph, prefetch=prefetch,
                                           prefetch_programs=prefetch_programs)
        self.attention.lanes = torch.zeros(lanes, dtype=torch.bool, device=self.device)
        self.lane_states = runtime.serving_lanes(self.layers, self.attention.lanes)
        if memory.hybrid:                         # every lane hierarchical until one is admitted resident
            self.lane_states.track_residency(self.device)
        self.tokens = torch.zeros(lanes, dtype=torch.int64, device=self.device)
        self.sampler = LaneSampling(lanes, model.config.vocab_size, self.device, graph)
        self.selections = None
        if selections is not None:
            count = model.config.num_hidden_layers
            if selections.dim() < 3 or selections.shape[1] != count or selections.dtype != torch.int32:
                raise ValueError(f"selections must be int32 [steps, {count} layers, ..., k], got "
                                 f"{selections.dtype} {tuple(selections.shape)}")
            self.selections = selections.to(self.device)
            self.host_selections = selections.cpu()       # beside requests' own traces (on the host)
            self.attention.replay_sel = torch.full((count, lanes, *selections.shape[2:]), -1,
                                                   dtype=torch.int32, device=self.device)
            # requests' own traces stay on the host: each step's rows are stacked here (pinned on a GPU,
            # so the copy is a DMA that does not wait on pageable staging), then copied asynchronously
            self._replay_host = torch.empty(self.attention.replay_sel.shape, dtype=torch.int32,
                                            pin_memory=self.device.type == "cuda")
            self._replay_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        # the decode step (graphed after its first eager run), keyed by whether it is hybrid's all-resident kind
        self.steps: dict[bool, Callable[[], torch.Tensor]] = {}
        self.resident_step = False
        self.warmed = False

    def check_trace(self, request: Request) -> None:
        """ValueError unless the request's own trace (kept on the host), or the shared one, fits this
        server's replay buffer and holds a step for each of its decode steps."""
        shared = self.selections
        if request.selections is not None:
            if shared is None:
                raise ValueError("a request brings selections to replay: build the server with selections= (the "
                                 "trace a request without its own replays, which sizes the replay buffer)")
            own = request.selections
            if own.dtype != torch.int32 or tuple(own.shape[1:]) != tuple(shared.shape[1:]):
                raise ValueError(f"request selections must be int32 [steps, {', '.join(map(str, shared.shape[1:]))}], "
                                 f"got {own.dtype} {tuple(own.shape)}")
            request.selections = own.cpu()    # on the host; each step stages its rows
        trace = request.selections if request.selections is not None else shared
        if trace is not None and request.max_new_tokens - 1 > trace.shape[0]:
            raise ValueError(f"max_new_tokens={request.max_new_tokens} needs {request.max_new_tokens - 1} decode steps "
                             f"of selections; the replayed trace has {trace.shape[0]}")

    # -- the decode step -------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Compile the prefill and decode kernels (and capture the decode graph) before any request, on
        a GPU; Triton's interpreter compiles nothing, so off the GPU there is nothing to prepare."""
        if self.warmed or self.device.type != "cuda":
            return
        prompt = torch.zeros(min(self.memory.max_context, 2 * self.runtime.unit_size + 3), dtype=torch.int64,
                             device=self.device)
        state = self.runtime.new_state(1, len(prompt))
        self.model.prefill(prompt[None], state, fast=self.fast, last_logits=True, backend=self.decode_backend)
        del state
        previous = self.model.sparse_attention
        self.model.sparse_attention = self.attention
        try:
            empty = [None] * self.memory.lanes
            for resident_step in (False, True) if self.memory.hybrid else (False,):
                for _ in range(2):          # eager (compiles), then captured and replayed with graph=True
                    self.decode_step(empty, resident_step)
        finally:
            self.model.sparse_attention = previous
        self.state.lengths.zero_()
        self.warmed = True

    def decode_step(self, lane_request: list[Request | None], resident_step: bool) -> torch.Tensor:
        """One decode step of every lane: logits [lanes, V]. resident_step (hybrid): every lane holding
        a request is resident, so the step skips the hierarchical write and resolve."""
        if resident_step != self.resident_step:
            self.lane_states.set_resident_step(resident_step)
            self.resident_step = resident_step
        lengths = [0 if r is None else r.length for r in lane_request]
        if self.memory.cache is not None:
            self.runtime.advance_streams(self.memory.cache, self.layers, lengths)
        self.state.lengths.copy_(torch.tensor(lengths, dtype=torch.int64))
        self.tokens.copy_(torch.tensor([0 if r is None else r.tokens[-1] for r in lane_request]))
        self.attention.lanes.copy_(torch.tensor([r is not None for r in lane_request]))
        if self.selections is not None:       # each lane's step of its trace (an empty lane's is masked)
            self._fill_replay(lane_request)
        self.state.max_length = max(lengths)
        step = self.steps.get(resident_step)
        if step is None:
            logits = self.model.decode(self.tokens, self.state)
            self.steps[resident_step] = self._graphed_step() if self.graph else (
                lambda: self.model.decode(self.tokens, self.state))
            return logits
        return step()

    def next_tokens(self, logits: torch.Tensor, lane_request: list[Request | None]) -> tuple[torch.Tensor, list]:
        """(tokens [lanes] on the host, each lane's logprobs entry or None) of a decode step's logits:
        the argmax while no lane needs the sampler, else `LaneSampling.sample` (its own graph)."""
        if not self.sampler.needed:
            tokens = logits.argmax(-1)
        else:
            tokens = self.sampler.sample(logits)
            self.sampler.advance(tokens, self.attention.lanes)
        tops = [None if r is None else r.sampling.logprobs for r in lane_request]
        return tokens.cpu(), token_logprobs(logits, tokens, tops)      # the step's host sync (one more with logprobs)

    def first_token(self, request: Request, logits: torch.Tensor) -> tuple[int, object]:
        """(token, logprobs entry or None) from a prefill's last logits [V]; the lane's sampler set up."""
        self.sampler.set_lane(request.lane, request.sampling)
        if self.sampler.uses[request.lane]:
            token = self.sampler.sample_lane(request.lane, logits)
        else:
            token = int(logits.argmax())
        return token, token_logprobs(logits[None], torch.tensor([token]), [request.sampling.logprobs])[0]

    def clear_lane(self, lane: int) -> None:
        """A request left the lane: its streams' state and its sampling settings go."""
        self.lane_states.clear(lane)
        self.sampler.clear_lane(lane)

    def _fill_replay(self, lane_request: list[Request | None]) -> None:
        """replay_sel [layers, lanes, ..., k] from each lane's trace at the lane's next decode step."""
        steps = [0 if r is None else len(r.tokens) - 1 for r in lane_request]
        own = [r is not None and r.selections is not None for r in lane_request]
        if not any(own):                      # one shared trace, on the device: one gather
            index = torch.tensor(steps, device=self.device)
            self.attention.replay_sel.copy_(self.selections[index].transpose(0, 1))
            return
        rows = [(r.selections if mine else self.host_selections)[step]
                for r, mine, step in zip(lane_request, own, steps)]
        if self._replay_copied is not None:
            self._replay_copied.synchronize()     # the last step's copy has read the staging buffer
        torch.stack(rows, dim=1, out=self._replay_host)
        self.attention.replay_sel.copy_(self._replay_host, non_blocking=True)
        if self._replay_copied is not None:
            self._replay_copied.record()

    def _graphed_step(self) -> Callable[[], torch.Tensor]:
        count_graph_capture()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.model.decode(self.tokens, self.state)

        def step() -> torch.Tensor:
            if self.urgent is None:
                graph.replay()
                return logits
            main = torch.cuda.current_stream()
            self.urgent.wait_stream(main)               # after the lane setup; the main stream waits for it
            with torch.cuda.stream(self.urgent):
                graph.replay()
            main.wait_stream(self.urgent)
            return logits

        return step

    def lane_counts(self, lane: int) -> tuple[int, int] | None:
        """(hits, misses) of the resolves of a lane's own streams, None if it holds none."""
        ids = self.lane_states.streams(lane, owned=True)
        if not ids:
            return None
        hits, misses = self.memory.cache.stats[torch.tensor(ids, device=self.device)].sum(0).tolist()
        return int(hits), int(misses)

    # -- a prefill, in pieces --------------------------------------------------------------------

    def start_prefill(self, request: Request, placement: dict) -> PrefillJob:
        """A prefill into the request's lane (hybrid: `placement`'s runs, given back if it fails), on
        from the cached prefix of its prompt where the server shares prefixes (`memory.sharing`)."""
        memory = self.memory
        try:
            shared = memory.sharing.take(request.prompt) if memory.sharing is not None and request.handoff is None \
                else None
            pages = {} if shared is None or shared[0] is None else {"shared_pages": shared[0]}   # (not given back below)
            lane_prefill = self.runtime.lane_prefill(memory.kv_mode, memory.cache, self.layers, request.lane,
                                                     len(request.prompt), len(request.prompt) + request.max_new_tokens,
                                                     **placement, **pages)
        except BaseException:
            for first in [first for held in placement.values() for first in held]:
                memory.cache.release_run(first)
            raise
        job = PrefillJob(request, lane_prefill)
        if shared is not None:
            self.adopt(job, shared[1])
        if memory.sharing is not None and request.handoff is None:
            memory.sharing.count(len(request.prompt), shared[1].prompt_len if shared else 0)
        return job

    def adopt(self, job: PrefillJob, handoff=None) -> None:
        """The request's handoff (or `handoff`, a cached prefix's) placed as its own prefill would have
        placed it: the prompt is done, or (a prefix's handoff) its first `prompt_len` tokens, the prefill
        going on from there."""
        handoff = handoff or job.request.handoff
        try:
            job.lane_prefill.adopt(handoff.layer_rows, handoff.prompt_len)
        except BaseException:
            job.lane_prefill.cancel()            # its streams, regions and runs go back
            raise
        job.done, job.held = handoff.prompt_len, job.lane_prefill.workspace_bytes
        job.complete = handoff.prompt_len == len(job.request.prompt)
        job.last_logits = handoff.logits.to(self.device) if job.complete else None

    def join(self, job: PrefillJob):
        """The prompt done, its request staying: the lane reads what its prefill wrote (hybrid: its runs
        kept). Returns the prefill's state, which the join lets go, for a prefix cache to read next."""
        if job.lane_prefill.runs is not None:
            self.memory.lane_runs[job.request.lane] = job.lane_prefill.runs
        prefilled = job.lane_prefill.state
        job.lane_prefill.join()
        return prefilled

    def next_piece(self, job: PrefillJob | None, plan, scheduler, lanes_decode: bool) -> tuple[int, int, int] | None:
        """(chunk tokens, first layer, end layer) of this iteration's prefill piece, or None: a replayed
        schedule's `plan`, or the scheduler's next one; None while the previous piece still runs on the
        side stream beside decoding lanes (one piece in flight)."""
        if plan is not None:
            if plan.prefilled and self.disaggregated:
                raise ValueError("a disaggregated server prefills each prompt off the clock at its admission: replay "
                                 "handed_off_schedule(run.schedule), not a schedule with prefill pieces")
            under_way = job is not None and not job.complete
            return scheduler.planned_piece(plan, job.chunk if job else 0, job.layer if job else 0, under_way)
        if job is None or job.complete or self.piece_in_flight(job, lanes_decode):
            return None
        return scheduler.next_piece(len(job.request.prompt), job.done, job.chunk, job.layer)

    def piece_in_flight(self, job: PrefillJob, lanes_decode: bool) -> bool:
        """Whether the previous piece still runs on the side stream (and lanes decode beside it;
        with none decoding, wait for it rather than spin)."""
        if job.piece_done is None or job.piece_done.query():
            return False
        if lanes_decode:
            return True
        job.piece_done.synchronize()
        return False

    def main_event(self):
        """An event recorded on the current (main) stream now (None without a side stream)."""
        if self.side is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def run_piece(self, job: PrefillJob, chunk: int, lo: int, hi: int, after=None) -> None:
        """Layers lo .. hi - 1 of the chunk of `chunk` prompt tokens from job.done (lo = 0 starts it):
        on the side stream once it waited on `after` (overlap on a GPU), else on the current one. A
        chunk's last piece ends with the head and the chunk's staging (`chunk_done`); the prompt's
        last one records `job.finished` there. What the side stream allocates stays on it (the
        prompt's part, the activations); the workspace, made on the main stream, is freed at the join,
        after the main stream waited on `job.finished`."""
        side = self.side if after is not None else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if side is not None:
                side.wait_event(after)
            if lo == 0:
                part = job.request.prompt[job.done:job.done + chunk]    # pinned: a pageable copy would wait
                part = part.pin_memory().to(self.device, non_blocking=True) if side is not None else part.to(self.device)
                job.pieces = self.model.prefill_pieces(part[None], job.lane_prefill.state, 1, fast=self.fast,
                                                       last_logits=True, backend=self.decode_backend, start=job.done)
                job.chunk = len(part)
            logits = None
            for _ in range(hi - lo):                         # one layer a next(); the last one returns
                try:
                    next(job.pieces)
                except StopIteration as end:
                    logits = end.value
            job.layer = hi
            if (logits is None) != (hi < self.model.config.num_hidden_layers):
                raise RuntimeError(f"prefill piece of layers {lo}..{hi - 1} ended out of step with the model")
            if logits is not None:
                job.lane_prefill.chunk_done(job.done, job.done + job.chunk)
                job.held = job.lane_prefill.workspace_bytes
                job.done += job.chunk
                job.last_logits = logits[0, -1]
                job.pieces, job.chunk, job.layer = None, 0, 0
                if job.done == len(job.request.prompt):
                    job.complete = True
                    if side is not None:
                        job.finished = torch.cuda.Event()
                        job.finished.record(side)
            if side is not None:           # after the chunk's staging: it is part of the piece
                job.piece_done = torch.cuda.Event()
                job.piece_done.record(side)

    def prefill_whole(self, job: PrefillJob, scheduler) -> float:
        """The rest of the prompt at once, chunk after chunk on the current stream; the seconds it took
        (synchronised), also in `Request.prefill_s`: a disaggregated server's prefill, off its clock."""
        start = time.perf_counter()
        while not job.complete:
            self.run_piece(job, *scheduler.next_piece(len(job.request.prompt), job.done, job.chunk, job.layer))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        job.request.prefill_s = time.perf_counter() - start
        return job.request.prefill_s

    def may_join(self, job: PrefillJob, lanes_decode: bool) -> bool:
        """Whether a complete prompt joins now (not replaying): at once without overlap on a GPU, or
        once its last piece is done on the side stream (a non-blocking query), or when no lane
        decodes (then the join waits for it)."""
        return job.finished is None or not lanes_decode or job.finished.query()

    def wait_prefill(self, job: PrefillJob) -> None:
        """Before a prompt joins: the main stream waits on its side-stream work."""
        if job.finished is not None:
            main = torch.cuda.current_stream()
            main.wait_event(job.finished)
            job.last_logits.record_stream(main)              # made on the side stream, read on this one

    def stop_prefill(self) -> None:
        """A prefill is cancelled: its pieces in flight finish before its rows go back."""
        if self.side is not None:
            self.side.synchronize()


def side_stream(device: torch.device, sms: int | None) -> tuple[torch.cuda.Stream, object]:
    """(a stream beside the main one, its green context or None): an ordinary stream, or with `sms`
    one of a CUDA green context of that many SMs (torch.cuda.green_contexts), whose kernels then
    leave the other SMs free."""
    if sms is None:
        return torch.cuda.Stream(device), None
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if sms >= total:
        raise ValueError(f"prefill_sms={sms}: this GPU has {total} SMs; leave some to the decode steps")
    from torch.cuda.green_contexts import GreenContext
    context = GreenContext.create(num_sms=sms, device_id=device.index or 0)
    if hasattr(context, "Stream"):
        stream = context.Stream()
    else:                                             # torch before Stream(): one made while it is current
        context.set_context()
        try:
            stream = torch.cuda.Stream(device)
        finally:
            context.pop_context()
    return stream, context

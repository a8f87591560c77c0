"""Serving: requests join and leave one decode batch, admitted by what fits the memory budgets.

    server = Server(model, mode="hisparse", cache_slots=4096, max_context=40960, kv_budget_gib=24,
                    host_budget_gib=88, graph=True)
    run = server.serve(requests, clients=8)          # closed loop; clients=None: each request's arrival
    run.requests[0].tokens, run.summary()            # per request: tokens, TTFT, TPOT; per run: tokens/s

    server.open()                                    # or step by step (an HTTP front end does this)
    server.submit(Request(prompt, 64, arrival=math.nan))   # nan: arrives now
    while server.busy:
        finished = server.step()                     # one prefill chunk and one decode step
    run = server.close()

Lanes. The decode batch has a fixed number of rows, its lanes, sized once from the GPU budget: a
lane holds one request at a time, up to `max_context` tokens (a server's limit per request). In
`resident` mode a lane is that many tokens of KV on the GPU; in `hisparse` / `noio` it is the B slots
of each of its streams with their cache state and the family's always-resident parts (DSA's indexer
keys, Quest's page bounds, NSA's compressed blocks and window), while the request's rows go to a
host region of exactly its own length (prompt + max new tokens). An empty lane attends nothing, in
every mode (`UnitResolver.lanes`), so every decode step runs one shape, captured once in one CUDA
graph (`graph=True`): the batch changes by writing the static buffers between replays (tokens,
lengths, the lane mask, the lanes' stream ids), never by a new capture. One padded graph rather
than a graph per batch bucket: on the H200 every graph PyTorch captures from a process's 4th on
slows every graph's replay (results/notes/graphs.md), and a closed loop of C clients never runs
more than C requests, so the sweep sizes the lanes to min(C, what fits) and pads only while the
batch fills and drains.

Memory. GPU bytes in use = lanes x lane bytes + the cache's unit -> slot map (4 bytes per host row)
+ the prefill workspace. Every family prefills into the request's lane (its runtime's
`lane_prefill`): what the lane keeps on the GPU is written there directly, and in hierarchical modes
each chunk's units reach the host pool as the chunk finishes, so the workspace is only what the
prefill's own attention needs of the prompt beyond the lane (`lane_workspace_bytes` at
`max_context`: DSA's latents, Quest's Quest-layer keys and values, NSA's whole state). A runtime
without `lane_prefill` prefills into the model's own state and joins by a copy (the workspace then
counts that state and the copy). Activations (the prefill's score blocks, the MoE) are outside the
budget. The host budget sizes the host pool; a request is admitted when a lane
is free and its streams' regions fit the pool (first-fit, as it will allocate them). A request that
could never fit (longer than max_context, more host rows than the pool holds) is refused when it is
submitted.

Each iteration: admit the head of the queue (first come, first served) when nothing is being
prefilled; run one chunk of at most `prefill_chunk` prompt tokens of the request being prefilled
(into its lane and the workspace; when the prompt is done, its first token is out and it decodes);
then one decode step of every lane, reading each new token on the host (TTFT and TPOT are host times
after that read); requests that reached their max new tokens leave, their streams and host regions
freed. So a running request waits at most one prefill chunk between two of its tokens: the chunk
size trades TTFT (a whole prompt in one chunk) against TPOT.

With `prefill_overlap` (DSA) the prefill does not stall the lanes: each iteration joins a request
whose prompt finished in an earlier one (the main stream waits on the event its last piece recorded,
then its first token is read), admits, launches the decode step of the running lanes (a graphed step
on a higher-priority stream the main one waits on), then `prefill_layers` layers of the current
chunk (`CausalLM.prefill_pieces`) on a side stream that waited only on what the main stream did
before the step, then reads the step's tokens. One piece is in flight at a time: an iteration whose
previous piece is still running on the side stream launches none (a non-blocking event query), so
the pieces keep pace with the GPU instead of piling up ahead of the decode steps, and a finished
prompt joins once its last piece is done (reading its first token earlier would stall the host); a
graphed step's higher-priority stream lets the SMs take its blocks before the piece's. A chunk's
last piece stages it to the host pool there too. A piece never reads from the GPU (DSA's top-k puts its tied
picks in place on the GPU, `place_ties`, instead of reading back which rows tie), so launching it
never waits on the side stream. An empty lane's decode write lands where no request
reads (DSA's last position of the lane, hybrid's trash row of the cache), so the step and the
prefill into that lane never touch the same bytes. Without a GPU the piece runs inline after the
step, every iteration. The schedule records every piece (`Iteration.layers`) and join, whenever the
GPU let them run, so a replay runs them in the same iterations.

A run records its schedule (what each iteration admitted, prefilled and decoded); `serve(replay=...)`
runs the same schedule in another mode, with the same lanes, so every request meets the same batch
at every step: then tokens and logits are bitwise those of the recorded run (DESIGN section 6).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hisparse.engine import check_prompts, family_runtime
from hisparse.host_pool import as_int
from hisparse.models.base import DecodeState
from hisparse.runtime import (
    KV_MODES,
    cache_bytes,
    count_graph_capture,
    nbytes,
    prefetch_width,
)

# hybrid (every family): a request resident while its rows fit beside the others in runs of the cache's
# streams, hierarchical otherwise; a resident one is demoted when a hierarchical one needs the room
SERVING_MODES = (*KV_MODES, "hybrid")

GIB = 2 ** 30
_NOT_LANE_FIELDS = {"cache", "anchor_layer", "anchor_streams", "prefetched", "newest", "host_streams", "lanes",
                    "weight_k", "weight_v"}


@dataclass(eq=False)          # requests are compared as objects (queues remove this one, not an equal one)
class Request:
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
    hits: int = 0
    misses: int = 0
    lane: int | None = None
    cancelled: bool = False
    selections: torch.Tensor | None = None   # int32 [steps, layers, ..., k]: replayed instead of the indexer's
    on_token: object | None = None      # called as on_token(request, token) for each new token (streaming)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens

    @property
    def length(self) -> int:
        """Tokens the request's KV holds before its next decode step (prompt and every token but the last)."""
        return len(self.prompt) + len(self.tokens) - 1

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time between its tokens (None for a single token)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def queued(self) -> float:
        return self.prefill_start - self.arrival


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

    def summary(self) -> dict[str, float]:
        """Output tokens/s, TTFT / TPOT / latency / queueing percentiles (ms), running batch mean and max.
        itl: every gap between two tokens of a request, over all requests (TPOT is a request's mean gap;
        the stall of one prefill chunk shows in the ITL tail)."""
        reqs = self.requests
        out = {"requests": len(reqs), "output_tokens": sum(len(r.tokens) for r in reqs)}
        span = max((r.token_times[-1] for r in reqs), default=0.0) - min((r.arrival for r in reqs), default=0.0)
        out["tokens_per_s"] = out["output_tokens"] / span if span > 0 else math.nan
        series = {"ttft": [r.ttft for r in reqs], "tpot": [r.tpot for r in reqs if r.tpot is not None],
                  "itl": [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])],
                  "latency": [r.latency for r in reqs], "queue": [r.queued for r in reqs]}
        for name, values in series.items():
            for q in (50, 90, 99):
                out[f"{name}_ms_p{q}"] = percentile(values, q) * 1e3
        out["running_batch_mean"] = sum(self.running_batch) / max(1, len(self.running_batch))
        out["running_batch_max"] = max(self.running_batch, default=0)
        if self.hybrid is not None:
            out.update(self.hybrid)
        return out


PREFILL_LAYERS = 4          # layers of a prefill piece with prefill_overlap, by default


@dataclass
class _Prefill:
    request: Request
    state: DecodeState                # what the model's prefill runs on (the workspace)
    in_place: object | None = None    # the family's prefill into the lane (its runtime's lane_prefill)
    done: int = 0                     # prompt tokens prefilled (whole chunks)
    last_logits: torch.Tensor | None = None
    pieces: object | None = None      # the chunk under way: its prefill_pieces generator (one layer a next())
    chunk: int = 0                    # its tokens
    layer: int = 0                    # its layers done
    held: int = 0                     # workspace bytes held
    complete: bool = False            # every chunk done: the request joins at the next chance
    finished: object | None = None    # overlap on a GPU: the event its last piece recorded on the side stream
    piece_done: object | None = None  # overlap on a GPU: the event its latest piece recorded there


class Server:
    """A continuous-batching server over one model (see the module docstring).

    mode: resident, hisparse, noio or hybrid (sized as hisparse, see `_admit_hybrid`). cache_slots: B
    (hierarchical and hybrid modes). max_context: the most
    tokens a request may hold (prompt + max new tokens). kv_budget_gib: GPU memory for KV (lanes,
    cache, prefill workspace); host_budget_gib: the host pool (hierarchical modes; default: every lane
    at max_context). max_batch: the most lanes, whatever fits. lanes: exactly this many (a replay's;
    the budgets are then not applied). prefill_chunk: prompt tokens per iteration. graph: decode steps
    in one CUDA graph. prefill: "model" (the family's kernels) or "reference" (eager). keep_logits:
    every token's logits on each request. selections: int32 [steps, layers, ..., k], a trace each
    request replays from its first decode step instead of the indexer's selections, unless it brings
    its own (`Request.selections`, the same shape but for steps: its own draw of a synthetic workload,
    for realistic locality: a random model's own selections have none).
    token_budget (Quest), decode_backend (DSA), kv_dtype (DSA's "fp8" rows), prefetch, prefetch_programs:
    as `Engine`'s. prefill_overlap (DSA): each iteration launches the decode step first, then, unless
    the previous piece still runs, `prefill_layers` layers of the current prefill chunk on a side CUDA
    stream (inline after the step without a GPU), so the decode steps go on while a prompt is
    prefilled (see the module docstring). prefill_sms (with prefill_overlap, on a GPU): that side
    stream belongs to a CUDA green context of this many SMs (the driver rounds up to its granularity,
    8 on Hopper), so the pieces never hold the SMs the decode steps need; None: they share every SM."""

    def __init__(self, model, mode: str = "resident", cache_slots: int | None = None, max_context: int = 4096,
                 kv_budget_gib: float | None = None, host_budget_gib: float | None = None, max_batch: int = 256,
                 lanes: int | None = None, prefill_chunk: int = 8192, graph: bool = False, prefill: str = "model",
                 keep_logits: bool = False, token_budget: int | None = None, decode_backend: str = "auto",
                 prefetch: bool = False, prefetch_programs: int | None = None,
                 selections: torch.Tensor | None = None, kv_dtype: str = "bf16", prefill_overlap: bool = False,
                 prefill_layers: int = PREFILL_LAYERS, prefill_sms: int | None = None):
        if mode not in SERVING_MODES:
            raise ValueError(f"mode must be one of {SERVING_MODES}, got {mode!r}")
        if prefill not in ("model", "reference"):
            raise ValueError(f"prefill must be 'model' or 'reference', got {prefill!r}")
        if prefetch and mode != "hisparse":
            raise ValueError(f"prefetch applies to mode 'hisparse' (it overlaps copies), not {mode!r}")
        self.max_context = as_int(max_context, "max_context must be an int >= 2 (tokens a request may hold)", 2)
        self.prefill_chunk = as_int(prefill_chunk, "prefill_chunk must be an int >= 1 (prompt tokens an iteration)", 1)
        max_batch = as_int(max_batch, "max_batch must be an int >= 1 (lanes at most)", 1)
        weight = model.model.embed_tokens.weight
        if graph and not weight.is_cuda:
            raise ValueError("graph=True needs the model on a CUDA GPU")
        self.model, self.mode, self.graph, self.keep_logits = model, mode, graph, keep_logits
        self.fast = prefill == "model"
        self.device = weight.device
        self.runtime = family_runtime(model, token_budget, decode_backend, kv_dtype)
        if not isinstance(prefill_overlap, bool):
            raise ValueError(f"prefill_overlap must be True or False, got {prefill_overlap!r}")
        self.prefill_layers = as_int(prefill_layers, "prefill_layers must be an int >= 1 (layers of a prefill "
                                     "piece an iteration, with prefill_overlap)", 1)
        if prefill_overlap and (self.runtime.family != "DSA" or not hasattr(self.runtime, "lane_prefill")):
            raise ValueError(f"prefill_overlap=True is built for DSA models, whose empty lanes' decode writes "
                             f"land where no request reads; {self.runtime.family}'s still write into the lane a "
                             f"prefill fills (Quest's dense lanes at token 0, NSA's window): use prefill_overlap=False")
        if prefill_sms is not None:
            prefill_sms = as_int(prefill_sms, "prefill_sms must be an int >= 1 (SMs the prefill pieces may use, "
                                 "with prefill_overlap)", 1)
            if not prefill_overlap:
                raise ValueError(f"prefill_sms={prefill_sms} confines the prefill pieces of prefill_overlap=True "
                                 f"to that many SMs; without overlap a prefill runs alone: leave it None")
        self.prefill_overlap, self.prefill_sms = prefill_overlap, prefill_sms
        # the side stream the prefill pieces run on, beside the decode steps on the main one (and the
        # green context it belongs to with prefill_sms, kept as long as the stream)
        self._side, self._green = (side_stream(self.device, prefill_sms) if prefill_overlap
                                   and self.device.type == "cuda" else (None, None))
        # and the higher-priority stream graphed steps replay on beside them: a graph's kernels take
        # the priority of the stream it is launched into, so the SMs take the step's blocks first
        self._urgent = torch.cuda.Stream(self.device, priority=-1) if self._side is not None and graph else None
        self.hybrid = mode == "hybrid"
        if self.hybrid and not hasattr(self.runtime, "take_runs"):
            raise ValueError(f"mode 'hybrid' needs a runtime that keeps requests in runs of the cache's streams "
                             f"(take_runs, run_streams, runs_per_request, demote); {self.runtime.family}'s has "
                             f"none: use mode 'hisparse' or 'resident'")
        self.kv_mode = "hisparse" if self.hybrid else mode     # what the runtime's states and attention are
        # hybrid: where a hierarchical prefill's workspace sits: in runs of the cache's streams (DSA's:
        # its resident prefill writes straight into its runs, so only a hierarchical one needs it), or
        # beside the cache in every mode (Quest's and NSA's: their prefill attends over the model's own state)
        self._workspace_in_runs = self.runtime.workspace_in_runs
        self._lane_runs: dict[int, list[int]] = {}     # hybrid: lane -> its runs (runs_per_request) while resident
        self._lanes_changed, self._no_plan = 0, None   # hybrid: a count of lane changes; the last unplaceable
        # the empty state a prefill writes into: DSA's runtime makes its kv_dtype's rows
        self._new_state = getattr(self.runtime, "new_state", model.new_state)
        self.decode_backend, self.prefetch, self.kv_dtype = decode_backend, prefetch, kv_dtype
        self.prefetch_programs = prefetch_width(self.runtime.family, prefetch_programs)
        k = self.runtime.selection_size
        if mode != "resident":
            if cache_slots is None:
                raise ValueError(f"mode {mode!r} needs cache_slots (B >= k = {k})")
            cache_slots = as_int(cache_slots, f"cache_slots must be an int (B >= k = {k})", k)
        self.cache_slots = cache_slots
        self.streams_per_request = len(self.runtime.stream_regions(self.max_context))
        row_bytes = self._row_bytes()
        if host_budget_gib is not None and mode == "resident":
            host_budget_gib = None                   # resident keeps nothing on the host
        self.in_place = hasattr(self.runtime, "lane_prefill")     # the family prefills into the lane itself
        self.lane_bytes, state_bytes = self._lane_bytes()
        if self.in_place:
            self.workspace_bytes = self.runtime.lane_workspace_bytes(mode, self.max_context)
        else:        # the model's own prefill state, then the request's decode state beside it as it joins
            self.workspace_bytes = self._workspace_bytes() + state_bytes
        if lanes is None:
            if kv_budget_gib is None:
                raise ValueError("a server needs kv_budget_gib (GPU memory for KV, GiB), or lanes")
            if not isinstance(kv_budget_gib, (int, float)) or isinstance(kv_budget_gib, bool) or kv_budget_gib <= 0:
                raise ValueError(f"kv_budget_gib must be a positive number of GiB, got {kv_budget_gib!r}")
            self.kv_budget = int(kv_budget_gib * GIB)
            host_rows = self._host_rows(host_budget_gib, row_bytes, max_batch)
            fits = (self.kv_budget - self.workspace_bytes - 4 * host_rows) // self.lane_bytes
            if fits < 1:
                raise ValueError(f"kv_budget_gib={kv_budget_gib} holds no lane: one lane takes "
                                 f"{self.lane_bytes / GIB:.3f} GiB at max_context={self.max_context}, beside the "
                                 f"prefill workspace's {self.workspace_bytes / GIB:.3f} GiB and the cache's slot map "
                                 f"{4 * host_rows / GIB:.3f} GiB")
            self.lanes = int(min(fits, max_batch))
            if host_budget_gib is None and mode != "resident":
                host_rows = self._host_rows(None, row_bytes, self.lanes)
        else:
            self.lanes = as_int(lanes, "lanes must be an int >= 1", 1)
            self.kv_budget = None
            host_rows = self._host_rows(host_budget_gib, row_bytes, self.lanes)
        self.cache = None
        streams = self.lanes * self.streams_per_request
        # DSA hybrid: a row of the cache past its streams' for the decode write of the lanes not resident
        # (`HierMlaKV.write`), so no write lands in a run a prefill may be filling beside the step
        trash = self.hybrid and self.runtime.family == "DSA"
        if self.hybrid:
            # the budget the lanes leave goes to more streams: a resident request's rows sit in runs of
            # them, and so does a hierarchical prefill's workspace where the runtime puts it there (then
            # the workspace's budget is spare too; given lanes=, that alone: the memory hisparse holds)
            stream_bytes = self._stream_bytes()
            kept = 0 if self._workspace_in_runs else self.workspace_bytes
            spare = self.workspace_bytes - kept if self.kv_budget is None else \
                self.kv_budget - 4 * host_rows - self.lanes * self.lane_bytes - kept
            streams += max(0, (spare - trash * row_bytes) // stream_bytes)
        if mode != "resident":
            from hisparse.cache import HierarchicalKVCache
            self.cache = HierarchicalKVCache(max_streams=streams, cache_slots=cache_slots,
                                             host_rows=host_rows, row_elems=row_bytes // self._row_dtype().itemsize,
                                             dtype=self._row_dtype(), device=self.device, trash_row=trash)
        self.layers = self._empty_layers(self.lanes, self.cache)
        self.state = DecodeState(self.layers, self.max_context,
                                 torch.zeros(self.lanes, dtype=torch.int64, device=self.device))
        if self.hybrid:                             # every lane hierarchical until one is admitted resident
            for kv in self._hier_layers():
                kv.resident = torch.zeros(self.lanes, dtype=torch.bool, device=self.device)
        self.attention = self.runtime.attention(self.kv_mode, self.layers, check_values=not graph, prefetch=prefetch,
                                                prefetch_programs=self.prefetch_programs)
        self.attention.lanes = torch.zeros(self.lanes, dtype=torch.bool, device=self.device)
        for kv in self.layers:
            if hasattr(kv, "lanes"):          # DSA: an empty lane's decode write keeps what is there
                kv.lanes = self.attention.lanes
        self.tokens = torch.zeros(self.lanes, dtype=torch.int64, device=self.device)
        self.selections = None
        if selections is not None:
            layers = model.config.num_hidden_layers
            if selections.dim() < 3 or selections.shape[1] != layers or selections.dtype != torch.int32:
                raise ValueError(f"selections must be int32 [steps, {layers} layers, ..., k], got "
                                 f"{selections.dtype} {tuple(selections.shape)}")
            self.selections = selections.to(self.device)
            self._host_selections = selections.cpu()       # beside requests' own traces (on the host)
            self.attention.replay_sel = torch.full((layers, self.lanes, *selections.shape[2:]), -1,
                                                   dtype=torch.int32, device=self.device)
            # requests' own traces stay on the host: each step's rows are stacked here (pinned on a GPU,
            # so the copy is a DMA that does not wait on pageable staging), then copied asynchronously
            self._replay_host = torch.empty(self.attention.replay_sel.shape, dtype=torch.int32,
                                            pin_memory=self.device.type == "cuda")
            self._replay_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self.lane_request: list[Request | None] = [None] * self.lanes
        self._reserved: int | None = None        # the lane of the request being prefilled
        # the decode step (graphed after its first eager run); hybrid has a second for the steps whose
        # lanes are all resident (no resolve: resident's cost), keyed by that
        self._steps: dict[bool, Callable[[], torch.Tensor]] = {}
        self._resident_step = False
        self.resident_steps = 0                 # hybrid: decode steps of the resident kind (reset by open)
        self._warmed = False

    # -- memory ------------------------------------------------------------------------------

    def _row_bytes(self) -> int:
        """Bytes of one host-pool row (a unit of one stream) of this family."""
        cfg, elem = self.model.config, self.model.model.embed_tokens.weight.element_size()
        if self.runtime.family == "DSA":
            return self.runtime.row_bytes           # 576 values in the model's dtype, or 656 bytes (fp8)
        return 2 * self.runtime.unit_size * cfg.head_dim * elem

    def _row_dtype(self) -> torch.dtype:
        """The dtype of host-pool rows: the DSA runtime's (uint8 for fp8 rows), else the weights'."""
        return getattr(self.runtime, "row_dtype", self.model.model.embed_tokens.weight.dtype)

    def _host_rows(self, host_budget_gib: float | None, row_bytes: int, lanes: int) -> int:
        """Rows of the host pool: the host budget's, or every lane at max_context."""
        if self.mode == "resident":
            return 0
        if host_budget_gib is None:
            return lanes * sum(self.runtime.stream_regions(self.max_context))
        if not isinstance(host_budget_gib, (int, float)) or isinstance(host_budget_gib, bool) or host_budget_gib <= 0:
            raise ValueError(f"host_budget_gib must be a positive number of GiB, got {host_budget_gib!r}")
        return int(host_budget_gib * GIB // row_bytes)

    def _lane_bytes(self) -> tuple[int, int]:
        """(GPU bytes of one lane, of which its decode state outside the cache): measured on a
        one-lane state, built and dropped (slots and cache state per stream; not the slot map)."""
        cache = None
        if self.mode != "resident":
            from hisparse.cache import HierarchicalKVCache
            cache = HierarchicalKVCache(max_streams=self.streams_per_request, cache_slots=self.cache_slots,
                                        host_rows=self.streams_per_request, row_elems=self._row_bytes()
                                        // self._row_dtype().itemsize,
                                        dtype=self._row_dtype(), device=self.device, pin=False)
        layers = self._empty_layers(1, cache)
        state = self.runtime.kv_bytes(layers, None)
        if cache is None:
            return int(state), int(state)
        outside = sum(nbytes(t) for kv in layers for t in _lane_tensors(kv, 1))
        return int(state + cache_bytes(cache) - nbytes(cache.state.unit_slot)), int(outside)

    def _stream_bytes(self) -> int:
        """GPU bytes of one more stream of the cache: its B + 1 slots and its cache state."""
        from hisparse.cache import HierarchicalKVCache
        one = HierarchicalKVCache(max_streams=1, cache_slots=self.cache_slots, host_rows=1,
                                  row_elems=self._row_bytes() // self._row_dtype().itemsize, dtype=self._row_dtype(),
                                  device=self.device, pin=False)
        return int(cache_bytes(one) - nbytes(one.state.unit_slot))

    def _hier_layers(self) -> list:
        """The layer states whose KV is in the cache (Quest's dense layers keep the model's PagedKV)."""
        return [kv for kv in self.layers if getattr(kv, "streams", None) is not None]

    def _workspace_bytes(self) -> int:
        """Bytes of the KV the model's prefill holds for a max_context prompt (its own state)."""
        dtype = self.model.model.embed_tokens.weight.dtype
        kvs = [layer.self_attn.new_kv(1, self.max_context, "meta", dtype) for layer in self.model.model.layers]
        return sum(nbytes(t) for kv in kvs for t in vars(kv).values() if isinstance(t, torch.Tensor))

    def gpu_bytes(self, extra: int = 0) -> int:
        """Budgeted GPU bytes in use now: the lanes' state, the cache, the workspace in use (`extra`)."""
        return int(self.runtime.kv_bytes(self.layers, self.cache)) + extra

    # -- lanes -------------------------------------------------------------------------------

    def _empty_layers(self, lanes: int, cache) -> list:
        """Every layer's state for `lanes` empty lanes: zeros, and -1 streams (closed at once)."""
        one = [torch.zeros(1, dtype=torch.int64)] * lanes
        random = self.runtime.random_rows(one, self.device)

        def zero_rows(b: int, layer: int):
            return tuple(None if t is None else torch.zeros_like(t) for t in random(b, layer))

        lengths = torch.ones(lanes, dtype=torch.int64, device=self.device)
        layers = self.runtime.gather_layers(self.kv_mode, cache, zero_rows, lengths, self.max_context, self.prefetch,
                                            host_tokens=1)
        for lane in range(lanes):
            for kv in layers:
                if getattr(kv, "streams", None) is not None:
                    for s in _as_list(kv.host_streams[lane]):
                        cache.close_stream(s)
            _clear_lane(layers, lane, lanes)
        return layers

    def _join(self, request: Request, prefilled: DecodeState) -> int:
        """Move a prefilled request into its lane: returns the GPU bytes the move held beside the lanes."""
        lane = request.lane
        length = len(request.prompt)
        rows = self.runtime.prefilled_rows([prefilled])
        single = self.runtime.gather_layers(self.kv_mode, self.cache, rows, torch.tensor([length], device=self.device),
                                            self.max_context, self.prefetch,
                                            host_tokens=length + request.max_new_tokens)
        held = sum(nbytes(t) for kv in single for t in _lane_tensors(kv, 1))
        for kv, one in zip(self.layers, single):
            _copy_lane(kv, one, lane, self.lanes)
        return held

    def _leave(self, request: Request) -> None:
        """Free a finished request's lane: its counters read, its streams and host regions released."""
        lane = request.lane
        if self.cache is not None:
            own = [kv for kv in self.layers if getattr(kv, "anchor_layer", None) is None
                   and getattr(kv, "streams", None) is not None]
            ids = [s for kv in own for s in _as_list(kv.host_streams[lane])]
            if ids:
                hits, misses = self.cache.stats[torch.tensor(ids, device=self.device)].sum(0).tolist()
                request.hits, request.misses = int(hits), int(misses)
            for kv in self.layers:
                if getattr(kv, "streams", None) is not None:
                    for s in _as_list(kv.host_streams[lane]):
                        self.cache.close_stream(s)
        for first in self._lane_runs.pop(lane, []):          # hybrid: a resident lane's runs
            self.cache.release_run(first)
        self._lanes_changed += 1
        _clear_lane(self.layers, lane, self.lanes)
        self.lane_request[lane] = None
        request.lane = None

    # -- requests ----------------------------------------------------------------------------

    def check_request(self, request: Request) -> None:
        """ValueError if the request could never be served: bad ids, or more than the server holds."""
        prompt = check_prompts([request.prompt])[0]
        request.prompt = prompt.cpu()
        request.max_new_tokens = as_int(request.max_new_tokens, "max_new_tokens must be an int >= 1", 1)
        vocab = self.model.config.vocab_size
        if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
            bad = int(prompt[(prompt < 0) | (prompt >= vocab)][0])
            raise ValueError(f"token id {bad} out of range: the vocabulary has {vocab} ids")
        need = len(prompt) + request.max_new_tokens
        if request.selections is not None:
            if self.selections is None:
                raise ValueError("a request brings selections to replay: build the server with selections= (the "
                                 "trace a request without its own replays, which sizes the replay buffer)")
            own = request.selections
            if own.dtype != torch.int32 or tuple(own.shape[1:]) != tuple(self.selections.shape[1:]):
                raise ValueError(f"request selections must be int32 [steps, {', '.join(map(str, self.selections.shape[1:]))}], "
                                 f"got {own.dtype} {tuple(own.shape)}")
            request.selections = own.cpu()    # on the host; each step stages its rows (`_fill_replay`)
        trace = request.selections if request.selections is not None else self.selections
        if trace is not None and request.max_new_tokens - 1 > trace.shape[0]:
            raise ValueError(f"max_new_tokens={request.max_new_tokens} needs {request.max_new_tokens - 1} decode steps of "
                             f"selections; the replayed trace has {trace.shape[0]}")
        if need > self.max_context:
            raise ValueError(f"a prompt of {len(prompt)} tokens plus {request.max_new_tokens} new ones needs {need} "
                             f"tokens, over the server's max_context={self.max_context}")
        if self.cache is not None:
            rows = sum(self.runtime.stream_regions(need))
            if rows > self.cache.host.capacity:
                raise ValueError(f"a request of {need} tokens needs {rows} host pool rows; the pool holds "
                                 f"{self.cache.host.capacity} (raise host_budget_gib)")
        if self.hybrid:                   # an empty server places it resident, or hierarchical with its workspace
            runs, total = self.runtime.runs_per_request(), self.cache.max_streams
            resident = self.runtime.run_streams(self.cache, self.max_context) * runs
            hierarchical = self.streams_per_request + self._workspace_streams(len(prompt)) * runs
            if min(resident, hierarchical) > total:
                raise ValueError(f"a prompt of {len(prompt)} tokens needs {hierarchical} of the cache's streams "
                                 f"in hybrid mode (its own and its prefill workspace's; resident: {resident}); "
                                 f"the cache has {total} (raise kv_budget_gib)")

    def _free_lane(self) -> int | None:
        """The lowest lane neither running a request nor reserved for the one being prefilled."""
        return next((i for i, r in enumerate(self.lane_request) if r is None and i != self._reserved), None)

    def _admissible(self, request: Request) -> bool:
        if self._free_lane() is None:
            return False
        if self.cache is None:
            return True
        if self.hybrid:
            return self._hybrid_plan(request) is not None
        return self.cache.host.fits(self.runtime.stream_regions(len(request.prompt) + request.max_new_tokens))

    # -- hybrid: resident while the rows fit, hierarchical otherwise -----------------------------

    def _workspace_streams(self, prompt: int) -> int:
        """Streams of each of the runs_per_request runs a hierarchical prefill of `prompt` tokens takes
        for its workspace (0 where the workspace sits beside the cache)."""
        return self.runtime.run_streams(self.cache, prompt) if self._workspace_in_runs else 0

    def _hybrid_plan(self, request: Request) -> tuple[str, list[int]] | None:
        """Where a request would go now: ("resident", []) when its runs are free, ("hierarchical",
        the resident lanes to demote first, in order) when, after those demotions, its workspace's runs
        (where it takes runs: one per run a resident request holds) and its own streams are free and
        the host pool holds the demoted requests' regions and then its own; None when nothing would place it. Planned on a copy of
        the cache's stream map with the cache's own rule (`lowest_runs`, lowest free stream first),
        so `_admit_hybrid` then places it exactly so. Not admissible plans are remembered until a
        lane changes (the queue's head asks every iteration)."""
        from hisparse.cache import lowest_runs
        key = (request.rid, self._lanes_changed)
        if self._no_plan == key:
            return None
        cache, count = self.cache, self.runtime.runs_per_request()
        run, work = self.runtime.run_streams(cache, self.max_context), self._workspace_streams(len(request.prompt))
        taken = cache.taken_streams()
        if lowest_runs(set(taken), cache.max_streams, run, count) is not None:
            return "resident", []
        regions = self.runtime.stream_regions(len(request.prompt) + request.max_new_tokens)
        demoted, sizes = [], []
        for lane in [None, *self._demotion_order()]:
            if lane is not None:                # its runs back and its streams opened, run by run
                for first in self._lane_runs[lane]:
                    taken.difference_update(range(first, first + run))
                    taken.add(next(i for i in range(cache.max_streams) if i not in taken))
                r = self.lane_request[lane]
                demoted.append(lane)
                sizes += self.runtime.stream_regions(len(r.prompt) + r.max_new_tokens)
            trial = set(taken)
            if (work == 0 or lowest_runs(trial, cache.max_streams, work, count) is not None) \
                    and cache.max_streams - len(trial) >= self.streams_per_request:
                if cache.host.fits(sizes + regions):
                    return "hierarchical", demoted
                break                           # more demotions would need more host rows still
        self._no_plan = key
        return None

    def _demotion_order(self) -> list[int]:
        """Resident lanes, the latest admitted first (with equal lengths, the most of its output ahead)."""
        return sorted(self._lane_runs, key=lambda lane: -self.lane_request[lane].rid)

    def _admit_hybrid(self, request: Request) -> dict[str, list[int]]:
        """Place a request about to prefill as `_hybrid_plan` says: {"runs": its resident runs}, or its
        demotions made, {"workspace_runs": its workspace's runs} (or {} where the workspace sits beside
        the cache)."""
        plan = self._hybrid_plan(request)
        if plan is None:
            raise RuntimeError(f"request {request.rid} was admitted with no room to place it (a replayed "
                               f"schedule from a server with more memory?)")
        kind, demoted = plan
        if kind == "resident":
            return {"runs": self.runtime.take_runs(self.cache, self.max_context)}
        for lane in demoted:
            r = self.lane_request[lane]
            self.runtime.demote(self.cache, self.layers, lane, r.length, len(r.prompt) + r.max_new_tokens,
                                self._lane_runs[lane])
            del self._lane_runs[lane]
            self.demotions += 1
        self._lanes_changed += 1
        if not self._workspace_in_runs:
            return {}
        return {"workspace_runs": self.runtime.take_runs(self.cache, len(request.prompt))}

    # -- the loop ----------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Compile the prefill and decode kernels (and capture the decode graph) before any request, on
        a GPU; Triton's interpreter compiles nothing, so off the GPU there is nothing to prepare."""
        if self._warmed or self.device.type != "cuda":
            return
        prompt = torch.zeros(min(self.max_context, 2 * self.runtime.unit_size + 3), dtype=torch.int64,
                             device=self.device)
        state = self._new_state(1, len(prompt))
        self.model.prefill(prompt[None], state, fast=self.fast, last_logits=True, backend=self.decode_backend)
        del state
        previous = self.model.sparse_attention
        self.model.sparse_attention = self.attention
        try:
            for resident_step in (False, True) if self.hybrid else (False,):
                for _ in range(2):          # eager (compiles), then captured and replayed with graph=True
                    self._decode_step(resident_step)
        finally:
            self.model.sparse_attention = previous
        self.state.lengths.zero_()
        self._warmed = True

    def _decode_step(self, resident_step: bool | None = None) -> torch.Tensor:
        """One decode step of every lane from the host's view of them: logits [lanes, V]. Hybrid: when
        every lane holding a request is resident (or `resident_step` says so), the step that skips the
        hierarchical write and resolve (`HierMlaKV.resident_step`, `HierQuestKV.resident_step`), else
        the mixed one."""
        if resident_step is None:
            resident_step = self.hybrid and all(r is None or lane in self._lane_runs
                                                for lane, r in enumerate(self.lane_request))
        if resident_step != self._resident_step:
            for kv in self._hier_layers():
                kv.resident_step = resident_step
            self._resident_step = resident_step
        self.resident_steps += resident_step
        lengths = [0 if r is None else r.length for r in self.lane_request]
        if self.cache is not None:
            self.runtime.advance_streams(self.cache, self.layers, lengths)
        self.state.lengths.copy_(torch.tensor(lengths, dtype=torch.int64))
        self.tokens.copy_(torch.tensor([0 if r is None else r.tokens[-1] for r in self.lane_request]))
        self.attention.lanes.copy_(torch.tensor([r is not None for r in self.lane_request]))
        if self.selections is not None:       # each lane's step of its trace (an empty lane's is masked)
            self._fill_replay()
        self.state.max_length = max(lengths)
        step = self._steps.get(resident_step)
        if step is None:
            logits = self.model.decode(self.tokens, self.state)
            self._steps[resident_step] = self._graphed_step() if self.graph else (
                lambda: self.model.decode(self.tokens, self.state))
            return logits
        return step()

    @property
    def graphs_captured(self) -> int:
        """CUDA graphs this server captured (one; hybrid two): from a process's 4th on, every graph
        replays slower on the H200 (results/notes/graphs.md)."""
        return len(self._steps) if self.graph else 0

    def _fill_replay(self) -> None:
        """replay_sel [layers, lanes, ..., k] from each lane's trace at the lane's next decode step."""
        steps = [0 if r is None else len(r.tokens) - 1 for r in self.lane_request]
        own = [r is not None and r.selections is not None for r in self.lane_request]
        if not any(own):                      # one shared trace, on the device: one gather
            index = torch.tensor(steps, device=self.device)
            self.attention.replay_sel.copy_(self.selections[index].transpose(0, 1))
            return
        rows = [(r.selections if mine else self._host_selections)[step]
                for r, mine, step in zip(self.lane_request, own, steps)]
        if self._replay_copied is not None:
            self._replay_copied.synchronize()     # the last step's copy has read the staging buffer
        torch.stack(rows, dim=1, out=self._replay_host)
        self.attention.replay_sel.copy_(self._replay_host, non_blocking=True)
        if self._replay_copied is not None:
            self._replay_copied.record()

    def _graphed_step(self):
        count_graph_capture()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.model.decode(self.tokens, self.state)

        def step() -> torch.Tensor:
            if self._urgent is None:
                graph.replay()
                return logits
            main = torch.cuda.current_stream()
            self._urgent.wait_stream(main)               # after the lane setup; the main stream waits for it
            with torch.cuda.stream(self._urgent):
                graph.replay()
            main.wait_stream(self._urgent)
            return logits

        return step

    # -- a run: open, submit, step, close (serve drives them for a list of requests) ---------------

    def open(self, replay: Schedule | None = None) -> None:
        """Start a run: kernels warmed up, the clock at 0, the server's attention in the model (until
        `close`). replay: follow that schedule (the same lanes) instead of choosing."""
        if replay is not None and replay.lanes != self.lanes:
            raise ValueError(f"the schedule ran {replay.lanes} lanes, this server has {self.lanes}: build it with "
                             f"lanes={replay.lanes}")
        if any(r is not None for r in self.lane_request):
            raise RuntimeError("the server still holds requests of an earlier run")
        self.warm_up()
        self._previous_attention = self.model.sparse_attention
        self.model.sparse_attention = self.attention
        self.requests: list[Request] = []           # every request submitted in this run, by rid
        self.waiting: list[Request] = []            # arrived, not admitted, first come first served
        self._pending: list[Request] = []           # submitted with an arrival still to come
        self._prefilling: _Prefill | None = None
        self._planned = iter(replay.iterations) if replay is not None else None
        self.schedule = Schedule(self.lanes)
        self.running_batch: list[int] = []
        self.peak_gpu, self.peak_host = self.gpu_bytes(), 0
        self.resident_admissions = self.demotions = self.resident_steps = 0      # hybrid's
        self._start = time.perf_counter()

    def now(self) -> float:
        """Seconds since `open`."""
        return time.perf_counter() - self._start

    def submit(self, request: Request) -> Request:
        """Queue a request (ValueError, and nothing queued, if it could never be served). Its
        arrival: as set, relative to `open`; math.nan (the default for a new Request is 0.0) means now."""
        self.check_request(request)
        request.rid, request.tokens, request.token_times, request.logits = len(self.requests), [], [], []
        request.prefill_start, request.lane, request.cancelled = None, None, False
        if math.isnan(request.arrival):
            request.arrival = self.now()
        self.requests.append(request)
        self._pending.append(request)
        self._pending.sort(key=lambda r: (r.arrival, r.rid))
        return request

    @property
    def running(self) -> list[Request]:
        return [r for r in self.lane_request if r is not None]

    @property
    def busy(self) -> bool:
        """Whether any request is queued, being prefilled or decoding."""
        return bool(self.waiting or self._pending or self._prefilling or self.running)

    def cancel(self, request: Request) -> None:
        """Stop a request wherever it is (a client that went away): its lane, streams and host regions
        are freed at once. Not while replaying a schedule."""
        if self._planned is not None:
            raise RuntimeError("a replayed schedule cannot lose a request")
        request.cancelled = True
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self._pending:
            self._pending.remove(request)
        elif self._prefilling is not None and self._prefilling.request is request:
            if self._side is not None:
                self._side.synchronize()         # its pieces in flight are done before its rows go back
            if self._prefilling.in_place is not None:
                self._prefilling.in_place.cancel()
            self._prefilling, self._reserved, request.lane = None, None, None
            self._lanes_changed += 1
        elif request.lane is not None and self.lane_request[request.lane] is request:
            self._leave(request)

    def step(self) -> list[Request]:
        """One iteration (see the module docstring); returns the requests that finished in it. On
        their way each request's `on_token(request, token)`, if set, is called for every new token."""
        t = self.now()
        while self._pending and self._pending[0].arrival <= t:     # arrivals so far join the queue
            self.waiting.append(self._pending.pop(0))
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
        if job is not None and job.complete and (plan.joined if plan is not None else self._may_join(job)):
            self._join_prefill(job, step, finished)
        if plan is not None:
            if plan.admitted >= 0:
                request = self.requests[plan.admitted]
                for queue in (self.waiting, self._pending):      # admitted as recorded, wherever it waits
                    if request in queue:
                        queue.remove(request)
                self._prefilling = self._start_prefill(request, t)
                step.admitted = request.rid
        elif self._prefilling is None and self.waiting and self._admissible(self.waiting[0]):
            request = self.waiting.pop(0)
            self._prefilling = self._start_prefill(request, t)
            step.admitted = request.rid
        job = self._prefilling
        piece = self._next_piece(job, plan)
        # without overlap (or where the schedule joins the request after this very piece) the piece
        # runs before the decode step, as one chunk of every layer does; an overlapping server runs
        # every piece on its side stream even so (the join then waits on it), so no tensor of a chunk
        # is made on one stream and used on the other
        overlapped = piece is not None and self.prefill_overlap and not (plan is not None and plan.joined
                                                                         and not step.joined)
        if piece is not None:
            step.prefilled, step.layers = piece[0], piece[1:]
        if piece is not None and not overlapped:
            self._run_piece(job, *piece, after=self._main_event() if self.prefill_overlap else None)
            if job.complete and (plan.joined if plan is not None else True):
                self._join_prefill(job, step, finished)
            elif plan is not None and plan.joined and not step.joined:
                raise ValueError(f"the replayed schedule joins request {job.request.rid} before its prompt is done")
        elif plan is not None and plan.joined and not step.joined:
            raise ValueError("the replayed schedule joins a request that is not being prefilled")
        active = self.running
        decoding = plan.decoded if plan is not None else bool(active)
        # the side stream sees what the main one did before the step (the lane's setup), not the step
        before = self._main_event() if overlapped else None
        if decoding:
            logits = self._decode_step()
        if overlapped:
            self._run_piece(job, *piece, after=before)
        if decoding:
            tokens = logits.argmax(-1).cpu()              # the step's one host sync
            t = self.now()
            self.running_batch.append(len(active))
            step.decoded = True
            for lane, r in enumerate(self.lane_request):
                if r is None:
                    continue
                self._emit(r, int(tokens[lane]), t, logits[lane])
                if r.done:
                    self._leave(r)
                    finished.append(r)
        if self.cache is not None:
            self.peak_host = max(self.peak_host, self.cache.host.capacity - self.cache.host.free_rows)
        self.peak_gpu = max(self.peak_gpu, self.gpu_bytes())
        if step.admitted >= 0 or step.prefilled or step.decoded or step.joined:
            self.schedule.iterations.append(step)
        return finished

    def next_arrival(self) -> float | None:
        """When the next submitted request arrives (seconds since `open`), None if none is due."""
        return self._pending[0].arrival if self._pending else None

    def close(self) -> ServingRun:
        """End the run (every request finished or cancelled): the model's own attention back."""
        if self._prefilling is not None or self.running:
            raise RuntimeError("close() with requests still running: cancel them first")
        self.model.sparse_attention = self._previous_attention
        return ServingRun([r for r in self.requests if not r.cancelled], self.schedule, self.now(),
                          self.running_batch, self.peak_gpu, self.peak_host,
                          {"resident_admissions": self.resident_admissions, "demotions": self.demotions,
                           "resident_steps": self.resident_steps} if self.hybrid else None)

    def _emit(self, request: Request, token: int, t: float, logits: torch.Tensor) -> None:
        request.tokens.append(token)
        request.token_times.append(t)
        if self.keep_logits:
            request.logits.append(logits.float().cpu())
        if request.on_token is not None:
            request.on_token(request, token)

    def serve(self, requests: list[Request], clients: int | None = None, replay: Schedule | None = None,
              progress: bool = False) -> ServingRun:
        """Serve `requests` to the end; the run lists them in their order (rids: order of submission).
        clients: a closed loop of that many clients, request i sent by client i % clients as soon as
        its previous one finished; None: each request arrives at its `arrival`. replay: run that
        schedule (the same lanes) instead of choosing. progress: a line on stderr every 10 s."""
        for r in requests:                   # every request checked before anything runs
            self.check_request(r)
        if clients is not None:
            clients = as_int(clients, "clients must be an int >= 1", 1)
            for i, r in enumerate(requests):
                r.client = i % clients
        self.open(replay)
        try:
            first = requests if clients is None else requests[:clients]
            for r in first:
                self.submit(r)
            place = {id(r): i for i, r in enumerate(requests)}
            done, last_progress = 0, time.perf_counter()
            while done < len(requests):
                for r in self.step():
                    done += 1
                    nxt = place[id(r)] + clients if clients is not None else len(requests)
                    if nxt < len(requests):                          # the client's next request, now
                        requests[nxt].arrival = r.token_times[-1]
                        self.submit(requests[nxt])
                if not (self._prefilling or self.running or self.waiting) and self._pending:
                    time.sleep(max(0.0, min(self._pending[0].arrival - self.now(), 0.05)))   # idle until then
                if progress and time.perf_counter() - last_progress > 10:
                    last_progress = time.perf_counter()
                    print(f"  serving: {done}/{len(requests)} requests done, {len(self.running)} running, "
                          f"{len(self.waiting)} waiting, {self.now():.0f} s", file=sys.stderr, flush=True)
            run = self.close()
            run.requests = list(requests)           # in the caller's order
            return run
        except BaseException:
            for r in list(self.requests):
                if r.lane is not None or r in self.waiting or r in self._pending:
                    self._planned = None
                    self.cancel(r)
            self.model.sparse_attention = self._previous_attention
            raise

    def _start_prefill(self, request: Request, t: float) -> _Prefill:
        request.prefill_start = t
        request.lane = self._reserved = self._free_lane()   # reserved while it prefills (still masked)
        if request.lane is None:
            raise ValueError(f"the replayed schedule admits request {request.rid} with every lane taken")
        try:
            if self.in_place:
                need = len(request.prompt) + request.max_new_tokens
                runs = self._admit_hybrid(request) if self.hybrid else {}
                try:
                    job = self.runtime.lane_prefill(self.kv_mode, self.cache, self.layers, request.lane,
                                                    len(request.prompt), need, **runs)
                except BaseException:
                    for first in [first for held in runs.values() for first in held]:
                        self.cache.release_run(first)
                    raise
                return _Prefill(request, job.state, job)
            return _Prefill(request, self._new_state(1, len(request.prompt)))
        except BaseException:             # (out of memory, say) the lane goes back
            self._reserved = request.lane = None
            raise

    def _next_piece(self, job: _Prefill | None, plan: Iteration | None) -> tuple[int, int, int] | None:
        """(chunk tokens, first layer, end layer) of this iteration's prefill piece, or None: the
        schedule's, or the next `prefill_layers` layers (every layer without overlap) of the chunk
        under way, a new chunk of at most `prefill_chunk` tokens when none is; None while the previous
        piece still runs on the side stream (overlap on a GPU: one piece in flight). Pieces are fixed
        numbers of layers; when they run follows the GPU, and the schedule records it."""
        count = self.model.config.num_hidden_layers
        if plan is not None:
            if not plan.prefilled:
                return None
            lo, hi = plan.layers if plan.layers is not None else (0, count)
            if job is None or job.complete or lo != job.layer or (lo > 0 and plan.prefilled != job.chunk) \
                    or not lo < hi <= count:
                raise ValueError(f"the replayed schedule's prefill piece ({plan.prefilled} tokens, layers {lo}.."
                                 f"{hi - 1}) does not follow the prefill under way")
            return plan.prefilled, lo, hi
        if job is None or job.complete:
            return None
        if job.piece_done is not None and not job.piece_done.query():       # the previous piece still runs
            if self.running:
                return None
            job.piece_done.synchronize()             # nothing decodes beside it: wait rather than spin
        chunk = job.chunk if job.layer else min(self.prefill_chunk, len(job.request.prompt) - job.done)
        per = self.prefill_layers if self.prefill_overlap else count
        return chunk, job.layer, min(job.layer + per, count)

    def _main_event(self):
        """An event recorded on the current (main) stream now (None without a GPU)."""
        if self._side is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _run_piece(self, job: _Prefill, chunk: int, lo: int, hi: int, after=None) -> None:
        """Layers lo .. hi - 1 of the chunk of `chunk` prompt tokens from job.done (lo = 0 starts it):
        on the side stream once it waited on `after` (overlap on a GPU), else on the current one. A
        chunk's last piece ends with the head and the chunk's staging (`chunk_done`); the prompt's
        last one records `job.finished` there. What the side stream allocates stays on it (the
        prompt's part, the activations); the workspace, made on the main stream, is freed at the join,
        after the main stream waited on `job.finished`."""
        side = self._side if after is not None else None
        with torch.cuda.stream(side) if side is not None else _no_stream():
            if side is not None:
                side.wait_event(after)
            if lo == 0:
                part = job.request.prompt[job.done:job.done + chunk]    # pinned: a pageable copy would wait
                part = part.pin_memory().to(self.device, non_blocking=True) if side is not None else part.to(self.device)
                job.pieces = self.model.prefill_pieces(part[None], job.state, 1, fast=self.fast, last_logits=True,
                                                       backend=self.decode_backend, start=job.done)
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
            if logits is None:
                self._piece_recorded(job, side)
                return
            if job.in_place is not None:
                job.in_place.chunk_done(job.done, job.done + job.chunk)
                job.held = job.in_place.workspace_bytes
            else:
                job.held = sum(nbytes(t) for kv in job.state.layers for t in vars(kv).values()
                               if isinstance(t, torch.Tensor))
            job.done += job.chunk
            job.last_logits = logits[0, -1]
            job.pieces, job.chunk, job.layer = None, 0, 0
            if job.done == len(job.request.prompt):
                job.complete = True
                if side is not None:
                    job.finished = torch.cuda.Event()
                    job.finished.record(side)
            self._piece_recorded(job, side)             # after the chunk's staging: it is part of the piece
        self.peak_gpu = max(self.peak_gpu, self.gpu_bytes(job.held))

    @staticmethod
    def _piece_recorded(job: _Prefill, side) -> None:
        """On the side stream, the event the next piece waits to be done before it launches."""
        if side is not None:
            job.piece_done = torch.cuda.Event()
            job.piece_done.record(side)

    def _may_join(self, job: _Prefill) -> bool:
        """Whether a complete prompt joins now (not replaying): at once without overlap on a GPU, or
        once its last piece is done on the side stream (a non-blocking query), or when no lane
        decodes (then the join waits for it)."""
        return job.finished is None or not self.running or job.finished.query()

    def _join_prefill(self, job: _Prefill, step: Iteration, finished: list[Request]) -> None:
        """The prompt is done: the main stream waits on its side-stream work, then its first token
        out and the request in its lane (`_first_token`)."""
        if job.finished is not None:
            main = torch.cuda.current_stream()
            main.wait_event(job.finished)
            job.last_logits.record_stream(main)              # made on the side stream, read on this one
        request = job.request
        joined = self._first_token(request, job, self.now())
        self.peak_gpu = max(self.peak_gpu, self.gpu_bytes(job.held + joined))
        self._prefilling, self._reserved = None, None
        step.joined = True
        if request.done:                       # that was its only token
            request.lane = None
            finished.append(request)

    def _first_token(self, request: Request, job: _Prefill, t: float) -> int:
        """The prompt is done: its first token out, and the request in its lane unless that was its
        only token. Returns the GPU bytes the move into the lane held beside the lanes."""
        logits = job.last_logits
        self._emit(request, int(logits.argmax()), t, logits)
        if request.done:
            if job.in_place is not None:
                job.in_place.cancel()
                self._lanes_changed += 1
            return 0
        if job.in_place is not None:
            if getattr(job.in_place, "runs", None) is not None:
                self._lane_runs[request.lane] = job.in_place.runs
                self.resident_admissions += 1
            job.in_place.join()                # (a workspace in runs goes back)
            self._lanes_changed += 1
            held = 0
        else:
            held = self._join(request, job.state)
        self.lane_request[request.lane] = request
        return held


@contextlib.contextmanager
def _no_stream():
    yield


def _as_list(streams) -> list[int]:
    """A lane's host streams (DSA: one id, Quest and NSA: one per KV head) without the empty lane's -1."""
    ids = streams if isinstance(streams, list) else [streams]
    return [s for s in ids if s >= 0]


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


def _lane_tensors(kv, lanes: int) -> list[torch.Tensor]:
    """The tensors of a layer state that hold one slice per lane (not shared weights or the cache)."""
    out = []
    for f in dataclasses.fields(kv):
        value = getattr(kv, f.name)
        if f.name not in _NOT_LANE_FIELDS and isinstance(value, torch.Tensor) and value.dim() > 0 \
                and value.shape[0] % lanes == 0:
            out.append(value)
    return out


def _copy_lane(kv, one, lane: int, lanes: int) -> None:
    """Copy a one-request layer state `one` into lane `lane` of the batch state `kv`."""
    for f in dataclasses.fields(kv):
        if f.name in _NOT_LANE_FIELDS:
            continue
        mine, theirs = getattr(kv, f.name), getattr(one, f.name)
        if not isinstance(mine, torch.Tensor):
            continue
        if mine.numel() != lanes * theirs.numel():
            raise ValueError(f"lane copy: {type(kv).__name__}.{f.name} {tuple(mine.shape)} is not {lanes} lanes of "
                             f"{tuple(theirs.shape)}")
        mine.view(lanes, -1)[lane].copy_(theirs.reshape(-1))
    if hasattr(kv, "host_streams") and getattr(kv, "streams", None) is not None:
        kv.host_streams[lane] = one.host_streams[0]


def _clear_lane(layers: list, lane: int, lanes: int) -> None:
    """An empty lane: -1 streams (its streams were closed) in every hierarchical layer."""
    for kv in layers:
        if getattr(kv, "streams", None) is None:
            continue
        kv.streams.view(lanes, -1)[lane] = -1
        kv.host_streams[lane] = [] if isinstance(kv.host_streams[lane], list) else -1
        if getattr(kv, "resident", None) is not None:
            kv.resident[lane] = False

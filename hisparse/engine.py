"""Batched greedy decoding with the KV resident or hierarchical: prefill, decode, CUDA graph.

    engine = Engine(model, mode="hisparse", cache_slots=4096, max_context=131072)
    out = engine.generate([prompt_a, prompt_b], new_tokens=64)   # prompts of any lengths
    out.tokens, out.logits, out.hits, out.misses

Prefill runs each prompt on its own through the model's prefill (the family's kernels, or with
prefill="reference" the eager torch one; chunked for long prompts), on a temporary resident state;
its KV then moves to where the mode keeps the selectable units (the resident pool, or the host pool
of a `HierarchicalKVCache`), and the family's always-resident parts (DSA's indexer keys, Quest's
page bounds, NSA's compressed blocks and window) to the GPU.
Decode runs every request together, one token per step; with `graph=True` the whole step (all
layers) is captured once in a CUDA graph and replayed.

Layers that share an anchor's selection (`glm_moe_dsa`'s "shared" layers) move in lockstep with
the anchor: they do no resolve of their own and replay its miss plan, in line or, with
`prefetch=True`, on a side stream while the layers in between compute (DESIGN section 4).

Families: DSA (`deepseek_v32`, `glm_moe_dsa`: one stream per (request, layer), token units),
Quest (`llama`, `qwen3`: 16-token pages on every layer but the first `quest_dense_layers`) and NSA
(`nsa`: 64-token selection blocks; compressed blocks and the sliding window stay resident), the
last two with one stream per (request, layer, KV head). What differs between them sits behind one
`hisparse.runtime.FamilyRuntime` (hisparse/dsa/runtime.py, quest/runtime.py, nsa/runtime.py). Every family
can share selections across layers (prefetch) and record and replay selection traces (per KV head
for the last two: `hisparse.synthetic.split_kv_heads` shapes a synthetic trace for them).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hisparse.cache import HierarchicalKVCache
from hisparse.dsa.fp8 import check_kv_dtype
from hisparse.dsa.fp8_index import check_index_dtype
from hisparse.dsa.model import DsaModel
from hisparse.dsa.runtime import DsaRuntime
from hisparse.host_pool import as_int
from hisparse.models.base import DecodeState
from hisparse.nsa.model import NsaModel
from hisparse.nsa.runtime import NsaRuntime
from hisparse.progress import PROGRESS_EVERY_S, Progress
from hisparse.quest.model import QuestModel
from hisparse.quest.runtime import QuestRuntime
from hisparse.resolve import MAX_K, MAX_SLOTS
from hisparse.runtime import (
    KV_MODES,
    FamilyRuntime,
    count_graph_capture,
    prefetch_width,
)
from hisparse.sampling import LaneSampling, SamplingParams, eos_token_ids, stops_at, token_logprobs
from hisparse.traces import Trace, TraceWriter, validate

RUNTIMES = {DsaModel: DsaRuntime, QuestModel: QuestRuntime, NsaModel: NsaRuntime}
PREFILLS = ("model", "reference", "random")
ENGINE_MODES = (*KV_MODES, "hybrid")        # hybrid: DSA models (`Engine`'s docstring)
GIB = 2**30


def family_runtime(model, token_budget: int | None = None, decode_backend: str = "auto",
                   kv_dtype: str = "bf16", index_dtype: str = "bf16") -> FamilyRuntime:
    """The runtime of the model's family; checks the model fits its kernels. token_budget: Quest only;
    decode_backend: DSA only (`hisparse.dsa.ops.DECODE_BACKENDS`); kv_dtype: "bf16" (rows in the
    model's dtype, every family) or "fp8" (DSA only: `hisparse.dsa.fp8`'s 656-byte rows); index_dtype:
    "bf16" (indexer keys in the model's dtype) or "fp8" (DSA only: `hisparse.dsa.fp8_index`'s keys)."""
    check_kv_dtype(kv_dtype)
    check_index_dtype(index_dtype)
    runtime = RUNTIMES.get(type(model))
    if runtime is None:
        raise ValueError(f"the engine runs DSA models (deepseek_v32, glm_moe_dsa), Quest models (llama, qwen3) "
                         f"and NSA models (nsa), got {type(model).__name__}")
    if index_dtype == "bf16":
        return runtime(model, token_budget, decode_backend, kv_dtype)
    if runtime is not DsaRuntime:
        raise ValueError(f"index_dtype={index_dtype!r} is DSA's FP8 indexer keys; this {type(model).__name__} "
                         f"has no lightning indexer (index_dtype 'bf16')")
    return runtime(model, token_budget, decode_backend, kv_dtype, index_dtype)


@dataclass
class Generation:
    tokens: torch.Tensor                      # [B, new_tokens] int64; -1 after a request's stop
    logits: list[torch.Tensor] = field(default_factory=list)   # per step [B, V] (prefill's last first)
    hits: int = 0                             # resolve counters over the decode steps (hisparse modes)
    misses: int = 0
    decode_s: float = 0.0                     # wall time of the timed decode steps
    timed_steps: int = 0                      # decode steps timed (after the warm-up steps)
    step_ms: list[float] = field(default_factory=list)   # each timed step (GPU: events; CPU: clock)
    launch_ms: list[float] = field(default_factory=list)  # host time of each timed step's call (see generate)
    kv_bytes_per_request: float = 0.0         # GPU bytes of KV state per request (pool or slots, the rest)

    misses_per_step: list[int] = field(default_factory=list)   # with replay, in hisparse modes
    prefetched_layers: int = 0                # shared layers whose copies ran on the side stream
    resident_requests: int = 0                # hybrid: requests placed resident (the first ones)
    resident_steps: int = 0                   # hybrid: decode steps of the all-resident kind (no resolve)
    finish_reasons: list[str] = field(default_factory=list)    # per request: "stop" or "length"
    sampling: list[SamplingParams] = field(default_factory=list)   # per request, its seed drawn if it had none
    token_logprobs: list[list] = field(default_factory=list)   # per request with logprobs: as Request.token_logprobs

    @property
    def miss_rate(self) -> float:
        return self.misses / max(1, self.hits + self.misses)


class StepClock:
    """Marks between decode steps: CUDA events on a GPU (recorded in stream order, read after the
    run's last sync, so timing adds no host sync), the host clock on a CPU (steps run synchronously)."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1e3 for a, b in pairs]


def check_prompts(prompts) -> list[torch.Tensor]:
    """prompts (a list of 1-D integer token sequences, or a [batch, len] tensor of equal-length ones) as
    int64 tensors, or ValueError naming the bad one."""
    if isinstance(prompts, torch.Tensor) and prompts.dim() == 2:
        prompts = list(prompts.unbind(0))
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
        shape = f" of shape {tuple(prompts.shape)}" if isinstance(prompts, torch.Tensor) else ""
        raise ValueError(f"prompts must be a list of prompts, each a 1-D sequence of token ids; got a "
                         f"{type(prompts).__name__}{shape} (one prompt: wrap it in a list)")
    if not prompts:
        raise ValueError("generate needs at least one prompt, each of at least one token")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (list, tuple)):      # name an element torch would refuse or read as a number
            bad = next(((j, x) for j, x in enumerate(prompt) if isinstance(x, bool) or not isinstance(
                x, (numbers.Integral, list, tuple, torch.Tensor, np.ndarray))), None)
            if bad is not None:
                raise ValueError(f"prompt {i} holds {bad[1]!r} at position {bad[0]}: token ids must be integers")
        t = torch.as_tensor(prompt)
        if t.dim() != 1 or len(t) == 0:
            raise ValueError(f"prompt {i} must be a 1-D sequence of at least one token id, got shape {tuple(t.shape)}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"prompt {i} holds {t.dtype} values: token ids must be integers")
        out.append(t.to(torch.int64))
    return out


def check_sampling(sampling, batch: int, vocab: int) -> list[SamplingParams]:
    """One checked SamplingParams per request (a seed drawn for a sampling one without), or ValueError."""
    if sampling is None:
        sampling = SamplingParams()
    params = [sampling] * batch if isinstance(sampling, SamplingParams) else sampling
    if not isinstance(params, (list, tuple)) or len(params) != batch or \
            not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling must be a SamplingParams or a list of {batch} (one per prompt), got {sampling!r}")
    out = []
    for p in params:
        p.check(vocab)
        if p.seed is None and not p.greedy:
            p = dataclasses.replace(p, seed=secrets.randbits(63))
        out.append(p)
    return out


def apply_stops(tokens: torch.Tensor, params: list[SamplingParams], eos: frozenset[int]) -> list[str]:
    """Each request's finish reason from its tokens [B, n] (host); the tokens after a stop set to -1."""
    reasons = []
    for b, p in enumerate(params):
        end = next((n for n, token in enumerate(tokens[b].tolist(), 1) if stops_at(p, token, n, eos)), None)
        reasons.append("length" if end is None else "stop")
        if end is not None:
            tokens[b, end:] = -1
    return reasons


class Engine:
    """prefetch: shared layers' copies overlap the layers after their anchor (hisparse mode on a GPU).
    prefill: "model" runs the model's prefill through the family's kernels (every family);
    "reference" through the eager torch reference (slow: dense masked softmax);
    "random" fills the prompt's KV with random rows and feeds the prompt's last token first (for
    timing decode at long contexts; outputs are noise).
    token_budget (Quest models only): tokens each KV head reads per step, k = token_budget // 16
    pages; default the model's `sparse_attention.token_budget`. prefetch_programs: the prefetch copy's
    width in programs (default: the family's measured one, `hisparse.runtime.PREFETCH_PROGRAMS_PER_FAMILY`).
    decode_backend (DSA models only): the sparse MLA decode kernel, "auto" (Gluon on Hopper where it
    runs, else Triton), "triton" or "gluon". kv_dtype (DSA models only for "fp8"): "bf16", latent rows
    in the model's dtype, or "fp8", 656-byte rows (hisparse.dsa.fp8) written quantised in prefill and
    decode, moved as bytes by the cache, read by an FP8 kernel (Gluon or Triton, as decode_backend picks).
    index_dtype (DSA models only for "fp8"): "bf16", indexer keys in the model's dtype, or "fp8",
    DeepSeek-V3.2's e4m3 keys with a scale a token (hisparse.dsa.fp8_index), scored with an e4m3 query.

    mode "hybrid" (DSA models): each `generate` places its batch from `kv_budget_gib` (GPU bytes of KV,
    `DsaRuntime.hybrid_bytes`): the first requests resident, as many as fit beside the others'
    hierarchical parts (`DsaRuntime.hybrid_placement`), their latents in one run of the cache's streams
    (row_base there, streams -1), the rest hierarchical as in hisparse; one decode step over both,
    the same kernels over `cache.gpu_rows`, so tokens and logits are bitwise resident's. Every
    request resident: the all-resident step (no resolve, no hierarchical write); none: hisparse's."""

    def __init__(self, model: DsaModel | QuestModel | NsaModel, mode: str = "resident",
                 cache_slots: int | None = None, max_context: int | None = None, chunk_size: int | None = None,
                 prefetch: bool = False, prefill: str = "model", token_budget: int | None = None,
                 prefetch_programs: int | None = None, decode_backend: str = "auto", kv_dtype: str = "bf16",
                 kv_budget_gib: float | None = None, index_dtype: str = "bf16"):
        if mode not in ENGINE_MODES:
            raise ValueError(f"mode must be one of {ENGINE_MODES}, got {mode!r}")
        if mode == "hybrid":
            if kv_budget_gib is None:
                raise ValueError("mode 'hybrid' needs kv_budget_gib (GPU memory for KV, GiB): it places each "
                                 "batch's requests resident or hierarchical by what fits")
            if isinstance(kv_budget_gib, bool) or not isinstance(kv_budget_gib, (int, float)) \
                    or not (math.isfinite(kv_budget_gib) and kv_budget_gib > 0):
                raise ValueError(f"kv_budget_gib must be a positive, finite number of GiB, got {kv_budget_gib!r}")
        elif kv_budget_gib is not None:
            raise ValueError(f"kv_budget_gib places mode 'hybrid''s requests; mode {mode!r} takes none "
                             f"(got {kv_budget_gib!r})")
        if prefetch and mode != "hisparse":
            raise ValueError(f"prefetch applies to mode 'hisparse' (it overlaps copies), not {mode!r}")
        if prefill not in PREFILLS:
            raise ValueError(f"prefill must be one of {PREFILLS}, got {prefill!r}")
        if token_budget is not None:
            token_budget = as_int(token_budget, "token_budget must be an int (tokens per KV head and step)", 1)
        if max_context is not None:
            max_context = as_int(max_context, "max_context must be an int >= 1 (tokens a request may reach)", 1)
        if chunk_size is not None:
            chunk_size = as_int(chunk_size, "chunk_size must be an int >= 1 (prompt tokens per prefill chunk)", 1)
        self.runtime = family_runtime(model, token_budget, decode_backend, kv_dtype, index_dtype)
        if mode == "hybrid" and not hasattr(self.runtime, "gather_hybrid"):
            raise ValueError(f"mode 'hybrid' is built for DSA models (deepseek_v32, glm_moe_dsa) so far; this "
                             f"{self.runtime.family} model ({type(model).__name__}) runs resident, hisparse or noio")
        self.kv_budget = None if kv_budget_gib is None else int(kv_budget_gib * GIB)
        self.decode_backend, self.kv_dtype, self.index_dtype = decode_backend, kv_dtype, index_dtype
        self.prefetch_programs = prefetch_width(self.runtime.family, prefetch_programs)
        if prefetch and not self.runtime.shared_layers:
            raise ValueError(f"prefetch replays an anchor's miss plan in shared layers; "
                             f"this {self.runtime.family} model ({type(model).__name__}) has none (they come "
                             f"from glm_moe_dsa's indexer_types, quest_selection_group > 1 in a Quest config "
                             f"or selection_group > 1 in an NSA one)")
        topk = self.runtime.selection_size
        if cache_slots is not None:       # in every mode (resident ignores its value): True is not 1 slot
            cache_slots = as_int(cache_slots, f"cache_slots must be an int (B >= k = {topk})")
        if mode != "resident":
            if cache_slots is None:
                raise ValueError(f"mode {mode!r} needs cache_slots (B >= k = {topk})")
            if topk > MAX_K:
                raise ValueError(f"the selection size k={topk} ({self.runtime.selection_name}) exceeds the "
                                 f"{MAX_K} the resolve kernel supports")
            if cache_slots > MAX_SLOTS:
                raise ValueError(f"cache_slots B={cache_slots} exceeds the supported {MAX_SLOTS}")
            if cache_slots < topk:
                raise ValueError(f"cache_slots B={cache_slots} is smaller than the selection size "
                                 f"k={topk} ({self.runtime.selection_name}): the cache must hold one whole "
                                 f"selection")
        self.model, self.mode, self.cache_slots = model, mode, cache_slots
        self.max_context, self.chunk_size = max_context, chunk_size
        self.prefetch, self.prefill = prefetch, prefill
        self.cache: HierarchicalKVCache | None = None
        self.resident_requests = 0          # hybrid: the last generate's placement (the first requests)

    @property
    def anchors(self) -> list[int]:
        """The layer whose selection each layer uses: itself, or the last "full" layer before it."""
        return self.runtime.anchors

    # -- prefill -----------------------------------------------------------------------------

    def _prefill(self, prompts: list[torch.Tensor], capacity: int) -> tuple[DecodeState, torch.Tensor]:
        """Prefill each prompt alone, then gather the batch state. Returns (state, first tokens [B]
        or, after the model's prefill, the last logits [B, V])."""
        model, device = self.model, self.model.model.embed_tokens.weight.device
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)
        if self.prefill == "random":
            first = torch.stack([p[-1] for p in prompts]).to(device)
            rows = self.runtime.random_rows(prompts, device)
        else:
            singles, last = [], []
            new_state = getattr(self.runtime, "new_state", model.new_state)   # DSA's: its kv_dtype's rows
            for prompt in prompts:
                state = new_state(1, len(prompt))
                logits = model.prefill(prompt.to(device)[None], state, self.chunk_size, fast=self.prefill == "model",
                                       last_logits=True, backend=self.decode_backend)
                singles.append(state)
                last.append(logits[0, -1])
            first = torch.stack(last)
            rows = self.runtime.prefilled_rows(singles)
        if self.mode == "hybrid":
            layers = self.runtime.gather_hybrid(self.cache, rows, lengths, capacity, self.resident_requests)
        else:
            layers = self.runtime.gather_layers(self.mode, self.cache, rows, lengths, capacity, self.prefetch)
        return DecodeState(layers, capacity, lengths, int(lengths.max())), first

    # -- decode ------------------------------------------------------------------------------

    def generate(self, prompts, new_tokens: int, graph: bool = False, keep_logits: bool = True,
                 record: TraceWriter | None = None, replay: Trace | None = None,
                 warmup_steps: int = 1, progress: Progress | None = None,
                 sampling: SamplingParams | list[SamplingParams] | None = None) -> Generation:
        """Decode `new_tokens` tokens for each prompt (token-id sequences of any lengths), greedy or as
        `sampling` says (one SamplingParams for all, or one per prompt; `hisparse.sampling`). Every
        request runs every step (the batch is fixed): one that stops (eos, stop ids) has -1 after its
        stop token in `tokens`, and `finish_reasons` says why each ended.

        The first `warmup_steps` decode steps are not timed: the first compiles the kernels and
        runs eagerly (with graph=True the step is captured after it); more let the GPU's clocks
        settle and, with a graph, keep its first replay (which uploads it) out of the timing.
        `decode_s` and `step_ms` time the rest; `launch_ms` is the host's time in each timed step's
        call (on a GPU the launches: a graph replay's launch near its step's time means the GPU
        waited on the host).

        record: a TraceWriter that receives every decode step's selections [layers, batch, (kv_heads,) k]
        (`trace_writer` makes one with this run's metadata). replay: a trace whose selections
        replace the indexer's (recorded from the same prompts, or synthetic); with it,
        `misses_per_step` holds each step's misses (hisparse modes; eager only). progress: a
        `hisparse.progress.Progress` told of the prefill and of the decode steps (a line every few seconds)."""
        prompts = check_prompts(prompts)
        new_tokens = as_int(new_tokens, "new_tokens must be an int >= 1", 1)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an int >= 1 (the first step compiles), got {warmup_steps!r}")
        longest = max(len(p) for p in prompts)
        capacity = longest + new_tokens if self.max_context is None else self.max_context
        if longest + new_tokens - 1 > capacity:
            raise ValueError(f"a prompt of {longest} tokens plus {new_tokens} new ones exceeds "
                             f"max_context={capacity}")
        if graph and not torch.cuda.is_available():
            raise ValueError("graph=True needs a CUDA GPU")
        if graph and record is not None:
            raise ValueError("recording selections runs eagerly: pass graph=False")
        if replay is not None:
            self._check_replay(replay, prompts, new_tokens)
        vocab = self.model.config.vocab_size
        params = check_sampling(sampling, len(prompts), vocab)
        bad = [int(t) for p in prompts for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} out of range: the vocabulary has {vocab} ids")

        batch = len(prompts)
        if self.mode == "hybrid":       # placed before anything is allocated or launched
            self.resident_requests = self.placement(batch, capacity)
        previous_attention = self.model.sparse_attention
        self.cache = None               # the last run's host pool goes before a new one is pinned
        try:
            if self.mode == "hybrid":
                self.cache = self.runtime.new_hybrid_cache(self.resident_requests, batch - self.resident_requests,
                                                           capacity, self.cache_slots)
            elif self.mode != "resident":
                self.cache = self.runtime.new_cache(batch, capacity, self.cache_slots)
            if progress is not None:
                progress(f"prefill of {batch} prompts ({sum(len(p) for p in prompts)} tokens)")
            state, first = self._prefill(prompts, capacity)
            if progress is not None:
                progress(f"prefilled; {new_tokens - 1} decode steps")
            kv_mode = "hisparse" if self.mode == "hybrid" else self.mode     # the attention's: resolves, copies
            attention = self.runtime.attention(kv_mode, state.layers, check_values=not graph, prefetch=self.prefetch,
                                               prefetch_programs=self.prefetch_programs)
            if replay is not None:     # the whole trace on the device: each step copies its slice
                steps = np.ascontiguousarray(replay.selections[:new_tokens - 1])
                replay_steps = torch.from_numpy(steps).to(first.device)
                attention.replay_sel = torch.empty_like(replay_steps[0], memory_format=torch.contiguous_format)
            self.model.sparse_attention = attention
            out = Generation(tokens=torch.empty(0))
            sampler = LaneSampling(batch, vocab, first.device)
            for lane, p in enumerate(params):
                sampler.set_lane(lane, p)
            out.sampling, out.token_logprobs = params, [[] for _ in params]
            tops = [p.logprobs for p in params]
            if first.dim() == 2:                       # the model's prefill: its last logits
                if keep_logits:
                    out.logits.append(first.float().cpu())
                logits, first = first, first.argmax(-1)
                if sampler.needed:
                    first = torch.tensor([sampler.sample_lane(b, row) if sampler.uses[b] else int(first[b])
                                          for b, row in enumerate(logits)], device=first.device)
                self._logprobs(out, logits, first, tops)
            tokens = first
            every_lane = torch.ones(batch, dtype=torch.bool, device=first.device)
            generated = [tokens]
            out.kv_bytes_per_request = self.runtime.kv_bytes(state.layers, self.cache) / batch
            out.prefetched_layers = sum(getattr(kv, "prefetched", None) is not None for kv in state.layers)
            if self.mode == "hybrid":
                out.resident_requests = self.resident_requests
                all_resident = state.layers[0].resident_step

            def step(toks: torch.Tensor) -> torch.Tensor:
                return self.model.decode(toks, state)
            timed_from = 1 + warmup_steps           # step 1 compiles, and precedes any capture
            clock = StepClock(first.is_cuda)
            for t in range(1, new_tokens):
                if replay is not None:
                    attention.replay_sel.copy_(replay_steps[t - 1])
                if t == 2 and graph:
                    step = self._graphed_step(tokens, state)
                if t == timed_from:
                    self._sync()
                    start = time.perf_counter()
                if t >= timed_from:
                    clock.mark()
                if self.cache is not None:         # the units this step opens, recorded on the host
                    self.runtime.advance_streams(self.cache, state.layers, [len(p) + t - 1 for p in prompts])
                launch_start = time.perf_counter()
                logits = step(tokens)
                if self.mode == "hybrid":
                    out.resident_steps += all_resident
                if t >= timed_from:
                    out.launch_ms.append((time.perf_counter() - launch_start) * 1e3)
                if record is not None:
                    record.add_step(attention.recorded_step(len(state.layers)))
                if replay is not None and self.cache is not None and not graph:
                    misses = self.runtime.counts(self.cache, state.layers)[1]
                    out.misses_per_step.append(misses - sum(out.misses_per_step))
                if sampler.needed:
                    tokens = sampler.sample(logits)
                    sampler.advance(tokens, every_lane)
                else:
                    tokens = logits.argmax(-1)
                self._logprobs(out, logits, tokens, tops)
                generated.append(tokens)
                if keep_logits:
                    out.logits.append(logits.float().cpu())
                if progress is not None:
                    progress(f"decode step {t} of {new_tokens - 1}", every=PROGRESS_EVERY_S)
            if new_tokens > timed_from:
                clock.mark()
            self._sync()
            if new_tokens > timed_from:
                out.decode_s = time.perf_counter() - start
                out.timed_steps = new_tokens - timed_from
                out.step_ms = clock.intervals_ms()
            out.tokens = torch.stack(generated, dim=1).cpu()
            out.finish_reasons = apply_stops(out.tokens, params, eos_token_ids(self.model.config))
            if self.cache is not None:
                out.hits, out.misses = self.runtime.counts(self.cache, state.layers)
            return out
        except BaseException:
            self.cache = None           # nothing half-built is kept
            raise
        finally:
            # the run's attention holds its layers, hence the cache: put the model's own back
            self.model.sparse_attention = previous_attention

    def placement(self, batch: int, capacity: int) -> int:
        """Mode hybrid: resident requests of a batch of `batch` requests of `capacity` tokens under the
        GPU budget (`DsaRuntime.hybrid_placement`), or ValueError when even all hierarchical exceeds it."""
        resident = self.runtime.hybrid_placement(batch, capacity, self.cache_slots, self.kv_budget)
        if resident is None:
            need = self.runtime.hybrid_bytes(0, batch, capacity, self.cache_slots)
            raise ValueError(f"kv_budget_gib={self.kv_budget / GIB:g} ({self.kv_budget} bytes) holds no placement of "
                             f"{batch} requests of {capacity} tokens: all hierarchical they take {need} bytes "
                             f"(cache_slots={self.cache_slots})")
        return resident

    def trace_writer(self, prompts, source: str = "") -> TraceWriter:
        """A TraceWriter with this model's metadata, for `generate(..., record=...)`."""
        return TraceWriter(self.runtime.family.lower(), self.runtime.unit_size, [len(p) for p in prompts],
                           self.anchors, source or self.model.config.model_type)

    def _check_replay(self, trace: Trace, prompts, new_tokens: int) -> None:
        validate(trace, "replayed trace")       # ids in range: decode steps run without value checks
        if trace.layer_anchor.tolist() != self.anchors:
            raise ValueError(f"trace layer anchors {trace.layer_anchor.tolist()} differ from the model's "
                             f"{self.anchors} (shared layers reuse their anchor's selection); "
                             f"hisparse.traces.with_anchors makes a trace fit")
        cfg, runtime = self.model.config, self.runtime
        want = {"layers": cfg.num_hidden_layers, "batch": len(prompts), "kv_heads": runtime.kv_heads,
                "k": runtime.selection_size, "unit_size": runtime.unit_size}
        got = {"layers": trace.layers, "batch": trace.batch, "kv_heads": trace.kv_heads, "k": trace.k,
               "unit_size": trace.unit_size}
        if want != got:
            raise ValueError(f"trace {trace} does not fit this run: expected {want}, got {got} (kv_heads None: "
                             f"one selection per request and layer)")
        dense = runtime.dense_layers
        if dense and (trace.selections[:, :dense] != -1).any():
            raise ValueError(f"trace {trace} selects units on layers 0..{dense - 1}, which this model keeps dense: "
                             f"their selections must be -1")
        if list(trace.context) != [len(p) for p in prompts]:
            raise ValueError(f"trace context {trace.context.tolist()} differs from the prompt lengths "
                             f"{[len(p) for p in prompts]}")
        if trace.steps < new_tokens - 1:
            raise ValueError(f"trace has {trace.steps} steps, {new_tokens} new tokens need {new_tokens - 1}")

    @staticmethod
    def _logprobs(out: Generation, logits: torch.Tensor, tokens: torch.Tensor, tops: list[int | None]) -> None:
        if any(n is not None for n in tops):
            for b, entry in enumerate(token_logprobs(logits, tokens, tops)):
                if entry is not None:
                    out.token_logprobs[b].append(entry)

    def _sync(self) -> None:
        if self.model.model.embed_tokens.weight.is_cuda:
            torch.cuda.synchronize()

    def _graphed_step(self, tokens: torch.Tensor, state: DecodeState):
        """Capture one decode step (all layers) in a CUDA graph; returns a replaying step function.

        Capturing records without executing, so the model's host-side length bound is put back."""
        static_tokens = tokens.clone()
        max_length = state.max_length
        count_graph_capture()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = self.model.decode(static_tokens, state)
        state.max_length = max_length

        def step(new_tokens: torch.Tensor) -> torch.Tensor:
            static_tokens.copy_(new_tokens)
            graph.replay()
            state.max_length += 1
            return static_logits

        return step

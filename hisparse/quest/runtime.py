"""The Quest decode step through the Triton kernels, with the KV pages resident or hierarchical.

`KernelQuestAttention` replaces `QuestModel.sparse_attention` (the torch reference step in
`hisparse.quest.reference`) on the Quest layers (every layer but the first
`quest_dense_layers`). Every mode runs the same metadata append, the same page scores and top-page
selection and the same `quest_attention`, reading the same rows in the same order (DESIGN section 6);
only where the rows sit differs:
- `resident`: every page of every (request, KV head) on the GPU (`QuestKV.pool`, the row layout of
  `hisparse/quest/ops.py`: row = (n * HKV + h) * P_MAX + page, each `[2, PAGE, D]`, keys then values);
- `hisparse` / `noio`: pages in the host pool of a `HierarchicalKVCache`, one stream per (request,
  layer, KV head) whose units are 16-token pages and whose rows are those same `[2, PAGE, D]`; each
  step resolves the selection to GPU slots first (`noio` skips the copy: the oracle).
The page min/max metadata (`kmin`, `kmax [N, HKV, P_MAX, D]`) stays resident in every mode, and
the dense layers keep the model's own resident `PagedKV` in every mode.

The newest page grows every step. It lives in the host pool, in the stream's reserved slot
(prefill's `append` leaves the last, possibly partial page there) and, once selected, in a cached
slot (unit -> slot map), all three with the same bytes. Each step `write_newest_token` stores the
token's key and value at its offset in all three (write-through; `HierarchicalKVCache.write_newest_token`):
2 * D elements per (request, layer, KV head) over PCIe, and the whole row, zeros but for the token,
when the token opens a page (2 * 16 * D elements, 8 KiB at D = 128 in bf16). No host sync, so the
step can be captured in a CUDA graph. The engine records on the host which streams gain a page
(`QuestRuntime.advance_streams`, before the step that opens it).

Serving (`hisparse.serving`) prefills a request into its lane in place (`QuestLanePrefill`): each
chunk's pages reach the lane or the host pool as the chunk is done, and the lane ends bitwise as a
gathered one. Its decode steps write every lane, so an empty lane's write keeps what the lane
holds (`QuestKV.lanes`): the one being prefilled into must keep its tokens (dense layers: see
`DenseLaneView`).

Hybrid serving keeps a lane resident in runs of the cache's streams (`QuestRuntime.take_runs`: one
run per Quest layer and KV head, of B + 1 pages a stream): its pages sit there in the resident
pool's layout, page p of KV head h at row `row_base[n, h] + p` of `cache.slots` viewed as rows, its
streams -1 (the resolve and the newest-token write skip it). Attention reads rows of the run for
such a lane and resolved slots for the others, in one launch over `cache.slots`, so each lane reads
its mode's bytes with the same kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from hisparse.cache import HierarchicalKVCache
from hisparse.models.base import DecodeState
from hisparse.quest.ops import (
    PAGE,
    pages_from_tokens,
    quest_attention,
    quest_metadata_append,
    quest_metadata_from_keys,
    quest_select,
    resident_rows,
)
from hisparse.quest.reference import PagedKV
from hisparse.runtime import (
    Rows,
    UnitResolver,
    advance_unit_streams,
    cache_bytes,
    gather_in_lockstep,
    nbytes,
    open_unit_streams,
    run_rows,
    shared_states,
    stream_counts,
    write_newest_unit,
    write_run_token,
)
from hisparse import unit_lanes
from hisparse.unit_lanes import UnitRowsRuntime


@dataclass
class QuestKV:
    """A Quest layer's KV, resident: `pool [N * HKV * P_MAX, 2, PAGE, D]` (None when hierarchical),
    `kmin, kmax [N, HKV, P_MAX, D]` the page bounds of the post-RoPE keys (always resident; None on a
    layer that shares another's selection, as it selects nothing), `max_pages` = P_MAX. `lanes [N]`
    bool: serving's rows that hold a request (None outside serving): an empty lane's decode write
    changes nothing."""

    pool: torch.Tensor | None
    kmin: torch.Tensor | None
    kmax: torch.Tensor | None
    max_pages: int = 0
    lanes: torch.Tensor | None = None

    def write(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, page_size: int) -> None:
        """Decode-step write (positions [N, 1]) of keys, values [N, HKV, 1, D]: the token's slot in
        its page's row, then its key folded into the page bounds."""
        if positions.shape[1] != 1:
            raise ValueError("a Quest decode state takes one token per row; prefill runs on the model's state")
        if page_size != PAGE:
            raise ValueError(f"the Quest kernels use {PAGE}-token pages, the model {page_size}")
        pos = positions[:, 0]
        key = keys[:, :, 0].contiguous()
        self._write_row(pos, key, values[:, :, 0])
        if self.kmin is not None:
            page_pos = pos.to(torch.int32)
            if self.lanes is not None:                       # -1: an empty lane's bounds stay
                page_pos = torch.where(self.lanes, page_pos, -1)
            quest_metadata_append(self.kmin, self.kmax, key, page_pos)

    def _write_row(self, pos: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        unit_lanes.write_resident_unit_kept(self.pool, pos, key, value, PAGE, self.max_pages, self.lanes)


@dataclass
class HierQuestKV(QuestKV):
    """A Quest layer's KV with its pages in the hierarchical cache: `pool` is None; `streams [N, HKV]`
    int32 are the streams of `cache` (unit = page, row = [2, PAGE, D] flattened); `host_streams[n]`
    the same ids of request n, on the host (for `advance_streams`).

    A shared layer (`quest_selection_group` > 1: it attends over its anchor layer's selection) moves
    in lockstep with its anchor: `anchor_layer` and `anchor_streams [N, HKV]` name the anchor, whose
    slot maps place its pages too, and `prefetched` is the event its layer-wise prefetch copy
    records, when prefetch is on.

    Hybrid serving: `resident [N]` bool marks the lanes whose pages sit in runs of the cache's
    streams, page p of KV head h at row `row_base [N, HKV]` int64 + p of `cache.slots` viewed as
    rows (their streams -1, their host_streams []); `resident_step` (host side) says every lane
    holding a request is resident this step, so the step skips the hierarchical write and the resolve."""

    streams: torch.Tensor | None = None
    cache: HierarchicalKVCache | None = None
    host_streams: list[list[int]] = field(default_factory=list)
    anchor_layer: int | None = None
    anchor_streams: torch.Tensor | None = None
    prefetched: torch.cuda.Event | None = None
    row_base: torch.Tensor | None = None
    resident: torch.Tensor | None = None
    resident_step: bool = False

    def _write_row(self, pos: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.resident is not None:         # resident lanes: into their runs' rows
            pool = self.cache.gpu_rows.view(-1, 2, PAGE, key.shape[-1])
            write_run_token(pool, self.row_base, self.resident, pos, key, value, PAGE)
            if self.resident_step:
                return
        write_newest_unit(self, pos, key, value, PAGE)


class KernelQuestAttention(UnitResolver):
    """`select` and `attend` of the Quest decode step (the contract of `TorchQuestAttention`).

    token_budget: tokens read per KV head and step, K = token_budget // PAGE pages (the current one
    included). check_values: validate selections against stream lengths before each resolve (a
    host sync; off inside a captured CUDA graph). Resolve counters accumulate in `cache.stats`
    (anchor layers only: shared layers do no resolve work).
    `recorded[layer]` holds the pages [N, HKV, K] each Quest layer attended over in the last step.
    shared, prefetch: layers sharing an anchor's selection (`hisparse.runtime.UnitResolver`).
    """

    family = "Quest"

    def __init__(self, mode: str = "resident", token_budget: int = 4096, check_values: bool = True,
                 prefetch: bool = False, shared: dict[int, list[HierQuestKV]] | None = None,
                 prefetch_programs: int | None = None):
        super().__init__(mode, check_values, prefetch, shared, prefetch_programs)
        if token_budget < PAGE:
            raise ValueError(f"token_budget {token_budget} is under one page ({PAGE} tokens)")
        self.token_budget = token_budget

    def select(self, layer_idx: int, q: torch.Tensor, kv: QuestKV, lengths: torch.Tensor,
               page_size: int) -> torch.Tensor:
        """q [N, HQ, D] (roped) -> pages [N, HKV, K] int32, ascending, -1 padding (or a trace's,
        in its order, when `replay_sel` is set)."""
        if self.replay_sel is not None:
            return self.replay_sel[layer_idx]
        return quest_select(q.contiguous(), kv.kmin, kv.kmax, lengths.to(torch.int32), self.token_budget)

    def attend(self, layer_idx: int, q: torch.Tensor, kv: QuestKV, lengths: torch.Tensor,
               selection: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
        """Attention of q [N, HQ, D] over the selected pages -> [N, HQ, D]."""
        selection = self.lane_masked(selection.to(torch.int32)).contiguous()
        self.recorded[layer_idx] = selection
        if isinstance(kv, HierQuestKV):
            if kv.resident is None:
                rows = self.unit_rows(layer_idx, kv, selection)
            elif kv.resident_step:      # no hierarchical lane: nothing to resolve (empty lanes' are -1)
                rows = unit_lanes.run_unit_rows(kv.row_base, selection)
            else:           # resolve the hierarchical lanes only; a resident lane reads its runs' rows
                keep = kv.resident[:, None, None]
                rows = torch.where(keep, unit_lanes.run_unit_rows(kv.row_base, selection),
                                   self.unit_rows(layer_idx, kv, torch.where(keep, -1, selection)))
            pool = kv.cache.gpu_rows
        else:
            rows, pool = resident_rows(selection, kv.max_pages), kv.pool
        return quest_attention(q.contiguous(), pool, rows, selection, lengths.to(torch.int32), scale)


# -- the engine's Quest side (a `hisparse.runtime.FamilyRuntime`) -----------------------------------

def quest_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if layer.self_attn.quest]


def selection_size(model, token_budget: int) -> int:
    """K pages per KV head and step for `token_budget`; checks the model fits the Quest kernels."""
    cfg = model.config
    if cfg.quest_page_size != PAGE:
        raise ValueError(f"the Quest kernels use {PAGE}-token pages, the model's quest_page_size is "
                         f"{cfg.quest_page_size}")
    if token_budget < PAGE:
        raise ValueError(f"token_budget {token_budget} is under one page ({PAGE} tokens)")
    return token_budget // PAGE


def new_cache(model, batch: int, capacity: int, cache_slots: int) -> HierarchicalKVCache:
    """One stream per (request, Quest layer, KV head), each with a host region of P_MAX pages."""
    cfg, weight = model.config, model.model.embed_tokens.weight
    layers = len(quest_layers(model))
    if layers == 0:
        raise ValueError(f"the model has no Quest layer (all {cfg.num_hidden_layers} are dense): "
                         f"use mode 'resident'")
    streams = batch * layers * cfg.num_key_value_heads
    return HierarchicalKVCache(max_streams=streams, cache_slots=cache_slots,
                               host_rows=streams * triton.cdiv(capacity, PAGE),
                               row_elems=2 * PAGE * cfg.head_dim, dtype=weight.dtype, device=weight.device)


def gather_layer(model, mode: str, cache: HierarchicalKVCache | None, layer: int, parts, lengths: torch.Tensor,
                 capacity: int, host_tokens: int | None = None):
    """One layer's batch state from per-request (keys, values) [HKV, len, D]: the model's PagedKV on
    a dense layer (every mode), `QuestKV` (resident) or `HierQuestKV` (pages into the host pool)."""
    attn = model.model.layers[layer].self_attn
    keys0 = parts[0][0]
    hkv, d, batch = keys0.shape[0], keys0.shape[-1], len(parts)
    device = keys0.device
    max_pages = triton.cdiv(capacity, PAGE)
    if not attn.quest:
        kv = attn.new_kv(batch, capacity, device, keys0.dtype)
        for b, (k, v) in enumerate(parts):
            kv.keys[b, :, :k.shape[1]] = k
            kv.values[b, :, :k.shape[1]] = v
        kv.page_min, kv.page_max = quest_metadata_from_keys(kv.keys, lengths.to(torch.int32), kv.page_min.shape[2])
        return kv
    selects = model.config.selection_anchor(layer) == layer      # else it shares another layer's selection
    kmin = keys0.new_zeros(batch, hkv, max_pages, d) if selects else None
    kmax = keys0.new_zeros(batch, hkv, max_pages, d) if selects else None
    pages = []
    for b, (k, v) in enumerate(parts):
        n_pages = triton.cdiv(k.shape[1], PAGE)
        if selects:
            length = torch.tensor([k.shape[1]], dtype=torch.int32, device=device)
            lo, hi = quest_metadata_from_keys(k[None], length, n_pages)
            kmin[b, :, :n_pages], kmax[b, :, :n_pages] = lo[0], hi[0]
        pages.append(pages_from_tokens(k[None], v[None], n_pages).view(hkv, n_pages, 2, PAGE, d))
    if mode == "resident":
        pool = keys0.new_zeros(batch, hkv, max_pages, 2, PAGE, d)
        for b, rows in enumerate(pages):
            pool[b, :, :rows.shape[1]] = rows
        return QuestKV(pool=pool.view(-1, 2, PAGE, d), kmin=kmin, kmax=kmax, max_pages=max_pages)
    region = max_pages if host_tokens is None else triton.cdiv(host_tokens, PAGE)
    host_streams = [open_unit_streams(cache, rows, region) for rows in pages]
    return HierQuestKV(pool=None, kmin=kmin, kmax=kmax, max_pages=max_pages, cache=cache, host_streams=host_streams,
                       streams=torch.tensor(host_streams, dtype=torch.int32, device=device),
                       row_base=torch.zeros(batch, hkv, dtype=torch.int64, device=device))


class QuestRuntime(UnitRowsRuntime):
    """Quest models (llama, qwen3) in the engine: `token_budget` tokens per KV head and step
    (default the model's), k = token_budget // 16 pages; the first `quest_dense_layers` stay dense
    and resident in every mode. decode_backend and kv_dtype are DSA's options (every runtime takes
    the same arguments): only their defaults are accepted."""

    family = "Quest"
    selection_name = "token_budget // 16 pages"
    # serving: an empty lane's decode write still lands in the lane a prefill fills (Quest's dense lanes write at token 0)
    prefill_beside_decode, hybrid_trash_row = False, False
    lane_kv, hier_kv = QuestKV, HierQuestKV
    unit_size = PAGE
    row_token_dims = (1, 1)          # prefilled rows: keys, values [HKV, T, D]
    # hybrid serving: a prefill's workspace is the model's PagedKV in every mode, beside the cache
    workspace_in_runs = False

    def __init__(self, model, token_budget: int | None = None, decode_backend: str = "auto",
                 kv_dtype: str = "bf16"):
        self.refuse_dsa_options(model, decode_backend, kv_dtype)
        self.model = model
        self.token_budget = model.sparse_attention.token_budget if token_budget is None else token_budget
        self.selection_size = selection_size(model, self.token_budget)
        self.kv_heads = model.config.num_key_value_heads
        self.dense_layers = min(model.config.quest_dense_layers, model.config.num_hidden_layers)
        self.anchors = [model.config.selection_anchor(i) for i in range(model.config.num_hidden_layers)]
        self.shared_layers = any(a != i for i, a in enumerate(self.anchors))   # prefetch has layers to serve

    def random_rows(self, prompts: list[torch.Tensor], device: torch.device) -> Rows:
        """rows(b, layer) -> random (keys, values) [HKV, len, D]."""
        cfg, dtype = self.model.config, self.model.model.embed_tokens.weight.dtype

        def rows(b: int, layer: int):
            shape = (cfg.num_key_value_heads, len(prompts[b]), cfg.head_dim)
            return torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)

        return rows

    def prefilled_rows(self, states: list[DecodeState]) -> Rows:
        return lambda b, i: (states[b].layers[i].keys[0], states[b].layers[i].values[0])

    def new_cache(self, batch: int, capacity: int, cache_slots: int) -> HierarchicalKVCache:
        return new_cache(self.model, batch, capacity, cache_slots)

    def gather_layers(self, mode, cache, rows: Rows, lengths, capacity: int, prefetch: bool,
                      host_tokens: int | None = None) -> list:
        """Each layer's batch state; a shared layer's names its anchor's (lockstep, HierQuestKV).
        host_tokens: each stream's host region, in tokens (default the capacity)."""
        def gather(i: int):
            return gather_layer(self.model, mode, cache, i, [rows(b, i) for b in range(len(lengths))], lengths,
                                capacity, host_tokens)
        return gather_in_lockstep(self.anchors, gather, HierQuestKV, mode, prefetch)

    def stream_regions(self, tokens: int) -> list[int]:
        """Host units (pages) of each stream of one request of `tokens` tokens: one a Quest layer and KV head."""
        return [triton.cdiv(tokens, PAGE)] * (len(quest_layers(self.model)) * self.kv_heads)

    def stream_layers(self) -> list[int]:
        """The layers whose rows are in streams (hierarchical modes): the Quest layers."""
        return quest_layers(self.model)

    def lane_prefill(self, mode: str, cache: HierarchicalKVCache | None, layers: list, lane: int, prompt: int,
                     host_tokens: int, runs: list[int] | None = None,
                     shared_pages: list[list[int]] | None = None) -> QuestLanePrefill:
        """A serving lane's prefill in place (`hisparse.serving`; see `QuestLanePrefill`): the
        request's streams opened now with `host_tokens` tokens of pages each (hierarchical modes), on a
        cached prefix's `shared_pages` (per stream). runs: a hybrid lane kept resident, its pages
        written straight into these runs of the cache's streams (`take_runs`) and read from there."""
        return QuestLanePrefill(self, mode, cache, layers, lane, prompt, host_tokens, runs, shared_pages)

    # -- hybrid serving: a lane resident in runs of the cache's streams, or hierarchical ------------

    def run_streams(self, cache: HierarchicalKVCache, capacity: int) -> int:
        """Streams of a run that holds the pages of `capacity` tokens of one KV head (B + 1 pages a stream)."""
        return -(-triton.cdiv(capacity, PAGE) // (cache.cache_slots + 1))

    def runs_per_request(self) -> int:
        """Runs a resident request holds, one per stream it has when hierarchical: one a Quest layer and KV head."""
        return len(quest_layers(self.model)) * self.kv_heads

    def take_runs(self, cache: HierarchicalKVCache, capacity: int) -> list[int] | None:
        """One run of `capacity` tokens per Quest layer and KV head, layer by layer (first stream ids),
        or None (nothing taken)."""
        return cache.take_runs(self.run_streams(cache, capacity), self.runs_per_request())

    def demote(self, cache: HierarchicalKVCache, layers: list, lane: int, length: int, host_tokens: int,
               runs: list[int]) -> None:
        """A resident hybrid lane becomes hierarchical between steps: run by run (Quest layer by layer,
        KV head by head) its run goes back and a stream with a host region of `host_tokens` tokens of
        pages gets the run's first pages up to token `length` (bytes as stored; the stream may reuse
        the run's own streams, whose rows are read before anything is written there); the lane reads
        through its streams from the next step, their caches empty. ValueError, before anything
        changes, for runs that are not the lane's count or a host pool that cannot hold the regions."""
        unit_lanes.demote_unit_runs(cache, layers, lane, triton.cdiv(length, PAGE), triton.cdiv(host_tokens, PAGE), runs,
                         self.kv_heads)

    def lane_workspace_bytes(self, mode: str, tokens: int) -> int:
        """GPU bytes a `lane_prefill` of `tokens` holds beside the lanes, in every mode: the Quest
        layers' keys, values and page bounds of the whole prompt (the model's PagedKV)."""
        return sum(nbytes(*paged_tensors(quest_workspace(self.model, i, tokens, "meta")))
                   for i in quest_layers(self.model))

    def attention(self, mode: str, layers: list, check_values: bool, prefetch: bool,
                  prefetch_programs: int | None = None) -> KernelQuestAttention:
        return KernelQuestAttention(mode, self.token_budget, check_values=check_values, prefetch=prefetch,
                                    shared=shared_states(layers, HierQuestKV), prefetch_programs=prefetch_programs)

    def advance_streams(self, cache: HierarchicalKVCache, layers: list, positions: list[int]) -> None:
        """A position opening a page adds a unit to each of its request's streams."""
        hier = [kv.host_streams for kv in layers if isinstance(kv, HierQuestKV)]
        advance_unit_streams(cache, hier, positions, PAGE)

    def counts(self, cache: HierarchicalKVCache, layers: list) -> tuple[int, int]:
        """(hits, misses) over every Quest layer; a shared layer counts its anchor's, whose pages it copies."""
        return stream_counts(cache, [kv.streams if kv.anchor_streams is None else kv.anchor_streams
                                     for kv in layers if isinstance(kv, HierQuestKV)])

    def kv_bytes(self, layers: list, cache: HierarchicalKVCache | None) -> float:
        """The dense layers' keys, values and bounds, the Quest layers' bounds, and their resident
        pages or the hot slots with the cache state."""
        total = 0
        for kv in layers:
            if isinstance(kv, PagedKV):
                total += nbytes(kv.keys, kv.values, kv.page_min, kv.page_max)
            else:
                total += nbytes(kv.pool, kv.kmin, kv.kmax)
        return total + cache_bytes(cache)


# -- a serving lane's prefill in place (`QuestRuntime.lane_prefill`; its unit helpers in hisparse/unit_lanes.py)

def paged_tensors(kv: PagedKV) -> list[torch.Tensor]:
    return [kv.keys, kv.values, kv.page_min, kv.page_max]


@dataclass
class DenseLaneView(PagedKV):
    """A dense layer's serving lane as a prefill into it sees it: views of the lane's row of the
    batch's PagedKV. The other lanes' decode steps between two chunks write this lane too, an empty
    one to them, at its length 0 (`hisparse.serving` decodes empty lanes at length 0, and the
    model's PagedKV has no lane mask, unlike QuestKV), so the prefill's first token is kept here and
    put back before each later chunk writes and reads the lane (its first page's bounds are remade
    at the join)."""

    first_token: tuple[torch.Tensor, torch.Tensor] | None = None     # key, value [1, HKV, D]

    def write(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, page_size: int) -> None:
        if self.first_token is not None:
            self.keys[:, :, 0], self.values[:, :, 0] = self.first_token
        super().write(positions, keys, values, page_size)
        if self.first_token is None:
            self.first_token = self.keys[:, :, 0].clone(), self.values[:, :, 0].clone()


def quest_workspace(model, layer: int, tokens: int, device, dtype=None) -> PagedKV:
    """The model's own PagedKV of one request for a Quest layer, `tokens` long (a lane prefill's workspace)."""
    dtype = dtype or model.model.embed_tokens.weight.dtype
    return model.model.layers[layer].self_attn.new_kv(1, tokens, device, dtype)


class QuestLanePrefill:
    """One request's prefill into serving lane `lane` (`QuestRuntime.lane_prefill`; the contract of
    `hisparse.dsa.runtime.LanePrefill`): `state` is what the model's prefill runs on;
    `chunk_done(start, end)` after each chunk; `join()` when the prompt is done; `cancel()` if it
    will not join. The lane ends bitwise as `gather_layers` of the prefilled request would make it.

    Dense layers prefill straight into the lane (`DenseLaneView`; after each chunk the bounds of
    the pages it touched are remade from the lane's keys, as `gather_layer` makes them). Quest
    layers prefill into a workspace of the prompt's length, the model's PagedKV (the prefill's
    attention reads the whole prefix); after each chunk the pages it touched go to the lane
    (resident pool rows) or to the request's streams in the host pool (a page the previous chunk
    left partial rewritten whole), and their bounds into the lane's kmin / kmax. The lane is zeroed
    first, so what a former request left past this one's tokens is gone, as in a gathered lane."""

    def __init__(self, runtime: QuestRuntime, mode: str, cache: HierarchicalKVCache | None, layers: list, lane: int,
                 prompt: int, host_tokens: int, runs: list[int] | None = None,
                 shared_pages: list[list[int]] | None = None):
        self.layers, self.lane = layers, lane
        self.heads = runtime.kv_heads
        self.shared = len(shared_pages[0]) * cache.page_rows if shared_pages else 0   # units on shared pages
        self.quest = [i for i, kv in enumerate(layers) if isinstance(kv, QuestKV)]
        self.lanes = self._lane_count(layers[0])
        self.runs = runs
        self.run_of = unit_lanes.lane_runs(cache, self.quest, self.heads, runs)   # hybrid, resident: layer -> its runs
        for kv in layers:
            unit_lanes.zero_lane(self._lane_parts(kv), lane, self.lanes)
        device = runtime.model.model.embed_tokens.weight.device
        prefilled = [quest_workspace(runtime.model, i, prompt, device) if i in self.quest   # Quest: workspace
                     else DenseLaneView(*(t[lane:lane + 1] for t in paged_tensors(kv)))   # dense: the lane
                     for i, kv in enumerate(layers)]
        self.streams: dict[int, list[int]] = {}        # Quest layer -> the request's stream per KV head
        if mode != "resident" and runs is None:
            self.streams = unit_lanes.open_lane_streams(cache, self.quest, self.heads, triton.cdiv(host_tokens, PAGE),
                                                        shared_pages)
        self.cache = cache
        self.state = DecodeState(prefilled, prompt, torch.zeros(1, dtype=torch.int64, device=device))

    def _lane_count(self, kv) -> int:
        if isinstance(kv, PagedKV):
            return kv.keys.shape[0]
        if isinstance(kv, HierQuestKV):
            return kv.streams.shape[0]
        return kv.pool.shape[0] // (self.heads * kv.max_pages)

    @staticmethod
    def _lane_parts(kv) -> list:
        """The per-lane tensors of a layer state (not the cache's, not the streams)."""
        if isinstance(kv, PagedKV):
            return paged_tensors(kv)
        return [kv.pool, kv.kmin, kv.kmax]

    @property
    def workspace_bytes(self) -> int:
        if self.state is None:
            return 0
        return sum(nbytes(*paged_tensors(self.state.layers[i])) for i in self.quest)

    def adopt(self, rows: Rows, prompt: int) -> None:
        """The prompt's keys and values as a prefill elsewhere made them (`prefilled_rows`): written
        into the workspace as the model writes them, then placed as one chunk."""
        device = self.state.lengths.device
        positions = torch.arange(prompt, device=device)[None]
        for i, kv in enumerate(self.state.layers):
            keys, values = (t[None, :, :prompt].to(device) for t in rows(0, i))
            kv.write(positions, keys, values, PAGE)
        self.chunk_done(0, prompt)

    def chunk_done(self, start: int, end: int) -> None:
        """The pages prompt tokens start .. end - 1 touched, from the workspace into the lane or the
        host pool, with their bounds."""
        first, last = start // PAGE, triton.cdiv(end, PAGE)
        span = torch.tensor([end - first * PAGE], dtype=torch.int32, device=self.state.lengths.device)
        for i, (work, kv) in enumerate(zip(self.state.layers, self.layers)):
            keys, values = work.keys[:, :, first * PAGE:end], work.values[:, :, first * PAGE:end]
            if isinstance(kv, PagedKV):          # a view of the lane: its bounds as `gather_layer` makes them
                low, high = quest_metadata_from_keys(keys, span, last - first)     # [1, HKV, pages, D]
                kv.page_min[self.lane, :, first:last], kv.page_max[self.lane, :, first:last] = low[0], high[0]
                continue
            if kv.kmin is not None:
                low, high = quest_metadata_from_keys(keys, span, last - first)
                kv.kmin[self.lane, :, first:last], kv.kmax[self.lane, :, first:last] = low[0], high[0]
            rows = pages_from_tokens(keys, values, last - first).view(self.heads, last - first, 2, PAGE, -1)
            if i in self.run_of:            # hybrid, resident: the resident pool's layout, in the runs
                for first_stream, head_rows in zip(self.run_of[i], rows):
                    run_rows(self.cache, first_stream)[first:last] = head_rows.reshape(last - first, -1)
                continue
            unit_lanes.store_lane_units(kv, self.lane, self.lanes, first, rows, kv.max_pages, self.streams.get(i),
                                        self.shared)

    def join(self) -> None:
        """The dense layers' first page bounds remade (see `DenseLaneView`), and the request's streams
        into its lane (hierarchical modes; the lane holds the rest already)."""
        first_page = min(PAGE, self.state.capacity)
        span = torch.tensor([first_page], dtype=torch.int32, device=self.state.lengths.device)
        for view, kv in zip(self.state.layers, self.layers):
            if isinstance(view, DenseLaneView):
                low, high = quest_metadata_from_keys(view.keys[:, :, :first_page], span, 1)
                kv.page_min[self.lane, :, :1], kv.page_max[self.lane, :, :1] = low[0], high[0]
        unit_lanes.join_lane_streams(self.layers, self.lane, self.streams)
        unit_lanes.join_lane_runs(self.cache, self.layers, self.lane, self.run_of)
        self.state = None

    def cancel(self) -> None:
        """Give back the streams (or runs) of a prefill that will not join."""
        unit_lanes.close_lane_streams(self.cache, self.streams)
        for first in self.runs or []:
            self.cache.release_run(first)
        self.streams, self.runs, self.run_of, self.state = {}, None, {}, None

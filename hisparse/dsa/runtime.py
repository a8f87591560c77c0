"""The DSA decode step through the Triton kernels, with the MLA latents resident or hierarchical.

`KernelDsaAttention` replaces `DsaModel.sparse_attention` (the torch reference step in
`hisparse.dsa.reference`). Both modes run the same indexer, the same top-k and the same
`sparse_mla_decode`, reading the same rows in the same order; only where the rows sit differs:
- `resident`: every latent of every request on the GPU (`MlaKV.latent [B, capacity, D]`);
- `hisparse` / `noio`: latents in the host pool of a `HierarchicalKVCache`, one stream per
  (request, layer); each step resolves the selection to GPU slots first (`noio` skips the copy:
  the oracle, whose outputs are wrong but whose time is the upper bound).
The indexer keys stay resident in every mode (DESIGN section 5). With kv_dtype "fp8" every stored
latent row (resident pool, host pool, hot slots) is hisparse.dsa.fp8's 656-byte uint8 row, quantised
where it is written; the cache moves them as bytes, and decode reads them through the FP8 kernel.
With index_dtype "fp8" every stored indexer key (lanes, prefill states, hybrid batches) is
hisparse.dsa.fp8_index's uint8 key of Di + 4 bytes, quantised where it is written, scored by the
FP8 indexer kernels in every mode.

Selections can be recorded (`recorded`, filled by every layer's `attend`) and replayed from a
trace instead of the indexer (`replay_sel`): the system does not depend on where selections come
from, so a trace with realistic locality drives it with realistic hit rates.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hisparse.cache import HierarchicalKVCache
from hisparse.dsa import fp8, fp8_index
from hisparse.dsa.ops import DECODE_BACKENDS
from hisparse.dsa.reference import MlaKV
from hisparse.models.base import DecodeState
from hisparse.resolve import CacheState
from hisparse.runtime import (
    KV_MODES,
    LaneStates,
    Rows,
    UnitResolver,
    cache_bytes,
    nbytes,
    read_pages,
    run_rows,
    shared_states,
    stream_counts,
    token_slices,
)

__all__ = ["KV_MODES", "DsaRuntime", "HierMlaKV", "KernelDsaAttention"]

@dataclass
class HierMlaKV(MlaKV):
    """A layer's KV with the latents in the hierarchical cache: `latent` is None; `streams [B]`
    int32 are the rows' streams in `cache` (`host_streams` the same ids on the host), and
    `row_base [B]` int64 the row of each stream's slot 0 in `cache.gpu_rows` (the slots viewed as rows);
    `index_keys [B, capacity, Di]` (and FP8 keys' `index_scales [B, capacity]`) stay resident.

    A shared layer (one that reuses an anchor layer's selection) moves in lockstep with its anchor:
    `anchor_layer` and `anchor_streams` name the anchor, whose slot maps place its rows too, and
    `prefetched` is the event its layer-wise prefetch copy records, when prefetch is on."""

    streams: torch.Tensor | None = None
    row_base: torch.Tensor | None = None
    cache: HierarchicalKVCache | None = None
    host_streams: list[int] = field(default_factory=list)
    anchor_layer: int | None = None
    anchor_streams: torch.Tensor | None = None
    prefetched: torch.cuda.Event | None = None
    newest: tuple | None = None                # an anchor's (units [B], rows [B, D]) its resolve writes
    # hybrid (serving, and the fixed-batch engine): [B] bool, the lanes whose latents are all on the GPU,
    # token t at row row_base + t of `cache.gpu_rows` (in a run of the cache's streams); their streams are -1
    resident: torch.Tensor | None = None
    # hybrid, host side: every lane holding a request is resident in this step (set before an eager
    # step or a graph's capture), so the step skips the hierarchical write and the resolve; the
    # engine's all-resident batch sets it for the whole run
    resident_step: bool = False

    def write(self, positions: torch.Tensor, latent: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Decode-step write (positions [B, 1]): the latent goes to the host pool, the reserved slot
        and any cached copy (quantised first where the cache holds FP8 rows, uint8); the indexer key
        stays on the GPU. A selection that holds the newest token then fetches its row from the host
        like any miss. An anchor layer leaves the latent to its resolve, which writes it first in the
        same launch (`newest`). A prefetched shared layer
        first waits for its copy, so the write-through of the newest row lands after (not under) the
        copy."""
        if positions.shape[1] != 1:
            raise ValueError("a hierarchical state takes one token per row; prefill runs on a resident state")
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        if index_keys is not None:
            self.write_index_keys(rows, positions, index_keys)
        if self.cache.slots.dtype == torch.uint8:
            latent = fp8.to_rows(latent)
        if self.resident is not None:           # resident lanes: at their rows
            pool, trash = self.cache.gpu_rows, self.cache.trash_row
            if trash is not None:     # serving: the others to the cache's trash row, which nothing reads
                pool[torch.where(self.resident, self.row_base + positions[:, 0], trash)] = latent[:, 0]
            else:         # the fixed-batch engine (no empty lane, no prefill beside a step): what is there
                at = torch.where(self.resident, self.row_base + positions[:, 0], 0)
                pool[at] = torch.where(self.resident[:, None], latent[:, 0], pool[at])
            if self.resident_step:
                return
        if self.anchor_layer is None:
            if self.newest is not None:
                raise RuntimeError("the last step's newest latents were never written: an anchor layer's "
                                   "write must be followed by its resolve (KernelDsaAttention)")
            self.newest = positions[:, 0].to(torch.int64), latent[:, 0].contiguous()
            return
        if self.prefetched is not None:
            torch.cuda.current_stream().wait_event(self.prefetched)
        self.cache.write_newest(self.streams, positions[:, 0], latent[:, 0].contiguous(), self.anchor_streams)


class KernelDsaAttention(UnitResolver):
    """`select` and `attend` of the DSA decode step (the contract of `TorchDsaAttention`).

    check_values, shared, prefetch: as `hisparse.runtime.UnitResolver` (resolve counters in
    `cache.stats`, anchor layers only; shared layers replay their anchor's miss plan, in line or on
    the prefetch side stream, so the copy overlaps the layers in between: DESIGN section 4).
    replay_sel [layers, B, k] int32: when set, selections come from it instead of the indexer (the
    caller fills it from a trace before each step). `recorded[layer]` holds the selection each
    layer attended over in the last step. Rows are read as stored: uint8 FP8 rows through the FP8
    kernels (`fp8.sparse_mla_decode_stored`), others through the bf16 ones, each picked by `backend`.
    """

    family = "DSA"

    def __init__(self, mode: str = "resident", check_values: bool = True, prefetch: bool = False,
                 shared: dict[int, list[HierMlaKV]] | None = None, prefetch_programs: int | None = None,
                 backend: str = "auto"):
        super().__init__(mode, check_values, prefetch, shared, prefetch_programs)
        if backend not in DECODE_BACKENDS:
            raise ValueError(f"decode backend {backend!r}: expected one of {DECODE_BACKENDS}")
        self.backend = backend
        self._bases: dict[tuple, torch.Tensor] = {}

    def select(self, layer_idx: int, index_q: torch.Tensor, index_weights: torch.Tensor, kv: MlaKV,
               lengths: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
        if self.replay_sel is not None:
            selection = self.replay_sel[layer_idx]
        else:
            # relu(scale * q.k) = scale * relu(q.k) for scale > 0: fold the scale into the head weights
            selection = fp8_index.select_stored(index_q, index_weights * scale, kv.index_keys, lengths, topk,
                                                kv.index_scales)
        return selection

    def attend(self, layer_idx: int, q_latent: torch.Tensor, q_rope: torch.Tensor, kv: MlaKV,
               lengths: torch.Tensor, selection: torch.Tensor, scale: float) -> torch.Tensor:
        q = torch.cat([q_latent, q_rope], dim=-1)                            # [B, H, Dc + Dr]
        selection = self.lane_masked(selection.to(torch.int32))
        self.recorded[layer_idx] = selection
        # rows index each request's own region of the pool (row_base): its slots, or its token ids
        if isinstance(kv, HierMlaKV):
            if kv.resident is None:
                rows = self._slots(layer_idx, kv, selection)
            elif kv.resident_step:      # no hierarchical lane: nothing to resolve (empty lanes' are -1)
                rows = selection
            else:           # resolve the hierarchical lanes only; a resident lane's selection is its rows
                keep = kv.resident[:, None]
                rows = torch.where(keep, selection, self._slots(layer_idx, kv, torch.where(keep, -1, selection)))
            row_base = kv.row_base
            pool = kv.cache.gpu_rows
        else:
            batch, capacity, _ = kv.latent.shape
            rows, row_base = selection, self._resident_base(batch, capacity, selection.device)
            pool = kv.latent.view(-1, kv.latent.shape[-1])
        return fp8.sparse_mla_decode_stored(q, pool, rows, scale, d_v=q_latent.shape[-1], row_base=row_base,
                                            backend=self.backend)

    def _resident_base(self, batch: int, capacity: int, device) -> torch.Tensor:
        """Row of token 0 of each request in the resident latents [B, capacity, D] viewed as rows;
        made once (in the warm-up step, before any capture) and reused by every layer."""
        key = (batch, capacity, device)
        if key not in self._bases:
            self._bases[key] = torch.arange(batch, dtype=torch.int64, device=device) * capacity
        return self._bases[key]


# -- the engine's DSA side (a `hisparse.runtime.FamilyRuntime`) -------------------------------------

class DsaRuntime:
    """DSA models (deepseek_v32, glm_moe_dsa) in the engine: one stream per (request, layer) whose
    units are tokens (rows: the 576-value MLA latent at DeepSeek's sizes), k = index_topk. A
    "shared" layer (glm_moe_dsa) reuses its anchor's selection: its streams move in lockstep with
    the anchor's (no resolve of their own) and replay its miss plan, in line or, with prefetch, on
    a side stream. kv_dtype: how a latent row is stored (`fp8.KV_DTYPES`): "bf16", the 576 values in
    the model's dtype, or "fp8", a 656-byte uint8 row (`row_elems`, `row_dtype`), in the prefill's
    state, the resident pool, the host pool and the hot slots alike. index_dtype: how an indexer key is
    stored (`fp8_index.INDEX_DTYPES`): "bf16", in the model's dtype, or "fp8", DeepSeek-V3.2's e4m3
    key [.., Di] and its float32 scale [..] in two arrays, Di + 4 bytes a token (`index_row_bytes`),
    wherever keys are held. A layer's rows (`Rows`) are (latents, index keys, their scales), the
    keys and scales None on shared layers, the scales None unless FP8."""

    family = "DSA"
    selection_name = "index_topk"
    unit_size, kv_heads, dense_layers = 1, None, 0
    # hybrid serving: a hierarchical prefill's workspace (its latents) sits in runs of the spare streams
    workspace_in_runs = True
    # serving: an empty lane's decode write lands at its lane's last position (MlaKV.lanes), so a prefill
    # may fill a lane beside the steps; hybrid's non-resident lanes write the cache's trash row
    prefill_beside_decode, hybrid_trash_row = True, True
    shares_prefixes = True          # its lane prefill opens streams on a cached prefix's pages (serving.sharing)
    prefill_depends_on_chunks = False
    row_token_dims = (0, 1, 1)      # latents [T, W], keys [1, T, Di], scales [1, T]

    def __init__(self, model, token_budget: int | None = None, decode_backend: str = "auto",
                 kv_dtype: str = "bf16", index_dtype: str = "bf16"):
        if token_budget is not None:
            raise ValueError("token_budget applies to Quest models; a DSA model selects index_topk tokens")
        if decode_backend not in DECODE_BACKENDS:
            raise ValueError(f"decode_backend={decode_backend!r}: expected one of {DECODE_BACKENDS}")
        cfg = model.config
        if fp8.check_kv_dtype(kv_dtype) == "fp8":
            fp8.check_fp8_geometry(cfg)
            fp8.check_fp8_backend(decode_backend)
            self.row_elems, self.row_dtype = fp8.ROW_BYTES, torch.uint8
        else:
            self.row_elems = cfg.kv_lora_rank + cfg.qk_rope_head_dim
            self.row_dtype = model.model.embed_tokens.weight.dtype
        self.model, self.decode_backend, self.kv_dtype = model, decode_backend, kv_dtype
        self.index_dtype = fp8_index.check_index_dtype(index_dtype)
        self.index_row_bytes = fp8_index.stored_index_bytes(cfg.index_head_dim, model.model.embed_tokens.weight
                                                            .element_size(), index_dtype)
        self.selection_size = model.config.index_topk
        self.shared_layers = "shared" in model.config.indexer_types     # prefetch has layers to serve
        self.anchors, last_full = [], 0
        for i, kind in enumerate(model.config.indexer_types):
            last_full = i if kind == "full" else last_full
            self.anchors.append(last_full)

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored latent row: 1152 at DeepSeek's sizes in bf16, 656 in fp8."""
        return self.row_elems * self.row_dtype.itemsize

    def new_state(self, batch: int, capacity: int) -> DecodeState:
        """The model's empty state for a prefill, its latents stored as this runtime's rows."""
        return self.model.new_state(batch, capacity, kv_dtype=self.kv_dtype, index_dtype=self.index_dtype)

    def random_rows(self, prompts: list[torch.Tensor], device: torch.device) -> Rows:
        """rows(b, layer) -> random (latents [len, D] as stored (FP8 rows quantised), index keys
        [1, len, Di] and scales [1, len] as stored (FP8 keys quantised, else scales None) on anchor
        layers, else None, None)."""
        cfg, dtype = self.model.config, self.model.model.embed_tokens.weight.dtype
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim

        def rows(b: int, layer: int):
            n = len(prompts[b])
            keys = scales = None
            if cfg.indexer_types[layer] == "full":
                keys = torch.randn(1, n, cfg.index_head_dim, device=device, dtype=dtype)
                if self.index_dtype == "fp8":
                    keys, scales = fp8_index.quantize_keys(keys)
            latent = torch.randn(n, width, device=device, dtype=dtype)
            return (fp8.to_rows(latent) if self.kv_dtype == "fp8" else latent), keys, scales

        return rows

    def prefilled_rows(self, states: list[DecodeState]) -> Rows:
        return lambda b, i: (states[b].layers[i].latent[0], states[b].layers[i].index_keys,
                             states[b].layers[i].index_scales)

    def prefix_rows(self, rows: tuple, start: int, end: int, first: int = 0) -> tuple:
        return token_slices(rows, self.row_token_dims, start - first, end - first)

    def shared_page_parts(self, layer: int) -> tuple:
        return (0,)                 # a host row is a token's latent

    def shared_rows(self, cache: HierarchicalKVCache, pages: list[list[int]]) -> dict[int, tuple]:
        """Each layer's latents [T, W] from its stream's pages (a stream a layer)."""
        return {layer: (read_pages(cache, stream_pages), None, None)
                for layer, stream_pages in enumerate(pages)}

    def new_cache(self, batch: int, capacity: int, cache_slots: int) -> HierarchicalKVCache:
        layers, weight = self.model.config.num_hidden_layers, self.model.model.embed_tokens.weight
        return HierarchicalKVCache(max_streams=batch * layers, cache_slots=cache_slots,
                                   host_rows=batch * layers * capacity, row_elems=self.row_elems,
                                   dtype=self.row_dtype, device=weight.device)

    def gather_layers(self, mode, cache, rows: Rows, lengths, capacity: int, prefetch: bool,
                      host_tokens: int | None = None) -> list:
        layers = []
        for i, anchor in enumerate(self.anchors):
            parts = [rows(b, i) for b in range(len(lengths))]
            layers.append(self._gather_layer(mode, cache, i, parts, lengths, capacity,
                                             layers[anchor] if anchor != i else None, prefetch,
                                             host_tokens or capacity))
        return layers

    def stream_regions(self, tokens: int) -> list[int]:
        """Host units of each stream of one request of `tokens` tokens (one stream a layer)."""
        return [tokens] * self.model.config.num_hidden_layers

    def _gather_layer(self, mode, cache, layer: int, parts, lengths, capacity: int, anchor: MlaKV | None,
                      prefetch: bool, host_tokens: int) -> MlaKV:
        """One layer's batch state from per-request (latents [len, D], index keys [1, len, Di] | None,
        their scales [1, len] | None)."""
        batch = len(lengths)
        latent = parts[0][0]
        index_keys, index_scales = _index_keys(parts, lengths, capacity)
        if mode == "resident":
            pool = latent.new_zeros(batch, capacity, latent.shape[-1])
            for b, (lat, *_) in enumerate(parts):
                pool[b, :lengths[b]] = lat
            return MlaKV(latent=pool, index_keys=index_keys, index_scales=index_scales)
        streams = []
        for lat, *_ in parts:
            stream = cache.open_stream(host_tokens)
            cache.append(stream, lat)
            streams.append(stream)
        ids = torch.tensor(streams, dtype=torch.int32, device=latent.device)
        kv = HierMlaKV(latent=None, index_keys=index_keys, index_scales=index_scales, cache=cache,
                       host_streams=streams, streams=ids,
                       row_base=cache.row_base(ids))
        if anchor is not None:
            kv.anchor_layer, kv.anchor_streams = self.anchors[layer], anchor.streams
            if prefetch and mode == "hisparse" and latent.is_cuda:
                kv.prefetched = torch.cuda.Event()
        return kv

    # -- hybrid in the fixed-batch engine: the first requests resident in one run, the others hierarchical --

    def hybrid_run_streams(self, resident: int, capacity: int, cache_slots: int) -> int:
        """Run-only streams of a hybrid engine batch: `resident` requests' latents packed in one run,
        `capacity` rows per (request, layer), rounded up to whole streams of B + 1 rows."""
        rows = resident * self.model.config.num_hidden_layers * capacity
        return -(-rows // (cache_slots + 1))

    def hybrid_bytes(self, resident: int, hierarchical: int, capacity: int, cache_slots: int) -> int:
        """GPU bytes of a hybrid engine batch as `new_hybrid_cache` and `gather_hybrid` allocate them
        (what `kv_bytes` then measures): every request's indexer keys (anchor layers); per hierarchical
        request one stream a layer (B + 1 slots and their LRU state) and a 4-byte slot map entry per host
        row; the resident requests' latents in one run of streams without cache state (`capacity` rows
        per request and layer, less than B + 1 rows more than resident mode's in all)."""
        cfg = self.model.config
        anchors = sum(1 for t in cfg.indexer_types if t == "full")
        index = (resident + hierarchical) * anchors * capacity * self.index_row_bytes
        streams = hierarchical * cfg.num_hidden_layers
        host_rows = max(1, streams * capacity)
        state = CacheState.empty(streams, cache_slots, host_rows, "meta")
        rows = (streams + self.hybrid_run_streams(resident, capacity, cache_slots)) * (cache_slots + 1)
        return index + rows * self.row_bytes + nbytes(*state.tensors())

    def hybrid_placement(self, batch: int, capacity: int, cache_slots: int, kv_budget: int,
                         host_rows: int | None = None) -> int | None:
        """Resident requests of a hybrid batch of `batch` requests of `capacity` tokens: the most whose
        placement (`hybrid_bytes`, the rest hierarchical) fits `kv_budget` GPU bytes, with the
        hierarchical ones' latents within `host_rows` host rows where given; None when none fits."""
        layers = self.model.config.num_hidden_layers
        for resident in range(batch, -1, -1):
            hierarchical = batch - resident
            if host_rows is not None and hierarchical * layers * capacity > host_rows:
                return None                 # fewer resident requests need more host rows still
            if self.hybrid_bytes(resident, hierarchical, capacity, cache_slots) <= kv_budget:
                return resident
        return None

    def new_hybrid_cache(self, resident: int, hierarchical: int, capacity: int,
                         cache_slots: int) -> HierarchicalKVCache:
        """The cache of a hybrid engine batch: a stream with cache state per (hierarchical request,
        layer), a host region each, and `hybrid_run_streams` run-only streams for the resident ones."""
        layers, weight = self.model.config.num_hidden_layers, self.model.model.embed_tokens.weight
        return HierarchicalKVCache(max_streams=hierarchical * layers, cache_slots=cache_slots,
                                   host_rows=max(1, hierarchical * layers * capacity), row_elems=self.row_elems,
                                   dtype=self.row_dtype, device=weight.device,
                                   run_only_streams=self.hybrid_run_streams(resident, capacity, cache_slots))

    def gather_hybrid(self, cache: HierarchicalKVCache, rows: Rows, lengths, capacity: int,
                      resident: int) -> list[HierMlaKV]:
        """A hybrid engine batch's layers (cache: `new_hybrid_cache`): requests 0 .. resident - 1
        resident, request j's layer i at rows base + (j * layers + i) * capacity of the cache's one run
        (row_base there, streams -1, `resident` True); the others hierarchical as in hisparse (one
        stream a layer, every latent in the host pool). All resident: every step is the resident one
        (`resident_step`: no resolve, no hierarchical write); none resident: hisparse's (`resident` None)."""
        batch, layers = len(lengths), len(self.anchors)
        host = [[cache.open_stream(capacity) for _ in range(resident, batch)] for _ in range(layers)]
        base = 0
        if resident:        # after the streams are open: the run is then the run-only streams
            first = cache.take_runs(self.hybrid_run_streams(resident, capacity, cache.cache_slots))
            if first is None or first[0] < cache.state_streams:
                raise RuntimeError(f"the hybrid cache's run-only streams hold no run of {resident} resident "
                                   f"requests (got {first}): make the cache with new_hybrid_cache")
            base = int(cache.row_base(torch.tensor(first))[0])
        out = []
        for i, anchor in enumerate(self.anchors):
            parts = [rows(b, i) for b in range(batch)]
            bases = [base + (j * layers + i) * capacity for j in range(resident)]
            for j in range(resident):
                cache.gpu_rows[bases[j]:bases[j] + int(lengths[j])] = parts[j][0]
            for stream, (latent, *_) in zip(host[i], parts[resident:]):
                cache.append(stream, latent)
            device = cache.gpu_rows.device
            ids = [-1] * resident + host[i]
            index_keys, index_scales = _index_keys(parts, lengths, capacity)
            kv = HierMlaKV(latent=None, index_keys=index_keys, index_scales=index_scales, cache=cache,
                           host_streams=ids, streams=torch.tensor(ids, dtype=torch.int32, device=device),
                           row_base=torch.tensor(bases + [s * (cache.cache_slots + 1) for s in host[i]],
                                                 dtype=torch.int64, device=device))
            if anchor != i:
                kv.anchor_layer, kv.anchor_streams = anchor, out[anchor].streams
            if resident:
                kv.resident = torch.arange(batch, device=device) < resident
                kv.resident_step = resident == batch
            out.append(kv)
        return out

    def lane_prefill(self, mode: str, cache: HierarchicalKVCache | None, layers: list, lane: int, prompt: int,
                     host_tokens: int, runs: list[int] | None = None,
                     workspace_runs: list[int] | None = None, shared_pages: list[list[int]] | None = None) -> "LanePrefill":
        """A serving lane's prefill in place (`hisparse.serving`): the model's prefill writes the
        indexer keys (and, resident, the latents) straight into lane `lane` of the batch `layers`;
        hierarchical latents go to a workspace of the prompt's length and, chunk by chunk, to the
        request's streams (opened now with `host_tokens` units each). Nothing is copied at the join.
        runs: a hybrid lane kept resident, its latents written straight into these runs of the cache's
        streams (one per layer, `take_runs`) and read from there. workspace_runs: a hybrid lane's
        hierarchical prefill, its workspace in these runs (given back at the join). shared_pages: per
        layer, host pages of a cached prefix its streams open on (`hisparse.serving.sharing`)."""
        return LanePrefill(self, mode, cache, layers, lane, prompt, host_tokens, runs, workspace_runs, shared_pages)

    # -- hybrid serving: a lane resident in a run of the cache's streams, or hierarchical ------------

    def run_streams(self, cache: HierarchicalKVCache, capacity: int) -> int:
        """Streams of a run that holds `capacity` tokens of one layer (B + 1 rows a stream)."""
        return -(-capacity // (cache.cache_slots + 1))

    def runs_per_request(self) -> int:
        """Runs a resident request holds, one per stream it has when hierarchical: one a layer."""
        return self.model.config.num_hidden_layers

    def take_runs(self, cache: HierarchicalKVCache, capacity: int) -> list[int] | None:
        """One run of `capacity` tokens per layer (first stream ids), or None (nothing taken)."""
        return cache.take_runs(self.run_streams(cache, capacity), self.runs_per_request())

    def demote(self, cache: HierarchicalKVCache, layers: list, lane: int, length: int, host_tokens: int,
               runs: list[int]) -> None:
        """A resident hybrid lane becomes hierarchical between steps: per layer its run goes back and a
        stream with a host region of `host_tokens` units gets the run's first `length` rows (bytes as
        stored, so every later read is the same value; the stream may reuse the run's own streams,
        whose rows are read before anything is written there); the lane reads through its streams
        from the next step, their caches empty. ValueError, before anything changes, when the host
        pool cannot hold the regions."""
        if not cache.fits([host_tokens] * len(layers)):
            raise ValueError(f"demoting lane {lane} needs {len(layers)} host regions of {host_tokens} rows; "
                             f"the host pool has {cache.host.free_rows} rows free")
        pool = cache.gpu_rows
        for kv, first in zip(layers, runs):
            base = int(cache.row_base(torch.tensor([first]))[0])
            cache.release_run(first)
            stream = cache.open_stream(host_tokens)
            cache.append(stream, pool[base:base + length])
            kv.resident[lane] = False
            kv.streams[lane] = stream
            kv.row_base[lane] = int(cache.row_base(torch.tensor([stream]))[0])
            kv.host_streams[lane] = stream

    def lane_workspace_bytes(self, mode: str, tokens: int) -> int:
        """GPU bytes a `lane_prefill` of `tokens` holds beside the lanes: the hierarchical modes' latents."""
        if mode == "resident":
            return 0
        return self.model.config.num_hidden_layers * tokens * self.row_bytes

    def serving_lanes(self, layers: list, mask: torch.Tensor | None = None) -> LaneStates:
        """The lanes of a serving batch's layers; each keeps an empty lane's decode write (`MlaKV.lanes`)."""
        for kv in layers if mask is not None else []:
            kv.lanes = mask
        return LaneStates([kv for kv in layers if isinstance(kv, HierMlaKV) and kv.streams is not None])

    def attention(self, mode: str, layers: list, check_values: bool, prefetch: bool,
                  prefetch_programs: int | None = None) -> KernelDsaAttention:
        return KernelDsaAttention(mode, check_values=check_values, prefetch=prefetch,
                                  shared=shared_states(layers, HierMlaKV), prefetch_programs=prefetch_programs,
                                  backend=self.decode_backend)

    def advance_streams(self, cache: HierarchicalKVCache, layers: list, positions: list[int]) -> None:
        """Every step writes one more token, a unit, into every stream (-1: an empty serving lane)."""
        cache.advance([s for kv in layers for s in kv.host_streams if s >= 0], 1)

    def counts(self, cache: HierarchicalKVCache, layers: list) -> tuple[int, int]:
        """(hits, misses) over every layer; a shared layer counts its anchor's, whose rows it copies."""
        streams = [kv.streams if kv.anchor_streams is None else kv.anchor_streams for kv in layers]
        return stream_counts(cache, [s[s >= 0] for s in streams])      # a resident lane's are -1

    def kv_bytes(self, layers: list, cache: HierarchicalKVCache | None) -> float:
        """The resident indexer keys (and FP8 keys' scales), plus the resident latents or the hot
        slots with their LRU state and unit -> slot map (4 bytes per unit)."""
        total = sum(nbytes(kv.index_keys, kv.index_scales) for kv in layers)
        if cache is not None:
            return total + cache_bytes(cache)
        return total + sum(nbytes(kv.latent) for kv in layers)


def _index_keys(parts, lengths, capacity: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A layer's indexer keys [B, capacity, Di] and scales [B, capacity] (FP8 keys, else None) from
    per-request (latents, keys [1, len, Di] | None, scales [1, len] | None)."""
    _, keys, scales = parts[0]
    if keys is None:
        return None, None
    index_keys = keys.new_zeros(len(parts), capacity, keys.shape[-1])
    index_scales = None if scales is None else scales.new_zeros(len(parts), capacity)
    for b, (_, k, sc) in enumerate(parts):
        index_keys[b, :lengths[b]] = k[0]
        if index_scales is not None:
            index_scales[b, :lengths[b]] = sc[0]
    return index_keys, index_scales


class LanePrefill:
    """One request's prefill into serving lane `lane` (`DsaRuntime.lane_prefill`): `state` is what the
    model's prefill runs on; `chunk_done(start, end)` after each chunk; `join()` when the prompt is done."""

    def __init__(self, runtime: DsaRuntime, mode: str, cache, layers: list, lane: int, prompt: int,
                 host_tokens: int, runs: list[int] | None = None, workspace_runs: list[int] | None = None,
                 shared_pages: list[list[int]] | None = None):
        self.mode, self.cache, self.layers, self.lane, self.runs = mode, cache, layers, lane, runs
        self.workspace_runs = workspace_runs
        if runs is not None:            # a hybrid lane kept resident: its latents live in its runs
            mode = self.mode = "resident"
        views = []
        for i, kv in enumerate(layers):
            keys = {name: None if t is None else t[lane:lane + 1]       # the lane's own rows: views
                    for name, t in (("index_keys", kv.index_keys), ("index_scales", kv.index_scales))}
            if runs is not None:
                views.append(MlaKV(latent=run_rows(cache, runs[i])[None], **keys))
            elif workspace_runs is not None:
                views.append(MlaKV(latent=run_rows(cache, workspace_runs[i])[None, :prompt], **keys))
            elif mode == "resident":
                views.append(MlaKV(latent=kv.latent[lane:lane + 1], **keys))
            else:                   # the rows as the cache stores them (FP8: uint8 rows, quantised by the write)
                latent = torch.empty(1, prompt, runtime.row_elems, dtype=runtime.row_dtype,
                                     device=kv.cache.slots.device)
                views.append(MlaKV(latent=latent, **keys))
        self.streams = []
        if mode != "resident":
            try:
                for i in range(len(layers)):
                    self.streams.append(cache.open_stream(host_tokens, shared_pages[i] if shared_pages else ()))
            except BaseException:
                for stream in self.streams:
                    cache.close_stream(stream)
                raise
        device = layers[0].index_keys.device if layers[0].index_keys is not None else views[0].latent.device
        self.state = DecodeState(views, prompt, torch.zeros(1, dtype=torch.int64, device=device))

    @property
    def workspace_bytes(self) -> int:
        """GPU bytes held beside the lanes and the cache (a workspace in the cache's runs is inside it)."""
        if self.mode == "resident" or self.workspace_runs is not None:
            return 0
        return sum(nbytes(kv.latent) for kv in self.state.layers)

    def chunk_done(self, start: int, end: int) -> None:
        """The latents of prompt tokens start .. end - 1 to the request's streams in the host pool."""
        for stream, kv in zip(self.streams, self.state.layers):
            if self.mode != "resident":
                self.cache.append(stream, kv.latent[0, start:end])

    def adopt(self, rows: Rows, prompt: int) -> None:
        """The prompt's rows as a prefill elsewhere made them (`prefilled_rows`, on the host): the
        indexer keys into the lane, the latents into the request's streams straight from the host
        (hierarchical) or into the lane or its runs (resident), as the chunks' `chunk_done` would.
        A prefix of the prompt (`prompt` tokens of more): its latents go to the workspace too, where
        the prefill of the rest attends to them; rows a stream holds already (shared pages) stay as they are."""
        for i, view in enumerate(self.state.layers):
            latent, keys, scales = rows(0, i)
            if view.index_keys is not None:
                view.index_keys[0, :prompt].copy_(keys[0, :prompt])
            if view.index_scales is not None:
                view.index_scales[0, :prompt].copy_(scales[0, :prompt])
            if self.mode == "resident" or prompt < view.latent.shape[1]:
                view.latent[0, :prompt].copy_(latent[:prompt])
            held = self.cache.stream_len[self.streams[i]] if self.mode != "resident" else prompt
            if held < prompt:
                self.cache.append(self.streams[i], latent[held:prompt])

    def join(self) -> None:
        """The request's streams into its lane (hierarchical modes; resident lanes already hold it)."""
        if self.runs is not None:                       # hybrid, resident: the lane reads its runs
            for first, kv in zip(self.runs, self.layers):
                kv.resident[self.lane] = True
                kv.streams[self.lane] = -1
                kv.row_base[self.lane] = self.cache.row_base(torch.tensor([first], device=kv.row_base.device))[0]
                kv.host_streams[self.lane] = -1
        for stream, kv in zip(self.streams, self.layers):
            kv.streams[self.lane] = stream
            kv.row_base[self.lane] = self.cache.row_base(torch.tensor([stream], device=kv.row_base.device))[0]
            kv.host_streams[self.lane] = stream
        for first in self.workspace_runs or []:
            self.cache.release_run(first)
        self.workspace_runs, self.state = None, None

    def cancel(self) -> None:
        """Give back the streams (or runs) of a prefill that will not join."""
        for stream in self.streams:
            self.cache.close_stream(stream)
        for first in (self.runs or []) + (self.workspace_runs or []):
            self.cache.release_run(first)
        self.streams, self.runs, self.workspace_runs, self.state = [], None, None, None

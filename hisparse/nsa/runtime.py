"""The NSA decode step through the Triton kernels, with the selection blocks resident or hierarchical.

`KernelNsaAttention` replaces `NsaModel.sparse_attention` (the torch reference step in
`hisparse.nsa.reference`). Every mode runs the same `nsa_decode` (compressed branch, block
selection, selected branch, window branch, gates), reading the same rows in the same order (DESIGN
section 6); only where the selection blocks sit differs:
- `resident`: every block of every (request, KV head) on the GPU (`NsaBlocksKV.pool`, the row
  layout of `hisparse/nsa/ops.py`: row = (n * HKV + h) * U + block, each `[2, SEL_BLOCK, D]`, keys then
  values, U = the blocks of the capacity);
- `hisparse` / `noio`: blocks in the host pool of a `HierarchicalKVCache`, one stream per (request,
  layer, KV head) whose units are 64-token blocks with those same rows; each step resolves the
  selection to GPU slots first (`noio` skips the copy: the oracle).
The compressed blocks (`[N, HKV, C, D]`) and the sliding window (a ring of the last W tokens,
token t at t % W) stay resident in every mode (DESIGN section 5).

Each decode step writes the new token's key and value into the window ring and into its block:
the resident pool's row, or (hierarchical) the newest block in the host pool, the reserved slot and
any cached copy (write-through, as Quest's newest page: `HierarchicalKVCache.write_newest_token`; the
token alone, or the whole row, zeros but for the token, when it opens a block). Then
`nsa_compress_newest` computes, from the ring, the compressed block the token completes (in the rows
where it completes one), through the layer's `compress_k` / `compress_v`. No host sync, so the step
can be captured in a CUDA graph. The engine records on the host which streams gain a block
(`NsaRuntime.advance_streams`).

Serving (`hisparse.serving`) prefills a request into its lane in place (`NsaLanePrefill`, with the
unit helpers of hisparse/unit_lanes.py, which Quest's uses too): each chunk's blocks, window tokens
and compressed blocks reach the lane or the host pool as the chunk is done; an empty lane's decode
write keeps what the lane holds (`NsaBlocksKV.lanes`). Hybrid serving keeps a lane's selection blocks
resident in runs of the cache's streams as Quest keeps its pages (hisparse/quest/runtime.py): block b
of KV head h at row `row_base[n, h] + b`; the window and compressed blocks are the lane's in every mode.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hisparse.cache import HierarchicalKVCache
from hisparse.models.base import DecodeState
from hisparse.nsa.ops import (
    CMP_BLOCK,
    CMP_STRIDE,
    SEL_BLOCK,
    block_count,
    nsa_block_rows,
    nsa_compress_newest,
    nsa_decode,
    nsa_window_ring,
)
from hisparse.nsa.reference import NsaKV, compressed_blocks
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
    token_slices,
    write_newest_unit,
    write_run_token,
)
from hisparse import unit_lanes
from hisparse.unit_lanes import UnitRowsRuntime


@dataclass
class NsaBlocksKV:
    """An NSA layer's KV for the kernels. pool [N * HKV * U, 2, SEL_BLOCK, D] (None when
    hierarchical); window_keys, window_values [N, HKV, W, D] the ring of the last W tokens;
    compressed_keys, compressed_values [N, HKV, C, D]; weight_k, weight_v [D, D] the layer's
    compress_k / compress_v weights transposed (the kernels compute mean @ weight); n_units = U.
    lanes [N] bool: serving's rows that hold a request (None outside serving): an empty lane's
    decode write changes nothing (a request may be prefilling into it: `NsaLanePrefill`)."""

    pool: torch.Tensor | None
    window_keys: torch.Tensor
    window_values: torch.Tensor
    compressed_keys: torch.Tensor
    compressed_values: torch.Tensor
    weight_k: torch.Tensor
    weight_v: torch.Tensor
    n_units: int
    lanes: torch.Tensor | None = None

    def write(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Decode-step write (positions [N, 1]) of keys, values [N, HKV, 1, D]: the window ring, the
        token's block row, then the compressed block the token completes."""
        if positions.shape[1] != 1:
            raise ValueError("an NSA decode state takes one token per row; prefill runs on the model's state")
        pos, key, value = positions[:, 0], keys[:, :, 0], values[:, :, 0]
        n, hkv, _ = key.shape
        reqs = torch.arange(n, device=pos.device)[:, None]
        heads = torch.arange(hkv, device=pos.device)[None, :]
        ring = (pos % self.window_keys.shape[2])[:, None]
        self.window_keys[reqs, heads, ring] = unit_lanes.kept_in_empty_lanes(self.lanes, key, self.window_keys[reqs, heads, ring])
        self.window_values[reqs, heads, ring] = unit_lanes.kept_in_empty_lanes(self.lanes, value,
                                                                    self.window_values[reqs, heads, ring])
        self._write_row(pos, key, value)
        lengths = pos + 1 if self.lanes is None else torch.where(self.lanes, pos + 1, 0)   # 0: no block completes
        nsa_compress_newest(self.window_keys, self.window_values, lengths, self.compressed_keys,
                            self.compressed_values, self.weight_k, self.weight_v)

    def _write_row(self, pos: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        unit_lanes.write_resident_unit_kept(self.pool, pos, key, value, SEL_BLOCK, self.n_units, self.lanes)


@dataclass
class HierNsaKV(NsaBlocksKV):
    """An NSA layer's KV with its selection blocks in the hierarchical cache: `pool` is None;
    `streams [N, HKV]` int32 are the streams of `cache` (unit = block, row = [2, SEL_BLOCK, D]
    flattened); `host_streams[n]` the same ids of request n, on the host.

    A shared layer (`selection_group` > 1: it attends over its anchor layer's blocks) moves in
    lockstep with its anchor: `anchor_layer` and `anchor_streams [N, HKV]` name the anchor, whose
    slot maps place its blocks too, and `prefetched` is the event its layer-wise prefetch copy
    records, when prefetch is on (as Quest's `HierQuestKV`). Hybrid serving: `resident`, `row_base`,
    `resident_step` as Quest's (a resident lane's blocks in runs of the cache's streams)."""

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
            pool = self.cache.gpu_rows.view(-1, 2, SEL_BLOCK, key.shape[-1])
            write_run_token(pool, self.row_base, self.resident, pos, key, value, SEL_BLOCK)
            if self.resident_step:
                return
        write_newest_unit(self, pos, key, value, SEL_BLOCK)


class KernelNsaAttention(UnitResolver):
    """`decode` of the NSA step (the contract of `TorchNsaAttention.decode`) through `nsa_decode`.

    n_select: selection blocks per KV head and step. check_values: validate selections against
    stream lengths before each resolve (a host sync; off inside a captured CUDA graph). Resolve
    counters accumulate in `cache.stats` (anchor layers only). `recorded[layer]` holds the blocks
    [N, HKV, n_select] each layer attended over in the last step. shared, prefetch: layers sharing an
    anchor's selection (`hisparse.runtime.UnitResolver`)."""

    family = "NSA"

    def __init__(self, mode: str, n_select: int, check_values: bool = True, prefetch: bool = False,
                 shared: dict[int, list[HierNsaKV]] | None = None, prefetch_programs: int | None = None):
        super().__init__(mode, check_values, prefetch, shared, prefetch_programs)
        self.n_select = n_select

    def decode(self, layer_idx: int, q: torch.Tensor, gates: torch.Tensor, kv: NsaBlocksKV,
               lengths: torch.Tensor, blocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, H, D] (roped), gates [N, H, 3] (sigmoid-ed), rows of lengths [N] -> out [N, H, D] and the
        blocks [N, HKV, n_select] it attended over: its own selection, or `blocks` when given (a layer
        sharing its anchor's selection), or a trace's when `replay_sel` is set."""
        if blocks is None and self.replay_sel is not None:
            blocks = self.replay_sel[layer_idx]
        pool, rows_of = kv.pool, None
        if isinstance(kv, HierNsaKV):
            pool = kv.cache.gpu_rows

            def rows_of(chosen: torch.Tensor) -> torch.Tensor:
                chosen = self.lane_masked(chosen)
                if kv.resident is None:
                    return self.unit_rows(layer_idx, kv, chosen)
                if kv.resident_step:    # no hierarchical lane: nothing to resolve (empty lanes' are -1)
                    return unit_lanes.run_unit_rows(kv.row_base, chosen)
                keep = kv.resident[:, None, None]      # resolve the hierarchical lanes only
                return torch.where(keep, unit_lanes.run_unit_rows(kv.row_base, chosen),
                                   self.unit_rows(layer_idx, kv, torch.where(keep, -1, chosen))).contiguous()
        elif self.lanes is not None:         # empty serving lanes read nothing, as their -1 streams do

            def rows_of(chosen: torch.Tensor) -> torch.Tensor:
                n, hkv, _ = chosen.shape
                heads = torch.arange(n * hkv, device=chosen.device, dtype=torch.int32).view(n, hkv, 1)
                chosen = self.lane_masked(chosen)
                return torch.where(chosen >= 0, heads * kv.n_units + chosen, -1).to(torch.int32).contiguous()
        out, blocks = nsa_decode(q, kv.compressed_keys, kv.compressed_values, pool, kv.window_keys,
                                 kv.window_values, lengths.to(torch.int32), gates.contiguous(), kv.n_units,
                                 rows_of=rows_of, n_select=self.n_select, blocks=blocks)
        self.recorded[layer_idx] = blocks
        return out, blocks


# -- the engine's NSA side (a `hisparse.runtime.FamilyRuntime`) -------------------------------------

def selection_size(config) -> int:
    """num_selected_blocks, once the config is checked against the sizes the kernels are built for."""
    kernel_sizes = {"compress_block_size": CMP_BLOCK, "compress_block_stride": CMP_STRIDE,
                    "selection_block_size": SEL_BLOCK}
    for name, size in kernel_sizes.items():
        if getattr(config, name) != size:
            raise ValueError(f"the NSA kernels are built for {name} {size}, the model's is {getattr(config, name)}")
    if config.sliding_window < CMP_BLOCK:
        raise ValueError(f"the NSA kernels compress new blocks from the window ring: sliding_window must be "
                         f">= {CMP_BLOCK}, the model's is {config.sliding_window}")
    return config.num_selected_blocks


class NsaRuntime(UnitRowsRuntime):
    """NSA models (model_type nsa) in the engine: k = num_selected_blocks blocks per KV head and step.
    token_budget (Quest's), decode_backend and kv_dtype (DSA's) are other families' options (every
    runtime takes the same arguments): only their defaults are accepted."""

    prefill_depends_on_chunks = True    # its prefill's rows change where the chunk boundaries move (tests)

    family = "NSA"
    selection_name = "num_selected_blocks"
    # serving: an empty lane's decode write still lands in the lane a prefill fills (NSA's window ring)
    prefill_beside_decode, hybrid_trash_row = False, False
    lane_kv, hier_kv = NsaBlocksKV, HierNsaKV
    unit_size, dense_layers = SEL_BLOCK, 0
    row_token_dims = (1, 1, 1, 1)    # prefilled rows: keys, values [HKV, T, D], compressed ones [HKV, blocks, D]

    def __init__(self, model, token_budget: int | None = None, decode_backend: str = "auto",
                 kv_dtype: str = "bf16"):
        self.refuse_dsa_options(model, decode_backend, kv_dtype)
        if token_budget is not None:
            raise ValueError("token_budget applies to Quest models; an NSA model selects num_selected_blocks "
                             "blocks")
        self.model, self.config = model, model.config
        self.selection_size = selection_size(model.config)
        self.kv_heads = model.config.num_key_value_heads
        self.anchors = [model.config.selection_anchor(i) for i in range(model.config.num_hidden_layers)]
        self.shared_layers = any(a != i for i, a in enumerate(self.anchors))   # prefetch has layers to serve

    def random_rows(self, prompts: list[torch.Tensor], device: torch.device) -> Rows:
        """rows(b, layer) -> random (keys, values [HKV, len, D], compressed keys, values [HKV, C, D])."""
        cfg, dtype = self.config, self.model.model.embed_tokens.weight.dtype

        def rows(b: int, layer: int):
            hkv, length, d = cfg.num_key_value_heads, len(prompts[b]), cfg.head_dim
            tokens, compressed = (hkv, length, d), (hkv, compressed_blocks(length, cfg), d)
            return tuple(torch.randn(shape, device=device, dtype=dtype)
                         for shape in (tokens, tokens, compressed, compressed))

        return rows

    def prefilled_rows(self, states: list[DecodeState]) -> Rows:
        def rows(b: int, layer: int):
            kv = states[b].layers[layer]
            n_cmp = compressed_blocks(kv.keys.shape[2], self.config)
            return (kv.keys[0], kv.values[0], kv.compressed_keys[0, :, :n_cmp], kv.compressed_values[0, :, :n_cmp])

        return rows

    def prefix_rows(self, rows: tuple, start: int, end: int, first: int = 0) -> tuple:
        """Tokens start .. end - 1's keys and values, and the compressed blocks complete among the
        first `end` tokens but not among the first `start` (a block straddling `end` is the rest's)."""
        blocks = [compressed_blocks(t, self.config) - compressed_blocks(first, self.config) for t in (start, end)]
        return token_slices(rows[:2], (1, 1), start - first, end - first) + \
            token_slices(rows[2:], (1, 1), blocks[0], blocks[1])

    def new_cache(self, batch: int, capacity: int, cache_slots: int) -> HierarchicalKVCache:
        """One stream per (request, layer, KV head), each with a host region of the capacity's blocks."""
        cfg, weight = self.config, self.model.model.embed_tokens.weight
        streams = batch * cfg.num_hidden_layers * cfg.num_key_value_heads
        return HierarchicalKVCache(max_streams=streams, cache_slots=cache_slots,
                                   host_rows=streams * int(block_count(capacity)),
                                   row_elems=2 * SEL_BLOCK * cfg.head_dim, dtype=weight.dtype, device=weight.device)

    def gather_layers(self, mode, cache, rows: Rows, lengths, capacity: int, prefetch: bool,
                      host_tokens: int | None = None) -> list:
        """Each layer's batch state; a shared layer's names its anchor's (lockstep, HierNsaKV).
        host_tokens: each stream's host region, in tokens (default the capacity)."""
        def gather(i: int) -> NsaBlocksKV:
            return self._gather_layer(mode, cache, i, [rows(b, i) for b in range(len(lengths))], capacity,
                                      host_tokens or capacity)
        return gather_in_lockstep(self.anchors, gather, HierNsaKV, mode, prefetch)

    def stream_regions(self, tokens: int) -> list[int]:
        """Host units (blocks) of each stream of one request of `tokens` tokens: one a layer and KV head."""
        return [int(block_count(tokens))] * (self.config.num_hidden_layers * self.kv_heads)

    def _gather_layer(self, mode: str, cache, layer: int, parts, capacity: int, host_tokens: int) -> NsaBlocksKV:
        """One layer's batch state from per-request (keys, values, compressed keys, compressed values)."""
        cfg, attn = self.config, self.model.model.layers[layer].self_attn
        keys0 = parts[0][0]
        batch, (hkv, _, d) = len(parts), keys0.shape
        n_units = int(block_count(capacity))
        n_cmp = max(compressed_blocks(capacity, cfg), 1)
        resident = {"window_keys": keys0.new_zeros(batch, hkv, cfg.sliding_window, d),
                    "window_values": keys0.new_zeros(batch, hkv, cfg.sliding_window, d),
                    "compressed_keys": keys0.new_zeros(batch, hkv, n_cmp, d),
                    "compressed_values": keys0.new_zeros(batch, hkv, n_cmp, d),
                    "weight_k": attn.compress_k.weight.T.contiguous(),
                    "weight_v": attn.compress_v.weight.T.contiguous(), "n_units": n_units}
        blocks = []
        for b, (k, v, ck, cv) in enumerate(parts):
            length = torch.tensor([k.shape[1]], device=k.device)
            ring_k, ring_v = nsa_window_ring(k[None], v[None], length, cfg.sliding_window)
            resident["window_keys"][b], resident["window_values"][b] = ring_k[0], ring_v[0]
            resident["compressed_keys"][b, :, :ck.shape[1]] = ck
            resident["compressed_values"][b, :, :cv.shape[1]] = cv
            blocks.append(nsa_block_rows(k[None], v[None]).view(hkv, -1, 2, SEL_BLOCK, d))
        if mode == "resident":
            pool = keys0.new_zeros(batch, hkv, n_units, 2, SEL_BLOCK, d)
            for b, rows in enumerate(blocks):
                pool[b, :, :rows.shape[1]] = rows
            return NsaBlocksKV(pool=pool.view(-1, 2, SEL_BLOCK, d), **resident)
        host_streams = [open_unit_streams(cache, rows, int(block_count(host_tokens))) for rows in blocks]
        return HierNsaKV(pool=None, **resident, cache=cache, host_streams=host_streams,
                         streams=torch.tensor(host_streams, dtype=torch.int32, device=keys0.device),
                         row_base=torch.zeros(batch, hkv, dtype=torch.int64, device=keys0.device))

    def stream_layers(self) -> list[int]:
        """The layers whose rows are in streams (hierarchical modes): every layer."""
        return list(range(self.config.num_hidden_layers))

    def lane_prefill(self, mode: str, cache: HierarchicalKVCache | None, layers: list, lane: int, prompt: int,
                     host_tokens: int, runs: list[int] | None = None,
                     shared_pages: list[list[int]] | None = None) -> NsaLanePrefill:
        """A serving lane's prefill in place (`hisparse.serving`; see `NsaLanePrefill`): the
        request's streams opened now with `host_tokens` tokens of blocks each (hierarchical modes), on a
        cached prefix's `shared_pages` (per stream). runs: a hybrid lane kept resident, its blocks
        written straight into these runs of the cache's streams (`take_runs`) and read from there."""
        return NsaLanePrefill(self, mode, cache, layers, lane, prompt, host_tokens, runs, shared_pages)

    # -- hybrid serving: a lane resident in runs of the cache's streams, or hierarchical ------------

    # a prefill's workspace is the model's own state in every mode, beside the cache
    workspace_in_runs = False

    def run_streams(self, cache: HierarchicalKVCache, capacity: int) -> int:
        """Streams of a run that holds the blocks of `capacity` tokens of one KV head (B + 1 blocks a stream)."""
        return -(-int(block_count(capacity)) // (cache.cache_slots + 1))

    def runs_per_request(self) -> int:
        """Runs a resident request holds, one per stream it has when hierarchical: one a layer and KV head."""
        return self.config.num_hidden_layers * self.kv_heads

    def take_runs(self, cache: HierarchicalKVCache, capacity: int) -> list[int] | None:
        """One run of `capacity` tokens per layer and KV head, layer by layer (first stream ids), or None."""
        return cache.take_runs(self.run_streams(cache, capacity), self.runs_per_request())

    def demote(self, cache: HierarchicalKVCache, layers: list, lane: int, length: int, host_tokens: int,
               runs: list[int]) -> None:
        """A resident hybrid lane becomes hierarchical between steps (as `QuestRuntime.demote`, blocks
        for pages): its window and compressed blocks stay where they are."""
        unit_lanes.demote_unit_runs(cache, layers, lane, int(block_count(length)), int(block_count(host_tokens)), runs,
                         self.kv_heads)

    def lane_workspace_bytes(self, mode: str, tokens: int) -> int:
        """GPU bytes a `lane_prefill` of `tokens` holds beside the lanes, in every mode: the model's
        own state of the prompt (keys, values, compressed blocks of every layer)."""
        dtype = self.model.model.embed_tokens.weight.dtype
        return sum(nbytes(*vars(layer.self_attn.new_kv(1, tokens, "meta", dtype)).values())
                   for layer in self.model.model.layers)

    def attention(self, mode: str, layers: list, check_values: bool, prefetch: bool,
                  prefetch_programs: int | None = None) -> KernelNsaAttention:
        return KernelNsaAttention(mode, self.selection_size, check_values=check_values, prefetch=prefetch,
                                  shared=shared_states(layers, HierNsaKV), prefetch_programs=prefetch_programs)

    def advance_streams(self, cache: HierarchicalKVCache, layers: list, positions: list[int]) -> None:
        """A position opening a block adds a unit to each of its request's streams."""
        advance_unit_streams(cache, [kv.host_streams for kv in layers], positions, SEL_BLOCK)

    def counts(self, cache: HierarchicalKVCache, layers: list) -> tuple[int, int]:
        """(hits, misses) over every layer; a shared layer counts its anchor's, whose blocks it copies."""
        return stream_counts(cache, [kv.streams if kv.anchor_streams is None else kv.anchor_streams
                                     for kv in layers])

    def kv_bytes(self, layers: list, cache: HierarchicalKVCache | None) -> float:
        """The window rings and compressed blocks, plus the resident blocks or the hot slots with the
        cache state."""
        total = sum(nbytes(kv.pool, kv.window_keys, kv.window_values, kv.compressed_keys, kv.compressed_values)
                    for kv in layers)
        return total + cache_bytes(cache)


class NsaLanePrefill:
    """One request's prefill into serving lane `lane` (`NsaRuntime.lane_prefill`; the contract of
    `hisparse.dsa.runtime.LanePrefill`): `state` is what the model's prefill runs on;
    `chunk_done(start, end)` after each chunk; `join()` when the prompt is done; `cancel()` if it
    will not join. The lane ends bitwise as `gather_layers` of the prefilled request would make it.

    The model prefills into its own state of the prompt's length (`NsaAttention.new_kv`: the
    selected and window branches read any earlier token, the compressed branch the compressed
    blocks so far), the workspace. After each chunk, per layer: its tokens into the lane's window
    ring, the compressed blocks it completed into the lane's, and the selection blocks it touched
    into the lane's resident pool rows or the request's streams in the host pool (a block the
    previous chunk left partial rewritten whole). The lane is zeroed first, so what a former request
    left past this one's tokens is gone, as in a gathered lane."""

    def __init__(self, runtime: NsaRuntime, mode: str, cache: HierarchicalKVCache | None, layers: list, lane: int,
                 prompt: int, host_tokens: int, runs: list[int] | None = None,
                 shared_pages: list[list[int]] | None = None):
        self.config, self.cache, self.layers, self.lane = runtime.config, cache, layers, lane
        self.heads = runtime.kv_heads
        self.shared = len(shared_pages[0]) * cache.page_rows if shared_pages else 0   # units on shared pages
        self.lanes = layers[0].window_keys.shape[0]
        self.runs = runs
        self.run_of = unit_lanes.lane_runs(cache, list(range(len(layers))), self.heads, runs)   # hybrid, resident
        for kv in layers:
            unit_lanes.zero_lane([kv.pool, kv.window_keys, kv.window_values, kv.compressed_keys, kv.compressed_values], lane,
                      self.lanes)
        weight = runtime.model.model.embed_tokens.weight
        workspace = [layer.self_attn.new_kv(1, prompt, weight.device, weight.dtype)
                     for layer in runtime.model.model.layers]
        self.streams: dict[int, list[int]] = {}        # layer -> the request's stream per KV head
        if mode != "resident" and runs is None:
            self.streams = unit_lanes.open_lane_streams(cache, list(range(len(layers))), self.heads,
                                                        int(block_count(host_tokens)), shared_pages)
        self.state = DecodeState(workspace, prompt, torch.zeros(1, dtype=torch.int64, device=weight.device))

    @property
    def workspace_bytes(self) -> int:
        if self.state is None:
            return 0
        return sum(nbytes(*vars(kv).values()) for kv in self.state.layers)

    def adopt(self, rows: Rows, prompt: int) -> None:
        """The prompt's keys, values and compressed blocks as a prefill elsewhere made them
        (`prefilled_rows`): written into the workspace as the model writes them, then placed as one chunk."""
        device = self.state.lengths.device
        positions = torch.arange(prompt, device=device)[None]
        for i, kv in enumerate(self.state.layers):
            keys, values, cmp_keys, cmp_values = (t[None].to(device) for t in rows(0, i))
            kv.write(positions, keys[:, :, :prompt], values[:, :, :prompt])
            if cmp_keys.shape[2]:
                kv.write_compressed(torch.arange(cmp_keys.shape[2], device=device)[None], cmp_keys, cmp_values)
        self.chunk_done(0, prompt)

    def chunk_done(self, start: int, end: int) -> None:
        """What prompt tokens start .. end - 1 made, from the workspace into the lane or the host pool."""
        first, last = start // SEL_BLOCK, -(-end // SEL_BLOCK)
        for layer, (work, kv) in enumerate(zip(self.state.layers, self.layers)):
            self._window(work, kv, start, end)
            made = slice(compressed_blocks(start, self.config), compressed_blocks(end, self.config))
            kv.compressed_keys[self.lane, :, made] = work.compressed_keys[0, :, made]
            kv.compressed_values[self.lane, :, made] = work.compressed_values[0, :, made]
            span = slice(first * SEL_BLOCK, end)
            rows = nsa_block_rows(work.keys[:, :, span], work.values[:, :, span])      # [HKV * n, 2, SEL_BLOCK, D]
            rows = rows.view(self.heads, last - first, *rows.shape[1:])
            if layer in self.run_of:        # hybrid, resident: the resident pool's layout, in the runs
                for first_stream, head_rows in zip(self.run_of[layer], rows):
                    run_rows(self.cache, first_stream)[first:last] = head_rows.reshape(last - first, -1)
                continue
            unit_lanes.store_lane_units(kv, self.lane, self.lanes, first, rows, kv.n_units, self.streams.get(layer),
                                        self.shared)

    def _window(self, work: NsaKV, kv: NsaBlocksKV, start: int, end: int) -> None:
        """The chunk's last (at most W) tokens into the lane's ring (token t at t % W), as
        `nsa_window_ring` places a prompt's."""
        window = kv.window_keys.shape[2]
        tokens = torch.arange(max(start, end - window), end, device=work.keys.device)
        kv.window_keys[self.lane][:, tokens % window] = work.keys[0][:, tokens]
        kv.window_values[self.lane][:, tokens % window] = work.values[0][:, tokens]

    def join(self) -> None:
        """The request's streams into its lane (hierarchical modes; the lane holds the rest already)."""
        unit_lanes.join_lane_streams(self.layers, self.lane, self.streams)
        unit_lanes.join_lane_runs(self.cache, self.layers, self.lane, self.run_of)
        self.state = None

    def cancel(self) -> None:
        """Give back the streams (or runs) of a prefill that will not join."""
        unit_lanes.close_lane_streams(self.cache, self.streams)
        for first in self.runs or []:
            self.cache.release_run(first)
        self.streams, self.runs, self.run_of, self.state = {}, None, {}, None

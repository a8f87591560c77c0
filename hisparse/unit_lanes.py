"""Lane, stream and run helpers of the families whose unit is a multi-token page or block per KV head
(Quest's 16-token pages, NSA's 64-token selection blocks): rows [2, T, D], keys then values, one
stream per (request, layer, KV head). What `hisparse.quest.runtime` and `hisparse.nsa.runtime` share:
an empty serving lane's writes, a lane's prefill in place (its streams or, hybrid, its runs) and a
resident hybrid lane's demotion."""
from __future__ import annotations

import torch

from hisparse.cache import HierarchicalKVCache
from hisparse.models.base import DecodeState
from hisparse.runtime import LaneStates, page_rows_of, run_rows, token_slices, write_resident_unit


class UnitRowsRuntime:
    """What the two families' runtimes share for serving: host-pool rows of one unit's keys and values
    of one KV head in the model's dtype, and the lanes of a batch (`lane_kv`: the layer states that keep
    an empty lane's decode write; `hier_kv`: those whose rows are in the cache)."""

    lane_kv: type
    hier_kv: type
    shares_prefixes = True      # its lane prefill opens streams on a cached prefix's pages (serving.sharing)
    prefill_depends_on_chunks = False   # (NSA's does)

    def refuse_dsa_options(self, model, decode_backend: str, kv_dtype: str) -> None:
        """ValueError for DSA's options (its decode kernels, its FP8 rows), which these families lack."""
        if decode_backend != "auto":
            raise ValueError(f"decode_backend={decode_backend!r} picks DSA's sparse MLA decode kernel; this "
                             f"{self.family} model ({type(model).__name__}) has none")
        if kv_dtype != "bf16":
            raise ValueError(f"kv_dtype={kv_dtype!r} is DSA's FP8 MLA row; this {self.family} model "
                             f"({type(model).__name__}) stores its KV in the model's dtype (kv_dtype 'bf16')")

    @property
    def row_bytes(self) -> int:
        """Bytes of one host-pool row: a unit's keys and values of one KV head."""
        return 2 * self.unit_size * self.model.config.head_dim * self.row_dtype.itemsize

    @property
    def row_dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    def new_state(self, batch: int, capacity: int) -> DecodeState:
        return self.model.new_state(batch, capacity)

    def prefix_rows(self, rows: tuple, start: int, end: int, first: int = 0) -> tuple:
        return token_slices(rows, self.row_token_dims, start - first, end - first)

    def shared_page_parts(self, layer: int) -> tuple:
        """Keys and values (parts 0 and 1) of the layers whose rows are in streams (`stream_layers`)."""
        return (0, 1) if layer in self.stream_layers() else ()

    def shared_rows(self, cache: HierarchicalKVCache, pages: list[list[int]]) -> dict[int, tuple]:
        """Each stream layer's keys and values [HKV, T, D] from its streams' pages (layer by layer,
        head by head; a row is a unit's keys then its values, [2, unit, D])."""
        heads, d, parts = self.kv_heads, self.model.config.head_dim, len(self.row_token_dims)
        out = {}
        for j, layer in enumerate(self.stream_layers()):
            rows = torch.stack([cache.host.rows[page_rows_of(cache, pages[j * heads + h])] for h in range(heads)])
            rows = rows.view(heads, -1, 2, self.unit_size, d)                     # [HKV, units, 2, unit, D]
            out[layer] = (rows[:, :, 0].reshape(heads, -1, d), rows[:, :, 1].reshape(heads, -1, d)) + \
                (None,) * (parts - 2)
        return out

    def serving_lanes(self, layers: list, mask: torch.Tensor | None = None) -> LaneStates:
        """The lanes of a serving batch's layers; each `lane_kv` keeps an empty lane's decode write."""
        for kv in layers if mask is not None else []:
            if isinstance(kv, self.lane_kv):
                kv.lanes = mask
        return LaneStates([kv for kv in layers if isinstance(kv, self.hier_kv) and kv.streams is not None])


def kept_in_empty_lanes(lanes: torch.Tensor | None, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """new [N, ...] where serving lane n holds a request (lanes [N] bool), old where it is empty:
    a decode step writes every lane, and an empty lane may be one a request is being prefilled
    into (`hisparse.quest.runtime.QuestLanePrefill`, `hisparse.nsa.runtime.NsaLanePrefill`), whose tokens must stay."""
    if lanes is None:
        return new
    return torch.where(lanes.view(-1, *([1] * (new.dim() - 1))), new, old)


def write_resident_unit_kept(pool: torch.Tensor, pos: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             unit_tokens: int, units_per_head: int, lanes: torch.Tensor | None) -> None:
    """`write_resident_unit`, an empty serving lane's row keeping what it holds (lanes [N] bool or None)."""
    if lanes is not None:
        n, hkv, _ = key.shape
        heads = torch.arange(n * hkv, device=pos.device).view(n, hkv)
        rows = heads * units_per_head + (pos // unit_tokens)[:, None]               # [N, HKV]
        offset = (pos % unit_tokens)[:, None].expand(n, hkv)
        key = kept_in_empty_lanes(lanes, key, pool[rows, 0, offset])
        value = kept_in_empty_lanes(lanes, value, pool[rows, 1, offset])
    write_resident_unit(pool, pos, key, value, unit_tokens, units_per_head)


def run_unit_rows(row_base: torch.Tensor, selection: torch.Tensor) -> torch.Tensor:
    """Rows [N, HKV, K] int32 of `cache.slots` viewed as rows holding units selection [N, HKV, K] of
    lanes kept resident in runs (row_base [N, HKV]: each run's first row); -1 stays."""
    return torch.where(selection >= 0, row_base[:, :, None] + selection.long(), -1).to(torch.int32)


def open_lane_streams(cache: HierarchicalKVCache, layers: list[int], heads: int, region: int,
                      shared_pages: list[list[int]] | None = None) -> dict[int, list[int]]:
    """One request's streams, layer by layer and head by head (the order `gather_layers` opens them
    in, so the same ids and host regions): layer -> its stream per KV head. All or nothing.
    shared_pages: per stream in that order, the host pages of a cached prefix it opens on."""
    opened: dict[int, list[int]] = {}
    try:
        for j, layer in enumerate(layers):
            opened[layer] = []
            for h in range(heads):
                opened[layer].append(cache.open_stream(region, shared_pages[j * heads + h] if shared_pages else ()))
    except BaseException:
        close_lane_streams(cache, opened)
        raise
    return opened


def close_lane_streams(cache: HierarchicalKVCache, streams: dict[int, list[int]]) -> None:
    for ids in streams.values():
        for stream in ids:
            cache.close_stream(stream)


def join_lane_streams(layers: list, lane: int, streams: dict[int, list[int]]) -> None:
    """A request's streams (layer -> its stream per KV head) into serving lane `lane` of each layer's
    state: `streams [lanes, HKV]` and `host_streams[lane]` (a shared layer's `anchor_streams` is its
    anchor's `streams` tensor, so it follows)."""
    for layer, ids in streams.items():
        kv = layers[layer]
        kv.streams[lane] = torch.tensor(ids, dtype=kv.streams.dtype, device=kv.streams.device)
        kv.host_streams[lane] = list(ids)


def lane_runs(cache: HierarchicalKVCache, layers: list[int], heads: int,
              runs: list[int] | None) -> dict[int, list[int]]:
    """A resident hybrid lane's runs (`take_runs`: layer by layer, head by head) as layer -> its run
    per KV head, each run zeroed (as a resident lane is: nothing past its tokens); {} for runs None."""
    if runs is None:
        return {}
    if len(runs) != len(layers) * heads:
        raise ValueError(f"a resident hybrid lane needs one run per hierarchical layer and KV head "
                         f"({len(layers)} x {heads}), got {len(runs)}")
    for first in runs:
        run_rows(cache, first).zero_()
    return {layer: runs[j * heads:(j + 1) * heads] for j, layer in enumerate(layers)}


def join_lane_runs(cache: HierarchicalKVCache, layers: list, lane: int, run_of: dict[int, list[int]]) -> None:
    """A resident hybrid lane's runs (layer -> its run per KV head) into lane `lane`: resident, its
    rows' base the runs' first rows, its streams -1 (the resolve and the newest-unit write skip it)."""
    for layer, firsts in run_of.items():
        kv = layers[layer]
        kv.resident[lane] = True
        kv.streams[lane] = -1
        kv.row_base[lane] = cache.row_base(torch.tensor(firsts, device=kv.row_base.device))
        kv.host_streams[lane] = []


def demote_unit_runs(cache: HierarchicalKVCache, layers: list, lane: int, units: int, region: int, runs: list[int],
                     heads: int) -> None:
    """A resident hybrid lane of a per-KV-head family becomes hierarchical between steps: run by run
    (hierarchical layer by layer, KV head by head) its run goes back and a stream with a host region
    of `region` units gets the run's first `units` rows (bytes as stored; the stream may reuse the
    run's own streams, whose rows are read before anything is written there); the lane reads through
    its streams from the next step, their caches empty. ValueError, before anything changes, for
    runs that are not the lane's count or a host pool that cannot hold the regions."""
    hier = [kv for kv in layers if getattr(kv, "streams", None) is not None]
    if len(runs) != len(hier) * heads:
        raise ValueError(f"demoting lane {lane}: {len(runs)} runs, expected one per hierarchical layer and KV "
                         f"head ({len(hier)} x {heads})")
    if not cache.fits([region] * len(runs)):
        raise ValueError(f"demoting lane {lane} needs {len(runs)} host regions of {region} units; the host "
                         f"pool has {cache.host.free_rows} rows free")
    for j, kv in enumerate(hier):
        ids = []
        for first in runs[j * heads:(j + 1) * heads]:
            rows = run_rows(cache, first)[:units]
            cache.release_run(first)
            stream = cache.open_stream(region)
            cache.append(stream, rows)
            ids.append(stream)
        kv.resident[lane] = False
        kv.streams[lane] = torch.tensor(ids, dtype=kv.streams.dtype, device=kv.streams.device)
        kv.host_streams[lane] = ids


def write_stream_units(cache: HierarchicalKVCache, stream: int, first: int, rows: torch.Tensor) -> None:
    """rows [n, E] become units first .. first + n - 1 of `stream`: a unit the stream already holds
    (the last one, left partial by the previous chunk) rewritten whole, the others appended."""
    held = cache.stream_len[stream]
    if first > held or first < held - 1:
        raise ValueError(f"stream {stream} holds {held} units; a chunk's units must start at its last or next "
                         f"one, not {first}")
    if first < held:
        cache.write_unit(stream, first, rows[0])
        rows = rows[1:]
    if rows.shape[0]:
        cache.append(stream, rows)


def store_lane_units(kv, lane: int, lanes: int, first: int, rows: torch.Tensor, units_per_head: int,
                     streams: list[int] | None, shared: int = 0) -> None:
    """A chunk's units rows [HKV, n, 2, T, D] (units first .. first + n - 1 of each KV head) into
    serving lane `lane` of layer state `kv`: its resident pool rows [lanes * HKV * units_per_head,
    2, T, D], or (streams: one per KV head) the request's streams in the host pool, less their first
    `shared` units (a cached prefix's shared pages: the same bytes, read-only)."""
    hkv, n = rows.shape[:2]
    if streams is None:
        kv.pool.view(lanes, hkv, units_per_head, *rows.shape[2:])[lane, :, first:first + n] = rows
        return
    skip = min(max(shared - first, 0), n)
    for stream, head_rows in zip(streams, rows):
        if skip < n:
            write_stream_units(kv.cache, stream, first + skip, head_rows.reshape(n, -1)[skip:])


def zero_lane(tensors: list[torch.Tensor | None], lane: int, lanes: int) -> None:
    """Lane `lane` of per-lane tensors [lanes * ..., ...] zeroed, as a gathered lane is past its tokens."""
    for t in tensors:
        if t is not None:
            t.view(lanes, -1)[lane].zero_()

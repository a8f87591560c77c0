"""The torch reference of the resolve and of the decode step's unit writes (DESIGN section 3),
one stream at a time in plain torch and Python: what the kernels in hisparse/resolve.py must equal."""
from __future__ import annotations

import torch

from hisparse.resolve import CacheState, PageTable, ResolveResult, check_new_rows, check_unit_token, host_rows_of


def resolve_ref(state: CacheState, streams: torch.Tensor, sel: torch.Tensor, host: torch.Tensor,
                cache: torch.Tensor, *, fetch: bool = True,
                newest: tuple[torch.Tensor, torch.Tensor] | None = None) -> ResolveResult:
    """The same resolve, one stream at a time in plain torch and Python, updating `state` in place;
    `newest` rows are written first, as `write_rows` would (host row, reserved slot, cached copy).
    Map rows (host_base + unit) index the slot map; `state.pages` says which host rows hold them."""

    def host_row(map_row: int) -> int:
        return int(host_rows_of(state.pages, torch.tensor(map_row)))

    if newest is not None:
        check_new_rows(streams, *newest, host)
        for stream, unit, row in zip(streams.tolist(), newest[0].tolist(), newest[1]):
            if stream >= 0:
                map_row = int(state.host_base[stream]) + unit
                host[host_row(map_row)] = row.to(host.device)
                slot = int(state.unit_slot[map_row])
                for place in [cache[stream, -1]] + ([cache[stream, slot]] if slot >= 0 else []):
                    place.copy_(row)
    n, k = sel.shape
    slots = torch.full((n, k), -1, dtype=torch.int32)
    counts = torch.zeros(n, 2, dtype=torch.int32)
    plan_unit = torch.full((n, k), -1, dtype=torch.int32)
    plan_slot = torch.full((n, k), -1, dtype=torch.int32)
    for row in range(n):
        stream = int(streams[row])
        if stream < 0:
            continue
        base = int(state.host_base[stream])
        units = [int(u) for u in sel[row] if u >= 0]
        order = state.lru[stream].tolist()
        unit_of = dict(zip(order, state.lru_unit[stream].tolist()))   # slot -> unit it holds
        cached = {u: int(state.unit_slot[base + u]) for u in units if state.unit_slot[base + u] >= 0}
        hit_units = [u for u in units if u in cached]
        miss_units = [u for u in units if u not in cached]
        hit_slots = set(cached.values())
        free = [s for s in order if s not in hit_slots]          # LRU first
        victims = free[:len(miss_units)]
        untouched = free[len(miss_units):]
        for slot, unit in zip(victims, miss_units):
            if unit_of[slot] >= 0:
                state.unit_slot[base + unit_of[slot]] = -1
            state.unit_slot[base + unit] = slot
            unit_of[slot] = unit
            if fetch:
                cache[stream, slot] = host[host_row(base + unit)].to(cache.device)
        slot_of = {**cached, **dict(zip(miss_units, victims))}
        new_order = untouched + victims + [cached[u] for u in hit_units]
        state.lru[stream] = torch.tensor(new_order, dtype=torch.int32)
        state.lru_unit[stream] = torch.tensor([unit_of[s] for s in new_order], dtype=torch.int32)
        for i, u in enumerate(sel[row].tolist()):
            if u >= 0:
                slots[row, i] = slot_of[u]
        planned = list(zip(miss_units, victims))
        plan_unit[row, :len(planned)] = torch.tensor([u for u, _ in planned], dtype=torch.int32)
        plan_slot[row, :len(planned)] = torch.tensor([s for _, s in planned], dtype=torch.int32)
        counts[row] = torch.tensor([len(hit_units), len(miss_units)])
        state.stats[stream] += counts[row].to(state.stats)
    return ResolveResult(slots, counts, plan_unit, plan_slot)


def write_unit_token_ref(streams, pos, keys, values, host_base, unit_slot, host, cache, unit_tokens: int,
                         map_streams=None, pages: PageTable | None = None) -> None:
    """`write_unit_token` in torch, in place."""
    check_unit_token(streams, pos, keys, values, host, cache, unit_tokens, map_streams)
    map_streams = streams if map_streams is None else map_streams
    n, hkv, d = keys.shape
    for m, stream in enumerate(streams.tolist()):
        if stream < 0:
            continue
        req, head, p = m // hkv, m % hkv, int(pos[m // hkv])
        host_row = int(host_rows_of(pages, host_base[stream] + p // unit_tokens))
        map_stream = int(map_streams[m])
        slot = int(unit_slot[int(host_base[map_stream]) + p // unit_tokens]) if map_stream >= 0 else -1
        places = [host[host_row], cache[stream, -1]] + ([cache[stream, slot]] if slot >= 0 else [])
        for place in places:                       # views: the writes land in host and cache
            row = place.view(2, unit_tokens, d)
            if p % unit_tokens == 0:               # a new unit: its whole row, zeros but for the token
                row.zero_()
            row[0, p % unit_tokens] = keys[req, head].to(row.device)
            row[1, p % unit_tokens] = values[req, head].to(row.device)

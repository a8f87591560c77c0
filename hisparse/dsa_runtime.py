"""The DSA decode step through the Triton kernels, with the MLA latents resident or hierarchical.

`KernelDsaAttention` replaces `DsaModel.sparse_attention` (the torch reference step in
`hisparse.models.dsa_decode`). Both modes run the same indexer, the same top-k and the same
`sparse_mla_decode`, reading the same rows in the same order; only where the rows sit differs:
- `resident`: every latent of every request on the GPU (`MlaKV.latent [B, capacity, D]`);
- `hisparse` / `noio`: latents in the host pool of a `HierarchicalKVCache`, one stream per
  (request, layer); each step resolves the selection to GPU slots first (`noio` skips the copy:
  the oracle, whose outputs are wrong but whose time is the upper bound).
The indexer keys stay resident in every mode (DESIGN section 5).

Selections can be recorded (`recorded`, filled by every layer's `attend`) and replayed from a
trace instead of the indexer (`replay_sel`): the system does not depend on where selections come
from, so a trace with realistic locality drives it with realistic hit rates.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from hisparse.cache import HierarchicalKVCache
from hisparse.resolve import ResolveResult
from hisparse.dsa import dsa_select, sparse_mla_decode
from hisparse.models.dsa_decode import MlaKV

KV_MODES = ("resident", "hisparse", "noio")
PREFETCH_PROGRAMS = int(os.environ.get("HISPARSE_PREFETCH_PROGRAMS", "32"))


@dataclass
class HierMlaKV(MlaKV):
    """A layer's KV with the latents in the hierarchical cache: `latent` is None; `streams [B]`
    int32 are the rows' streams in `cache`; `index_keys [B, capacity, Di]` stay resident.

    A shared layer (one that reuses an anchor layer's selection) moves in lockstep with its anchor:
    `anchor_layer` and `anchor_streams` name the anchor, whose slot maps place its rows too, and
    `prefetched` is the event its layer-wise prefetch copy records, when prefetch is on."""

    streams: torch.Tensor | None = None
    cache: HierarchicalKVCache | None = None
    anchor_layer: int | None = None
    anchor_streams: torch.Tensor | None = None
    prefetched: torch.cuda.Event | None = None

    def write(self, positions: torch.Tensor, latent: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Decode-step write (positions [B, 1]): the latent goes to the host pool, the reserved slot
        and any cached copy; the indexer key stays on the GPU. A prefetched shared layer first waits
        for its copy, so the write-through of the newest row lands after (not under) the copy."""
        if positions.shape[1] != 1:
            raise ValueError("a hierarchical state takes one token per row; prefill runs on a resident state")
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        if index_keys is not None:
            self.index_keys[rows, positions] = index_keys
        if self.prefetched is not None:
            torch.cuda.current_stream().wait_event(self.prefetched)
        self.cache.write_newest(self.streams, positions[:, 0], latent[:, 0].contiguous(), self.anchor_streams)


class KernelDsaAttention:
    """`select` and `attend` of the DSA decode step (the contract of `TorchDsaAttention`).

    check_values: validate selections against stream lengths before each resolve (a host sync;
    off inside a captured CUDA graph). Per-call resolve counters accumulate in `cache.stats`
    (anchor layers only: shared layers do no resolve work).
    shared: anchor layer -> its shared layers' states; each shared layer replays its anchor's miss
    plan, in line (prefetch off) or, with `prefetch` on a GPU, on a side stream launched right after
    the anchor's resolve, so the copy overlaps the layers in between (DESIGN section 4).
    replay_sel [layers, B, k] int32: when set, selections come from it instead of the indexer (the
    caller fills it from a trace before each step). `recorded[layer]` holds the selection each
    layer attended over in the last step.
    """

    def __init__(self, mode: str = "resident", check_values: bool = True, prefetch: bool = False,
                 shared: dict[int, list[HierMlaKV]] | None = None):
        if mode not in KV_MODES:
            raise ValueError(f"mode must be one of {KV_MODES}, got {mode!r}")
        self.mode = mode
        self.check_values = check_values
        self.shared = shared or {}
        self.side = torch.cuda.Stream() if prefetch and torch.cuda.is_available() else None
        # a copy from pinned host memory needs few programs to keep PCIe busy; more would crowd
        # out the layers it overlaps with
        self.prefetch_programs = PREFETCH_PROGRAMS
        self.replay_sel: torch.Tensor | None = None
        self.recorded: dict[int, torch.Tensor] = {}
        self._resolved: dict[int, ResolveResult] = {}

    def select(self, layer_idx: int, index_q: torch.Tensor, index_weights: torch.Tensor, kv: MlaKV,
               lengths: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
        if self.replay_sel is not None:
            return self.replay_sel[layer_idx]
        # relu(scale * q.k) = scale * relu(q.k) for scale > 0: fold the scale into the head weights
        return dsa_select(index_q, index_weights * scale, kv.index_keys, lengths, topk)

    def attend(self, layer_idx: int, q_latent: torch.Tensor, q_rope: torch.Tensor, kv: MlaKV,
               lengths: torch.Tensor, selection: torch.Tensor, scale: float) -> torch.Tensor:
        q = torch.cat([q_latent, q_rope], dim=-1)                            # [B, H, Dc + Dr]
        selection = selection.to(torch.int32)
        self.recorded[layer_idx] = selection
        if isinstance(kv, HierMlaKV):
            slots = self._slots(layer_idx, kv, selection)
            rows = kv.cache.slot_rows(kv.streams, slots)
            pool = kv.cache.slots.view(-1, kv.cache.slots.shape[-1])
        else:
            batch, capacity, _ = kv.latent.shape
            base = torch.arange(batch, dtype=torch.int32, device=selection.device)[:, None] * capacity
            rows = torch.where(selection >= 0, base + selection, -1)
            pool = kv.latent.view(-1, kv.latent.shape[-1])
        out, _ = sparse_mla_decode(q, pool, rows, scale, d_v=q_latent.shape[-1])
        return out

    def _slots(self, layer_idx: int, kv: HierMlaKV, selection: torch.Tensor) -> torch.Tensor:
        """Slots of the selection in this layer's cache: resolved (anchor) or the anchor's (shared)."""
        copy = self.mode != "noio"
        if kv.anchor_layer is not None:                 # shared: in lockstep with the anchor
            plan = self._resolved[kv.anchor_layer]
            if copy and kv.prefetched is None:
                kv.cache.replay_plan(plan, kv.streams)
            return plan.slots
        plan = kv.cache.resolve(kv.streams, selection, mode="normal" if copy else "noio",
                                check_values=self.check_values)
        self._resolved[layer_idx] = plan
        if copy and self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                for shared in self.shared.get(layer_idx, []):
                    kv.cache.replay_plan(plan, shared.streams, self.prefetch_programs)
                    shared.prefetched.record(self.side)
        return plan.slots

"""A Llama-style GQA model with Native Sparse Attention in every layer (`model_type` "nsa").

Our own format (keys in hisparse/nsa/README.md): Llama names for everything shared with Llama, plus per layer
`self_attn.g_proj` (hidden -> 3 gates per query head, order compressed, selected, window) and
`self_attn.compress_k` / `self_attn.compress_v` (head_dim -> head_dim, applied to block means).
Prefill applies, for every query, exactly the decode semantics of reference.py over the tokens up
to it; decode goes through `NsaModel.sparse_attention`. With `selection_group` g > 1, each group of g
consecutive layers attends over the blocks its first layer selected (its selected branch; each layer
keeps its own compressed and window branches): a shared selection, for layer-wise prefetch.
"""
import torch
from torch import nn

from hisparse.models.base import CausalLM, DecoderLayer, Step
from hisparse.models.config import NsaConfig
from hisparse.models.layers import GatedMLP, Rotary, rope_half
from hisparse.nsa.ops import nsa_prefill_selected, nsa_prefill_window
from hisparse.nsa.reference import (
    NsaKV,
    TorchNsaAttention,
    block_score_map,
    compressed_blocks,
    grouped_attention,
    selection_scores,
    top_blocks,
)

PREFILL_ELEMENTS = 1 << 26   # compressed-branch logits [B, H, rows, C] per row block of the fast prefill


class NsaAttention(nn.Module):
    def __init__(self, config: NsaConfig, rotary: Rotary, owner: "NsaModel", layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        h, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, hkv, d
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)
        self.g_proj = nn.Linear(config.hidden_size, 3 * h, bias=False)
        self.compress_k = nn.Linear(d, d, bias=False)
        self.compress_v = nn.Linear(d, d, bias=False)
        self._rotary = (rotary,)  # shared by every layer, not a submodule
        self._owner = (owner,)
        self.anchor = config.selection_anchor(layer_idx)    # the layer whose block selection this one uses

    def new_kv(self, batch: int, capacity: int, device, dtype) -> NsaKV:
        full = (batch, self.n_kv_heads, capacity, self.head_dim)
        compressed = (batch, self.n_kv_heads, max(compressed_blocks(capacity, self.config), 1), self.head_dim)
        return NsaKV(*(torch.zeros(s, device=device, dtype=dtype) for s in (full, full, compressed, compressed)))

    def forward(self, x: torch.Tensor, step: Step, kv: NsaKV) -> torch.Tensor:
        b, s, _ = x.shape
        cos, sin = self._rotary[0](step.positions, x.dtype)
        cos, sin = cos[:, :, None], sin[:, :, None]
        q = rope_half(self.q_proj(x).view(b, s, self.n_heads, self.head_dim), cos, sin)
        k = rope_half(self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim), cos, sin)
        kv.write(step.positions, k.transpose(1, 2), self.v_proj(x).view(b, s, self.n_kv_heads, -1).transpose(1, 2))
        gates = torch.sigmoid(self.g_proj(x)).view(b, s, self.n_heads, 3)
        if step.decode:
            if isinstance(kv, NsaKV):  # a kernel state (hisparse.nsa.runtime) compresses in its own write
                self._compress_newest(kv, step.lengths)
            shared = step.shared["nsa_blocks"] if self.anchor != self.layer_idx else None
            out, blocks = self._owner[0].sparse_attention.decode(self.layer_idx, q[:, 0], gates[:, 0], kv,
                                                                 step.lengths, blocks=shared)
            step.shared["nsa_blocks"] = blocks
            out = out[:, None]
        else:
            end = step.start + s
            self._compress(kv, step.start, end)
            out = self._prefill_fast(q, gates, kv, step, end) if step.fast else self._prefill(q, gates, kv, step, end)
        return self.o_proj(out.reshape(b, s, self.n_heads * self.head_dim))

    def _compressed(self, keys: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        """Compressed keys, values [..., C, D] of blocks given as [..., C, D, block] token windows."""
        pairs = ((keys, self.compress_k), (values, self.compress_v))
        return [proj(x.float().mean(-1).to(x.dtype)) for x, proj in pairs]

    def _compress(self, kv: NsaKV, start: int, end: int) -> None:
        """Prefill: the compressed blocks completed by tokens start .. end - 1 (every row)."""
        first, last = compressed_blocks(start, self.config), compressed_blocks(end, self.config)
        if last == first:
            return
        stride, size = self.config.compress_block_stride, self.config.compress_block_size
        span = slice(first * stride, (last - 1) * stride + size)
        keys, values = (x[:, :, span].unfold(2, size, stride) for x in (kv.keys, kv.values))
        blocks = torch.arange(first, last, device=kv.keys.device).expand(kv.keys.shape[0], -1)
        kv.write_compressed(blocks, *self._compressed(keys, values))

    def _compress_newest(self, kv: NsaKV, lengths: torch.Tensor) -> None:
        """Decode: the compressed block the newest token completes, in the rows where it completes one."""
        stride, size = self.config.compress_block_stride, self.config.compress_block_size
        b, h, _, d = kv.keys.shape
        complete = (lengths >= size) & ((lengths - size) % stride == 0)  # [B]
        block = compressed_blocks(lengths, self.config).clamp(min=1) - 1  # [B]
        tokens = (block[:, None] * stride + torch.arange(size, device=lengths.device)).clamp(max=kv.keys.shape[2] - 1)
        index = tokens[:, None, :, None].expand(b, h, size, d)
        # [B, H, 1, D, size]: one block per row, tokens last as unfold lays them out
        keys, values = (x.gather(2, index).transpose(2, 3)[:, :, None] for x in (kv.keys, kv.values))
        new_keys, new_values = self._compressed(keys, values)
        rows = torch.arange(b, device=lengths.device)
        keep = ~complete[:, None, None, None]
        old_keys = kv.compressed_keys[rows, :, block][:, :, None]  # [B, H, 1, D]
        old_values = kv.compressed_values[rows, :, block][:, :, None]
        kv.write_compressed(block[:, None], torch.where(keep, old_keys, new_keys),
                            torch.where(keep, old_values, new_values))

    def _prefill(self, q, gates, kv: NsaKV, step: Step, end) -> torch.Tensor:
        """The three gated branches for every query (positions step.positions[0] [S]) over tokens < its
        position + 1; a shared layer selects the blocks its anchor selected (step.shared)."""
        cfg, b, s = self.config, q.shape[0], q.shape[1]
        positions = step.positions[0]
        qg = q.view(b, s, self.n_kv_heads, -1, self.head_dim).permute(0, 2, 3, 1, 4).flatten(2, 3)  # [B, Hkv, G*S, D]
        group = qg.shape[2] // s
        lengths = positions + 1  # [S]
        tokens = torch.arange(end, device=q.device)
        n_cmp = compressed_blocks(end, cfg)
        cmp_mask = (torch.arange(n_cmp, device=q.device)[None, :] * cfg.compress_block_stride
                    + cfg.compress_block_size <= lengths[:, None])  # [S, C]
        o_cmp, probs = self._masked(qg, kv.compressed_keys[:, :, :n_cmp], kv.compressed_values[:, :, :n_cmp],
                                    cmp_mask.repeat(group, 1))
        n_blocks = -(-end // cfg.selection_block_size)
        p_cmp = probs.view(b, self.n_kv_heads, group, s, n_cmp).sum(2)  # [B, Hkv, S, C]
        scores = p_cmp @ block_score_map(n_cmp, n_blocks, cfg, q.device)
        query_blocks = (-(-lengths // cfg.selection_block_size))[:, None]  # [S, 1]
        if self.anchor == self.layer_idx:
            step.shared["nsa_blocks"] = top_blocks(scores, query_blocks, cfg.num_selected_blocks)  # [B, Hkv, S, n]
        blocks = step.shared["nsa_blocks"]           # a shared layer's: its group's anchor's
        chosen = torch.zeros(*blocks.shape[:3], n_blocks + 1, dtype=torch.bool, device=q.device)
        chosen = chosen.scatter(-1, torch.where(blocks < 0, n_blocks, blocks), True)[..., :n_blocks]
        causal = tokens[None, :] < lengths[:, None]  # [S, T]
        slc_mask = chosen[..., tokens // cfg.selection_block_size] & causal  # [B, Hkv, S, T]
        o_slc, _ = self._masked(qg, kv.keys[:, :, :end], kv.values[:, :, :end], slc_mask.repeat(1, 1, group, 1))
        win_mask = causal & (tokens[None, :] >= lengths[:, None] - cfg.sliding_window)
        o_win, _ = self._masked(qg, kv.keys[:, :, :end], kv.values[:, :, :end], win_mask.repeat(group, 1))
        g = gates.permute(0, 2, 1, 3).reshape(b, self.n_kv_heads, group * s, 3).to(q.dtype)  # head-major like qg
        out = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win  # [B, Hkv, G*S, D]
        return out.view(b, self.n_kv_heads, group, s, self.head_dim).permute(0, 3, 1, 2, 4)

    def _prefill_fast(self, q, gates, kv: NsaKV, step: Step, end: int) -> torch.Tensor:
        """The reference prefill's three gated branches in memory linear in the prompt: q [B, S, H, D]
        at positions step.start .. end - 1 -> [B, S, H, D]. Compressed branch and selection in torch,
        a bounded block of rows at a time; selected branch through the decode kernel, one query per
        row list; window branch through torch's fused attention (hisparse/nsa/ops.py)."""
        cfg = self.config
        o_cmp, blocks = self._compressed_rows(q, kv, step.start, end, select=self.anchor == self.layer_idx)
        if blocks is not None:
            step.shared["nsa_blocks"] = blocks                                  # [B, Hkv, S, n]
        blocks = step.shared["nsa_blocks"]           # a shared layer's: its group's anchor's
        o_slc = nsa_prefill_selected(q, kv.keys, kv.values, blocks, step.start, cfg.selection_block_size)
        o_win = nsa_prefill_window(q, kv.keys, kv.values, step.start, cfg.sliding_window)
        g = gates.float()                                                           # [B, S, H, 3]
        out = g[..., 0:1] * o_cmp.float() + g[..., 1:2] * o_slc + g[..., 2:3] * o_win.float()
        return out.to(q.dtype)

    def _compressed_rows(self, q, kv: NsaKV, start: int, end: int, select: bool):
        """Compressed branch of q [B, S, H, D] -> out [B, S, H, D] and, with `select`, the top blocks
        [B, Hkv, S, n] int64, as `_prefill` computes them, rows of queries at a time: the logits of
        one row block ([B, H, rows, C]) are the only workspace, and selection scores are formed in
        linear memory (`selection_scores`), never as a [C, blocks] map."""
        cfg, (b, s, h, d) = self.config, q.shape
        hkv, group = self.n_kv_heads, h // self.n_kv_heads
        n_cmp, n_blocks = compressed_blocks(end, cfg), -(-end // cfg.selection_block_size)
        keys, values = kv.compressed_keys[:, :, :n_cmp], kv.compressed_values[:, :, :n_cmp]
        needs = torch.arange(n_cmp, device=q.device) * cfg.compress_block_stride + cfg.compress_block_size  # [C]
        out = torch.empty_like(q)
        blocks = torch.empty(b, hkv, s, cfg.num_selected_blocks, dtype=torch.int64, device=q.device) if select else None
        rows = max(1, PREFILL_ELEMENTS // (b * h * max(n_cmp, 1)))
        for first in range(0, s, rows):
            last = min(first + rows, s)
            lengths = torch.arange(start + first + 1, start + last + 1, device=q.device)  # [R]
            qg = q[:, first:last].reshape(b, last - first, hkv, group, d).permute(0, 2, 3, 1, 4).flatten(2, 3)
            o, probs = self._masked(qg, keys, values, (needs[None, :] <= lengths[:, None]).repeat(group, 1))
            out[:, first:last] = o.view(b, hkv, group, last - first, d).permute(0, 3, 1, 2, 4).flatten(2, 3)
            if select:
                p_cmp = probs.view(b, hkv, group, last - first, n_cmp).sum(2)    # [B, Hkv, R, C]
                query_blocks = (-(-lengths // cfg.selection_block_size))[:, None]  # [R, 1]
                blocks[:, :, first:last] = top_blocks(selection_scores(p_cmp, n_blocks, cfg), query_blocks,
                                                      cfg.num_selected_blocks)
        return out, blocks

    def _masked(self, qg, k, v, mask):
        return grouped_attention(qg, k, v, mask, self.head_dim ** -0.5)


class NsaModel(CausalLM):
    def __init__(self, config: NsaConfig):
        rotary = Rotary(config.rope_parameters, config.head_dim)
        layers = [DecoderLayer(NsaAttention(config, rotary, self, i),
                               GatedMLP(config.hidden_size, config.intermediate_size),
                               config.hidden_size, config.rms_norm_eps)
                  for i in range(config.num_hidden_layers)]
        super().__init__(config, layers)
        self.rotary = rotary
        self.sparse_attention = TorchNsaAttention(config)

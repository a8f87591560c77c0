"""A Llama-style GQA model with Native Sparse Attention in every layer (`model_type` "nsa").

Our own format (keys in README_NSA.md): Llama names for everything shared with Llama, plus per layer
`self_attn.g_proj` (hidden -> 3 gates per query head, order compressed, selected, window) and
`self_attn.compress_k` / `self_attn.compress_v` (head_dim -> head_dim, applied to block means).
Prefill applies, for every query, exactly the decode semantics of nsa_decode.py over the tokens up
to it; decode goes through `NsaModel.sparse_attention`.
"""
import torch
from torch import nn

from hisparse.models.base import CausalLM, DecoderLayer, Step
from hisparse.models.config import NsaConfig
from hisparse.models.layers import GatedMLP, Rotary, rope_half
from hisparse.models.nsa_decode import (NsaKV, TorchNsaAttention, block_score_map, compressed_count,
                                        grouped_attention, top_blocks)


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

    def new_kv(self, batch: int, capacity: int, device, dtype) -> NsaKV:
        full = (batch, self.n_kv_heads, capacity, self.head_dim)
        compressed = (batch, self.n_kv_heads, max(compressed_count(capacity, self.config), 1), self.head_dim)
        return NsaKV(*(torch.zeros(s, device=device, dtype=dtype) for s in (full, full, compressed, compressed)))

    def forward(self, x: torch.Tensor, step: Step, kv: NsaKV) -> torch.Tensor:
        b, s, _ = x.shape
        start, end = step.start, step.start + s
        cos, sin = self._rotary[0](step.positions, x.dtype)
        q = rope_half(self.q_proj(x).view(b, s, self.n_heads, self.head_dim), cos[:, None], sin[:, None])
        k = rope_half(self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim), cos[:, None], sin[:, None])
        kv.write(start, k.transpose(1, 2), self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2))
        self._compress(kv, start, end)
        gates = torch.sigmoid(self.g_proj(x)).view(b, s, self.n_heads, 3)
        if step.decode:
            out = self._owner[0].sparse_attention.decode(self.layer_idx, q[:, 0], gates[:, 0], kv, end)[:, None]
        else:
            out = self._prefill(q, gates, kv, step.positions, end)
        return self.o_proj(out.reshape(b, s, self.n_heads * self.head_dim))

    def _compress(self, kv: NsaKV, start: int, end: int) -> None:
        """Compressed keys/values of the blocks completed by tokens start .. end - 1."""
        first, last = compressed_count(start, self.config), compressed_count(end, self.config)
        if last == first:
            return
        stride, size = self.config.compress_block_stride, self.config.compress_block_size
        span = slice(first * stride, (last - 1) * stride + size)
        compressed = [proj(source[:, :, span].float().unfold(2, size, stride).mean(-1).to(source.dtype))
                      for source, proj in ((kv.keys, self.compress_k), (kv.values, self.compress_v))]
        kv.write_compressed(first, *compressed)

    def _prefill(self, q, gates, kv: NsaKV, positions, end) -> torch.Tensor:
        """The three gated branches for every query (positions [S]) over tokens < its position + 1."""
        cfg, b, s = self.config, q.shape[0], q.shape[1]
        qg = q.view(b, s, self.n_kv_heads, -1, self.head_dim).permute(0, 2, 3, 1, 4).flatten(2, 3)  # [B, Hkv, G*S, D]
        group = qg.shape[2] // s
        lengths = positions + 1  # [S]
        tokens = torch.arange(end, device=q.device)
        n_cmp = compressed_count(end, cfg)
        cmp_mask = (torch.arange(n_cmp, device=q.device)[None, :] * cfg.compress_block_stride
                    + cfg.compress_block_size <= lengths[:, None])  # [S, C]
        o_cmp, probs = self._masked(qg, kv.compressed_keys[:, :, :n_cmp], kv.compressed_values[:, :, :n_cmp],
                                    cmp_mask.repeat(group, 1))
        n_blocks = -(-end // cfg.selection_block_size)
        p_cmp = probs.view(b, self.n_kv_heads, group, s, n_cmp).sum(2)  # [B, Hkv, S, C]
        scores = p_cmp @ block_score_map(n_cmp, n_blocks, cfg, q.device)
        query_blocks = (-(-lengths // cfg.selection_block_size))[:, None]  # [S, 1]
        blocks = top_blocks(scores, query_blocks, cfg.num_selected_blocks)  # [B, Hkv, S, n]
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

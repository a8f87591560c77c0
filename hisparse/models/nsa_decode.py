"""NSA decode-step attention in plain torch: the swappable part of the NSA model.

Same semantics as `hisparse/nsa.py` (the Triton decode kernels and their references), with the block
sizes taken from the config. For a sequence of L tokens and one query:
- compressed branch: attention over the complete compressed blocks (block i = tokens
  [i * stride, i * stride + compress_block_size)), whose keys/values are the block means of the
  roped keys / values passed through the layer's `compress_k` / `compress_v` projections;
- selection: compressed probabilities summed over the query heads of a GQA group, mapped onto
  selection blocks by `block_score_map`; block 0 and the two newest blocks are forced, the others
  follow by descending score (ties to the lower id), `num_selected_blocks` in all, -1 pads;
- selected branch: attention over the tokens of the selected blocks (< L);
- window branch: attention over the last `sliding_window` tokens;
- out = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win, gates sigmoid-ed per query head.
"""
from dataclasses import dataclass

import torch

from hisparse.models.config import NsaConfig


@dataclass
class NsaKV:
    """One layer's KV: keys (roped), values [B, Hkv, capacity, D]; compressed_keys,
    compressed_values [B, Hkv, compressed capacity, D]. Entries beyond a row's length are unused."""

    keys: torch.Tensor
    values: torch.Tensor
    compressed_keys: torch.Tensor
    compressed_values: torch.Tensor

    def write(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys, values [B, Hkv, S, D] of the tokens at positions [B, S] (a hierarchical state
        overrides this to write its host pool too)."""
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        self.keys[rows, :, positions] = keys.transpose(1, 2)
        self.values[rows, :, positions] = values.transpose(1, 2)

    def write_compressed(self, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store compressed blocks blocks [B, C]: keys, values [B, Hkv, C, D]."""
        rows = torch.arange(blocks.shape[0], device=blocks.device)[:, None]
        self.compressed_keys[rows, :, blocks] = keys.transpose(1, 2)
        self.compressed_values[rows, :, blocks] = values.transpose(1, 2)


def compressed_count(length, config: NsaConfig):
    """Complete compressed blocks among `length` tokens (an int, or a tensor of lengths)."""
    size, stride = config.compress_block_size, config.compress_block_stride
    if isinstance(length, torch.Tensor):
        return torch.where(length >= size, (length - size) // stride + 1, 0)
    return 0 if length < size else (length - size) // stride + 1


def block_score_map(n_compressed: int, n_blocks: int, config: NsaConfig, device) -> torch.Tensor:
    """[n_compressed, n_blocks] weights: score[j] = sum_{m < sel/stride} sum_{p < cmp/stride}
    p_cmp[(sel/stride) * j + m - p] (NSA paper eq. 9, indices shifted as in hisparse/nsa.py)."""
    ratio = config.selection_block_size // config.compress_block_stride
    span = config.compress_block_size // config.compress_block_stride
    i = torch.arange(n_compressed, device=device)[:, None]
    offset = i - ratio * torch.arange(n_blocks, device=device)[None, :]  # m - p
    m = torch.arange(ratio, device=device)
    p = torch.arange(span, device=device)
    pairs = (m[:, None] - p[None, :]).flatten()
    return (offset[..., None] == pairs).sum(-1).float()


def top_blocks(scores: torch.Tensor, n_blocks: torch.Tensor, n_select: int) -> torch.Tensor:
    """scores [..., nb] float32 and the block count per row (broadcastable to [..., 1]) -> ids [..., n_select]."""
    j = torch.arange(scores.shape[-1], device=scores.device)
    ranked = torch.where((j == 0) | (j >= n_blocks - 2), float("inf"), scores)
    ranked = torch.where(j < n_blocks, ranked, float("-inf"))
    values, order = torch.sort(ranked, dim=-1, descending=True, stable=True)
    blocks = torch.where(values == float("-inf"), -1, order)[..., :n_select]
    return torch.nn.functional.pad(blocks, (0, n_select - blocks.shape[-1]), value=-1)


def grouped_attention(q, k, v, mask, scale):
    """q [B, Hkv, G, D], k, v [B, Hkv, L, D], mask broadcastable to [B, Hkv, G, L] -> out
    [B, Hkv, G, D] and float32 probs [B, Hkv, G, L]; rows without a valid key give zeros."""
    logits = torch.einsum("bkgd,bkld->bkgl", q.float(), k.float()) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.where(mask, torch.softmax(logits, dim=-1), 0.0)
    return torch.einsum("bkgl,bkld->bkgd", probs.to(v.dtype), v), probs


class TorchNsaAttention:
    def __init__(self, config: NsaConfig):
        self.config = config
        self.scale = config.head_dim ** -0.5

    def decode(self, layer_idx: int, q: torch.Tensor, gates: torch.Tensor, kv: NsaKV,
               lengths: torch.Tensor, blocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, H, D] (roped), gates [B, H, 3] (sigmoid-ed), rows of lengths [B] -> out [B, H, D] and
        the selection blocks [B, Hkv, n] it attended over: its own, or `blocks` when given (a layer
        sharing its anchor's selection)."""
        b, h, d = q.shape
        qg = q.view(b, kv.keys.shape[1], -1, d)
        o_cmp, probs = self.compressed(layer_idx, qg, kv, lengths)
        if blocks is None:
            blocks = self.select(layer_idx, probs, lengths, -(-kv.keys.shape[2] // self.config.selection_block_size))
        o_slc = self.selected(layer_idx, qg, kv, lengths, blocks)
        o_win = self.window(layer_idx, qg, kv, lengths)
        g = gates.view(b, kv.keys.shape[1], -1, 3).to(q.dtype)
        out = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win
        return out.reshape(b, h, d), blocks

    def compressed(self, layer_idx, qg, kv: NsaKV, lengths: torch.Tensor):
        blocks = torch.arange(kv.compressed_keys.shape[2], device=qg.device)
        mask = (blocks[None, :] < compressed_count(lengths, self.config)[:, None])[:, None, None, :]
        return grouped_attention(qg, kv.compressed_keys, kv.compressed_values, mask, self.scale)

    def select(self, layer_idx, probs: torch.Tensor, lengths: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """Compressed probs [B, Hkv, G, C] -> selection blocks [B, Hkv, num_selected_blocks] int64,
        among the first `n_blocks` blocks (those of the capacity)."""
        size = self.config.selection_block_size
        weights = block_score_map(probs.shape[-1], n_blocks, self.config, probs.device)
        scores = probs.sum(2) @ weights  # [B, Hkv, nb]
        return top_blocks(scores, ((lengths + size - 1) // size)[:, None, None], self.config.num_selected_blocks)

    def selected(self, layer_idx, qg, kv: NsaKV, lengths: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        size = self.config.selection_block_size
        tokens = (blocks[..., None] * size + torch.arange(size, device=qg.device)).flatten(2)  # [B, Hkv, n * size]
        valid = (tokens >= 0) & (tokens < lengths[:, None, None]) & (blocks >= 0).repeat_interleave(size, dim=-1)
        index = tokens.clamp(0, kv.keys.shape[2] - 1)[..., None].expand(-1, -1, -1, qg.shape[-1])
        out, _ = grouped_attention(qg, kv.keys.gather(2, index), kv.values.gather(2, index), valid[:, :, None],
                                   self.scale)
        return out

    def window(self, layer_idx, qg, kv: NsaKV, lengths: torch.Tensor) -> torch.Tensor:
        tokens = torch.arange(kv.keys.shape[2], device=qg.device)[None, :]
        mask = (tokens < lengths[:, None]) & (tokens >= lengths[:, None] - self.config.sliding_window)
        return grouped_attention(qg, kv.keys, kv.values, mask[:, None, None, :], self.scale)[0]

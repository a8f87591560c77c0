"""NSA in plain torch: the references of the kernels in ops.py, and the decode-step attention the NSA model swaps.

Same semantics as `hisparse/nsa/ops.py` (the Triton decode kernels and their references), with the block
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
import torch.nn.functional as F

from hisparse.models.config import NsaConfig
from hisparse.nsa.ops import (
    CMP_BLOCK,
    CMP_STRIDE,
    N_SELECT,
    SEL_BLOCK,
    block_count,
    compressed_count,
    resident_rows,
)


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


def compressed_blocks(length, config: NsaConfig):
    """Complete compressed blocks among `length` tokens (an int, or a tensor of lengths)."""
    size, stride = config.compress_block_size, config.compress_block_stride
    if isinstance(length, torch.Tensor):
        return torch.where(length >= size, (length - size) // stride + 1, 0)
    return 0 if length < size else (length - size) // stride + 1


def block_score_map(n_compressed: int, n_blocks: int, config: NsaConfig, device) -> torch.Tensor:
    """[n_compressed, n_blocks] weights: score[j] = sum_{m < sel/stride} sum_{p < cmp/stride}
    p_cmp[(sel/stride) * j + m - p] (NSA paper eq. 9, indices shifted as in hisparse/nsa/ops.py)."""
    ratio = config.selection_block_size // config.compress_block_stride
    span = config.compress_block_size // config.compress_block_stride
    i = torch.arange(n_compressed, device=device)[:, None]
    offset = i - ratio * torch.arange(n_blocks, device=device)[None, :]  # m - p
    m = torch.arange(ratio, device=device)
    p = torch.arange(span, device=device)
    pairs = (m[:, None] - p[None, :]).flatten()
    return (offset[..., None] == pairs).sum(-1).float()


def selection_scores(p_cmp: torch.Tensor, n_blocks: int, config: NsaConfig) -> torch.Tensor:
    """p_cmp [..., C] float32 -> scores [..., n_blocks]: p_cmp @ block_score_map(C, n_blocks) in
    linear memory (the prefill's), as sums of (sel/stride) * (cmp/stride) shifted slices: score[j] =
    sum_{m, p} p_cmp[(sel/stride) * j + m - p], indices outside [0, C) skipped. The same values up to
    the order of the float additions."""
    ratio = config.selection_block_size // config.compress_block_stride
    span = config.compress_block_size // config.compress_block_stride
    # index i sits at i + span - 1; the right pad reaches index ratio * (n_blocks - 1) + ratio - 1
    padded = torch.nn.functional.pad(p_cmp, (span - 1, max(ratio * n_blocks - p_cmp.shape[-1], 0)))
    scores = torch.zeros(*p_cmp.shape[:-1], n_blocks, dtype=p_cmp.dtype, device=p_cmp.device)
    for m in range(ratio):
        for p in range(span):
            first = m - p + span - 1
            scores += padded[..., first: first + ratio * (n_blocks - 1) + 1: ratio]
    return scores


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
        mask = (blocks[None, :] < compressed_blocks(lengths, self.config)[:, None])[:, None, None, :]
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


def _prefill_masked_ref(q, keys, values, mask, scale):
    """q [B, S, H, D], keys, values [B, KV, T, D], mask broadcastable to [B, KV, S, T] -> fp32 [B, S, H, D]."""
    b, s, h, d = q.shape
    kv_heads = keys.shape[1]
    qg = q.float().view(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)          # [B, KV, G, S, D]
    logits = torch.einsum("bkgsd,bktd->bkgst", qg, keys.float()) * (d ** -0.5 if scale is None else scale)
    mask = mask[..., None, :, :]                                                         # over the G heads
    probs = torch.where(mask, torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1), 0.0)
    return torch.einsum("bkgst,bktd->bkgsd", probs, values.float()).permute(0, 3, 1, 2, 4).reshape(b, s, h, d)


def nsa_prefill_selected_ref(q, keys, values, blocks, start, block_size, scale=None):
    """nsa_prefill_selected in torch: q [B, S, H, D] at positions start .. start + S - 1, keys,
    values [B, KV, T, D], blocks [B, KV, S, n] (-1 pads) -> fp32 [B, S, H, D], each query over the
    tokens of its blocks up to it, as the reference prefill's mask."""
    b, s = q.shape[:2]
    kv_heads, t = keys.shape[1], keys.shape[2]
    tokens = torch.arange(t, device=q.device)
    chosen = torch.zeros(b, kv_heads, s, -(-t // block_size) + 1, dtype=torch.bool, device=q.device)
    chosen = chosen.scatter(-1, torch.where(blocks < 0, chosen.shape[-1] - 1, blocks.long()), True)[..., :-1]
    causal = tokens[None, :] <= torch.arange(start, start + s, device=q.device)[:, None]  # [S, T]
    return _prefill_masked_ref(q, keys, values, chosen[..., tokens // block_size] & causal, scale)


def nsa_prefill_window_ref(q, keys, values, start, window, scale=None):
    """nsa_prefill_window in torch: each query over the last `window` tokens up to it -> fp32 [B, S, H, D]."""
    pos = torch.arange(start, start + q.shape[1], device=q.device)[:, None]
    tokens = torch.arange(keys.shape[2], device=q.device)[None, :]
    return _prefill_masked_ref(q, keys, values, (tokens <= pos) & (tokens > pos - window), scale)


def nsa_compress_ref(k, v, weight_k=None, weight_v=None):
    """Compressed keys/values [N, KV, C, D] of dense k, v [N, KV, T, D], C = blocks fitting in T."""
    def pool(x, w):
        if x.shape[2] < CMP_BLOCK:
            return x.new_zeros(*x.shape[:2], 0, x.shape[3])
        y = x.float().unfold(2, CMP_BLOCK, CMP_STRIDE).mean(-1)  # [N, KV, C, D]
        return (y @ w.float() if w is not None else y).to(x.dtype)
    return pool(k, weight_k), pool(v, weight_v)


def _masked_attention(q, k, v, mask, scale):
    """q [N, KV, G, D], k, v [N, KV, L, D], mask [N, KV, L] -> out [N, KV, G, D], probs [N, KV, G, L].

    Rows without any valid key give zeros."""
    logits = torch.einsum("nkgd,nkld->nkgl", q, k) * scale
    logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    probs = torch.where(mask[:, :, None, :], probs, 0.0).to(v.dtype)
    return torch.einsum("nkgl,nkld->nkgd", probs, v), probs


def _grouped(q, kv_heads, dtype):
    n, h, d = q.shape
    return q.to(dtype).view(n, kv_heads, h // kv_heads, d)


def nsa_compressed_attention_ref(q, ck, cv, lengths, scale=None, dtype=torch.float32):
    """-> out [N, H, D], probs [N, KV, G, C] (compressed-branch softmax, 0 beyond each request)."""
    n, h, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    valid = torch.arange(ck.shape[2], device=q.device)[None, :] < compressed_count(lengths)[:, None]
    mask = valid[:, None, :].expand(n, ck.shape[1], -1)
    out, probs = _masked_attention(_grouped(q, ck.shape[1], dtype), ck.to(dtype), cv.to(dtype), mask, scale)
    return out.reshape(n, h, d), probs


def nsa_selection_scores_ref(probs, n_blocks):
    """Selection-block scores [N, KV, n_blocks] from compressed probabilities [N, KV, G, C]."""
    p_cmp = probs.float().sum(2)  # [N, KV, C]
    ratio, span = SEL_BLOCK // CMP_STRIDE, CMP_BLOCK // CMP_STRIDE
    padded = F.pad(p_cmp, (span - 1, ratio * n_blocks + ratio))
    j = torch.arange(n_blocks, device=probs.device)
    scores = torch.zeros(*p_cmp.shape[:2], n_blocks, device=probs.device)
    for m in range(ratio):
        for p in range(span):
            scores += padded[..., ratio * j + m - p + span - 1]
    return scores


def nsa_topn_ref(scores, lengths, n_select=N_SELECT):
    """Top-n selection blocks [N, KV, n_select] int32: forced 0 and the two newest, then by score."""
    n_blocks = scores.shape[-1]
    j = torch.arange(n_blocks, device=scores.device)
    n_blk = block_count(lengths).clamp(max=n_blocks)[:, None, None]
    cur = torch.where((j == 0) | (j >= n_blk - 2), float("inf"), scores.float())
    cur = torch.where(j < n_blk, cur, float("-inf"))
    values, order = torch.sort(cur, dim=-1, descending=True, stable=True)
    values, order = values[..., :n_select], order[..., :n_select]
    blocks = torch.where(values == float("-inf"), -1, order)
    return F.pad(blocks, (0, n_select - blocks.shape[-1]), value=-1).to(torch.int32)


def nsa_selected_attention_ref(q, kv_rows, rows, blocks, lengths, scale=None, dtype=torch.float32):
    """Attention over the rows `rows [N, KV, n]` of kv_rows [R, 2, SEL_BLOCK, D] -> [N, H, D]."""
    n, h, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    kv_heads, n_sel = rows.shape[1:]
    kv_rows = kv_rows.view(-1, 2, SEL_BLOCK, d)
    gathered = kv_rows[rows.clamp(min=0).long()].to(dtype)  # [N, KV, n, 2, SEL_BLOCK, D]
    k = gathered[:, :, :, 0].reshape(n, kv_heads, n_sel * SEL_BLOCK, d)
    v = gathered[:, :, :, 1].reshape(n, kv_heads, n_sel * SEL_BLOCK, d)
    valid_len = lengths[:, None, None] - blocks.long() * SEL_BLOCK  # [N, KV, n]
    t = torch.arange(SEL_BLOCK, device=q.device)
    mask = (t < valid_len[..., None]) & (rows >= 0)[..., None] & (blocks >= 0)[..., None]
    out, _ = _masked_attention(_grouped(q, kv_heads, dtype), k, v, mask.reshape(n, kv_heads, -1), scale)
    return out.reshape(n, h, d)


def nsa_window_attention_ref(q, win_k, win_v, lengths, scale=None, dtype=torch.float32):
    """Attention over the valid part of the ring buffers win_k, win_v [N, KV, W, D] -> [N, H, D]."""
    n, h, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    window = win_k.shape[2]
    valid = torch.arange(window, device=q.device)[None, :] < lengths.clamp(max=window)[:, None]
    mask = valid[:, None, :].expand(n, win_k.shape[1], -1)
    out, _ = _masked_attention(_grouped(q, win_k.shape[1], dtype), win_k.to(dtype), win_v.to(dtype), mask, scale)
    return out.reshape(n, h, d)


def nsa_gate_ref(gates, o_cmp, o_slc, o_win):
    g = gates.float()
    return g[..., 0:1] * o_cmp.float() + g[..., 1:2] * o_slc.float() + g[..., 2:3] * o_win.float()


def nsa_decode_ref(q, ck, cv, pool, win_k, win_v, lengths, gates, n_units, n_select=N_SELECT,
                   scale=None, dtype=torch.float32):
    """The whole NSA decode step over the resident pool: -> out [N, H, D] (q's dtype), blocks."""
    o_cmp, probs = nsa_compressed_attention_ref(q, ck, cv, lengths, scale, dtype)
    blocks = nsa_topn_ref(nsa_selection_scores_ref(probs, n_units), lengths, n_select)
    rows = resident_rows(blocks, n_units)
    o_slc = nsa_selected_attention_ref(q, pool, rows, blocks, lengths, scale, dtype)
    o_win = nsa_window_attention_ref(q, win_k, win_v, lengths, scale, dtype)
    return nsa_gate_ref(gates, o_cmp, o_slc, o_win).to(q.dtype), blocks

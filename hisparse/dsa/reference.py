"""DSA in plain torch: the references of the kernels in ops.py and fp8.py, and the decode step the DSA model swaps.

`DsaModel` calls `select` on anchor layers (indexer top-k) and `attend` on every layer (absorbed MLA
over the selected tokens). Replace the object in `DsaModel.sparse_attention` to run the same two steps
through kernels that read the hierarchical cache; the signatures are the contract.
"""
from dataclasses import dataclass

import torch

from hisparse.dsa import fp8, fp8_index


@dataclass
class MlaKV:
    """One layer's KV state: `latent` [B, capacity, kv_lora_rank + qk_rope_head_dim] (normalised
    latent then roped key, V = the first kv_lora_rank values), or uint8 [B, capacity, 656] FP8 rows
    (kv_dtype "fp8": hisparse.dsa.fp8, written quantised, read dequantised); `index_keys` [B,
    capacity, index_head_dim] on anchor layers, or float8_e4m3fn values with `index_scales` [B,
    capacity] float32 (index_dtype "fp8": hisparse.dsa.fp8_index's keys, written quantised), None on
    shared layers (`index_scales` None but with FP8 keys). Positions >= a row's length are unused."""

    latent: torch.Tensor
    index_keys: torch.Tensor | None
    index_scales: torch.Tensor | None = None
    # serving (hisparse.serving): [B] bool, the rows that hold a request; an empty row's decode write
    # goes to position capacity - 1, which no request ever holds (`lane_positions`), so a lane whose
    # request is being prefilled in place, even beside the step on another CUDA stream, is never written
    lanes: torch.Tensor | None = None

    def write(self, positions: torch.Tensor, latent: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Store the rows of the tokens at positions [B, S]: latent [B, S, Dc + Dr], index_keys
        [B, S, Di] or None (a hierarchical state overrides this to write its host pool too); FP8
        rows store the latents quantised (`fp8.to_rows`), FP8 keys the keys (`fp8_index.quantize_keys`)."""
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        if self.latent.dtype == torch.uint8:
            latent = fp8.to_rows(latent)
        self.latent[rows, self.lane_positions(positions, self.latent)] = latent
        if index_keys is not None:
            self.write_index_keys(rows, positions, index_keys)

    def write_index_keys(self, rows: torch.Tensor, positions: torch.Tensor, index_keys: torch.Tensor) -> None:
        """index_keys [B, S, Di] at positions [B, S] of rows [B, 1], quantised where stored as FP8 keys."""
        at = self.lane_positions(positions, self.index_keys)
        if self.index_scales is not None:
            index_keys, scales = fp8_index.quantize_keys(index_keys)
            self.index_scales[rows, at] = scales
        self.index_keys[rows, at] = index_keys

    def lane_positions(self, positions: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        """positions [B, S] with an empty lane's moved to the last position of pool [B, capacity, D].
        No request's KV holds position capacity - 1: the server refuses prompt + max_new_tokens >
        max_context (its states' capacity), and a request holds at most prompt + max_new_tokens - 1
        tokens (its last token is never written), so an empty lane writes there unconditionally."""
        if self.lanes is None:
            return positions
        return torch.where(self.lanes[:, None], positions, pool.shape[1] - 1)


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k largest scores along the last dim, best first, ties to the lower id (as
    hisparse.dsa.ops.topk_select; torch.topk leaves the order of ties unspecified)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


class TorchDsaAttention:
    def select(self, layer_idx: int, index_q: torch.Tensor, index_weights: torch.Tensor, kv: MlaKV,
               lengths: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
        """Lightning indexer top-k for one new token per row.

        index_q [B, Hi, Di] (roped), index_weights [B, Hi] (float32, already times Hi^-0.5):
        score(s) = sum_h w_h * relu(scale * q_h . k_s) over the first lengths[b] keys of row b. Returns
        [B, topk] int64 token ids in descending score order (ties to the lower id), -1 where a row has
        fewer than topk tokens. FP8 keys (with scales): `fp8_index.fp8_scores_ref`, the query quantised.
        """
        if kv.index_scales is not None:
            index_scores = fp8_index.fp8_scores_ref(index_q[:, None], index_weights[:, None] * scale,
                                                    kv.index_keys, kv.index_scales)[:, 0]
        else:
            scores = torch.relu(torch.einsum("bhd,btd->bht", index_q.float(), kv.index_keys.float()) * scale)
            index_scores = torch.einsum("bh,bht->bt", index_weights, scores)
        valid = torch.arange(index_scores.shape[1], device=lengths.device)[None, :] < lengths[:, None]
        chosen = stable_topk(index_scores.masked_fill(~valid, float("-inf")), topk)
        chosen = torch.where(valid.gather(1, chosen), chosen, -1)
        return torch.nn.functional.pad(chosen, (0, topk - chosen.shape[1]), value=-1)

    def attend(self, layer_idx: int, q_latent: torch.Tensor, q_rope: torch.Tensor, kv: MlaKV, lengths: torch.Tensor,
               selection: torch.Tensor, scale: float) -> torch.Tensor:
        """Absorbed MLA over the selected tokens: q_latent [B, H, Dc], q_rope [B, H, Dr],
        selection [B, k] (-1 pads). Returns the attention-weighted latent [B, H, Dc]."""
        dc = q_latent.shape[-1]
        valid = selection >= 0  # [B, k]
        rows = kv.latent.gather(1, selection.clamp(min=0)[..., None].expand(-1, -1, kv.latent.shape[-1]))
        if rows.dtype == torch.uint8:                                  # FP8 rows: their values in q's dtype
            rows = fp8.from_rows(rows, q_latent.dtype)
        q = torch.cat([q_latent, q_rope], dim=-1)  # [B, H, Dc + Dr]
        scores = torch.einsum("bhd,bkd->bhk", q, rows) * scale
        scores = scores.masked_fill(~valid[:, None, :], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("bhk,bkc->bhc", probs, rows[..., :dc])


def indexer_scores_ref(q, weights, keys, lengths, key_scale=None) -> torch.Tensor:
    """Plain-torch lightning-indexer scores [N, T] float32, -inf at t >= lengths[n]."""
    logits = torch.einsum("nhd,ntd->nht", q.float(), keys.float())  # [N, H, T]
    scores = (logits.relu() * weights.float()[:, :, None]).sum(dim=1)  # [N, T]
    if key_scale is not None:
        scores = scores * key_scale
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] < lengths[:, None]
    return scores.masked_fill(~valid, float("-inf"))


def topk_select_ref(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Plain-torch top-k: stable descending sort of the valid scores, -1 padding."""
    n, t = scores.shape
    valid = torch.arange(t, device=scores.device)[None, :] < lengths[:, None]
    order = torch.sort(scores.masked_fill(~valid, float("-inf")), dim=1, descending=True, stable=True).indices
    order = order[:, :k]
    sel = torch.full((n, k), -1, dtype=torch.int32, device=scores.device)
    sel[:, :order.shape[1]] = torch.where(order < lengths[:, None], order, -1).to(torch.int32)
    return sel


def sparse_mla_decode_ref(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, sm_scale: float,
                          d_v: int = 512, row_base: torch.Tensor | None = None):
    """Plain-torch float32 absorbed-MLA decode over the selected rows: (out in q's dtype, lse float32)."""
    valid = rows >= 0  # [N, k]
    base = 0 if row_base is None else row_base[:, None]
    picked = kv[torch.where(valid, base + rows.long(), 0)].float()  # [N, k, D]
    logits = torch.einsum("nhd,nkd->nhk", q.float(), picked) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [N, H], -inf without a valid row
    probs = torch.exp(logits - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("nhk,nkv->nhv", probs, picked[..., :d_v])
    return out.to(q.dtype), lse


def sparse_mla_decode_fp8_ref(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, sm_scale: float,
                              row_base: torch.Tensor | None = None):
    """`fp8.sparse_mla_decode_fp8` in plain torch: dequantise the selected rows of kv uint8 [R, 656]
    (`fp8.dequantize_rows`), then `sparse_mla_decode_ref` (float32 absorbed MLA): (out [N, H, 512] in
    q's dtype, lse [N, H] float32)."""
    n, k = rows.shape
    valid = rows >= 0
    base = 0 if row_base is None else row_base[:, None]
    latent, rope = fp8.dequantize_rows(kv[torch.where(valid, base + rows.long(), 0)])  # [N, k, 512], [N, k, 64]
    picked = torch.cat([latent, rope.float()], dim=-1).view(n * k, fp8.D_LATENT + fp8.D_ROPE)
    local = torch.where(valid, torch.arange(n * k, device=rows.device).view(n, k), -1)
    return sparse_mla_decode_ref(q, picked, local, sm_scale, d_v=fp8.D_LATENT)

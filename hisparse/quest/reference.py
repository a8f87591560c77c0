"""Quest in plain torch: the references of the kernels in ops.py, and the decode step the model swaps.

Pages of `page_size` tokens; per page and KV head the element-wise min and max of the post-RoPE keys
stay resident. A query head bounds a page by sum_i max(q_i * max_i, q_i * min_i); a KV head scores the page with
the max of the bounds of its GQA group, so there is one selection per KV head (a stream per
(request, layer, KV head)). The page holding the newest token is always selected, plus the best
other pages (ties to the lower page) up to `token_budget // page_size` pages, output in ascending
page order, -1 padding at the end: the semantics of hisparse/quest/ops.py.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hisparse.models.layers import softmax_attention
from hisparse.quest.ops import PAGE, check_append, check_attention, check_scores, check_select


@dataclass
class PagedKV:
    """One layer's KV: keys, values [B, Hkv, capacity, D] (keys after RoPE); page_min, page_max
    [B, Hkv, ceil(capacity / page_size), D]. Positions >= a row's length are unused."""

    keys: torch.Tensor
    values: torch.Tensor
    page_min: torch.Tensor
    page_max: torch.Tensor

    def write(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, page_size: int) -> None:
        """Store keys, values [B, Hkv, S, D] of the tokens at positions [B, S] and update the bounds
        of their pages (a hierarchical state overrides this to write its host pool too)."""
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        self.keys[rows, :, positions] = keys.transpose(1, 2)
        self.values[rows, :, positions] = values.transpose(1, 2)
        if positions.shape[1] == 1:
            self._update_newest_pages(positions[:, 0] + 1, page_size)
        else:  # prefill: every row at the same positions
            self._update_pages(int(positions[0, 0]), int(positions[0, -1]) + 1, page_size)

    def _update_pages(self, start: int, end: int, page_size: int) -> None:
        """Recompute the bounds of the pages holding positions start .. end - 1 (every row)."""
        first, last = start // page_size, (end - 1) // page_size + 1
        keys = self.keys[:, :, first * page_size: end]
        pad = last * page_size - end
        b, h, _, d = keys.shape
        low = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("inf")).view(b, h, -1, page_size, d)
        high = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("-inf")).view(b, h, -1, page_size, d)
        self.page_min[:, :, first:last] = low.amin(dim=3)
        self.page_max[:, :, first:last] = high.amax(dim=3)

    def _update_newest_pages(self, lengths: torch.Tensor, page_size: int) -> None:
        """Recompute the bounds of each row's newest page, rows holding lengths [B] tokens."""
        b, h, _, d = self.keys.shape
        page = (lengths - 1) // page_size  # [B]
        tokens = page[:, None] * page_size + torch.arange(page_size, device=lengths.device)  # [B, P]
        keys = self.keys.gather(2, tokens.clamp(max=self.keys.shape[2] - 1)[:, None, :, None].expand(b, h, -1, d))
        valid = (tokens < lengths[:, None])[:, None, :, None]
        rows = torch.arange(b, device=lengths.device)
        self.page_min[rows, :, page] = torch.where(valid, keys, float("inf")).amin(dim=2)
        self.page_max[rows, :, page] = torch.where(valid, keys, float("-inf")).amax(dim=2)


class TorchQuestAttention:
    def __init__(self, token_budget: int = 4096):
        self.token_budget = token_budget

    def select(self, layer_idx: int, q: torch.Tensor, kv: PagedKV, lengths: torch.Tensor,
               page_size: int) -> torch.Tensor:
        """q [B, H, D] (roped) -> page ids [B, Hkv, budget pages] int64, ascending, -1 padding."""
        b, hkv, max_pages, d = kv.page_min.shape
        n_select = max(self.token_budget // page_size, 1)
        qg = q.view(b, hkv, -1, 1, d).float()  # [B, Hkv, G, 1, D]
        low, high = kv.page_min[:, :, None].float(), kv.page_max[:, :, None].float()
        scores = torch.maximum(qg * low, qg * high).sum(-1).amax(2)  # [B, Hkv, max_pages]
        pages = torch.arange(max_pages, device=q.device)
        current = ((lengths - 1) // page_size)[:, None, None]
        scores = torch.where(pages == current, float("inf"), scores)
        scores = torch.where(pages > current, float("-inf"), scores)
        values, chosen = torch.sort(scores, dim=-1, descending=True, stable=True)
        chosen = torch.where(values > float("-inf"), chosen, max_pages)[..., :n_select].sort(dim=-1).values
        chosen = torch.where(chosen == max_pages, -1, chosen)
        return torch.nn.functional.pad(chosen, (0, n_select - chosen.shape[-1]), value=-1)

    def attend(self, layer_idx: int, q: torch.Tensor, kv: PagedKV, lengths: torch.Tensor, selection: torch.Tensor,
               page_size: int, scale: float) -> torch.Tensor:
        """Attention of q [B, H, D] over the tokens of the selected pages -> [B, H, D]."""
        b, hkv, _, d = kv.keys.shape
        offsets = torch.arange(page_size, device=q.device)
        tokens = (selection[..., None] * page_size + offsets).flatten(2)  # [B, Hkv, n_select * P]
        valid = (selection[..., None] >= 0).expand(-1, -1, -1, page_size).flatten(2)
        valid = valid & (tokens < lengths[:, None, None])
        index = tokens.clamp(0, kv.keys.shape[2] - 1)[..., None].expand(-1, -1, -1, d)
        keys, values = kv.keys.gather(2, index), kv.values.gather(2, index)
        qg = q.view(b, hkv, -1, d)  # [B, Hkv, G, D]
        out = softmax_attention(qg, keys, values, scale, valid[:, :, None, :])
        return out.reshape(b, -1, d)


def quest_metadata_append_ref(kmin, kmax, key, positions) -> None:
    """Reference of `quest_metadata_append` (in place)."""
    check_append(kmin, kmax, key, positions)
    for n, pos in enumerate(positions.tolist()):
        if not 0 <= pos < kmin.shape[2] * PAGE:
            continue
        page = pos // PAGE
        if pos % PAGE == 0:
            kmin[n, :, page] = key[n]
            kmax[n, :, page] = key[n]
        else:
            kmin[n, :, page] = torch.minimum(kmin[n, :, page], key[n])
            kmax[n, :, page] = torch.maximum(kmax[n, :, page], key[n])


def quest_page_scores_ref(q, kmin, kmax, lengths) -> torch.Tensor:
    """Reference of `quest_page_scores`, in float32."""
    group = check_scores(q, kmin, kmax, lengths)
    n, hkv, max_pages, d = kmin.shape
    qg = q.float().view(n, hkv, group, 1, d)
    lo, hi = kmin.float().unsqueeze(2), kmax.float().unsqueeze(2)  # [N, HKV, 1, P, D]
    bound = torch.maximum(qg * hi, qg * lo).sum(-1).amax(2)  # [N, HKV, P]
    n_pages = (lengths.long() + PAGE - 1) // PAGE
    valid = torch.arange(max_pages, device=q.device) < n_pages.view(n, 1, 1)
    return bound.masked_fill(~valid, float("-inf"))


def quest_select_pages_ref(scores, lengths, budget_tokens) -> torch.Tensor:
    """Reference of `quest_select_pages`: stable sorts by (current page first, score desc, page asc)."""
    k = check_select(scores, lengths, budget_tokens)
    n, hkv, max_pages = scores.shape
    cur = ((lengths.long() + PAGE - 1) // PAGE - 1).view(n, 1, 1)
    idx = torch.arange(max_pages, device=scores.device).expand(n, hkv, max_pages)
    rank_class = torch.where(idx == cur, 0, torch.where(idx < cur, 1, 2))  # current, other, none
    by_score = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    by_class = torch.sort(rank_class.gather(-1, by_score), dim=-1, stable=True).indices
    ranked = by_score.gather(-1, by_class)[..., :k]
    chosen = torch.where(rank_class.gather(-1, ranked) < 2, ranked, max_pages)
    chosen = torch.sort(chosen, dim=-1).values
    chosen = torch.where(chosen == max_pages, -1, chosen).to(torch.int32)
    return F.pad(chosen, (0, k - chosen.shape[-1]), value=-1)


def quest_attention_ref(q, kv, rows, pages, lengths, scale: float | None = None) -> torch.Tensor:
    """Reference of `quest_attention`: gather the rows, then plain softmax attention in float32."""
    kv, group = check_attention(q, kv, rows, pages, lengths)
    n, hq, d = q.shape
    hkv, k = rows.shape[1], rows.shape[2]
    scale = d ** -0.5 if scale is None else scale
    gathered = kv[rows.clamp(min=0).long()].float()  # [N, HKV, K, 2, PAGE, D]
    pos = pages.long().unsqueeze(-1) * PAGE + torch.arange(PAGE, device=q.device)  # [N, HKV, K, PAGE]
    valid = (rows >= 0).unsqueeze(-1) & (pages >= 0).unsqueeze(-1) & (pos < lengths.view(n, 1, 1, 1))
    keys = gathered[:, :, :, 0].reshape(n, hkv, k * PAGE, d)
    values = gathered[:, :, :, 1].reshape(n, hkv, k * PAGE, d)
    logits = q.float().view(n, hkv, group, d) @ keys.transpose(-1, -2) * scale  # [N, HKV, G, K*PAGE]
    logits = logits.masked_fill(~valid.view(n, hkv, 1, k * PAGE), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no valid token gives zeros
    return (probs @ values).view(n, hq, d).to(q.dtype)


def dense_attention_ref(q, k, v, lengths=None, scale: float | None = None) -> torch.Tensor:
    """Reference of `dense_attention`: plain softmax attention in float32."""
    n, hq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    logits = q.float().view(n, hkv, hq // hkv, d) @ k.float().transpose(-1, -2) * scale  # [N, HKV, G, T]
    if lengths is not None:
        valid = torch.arange(t, device=q.device) < lengths.view(n, 1).long()
        logits = logits.masked_fill(~valid.view(n, 1, 1, t), float("-inf"))
    return (torch.softmax(logits, dim=-1) @ v.float()).view(n, hq, d).to(q.dtype)

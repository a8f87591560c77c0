"""Quest decode-step sparse attention in plain torch: the swappable part of the Quest model.

Pages of `page_size` tokens; per page and KV head the element-wise min and max of the post-RoPE keys
stay resident. A query head bounds a page by sum_i max(q_i * max_i, q_i * min_i); a KV head scores the page with
the max of the bounds of its GQA group, so there is one selection per KV head (a stream per
(request, layer, KV head)). The page holding the newest token is always selected, plus the best
other pages (ties to the lower page) up to `token_budget // page_size` pages, output in ascending
page order, -1 padding at the end: the semantics of hisparse/quest.py.
"""
from dataclasses import dataclass

import torch

from hisparse.models.layers import softmax_attention


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

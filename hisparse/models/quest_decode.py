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
    [B, Hkv, ceil(capacity / page_size), D]. Positions >= the state's length are unused."""

    keys: torch.Tensor
    values: torch.Tensor
    page_min: torch.Tensor
    page_max: torch.Tensor

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor, page_size: int) -> None:
        """Store keys, values [B, Hkv, S, D] at positions start .. start + S - 1 and update the
        bounds of their pages (a hierarchical state overrides this to write its host pool too)."""
        end = start + keys.shape[2]
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        self.update_pages(start, end, page_size)

    def update_pages(self, start: int, end: int, page_size: int) -> None:
        """Recompute the bounds of the pages holding positions start .. end - 1."""
        first, last = start // page_size, (end - 1) // page_size + 1
        keys = self.keys[:, :, first * page_size: end]
        pad = last * page_size - end
        b, h, _, d = keys.shape
        low = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("inf")).view(b, h, -1, page_size, d)
        high = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("-inf")).view(b, h, -1, page_size, d)
        self.page_min[:, :, first:last] = low.amin(dim=3)
        self.page_max[:, :, first:last] = high.amax(dim=3)


class TorchQuestAttention:
    def __init__(self, token_budget: int = 4096):
        self.token_budget = token_budget

    def select(self, layer_idx: int, q: torch.Tensor, kv: PagedKV, length: int, page_size: int) -> torch.Tensor:
        """q [B, H, D] (roped) -> page ids [B, Hkv, budget pages] int64, ascending, -1 padding."""
        b, hkv = kv.keys.shape[:2]
        n_pages = (length + page_size - 1) // page_size
        n_select = max(self.token_budget // page_size, 1)
        qg = q.view(b, hkv, -1, 1, q.shape[-1]).float()  # [B, Hkv, G, 1, D]
        low, high = kv.page_min[:, :, None, :n_pages].float(), kv.page_max[:, :, None, :n_pages].float()
        scores = torch.maximum(qg * low, qg * high).sum(-1).amax(2)  # [B, Hkv, n_pages]
        current = n_pages - 1
        others = torch.sort(scores[..., :current], dim=-1, descending=True, stable=True).indices
        chosen = torch.cat([others[..., : n_select - 1], others.new_full((b, hkv, 1), current)], dim=-1)
        chosen = chosen.sort(dim=-1).values
        selection = chosen.new_full((b, hkv, n_select), -1)
        selection[..., : chosen.shape[-1]] = chosen
        return selection

    def attend(self, layer_idx: int, q: torch.Tensor, kv: PagedKV, length: int, selection: torch.Tensor,
               page_size: int, scale: float) -> torch.Tensor:
        """Attention of q [B, H, D] over the tokens of the selected pages -> [B, H, D]."""
        b, hkv, _, d = kv.keys.shape
        offsets = torch.arange(page_size, device=q.device)
        tokens = (selection[..., None] * page_size + offsets).flatten(2)  # [B, Hkv, n_select * P]
        valid = (selection[..., None] >= 0).expand(-1, -1, -1, page_size).flatten(2) & (tokens < length)
        index = tokens.clamp(0, kv.keys.shape[2] - 1)[..., None].expand(-1, -1, -1, d)
        keys, values = kv.keys.gather(2, index), kv.values.gather(2, index)
        qg = q.view(b, hkv, -1, d)  # [B, Hkv, G, D]
        out = softmax_attention(qg, keys, values, scale, valid[:, :, None, :])
        return out.reshape(b, -1, d)

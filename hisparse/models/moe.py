"""DeepSeek-V3 style mixture of experts (sigmoid router, group-limited top-k, shared experts).

Routed experts are held fused as in transformers (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); checkpoints store them per expert
(`experts.{e}.gate_proj.weight`, ...) and `loading.py` maps one onto the other.
"""
import torch
import torch.nn.functional as F
from torch import nn

from hisparse.models.config import DsaConfig
from hisparse.models.layers import GatedMLP


class TopkRouter(nn.Module):
    def __init__(self, config: DsaConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, top_k], expert ids [N, top_k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        n, experts = choice.shape
        group_scores = choice.view(n, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask[..., None].expand(-1, -1, experts // self.n_group).reshape(n, experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class Experts(nn.Module):
    def __init__(self, config: DsaConfig):
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], ids and weights [N, top_k] -> [N, H]: the routed experts' outputs, weighted."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.every_expert(x, ids, weights)
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():     # a host sync: not inside a CUDA graph
            token, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def every_expert(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The same sum with every expert run on every token, weight 0 where it is not routed: no
        data-dependent shapes or host syncs, so a CUDA graph can hold it, at E times the expert
        FLOPs (decode batches are small). Two matrix products read every expert's weights once, in
        place: one GEMM over all experts' gate and up rows stacked, one batched GEMM over their down
        projections. Each expert's output is weighted after its down projection, as in the sparse path,
        and the experts are summed in float32 with one rounding to x's dtype (the sparse path adds them
        in x's dtype, one after another: the last bits may differ)."""
        e, two_i, h = self.gate_up_proj.shape
        for name, w in (("gate_up_proj", self.gate_up_proj), ("down_proj", self.down_proj)):
            if not w.is_contiguous():     # a copy would double the step's reads
                raise ValueError(f"experts.{name} {tuple(w.shape)} has strides {w.stride()}: expected the "
                                 f"contiguous stacked layout, which the graphed path reads without a copy")
        n = x.shape[0]
        routed = torch.zeros(n, e, dtype=weights.dtype, device=x.device).scatter_add_(1, ids, weights)  # [N, E]
        gate_up = F.linear(x, self.gate_up_proj.view(e * two_i, h)).view(n, e, two_i)        # [N, E, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        act = (F.silu(gate) * up).transpose(0, 1)                                             # [E, N, I]
        y = torch.bmm(act, self.down_proj.transpose(1, 2))                                    # [E, N, H]
        return (y * routed.t()[..., None]).sum(dim=0).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, config: DsaConfig):
        super().__init__()
        self.gate = TopkRouter(config)
        self.experts = Experts(config)
        self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        return self.experts(flat, ids, weights).view_as(x) + self.shared_experts(x)

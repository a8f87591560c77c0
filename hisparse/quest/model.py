"""Llama (`llama`) and Qwen3 (`qwen3`) with Quest decoding on every layer but the first
`quest_dense_layers` (2). With `quest_selection_group` g > 1, each group of g consecutive Quest layers
attends over the pages its first layer selected (that layer's query and page bounds), so the others
select nothing: a shared selection, what layer-wise prefetch needs (DESIGN section 4).

Prefill is dense causal attention, as transformers' eager `LlamaForCausalLM` / `Qwen3ForCausalLM`
(Qwen3 adds an RMSNorm over each query and key head before RoPE). Decode on the Quest layers goes
through `QuestModel.sparse_attention` (see reference.py); the dense layers stay dense.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from hisparse.models.base import CausalLM, DecoderLayer, Step
from hisparse.models.config import LlamaConfig
from hisparse.models.layers import GatedMLP, RMSNorm, Rotary, rope_half, softmax_attention
from hisparse.quest.reference import PagedKV, TorchQuestAttention


class GqaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, rotary: Rotary, owner: "QuestModel"):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                        config.head_dim)
        self.page_size = config.quest_page_size
        self.quest = layer_idx >= config.quest_dense_layers
        self.anchor = config.selection_anchor(layer_idx)    # the layer whose selection this one uses
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scaling = self.head_dim ** -0.5
        self._rotary = (rotary,)  # shared by every layer, not a submodule
        self._owner = (owner,)

    def new_kv(self, batch: int, capacity: int, device, dtype) -> PagedKV:
        shape = (batch, self.n_kv_heads, capacity, self.head_dim)
        pages = (batch, self.n_kv_heads, -(-capacity // self.page_size), self.head_dim)
        return PagedKV(keys=torch.zeros(shape, device=device, dtype=dtype),
                       values=torch.zeros(shape, device=device, dtype=dtype),
                       page_min=torch.zeros(pages, device=device, dtype=dtype),
                       page_max=torch.zeros(pages, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, step: Step, kv: PagedKV) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self._rotary[0](step.positions, x.dtype)
        cos, sin = cos[:, :, None], sin[:, :, None]
        q = rope_half(q, cos, sin).transpose(1, 2)  # [B, H, S, D]
        kv.write(step.positions, rope_half(k, cos, sin).transpose(1, 2),
                 self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2), self.page_size)
        if step.decode and self.quest:
            quest = self._owner[0].sparse_attention
            if self.anchor == self.layer_idx:
                step.shared["quest_selection"] = quest.select(self.layer_idx, q[:, :, 0], kv, step.lengths,
                                                              self.page_size)
            selection = step.shared["quest_selection"]      # a shared layer's: its group's anchor's
            out = quest.attend(self.layer_idx, q[:, :, 0], kv, step.lengths, selection, self.page_size, self.scaling)
            out = out[:, None]
        else:
            out = self._dense(q, kv, step).transpose(1, 2)
        return self.o_proj(out.reshape(b, s, self.n_heads * self.head_dim))

    def _dense(self, q: torch.Tensor, kv: PagedKV, step: Step) -> torch.Tensor:
        """Causal GQA attention of q [B, H, S, D] over every token held: [B, H, S, D]."""
        b, _, s, d = q.shape
        if step.fast and not step.decode:
            return self._flash(q, kv, step.start + s)
        if step.decode:
            tokens = torch.arange(kv.keys.shape[2], device=q.device)
            mask, end = (tokens < step.lengths[:, None])[:, None, None, :], kv.keys.shape[2]  # [B, 1, 1, T]
        else:
            end = step.start + s
            causal = step.positions[0, :, None] >= torch.arange(end, device=q.device)[None, :]
            mask = causal.repeat(self.n_heads // self.n_kv_heads, 1)
        qg = q.reshape(b, self.n_kv_heads, -1, d)  # [B, Hkv, G * S, D]
        out = softmax_attention(qg, kv.keys[:, :, :end], kv.values[:, :, :end], self.scaling, mask)
        return out.view(b, self.n_heads, s, d)

    def _flash(self, q: torch.Tensor, kv: PagedKV, end: int) -> torch.Tensor:
        """Prefill's causal attention through torch's fused kernels: the chunk's queries q [B, H, S, D]
        at positions end - S .. end - 1 over tokens 0 .. end - 1 (GQA: query head h reads KV head
        h // group)."""
        keys, values = kv.keys[:, :, :end], kv.values[:, :, :end]
        s = q.shape[2]
        if s == end:                          # the whole prompt at once: causal from the top left
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.scaling,
                                                  enable_gqa=True)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(s, end),
                                              scale=self.scaling, enable_gqa=True)


class QuestModel(CausalLM):
    """`LlamaForCausalLM` / `Qwen3ForCausalLM` weights; `sparse_attention` is swappable."""

    def __init__(self, config: LlamaConfig, token_budget: int = 4096):
        rotary = Rotary(config.rope_parameters, config.head_dim)
        layers = [DecoderLayer(GqaAttention(config, i, rotary, self),
                               GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias),
                               config.hidden_size, config.rms_norm_eps)
                  for i in range(config.num_hidden_layers)]
        super().__init__(config, layers)
        self.rotary = rotary
        self.sparse_attention = TorchQuestAttention(token_budget)

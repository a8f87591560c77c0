"""The causal-LM skeleton shared by the families: embeddings, pre-norm decoder layers, head,
prefill and single-token decode over a per-layer KV state.

Each family supplies an attention module with `forward(x, step, kv)`: in prefill `x` is [B, S, H]
for positions `step.start .. step.start + S - 1`; in decode `x` is [B, 1, H] for position
`step.start`. The attention writes its new KV into `kv` (its own plain-tensor state object, created
by `new_kv`) and may leave per-step data for later layers in `step` (DSA's anchor selection).
"""
from dataclasses import dataclass, field

import torch
from torch import nn

from hisparse.models.layers import RMSNorm


@dataclass
class Step:
    """Per-step metadata shared by every layer of one forward."""

    start: int
    decode: bool
    positions: torch.Tensor
    shared: dict = field(default_factory=dict)


@dataclass
class DecodeState:
    """KV of every layer for a batch of equal-length sequences; `length` tokens are held."""

    layers: list
    capacity: int
    length: int = 0


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, step: Step, kv) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), step, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """`model.embed_tokens`, `model.layers.{i}`, `model.norm`, `lm_head`: the Hugging Face names."""

    def __init__(self, config, layers: list[nn.Module]):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def new_state(self, batch: int, capacity: int) -> DecodeState:
        weight = self.model.embed_tokens.weight
        kvs = [layer.self_attn.new_kv(batch, capacity, weight.device, weight.dtype) for layer in self.model.layers]
        return DecodeState(layers=kvs, capacity=capacity)

    def _run(self, input_ids: torch.Tensor, state: DecodeState, decode: bool) -> torch.Tensor:
        seq = input_ids.shape[1]
        if state.length + seq > state.capacity:
            raise ValueError(f"state capacity {state.capacity} cannot hold {state.length} + {seq} tokens")
        positions = torch.arange(state.length, state.length + seq, device=input_ids.device)
        step = Step(start=state.length, decode=decode, positions=positions)
        x = self.model.embed_tokens(input_ids)
        for layer, kv in zip(self.model.layers, state.layers):
            x = layer(x, step, kv)
        state.length += seq
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, state: DecodeState, chunk_size: int | None = None) -> torch.Tensor:
        """input_ids [B, S] appended to `state` (causal over everything held): logits [B, S, V].
        With `chunk_size`, the prompt goes through in chunks (same result, memory linear in S)."""
        if chunk_size is None:
            return self._run(input_ids, state, decode=False)
        chunks = input_ids.split(chunk_size, dim=1)
        return torch.cat([self._run(chunk, state, decode=False) for chunk in chunks], dim=1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """One new token per row, tokens [B]: logits [B, V], through the family's sparse attention."""
        return self._run(tokens[:, None], state, decode=True)[:, 0]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of a whole sequence from an empty state (the prefill path)."""
        return self.prefill(input_ids, self.new_state(input_ids.shape[0], input_ids.shape[1]))

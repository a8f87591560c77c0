"""The causal-LM skeleton shared by the families: embeddings, pre-norm decoder layers, head,
prefill and single-token decode over a per-layer KV state.

Each family supplies an attention module with `forward(x, step, kv)`, x [B, S, H] for the tokens at
`step.positions` [B, S]. It writes their KV into `kv` (its own plain-tensor state object, created by
`new_kv`, written through `kv.write`) and may leave per-step data for later layers in
`step.shared` (DSA's anchor selection). Prefill runs on rows of equal length (`step.start`, a
Python int); decode takes one token per row, rows of any lengths, and depends on no host value
(positions and lengths are device tensors), so a decode step can be captured in a CUDA graph once
the sparse attention and the MoE routing are capture-safe.
"""
import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from hisparse.models.layers import RMSNorm


@dataclass
class Step:
    """Per-step metadata shared by every layer of one forward."""

    positions: torch.Tensor  # [B, S] position of each new token
    lengths: torch.Tensor  # [B] tokens held per row once this step's tokens are written
    decode: bool
    start: int | None = None  # prefill: the first position, the same for every row
    fast: bool = False  # prefill through the family's kernels (else the eager torch reference)
    backend: str = "auto"  # DSA's sparse MLA kernel in a fast prefill (hisparse.dsa.ops.DECODE_BACKENDS)
    shared: dict = field(default_factory=dict)


@dataclass
class DecodeState:
    """KV of every layer; row b holds `lengths[b]` tokens (int64, on the model's device).
    `max_length` is a host-side bound on the lengths, kept to refuse overflowing the capacity."""

    layers: list
    capacity: int
    lengths: torch.Tensor
    max_length: int = 0


def stack_states(states: list[DecodeState]) -> DecodeState:
    """One batch from states prefilled separately (prompts of different lengths), same capacity."""
    if len({s.capacity for s in states}) != 1:
        raise ValueError(f"states to stack must share one capacity, found {[s.capacity for s in states]}")
    layers = []
    for kvs in zip(*(s.layers for s in states)):
        fields = {f.name: [getattr(kv, f.name) for kv in kvs] for f in dataclasses.fields(kvs[0])}
        layers.append(type(kvs[0])(**{name: None if parts[0] is None else torch.cat(parts)
                                      for name, parts in fields.items()}))
    return DecodeState(layers=layers, capacity=states[0].capacity, lengths=torch.cat([s.lengths for s in states]),
                       max_length=max(s.max_length for s in states))


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
        lengths = torch.zeros(batch, dtype=torch.int64, device=weight.device)
        return DecodeState(layers=kvs, capacity=capacity, lengths=lengths)

    def _run(self, input_ids: torch.Tensor, step: Step, state: DecodeState, last: bool = False) -> torch.Tensor:
        """Logits [B, S, V] of the tokens, or with `last` of the last one alone, [B, 1, V]."""
        pieces = self._pieces(input_ids, step, state, last, len(self.model.layers))
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                return done.value

    def _pieces(self, input_ids: torch.Tensor, step: Step, state: DecodeState, last: bool, layers_per_piece: int):
        """`_run` as a generator: it yields after every `layers_per_piece` layers but the last ones, and
        returns the logits (StopIteration.value) after the last piece, which ends with the head."""
        x = self.model.embed_tokens(input_ids)
        count = len(self.model.layers)
        for i, (layer, kv) in enumerate(zip(self.model.layers, state.layers)):
            x = layer(x, step, kv)
            if (i + 1) % layers_per_piece == 0 and i + 1 < count:
                yield i + 1
        state.lengths.copy_(step.lengths)
        return self.lm_head(self.model.norm(x[:, -1:] if last else x))

    def _prefill_step(self, input_ids: torch.Tensor, state: DecodeState, fast: bool, backend: str,
                      start: int | None = None) -> Step:
        """The Step of a prefill of input_ids [B, S] appended to `state` (its rows' lengths checked equal,
        read from the device, unless the caller knows them: `start`)."""
        batch, seq = input_ids.shape
        if start is None:
            start = int(state.lengths.max())
            if start != int(state.lengths.min()):
                raise ValueError(f"prefill needs rows of equal length, found lengths {state.lengths.tolist()}; "
                                 f"prefill rows separately and join them with stack_states")
        if start + seq > state.capacity:
            raise ValueError(f"state capacity {state.capacity} cannot hold {start} + {seq} tokens")
        positions = torch.arange(start, start + seq, device=input_ids.device).expand(batch, seq)
        state.max_length = start + seq
        return Step(positions, state.lengths + seq, decode=False, start=start, fast=fast, backend=backend)

    def _prefill(self, input_ids: torch.Tensor, state: DecodeState, fast: bool, last: bool,
                 backend: str) -> torch.Tensor:
        return self._run(input_ids, self._prefill_step(input_ids, state, fast, backend), state, last)

    @torch.no_grad()
    def prefill_pieces(self, input_ids: torch.Tensor, state: DecodeState, layers_per_piece: int, fast: bool = False,
                       last_logits: bool = False, backend: str = "auto", start: int | None = None):
        """One prefill chunk (`prefill` without chunk_size) as a generator: next() runs the next
        `layers_per_piece` layers (the first piece after the embedding, the last one with the head),
        yielding the layers done so far between pieces; the last piece's next() raises StopIteration
        whose value is the logits. The same ops in the same order as `prefill`, so the same bits.
        start: the rows' length before the chunk, where the caller knows it: then a fast prefill reads
        nothing back from the device (a piece beside decode steps must not stall their launches)."""
        if isinstance(layers_per_piece, bool) or not isinstance(layers_per_piece, int) or layers_per_piece < 1:
            raise ValueError(f"layers_per_piece must be an int >= 1, got {layers_per_piece!r}")
        step = self._prefill_step(input_ids, state, fast, backend, start)
        return (yield from self._pieces(input_ids, step, state, last_logits, layers_per_piece))

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, state: DecodeState, chunk_size: int | None = None,
                fast: bool = False, last_logits: bool = False, backend: str = "auto") -> torch.Tensor:
        """input_ids [B, S] appended to `state` (causal over everything held): logits [B, S, V], or
        with `last_logits` those of the last token alone, [B, 1, V]. With `chunk_size`, the prompt
        goes through in chunks (the same result, memory linear in S). `fast` runs the attention
        through the family's kernels, DSA's sparse MLA through `backend` (within each dtype's
        tolerance of the eager reference, which is the default; NSA's three branches too)."""
        chunks = [input_ids] if chunk_size is None else input_ids.split(chunk_size, dim=1)
        logits = [self._prefill(chunk, state, fast, last_logits, backend) for chunk in chunks]
        return logits[-1] if last_logits else torch.cat(logits, dim=1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """One new token per row, tokens [B]: logits [B, V], through the family's sparse attention."""
        if state.max_length + 1 > state.capacity:
            raise ValueError(f"state capacity {state.capacity} is full ({state.max_length} tokens)")
        state.max_length += 1
        step = Step(state.lengths[:, None], state.lengths + 1, decode=True)
        return self._run(tokens[:, None], step, state)[:, 0]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of a whole sequence from an empty state (the prefill path)."""
        return self.prefill(input_ids, self.new_state(input_ids.shape[0], input_ids.shape[1]))

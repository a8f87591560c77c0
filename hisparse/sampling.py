"""How a request picks its tokens and when it stops: the settings OpenAI-style clients send.

`SamplingParams()` is greedy decoding to `max_new_tokens`, bit-for-bit what the engine did before
sampling existed. Every field is checked by `check`, which names the field and what it expects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20      # top log-probabilities a token may carry (OpenAI's cap)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0: greedy (argmax); else logits / temperature
    top_p: float = 1.0                # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0                    # keep the k most likely tokens (0: all)
    min_p: float = 0.0                # keep tokens at least min_p times the most likely one's probability
    seed: int | None = None           # the request's random stream (None: one drawn at submission)
    presence_penalty: float = 0.0     # subtracted once from a token's logit if it was generated
    frequency_penalty: float = 0.0    # subtracted per time a token was generated
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    logprobs: int | None = None       # None: none; N in 0..20: the chosen token's and the top N
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False          # do not stop at the checkpoint's end-of-sequence ids
    min_tokens: int = 0               # no stop (eos, stop ids, stop strings) before this many tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self, vocab: int) -> "SamplingParams":
        """ValueError naming the field unless every setting is in range for a `vocab`-id model."""
        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < lo or value > hi or (lo_open and value == lo):
                raise ValueError(f"{name}={value!r}: expected a finite number in {'(' if lo_open else '['}"
                                 f"{lo:g}, {hi:g}]")

        def integer(name: str, lo: int, hi: int, value=None) -> int:
            value = getattr(self, name) if value is None else value
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name}={value!r}: expected an int in [{lo}, {hi}]")
            return value

        number("temperature", 0.0, 100.0)
        number("top_p", 0.0, 1.0, lo_open=True)
        integer("top_k", 0, vocab)
        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        if self.seed is not None:
            integer("seed", 0, 2**63 - 1)
        if self.logprobs is not None:
            integer("logprobs", 0, MAX_LOGPROBS)
        integer("min_tokens", 0, 2**31 - 1)
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias={self.logit_bias!r}: expected a mapping of token id to a number")
        for token, bias in self.logit_bias.items():
            integer("logit_bias", 0, vocab - 1, value=token)
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{token}]={bias!r}: expected a number in [-100, 100]")
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: expected a list of token ids")
        for token in self.stop_token_ids:
            integer("stop_token_ids", 0, vocab - 1, value=token)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r}: expected true or false")
        return self

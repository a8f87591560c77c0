"""How a request picks its tokens and when it stops: the settings OpenAI-style clients send, and the
sampler that applies them to a decode step's logits.

`SamplingParams()` is greedy decoding to `max_new_tokens`, bit-for-bit what the engine did before
sampling existed. Every field is checked by `check`, which names the field and what it expects.

The sampler (`sample_tokens`, over `LaneSampling`'s static per-lane buffers) is four Triton kernels
a CUDA graph captures (kernels_triton/sampling.py): no host sync, no data-dependent shape, no sort.
Per row: the logits plus logit_bias, less presence * (count > 0) + frequency * count over the tokens
the request generated (not its prompt); greedy rows (temperature 0, which settings below
GREEDY_BELOW write) take the argmax of those (the raw logits' argmax when no bias or penalty is
set); the others divide by the temperature (z) and
keep {z >= t}, t = max(t_k, t_p, t_min): t_k the top_k-th largest z, t_p the largest z whose ids at
or above it hold top_p of the softmax mass, t_min = max z + log(min_p). Ids tied with t are kept (a
sorted prefix could cut inside a tie group). The token is the Gumbel-max of the kept ids, equal
scores going to the lowest id. The Gumbel noise of vocabulary id v at the request's token index t
comes from `uniform(seed, t, v)`, a counter-based integer hash (the same numbers on CPU and GPU): a
request's draws never depend on the other rows of its batch. `sample_tokens_ref` is all torch: the
thresholds from a sorted row, the noise of every id.

Log-probabilities (`token_logprobs`) are the log-softmax of the raw logits, before bias, penalties,
temperature and filtering (as vLLM and OpenAI report them). Stops (`stop_reason`): the checkpoint's
eos ids (unless ignore_eos) and stop_token_ids end a request from its min_tokens-th token on; the
eos logit is not masked before then (the token is emitted as any other), unlike vLLM's min_tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
import triton

from kernels_triton.sampling import _pick_kernel, _pick_reduce_kernel, _prepare_kernel, _threshold_kernel

MAX_LOGPROBS = 20      # top log-probabilities a token may carry (OpenAI's cap)
GREEDY_BELOW = 1e-5    # temperatures below are greedy, as vLLM's: logits / 1e-38 overflow float32 (inf - inf: NaN)
CHUNK = 4096           # ids a program of the row-split passes (prepare, pick) takes
SEARCH_BLOCK = 1024    # ids a step of the threshold search takes


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
        """Temperature 0, or one below GREEDY_BELOW (its lane's buffer then holds 0)."""
        return self.temperature < GREEDY_BELOW

    @cached_property
    def stop_ids(self) -> frozenset[int]:
        """stop_token_ids as a set: the stop test of every token (on the server thread) is one lookup."""
        return frozenset(self.stop_token_ids)

    @property
    def needs_sampler(self) -> bool:
        """Whether its tokens differ from the raw logits' argmax: temperature, bias or a penalty set."""
        return not self.greedy or bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0

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


GREEDY = SamplingParams()


# -- the counter-based random numbers: integer ops in int64, every value below 2**32 ----------------

MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32, in int64 without overflow (x split in 16-bit halves)."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit hash (Wellons' lowbias32): every input bit flips each output bit about half the time."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _tempered(logits, temperature, bias, counts, presence, frequency):
    """(each row's greedy token [R], the tempered rows z [R, V] float32): logits + bias - penalties."""
    x = logits.float()
    if bias is not None:
        x = x + bias - presence[:, None] * (counts > 0) - frequency[:, None] * counts
    return x.argmax(-1), x / torch.where(temperature == 0, 1.0, temperature)[:, None]


def _row_keys(seed: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit key words of each row's noise ([R] int64 each): its seed and token index."""
    row = _mix32(_mix32(_mix32(seed & MASK32) ^ (seed >> 32)) ^ (index & MASK32))
    return row, _mix32(row ^ 0x9E3779B9)


def uniform(seed: torch.Tensor, index: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 [R, N] in (0, 1): the request's (seed [R] int64, token index [R] int64) as the key, each
    vocabulary id (ids [R, N] int64) as the counter; 24 bits a number, the same on every device."""
    row, other = _row_keys(seed, index)
    h = _mix32((_mix32(ids ^ row[:, None]) + other[:, None]) & MASK32)
    return ((h >> 8).float() + 0.5) * 2.0**-24


def _check_inputs(logits, per_row: dict, bias, counts, presence, frequency) -> None:
    """ValueError naming the argument unless the shapes, dtypes and devices are what the kernels read."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a float [rows, vocab] tensor with unit stride along vocab, "
                         f"got {tuple(logits.shape)} {logits.dtype} strides {logits.stride()}")
    rows, vocab = logits.shape
    for name, (t, dtype) in dict(per_row, presence=(presence, torch.float32),
                                 frequency=(frequency, torch.float32)).items():
        if t is None and name in ("presence", "frequency"):
            continue
        if t.shape != (rows,) or t.dtype != dtype or t.device != logits.device or t.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous [{rows}] {dtype} tensor on {logits.device}, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    if (bias is None) != (counts is None) or (bias is not None and (presence is None or frequency is None)):
        raise ValueError("bias, counts, presence and frequency: expected all four or none")
    for name, t in (("bias", bias), ("counts", counts)):
        if t is not None and (t.shape != (rows, vocab) or t.dtype != torch.float32 or t.stride(1) != 1
                              or t.device != logits.device):
            raise ValueError(f"{name}: expected a [{rows}, {vocab}] float32 tensor with unit stride along vocab "
                             f"on {logits.device}, got {tuple(t.shape)} {t.dtype} strides {t.stride()}")


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  min_p: torch.Tensor, seed: torch.Tensor, index: torch.Tensor, bias: torch.Tensor | None = None,
                  counts: torch.Tensor | None = None, presence: torch.Tensor | None = None,
                  frequency: torch.Tensor | None = None, adjusted: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R]: each row's token (see the module docstring). logits [R, V]; per row [R]: temperature,
    top_p, min_p (float32), top_k (int64, 0: all), seed, index (int64); bias, counts [R, V] float32 and
    presence, frequency [R] float32, or None for none; adjusted int32 [R]: 0 where a row's bias and
    penalties are all zero (their loads skipped), None: every row's applied. Four kernels, no sort
    (kernels_triton/sampling.py); `sample_tokens_ref` is the same distribution in torch."""
    _check_inputs(logits, dict(temperature=(temperature, torch.float32), top_p=(top_p, torch.float32),
                               top_k=(top_k, torch.int64), min_p=(min_p, torch.float32), seed=(seed, torch.int64),
                               index=(index, torch.int64)), bias, counts, presence, frequency)
    rows, vocab = logits.shape
    chunks, dev = triton.cdiv(vocab, CHUNK), logits.device
    z = torch.empty(rows, vocab, dtype=torch.float32, device=dev)              # the tempered rows
    part_max, part_min = (torch.empty(rows, chunks, dtype=torch.float32, device=dev) for _ in range(2))
    part_arg = torch.empty(rows, chunks, dtype=torch.int32, device=dev)        # first id of each chunk's max
    if bias is None:
        bias, counts, presence, frequency = z, z, temperature, temperature     # never read: adjusted all 0
        adjusted = torch.zeros(rows, dtype=torch.int32, device=dev)
    elif adjusted is None:
        adjusted = torch.ones(rows, dtype=torch.int32, device=dev)
    _prepare_kernel[(rows, chunks)](logits, bias, counts, presence, frequency, adjusted, temperature, z, part_max,
                                    part_arg, part_min, vocab, logits.stride(0), bias.stride(0), counts.stride(0),
                                    z.stride(0), chunks, CHUNK=CHUNK, num_warps=8)
    greedy = torch.empty(rows, dtype=torch.int32, device=dev)
    threshold = torch.empty(rows, dtype=torch.float32, device=dev)
    chunks_p2 = triton.next_power_of_2(chunks)
    _threshold_kernel[(rows,)](z, part_max, part_arg, part_min, temperature, top_p, top_k, min_p, greedy, threshold,
                               vocab, z.stride(0), chunks, CHUNKS_P2=chunks_p2, BLOCK=SEARCH_BLOCK, num_warps=8)
    part_score = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    part_id = torch.empty(rows, chunks, dtype=torch.int32, device=dev)
    _pick_kernel[(rows, chunks)](z, threshold, seed, index, temperature, part_score, part_id, vocab, z.stride(0),
                                 chunks, CHUNK=CHUNK, num_warps=8)
    out = torch.empty(rows, dtype=torch.int64, device=dev)
    _pick_reduce_kernel[(rows,)](part_score, part_id, greedy, temperature, out, chunks, CHUNKS_P2=chunks_p2)
    return out


def sample_tokens_ref(logits, temperature, top_p, top_k, min_p, seed, index, bias=None, counts=None, presence=None,
                      frequency=None) -> torch.Tensor:
    """`sample_tokens` in torch alone: the thresholds from a sort, the noise of every id of every row."""
    best, z = _tempered(logits, temperature, bias, counts, presence, frequency)
    vocab = z.shape[-1]
    values = z.sort(-1, descending=True).values
    top = values[:, 0]
    minus_inf = torch.full_like(top, -math.inf)
    t_k = torch.where((top_k > 0) & (top_k < vocab), values.gather(-1, (top_k - 1).clamp(0, vocab - 1)[:, None])[:, 0],
                      minus_inf)                                       # the k-th largest value
    mass = torch.exp(values - top[:, None]).cumsum(-1)                 # the softmax mass at or above each value
    reach = mass >= top_p[:, None] * mass[:, -1:]
    first = reach.int().argmax(-1, keepdim=True)                       # the first value whose mass reaches top_p
    t_p = torch.where((top_p < 1) & reach.any(-1), values.gather(-1, first)[:, 0], minus_inf)
    t = torch.maximum(torch.maximum(t_k, t_p), top + torch.log(min_p))
    noise = -torch.log(-torch.log(uniform(seed, index, torch.arange(vocab, device=z.device).expand_as(z))))
    pick = torch.where(z >= t[:, None], z + noise, -math.inf).argmax(-1)   # equal scores: the lowest id
    return torch.where(temperature == 0, best, pick)


class LaneSampling:
    """Each lane's settings as static device buffers, rewritten between steps (`set_lane`, `clear_lane`),
    so the step that samples (`sample`) keeps one shape: [lanes] temperature, top_p, top_k, min_p,
    penalties, seed, token index and whether bias or a penalty is set (`adjusted`: the sampler skips
    the [V] loads where not), [lanes, V] logit bias and generated-token counts. The buffers
    are allocated when a lane first needs the sampler (`SamplingParams.needs_sampler`); while no lane
    does, `needed` is False and the caller takes the argmax. graph: `sample` replays a CUDA graph
    of itself, captured at its first call over that call's logits (a graphed step's static output;
    logits elsewhere are copied there first)."""

    def __init__(self, lanes: int, vocab: int, device: torch.device, graph: bool = False):
        self.lanes, self.vocab, self.device, self.graph = lanes, vocab, torch.device(device), graph
        self.uses = [False] * lanes              # the lane needs the sampler (host)
        self.buffers: dict[str, torch.Tensor] | None = None
        self._graph = None                       # (graph, its logits input, its tokens output)

    needed = property(lambda self: any(self.uses))

    def _allocate(self) -> dict[str, torch.Tensor]:
        lanes, vocab, dev = self.lanes, self.vocab, self.device
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        return {"temperature": zeros(lanes), "top_p": torch.ones(lanes, device=dev),
                "top_k": zeros(lanes, dtype=torch.int64), "min_p": zeros(lanes), "seed": zeros(lanes, dtype=torch.int64),
                "index": zeros(lanes, dtype=torch.int64), "bias": zeros(lanes, vocab), "counts": zeros(lanes, vocab),
                "presence": zeros(lanes), "frequency": zeros(lanes), "adjusted": zeros(lanes, dtype=torch.int32)}

    def set_lane(self, lane: int, params: SamplingParams) -> None:
        """The lane samples by `params` from its token index 0, nothing generated yet."""
        self.uses[lane] = params.needs_sampler
        if self.buffers is None:
            if not params.needs_sampler:
                return
            self.buffers = self._allocate()
        b = self.buffers
        temperature = 0.0 if params.greedy else params.temperature
        for name, value in (("temperature", temperature), ("top_p", params.top_p), ("top_k", params.top_k),
                            ("min_p", params.min_p), ("seed", params.seed or 0), ("index", 0),
                            ("presence", params.presence_penalty), ("frequency", params.frequency_penalty)):
            b[name][lane] = value
        b["adjusted"][lane] = int(bool(params.logit_bias) or params.presence_penalty != 0
                                  or params.frequency_penalty != 0)
        b["counts"][lane].zero_()
        b["bias"][lane].zero_()
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
            b["bias"][lane, ids.to(self.device)] = torch.tensor(list(params.logit_bias.values()),
                                                                dtype=torch.float32, device=self.device)

    def clear_lane(self, lane: int) -> None:
        self.set_lane(lane, GREEDY)

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        b = self.buffers
        return sample_tokens(logits, b["temperature"], b["top_p"], b["top_k"], b["min_p"], b["seed"], b["index"],
                             b["bias"], b["counts"], b["presence"], b["frequency"], b["adjusted"])

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [lanes]: every lane's token from logits [lanes, V] (greedy lanes: the argmax)."""
        if not self.graph or not logits.is_cuda:
            return self._sample(logits)
        if self._graph is None:
            from hisparse.runtime import count_graph_capture
            self._sample(logits)                  # eager first: anything lazy is set up outside the capture
            count_graph_capture()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                tokens = self._sample(logits)
            self._graph = (graph, logits, tokens)
        graph, captured, tokens = self._graph
        if captured is not logits:                # another graph's output (hybrid's second step): one copy
            captured.copy_(logits)
        graph.replay()
        return tokens

    def sample_lane(self, lane: int, logits: torch.Tensor) -> int:
        """The lane's next token from one row of logits [V] (a prefill's last: its first token), counted."""
        b = self.buffers
        row = slice(lane, lane + 1)
        token = sample_tokens(logits[None], b["temperature"][row], b["top_p"][row], b["top_k"][row], b["min_p"][row],
                              b["seed"][row], b["index"][row], b["bias"][row], b["counts"][row], b["presence"][row],
                              b["frequency"][row], b["adjusted"][row])
        b["counts"][row].scatter_add_(1, token[:, None], torch.ones(1, 1, device=self.device))
        b["index"][row] += 1
        return int(token[0])

    def advance(self, tokens: torch.Tensor, lanes: torch.Tensor) -> None:
        """The lanes (bool [lanes]) emitted `tokens` [lanes]: their counts and token indices move on."""
        if self.buffers is None:
            return
        b = self.buffers
        b["counts"].scatter_add_(1, tokens[:, None], lanes[:, None].float())
        b["index"] += lanes


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int | None]) -> list:
    """Per row of logits [R, V] (raw: see the module docstring) and its token [R], None where tops[r]
    is None, else (the token's log-probability, [(id, log-probability)] of the tops[r] most likely)."""
    want = [n for n in tops if n is not None]
    if not want:
        return [None] * len(tops)
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp.gather(-1, tokens.to(logp.device).view(-1, 1))[:, 0].tolist()
    top_values, top_ids = logp.topk(max(want), -1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [None if n is None else (chosen[r], list(zip(top_ids[r][:n], top_values[r][:n])))
            for r, n in enumerate(tops)]


def eos_token_ids(config) -> frozenset[int]:
    """The checkpoint's end-of-sequence ids (config.json's eos_token_id: an id, a list or none)."""
    eos = getattr(config, "eos_token_id", None)
    return frozenset(eos if isinstance(eos, list) else () if eos is None else (eos,))


def stop_reason(params: SamplingParams, tokens: list[int], max_new_tokens: int, eos: frozenset[int]) -> str | None:
    """"stop" if the last of `tokens` ends the request (an eos id unless ignore_eos, or a stop id, from
    the min_tokens-th token on), "length" at max_new_tokens, else None."""
    if stops_at(params, tokens[-1], len(tokens), eos):
        return "stop"
    return "length" if len(tokens) >= max_new_tokens else None


def stops_at(params: SamplingParams, token: int, count: int, eos: frozenset[int]) -> bool:
    """Whether `token`, a request's count-th, is a stop: an eos id (unless ignore_eos) or a stop id,
    and count >= min_tokens."""
    return count >= params.min_tokens and ((token in eos and not params.ignore_eos) or token in params.stop_ids)

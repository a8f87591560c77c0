"""The serving study's requests, one definition for the in-process study (experiments.sweep) and
the HTTP load client (hisparse.serve.bench), so a row from one sits beside its twin from the other.

`RandomWorkload` is the `random` dataset of the serving benchmarks' common dialect
(`sglang.bench_serving`, `vllm bench serve`): num_prompts requests whose prompt and output lengths
are drawn uniformly from [len * range_ratio, len], random prompt ids, Poisson arrivals at
request_rate per second (inf: every request at 0), at most max_concurrency in flight (the driver's
cap: `hisparse.serving.scheduler.drive`), all of it from one seed. The study's own loads are special
cases of it (`serving_requests`): a closed loop's clients (arrivals set as each client's previous
request finishes) or an open loop's Poisson arrivals, fixed lengths, seed 0.

Two loads share prefixes, for a prefix cache (`hisparse.serving.prefix`): `MultiTurnWorkload`
(conversations whose every turn's prompt extends the previous turn's) and `SharedDocumentWorkload`
(one long document, many short questions). `attach_selections` gives any of these requests their
own synthetic selection draws, per prompt length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hisparse.serving.request import Request
from hisparse.synthetic import request_draws

REQUESTS_PER_CLIENT = 2            # a closed loop's default: requests each client sends
MAX_SEED = 2**31 - 1
# arrivals: stream 0; request (or conversation) i's prompt: stream 1000 + i
LENGTHS_STREAM, DOCUMENT_STREAM, PROMPT_STREAM = 1, 2, 1000


def _generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one stream of a seed's draws (seed 0: the stream number itself, as the
    study's draws were seeded before seeds existed). The CPU generator keeps 32 bits of its seed, so
    the seed is spread over them by an odd multiplier rather than shifted above them."""
    return torch.Generator().manual_seed((stream + seed * 0x9E3779B1) % 2**32)


def _check_positive_ints(workload, names) -> None:
    for name in names:
        value = getattr(workload, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r}: expected a positive integer")


def _check_rate(rate) -> None:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or math.isnan(rate) or rate <= 0:
        raise ValueError(f"request_rate = {rate!r}: expected a positive number of requests/s, or inf (every "
                         f"request at once)")


def _check_cap(cap) -> None:
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"max_concurrency = {cap!r}: expected a positive integer, or None (no cap)")


def _check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed = {seed!r}: expected an integer in [0, {MAX_SEED}]")


def _check_vocab(vocab) -> None:
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab = {vocab!r}: expected a positive integer")


def _poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start: exponential gaps of mean 1 / rate (inf: all 0), from stream 0."""
    if math.isinf(rate):
        return [0.0] * count
    gaps = torch.empty(count).exponential_(generator=_generator(seed, 0))
    return (gaps.cumsum(0) / rate).tolist()


@dataclass(slots=True)
class RandomWorkload:
    """bench_serving's random dataset: see the module docstring. Validated on construction (a
    ValueError naming the field and what it expects)."""

    input_len: int
    output_len: int
    num_prompts: int
    range_ratio: float = 1.0
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self):
        _check_positive_ints(self, ("input_len", "output_len", "num_prompts"))
        r = self.range_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"range_ratio = {r!r}: expected a number in (0, 1] (lengths are drawn from "
                             f"[len * range_ratio, len])")
        _check_rate(self.request_rate)
        _check_cap(self.max_concurrency)
        _check_seed(self.seed)

    def lengths(self) -> tuple[list[int], list[int]]:
        """Each request's prompt and output length, uniform over [len * range_ratio, len] (at least 1)."""
        gen = _generator(self.seed, LENGTHS_STREAM)
        out = []
        for top in (self.input_len, self.output_len):
            low = max(1, int(top * self.range_ratio))
            out.append(torch.randint(low, top + 1, (self.num_prompts,), generator=gen).tolist())
        return out[0], out[1]

    def arrivals(self) -> list[float]:
        """Seconds after the start: exponential gaps of mean 1 / request_rate (inf: all 0)."""
        return _poisson_arrivals(self.num_prompts, self.request_rate, self.seed)

    def requests(self, vocab: int) -> list[Request]:
        """The requests: prompt ids below `vocab` (each request's from its own generator), output
        lengths and arrivals as drawn."""
        _check_vocab(vocab)
        inputs, outputs = self.lengths()
        reqs = []
        for i, (n_in, n_out, arrival) in enumerate(zip(inputs, outputs, self.arrivals(), strict=True)):
            prompt = torch.randint(0, vocab, (n_in,), generator=_generator(self.seed, PROMPT_STREAM + i))
            reqs.append(Request(prompt, n_out, arrival=arrival))
        return reqs


@dataclass(slots=True)
class MultiTurnWorkload:
    """`conversations` conversations of `turns` turns. Turn 0's prompt is first_len tokens (a system
    prompt and the first user message); turn t + 1's is turn t's prompt, its answer (answer_len tokens,
    the turn's max_new_tokens) and a new user message of user_len tokens, so each prompt extends the
    last and a prefix cache can hit all of it but the new message.

    The answers in later prompts are random tokens fixed in advance, not what the model generated:
    the requests are known before the run (the same in every mode, in process and over HTTP, and
    their selections drawn beforehand), at the price that a cache of generated tokens never hits,
    only one of prompts; say so beside its figures.

    Requests come turn-major (request t * conversations + c is conversation c's turn t). Arrivals:
    request_rate None: a closed loop of one client per conversation (`clients()`; `Server.serve(...,
    clients=...)` sends request i by client i % clients, so a conversation's turns in order), each
    turn sent think_time seconds after its previous one finished (`Request.think_time`, which
    `drive` waits); or Poisson at request_rate requests/s (inf: all at 0) in that order, whether the
    previous turn has finished or not. Prompts from one generator per conversation."""

    conversations: int
    turns: int
    first_len: int
    user_len: int
    answer_len: int
    think_time: float = 0.0
    request_rate: float | None = None
    seed: int = 0

    def __post_init__(self):
        _check_positive_ints(self, ("conversations", "turns", "first_len", "user_len", "answer_len"))
        t = self.think_time
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"think_time = {t!r}: expected seconds >= 0 between a turn's end and the next turn")
        if self.request_rate is not None:
            _check_rate(self.request_rate)
        _check_seed(self.seed)

    def prompt_len(self, turn: int) -> int:
        """Prompt tokens of a conversation's turn `turn` (from 0)."""
        return self.first_len + turn * (self.answer_len + self.user_len)

    def max_context(self) -> int:
        """The longest request's tokens: the last turn's prompt and its answer."""
        return self.prompt_len(self.turns - 1) + self.answer_len

    def clients(self) -> int | None:
        """The closed loop's clients (one per conversation), or None: each request at its arrival."""
        return self.conversations if self.request_rate is None else None

    def length_groups(self) -> dict[tuple[int, int], int]:
        """Requests per (prompt, output) length: `attach_selections`' draws."""
        return {(self.prompt_len(t), self.answer_len): self.conversations for t in range(self.turns)}

    def requests(self, vocab: int) -> list[Request]:
        _check_vocab(vocab)
        n = self.conversations
        prompts = [[] for _ in range(n)]
        gens = [_generator(self.seed, PROMPT_STREAM + c) for c in range(n)]
        arrivals = [0.0] * (n * self.turns) if self.request_rate is None else \
            _poisson_arrivals(n * self.turns, self.request_rate, self.seed)
        reqs = []
        for t in range(self.turns):
            for c in range(n):
                grow = self.first_len if t == 0 else self.answer_len + self.user_len
                prompts[c].append(torch.randint(0, vocab, (grow,), generator=gens[c]))
                reqs.append(Request(torch.cat(prompts[c]), self.answer_len, arrival=arrivals[t * n + c],
                                    think_time=self.think_time if t else 0.0))
        return reqs


@dataclass(slots=True)
class SharedDocumentWorkload:
    """One document of document_len tokens and `questions` questions about it: request i's prompt is
    the document and question i (question_len tokens), answer_len tokens out, Poisson arrivals at
    request_rate (inf: all at 0), at most max_concurrency out at once. The document from its own
    generator, each question from its own."""

    document_len: int
    questions: int
    question_len: int
    answer_len: int
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self):
        _check_positive_ints(self, ("document_len", "questions", "question_len", "answer_len"))
        _check_rate(self.request_rate)
        _check_cap(self.max_concurrency)
        _check_seed(self.seed)

    def max_context(self) -> int:
        return self.document_len + self.question_len + self.answer_len

    def clients(self) -> None:
        return None

    def length_groups(self) -> dict[tuple[int, int], int]:
        return {(self.document_len + self.question_len, self.answer_len): self.questions}

    def requests(self, vocab: int) -> list[Request]:
        _check_vocab(vocab)
        document = torch.randint(0, vocab, (self.document_len,), generator=_generator(self.seed, DOCUMENT_STREAM))
        arrivals = _poisson_arrivals(self.questions, self.request_rate, self.seed)
        return [Request(torch.cat([document, torch.randint(0, vocab, (self.question_len,),
                                                           generator=_generator(self.seed, PROMPT_STREAM + i))]),
                        self.answer_len, arrival=arrivals[i]) for i in range(self.questions)]


def attach_selections(requests: list[Request], workload: str, model_config, cache=None) -> None:
    """Give each request its own draw of synthetic preset `workload` (`synthetic.request_draws`, as
    the serving study's random loads get theirs) for its prompt and output lengths: requests of one
    (prompt, output) length are drawn together, the j-th of them with seed request_seed(0, j), so a
    multi-turn conversation draws the same seed at each turn's context. cache: request_draws'."""
    groups: dict[tuple[int, int], list[Request]] = {}
    for r in requests:
        groups.setdefault((len(r.prompt), r.max_new_tokens), []).append(r)
    for (input_len, output_len), group in groups.items():
        draws = request_draws(workload, model_config, input_len, output_len, len(group), cache=cache)
        for r, draw in zip(group, draws, strict=True):
            r.selections = draw


DATASETS = ("random", "multiturn", "shared_document")


def serving_request_count(study: dict, point: dict) -> int:
    """Requests of a serving point: requests_per_client per client, `requests` (open loop), or
    num_prompts (a request_rate point); a multiturn point's conversations x turns."""
    if point.get("dataset") == "multiturn":
        return point["conversations"] * point["turns"]
    if point.get("request_rate") is not None:
        return point["num_prompts"]
    closed = point["concurrency"] is not None
    return point["concurrency"] * study["requests_per_client"] if closed else study["requests"]


def point_workload(study: dict, point: dict):
    """The point's workload: a multiturn or shared_document point's (its conversations, closed loop,
    seed 0; its questions are num_prompts at request_rate), a request_rate point's own, or the
    study's loads as one (fixed lengths, seed 0; a closed loop's arrivals all 0, set by its clients as
    they go)."""
    dataset = point.get("dataset", "random")
    if dataset == "multiturn":
        return MultiTurnWorkload(point["conversations"], point["turns"], point["first_len"], point["user_len"],
                                 point["output_len"])
    if dataset == "shared_document":
        return SharedDocumentWorkload(point["document_len"], point["num_prompts"], point["question_len"],
                                      point["output_len"], point["request_rate"], point["max_concurrency"],
                                      point["seed"])
    if point.get("request_rate") is not None:
        return RandomWorkload(point["input_len"], point["output_len"], point["num_prompts"], point["range_ratio"],
                              point["request_rate"], point["max_concurrency"], point["seed"])
    closed = point["concurrency"] is not None
    return RandomWorkload(point["input_len"], point["output_len"], serving_request_count(study, point),
                          request_rate=math.inf if closed else point["rate"])


def serving_requests(study: dict, point: dict, vocab: int) -> tuple[list[Request], int | None]:
    """The point's requests (`point_workload`) and its client count (None: each at its arrival)."""
    workload = point_workload(study, point)
    clients = point["concurrency"] if isinstance(workload, RandomWorkload) else workload.clients()
    return workload.requests(vocab), clients

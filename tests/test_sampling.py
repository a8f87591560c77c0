"""The sampler on fixed logits: its integer hash against Python's integers, greedy rows exactly the
argmax, temperature / top_k / top_p / min_p keeping exactly their tokens at the softmax's frequencies
(binomial bounds), penalties and logit_bias, rows independent of their batch, logprobs, stops, and
every bad setting a ValueError naming its field (no model: plain torch on the CPU)."""
import math

import pytest
import torch

from hisparse.sampling import (
    MASK32,
    LaneSampling,
    SamplingParams,
    _mix32,
    _mul32,
    eos_token_ids,
    sample_tokens,
    sample_tokens_ref,
    stop_reason,
    stops_at,
    token_logprobs,
    uniform,
)

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.2, 0.3, -2.0])   # V = 11, no ties
DRAWS = 4000


def mix32_python(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def test_the_hash_is_32_bit_integer_arithmetic_without_overflow():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randint(0, 2**32, (999,), generator=gen, dtype=torch.int64),
                   torch.tensor([0, 1, MASK32, MASK32 - 1, 2**31])])
    assert _mul32(x, 0x846CA68B).tolist() == [(v * 0x846CA68B) & MASK32 for v in x.tolist()]
    assert _mix32(x).tolist() == [mix32_python(v) for v in x.tolist()]


def test_uniform_numbers_are_a_function_of_seed_index_and_id_only():
    seed = torch.tensor([7, 7, 2**62 + 5, 7])
    index = torch.tensor([0, 1, 0, 0])
    ids = torch.arange(61)[None].expand(4, -1)
    u = uniform(seed, index, ids)
    assert u.dtype == torch.float32 and (u > 0).all() and (u < 1).all()
    assert torch.equal(u[0], u[3])                              # same (seed, index): same numbers
    assert torch.equal(uniform(seed[:1], index[:1], ids[:1, 40:]), u[:1, 40:])   # per id, whatever else is asked
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    many = uniform(torch.arange(200), torch.zeros(200, dtype=torch.int64), torch.arange(1000)[None].expand(200, -1))
    counts = torch.histc(many, bins=10, min=0, max=1)
    expected = many.numel() / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 40, f"uniform's deciles are uneven: chi2 {chi2:.1f} with 9 degrees of freedom"


def draws(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = DRAWS) -> torch.Tensor:
    """n tokens from one logit vector: a request's token indices 0 .. n-1 (one row each), by the torch
    reference (thousands of rows are minutes in the interpreter; the kernel is checked equal to it below)."""
    rows = n
    full = lambda v, dtype=torch.float32: torch.full((rows,), v, dtype=dtype)  # noqa: E731
    return sample_tokens_ref(logits.expand(rows, -1), full(params.temperature), full(params.top_p),
                         full(params.top_k, torch.int64), full(params.min_p), full(params.seed, torch.int64),
                         torch.arange(rows))


def expected_probs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The distribution the settings define, in float64: softmax(logits / T) over what they keep, renormalised."""
    p = torch.softmax(LOGITS.double() / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    ahead = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or (top_p < 1 and ahead >= top_p) or p[i] < min_p * p[order[0]]:
            break
        keep[i] = True
        ahead += float(p[i])
    q = torch.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.5), dict(temperature=2.0),
                                      dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.7),
                                      dict(temperature=0.8, top_p=0.9, top_k=5), dict(temperature=1.0, min_p=0.2),
                                      dict(temperature=1.5, min_p=0.05, top_k=6)],
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_filters_keep_exactly_their_tokens_at_the_softmax_frequencies(settings):
    tokens = draws(SamplingParams(seed=12345, **settings))
    q = expected_probs(**settings)
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    kept = set(torch.nonzero(q).flatten().tolist())
    assert set(torch.nonzero(counts).flatten().tolist()) <= kept, "a filtered-out token was drawn"
    for i in range(len(LOGITS)):
        mean, sd = DRAWS * float(q[i]), math.sqrt(DRAWS * float(q[i]) * (1 - float(q[i])))
        assert abs(float(counts[i]) - mean) <= 5 * sd + 1, f"token {i}: {counts[i]:.0f} draws, expected {mean:.1f}"
    if settings.get("top_k") or settings.get("top_p", 1) < 1 or settings.get("min_p"):
        assert len(kept) < len(LOGITS), "the settings filter nothing: the test checks no filter"


def test_greedy_rows_are_exactly_the_argmax_beside_sampling_rows():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 97, generator=gen).round(decimals=1)        # ties, resolved as argmax resolves them
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.7, 0.0, 1.0])
    tokens = sample_tokens(logits, temperature, torch.full((6,), 0.9), torch.zeros(6, dtype=torch.int64),
                           torch.zeros(6), torch.arange(6), torch.zeros(6, dtype=torch.int64))
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])


def test_a_row_samples_the_same_token_whatever_shares_its_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 211, generator=gen)

    def one(rows):
        r = torch.tensor(rows)
        return sample_tokens(logits[r], torch.full((len(rows),), 1.0), torch.tensor([0.95] * len(rows)),
                             torch.zeros(len(rows), dtype=torch.int64), torch.zeros(len(rows)),
                             100 + r, 3 + r)
    alone = one([2])
    assert int(one([0, 2, 4])[1]) == int(alone[0]) == int(one([2, 1, 3, 0])[0])


def lane_sampler(params: list[SamplingParams], vocab: int = len(LOGITS)) -> LaneSampling:
    sampler = LaneSampling(len(params), vocab, torch.device("cpu"))
    for lane, p in enumerate(params):
        sampler.set_lane(lane, p)
    return sampler


def test_the_stop_test_is_a_set_lookup_whatever_the_number_of_stop_ids():
    """A request's stop ids are tested on the server thread at every token: 10 million ids in a tuple
    took 0.18 s a token there, for every lane. The test reads a set, never the tuple."""
    class Unread(tuple):
        def __contains__(self, token):
            raise AssertionError("stop_token_ids read as a tuple")
    params = SamplingParams(stop_token_ids=Unread((5, 6))).check(97)
    assert stops_at(params, 6, 1, frozenset()) and not stops_at(params, 7, 1, frozenset())


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """logits / 1e-40 overflow float32 (inf - inf: NaN), which picked token 0 or 4, not the argmax:
    temperatures below GREEDY_BELOW are greedy (as vLLM's), beside a sampling lane and alone."""
    tiny = [1e-40, 1e-38, 1e-20, 1e-300]
    assert all(SamplingParams(temperature=t).greedy for t in tiny) and not SamplingParams(temperature=0.01).greedy
    sampler = lane_sampler([SamplingParams(temperature=t, seed=1) for t in tiny] + [SamplingParams(temperature=1.0)])
    logits = torch.randn(len(tiny) + 1, len(LOGITS), generator=torch.Generator().manual_seed(3)) * 3
    assert torch.equal(sampler.sample(logits)[:len(tiny)], logits.argmax(-1)[:len(tiny)])


def test_logit_bias_and_penalties_move_the_logits_as_openai_defines():
    sampler = lane_sampler([SamplingParams(logit_bias={7: 100.0}), SamplingParams(frequency_penalty=0.3),
                            SamplingParams(presence_penalty=0.6), SamplingParams()])
    assert sampler.needed and sampler.uses == [True, True, True, False]
    logits = LOGITS.expand(4, -1).clone()
    assert sampler.sample(logits).tolist() == [7, 0, 0, 0]            # greedy: the bias wins; no counts yet
    lanes = torch.ones(4, dtype=torch.bool)
    sampler.advance(torch.tensor([7, 0, 0, 0]), lanes)                 # token 0 generated once: 2.0 - 0.3 > 1.5
    assert sampler.sample(logits).tolist() == [7, 0, 1, 0]             # presence: 2.0 - 0.6 < 1.5
    sampler.advance(torch.tensor([7, 0, 1, 0]), lanes)                 # frequency: 0 twice, 2.0 - 0.6 < 1.5
    assert sampler.sample(logits).tolist() == [7, 1, 0, 0]             # presence: 0 at 1.4, 1 at 0.9, 8 at 1.2
    assert sampler.buffers["index"].tolist() == [2, 2, 2, 2]
    sampler.clear_lane(0)
    assert sampler.uses[0] is False and float(sampler.buffers["bias"][0].abs().sum()) == 0
    assert sampler.sample(logits).tolist()[0] == 0


def test_a_lane_first_token_is_its_row_of_the_batch_sampler():
    params = [SamplingParams(temperature=1.0, seed=s, top_p=0.8) for s in (5, 6, 7)]
    batch = lane_sampler(params).sample(LOGITS.expand(3, -1).clone())
    single = lane_sampler(params)
    assert [single.sample_lane(lane, LOGITS) for lane in range(3)] == batch.tolist()
    assert single.buffers["index"].tolist() == [1, 1, 1]
    assert single.buffers["counts"].sum(1).tolist() == [1.0, 1.0, 1.0]


def test_logprobs_are_the_raw_logits_log_softmax_and_its_top_n():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    out = token_logprobs(logits, torch.tensor([3, 4]), [2, None])
    logp = torch.log_softmax(LOGITS, -1)
    assert out[1] is None
    chosen, top = out[0]
    assert chosen == pytest.approx(float(logp[3]))
    assert [i for i, _ in top] == [0, 1] and top[0][1] == pytest.approx(float(logp[0]))
    assert token_logprobs(logits, torch.tensor([3, 4]), [None, None]) == [None, None]
    assert token_logprobs(logits, torch.tensor([3, 4]), [0, 0])[0][1] == []


def test_stops_eos_stop_ids_min_tokens_and_length():
    eos = eos_token_ids(type("Config", (), {"eos_token_id": [2, 3]})())
    assert eos == {2, 3} and eos_token_ids(type("Config", (), {"eos_token_id": None})()) == frozenset()
    plain = SamplingParams()
    assert stop_reason(plain, [5, 3], 10, eos) == "stop"
    assert stop_reason(plain, [5, 4], 10, eos) is None
    assert stop_reason(plain, [5, 4], 2, eos) == "length"
    assert stop_reason(SamplingParams(ignore_eos=True), [5, 3], 10, eos) is None
    assert stop_reason(SamplingParams(ignore_eos=True, stop_token_ids=(3,)), [5, 3], 10, eos) == "stop"
    assert stop_reason(SamplingParams(min_tokens=3), [5, 3], 10, eos) is None
    assert stop_reason(SamplingParams(min_tokens=3), [5, 3, 2], 10, eos) == "stop"


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", True), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -1), ("top_k", 98), ("top_k", 2.0), ("min_p", 1.1), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("seed", -1), ("seed", 2**63), ("logprobs", 21), ("logprobs", -1),
    ("min_tokens", -1), ("logit_bias", {97: 1.0}), ("logit_bias", {3: 200.0}), ("logit_bias", [1, 2]),
    ("stop_token_ids", (5, 97)), ("stop_token_ids", 5), ("ignore_eos", 1)])
def test_every_bad_setting_is_a_value_error_naming_its_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}"):
        SamplingParams(**{field: value}).check(97)


def test_ties_at_the_threshold_are_kept():
    """top_k 2 over [3, 1, 1, 1, 0] keeps the whole tie group at the 2nd value; top_p likewise."""
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0])
    for settings in (dict(top_k=2), dict(top_p=0.9)):
        tokens = draws(SamplingParams(temperature=1.0, seed=7, **settings), logits, n=600)
        assert set(tokens.tolist()) == {0, 1, 2, 3}, settings


def kernel_and_reference(logits, temperature, top_p, top_k, min_p, seed, index, *penalties):
    got = sample_tokens(logits, temperature, top_p, top_k, min_p, seed, index, *penalties)
    want = sample_tokens_ref(logits, temperature, top_p, top_k, min_p, seed, index, *penalties)
    assert torch.equal(got, want), (got, want)
    return got


def test_the_kernels_are_their_torch_reference(nan_empty):
    """sample_tokens (four kernels, no sort) against sample_tokens_ref (a sort, torch's noise over every
    id): the same tokens for greedy, top_k, top_p, min_p rows, rows of many chunks, ties, and bias
    and penalties; outputs the kernels fail to write are NaN or -7 (nan_empty)."""
    from hisparse.sampling import CHUNK
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 12, 2 * CHUNK + 77
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.5, 6.0, rows)[:, None]
    logits[4:8] = logits[4:8].round(decimals=1)                        # ties, top_k's k-th among them
    logits[6, 2 * CHUNK + 50] = logits[6].max()                        # the greedy max in the last chunk, tied
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3] * 3)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.99, 1.0, 0.3, 1.0, 0.95, 1.0, 1.0])
    top_k = torch.tensor([0, 0, 0, 0, 5, 0, CHUNK + 3, 0, 0, 40, 0, vocab])
    min_p = torch.tensor([0.0] * 8 + [0.1, 0.0, 0.01, 0.0])
    seed, index = torch.arange(rows) * 7919 + 2**40, torch.arange(rows) + 100
    for step in range(3):
        kernel_and_reference(logits, temperature, top_p, top_k, min_p, seed, index + step)
    bias = torch.zeros(rows, vocab)
    bias[:, 17] = 30.0
    counts = torch.randint(0, 3, (rows, vocab), generator=gen).float()
    presence, frequency = torch.linspace(-2, 2, rows), torch.linspace(2, -2, rows)
    tokens = kernel_and_reference(logits, temperature, top_p, top_k, min_p, seed, index, bias, counts, presence,
                                  frequency)
    assert (tokens == 17).sum() >= 6, "the bias of 30 should win most rows"


@pytest.mark.gpu
def test_the_kernels_are_their_reference_at_full_vocab_and_in_a_graph():
    """DeepSeek-V3.2's vocabulary, bf16 logits, 64 lanes: kernel == reference (GPU exp and log are not
    torch's: a flip needs two scores within about 1e-6, not met at this seed), and LaneSampling's
    graph replay == its eager call."""
    rows, vocab = 64, 129280
    gen = torch.Generator(device="cuda").manual_seed(5)
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 3).bfloat16()
    kinds = (dict(temperature=0.8, top_p=0.95), dict(temperature=1.0, top_k=50), dict(temperature=0.7, min_p=0.05),
             dict(temperature=0.0))
    params = [SamplingParams(seed=lane, **kinds[lane % 4]) for lane in range(rows)]
    eager, graphed = LaneSampling(rows, vocab, "cuda"), LaneSampling(rows, vocab, "cuda", graph=True)
    for lane, p in enumerate(params):
        eager.set_lane(lane, p)
        graphed.set_lane(lane, p)
    b = eager.buffers
    want = sample_tokens_ref(logits, b["temperature"], b["top_p"], b["top_k"], b["min_p"], b["seed"], b["index"])
    assert torch.equal(eager.sample(logits), want)
    assert torch.equal(graphed.sample(logits), want) and torch.equal(graphed.sample(logits), want)

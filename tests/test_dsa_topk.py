"""kernels_triton/dsa_topk.py's radix-select top-k against `hisparse.dsa.ops.topk_select` (best first,
equal scores to the lower index, -1 padding), exactly, through Triton's interpreter on the CPU: random
rows, equal scores straddling the k-th place, -inf rows, lengths 0 / < k / = T / > T, negative and
mixed-sign scores, -0.0; each narrowing path (bin taken whole, exact threshold ranked in index order,
small bin gathered and sorted) by small capacities and digit widths."""
import pytest
import torch

import kernels_triton  # noqa: F401  the interpreter choice, before triton is imported
from hisparse.dsa.ops import topk_select
from kernels_triton.dsa_topk import radix_topk, radix_topk_ref


def check(scores: torch.Tensor, lengths: torch.Tensor, k: int, **options) -> None:
    ids, values = radix_topk(scores, lengths, k, **options)
    expected = topk_select(scores, lengths, k)
    assert ids.dtype == torch.int32 and ids.shape == (scores.shape[0], k)
    assert torch.equal(ids.sort(dim=1).values, expected.sort(dim=1).values), "not the same set"
    assert torch.equal(ids, expected), "the same set, not best first with ties to the lower index"
    picked = ids >= 0
    folded = scores.masked_fill(scores == 0, 0.0)
    assert torch.equal(values[picked], folded.gather(1, ids.clamp(min=0).long())[picked])
    assert (values[~picked] == float("-inf")).all()
    ref_ids, ref_values = radix_topk_ref(scores, lengths, k)
    assert torch.equal(ref_ids, expected) and torch.equal(ref_values, values)


def causal(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """-inf past each row's length, as the prefill indexer writes its scores."""
    past = torch.arange(scores.shape[1])[None, :] >= lengths[:, None]
    return scores.masked_fill(past, float("-inf"))


OPTIONS = {"gather": dict(capacity=256), "narrow-11": dict(capacity=8),
           "narrow-4": dict(bits=4, capacity=2), "exact": dict(capacity=1, block_t=16)}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("n,t,k", [(5, 113, 27), (3, 61, 61), (4, 200, 7)], ids=lambda v: str(v))
def test_random_rows(n, t, k, option):
    gen = torch.Generator().manual_seed(n * t + k)
    scores = torch.randn(n, t, generator=gen) * 3
    lengths = torch.randint(0, t + 1, (n,), generator=gen)
    lengths[0] = t
    check(causal(scores, lengths), lengths, k, **OPTIONS[option])
    check(scores, lengths, k, **OPTIONS[option])             # scores past a length are not picked


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_equal_scores_straddle_the_kth_place(option):
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(-2, 3, (6, 97), generator=gen).float() * 0.5      # 5 values, many of each
    scores[1] = 1.0                                                          # one value only
    scores[2, ::2] = -0.0
    scores[2, 1::2] = 0.0                                                    # -0.0 equals +0.0
    lengths = torch.tensor([97, 97, 97, 50, 31, 12])
    check(causal(scores, lengths), lengths, 30, **OPTIONS[option])


def test_minus_inf_rows_and_short_lengths():
    scores = torch.full((5, 40), float("-inf"))
    scores[3, :20] = torch.linspace(-1, 1, 20)
    lengths = torch.tensor([40, 0, 5, 20, 40], dtype=torch.int32)
    for k in (1, 7, 40, 64):                                                 # k > T pads with -1
        check(scores, lengths, k, capacity=2)


def test_lengths_past_t_and_negative_clamp_as_topk_select_does():
    scores = torch.randn(3, 33, generator=torch.Generator().manual_seed(2))
    check(scores, torch.tensor([50, -3, 33]), 9, capacity=2)


@pytest.mark.parametrize("option", ["gather", "exact"])
def test_negative_mixed_sign_and_extreme_scores(option):
    gen = torch.Generator().manual_seed(3)
    negative = -torch.rand(2, 75, generator=gen) * 1e3
    mixed = torch.randn(2, 75, generator=gen)
    mixed[0, :10] = torch.tensor([float("inf"), 3.4e38, -3.4e38, 1e-45, -1e-45, 0.0, -0.0, 1e-38, -1e-38,
                                  float("-inf")])
    scores = torch.cat([negative, mixed])
    check(scores, torch.tensor([75, 40, 75, 75]), 19, **OPTIONS[option])


def test_empty_shapes():
    check(torch.zeros(0, 10), torch.zeros(0, dtype=torch.int64), 3)
    ids, values = radix_topk(torch.zeros(2, 0), torch.zeros(2, dtype=torch.int64), 3)
    assert (ids == -1).all() and (values == float("-inf")).all()


@pytest.mark.parametrize("args,kwargs,match", [
    ((torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2, dtype=torch.int64), 2), {}, "float32"),
    ((torch.zeros(8), torch.zeros(1, dtype=torch.int64), 2), {}, r"\[N, T\]"),
    ((torch.zeros(8, 2).t(), torch.zeros(2, dtype=torch.int64), 2), {}, "contiguous last dim"),
    ((torch.zeros(2, 8), torch.zeros(3, dtype=torch.int64), 2), {}, "lengths"),
    ((torch.zeros(2, 8), torch.zeros(2), 2), {}, "int32/int64"),
    ((torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), 0), {}, "positive int"),
    ((torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), True), {}, "positive int"),
    ((torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), 2), dict(bits=13), "bits"),
    ((torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), 2), dict(capacity=3), "capacity"),
    ((torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), 2), dict(block_t=24), "block_t"),
], ids=["fp16", "1d", "strided", "lengths-shape", "lengths-float", "k0", "k-bool", "bits", "capacity", "block_t"])
def test_bad_inputs_raise(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        radix_topk(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("ties", [False, True], ids=["random", "rounded"])
def test_prefill_shape_on_gpu(ties):
    """Prefill's shape: 256 queries over a 128K prompt (lengths T - 255 .. T, -inf past them), k = 2048;
    rounded scores put thousands of equal values at the k-th place."""
    n, t, k = 256, 131072, 2048
    gen = torch.Generator(device="cuda").manual_seed(4)
    scores = torch.randn(n, t, device="cuda", generator=gen)
    if ties:
        scores = (scores * 4).round() / 4
    lengths = torch.arange(t - n + 1, t + 1, device="cuda")
    scores.masked_fill_(torch.arange(t, device="cuda")[None, :] >= lengths[:, None], float("-inf"))
    ids, values = radix_topk(scores, lengths, k)
    assert torch.equal(ids, topk_select(scores, lengths, k))
    assert torch.equal(values, scores.gather(1, ids.long()).masked_fill(values == 0, 0.0))

"""The radix top-k picks (kernels_triton/topk.py) against `topk_select`: in the interpreter on tiny
rows, every path of the kernel forced by its keywords (a guess that holds, one that misses, candidates
over capacity, ties, NaNs, rows shorter than k); on the GPU at the prefill's shapes through
`topk_of_indexer_scores`."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hisparse.dsa.ops import order_picks, topk_of_indexer_scores, topk_select
from kernels_triton.topk import radix_topk_picks, radix_topk_picks_ref

NANS = torch.tensor([0x7FC00000, 0x7F800001, -0x400000, -1], dtype=torch.int32).view(torch.float32)  # +, +, -, -


def scores_of(kind: str, n: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """[n, t] float32 scores of a kind; -0.0 mixed with +0.0 wherever zeros occur."""
    if kind == "random":
        s = torch.randn(n, t, generator=gen)
    elif kind == "ties":                                   # few values: the k-th is shared by many
        s = torch.randint(-2, 3, (n, t), generator=gen).float() * 0.5
    elif kind == "equal":
        s = torch.full((n, t), 0.75)
    elif kind == "zeros":
        s = torch.zeros(n, t)
    elif kind == "infs":                                   # -inf and +inf inside the lengths
        s = torch.randn(n, t, generator=gen)
        r = torch.rand(n, t, generator=gen)
        s[r < 0.3] = float("-inf")
        s[r > 0.9] = float("inf")
    elif kind == "nans":                                   # NaNs of both signs: above +inf / below -inf
        s = torch.randn(n, t, generator=gen) * torch.exp(4 * torch.randn(n, t, generator=gen))
        s = torch.where(torch.rand(n, t, generator=gen) < 0.2, NANS[torch.randint(0, 4, (n, t), generator=gen)], s)
    s[(s == 0) & (torch.rand(n, t, generator=gen) < 0.5)] = -0.0
    return s


def lengths_for(t: int, k: int) -> torch.Tensor:
    """A row of each length that matters: whole, 0, 1, k - 1, k, k + 1 (within t), past t (clamped)."""
    return torch.tensor([t, 0, 1, min(k - 1, t), min(k, t), min(k + 1, t), t + 5])


def assert_same_picks(got, want):
    """(values, ids) pairs equal as sets: the same ids with bit-equal values (-0.0 kept), any order."""
    (got_v, got_i), (want_v, want_i) = got, want
    assert got_i.shape == want_i.shape and got_i.dtype == torch.int64 and got_v.dtype == torch.float32
    got_i, got_o = got_i.sort(dim=1)
    want_i, want_o = want_i.sort(dim=1)
    assert torch.equal(got_i, want_i)
    assert torch.equal(got_v.gather(1, got_o).view(torch.int32), want_v.gather(1, want_o).view(torch.int32))


def check(scores, lengths, k, **keywords):
    """The kernel's picks are the reference's, and both, ordered, are `topk_select`'s selection."""
    got = radix_topk_picks(scores, lengths, k, **keywords)
    want = radix_topk_picks_ref(scores, lengths, k)
    assert_same_picks(got, want)
    expected = topk_select(scores, lengths, k)
    assert torch.equal(order_picks(*got, lengths, k)[0], expected)
    assert torch.equal(order_picks(*want, lengths, k)[0], expected)


@pytest.mark.parametrize("kind", ["random", "ties", "equal", "zeros", "infs", "nans"])
@pytest.mark.parametrize("t, k", [(61, 16), (113, 27), (20, 27)], ids=["T61-k16", "T113-k27", "T20-k27-k_over_T"])
def test_picks_are_topk_select(kind, t, k, nan_empty):
    """Rows of every length that matters, T not a multiple of the interpreter's 32-score block;
    outputs start as NaN / -7, so a place the kernel leaves unwritten fails."""
    gen = torch.Generator().manual_seed(t + k)
    lengths = lengths_for(t, k)
    check(scores_of(kind, len(lengths), t, gen), lengths, k)


@pytest.mark.parametrize("keywords", [
    pytest.param({"margin": 0.0}, id="guess-misses"),                  # a one-key guess: radix passes over the row
    pytest.param({"capacity": 16}, id="over-capacity"),                # the row's passes narrow to 16 candidates
    pytest.param({"sample": 64, "block": 64, "capacity": 32}, id="sample64-block64"),
])
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_every_path_gives_the_same_picks(kind, keywords, nan_empty):
    gen = torch.Generator().manual_seed(5)
    t, k = 203, 24
    lengths = lengths_for(t, k)
    check(scores_of(kind, len(lengths), t, gen), lengths, k, **keywords)


def test_ties_go_to_the_lower_ids():
    """Ten equal scores straddle the k-th place: the picks are the lowest ids among them, after every
    id above; -0.0 ties with +0.0, and a negative NaN ranks below the -inf past the length."""
    scores = torch.tensor([[1.0, 0.0, 2.0, 0.0, -0.0, 0.0, 3.0, 0.0, 0.0, -0.0, 0.0, 0.0, 0.0, NANS[2]]])
    for k, ids in ((5, [0, 1, 2, 3, 6]), (7, [0, 1, 2, 3, 4, 5, 6])):
        values, picks = radix_topk_picks(scores, torch.tensor([14]), k, margin=0.0)
        assert sorted(picks[0].tolist()) == ids
    values, picks = radix_topk_picks(scores, torch.tensor([14]), 14)
    assert sorted(picks[0].tolist()) == list(range(14))
    t = scores.shape[1]
    wide = torch.cat([scores, torch.zeros(1, 2)], dim=1)               # two places past the length
    values, picks = radix_topk_picks(wide, torch.tensor([t]), t)
    assert sorted(picks[0].tolist()) == list(range(13)) + [t]          # -inf at t, not the NaN at 13
    assert values[0, picks[0].tolist().index(t)] == float("-inf")


def test_input_checks():
    scores, lengths = torch.randn(2, 9), torch.tensor([9, 4])
    for args, message in [
        ((scores.double(), lengths, 4), "scores must be float32"),
        ((scores, lengths.float(), 4), "lengths must be int32/int64"),
        ((scores, lengths[:1], 4), "lengths must be int32/int64 of shape"),
        ((scores, lengths, 0), "k must be a positive int"),
        ((scores.t(), torch.tensor([2] * 9), 4), "contiguous last dim"),
    ]:
        with pytest.raises(ValueError, match=message):
            radix_topk_picks(*args)
    with pytest.raises(ValueError, match="capacity=24: expected a power of 2 in 16 .. "):
        radix_topk_picks(scores, lengths, 4, capacity=24)
    with pytest.raises(ValueError, match="margin=-1"):
        radix_topk_picks(scores, lengths, 4, margin=-1)
    values, ids = radix_topk_picks(scores[:0], lengths[:0], 4)
    assert values.shape == ids.shape == (0, 4)


def test_kernel_compiles_for_hopper_without_spills():
    """The interpreter never compiles: build the GPU default (block 2048, 8 warps) for sm_90a in a
    process without it (experiments/tools/sass_topk.py): no spills, 16-byte loads of the scores,
    shared memory within Hopper's 227 KiB."""
    env = os.environ | {"TRITON_INTERPRET": "0"}   # else kernels_triton interprets them here, without a GPU
    done = subprocess.run([sys.executable, "-m", "experiments.tools.sass_topk", "--sample", "512", "--bins"],
                          cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("block 2048"))
    assert int(re.search(r"(\d+) B spilled", line).group(1)) == 0, line
    assert int(re.search(r"(\d+) 16-byte loads", line).group(1)) > 0, line
    assert int(re.search(r"(\d+) B shared", line).group(1)) <= 227 * 1024, line


# -- on a GPU --------------------------------------------------------------------------------------
#     python -m pytest -q -m gpu tests/test_topk.py      # on an H100 / H200, Triton 3.6

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "ties"])
@pytest.mark.parametrize("n, t", [(2048, 32768), (512, 131072)], ids=["2048x32K", "512x128K"])
def test_gpu_topk_of_indexer_scores_real_shapes(n, t, kind):
    """The prefill's rows (the last n queries of a t-token prompt: causal lengths, -inf past them, a
    few short rows), k 2048: random scores, and scores quantised to many ties (-0.0 and +0.0 mixed);
    through the guess (`topk_of_indexer_scores`, method radix) and through the radix passes alone (margin 0)."""
    gen = torch.Generator(device="cuda").manual_seed(t + n)
    k = 2048
    lengths = torch.arange(t - n + 1, t + 1, device="cuda")
    lengths[:6] = torch.tensor([0, 1, k - 1, k, k + 1, t // 3])
    scores = torch.randn(n, t, device="cuda", generator=gen)
    if kind == "ties":
        scores = (scores / 0.25).round() * 0.25
        scores[(scores == 0) & (torch.rand(n, t, device="cuda", generator=gen) < 0.5)] = -0.0
    scores = scores.masked_fill(torch.arange(t, device="cuda")[None, :] >= lengths[:, None], float("-inf"))
    expected = topk_select(scores, lengths, k)
    assert torch.equal(topk_of_indexer_scores(scores, lengths, k, method="radix"), expected)
    rows = slice(0, 64)
    picks = radix_topk_picks(scores[rows], lengths[rows], k, margin=0.0)
    assert torch.equal(order_picks(*picks, lengths[rows], k)[0], expected[rows])

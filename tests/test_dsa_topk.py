"""DSA prefill top-k through candidates (hisparse/dsa/ops.py, kernels_triton/dsa_topk.py): the
threshold, the compaction, and `topk_of_indexer_scores` exactly `topk_select` on every kind of row,
through the kernels (the interpreter off the GPU) and through torch.

Tiny shapes: k = 16 makes 32 groups and 64 candidate places, so rows of a few hundred scores take
the candidate path; each case also asserts that the path it means to test was taken.
"""
import pytest
import torch

from hisparse.dsa import ops as dsa

K, WIDTH = 16, 64
NEG_INF = float("-inf")


def masked(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The scores topk_select ranks: -inf at t >= lengths[n]."""
    return scores.masked_fill(torch.arange(scores.shape[1])[None, :] >= lengths[:, None], NEG_INF)


def kth_best(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k-th largest score within its length [N] (-inf if fewer than k)."""
    m = masked(scores, lengths)
    return m.topk(min(k, m.shape[1]), dim=1).values[:, -1]


def causal_rows(t: int, s: int):
    """The lengths of the last s queries of a t-token prompt, as dsa_prefill_select builds them."""
    return torch.arange(t - s + 1, t + 1)


def make_rows(kind: str, gen: torch.Generator):
    """(scores [N, T] float32, -inf past each length, and lengths [N] int64) of one kind of row."""
    if kind == "random":
        n, t = 9, 613
        lengths = torch.randint(K, t + 1, (n,), generator=gen)
        scores = torch.randn(n, t, generator=gen)
    elif kind == "ties":                        # a few values, -0.0 and +0.0 mixed: ties at the k-th place
        n, t = 9, 611
        lengths = torch.randint(t // 2, t + 1, (n,), generator=gen)
        scores = torch.randint(-40, 41, (n, t), generator=gen).float() * 0.125
        scores[(scores == 0) & (torch.rand(n, t, generator=gen) < 0.5)] = -0.0
    elif kind == "causal-tail":                 # the last queries of a prompt
        t = 700
        lengths = causal_rows(t, 24)
        scores = torch.randn(len(lengths), t, generator=gen)
    elif kind == "causal-first-chunk":          # a prompt's first queries: lengths 1 .. T, many shorter than k
        t = 200
        lengths = causal_rows(t, t)[::7]
        scores = torch.randn(len(lengths), t, generator=gen)
    elif kind == "short":                       # fewer than k finite scores; no scores; a length past T
        n, t = 8, 333
        lengths = torch.tensor([0, 1, 5, K - 1, K, K + 1, 90, t + 9])
        scores = torch.randn(n, t, generator=gen)
    elif kind == "overflow":    # more candidates than places: all equal, two values, the groups' period, a plateau
        n, t = 6, 517
        lengths = torch.tensor([t, t, 300, t, t - 1, 200])
        scores = torch.randn(n, t, generator=gen)
        scores[0] = 1.5
        scores[1] = torch.randint(0, 2, (t,), generator=gen).float()
        scores[2] = (torch.arange(t) % 32).float()      # each group (a residue of 32) holds one value
        scores[3, : t // 2] = 5.0
    else:
        raise AssertionError(kind)
    return masked(scores, lengths), lengths


def paths(scores, lengths, k=K, width=WIDTH):
    """Which rows the candidate path should send where: (rows with more candidates than width, rows
    whose ties straddle the k-th place, rows with tau = -inf that stay on the candidate path)."""
    tau = dsa.topk_threshold_ref(scores, lengths, k)
    count = dsa.topk_candidates_ref(scores, lengths, tau, width)[2]
    m = masked(scores, lengths)
    v = kth_best(scores, lengths, k)
    top = m.topk(k, dim=1).values
    straddle = (v > NEG_INF) & ((m == v[:, None]).sum(1) > (top == v[:, None]).sum(1))
    fits = count <= width
    return int((~fits).sum()), int((straddle & fits).sum()), int(((tau == NEG_INF) & fits).sum())


CASES = ["random", "ties", "causal-tail", "causal-first-chunk", "short", "overflow"]


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("kind", CASES)
def test_topk_through_candidates_is_topk_select(kind, kernels):
    gen = torch.Generator().manual_seed(CASES.index(kind))
    scores, lengths = make_rows(kind, gen)
    assert scores.shape[1] > WIDTH                               # the candidate path, not the whole row's
    overflow, straddle, unbounded = paths(scores, lengths)
    expect = {"ties": straddle > 0, "overflow": overflow >= 4, "short": unbounded >= 4,
              "causal-first-chunk": unbounded > 0 and unbounded < len(lengths)}
    assert expect.get(kind, overflow == 0), (overflow, straddle, unbounded)
    if kernels:                                                  # lengths of either dtype
        lengths = lengths.to(torch.int32)
    got = dsa.topk_of_indexer_scores(scores, lengths, K, kernels=kernels)       # width 4k = WIDTH
    assert torch.equal(got, dsa.topk_select(scores, lengths, K))


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_rows_no_longer_than_width_take_the_whole_row_path(kernels):
    """T <= width (here T < 2k too): today's whole-row path, ties and short rows included."""
    gen = torch.Generator().manual_seed(11)
    n, t = 7, 29
    scores = torch.randint(-2, 3, (n, t), generator=gen).float() * 0.5
    lengths = torch.tensor([0, 3, K, 20, t, t, t + 4])
    scores = masked(scores, lengths)
    got = dsa.topk_of_indexer_scores(scores, lengths, K, kernels=kernels)
    assert torch.equal(got, dsa.topk_select(scores, lengths, K))
    assert dsa.topk_of_indexer_scores(scores[:, :0], lengths, K, kernels=kernels).eq(-1).all()
    assert dsa.topk_of_indexer_scores(scores[:0], lengths[:0], K, kernels=kernels).shape == (0, K)
    assert dsa.topk_of_indexer_scores(torch.zeros(0, 500), lengths[:0], K, kernels=kernels).shape == (0, K)


def test_a_row_with_a_minus_inf_score_within_its_length_is_still_topk_select():
    """Out of the indexer's range, but exact all the same: fewer than k finite scores and a -inf one
    within the length, where the candidates' -inf padding might stand in for it (flagged, exact keys)."""
    t = 200
    scores = torch.randn(3, t, generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([10, 12, t])
    scores = masked(scores, lengths)
    scores[0, 3] = scores[1, 11] = NEG_INF
    for kernels in (False, True):
        got = dsa.topk_of_indexer_scores(scores, lengths, K, width=WIDTH, kernels=kernels)
        assert torch.equal(got, dsa.topk_select(scores, lengths, K))
        assert got[0, 9].item() == 3 and got[1, 11].item() == 11        # the -inf tokens, last


@pytest.mark.parametrize("kind", ["random", "ties", "causal-first-chunk", "short", "overflow"])
def test_threshold_is_at_most_the_kth_best_and_kernel_matches_torch(kind):
    """One span: the kernel's threshold is the torch one, bit for bit; more spans: finer groups, so a
    threshold between the one-span threshold and the k-th best score. The groups (residues of 32)
    do not divide these T."""
    gen = torch.Generator().manual_seed(20 + CASES.index(kind))
    scores, lengths = make_rows(kind, gen)
    assert scores.shape[1] % 32
    ref = dsa.topk_threshold_ref(scores, lengths, K)
    v = kth_best(scores, lengths, K)
    assert (ref <= v).all() and (ref > NEG_INF).any()
    assert torch.equal(dsa.topk_threshold(scores, lengths, K, splits=1), ref)
    tau = dsa.topk_threshold(scores, lengths, K, splits=3)
    assert (ref <= tau).all() and (tau <= v).all()
    assert torch.equal(dsa.topk_threshold(scores, lengths, K, groups=16, splits=1),
                       dsa.topk_threshold_ref(scores, lengths, K, groups=16))


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("kind", ["ties", "causal-first-chunk", "overflow"])
def test_candidates_are_the_scores_at_or_above_the_threshold(kind, splits):
    """The kernel's candidates are torch's as sets (its order is the atomics'), counts exact past
    width, padding -inf with id T; and the candidates hold every top-k token and every score equal to
    the k-th, so counting ties among them counts the whole row's."""
    gen = torch.Generator().manual_seed(40 + CASES.index(kind))
    scores, lengths = make_rows(kind, gen)
    n, t = scores.shape
    tau = dsa.topk_threshold_ref(scores, lengths, K)
    values, ids, count = dsa.topk_candidates(scores, lengths, tau, WIDTH, splits=splits)
    ref_values, ref_ids, ref_count = dsa.topk_candidates_ref(scores, lengths, tau, WIDTH)
    assert torch.equal(count, ref_count)
    m, v = masked(scores, lengths), kth_best(scores, lengths, K)
    best = dsa.topk_select(scores, lengths, K)
    checked = 0
    for r in range(n):
        c = int(count[r])
        want = set(((m[r] >= tau[r]) & (torch.arange(t) < lengths[r])).nonzero().flatten().tolist())
        assert len(want) == c
        got = ids[r, :min(c, WIDTH)].tolist()
        assert len(set(got)) == len(got) and set(got) <= want
        assert torch.equal(values[r, :min(c, WIDTH)], scores[r, got])
        if c > WIDTH:
            continue
        assert set(got) == want == set(ref_ids[r, :c].tolist())
        assert (values[r, c:] == NEG_INF).all() and (ids[r, c:] == t).all()
        assert torch.equal(values[r].sort().values, ref_values[r].sort().values)
        assert set(best[r][best[r] >= 0].tolist()) <= set(got)
        if v[r] > NEG_INF:
            assert int((values[r] == v[r]).sum()) == int((m[r] == v[r]).sum())
            checked += 1
    assert checked > 0 and (count > WIDTH).any() == (kind == "overflow")


def test_new_functions_refuse_bad_inputs():
    scores = torch.randn(4, 100)
    lengths = torch.full((4,), 100)
    tau = torch.zeros(4)
    with pytest.raises(ValueError, match="width=8: expected an int >= k=16"):
        dsa.topk_of_indexer_scores(scores, lengths, K, width=8)
    with pytest.raises(ValueError, match="groups=24: expected a power of 2 >= k=16"):
        dsa.topk_threshold(scores, lengths, K, groups=24)
    with pytest.raises(ValueError, match="groups=8: expected a power of 2 >= k=16"):
        dsa.topk_threshold_ref(scores, lengths, K, groups=8)
    with pytest.raises(ValueError, match="splits=0: expected an int >= 1"):
        dsa.topk_threshold(scores, lengths, K, splits=0)
    with pytest.raises(ValueError, match="scores need a contiguous last dim"):
        dsa.topk_threshold(scores.t().contiguous().t(), lengths, K)
    with pytest.raises(ValueError, match=r"tau must be float32 \[4\]"):
        dsa.topk_candidates(scores, lengths, tau[:3], WIDTH)
    with pytest.raises(ValueError, match="width=0: expected a positive int"):
        dsa.topk_candidates(scores, lengths, tau, 0)
    with pytest.raises(ValueError, match="splits=2.0: expected an int >= 1"):
        dsa.topk_candidates(scores, lengths, tau, WIDTH, splits=2.0)
    with pytest.raises(ValueError, match="lengths must be int32/int64"):
        dsa.topk_candidates(scores, lengths.float(), tau, WIDTH)


@pytest.mark.gpu
def test_topk_through_candidates_is_topk_select_at_prefill_shapes():
    """k = 2048 over 16K-token rows as prefill makes them (-inf past each causal length): random,
    quantised to many ties (-0.0 and +0.0 mixed), a ramp that puts the best scores near the end, a
    first chunk's short rows, rows that overflow; the kernels and torch agree with topk_select."""
    k, t = 2048, 16384
    gen = torch.Generator(device="cuda").manual_seed(0)
    tail = torch.arange(t - 255, t + 1, device="cuda")
    first = torch.arange(1, t + 1, 64, device="cuda")
    for name, lengths in (("tail", tail), ("first", first)):
        base = torch.randn(len(lengths), t, device="cuda", generator=gen)
        quantised = (base / 0.25).round() * 0.25
        quantised[(quantised == 0) & (torch.rand(quantised.shape, device="cuda", generator=gen) < 0.5)] = -0.0
        ramp = base + torch.arange(t, device="cuda") / t * 8
        flat = torch.where(torch.rand(base.shape, device="cuda", generator=gen) < 0.5, 1.0, 0.0)
        for kind, scores in (("random", base), ("quantised", quantised), ("ramp", ramp), ("flat", flat)):
            scores = scores.masked_fill(torch.arange(t, device="cuda")[None, :] >= lengths[:, None], NEG_INF)
            want = dsa.topk_select(scores, lengths, k)
            for kernels in (True, False):
                assert torch.equal(dsa.topk_of_indexer_scores(scores, lengths, k, kernels=kernels), want), (name, kind)

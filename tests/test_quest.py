"""Quest kernels against their torch references: page metadata, page scores, selection, attention.

CPU tests run the kernels through Triton's interpreter on small odd shapes (float16/float32); GPU
tests check bf16 at real shapes with GQA (32 query heads, 8 KV heads, head dim 128).
"""
import pytest
import torch
import triton

from hisparse.quest import ops as quest
from hisparse.quest import reference as quest_ref
from hisparse.quest.ops import PAGE

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32")]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| over max |expected| on finite entries; infinities must coincide, no NaN."""
    actual, expected = actual.float(), expected.float()
    assert not torch.isnan(actual).any(), "NaN in the output"
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), "infinities differ"
    finite = torch.isfinite(expected)
    if not finite.any():
        return 0.0
    diff = (actual[finite] - expected[finite]).abs().max()
    return (diff / expected[finite].abs().max().clamp_min(1e-6)).item()


def n_pages_of(lengths: torch.Tensor) -> torch.Tensor:
    return (lengths.long() + PAGE - 1) // PAGE


def make_tokens(n, hq, hkv, d, lengths, dtype, gen, device="cpu"):
    """q [N, HQ, D], k and v [N, HKV, T, D] with NaN at every position past a request's length."""
    lengths = torch.tensor(lengths, dtype=torch.int32)
    t = int(lengths.max())
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    k = torch.randn(n, hkv, t, d, generator=gen).to(dtype)
    v = torch.randn(n, hkv, t, d, generator=gen).to(dtype)
    past = torch.arange(t) >= lengths.view(n, 1)
    k[past.view(n, 1, t, 1).expand_as(k)] = float("nan")
    v[past.view(n, 1, t, 1).expand_as(v)] = float("nan")
    return [x.to(device) for x in (q, k, v, lengths)]


def random_selection(lengths, hkv, k, gen, pad_frac=0.25, shuffle=False):
    """pages [N, HKV, K] int32: the current page plus distinct random earlier pages, -1 padding spread
    among them (about pad_frac), in page order unless shuffled."""
    out = torch.full((len(lengths), hkv, k), -1, dtype=torch.int32)
    for n, length in enumerate(lengths.tolist()):
        n_pages = (length + PAGE - 1) // PAGE
        for h in range(hkv):
            if n_pages == 0:
                continue
            earlier = torch.randperm(n_pages - 1, generator=gen)[: k - 1].tolist()
            chosen = sorted(earlier) + [n_pages - 1]
            chosen = [p if torch.rand(1, generator=gen).item() > pad_frac else -1 for p in chosen[:-1]] + [chosen[-1]]
            chosen += [-1] * (k - len(chosen))
            if shuffle:
                chosen = [chosen[i] for i in torch.randperm(k, generator=gen).tolist()]
            out[n, h] = torch.tensor(chosen, dtype=torch.int32)
    return out


def plain_attention_over_tokens(q, k, v, pages, lengths, scale):
    """Softmax attention per query head over the token positions of the selected pages, from
    token-level k, v (independent of the row layout)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.zeros(n, hq, d)
    for i in range(n):
        for hh in range(hq):
            h = hh // (hq // hkv)
            sel = [p for p in pages[i, h].tolist() if p >= 0]
            pos = [p * PAGE + t for p in sel for t in range(PAGE) if p * PAGE + t < int(lengths[i])]
            if not pos:
                continue
            keys, values = k[i, h, pos].float(), v[i, h, pos].float()
            probs = torch.softmax(keys @ q[i, hh].float() * scale, dim=0)
            out[i, hh] = probs @ values
    return out


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------

META_CASES = [
    pytest.param(3, 2, 24, [61, 27, 0], id="N3-HKV2-D24-len61,27,0"),
    pytest.param(2, 3, 40, [33, 16], id="N2-HKV3-D40-len33,16"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, hkv, d, lengths", META_CASES)
def test_metadata_append_matches_ref_and_prefill(n, hkv, d, lengths, dtype):
    gen = torch.Generator().manual_seed(10)
    _, keys, _, lengths = make_tokens(n, hkv, hkv, d, lengths, dtype, gen)
    max_pages = int(n_pages_of(lengths).max()) + 1
    kmin = torch.full((n, hkv, max_pages, d), float("nan"), dtype=dtype)
    kmax, kmin_ref, kmax_ref = kmin.clone(), kmin.clone(), kmin.clone()
    for t in range(keys.shape[2]):
        positions = torch.where(lengths > t, t, -1).to(torch.int32)
        key = keys[:, :, t].contiguous()
        quest.quest_metadata_append(kmin, kmax, key, positions)
        quest_ref.quest_metadata_append_ref(kmin_ref, kmax_ref, key, positions)
    before = kmin.clone()
    past_capacity = torch.full((n,), max_pages * PAGE, dtype=torch.int32)
    quest.quest_metadata_append(kmin, kmax, keys[:, :, 0].contiguous(), past_capacity)
    assert torch.equal(kmin.nan_to_num(), before.nan_to_num()), "a position past capacity must be skipped"
    assert torch.equal(kmin.isnan(), kmin_ref.isnan()) and torch.equal(kmax.isnan(), kmax_ref.isnan())
    assert torch.equal(kmin.nan_to_num(), kmin_ref.nan_to_num())
    assert torch.equal(kmax.nan_to_num(), kmax_ref.nan_to_num())
    pre_min, pre_max = quest.quest_metadata_from_keys(keys, lengths, max_pages)
    used = (torch.arange(max_pages) < n_pages_of(lengths).view(n, 1)).view(n, 1, max_pages).expand(n, hkv, -1)
    assert torch.equal(kmin[used], pre_min[used]) and torch.equal(kmax[used], pre_max[used])
    assert kmin[~used].isnan().all(), "the kernel wrote a page no token reached"


def test_metadata_from_keys_matches_explicit_min_max():
    gen = torch.Generator().manual_seed(11)
    _, keys, _, lengths = make_tokens(2, 2, 2, 8, [37, 5], torch.float32, gen)
    kmin, kmax = quest.quest_metadata_from_keys(keys, lengths, 4)
    assert torch.equal(kmin[0, 1, 2], keys[0, 1, 32:37].amin(0))
    assert torch.equal(kmax[0, 1, 1], keys[0, 1, 16:32].amax(0))
    assert torch.equal(kmax[1, 0, 0], keys[1, 0, 0:5].amax(0))
    assert (kmin[1, :, 1:] == 0).all() and (kmax[0, :, 3] == 0).all()


# ---------------------------------------------------------------------------------------------
# Page scores
# ---------------------------------------------------------------------------------------------

SCORE_CASES = [
    pytest.param(4, 6, 2, 24, [113, 27, 1, 0], id="N4-HQ6-HKV2-D24-len113,27,1,0"),
    pytest.param(2, 9, 3, 64, [61, 200], id="N2-HQ9-HKV3-D64-len61,200"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, hq, hkv, d, lengths", SCORE_CASES)
def test_page_scores_match_ref_and_bound_the_logits(n, hq, hkv, d, lengths, dtype, nan_empty):
    gen = torch.Generator().manual_seed(20)
    q, k, _, lengths = make_tokens(n, hq, hkv, d, lengths, dtype, gen)
    max_pages = int(n_pages_of(lengths).max()) + 2
    kmin, kmax = quest.quest_metadata_from_keys(k, lengths, max_pages)
    scores = quest.quest_page_scores(q, kmin, kmax, lengths)
    assert scores.shape == (n, hkv, max_pages) and scores.dtype == torch.float32
    assert rel_err(scores, quest_ref.quest_page_scores_ref(q, kmin, kmax, lengths)) < TOL[dtype]
    group = hq // hkv
    for i in range(n):
        for h in range(hkv):
            for p in range(int(n_pages_of(lengths)[i])):
                tokens = k[i, h, p * PAGE: min((p + 1) * PAGE, int(lengths[i]))].float()  # [<=PAGE, D]
                logits = q[i, h * group: (h + 1) * group].float() @ tokens.T  # [G, tokens]
                assert scores[i, h, p] >= logits.max() - 1e-3 * logits.abs().max(), (i, h, p)
    past = (n_pages_of(lengths).view(n, 1, 1) <= torch.arange(max_pages)).expand(n, hkv, max_pages)
    assert torch.isinf(scores[past]).all(), "pages past a request's length must score -inf"


# ---------------------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------------------

def test_select_pages_explicit_example():
    scores = torch.tensor([[[5.0, 7.0, 7.0, 1.0, 7.0, -9.0, 0.5]]])
    lengths = torch.tensor([6 * PAGE - 3], dtype=torch.int32)  # 6 pages, the last partial
    pages = quest.quest_select_pages(scores, lengths, 3 * PAGE)
    assert pages.tolist() == [[[1, 2, 5]]], "current page 5, then the two lowest-index 7.0 pages"
    assert quest_ref.quest_select_pages_ref(scores, lengths, 3 * PAGE).tolist() == [[[1, 2, 5]]]
    more = quest.quest_select_pages(scores, lengths, 9 * PAGE + 7)
    assert more.tolist() == [[[0, 1, 2, 3, 4, 5, -1, -1, -1]]], "all 6 pages, then padding"


def tied_scores(n, hkv, max_pages, gen):
    """Scores from a few values (many ties), -0.0 and 0.0 among them."""
    values = torch.tensor([-2.5, -0.0, 0.0, 1.0, 3.0, float("-inf")])
    return values[torch.randint(0, len(values), (n, hkv, max_pages), generator=gen)]


@pytest.mark.parametrize("budget_pages", [1, 3, 5, 8], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_select_pages_matches_ref_exactly(budget_pages, ties, nan_empty):
    gen = torch.Generator().manual_seed(30 + budget_pages)
    n, hkv, max_pages = 6, 3, 27
    lengths = torch.tensor([27 * PAGE, 27 * PAGE - 5, 61, 5 * PAGE, 1, 0], dtype=torch.int32)
    scores = tied_scores(n, hkv, max_pages, gen) if ties else torch.randn(n, hkv, max_pages, generator=gen)
    budget = budget_pages * PAGE + 7  # a budget that is not a whole number of pages rounds down
    pages = quest.quest_select_pages(scores, lengths, budget)
    expected = quest_ref.quest_select_pages_ref(scores, lengths, budget)
    assert pages.dtype == torch.int32 and torch.equal(pages, expected)
    n_pages = n_pages_of(lengths)
    for i in range(n):
        count = min(int(n_pages[i]), budget_pages)
        for h in range(hkv):
            chosen = pages[i, h, :count].tolist()
            assert chosen == sorted(set(chosen)) and (pages[i, h, count:] == -1).all()
            if count:
                assert chosen[-1] == n_pages[i] - 1, "the current page must be selected"
                others = scores[i, h, : n_pages[i] - 1]
                worst_in = min((others[p].item() for p in chosen[:-1]), default=float("inf"))
                rest = [others[p].item() for p in range(len(others)) if p not in chosen]
                assert all(s <= worst_in for s in rest), "a better page was left out"


# ---------------------------------------------------------------------------------------------
# Attention over pages
# ---------------------------------------------------------------------------------------------

ATTN_CASES = [
    pytest.param(3, 6, 2, 32, [113, 27, 1], 5, 1, 4, id="N3-HQ6-HKV2-D32-K5-splits1-ppi4"),
    pytest.param(2, 9, 3, 24, [61, 200], 7, 3, 2, id="N2-HQ9-HKV3-D24-K7-splits3-ppi2"),
    pytest.param(2, 4, 4, 16, [45, 0], 4, 2, 1, id="N2-HQ4-HKV4-D16-K4-splits2-ppi1-len0"),
]


def resident_inputs(n, hq, hkv, d, lengths, budget_pages, dtype, gen, shuffle=False):
    q, k, v, lengths = make_tokens(n, hq, hkv, d, lengths, dtype, gen)
    max_pages = int(n_pages_of(lengths).max())
    pool = quest.pages_from_tokens(k, v, max_pages)
    pages = random_selection(lengths, hkv, budget_pages, gen, shuffle=shuffle)
    return q, k, v, lengths, pool, pages, quest.resident_rows(pages, max_pages)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, hq, hkv, d, lengths, budget_pages, splits, ppi", ATTN_CASES)
def test_attention_matches_ref_and_plain_softmax(n, hq, hkv, d, lengths, budget_pages, splits, ppi, dtype,
                                                 nan_empty):
    gen = torch.Generator().manual_seed(40)
    q, k, v, lengths, pool, pages, rows = resident_inputs(n, hq, hkv, d, lengths, budget_pages, dtype, gen,
                                                          shuffle=True)
    scale = 0.7 * d ** -0.5
    out = quest.quest_attention(q, pool, rows, pages, lengths, scale=scale, splits=splits, pages_per_iter=ppi)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, quest_ref.quest_attention_ref(q, pool, rows, pages, lengths, scale=scale)) < TOL[dtype]
    assert rel_err(out, plain_attention_over_tokens(q, k, v, pages, lengths, scale)) < TOL[dtype]
    if (lengths == 0).any():
        assert (out[lengths == 0] == 0).all(), "a padded request (length 0) must give zeros"


def hot_cache_rows(pool, rows, slots, gen):
    """A shuffled hot cache [S * (slots + 1), *row] holding each selected row of stream s at a random
    slot of s (NaN elsewhere), and the rows [N, HKV, K] that address it."""
    n, hkv, k = rows.shape
    cache = torch.full((n * hkv * (slots + 1),) + tuple(pool.shape[1:]), float("nan"), dtype=pool.dtype)
    hot = torch.full_like(rows, -1)
    for s in range(n * hkv):
        i, h = divmod(s, hkv)
        free = torch.randperm(slots, generator=gen).tolist()
        for j, row in enumerate(rows[i, h].tolist()):
            if row >= 0:
                hot[i, h, j] = s * (slots + 1) + free[j]
                cache[hot[i, h, j]] = pool[row]
    return cache, hot


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 2], ids=["splits1", "splits2"])
def test_hot_cache_and_resident_are_bitwise_equal(splits, dtype):
    gen = torch.Generator().manual_seed(50)
    q, _, _, lengths, pool, pages, rows = resident_inputs(2, 6, 2, 32, [99, 50], 6, dtype, gen, shuffle=True)
    cache, hot = hot_cache_rows(pool, rows, slots=11, gen=gen)
    resident = quest.quest_attention(q, pool, rows, pages, lengths, splits=splits, pages_per_iter=2)
    hierarchical = quest.quest_attention(q, cache.flatten(1), hot, pages, lengths, splits=splits,
                                         pages_per_iter=2)
    assert not resident.isnan().any()
    assert torch.equal(resident, hierarchical)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_steps_through_the_hierarchical_cache_equal_resident(dtype):
    """Decode steps with the real cache core: the newest token's page grows (append or write-through),
    metadata follows, the selection is resolved to slots, and attention through the slots is bitwise
    that of the resident pool (and close to plain softmax over the selected tokens)."""
    from hisparse.cache import HierarchicalKVCache
    gen = torch.Generator().manual_seed(55)
    n, hq, hkv, d, steps, budget_pages = 2, 4, 2, 16, 5, 3
    prompt = torch.tensor([37, 46], dtype=torch.int32)
    q_all, k, v, _ = make_tokens(n, hq, hkv, d, [int(prompt.max()) + steps] * n, dtype, gen)
    max_pages = triton.cdiv(k.shape[2], PAGE)
    cache = HierarchicalKVCache(max_streams=n * hkv, cache_slots=budget_pages + 1, host_rows=n * hkv * max_pages,
                                row_elems=2 * PAGE * d, dtype=dtype, device="cpu", pin=False)
    streams = torch.tensor([cache.open_stream(capacity=max_pages) for _ in range(n * hkv)], dtype=torch.int32)

    def resident_pool(lengths):
        past = (torch.arange(k.shape[2]) >= lengths.view(n, 1)).view(n, 1, -1, 1)
        return quest.pages_from_tokens(k.masked_fill(past, 0), v.masked_fill(past, 0), max_pages)

    lengths = prompt.clone()
    pool = resident_pool(lengths)
    for s in range(n * hkv):
        prompt_pages = int(n_pages_of(lengths)[s // hkv])
        cache.append(int(streams[s]), pool[s * max_pages: s * max_pages + prompt_pages].flatten(1))
    kmin, kmax = quest.quest_metadata_from_keys(k, lengths, max_pages)
    for step in range(steps):
        positions = lengths.clone()
        lengths = lengths + 1
        quest.quest_metadata_append(kmin, kmax, k[torch.arange(n), :, positions.long()].contiguous(), positions)
        pool = resident_pool(lengths)
        for s in range(n * hkv):
            page = int(positions[s // hkv]) // PAGE
            row = pool[s * max_pages + page].flatten()
            if page == cache.stream_len[int(streams[s])]:
                cache.append(int(streams[s]), row[None])
            else:
                cache.write_unit(int(streams[s]), page, row)
        q = torch.randn(n, hq, d, generator=gen).to(dtype)
        pages = quest.quest_select(q, kmin, kmax, lengths, budget_pages * PAGE)
        slots = cache.resolve(streams, pages.view(n * hkv, budget_pages)).slots
        hot = cache.slot_rows(streams, slots).view(n, hkv, budget_pages)
        out_hot = quest.quest_attention(q, cache.slots.view(-1, 2 * PAGE * d), hot, pages, lengths)
        out_resident = quest.quest_attention(q, pool, quest.resident_rows(pages, max_pages), pages, lengths)
        assert torch.equal(out_hot, out_resident), f"step {step}"
        assert rel_err(out_hot, plain_attention_over_tokens(q, k, v, pages, lengths, d ** -0.5)) < TOL[dtype]
    assert int(cache.stats[:, 1].sum()) > 0, "no miss: the test did not exercise fetches"


def test_pipeline_append_select_attend(nan_empty):
    """One decode step end to end: append the newest key, score, select, attend over the selection."""
    gen = torch.Generator().manual_seed(60)
    q, k, v, lengths, pool, _, _ = resident_inputs(2, 6, 3, 16, [70, 33], 3, torch.float32, gen)
    max_pages = pool.shape[0] // 6
    kmin, kmax = quest.quest_metadata_from_keys(k, lengths - 1, max_pages)
    last = (lengths - 1).long()
    quest.quest_metadata_append(kmin, kmax, k[torch.arange(2), :, last].contiguous(), lengths - 1)
    scores = quest.quest_page_scores(q, kmin, kmax, lengths)
    pages = quest.quest_select(q, kmin, kmax, lengths, 3 * PAGE)
    assert torch.equal(pages, quest_ref.quest_select_pages_ref(scores, lengths, 3 * PAGE))
    rows = quest.resident_rows(pages, max_pages)
    out = quest.quest_attention(q, pool, rows, pages, lengths)
    assert rel_err(out, plain_attention_over_tokens(q, k, v, pages, lengths, 16 ** -0.5)) < TOL[torch.float32]


# ---------------------------------------------------------------------------------------------
# Dense layers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_attention_matches_ref(dtype):
    gen = torch.Generator().manual_seed(70)
    q, k, v, lengths = make_tokens(3, 6, 2, 24, [61, 27, 5], dtype, gen)
    k, v = k.nan_to_num(), v.nan_to_num()  # SDPA's masked positions must be finite
    assert rel_err(quest.dense_attention(q, k, v, lengths), quest_ref.dense_attention_ref(q, k, v, lengths)) < TOL[dtype]
    full = torch.full_like(lengths, k.shape[2])
    assert rel_err(quest.dense_attention(q, k, v), quest_ref.dense_attention_ref(q, k, v, full)) < TOL[dtype]
    assert quest.is_dense_layer(0) and quest.is_dense_layer(1) and not quest.is_dense_layer(2)


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------

def test_launchers_reject_bad_inputs():
    gen = torch.Generator().manual_seed(80)
    q, _, _, lengths, pool, pages, rows = resident_inputs(2, 6, 2, 16, [40, 20], 3, torch.float32, gen)
    with pytest.raises(ValueError, match="dtype"):
        quest.quest_attention(q.half(), pool, rows, pages, lengths)
    with pytest.raises(ValueError, match="rows"):
        quest.quest_attention(q, pool, rows.long(), pages, lengths)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        quest.quest_attention(q[:, :5].contiguous(), pool, rows, pages, lengths)
    with pytest.raises(ValueError, match="kv rows hold"):
        quest.quest_attention(q, pool.flatten(1)[:, :-1], rows, pages, lengths)
    with pytest.raises(ValueError, match="splits"):
        quest.quest_attention(q, pool, rows, pages, lengths, splits=5)
    with pytest.raises(ValueError, match="budget_tokens"):
        quest.quest_select_pages(torch.zeros(2, 2, 3), lengths, PAGE - 1)
    with pytest.raises(ValueError, match="lengths"):
        quest.quest_page_scores(q, torch.zeros(2, 2, 3, 16), torch.zeros(2, 2, 3, 16), lengths.long())


# ---------------------------------------------------------------------------------------------
# GPU: bf16, real shapes
# ---------------------------------------------------------------------------------------------

GPU_LENGTHS = [32768 + 5, 20011, 4096, 131]


@pytest.fixture
def gpu_case():
    gen = torch.Generator().manual_seed(90)
    q, k, v, lengths = make_tokens(4, 32, 8, 128, GPU_LENGTHS, torch.bfloat16, gen, device="cuda")
    return q, k.nan_to_num(), v.nan_to_num(), lengths


@pytest.mark.gpu
def test_gpu_metadata_scores_selection(gpu_case):
    q, k, _, lengths = gpu_case
    max_pages = int(n_pages_of(lengths).max())
    kmin, kmax = quest.quest_metadata_from_keys(k, lengths - 1, max_pages)
    positions = lengths - 1
    newest = k[torch.arange(4, device="cuda"), :, positions.long()].contiguous()
    kmin_ref, kmax_ref = kmin.clone(), kmax.clone()
    quest.quest_metadata_append(kmin, kmax, newest, positions)
    quest_ref.quest_metadata_append_ref(kmin_ref, kmax_ref, newest, positions)
    assert torch.equal(kmin, kmin_ref) and torch.equal(kmax, kmax_ref)
    full_min, full_max = quest.quest_metadata_from_keys(k, lengths, max_pages)
    assert torch.equal(kmin, full_min) and torch.equal(kmax, full_max)
    scores = quest.quest_page_scores(q, kmin, kmax, lengths)
    assert rel_err(scores, quest_ref.quest_page_scores_ref(q, kmin, kmax, lengths)) < 1e-5
    pages = quest.quest_select_pages(scores, lengths, 2048)
    assert torch.equal(pages, quest_ref.quest_select_pages_ref(scores, lengths, 2048))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1], ids=["splits-auto", "splits1"])
def test_gpu_attention_bf16_and_bitwise_hot_cache(gpu_case, splits):
    q, k, v, lengths = gpu_case
    gen = torch.Generator().manual_seed(91)
    max_pages = int(n_pages_of(lengths).max())
    pool = quest.pages_from_tokens(k, v, max_pages)
    pages = random_selection(lengths.cpu(), 8, 128, gen, pad_frac=0.05).cuda()
    rows = quest.resident_rows(pages, max_pages)
    out = quest.quest_attention(q, pool, rows, pages, lengths, splits=splits)
    assert rel_err(out, quest_ref.quest_attention_ref(q, pool, rows, pages, lengths)) < TOL[torch.bfloat16]
    cache, hot = hot_cache_rows(pool.cpu(), rows.cpu(), slots=257, gen=gen)
    hierarchical = quest.quest_attention(q, cache.cuda(), hot.cuda(), pages, lengths, splits=splits)
    assert torch.equal(out, hierarchical)


@pytest.mark.gpu
def test_gpu_attention_rows_past_int32_elements():
    """Rows whose element offset exceeds 2^31 (a 4.3 GB pool): the kernel must address in 64 bits."""
    d, hkv = 128, 8
    row_elems = 2 * PAGE * d
    n_rows = (2 ** 31) // row_elems + 64
    pool = torch.empty(n_rows, 2, PAGE, d, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(92)
    rows = (n_rows - 1 - torch.arange(hkv * 16, device="cuda", dtype=torch.int32)).view(1, hkv, 16)
    pool[rows.long().flatten()] = torch.randn(hkv * 16, 2, PAGE, d, device="cuda", generator=gen).bfloat16()
    pages = torch.arange(16, device="cuda", dtype=torch.int32).expand(1, hkv, 16).contiguous()
    lengths = torch.tensor([16 * PAGE], device="cuda", dtype=torch.int32)
    q = torch.randn(1, 32, d, device="cuda", generator=gen).bfloat16()
    out = quest.quest_attention(q, pool, rows, pages, lengths)
    assert rel_err(out, quest_ref.quest_attention_ref(q, pool, rows, pages, lengths)) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_dense_attention_bf16(gpu_case):
    q, k, v, lengths = gpu_case
    assert rel_err(quest.dense_attention(q, k, v, lengths), quest_ref.dense_attention_ref(q, k, v, lengths)) < 2e-2

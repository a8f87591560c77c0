"""DSA kernels against their torch references: indexer scores, top-k, sparse MLA decode.

CPU tests run the kernels through Triton's interpreter on small odd shapes (float16/float32, fp8
keys too: the interpreter handles them); GPU tests check bf16 at the model's shapes.
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import triton

from hisparse.dsa import ops as dsa
from hisparse.dsa import reference as dsa_ref
from hisparse.dsa.ops import sparse_mla_decode_gluon
from kernels_triton.dsa_gluon_prefill import sparse_mla_prefill_gluon

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DSV32_SCALE = 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2  # qk head dim 192, YaRN mscale of factor 40


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| over max |expected|, on the finite entries; infinities must coincide."""
    actual, expected = actual.float(), expected.float()
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), "infinities differ"
    assert not torch.isnan(actual).any(), "NaN in the output"
    finite = torch.isfinite(expected)
    if not finite.any():
        return 0.0
    diff = (actual[finite] - expected[finite]).abs().max()
    return (diff / expected[finite].abs().max().clamp_min(1e-6)).item()


def random_rows(n: int, k: int, num_rows: int, gen: torch.Generator, pad_frac: float = 0.2) -> torch.Tensor:
    """[n, k] int32 distinct rows per request with about pad_frac entries -1; the last request all -1."""
    rows = torch.stack([torch.randperm(num_rows, generator=gen)[:k] for _ in range(n)]).to(torch.int32)
    rows[torch.rand(n, k, generator=gen) < pad_frac] = -1
    rows[-1] = -1
    return rows


# ---------------------------------------------------------------------------------------------
# Indexer and top-k
# ---------------------------------------------------------------------------------------------

INDEXER_CASES = [
    pytest.param(3, 5, 32, 77, id="N3-H5-D32-T77"),
    pytest.param(2, 27, 64, 61, id="N2-H27-D64-T61"),
]


def indexer_inputs(n, h, d, t, dtype, gen):
    """Keys are a strided view into a larger pool; lengths: one past T (clamped), one 0, one partial."""
    q = torch.randn(n, h, d, generator=gen).to(dtype)
    weights = torch.randn(n, h, generator=gen) * h ** -0.5
    keys = torch.randn(n, t + 9, d, generator=gen).to(dtype)[:, 4:4 + t]
    lengths = torch.tensor([t + 3, 0, t // 2 + 1][:n] + [t] * max(0, n - 3), dtype=torch.int32)
    return q, weights, keys, lengths


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("n, h, d, t", INDEXER_CASES)
def test_indexer_scores_match_ref(n, h, d, t, dtype, nan_empty):
    gen = torch.Generator().manual_seed(1)
    q, weights, keys, lengths = indexer_inputs(n, h, d, t, dtype, gen)
    scores = dsa.indexer_scores(q, weights, keys, lengths)
    assert rel_err(scores, dsa_ref.indexer_scores_ref(q, weights, keys, lengths)) < TOL[dtype]
    assert torch.isinf(scores[1]).all(), "a request of length 0 must score -inf everywhere"


@pytest.mark.parametrize("n, h, d, t", INDEXER_CASES)
def test_indexer_fp8_keys_with_scale_match_ref(n, h, d, t, nan_empty):
    gen = torch.Generator().manual_seed(2)
    q, weights, keys, lengths = indexer_inputs(n, h, d, t, torch.float32, gen)
    keys8 = keys.to(dsa.FP8)
    scale = torch.rand(n, t, generator=gen) + 0.25
    scores = dsa.indexer_scores(q, weights, keys8, lengths, key_scale=scale)
    assert rel_err(scores, dsa_ref.indexer_scores_ref(q, weights, keys8, lengths, key_scale=scale)) < 1e-5


def test_topk_ties_rank_lower_index_first():
    scores = torch.tensor([[1.0, 2.0, 2.0, -0.0, 0.0, 2.0, float("-inf"), 5.0]])
    lengths = torch.tensor([7])
    expected = torch.tensor([[1, 2, 5, 0, 3, 4, 6, -1, -1]], dtype=torch.int32)
    assert torch.equal(dsa.topk_select(scores, lengths, 9), expected)
    assert torch.equal(dsa_ref.topk_select_ref(scores, lengths, 9), expected)


@pytest.mark.parametrize("n, t, k", [
    pytest.param(4, 61, 27, id="N4-T61-k27"),
    pytest.param(3, 113, 64, id="N3-T113-k64"),
    pytest.param(2, 20, 27, id="N2-T20-k27-k_over_T"),
])
def test_topk_select_matches_stable_sort_exactly(n, t, k):
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(-3, 4, (n, t), generator=gen).float() * 0.5  # many ties, both signs of zero
    scores[scores == 0] *= torch.where(torch.rand(int((scores == 0).sum()), generator=gen) < 0.5, -1.0, 1.0)
    scores[1, ::7] = float("-inf")
    lengths = torch.tensor([0, t, k // 2, t - 1][:n], dtype=torch.int64)
    sel = dsa.topk_select(scores, lengths, k)
    assert sel.dtype == torch.int32 and sel.shape == (n, k)
    assert torch.equal(sel, dsa_ref.topk_select_ref(scores, lengths, k))
    assert (sel[0] == -1).all(), "a request of length 0 selects nothing"


def test_dsa_select_is_indexer_then_topk():
    gen = torch.Generator().manual_seed(4)
    q, weights, keys, lengths = indexer_inputs(3, 5, 32, 77, torch.float32, gen)
    expected = dsa_ref.topk_select_ref(dsa_ref.indexer_scores_ref(q, weights, keys, lengths), lengths, 29)
    assert torch.equal(dsa.dsa_select(q, weights, keys, lengths, 29), expected)


# ---------------------------------------------------------------------------------------------
# Prefill: the indexer over a chunk of queries, the top-k's picks ordered
# ---------------------------------------------------------------------------------------------

def prefill_inputs(s, start, h, d, dtype, gen):
    """A chunk of s queries at positions start .. start + s - 1 over keys [start + s, d]."""
    q = torch.randn(s, h, d, generator=gen).to(dtype)
    weights = torch.randn(s, h, generator=gen) * h ** -0.5
    return q, weights, torch.randn(start + s, d, generator=gen).to(dtype)


def decode_indexer_of_chunk(q, weights, keys, start):
    """The decode indexer of each query with its causal length: what the prefill kernel must equal
    within float32 rounding."""
    s, t = q.shape[0], keys.shape[0]
    lengths = torch.arange(start + 1, start + s + 1, device=q.device)
    return dsa.indexer_scores(q, weights, keys.expand(s, t, keys.shape[1]), lengths), lengths


def assert_causal_scores(got, expected, start, tol):
    """-inf exactly at t >= start + s + 1 (query s's length), no NaN, the finite scores within tol of
    expected's largest."""
    s, t = got.shape
    beyond = torch.arange(t, device=got.device)[None, :] >= torch.arange(start + 1, start + s + 1, device=got.device)[:, None]
    assert torch.equal(torch.isneginf(got), beyond), "-inf where it should not be, or missing"
    assert torch.isfinite(got[~beyond]).all(), "NaN or +inf in the scores"
    scale = expected[~beyond].abs().max().clamp_min(1e-6)
    assert ((got[~beyond] - expected[~beyond]).abs().max() / scale).item() < tol


PREFILL_CONFIGS = {
    "default": None,
    "q1": dsa.PrefillIndexerConfig(block_t=32, queries=1, num_warps=4, num_stages=1),
    "q2-split2": dsa.PrefillIndexerConfig(block_t=32, queries=2, num_warps=4, num_stages=1, splits=2),
    "q4-split3": dsa.PrefillIndexerConfig(block_t=32, queries=4, num_warps=4, num_stages=1, splits=3),
    "t16-q4-split2": dsa.PrefillIndexerConfig(block_t=16, queries=4, num_warps=4, num_stages=1, splits=2),
}


@pytest.mark.parametrize("config", PREFILL_CONFIGS.values(), ids=PREFILL_CONFIGS.keys())
@pytest.mark.parametrize("s, start, h, d", [
    pytest.param(7, 0, 5, 16, id="first-chunk-odd"),         # S not a multiple of the 2 / 4 resident queries
    pytest.param(5, 38, 27, 32, id="start38-cuts-a-tile"),   # lengths 39..43 end inside a 16 / 32-key tile
    pytest.param(2, 3, 4, 16, id="rows-shorter-than-a-tile"),
    pytest.param(1, 70, 4, 16, id="one-query"),
    pytest.param(3, 61, 64, 16, id="h64"),                   # BLOCK_H = H: the product's N = queries * 64
])
def test_prefill_indexer_is_the_decode_indexer_within_rounding(s, start, h, d, config):
    """Causality as lengths: query i scores the tokens < start + i + 1, -inf after, the decode
    kernel's scores and the torch reference's within float32 rounding (the heads are summed in
    another order than the decode kernel's)."""
    gen = torch.Generator().manual_seed(s * 100 + start)
    q, weights, keys = prefill_inputs(s, start, h, d, torch.float32, gen)
    got = dsa.prefill_indexer_scores(q, weights, keys, start, config)
    decode, lengths = decode_indexer_of_chunk(q, weights, keys, start)
    assert_causal_scores(got, decode, start, TOL[torch.float32])
    expanded = keys.expand(s, *keys.shape)
    assert_causal_scores(got, dsa_ref.indexer_scores_ref(q, weights, expanded, lengths), start, TOL[torch.float32])


def test_prefill_indexer_in_fp16_past_the_chunk_and_with_a_prefix_of_queries():
    """fp16 within its tolerance of the reference; keys past the chunk's last length (NaN: never to
    be read) give -inf through the tail loop, across splits; a row block (queries r.., start + r)
    is those rows of the whole chunk's scores, as dsa_prefill_select makes them."""
    gen = torch.Generator().manual_seed(3)
    s, start = 9, 21
    q, weights, keys = prefill_inputs(s, start, 6, 32, torch.float16, gen)
    keys = torch.cat([keys, torch.full((37, 32), float("nan"), dtype=keys.dtype)])
    split3 = dsa.PrefillIndexerConfig(block_t=16, queries=4, num_warps=4, num_stages=1, splits=3)
    for config in (None, split3):
        whole = dsa.prefill_indexer_scores(q, weights, keys, start, config)
        lengths = torch.arange(start + 1, start + s + 1)
        expected = dsa_ref.indexer_scores_ref(q, weights, keys[:start + s].expand(s, start + s, 32), lengths)
        assert_causal_scores(whole[:, :start + s], expected, start, TOL[torch.float16])
        assert torch.isneginf(whole[:, start + s:]).all()
        assert torch.equal(dsa.prefill_indexer_scores(q[4:], weights[4:], keys, start + 4, config), whole[4:])


def test_prefill_indexer_refuses_bad_inputs():
    q, w, keys = torch.randn(4, 2, 16), torch.rand(4, 2), torch.randn(9, 16)
    with pytest.raises(ValueError, match="start=6"):
        dsa.prefill_indexer_scores(q, w, keys, 6)                      # 6 + 4 > 9 keys
    with pytest.raises(ValueError, match="keys"):
        dsa.prefill_indexer_scores(q, w, keys.to(torch.float16), 5)
    with pytest.raises(ValueError, match="weights"):
        dsa.prefill_indexer_scores(q, w[:3], keys, 5)
    with pytest.raises(ValueError, match="queries=3"):
        dsa.PrefillIndexerConfig(block_t=32, queries=3, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="block_t=48"):
        dsa.PrefillIndexerConfig(block_t=48, queries=2, num_warps=4, num_stages=1)
    assert dsa.prefill_indexer_scores(q[:0], w[:0], keys[:5], 5).shape == (0, 5)
    for bad in (24, 8, 32.0):
        with pytest.raises(ValueError, match=f"block_t={bad!r}: expected a power of 2 of at least 16"):
            dsa.indexer_scores(q, w, keys.expand(4, 9, 16), torch.full((4,), 9), block_t=bad)


@pytest.mark.parametrize("picked, k", [(16, 16), (5, 7), (12, 12)], ids=["k16", "fewer-picks-k7", "k12"])
def test_order_picks_is_two_stable_sorts(picked, k):
    """Heavy ties with -0.0 and +0.0 mixed, -inf picks, ids past the length: the same selection as
    the torch sorts, and the lowest pick with how many picks equal it."""
    gen = torch.Generator().manual_seed(picked + k)
    n, t = 9, 40
    scores = torch.randint(-2, 3, (n, t), generator=gen).float() * 0.5
    scores[(scores == 0) & (torch.rand(n, t, generator=gen) < 0.5)] = -0.0
    scores[:, 30:] = float("-inf")
    values, ids = scores.topk(picked, dim=1, sorted=False)
    values, ids = values.contiguous(), ids.contiguous()
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    sel, last, ties = dsa.order_picks(values, ids, lengths, k)
    ref_sel, ref_last, ref_ties = dsa.order_picks_ref(values, ids, lengths, k)
    assert torch.equal(sel, ref_sel) and torch.equal(last, ref_last) and torch.equal(ties, ref_ties)
    assert torch.equal(ties, (values == last[:, None]).sum(1).to(torch.int32))
    strided = torch.stack([lengths, torch.zeros_like(lengths)], 1)[:, 0]      # a view of stride 2
    assert torch.equal(dsa.order_picks(values, ids, strided, k)[0], sel)


def test_order_picks_puts_a_negative_nan_before_the_padding():
    """A -NaN of bits 0xFFFFFFFF has the lowest high half of `topk_select`'s keys: it still ranks
    above the places past the picks (fewer picks than the kernel's sort), as in `topk_select`."""
    scores = torch.tensor([[1.0, 0.5, 2.0, -1.0, 3.0]])
    scores[0, 1] = torch.tensor(-1, dtype=torch.int32).view(torch.float32)
    lengths = torch.tensor([5])
    values, ids = scores.topk(5, dim=1, sorted=False)
    assert torch.equal(dsa.order_picks(values.contiguous(), ids.contiguous(), lengths, 7)[0],
                       dsa.topk_select(scores, lengths, 7))


def test_place_ties_takes_the_lowest_ids_of_the_lowest_pick():
    """The picks equal to the lowest one become the lowest ids of that score, in id order, across
    several of the kernel's blocks of scores (interpreter: 64 a block), -0.0 equal to +0.0, rows
    whose lowest pick is -inf untouched: as in torch, and then topk_select's selection exactly."""
    gen = torch.Generator().manual_seed(3)
    n, t, k = 10, 150, 12
    scores = torch.randint(-2, 3, (n, t), generator=gen).float() * 0.5
    scores[(scores == 0) & (torch.rand(n, t, generator=gen) < 0.5)] = -0.0
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    lengths[:2] = torch.tensor([5, 12])                              # fewer valid tokens than k, exactly k
    scores = scores.masked_fill(torch.arange(t)[None, :] >= lengths[:, None], float("-inf"))
    values, ids = scores.topk(k, dim=1, sorted=False)
    sel, last, ties = dsa.order_picks_ref(values, ids, lengths, k)
    got, want = sel.clone(), sel.clone()
    dsa.place_ties(scores, last, ties, got, k)
    dsa.place_ties_ref(scores, last, ties, want, k)
    assert torch.equal(got, want)
    assert not torch.equal(got, sel)                                 # torch.topk picked other ties: replaced
    assert torch.equal(got, dsa.topk_select(scores, lengths, k))
    with pytest.raises(ValueError, match="ties int32"):
        dsa.place_ties(scores, last, ties.long(), got, k)


# ---------------------------------------------------------------------------------------------
# Sparse MLA decode
# ---------------------------------------------------------------------------------------------

DECODE_CASES = [
    pytest.param(3, 5, 64, 16, 100, 97, id="N3-H5-dv64-rope16-R100-k97"),
    pytest.param(2, 27, 512, 64, 113, 27, id="N2-H27-dv512-rope64-R113-k27"),
]
SMALL_TILES = dsa.DecodeConfig(block_h=16, block_k=16, num_warps=4, num_stages=1)


def decode_inputs(n, h, d_v, d_rope, r, k, dtype, gen):
    q = torch.randn(n, h, d_v + d_rope, generator=gen).to(dtype)
    kv = torch.randn(r, d_v + d_rope, generator=gen).to(dtype)
    return q, kv, random_rows(n, k, r, gen)


@pytest.mark.parametrize("splits", [1, 3, 4], ids=["splits1", "splits3", "splits4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("n, h, d_v, d_rope, r, k", DECODE_CASES)
def test_sparse_mla_decode_matches_ref(n, h, d_v, d_rope, r, k, dtype, splits, nan_empty):
    gen = torch.Generator().manual_seed(5)
    q, kv, rows = decode_inputs(n, h, d_v, d_rope, r, k, dtype, gen)
    out, lse = dsa.sparse_mla_decode(q, kv, rows, 0.1, d_v=d_v, num_splits=splits, config=SMALL_TILES)
    ref_out, ref_lse = dsa_ref.sparse_mla_decode_ref(q, kv, rows, 0.1, d_v=d_v)
    used = dsa.split_plan(n, h, k, SMALL_TILES, q.device, splits)[1]
    assert used == splits or k < splits * SMALL_TILES.block_k, "every split count is run where k allows it"
    assert out.dtype == dtype and out.shape == (n, h, d_v) and lse.shape == (n, h)
    assert rel_err(out, ref_out) < TOL[dtype]
    assert rel_err(lse, ref_lse) < 1e-5
    assert torch.equal(out[-1], torch.zeros_like(out[-1])), "no valid row must give zeros"
    assert torch.isneginf(lse[-1]).all()


@pytest.mark.parametrize("splits", [1, 3], ids=["splits1", "splits3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_sparse_mla_decode_with_an_empty_chunk_matches_ref(dtype, splits):
    """A whole chunk of -1 rows inside a request that has valid rows elsewhere, and a request with none."""
    gen = torch.Generator().manual_seed(13)
    q, kv, rows = decode_inputs(3, 5, 64, 16, 100, 97, dtype, gen)
    rows[0, :48] = -1                                   # splits3: the first chunk (48 rows) is empty
    out, _ = dsa.sparse_mla_decode(q, kv, rows, 0.1, d_v=64, num_splits=splits, config=SMALL_TILES)
    assert rel_err(out, dsa_ref.sparse_mla_decode_ref(q, kv, rows, 0.1, d_v=64)[0]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_sparse_mla_decode_matches_softmax_attention_over_selected_rows(dtype):
    gen = torch.Generator().manual_seed(6)
    n, h, d_v, d_rope = 3, 27, 64, 16
    q, kv, rows = decode_inputs(n, h, d_v, d_rope, 61, 45, dtype, gen)
    out, _ = dsa.sparse_mla_decode(q, kv, rows, DSV32_SCALE, d_v=d_v, num_splits=2, config=SMALL_TILES)
    for i in range(n - 1):  # the last request has no valid row
        picked = kv[rows[i][rows[i] >= 0].long()].float()  # [valid, D]
        expected = F.scaled_dot_product_attention(q[i].float()[None, None], picked[None, None],
                                                  picked[None, None, :, :d_v], scale=DSV32_SCALE)[0, 0]
        assert rel_err(out[i], expected) < TOL[dtype]


def build_resident_and_hot(streams, units, slots, k, d, dtype, gen):
    """A resident pool and a hot cache holding the selected units of each stream at shuffled slots.

    Returns kv_resident [S*units, D], rows_resident, kv_hot [S*(slots+1), D], rows_hot: the same
    rows in the same order, at different places.
    """
    pool = torch.randn(streams, units, d, generator=gen).to(dtype)
    sel = random_rows(streams, k, units, gen, pad_frac=0.1).long()  # unit ids, -1 pads
    sel[-1, : k // 2] = torch.randperm(units, generator=gen)[: k // 2]  # the last stream is partly padded
    cache = torch.randn(streams, slots + 1, d, generator=gen).to(dtype)  # stale rows everywhere
    slot = torch.full_like(sel, -1)
    for s in range(streams):
        valid = sel[s] >= 0
        slot[s, valid] = torch.randperm(slots, generator=gen)[: int(valid.sum())]
        cache[s, slot[s, valid]] = pool[s, sel[s, valid]]
    base_res = torch.arange(streams)[:, None] * units
    base_hot = torch.arange(streams)[:, None] * (slots + 1)
    rows_res = torch.where(sel >= 0, base_res + sel, -1).to(torch.int32)
    rows_hot = torch.where(slot >= 0, base_hot + slot, -1).to(torch.int32)
    return pool.view(-1, d), rows_res, cache.view(-1, d), rows_hot


@pytest.mark.parametrize("splits", [1, 2], ids=["splits1", "splits2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_hot_cache_and_resident_pool_bitwise_equal(dtype, splits):
    gen = torch.Generator().manual_seed(7)
    kv_res, rows_res, kv_hot, rows_hot = build_resident_and_hot(3, 97, 61, 37, 80, dtype, gen)
    q = torch.randn(3, 5, 80, generator=gen).to(dtype)
    args = {"d_v": 64, "num_splits": splits, "config": SMALL_TILES}
    out_res, lse_res = dsa.sparse_mla_decode(q, kv_res, rows_res, DSV32_SCALE, **args)
    out_hot, lse_hot = dsa.sparse_mla_decode(q, kv_hot, rows_hot, DSV32_SCALE, **args)
    assert torch.equal(out_res, out_hot) and torch.equal(lse_res, lse_hot)
    assert rel_err(out_res, dsa_ref.sparse_mla_decode_ref(q, kv_res, rows_res, DSV32_SCALE, d_v=64)[0]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_row_base_reads_each_requests_own_region(dtype):
    """rows as each request's local ids (token ids, or slots) from row_base[n]: the same outputs,
    bitwise, as the same rows translated to pool rows beforehand."""
    gen = torch.Generator().manual_seed(11)
    kv_res, rows_res, kv_hot, rows_hot = build_resident_and_hot(3, 97, 61, 37, 80, dtype, gen)
    q = torch.randn(3, 5, 80, generator=gen).to(dtype)
    for kv, rows, region in ((kv_res, rows_res, 97), (kv_hot, rows_hot, 62)):
        base = torch.arange(3, dtype=torch.int64) * region
        local = torch.where(rows >= 0, rows - base[:, None], -1).to(torch.int32)
        assert (local < region).all()
        for splits in (1, 2):
            want = dsa.sparse_mla_decode(q, kv, rows, DSV32_SCALE, d_v=64, num_splits=splits, config=SMALL_TILES)
            got = dsa.sparse_mla_decode(q, kv, local, DSV32_SCALE, d_v=64, num_splits=splits, config=SMALL_TILES,
                                        row_base=base)
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        ref = dsa_ref.sparse_mla_decode_ref(q, kv, rows, DSV32_SCALE, d_v=64)
        ref_local = dsa_ref.sparse_mla_decode_ref(q, kv, local, DSV32_SCALE, d_v=64, row_base=base)
        assert torch.equal(ref[0], ref_local[0]) and torch.equal(ref[1], ref_local[1])


def test_sparse_mla_decode_fills_given_buffers():
    gen = torch.Generator().manual_seed(8)
    q, kv, rows = decode_inputs(2, 5, 64, 16, 50, 27, torch.float32, gen)
    out = torch.full((2, 5, 64), float("nan"))
    lse = torch.full((2, 5), float("nan"))
    got_out, got_lse = dsa.sparse_mla_decode(q, kv, rows, 0.2, d_v=64, out=out, lse=lse, config=SMALL_TILES)
    assert got_out is out and got_lse is lse
    ref_out, ref_lse = dsa_ref.sparse_mla_decode_ref(q, kv, rows, 0.2, d_v=64)
    assert rel_err(out, ref_out) < TOL[torch.float32] and rel_err(lse, ref_lse) < 1e-5


def test_default_config_shrinks_when_it_does_not_fit(monkeypatch):
    """A default config the GPU cannot launch is replaced by smaller tiles, kept for later calls."""
    launched = []
    real_launch = dsa._launch_decode

    def launch_small_only(q, kv, rows, row_base, out, lse, sm_scale, cfg, num_splits):
        launched.append(cfg)
        if cfg.block_k > 16:
            raise triton.runtime.errors.OutOfResources(cfg.block_k * 7000, 232448, "shared memory")
        real_launch(q, kv, rows, row_base, out, lse, sm_scale, cfg, num_splits)

    monkeypatch.setattr(dsa, "_launch_decode", launch_small_only)
    monkeypatch.setattr(dsa, "_FITTED_CONFIGS", {})
    gen = torch.Generator().manual_seed(9)
    q, kv, rows = decode_inputs(2, 5, 512, 64, 50, 27, torch.float16, gen)
    with pytest.warns(UserWarning, match="does not fit"):
        out, _ = dsa.sparse_mla_decode(q, kv, rows, 0.2)
    assert [c.block_k for c in launched] == [64, 32, 16]
    assert rel_err(out, dsa_ref.sparse_mla_decode_ref(q, kv, rows, 0.2)[0]) < TOL[torch.float16]
    dsa.sparse_mla_decode(q, kv, rows, 0.2)
    assert [c.block_k for c in launched] == [64, 32, 16, 16], "the fitted config is kept"


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------

def test_launchers_reject_bad_inputs():
    q, kv = torch.randn(2, 4, 80), torch.randn(30, 80)
    rows = torch.zeros(2, 8, dtype=torch.int32)
    bad_decode = {
        "rows dtype": ({"rows": rows.long()}, "rows must be int32"),
        "kv dtype": ({"kv": kv.half()}, "kv dtype"),
        "kv width": ({"kv": kv[:, :72]}, "kv shape"),
        "d_v": ({"d_v": 48}, "d_v=48"),
        "scale": ({"sm_scale": -1.0}, "sm_scale=-1.0"),
        "rows batch": ({"rows": rows[:1]}, "rows must be int32"),
        "out": ({"out": torch.empty(2, 4, 32)}, "out torch.float32"),
        "row_base dtype": ({"row_base": torch.zeros(2, dtype=torch.int32)}, "row_base must be a contiguous int64"),
        "row_base batch": ({"row_base": torch.zeros(3, dtype=torch.int64)}, "row_base must be a contiguous int64"),
        "row_base strided": ({"row_base": torch.zeros(2, 2, dtype=torch.int64)[:, 0]}, "stride \\(2,\\)"),
    }
    for (change, message) in bad_decode.values():
        args = {"q": q, "kv": kv, "rows": rows, "sm_scale": 0.1, "d_v": 64} | change
        with pytest.raises(ValueError, match=message):
            dsa.sparse_mla_decode(**args)
    qi, w, keys, lengths = torch.randn(2, 3, 32), torch.randn(2, 3), torch.randn(2, 9, 32), torch.tensor([9, 4])
    with pytest.raises(ValueError, match="fp8 keys need key_scale"):
        dsa.indexer_scores(qi, w, keys.to(dsa.FP8), lengths)
    with pytest.raises(ValueError, match="key_scale is only for fp8"):
        dsa.indexer_scores(qi, w, keys, lengths, key_scale=torch.ones(2, 9))
    with pytest.raises(ValueError, match="indexer head dim 24"):
        dsa.indexer_scores(qi[..., :24], w, keys[..., :24], lengths)
    with pytest.raises(ValueError, match="k must be a positive int"):
        dsa.topk_select(torch.randn(2, 9), lengths, 0)
    with pytest.raises(ValueError, match="block_k=24"):
        dsa.DecodeConfig(block_h=16, block_k=24, num_warps=4, num_stages=1)


def test_decode_backend_choice_and_refusals():
    """Off Hopper, "auto" is the Triton kernel; asking for Gluon there, an unknown backend, or Gluon
    with a Triton config, is refused before any launch, naming why."""
    q, kv = torch.randn(2, 4, 80), torch.randn(30, 80)
    rows = torch.zeros(2, 8, dtype=torch.int32)
    assert dsa.decode_backend(q, 64) == "triton" and dsa.decode_backend(q, 64, "auto") == "triton"
    assert dsa.decode_backend(q, 64, "auto", SMALL_TILES) == "triton"
    assert "not a CUDA GPU" in dsa.gluon_decode_unsupported(q, 64) or dsa.dsa_gluon.GLUON_IMPORT_ERROR
    refused = {"gluon": "backend='gluon': the Gluon decode kernel cannot run this", "flash": "backend='flash'"}
    for backend, message in refused.items():
        with pytest.raises(ValueError, match=message):
            dsa.sparse_mla_decode(q, kv, rows, 0.1, d_v=64, backend=backend)
    with pytest.raises(ValueError, match="is the Triton kernel's"):
        dsa.sparse_mla_decode(q, kv, rows, 0.1, d_v=64, backend="gluon", config=SMALL_TILES)
    with pytest.raises(ValueError, match="cannot run this"):
        dsa.sparse_mla_decode_gluon(q, kv, rows, 0.1, d_v=64)


# The GPU machine's Triton (3.6) builds the default config without spilling; other versions
# allocate registers differently (3.9: 216 B), so the check bounds the spill by what 3.9 needs.
SPILL_BOUND = {(3, 6): 0}
SPILL_BOUND_OTHER = 256


def test_decode_kernel_compiles_for_hopper_within_registers():
    """The interpreter never compiles: build the default bf16 decode config for sm_90a in a process
    without it (experiments/tools/sass_dsa.py), with and without row_base: wgmma and asynchronous copies,
    shared memory within Hopper's 227 KiB, no spills with Triton 3.6 (at most a few hundred bytes
    with others)."""
    env = os.environ | {"TRITON_INTERPRET": "0"}   # else kernels_triton interprets them here, without a GPU
    done = subprocess.run([sys.executable, "-m", "experiments.tools.sass_dsa"],
                          cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.strip().startswith("row_base")]
    assert len(lines) == 2, done.stdout
    version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    bound = SPILL_BOUND.get(version, SPILL_BOUND_OTHER)
    for line in lines:
        fields = dict(re.findall(r"([A-Z]+) (\d+)", line.split("|")[1]))
        assert int(re.search(r"(\d+) B spilled", line).group(1)) <= bound, (triton.__version__, line)
        assert int(fields["HGMMA"]) > 0 and int(fields["LDGSTS"]) > 0, line
        assert int(re.search(r"(\d+) KiB shared", line).group(1)) <= 227, line


# ---------------------------------------------------------------------------------------------
# GPU: bf16 at the model's shapes (128 heads, k = 2048, 32K and 128K contexts)
# ---------------------------------------------------------------------------------------------

def needs_backend(backend: str, q: torch.Tensor) -> None:
    """Skip a GPU test of the Gluon decode kernel where it cannot run (not Hopper, not Triton 3.6)."""
    if backend == "gluon" and (reason := dsa.gluon_decode_unsupported(q, 512)):
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "gluon"])
@pytest.mark.parametrize("context", [32768, 131072], ids=["ctx32K", "ctx128K"])
def test_gpu_sparse_mla_decode_real_shapes(context, backend):
    gen = torch.Generator(device="cuda").manual_seed(10)
    n, h, k = 4, 128, 2048
    kv = torch.randn(n * context, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(n, h, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    tokens = torch.rand(n, context, device="cuda", generator=gen).topk(k, dim=1).indices
    rows = (tokens + torch.arange(n, device="cuda")[:, None] * context).to(torch.int32)
    rows[1, 1000:] = -1  # a short request
    rows[2] = -1  # a request with nothing selected
    needs_backend(backend, q)
    ref_out, ref_lse = dsa_ref.sparse_mla_decode_ref(q, kv, rows, DSV32_SCALE)
    for splits in (None, 1, 7):
        out, lse = dsa.sparse_mla_decode(q, kv, rows, DSV32_SCALE, num_splits=splits, backend=backend)
        assert rel_err(out, ref_out) < TOL[torch.bfloat16], f"num_splits={splits}"
        assert rel_err(lse, ref_lse) < 1e-4, f"num_splits={splits}"
        assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "gluon"])
@pytest.mark.parametrize("batch", [2, 64], ids=["N2-split", "N64"])
def test_gpu_hot_cache_and_resident_pool_bitwise_equal(batch, backend):
    gen = torch.Generator().manual_seed(11)
    kv_res, rows_res, kv_hot, rows_hot = build_resident_and_hot(batch, 8192, 4096, 2048, 576, torch.bfloat16,
                                                                gen)
    q = torch.randn(batch, 128, 576, generator=gen).to(torch.bfloat16).cuda()
    needs_backend(backend, q)
    out_res, lse_res = dsa.sparse_mla_decode(q, kv_res.cuda(), rows_res.cuda(), DSV32_SCALE, backend=backend)
    out_hot, lse_hot = dsa.sparse_mla_decode(q, kv_hot.cuda(), rows_hot.cuda(), DSV32_SCALE, backend=backend)
    assert torch.equal(out_res, out_hot) and torch.equal(lse_res, lse_hot)


@pytest.mark.gpu
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, dsa.FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("context", [32768, 131072], ids=["ctx32K", "ctx128K"])
def test_gpu_indexer_and_topk_real_shapes(context, key_dtype):
    gen = torch.Generator(device="cuda").manual_seed(12)
    n, h, d, k = 4, 64, 128, 2048
    q = torch.randn(n, h, d, device="cuda", generator=gen).to(torch.bfloat16)
    weights = torch.randn(n, h, device="cuda", generator=gen) * h ** -0.5 * d ** -0.5
    keys = torch.randn(n, context, d, device="cuda", generator=gen)
    scale = None
    if key_dtype == dsa.FP8:
        scale = keys.abs().amax(dim=-1) / 448.0
        keys = (keys / scale[..., None]).to(dsa.FP8)
    else:
        keys = keys.to(key_dtype)
    lengths = torch.tensor([context, context // 3, 1000, 0], device="cuda", dtype=torch.int32)
    scores = dsa.indexer_scores(q, weights, keys, lengths, key_scale=scale)
    assert rel_err(scores, dsa_ref.indexer_scores_ref(q, weights, keys, lengths, key_scale=scale)) < 1e-3
    sel = dsa.topk_select(scores, lengths, k)
    assert torch.equal(sel, dsa_ref.topk_select_ref(scores, lengths, k))
    assert (sel[2, 1000:] == -1).all() and (sel[3] == -1).all() and (sel[:2] >= 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "gluon"])
def test_gpu_offsets_beyond_int32(backend):
    """Row and key offsets past 2^31 elements: 64-bit addressing in the kernels (each decode one)."""
    rows_total = 2 ** 31 // 576 + 4096
    q = torch.randn(2, 128, 576, device="cuda", dtype=torch.bfloat16)
    needs_backend(backend, q)
    kv = torch.zeros(rows_total, 576, device="cuda", dtype=torch.bfloat16)
    kv[-4096:] = torch.randn(4096, 576, device="cuda", dtype=torch.bfloat16)
    rows = (rows_total - 1 - torch.stack([torch.randperm(4096, device="cuda")[:2048] for _ in range(2)]))
    rows = rows.to(torch.int32)
    out, _ = dsa.sparse_mla_decode(q, kv, rows, DSV32_SCALE, backend=backend)
    assert rel_err(out, dsa_ref.sparse_mla_decode_ref(q, kv, rows, DSV32_SCALE)[0]) < TOL[torch.bfloat16]
    del kv
    t = 2 ** 31 // 128 + 1024
    keys = torch.zeros(2, t, 128, device="cuda", dtype=torch.bfloat16)
    keys[1, -1024:] = torch.randn(1024, 128, device="cuda", dtype=torch.bfloat16)
    qi, w = torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16), torch.rand(2, 64, device="cuda")
    lengths = torch.tensor([t, t], device="cuda", dtype=torch.int32)
    scores = dsa.indexer_scores(qi, w, keys, lengths)[1, -1024:]
    expected = dsa_ref.indexer_scores_ref(qi[1:], w[1:], keys[1:, -1024:], lengths[1:] * 0 + 1024)[0]
    assert rel_err(scores, expected) < 1e-3


# -- on a GPU --------------------------------------------------------------------------------------
# The Gluon sparse MLA decode kernel (kernels_triton/dsa_gluon.py, launched by hisparse/dsa/ops.py)
# against hisparse/dsa/reference.py's torch reference, on a Hopper GPU only (Gluon kernels do not run
# in the interpreter; skipped elsewhere).
#
#     python -m pytest -q -m gpu tests/test_dsa.py      # on an H100 / H200, Triton 3.6
#     python -m benchmarks.bench_attention_dsa --tune             # times it beside the Triton kernel's configs
#
# bf16 at the model's shapes: 128 heads, D 576 (512 + 64), k = 2048, batch 2-4; scattered -1 rows, a
# short request, a request with no valid row, row_base, and one and two splits.

TOL_BF16 = TOL[torch.bfloat16]


def _skip_reason():
    """Why the Gluon kernel cannot run here (no GPU, not Hopper, no Triton 3.6 Gluon), or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return dsa.gluon_decode_unsupported(torch.empty(1, 64, 576, dtype=torch.bfloat16, device="cuda"), 512)


def gluon_inputs(n: int, context: int, k: int = 2048, h: int = 128, seed: int = 20):
    """kv [n * context, 576] bf16 (request i owns rows i*context ...), q [n, h, 576], rows [n, k] int32
    global row numbers: about 10% scattered -1, request 1 valid for its first 1000 only (when n > 2),
    the last request none at all."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(n * context, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(n, h, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    tokens = torch.rand(n, context, device="cuda", generator=gen).topk(k, dim=1).indices
    rows = (tokens + torch.arange(n, device="cuda")[:, None] * context).to(torch.int32)
    rows[torch.rand(n, k, device="cuda", generator=gen) < 0.1] = -1
    if n > 2:
        rows[1, 1000:] = -1
    rows[-1] = -1
    return q, kv, rows


@pytest.fixture
def needs_gluon():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_gluon")
@pytest.mark.parametrize("splits", [1, 2], ids=["splits1", "splits2"])
@pytest.mark.parametrize("batch", [2, 4], ids=["N2", "N4"])
def test_gpu_gluon_decode_matches_ref(batch, splits, nan_empty):
    q, kv, rows = gluon_inputs(batch, 32768)
    out, lse = sparse_mla_decode_gluon(q, kv, rows, DSV32_SCALE, num_splits=splits)
    torch.cuda.synchronize()
    ref_out, ref_lse = dsa_ref.sparse_mla_decode_ref(q, kv, rows, DSV32_SCALE)
    assert out.shape == (batch, 128, 512) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rel_err(out, ref_out) < TOL_BF16
    assert rel_err(lse, ref_lse) < 1e-4
    assert torch.equal(out[-1], torch.zeros_like(out[-1])), "no valid row must give zeros"
    assert torch.isneginf(lse[-1]).all()
    # and close to the Triton kernel (not bitwise: the accumulation order differs)
    tri_out, tri_lse = dsa.sparse_mla_decode(q, kv, rows, DSV32_SCALE, num_splits=splits, backend="triton")
    assert rel_err(out, tri_out) < TOL_BF16 and rel_err(lse, tri_lse) < 1e-4


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_gluon")
def test_gpu_gluon_is_the_default_decode_here():
    """On this Hopper GPU with Triton 3.6, sparse_mla_decode's default backend ("auto") runs the
    Gluon kernel at the model's shape (bitwise its output)."""
    q, kv, rows = gluon_inputs(2, 8192, seed=24)
    assert dsa.gluon_decode_unsupported(q, 512) is None
    assert dsa.decode_backend(q, 512) == "gluon"
    assert dsa.decode_backend(q[:, :32], 512) == "triton", "fewer than 64 heads: Triton"
    out, lse = dsa.sparse_mla_decode(q, kv, rows, DSV32_SCALE, num_splits=1)
    g_out, g_lse = sparse_mla_decode_gluon(q, kv, rows, DSV32_SCALE, num_splits=1)
    assert torch.equal(out, g_out) and torch.equal(lse, g_lse)


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_gluon")
@pytest.mark.parametrize("batch", [2, 4], ids=["N2", "N4"])
def test_gpu_gluon_decode_row_base(batch):
    """rows as request-local ids from row_base[n]: the reference's answer, and bitwise the answer of
    the same rows given as global rows."""
    context = 8192
    q, kv, rows = gluon_inputs(batch, context, seed=21)
    base = torch.arange(batch, device="cuda", dtype=torch.int64) * context
    local = torch.where(rows >= 0, rows - base[:, None], -1).to(torch.int32)
    out, lse = sparse_mla_decode_gluon(q, kv, local, DSV32_SCALE, row_base=base)
    ref_out, ref_lse = dsa_ref.sparse_mla_decode_ref(q, kv, local, DSV32_SCALE, row_base=base)
    assert rel_err(out, ref_out) < TOL_BF16
    assert rel_err(lse, ref_lse) < 1e-4
    glob_out, glob_lse = sparse_mla_decode_gluon(q, kv, rows, DSV32_SCALE)
    assert torch.equal(out, glob_out) and torch.equal(lse, glob_lse)


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_gluon")
def test_gpu_gluon_decode_every_row_valid_and_tail_tile():
    """No -1 at all (every tile full), and k not a multiple of the 64-row tile (a partial last tile)."""
    for k in (2048, 2000):
        gen = torch.Generator(device="cuda").manual_seed(22)
        kv = torch.randn(3 * 4096, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
        q = torch.randn(3, 128, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
        rows = torch.stack([torch.randperm(kv.shape[0], device="cuda", generator=gen)[:k] for _ in range(3)])
        rows = rows.to(torch.int32)
        out, lse = sparse_mla_decode_gluon(q, kv, rows, DSV32_SCALE)
        ref_out, ref_lse = dsa_ref.sparse_mla_decode_ref(q, kv, rows, DSV32_SCALE)
        assert rel_err(out, ref_out) < TOL_BF16, k
        assert rel_err(lse, ref_lse) < 1e-4, k


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_gluon")
@pytest.mark.parametrize("block_k, num_stages", [(64, 3), (32, 3), (32, 4)], ids=["bk64-st3", "bk32-st3", "bk32-st4"])
def test_gpu_gluon_decode_other_tiles_and_rings(block_k, num_stages):
    """Smaller tiles and deeper rings of gathered tiles (wait_group(NUM_STAGES - 2)); (64, 3) does not fit
    Hopper's shared memory and must be refused by the launch, not run wrong."""
    import triton.runtime.errors

    q, kv, rows = gluon_inputs(3, 8192, seed=23)
    if block_k * 1152 * num_stages + 72 * 1024 > 227 * 1024:
        with pytest.raises(triton.runtime.errors.OutOfResources):
            sparse_mla_decode_gluon(q, kv, rows, DSV32_SCALE, block_k=block_k, num_stages=num_stages)
        return
    out, lse = sparse_mla_decode_gluon(q, kv, rows, DSV32_SCALE, block_k=block_k, num_stages=num_stages)
    ref_out, ref_lse = dsa_ref.sparse_mla_decode_ref(q, kv, rows, DSV32_SCALE)
    assert rel_err(out, ref_out) < TOL_BF16
    assert rel_err(lse, ref_lse) < 1e-4
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_gluon")
@pytest.mark.parametrize("k", [40, 320, 2000, 2048])
def test_gpu_gluon_prefill_kernel_matches_ref(k):
    """kernels_triton/dsa_gluon_prefill.py (the prefill's sparse MLA on Hopper): the reference's answer with
    scattered -1 rows, a short row list, none at all, and whole empty tiles before valid ones; the same
    bits twice; request-local rows from row_base bitwise the same rows given globally."""
    context = 8192
    q, kv, rows = gluon_inputs(4, context, k=k, seed=30 + k)
    if k > 128:
        rows[0, :64] = -1                    # round 0's tile a empty
        rows[2, 64:128] = -1                 # round 0's tile b empty
    out, lse = sparse_mla_prefill_gluon(q, kv, rows, DSV32_SCALE)
    ref_out, ref_lse = dsa_ref.sparse_mla_decode_ref(q, kv, rows, DSV32_SCALE)
    assert rel_err(out, ref_out) < TOL_BF16 and rel_err(lse, ref_lse) < 1e-4
    assert torch.equal(out[-1], torch.zeros_like(out[-1])) and torch.isneginf(lse[-1]).all()
    again = sparse_mla_prefill_gluon(q, kv, rows, DSV32_SCALE)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
    base = torch.arange(4, device="cuda", dtype=torch.int64) * context
    local = torch.where(rows >= 0, rows - base[:, None], -1).to(torch.int32)
    b_out, b_lse = sparse_mla_prefill_gluon(q, kv, local, DSV32_SCALE, row_base=base)
    assert torch.equal(out, b_out) and torch.equal(lse, b_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("s, start", [(2048, 30720), (512, 130560), (333, 4001)], ids=["32K", "128K", "odd"])
def test_gpu_prefill_indexer_is_the_decode_indexer_within_rounding(s, start):
    """bf16 at the model's indexer (64 heads of 128): the default config's scores are the decode
    kernel's within float32 rounding, -inf at the same places; the prefill's selection is the exact
    top-k of its own scores (`topk_select`) and nearly every pick the decode path's."""
    gen = torch.Generator(device="cuda").manual_seed(s)
    q = torch.randn(s, 64, 128, device="cuda", generator=gen).to(torch.bfloat16)
    weights = torch.randn(s, 64, device="cuda", generator=gen) * 0.1
    keys = torch.randn(start + s, 128, device="cuda", generator=gen).to(torch.bfloat16)
    got = dsa.prefill_indexer_scores(q, weights, keys, start)
    decode, lengths = decode_indexer_of_chunk(q, weights, keys, start)
    assert_causal_scores(got, decode, start, 1e-5)
    rows = slice(s - 64, s)
    picked = dsa.dsa_prefill_select(q, weights, keys, start, 2048)[rows]
    assert torch.equal(picked, dsa.topk_select(got[rows], lengths[rows], 2048))
    decode_picked = dsa.topk_select(decode[rows], lengths[rows], 2048)       # near-ties may swap, nothing more
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(picked.cpu(), decode_picked.cpu()))
    assert same >= 0.999 * picked.numel(), same
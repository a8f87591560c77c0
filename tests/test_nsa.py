"""NSA decode kernels against their torch references and against plain softmax attention.

CPU tests run the kernels through Triton's interpreter on small odd shapes (float16/float32);
GPU tests check bf16 at real shapes (32 query heads, 8 KV heads, head dim 128).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hisparse.nsa import ops as nsa
from hisparse.nsa import reference as nsa_ref

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# Scores are fp32 sums of probabilities whatever the input dtype; bf16 runs on the GPU at long contexts.
SCORE_TOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-4}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| over max |expected|; NaN in `actual` fails."""
    actual, expected = actual.double(), expected.double()
    assert not torch.isnan(actual).any(), "NaN in the output"
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()


class Case:
    """Random inputs of one NSA decode step: dense per-branch tokens and their resident forms.

    The window defaults to 128 tokens (not 512) to keep interpreter runs short."""

    def __init__(self, n, h, kv_heads, d, lengths, dtype, device="cpu", window=128, seed=0,
                 weights=False):
        gen = torch.Generator(device=device).manual_seed(seed)
        t = max(lengths)

        def rnd(*shape):
            return torch.randn(*shape, generator=gen, device=device).to(dtype)

        self.n, self.h, self.kv_heads, self.d, self.dtype = n, h, kv_heads, d, dtype
        self.lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.q = rnd(n, h, d)
        self.k_cmp, self.v_cmp = rnd(n, kv_heads, t, d), rnd(n, kv_heads, t, d)
        self.k_slc, self.v_slc = rnd(n, kv_heads, t, d), rnd(n, kv_heads, t, d)
        self.k_win, self.v_win = rnd(n, kv_heads, t, d), rnd(n, kv_heads, t, d)
        self.weight_k = rnd(d, d) * d ** -0.5 if weights else None
        self.weight_v = rnd(d, d) * d ** -0.5 if weights else None
        self.ck, self.cv = nsa_ref.nsa_compress_ref(self.k_cmp, self.v_cmp, self.weight_k, self.weight_v)
        self.pool = nsa.nsa_block_rows(self.k_slc, self.v_slc)
        self.n_units = nsa.block_count(torch.tensor(t)).item()
        self.win_k, self.win_v = nsa.nsa_window_ring(self.k_win, self.v_win, self.lengths, window)
        self.gates = torch.rand(n, h, 3, generator=gen, device=device).to(dtype)


def plain_attention(q, k, v):
    """softmax(q k^T / sqrt(D)) v in float64 for one head: q [D], k, v [L, D]; zeros when L = 0."""
    if k.shape[0] == 0:
        return torch.zeros_like(q, dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    return torch.softmax(k @ q * q.shape[0] ** -0.5, dim=0) @ v


def plain_selected(case, blocks):
    """The selected branch computed from the dense tokens of the selected blocks: [N, H, D]."""
    out = torch.zeros(case.n, case.h, case.d, dtype=torch.float64)
    g = case.h // case.kv_heads
    for i in range(case.n):
        length = case.lengths[i].item()
        for kvh in range(case.kv_heads):
            tok = [t for b in blocks[i, kvh].tolist() if b >= 0
                   for t in range(b * nsa.SEL_BLOCK, min(b * nsa.SEL_BLOCK + nsa.SEL_BLOCK, length))]
            for hq in range(kvh * g, kvh * g + g):
                out[i, hq] = plain_attention(case.q[i, hq].cpu(), case.k_slc[i, kvh, tok].cpu(),
                                             case.v_slc[i, kvh, tok].cpu())
    return out


def shuffled_cache(pool, gen, extra=7):
    """A 'hot cache' holding every pool row at another position, garbage elsewhere: (cache, where)."""
    r = pool.shape[0]
    cache = torch.randn(r + extra, *pool.shape[1:], generator=gen, device=pool.device).to(pool.dtype)
    where = torch.randperm(r + extra, generator=gen, device=pool.device)[:r]
    cache[where] = pool
    return cache, where.to(torch.int32)


def to_cache_rows(rows, where):
    return torch.where(rows >= 0, where[rows.clamp(min=0).long()], -1).to(torch.int32)


DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32")]
CASES = [  # n, h, kv_heads, d, lengths
    pytest.param(4, 6, 2, 27, [61, 453, 5, 0], id="N4-H6-KV2-D27-L61,453,5,0"),  # 0: a padded batch row
    pytest.param(2, 4, 4, 32, [300, 129], id="N2-H4-KV4-D32-L300,129"),
]
N_SEL = 5  # small n keeps interpreter runs short; N_SELECT = 16 runs in test_decode_default_n_select


# ---------------------------------------------------------------------------------------------
# Compression
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", [False, True], ids=["mean", "mean+linear"])
@pytest.mark.parametrize("t, d", [(61, 27), (96, 32)], ids=["T61-D27", "T96-D32"])
def test_compress_matches_ref(t, d, weights, dtype, nan_empty):
    case = Case(2, 2, 2, d, [t, t], dtype, weights=weights)
    ck, cv = nsa.nsa_compress(case.k_cmp, case.v_cmp, case.weight_k, case.weight_v)
    assert ck.shape == (2, 2, (t - 32) // 16 + 1, d)
    assert rel_err(ck, case.ck) < TOL[dtype] and rel_err(cv, case.cv) < TOL[dtype]
    block = case.k_cmp[1, 0, 16:48].float().mean(0)  # compressed block 1, by definition
    if weights:
        block = block @ case.weight_k.float()
    assert rel_err(ck[1, 0, 1], block) < TOL[dtype]


def test_compress_short_input_gives_no_blocks():
    k = torch.randn(1, 2, 31, 16)
    ck, cv = nsa.nsa_compress(k, k.clone())
    assert ck.shape == (1, 2, 0, 16) and cv.shape == (1, 2, 0, 16)


@pytest.mark.parametrize("weights, dtype", [
    pytest.param(False, torch.float16, id="mean-fp16"), pytest.param(True, torch.float32, id="mean+linear-fp32")])
def test_compress_newest_from_ring_matches_full_compression(weights, dtype):
    """Decode steps grow requests token by token; each step writes the block its token completes.
    One KV head (the interpreter's time goes by programs, one per request and KV head, at each of the
    37 steps): a KV head's offsets are the same kernel's in test_compress_matches_ref (2 KV heads), and
    the decode loop compresses the newest blocks of 2 KV heads against the torch step in
    tests/test_engine_nsa.py."""
    case = Case(3, 2, 1, 27, [66, 66, 66], dtype, window=48, seed=15, weights=weights)
    ck = torch.full_like(case.ck, float("nan"))
    cv = torch.full_like(case.cv, float("nan"))
    for step in range(29, 66):
        lengths = torch.tensor([step, step + 1, step - 17], dtype=torch.int32)
        win_k, win_v = nsa.nsa_window_ring(case.k_cmp, case.v_cmp, lengths, 48)
        nsa.nsa_compress_newest(win_k, win_v, lengths, ck, cv, case.weight_k, case.weight_v)
    n_cmp = nsa.compressed_count(torch.tensor([65, 66, 48])).tolist()
    for i, c in enumerate(n_cmp):
        assert torch.isnan(ck[i, :, c:]).all() and torch.isnan(cv[i, :, c:]).all(), "a block written too early"
        if weights:
            assert rel_err(ck[i, :, :c], case.ck[i, :, :c]) < TOL[dtype]
            assert rel_err(cv[i, :, :c], case.cv[i, :, :c]) < TOL[dtype]
        else:
            full_k, full_v = nsa.nsa_compress(case.k_cmp, case.v_cmp)
            assert torch.equal(ck[i, :, :c], full_k[i, :, :c]) and torch.equal(cv[i, :, :c], full_v[i, :, :c])


# ---------------------------------------------------------------------------------------------
# Compressed branch, selection scores, top-n
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, h, kv_heads, d, lengths", CASES)
def test_compressed_attention_and_scores_match_ref(n, h, kv_heads, d, lengths, dtype, nan_empty):
    case = Case(n, h, kv_heads, d, lengths, dtype)
    out, lse, logits = nsa.nsa_compressed_attention(case.q, case.ck, case.cv, case.lengths)
    ref_out, probs = nsa_ref.nsa_compressed_attention_ref(case.q, case.ck, case.cv, case.lengths)
    assert rel_err(out, ref_out) < TOL[dtype]
    n_cmp = nsa.compressed_count(case.lengths)
    for i in range(n):  # probabilities exp(logit - lse) over the valid compressed blocks
        if n_cmp[i] == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i])), "no compressed block: zero output"
            continue
        p = torch.exp(logits[i, :, :n_cmp[i]] - lse[i, :, None])
        assert rel_err(p, probs[i].reshape(h, -1)[:, :n_cmp[i]]) < TOL[dtype]

    blocks, scores = nsa.nsa_select(logits, lse, case.lengths, kv_heads, case.n_units, N_SEL)
    ref_scores = nsa_ref.nsa_selection_scores_ref(probs, case.n_units)
    assert rel_err(scores, ref_scores) < SCORE_TOL[dtype]
    assert torch.equal(blocks, nsa_ref.nsa_topn_ref(scores, case.lengths, N_SEL))


def test_selection_scores_ref_is_stride_overlap():
    """score[j] = sum_i p[i] * (16-token strides shared by compressed block i and selection block j)."""
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(2, 3, 2, 29, generator=gen)  # [N, KV, G, C]
    n_blocks = 9
    p_cmp = probs.sum(2)
    expected = torch.zeros(2, 3, n_blocks)
    for j in range(n_blocks):
        for i in range(29):
            shared = len({i, i + 1} & set(range(4 * j, 4 * j + 4)))
            expected[..., j] += shared * p_cmp[..., i]
    assert rel_err(nsa_ref.nsa_selection_scores_ref(probs, n_blocks), expected) < 1e-6


def test_topn_ref_forced_blocks_and_ties():
    scores = torch.tensor([[[0.5, 0.1, 0.3, 0.3, 0.9, 0.2, 0.0, 0.0]], [[0.0] * 8]])
    lengths = torch.tensor([8 * 64 - 10, 100])
    blocks = nsa_ref.nsa_topn_ref(scores, lengths, 5)
    assert blocks.tolist() == [[[0, 6, 7, 4, 2]], [[0, 1, -1, -1, -1]]]


@pytest.mark.parametrize("length", [1000, 700], ids=["L1000", "L700"])
def test_select_uniform_logits_ties_go_to_lower_blocks(length, nan_empty):
    """Equal logits make all interior blocks tie: forced blocks, then interior blocks by index."""
    n_cmp = (length - 32) // 16 + 1
    n_blk = -(-length // 64)
    logits = torch.zeros(1, 4, n_cmp)
    lse = torch.full((1, 4), float(torch.log(torch.tensor(float(n_cmp)))))
    lengths = torch.tensor([length], dtype=torch.int32)
    blocks, scores = nsa.nsa_select(logits, lse, lengths, 2, n_blk + 2, 8)
    assert torch.equal(blocks, nsa_ref.nsa_topn_ref(scores, lengths, 8))
    assert blocks[0, 0].tolist() == [0, n_blk - 2, n_blk - 1, 1, 2, 3, 4, 5]
    assert (scores[0, :, n_blk:] == 0).all()


# ---------------------------------------------------------------------------------------------
# Selected and window branches, gates
# ---------------------------------------------------------------------------------------------

def random_blocks(case, n_sel, gen):
    """Distinct valid blocks per (request, KV head) in random order, some -1; -> blocks, rows."""
    n_blk = nsa.block_count(case.lengths).tolist()
    blocks = torch.full((case.n, case.kv_heads, n_sel), -1, dtype=torch.int32)
    for i in range(case.n):
        for kvh in range(case.kv_heads):
            pick = torch.randperm(n_blk[i], generator=gen)[:n_sel]
            blocks[i, kvh, :len(pick)] = pick.to(torch.int32)
    blocks[0, 0, 1] = -1
    return blocks, nsa.resident_rows(blocks, case.n_units)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, h, kv_heads, d, lengths", CASES)
def test_selected_attention_matches_ref_and_plain(n, h, kv_heads, d, lengths, dtype, nan_empty):
    case = Case(n, h, kv_heads, d, lengths, dtype)
    blocks, rows = random_blocks(case, N_SEL, torch.Generator().manual_seed(4))
    out = nsa.nsa_selected_attention(case.q, case.pool, rows, blocks, case.lengths)
    assert rel_err(out, nsa_ref.nsa_selected_attention_ref(case.q, case.pool, rows, blocks, case.lengths)) < TOL[dtype]
    assert rel_err(out, plain_selected(case, blocks)) < TOL[dtype]
    flat = nsa.nsa_selected_attention(case.q, case.pool.view(case.pool.shape[0], -1), rows, blocks, case.lengths)
    assert torch.equal(out, flat)


# each case in one dtype: the three ways of addressing the rows (hot cache, resident rows, direct) read
# the same rows in the same order whatever their dtype, and each case's arithmetic in both dtypes is
# test_selected_attention_matches_ref_and_plain's and test_decode_matches_ref's
@pytest.mark.parametrize("n, h, kv_heads, d, lengths, dtype", [
    pytest.param(*CASES[0].values, torch.float32, id=f"{CASES[0].id}-fp32"),
    pytest.param(*CASES[1].values, torch.float16, id=f"{CASES[1].id}-fp16")])
def test_hot_cache_and_resident_are_bitwise_equal(n, h, kv_heads, d, lengths, dtype):
    case = Case(n, h, kv_heads, d, lengths, dtype)
    gen = torch.Generator().manual_seed(5)
    blocks, rows = random_blocks(case, N_SEL, gen)
    cache, where = shuffled_cache(case.pool, gen)
    resident = nsa.nsa_selected_attention(case.q, case.pool, rows, blocks, case.lengths)
    hot = nsa.nsa_selected_attention(case.q, cache, to_cache_rows(rows, where), blocks, case.lengths)
    assert torch.equal(resident, hot)

    direct = nsa.nsa_selected_attention(case.q, case.pool, None, blocks, case.lengths, n_units=case.n_units)
    assert torch.equal(resident, direct)

    args = (case.q, case.ck, case.cv)
    win = (case.win_k, case.win_v, case.lengths, case.gates, case.n_units)
    out_dir, blk_dir = nsa.nsa_decode(*args, case.pool, *win, None, N_SEL)
    out_res, blk_res = nsa.nsa_decode(*args, case.pool, *win, lambda b: nsa.resident_rows(b, case.n_units), N_SEL)
    out_hot, blk_hot = nsa.nsa_decode(*args, cache, *win,
                                      lambda b: to_cache_rows(nsa.resident_rows(b, case.n_units), where), N_SEL)
    assert torch.equal(blk_res, blk_hot) and torch.equal(blk_res, blk_dir)
    assert torch.equal(out_res, out_hot) and torch.equal(out_res, out_dir)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [96, 128], ids=["W96", "W128"])
def test_window_attention_matches_ref_and_plain(window, dtype, nan_empty):
    case = Case(3, 6, 2, 27, [61, 301, 5], dtype, window=window, seed=6)
    out = nsa.nsa_window_attention(case.q, case.win_k, case.win_v, case.lengths)
    assert rel_err(out, nsa_ref.nsa_window_attention_ref(case.q, case.win_k, case.win_v, case.lengths)) < TOL[dtype]
    plain = torch.zeros(3, 6, 27, dtype=torch.float64)
    for i, length in enumerate(case.lengths.tolist()):
        tok = torch.arange(max(0, length - window), length)
        for hq in range(6):
            plain[i, hq] = plain_attention(case.q[i, hq], case.k_win[i, hq // 3, tok], case.v_win[i, hq // 3, tok])
    assert rel_err(out, plain) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_matches_ref(dtype, nan_empty):
    gen = torch.Generator().manual_seed(7)
    o = [torch.randn(3, 5, 27, generator=gen) for _ in range(3)]
    gates = torch.rand(3, 5, 3, generator=gen).to(dtype)
    out = nsa.nsa_gate(gates, *o, dtype)
    assert out.dtype == dtype
    assert rel_err(out, nsa_ref.nsa_gate_ref(gates, *o)) < TOL[dtype]


# ---------------------------------------------------------------------------------------------
# The whole decode step
# ---------------------------------------------------------------------------------------------

def check_decode(case, n_sel):
    """nsa_decode vs the reference pipeline, branch by branch on the kernel's own selection."""
    out, blocks = nsa.nsa_decode(case.q, case.ck, case.cv, case.pool, case.win_k, case.win_v,
                                 case.lengths, case.gates, case.n_units, n_select=n_sel)
    o_cmp, probs = nsa_ref.nsa_compressed_attention_ref(case.q, case.ck, case.cv, case.lengths)
    ref_scores = nsa_ref.nsa_selection_scores_ref(probs, case.n_units)
    _, lse, logits = nsa.nsa_compressed_attention(case.q, case.ck, case.cv, case.lengths)
    _, scores = nsa.nsa_select(logits, lse, case.lengths, case.kv_heads, case.n_units, n_sel)
    assert rel_err(scores, ref_scores) < SCORE_TOL[case.dtype]
    assert torch.equal(blocks, nsa_ref.nsa_topn_ref(scores, case.lengths, n_sel))
    rows = nsa.resident_rows(blocks, case.n_units)
    o_slc = nsa_ref.nsa_selected_attention_ref(case.q, case.pool, rows, blocks, case.lengths)
    o_win = nsa_ref.nsa_window_attention_ref(case.q, case.win_k, case.win_v, case.lengths)
    ref = nsa_ref.nsa_gate_ref(case.gates, o_cmp, o_slc, o_win)
    assert out.dtype == case.dtype
    assert rel_err(out, ref) < TOL[case.dtype]
    return out, blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, h, kv_heads, d, lengths", CASES)
def test_decode_matches_ref(n, h, kv_heads, d, lengths, dtype, nan_empty):
    case = Case(n, h, kv_heads, d, lengths, dtype, seed=8, weights=True)
    out, blocks = check_decode(case, N_SEL)
    ref_out, ref_blocks = nsa_ref.nsa_decode_ref(case.q, case.ck, case.cv, case.pool, case.win_k, case.win_v,
                                             case.lengths, case.gates, case.n_units, N_SEL)
    assert torch.equal(blocks, ref_blocks)
    assert rel_err(out, ref_out) < TOL[dtype]


def test_decode_with_a_given_selection(nan_empty):
    """blocks= (a layer sharing another's selection): its own blocks given back give the same bits;
    other blocks are attended over instead (the reference's output on them); a bad one is refused."""
    case = Case(2, 4, 2, 16, [700, 333], torch.float32, seed=10, weights=True)
    args = (case.q, case.ck, case.cv, case.pool, case.win_k, case.win_v, case.lengths, case.gates, case.n_units)
    out, blocks = nsa.nsa_decode(*args, n_select=N_SEL)
    again, same = nsa.nsa_decode(*args, n_select=N_SEL, blocks=blocks)
    assert torch.equal(again, out) and same is blocks
    other = blocks.flip(0).contiguous()          # request 1's selection for request 0 and back, kept in range
    other = torch.where(other < nsa.block_count(case.lengths)[:, None, None].int(), other, -1).int()
    got, _ = nsa.nsa_decode(*args, n_select=N_SEL, blocks=other)
    o_cmp, _ = nsa_ref.nsa_compressed_attention_ref(case.q, case.ck, case.cv, case.lengths)
    o_slc = nsa_ref.nsa_selected_attention_ref(case.q, case.pool, nsa.resident_rows(other, case.n_units), other,
                                           case.lengths)
    o_win = nsa_ref.nsa_window_attention_ref(case.q, case.win_k, case.win_v, case.lengths)
    assert rel_err(got, nsa_ref.nsa_gate_ref(case.gates, o_cmp, o_slc, o_win)) < TOL[torch.float32]
    assert not torch.equal(got, out)
    with pytest.raises(ValueError, match=r"blocks: got torch.int64 \(2, 2, 5\), expected int32 \(2, 2, 5\)"):
        nsa.nsa_decode(*args, n_select=N_SEL, blocks=blocks.long())


def test_decode_default_n_select(nan_empty):
    case = Case(2, 4, 2, 16, [1203, 1090], torch.float32, window=nsa.WINDOW, seed=9)
    _, blocks = check_decode(case, nsa.N_SELECT)
    assert blocks.shape == (2, 2, nsa.N_SELECT) and (blocks >= 0).all()
    assert blocks[0, :, :3].tolist() == [[0, 17, 18]] * 2


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------

def test_launchers_reject_bad_inputs():
    case = Case(2, 4, 2, 16, [100, 70], torch.float32, window=64)
    blocks, rows = random_blocks(case, 3, torch.Generator().manual_seed(10))
    with pytest.raises(ValueError, match="rows.dtype"):
        nsa.nsa_selected_attention(case.q, case.pool, rows.long(), blocks, case.lengths)
    with pytest.raises(ValueError, match="blocks.shape"):
        nsa.nsa_selected_attention(case.q, case.pool, rows, blocks[:, :, :2].contiguous(), case.lengths)
    with pytest.raises(ValueError, match="kv_rows.dtype"):
        nsa.nsa_selected_attention(case.q, case.pool.half(), rows, blocks, case.lengths)
    with pytest.raises(ValueError, match="q.shape"):
        nsa.nsa_window_attention(case.q[0], case.win_k, case.win_v, case.lengths)
    with pytest.raises(ValueError, match="query heads"):
        nsa.nsa_window_attention(case.q[:, :3], case.win_k, case.win_v, case.lengths)
    with pytest.raises(ValueError, match="lengths.shape"):
        nsa.nsa_compressed_attention(case.q, case.ck, case.cv, case.lengths[:1])
    with pytest.raises(ValueError, match="cv.shape"):
        nsa.nsa_compressed_attention(case.q, case.ck, case.cv[:, :, :1].contiguous(), case.lengths)
    with pytest.raises(ValueError, match="n_select"):
        nsa.nsa_select(torch.zeros(2, 4, 5), torch.zeros(2, 4), case.lengths, 2, 2, 2)
    with pytest.raises(ValueError, match="gates.shape"):
        o = torch.zeros(2, 4, 16)
        nsa.nsa_gate(case.gates[..., :2], o, o, o, torch.float32)
    with pytest.raises(ValueError, match="weights"):
        nsa.nsa_compress(case.k_cmp, case.v_cmp, torch.eye(16), None)
    with pytest.raises(ValueError, match="window"):
        nsa.nsa_compress_newest(case.win_k[:, :, :16], case.win_v[:, :, :16], case.lengths, case.ck, case.cv)


# ---------------------------------------------------------------------------------------------
# Compiled mode without a GPU: every kernel variant compiles for sm_90 (the interpreter runs none)
# ---------------------------------------------------------------------------------------------

SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels_triton import nsa as K

def compile_sm90(fn, types, consts, **options):
    signature = {name: types.get(name, "i32") for name in fn.arg_names}
    signature.update({name: "constexpr" for name in consts})
    source = ASTSource(fn=fn, signature=signature, constexprs=consts)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)

bf16 = {name: "*bf16" for name in ("q", "k", "v", "wk", "wv", "ck", "cv", "gates", "out")}
fp32 = {name: "*fp32" for name in ("part", "logits", "lse", "scores", "o_cmp", "slc", "win")}
ints = {name: "*i32" for name in ("rows", "blocks", "lengths")}
types = {**bf16, **fp32, **ints, "scale": "fp32"}
for gather, resident, store in ((False, False, True), (True, True, False), (True, False, False)):
    compile_sm90(K._nsa_attention_partial_kernel, types, dict(
        T=64, BLOCK_G=16, BLOCK_D=128, GATHER=gather, RESIDENT=resident, VALID_KIND=0, CMP_BLOCK=32,
        CMP_STRIDE=16, STORE_LOGITS=store, DOT_PRECISION="tf32"), num_warps=4, num_stages=2)
compile_sm90(K._nsa_merge_kernel, types, dict(BLOCK_S=128, BLOCK_D=128), num_warps=8)
compile_sm90(K._nsa_select_kernel, types, dict(CMP_BLOCK=32, CMP_STRIDE=16, SEL_BLOCK=64, N_SELECT=16,
                                               BLOCK_NB=2048), num_warps=8)
compile_sm90(K._nsa_gate_kernel, types, dict(BLOCK_S_SLC=4, BLOCK_S_WIN=2, BLOCK_D=128), num_warps=1)
compile_sm90(K._nsa_compress_kernel, types, dict(CMP_BLOCK=32, CMP_STRIDE=16, BLOCK_C=16, BLOCK_D=128,
                                                 HAS_WEIGHT=True, RING=True, DOT_PRECISION="ieee"), num_warps=8)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the GPU tests compile and run the kernels")
def test_kernels_compile_for_sm90():
    """The interpreter never compiles: build each kernel variant for Hopper in a process without it
    (TRITON_INTERPRET=0: else kernels_triton chooses the interpreter where no GPU is visible)."""
    env = os.environ | {"TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", SM90_COMPILE], cwd=Path(__file__).resolve().parent.parent,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


# ---------------------------------------------------------------------------------------------
# GPU: bf16 at real shapes
# ---------------------------------------------------------------------------------------------

GPU_LENGTHS = [8192, 5000, 16385, 777, 64, 12000]


@pytest.mark.gpu
def test_gpu_decode_bf16_real_shapes():
    case = Case(6, 32, 8, 128, GPU_LENGTHS, torch.bfloat16, device="cuda", window=nsa.WINDOW, seed=11, weights=True)
    ck, cv = nsa.nsa_compress(case.k_cmp, case.v_cmp, case.weight_k, case.weight_v)
    assert rel_err(ck, case.ck) < TOL[torch.bfloat16] and rel_err(cv, case.cv) < TOL[torch.bfloat16]
    check_decode(case, nsa.N_SELECT)


@pytest.mark.gpu
def test_gpu_hot_cache_and_resident_are_bitwise_equal():
    case = Case(6, 32, 8, 128, GPU_LENGTHS, torch.bfloat16, device="cuda", window=nsa.WINDOW, seed=12)
    gen = torch.Generator(device="cuda").manual_seed(13)
    cache, where = shuffled_cache(case.pool, gen, extra=1000)
    rows_hot = lambda b: to_cache_rows(nsa.resident_rows(b, case.n_units), where)  # noqa: E731
    args = (case.q, case.ck, case.cv)
    win = (case.win_k, case.win_v, case.lengths, case.gates, case.n_units)
    out_res, blk_res = nsa.nsa_decode(*args, case.pool, *win)
    out_hot, blk_hot = nsa.nsa_decode(*args, cache, *win, rows_hot)
    assert torch.equal(blk_res, blk_hot) and torch.equal(out_res, out_hot)


@pytest.mark.gpu
def test_gpu_rows_beyond_int32_offsets():
    """Rows past 2**31 elements of the pool (64-bit addressing): 140000 rows of 16384 bf16."""
    n, h, kvh, d = 2, 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(14)
    pool = torch.zeros(140_000, 2, nsa.SEL_BLOCK, d, dtype=torch.bfloat16, device="cuda")
    assert pool.numel() > 2 ** 31
    rows = (pool.shape[0] - 1 - torch.arange(n * kvh * 4, device="cuda")).view(n, kvh, 4).to(torch.int32)
    pool[rows.flatten().long()] = torch.randn(rows.numel(), 2, nsa.SEL_BLOCK, d, generator=gen,
                                              device="cuda").to(torch.bfloat16)
    blocks = torch.arange(4, device="cuda", dtype=torch.int32).expand(n, kvh, 4).contiguous()
    q = torch.randn(n, h, d, generator=gen, device="cuda").to(torch.bfloat16)
    lengths = torch.tensor([256, 200], dtype=torch.int32, device="cuda")
    out = nsa.nsa_selected_attention(q, pool, rows, blocks, lengths)
    ref = nsa_ref.nsa_selected_attention_ref(q, pool, rows, blocks, lengths)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_compress_newest_bf16():
    """Three decode steps at real shapes: blocks completed from the ring equal full compression."""
    case = Case(4, 32, 8, 128, [4096, 4096, 4096, 4096], torch.bfloat16, device="cuda", window=nsa.WINDOW, seed=16)
    full_k, full_v = nsa.nsa_compress(case.k_cmp, case.v_cmp)
    ck, cv = torch.full_like(full_k, float("nan")), torch.full_like(full_v, float("nan"))
    for step in (4080, 4081, 4096):  # 4080 and 4096 complete blocks 253 and 254; 4081 none
        lengths = torch.full((4,), step, dtype=torch.int32, device="cuda")
        win_k, win_v = nsa.nsa_window_ring(case.k_cmp, case.v_cmp, lengths, nsa.WINDOW)
        nsa.nsa_compress_newest(win_k, win_v, lengths, ck, cv)
    assert torch.equal(ck[:, :, 253:255], full_k[:, :, 253:255])
    assert torch.equal(cv[:, :, 253:255], full_v[:, :, 253:255])
    assert torch.isnan(ck[:, :, :253]).all() and torch.isnan(ck[:, :, 255:]).all()


# ----------------------------------------------------------------------------- prefill

def prefill_case(b, s, h, kv_heads, d, start, n, block, dtype, seed=0, device="cpu"):
    """Random prefill inputs: q [B, S, H, D] at positions start .., dense keys, values [B, KV, T, D]
    (T a little past the chunk), and per query n distinct blocks it may read (-1 pads the rest)."""
    gen = torch.Generator().manual_seed(seed)
    t = start + s + 5
    q, k, v = (torch.randn(*shape, generator=gen).to(dtype).to(device)
               for shape in ((b, s, h, d), (b, kv_heads, t, d), (b, kv_heads, t, d)))
    own = -(-(torch.arange(start, start + s) + 1) // block)  # [S] blocks each query has
    scores = torch.rand(b, kv_heads, s, -(-t // block), generator=gen)
    scores = scores.masked_fill(torch.arange(scores.shape[-1]) >= own[:, None], -1.0)
    blocks = scores.topk(min(n, scores.shape[-1]), dim=-1).indices
    blocks = torch.where(scores.gather(-1, blocks) >= 0, blocks, -1)
    blocks = torch.nn.functional.pad(blocks, (0, n - blocks.shape[-1]), value=-1)
    blocks[0, 0, 0] = -1                                     # a query with nothing selected gives zeros
    return q, k, v, blocks.to(device)


@pytest.mark.parametrize("per_program", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,s,h,kv_heads,d,start,n,block", [
    (2, 13, 4, 2, 16, 40, 3, 16), (1, 27, 6, 3, 24, 0, 2, 16), (1, 9, 2, 1, 32, 61, 4, 64)],
    ids=["B2-S13-start40", "B1-S27-G2-start0", "B1-S9-block64"])
def test_prefill_selected_matches_reference(per_program, dtype, b, s, h, kv_heads, d, start, n, block):
    """Partial newest blocks (causality as each query's length), -1 pads, queries of one tile
    reading different blocks; every tile size the same within the dtype's tolerance."""
    q, k, v, blocks = prefill_case(b, s, h, kv_heads, d, start, n, block, dtype)
    got = nsa.nsa_prefill_selected(q, k, v, blocks, start, block, queries_per_program=per_program)
    want = nsa_ref.nsa_prefill_selected_ref(q, k, v, blocks, start, block)
    assert got.dtype == torch.float32 and rel_err(got, want) < TOL[dtype]
    assert (got[0, 0, :h // kv_heads] == 0).all()


@pytest.mark.parametrize("window,start,s", [(7, 30, 19), (64, 0, 27), (5, 3, 2)])
def test_prefill_window_matches_reference(window, start, s):
    q, k, v, _ = prefill_case(2, s, 4, 2, 16, start, 1, 16, torch.float32, seed=window)
    got = nsa.nsa_prefill_window(q, k, v, start, window)
    assert rel_err(got, nsa_ref.nsa_prefill_window_ref(q, k, v, start, window)) < TOL[torch.float32]


def test_prefill_launchers_refuse_bad_inputs_before_launching():
    q, k, v, blocks = prefill_case(1, 5, 4, 2, 16, 3, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="block_size: got 24, expected a power of two >= 16"):
        nsa.nsa_prefill_selected(q, k, v, blocks, 3, 24)
    with pytest.raises(ValueError, match="start: got 9"):
        nsa.nsa_prefill_selected(q, k, v, blocks, 9, 16)
    with pytest.raises(ValueError, match="blocks.shape"):
        nsa.nsa_prefill_selected(q, k, v, blocks[:, :1], 3, 16)
    with pytest.raises(ValueError, match="keys layout"):
        nsa.nsa_prefill_selected(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, blocks, 3, 16)
    with pytest.raises(ValueError, match="values.dtype"):
        nsa.nsa_prefill_window(q, k, v.half(), 3, 8)
    with pytest.raises(ValueError, match="window: got 0"):
        nsa.nsa_prefill_window(q, k, v, 3, 0)


@pytest.mark.gpu
def test_gpu_prefill_selected_bf16_real_shapes():
    """bf16 at 64 query and 4 KV heads of 128, 16 blocks of 64 per query, 2048 queries at 6000."""
    q, k, v, blocks = prefill_case(1, 2048, 64, 4, 128, 6000, 16, 64, torch.bfloat16, device="cuda")
    got = nsa.nsa_prefill_selected(q, k, v, blocks, 6000, 64)
    want = nsa_ref.nsa_prefill_selected_ref(q, k, v, blocks, 6000, 64)
    assert rel_err(got, want) < TOL[torch.bfloat16]

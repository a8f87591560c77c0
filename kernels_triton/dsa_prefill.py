"""DSA prefill kernels: the lightning indexer's scores of a chunk of queries, and the ordering of
each query's top-k picks.

Launchers and input checks live in `hisparse/dsa/ops.py` (`prefill_indexer_scores`, `dsa_prefill_select`);
the torch reference is `hisparse.dsa.reference.indexer_scores_ref` with causality as lengths.
"""
import triton
import triton.language as tl


@triton.jit
def _query_tile_scores(b_q, b_w, b_k, DOT_PRECISION: tl.constexpr):
    """sum_h w[h] * ReLU(q[h] . k[t]) of one query over one key tile: b_q [BLOCK_H, D], b_w [BLOCK_H]
    float32, b_k [BLOCK_T, D] -> [BLOCK_T] float32. The same operations, on the same tile shapes, as
    `kernels_triton.dsa._indexer_scores_kernel`: with its BLOCK_T and warps the scores are its bits."""
    b_dot = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_T]
    return tl.sum(tl.maximum(b_dot, 0.0) * b_w[:, None], axis=0)


@triton.jit
def _store_query_scores(p_row, b_q, b_w, b_k, o_t, T, s, S, START, DOT_PRECISION: tl.constexpr):
    """Query s's scores over one key tile into its row: -inf at t >= START + s + 1, nothing if s >= S."""
    b_score = _query_tile_scores(b_q, b_w, b_k, DOT_PRECISION)
    b_score = tl.where(o_t < START + s + 1, b_score, float("-inf"))
    tl.store(p_row + o_t, b_score, mask=(o_t < T) & ((s + 0 * o_t) < S))


@triton.jit
def _load_query(q_ptr, w_ptr, s, S, stride_qs, stride_qh, stride_ws, stride_wh, o_h, o_d, m_h):
    """Query s's indexer heads [BLOCK_H, D] and weights [BLOCK_H] float32 (zeros past H or S)."""
    m_q = m_h & ((s + 0 * o_h) < S)                                  # [BLOCK_H]
    p_q = q_ptr + s.to(tl.int64) * stride_qs + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_q[:, None], other=0.0)
    b_w = tl.load(w_ptr + s.to(tl.int64) * stride_ws + o_h * stride_wh, mask=m_q, other=0.0)
    return b_q, b_w.to(tl.float32)


# the integer arguments that change from row block to row block are not specialised on (divisibility
# by 16), so that a prefill compiles its kernels once, not again in the middle of a prompt
@triton.jit(do_not_specialize=["S", "START", "TILES_PER_SPLIT"])
def _prefill_indexer_kernel(
    q_ptr, w_ptr, k_ptr, out_ptr,
    stride_qs, stride_qh, stride_ws, stride_wh, stride_kt, stride_os,
    S, T, START, TILES_PER_SPLIT,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
    QUERIES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """scores[s, t] = sum_h w[s, h] * ReLU(q[s, h] . k[t]) for t < START + s + 1 (query s's causal
    length), else -inf; q [S, H, D], w [S, H], k [T, D], scores [S, T] float32.

    Program (query block, split) keeps QUERIES consecutive queries resident (1, 2 or 4: one q tile
    each, so that each dot is the decode kernel's [BLOCK_H, D] x [D, BLOCK_T]) and loops over the
    key tiles of its split, TILES_PER_SPLIT * BLOCK_T keys from split * that: each tile is loaded
    once (pipelined by num_stages) and serves every query of the block. Tiles at or past the block's
    last causal length are not read: they store -inf.
    """
    i_q = tl.program_id(0)
    i_split = tl.program_id(1)
    s0 = i_q * QUERIES
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, D)
    o_k = tl.arange(0, BLOCK_T)
    m_h = o_h < H
    t_begin = i_split * TILES_PER_SPLIT * BLOCK_T
    t_end = tl.minimum(T, t_begin + TILES_PER_SPLIT * BLOCK_T)
    t_causal = tl.minimum(t_end, START + tl.minimum(s0 + QUERIES, S))   # the block's longest length
    p_out = out_ptr + s0.to(tl.int64) * stride_os

    b_q0, b_w0 = _load_query(q_ptr, w_ptr, s0, S, stride_qs, stride_qh, stride_ws, stride_wh, o_h, o_d, m_h)
    if QUERIES > 1:
        b_q1, b_w1 = _load_query(q_ptr, w_ptr, s0 + 1, S, stride_qs, stride_qh, stride_ws, stride_wh, o_h, o_d, m_h)
    if QUERIES > 2:
        b_q2, b_w2 = _load_query(q_ptr, w_ptr, s0 + 2, S, stride_qs, stride_qh, stride_ws, stride_wh, o_h, o_d, m_h)
        b_q3, b_w3 = _load_query(q_ptr, w_ptr, s0 + 3, S, stride_qs, stride_qh, stride_ws, stride_wh, o_h, o_d, m_h)
    for t0 in range(t_begin, t_causal, BLOCK_T):
        o_t = t0 + o_k
        b_k = tl.load(k_ptr + o_t[:, None].to(tl.int64) * stride_kt + o_d[None, :],
                      mask=(o_t < t_causal)[:, None], other=0.0).to(b_q0.dtype)      # [BLOCK_T, D]
        _store_query_scores(p_out, b_q0, b_w0, b_k, o_t, T, s0, S, START, DOT_PRECISION)
        if QUERIES > 1:
            _store_query_scores(p_out + stride_os, b_q1, b_w1, b_k, o_t, T, s0 + 1, S, START, DOT_PRECISION)
        if QUERIES > 2:
            _store_query_scores(p_out + 2 * stride_os, b_q2, b_w2, b_k, o_t, T, s0 + 2, S, START, DOT_PRECISION)
            _store_query_scores(p_out + 3 * stride_os, b_q3, b_w3, b_k, o_t, T, s0 + 3, S, START, DOT_PRECISION)

    # the split's tiles past the block's longest length: -inf without reading keys
    t_tail = t_begin + tl.cdiv(tl.maximum(t_causal - t_begin, 0), BLOCK_T) * BLOCK_T
    o_j = tl.arange(0, QUERIES)
    b_inf = tl.full([QUERIES, BLOCK_T], float("-inf"), dtype=tl.float32)
    p_rows = p_out + o_j[:, None].to(tl.int64) * stride_os
    for t0 in range(t_tail, t_end, BLOCK_T):
        o_t = t0 + o_k
        tl.store(p_rows + o_t[None, :], b_inf, mask=((s0 + o_j) < S)[:, None] & (o_t < t_end)[None, :])


@triton.jit(do_not_specialize=["K_PICKED"])
def _order_picks_kernel(
    val_ptr, id_ptr, len_ptr, sel_ptr, last_ptr, ties_ptr,
    stride_vn, stride_in, stride_sn,
    K_PICKED, K,
    BLOCK_K: tl.constexpr,
):
    """One row's K_PICKED top-k picks (values float32, token ids int64, in any order) into its
    selection sel[n, :K] int32, best first, equal scores to the lower id, ids >= lengths[n] and the
    places past K_PICKED as -1; and, for the tie check, the lowest picked value last[n] and how
    many picks equal it, ties[n].

    The order is one sort of unique int64 keys, as `hisparse.dsa.ops.topk_select` builds them: the
    high 32 bits the score's float order (-0.0 folded into +0.0), the low 32 bits 2^32 - 1 - id.
    """
    i_n = tl.program_id(0).to(tl.int64)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K_PICKED
    b_val = tl.load(val_ptr + i_n * stride_vn + o_k, mask=m_k, other=0.0)
    b_id = tl.load(id_ptr + i_n * stride_in + o_k, mask=m_k, other=0)
    b_last = tl.min(tl.where(m_k, b_val, float("inf")), axis=0)
    tl.store(last_ptr + i_n, b_last)
    tl.store(ties_ptr + i_n, tl.sum((m_k & (b_val == b_last)).to(tl.int32), axis=0))
    b_val = tl.where(b_val == 0.0, 0.0, b_val)                       # -0.0 ranks as +0.0
    b_bits = b_val.to(tl.int32, bitcast=True)
    b_bits = b_bits ^ ((b_bits >> 31) & 0x7FFFFFFF)                  # signed int order of the float order
    b_bits = tl.where(m_k, b_bits, -2147483648)                      # padding sorts last
    b_key = (b_bits.to(tl.int64) << 32) | (0xFFFFFFFF - b_id)
    b_key = tl.sort(b_key, descending=True)
    b_sel = 0xFFFFFFFF - (b_key & 0xFFFFFFFF)
    length = tl.load(len_ptr + i_n).to(tl.int64)
    b_sel = tl.where(m_k & (b_sel < length), b_sel, -1)          # m_k: sorted, the picks come first
    tl.store(sel_ptr + i_n * stride_sn + o_k, b_sel.to(tl.int32), mask=o_k < K)


@triton.jit
def _count_equal_kernel(scores_ptr, last_ptr, count_ptr, stride_n, T, BLOCK_T: tl.constexpr):
    """count[n] = how many of row n's T scores equal last[n] (+0.0 == -0.0): one pass over the row."""
    i_n = tl.program_id(0).to(tl.int64)
    b_last = tl.load(last_ptr + i_n)
    b_count = tl.zeros([BLOCK_T], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        o_t = t0 + tl.arange(0, BLOCK_T)
        b_s = tl.load(scores_ptr + i_n * stride_n + o_t, mask=o_t < T, other=float("nan"))
        b_count += (b_s == b_last).to(tl.int32)
    tl.store(count_ptr + i_n, tl.sum(b_count, axis=0))

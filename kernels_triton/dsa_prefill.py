"""DSA prefill kernels: the lightning indexer's scores of a chunk of queries, and the ordering of
each query's top-k picks.

Launchers and input checks live in `hisparse/dsa/ops.py` (`prefill_indexer_scores`, `dsa_prefill_select`);
the torch reference is `hisparse.dsa.reference.indexer_scores_ref` with causality as lengths.
"""
import triton
import triton.language as tl


# the integer arguments that change from row block to row block are not specialised on (divisibility
# by 16), so that a prefill compiles its kernels once, not again in the middle of a prompt
@triton.jit(do_not_specialize=["S", "START", "TILES_PER_SPLIT"])
def _prefill_indexer_kernel(
    q_ptr, w_ptr, k_ptr, ks_ptr, out_ptr,
    stride_qs, stride_qh, stride_ws, stride_wh, stride_kt, stride_ks, stride_os,
    S, T, START, TILES_PER_SPLIT,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
    QUERIES: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SCALE: tl.constexpr, FP8_Q: tl.constexpr,
    FP8_DOT: tl.constexpr,
):
    """scores[s, t] = scale(t) * sum_h w[s, h] * ReLU(q[s, h] . k[t]) for t < START + s + 1 (query
    s's causal length), else -inf; q [S, H, D], w [S, H], k [T, D], scale [T] float32 (HAS_SCALE,
    else 1), scores [S, T] float32. FP8_Q and FP8_DOT as in `_indexer_scores_kernel`: e4m3 q and
    keys, multiplied as e4m3 on the tensor cores or upcast to float16 first.

    Program (query block, split) keeps QUERIES consecutive queries resident and loops over the key
    tiles of its split, TILES_PER_SPLIT * BLOCK_T keys from split * that; tiles at or past the
    block's last causal length are not read: they store -inf. Keys are the MMA's rows: one
    [BLOCK_T, D] x [D, QUERIES * BLOCK_H] product a tile (column n is head n % BLOCK_H of query
    s0 + n // BLOCK_H), then each query's BLOCK_H columns summed, within a thread and the 4 lanes of
    its quad. The heads-as-rows product the decode kernel makes ([BLOCK_H, D] x [D, BLOCK_T]) sums
    over the MMA's M axis, spread over the warps: a reduction through shared memory with barriers
    every tile, slower here (results/notes/prefill.md). The heads are summed in
    another order than the decode kernel's, so the scores equal its within float32 rounding, not
    bit for bit.
    """
    i_q = tl.program_id(0)
    i_split = tl.program_id(1)
    s0 = i_q * QUERIES
    o_d = tl.arange(0, D)
    o_k = tl.arange(0, BLOCK_T)
    o_j = tl.arange(0, QUERIES)
    t_begin = i_split * TILES_PER_SPLIT * BLOCK_T
    t_end = tl.minimum(T, t_begin + TILES_PER_SPLIT * BLOCK_T)
    t_causal = tl.minimum(t_end, START + tl.minimum(s0 + QUERIES, S))   # the block's longest length
    p_rows = out_ptr + (s0 + o_j).to(tl.int64) * stride_os                # [QUERIES]
    m_rows = (s0 + o_j) < S                                               # [QUERIES]

    # the block's queries side by side as the product's columns
    o_n = tl.arange(0, QUERIES * BLOCK_H)
    o_nh = o_n % BLOCK_H
    s_n = s0 + o_n // BLOCK_H
    m_n = (o_nh < H) & (s_n < S)                                          # [QUERIES * BLOCK_H]
    p_q = q_ptr + s_n[:, None].to(tl.int64) * stride_qs + o_nh[:, None] * stride_qh + o_d[None, :]
    b_qt = tl.trans(tl.load(p_q, mask=m_n[:, None], other=0.0))          # [D, QUERIES * BLOCK_H]
    if FP8_Q and not FP8_DOT:
        b_qt = b_qt.to(tl.float16)                                        # exact: e4m3 values are float16s
    b_wn = tl.load(w_ptr + s_n.to(tl.int64) * stride_ws + o_nh * stride_wh, mask=m_n, other=0.0).to(tl.float32)
    for t0 in range(t_begin, t_causal, BLOCK_T):
        o_t = t0 + o_k
        b_k = tl.load(k_ptr + o_t[:, None].to(tl.int64) * stride_kt + o_d[None, :],
                      mask=(o_t < t_causal)[:, None], other=0.0).to(b_qt.dtype)      # [BLOCK_T, D]
        if FP8_Q:
            b_dot = tl.dot(b_k, b_qt)                                              # [BLOCK_T, QUERIES * BLOCK_H]
        else:
            b_dot = tl.dot(b_k, b_qt, input_precision=DOT_PRECISION)
        b_dot = tl.maximum(b_dot, 0.0) * b_wn[None, :]
        b_score = tl.sum(tl.reshape(b_dot, [BLOCK_T, QUERIES, BLOCK_H]), axis=2)   # [BLOCK_T, QUERIES]
        if HAS_SCALE:
            b_score *= tl.load(ks_ptr + o_t.to(tl.int64) * stride_ks, mask=o_t < t_causal, other=0.0)[:, None]
        b_score = tl.where(o_t[:, None] < START + s0 + o_j[None, :] + 1, b_score, float("-inf"))
        tl.store(p_rows[None, :] + o_t[:, None], b_score, mask=(o_t < T)[:, None] & m_rows[None, :])

    # the split's tiles past the block's longest length: -inf without reading keys
    t_tail = t_begin + tl.cdiv(tl.maximum(t_causal - t_begin, 0), BLOCK_T) * BLOCK_T
    b_inf = tl.full([QUERIES, BLOCK_T], float("-inf"), dtype=tl.float32)
    for t0 in range(t_tail, t_end, BLOCK_T):
        o_t = t0 + o_k
        tl.store(p_rows[:, None] + o_t[None, :], b_inf, mask=m_rows[:, None] & (o_t < t_end)[None, :])


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
    b_key = (b_bits.to(tl.int64) << 32) | (0xFFFFFFFF - b_id)
    b_key = tl.where(m_k, b_key, -2**63)            # padding sorts last, below a -NaN of bits 0xFFFFFFFF
    b_key = tl.sort(b_key, descending=True)
    b_sel = 0xFFFFFFFF - (b_key & 0xFFFFFFFF)
    length = tl.load(len_ptr + i_n).to(tl.int64)
    b_sel = tl.where(m_k & (b_sel < length), b_sel, -1)          # m_k: sorted, the picks come first
    tl.store(sel_ptr + i_n * stride_sn + o_k, b_sel.to(tl.int32), mask=o_k < K)


@triton.jit
def _place_ties_kernel(scores_ptr, last_ptr, ties_ptr, sel_ptr, stride_n, stride_sn, T, K_PICKED,
                       BLOCK_T: tl.constexpr):
    """The tail of row n's ordered picks, sel[n, K_PICKED - ties[n] : K_PICKED], rewritten as the
    ties[n] lowest token ids whose score equals the lowest pick last[n] (+0.0 == -0.0), in id order:
    torch.topk picks any of equal scores, the exact order (`topk_select`) the lowest ids. One pass
    over the row's T scores, no read back to the host; a row whose lowest pick is -inf (fewer valid
    tokens than picks) is left as it is."""
    i_n = tl.program_id(0).to(tl.int64)
    b_last = tl.load(last_ptr + i_n)
    ties = tl.load(ties_ptr + i_n)
    ties = tl.where(b_last > float("-inf"), ties, 0)               # -inf: every valid token is in
    base = K_PICKED - ties
    seen = tl.full((), 0, dtype=tl.int32)                           # equal scores before this block
    for t0 in range(0, T, BLOCK_T):
        o_t = t0 + tl.arange(0, BLOCK_T)
        b_s = tl.load(scores_ptr + i_n * stride_n + o_t, mask=o_t < T, other=float("nan"))
        b_eq = (b_s == b_last).to(tl.int32)
        b_rank = seen + tl.cumsum(b_eq, axis=0) - 1                 # among the row's equal scores
        tl.store(sel_ptr + i_n * stride_sn + base + b_rank, o_t.to(tl.int32), mask=(b_eq > 0) & (b_rank < ties))
        seen += tl.sum(b_eq, axis=0)

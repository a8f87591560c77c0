"""DSA (DeepSeek-V3.2 sparse attention) kernels: lightning-indexer scores and sparse MLA decode.

Launchers and input checks live in `hisparse/dsa/ops.py`, torch references in `hisparse/dsa/reference.py`.
"""
import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, ks_ptr, len_ptr, out_ptr,
    stride_qn, stride_qh, stride_wn, stride_wh, stride_kn, stride_kt, stride_sn, stride_st, stride_on,
    T,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_Q: tl.constexpr, FP8_DOT: tl.constexpr,
):
    """scores[n, t] = scale(n, t) * sum_h w[n, h] * ReLU(q[n, h] . k[n, t]) for t < lengths[n], else -inf.

    One program per (request, block of BLOCK_T tokens); blocks past the request's length store -inf
    without reading keys. FP8_Q: q and keys e4m3 (DeepSeek-V3.2's FP8 indexer; w carries q's
    scales; keys [N, T, D] in rows of D bytes, 16-byte vectors when stride_kt is a multiple of 16,
    HAS_SCALE's scales one float a key); FP8_DOT multiplies them as e4m3 on the tensor cores
    (sm_89+), else both are upcast to float16 first (exact: every e4m3 value is a float16) for a
    float16 product with float32 sums.
    """
    i_t = tl.program_id(0)  # token blocks on axis 0: it allows 2**31 - 1 programs, axis 1 only 65535
    i_n = tl.program_id(1).to(tl.int64)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    length = tl.minimum(tl.load(len_ptr + i_n).to(tl.int32), T)
    m_t = o_t < length
    b_score = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    if i_t * BLOCK_T < length:
        o_h = tl.arange(0, BLOCK_H)
        o_d = tl.arange(0, D)
        m_h = o_h < H
        p_q = q_ptr + i_n * stride_qn + o_h[:, None] * stride_qh + o_d[None, :]
        b_q = tl.load(p_q, mask=m_h[:, None], other=0.0)  # [BLOCK_H, D]
        p_k = k_ptr + i_n * stride_kn + o_t[:, None].to(tl.int64) * stride_kt + o_d[None, :]
        b_k = tl.load(p_k, mask=m_t[:, None], other=0.0)  # [BLOCK_T, D]
        if FP8_Q:
            if FP8_DOT:
                b_dot = tl.dot(b_q, tl.trans(b_k))  # [BLOCK_H, BLOCK_T], e4m3 products
            else:
                b_dot = tl.dot(b_q.to(tl.float16), tl.trans(b_k.to(tl.float16)))
        else:
            b_dot = tl.dot(b_q, tl.trans(b_k.to(b_q.dtype)), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_T]
        b_w = tl.load(w_ptr + i_n * stride_wn + o_h * stride_wh, mask=m_h, other=0.0).to(tl.float32)
        b_sum = tl.sum(tl.maximum(b_dot, 0.0) * b_w[:, None], axis=0)  # [BLOCK_T]
        if HAS_SCALE:
            b_sum *= tl.load(ks_ptr + i_n * stride_sn + o_t * stride_st, mask=m_t, other=0.0)
        b_score = tl.where(m_t, b_sum, b_score)
    tl.store(out_ptr + i_n * stride_on + o_t, b_score, mask=o_t < T)


@triton.jit
def _softmax_accumulate(b_s, b_v, b_m, b_l, b_acc, DOT_PRECISION: tl.constexpr):
    """One online-softmax step: logits b_s [BLOCK_H, BLOCK_K] (log2 domain, -inf where masked) and
    their value rows b_v [BLOCK_K, D_V] into the running max b_m, sum b_l [BLOCK_H] and b_acc."""
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no (-inf) - (-inf)
    b_alpha = tl.exp2(b_m - b_m_safe)
    b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BLOCK_H, BLOCK_K]
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc * b_alpha[:, None], input_precision=DOT_PRECISION)
    return b_m_new, b_l, b_acc


@triton.jit
def _sparse_mla_decode_kernel(
    q_ptr, kv_ptr, rows_ptr, row_base_ptr, out_ptr, lse_ptr,
    stride_qn, stride_qh, stride_kv, stride_rn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
    stride_ls,
    H, K_SEL, CHUNK, qk_scale_log2,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_ROW_BASE: tl.constexpr,
):
    """Absorbed-MLA attention of BLOCK_H query heads over one chunk of a request's selected rows.

    Program (head block, n, split) reads rows[n, split*CHUNK : (split+1)*CHUNK] in order, BLOCK_K at a
    time; a row is kv[row_base[n] + row, :D_V + D_ROPE] (row_base 0 without HAS_ROW_BASE), its first
    D_V values are V; row -1 is skipped. It stores the softmax-normalised output (zeros when no row is
    valid) and the natural-log sum-exp (-inf then) at split index `split` of out / lse: the final
    output when there is one split, else a float32 partial that `_sparse_mla_combine_kernel` merges.
    Each tile of rows is loaded once, by the pipeliner's asynchronous copies (num_stages >= 2), and
    serves both QK^T and then PV in the same iteration. With two warp groups on 64 heads both
    compute the whole QK^T: Triton gives a dot that feeds another (through P) the one-axis warp
    layout, and routing P through a scratch tile needs a barrier that stops the pipelining.
    kernels_triton/dsa_gluon.py writes the layouts out by hand so that QK^T is computed once, and
    `hisparse.dsa.ops.sparse_mla_decode` runs it on Hopper with Triton 3.6 (the faster there:
    results/attention.csv), this one elsewhere (other GPUs, other Tritons, the CPU interpreter).
    """
    i_hb = tl.program_id(0)  # fastest: the head blocks of a request run together and share rows in L2
    i_n = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_v = tl.arange(0, D_V)
    o_r = D_V + tl.arange(0, D_ROPE)
    o_k = tl.arange(0, BLOCK_K)
    p_q = q_ptr + i_n * stride_qn + o_h[:, None].to(tl.int64) * stride_qh
    b_q_nope = tl.load(p_q + o_v[None, :], mask=m_h[:, None], other=0.0)  # [BLOCK_H, D_V]
    b_q_rope = tl.load(p_q + o_r[None, :], mask=m_h[:, None], other=0.0)  # [BLOCK_H, D_ROPE]
    p_rows = rows_ptr + i_n * stride_rn
    if HAS_ROW_BASE:     # the request's rows start there: a slot list or token ids need no translation
        kv_ptr += tl.load(row_base_ptr + i_n) * stride_kv

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_H, D_V], dtype=tl.float32)
    start = i_s * CHUNK
    end = tl.minimum(start + CHUNK, K_SEL)
    for j0 in range(start, end, BLOCK_K):
        o_j = j0 + o_k
        b_row = tl.load(p_rows + o_j, mask=o_j < end, other=-1)  # [BLOCK_K]
        m_j = b_row >= 0
        p_kv = kv_ptr + b_row[:, None].to(tl.int64) * stride_kv
        b_kv = tl.load(p_kv + o_v[None, :], mask=m_j[:, None], other=0.0)  # [BLOCK_K, D_V]: K, and V
        b_kr = tl.load(p_kv + o_r[None, :], mask=m_j[:, None], other=0.0)  # [BLOCK_K, D_ROPE]
        b_s = tl.dot(b_q_rope, tl.trans(b_kr), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_K]
        b_s = tl.dot(b_q_nope, tl.trans(b_kv), b_s, input_precision=DOT_PRECISION)
        b_s = tl.where(m_j[None, :], b_s * qk_scale_log2, float("-inf"))  # log2 domain
        b_m, b_l, b_acc = _softmax_accumulate(b_s, b_kv, b_m, b_l, b_acc, DOT_PRECISION)

    m_any = b_l > 0.0
    b_out = b_acc / tl.where(m_any, b_l, 1.0)[:, None]  # [BLOCK_H, D_V]
    b_lse = tl.where(m_any, (b_m + tl.log2(tl.where(m_any, b_l, 1.0))) * LN2, float("-inf"))
    p_out = out_ptr + i_n * stride_on + o_h[:, None].to(tl.int64) * stride_oh + i_s * stride_os + o_v[None, :]
    tl.store(p_out, b_out, mask=m_h[:, None])
    tl.store(lse_ptr + i_n * stride_ln + o_h * stride_lh + i_s * stride_ls, b_lse, mask=m_h)


@triton.jit
def _sparse_mla_combine_kernel(
    part_ptr, part_lse_ptr, out_ptr, lse_ptr,
    stride_pn, stride_ph, stride_ps, stride_pln, stride_plh, stride_pls, stride_on, stride_oh, stride_ln,
    stride_lh, SPLITS,
    D_V: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge the per-split partial outputs of one (request, head), in split order: weights exp(lse_s - max).

    Splits without a valid row carry lse -inf and weight 0; a head with none at all gets zeros, lse -inf.
    """
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    o_v = tl.arange(0, D_V)
    p_lse = part_lse_ptr + i_n * stride_pln + i_h * stride_plh
    b_max = tl.max(tl.load(p_lse + o_s * stride_pls, mask=o_s < SPLITS, other=float("-inf")), axis=0)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_acc = tl.zeros([D_V], dtype=tl.float32)
    b_den = 0.0
    p_part = part_ptr + i_n * stride_pn + i_h * stride_ph + o_v
    for i_s in range(SPLITS):
        b_w = tl.exp(tl.load(p_lse + i_s * stride_pls) - b_max)
        b_acc += b_w * tl.load(p_part + i_s * stride_ps)  # [D_V]
        b_den += b_w
    b_den_safe = tl.where(b_den > 0.0, b_den, 1.0)
    tl.store(out_ptr + i_n * stride_on + i_h * stride_oh + o_v, b_acc / b_den_safe)
    b_lse = tl.where(b_den > 0.0, b_max + tl.log(b_den_safe), float("-inf"))
    tl.store(lse_ptr + i_n * stride_ln + i_h * stride_lh, b_lse)

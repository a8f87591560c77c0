"""NSA decode kernels (one query token per request): compression, attention partials, merge,
selection, gates. Launchers: hisparse/nsa/ops.py; torch references: hisparse/nsa/reference.py.

All attention branches run through one kernel, `_nsa_attention_partial_kernel`: a program owns one
(request, KV head) stream and one split of its entries, an entry being a tile of T consecutive keys
and values. It reads the entries in the order given and writes a partial softmax state (acc, m, l)
per query head of the GQA group; `_merge_splits` folds the splits in index order (in
`_nsa_merge_kernel` for the compressed branch, in `_nsa_gate_kernel` for the other two). The split
plan depends only on shapes, so with the same entries in the same order every floating-point
operation has the same inputs: hot-cache and resident runs are bitwise equal.
"""
import triton
import triton.language as tl


@triton.jit
def _nsa_compress_kernel(
    k, v, wk, wv, ck, cv, lengths,
    stride_k_s, stride_k_t, stride_v_s, stride_v_t,
    stride_ck_s, stride_ck_c, stride_cv_s, stride_cv_c,
    n_cmp, D, KV_HEADS, ring,
    CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, RING: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Compressed block c = mean(tokens [c * STRIDE, c * STRIDE + BLOCK)) (@ W when given), the
    tokens summed in order. Stream s = n * KV_HEADS + kv_head; program (s, i) writes blocks
    [i * BLOCK_C, ...) from dense tokens; with RING, program (s, 0) writes only the block that the
    newest token of a request of lengths[n] tokens completes, from a ring of `ring` tokens (t at t % ring)."""
    i_s = tl.program_id(0).to(tl.int64)
    o_lane = tl.arange(0, BLOCK_C)
    if RING:
        length = tl.load(lengths + i_s // KV_HEADS).to(tl.int32)
        completes = (length >= CMP_BLOCK) & ((length - CMP_BLOCK) % CMP_STRIDE == 0)
        o_c = (length - CMP_BLOCK) // CMP_STRIDE + o_lane
        n_write = tl.where(completes, n_cmp, 0)  # scalar bounds, not scalar masks (interpreter)
        m_c = (o_lane == 0) & (o_c >= 0) & (o_c < n_write)
    else:
        o_c = tl.program_id(1) * BLOCK_C + o_lane
        m_c = o_c < n_cmp
    o_d = tl.arange(0, BLOCK_D)
    m_cd = m_c[:, None] & (o_d[None, :] < D)
    o_tok = (o_c * CMP_STRIDE).to(tl.int64)
    b_k = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    b_v = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    for t in range(CMP_BLOCK):
        o_t = o_tok + t  # [BLOCK_C]
        if RING:
            o_t = o_t % ring
        p_k = k + i_s * stride_k_s + o_t[:, None] * stride_k_t + o_d[None, :]
        p_v = v + i_s * stride_v_s + o_t[:, None] * stride_v_t + o_d[None, :]
        b_k += tl.load(p_k, mask=m_cd, other=0.0).to(tl.float32)  # [BLOCK_C, BLOCK_D]
        b_v += tl.load(p_v, mask=m_cd, other=0.0).to(tl.float32)
    b_k = b_k / CMP_BLOCK
    b_v = b_v / CMP_BLOCK
    if HAS_WEIGHT:
        m_dd = (o_d[:, None] < D) & (o_d[None, :] < D)
        p_w = o_d[:, None] * D + o_d[None, :]
        b_wk = tl.load(wk + p_w, mask=m_dd, other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_D]
        b_wv = tl.load(wv + p_w, mask=m_dd, other=0.0).to(tl.float32)
        b_k = tl.dot(b_k, b_wk, input_precision=DOT_PRECISION)
        b_v = tl.dot(b_v, b_wv, input_precision=DOT_PRECISION)
    o_out = o_c.to(tl.int64)[:, None]
    tl.store(ck + i_s * stride_ck_s + o_out * stride_ck_c + o_d[None, :], b_k.to(ck.dtype.element_ty), mask=m_cd)
    tl.store(cv + i_s * stride_cv_s + o_out * stride_cv_c + o_d[None, :], b_v.to(cv.dtype.element_ty), mask=m_cd)


@triton.jit
def _nsa_attention_partial_kernel(
    q, k, v, rows, blocks, lengths, part, logits,
    stride_q_n, stride_q_h,
    stride_k_a, stride_k_t, stride_v_a, stride_v_t,
    stride_rows_s, stride_logits_h, stride_part_h, stride_part_s,
    KV_HEADS, G, D, n_entries, entries_per_split, max_valid, units_per_stream, scale,
    T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    GATHER: tl.constexpr, RESIDENT: tl.constexpr, VALID_KIND: tl.constexpr,
    CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr,
    STORE_LOGITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Partial attention of the G query heads of stream s = n * KV_HEADS + kv_head over entries
    [split * entries_per_split, ...) of that stream.

    GATHER: entry e is the row rows[s, e] of k / v (-1 = skip), or with RESIDENT the row
    s * units_per_stream + blocks[s, e] of the resident pool; its valid length is that of selection
    block blocks[s, e] (-1 = skip) of a request of lengths[n] tokens (T = selection block size).
    Otherwise entry e holds keys [e * T, e * T + T) of stream s (k + s * stride_k_a), and the
    stream's valid key count is, by VALID_KIND: 0 = compressed blocks of lengths[n] tokens,
    1 = min(lengths[n], max_valid) (the window ring buffer). max_valid caps every count.
    Writes part[n * H + h, split] = (acc [D], m, l) of each query head h of the group.
    """
    i_s = tl.program_id(0)
    i_split = tl.program_id(1)
    i_n = i_s // KV_HEADS
    i_kvh = i_s % KV_HEADS
    length = tl.load(lengths + i_n).to(tl.int32)
    if VALID_KIND == 0:
        n_valid = tl.where(length >= CMP_BLOCK, (length - CMP_BLOCK) // CMP_STRIDE + 1, 0)
    else:
        n_valid = length
    n_valid = tl.minimum(n_valid, max_valid)

    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    o_t = tl.arange(0, T)
    m_g = o_g < G
    m_d = o_d < D
    o_h = (i_kvh * G + o_g).to(tl.int64)  # [BLOCK_G] query heads of the group
    o_hf = i_n.to(tl.int64) * KV_HEADS * G + o_h  # [BLOCK_G] flat (request, query head)
    p_q = q + i_n.to(tl.int64) * stride_q_n + o_h[:, None] * stride_q_h + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    b_m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_G], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    e_start = i_split * entries_per_split
    e_end = tl.minimum(e_start + entries_per_split, n_entries)
    for e in range(e_start, e_end):
        if GATHER:
            i_blk = tl.load(blocks + i_s.to(tl.int64) * stride_rows_s + e)
            if RESIDENT:
                i_row = i_s.to(tl.int64) * units_per_stream + i_blk
            else:
                i_row = tl.load(rows + i_s.to(tl.int64) * stride_rows_s + e).to(tl.int64)
            count = tl.where((i_row >= 0) & (i_blk >= 0), tl.minimum(length - i_blk * T, T), 0)
            off_k = tl.maximum(i_row, 0) * stride_k_a
            off_v = tl.maximum(i_row, 0) * stride_v_a
        else:
            count = tl.minimum(n_valid - e * T, T)
            off_k = i_s.to(tl.int64) * stride_k_a + e * T * stride_k_t  # within a stream: int32 is enough
            off_v = i_s.to(tl.int64) * stride_v_a + e * T * stride_v_t
        m_t = o_t < count
        m_td = m_t[:, None] & m_d[None, :]
        b_k = tl.load(k + off_k + o_t[:, None].to(tl.int64) * stride_k_t + o_d[None, :], mask=m_td, other=0.0)
        b_v = tl.load(v + off_v + o_t[:, None].to(tl.int64) * stride_v_t + o_d[None, :], mask=m_td, other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * scale  # [BLOCK_G, T]
        b_s = tl.where(m_t[None, :], b_s, float("-inf"))
        if STORE_LOGITS:
            p_lg = logits + o_hf[:, None] * stride_logits_h + e * T + o_t[None, :]
            tl.store(p_lg, b_s, mask=m_g[:, None] & m_t[None, :])
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp(b_m - b_m_use)
        b_p = tl.exp(b_s - b_m_use[:, None])  # [BLOCK_G, T]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_m = b_m_new

    p_part = part + o_hf * stride_part_h + i_split * stride_part_s  # [BLOCK_G]
    tl.store(p_part[:, None] + o_d[None, :], b_acc, mask=m_g[:, None] & m_d[None, :])
    tl.store(p_part + D, b_m, mask=m_g)
    tl.store(p_part + D + 1, b_l, mask=m_g)


@triton.jit
def _merge_splits(part, i_h, stride_part_h, stride_part_s, n_splits, D,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Fold the splits part[i_h, split] = (acc [D], m, l) of flat (request, query head) i_h in
    index order: -> out [BLOCK_D], lse. No key in any split: out 0, lse -inf."""
    o_sp = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_sp = o_sp < n_splits
    p_part = part + i_h * stride_part_h + o_sp * stride_part_s  # [BLOCK_S]
    b_m = tl.load(p_part + D, mask=m_sp, other=float("-inf"))  # [BLOCK_S]
    b_l = tl.load(p_part + D + 1, mask=m_sp, other=0.0)
    b_acc = tl.load(p_part[:, None] + o_d[None, :], mask=m_sp[:, None] & (o_d[None, :] < D), other=0.0)
    b_max = tl.max(b_m, 0)
    b_max_use = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_w = tl.exp(b_m - b_max_use)  # [BLOCK_S]
    b_sum = tl.sum(b_w * b_l, 0)
    b_sum_use = tl.where(b_sum > 0, b_sum, 1.0)
    b_o = tl.where(b_sum > 0, tl.sum(b_w[:, None] * b_acc, 0) / b_sum_use, 0.0)  # [BLOCK_D]
    b_lse = tl.where(b_sum > 0, b_max_use + tl.log(b_sum_use), float("-inf"))
    return b_o, b_lse


@triton.jit
def _nsa_merge_kernel(
    part, out, lse,
    stride_part_h, stride_part_s, stride_out_h,
    n_splits, D,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out [D] fp32 and lse of one flat (request, query head) from its partials."""
    i_h = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    b_o, b_lse = _merge_splits(part, i_h, stride_part_h, stride_part_s, n_splits, D, BLOCK_S, BLOCK_D)
    tl.store(out + i_h * stride_out_h + o_d, b_o, mask=o_d < D)
    tl.store(lse + i_h, b_lse)


@triton.jit
def _nsa_select_kernel(
    logits, lse, lengths, scores, blocks,
    stride_logits_h, stride_scores_s, stride_blocks_s,
    KV_HEADS, G, n_cmp_max, n_blocks_max,
    CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
    N_SELECT: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    """Selection of one (request, KV head) stream.

    score[j] = sum over the G heads of the group, m < SEL_BLOCK / STRIDE, p < CMP_BLOCK / STRIDE of
    p_cmp[h, 4 j + m - p] (4 = SEL_BLOCK / STRIDE), p_cmp = exp(logit - lse) the compressed-branch
    probabilities. Block 0 and the two newest blocks are forced (score +inf); the top N_SELECT
    blocks are taken by descending score, ties to the lower block index; -1 pads.
    """
    i_s = tl.program_id(0)
    i_n = i_s // KV_HEADS
    i_kvh = i_s % KV_HEADS
    length = tl.load(lengths + i_n).to(tl.int32)
    n_cmp = tl.where(length >= CMP_BLOCK, (length - CMP_BLOCK) // CMP_STRIDE + 1, 0)
    n_cmp = tl.minimum(n_cmp, n_cmp_max)
    n_blk = tl.minimum(tl.cdiv(length, SEL_BLOCK), n_blocks_max)

    o_j = tl.arange(0, BLOCK_NB)
    b_score = tl.zeros([BLOCK_NB], dtype=tl.float32)
    for g in range(G):
        i_h = (i_n * KV_HEADS * G + i_kvh * G + g).to(tl.int64)
        b_lse = tl.load(lse + i_h)
        b_lse = tl.where(b_lse == float("-inf"), 0.0, b_lse)  # no compressed block: all masked
        for m in tl.static_range(SEL_BLOCK // CMP_STRIDE):
            for p in tl.static_range(CMP_BLOCK // CMP_STRIDE):
                o_i = (SEL_BLOCK // CMP_STRIDE) * o_j + m - p  # [BLOCK_NB] compressed block index
                m_i = (o_i >= 0) & (o_i < n_cmp)
                b_lg = tl.load(logits + i_h * stride_logits_h + o_i, mask=m_i, other=float("-inf"))
                b_score += tl.where(m_i, tl.exp(b_lg - b_lse), 0.0)
    tl.store(scores + i_s.to(tl.int64) * stride_scores_s + o_j, b_score, mask=o_j < n_blocks_max)

    m_forced = (o_j == 0) | (o_j >= n_blk - 2)
    b_cur = tl.where(m_forced, float("inf"), b_score)
    b_cur = tl.where(o_j < n_blk, b_cur, float("-inf"))
    for i in tl.static_range(N_SELECT):
        b_best = tl.max(b_cur, 0)
        i_best = tl.min(tl.where(b_cur == b_best, o_j, BLOCK_NB), 0)
        i_sel = tl.where(b_best == float("-inf"), -1, i_best)
        tl.store(blocks + i_s.to(tl.int64) * stride_blocks_s + i, i_sel.to(blocks.dtype.element_ty))
        b_cur = tl.where(o_j == i_best, float("-inf"), b_cur)


@triton.jit
def _nsa_gate_kernel(
    o_cmp, slc, win, gates, out,
    stride_o_h, stride_slc_h, stride_slc_s, stride_win_h, stride_win_s, stride_gates_h, stride_out_h,
    slc_splits, win_splits, D,
    BLOCK_S_SLC: tl.constexpr, BLOCK_S_WIN: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out = g0 * o_cmp + g1 * o_slc + g2 * o_win for one flat (request, query head); the selected
    and window outputs are merged here from their partials."""
    i_h = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_slc, _ = _merge_splits(slc, i_h, stride_slc_h, stride_slc_s, slc_splits, D, BLOCK_S_SLC, BLOCK_D)
    b_win, _ = _merge_splits(win, i_h, stride_win_h, stride_win_s, win_splits, D, BLOCK_S_WIN, BLOCK_D)
    b_g0 = tl.load(gates + i_h * stride_gates_h).to(tl.float32)
    b_g1 = tl.load(gates + i_h * stride_gates_h + 1).to(tl.float32)
    b_g2 = tl.load(gates + i_h * stride_gates_h + 2).to(tl.float32)
    b_o = b_g0 * tl.load(o_cmp + i_h * stride_o_h + o_d, mask=m_d, other=0.0)
    b_o += b_g1 * b_slc
    b_o += b_g2 * b_win
    tl.store(out + i_h * stride_out_h + o_d, b_o.to(out.dtype.element_ty), mask=m_d)

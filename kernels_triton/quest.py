"""Quest kernels: page min/max metadata, page upper-bound scores, top-page selection, sparse attention.

Launchers and layouts live in `hisparse/quest/ops.py`, torch references in `hisparse/quest/reference.py`.
A page holds PAGE tokens; one row per (page, KV head) is `[2, PAGE, D]`: the page's keys, then its values.
"""
import triton
import triton.language as tl


@triton.jit
def _quest_metadata_append_kernel(
    kmin_ptr, kmax_ptr, key_ptr, pos_ptr,
    stride_mn, stride_mh, stride_mp, stride_kn, stride_kh,
    P_MAX,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
):
    """One program per (request, KV head): fold the new key into its page's min/max (positions
    below 0 or past P_MAX pages are skipped)."""
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    pos = tl.load(pos_ptr + i_n).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    b_pos = tl.zeros([BLOCK_D], tl.int64) + pos  # [BLOCK_D]: vector masks (scalar & vector breaks the interpreter)
    m_d = (o_d < D) & (b_pos >= 0) & (b_pos < P_MAX * PAGE)
    b_key = tl.load(key_ptr + i_n * stride_kn + i_h * stride_kh + o_d, mask=m_d)  # [BLOCK_D]
    p_meta = i_n * stride_mn + i_h * stride_mh + (pos // PAGE) * stride_mp + o_d
    first = (b_pos % PAGE) == 0
    m_old = m_d & (b_pos % PAGE != 0)
    b_min = tl.load(kmin_ptr + p_meta, mask=m_old, other=0.0)
    b_max = tl.load(kmax_ptr + p_meta, mask=m_old, other=0.0)
    b_min = tl.where(first, b_key, tl.minimum(b_min, b_key))
    b_max = tl.where(first, b_key, tl.maximum(b_max, b_key))
    tl.store(kmin_ptr + p_meta, b_min, mask=m_d)
    tl.store(kmax_ptr + p_meta, b_max, mask=m_d)


@triton.jit
def _quest_page_scores_kernel(
    q_ptr, kmin_ptr, kmax_ptr, len_ptr, out_ptr,
    stride_qn, stride_qh, stride_mn, stride_mh, stride_mp, stride_on, stride_oh,
    P_MAX,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    PAGE: tl.constexpr,
):
    """One program per (request, KV head, block of pages): max over the group of the page bounds."""
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_p = tl.program_id(2).to(tl.int64)
    n_pages = (tl.load(len_ptr + i_n).to(tl.int64) + PAGE - 1) // PAGE
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_d = tl.arange(0, BLOCK_D)
    m_p = o_p < n_pages
    m_d = o_d < D
    p_meta = i_n * stride_mn + i_h * stride_mh + o_p[:, None] * stride_mp + o_d[None, :]
    m_meta = m_p[:, None] & m_d[None, :]
    b_min = tl.load(kmin_ptr + p_meta, mask=m_meta, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_D]
    b_max = tl.load(kmax_ptr + p_meta, mask=m_meta, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_D]
    b_score = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for g in tl.static_range(GROUP):
        p_q = q_ptr + i_n * stride_qn + (i_h * GROUP + g) * stride_qh + o_d
        b_q = tl.load(p_q, mask=m_d, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_D]
        b_bound = tl.sum(tl.maximum(b_q * b_max, b_q * b_min), axis=1)  # [BLOCK_P]
        b_score = tl.maximum(b_score, b_bound)
    b_score = tl.where(m_p, b_score, float("-inf"))
    tl.store(out_ptr + i_n * stride_on + i_h * stride_oh + o_p, b_score, mask=o_p < P_MAX)


@triton.jit
def _quest_select_pages_kernel(
    score_ptr, len_ptr, out_ptr,
    stride_sn, stride_sh, stride_on, stride_oh,
    P_MAX,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, PAGE: tl.constexpr,
):
    """One program per (request, KV head): the current page plus the top K-1 other pages.

    The K-1 best scores are found by a bitwise search for the threshold over order-preserving
    integer keys; ties at the threshold go to the lower page index. Output is in page order.
    """
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    n_pages = (tl.load(len_ptr + i_n) + PAGE - 1) // PAGE
    cur = n_pages - 1
    need = tl.minimum(K - 1, cur)
    o_p = tl.arange(0, BLOCK_P)
    m_cand = o_p < cur
    b_s = tl.load(score_ptr + i_n * stride_sn + i_h * stride_sh + o_p, mask=m_cand & (o_p < P_MAX),
                  other=0.0)  # [BLOCK_P]
    b_s = tl.where(b_s == 0.0, 0.0, b_s)  # -0.0 and 0.0 tie, as in torch.sort
    b_bits = b_s.to(tl.int32, bitcast=True)
    b_key = (b_bits ^ ((b_bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)  # [BLOCK_P], float order
    thr = tl.full([], 0, tl.uint32)
    for bit in tl.static_range(32):
        cand = thr | (tl.full([], 1, tl.uint32) << (31 - bit))
        count = tl.sum(((b_key >= cand) & m_cand).to(tl.int32), axis=0)
        thr = tl.where(count >= need, cand, thr)
    above = (b_key > thr) & m_cand
    n_above = tl.sum(above.to(tl.int32), axis=0)
    tie = (b_key == thr) & m_cand
    tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) - 1
    chosen = above | (tie & (tie_rank < need - n_above)) | (o_p == cur)
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    p_out = out_ptr + i_n * stride_on + i_h * stride_oh
    tl.store(p_out + slot, o_p.to(tl.int32), mask=chosen)
    o_k = tl.arange(0, BLOCK_K)
    tl.store(p_out + o_k, tl.full([BLOCK_K], -1, tl.int32), mask=(o_k > need) & (o_k < K))


@triton.jit
def _quest_attention_split_kernel(
    q_ptr, kv_ptr, rows_ptr, pages_ptr, len_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    stride_qn, stride_qh, stride_kvr, stride_rn, stride_rh, stride_pn, stride_ph,
    N_SEL, PAGES_PER_SPLIT, SPLITS, scale_log2,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, PAGES_PER_ITER: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (request, KV head, split): online softmax over a run of selected pages.

    Pages are read in selection order; partial results (log2-domain max, sum, unnormalised output)
    go to [N, HQ, SPLITS] buffers for `_quest_attention_combine_kernel`.
    """
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    HQ = tl.num_programs(1) * GROUP
    length = tl.load(len_ptr + i_n).to(tl.int64)
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < GROUP
    m_d = o_d < D
    p_q = q_ptr + i_n * stride_qn + (i_h * GROUP + o_g)[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    o_t = tl.arange(0, PAGES_PER_ITER * PAGE)  # [BLOCK_T]: PAGES_PER_ITER pages of PAGE tokens
    t_page = o_t // PAGE
    t_tok = (o_t % PAGE).to(tl.int64)
    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = i_s * PAGES_PER_SPLIT
    end = tl.minimum(start + PAGES_PER_SPLIT, N_SEL)
    p_rows = rows_ptr + i_n * stride_rn + i_h * stride_rh
    p_pages = pages_ptr + i_n * stride_pn + i_h * stride_ph
    for j in range(start, end, PAGES_PER_ITER):
        i_sel = j + t_page  # [BLOCK_T]
        m_sel = i_sel < end
        row = tl.load(p_rows + i_sel, mask=m_sel, other=-1).to(tl.int64)
        page = tl.load(p_pages + i_sel, mask=m_sel, other=-1).to(tl.int64)
        m_t = m_sel & (row >= 0) & (page >= 0) & (page * PAGE + t_tok < length)  # [BLOCK_T]
        p_k = kv_ptr + row[:, None] * stride_kvr + t_tok[:, None] * D + o_d[None, :]
        m_kv = m_t[:, None] & m_d[None, :]
        b_k = tl.load(p_k, mask=m_kv, other=0.0)  # [BLOCK_T, BLOCK_D]
        b_v = tl.load(p_k + PAGE * D, mask=m_kv, other=0.0)  # [BLOCK_T, BLOCK_D]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_T]
        b_s = tl.where(m_t[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp2(b_m - b_m_safe)
        b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BLOCK_G, BLOCK_T]
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
        b_m = b_m_new
    o_hq = i_h * GROUP + o_g
    o_part = (i_n * HQ + o_hq) * SPLITS + i_s  # [BLOCK_G], int64 through i_n
    tl.store(part_max_ptr + o_part, b_m, mask=m_g)
    tl.store(part_sum_ptr + o_part, b_l, mask=m_g)
    tl.store(part_acc_ptr + o_part[:, None] * D + o_d[None, :], b_acc, mask=m_g[:, None] & m_d[None, :])


@triton.jit
def _quest_attention_combine_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
    stride_on, stride_oh, SPLITS,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per (request, query head): merge the splits; no valid token gives zeros."""
    i_n = tl.program_id(0).to(tl.int64)
    i_hq = tl.program_id(1).to(tl.int64)
    HQ = tl.num_programs(1)
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_s = o_s < SPLITS
    m_d = o_d < D
    o_part = (i_n * HQ + i_hq) * SPLITS + o_s  # [BLOCK_S]
    b_m = tl.load(part_max_ptr + o_part, mask=m_s, other=float("-inf"))
    b_l = tl.load(part_sum_ptr + o_part, mask=m_s, other=0.0)
    b_acc = tl.load(part_acc_ptr + o_part[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :],
                    other=0.0)  # [BLOCK_S, BLOCK_D]
    m_all = tl.max(b_m, axis=0)
    b_w = tl.exp2(b_m - tl.where(m_all == float("-inf"), 0.0, m_all))  # [BLOCK_S]
    l_all = tl.sum(b_w * b_l, axis=0)
    b_out = tl.sum(b_w[:, None] * b_acc, axis=0) / tl.where(l_all == 0.0, 1.0, l_all)  # [BLOCK_D]
    tl.store(out_ptr + i_n * stride_on + i_hq * stride_oh + o_d, b_out.to(out_ptr.dtype.element_ty),
             mask=m_d)

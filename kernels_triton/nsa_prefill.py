"""NSA prefill: the selected branch for a tile of consecutive queries of one (request, KV head).
Launcher: hisparse/nsa/ops.py `nsa_prefill_selected`; torch reference: hisparse/nsa/reference.py
`nsa_prefill_selected_ref`.

Each query attends its own selection blocks, so the tile's keys are gathered per query: column
c = j * T + t of a key tile is token t of query j's block. Rows r = i * BLOCK_G + g are (query i,
head g of the GQA group), and a row keeps only its own query's columns (i == j). With
BLOCK_Q = 1 this is the decode kernel's shape (one query per row list); larger tiles waste
BLOCK_Q - 1 of every BLOCK_Q products, which pays only where a program costs far more than its
arithmetic (Triton's interpreter).
"""
import triton
import triton.language as tl


@triton.jit
def _nsa_prefill_selected_kernel(
    q, k, v, blocks, out,
    stride_q_b, stride_q_s, stride_q_h,
    stride_kv_s, stride_kv_t,
    stride_blk_s, stride_blk_q,
    stride_o_b, stride_o_s, stride_o_h,
    KV_HEADS, G, D, S, n_entries, start, scale,
    T: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (s, i): stream s = b * KV_HEADS + kv_head, queries [i * BLOCK_Q, ...) of the chunk;
    query j sits at position start + j and reads blocks[s, j, e] (e < n_entries, -1 = skip), each
    block's tokens below its length start + j + 1. Keys of stream s: k + s * stride_kv_s, token
    stride stride_kv_t. Writes out[b, j, kv_head * G + g] (fp32; 0 without any key)."""
    i_s = tl.program_id(0).to(tl.int64)
    i_b = i_s // KV_HEADS
    i_kvh = i_s % KV_HEADS
    o_r = tl.arange(0, BLOCK_Q * BLOCK_G)
    o_rq = tl.program_id(1) * BLOCK_Q + o_r // BLOCK_G  # [R] query of each row
    o_rg = o_r % BLOCK_G  # [R] head of the group
    o_c = tl.arange(0, BLOCK_Q * T)
    o_cq = tl.program_id(1) * BLOCK_Q + o_c // T  # [C] query of each key column
    o_ct = o_c % T  # [C] token within the block
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_r = (o_rg < G) & (o_rq < S)
    m_cq = o_cq < S
    o_h = i_kvh * G + o_rg  # [R] query head
    p_q = q + i_b * stride_q_b + o_rq.to(tl.int64)[:, None] * stride_q_s + o_h[:, None] * stride_q_h + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)  # [R, BLOCK_D]
    m_own = o_rq[:, None] == o_cq[None, :]  # [R, C] a row sees its own query's columns
    length = start + o_cq + 1  # [C]

    b_m = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], dtype=tl.float32)
    for e in range(n_entries):
        i_blk = tl.load(blocks + i_s * stride_blk_s + o_cq.to(tl.int64) * stride_blk_q + e, mask=m_cq, other=-1)
        count = tl.where(i_blk >= 0, tl.minimum(length - i_blk * T, T), 0)  # [C] valid tokens of the block
        m_c = m_cq & (o_ct < count)
        o_tok = (tl.maximum(i_blk, 0) * T + o_ct).to(tl.int64)  # [C]
        p_kv = i_s * stride_kv_s + o_tok[:, None] * stride_kv_t + o_d[None, :]
        m_cd = m_c[:, None] & m_d[None, :]
        b_k = tl.load(k + p_kv, mask=m_cd, other=0.0)  # [C, BLOCK_D]
        b_v = tl.load(v + p_kv, mask=m_cd, other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * scale  # [R, C]
        b_s = tl.where(m_own & m_c[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp(b_m - b_m_use)
        b_p = tl.exp(b_s - b_m_use[:, None])  # [R, C]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_m = b_m_new

    b_o = tl.where(b_l[:, None] > 0, b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None], 0.0)
    p_o = out + i_b * stride_o_b + o_rq.to(tl.int64)[:, None] * stride_o_s + o_h[:, None] * stride_o_h + o_d[None, :]
    tl.store(p_o, b_o, mask=m_r[:, None] & m_d[None, :])

"""DSA sparse MLA decode over FP8 rows: the 656-byte row format DeepSeek-V3.2 serves with.

A row (hisparse/dsa/fp8.py states the format) is bytes [0, 512) float8_e4m3fn latent, [512, 528) four
float32 scales (one per 128 latent values), [528, 656) 64 bf16 RoPE values. The kernel gathers each
selected row's bytes, dequantises in registers (latent * its block's scale, RoPE as stored) to q's dtype,
then runs the bf16 kernel's loop: `_sparse_mla_decode_kernel` in kernels_triton/dsa.py, the same
online softmax (its `_softmax_accumulate`), split layout and -1 handling, so its float32 partials merge
through the same `_sparse_mla_combine_kernel`.

Launcher and input checks: `hisparse.dsa.fp8.sparse_mla_decode_fp8`; torch reference beside it.
"""
import triton
import triton.language as tl

from kernels_triton.dsa import LN2, _softmax_accumulate


@triton.jit
def _sparse_mla_decode_fp8_kernel(
    q_ptr, kv_ptr, rows_ptr, row_base_ptr, out_ptr, lse_ptr,
    stride_qn, stride_qh, stride_kv, stride_rn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
    stride_ls,
    H, K_SEL, CHUNK, qk_scale_log2,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, TILE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_ROW_BASE: tl.constexpr,
):
    """Absorbed-MLA attention of BLOCK_H query heads over one chunk of a request's selected FP8 rows.

    As `_sparse_mla_decode_kernel`, except that kv_ptr is the uint8 row pool (stride_kv bytes a row,
    each row 16-byte aligned) and row r's K is dequantised from its bytes: latent value c is
    fp8[c] * scale[c // TILE] (D_V // TILE float32 scales at byte D_V), RoPE dims are D_ROPE bf16 at
    byte D_V + 4 * (D_V // TILE); both converted to q's dtype, V = the dequantised latent. The
    products of an e4m3 value and a power of two are exact in float32 and bf16, so for those q
    dtypes the dots get exactly the operands the bf16 kernel gets over the dequantised rows.
    """
    N_TILES: tl.constexpr = D_V // TILE
    SCALE_BYTE: tl.constexpr = D_V
    ROPE_BYTE: tl.constexpr = D_V + 4 * N_TILES
    i_hb = tl.program_id(0)
    i_n = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_v = tl.arange(0, D_V)
    o_r = tl.arange(0, D_ROPE)
    o_t = tl.arange(0, N_TILES)
    o_c = tl.arange(0, TILE)
    o_k = tl.arange(0, BLOCK_K)
    p_q = q_ptr + i_n * stride_qn + o_h[:, None].to(tl.int64) * stride_qh
    b_q_nope = tl.load(p_q + o_v[None, :], mask=m_h[:, None], other=0.0)  # [BLOCK_H, D_V]
    b_q_rope = tl.load(p_q + D_V + o_r[None, :], mask=m_h[:, None], other=0.0)  # [BLOCK_H, D_ROPE]
    p_rows = rows_ptr + i_n * stride_rn
    if HAS_ROW_BASE:
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
        p_row = kv_ptr + b_row.to(tl.int64) * stride_kv  # [BLOCK_K] first byte of each row
        p_lat = p_row[:, None, None] + (o_t[None, :, None] * TILE + o_c[None, None, :])
        b_lat = tl.load(p_lat.to(tl.pointer_type(tl.float8e4nv)), mask=m_j[:, None, None], other=0.0)
        p_scale = (p_row + SCALE_BYTE).to(tl.pointer_type(tl.float32))
        b_scale = tl.load(p_scale[:, None] + o_t[None, :], mask=m_j[:, None], other=0.0)  # [BLOCK_K, N_TILES]
        b_kv = b_lat.to(tl.float32) * b_scale[:, :, None]  # [BLOCK_K, N_TILES, TILE]
        b_kv = tl.reshape(b_kv, [BLOCK_K, D_V]).to(b_q_nope.dtype)  # [BLOCK_K, D_V]: K, and V
        p_kr = (p_row + ROPE_BYTE).to(tl.pointer_type(tl.bfloat16))
        b_kr = tl.load(p_kr[:, None] + o_r[None, :], mask=m_j[:, None], other=0.0)  # [BLOCK_K, D_ROPE]
        b_kr = b_kr.to(b_q_rope.dtype)
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

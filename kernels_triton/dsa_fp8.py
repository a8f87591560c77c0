"""DSA sparse MLA decode over FP8 rows: the 656-byte row format DeepSeek-V3.2 serves with.

A row (hisparse/dsa/fp8.py states the format) is bytes [0, 512) float8_e4m3fn latent, [512, 528) four
float32 scales (one per 128 latent values), [528, 656) 64 bf16 RoPE values. The kernel gathers each
selected row's bytes, dequantises in registers (latent * its block's scale, RoPE as stored) to q's dtype,
then runs the bf16 kernel's loop: `_sparse_mla_decode_kernel` in kernels_triton/dsa.py, the same
online softmax (its `_softmax_accumulate`), split layout and -1 handling, so its float32 partials merge
through the same `_sparse_mla_combine_kernel`.

How a tile is dequantised is a constexpr switch, DEQUANT (`FP8_DEQUANT` names its values for the
launcher and `bench_attention_dsa --tune --kv-dtype fp8`):
  0 "inline" (the default): the tile's latent bytes as one [BLOCK_K, D_V // TILE, TILE] load times its
    [BLOCK_K, D_V // TILE] scales broadcast (one 16-byte load a row, not a gather per value), reshaped
    to [BLOCK_K, D_V]; QK^T and PV read it whole.
  1 "split": D_V // TILE (4) separate [BLOCK_K, TILE] tiles, each scaled by its [BLOCK_K] scale
    broadcast along the row: no 3D tile and no reshape; QK^T is the chain of the RoPE dot and the 4
    blocks' dots, PV accumulates 4 [BLOCK_H, TILE] blocks. The dots get the same operands as
    "inline" and accumulate the same products, in the same order along QK^T's chain; in the
    interpreter (numpy) the 4 partial dots round differently from one, so "split" equals "inline"
    within float32 rounding, not bit for bit.
Both keep hisparse == resident bitwise (the same kernel over the same bytes in the same order).
Why the default tile is slow and what each mode compiles to (offline sm_90a compiles, no GPU time):
results/notes/fp8.md; `bench_attention_dsa --tune --kv-dtype fp8` times both.

Launcher and input checks: `hisparse.dsa.fp8.sparse_mla_decode_fp8`; torch reference beside it.
"""
import triton
import triton.language as tl

from kernels_triton.dsa import LN2, _softmax_accumulate

FP8_DEQUANT = {"inline": 0, "split": 1}        # name -> DEQUANT of `_sparse_mla_decode_fp8_kernel`


@triton.jit
def _softmax_weights(b_s, b_m, b_l):
    """`_softmax_accumulate`'s step without the PV dot: (new max, new sum, the rescale of what was
    accumulated, the weights p [BLOCK_H, BLOCK_K]), the same operations in the same order."""
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no (-inf) - (-inf)
    b_alpha = tl.exp2(b_m - b_m_safe)
    b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BLOCK_H, BLOCK_K]
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    return b_m_new, b_l, b_alpha, b_p


@triton.jit
def _fp8_latent_block(p_row, m_j, t: tl.constexpr, D_V: tl.constexpr, TILE: tl.constexpr, dtype: tl.constexpr):
    """Latent block t (values t*TILE .. t*TILE + TILE) of the rows starting at p_row [BLOCK_K]
    (masked rows: zeros), dequantised: [BLOCK_K, TILE] in dtype."""
    o_c = tl.arange(0, TILE)
    p_lat = (p_row[:, None] + (t * TILE + o_c)[None, :]).to(tl.pointer_type(tl.float8e4nv))
    b_lat = tl.load(p_lat, mask=m_j[:, None], other=0.0)  # [BLOCK_K, TILE]
    b_scale = tl.load((p_row + D_V + 4 * t).to(tl.pointer_type(tl.float32)), mask=m_j, other=0.0)  # [BLOCK_K]
    return (b_lat.to(tl.float32) * b_scale[:, None]).to(dtype)


@triton.jit
def _sparse_mla_decode_fp8_kernel(
    q_ptr, kv_ptr, rows_ptr, row_base_ptr, out_ptr, lse_ptr,
    stride_qn, stride_qh, stride_kv, stride_rn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
    stride_ls,
    H, K_SEL, CHUNK, qk_scale_log2,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, TILE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_ROW_BASE: tl.constexpr,
    DEQUANT: tl.constexpr = 0,
):
    """Absorbed-MLA attention of BLOCK_H query heads over one chunk of a request's selected FP8 rows.

    As `_sparse_mla_decode_kernel`, except that kv_ptr is the uint8 row pool (stride_kv bytes a row,
    each row 16-byte aligned) and row r's K is dequantised from its bytes: latent value c is
    fp8[c] * scale[c // TILE] (D_V // TILE float32 scales at byte D_V), RoPE dims are D_ROPE bf16 at
    byte D_V + 4 * (D_V // TILE); both converted to q's dtype, V = the dequantised latent. The
    products of an e4m3 value and a power of two are exact in float32 and bf16, so for those q
    dtypes the dots get exactly the operands the bf16 kernel gets over the dequantised rows.
    DEQUANT: 0 "inline", 1 "split" (the module's docstring).
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
    if DEQUANT == 0:
        b_q_nope = tl.load(p_q + o_v[None, :], mask=m_h[:, None], other=0.0)  # [BLOCK_H, D_V]
    b_q_rope = tl.load(p_q + D_V + o_r[None, :], mask=m_h[:, None], other=0.0)  # [BLOCK_H, D_ROPE]
    p_rows = rows_ptr + i_n * stride_rn
    if HAS_ROW_BASE:
        kv_ptr += tl.load(row_base_ptr + i_n) * stride_kv

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    if DEQUANT == 0:
        b_acc = tl.zeros([BLOCK_H, D_V], dtype=tl.float32)
    start = i_s * CHUNK
    end = tl.minimum(start + CHUNK, K_SEL)
    if DEQUANT == 0:
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
    else:  # "split": 4 latent blocks of TILE values, each with its row's scale
        tl.static_assert(N_TILES == 4, "DEQUANT 'split' is written out for 4 scale blocks a row")
        dtype = b_q_rope.dtype
        b_q0 = tl.load(p_q + o_c[None, :], mask=m_h[:, None], other=0.0)  # [BLOCK_H, TILE] each
        b_q1 = tl.load(p_q + TILE + o_c[None, :], mask=m_h[:, None], other=0.0)
        b_q2 = tl.load(p_q + 2 * TILE + o_c[None, :], mask=m_h[:, None], other=0.0)
        b_q3 = tl.load(p_q + 3 * TILE + o_c[None, :], mask=m_h[:, None], other=0.0)
        b_acc0 = tl.zeros([BLOCK_H, TILE], dtype=tl.float32)
        b_acc1 = tl.zeros([BLOCK_H, TILE], dtype=tl.float32)
        b_acc2 = tl.zeros([BLOCK_H, TILE], dtype=tl.float32)
        b_acc3 = tl.zeros([BLOCK_H, TILE], dtype=tl.float32)
        for j0 in range(start, end, BLOCK_K):
            o_j = j0 + o_k
            b_row = tl.load(p_rows + o_j, mask=o_j < end, other=-1)  # [BLOCK_K]
            m_j = b_row >= 0
            p_row = kv_ptr + b_row.to(tl.int64) * stride_kv  # [BLOCK_K] first byte of each row
            b_k0 = _fp8_latent_block(p_row, m_j, 0, D_V, TILE, dtype)  # [BLOCK_K, TILE]: K, and V
            b_k1 = _fp8_latent_block(p_row, m_j, 1, D_V, TILE, dtype)
            b_k2 = _fp8_latent_block(p_row, m_j, 2, D_V, TILE, dtype)
            b_k3 = _fp8_latent_block(p_row, m_j, 3, D_V, TILE, dtype)
            p_kr = (p_row + ROPE_BYTE).to(tl.pointer_type(tl.bfloat16))
            b_kr = tl.load(p_kr[:, None] + o_r[None, :], mask=m_j[:, None], other=0.0).to(dtype)  # [BLOCK_K, D_ROPE]
            b_s = tl.dot(b_q_rope, tl.trans(b_kr), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_K]
            b_s = tl.dot(b_q0, tl.trans(b_k0), b_s, input_precision=DOT_PRECISION)
            b_s = tl.dot(b_q1, tl.trans(b_k1), b_s, input_precision=DOT_PRECISION)
            b_s = tl.dot(b_q2, tl.trans(b_k2), b_s, input_precision=DOT_PRECISION)
            b_s = tl.dot(b_q3, tl.trans(b_k3), b_s, input_precision=DOT_PRECISION)
            b_s = tl.where(m_j[None, :], b_s * qk_scale_log2, float("-inf"))  # log2 domain
            b_m, b_l, b_alpha, b_p = _softmax_weights(b_s, b_m, b_l)
            b_p = b_p.to(dtype)
            b_acc0 = tl.dot(b_p, b_k0, b_acc0 * b_alpha[:, None], input_precision=DOT_PRECISION)
            b_acc1 = tl.dot(b_p, b_k1, b_acc1 * b_alpha[:, None], input_precision=DOT_PRECISION)
            b_acc2 = tl.dot(b_p, b_k2, b_acc2 * b_alpha[:, None], input_precision=DOT_PRECISION)
            b_acc3 = tl.dot(b_p, b_k3, b_acc3 * b_alpha[:, None], input_precision=DOT_PRECISION)
        m_any = b_l > 0.0
        b_den = tl.where(m_any, b_l, 1.0)[:, None]
        b_lse = tl.where(m_any, (b_m + tl.log2(tl.where(m_any, b_l, 1.0))) * LN2, float("-inf"))
        p_out = out_ptr + i_n * stride_on + o_h[:, None].to(tl.int64) * stride_oh + i_s * stride_os
        tl.store(p_out + o_c[None, :], b_acc0 / b_den, mask=m_h[:, None])
        tl.store(p_out + TILE + o_c[None, :], b_acc1 / b_den, mask=m_h[:, None])
        tl.store(p_out + 2 * TILE + o_c[None, :], b_acc2 / b_den, mask=m_h[:, None])
        tl.store(p_out + 3 * TILE + o_c[None, :], b_acc3 / b_den, mask=m_h[:, None])
    tl.store(lse_ptr + i_n * stride_ln + o_h * stride_lh + i_s * stride_ls, b_lse, mask=m_h)

"""Candidate variants of the DSA sparse MLA decode kernel (kernels_triton/dsa.py), kernel and launcher
side by side, to time against the default on the GPU (scripts/time_dsa_variants.py).

`fused`: every tile of selected rows is loaded once (by the pipeliner's asynchronous copies) and
serves both QK^T and PV: no deferred step, no second read of V. Optionally the value dimension is
split over V_SPLIT programs (each holds an accumulator [BLOCK_H, D_V / V_SPLIT] and computes the
whole QK^T itself: at V_SPLIT 2, (2*576 + 512) / (576 + 512) = 1.53x the matrix work, but a program
with 64 heads x 256 values fits 4 warps and 108 KiB, so 2 CTAs share an SM).
Results depend on the rows' order only: no atomics, fixed reduction order.
"""
import torch
import triton
import triton.language as tl

from kernels_triton.dsa import LN2, _sparse_mla_combine_kernel


@triton.jit
def _mla_fused_kernel(
    q_ptr, kv_ptr, rows_ptr, row_base_ptr, out_ptr, lse_ptr,
    stride_qn, stride_qh, stride_kv, stride_rn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
    stride_ls,
    H, K_SEL, CHUNK, qk_scale_log2,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    V_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_ROW_BASE: tl.constexpr,
):
    """BLOCK_H heads x one value slice (D_V / V_SPLIT columns) over one chunk of a request's rows.

    Program (head block * V_SPLIT + slice, n, split). QK^T is summed in the order rope, own slice,
    other slice: slice 1's logits may round differently from slice 0's, so only slice 0 stores lse
    (each slice's output is normalised by its own sum; all deterministic).
    """
    DVB: tl.constexpr = D_V // V_SPLIT
    i_hb = tl.program_id(0) // V_SPLIT  # the slices and head blocks of a request run together: rows in L2
    i_v = tl.program_id(0) % V_SPLIT
    i_n = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_own = i_v * DVB + tl.arange(0, DVB)          # this program's value columns
    o_oth = (1 - i_v) * DVB + tl.arange(0, DVB)    # the other slice's (V_SPLIT 2 only)
    o_r = D_V + tl.arange(0, D_ROPE)
    o_k = tl.arange(0, BLOCK_K)
    p_q = q_ptr + i_n * stride_qn + o_h[:, None].to(tl.int64) * stride_qh
    b_q_own = tl.load(p_q + o_own[None, :], mask=m_h[:, None], other=0.0)   # [BLOCK_H, DVB]
    b_q_rope = tl.load(p_q + o_r[None, :], mask=m_h[:, None], other=0.0)    # [BLOCK_H, D_ROPE]
    if V_SPLIT == 2:
        b_q_oth = tl.load(p_q + o_oth[None, :], mask=m_h[:, None], other=0.0)  # [BLOCK_H, DVB]
    p_rows = rows_ptr + i_n * stride_rn
    if HAS_ROW_BASE:
        kv_ptr += tl.load(row_base_ptr + i_n) * stride_kv

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_H, DVB], dtype=tl.float32)
    start = i_s * CHUNK
    end = tl.minimum(start + CHUNK, K_SEL)
    for j0 in range(start, end, BLOCK_K):
        o_j = j0 + o_k
        b_row = tl.load(p_rows + o_j, mask=o_j < end, other=-1)  # [BLOCK_K]
        m_j = b_row >= 0
        p_kv = kv_ptr + b_row[:, None].to(tl.int64) * stride_kv
        b_k = tl.load(p_kv + o_own[None, :], mask=m_j[:, None], other=0.0)   # [BLOCK_K, DVB]: K and V
        b_kr = tl.load(p_kv + o_r[None, :], mask=m_j[:, None], other=0.0)    # [BLOCK_K, D_ROPE]
        b_s = tl.dot(b_q_rope, tl.trans(b_kr), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_K]
        b_s = tl.dot(b_q_own, tl.trans(b_k), b_s, input_precision=DOT_PRECISION)
        if V_SPLIT == 2:
            b_ko = tl.load(p_kv + o_oth[None, :], mask=m_j[:, None], other=0.0)  # [BLOCK_K, DVB]
            b_s = tl.dot(b_q_oth, tl.trans(b_ko), b_s, input_precision=DOT_PRECISION)
        b_s = tl.where(m_j[None, :], b_s * qk_scale_log2, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no (-inf) - (-inf)
        b_alpha = tl.exp2(b_m - b_m_safe)
        b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BLOCK_H, BLOCK_K]
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = tl.dot(b_p.to(b_k.dtype), b_k, b_acc * b_alpha[:, None], input_precision=DOT_PRECISION)
        b_m = b_m_new

    m_any = b_l > 0.0
    b_out = b_acc / tl.where(m_any, b_l, 1.0)[:, None]  # [BLOCK_H, DVB]
    p_out = out_ptr + i_n * stride_on + o_h[:, None].to(tl.int64) * stride_oh + i_s * stride_os + o_own[None, :]
    tl.store(p_out, b_out, mask=m_h[:, None])
    b_lse = tl.where(m_any, (b_m + tl.log2(tl.where(m_any, b_l, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + i_n * stride_ln + o_h * stride_lh + i_s * stride_ls, b_lse,
             mask=m_h & (tl.full([BLOCK_H], i_v, tl.int32) == 0))


def _num_splits(batch: int, programs_per_request: int, k: int, block_k: int, ctas_per_sm: int,
                device: torch.device) -> int:
    """Split k until the grid roughly fills the GPU's CTA slots, keeping >= 4 tiles per split."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(sms * ctas_per_sm // max(1, batch * programs_per_request), k // (4 * block_k)))


def mla_decode_fused(q, kv, rows, row_base, sm_scale: float, d_v: int = 512, *, block_h: int = 64,
                     block_k: int = 16, v_split: int = 2, num_warps: int = 4, num_stages: int = 2,
                     ctas_per_sm: int = 2, num_splits: int | None = None) -> torch.Tensor:
    """out [N, H, d_v] (q's dtype) of `_mla_fused_kernel`; arguments as hisparse.dsa.sparse_mla_decode.

    `ctas_per_sm` only steers the default split count (how many programs fill the GPU).
    """
    assert v_split in (1, 2) and d_v % v_split == 0
    n, h, d = q.shape
    k = rows.shape[1]
    out = torch.empty((n, h, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((n, h), dtype=torch.float32, device=q.device)
    head_blocks = triton.cdiv(h, block_h)
    if num_splits is None:
        num_splits = _num_splits(n, head_blocks * v_split, k, block_k, ctas_per_sm, q.device)
    chunk = triton.cdiv(triton.cdiv(k, num_splits), block_k) * block_k
    splits = triton.cdiv(k, chunk)
    if splits == 1:
        part, part_lse, split_strides = out, lse, (0, 0)
    else:
        part = torch.empty((n, h, splits, d_v), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n, h, splits), dtype=torch.float32, device=q.device)
        split_strides = (part.stride(2), part_lse.stride(2))
    _mla_fused_kernel[(head_blocks * v_split, n, splits)](
        q, kv, rows, rows if row_base is None else row_base, part, part_lse,
        q.stride(0), q.stride(1), kv.stride(0), rows.stride(0), part.stride(0), part.stride(1),
        split_strides[0], part_lse.stride(0), part_lse.stride(1), split_strides[1],
        h, k, chunk, sm_scale * 1.4426950408889634,
        D_V=d_v, D_ROPE=d - d_v, BLOCK_H=block_h, BLOCK_K=block_k, V_SPLIT=v_split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_ROW_BASE=row_base is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _sparse_mla_combine_kernel[(n, h)](
            part, part_lse, out, lse,
            part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
            part_lse.stride(2), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            splits, D_V=d_v, BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
        )
    return out

"""Sparse MLA decode in Gluon (Triton 3.6's `triton.experimental.gluon`): the DSA decode kernel with its
QK^T computed once per tile on Hopper. `hisparse.dsa.ops.sparse_mla_decode` runs it where it applies
(`gluon_decode_unsupported` says why not elsewhere): an sm_90 GPU, bf16 / fp16, at least 64 heads,
512 + 64 wide rows; its launcher is `hisparse.dsa.ops.launch_gluon_decode`. Its SASS can be inspected
offline (experiments/tools/sass_dsa_gluon.py); it is checked against the torch reference on a GPU
(tests/test_dsa.py, marked gpu). Its time against the Triton kernel's: results/attention.csv.

Why
---
`kernels_triton/dsa.py`'s `_sparse_mla_decode_kernel` runs 64 query heads per program with 8 warps
(two warp groups: the fp32 accumulator 64 x 512 does not fit one warp group's registers). Triton
gives a dot that feeds another dot (through P) the one-axis warp layout, so both warp groups compute
the whole S = Q K^T of each tile (Nsight Compute: 72 HGMMA.64x32x16 per 64-row tile instead of 36),
and routing P through shared memory in plain Triton needs a block barrier, which turns Triton's
software pipelining off. Here the layouts, shared memory, barriers and copies are explicit.

Shapes (one program = head block `i_hb` of BLOCK_H = 64 heads, request n, split s)
---------------------------------------------------------------------------------
q [N, H, D] (D = D_V + D_ROPE = 512 + 64), kv [R, D], rows [N, k] int32 (-1 = skip),
row_base [N] int64 (optional), out [N, H, D_V] (or float32 partials [N, H, splits, D_V]),
lse [N, H] (or [N, H, splits]) float32.
Shared memory (bf16): Q nope 64 x 512 (64 KiB) + Q rope 64 x 64 (8 KiB), NUM_STAGES stages of
gathered rows [BLOCK_K, 512] + [BLOCK_K, 64] (BLOCK_K * 1152 B each), P 64 x BLOCK_K. BLOCK_K 64 with
2 stages: 224 KiB (one 72 KiB tile in flight); BLOCK_K 32 with 4 stages: 184 KiB (three 36 KiB tiles
in flight, at the price of 64x16x16 QK^T instructions).

Work split between the two warp groups (warps_per_cta [4, 2] in both MMA layouts)
--------------------------------------------------------------------------------
- S = Q K^T, [64, BLOCK_K]: warp group g computes the columns (rows of the tile)
  g * BLOCK_K/2 ... (g+1) * BLOCK_K/2: each tile's QK^T is computed once, split between the groups
  (36 HGMMA.64x32x16 per group per 64-row tile, both operands from shared memory, against the
  Triton kernel's 72 in each group). This differs from the FlashMLA-style split (warp group 0
  computes all of S while group 1 waits for P) but does the same tensor-core work, balanced.
- online softmax in the log2 domain: the row max reduces across the two groups (Gluon lowers the
  reduction through a little shared memory); the row sum is kept per thread (a [64, BLOCK_K] running
  sum rescaled like O) and reduced once after the loop, which was faster (results/notes/attention.md).
  P (bf16) is written to shared memory, fenced for the async proxy, then a block barrier.
- O += P V: each group owns a 64 x 256 fp32 accumulator (columns g*256 ... (g+1)*256 of V): A = P
  (shared, all of it), B = the tile's first D_V columns (shared). PV of tile i is issued without
  waiting, then (once tile i+1 has landed) QK^T of tile i+1 behind it, and the warps wait for both:
  the tensor cores run them back to back, without the barrier and copy issue between them
  (results/notes/attention.md).
- rows are gathered with cp.async (pointer tensors: rows[n, j] index kv) into a ring of NUM_STAGES
  buffers. Tile i + NUM_STAGES - 1 goes into the buffer of tile i - 1, so it is issued at the top of
  iteration i, after the barrier that follows PV(i-1)'s wait; with 2 stages it must have landed once
  PV(i) is issued, and the warps' wait for it overlaps PV(i) on the tensor cores. Rows -1 (and rows
  past the chunk's end) are masked copies (cp.async zero-fills them) and their logits are -inf.

Semantics are `_sparse_mla_decode_kernel`'s: output = acc / l (zeros without a valid row), lse in
natural log (-inf without a valid row), fp32 accumulation, rows read in order BLOCK_K at a time.
The accumulation order differs from the Triton kernel's (no bitwise equality between the two).

Only bf16 / fp16 on sm_90 with BLOCK_H = 64, 8 warps, written against Triton 3.6's Gluon (it
compiles there without spills, 224 KiB shared at BLOCK_K 64). The module imports under any Triton; where Gluon
or its Hopper API is missing, GLUON_IMPORT_ERROR says so. Under Triton 3.9 it imports but the kernel
does not build (Gluon's async_copy API changed), so `gluon_decode_unsupported` admits Triton 3.6 only.
"""
from __future__ import annotations

from kernels_triton.gluon_hopper import (  # noqa: F401  GLUON_IMPORT_ERROR: the launchers' reason
    GLUON_IMPORT_ERROR, gl, gluon, async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait,
)

BLOCK_H = 64      # heads per program: one wgmma M (64) per warp group
BLOCK_K = 64      # default rows per tile
NUM_STAGES = 2    # default ring of gathered tiles: NUM_STAGES - 1 in flight while one is computed
NUM_WARPS = 8     # two warp groups

if GLUON_IMPORT_ERROR is None:
    try:
        LN2 = gl.constexpr(0.6931471805599453)

        @gluon.constexpr_function
        def _nvmma_shared(shape, bitwidth):
            """NVMMA (wgmma-readable, swizzled) shared layout of a 2-D tile [rows, cols] of `bitwidth`."""
            inner = shape[-1] * bitwidth // 8
            swizzle = 128 if inner % 128 == 0 else 64 if inner % 64 == 0 else 32 if inner % 32 == 0 else 0
            return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=bitwidth, rank=2)

        @gluon.constexpr_function
        def _gather_layout(cols, num_warps):
            """Blocked layout of a [rows, cols] 16-bit tile: 16-byte vectors, a warp along a row's columns."""
            lanes_c = min(32, cols // 8)
            return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // lanes_c, lanes_c],
                                    warps_per_cta=[num_warps, 1], order=[1, 0])

        @gluon.jit
        def _gather_rows(kv_ptr, p_rows, j0, end, stride_kv, dst_smem,
                         COL0: gl.constexpr, COLS: gl.constexpr, BLOCK_K: gl.constexpr, layout: gl.constexpr):
            """cp.async kv[row, COL0:COL0+COLS] for rows[j0 : j0+BLOCK_K] (-1 or j >= end: zero-filled)."""
            o_j = j0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
            row = gl.load(p_rows + o_j, mask=o_j < end, other=-1)
            o_c = COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
            ptrs = kv_ptr + row[:, None].to(gl.int64) * stride_kv + o_c[None, :]
            async_copy.async_copy_global_to_shared(dst_smem, ptrs, mask=(row >= 0)[:, None])

        @gluon.jit
        def _sparse_mla_decode_gluon_kernel(
            q_ptr, kv_ptr, rows_ptr, row_base_ptr, out_ptr, lse_ptr,
            stride_qn, stride_qh, stride_kv, stride_rn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
            stride_ls,
            H, K_SEL, CHUNK, qk_scale_log2,
            D_V: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
            HAS_ROW_BASE: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
        ):
            """Same arguments (less DOT_PRECISION) and results as kernels_triton/dsa.py's
            `_sparse_mla_decode_kernel`; see the module docstring for the work split."""
            gl.static_assert(num_warps == 8, "two warp groups: warps_per_cta [4, 2]")
            gl.static_assert(BLOCK_H == 64, "one wgmma M of 64 rows per warp group")
            gl.static_assert(D_V // 2 <= 256, "a warp group's half of V must be one wgmma N (<= 256)")
            gl.static_assert(NUM_STAGES >= 2, "at least one tile in flight while one is computed")
            dtype: gl.constexpr = kv_ptr.dtype.element_ty
            bits: gl.constexpr = dtype.primitive_bitwidth

            # Register layouts. S [BLOCK_H, BLOCK_K] and O [BLOCK_H, D_V] both split their columns
            # between the two warp groups; their row distributions coincide, so row statistics move
            # from one to the other without data movement.
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                               instr_shape=[16, BLOCK_K // 2, 16])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                               instr_shape=[16, D_V // 2, 16])
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
            nope_reg: gl.constexpr = _gather_layout(D_V, num_warps)
            rope_reg: gl.constexpr = _gather_layout(D_ROPE, num_warps)

            # Shared memory: Q (read by every tile's QK^T), two stages of gathered rows, P.
            q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], _nvmma_shared([BLOCK_H, D_V], bits))
            q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], _nvmma_shared([BLOCK_H, D_ROPE], bits))
            k_nope = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, D_V], _nvmma_shared([BLOCK_K, D_V], bits))
            k_rope = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, D_ROPE],
                                               _nvmma_shared([BLOCK_K, D_ROPE], bits))
            p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_K], _nvmma_shared([BLOCK_H, BLOCK_K], bits))

            i_hb = gl.program_id(0)  # fastest: the head blocks of a request share its rows in L2
            i_n = gl.program_id(1).to(gl.int64)
            i_s = gl.program_id(2)
            p_rows = rows_ptr + i_n * stride_rn
            if HAS_ROW_BASE:
                kv_ptr += gl.load(row_base_ptr + i_n) * stride_kv
            start = i_s * CHUNK
            end = gl.minimum(start + CHUNK, K_SEL)
            n_tiles = gl.cdiv(end - start, BLOCK_K)

            # Q (heads past H zero-filled) and tile 0 as one copy group, then tiles 1 ... NUM_STAGES-2, a
            # group each (a group is committed even when empty, so that wait_group counts tiles).
            o_hn = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, nope_reg))
            o_vn = gl.arange(0, D_V, layout=gl.SliceLayout(0, nope_reg))
            p_qn = q_ptr + i_n * stride_qn + o_hn[:, None].to(gl.int64) * stride_qh + o_vn[None, :]
            async_copy.async_copy_global_to_shared(q_nope, p_qn, mask=(o_hn < H)[:, None])
            o_hr = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rope_reg))
            o_rr = D_V + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rope_reg))
            p_qr = q_ptr + i_n * stride_qn + o_hr[:, None].to(gl.int64) * stride_qh + o_rr[None, :]
            async_copy.async_copy_global_to_shared(q_rope, p_qr, mask=(o_hr < H)[:, None])
            for t in gl.static_range(NUM_STAGES - 1):
                if t < n_tiles:
                    _gather_rows(kv_ptr, p_rows, start + t * BLOCK_K, end, stride_kv, k_nope.index(t), 0, D_V,
                                 BLOCK_K, nope_reg)
                    _gather_rows(kv_ptr, p_rows, start + t * BLOCK_K, end, stride_kv, k_rope.index(t), D_V, D_ROPE,
                                 BLOCK_K, rope_reg)
                async_copy.commit_group()

            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
            l_part = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)  # row sums, reduced at the end
            acc = gl.zeros([BLOCK_H, D_V], gl.float32, layout=o_layout)
            s_zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)
            o_kc = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))

            # S of tile 0 (for n_tiles == 0 it reads unwritten shared memory and is never used).
            async_copy.wait_group(NUM_STAGES - 2)
            fence_async_shared()
            gl.thread_barrier()
            s_tok = warpgroup_mma(q_rope, k_rope.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_tok = warpgroup_mma(q_nope, k_nope.index(0).permute((1, 0)), s_tok, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
            for i in range(n_tiles):
                # Here S = Q K^T of tile i is in registers and PV of tile i-1 is done in this warp group.
                j0 = start + i * BLOCK_K
                stage = i % NUM_STAGES
                o_j = j0 + o_kc
                row = gl.load(p_rows + o_j, mask=o_j < end, other=-1)
                # Every warp is past PV(i-1): P and stage (i-1) % NUM_STAGES may be overwritten.
                gl.thread_barrier()
                if i + NUM_STAGES - 1 < n_tiles:  # prefetch tile i + NUM_STAGES - 1 into that stage
                    j_pre = j0 + (NUM_STAGES - 1) * BLOCK_K
                    s_pre = (i + NUM_STAGES - 1) % NUM_STAGES
                    _gather_rows(kv_ptr, p_rows, j_pre, end, stride_kv, k_nope.index(s_pre), 0, D_V, BLOCK_K,
                                 nope_reg)
                    _gather_rows(kv_ptr, p_rows, j_pre, end, stride_kv, k_rope.index(s_pre), D_V, D_ROPE, BLOCK_K,
                                 rope_reg)
                async_copy.commit_group()

                # Online softmax, log2 domain. The row max reduces across the two warp groups; the row
                # sum does not: each thread keeps its own elements' running sums (rescaled by alpha
                # like the output), summed once after the loop.
                s = gl.where((row >= 0)[None, :], s * qk_scale_log2, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, axis=1))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf)
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(s - m_safe[:, None])
                l_part = l_part * alpha[:, None] + p
                m_i = m_new

                # P to shared memory for both warp groups, then O = O * alpha + P V (own half of V),
                # issued without waiting: S of tile i+1 is issued behind it, so the tensor cores run
                # the two back to back while the warps wait for both.
                p_smem.store(p.to(dtype))
                fence_async_shared()
                gl.thread_barrier()
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                acc_tok = warpgroup_mma(p_smem, k_nope.index(stage), acc, is_async=True)
                if i + 1 < n_tiles:
                    # tile i+1 landed (this thread's copies) and is visible to every warp and to wgmma
                    async_copy.wait_group(NUM_STAGES - 2)
                    fence_async_shared()
                    gl.thread_barrier()
                    nxt = (i + 1) % NUM_STAGES
                    s_tok = warpgroup_mma(q_rope, k_rope.index(nxt).permute((1, 0)), s_zero, use_acc=False,
                                          is_async=True)
                    s_tok = warpgroup_mma(q_nope, k_nope.index(nxt).permute((1, 0)), s_tok, is_async=True)
                    s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, acc_tok))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
            async_copy.wait_group(0)  # the last (empty) groups
            l_i = gl.sum(l_part, axis=1)

            m_any = l_i > 0.0
            l_safe = gl.where(m_any, l_i, 1.0)
            lse = gl.where(m_any, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
            out = acc / gl.convert_layout(l_safe, row_o)[:, None]
            o_ho = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_o)
            o_vo = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
            p_out = (out_ptr + i_n * stride_on + o_ho[:, None].to(gl.int64) * stride_oh + i_s * stride_os
                     + o_vo[None, :])
            gl.store(p_out, out.to(out_ptr.dtype.element_ty), mask=(o_ho < H)[:, None])
            o_hl = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_s)
            gl.store(lse_ptr + i_n * stride_ln + o_hl * stride_lh + i_s * stride_ls, lse, mask=o_hl < H)
    except Exception as exc:  # noqa: BLE001 - a Gluon whose API differs: the module still imports
        GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

if GLUON_IMPORT_ERROR is not None:
    _sparse_mla_decode_gluon_kernel = None



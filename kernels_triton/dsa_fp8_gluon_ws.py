"""Sparse MLA decode over DSA's 656-byte FP8 rows in Gluon with a producer warp group (warp specialised), a
prototype of issue 36 beside kernels_triton/dsa_fp8_gluon.py: the same arguments, outputs and, meant bit for
bit, values; launcher, offline check, smoke test and timing in experiments/tools/gluon_fp8_ws.py until it is
measured on a GPU.

Why
---
In the Gluon FP8 kernel the two warp groups that run the matrix math also dequantise (255 registers, one
program an SM), so the conversion adds to each tile's time instead of hiding behind the tensor cores: 0.31
of the roofline against the bf16 Gluon kernel's 0.41 over the same math. Here a third warp group converts
tile i + 1 into a second K buffer while the two others compute tile i, as FlashMLA's sparse FP8 decode
does; the consumers' loop is then the bf16 kernel's, waiting on a barrier instead of converting.

Partitions (Gluon `warp_specialize`: setmaxnreg gives the producer PRODUCER_REGS registers, or
PRODUCER_REGS_OVERLAP with OVERLAP, and the consumers the rest)
--------------------------------------------------------------------------------------------
- consumers, 8 warps (the default partition; warps_per_cta [4, 2] in both MMA layouts, as dsa_gluon.py):
  per tile i, wait `full[i % 2]`, S = Q K(i)^T (RoPE dims first, then the four 128-column blocks, one
  accumulator chain: the Gluon FP8 kernel's order), online softmax in the log2 domain (row sums per row,
  warp group and lane: `_thread_sums`), P to shared memory, O = O * alpha + P V(i), wait, arrive
  `empty[i % 2]`.
  With OVERLAP (constexpr, default False) the consumers issue S(i + 1) = Q K(i + 1)^T before tile i's
  softmax, so the tensor cores work while it runs (the wgmma groups complete in order, so waiting for
  all but the newest, PV(i), gives S(i + 1)); the same operations on the same values, the same bits.
  But with two K buffers the consumers then hold both from softmax(i) to PV(i)'s end, so the producer
  converts tile i + 2 only after that and the next trip waits for it: the producer's work and the
  consumers' alternate instead of running side by side. Which costs less is for the GPU to say.
- producer, 4 warps: per tile i (its row ids loaded a tile ahead), load the e4m3 bytes and scales of two
  128-column blocks at a time from global memory into registers (-1 rows and rows past the chunk:
  zeros; the first two before waiting `empty[i % 2]`, the consumers being done with tile i - 2),
  convert (`_dequant`, the Gluon FP8 kernel's) and store to K nope; the RoPE dims as stored; fence,
  arrive `full[i % 2]`.
A Gluon `mbarrier.arrive` is one arrival, by thread 0 of its partition, so every barrier counts 1; the
partition's `gl.thread_barrier()` before it puts all its warps' work first. `empty` starts as if complete
(the producer waits parity 1 of a fresh barrier, which returns at once).

Shapes (one program = head block `i_hb` of BLOCK_H = 64 heads, request n, split s), as dsa_fp8_gluon.py
----------------------------------------------------------------------------------------------------
q [N, H, 576] bf16; kv uint8 [R, 656] as three views (kv8 e4m3, kv32 float32, kv16 bf16); rows [N, k]
int32 (-1 = skip); row_base [N] int64 (optional); out [N, H, 512] bf16 (or float32 partials [N, H,
splits, 512]); lse [N, H] (or [N, H, splits]) float32.
Shared memory: Q nope 64 x 512 bf16 (64 KiB) + rope 64 x 64 (8 KiB); K nope [2, 64, 512] bf16 (128 KiB) +
rope [2, 64, 64] (16 KiB); P 64 x 64 (8 KiB); 4 mbarriers: 224 KiB. (No raw-byte ring: the producer
reads global memory into registers, which is what frees the room for a second K buffer.)

bf16 q only, 512 + 64 rows, >= 64 heads, sm_90a, Triton 3.6.
"""
from __future__ import annotations

from kernels_triton.dsa_fp8_gluon import (  # noqa: F401 -- the shapes are the Gluon FP8 kernel's
    BLOCK_H, BLOCK_K, D_ROPE, D_V, GLUON_IMPORT_ERROR, ROPE_HALF, SCALE_WORD, TILE,
)

NUM_WARPS = 8             # the consumers (the default partition); the producer adds PRODUCER_WARPS
PRODUCER_WARPS = 4
PRODUCER_REGS = 120       # a producer thread's registers (setmaxnreg); the consumers get 192
PRODUCER_REGS_OVERLAP = 72  # with OVERLAP: the consumers need 216 to hold S(i + 1) beside S(i) without a spill
NUM_BUFFERS = 2           # K tiles: tile i + 1 converted while tile i is computed

if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    from kernels_triton.dsa_fp8_gluon import (
        _D_ROPE,
        _D_V,
        _ROPE_HALF,
        _SCALE_WORD,
        _TILE,
        LN2,
        _dequant,
        _nvmma_shared,
        _qk_block,
        _row_lanes_layout,
        _thread_sums,
        _vector_layout,
    )

    _BLOCK_H = gl.constexpr(BLOCK_H)
    _BLOCK_K = gl.constexpr(BLOCK_K)
    _PRODUCER_WARPS = gl.constexpr(PRODUCER_WARPS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)
    _PRODUCER_REGS_OVERLAP = gl.constexpr(PRODUCER_REGS_OVERLAP)

    @gluon.jit
    def _prefetch_rows_l2(ptrs):
        """cp.async.bulk.prefetch.L2 of the 656 bytes at each of ptrs [BLOCK_K] (SliceLayout(1) of the producer's
        `_row_lanes_layout`: lanes 0-7 hold distinct rows, the other 24 the same ones, so only they issue)."""
        return gl.inline_asm_elementwise(
            asm="""{
            .reg .pred p;
            .reg .b32 l;
            mov.u32 l, %laneid;
            setp.lt.u32 p, l, 8;
            @p cp.async.bulk.prefetch.L2.global [$1], 656;
            mov.u32 $0, 0;
            }""",
            constraints="=r,l", args=[ptrs], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _prefetch_lines_l2_2(ptrs, ptrs2):
        """prefetch.global.L2 of two 128-byte lines per element: ptrs [BLOCK_K, 4] (row r's start + j * 128)
        covers byte j * 128 and byte min(512 + j * 128, 655) of each row, so the four cover every line a
        656-byte row touches."""
        return gl.inline_asm_elementwise(
            asm="""{
            prefetch.global.L2 [$1];
            prefetch.global.L2 [$2];
            mov.u32 $0, 0;
            }""",
            constraints="=r,l,l", args=[ptrs, ptrs2], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _produce(kv8_ptr, kv32_ptr, kv16_ptr, p_rows, start, end, n_tiles, STRIDE16, k_nope, k_rope, full, empty,
                 PROBE: gl.constexpr, PREFETCH: gl.constexpr):
        """The producer partition: every tile of the chunk dequantised into K buffer i % 2 (module docstring)."""
        deq_l: gl.constexpr = _row_lanes_layout(_TILE, 8, _PRODUCER_WARPS)     # [BLOCK_K, 128] e4m3: 4 x 16 B a thread
        rope_l: gl.constexpr = _vector_layout(_D_ROPE, 16, _PRODUCER_WARPS)    # [BLOCK_K, 64] bf16: 4 x 16 B a thread
        o_k = gl.arange(0, _BLOCK_K, layout=gl.SliceLayout(1, deq_l))
        o_c = gl.arange(0, _TILE, layout=gl.SliceLayout(0, deq_l))
        o_kr = gl.arange(0, _BLOCK_K, layout=gl.SliceLayout(1, rope_l))
        o_r = _ROPE_HALF + gl.arange(0, _D_ROPE, layout=gl.SliceLayout(0, rope_l))
        # each tile's row ids are loaded a tile ahead, so its data loads need not wait for them (two layouts'
        # copies: converting one to the other would take scratch shared memory)
        next_row = gl.load(p_rows + start + o_k, mask=start + o_k < end, other=-1)
        next_row_r = gl.load(p_rows + start + o_kr, mask=start + o_kr < end, other=-1)
        for i in range(n_tiles):
            b = i % 2
            row, row_r = next_row, next_row_r
            if PROBE == 1:            # timing probe: every tile reads tile 0's rows (cache hits), wrong values
                row = gl.load(p_rows + start + o_k, mask=start + o_k < end, other=-1)
                row_r = gl.load(p_rows + start + o_kr, mask=start + o_kr < end, other=-1)
            j1 = start + (i + 1) * _BLOCK_K
            next_row = gl.load(p_rows + j1 + o_k, mask=j1 + o_k < end, other=-1)
            next_row_r = gl.load(p_rows + j1 + o_kr, mask=j1 + o_kr < end, other=-1)
            if PREFETCH == 3:
                j2 = j1 + _BLOCK_K
                pf2_row = gl.load(p_rows + j2 + o_k, mask=j2 + o_k < end, other=-1)
            valid = row >= 0
            p_row = kv8_ptr + (row.to(gl.int64) * STRIDE16 * 16)[:, None] + o_c[None, :]
            p_scale = kv32_ptr + row.to(gl.int64) * STRIDE16 * 4 + _SCALE_WORD
            rope = gl.load(kv16_ptr + (row_r.to(gl.int64) * STRIDE16 * 8)[:, None] + o_r[None, :],
                           mask=(row_r >= 0)[:, None], other=0.0)
            # two blocks' bytes in flight at a time ([BLOCK_K, 128] e4m3 and [BLOCK_K] scales each), the first two
            # before waiting for the buffer
            k_tile = k_nope.index(b)                                   # [BLOCK_K, 512] bf16, block c at c * 128
            for h in gl.static_range(2):
                xa = gl.load(p_row + 2 * h * _TILE, mask=valid[:, None], other=0.0)
                xb = gl.load(p_row + (2 * h + 1) * _TILE, mask=valid[:, None], other=0.0)
                sa = gl.load(p_scale + 2 * h, mask=valid, other=0.0)
                sb = gl.load(p_scale + 2 * h + 1, mask=valid, other=0.0)
                if h == 0:
                    mbarrier.wait(empty.index(b), ((i // 2) & 1) ^ 1)    # the consumers are done with tile i - 2
                    k_rope.index(b).store(rope)
                if PREFETCH == 1 and h == 1:   # tile i + 1's rows into L2 (row -1: row 0, read by nobody); the
                    # asm's zero added to the row ids, or the unused asm would be dropped
                    next_row += _prefetch_rows_l2(kv8_ptr + gl.maximum(next_row, 0).to(gl.int64) * STRIDE16 * 16)
                if PREFETCH >= 2 and h == 1:   # 2: tile i + 1's rows; 3: tile i + 2's
                    pf_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[8, 4],
                                                          warps_per_cta=[_PRODUCER_WARPS, 1], order=[0, 1])
                    if PREFETCH == 3:
                        pf_row = gl.convert_layout(gl.maximum(pf2_row, 0), gl.SliceLayout(1, pf_l))
                    else:
                        pf_row = gl.convert_layout(gl.maximum(next_row, 0), gl.SliceLayout(1, pf_l))
                    o_j = gl.arange(0, 4, layout=gl.SliceLayout(0, pf_l))
                    base = kv8_ptr + (pf_row.to(gl.int64) * STRIDE16 * 16)[:, None]
                    zero = _prefetch_lines_l2_2(base + o_j[None, :] * 128, base + gl.minimum(512 + o_j * 128, 655)[None, :])
                    next_row += gl.convert_layout(gl.max(zero, axis=1), next_row.type.layout)
                if PROBE == 2:        # timing probe: every byte loaded, half the blocks converted and stored
                    bits = xa.to(gl.uint8, bitcast=True) ^ xb.to(gl.uint8, bitcast=True)
                    k_tile.slice(2 * h * _TILE, _TILE, dim=1).store(_dequant(bits.to(xa.dtype, bitcast=True), sa + sb))
                else:
                    k_tile.slice(2 * h * _TILE, _TILE, dim=1).store(_dequant(xa, sa))
                    k_tile.slice((2 * h + 1) * _TILE, _TILE, dim=1).store(_dequant(xb, sb))
            fence_async_shared()                                   # the stores, visible to wgmma
            gl.thread_barrier()                       # every producer warp's stores, before thread 0 arrives
            mbarrier.arrive(full.index(b))

    @gluon.jit
    def _issue_qk(q_nope, q_rope, k_nope, k_rope, b, s_zero):
        """Issue S = Q K^T of K buffer b (async): the RoPE dims, then the four 128-column blocks, one chain (the
        Gluon FP8 kernel's order)."""
        s_tok = warpgroup_mma(q_rope, k_rope.index(b).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        for c in gl.static_range(_D_V // _TILE):
            s_tok = _qk_block(q_nope, k_nope.index(b), c, s_tok)
        return s_tok

    @gluon.jit
    def _softmax(s, row, m_i, l_thr, qk_scale_log2):
        """One tile's online softmax in the log2 domain (the Gluon FP8 kernel's): S [BLOCK_H, BLOCK_K] with -1 rows
        -inf, the running max m_i [BLOCK_H] and the per-thread row sums l_thr [BLOCK_H, 2, 4] -> (P, alpha, m_i,
        l_thr)."""
        s = gl.where((row >= 0)[None, :], s * qk_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        alpha_thr: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, l_thr.type.layout))
        l_thr = l_thr * gl.convert_layout(alpha, alpha_thr)[:, None, None] + _thread_sums(p)
        return p, alpha, m_new, l_thr

    @gluon.jit
    def _issue_pv(p, alpha, acc, p_smem, k_tile):
        """P to shared memory (both groups are past the previous PV, so it is free), then O = O * alpha + P V
        issued async: its token."""
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
        return warpgroup_mma(p_smem, k_tile, acc, is_async=True)

    @gluon.jit
    def _consume(q_nope, q_rope, k_nope, k_rope, p_smem, full, empty, p_rows, start, end, n_tiles, qk_scale_log2,
                 out_ptr, lse_ptr, i_hb, i_n, i_s, H, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                 stride_ls, OVERLAP: gl.constexpr):
        """The consumer partition (8 warps): the tile loop of the Gluon FP8 kernel without its dequantisation,
        then out and lse (module docstring)."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, _BLOCK_K // 2, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, _D_V // 2, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        m_i = gl.full([_BLOCK_H], float("-inf"), gl.float32, layout=row_s)
        acc = gl.zeros([_BLOCK_H, _D_V], gl.float32, layout=o_layout)
        s_zero = gl.zeros([_BLOCK_H, _BLOCK_K], gl.float32, layout=s_layout)
        l_thr = _thread_sums(s_zero)                                 # [BLOCK_H, 2, 4]: 2 registers a thread
        o_kc = gl.arange(0, _BLOCK_K, layout=gl.SliceLayout(0, s_layout))
        if OVERLAP:
            # S(i + 1) on the tensor cores while softmax(i) runs: S(0) first, then each trip issues the next
            # tile's QK^T (a placeholder token on the last) before its own softmax and PV
            s = s_zero
            if n_tiles > 0:
                mbarrier.wait(full.index(0), 0)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(_issue_qk(q_nope, q_rope, k_nope, k_rope, 0, s_zero), ))
            for i in range(n_tiles):
                b = i % 2
                o_j = start + i * _BLOCK_K + o_kc
                row = gl.load(p_rows + o_j, mask=o_j < end, other=-1)
                s_next = warpgroup_mma_init(s_zero)
                if i + 1 < n_tiles:
                    mbarrier.wait(full.index(1 - b), ((i + 1) // 2) & 1)
                    s_next = _issue_qk(q_nope, q_rope, k_nope, k_rope, 1 - b, s_zero)
                p, alpha, m_i, l_thr = _softmax(s, row, m_i, l_thr, qk_scale_log2)
                acc_tok = _issue_pv(p, alpha, acc, p_smem, k_nope.index(b))
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, ))   # QK^T(i + 1): committed before PV(i)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
                gl.thread_barrier()                   # both groups are done with K(i) and P
                mbarrier.arrive(empty.index(b))
        else:
            for i in range(n_tiles):
                b = i % 2
                o_j = start + i * _BLOCK_K + o_kc
                row = gl.load(p_rows + o_j, mask=o_j < end, other=-1)
                mbarrier.wait(full.index(b), (i // 2) & 1)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(_issue_qk(q_nope, q_rope, k_nope, k_rope, b, s_zero), ))
                p, alpha, m_i, l_thr = _softmax(s, row, m_i, l_thr, qk_scale_log2)
                acc_tok = _issue_pv(p, alpha, acc, p_smem, k_nope.index(b))
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
                gl.thread_barrier()                   # both groups are done with K(i) and P
                mbarrier.arrive(empty.index(b))
        l_i = gl.convert_layout(gl.sum(gl.sum(l_thr, axis=2), axis=1), row_s)   # lanes, then groups

        m_any = l_i > 0.0
        l_safe = gl.where(m_any, l_i, 1.0)
        lse = gl.where(m_any, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        out = acc / gl.convert_layout(l_safe, row_o)[:, None]
        o_ho = i_hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=row_o)
        o_vo = gl.arange(0, _D_V, layout=gl.SliceLayout(0, o_layout))
        p_out = (out_ptr + i_n * stride_on + o_ho[:, None].to(gl.int64) * stride_oh + i_s * stride_os
                 + o_vo[None, :])
        gl.store(p_out, out.to(out_ptr.dtype.element_ty), mask=(o_ho < H)[:, None])
        o_hl = i_hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=row_s)
        gl.store(lse_ptr + i_n * stride_ln + o_hl * stride_lh + i_s * stride_ls, lse, mask=o_hl < H)

    @gluon.jit
    def _sparse_mla_decode_fp8_ws_kernel(
        q_ptr, kv8_ptr, kv32_ptr, kv16_ptr, rows_ptr, row_base_ptr, out_ptr, lse_ptr,
        stride_qn, stride_qh, STRIDE16, stride_rn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
        stride_ls,
        H, K_SEL, CHUNK, qk_scale_log2,
        BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, HAS_ROW_BASE: gl.constexpr, NUM_STAGES: gl.constexpr,
        num_warps: gl.constexpr, OVERLAP: gl.constexpr = False, PROBE: gl.constexpr = 0,
        PREFETCH: gl.constexpr = 1,
    ):
        """`_sparse_mla_decode_fp8_gluon_kernel`'s arguments and semantics (NUM_STAGES: K buffers, 2), with a
        producer warp group (the module docstring)."""
        gl.static_assert(num_warps == 8, "two consumer warp groups: warps_per_cta [4, 2]")
        gl.static_assert(BLOCK_H == 64, "one wgmma M of 64 rows per warp group")
        gl.static_assert(BLOCK_K == 64, "the producer's layouts are written for 64-row tiles")
        gl.static_assert(NUM_STAGES == 2, "two K buffers")
        dtype: gl.constexpr = gl.bfloat16
        nope_reg: gl.constexpr = _vector_layout(_D_V, 16, num_warps)
        rope_reg: gl.constexpr = _vector_layout(_D_ROPE, 16, num_warps)

        q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, _D_V], _nvmma_shared([BLOCK_H, _D_V], 16))
        q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, _D_ROPE], _nvmma_shared([BLOCK_H, _D_ROPE], 16))
        k_nope = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, _D_V], _nvmma_shared([BLOCK_K, _D_V], 16))
        k_rope = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, _D_ROPE], _nvmma_shared([BLOCK_K, _D_ROPE], 16))
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_K], _nvmma_shared([BLOCK_H, BLOCK_K], 16))
        full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(NUM_STAGES):
            mbarrier.init(full.index(b), count=1)
            mbarrier.init(empty.index(b), count=1)

        i_hb = gl.program_id(0)  # fastest: the head blocks of a request share its rows in L2
        i_n = gl.program_id(1).to(gl.int64)
        i_s = gl.program_id(2)
        p_rows = rows_ptr + i_n * stride_rn
        if HAS_ROW_BASE:
            base = gl.load(row_base_ptr + i_n) * STRIDE16
            kv8_ptr += base * 16
            kv32_ptr += base * 4
            kv16_ptr += base * 8
        start = i_s * CHUNK
        end = gl.minimum(start + CHUNK, K_SEL)
        n_tiles = gl.cdiv(end - start, BLOCK_K)

        # Q (heads past H zero-filled), before the partitions fork (the producer's warps wait here)
        o_hn = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, nope_reg))
        o_vn = gl.arange(0, _D_V, layout=gl.SliceLayout(0, nope_reg))
        p_qn = q_ptr + i_n * stride_qn + o_hn[:, None].to(gl.int64) * stride_qh + o_vn[None, :]
        async_copy.async_copy_global_to_shared(q_nope, p_qn, mask=(o_hn < H)[:, None])
        o_hr = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rope_reg))
        o_rr = _D_V + gl.arange(0, _D_ROPE, layout=gl.SliceLayout(0, rope_reg))
        p_qr = q_ptr + i_n * stride_qn + o_hr[:, None].to(gl.int64) * stride_qh + o_rr[None, :]
        async_copy.async_copy_global_to_shared(q_rope, p_qr, mask=(o_hr < H)[:, None])
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()

        regs: gl.constexpr = _PRODUCER_REGS_OVERLAP if OVERLAP else _PRODUCER_REGS
        gl.warp_specialize([
            (_consume, (q_nope, q_rope, k_nope, k_rope, p_smem, full, empty, p_rows, start, end, n_tiles,
                        qk_scale_log2, out_ptr, lse_ptr, i_hb, i_n, i_s, H, stride_on, stride_oh, stride_os,
                        stride_ln, stride_lh, stride_ls, OVERLAP)),
            (_produce, (kv8_ptr, kv32_ptr, kv16_ptr, p_rows, start, end, n_tiles, STRIDE16, k_nope, k_rope, full,
                        empty, PROBE, PREFETCH)),
        ], [_PRODUCER_WARPS], [regs])
else:
    _sparse_mla_decode_fp8_ws_kernel = None

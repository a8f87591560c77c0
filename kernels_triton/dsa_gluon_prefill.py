"""Sparse MLA for DSA's prefill in Gluon (Triton 3.6's `triton.experimental.gluon`), for Hopper: each query
token's 128 heads attend to that token's own selected rows, as the decode kernel (kernels_triton/dsa_gluon.py)
does, but with three warp groups in FlashMLA's sparse prefill schedule: two consumer groups that each own
whole tiles' QK^T and softmax and exchange P, and a producer group that gathers the rows. Launcher:
`sparse_mla_prefill_gluon` / `launch_gluon_prefill` below; DSA's absorbed prefill (`hisparse.dsa.model`) runs
it over bf16 rows where `prefill_unsupported` says it can and the decode backend is "auto". Offline compile:
`experiments/tools/sass_dsa_gluon.py --prefill`; checked against the torch reference on a GPU
(tests/test_dsa.py, marked gpu); its time against the decode kernel's: results/notes/prefill.md.

Why
---
The prefill runs the decode kernel over N = prompt tokens (about 353 TFLOP/s at N 4096 on an H200). Its
two warp groups split every tile's QK^T by columns (64 x 32 wgmmas with both operands in shared memory,
which read 3 KiB of shared memory per 16 cycles of math: bound by shared-memory bandwidth, not the tensor
cores), reduce the row max across groups through shared memory, and meet at a block barrier around P every
tile, so the softmax of both groups runs while the tensor cores wait. Here each consumer group owns a whole
tile (64 x 64 wgmmas, math and operand bandwidth balanced), only the row max and P cross between groups,
through mbarriers, and one group's softmax runs while the other's matrix math does.

Shapes (one program = head block `i_hb` of BLOCK_H = 64 heads, query n, split s)
--------------------------------------------------------------------------------
q [N, H, D] (D = D_V + D_ROPE = 512 + 64), kv [R, D] (any row stride), rows [N, k] int32 (-1 = skip),
row_base [N] int64 (optional), out [N, H, D_V] (or float32 partials [N, H, splits, D_V]), lse [N, H] (or
[N, H, splits]) float32: the decode kernel's arguments and results.

Partitions (`gl.warp_specialize`, 12 warps; setmaxnreg: WG1 CONSUMER_REGS, the producer PRODUCER_REGS,
WG0 what is left of the 64K)
------------------------------------------------------------------------------------------------------
The chunk's rows go by rounds of two 64-row tiles: tile a = 2r in K buffer 0, tile b = 2r + 1 in buffer 1.
Each buffer is held as three shared tiles, left (latent columns 0-255), right (256-511) and rope (512-575),
with a `ready` and a `free` mbarrier for the left part and for the right part + rope.
- WG0 (the default partition, 4 warps): S_a = Q K_a^T (left first, then right and rope, as they land),
  online softmax in the log2 domain from the running max m: m_a = max(m, rowmax S_a), P_a = exp2(S_a - m_a);
  m_a to shared memory (`xbar` M0); O_L = O_L * alpha + P_a V_a[:, :256] with P_a from registers; frees
  buffer 0's left part; waits for WG1's m_b (M1), rescales P_a by exp2(m_a - m_b) into shared memory (in
  buffer 0's rope tile, which no one reads again this round: P0) and O_L and its row sums likewise; waits for
  P_b (P1); O_L += P_b V_b[:, :256], with S of tile a + 2 issued behind it (its left part, then, once that
  PV is done and buffer 1's left part freed, its right part and rope).
- WG1 (worker, 4 warps): S_b = Q K_b^T (right part and rope first, then left), waits for m_a (M0),
  m_b = max(m_a, rowmax S_b), P_b = exp2(S_b - m_b), rescales O_R; m_b to shared memory (M1);
  O_R += P_b V_b[:, 256:] from registers; P_b to shared memory (P1); waits for P_a (P0);
  O_R += P_a V_a[:, 256:]; frees buffer 1's right part, then buffer 0's right part (and the P0 tile).
- producer (worker, 4 warps): per round, each round's row ids loaded first, then in the order the
  consumers need them: buffer 0 left (tile a), buffer 1 right + rope (tile b), buffer 0 right + rope,
  buffer 1 left, each after its `free` wait, as cp.async (rows -1 or past the chunk zero-filled), each
  thread's copies then completing the part's `ready` barrier (`cp.async.mbarrier.arrive.noinc`, 128
  arrivals).
After the loop the groups exchange their row sums (L0, L1) and each writes its 256 columns of out (WG1 lse).
Per round and group: QK^T 36 HGMMA.64x64x16, PV 8 HGMMA.64x256x16 (4 from registers, 4 from shared memory).

Barriers (each mbarrier and each row-statistic slot its own allocation: Triton orders accesses to one
allocation by different threads with a barrier, needed or not): `ready` (4, count 128: the producer's
threads), `free` (4, count 1), `xbar` (6, count 1: M0, M1, P0, P1, L0, L1). A Gluon `mbarrier.arrive` is one
arrival by the partition's thread 0 between two named barriers over the partition's 4 warps (Triton 3.6's
lowering), so all its warps' stores and wgmma waits come first; `_arrive` says so with a
`gl.thread_barrier()` of its own (merged with the lowering's). Each barrier completes once a round, in an
order each waiter's previous wait precedes (checked in the comments below), so parity r & 1 names the phase;
the producer waits `free` at parity (r & 1) ^ 1 (a fresh barrier's parity 1 returns at once).

Shared memory: Q 64 x 576 bf16 (72 KiB), two K buffers 64 x 576 (144 KiB), P1 64 x 64 (8 KiB; P0 lives in
buffer 0's rope tile), row maxima and sums 2 x 2 x 64 float32 (1 KiB), 14 mbarriers: 225 KiB of 227.

Compiled offline (sm_90a, Triton 3.6; `python -m experiments.tools.sass_dsa_gluon --prefill`): WG0 232
registers, WG1 208, the producer 64, no spills. The consumers index every shared tile they hand to wgmma with
`_opaque_zero`, so its descriptors are computed in the loop: as loop invariants (72 of them) LLVM hoisted them
and ptxas spilled them.

Semantics are the decode kernel's: out = acc / l (zeros without a valid row), lse in natural log (-inf
without a valid row), fp32 accumulation; the same operations in the same order on every launch, so the
same bits for the same inputs. The accumulation order differs from the decode kernel's (the row maxima
run tile pair by tile pair; O_R takes P_a as rounded to bf16 for O_L, times exp2(m_a - m_b), rounded
again), so it is not bitwise that kernel, only within bf16 rounding of it.

bf16 q and rows, D_V 512 + D_ROPE 64, BLOCK_H 64 (H a multiple of 64 is the intended case; heads past H
are zero-filled and not stored), sm_90a, Triton 3.6; where Gluon or its Hopper API is missing,
GLUON_IMPORT_ERROR says so (the module still imports).
"""
from __future__ import annotations

from kernels_triton.gluon_hopper import (  # noqa: F401  GLUON_IMPORT_ERROR: the launchers' reason
    GLUON_IMPORT_ERROR, gl, gluon, async_copy, fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

BLOCK_H = 64          # heads per program: one wgmma M (64) per consumer warp group
BLOCK_K = 64          # rows per tile
NUM_STAGES = 2        # K buffers (a round's two tiles)
NUM_WARPS = 4         # the default partition (WG0); WG1 and the producer add 4 warps each
CONSUMER_REGS = 208   # WG1's registers (setmaxnreg); WG0 gets what the other two leave
PRODUCER_REGS = 64
D_V, D_ROPE = 512, 64

if GLUON_IMPORT_ERROR is None:
    try:
        from kernels_triton.dsa_gluon import _gather_layout, _nvmma_shared   # the decode kernel's layouts

        LN2 = gl.constexpr(0.6931471805599453)
        _BLOCK_H = gl.constexpr(BLOCK_H)
        _BLOCK_K = gl.constexpr(BLOCK_K)
        _HALF = gl.constexpr(D_V // 2)
        _D_V = gl.constexpr(D_V)
        _D_ROPE = gl.constexpr(D_ROPE)
        # indices into the `ready` / `free` barriers: the parts of the two K buffers, in the producer's order
        _K0L = gl.constexpr(0)
        _K1R = gl.constexpr(1)
        _K0R = gl.constexpr(2)
        _K1L = gl.constexpr(3)
        # indices into `xbar`, the consumers' exchanges
        _M0 = gl.constexpr(0)
        _M1 = gl.constexpr(1)
        _P0 = gl.constexpr(2)
        _P1 = gl.constexpr(3)
        _L0 = gl.constexpr(4)
        _L1 = gl.constexpr(5)

        @gluon.constexpr_function
        def _producer_layout():
            """The producer's [BLOCK_K, cols] 16-bit tiles (cols 256 or 64): 8 lanes along 128 bytes of a row, 4 rows
            a warp, so a thread's rows are the same 4 (16 rows apart) in every part of a tile and its copies of a
            row differ by constant offsets (one 64-bit address a row)."""
            return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                    order=[1, 0])

        @gluon.constexpr_function
        def _s_layout():
            """S = Q K^T [BLOCK_H, BLOCK_K] of one warp group: 64 x 64 wgmmas."""
            return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_K, 16])

        @gluon.constexpr_function
        def _o_layout():
            """A group's half of O [BLOCK_H, D_V / 2]: 64 x 256 wgmmas."""
            return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_V // 2, 16])

        @gluon.jit
        def _load_rows(p_rows, j0, end, layout: gl.constexpr):
            """rows[j0 : j0 + BLOCK_K] in SliceLayout(1, layout) (-1 past the chunk's end)."""
            o_j = j0 + gl.arange(0, _BLOCK_K, layout=gl.SliceLayout(1, layout))
            return gl.load(p_rows + o_j, mask=o_j < end, other=-1)

        @gluon.jit
        def _gather(kv_ptr, row, stride_kv, dst_smem, COL0: gl.constexpr, COLS: gl.constexpr,
                    layout: gl.constexpr):
            """cp.async kv[row, COL0:COL0+COLS] into dst_smem [BLOCK_K, COLS] (row -1: zero-filled)."""
            o_c = COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
            ptrs = kv_ptr + row[:, None].to(gl.int64) * stride_kv + o_c[None, :]
            async_copy.async_copy_global_to_shared(dst_smem, ptrs, mask=(row >= 0)[:, None])

        @gluon.jit
        def _produce(kv_ptr, p_rows, start, end, n_rounds, stride_kv, k_l, k_r, k_rope, ready, free):
            """The producer partition (4 warps): every round's two tiles gathered part by part (module docstring)."""
            layout: gl.constexpr = _producer_layout()   # [64, 256]: 16 copies a thread; [64, 64]: 4
            for r in range(n_rounds):
                ph = (r & 1) ^ 1
                j_a = start + 2 * r * _BLOCK_K
                j_b = j_a + _BLOCK_K
                # the round's row ids first, so their latency overlaps the first `free` wait
                row_a = _load_rows(p_rows, j_a, end, layout)
                row_b = _load_rows(p_rows, j_b, end, layout)
                # buffer 0, left: WG0's PV of tile a - 2 is done with it
                mbarrier.wait(free[_K0L], ph)
                _gather(kv_ptr, row_a, stride_kv, k_l.index(0), 0, _HALF, layout)
                async_copy.mbarrier_arrive(ready[_K0L], increment_count=False)
                # buffer 1, right + rope: WG1's QK^T and PV of tile b - 2 are done with it
                mbarrier.wait(free[_K1R], ph)
                _gather(kv_ptr, row_b, stride_kv, k_r.index(1), _HALF, _HALF, layout)
                _gather(kv_ptr, row_b, stride_kv, k_rope.index(1), _D_V, _D_ROPE, layout)
                async_copy.mbarrier_arrive(ready[_K1R], increment_count=False)
                # buffer 0, right + rope: WG1's PV over P_a (which sat in the rope tile) is done with it
                mbarrier.wait(free[_K0R], ph)
                _gather(kv_ptr, row_a, stride_kv, k_r.index(0), _HALF, _HALF, layout)
                _gather(kv_ptr, row_a, stride_kv, k_rope.index(0), _D_V, _D_ROPE, layout)
                async_copy.mbarrier_arrive(ready[_K0R], increment_count=False)
                # buffer 1, left: WG0's PV over P_b of tile b - 2 is done with it
                mbarrier.wait(free[_K1L], ph)
                _gather(kv_ptr, row_b, stride_kv, k_l.index(1), 0, _HALF, layout)
                async_copy.mbarrier_arrive(ready[_K1L], increment_count=False)

        @gluon.jit
        def _alloc_bar(count: gl.constexpr):
            """One mbarrier in its own shared allocation, initialised to expect `count` arrivals."""
            bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(bar, count=count)
            return bar

        @gluon.jit
        def _alloc_vec(n: gl.constexpr):
            """A float32 [n] in its own shared allocation (a row statistic crossing between the consumer groups)."""
            return gl.allocate_shared_memory(gl.float32, [n], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                                                     order=[0]))

        @gluon.jit
        def _opaque_zero(x):
            """0, from an asm the compiler cannot see through (x: any int32 scalar). Shared tiles indexed by it
            in the loop have their wgmma descriptors computed there, next to their use: as loop invariants they
            were hoisted and held in registers across the loop (36 QK^T instructions, 2 descriptors each), which
            spilled."""
            return gl.inline_asm_elementwise(asm="mov.b32 $0, 0;", constraints="=r,r", args=[x], dtype=gl.int32,
                                             is_pure=False, pack=1)

        @gluon.jit
        def _wait_ready(bar, phase, FENCE: gl.constexpr):
            """Wait for a K part the producer's cp.async filled; with FENCE, a proxy fence before wgmma reads it."""
            mbarrier.wait(bar, phase)
            if FENCE:
                fence_async_shared()

        @gluon.jit
        def _arrive(bar):
            """One arrival on bar once every warp of this partition is past what came before (stores, waits)."""
            gl.thread_barrier()
            mbarrier.arrive(bar)

        @gluon.jit
        def _softmax(s, row, m_ref, m_i, l_i, qk_scale_log2):
            """Online softmax of S [64, 64] (raw logits; rows -1 masked) from the running max m_ref: returns the
            new max m, P = exp2(S * scale - m), alpha = exp2(m_i - m) and l_i * alpha + rowsum(P)."""
            s = gl.where((row >= 0)[None, :], s * qk_scale_log2, float("-inf"))
            m_new = gl.maximum(m_ref, gl.max(s, axis=1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            return m_new, p, alpha, l_i

        @gluon.jit
        def _finish(acc, m_i, l_i, l_x, xbar, G: gl.constexpr, out_ptr, lse_ptr, i_hb, i_n, i_s, H,
                    stride_on, stride_oh, stride_os, stride_ln, stride_lh, stride_ls):
            """Exchange the row sums with the other group (l = l_WG0 + l_WG1 in both), then out's columns
            G*256 ... (G+1)*256 and, in WG1, lse."""
            s_layout: gl.constexpr = _s_layout()
            o_layout: gl.constexpr = _o_layout()
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
            l_x[G].store(l_i)
            _arrive(xbar[_L0 + G])
            mbarrier.wait(xbar[_L1 - G], 0)
            l_other = l_x[1 - G].load(row_s)
            if G == 0:
                l_tot = l_i + l_other
            else:
                l_tot = l_other + l_i
            m_any = l_tot > 0.0
            l_safe = gl.where(m_any, l_tot, 1.0)
            out = acc / gl.convert_layout(l_safe, row_o)[:, None]
            o_ho = i_hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=row_o)
            o_vo = G * _HALF + gl.arange(0, _HALF, layout=gl.SliceLayout(0, o_layout))
            p_out = (out_ptr + i_n * stride_on + o_ho[:, None].to(gl.int64) * stride_oh + i_s * stride_os
                     + o_vo[None, :])
            gl.store(p_out, out.to(out_ptr.dtype.element_ty), mask=(o_ho < H)[:, None])
            if G == 1:
                lse = gl.where(m_any, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
                o_hl = i_hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=row_s)
                gl.store(lse_ptr + i_n * stride_ln + o_hl * stride_lh + i_s * stride_ls, lse, mask=o_hl < H)

        @gluon.jit
        def _consume_a(q_l, q_r, q_rope, k_l, k_r, k_rope, p1_smem, m_x, l_x, ready, free, xbar, p_rows, start,
                       end, n_rounds, qk_scale_log2, out_ptr, lse_ptr, i_hb, i_n, i_s, H, stride_on, stride_oh,
                       stride_os, stride_ln, stride_lh, stride_ls, FENCE: gl.constexpr):
            """WG0 (the default partition): tiles a = 2r, columns 0-255 of O (module docstring)."""
            s_layout: gl.constexpr = _s_layout()
            o_layout: gl.constexpr = _o_layout()
            p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
            dtype: gl.constexpr = gl.bfloat16

            m_i = gl.full([_BLOCK_H], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([_BLOCK_H], gl.float32, layout=row_s)
            acc = gl.zeros([_BLOCK_H, _HALF], gl.float32, layout=o_layout)
            s_zero = gl.zeros([_BLOCK_H, _BLOCK_K], gl.float32, layout=s_layout)
            o_kc = gl.arange(0, _BLOCK_K, layout=gl.SliceLayout(0, s_layout))

            # S of tile 0 (no wait at all for an empty chunk: the producer then fills nothing)
            s = s_zero
            if n_rounds > 0:
                z = _opaque_zero(n_rounds)
                _wait_ready(ready[_K0L], 0, FENCE)
                s_tok = warpgroup_mma(q_l.index(z), k_l.index(z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                _wait_ready(ready[_K0R], 0, FENCE)
                s_tok = warpgroup_mma(q_r.index(z), k_r.index(z).permute((1, 0)), s_tok, is_async=True)
                s_tok = warpgroup_mma(q_rope.index(z), k_rope.index(z).permute((1, 0)), s_tok, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
            for r in range(n_rounds):
                # Here S of tile a is in registers and WG0's wgmmas are all done.
                ph = r & 1
                z = _opaque_zero(r)
                o_j = start + 2 * r * _BLOCK_K + o_kc
                row = gl.load(p_rows + o_j, mask=o_j < end, other=-1)
                m_a, p, alpha, l_i = _softmax(s, row, m_i, m_i, l_i, qk_scale_log2)
                # m_a for WG1. WG1 read last round's m_a before it arrived P1 (which this group waited for),
                # so the slot is free.
                m_x[0].store(m_a)
                _arrive(xbar[_M0])
                # O_L = O_L * alpha + P_a V_a[:, :256], P_a from registers; then buffer 0's left part is free
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                p_bf = p.to(dtype)
                p_reg = gl.convert_layout(p_bf, p_op)
                acc_tok = warpgroup_mma(p_reg, k_l.index(z), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
                _arrive(free[_K0L])
                # WG1's m_b (>= m_a); P_a rescaled to it into buffer 0's rope tile (the producer refills that
                # only after WG1's PV over it arrives K0R's `free`), O_L and the row sums likewise
                mbarrier.wait(xbar[_M1], ph)
                m_b = m_x[1].load(row_s)
                beta = gl.exp2(m_a - gl.where(m_b == float("-inf"), 0.0, m_b))
                k_rope.index(z).store((p_bf.to(gl.float32) * beta[:, None]).to(dtype))
                fence_async_shared()
                _arrive(xbar[_P0])
                acc = acc * gl.convert_layout(beta, row_o)[:, None]
                l_i = l_i * beta
                m_i = m_b
                # O_L += P_b V_b[:, :256], P_b from shared memory
                mbarrier.wait(xbar[_P1], ph)
                acc_tok = warpgroup_mma(p1_smem.index(z), k_l.index(z + 1), acc, is_async=True)
                if r + 1 < n_rounds:
                    # S of tile a + 2 behind it: its left part, then (that PV done: buffer 1's left part free)
                    # its right part and rope
                    _wait_ready(ready[_K0L], ph ^ 1, FENCE)
                    s_tok = warpgroup_mma(q_l.index(z), k_l.index(z).permute((1, 0)), s_zero, use_acc=False,
                                          is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc_tok, ))
                    _arrive(free[_K1L])
                    _wait_ready(ready[_K0R], ph ^ 1, FENCE)
                    s_tok = warpgroup_mma(q_r.index(z), k_r.index(z).permute((1, 0)), s_tok, is_async=True)
                    s_tok = warpgroup_mma(q_rope.index(z), k_rope.index(z).permute((1, 0)), s_tok, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
            _finish(acc, m_i, l_i, l_x, xbar, 0, out_ptr, lse_ptr, i_hb, i_n, i_s, H, stride_on, stride_oh,
                    stride_os, stride_ln, stride_lh, stride_ls)

        @gluon.jit
        def _consume_b(q_l, q_r, q_rope, k_l, k_r, k_rope, p1_smem, m_x, l_x, ready, free, xbar, p_rows, start,
                       end, n_rounds, qk_scale_log2, out_ptr, lse_ptr, i_hb, i_n, i_s, H, stride_on, stride_oh,
                       stride_os, stride_ln, stride_lh, stride_ls, FENCE: gl.constexpr):
            """WG1 (a worker partition): tiles b = 2r + 1, columns 256-511 of O (module docstring)."""
            s_layout: gl.constexpr = _s_layout()
            o_layout: gl.constexpr = _o_layout()
            p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
            dtype: gl.constexpr = gl.bfloat16

            m_i = gl.full([_BLOCK_H], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([_BLOCK_H], gl.float32, layout=row_s)
            acc = gl.zeros([_BLOCK_H, _HALF], gl.float32, layout=o_layout)
            s_zero = gl.zeros([_BLOCK_H, _BLOCK_K], gl.float32, layout=s_layout)
            o_kc = gl.arange(0, _BLOCK_K, layout=gl.SliceLayout(0, s_layout))
            for r in range(n_rounds):
                ph = r & 1
                z = _opaque_zero(r)
                # S_b = Q K_b^T: right part and rope first (the producer fills them first), then left
                _wait_ready(ready[_K1R], ph, FENCE)
                s_tok = warpgroup_mma(q_r.index(z), k_r.index(z + 1).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                s_tok = warpgroup_mma(q_rope.index(z), k_rope.index(z + 1).permute((1, 0)), s_tok, is_async=True)
                _wait_ready(ready[_K1L], ph, FENCE)
                s_tok = warpgroup_mma(q_l.index(z), k_l.index(z + 1).permute((1, 0)), s_tok, is_async=True)
                o_j = start + (2 * r + 1) * _BLOCK_K + o_kc
                row = gl.load(p_rows + o_j, mask=o_j < end, other=-1)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
                # WG0's m_a, then this tile's softmax from it: m_b = max(m_a, rowmax S_b)
                mbarrier.wait(xbar[_M0], ph)
                m_a = m_x[0].load(row_s)
                m_b, p, alpha, l_i = _softmax(s, row, m_a, m_i, l_i, qk_scale_log2)
                # m_b for WG0. WG0 read last round's m_b before it arrived M0 (waited above): the slot is free.
                m_x[1].store(m_b)
                _arrive(xbar[_M1])
                # O_R = O_R * alpha + P_b V_b[:, 256:], P_b from registers; P_b to shared memory for WG0 (whose
                # PV over last round's P_b was done before it arrived M0)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                p_bf = p.to(dtype)
                p_reg = gl.convert_layout(p_bf, p_op)
                p1_smem.index(z).store(p_bf)    # (before the wgmma: its register operand is not read meanwhile)
                fence_async_shared()
                acc_tok = warpgroup_mma(p_reg, k_r.index(z + 1), acc, is_async=True)
                _arrive(xbar[_P1])
                # O_R += P_a V_a[:, 256:], P_a (rescaled to m_b by WG0) from buffer 0's rope tile
                mbarrier.wait(xbar[_P0], ph)
                acc_tok = warpgroup_mma(k_rope.index(z), k_r.index(z), acc_tok, is_async=True)
                warpgroup_mma_wait(num_outstanding=1, deps=(p_reg, ))
                _arrive(free[_K1R])          # buffer 1's right part and rope: QK^T and PV done
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
                _arrive(free[_K0R])          # buffer 0's right part and rope (P_a): PV done
                m_i = m_b
            _finish(acc, m_i, l_i, l_x, xbar, 1, out_ptr, lse_ptr, i_hb, i_n, i_s, H, stride_on, stride_oh,
                    stride_os, stride_ln, stride_lh, stride_ls)

        @gluon.jit
        def _sparse_mla_prefill_gluon_kernel(
            q_ptr, kv_ptr, rows_ptr, row_base_ptr, out_ptr, lse_ptr,
            stride_qn, stride_qh, stride_kv, stride_rn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
            stride_ls,
            H, K_SEL, CHUNK, qk_scale_log2,
            D_V: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
            HAS_ROW_BASE: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
            FENCE: gl.constexpr = True, CONSUMER_REGS: gl.constexpr = 208,
            PRODUCER_REGS: gl.constexpr = 64,
        ):
            """The decode kernel's arguments and results (kernels_triton/dsa_gluon.py's
            `_sparse_mla_decode_gluon_kernel`); the module docstring gives the schedule. FENCE: a proxy fence
            after each wait for gathered rows; CONSUMER_REGS / PRODUCER_REGS: WG1's and the producer's registers."""
            gl.static_assert(num_warps == 4, "the default partition is one warp group (WG0)")
            gl.static_assert(BLOCK_H == 64, "one wgmma M of 64 rows per warp group")
            gl.static_assert(BLOCK_K == 64, "64-row tiles (two K buffers fill shared memory)")
            gl.static_assert(NUM_STAGES == 2, "two K buffers: a round's two tiles")
            gl.static_assert(D_V == 512 and D_ROPE == 64, "MLA's 512 + 64 rows")
            dtype: gl.constexpr = gl.bfloat16
            half_sh: gl.constexpr = _nvmma_shared([BLOCK_H, D_V // 2], 16)
            rope_sh: gl.constexpr = _nvmma_shared([BLOCK_H, D_ROPE], 16)

            q_l = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_V // 2], half_sh)
            q_r = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_V // 2], half_sh)
            q_rope = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_ROPE], rope_sh)
            k_l = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, D_V // 2], half_sh)
            k_r = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, D_V // 2], half_sh)
            k_rope = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, D_ROPE], rope_sh)
            p1_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, BLOCK_K], rope_sh)
            # one allocation each (Triton's shared-memory analysis puts a barrier between accesses to one
            # allocation by different threads, so slots or mbarriers sharing one would be ordered needlessly)
            m_x = (_alloc_vec(BLOCK_H), _alloc_vec(BLOCK_H))
            l_x = (_alloc_vec(BLOCK_H), _alloc_vec(BLOCK_H))
            ready = (_alloc_bar(128), _alloc_bar(128), _alloc_bar(128), _alloc_bar(128))  # the producer's threads
            free = (_alloc_bar(1), _alloc_bar(1), _alloc_bar(1), _alloc_bar(1))
            xbar = (_alloc_bar(1), _alloc_bar(1), _alloc_bar(1), _alloc_bar(1), _alloc_bar(1), _alloc_bar(1))

            i_hb = gl.program_id(0)  # fastest: the head blocks of a query share its rows in L2
            i_n = gl.program_id(1).to(gl.int64)
            i_s = gl.program_id(2)
            p_rows = rows_ptr + i_n * stride_rn
            if HAS_ROW_BASE:
                kv_ptr += gl.load(row_base_ptr + i_n) * stride_kv
            start = i_s * CHUNK
            end = gl.minimum(start + CHUNK, K_SEL)
            n_rounds = gl.cdiv(end - start, 2 * BLOCK_K)   # an odd tile count's last tile b is all -1 rows

            # Q (heads past H zero-filled), by the default partition's 4 warps before the fork
            half_l: gl.constexpr = _gather_layout(D_V // 2, num_warps)
            rope_l: gl.constexpr = _gather_layout(D_ROPE, num_warps)
            o_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, half_l))
            o_c = gl.arange(0, D_V // 2, layout=gl.SliceLayout(0, half_l))
            p_q = q_ptr + i_n * stride_qn + o_h[:, None].to(gl.int64) * stride_qh + o_c[None, :]
            async_copy.async_copy_global_to_shared(q_l.index(0), p_q, mask=(o_h < H)[:, None])
            async_copy.async_copy_global_to_shared(q_r.index(0), p_q + D_V // 2, mask=(o_h < H)[:, None])
            o_hr = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rope_l))
            o_cr = D_V + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rope_l))
            p_qr = q_ptr + i_n * stride_qn + o_hr[:, None].to(gl.int64) * stride_qh + o_cr[None, :]
            async_copy.async_copy_global_to_shared(q_rope.index(0), p_qr, mask=(o_hr < H)[:, None])
            async_copy.commit_group()
            async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()

            gl.warp_specialize([
                (_consume_a, (q_l, q_r, q_rope, k_l, k_r, k_rope, p1_smem, m_x, l_x, ready, free, xbar, p_rows,
                              start, end, n_rounds, qk_scale_log2, out_ptr, lse_ptr, i_hb, i_n, i_s, H, stride_on,
                              stride_oh, stride_os, stride_ln, stride_lh, stride_ls, FENCE)),
                (_consume_b, (q_l, q_r, q_rope, k_l, k_r, k_rope, p1_smem, m_x, l_x, ready, free, xbar, p_rows,
                              start, end, n_rounds, qk_scale_log2, out_ptr, lse_ptr, i_hb, i_n, i_s, H, stride_on,
                              stride_oh, stride_os, stride_ln, stride_lh, stride_ls, FENCE)),
                (_produce, (kv_ptr, p_rows, start, end, n_rounds, stride_kv, k_l, k_r, k_rope, ready, free)),
            ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    except Exception as exc:  # noqa: BLE001 - a Gluon whose API differs: the module still imports
        GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

if GLUON_IMPORT_ERROR is not None:
    _sparse_mla_prefill_gluon_kernel = None


def launch_gluon_prefill(q, kv, rows, row_base, out, lse, sm_scale: float, *, fence: bool = True,
                         consumer_regs: int = CONSUMER_REGS, producer_regs: int = PRODUCER_REGS) -> None:
    """The launch alone, into out [N, H, 512] and lse [N, H], for inputs already checked: one program per
    (64-head block, query), all k rows in one split. Keywords: the kernel's tuning constexprs."""
    import triton

    n, h, d = q.shape
    k = rows.shape[1]
    if n == 0 or h == 0:
        return
    _sparse_mla_prefill_gluon_kernel[(triton.cdiv(h, BLOCK_H), n, 1)](
        q, kv, rows, rows if row_base is None else row_base, out, lse,
        q.stride(0), q.stride(1), kv.stride(0), rows.stride(0), out.stride(0), out.stride(1), 0,
        lse.stride(0), lse.stride(1), 0,
        h, k, k, sm_scale * 1.4426950408889634,
        D_V=D_V, D_ROPE=d - D_V, BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K, HAS_ROW_BASE=row_base is not None,
        NUM_STAGES=NUM_STAGES, num_warps=NUM_WARPS, FENCE=fence, CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs,
    )


def prefill_unsupported(q, kv, rows, row_base=None) -> str | None:
    """Why `sparse_mla_prefill_gluon` cannot run these arguments, or None."""
    import torch
    import triton

    if GLUON_IMPORT_ERROR is not None:
        return f"Triton {triton.__version__} has no usable Gluon ({GLUON_IMPORT_ERROR})"
    if not q.is_cuda:
        return f"q is on {q.device}, not a CUDA GPU"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return "it needs an sm_90 (Hopper) GPU"
    if triton.__version__.split(".")[:2] != ["3", "6"]:
        return f"it is written against Triton 3.6's Gluon, this is {triton.__version__}"
    if q.dim() != 3 or q.dtype != torch.bfloat16 or q.shape[2] != D_V + D_ROPE or q.stride(2) != 1:
        return f"q {q.dtype} {tuple(q.shape)}: expected bf16 [N, H, {D_V + D_ROPE}] with a contiguous last dim"
    if kv.dim() != 2 or kv.dtype != torch.bfloat16 or kv.shape[1] != D_V + D_ROPE or kv.stride(1) != 1:
        return f"kv {kv.dtype} {tuple(kv.shape)}: expected bf16 [R, {D_V + D_ROPE}] with a contiguous last dim"
    if rows.dim() != 2 or rows.dtype != torch.int32 or rows.shape[0] != q.shape[0] or rows.stride(1) != 1:
        return f"rows {rows.dtype} {tuple(rows.shape)}: expected int32 [{q.shape[0]}, k], contiguous last dim"
    if row_base is not None and (row_base.dtype != torch.int64 or tuple(row_base.shape) != (q.shape[0], )):
        return f"row_base {row_base.dtype} {tuple(row_base.shape)}: expected int64 [{q.shape[0]}]"
    if q.shape[1] % BLOCK_H:
        return f"{q.shape[1]} heads: it runs {BLOCK_H} a program, so needs a multiple of that"
    return None


def sparse_mla_prefill_gluon(q, kv, rows, sm_scale: float, row_base=None, out=None, lse=None, **tuning):
    """Sparse MLA through this module's kernel: q [N, H, 576] bf16, kv [R, 576] bf16 (V = kv[:, :512]), rows
    [N, k] int32 (-1 skipped), each naming row row_base[n] + rows[n, j] of kv (row_base [N] int64 or None):
    returns out [N, H, 512] bf16 and lse [N, H] float32, as `hisparse.dsa.ops.sparse_mla_decode_gluon` with
    one split. `tuning`: `launch_gluon_prefill`'s keywords."""
    import torch

    reason = prefill_unsupported(q, kv, rows, row_base)
    if reason is not None:
        raise ValueError(f"the Gluon prefill kernel cannot run this: {reason}")
    n, h, _ = q.shape
    out = out if out is not None else torch.empty((n, h, D_V), dtype=q.dtype, device=q.device)
    lse = lse if lse is not None else torch.empty((n, h), dtype=torch.float32, device=q.device)
    launch_gluon_prefill(q, kv, rows, row_base, out, lse, sm_scale, **tuning)
    return out, lse

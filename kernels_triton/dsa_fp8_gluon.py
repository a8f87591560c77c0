"""Sparse MLA decode over DSA's 656-byte FP8 rows in Gluon (Triton 3.6's `triton.experimental.gluon`), for
Hopper, warp-specialised: a producer warp group dequantises each tile of rows into one of two bf16 K buffers
while two consumer warp groups run kernels_triton/dsa_gluon.py's tile loop (64 heads a program, each group
half of each tile's QK^T, P through shared memory, each group its half of O) on the other. Launcher:
`hisparse.dsa.fp8.sparse_mla_decode_fp8(..., backend="gluon")` (`fp8_gluon_unsupported` says where it cannot
run); offline compile: experiments/tools/sass_dsa_fp8_gluon.py; checked against the torch reference on a GPU
(tests/test_dsa_fp8.py, marked gpu).

Why
---
Dequantising on the warps that wait on every wgmma adds the conversion to each tile's matrix math. In its
own warps it hides behind it, as in FlashMLA's sparse FP8 decode, but only once the rows' bytes are near: a
producer that gathers 64 random 656-byte rows from HBM into registers waits on that latency every tile (no
faster than dequantising inline). So it asks L2 for the next tile's rows (prefetch.global.L2, one
instruction per 128-byte line) half a tile ahead, and its loads then find them there. The bf16 Gluon kernel
is these consumers without the FP8 rows, the bar this kernel is measured against (results/attention.csv,
results/notes/fp8.md).

Partitions (Gluon `warp_specialize`; setmaxnreg: the producer PRODUCER_REGS registers, the consumers 192)
--------------------------------------------------------------------------------------------------------
- consumers, 8 warps (the default partition; warps_per_cta [4, 2] in both MMA layouts): per tile i, wait
  `full[i % 2]`, S = Q K(i)^T (RoPE dims first, then the four 128-column blocks, one accumulator chain),
  online softmax in the log2 domain (-1 rows -inf; row sums per row, warp group and lane, reduced once after
  the loop: `_thread_sums`), P to shared memory, O = O * alpha + P V(i) (group g: V columns g*256 ..), wait,
  arrive `empty[i % 2]`.
- producer, 4 warps: per tile i (its row ids loaded a tile ahead), load the e4m3 bytes and scales of two
  128-column blocks at a time from global memory into registers (-1 rows and rows past the chunk: zeros;
  the first two before waiting `empty[i % 2]`), convert them (`_dequant`) and store to K buffer i % 2; the
  RoPE dims as stored; between the two halves, prefetch tile i + 1's rows into L2; fence, arrive
  `full[i % 2]`.
A Gluon `mbarrier.arrive` is one arrival, by thread 0 of its partition, so every barrier counts 1; the
partition's `gl.thread_barrier()` before it puts all its warps' work first. `empty` starts as if complete
(the producer waits parity 1 of a fresh barrier, which returns at once).

Shapes (one program = head block `i_hb` of BLOCK_H = 64 heads, request n, split s)
---------------------------------------------------------------------------------
q [N, H, 576] bf16; the row pool kv uint8 [R, 656] passed as three views of the same bytes: kv8
float8_e4m3fn [R, 656] (latent at 0), kv32 float32 [R, 164] (4 scales at 128), kv16 bf16 [R, 328] (RoPE at
264), one row every STRIDE16 * 16 bytes; rows [N, k] int32 (-1 = skip), row_base [N] int64 (optional), out
[N, H, 512] bf16 (or float32 partials [N, H, splits, 512]), lse [N, H] (or [N, H, splits]) float32:
`kernels_triton/dsa_gluon.py`'s outputs.
Shared memory: Q nope 64 x 512 bf16 (64 KiB) + rope 64 x 64 (8 KiB); K nope [2, 64, 512] bf16 (128 KiB) +
rope [2, 64, 64] (16 KiB); P 64 x 64 (8 KiB); 4 mbarriers: 224 KiB. No raw-byte ring: the producer reads
global memory into registers, which is what leaves room for the second K buffer.

Dequantisation (`_e4m3_bf16x2`, `_dequant`): e4m3 bits moved into bf16 (PRMT, SHL, AND) and two packed bf16
multiplies per 2 values, the bits of e4m3 -> float32, times the power-of-two scale, -> bf16 (every e4m3 byte
at every scale checked against `hisparse.dsa.fp8.dequantize_rows` on the GPU). The producer's layout puts 8
lanes down 8 rows (`_row_lanes_layout`), so its 16-byte stores into the 128-byte-swizzled K tile meet 8 bank
groups.

Semantics are `_sparse_mla_decode_gluon_kernel`'s over the dequantised rows: output = acc / l (zeros
without a valid row), lse in natural log (-inf without a valid row), fp32 accumulation, rows read in order
BLOCK_K at a time, the same operations in the same order on every launch (so hisparse and resident agree
bit for bit). Its QK^T accumulates the nope part in four chained blocks and its row sums are per thread,
so it is not bitwise the bf16 Gluon kernel (out and lse within float32 rounding of it).

bf16 q only (the rows' RoPE is bf16 as stored), 512 + 64 rows, >= 64 heads, sm_90a, Triton 3.6; where
Gluon or its Hopper API is missing, GLUON_IMPORT_ERROR says so (the module still imports).
"""
from __future__ import annotations

from kernels_triton.gluon_hopper import (  # noqa: F401  GLUON_IMPORT_ERROR: the launchers' reason
    GLUON_IMPORT_ERROR, gl, gluon, async_copy, fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

BLOCK_H = 64          # heads per program: one wgmma M (64) per consumer warp group
BLOCK_K = 64          # rows per tile
NUM_STAGES = 2        # K buffers: tile i + 1 dequantised while tile i is computed
NUM_WARPS = 8         # the consumers, two warp groups; the producer adds PRODUCER_WARPS
PRODUCER_WARPS = 4
PRODUCER_REGS = 120   # a producer thread's registers (setmaxnreg); the consumers get 192 of the 64K
TILE = 128            # latent values per scale
D_V, D_ROPE = 512, 64
SCALE_WORD = D_V // 4            # float32 index of a row's first scale (byte 512)
ROPE_HALF = (D_V + 16) // 2      # bf16 index of a row's first RoPE value (byte 528)
ROW_BYTES = 656                  # a row's bytes (the lines the producer prefetches)

if GLUON_IMPORT_ERROR is None:
    try:
        LN2 = gl.constexpr(0.6931471805599453)
        _D_V = gl.constexpr(D_V)
        _D_ROPE = gl.constexpr(D_ROPE)
        _TILE = gl.constexpr(TILE)
        _SCALE_WORD = gl.constexpr(SCALE_WORD)
        _ROPE_HALF = gl.constexpr(ROPE_HALF)
        _ROW_LAST = gl.constexpr(ROW_BYTES - 1)
        _BLOCK_H = gl.constexpr(BLOCK_H)
        _BLOCK_K = gl.constexpr(BLOCK_K)
        _PRODUCER_WARPS = gl.constexpr(PRODUCER_WARPS)
        _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)
        _TWO_120 = gl.constexpr(2.0 ** 120)   # e4m3 bits placed in a bf16 read as the value times 2 ** -120
        _TWO_7 = gl.constexpr(2.0 ** 7)       # the largest scale whose scale * 2 ** 120 is a finite bf16

        @gluon.constexpr_function
        def _nvmma_shared(shape, bitwidth):
            """NVMMA (wgmma-readable, swizzled) shared layout of a 2-D tile [rows, cols] of `bitwidth`."""
            inner = shape[-1] * bitwidth // 8
            swizzle = 128 if inner % 128 == 0 else 64 if inner % 64 == 0 else 32 if inner % 32 == 0 else 0
            return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=bitwidth, rank=2)

        @gluon.constexpr_function
        def _vector_layout(cols, bits, num_warps):
            """Blocked layout of a [rows, cols] tile of `bits`-bit values: 16-byte vectors, a warp along the columns."""
            per = 128 // bits
            lanes_c = min(32, cols // per)
            return gl.BlockedLayout(size_per_thread=[1, per], threads_per_warp=[32 // lanes_c, lanes_c],
                                    warps_per_cta=[num_warps, 1], order=[1, 0])

        @gluon.constexpr_function
        def _row_lanes_layout(cols, bits, num_warps):
            """Blocked layout of a [rows, cols] tile of `bits`-bit values: 16-byte vectors, 8 consecutive lanes on
            8 consecutive rows (same columns), 4 lanes along them: a 16-byte shared access (served 8 lanes at a
            time) of 8 rows' same chunk meets 8 XOR phases of a 128-byte swizzle, so 8 bank groups."""
            return gl.BlockedLayout(size_per_thread=[1, 128 // bits], threads_per_warp=[8, 4],
                                    warps_per_cta=[num_warps, 1], order=[0, 1])

        @gluon.jit
        def _e4m3_bf16x2(x, mult, mult2):
            """bf16 x * mult * mult2 of x e4m3 and bf16 factors broadcast to it, 4 values an asm. Per 2 bytes:
            prmt to [sign(b1) b1 sign(b0) b0] (selector nibble 8 + i: byte i's sign replicated), shl 4, and
            0x87F087F0 leave sign << 15 | (b & 0x7f) << 4 in each 16-bit half: the bf16 of the e4m3 value times
            2 ** -120 (e4m3 subnormals become bf16 subnormals, still exact), then two mul.rn.bf16x2. With
            mult = min(scale, 2 ** 7) * 2 ** 120 (finite) and mult2 = max(scale / 2 ** 7, 1), both exact for a
            power-of-two scale, every product is exact or rounds once as the f32 path's bf16 does: the same bits
            (one multiply would overflow for scales over 2 ** 7). An e4m3 NaN byte (never written) gives a
            finite value."""
            return gl.inline_asm_elementwise(
                asm="""{
                .reg .b32 lo, hi;
                prmt.b32 lo, $2, 0, 0x9180;
                prmt.b32 hi, $2, 0, 0xB3A2;
                shl.b32 lo, lo, 4;
                shl.b32 hi, hi, 4;
                and.b32 lo, lo, 0x87F087F0;
                and.b32 hi, hi, 0x87F087F0;
                mul.rn.bf16x2 lo, lo, $3;
                mul.rn.bf16x2 hi, hi, $4;
                mul.rn.bf16x2 $0, lo, $5;
                mul.rn.bf16x2 $1, hi, $6;
                }""",
                constraints="=r,=r,r,r,r,r,r", args=[x.to(gl.uint8, bitcast=True), mult, mult2], dtype=gl.bfloat16,
                is_pure=True, pack=4)

        @gluon.jit
        def _dequant(x, scale):
            """x [BLOCK_K, 128] e4m3 times its rows' scales [BLOCK_K] (SliceLayout(1) of x's layout), as bf16
            in x's layout (`_e4m3_bf16x2`: for power-of-two scales the bits of e4m3 -> float32, times the
            scale, -> bf16, which is exact)."""
            m1 = (gl.minimum(scale, _TWO_7) * _TWO_120).to(gl.bfloat16)        # [BLOCK_K]: <= 2 ** 127
            m2 = gl.maximum(scale * (1.0 / _TWO_7), 1.0).to(gl.bfloat16)     # [BLOCK_K]: 1 unless scale > 2 ** 7
            return _e4m3_bf16x2(x, m1[:, None], m2[:, None])

        @gluon.jit
        def _thread_sums(x):
            """x [BLOCK_H, BLOCK_K] in the QK^T accumulator layout (warps [4, 2], instr N = BLOCK_K / 2), summed
            over the columns each thread holds: [BLOCK_H, 2, 4]. Column g * BLOCK_K/2 + j * 8 + t * 2 + b sits in
            warp group g, lane t (mod 4), registers j and b, so the sum over j and b stays in registers."""
            BH: gl.constexpr = x.shape[0]
            BK: gl.constexpr = x.shape[1]
            x5 = gl.reshape(x, [BH, 2, BK // 16, 4, 2])        # [rows, group g, chunk j, lane t, pair b]: no moves
            return gl.sum(gl.sum(x5, axis=4), axis=2)

        @gluon.jit
        def _qk_block(q_nope, k_nope, c: gl.constexpr, s_tok):
            """Issue S += Q[:, block c] K[:, block c]^T (async), behind s_tok."""
            return warpgroup_mma(q_nope.slice(c * _TILE, _TILE, dim=1),
                                 k_nope.slice(c * _TILE, _TILE, dim=1).permute((1, 0)), s_tok, is_async=True)

        @gluon.jit
        def _prefetch_l2(lines, last):
            """prefetch.global.L2 of the 128-byte lines holding `lines` and `last` (pointers of one shape and
            layout); returns zeros of that shape (add them to something used, or the asm is dropped)."""
            return gl.inline_asm_elementwise(
                asm="""{
                prefetch.global.L2 [$1];
                prefetch.global.L2 [$2];
                mov.u32 $0, 0;
                }""",
                constraints="=r,l,l", args=[lines, last], dtype=gl.int32, is_pure=False, pack=1)

        @gluon.jit
        def _prefetch_rows(kv8_ptr, row, STRIDE16):
            """Every 128-byte line of the rows `row` [BLOCK_K] (SliceLayout(1) of the producer's
            `_row_lanes_layout`; -1: row 0, read by nobody) asked of L2: lane j of a row's 4 takes bytes j * 128
            and min(512 + j * 128, 655), which between them meet every line a 656-byte row touches at any
            alignment. Returns zeros in row's layout."""
            pf_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[8, 4],
                                                  warps_per_cta=[_PRODUCER_WARPS, 1], order=[0, 1])
            pf_row = gl.convert_layout(gl.maximum(row, 0), gl.SliceLayout(1, pf_l))     # the same lanes: no moves
            o_j = gl.arange(0, 4, layout=gl.SliceLayout(0, pf_l))
            start = kv8_ptr + (pf_row.to(gl.int64) * STRIDE16 * 16)[:, None]           # [BLOCK_K, 1]
            zero = _prefetch_l2(start + o_j[None, :] * 128, start + gl.minimum(512 + o_j * 128, _ROW_LAST)[None, :])
            return gl.convert_layout(gl.max(zero, axis=1), row.type.layout)

        @gluon.jit
        def _produce(kv8_ptr, kv32_ptr, kv16_ptr, p_rows, start, end, n_tiles, STRIDE16, k_nope, k_rope, full,
                     empty):
            """The producer partition: every tile of the chunk dequantised into K buffer i % 2 (module docstring)."""
            deq_l: gl.constexpr = _row_lanes_layout(_TILE, 8, _PRODUCER_WARPS)  # [BLOCK_K, 128] e4m3: 64 B a thread
            rope_l: gl.constexpr = _vector_layout(_D_ROPE, 16, _PRODUCER_WARPS)  # [BLOCK_K, 64] bf16: 64 B a thread
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
                j1 = start + (i + 1) * _BLOCK_K
                next_row = gl.load(p_rows + j1 + o_k, mask=j1 + o_k < end, other=-1)
                next_row_r = gl.load(p_rows + j1 + o_kr, mask=j1 + o_kr < end, other=-1)
                valid = row >= 0
                p_row = kv8_ptr + (row.to(gl.int64) * STRIDE16 * 16)[:, None] + o_c[None, :]
                p_scale = kv32_ptr + row.to(gl.int64) * STRIDE16 * 4 + _SCALE_WORD
                rope = gl.load(kv16_ptr + (row_r.to(gl.int64) * STRIDE16 * 8)[:, None] + o_r[None, :],
                               mask=(row_r >= 0)[:, None], other=0.0)
                # two blocks' bytes in flight at a time ([BLOCK_K, 128] e4m3 and [BLOCK_K] scales each), the
                # first two before waiting for the buffer
                k_tile = k_nope.index(b)                                   # [BLOCK_K, 512] bf16, block c at c * 128
                for h in gl.static_range(2):
                    xa = gl.load(p_row + 2 * h * _TILE, mask=valid[:, None], other=0.0)
                    xb = gl.load(p_row + (2 * h + 1) * _TILE, mask=valid[:, None], other=0.0)
                    sa = gl.load(p_scale + 2 * h, mask=valid, other=0.0)
                    sb = gl.load(p_scale + 2 * h + 1, mask=valid, other=0.0)
                    if h == 0:
                        mbarrier.wait(empty.index(b), ((i // 2) & 1) ^ 1)    # the consumers are done with tile i - 2
                        k_rope.index(b).store(rope)
                    else:
                        # tile i + 1's rows into L2 while this half converts (its row ids have landed by now)
                        next_row += _prefetch_rows(kv8_ptr, next_row, STRIDE16)
                    k_tile.slice(2 * h * _TILE, _TILE, dim=1).store(_dequant(xa, sa))
                    k_tile.slice((2 * h + 1) * _TILE, _TILE, dim=1).store(_dequant(xb, sb))
                fence_async_shared()                                   # the stores, visible to wgmma
                gl.thread_barrier()                       # every producer warp's stores, before thread 0 arrives
                mbarrier.arrive(full.index(b))

        @gluon.jit
        def _issue_qk(q_nope, q_rope, k_nope, k_rope, b, s_zero):
            """Issue S = Q K^T of K buffer b (async): the RoPE dims, then the four 128-column blocks, one chain."""
            s_tok = warpgroup_mma(q_rope, k_rope.index(b).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            for c in gl.static_range(_D_V // _TILE):
                s_tok = _qk_block(q_nope, k_nope.index(b), c, s_tok)
            return s_tok

        @gluon.jit
        def _consume(q_nope, q_rope, k_nope, k_rope, p_smem, full, empty, p_rows, start, end, n_tiles,
                     qk_scale_log2, out_ptr, lse_ptr, i_hb, i_n, i_s, H, stride_on, stride_oh, stride_os, stride_ln,
                     stride_lh, stride_ls):
            """The consumer partition (8 warps): the tile loop, then out and lse (module docstring)."""
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                               instr_shape=[16, _BLOCK_K // 2, 16])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                               instr_shape=[16, _D_V // 2, 16])
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

            m_i = gl.full([_BLOCK_H], float("-inf"), gl.float32, layout=row_s)
            acc = gl.zeros([_BLOCK_H, _D_V], gl.float32, layout=o_layout)
            s_zero = gl.zeros([_BLOCK_H, _BLOCK_K], gl.float32, layout=s_layout)
            # row sums per row, warp group and lane [BLOCK_H, 2, 4] (2 registers a thread, where one per element
            # of S would take 16), reduced across threads once after the loop
            l_thr = _thread_sums(s_zero)
            alpha_thr: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, l_thr.type.layout))
            o_kc = gl.arange(0, _BLOCK_K, layout=gl.SliceLayout(0, s_layout))
            for i in range(n_tiles):
                b = i % 2
                o_j = start + i * _BLOCK_K + o_kc
                row = gl.load(p_rows + o_j, mask=o_j < end, other=-1)
                mbarrier.wait(full.index(b), (i // 2) & 1)
                s_tok = _issue_qk(q_nope, q_rope, k_nope, k_rope, b, s_zero)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))

                s = gl.where((row >= 0)[None, :], s * qk_scale_log2, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, axis=1))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf)
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(s - m_safe[:, None])
                l_thr = l_thr * gl.convert_layout(alpha, alpha_thr)[:, None, None] + _thread_sums(p)
                m_i = m_new

                # P to shared memory (both groups are past the previous PV), then O = O * alpha + P V
                p_smem.store(p.to(gl.bfloat16))
                fence_async_shared()
                gl.thread_barrier()
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                acc_tok = warpgroup_mma(p_smem, k_nope.index(b), acc, is_async=True)
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
        def _sparse_mla_decode_fp8_gluon_kernel(
            q_ptr, kv8_ptr, kv32_ptr, kv16_ptr, rows_ptr, row_base_ptr, out_ptr, lse_ptr,
            stride_qn, stride_qh, STRIDE16, stride_rn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
            stride_ls,
            H, K_SEL, CHUNK, qk_scale_log2,
            BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, HAS_ROW_BASE: gl.constexpr, NUM_STAGES: gl.constexpr,
            num_warps: gl.constexpr,
        ):
            """As `_sparse_mla_decode_gluon_kernel` over FP8 rows (the module docstring): STRIDE16 = the pool's
            row stride in 16-byte units; the three kv pointers view the same bytes; NUM_STAGES K buffers."""
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
            k_rope = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, _D_ROPE],
                                               _nvmma_shared([BLOCK_K, _D_ROPE], 16))
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

            # Q (heads past H zero-filled), before the partitions fork
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

            gl.warp_specialize([
                (_consume, (q_nope, q_rope, k_nope, k_rope, p_smem, full, empty, p_rows, start, end, n_tiles,
                            qk_scale_log2, out_ptr, lse_ptr, i_hb, i_n, i_s, H, stride_on, stride_oh, stride_os,
                            stride_ln, stride_lh, stride_ls)),
                (_produce, (kv8_ptr, kv32_ptr, kv16_ptr, p_rows, start, end, n_tiles, STRIDE16, k_nope, k_rope,
                            full, empty)),
            ], [_PRODUCER_WARPS], [_PRODUCER_REGS])
    except Exception as exc:  # noqa: BLE001 - a Gluon whose API differs: the module still imports
        GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

if GLUON_IMPORT_ERROR is not None:
    _sparse_mla_decode_fp8_gluon_kernel = None

"""Sparse MLA decode over DSA's 656-byte FP8 rows in Gluon (Triton 3.6's `triton.experimental.gluon`), for
Hopper: kernels_triton/dsa_gluon.py's design (64 heads a program, two warp groups splitting each tile's
QK^T, P through shared memory, each group its half of O) with the rows' bytes gathered and dequantised
to bf16 in shared memory. Launcher: `hisparse.dsa.fp8.sparse_mla_decode_fp8(..., backend="gluon")`
(`fp8_gluon_unsupported` says where it cannot run); offline compile: experiments/tools/sass_dsa_fp8_gluon.py;
checked against the torch reference on a GPU (tests/test_dsa_fp8.py, marked gpu).

Why
---
The Triton FP8 kernel (kernels_triton/dsa_fp8.py) dequantises in registers at 255 registers and
waits on each wgmma at once, so the conversion never overlaps the matrix math (0.25 of roofline).
Here the conversion runs while the tensor cores work: block c + 1 of the next tile is converted
while QK^T of block c runs, and block 0 while PV of this tile runs.

Shapes (one program = head block `i_hb` of BLOCK_H = 64 heads, request n, split s)
---------------------------------------------------------------------------------
q [N, H, 576] bf16; the row pool kv uint8 [R, 656] passed as three views of the same bytes:
kv8 float8_e4m3fn [R, 656] (latent at 0), kv32 float32 [R, 164] (4 scales at 128), kv16 bf16
[R, 328] (RoPE at 264), one row every STRIDE16 * 16 bytes; rows [N, k] int32 (-1 = skip),
row_base [N] int64 (optional), out [N, H, 512] bf16 (or float32 partials [N, H, splits, 512]),
lse [N, H] (or [N, H, splits]) float32: `kernels_triton/dsa_gluon.py`'s outputs.
Shared memory (BLOCK_K 64, NUM_STAGES 2): Q nope bf16 64 x 512 (64 KiB) + rope 64 x 64 (8 KiB);
K nope bf16 [BLOCK_K, 512] (64 KiB, one buffer: a second does not fit 227 KiB beside the raw ring);
K rope bf16 [NUM_STAGES, BLOCK_K, 64] (16 KiB, cp.async'd as stored); raw latent bytes
[NUM_STAGES, BLOCK_K, 512] e4m3 (64 KiB) and their scales [NUM_STAGES * 4, BLOCK_K] float32 (2 KiB);
P bf16 64 x BLOCK_K (8 KiB): 226 KiB.

One tile i (two warp groups, warps_per_cta [4, 2] in both MMA layouts, as dsa_gluon.py)
--------------------------------------------------------------------------------------
- top: S(i) = Q K(i)^T is in registers; barrier (every warp is past tile i's dequantisation and
  QK^T), then cp.async tile i + 2's raw bytes, scales and RoPE into stage i % 2: they have one
  whole tile's time to land.
- online softmax in the log2 domain (row max across the groups, row sums per row, warp group and
  lane, reduced once after the loop, -1 rows -inf), P to shared memory; tile i + 1's copies waited for (issued a tile
  ago) under the same barrier; O = O * alpha + P V(i) issued async (group g: V columns g*256 ..).
- while PV(i) runs: block 0 (latent columns 0 .. 127) of tile i + 1 read from the raw stage and
  converted in registers to bf16 times its row's scale (`_e4m3_bf16x2`; a power-of-two scale: exact).
- PV(i) waited, barrier (both groups are done reading K nope), block 0 stored; then for c = 0 .. 3:
  fence, barrier, QK^T of block c issued async (after the RoPE dims' for c = 0, one accumulator
  chain), and block c + 1 converted and stored while it runs. S(i + 1) waited for at the end.
  Per tile and group: 36 HGMMA.64x32x16 for QK^T (4 of them RoPE) and 4 HGMMA.64x256x16 for PV,
  the bf16 kernel's counts; what is left unhidden is block 0's shared stores and the barriers.
Rows -1 (and rows past the chunk's end) are masked copies, zero-filled (a zero byte is e4m3 0, a
zero scale 0), and their logits are -inf.

Dequantisation without shared-memory conflicts, and row sums without a spill
--------------------------------------------------------------------------
- Layout: 8 lanes down 8 rows (`_row_lanes_layout`) and the raw bytes' 16-byte chunks XORed with
  row % 8 (`_RAW_LAYOUT`), so the raw loads, the cp.async writes and the bf16 stores of 8 lanes each
  meet 8 bank groups (row-major bytes with 8 lanes along a row conflict 2-way on the bf16 stores:
  Nsight Compute's excess shared wavefronts); one scale a thread a block.
- Conversion (`_e4m3_bf16x2`): e4m3 bits moved into bf16 (PRMT, SHL, AND) and two packed bf16
  multiplies per 2 values, against the float32 path's F2FP, 2 HADD2, 2 FMUL, F2FP: the same bits for
  power-of-two scales (the format's; every e4m3 byte checked against the float32 path).
- Row sums per row, warp group and lane (`_thread_sums`, 2 registers a thread) rather than per
  element of S (16): 255 registers without the spill; out and lse are within float32 rounding of
  per-element sums, not bitwise.
Measured against the float32 conversion with per-element sums (H200, 1b552100e410, graphed, batch 64,
128 heads, k 2048): 149.6 against 172.8 us; results/notes/fp8.md.

Semantics are `_sparse_mla_decode_gluon_kernel`'s over the dequantised rows: output = acc / l
(zeros without a valid row), lse in natural log (-inf without a valid row), fp32 accumulation,
rows read in order BLOCK_K at a time, the same operations in the same order on every launch. Its
QK^T accumulates the nope part in four chained blocks, so it is not bitwise the bf16 Gluon kernel.

bf16 q only (the rows' RoPE is bf16 as stored), 512 + 64 rows, >= 64 heads, sm_90, Triton 3.6;
where Gluon or its Hopper API is missing, GLUON_IMPORT_ERROR says so (the module still imports).
"""
from __future__ import annotations

GLUON_IMPORT_ERROR: str | None = None
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except Exception as exc:  # noqa: BLE001 - an older/newer Triton without this Gluon API: import still works
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    gluon = gl = None

BLOCK_H = 64      # heads per program: one wgmma M (64) per warp group
BLOCK_K = 64      # rows per tile
NUM_STAGES = 2    # ring of raw tiles: tile i + 2 copied while tile i is computed and tile i + 1 converted
NUM_WARPS = 8     # two warp groups
TILE = 128        # latent values per scale
D_V, D_ROPE = 512, 64
SCALE_WORD = D_V // 4            # float32 index of a row's first scale (byte 512)
ROPE_HALF = (D_V + 16) // 2      # bf16 index of a row's first RoPE value (byte 528)

if GLUON_IMPORT_ERROR is None:
    try:
        LN2 = gl.constexpr(0.6931471805599453)
        _D_V = gl.constexpr(D_V)
        _D_ROPE = gl.constexpr(D_ROPE)
        _TILE = gl.constexpr(TILE)
        _SCALE_WORD = gl.constexpr(SCALE_WORD)
        _ROPE_HALF = gl.constexpr(ROPE_HALF)
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

        # Shared layout of the raw latent bytes [BLOCK_K, 512]: 16-byte chunks XORed with row % 8 (rows are
        # 512 bytes, so unswizzled 8 rows' same chunk would share banks)
        _RAW_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0]))

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
        def _gather_tile(kv8_ptr, kv32_ptr, kv16_ptr, p_rows, j0, end, STRIDE16, raw_smem, scale_smem, sbase, rope_smem,
                         BLOCK_K: gl.constexpr, num_warps: gl.constexpr):
            """cp.async the rows rows[j0 : j0 + BLOCK_K] (-1 or j >= end: zero-filled) into one stage:
            latent bytes [BLOCK_K, 512] -> raw_smem, scale t of each row -> scale_smem.index(sbase + t)
            [BLOCK_K], RoPE bf16 [BLOCK_K, 64] -> rope_smem."""
            lat_l: gl.constexpr = _vector_layout(_D_V, 8, num_warps)
            rope_l: gl.constexpr = _vector_layout(_D_ROPE, 16, num_warps)
            o_j = j0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, lat_l))
            row = gl.load(p_rows + o_j, mask=o_j < end, other=-1)
            o_c = gl.arange(0, _D_V, layout=gl.SliceLayout(0, lat_l))
            p_lat = kv8_ptr + (row.to(gl.int64) * STRIDE16 * 16)[:, None] + o_c[None, :]
            async_copy.async_copy_global_to_shared(raw_smem, p_lat, mask=(row >= 0)[:, None])
            row_r = gl.convert_layout(row, gl.SliceLayout(1, rope_l))
            o_r = _ROPE_HALF + gl.arange(0, _D_ROPE, layout=gl.SliceLayout(0, rope_l))
            p_rope = kv16_ptr + (row_r.to(gl.int64) * STRIDE16 * 8)[:, None] + o_r[None, :]
            async_copy.async_copy_global_to_shared(rope_smem, p_rope, mask=(row_r >= 0)[:, None])
            sc_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                                  warps_per_cta=[num_warps], order=[0])
            row_s = gl.convert_layout(row, sc_l)
            p_sc = kv32_ptr + row_s.to(gl.int64) * STRIDE16 * 4 + _SCALE_WORD
            for t in gl.static_range(_D_V // _TILE):
                async_copy.async_copy_global_to_shared(scale_smem.index(sbase + t), p_sc + t, mask=row_s >= 0)

        @gluon.jit
        def _dequant(x, scale):
            """x [BLOCK_K, 128] e4m3 times its rows' scales [BLOCK_K] (SliceLayout(1) of x's layout), as bf16
            in x's layout (`_e4m3_bf16x2`: for power-of-two scales the bits of e4m3 -> float32, times the
            scale, -> bf16, which is exact)."""
            m1 = (gl.minimum(scale, _TWO_7) * _TWO_120).to(gl.bfloat16)        # [BLOCK_K]: <= 2 ** 127
            m2 = gl.maximum(scale * (1.0 / _TWO_7), 1.0).to(gl.bfloat16)     # [BLOCK_K]: 1 unless scale > 2 ** 7
            return _e4m3_bf16x2(x, m1[:, None], m2[:, None])

        @gluon.jit
        def _convert_block(raw_smem, scale_smem, sbase, c: gl.constexpr, layout: gl.constexpr):
            """Latent block c (columns c*128 .. c*128 + 127) of a raw stage, dequantised: [BLOCK_K, 128] bf16
            in `layout`."""
            x = raw_smem.slice(c * _TILE, _TILE, dim=1).load(layout)                 # [BLOCK_K, 128] e4m3
            scale = scale_smem.index(sbase + c).load(gl.SliceLayout(1, layout))            # [BLOCK_K]
            return _dequant(x, scale)

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
        def _dequant_and_qk(q_nope, q_rope, k_nope, k_rope, raw_smem, scale_smem, sbase, b0, s_zero,
                            deq_l: gl.constexpr):
            """K nope := the dequantised raw stage (block 0 already converted: b0), QK^T issued block by
            block, each block's conversion overlapping the previous block's MMA. Returns S (waited)."""
            k_nope.slice(0, _TILE, dim=1).store(b0)
            fence_async_shared()
            gl.thread_barrier()
            s_tok = warpgroup_mma(q_rope, k_rope.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_tok = _qk_block(q_nope, k_nope, 0, s_tok)
            for c in gl.static_range(1, _D_V // _TILE):
                blk = _convert_block(raw_smem, scale_smem, sbase, c, deq_l)
                k_nope.slice(c * _TILE, _TILE, dim=1).store(blk)
                fence_async_shared()
                gl.thread_barrier()
                s_tok = _qk_block(q_nope, k_nope, c, s_tok)
            return warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))

        @gluon.jit
        def _sparse_mla_decode_fp8_gluon_kernel(
            q_ptr, kv8_ptr, kv32_ptr, kv16_ptr, rows_ptr, row_base_ptr, out_ptr, lse_ptr,
            stride_qn, stride_qh, STRIDE16, stride_rn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
            stride_ls,
            H, K_SEL, CHUNK, qk_scale_log2,
            BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, HAS_ROW_BASE: gl.constexpr, NUM_STAGES: gl.constexpr,
            num_warps: gl.constexpr,
        ):
            """As `_sparse_mla_decode_gluon_kernel` over FP8 rows (the module docstring): STRIDE16 =
            the pool's row stride in 16-byte units; the three kv pointers view the same bytes."""
            gl.static_assert(num_warps == 8, "two warp groups: warps_per_cta [4, 2]")
            gl.static_assert(BLOCK_H == 64, "one wgmma M of 64 rows per warp group")
            gl.static_assert(NUM_STAGES == 2, "tile i + 2 is copied into tile i's stage")
            dtype: gl.constexpr = gl.bfloat16

            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                               instr_shape=[16, BLOCK_K // 2, 16])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                               instr_shape=[16, _D_V // 2, 16])
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
            nope_reg: gl.constexpr = _vector_layout(_D_V, 16, num_warps)
            rope_reg: gl.constexpr = _vector_layout(_D_ROPE, 16, num_warps)
            deq_l: gl.constexpr = _row_lanes_layout(_TILE, 8, num_warps)   # [BLOCK_K, 128] e4m3: 2 x 16 a thread

            q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, _D_V], _nvmma_shared([BLOCK_H, _D_V], 16))
            q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, _D_ROPE], _nvmma_shared([BLOCK_H, _D_ROPE], 16))
            k_nope = gl.allocate_shared_memory(dtype, [BLOCK_K, _D_V], _nvmma_shared([BLOCK_K, _D_V], 16))
            k_rope = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, _D_ROPE],
                                               _nvmma_shared([BLOCK_K, _D_ROPE], 16))
            raw = gl.allocate_shared_memory(kv8_ptr.dtype.element_ty, [NUM_STAGES, BLOCK_K, _D_V],
                                         _RAW_LAYOUT)
            scales = gl.allocate_shared_memory(gl.float32, [NUM_STAGES * (_D_V // _TILE), BLOCK_K],
                                               gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
            p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_K], _nvmma_shared([BLOCK_H, BLOCK_K], 16))

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
            N_BLK: gl.constexpr = _D_V // _TILE

            # Q (heads past H zero-filled) and tile 0 as one copy group, tile 1 as the next (a group is
            # committed even when empty, so that wait_group counts tiles).
            o_hn = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, nope_reg))
            o_vn = gl.arange(0, _D_V, layout=gl.SliceLayout(0, nope_reg))
            p_qn = q_ptr + i_n * stride_qn + o_hn[:, None].to(gl.int64) * stride_qh + o_vn[None, :]
            async_copy.async_copy_global_to_shared(q_nope, p_qn, mask=(o_hn < H)[:, None])
            o_hr = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rope_reg))
            o_rr = _D_V + gl.arange(0, _D_ROPE, layout=gl.SliceLayout(0, rope_reg))
            p_qr = q_ptr + i_n * stride_qn + o_hr[:, None].to(gl.int64) * stride_qh + o_rr[None, :]
            async_copy.async_copy_global_to_shared(q_rope, p_qr, mask=(o_hr < H)[:, None])
            for t in gl.static_range(NUM_STAGES):
                if t < n_tiles:
                    _gather_tile(kv8_ptr, kv32_ptr, kv16_ptr, p_rows, start + t * BLOCK_K, end, STRIDE16,
                                 raw.index(t), scales, t * N_BLK, k_rope.index(t), BLOCK_K, num_warps)
                async_copy.commit_group()

            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
            # row sums per row, warp group and lane [BLOCK_H, 2, 4], reduced across threads once after the loop
            # (`_thread_sums`: 2 registers a thread, where one per element of S would take 16 and spill)
            acc = gl.zeros([BLOCK_H, _D_V], gl.float32, layout=o_layout)
            s_zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)
            l_thr = _thread_sums(s_zero)
            alpha_thr: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, l_thr.type.layout))
            o_kc = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))

            # tile 0: dequantised and S computed (for n_tiles == 0 it reads unwritten shared memory and
            # is never used)
            async_copy.wait_group(NUM_STAGES - 1)
            gl.thread_barrier()
            b0 = _convert_block(raw.index(0), scales, 0, 0, deq_l)
            s = _dequant_and_qk(q_nope, q_rope, k_nope, k_rope.index(0), raw.index(0), scales, 0, b0,
                                s_zero, deq_l)
            for i in range(n_tiles):
                # Here S = Q K^T of tile i is in registers and K nope holds tile i.
                j0 = start + i * BLOCK_K
                stage = i % NUM_STAGES
                o_j = j0 + o_kc
                row = gl.load(p_rows + o_j, mask=o_j < end, other=-1)
                # Every warp is past tile i's dequantisation and QK^T: stage i % 2 may be overwritten.
                gl.thread_barrier()
                if i + NUM_STAGES < n_tiles:
                    _gather_tile(kv8_ptr, kv32_ptr, kv16_ptr, p_rows, j0 + NUM_STAGES * BLOCK_K, end, STRIDE16,
                                 raw.index(stage), scales, stage * N_BLK, k_rope.index(stage),
                                 BLOCK_K, num_warps)
                async_copy.commit_group()

                s = gl.where((row >= 0)[None, :], s * qk_scale_log2, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, axis=1))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf)
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(s - m_safe[:, None])
                l_thr = l_thr * gl.convert_layout(alpha, alpha_thr)[:, None, None] + _thread_sums(p)
                m_i = m_new

                # P to shared memory; tile i + 1's copies (this thread's) landed; one barrier makes both
                # visible to every warp (and P to wgmma).
                p_smem.store(p.to(dtype))
                async_copy.wait_group(NUM_STAGES - 1)
                fence_async_shared()
                gl.thread_barrier()
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                acc_tok = warpgroup_mma(p_smem, k_nope, acc, is_async=True)
                if i + 1 < n_tiles:
                    nxt = (i + 1) % NUM_STAGES
                    raw_n = raw.index(nxt)
                    sc_n = nxt * N_BLK
                    b0 = _convert_block(raw_n, scales, sc_n, 0, deq_l)     # overlaps PV(i)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
                    gl.thread_barrier()                                     # both groups are done with K nope
                    s = _dequant_and_qk(q_nope, q_rope, k_nope, k_rope.index(nxt), raw_n, scales, sc_n, b0,
                                        s_zero, deq_l)
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
            async_copy.wait_group(0)  # the last (empty) groups
            l_i = gl.convert_layout(gl.sum(gl.sum(l_thr, axis=2), axis=1), row_s)   # lanes, then groups

            m_any = l_i > 0.0
            l_safe = gl.where(m_any, l_i, 1.0)
            lse = gl.where(m_any, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
            out = acc / gl.convert_layout(l_safe, row_o)[:, None]
            o_ho = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_o)
            o_vo = gl.arange(0, _D_V, layout=gl.SliceLayout(0, o_layout))
            p_out = (out_ptr + i_n * stride_on + o_ho[:, None].to(gl.int64) * stride_oh + i_s * stride_os
                     + o_vo[None, :])
            gl.store(p_out, out.to(out_ptr.dtype.element_ty), mask=(o_ho < H)[:, None])
            o_hl = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_s)
            gl.store(lse_ptr + i_n * stride_ln + o_hl * stride_lh + i_s * stride_ls, lse, mask=o_hl < H)
    except Exception as exc:  # noqa: BLE001 - a Gluon whose API differs: the module still imports
        GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

if GLUON_IMPORT_ERROR is not None:
    _sparse_mla_decode_fp8_gluon_kernel = None

"""Sparse MLA decode over DSA's 656-byte FP8 rows as a 2-CTA cluster in Gluon (Triton 3.6, sm_90a): at 128 heads
each selected row is copied and dequantised once per request instead of once per 64-head program (issue 36;
results/notes/fp8.md, "A 2-CTA cluster"). A prototype beside kernels_triton/dsa_fp8_gluon.py, not yet behind
`hisparse.dsa.fp8.sparse_mla_decode_fp8`: its launcher, offline compile check, smoke test and timing are in
experiments/tools/gluon_fp8_cluster.py until it is measured; tests in tests/test_dsa_fp8_cluster.py.

Scheme
------
One cluster of 2 CTAs = one request n and split s, all 128 heads (launch option num_ctas=2; grid (1, N, splits)
clusters, the CUDA grid twice as wide). CTA r holds heads r*64 .. r*64+63: Q, S, P, O, out and lse in layouts
split over the pair by heads (cga_layout [[1, 0]]), each CTA running today's 64-head program on them (warps
[4, 2], the same wgmma shapes, the same per-CTA register layouts). The K tiles (latent bf16 [64, 512], RoPE bf16
[64, 64]) are held whole by both CTAs ([[0, 0]]). Of each 64-row tile, CTA r cp.asyncs the latent bytes and
scales of rows r*32 .. r*32+31 only (a half-height raw ring) and dequantises them, 128 columns a block exactly
as today (e4m3 -> float32, times the row's float32 scale, -> bf16), and writes each 16-byte piece into its own K
tile (st.shared) and into the peer's (st.async; inline PTX: Triton 3.6's Gluon has no remote store), at the
address Triton gave the K tile: global_smem + K_OFF (checked against the MLIR dump's allocation.offset by the
offline check and by --smoke) plus the NVMMA 128-byte swizzle of a bf16 [64, 512] tile, by hand:
    (col // 64) * 8192 + row * 128 + (((col % 64) // 8) ^ (row % 8)) * 16 + (col % 8) * 2
(Triton's nvmmaSharedToLinearLayout: 8 x 64 swizzled core tiles down the rows, then 64-column chunks). The local
and peer addresses are computed once (mapa outside the loop) and each block's offset is an immediate: with the
mapa inside the store's asm, ptxas hoisted 16 remote addresses out of the loop and spilled 400 bytes. The RoPE
rows (128 bytes each) are cp.async'd whole by both CTAs, as stored.
Gluon 3.6 cannot subslice a shared buffer in a cluster ("non-trivial block dimension not supported"), so every
block is a buffer index instead: Q nope as [4, 128, 128], K nope allocated [64, 512] (PV's V) and reinterpreted
as [4, 64, 128] (the same bytes: a block is two 64-column chunks), the raw ring [2, 4, 32, 128] e4m3 and the
scales [2, 4, 32], each tile's half copied by one cp.async each (no CTA barrier between copies into one buffer).

Synchronisation (inline PTX where Gluon 3.6 has none)
------------------------------------------------------
- setup: each CTA inits 4 mbarriers (one per 128-column block, count 1), fence.mbarrier_init, then a cluster
  barrier (arrive.release / wait.acquire, its one MEMBAR.ALL.GPU): the peer's barriers exist before anything is
  written into it.
- readiness, per block and tile: before writing tile t, one thread arrives on each block's mbarrier expecting
  8192 bytes (the peer's 32 rows x 128 columns of bf16; Gluon's mbarrier.expect); the peer's st.async complete
  them. Before QK^T of block c: this CTA's own stores done and bar[c] through phase t (mbarrier wait on parity
  t % 2), then fence.proxy.async and a CTA barrier (as today), so wgmma sees both halves.
- "K free": where today's kernel has a CTA barrier after PV (both warp groups done reading K), a relaxed cluster
  barrier: neither CTA writes tile t + 1 into either K tile before both CTAs' PV(t) have read it (QK^T(t)
  finished before PV(t) began). A relaxed arrive adds no MEMBAR.ALL.GPU (the release form does); a write after
  a read needs no release. Phase t + 1 of a block's mbarrier cannot complete before every thread here has seen
  phase t complete (it needs this CTA's arrival, issued after this barrier), so parity waits never skip a phase;
  the peer's bytes may land before that arrival (the transaction count goes negative meanwhile, as PTX allows).
- exit: a relaxed cluster arrive after the loop (after this CTA's last remote store) and its wait at the
  kernel's end, around the epilogue: neither CTA exits while its peer may still write into it.

Exactness
---------
Every head's out and lse are meant to equal today's default Gluon FP8 kernel's (kernels_triton/dsa_fp8_gluon.py,
DEQUANT "f32", THREAD_SUMS off) bit for bit, for the same split plan (the launcher reuses
`split_plan(..., GLUON_FP8_TILES, ...)`): the same bf16 K tile values (the same f32 arithmetic per value; which CTA
computes a row does not change its bits), the same wgmma sequence (RoPE then latent blocks 0..3 into one chain;
PV as 64x256x16 per warp group) over the same per-CTA operand layouts, the same online softmax in the same
per-CTA layout and order (row sums per element of S, reduced after the loop), the same epilogue and combine.
Not checked on a GPU yet: tests/test_dsa_fp8_cluster.py compares the two with torch.equal.

Shared memory per CTA: Q nope 64 KiB + Q rope 8 + K nope 64 + K rope 2 x 8 + raw half-rows 2 x 16 + scales 1
+ P 8 + 4 mbarriers: 198688 bytes (today's kernel 231936). Shapes: q [N, 128, 576] bf16; kv uint8 [R, 656] rows
passed as three views (kv8 e4m3 / kv32 float32 / kv16 bf16 of the same bytes, as today's kernel); rows [N, k]
int32 (-1 skipped); row_base [N] int64 (optional); out [N, 128, 512] bf16 or float32 partials [N, 128, splits,
512]; lse [N, 128] or [N, 128, splits] float32.

Risks (what to check first on a GPU): hand-placed addresses (K_OFF, BAR_OFF, the swizzle), fences the compiler
cannot see (our asm's shared stores are invisible to Triton's barrier analysis; explicit barriers cover them),
and both CTAs taking the same control flow to the end (they do: same request, same split, same tile count).
"""
from __future__ import annotations

HEADS = 128          # per request: 64 a CTA, 2 CTAs a cluster
BLOCK_H = 64         # heads a CTA (one wgmma M per warp group)
BLOCK_K = 64         # rows a tile (both CTAs' K tiles hold all 64)
HALF_K = 32          # rows a CTA copies and dequantises per tile
NUM_STAGES = 2       # raw ring: tile i + 2 copied while tile i is computed and tile i + 1 converted
NUM_WARPS = 8        # two warp groups a CTA
NUM_CTAS = 2         # the cluster
TILE = 128           # latent values per scale (= a dequantised block's columns)
D_V, D_ROPE = 512, 64
SCALE_WORD = D_V // 4              # float32 index of a row's first scale (byte 512)
ROPE_HALF = (D_V + 16) // 2        # bf16 index of a row's first RoPE value (byte 528)
BLOCK_BYTES = HALF_K * TILE * 2    # bytes of one block the peer writes into this CTA's K tile per tile: 8192
# Where Triton 3.6 places the K nope tile and the 4 mbarriers (bytes from global_smem): the MLIR dump's
# allocation.offset of %k_nope and %bars, checked by `offline()` for both HAS_ROW_BASE specialisations.
K_OFF = 0
BAR_OFF = 198656

GLUON_IMPORT_ERROR: str | None = None
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except Exception as exc:  # noqa: BLE001 - a Triton without this Gluon API: the module still imports
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    gluon = gl = None

if GLUON_IMPORT_ERROR is None:
    try:
        LN2 = gl.constexpr(0.6931471805599453)
        _D_V = gl.constexpr(D_V)
        _D_ROPE = gl.constexpr(D_ROPE)
        _TILE = gl.constexpr(TILE)
        _HALF_K = gl.constexpr(HALF_K)
        _SCALE_WORD = gl.constexpr(SCALE_WORD)
        _ROPE_HALF = gl.constexpr(ROPE_HALF)
        _BLOCK_BYTES = gl.constexpr(BLOCK_BYTES)
        _HEADS = gl.constexpr(HEADS)
        _BLOCK_K = gl.constexpr(BLOCK_K)
        _NUM_STAGES = gl.constexpr(NUM_STAGES)
        _THREADS = gl.constexpr(NUM_WARPS * 32)
        # Layouts: module-level constexprs (a cga_layout list written inside a jit function breaks layout
        # equality in 3.6). SPLIT: dim 0 split over the 2 CTAs (heads); WHOLE: every CTA holds all of it.
        _SPLIT, _WHOLE = [[1, 0]], [[0, 0]]
        # S [128 heads, 64 rows] and O [128, 512] float32: per CTA today's MMA layouts (warps [4, 2])
        S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                          instr_shape=[16, BLOCK_K // 2, 16], cga_layout=_SPLIT))
        O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                          instr_shape=[16, D_V // 2, 16], cga_layout=_SPLIT))
        # Q nope block [128, 128] / Q rope [128, 64] bf16 loads: 16-byte vectors, lanes along the row
        QN_REG = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0], cga_layout=_SPLIT))
        QR_REG = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0], cga_layout=_SPLIT))
        # K rope [64, 64] bf16: all rows in both CTAs
        ROPE_REG = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0], cga_layout=_WHOLE))
        # one latent block of this CTA's half-tile [32, 128] (e4m3 when copied, bf16 once dequantised): 16 values a
        # thread, 8 lanes along a row (today's "f32" layout at half height); no element held twice, so each CTA
        # st.async's exactly BLOCK_BYTES a block into its peer
        DEQ_REG = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0], cga_layout=_WHOLE))
        # one value a thread ([256]): the cluster barriers' asm runs once a thread
        ONE_REG = gl.constexpr(gl.BlockedLayout([1], [32], [NUM_WARPS], [0], cga_layout=[[0]]))
        # a half-tile's copy [4 blocks, 32 rows, 128] e4m3: each thread 16 bytes of one row in each block (its row
        # index loaded once); and its scales [4, 32] float32 (a lane a row, warps repeating it)
        GATHER3 = gl.constexpr(gl.BlockedLayout([1, 1, 16], [1, 4, 8], [1, NUM_WARPS, 1], [2, 1, 0],
                                                cga_layout=[[0, 0, 0]]))
        SC_REG = gl.constexpr(gl.BlockedLayout([4, 1], [1, 32], [1, NUM_WARPS], [1, 0], cga_layout=_WHOLE))
        # shared: every wgmma tile is 128 bytes a row or a multiple of it (the 128-byte NVMMA swizzle). Gluon 3.6
        # cannot subslice a buffer in a cluster ("non-trivial block dimension"), so blocks are buffer indices.
        Q_SH = gl.constexpr(gl.NVMMASharedLayout(128, 16, rank=2, cga_layout=_SPLIT))       # Q blocks, Q rope, P
        K_SH = gl.constexpr(gl.NVMMASharedLayout(128, 16, rank=2, cga_layout=_WHOLE))       # K nope, K rope stages
        RAW_SH = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0], cga_layout=_WHOLE))  # raw blocks, row-major
        RAW3_SH = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0], cga_layout=[[0, 0, 0]]))  # the same, 3-D
        SC_SH = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0], cga_layout=[[0]]))      # scales [8, 32]
        BAR_SH = gl.constexpr(mbarrier.MBarrierLayout(cga_layout=[[0]]))                   # mbarriers [4, 1]
        # 8 int8 results (2 registers, unused); 8 int32 each of local addresses ($2..$9), peer addresses ($10..$17)
        # and peer mbarrier addresses ($18..$25); 8 bf16 packed in 4 registers ($26..$29)
        _STORE_CONSTRAINTS = gl.constexpr("=r,=r," + ",".join(["r"] * 28))

        @gluon.jit
        def _cluster_rank(like):
            """This CTA's rank in its cluster (0 or 1), in `like`'s shape and layout."""
            return gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r,r", [like], dtype=gl.int32,
                                             is_pure=True, pack=1)

        @gluon.jit
        def _cluster_sync_init(like):
            """After mbarrier.init: the inits released to the cluster, then a full cluster barrier (release /
            acquire; once a launch, so its MEMBAR.ALL.GPU costs nothing). `like`: one value a thread."""
            return gl.inline_asm_elementwise(
                "fence.mbarrier_init.release.cluster;\n\tbarrier.cluster.arrive.release.aligned;\n\t"
                "barrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
                "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)

        @gluon.jit
        def _cluster_sync_relaxed(like):
            """A cluster barrier without release semantics (no MEMBAR.ALL.GPU): execution order only ("K free")."""
            return gl.inline_asm_elementwise(
                "barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;\n\tmov.u32 $0, 0;",
                "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)

        @gluon.jit
        def _cluster_arrive_relaxed(like):
            """The arrive half of a relaxed cluster barrier (its wait: `_cluster_wait`)."""
            return gl.inline_asm_elementwise("barrier.cluster.arrive.relaxed.aligned;\n\tmov.u32 $0, 0;",
                                             "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)

        @gluon.jit
        def _cluster_wait(like):
            return gl.inline_asm_elementwise("barrier.cluster.wait.aligned;\n\tmov.u32 $0, 0;",
                                             "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)

        @gluon.jit
        def _smem_addr(off):
            """The shared-window address of byte `off` of this CTA's shared memory (from Triton's global_smem)."""
            return gl.inline_asm_elementwise("{\n .reg .b32 a;\n mov.u32 a, global_smem;\n add.u32 $0, a, $1;\n}",
                                             "=r,r", [off], dtype=gl.int32, is_pure=True, pack=1)

        @gluon.jit
        def _peer_addr(addr):
            """mapa: the address of the same shared byte in the peer CTA (rank ^ 1), as a shared::cluster address."""
            return gl.inline_asm_elementwise(
                "{\n .reg .b32 p;\n mov.u32 p, %cluster_ctarank;\n xor.b32 p, p, 1;\n"
                " mapa.shared::cluster.u32 $0, $1, p;\n}",
                "=r,r", [addr], dtype=gl.int32, is_pure=True, pack=1)

        @gluon.constexpr_function
        def _store_here_and_peer_asm(k_off, bar_off):
            """PTX: 16 bytes ($26..$29: 8 bf16) at $2 + k_off here (st.shared) and at $10 + k_off in the peer
            (st.async, completing the peer's mbarrier at $18 + bar_off by 16 bytes). The addresses come in computed
            once (`_smem_addr`, `_peer_addr`); the block's offsets are immediates, so nothing here is loop-invariant
            work that ptxas would hoist into registers held across the loop."""
            return gl.constexpr(
                f"st.shared.v4.b32 [$2+{k_off}], {{$26, $27, $28, $29}};\n\t"
                f"st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [$10+{k_off}], {{$26, $27, $28, $29}}, "
                f"[$18+{bar_off}];\n\tmov.b32 $0, 0;\n\tmov.b32 $1, 0;")

        @gluon.jit
        def _store_here_and_peer(here, peer, peer_bar, blk, K_BLOCK_OFF: gl.constexpr, BLK_BAR_OFF: gl.constexpr):
            """blk [32, 128] bf16 (DEQ_REG) into this CTA's K tile and the peer's: here / peer [32, 128] the addresses
            of each element in K nope's block 0 (the first of each 8 is used: 8 consecutive columns, 16 bytes),
            peer_bar the peer's mbarrier 0; K_BLOCK_OFF / BLK_BAR_OFF the block's and its mbarrier's byte offsets
            from those."""
            return gl.inline_asm_elementwise(
                asm=_store_here_and_peer_asm(K_BLOCK_OFF, BLK_BAR_OFF),
                constraints=_STORE_CONSTRAINTS, args=[here, peer, peer_bar, blk], dtype=gl.int8, is_pure=False,
                pack=8)

        @gluon.jit
        def _gather_half(kv8_ptr, kv32_ptr, kv16_ptr, p_rows, j0, end, STRIDE16, rank_lat, rank_sc, raw_stage,
                         scale_stage, rope_smem):
            """cp.async, of the tile rows[j0 : j0 + 64] (-1 or j >= end: zero-filled), this CTA's half (rows
            j0 + rank*32 ..): its latent bytes as raw_stage [4 blocks, 32, 128] e4m3, its scales as scale_stage
            [4, 32]; and every row's RoPE bf16 [64, 64] -> rope_smem (both CTAs copy it all). One copy each (no CTA
            barrier between copies into one buffer), one row index a thread."""
            rows_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, GATHER3))
            o_j = j0 + rank_lat * _HALF_K + gl.arange(0, _HALF_K, layout=rows_l)
            row = gl.load(p_rows + o_j, mask=o_j < end, other=-1)                                    # [32]
            o_t = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, GATHER3)))
            o_c = gl.arange(0, _TILE, layout=gl.SliceLayout(0, gl.SliceLayout(1, GATHER3)))
            p_lat = kv8_ptr + ((row.to(gl.int64) * STRIDE16 * 16)[None, :, None] + (o_t * _TILE)[:, None, None]
                               + o_c[None, None, :])                                                 # [4, 32, 128]
            async_copy.async_copy_global_to_shared(raw_stage, p_lat, mask=(row >= 0)[None, :, None])
            o_jr = j0 + gl.arange(0, 2 * _HALF_K, layout=gl.SliceLayout(1, ROPE_REG))                # [64]
            row_r = gl.load(p_rows + o_jr, mask=o_jr < end, other=-1)
            o_r = _ROPE_HALF + gl.arange(0, _D_ROPE, layout=gl.SliceLayout(0, ROPE_REG))
            p_rope = kv16_ptr + (row_r.to(gl.int64) * STRIDE16 * 8)[:, None] + o_r[None, :]
            async_copy.async_copy_global_to_shared(rope_smem, p_rope, mask=(row_r >= 0)[:, None])
            o_js = j0 + rank_sc * _HALF_K + gl.arange(0, _HALF_K, layout=gl.SliceLayout(0, SC_REG))   # [32]
            row_s = gl.load(p_rows + o_js, mask=o_js < end, other=-1)
            o_ts = gl.arange(0, 4, layout=gl.SliceLayout(1, SC_REG))
            p_sc = kv32_ptr + (row_s.to(gl.int64) * STRIDE16 * 4 + _SCALE_WORD)[None, :] + o_ts[:, None]  # [4, 32]
            async_copy.async_copy_global_to_shared(scale_stage, p_sc, mask=(row_s >= 0)[None, :])

        @gluon.jit
        def _convert_block(raw_smem, scale_smem, sbase, c: gl.constexpr):
            """Latent block c (columns c*128 ..) of this CTA's raw half-tile, dequantised: [32, 128] bf16 in DEQ_REG
            (e4m3 -> float32, times the row's scale, -> bf16: today's "f32" arithmetic, so the same bits)."""
            x = raw_smem.index(sbase + c).load(DEQ_REG)                                    # [32, 128] e4m3
            scale = scale_smem.index(sbase + c).load(gl.SliceLayout(1, DEQ_REG))           # [32] float32
            return (x.to(gl.float32) * scale[:, None]).to(gl.bfloat16)

        @gluon.jit
        def _qk_block(q_blk, k_blk, c: gl.constexpr, s_tok):
            """Issue S += Q[:, block c] K[:, block c]^T (async), behind s_tok: [128, 128] x [128, 64]."""
            return warpgroup_mma(q_blk.index(c), k_blk.index(c).permute((1, 0)), s_tok, is_async=True)

        @gluon.jit
        def _dequant_and_qk(q_blk, q_rope, k_blk, k_rope, raw_smem, scale_smem, sbase, b0, s_zero, k_here, k_peer,
                            bar_peer, bars, phase):
            """K nope := this tile (block 0 already converted here: b0; the peer writes the other half), QK^T issued
            block by block, each block's conversion overlapping the previous block's MMA. Returns S (waited).
            `phase`: this tile's parity on the block mbarriers."""
            # one arrival and the peer's 8 KiB, per block (Triton puts a CTA barrier between these and before the
            # wait; the same arrivals in inline asm, without them, made ptxas spill 400 bytes of wgmma descriptors)
            for c in gl.static_range(_D_V // _TILE):
                mbarrier.expect(bars.index(c), _BLOCK_BYTES)
            _store_here_and_peer(k_here, k_peer, bar_peer, b0, 0, 0)
            mbarrier.wait(bars.index(0), phase)                # the peer's half of block 0 has landed here
            fence_async_shared()                               # ours (generic proxy) seen by wgmma (async proxy)
            gl.thread_barrier()                                # every warp's stores and waits done
            s_tok = warpgroup_mma(q_rope, k_rope.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_tok = _qk_block(q_blk, k_blk, 0, s_tok)
            for c in gl.static_range(1, _D_V // _TILE):
                blk = _convert_block(raw_smem, scale_smem, sbase, c)
                _store_here_and_peer(k_here, k_peer, bar_peer, blk, c * _BLOCK_K * _TILE * 2, c * 8)  # +16 KiB a block
                mbarrier.wait(bars.index(c), phase)
                fence_async_shared()
                gl.thread_barrier()
                s_tok = _qk_block(q_blk, k_blk, c, s_tok)
            return warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))

        @gluon.jit
        def _sparse_mla_decode_fp8_cluster_kernel(
            q_ptr, kv8_ptr, kv32_ptr, kv16_ptr, rows_ptr, row_base_ptr, out_ptr, lse_ptr,
            stride_qn, stride_qh, STRIDE16, stride_rn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
            stride_ls,
            H, K_SEL, CHUNK, qk_scale_log2,
            HAS_ROW_BASE: gl.constexpr, K_OFF: gl.constexpr, BAR_OFF: gl.constexpr,
        ):
            """`_sparse_mla_decode_fp8_gluon_kernel` (DEQUANT 0, THREAD_SUMS off) for 128 heads as a 2-CTA cluster
            (the module docstring). Launch with num_warps=8, num_ctas=2, grid (1, N, splits). K_OFF / BAR_OFF: the
            shared offsets of K nope and of the mbarriers (module constants, checked offline)."""
            dtype: gl.constexpr = gl.bfloat16
            BH2: gl.constexpr = _HEADS                          # 128 heads: 64 a CTA
            BK: gl.constexpr = _BLOCK_K                         # 64 rows a tile
            HK: gl.constexpr = _HALF_K                          # 32 of them copied and dequantised here
            NS: gl.constexpr = _NUM_STAGES
            N_BLK: gl.constexpr = _D_V // _TILE                 # 4 latent blocks of 128
            row_s: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)   # [128] split: a CTA's 64 heads
            row_o: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

            # K nope and the barriers first: their offsets are hand-placed in the asm (K_OFF, BAR_OFF)
            k_nope = gl.allocate_shared_memory(dtype, [BK, _D_V], K_SH)                   # [64, 512] whole: PV's V
            bars = gl.allocate_shared_memory(gl.int64, [N_BLK, 1], BAR_SH)                # one per latent block
            k_blk = k_nope._reinterpret(dtype, [N_BLK, BK, _TILE], K_SH)                  # the same bytes as 4 blocks
            q_blk = gl.allocate_shared_memory(dtype, [N_BLK, BH2, _TILE], Q_SH)           # [4, 128, 128] split
            q_rope = gl.allocate_shared_memory(dtype, [BH2, _D_ROPE], Q_SH)               # [128, 64] split
            k_rope = gl.allocate_shared_memory(dtype, [NS, BK, _D_ROPE], K_SH)            # [2, 64, 64] whole
            e4m3: gl.constexpr = kv8_ptr.dtype.element_ty
            raw_g = gl.allocate_shared_memory(e4m3, [NS, N_BLK, HK, _TILE], RAW3_SH)      # [2, 4, 32, 128]
            raw = raw_g._reinterpret(e4m3, [NS * N_BLK, HK, _TILE], RAW_SH)              # as [8, 32, 128] blocks
            scales_g = gl.allocate_shared_memory(gl.float32, [NS, N_BLK, HK], RAW_SH)     # [2, 4, 32]
            scales = scales_g._reinterpret(gl.float32, [NS * N_BLK, HK], SC_SH)           # as [8, 32]
            p_smem = gl.allocate_shared_memory(dtype, [BH2, BK], Q_SH)                    # [128, 64] split

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
            n_tiles = gl.cdiv(end - start, BK)

            one = gl.arange(0, _THREADS, layout=ONE_REG)                                  # [256]: one a thread
            # this CTA's rank (0 or 1), in the layouts of the gathers' row indices [128] and of a block's rows [32]
            rank_lat = _cluster_rank(gl.arange(0, HK, layout=gl.SliceLayout(0, gl.SliceLayout(2, GATHER3))))
            rank_sc = _cluster_rank(gl.arange(0, HK, layout=gl.SliceLayout(0, SC_REG)))
            rank_d = _cluster_rank(gl.arange(0, HK, layout=gl.SliceLayout(1, DEQ_REG)))
            # byte offset of each element of a dequantised block [32, 128] in K nope's block (row rank*32 + r; the
            # 128-byte swizzle of a [64, 512] bf16 NVMMA tile; block c starts c * 16 KiB on)
            r_d = rank_d * HK + gl.arange(0, HK, layout=gl.SliceLayout(1, DEQ_REG))
            c_d = gl.arange(0, _TILE, layout=gl.SliceLayout(0, DEQ_REG))
            kofs = (c_d[None, :] // 64) * (BK * 128) + r_d[:, None] * 128 + \
                (((c_d[None, :] % 64) // 8) ^ (r_d[:, None] % 8)) * 16 + (c_d[None, :] % 8) * 2
            k_here = _smem_addr(K_OFF + kofs)                     # [32, 128]: each element's address, block 0
            k_peer = _peer_addr(k_here)                           # the same bytes of the peer's K nope
            bar_peer = _peer_addr(_smem_addr(BAR_OFF + kofs * 0))  # the peer's mbarrier 0

            for c in gl.static_range(N_BLK):
                mbarrier.init(bars.index(c), count=1)

            # Q (this CTA's 64 heads) and tile 0 as one copy group, tile 1 as the next (a group is committed even
            # when empty, so that wait_group counts tiles)
            o_hn = gl.arange(0, BH2, layout=gl.SliceLayout(1, QN_REG))
            o_vn = gl.arange(0, _TILE, layout=gl.SliceLayout(0, QN_REG))
            p_qn = q_ptr + i_n * stride_qn + o_hn[:, None].to(gl.int64) * stride_qh + o_vn[None, :]
            for c in gl.static_range(N_BLK):
                async_copy.async_copy_global_to_shared(q_blk.index(c), p_qn + c * _TILE, mask=(o_hn < H)[:, None])
            o_hr = gl.arange(0, BH2, layout=gl.SliceLayout(1, QR_REG))
            o_rr = _D_V + gl.arange(0, _D_ROPE, layout=gl.SliceLayout(0, QR_REG))
            p_qr = q_ptr + i_n * stride_qn + o_hr[:, None].to(gl.int64) * stride_qh + o_rr[None, :]
            async_copy.async_copy_global_to_shared(q_rope, p_qr, mask=(o_hr < H)[:, None])
            for t in gl.static_range(NS):
                if t < n_tiles:
                    _gather_half(kv8_ptr, kv32_ptr, kv16_ptr, p_rows, start + t * BK, end, STRIDE16, rank_lat,
                                 rank_sc, raw_g.index(t), scales_g.index(t), k_rope.index(t))
                async_copy.commit_group()

            m_i = gl.full([BH2], float("-inf"), gl.float32, layout=row_s)
            l_part = gl.zeros([BH2, BK], gl.float32, layout=S_LAYOUT)     # row sums per element of S (today's)
            acc = gl.zeros([BH2, _D_V], gl.float32, layout=O_LAYOUT)
            s_zero = gl.zeros([BH2, BK], gl.float32, layout=S_LAYOUT)
            o_kc = gl.arange(0, BK, layout=gl.SliceLayout(0, S_LAYOUT))   # [64]: both CTAs all of a tile's rows

            _cluster_sync_init(one)            # both CTAs' mbarriers initialised before either writes into the other
            # tile 0 (n_tiles >= 1: the launcher's split plan never makes an empty chunk)
            async_copy.wait_group(NS - 1)
            gl.thread_barrier()
            b0 = _convert_block(raw, scales, 0, 0)
            s = _dequant_and_qk(q_blk, q_rope, k_blk, k_rope.index(0), raw, scales, 0, b0, s_zero, k_here, k_peer,
                                bar_peer, bars, 0)
            for i in range(n_tiles):
                # Here S = Q K^T of tile i is in registers and K nope (both CTAs) holds tile i.
                j0 = start + i * BK
                stage = i % NS
                o_j = j0 + o_kc
                row = gl.load(p_rows + o_j, mask=o_j < end, other=-1)
                # Every warp is past tile i's dequantisation and QK^T: stage i % 2 may be overwritten.
                gl.thread_barrier()
                if i + NS < n_tiles:
                    _gather_half(kv8_ptr, kv32_ptr, kv16_ptr, p_rows, j0 + NS * BK, end, STRIDE16, rank_lat,
                                 rank_sc, raw_g.index(stage), scales_g.index(stage), k_rope.index(stage))
                async_copy.commit_group()

                s = gl.where((row >= 0)[None, :], s * qk_scale_log2, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, axis=1))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf)
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(s - m_safe[:, None])
                l_part = l_part * alpha[:, None] + p
                m_i = m_new

                # P to shared memory; tile i + 1's copies (this thread's) landed; one barrier makes both visible to
                # every warp (and P to wgmma).
                p_smem.store(p.to(dtype))
                async_copy.wait_group(NS - 1)
                fence_async_shared()
                gl.thread_barrier()
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                acc_tok = warpgroup_mma(p_smem, k_nope, acc, is_async=True)
                if i + 1 < n_tiles:
                    nxt = (i + 1) % NS
                    sc_n = nxt * N_BLK
                    b0 = _convert_block(raw, scales, sc_n, 0)                       # overlaps PV(i)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
                    _cluster_sync_relaxed(one)          # K free: both CTAs' PV(i) are done with K nope (today: a CTA's)
                    s = _dequant_and_qk(q_blk, q_rope, k_blk, k_rope.index(nxt), raw, scales, sc_n, b0, s_zero, k_here,
                                        k_peer, bar_peer, bars, (i + 1) % 2)
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
            _cluster_arrive_relaxed(one)       # this CTA's last remote store is issued (the peer waits for it)
            async_copy.wait_group(0)           # the last (empty) groups
            l_i = gl.sum(l_part, axis=1)

            m_any = l_i > 0.0
            l_safe = gl.where(m_any, l_i, 1.0)
            lse = gl.where(m_any, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
            out = acc / gl.convert_layout(l_safe, row_o)[:, None]
            o_ho = gl.arange(0, BH2, layout=row_o)
            o_vo = gl.arange(0, _D_V, layout=gl.SliceLayout(0, O_LAYOUT))
            p_out = (out_ptr + i_n * stride_on + o_ho[:, None].to(gl.int64) * stride_oh + i_s * stride_os
                     + o_vo[None, :])
            gl.store(p_out, out.to(out_ptr.dtype.element_ty), mask=(o_ho < H)[:, None])   # split: each CTA its heads
            o_hl = gl.arange(0, BH2, layout=row_s)
            gl.store(lse_ptr + i_n * stride_ln + o_hl * stride_lh + i_s * stride_ls, lse, mask=o_hl < H)
            _cluster_wait(one)                 # the peer has issued its last store into this CTA: safe to exit
    except Exception as exc:  # noqa: BLE001 - a Gluon whose API differs: the module still imports
        GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

if GLUON_IMPORT_ERROR is not None:
    _sparse_mla_decode_fp8_cluster_kernel = None

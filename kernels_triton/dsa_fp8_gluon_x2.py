"""Sparse MLA decode over DSA's 656-byte FP8 rows for 128 heads as a 2-CTA cluster of warp-specialised programs
(Gluon, Triton 3.6, sm_90a): kernels_triton/dsa_fp8_gluon.py's kernel, with each tile's rows dequantised once per
request instead of once per 64-head program (FlashMLA's "crossover"). A prototype of issue 36: launcher, offline
check, smoke test and timing in experiments/tools/gluon_fp8_x2.py until it is measured (results/notes/fp8.md).

Scheme
------
One cluster = request n, split s, all 128 heads (launch option num_ctas=2, grid (1, N, splits)). CTA r holds heads
r*64 .. r*64+63: Q, S, P, O, out and lse are cluster-wide tensors split over the pair by heads (cga_layout
[[1, 0]]); each CTA's consumers (8 warps) run today's tile loop on them. The K buffers ([2, 64, 512] latent, [2,
64, 64] RoPE, bf16) are held whole by both CTAs ([[0, 0]]). Each CTA's producer (4 warps) loads, dequantises
(`_dequant`) and stores rows r*32 .. r*32+31 of each tile, each 16-byte piece into its own K buffer (st.shared)
and into the peer's (st.async, completing the peer's `full` mbarrier by 16 bytes), at the address Triton gave
the buffer: global_smem + K_OFF (the MLIR dump's allocation offset, checked by the tool) plus the 128-byte NVMMA
swizzle of a bf16 [64, 512] tile:
    b * 65536 + (col // 64) * 8192 + row * 128 + (((col % 64) // 8) ^ (row % 8)) * 16 + (col % 8) * 2
Both CTAs load all 64 rows' RoPE (128 bytes a row) and store them locally.

Barriers (bars [4, 1] at global_smem + BAR_OFF: full[0], full[1], empty[0], empty[1])
--------------------------------------------------------------------------------
- full[b], count 2: this CTA's producer arrives expecting TX_BYTES (the peer's 32 rows) when it starts tile i,
  and again after its own stores (fence, partition barrier); the peer's st.async complete the bytes.
- empty[b], count 2: this CTA's consumers arrive after PV(i), and so do the peer's (a relaxed remote mbarrier
  arrive, inline PTX: Gluon 3.6 has none; a release one costs a MEMBAR.ALL.GPU a tile), so a producer writes tile i + 2 into both CTAs' buffer b only after both
  CTAs' consumers are done with tile i. A fresh barrier passes parity 1 at once (tiles 0 and 1).
- A full cluster barrier at each partition's start (after mbarrier.init, released to the cluster) and end: no
  remote write reaches a barrier before it exists, and neither CTA exits while its peer may still write to it.

128 heads, bf16 q, 512 + 64 rows, sm_90a, Triton 3.6.
"""
from __future__ import annotations

from kernels_triton.dsa_fp8_gluon import (  # noqa: F401 -- the shapes are the Gluon FP8 kernel's
    BLOCK_K, D_ROPE, D_V, GLUON_IMPORT_ERROR, ROPE_HALF, SCALE_WORD, TILE,
)

HEADS = 128               # per request: 64 a CTA, 2 CTAs a cluster
BLOCK_H = 64
HALF_K = 32               # rows of each tile a CTA loads and dequantises
NUM_WARPS = 8             # consumers a CTA
PRODUCER_WARPS = 4
PRODUCER_REGS = 120
NUM_CTAS = 2
NUM_BUFFERS = 2
K_BUF_BYTES = BLOCK_K * D_V * 2          # one bf16 K nope buffer: 65536
TX_BYTES = HALF_K * D_V * 2              # the peer's latent rows of a tile, into this CTA's buffer: 32768
# Where Triton 3.6 places K nope and the 4 mbarriers (bytes from global_smem): the MLIR dump's allocation.offset
# of %k_nope and %bars, checked by experiments/tools/gluon_fp8_x2.py (offline and before the smoke test).
K_OFF = 0
BAR_OFF = 230400

if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from kernels_triton.dsa_fp8_gluon import LN2, _D_ROPE, _D_V, _ROPE_HALF, _SCALE_WORD, _TILE, _dequant, _thread_sums

    _HEADS = gl.constexpr(HEADS)
    _BLOCK_K = gl.constexpr(BLOCK_K)
    _HALF_K = gl.constexpr(HALF_K)
    _PRODUCER_WARPS = gl.constexpr(PRODUCER_WARPS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)
    _TX_BYTES = gl.constexpr(TX_BYTES)
    _K_BUF_BYTES = gl.constexpr(K_BUF_BYTES)
    _SPLIT, _WHOLE = [[1, 0]], [[0, 0]]
    S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BLOCK_K // 2, 16], cga_layout=_SPLIT))
    O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, D_V // 2, 16], cga_layout=_SPLIT))
    QN_REG = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0], cga_layout=_SPLIT))
    QR_REG = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0], cga_layout=_SPLIT))
    # producer: a block of its half-tile [32, 128] (e4m3, then bf16): 8 lanes down 8 rows, 4 along them
    DEQ_P = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [PRODUCER_WARPS, 1], [0, 1], cga_layout=_WHOLE))
    ROPE_P = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0], cga_layout=_WHOLE))
    # the same block as int32 words [32, 32] (4 e4m3 bytes each, 16-byte loads): what is held across the loop
    # (loop-carried 8-bit values are unpacked one a register; words stay packed)
    WORD_P = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [PRODUCER_WARPS, 1], [0, 1], cga_layout=_WHOLE))
    PF_P = gl.constexpr(gl.BlockedLayout([1, 1], [8, 4], [PRODUCER_WARPS, 1], [0, 1], cga_layout=_WHOLE))
    ONE_C = gl.constexpr(gl.BlockedLayout([1], [32], [NUM_WARPS], [0], cga_layout=[[0]]))
    ONE_P = gl.constexpr(gl.BlockedLayout([1], [32], [PRODUCER_WARPS], [0], cga_layout=[[0]]))
    Q_SH = gl.constexpr(gl.NVMMASharedLayout(128, 16, rank=2, cga_layout=_SPLIT))
    K_SH = gl.constexpr(gl.NVMMASharedLayout(128, 16, rank=2, cga_layout=_WHOLE))
    BAR_SH = gl.constexpr(mbarrier.MBarrierLayout(cga_layout=[[0]]))
    # 8 int8 results (2 registers, unused); 8 int32 each of local and peer addresses and peer mbarrier addresses
    # ($2..$25, the same value 8 times: the first is read); 8 bf16 packed in 4 registers ($26..$29)
    _STORE_CONSTRAINTS = gl.constexpr("=r,=r," + ",".join(["r"] * 28))
    _WORDS_CONSTRAINTS = gl.constexpr("=r,=r," + ",".join(["r"] * 10))     # 2 results; 2 each of 5 inputs

    @gluon.jit
    def _cluster_rank(like):
        """This CTA's rank in its cluster (0 or 1), in `like`'s shape and layout."""
        return gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r,r", [like], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _cluster_sync(like):
        """A full cluster barrier (release / acquire), every thread of both CTAs. `like`: one value a thread."""
        return gl.inline_asm_elementwise(
            "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
            "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _cluster_sync_relaxed(like):
        """A cluster barrier without release semantics (no MEMBAR.ALL.GPU): execution order only."""
        return gl.inline_asm_elementwise(
            "barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;\n\tmov.u32 $0, 0;",
            "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _fence_mbarrier_init(like):
        return gl.inline_asm_elementwise("fence.mbarrier_init.release.cluster;\n\tmov.u32 $0, 0;",
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

    @gluon.jit
    def _remote_arrive(peer_bar):
        """Thread 0 of the calling partition arrives (release, cluster scope) on the peer's mbarrier at peer_bar
        (a shared::cluster address, one value a thread)."""
        return gl.inline_asm_elementwise(
            "{\n .reg .pred p;\n .reg .b32 t;\n mov.u32 t, %tid.x;\n and.b32 t, t, 255;\n setp.eq.u32 p, t, 0;\n"
            " @p mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [$1];\n mov.u32 $0, 0;\n}",
            "=r,r", [peer_bar], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.constexpr_function
    def _store_here_and_peer_asm(k_off):
        """PTX: 16 bytes ($26..$29: 8 bf16) at $2 + k_off here (st.shared) and at $10 + k_off in the peer
        (st.async, completing the peer's mbarrier at $18 by 16 bytes)."""
        return gl.constexpr(
            f"st.shared.v4.b32 [$2+{k_off}], {{$26, $27, $28, $29}};\n\t"
            f"st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [$10+{k_off}], {{$26, $27, $28, $29}}, "
            f"[$18];\n\tmov.b32 $0, 0;\n\tmov.b32 $1, 0;")

    @gluon.jit
    def _store_here_and_peer(here, peer, peer_bar, blk, K_BLOCK_OFF: gl.constexpr):
        """blk [32, 128] bf16 (DEQ_P) into this CTA's K buffer and the peer's: here / peer [32, 128] each group of
        8 columns' address in block 0 of the buffer (the same value 8 times), peer_bar the peer's full mbarrier;
        K_BLOCK_OFF the block's byte offset."""
        return gl.inline_asm_elementwise(
            asm=_store_here_and_peer_asm(K_BLOCK_OFF),
            constraints=_STORE_CONSTRAINTS, args=[here, peer, peer_bar, blk], dtype=gl.int8, is_pure=False,
            pack=8)

    @gluon.jit
    def _dequant_words(w, scale):
        """w [32, 32] int32, 4 e4m3 values a word (byte j = value 4 * word + j), times the rows' float32 scales
        [32]: (lo, hi) int32 [32, 32], each two bf16 (values 4 * word + 0, 1 and + 2, 3), by dsa_fp8_gluon.py's
        `_e4m3_bf16x2` arithmetic (the same bits)."""
        m1 = (gl.minimum(scale, 128.0) * 1.329227995784916e36).to(gl.bfloat16)      # min(scale, 2^7) * 2^120
        m2 = gl.maximum(scale * (1.0 / 128.0), 1.0).to(gl.bfloat16)
        m1 = m1.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        m2 = m2.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        m1x2 = (m1 | (m1 << 16))[:, None]                                             # bf16x2
        m2x2 = (m2 | (m2 << 16))[:, None]
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
            mul.rn.bf16x2 hi, hi, $3;
            mul.rn.bf16x2 $0, lo, $4;
            mul.rn.bf16x2 $1, hi, $4;
            }""",
            constraints="=r,=r,r,r,r", args=[w, m1x2, m2x2], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)

    @gluon.constexpr_function
    def _store_words_asm(k_off):
        """PTX: 16 bytes ({$8, $10, $9, $11}: lo and hi of word 0, then of word 1) at $2 + k_off here and at $4 +
        k_off in the peer (st.async, completing the peer's mbarrier at $6 by 16 bytes)."""
        return gl.constexpr(
            f"st.shared.v4.b32 [$2+{k_off}], {{$8, $10, $9, $11}};\n\t"
            f"st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [$4+{k_off}], {{$8, $10, $9, $11}}, "
            f"[$6];\n\tmov.b32 $0, 0;\n\tmov.b32 $1, 0;")

    @gluon.jit
    def _store_words(here, peer, peer_bar, lo, hi, K_BLOCK_OFF: gl.constexpr):
        """lo, hi [32, 32] (`_dequant_words`) into this CTA's K buffer and the peer's, 2 words (16 bytes of
        bf16) an asm: here / peer [32, 32] each pair's address in block 0 (the same value twice)."""
        return gl.inline_asm_elementwise(
            asm=_store_words_asm(K_BLOCK_OFF),
            constraints=_WORDS_CONSTRAINTS, args=[here, peer, peer_bar, lo, hi],
            dtype=gl.int32, is_pure=False, pack=2)

    @gluon.jit
    def _load_half(kv32_ptr, row, o_w, STRIDE16):
        """A tile's latent bytes for this CTA: its rows' 4 blocks as words [32, 32] int32 and their scales [32]
        (-1 rows: zeros)."""
        valid = row >= 0
        p_w = kv32_ptr + (row.to(gl.int64) * STRIDE16 * 4)[:, None] + o_w[None, :]
        p_scale = kv32_ptr + row.to(gl.int64) * STRIDE16 * 4 + _SCALE_WORD
        x0 = gl.load(p_w, mask=valid[:, None], other=0.0).to(gl.int32, bitcast=True)
        x1 = gl.load(p_w + 32, mask=valid[:, None], other=0.0).to(gl.int32, bitcast=True)
        x2 = gl.load(p_w + 64, mask=valid[:, None], other=0.0).to(gl.int32, bitcast=True)
        x3 = gl.load(p_w + 96, mask=valid[:, None], other=0.0).to(gl.int32, bitcast=True)
        s0 = gl.load(p_scale, mask=valid, other=0.0)
        s1 = gl.load(p_scale + 1, mask=valid, other=0.0)
        s2 = gl.load(p_scale + 2, mask=valid, other=0.0)
        s3 = gl.load(p_scale + 3, mask=valid, other=0.0)
        return x0, x1, x2, x3, s0, s1, s2, s3

    @gluon.jit
    def _prefetch_rows(kv8_ptr, row, STRIDE16):
        """Every 128-byte line of the rows `row` [HALF_K] (SliceLayout(1, WORD_P); -1: row 0) asked of L2 (as
        dsa_fp8_gluon.py's). Returns zeros in row's layout."""
        pf_row = gl.convert_layout(gl.maximum(row, 0), gl.SliceLayout(1, PF_P))
        o_j = gl.arange(0, 4, layout=gl.SliceLayout(0, PF_P))
        start = kv8_ptr + (pf_row.to(gl.int64) * STRIDE16 * 16)[:, None]
        zero = gl.inline_asm_elementwise(
            asm="""{
            prefetch.global.L2 [$1];
            prefetch.global.L2 [$2];
            mov.u32 $0, 0;
            }""",
            constraints="=r,l,l", args=[start + o_j[None, :] * 128, start + gl.minimum(512 + o_j * 128, 655)[None, :]],
            dtype=gl.int32, is_pure=False, pack=1)
        return gl.convert_layout(gl.max(zero, axis=1), row.type.layout)

    @gluon.jit
    def _produce(kv8_ptr, kv32_ptr, kv16_ptr, p_rows, start, end, n_tiles, STRIDE16, k_rope, bars, K_OFF: gl.constexpr,
                 BAR_OFF: gl.constexpr):
        """The producer partition: this CTA's half of every tile dequantised into both CTAs' K buffer i % 2."""
        one = gl.arange(0, _PRODUCER_WARPS * 32, layout=ONE_P)
        _cluster_sync(one)                                  # both CTAs' mbarriers exist
        rank = _cluster_rank(gl.arange(0, _HALF_K, layout=gl.SliceLayout(1, WORD_P)))
        o_k = rank * _HALF_K + gl.arange(0, _HALF_K, layout=gl.SliceLayout(1, WORD_P))   # this CTA's rows of a tile
        o_w = gl.arange(0, 32, layout=gl.SliceLayout(0, WORD_P))                         # a block's words
        o_kr = gl.arange(0, _BLOCK_K, layout=gl.SliceLayout(1, ROPE_P))
        o_r = _ROPE_HALF + gl.arange(0, _D_ROPE, layout=gl.SliceLayout(0, ROPE_P))
        # each word pair's first bf16 byte in block 0 of K buffer 0 (bf16 column 4 * word; the same value for
        # the pair: one register)
        c8 = (o_w // 2) * 8
        kofs = (c8[None, :] // 64) * (_BLOCK_K * 128) + o_k[:, None] * 128 + \
            (((c8[None, :] % 64) // 8) ^ (o_k[:, None] % 8)) * 16
        here0 = _smem_addr(K_OFF + kofs)
        peer0 = _peer_addr(here0)
        peer_full0 = _peer_addr(_smem_addr(BAR_OFF + kofs * 0))
        # tile 0's bytes; then per tile: tile i + 1's loads first (held in registers, as words, a whole tile),
        # tile i + 2's rows into L2, tile i converted and stored
        row = gl.load(p_rows + start + o_k, mask=start + o_k < end, other=-1)
        x0, x1, x2, x3, s0, s1, s2, s3 = _load_half(kv32_ptr, row, o_w, STRIDE16)
        j1 = start + _BLOCK_K
        next_row = gl.load(p_rows + j1 + o_k, mask=j1 + o_k < end, other=-1)
        for i in range(n_tiles):
            b = i % 2
            j0 = start + i * _BLOCK_K
            row_r = gl.load(p_rows + j0 + o_kr, mask=j0 + o_kr < end, other=-1)
            rope = gl.load(kv16_ptr + (row_r.to(gl.int64) * STRIDE16 * 8)[:, None] + o_r[None, :],
                           mask=(row_r >= 0)[:, None], other=0.0)        # this tile's, stored last
            n0, n1, n2, n3, t0, t1, t2, t3 = _load_half(kv32_ptr, next_row, o_w, STRIDE16)
            j2 = j0 + 2 * _BLOCK_K
            next_row = gl.load(p_rows + j2 + o_k, mask=j2 + o_k < end, other=-1)
            here = here0 + b * _K_BUF_BYTES
            peer = peer0 + b * _K_BUF_BYTES
            peer_full = peer_full0 + b * 8
            mbarrier.wait(bars.index(2 + b), ((i // 2) & 1) ^ 1)        # both CTAs' consumers are done with tile i - 2
            mbarrier.expect(bars.index(b), _TX_BYTES)                 # arrival 1 of 2: the peer's bytes to come
            lo, hi = _dequant_words(x0, s0)
            _store_words(here, peer, peer_full, lo, hi, 0)
            lo, hi = _dequant_words(x1, s1)
            _store_words(here, peer, peer_full, lo, hi, 16384)
            next_row += _prefetch_rows(kv8_ptr, next_row, STRIDE16)
            lo, hi = _dequant_words(x2, s2)
            _store_words(here, peer, peer_full, lo, hi, 32768)
            lo, hi = _dequant_words(x3, s3)
            _store_words(here, peer, peer_full, lo, hi, 49152)
            k_rope.index(b).store(rope)
            fence_async_shared()                                  # the local stores, visible to wgmma
            gl.thread_barrier()                                   # every producer warp's stores first
            mbarrier.arrive(bars.index(b))                        # arrival 2 of 2
            x0, x1, x2, x3, s0, s1, s2, s3 = n0, n1, n2, n3, t0, t1, t2, t3
        _cluster_sync_relaxed(one)                                # the peer's partitions are done with this CTA

    @gluon.jit
    def _consume(q_blk, q_rope, k_nope, k_blk, k_rope, p_smem, bars, p_rows, start, end, n_tiles, qk_scale_log2,
                 out_ptr, lse_ptr, i_n, i_s, H, stride_on, stride_oh, stride_os, stride_ln, stride_lh, stride_ls,
                 BAR_OFF: gl.constexpr):
        """The consumer partition (8 warps a CTA): today's tile loop over this CTA's 64 heads, then out and lse."""
        one = gl.arange(0, 256, layout=ONE_C)
        _cluster_sync(one)                                  # both CTAs' mbarriers exist
        peer_empty0 = _peer_addr(_smem_addr(BAR_OFF + 16 + one * 0))
        row_s: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        row_o: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        m_i = gl.full([_HEADS], float("-inf"), gl.float32, layout=row_s)
        acc = gl.zeros([_HEADS, _D_V], gl.float32, layout=O_LAYOUT)
        s_zero = gl.zeros([_HEADS, _BLOCK_K], gl.float32, layout=S_LAYOUT)
        l_thr = _thread_sums(s_zero)                                 # [128, 2, 4]: per row, warp group and lane
        alpha_thr: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, l_thr.type.layout))
        o_kc = gl.arange(0, _BLOCK_K, layout=gl.SliceLayout(0, S_LAYOUT))
        for i in range(n_tiles):
            b = i % 2
            o_j = start + i * _BLOCK_K + o_kc
            row = gl.load(p_rows + o_j, mask=o_j < end, other=-1)
            mbarrier.wait(bars.index(b), (i // 2) & 1)
            s_tok = warpgroup_mma(q_rope, k_rope.index(b).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            for c in gl.static_range(_D_V // _TILE):
                s_tok = warpgroup_mma(q_blk.index(c), k_blk.index(b * 4 + c).permute((1, 0)), s_tok, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))

            s = gl.where((row >= 0)[None, :], s * qk_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[:, None])
            l_thr = l_thr * gl.convert_layout(alpha, alpha_thr)[:, None, None] + _thread_sums(p)
            m_i = m_new

            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc_tok = warpgroup_mma(p_smem, k_nope.index(b), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
            gl.thread_barrier()                   # both groups are done with K(i) and P
            mbarrier.arrive(bars.index(2 + b))
            _remote_arrive(peer_empty0 + b * 8)   # and the peer's producer may write into this CTA's buffer b

        l_i = gl.convert_layout(gl.sum(gl.sum(l_thr, axis=2), axis=1), row_s)   # lanes, then groups
        m_any = l_i > 0.0
        l_safe = gl.where(m_any, l_i, 1.0)
        lse = gl.where(m_any, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        out = acc / gl.convert_layout(l_safe, row_o)[:, None]
        o_ho = gl.arange(0, _HEADS, layout=row_o)
        o_vo = gl.arange(0, _D_V, layout=gl.SliceLayout(0, O_LAYOUT))
        p_out = (out_ptr + i_n * stride_on + o_ho[:, None].to(gl.int64) * stride_oh + i_s * stride_os
                 + o_vo[None, :])
        gl.store(p_out, out.to(out_ptr.dtype.element_ty), mask=(o_ho < H)[:, None])
        o_hl = gl.arange(0, _HEADS, layout=row_s)
        gl.store(lse_ptr + i_n * stride_ln + o_hl * stride_lh + i_s * stride_ls, lse, mask=o_hl < H)
        _cluster_sync_relaxed(one)                # the peer's partitions are done with this CTA

    @gluon.jit
    def _sparse_mla_decode_fp8_x2_kernel(
        q_ptr, kv8_ptr, kv32_ptr, kv16_ptr, rows_ptr, row_base_ptr, out_ptr, lse_ptr,
        stride_qn, stride_qh, STRIDE16, stride_rn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
        stride_ls,
        H, K_SEL, CHUNK, qk_scale_log2,
        HAS_ROW_BASE: gl.constexpr, K_OFF: gl.constexpr, BAR_OFF: gl.constexpr,
    ):
        """The Gluon FP8 kernel for 128 heads as a 2-CTA cluster (the module docstring). Launch with num_warps=8,
        num_ctas=2, grid (1, N, splits)."""
        dtype: gl.constexpr = gl.bfloat16
        # K nope and the barriers first: their offsets are hand-placed in the asm (K_OFF, BAR_OFF)
        k_nope = gl.allocate_shared_memory(dtype, [2, _BLOCK_K, _D_V], K_SH)               # [2, 64, 512] whole
        bars = gl.allocate_shared_memory(gl.int64, [4, 1], BAR_SH)                         # full 0, 1, empty 0, 1
        k_blk = k_nope._reinterpret(dtype, [8, _BLOCK_K, _TILE], K_SH)                     # buffer b block c: b*4+c
        q_blk = gl.allocate_shared_memory(dtype, [4, _HEADS, _TILE], Q_SH)                # [4, 128, 128] split
        q_rope = gl.allocate_shared_memory(dtype, [_HEADS, _D_ROPE], Q_SH)                 # [128, 64] split
        k_rope = gl.allocate_shared_memory(dtype, [2, _BLOCK_K, _D_ROPE], K_SH)            # [2, 64, 64] whole
        p_smem = gl.allocate_shared_memory(dtype, [_HEADS, _BLOCK_K], Q_SH)                # [128, 64] split
        for j in gl.static_range(4):
            mbarrier.init(bars.index(j), count=2)

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
        n_tiles = gl.cdiv(end - start, _BLOCK_K)

        o_hn = gl.arange(0, _HEADS, layout=gl.SliceLayout(1, QN_REG))
        o_vn = gl.arange(0, _TILE, layout=gl.SliceLayout(0, QN_REG))
        p_qn = q_ptr + i_n * stride_qn + o_hn[:, None].to(gl.int64) * stride_qh + o_vn[None, :]
        for c in gl.static_range(4):
            async_copy.async_copy_global_to_shared(q_blk.index(c), p_qn + c * _TILE, mask=(o_hn < H)[:, None])
        o_hr = gl.arange(0, _HEADS, layout=gl.SliceLayout(1, QR_REG))
        o_rr = _D_V + gl.arange(0, _D_ROPE, layout=gl.SliceLayout(0, QR_REG))
        p_qr = q_ptr + i_n * stride_qn + o_hr[:, None].to(gl.int64) * stride_qh + o_rr[None, :]
        async_copy.async_copy_global_to_shared(q_rope, p_qr, mask=(o_hr < H)[:, None])
        async_copy.commit_group()
        async_copy.wait_group(0)
        _fence_mbarrier_init(gl.arange(0, 256, layout=ONE_C))
        fence_async_shared()
        gl.thread_barrier()

        gl.warp_specialize([
            (_consume, (q_blk, q_rope, k_nope, k_blk, k_rope, p_smem, bars, p_rows, start, end, n_tiles,
                        qk_scale_log2, out_ptr, lse_ptr, i_n, i_s, H, stride_on, stride_oh, stride_os, stride_ln,
                        stride_lh, stride_ls, BAR_OFF)),
            (_produce, (kv8_ptr, kv32_ptr, kv16_ptr, p_rows, start, end, n_tiles, STRIDE16, k_rope, bars, K_OFF,
                        BAR_OFF)),
        ], [_PRODUCER_WARPS], [_PRODUCER_REGS])
else:
    _sparse_mla_decode_fp8_x2_kernel = None

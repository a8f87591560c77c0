"""DSA's FP8 indexer quantisation in one kernel: each row of x [..., D] rotated by the fast Walsh-Hadamard
transform in float32, then e4m3 values at one power-of-two scale a row (DeepSeek-V3.2's `act_quant`, ue8m0),
bit for bit `hisparse.dsa.fp8_index.quantize_rotated(rotate(x))`, its torch reference. Launcher and input
checks beside the kernel (`rotate_quantize`); nothing here imports hisparse, so hisparse.dsa.fp8_index takes
the format's constants from here.

One program = BLOCK_R rows, one row a thread: x read once in its dtype, the values [.., D] e4m3 and the
scales [..] float32 (or the head weights times them) written once; the torch path makes about ten passes
over float32 copies. The tile is held as [D, BLOCK_R] (rows along the last dim): Triton's layout for the
butterflies' split then keeps a whole row in one thread's registers, so no stage moves data between
threads (as [BLOCK_R, D] a row spread over lanes, and every stage past the first few went through shared
memory and shuffles: twice the instructions). A row a thread holds D float32: at D 128, 167 registers and
no spills; D 256 spills. Offline sm_90a compile: experiments/tools/sass_index_quant.py.

Each step is the reference's arithmetic, so the bits are its bits on any device:
- rotation: log2(D) butterfly stages, each pairing elements (2m, 2m + 1) of the row into a + b at m and
  a - b at D/2 + m (reshape, split, join, permute), so stage j pairs bit j of the original index; then one
  multiply by D ** -0.5 rounded to float32 (`rotate_scale`). The last stage's halves stay apart.
- scale: t = max(absmax, 1e-4) * float32(1/448); 2 ** ceil(log2 t) is t's exponent field, rounded up past a
  nonzero mantissa: bits (t + 0x7FFFFF) & 0x7F800000 (a power of two keeps its own exponent).
- values: times 1 / scale (a power of two in float32's normal range: the reference's exact division),
  clamped to +-448, then rounded to e4m3 to nearest even in float32 arithmetic (`_to_e4m3`), so the cast
  to e4m3 is given exact values. Triton's interpreter (3.6 and 3.9 alike) does not round that cast to
  nearest even: ties go away from zero, subnormal results are cut (3 * 2 ** -10 -> 2 ** -9), and where a
  mantissa of 111 rounds up the carry is ORed into the exponent (124 -> 64, not 128): triton-lang/triton
  issue 8322, pull request 11897 (open). The GPU's cvt.rn.satfinite rounds right; one program serves both.
"""
import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MAX_INV = torch.tensor(1 / FP8_MAX, dtype=torch.float32).item()   # as float32, the multiplier act_quant uses
AMAX_FLOOR = 1e-4
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NUM_WARPS = 4       # 128 rows a program, one a thread
_FP8_MAX, _FP8_MAX_INV, _AMAX_FLOOR = tl.constexpr(FP8_MAX), tl.constexpr(FP8_MAX_INV), tl.constexpr(AMAX_FLOOR)


def rotate_scale(d: int) -> float:
    """D ** -0.5 rounded to float32, as a Python float: the rotation's last multiplier, the same in torch and
    in the kernel (exact in either's float32)."""
    return torch.tensor(d ** -0.5, dtype=torch.float32).item()


@triton.jit
def _to_e4m3(b_v):
    """b_v (float32) clamped to +-448 and rounded to e4m3 to nearest even, as float8e4nv."""
    b_v = tl.minimum(tl.maximum(b_v, -_FP8_MAX), _FP8_MAX)
    v_bits = b_v.to(tl.uint32, bitcast=True)
    a_bits = v_bits & 0x7FFFFFFF
    # c = 2 ** 23 times e4m3's step at |v|: 2 ** (e - 3) at exponent e >= -6 (3 mantissa bits), 2 ** -9 below
    # (subnormals); |v| + c rounds |v| to that step, to nearest even (float32's own rounding), - c is exact
    b_c = ((tl.maximum(a_bits >> 23, 127 - 6) + 20) << 23).to(tl.float32, bitcast=True)
    b_r = (a_bits.to(tl.float32, bitcast=True) + b_c) - b_c
    b_q = (b_r.to(tl.uint32, bitcast=True) | (v_bits & 0x80000000)).to(tl.float32, bitcast=True)   # v's sign, -0 too
    return b_q.to(tl.float8e4nv)


@triton.jit
def _rotate_quantize_kernel(x_ptr, w_ptr, values_ptr, scales_ptr, n_rows, stride_xr, stride_xd, stride_w,
                            D: tl.constexpr, LOG2_D: tl.constexpr, ROTATE_SCALE: tl.constexpr,
                            BLOCK_R: tl.constexpr, HAS_W: tl.constexpr):
    """Rows [BLOCK_R] of x [n_rows, D] (strides stride_xr, stride_xd): values [n_rows, D] e4m3 (contiguous),
    scales [n_rows] float32, or w [n_rows] (stride_w) times them where HAS_W."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < n_rows
    o_r = o_r.to(tl.int64)
    o_d = tl.arange(0, D)
    b_x = tl.load(x_ptr + o_r[None, :] * stride_xr + o_d[:, None] * stride_xd, mask=m_r[None, :],
                  other=0.0).to(tl.float32)                                              # [D, BLOCK_R]
    for _ in tl.static_range(LOG2_D - 1):
        b_a, b_b = tl.split(tl.permute(tl.reshape(b_x, [D // 2, 2, BLOCK_R]), (0, 2, 1)))   # elements 2m, 2m + 1
        b_x = tl.reshape(tl.permute(tl.join(b_a + b_b, b_a - b_b), (2, 0, 1)), [D, BLOCK_R])  # to m, D/2 + m
    b_a, b_b = tl.split(tl.permute(tl.reshape(b_x, [D // 2, 2, BLOCK_R]), (0, 2, 1)))
    b_lo = (b_a + b_b) * ROTATE_SCALE                   # rotated elements m < D/2, [D // 2, BLOCK_R]
    b_hi = (b_a - b_b) * ROTATE_SCALE                   # and D/2 + m

    b_t = tl.maximum(tl.maximum(tl.max(tl.abs(b_lo), axis=0), tl.max(tl.abs(b_hi), axis=0)), _AMAX_FLOOR)
    scale_bits = ((b_t * _FP8_MAX_INV).to(tl.uint32, bitcast=True) + 0x7FFFFF) & 0x7F800000
    b_inv = (0x7F000000 - scale_bits).to(tl.float32, bitcast=True)        # 2 ** -e: biased exponent 254 - e
    o_m = tl.arange(0, D // 2)
    p_v = values_ptr + o_r[None, :] * D + o_m[:, None]
    tl.store(p_v, _to_e4m3(b_lo * b_inv[None, :]), mask=m_r[None, :])
    tl.store(p_v + D // 2, _to_e4m3(b_hi * b_inv[None, :]), mask=m_r[None, :])
    b_scale = scale_bits.to(tl.float32, bitcast=True)
    if HAS_W:
        b_scale = tl.load(w_ptr + o_r * stride_w, mask=m_r, other=0.0).to(tl.float32) * b_scale
    tl.store(scales_ptr + o_r, b_scale, mask=m_r)


def require(condition: bool, message: str) -> None:
    """hisparse.dsa.ops.require, here because kernels_triton imports nothing of hisparse."""
    if not condition:
        raise ValueError(message)


def rotate_quantize(x: torch.Tensor, weights: torch.Tensor | None = None,
                    num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float8_e4m3fn [..., D], scales float32 [...]) of x [..., D] (float16/bf16/float32, D a power of
    2 >= 16, finite and finite rotated): `quantize_rotated(rotate(x))` bit for bit. With weights [...] (float),
    weights * scales in place of the scales (`quantize_query`'s). 32 * num_warps rows a program."""
    require(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype}: expected one of {FLOAT_DTYPES}")
    d = x.shape[-1] if x.dim() else 0
    require(d >= 16 and d & (d - 1) == 0, f"x shape {tuple(x.shape)}: expected [..., D] with D a power of 2 >= 16")
    require(weights is None or (weights.shape == x.shape[:-1] and weights.dtype.is_floating_point
                                and weights.device == x.device),
            f"weights {None if weights is None else (weights.dtype, tuple(weights.shape), str(weights.device))}: "
            f"expected a float tensor {tuple(x.shape[:-1])} on {x.device}")
    rows = x.reshape(-1, d)                             # a view where the leading dims flatten, else a copy
    values = torch.empty(x.shape, dtype=FP8, device=x.device)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    w = scales if weights is None else weights.reshape(-1)
    block_r = 32 * num_warps
    if rows.shape[0]:
        _rotate_quantize_kernel[(triton.cdiv(rows.shape[0], block_r),)](
            rows, w, values, scales, rows.shape[0], rows.stride(0), rows.stride(1), w.stride(0),
            D=d, LOG2_D=d.bit_length() - 1, ROTATE_SCALE=rotate_scale(d), BLOCK_R=block_r,
            HAS_W=weights is not None, num_warps=num_warps)
    return values, scales

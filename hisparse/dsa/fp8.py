"""DSA's FP8 KV rows: the 656-byte format DeepSeek-V3.2 serves with (written and read in torch), and the
sparse MLA decode over such rows (launcher of kernels_triton/dsa_fp8.py; its torch reference is
`hisparse.dsa.reference.sparse_mla_decode_fp8_ref`).

One row per token (little-endian, as every target of this project):

    bytes [  0, 512)  512 float8_e4m3fn: latent value c is fp8[c] * scale[c // 128]
    bytes [512, 528)  4 float32 scales, one per 128 latent values, each a power of two
    bytes [528, 656)  64 bfloat16 RoPE values, stored as given (not quantised)

656 = 16 * 41: rows packed at stride 656 keep every row, and its scales (byte 512) and RoPE (byte 528),
16-byte aligned, so the host pool (`HostPool(rows, 656, torch.uint8)`) and the fetch copy whole
words (`resolve.as_words` views a row as 164 int32) or 16-byte vectors.

Scale rule, per 128-value block b with absmax a_b (over float32 values):
    scale_b = 2 ** ceil(log2(max(a_b / 448, 1e-4)))
448 is e4m3's largest finite value, so every |latent / scale_b| <= 448; the 1e-4 floor makes an
all-zero block's scale 2 ** -13 (its bytes 0x00), and blocks with a_b < 0.0448 share that scale.
ceil(log2(.)) is taken exactly (from the float32's exponent, not a rounded log2), and the quotient
is clamped to +-448 before the round-to-nearest-even cast, so no value saturates to NaN.

FlashMLA (tests/quant.py, `FP8KVCacheLayout.V32_FP8Sparse`, the layout its sparse FP8 decode
reads): the same byte layout, tile 128, the same scale rule with the same 1e-4 floor ("HFAI FP8's
FP8_AMAX_MARGIN"), so these rows are its rows. Where we differ: FlashMLA computes ceil(log2(x))
with torch's float log2 (a quotient just above a power of two can round down there, giving half the
scale and a saturated value) and casts without a clamp; its RoPE part is in the input's dtype
(bf16 in serving), ours always bf16; its cache is paged [blocks, block_size, 1, 656], ours rows
[R, 656]. vLLM's `fp8_ds_mla` cache has the same layout; the decoder here reads any float32
scale, a power of two or not (exactness of the dequantisation needs the power of two).

In the system (kv_dtype "fp8" of `DsaRuntime`, `Engine`, `Server`: DESIGN section 5.1) every stored
latent row is such a row: `to_rows` / `from_rows` convert MLA rows [..., 576] (latent, then RoPE key),
and `sparse_mla_decode_stored` reads stored rows of either kind.
"""
from __future__ import annotations

import torch
import triton
import triton.runtime.errors

from hisparse.dsa.ops import (
    DECODE_BACKENDS,
    FLOAT_DTYPES,
    DecodeConfig,
    check_selection_inputs,
    combine_splits,
    decode_backend,
    default_decode_config,
    dot_precision,
    gluon_platform_unsupported,
    launch_fitted,
    require,
    sparse_mla_decode,
    split_buffers,
    split_plan,
)
from kernels_triton import dsa_fp8_gluon
from kernels_triton.dsa_fp8 import FP8_DEQUANT, _sparse_mla_decode_fp8_kernel
from kernels_triton.dsa_fp8_gluon import _sparse_mla_decode_fp8_gluon_kernel

FP8 = torch.float8_e4m3fn
D_LATENT, D_ROPE, TILE = 512, 64, 128
N_TILES = D_LATENT // TILE                      # 4
SCALE_BYTE = D_LATENT                           # 512
ROPE_BYTE = SCALE_BYTE + 4 * N_TILES            # 528
ROW_BYTES = ROPE_BYTE + 2 * D_ROPE              # 656
FP8_MAX = 448.0
SCALE_FLOOR = 1e-4                              # FlashMLA's floor of a_b / 448
# How the DSA family stores an MLA row (`kv_dtype` of DsaRuntime, Engine, Server, generate --kv-dtype):
# "bf16", the 576 latent + RoPE values in the model's dtype (bf16 on the GPU, float32 in CPU tests);
# "fp8", this module's 656-byte rows (uint8 tensors [..., 656] wherever rows are stored)
KV_DTYPES = ("bf16", "fp8")
# How the decode kernel dequantises a tile (kernels_triton/dsa_fp8.py's docstring): "inline", the default
# everywhere, or "split" (4 [BLOCK_K, 128] tiles, each with its scale); `bench_attention_dsa --tune
# --kv-dtype fp8` times both
DEQUANT_MODES = tuple(FP8_DEQUANT)


def block_scales(latent: torch.Tensor) -> torch.Tensor:
    """The scales [..., 4] float32 of latent [..., 512]: 2 ** ceil(log2(max(absmax / 448, 1e-4)))."""
    absmax = latent.float().unflatten(-1, (N_TILES, TILE)).abs().amax(dim=-1)
    x = (absmax / FP8_MAX).clamp_min(SCALE_FLOOR)
    mantissa, exponent = torch.frexp(x)                 # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # x a power of two: log2 exact
    return torch.ldexp(torch.ones_like(x), exponent)


def quantize_rows(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rows uint8 [..., 656] of latent [..., 512] and rope [..., 64] (float16/bf16/float32, same
    leading shape and device), in the format of this module's docstring. Finite inputs only."""
    require(latent.dtype in FLOAT_DTYPES and rope.dtype in FLOAT_DTYPES,
            f"latent dtype {latent.dtype}, rope dtype {rope.dtype}: expected each one of {FLOAT_DTYPES}")
    require(latent.dim() >= 1 and latent.shape[-1] == D_LATENT,
            f"latent shape {tuple(latent.shape)}: expected [..., {D_LATENT}]")
    require(rope.dim() >= 1 and rope.shape[-1] == D_ROPE, f"rope shape {tuple(rope.shape)}: expected [..., {D_ROPE}]")
    require(latent.shape[:-1] == rope.shape[:-1],
            f"latent {tuple(latent.shape)} and rope {tuple(rope.shape)}: expected the same leading shape")
    require(latent.device == rope.device, f"latent is on {latent.device}, rope on {rope.device}")
    scales = block_scales(latent)                                                    # [..., 4]
    blocks = latent.float().unflatten(-1, (N_TILES, TILE)) / scales[..., None]       # exact: powers of two
    values = blocks.clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2)                      # [..., 512]
    out = torch.empty((*latent.shape[:-1], ROW_BYTES), dtype=torch.uint8, device=latent.device)
    out[..., :SCALE_BYTE] = values.view(torch.uint8)
    out[..., SCALE_BYTE:ROPE_BYTE] = scales.contiguous().view(torch.uint8)
    out[..., ROPE_BYTE:] = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def _check_rows(rows: torch.Tensor, name: str = "rows") -> None:
    require(rows.dtype == torch.uint8, f"{name} dtype {rows.dtype}: expected torch.uint8 (the {ROW_BYTES}-byte rows)")
    require(rows.dim() >= 1 and rows.shape[-1] == ROW_BYTES,
            f"{name} shape {tuple(rows.shape)}: expected [..., {ROW_BYTES}] (row width {ROW_BYTES} bytes)")


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent [..., 512] in `dtype`, rope [..., 64] bf16) of rows uint8 [..., 656].

    dtype float32 or bf16: an e4m3 value times a power-of-two scale is exact in both."""
    _check_rows(rows)
    require(dtype in (torch.float32, torch.bfloat16), f"dtype {dtype}: expected torch.float32 or torch.bfloat16")
    values = rows[..., :SCALE_BYTE].view(FP8).float().unflatten(-1, (N_TILES, TILE))
    scales = rows[..., SCALE_BYTE:ROPE_BYTE].contiguous().view(torch.float32)           # [..., 4]
    latent = (values * scales[..., None]).flatten(-2).to(dtype)
    rope = rows[..., ROPE_BYTE:].contiguous().view(torch.bfloat16)
    return latent, rope


def check_kv_dtype(kv_dtype) -> str:
    """kv_dtype itself if it is one of KV_DTYPES, else ValueError naming it and the choices."""
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}: expected one of {KV_DTYPES} (DSA's MLA rows: 'bf16', 576 "
                         f"values in the model's dtype; 'fp8', {ROW_BYTES}-byte rows of 512 e4m3, 4 scales, "
                         f"64 bf16 RoPE)")
    return kv_dtype


def check_fp8_geometry(config) -> None:
    """ValueError unless the model's MLA rows are 512 latent + 64 RoPE values, the FP8 row's."""
    dims = (config.kv_lora_rank, config.qk_rope_head_dim)
    require(dims == (D_LATENT, D_ROPE), f"kv_dtype='fp8' stores {D_LATENT} latent + {D_ROPE} RoPE values a row "
            f"(DeepSeek-V3.2's MLA); this model has kv_lora_rank={dims[0]}, qk_rope_head_dim={dims[1]}")


def check_fp8_backend(backend: str) -> None:
    """ValueError unless `backend` is one of DECODE_BACKENDS: each reads FP8 rows ("gluon" through
    kernels_triton/dsa_fp8_gluon.py); whether "gluon" can run a launch's inputs is checked at the
    launch, before it (`fp8_gluon_unsupported`)."""
    require(backend in DECODE_BACKENDS, f"decode backend {backend!r}: expected one of {DECODE_BACKENDS}")


def to_rows(latent: torch.Tensor) -> torch.Tensor:
    """FP8 rows uint8 [..., 656] of MLA rows [..., 576] (latent, then RoPE key): `quantize_rows`."""
    return quantize_rows(latent[..., :D_LATENT], latent[..., D_LATENT:])


def from_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MLA rows [..., 576] in `dtype` of FP8 rows uint8 [..., 656]: dequantised in float32 (exact), then
    cast, as the decode kernel converts them to q's dtype."""
    latent, rope = dequantize_rows(rows)
    return torch.cat([latent, rope.float()], dim=-1).to(dtype)


def sparse_mla_decode_stored(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, sm_scale: float, d_v: int,
                             row_base: torch.Tensor | None = None, out: torch.Tensor | None = None,
                             backend: str = "auto") -> torch.Tensor:
    """Absorbed-MLA decode over stored rows of either kind: FP8 rows (kv uint8 [R, 656]) through
    `sparse_mla_decode_fp8` with `backend` ("gluon" where it cannot run is refused before any launch),
    else `hisparse.dsa.ops.sparse_mla_decode` with `backend`. Returns out [N, H, d_v]."""
    if kv.dtype == torch.uint8:
        check_fp8_backend(backend)
        require(d_v == D_LATENT, f"d_v={d_v}: FP8 rows hold {D_LATENT} latent values (V)")
        return sparse_mla_decode_fp8(q, kv, rows, sm_scale, out=out, row_base=row_base, backend=backend)[0]
    return sparse_mla_decode(q, kv, rows, sm_scale, d_v=d_v, out=out, row_base=row_base, backend=backend)[0]


def stored_decode_kernel(q: torch.Tensor, d_v: int, kv_dtype: str = "bf16", backend: str = "auto") -> str:
    """The kernel `sparse_mla_decode_stored` runs for queries like q [N, H, d_v + RoPE] over rows of
    kv_dtype with `backend`: "gluon" or "triton" (over fp8 rows the FP8 kernel of that name). What
    result rows record as attention_kernel."""
    if check_kv_dtype(kv_dtype) == "fp8":
        return fp8_decode_backend(q, torch.empty(1, ROW_BYTES, dtype=torch.uint8, device=q.device), backend)
    return decode_backend(q, d_v, backend)


# ---------------------------------------------------------------------------------------------
# Sparse MLA decode over FP8 rows
# ---------------------------------------------------------------------------------------------

def _check_fp8_decode_inputs(q, kv, rows, sm_scale, out, lse, row_base) -> None:
    require(q.dim() == 3, f"q must be [N, H, D], got shape {tuple(q.shape)}")
    d = q.shape[2]
    require(q.dtype in FLOAT_DTYPES, f"q dtype {q.dtype}: expected one of {FLOAT_DTYPES}")
    require(d == D_LATENT + D_ROPE, f"q head dim {d}: expected {D_LATENT} + {D_ROPE} = {D_LATENT + D_ROPE} "
            f"(the FP8 rows hold MLA's latent and RoPE key)")
    require(kv.dim() == 2, f"kv shape {tuple(kv.shape)}: expected [R, {ROW_BYTES}] uint8 rows")
    _check_rows(kv, "kv")
    require(kv.stride(1) == 1 and kv.stride(0) % 16 == 0 and kv.data_ptr() % 16 == 0,
            f"kv strides {kv.stride()}, address {kv.data_ptr():#x}: expected contiguous 16-byte-aligned "
            f"rows (row stride a multiple of 16 bytes; {ROW_BYTES} is)")
    check_selection_inputs(q, kv, rows, sm_scale, D_LATENT, out, lse, row_base)


def default_fp8_decode_config(num_heads: int, dtype: torch.dtype) -> DecodeConfig:
    """The bf16 kernel's default tiles (`default_decode_config`); fixed, so equal shapes accumulate
    in equal order. Untuned on the GPU: where it does not fit, `sparse_mla_decode_fp8` shrinks it."""
    return default_decode_config(num_heads, D_LATENT + D_ROPE, dtype)


def fp8_gluon_unsupported(q: torch.Tensor, kv: torch.Tensor) -> str | None:
    """Why the Gluon FP8 decode kernel (kernels_triton/dsa_fp8_gluon.py) cannot run q [N, H, D] over
    kv [R, ...], or None if it can: it needs Triton 3.6's Gluon, an sm_90 GPU, bf16 q of 512 + 64
    values (the rows' RoPE is bf16 as stored), at least 64 heads and 656-byte uint8 rows."""
    reason = gluon_platform_unsupported(q, dsa_fp8_gluon.GLUON_IMPORT_ERROR)
    if reason is not None:
        return reason
    if q.dtype != torch.bfloat16:
        return f"q dtype {q.dtype}: it takes bf16 (the FP8 rows' RoPE is bf16)"
    if q.dim() != 3 or q.shape[2] != D_LATENT + D_ROPE:
        return f"q shape {tuple(q.shape)}: it takes [N, H, {D_LATENT} + {D_ROPE}] (MLA's latent and RoPE)"
    if q.shape[1] < dsa_fp8_gluon.BLOCK_H:
        return f"{q.shape[1]} heads: it runs {dsa_fp8_gluon.BLOCK_H} a program, so needs at least that many"
    if kv.dtype != torch.uint8 or kv.dim() != 2 or kv.shape[1] != ROW_BYTES:
        return f"kv {kv.dtype} {tuple(kv.shape)}: it reads uint8 [R, {ROW_BYTES}] rows"
    return None


def fp8_decode_backend(q: torch.Tensor, kv: torch.Tensor, backend: str = "auto",
                       config: DecodeConfig | None = None, dequant: str = "inline") -> str:
    """The kernel `sparse_mla_decode_fp8` runs: "triton" or "gluon". "auto" is the Gluon FP8 kernel
    where it can run (`fp8_gluon_unsupported`) and no Triton config or dequant mode is asked for, as
    for bf16 rows (it was faster at every batch measured: results/notes/fp8.md,
    results/attention.csv), else the Triton one. "gluon" where `fp8_gluon_unsupported` finds a
    reason, or with a Triton config or dequant mode, raises ValueError naming it."""
    require(backend in DECODE_BACKENDS, f"backend={backend!r}: expected one of {DECODE_BACKENDS}")
    if backend == "triton":
        return "triton"
    if backend == "auto":
        plain = config is None and dequant == "inline"
        return "gluon" if plain and fp8_gluon_unsupported(q, kv) is None else "triton"
    require(config is None, f"config={config} is the Triton kernel's: the Gluon FP8 kernel takes none")
    require(dequant == "inline", f"dequant={dequant!r} is the Triton kernel's: the Gluon FP8 kernel dequantises "
            "128 values a block into shared memory")
    reason = fp8_gluon_unsupported(q, kv)
    require(reason is None, f"backend='gluon': the Gluon FP8 decode kernel cannot run this: {reason}")
    return "gluon"


def sparse_mla_decode_fp8(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, sm_scale: float,
                          num_splits: int | None = None, config: DecodeConfig | None = None,
                          out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                          row_base: torch.Tensor | None = None, dequant: str = "inline", backend: str = "auto"):
    """Absorbed-MLA decode over selected FP8 rows: out [N, H, 512] (q's dtype), lse [N, H] float32.

    As `hisparse.dsa.ops.sparse_mla_decode` (backend "triton") with kv uint8 [R, 656] rows in this
    module's format instead of [R, 576] values: q [N, H, 576]; rows [N, k] int32, read in order
    (-1 skipped), naming row row_base[n] + rows[n, j]; not range-checked. A request with no valid
    row gets zeros and lse -inf; k is split into `num_splits` chunks (default `split_plan`) merged
    in order. The kernel dequantises in registers to q's dtype; with float32 or bf16 q it equals,
    bit for bit in the interpreter, `sparse_mla_decode` over the dequantised rows with the same
    config. Equal bytes in equal order give bitwise-equal outputs wherever the rows sit in kv.
    `dequant` (one of DEQUANT_MODES) picks how the kernel dequantises a tile: "inline" (the
    default, what every caller gets) or "split", which equals it within float32 rounding.
    `backend` (`fp8_decode_backend`): "triton" runs the Triton kernel; "gluon" the Gluon one
    (kernels_triton/dsa_fp8_gluon.py: Hopper, bf16 q, >= 64 heads, 64-row tiles; no config or
    dequant), refused before any launch where it cannot run; "auto" the Gluon one where it can run.
    The two accumulate in different orders (no bitwise equality between them); each is deterministic.
    """
    require(dequant in DEQUANT_MODES, f"dequant={dequant!r}: expected one of {DEQUANT_MODES}")
    _check_fp8_decode_inputs(q, kv, rows, sm_scale, out, lse, row_base)
    kernel = fp8_decode_backend(q, kv, backend, config, dequant)
    n, h, _ = q.shape
    out = out if out is not None else torch.empty((n, h, D_LATENT), dtype=q.dtype, device=q.device)
    lse = lse if lse is not None else torch.empty((n, h), dtype=torch.float32, device=q.device)
    if n == 0 or h == 0:
        return out, lse
    if kernel == "gluon":
        _launch_gluon(q, kv, rows, row_base, out, lse, sm_scale, num_splits)
        return out, lse
    if config is not None:
        _launch(q, kv, rows, row_base, out, lse, sm_scale, config, num_splits, dequant)
        return out, lse
    launch_fitted("sparse_mla_decode_fp8", ("fp8", dequant, h, q.dtype, q.device),
                  default_fp8_decode_config(h, q.dtype),
                  lambda cfg: _launch(q, kv, rows, row_base, out, lse, sm_scale, cfg, num_splits, dequant))
    return out, lse


def _launch(q, kv, rows, row_base, out, lse, sm_scale: float, cfg: DecodeConfig, num_splits: int | None,
            dequant: str = "inline") -> None:
    n, h, _ = q.shape
    k = rows.shape[1]
    chunk, splits = split_plan(n, h, k, cfg, q.device, num_splits)
    part, part_lse, split_strides = split_buffers(out, lse, splits)
    _sparse_mla_decode_fp8_kernel[(triton.cdiv(h, cfg.block_h), n, splits)](
        q, kv, rows, rows if row_base is None else row_base, part, part_lse,
        q.stride(0), q.stride(1), kv.stride(0), rows.stride(0), part.stride(0), part.stride(1),
        split_strides[0], part_lse.stride(0), part_lse.stride(1), split_strides[1],
        h, k, chunk, sm_scale * 1.4426950408889634,
        D_V=D_LATENT, D_ROPE=D_ROPE, TILE=TILE, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k,
        DOT_PRECISION=dot_precision(q.dtype), HAS_ROW_BASE=row_base is not None, DEQUANT=FP8_DEQUANT[dequant],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        combine_splits(part, part_lse, out, lse)


# The Gluon FP8 kernel's tiles, as `split_plan` takes them (64 heads x 64 rows a program; 8 consumer warps,
# 2 K buffers)
GLUON_FP8_TILES = DecodeConfig(block_h=dsa_fp8_gluon.BLOCK_H, block_k=dsa_fp8_gluon.BLOCK_K,
                               num_warps=dsa_fp8_gluon.NUM_WARPS, num_stages=dsa_fp8_gluon.NUM_STAGES)


def _launch_gluon(q, kv, rows, row_base, out, lse, sm_scale: float, num_splits: int | None) -> None:
    """The Gluon FP8 kernel over inputs already checked: kv passed as its e4m3, float32 and bf16 views
    (the latent bytes, the scales, the RoPE of the same rows), k split by `split_plan`."""
    n, h, _ = q.shape
    k = rows.shape[1]
    chunk, splits = split_plan(n, h, k, GLUON_FP8_TILES, q.device, num_splits)
    part, part_lse, split_strides = split_buffers(out, lse, splits)
    _sparse_mla_decode_fp8_gluon_kernel[(triton.cdiv(h, GLUON_FP8_TILES.block_h), n, splits)](
        q, kv.view(FP8), kv.view(torch.float32), kv.view(torch.bfloat16), rows,
        rows if row_base is None else row_base, part, part_lse,
        q.stride(0), q.stride(1), kv.stride(0) // 16, rows.stride(0), part.stride(0), part.stride(1),
        split_strides[0], part_lse.stride(0), part_lse.stride(1), split_strides[1],
        h, k, chunk, sm_scale * 1.4426950408889634,
        BLOCK_H=GLUON_FP8_TILES.block_h, BLOCK_K=GLUON_FP8_TILES.block_k, HAS_ROW_BASE=row_base is not None,
        NUM_STAGES=GLUON_FP8_TILES.num_stages, num_warps=GLUON_FP8_TILES.num_warps,
    )
    if splits > 1:
        combine_splits(part, part_lse, out, lse)

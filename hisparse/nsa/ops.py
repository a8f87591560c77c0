"""NSA decode (Native Sparse Attention, one query token per request): launchers (torch references in reference.py).

Three branches, gated per query head (DESIGN section 5):
1. compressed: attention over compressed blocks. Compressed block i covers tokens
   [i * CMP_STRIDE, i * CMP_STRIDE + CMP_BLOCK) and holds mean(keys) (@ weight_k when a weight is
   given), likewise for values; a request of L tokens has (L - 32) // 16 + 1 of them (0 if L < 32).
2. selected: attention over the top-n selection blocks of SEL_BLOCK tokens, one selection per KV head.
3. window: attention over the last WINDOW tokens, kept in a ring buffer (token t at t % W).
out = g0 * o_cmp + g1 * o_slc + g2 * o_win with gates [N, H, 3] given (already sigmoid-ed).

Selection scores (NSA paper eq. 9 for l' = 64, l = 32, d = 16): with p_cmp[i] the compressed-branch
softmax probabilities summed over the query heads of a GQA group,
    score[j] = sum_{m=0..3} sum_{p=0..1} p_cmp[4 j + m - p]        (indices outside [0, n_cmp) skipped)
that is, compressed block i weighs on selection block j by the number of 16-token strides they
share: blocks 4j-1 and 4j+3 count once, 4j .. 4j+2 twice. The paper writes p_cmp[4j - m - n], the
same weights 1, 2, 2, 2, 1 over indices 4j-4 .. 4j; with compressed block i starting at token 16 i,
the blocks that overlap selection block j are 4j-1 .. 4j+3, so we apply the weights there (m - p).
Block 0 and the two newest blocks are always selected (score +inf); the others by descending score,
ties to the lower block index; the selection is in that order, -1 pads when a request has fewer
blocks. The newest, partial block is attended over its valid tokens only.

Row layout (the hierarchical unit): one row per (selection block, KV head) = [2, SEL_BLOCK, D], keys
then values. The resident pool of stream s = n * KV + kv_head holds block u at row s * U + u.
Attention reads rows through `rows [N, KV, n]` (-1 = skip) with the block ids `blocks [N, KV, n]`
that say each row's valid length; rows are read in the order given, so a hot cache and the
resident pool holding the same rows give bitwise-equal outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels_triton.nsa import (
    _nsa_attention_partial_kernel,
    _nsa_compress_kernel,
    _nsa_gate_kernel,
    _nsa_merge_kernel,
    _nsa_select_kernel,
)
from kernels_triton.nsa_prefill import _nsa_prefill_selected_kernel

CMP_BLOCK = 32
CMP_STRIDE = 16
SEL_BLOCK = 64
N_SELECT = 16
WINDOW = 512
COMPRESS_TILE = 16  # compressed blocks per program of nsa_compress
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- helpers

# triton.cdiv and triton.next_power_of_2 are constexpr functions in recent Triton, costing several
# microseconds per call from Python; a decode step makes about 20 such calls.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def compressed_count(lengths: torch.Tensor) -> torch.Tensor:
    """Number of complete compressed blocks of requests of `lengths` tokens."""
    return torch.where(lengths >= CMP_BLOCK, (lengths - CMP_BLOCK) // CMP_STRIDE + 1, 0)


def block_count(lengths: torch.Tensor) -> torch.Tensor:
    """Number of selection blocks (the newest may be partial)."""
    return (lengths + SEL_BLOCK - 1) // SEL_BLOCK


def nsa_block_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Resident pool [N * KV * U, 2, SEL_BLOCK, D] from dense k, v [N, KV, T, D] (zero padded)."""
    n, kvh, t, d = k.shape
    units = _cdiv(t, SEL_BLOCK)
    pad = units * SEL_BLOCK - t
    kb = F.pad(k, (0, 0, 0, pad)).view(n, kvh, units, 1, SEL_BLOCK, d)
    vb = F.pad(v, (0, 0, 0, pad)).view(n, kvh, units, 1, SEL_BLOCK, d)
    return torch.cat([kb, vb], dim=3).reshape(n * kvh * units, 2, SEL_BLOCK, d)


def resident_rows(blocks: torch.Tensor, n_units: int) -> torch.Tensor:
    """Rows of the resident pool for `blocks [N, KV, n]` (-1 stays -1), int32."""
    n, kvh, _ = blocks.shape
    stream = torch.arange(n * kvh, device=blocks.device).view(n, kvh, 1)
    return torch.where(blocks >= 0, stream * n_units + blocks, -1).to(torch.int32)


def nsa_window_ring(k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, window: int = WINDOW):
    """Ring buffers [N, KV, window, D] holding the last `window` tokens of dense k, v (t at t % W)."""
    n, kvh, _, d = k.shape
    wk = k.new_zeros(n, kvh, window, d)
    wv = v.new_zeros(n, kvh, window, d)
    for i, length in enumerate(lengths.tolist()):
        tok = torch.arange(max(0, length - window), length, device=k.device)
        wk[i][:, tok % window] = k[i][:, tok]
        wv[i][:, tok % window] = v[i][:, tok]
    return wk, wv


# ----------------------------------------------------------------------------- launcher checks

def _fail(what, got, expected):
    raise ValueError(f"{what}: got {got}, expected {expected}")


def _check_float(name, x, device, dtype=None, ref="q"):
    if not isinstance(x, torch.Tensor):
        _fail(name, type(x).__name__, "a torch.Tensor")
    if x.dtype not in FLOAT_DTYPES:
        _fail(f"{name}.dtype", x.dtype, "float16, bfloat16 or float32")
    if dtype is not None and x.dtype != dtype:
        _fail(f"{name}.dtype", x.dtype, f"{dtype} (the dtype of {ref})")
    if x.device != device:
        _fail(f"{name}.device", x.device, f"{device} (the device of {ref})")


def _check_shape(name, x, expected):
    if x.dim() != len(expected) or any(e is not None and s != e for s, e in zip(x.shape, expected)):
        _fail(f"{name}.shape", tuple(x.shape), tuple("*" if e is None else e for e in expected))


def _check_contiguous(name, x):
    if not x.is_contiguous():
        _fail(f"{name} layout", f"strides {x.stride()}", "a contiguous tensor")


def _check_q(q):
    _check_float("q", q, q.device if isinstance(q, torch.Tensor) else None)
    if q.dim() != 3:
        _fail("q.shape", tuple(q.shape), "[N, H, D]")
    if q.stride(-1) != 1:
        _fail("q layout", f"strides {q.stride()}", "a unit stride on the head dim")


def _check_lengths(lengths, n, device):
    if not isinstance(lengths, torch.Tensor) or lengths.dtype not in (torch.int32, torch.int64):
        _fail("lengths.dtype", getattr(lengths, "dtype", type(lengths).__name__), "int32 or int64")
    _check_shape("lengths", lengths, (n,))
    if lengths.device != device:
        _fail("lengths.device", lengths.device, f"{device} (the device of q)")


def _check_kv_pair(names, k, v, q):
    n, h, d = q.shape
    for name, x in zip(names, (k, v)):
        _check_float(name, x, q.device, q.dtype)
        _check_shape(name, x, (n, None, None, d))
        _check_contiguous(name, x)
    if k.shape != v.shape:
        _fail(f"{names[1]}.shape", tuple(v.shape), f"{tuple(k.shape)} (the shape of {names[0]})")
    if k.shape[1] == 0 or h % k.shape[1]:
        _fail("query heads", h, f"a multiple of the {k.shape[1]} KV heads")


def _alloc(like, shape, dtype):
    """Every output and workspace of the launchers (torch.empty: tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=like.device)


def _block_d(d):
    return max(16, _next_pow2(d))  # tl.dot needs tiles of at least 16


def _tile_warps(elements):
    """Warps for a merge tile of `elements` fp32 values: about 32 per thread."""
    return max(1, min(8, elements // 1024))


def _dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _split(n_entries, n_streams, target_programs):
    """(entries per split, splits): enough programs to fill the GPU; depends on shapes only."""
    splits = max(1, min(n_entries, _cdiv(target_programs, n_streams)))
    per = _cdiv(max(n_entries, 1), splits)
    return per, _cdiv(max(n_entries, 1), per)


# ----------------------------------------------------------------------------- launchers

def nsa_compress(k, v, weight_k=None, weight_v=None):
    """Compressed keys/values [N, KV, C, D] of dense k, v [N, KV, T, D] (see nsa_compress_ref)."""
    _check_float("k", k, k.device if isinstance(k, torch.Tensor) else None)
    if k.dim() != 4:
        _fail("k.shape", tuple(k.shape), "[N, KV, T, D]")
    n, kvh, t, d = k.shape
    _check_float("v", v, k.device, k.dtype, ref="k")
    _check_shape("v", v, tuple(k.shape))
    for name, x in (("k", k), ("v", v)):
        _check_contiguous(name, x)
    _check_weights(weight_k, weight_v, d, k.device)
    n_cmp = (t - CMP_BLOCK) // CMP_STRIDE + 1 if t >= CMP_BLOCK else 0
    ck = _alloc(k, (n, kvh, n_cmp, d), k.dtype)
    cv = _alloc(v, (n, kvh, n_cmp, d), v.dtype)
    if n * kvh * n_cmp == 0:
        return ck, cv
    _launch_compress(k, v, ck, cv, weight_k, weight_v, grid=(n * kvh, _cdiv(n_cmp, COMPRESS_TILE)))
    return ck, cv


def nsa_compress_newest(win_k, win_v, lengths, ck, cv, weight_k=None, weight_v=None):
    """In place: write into ck, cv [N, KV, C, D] the compressed block that each request's newest
    token completes (when lengths[n] >= 32 and lengths[n] - 32 is a multiple of 16: block
    (lengths[n] - 32) // 16), from the window ring buffers win_k, win_v [N, KV, W, D] that already
    hold that token. The same sums in the same order as nsa_compress over the dense tokens: bitwise
    equal without weights."""
    _check_float("win_k", win_k, win_k.device if isinstance(win_k, torch.Tensor) else None)
    if win_k.dim() != 4:
        _fail("win_k.shape", tuple(win_k.shape), "[N, KV, W, D]")
    n, kvh, window, d = win_k.shape
    if window < CMP_BLOCK:
        _fail("window", window, f">= {CMP_BLOCK} tokens (one compressed block)")
    for name, x, shape in (("win_v", win_v, (n, kvh, window, d)), ("ck", ck, (n, kvh, None, d)),
                           ("cv", cv, (n, kvh, ck.shape[2], d))):
        _check_float(name, x, win_k.device, win_k.dtype, ref="win_k")
        _check_shape(name, x, shape)
    for name, x in (("win_k", win_k), ("win_v", win_v), ("ck", ck), ("cv", cv)):
        _check_contiguous(name, x)
    _check_lengths(lengths, n, win_k.device)
    _check_weights(weight_k, weight_v, d, win_k.device)
    if n * kvh * ck.shape[2]:
        _launch_compress(win_k, win_v, ck, cv, weight_k, weight_v, grid=(n * kvh, 1), lengths=lengths)


def _check_weights(weight_k, weight_v, d, device):
    if (weight_k is None) != (weight_v is None):
        _fail("weights", "only one of weight_k, weight_v", "both or neither")
    for name, w in (("weight_k", weight_k), ("weight_v", weight_v)):
        if w is not None:
            _check_float(name, w, device, ref="k")
            _check_shape(name, w, (d, d))
            _check_contiguous(name, w)


def _launch_compress(k, v, ck, cv, weight_k, weight_v, grid, lengths=None):
    """Dense tokens k, v; with `lengths`, ring buffers and only each request's newest block."""
    has_weight = weight_k is not None
    ring = lengths is not None
    _nsa_compress_kernel[grid](
        k, v, weight_k if has_weight else k, weight_v if has_weight else v, ck, cv, lengths if ring else k,
        k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        ck.stride(1), ck.stride(2), cv.stride(1), cv.stride(2),
        ck.shape[2], k.shape[3], k.shape[1], k.shape[2],
        CMP_BLOCK=CMP_BLOCK, CMP_STRIDE=CMP_STRIDE, BLOCK_C=COMPRESS_TILE, BLOCK_D=_block_d(k.shape[3]),
        HAS_WEIGHT=has_weight, RING=ring, DOT_PRECISION=_dot_precision(torch.float32),
        num_warps=8 if has_weight else 4,
    )


@dataclass(frozen=True, slots=True)
class NsaConfig:
    """Launch choices of the attention partials (outputs depend on them only through the splits).

    entry_tokens: keys per entry of the contiguous branches (compressed, window);
    target_programs: entries are split until about this many programs run per branch."""
    entry_tokens: int = 64
    target_programs: int = 1024
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.entry_tokens < 16 or self.entry_tokens & (self.entry_tokens - 1):
            _fail("NsaConfig.entry_tokens", self.entry_tokens, "a power of two >= 16")
        if self.target_programs < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            _fail("NsaConfig", self, "target_programs >= 1, num_warps a power of two <= 16, num_stages >= 1")


DEFAULT_CONFIG = NsaConfig()


class _Partials:
    """Per-split softmax states of one branch: part [N * H, S, D + 2] fp32 = (acc [D], m, l)."""

    def __init__(self, part):
        self.part = part
        self.splits = part.shape[1]

    def strides(self):
        return self.part.stride(0), self.part.stride(1)


def _partials(q, k, v, lengths, scale, config, *, n_entries, tokens, kv_heads, max_valid=0, valid_kind=0,
              rows=None, blocks=None, n_units=0, logits=None):
    """Launch the partial attention of one branch over `n_entries` entries per stream."""
    n, h, d = q.shape
    per, splits = _split(n_entries, n * kv_heads, config.target_programs)
    part = _alloc(q, (n * h, splits, d + 2), torch.float32)
    gather = blocks is not None
    if gather:
        stride_k, stride_v = k.stride(0), v.stride(0)  # one row of [SEL_BLOCK, D] keys
    else:
        stride_k, stride_v = k.stride(1), v.stride(1)  # one stream of [T, D] keys
    _nsa_attention_partial_kernel[(n * kv_heads, splits)](
        q, k, v, rows if rows is not None else lengths, blocks if gather else lengths, lengths, part,
        logits if logits is not None else part,
        q.stride(0), q.stride(1),
        stride_k, k.stride(-2), stride_v, v.stride(-2),
        blocks.stride(1) if gather else 0, logits.stride(1) if logits is not None else 0,
        part.stride(0), part.stride(1),
        kv_heads, h // kv_heads, d, n_entries, per, max_valid, n_units, d ** -0.5 if scale is None else float(scale),
        T=tokens, BLOCK_G=max(16, _next_pow2(h // kv_heads)), BLOCK_D=_block_d(d),
        GATHER=gather, RESIDENT=gather and rows is None, VALID_KIND=valid_kind,
        CMP_BLOCK=CMP_BLOCK, CMP_STRIDE=CMP_STRIDE,
        STORE_LOGITS=logits is not None, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return _Partials(part)


def _merge(q, part):
    """Fold a branch's splits: -> out fp32 [N, H, D], lse fp32 [N, H]."""
    n, h, d = q.shape
    out = _alloc(q, (n, h, d), torch.float32)
    lse = _alloc(q, (n, h), torch.float32)
    _nsa_merge_kernel[(n * h,)](
        part.part, out, lse, *part.strides(), out.stride(1), part.splits, d,
        BLOCK_S=_next_pow2(part.splits), BLOCK_D=_block_d(d),
        num_warps=_tile_warps(_next_pow2(part.splits) * _block_d(d)),
    )
    return out, lse


def _compressed_partials(q, ck, cv, lengths, scale, config):
    _check_q(q)
    _check_kv_pair(("ck", "cv"), ck, cv, q)
    _check_lengths(lengths, q.shape[0], q.device)
    n, h, _ = q.shape
    n_cmp = ck.shape[2]
    logits = _alloc(q, (n, h, max(n_cmp, 1)), torch.float32)
    part = _partials(q, ck, cv, lengths, scale, config, n_entries=_cdiv(n_cmp, config.entry_tokens),
                     tokens=config.entry_tokens, kv_heads=ck.shape[1], max_valid=n_cmp, valid_kind=0,
                     logits=logits)
    return part, logits


def nsa_compressed_attention(q, ck, cv, lengths, scale=None, config=DEFAULT_CONFIG):
    """Compressed branch over ck, cv [N, KV, C, D]: -> out fp32 [N, H, D], lse fp32 [N, H], logits fp32 [N, H, C].

    logits (scaled q.k of each valid compressed block, unset beyond) and lse give the branch's
    softmax probabilities exp(logits - lse), from which nsa_select scores the selection blocks."""
    part, logits = _compressed_partials(q, ck, cv, lengths, scale, config)
    out, lse = _merge(q, part)
    return out, lse, logits


def nsa_select(logits, lse, lengths, kv_heads, n_blocks, n_select=N_SELECT):
    """Top-n selection per KV head: -> blocks int32 [N, KV, n_select], scores fp32 [N, KV, n_blocks].

    n_blocks: selection blocks per stream (the pool's units); longer requests are cut to it."""
    for name, x, dims in (("logits", logits, 3), ("lse", lse, 2)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            _fail(f"{name}.dtype", getattr(x, "dtype", type(x).__name__), "float32")
        if x.dim() != dims or x.stride(-1) != 1:
            _fail(f"{name} layout", f"shape {tuple(x.shape)} strides {x.stride()}", f"{dims} dims, unit last stride")
    n, h, n_cmp = logits.shape
    _check_shape("lse", lse, (n, h))
    _check_lengths(lengths, n, logits.device)
    if lse.stride(0) != h or logits.stride(0) != h * logits.stride(1):
        _fail("lse, logits layout", f"strides {lse.stride()}, {logits.stride()}", "contiguous heads")
    if kv_heads < 1 or h % kv_heads:
        _fail("kv_heads", kv_heads, f"a divisor of the {h} query heads")
    if n_blocks < 1:
        _fail("n_blocks", n_blocks, ">= 1")
    if n_select < 3:
        _fail("n_select", n_select, ">= 3 (block 0 and the two newest are forced)")
    blocks = _alloc(logits, (n, kv_heads, n_select), torch.int32)
    scores = _alloc(logits, (n, kv_heads, n_blocks), torch.float32)
    block_nb = _next_pow2(n_blocks)
    _nsa_select_kernel[(n * kv_heads,)](
        logits, lse, lengths, scores, blocks,
        logits.stride(1), scores.stride(1), blocks.stride(1),
        kv_heads, h // kv_heads, n_cmp, n_blocks,
        CMP_BLOCK=CMP_BLOCK, CMP_STRIDE=CMP_STRIDE, SEL_BLOCK=SEL_BLOCK,
        N_SELECT=n_select, BLOCK_NB=block_nb, num_warps=4 if block_nb <= 1024 else 8,
    )
    return blocks, scores


def _selected_partials(q, kv_rows, rows, blocks, lengths, scale, config, n_units):
    _check_q(q)
    n, h, d = q.shape
    _check_float("kv_rows", kv_rows, q.device, q.dtype)
    if kv_rows.dim() == 2 and kv_rows.shape[1] == 2 * SEL_BLOCK * d:
        kv_rows = kv_rows.view(-1, 2, SEL_BLOCK, d)
    _check_shape("kv_rows", kv_rows, (None, 2, SEL_BLOCK, d))
    if kv_rows.stride()[1:] != (SEL_BLOCK * d, d, 1):
        _fail("kv_rows layout", f"strides {kv_rows.stride()}", "contiguous rows [2, SEL_BLOCK, D]")
    for name, x in (("rows", rows), ("blocks", blocks)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int32:
            _fail(f"{name}.dtype", getattr(x, "dtype", type(x).__name__), "int32")
        if x.device != q.device:
            _fail(f"{name}.device", x.device, f"{q.device} (the device of q)")
        _check_shape(name, x, (n, None, None))
        _check_contiguous(name, x)
    if rows is not None and rows.shape != blocks.shape:
        _fail("blocks.shape", tuple(blocks.shape), f"{tuple(rows.shape)} (the shape of rows)")
    if rows is None and (n_units < 1 or n * blocks.shape[1] * n_units > kv_rows.shape[0]):
        _fail("n_units", n_units, f">= 1 with N * KV * n_units <= {kv_rows.shape[0]} pool rows")
    if h % blocks.shape[1]:
        _fail("query heads", h, f"a multiple of the {blocks.shape[1]} KV heads of blocks")
    _check_lengths(lengths, n, q.device)
    return _partials(q, kv_rows[:, 0], kv_rows[:, 1], lengths, scale, config, n_entries=blocks.shape[2],
                     tokens=SEL_BLOCK, kv_heads=blocks.shape[1], rows=rows, blocks=blocks, n_units=n_units)


def nsa_selected_attention(q, kv_rows, rows, blocks, lengths, scale=None, config=DEFAULT_CONFIG, n_units=0):
    """Selected branch through rows: kv_rows [R, 2, SEL_BLOCK, D] or [R, 2 * SEL_BLOCK * D],
    rows, blocks int32 [N, KV, n] (-1 = skip) -> out fp32 [N, H, D]. Rows are read in order.

    rows=None reads the resident pool directly: row = (n * KV + kv_head) * n_units + block."""
    return _merge(q, _selected_partials(q, kv_rows, rows, blocks, lengths, scale, config, n_units))[0]


def _window_partials(q, win_k, win_v, lengths, scale, config):
    _check_q(q)
    _check_kv_pair(("win_k", "win_v"), win_k, win_v, q)
    _check_lengths(lengths, q.shape[0], q.device)
    window = win_k.shape[2]
    return _partials(q, win_k, win_v, lengths, scale, config, n_entries=_cdiv(window, config.entry_tokens),
                     tokens=config.entry_tokens, kv_heads=win_k.shape[1], max_valid=window, valid_kind=1)


def nsa_window_attention(q, win_k, win_v, lengths, scale=None, config=DEFAULT_CONFIG):
    """Window branch over ring buffers win_k, win_v [N, KV, W, D] (token t at t % W) -> fp32 [N, H, D]."""
    return _merge(q, _window_partials(q, win_k, win_v, lengths, scale, config))[0]


def _gate(gates, o_cmp, slc, win, out_dtype):
    n, h, d = o_cmp.shape
    _check_float("gates", gates, o_cmp.device, ref="o_cmp")
    _check_shape("gates", gates, (n, h, 3))
    _check_contiguous("gates", gates)
    if out_dtype not in FLOAT_DTYPES:
        _fail("out_dtype", out_dtype, "float16, bfloat16 or float32")
    out = _alloc(o_cmp, (n, h, d), out_dtype)
    _nsa_gate_kernel[(n * h,)](
        o_cmp, slc.part, win.part, gates, out,
        o_cmp.stride(1), *slc.strides(), *win.strides(), gates.stride(1), out.stride(1),
        slc.splits, win.splits, d,
        BLOCK_S_SLC=_next_pow2(slc.splits), BLOCK_S_WIN=_next_pow2(win.splits),
        BLOCK_D=_block_d(d),
        num_warps=_tile_warps(_next_pow2(max(slc.splits, win.splits)) * _block_d(d)),
    )
    return out


def _as_one_split(o):
    """A branch output [N, H, D] fp32 as partials of one split (m = 0, l = 1): merged, it is o exactly."""
    n, h, d = o.shape
    part = torch.zeros(n * h, 1, d + 2, device=o.device)
    part[:, 0, :d] = o.reshape(n * h, d)
    part[:, 0, d + 1] = 1.0
    return _Partials(part)


def nsa_gate(gates, o_cmp, o_slc, o_win, out_dtype):
    """out [N, H, D] = g0 * o_cmp + g1 * o_slc + g2 * o_win, gates [N, H, 3], branch outputs fp32."""
    _check_float("o_cmp", o_cmp, o_cmp.device if isinstance(o_cmp, torch.Tensor) else None)
    if o_cmp.dim() != 3:
        _fail("o_cmp.shape", tuple(o_cmp.shape), "[N, H, D]")
    for name, x in (("o_cmp", o_cmp), ("o_slc", o_slc), ("o_win", o_win)):
        _check_float(name, x, o_cmp.device, ref="o_cmp")
        if x.dtype != torch.float32:
            _fail(f"{name}.dtype", x.dtype, "torch.float32 (branch outputs are fp32)")
        _check_shape(name, x, tuple(o_cmp.shape))
        _check_contiguous(name, x)
    return _gate(gates, o_cmp, _as_one_split(o_slc), _as_one_split(o_win), out_dtype)


def nsa_decode(q, ck, cv, kv_rows, win_k, win_v, lengths, gates, n_blocks, rows_of=None,
               n_select=N_SELECT, scale=None, config=DEFAULT_CONFIG, blocks=None):
    """One NSA decode step: -> out [N, H, D] (q's dtype), blocks int32 [N, KV, n_select].

    Six launches: compressed partials, their merge, selection, selected partials, window partials,
    gates (which merge the last two). rows_of(blocks) gives the rows of kv_rows holding the selected
    blocks (the resolve step of the hot cache); None reads kv_rows as the resident pool of
    n_blocks units per stream. blocks: a selection made elsewhere (int32 [N, KV, n_select], from
    another layer of a group sharing one), used instead of this step's own: no selection launch."""
    part, logits = _compressed_partials(q, ck, cv, lengths, scale, config)
    o_cmp, lse = _merge(q, part)
    if blocks is None:
        blocks, _ = nsa_select(logits, lse, lengths, ck.shape[1], n_blocks, n_select)
    elif blocks.shape != (q.shape[0], ck.shape[1], n_select) or blocks.dtype != torch.int32:
        _fail("blocks", f"{blocks.dtype} {tuple(blocks.shape)}", f"int32 {(q.shape[0], ck.shape[1], n_select)}")
    rows = rows_of(blocks) if rows_of is not None else None
    slc = _selected_partials(q, kv_rows, rows, blocks, lengths, scale, config, n_blocks)
    win = _window_partials(q, win_k, win_v, lengths, scale, config)
    return _gate(gates, o_cmp, slc, win, q.dtype), blocks


# ----------------------------------------------------------------------------- prefill
# A prefill chunk's query s (position start + s) is a decode query of length start + s + 1: the
# selected branch runs through kernels_triton/nsa_prefill.py (the decode kernel's shape, one query
# per row list, on a GPU); the window branch through torch's fused attention over a band of keys,
# a bounded block of rows at a time.

def _check_prefill(q, keys, values, start):
    _check_float("q", q, q.device if isinstance(q, torch.Tensor) else None)
    if q.dim() != 4 or q.stride(-1) != 1:
        _fail("q", f"shape {tuple(q.shape)} strides {q.stride()}", "[B, S, H, D] with a unit stride on D")
    b, s, h, d = q.shape
    for name, x in (("keys", keys), ("values", values)):
        _check_float(name, x, q.device, q.dtype)
        _check_shape(name, x, (b, None, None, d))
    if keys.shape != values.shape:
        _fail("values.shape", tuple(values.shape), f"{tuple(keys.shape)} (the shape of keys)")
    if keys.shape[1] == 0 or h % keys.shape[1]:
        _fail("query heads", h, f"a multiple of the {keys.shape[1]} KV heads")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start + s > keys.shape[2]:
        _fail("start", start, f"an int >= 0 with start + {s} queries <= {keys.shape[2]} keys")


def nsa_prefill_selected(q, keys, values, blocks, start, block_size=SEL_BLOCK, scale=None, queries_per_program=None):
    """Selected branch of a prefill chunk: q [B, S, H, D] (roped) at positions start .. start + S - 1
    over the dense keys, values [B, KV, T, D] (the model's state), blocks [B, KV, S, n] int (each
    query's selection block ids, -1 pads) -> out fp32 [B, S, H, D].

    `_nsa_prefill_selected_kernel`: query s is a decode query of length start + s + 1 over its own
    blocks (the block's valid length is the causality). queries_per_program: 1 on a GPU (the decode
    kernel's shape), 16 in the interpreter, where each program costs far more than its arithmetic."""
    _check_prefill(q, keys, values, start)
    for name, x in (("keys", keys), ("values", values)):
        _check_contiguous(name, x)                  # stream b * KV + kv_head at one stride, unit stride on D
    b, s, h, d = q.shape
    kv_heads = keys.shape[1]
    if not isinstance(blocks, torch.Tensor) or blocks.dtype not in (torch.int32, torch.int64):
        _fail("blocks.dtype", getattr(blocks, "dtype", type(blocks).__name__), "int32 or int64")
    _check_shape("blocks", blocks, (b, kv_heads, s, None))
    if blocks.device != q.device or blocks.shape[3] == 0:
        _fail("blocks", f"{blocks.device}, {blocks.shape[3]} per query", f"on {q.device}, at least one per query")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        _fail("block_size", block_size, "a power of two >= 16 (the kernel's key tile)")
    per_program = queries_per_program or (1 if q.device.type == "cuda" else 16)
    if isinstance(per_program, bool) or not isinstance(per_program, int) or per_program & (per_program - 1):
        _fail("queries_per_program", queries_per_program, "a power of two")
    n = min(blocks.shape[3], _cdiv(start + s, block_size))     # past the chunk's blocks every entry is -1
    blocks = blocks[..., :n].to(torch.int32).contiguous()                              # [B, KV, S, n]
    out = _alloc(q, (b, s, h, d), torch.float32)
    if b * s == 0:
        return out
    g = h // kv_heads
    _nsa_prefill_selected_kernel[(b * kv_heads, _cdiv(s, per_program))](
        q, keys, values, blocks, out,
        q.stride(0), q.stride(1), q.stride(2),
        keys.stride(1), keys.stride(2),
        blocks.stride(1), blocks.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        kv_heads, g, d, s, n, start, d ** -0.5 if scale is None else float(scale),
        T=block_size, BLOCK_Q=per_program, BLOCK_G=max(16 // per_program, _next_pow2(g)), BLOCK_D=_block_d(d),
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=4,
    )
    return out


def nsa_prefill_window(q, keys, values, start, window=WINDOW, scale=None):
    """Window branch of a prefill chunk: q [B, S, H, D] at positions start .. start + S - 1 over the
    last `window` of keys, values [B, KV, T, D] up to each position -> out [B, S, H, D] (q's dtype).

    torch's scaled_dot_product_attention, `window` queries at a time over the band of keys they
    reach (window + rows keys, a [rows, keys] mask): the workspace does not grow with the prompt."""
    _check_prefill(q, keys, values, start)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        _fail("window", window, "an int >= 1")
    s = q.shape[1]
    q_heads = q.transpose(1, 2)                                                       # [B, H, S, D]
    out = torch.empty_like(q_heads)
    for first in range(0, s, window):
        last = min(first + window, s)
        lo, hi = max(0, start + first + 1 - window), start + last                    # the keys they reach
        pos = torch.arange(start + first, start + last, device=q.device)[:, None]     # [rows, 1]
        tok = torch.arange(lo, hi, device=q.device)[None, :]                         # [1, keys]
        mask = (tok <= pos) & (tok > pos - window)
        out[:, :, first:last] = F.scaled_dot_product_attention(
            q_heads[:, :, first:last], keys[:, :, lo:hi], values[:, :, lo:hi], attn_mask=mask,
            scale=scale, enable_gqa=True)
    return out.transpose(1, 2)

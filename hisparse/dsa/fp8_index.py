"""DSA's FP8 indexer keys: DeepSeek-V3.2's per-token e4m3 keys and query (quantised by one kernel on the
GPU, kernels_triton/dsa_index_quant.py, in torch elsewhere, the same bits), and the indexer scores and
selections over keys as stored (through the indexer kernels of kernels_triton/dsa.py and dsa_prefill.py
with e4m3 operands; torch reference `fp8_scores_ref`).

A stored key is two arrays, as DeepSeek's own cache (k_cache, k_scale_cache), vLLM's and SGLang's
keep them: the values float8_e4m3fn [..., T, D] (D bytes a token, rows 16-byte aligned at D = 128, so a
kernel loads them as wide vectors) and the scales float32 [..., T] (4 bytes a token, contiguous), D + 4
bytes a token in all (`key_row_bytes`, 132 at DeepSeek's D = 128): rotated key value c is value[c] * scale.

Quantisation, of a key [D] and of each query head [D] alike (DeepSeek-V3.2-Exp's inference
`act_quant`, block D, scale_fmt "ue8m0"): rotate by the orthonormal Hadamard matrix (`rotate`:
their `rotate_activation`; q.k is unchanged, outliers spread before rounding), a = max(absmax, 1e-4),
scale = 2 ** ceil(log2(a * (1 / 448))) (exactly, from the float32's exponent), values = the
rotated ones / scale clamped to +-448, rounded to nearest even. The score of token t is theirs
(`fp8_index`): scale_k(t) * sum_h w(h) * scale_q(h) * ReLU(q8(h) . k8(t)), w carrying the model's
weights and softmax scale; the kernels take w * scale_q (`quantize_query`).

Where we differ: vLLM, SGLang and DeepGEMM's paged `fp8_paged_mqa_logits` keep a page's 64 scales
after its 64 * D values in one buffer; we keep one values and one scales array per layer, each
indexed by (request, token) like the bf16 keys, so every place that holds keys by token (the lanes,
the prefill's state, hybrid runs, a handoff) slices and copies the two alike. We rotate in float32
(they rotate bf16 activations to bf16), by the fast Walsh-Hadamard transform in a fixed order (`rotate`),
whose adds a kernel repeats bit for bit: on CUDA tensors `quantize_keys` and `quantize_query` are one
kernel (`rotate_quantize`: x read once, no float32 copy), the CPU and the references (`fp8_scores_ref`)
the torch path. Head dims other than 128 (the tiny checkpoints' 32 or 64) take one scale for the whole
head as they would for one block.

In the system (index_dtype "fp8" of `DsaRuntime`, `Engine`, `Server`: DESIGN section 5.1)
`MlaKV.index_keys` is float8_e4m3fn [B, capacity, D] and `MlaKV.index_scales` float32 [B, capacity],
written quantised (`quantize_keys`) and read by `select_stored` / `prefill_select_stored`.
"""
from __future__ import annotations

import torch

from hisparse.dsa.ops import FP8, dsa_prefill_select, indexer_scores, require, topk_select
from kernels_triton.dsa_index_quant import AMAX_FLOOR, FP8_MAX, FP8_MAX_INV, rotate_quantize, rotate_scale

SCALE_BYTES = 4
# How the DSA family stores an indexer key (`index_dtype` of DsaRuntime, Engine, Server, generate
# --index-dtype): "bf16", D values in the model's dtype; "fp8", this module's e4m3 values and scale
INDEX_DTYPES = ("bf16", "fp8")


def check_index_dtype(index_dtype) -> str:
    """index_dtype itself if it is one of INDEX_DTYPES, else ValueError naming it and the choices."""
    if not isinstance(index_dtype, str) or index_dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype={index_dtype!r}: expected one of {INDEX_DTYPES} (DSA's indexer keys: "
                         f"'bf16', in the model's dtype; 'fp8', DeepSeek-V3.2's e4m3 keys with a float32 scale "
                         f"a token, 132 bytes at head dim 128)")
    return index_dtype


def key_row_bytes(head_dim: int) -> int:
    """Bytes of one stored FP8 key: head_dim e4m3 values and its float32 scale (132 at 128)."""
    return head_dim + SCALE_BYTES


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a power of 2) times the orthonormal Sylvester-Hadamard matrix, float32 (dot products kept):
    the fast Walsh-Hadamard transform, log2(D) stages each pairing elements (2m, 2m + 1) into a + b at m and
    a - b at D/2 + m (stage j pairs bit j of the index), then one multiply by D ** -0.5 in float32. Adds and
    one multiply, each rounded once: every device, and the kernel of `rotate_quantize`, gives these bits."""
    d = x.shape[-1]
    require(d >= 1 and d & (d - 1) == 0, f"head dim {d}: the Hadamard rotation needs a power of 2")
    y = x.float()
    for _ in range(d.bit_length() - 1):
        a, b = y[..., 0::2], y[..., 1::2]
        y = torch.cat((a + b, a - b), dim=-1)
    return y * rotate_scale(d)


def pow2_scale(absmax: torch.Tensor) -> torch.Tensor:
    """act_quant's ue8m0 scale of blocks with this absmax (float32): 2 ** ceil(log2(max(absmax, 1e-4) / 448))."""
    x = absmax.float().clamp_min(AMAX_FLOOR) * FP8_MAX_INV
    mantissa, exponent = torch.frexp(x)                   # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)   # x a power of two: log2 exact
    return torch.ldexp(torch.ones_like(x), exponent)


def quantize_rotated(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values e4m3 [..., D], scales float32 [...]) of rotated vectors x [..., D], one scale a vector."""
    scale = pow2_scale(x.abs().amax(dim=-1))
    values = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)   # exact division: a power of 2
    return values, scale


def quantize_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored keys (values float8_e4m3fn [..., D], scales float32 [...]) of indexer keys [..., D]
    (float16/bf16/float32, roped, finite): on CUDA tensors one kernel (`rotate_quantize`), elsewhere
    `quantize_rotated(rotate(keys))` in torch, the same bits."""
    require(keys.dtype in (torch.float16, torch.bfloat16, torch.float32),
            f"keys dtype {keys.dtype}: expected float16, bfloat16 or float32")
    require(keys.dim() >= 1 and keys.shape[-1] >= 16, f"keys shape {tuple(keys.shape)}: expected [..., D >= 16]")
    if keys.is_cuda:
        return rotate_quantize(keys)
    return quantize_rotated(rotate(keys))


def check_stored(values: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless values float8_e4m3fn [..., D] and scales float32 [...] are one stored key array."""
    require(values.dtype == FP8 and values.dim() >= 1 and scales is not None and scales.dtype == torch.float32
            and scales.shape == values.shape[:-1],
            f"stored keys {values.dtype} {tuple(values.shape)} with scales "
            f"{None if scales is None else (scales.dtype, tuple(scales.shape))}: expected {FP8} [..., D] and "
            f"float32 [...] of its leading shape")


def dequantize_keys(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The rotated keys float32 [..., D] of stored keys (values [..., D], scales [...]) (exact: e4m3 times 2 ** e)."""
    check_stored(values, scales)
    return values.float() * scales[..., None]


def quantize_query(q: torch.Tensor, weights: torch.Tensor,
                   reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q8 e4m3 [..., H, D], weights * scale_q float32 [..., H]) of queries q [..., H, D] and their head
    weights [..., H] (float32, the softmax scale already in): each head quantised as a key is, on CUDA
    tensors by one kernel (`rotate_quantize`, the weights' product in it), else (or with reference) in
    torch, the same bits."""
    require(q.dim() >= 2 and weights.shape == q.shape[:-1] and q.shape[-1] >= 16,
            f"q {tuple(q.shape)} and weights {tuple(weights.shape)}: expected [..., H, D >= 16] and [..., H]")
    if q.is_cuda and not reference:
        return rotate_quantize(q, weights)
    values, scale = quantize_rotated(rotate(q))
    return values, weights.float() * scale


def fp8_scores_ref(q: torch.Tensor, weights: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Plain-torch FP8 indexer scores [B, S, T] float32 of queries q [B, S, H, D] (roped, unquantised)
    with head weights [B, S, H] over stored keys (values e4m3 [B, T, D], scales float32 [B, T]), every
    pair (no mask): the query quantised (`quantize_query` in torch), e4m3 products summed in float32,
    then ReLU, weights, the key's scale."""
    check_stored(values, scales)
    q8, w = quantize_query(q, weights, reference=True)
    logits = torch.einsum("bshd,btd->bsht", q8.float(), values.float()).relu()
    return torch.einsum("bsh,bsht->bst", w, logits) * scales[:, None, :]


def indexer_scores_fp8_ref(q, weights, values, scales, lengths) -> torch.Tensor:
    """`indexer_scores_fp8` in plain torch: [N, T] float32, -inf at t >= lengths[n]."""
    scores = fp8_scores_ref(q[:, None], weights[:, None], values, scales)[:, 0]
    valid = torch.arange(values.shape[1], device=q.device)[None, :] < lengths[:, None]
    return scores.masked_fill(~valid, float("-inf"))


def indexer_scores_fp8(q: torch.Tensor, weights: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                       lengths: torch.Tensor, block_t: int | None = None, fp8_dot: bool | None = None) -> torch.Tensor:
    """Decode indexer scores [N, T] float32 (-inf at t >= lengths[n]) of queries q [N, H, D] (roped,
    in the model's dtype) with weights [N, H] over stored keys (values e4m3 [N, T, D], scales float32
    [N, T]): the query quantised here, then `ops.indexer_scores` (fp8_dot, block_t: its own)."""
    check_stored(values, scales)
    q8, w = quantize_query(q, weights)
    return indexer_scores(q8, w, values, lengths, key_scale=scales, block_t=block_t, fp8_dot=fp8_dot)


def select_stored(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor,
                  k: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """The decode selection [N, k] int32 (-1 padding) over indexer keys as stored: e4m3 keys with
    their scales [N, T] through `indexer_scores_fp8`, others through `ops.indexer_scores`; then the
    exact top-k."""
    if keys.dtype == FP8:
        return topk_select(indexer_scores_fp8(q, weights, keys, scales, lengths), lengths, k)
    require(scales is None, f"scales are for {FP8} keys, keys are {keys.dtype}")
    return topk_select(indexer_scores(q, weights, keys, lengths), lengths, k)


def prefill_select_stored(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start: int,
                          k: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """`ops.dsa_prefill_select` over one request's keys [T, D] as stored: e4m3 keys with their scales
    [T] (the chunk's queries quantised once, their scales in the weights), or keys in q's dtype."""
    if keys.dtype != FP8:
        require(scales is None, f"scales are for {FP8} keys, keys are {keys.dtype}")
        return dsa_prefill_select(q, weights, keys, start, k)
    check_stored(keys, scales)
    q8, w = quantize_query(q, weights)
    return dsa_prefill_select(q8, w, keys, start, k, key_scale=scales)


def stored_index_bytes(head_dim: int, elem_bytes: int, index_dtype: str) -> int:
    """Bytes of one token's indexer key as stored: head_dim values of elem_bytes, or an FP8 key's D + 4."""
    return key_row_bytes(head_dim) if check_index_dtype(index_dtype) == "fp8" else head_dim * elem_bytes

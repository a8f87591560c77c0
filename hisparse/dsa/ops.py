"""DSA (DeepSeek-V3.2 sparse attention): lightning indexer, top-k selection, sparse MLA decode.

Semantics follow Hugging Face transformers' `deepseek_v32` eager path (DESIGN section 5), for one
decode query per request:
- indexer score of past token s: scale(s) * sum_h w(h) * ReLU(q(h) . k(s)), over the tokens
  s < lengths[n] (the current token's key is written before scoring, so lengths counts it);
  `w` already carries the model's scaling; scale(s) is the per-token fp8 dequantisation scale (1 for
  bf16/fp16/fp32 keys). With an e4m3 query too (DeepSeek-V3.2's FP8 indexer, `hisparse.dsa.fp8_index`:
  the format, the query's quantisation, w carrying its scales) the products are e4m3's (`fp8_dot`).
- top-k: the k best scores, best first; equal scores (+0.0 == -0.0) rank the lower token index first;
  fewer than k valid tokens pad with -1.
- attention: absorbed MLA over the selected rows of a row buffer `kv [R, D]` (D = 576: 512 latent
  values, then 64 rope dims), read through `rows [N, k]` (int32 row numbers, -1 = skip) in the order
  given, all heads sharing one selection, softmax scale from the model config.
Prefill (`dsa_prefill_select`): a chunk's queries are decode queries of their causal lengths; their
scores come from `prefill_indexer_scores` (kernels_triton/dsa_prefill.py: queries resident, a loop over
key tiles, keys as the MMA's rows), the decode indexer's within float32 rounding, and their top-k from
`topk_of_indexer_scores`.
The `*_ref` functions in reference.py are the plain-torch definitions the kernels are tested against,
but for `order_picks_ref` and `place_ties_ref`: `topk_of_indexer_scores` runs them on the CPU, so they
stay here (reference.py imports fp8.py, which imports this module).
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.runtime.errors

from kernels_triton import dsa_gluon
from kernels_triton.dsa import (
    _indexer_scores_kernel,
    _sparse_mla_combine_kernel,
    _sparse_mla_decode_kernel,
)
from kernels_triton.dsa_gluon import (
    BLOCK_H,
    BLOCK_K,
    NUM_STAGES,
    NUM_WARPS,
    _sparse_mla_decode_gluon_kernel,
)
from kernels_triton.dsa_prefill import (
    _order_picks_kernel,
    _place_ties_kernel,
    _prefill_indexer_kernel,
)
from kernels_triton.topk import radix_topk_picks

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact float32 products; 16-bit ones use the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------------------------
# Lightning indexer
# ---------------------------------------------------------------------------------------------

def _check_indexer_inputs(q, weights, keys, lengths, key_scale) -> None:
    require(q.dim() == 3, f"q must be [N, H_index, D], got shape {tuple(q.shape)}")
    n, h, d = q.shape
    require(q.dtype in (*FLOAT_DTYPES, FP8), f"q dtype {q.dtype}: expected one of {FLOAT_DTYPES} or {FP8}")
    require(d >= 16 and d == triton.next_power_of_2(d), f"indexer head dim {d}: expected a power of 2 >= 16")
    require(weights.shape == (n, h), f"weights shape {tuple(weights.shape)}: expected {(n, h)}")
    require(weights.dtype.is_floating_point, f"weights dtype {weights.dtype}: expected a float dtype")
    require(keys.dim() == 3 and keys.shape[0] == n and keys.shape[2] == d,
            f"keys shape {tuple(keys.shape)}: expected [N={n}, T, D={d}]")
    require(keys.dtype in (q.dtype, FP8), f"keys dtype {keys.dtype}: expected {q.dtype} (as q) or {FP8}")
    require(q.dtype != FP8 or keys.dtype == FP8, f"q is {FP8}: keys must be too, got {keys.dtype}")
    require(lengths.shape == (n,) and lengths.dtype in (torch.int32, torch.int64),
            f"lengths must be int32/int64 of shape {(n,)}, got {lengths.dtype} {tuple(lengths.shape)}")
    _check_key_scale(keys, keys.shape[:2], key_scale)
    tensors = {"q": q, "weights": weights, "keys": keys, "lengths": lengths, "key_scale": key_scale}
    for name, t in tensors.items():
        if t is not None:
            require(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
    require(q.stride(-1) == 1 and keys.stride(-1) == 1,
            f"q and keys need a contiguous last dim, strides {q.stride()} and {keys.stride()}")


def _check_key_scale(keys, shape, key_scale) -> None:
    if keys.dtype == FP8:
        require(key_scale is not None, f"fp8 keys need key_scale {list(shape)} float32")
        require(key_scale.shape == shape and key_scale.dtype == torch.float32,
                f"key_scale {key_scale.dtype} {tuple(key_scale.shape)}: expected float32 {tuple(shape)}")
    else:
        require(key_scale is None, f"key_scale is only for fp8 keys, keys are {keys.dtype}")


def fp8_dot_default(device: torch.device) -> bool:
    """Whether e4m3 x e4m3 products run as such (tensor cores of sm_89 and later) by default: on those
    GPUs; elsewhere and in the interpreter both operands are upcast to float16 first."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _fp8_dot(q: torch.Tensor, fp8_dot: bool | None) -> bool:
    require(fp8_dot is None or isinstance(fp8_dot, bool), f"fp8_dot={fp8_dot!r}: expected None, True or False")
    require(not fp8_dot or q.dtype == FP8, f"fp8_dot=True multiplies e4m3 operands; q is {q.dtype}")
    if q.dtype != FP8:
        return False
    return fp8_dot_default(q.device) if fp8_dot is None else fp8_dot


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor,
                   key_scale: torch.Tensor | None = None, block_t: int | None = None,
                   fp8_dot: bool | None = None) -> torch.Tensor:
    """Lightning-indexer scores [N, T] float32 of each request's decode query; -inf at t >= lengths[n].

    q [N, H_index, D] (D a power of 2, 128 in the model), weights [N, H_index], keys [N, T, D] in q's
    dtype or float8_e4m3fn with key_scale [N, T] float32, lengths [N] (clamped to T). q may be e4m3
    too (keys then e4m3): fp8_dot (default `fp8_dot_default`) multiplies them as e4m3 on the tensor
    cores, False upcasts both to float16 first (exact products; the sums' order is the MMA's).
    block_t: keys a program scores (a power of 2 >= 16; default 128 on a GPU, 32 elsewhere): another
    tile, or the prefill indexer (`prefill_indexer_scores`), gives the same within float32 rounding.
    """
    _check_indexer_inputs(q, weights, keys, lengths, key_scale)
    fp8_dot = _fp8_dot(q, fp8_dot)
    if block_t is not None:
        require(isinstance(block_t, int) and block_t >= 16 and block_t & (block_t - 1) == 0,
                f"block_t={block_t!r}: expected a power of 2 of at least 16")
    n, h, d = q.shape
    t = keys.shape[1]
    out = torch.empty((n, t), dtype=torch.float32, device=q.device)
    if n == 0 or t == 0:
        return out
    scale = key_scale if key_scale is not None else out  # never read without HAS_SCALE
    block_t = block_t or (128 if q.is_cuda else 32)
    _indexer_scores_kernel[(triton.cdiv(t, block_t), n)](
        q, weights, keys, scale, lengths, out,
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), keys.stride(0), keys.stride(1),
        scale.stride(0), scale.stride(1), out.stride(0),
        t,
        H=h, D=d, BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_T=block_t,
        HAS_SCALE=key_scale is not None, DOT_PRECISION=dot_precision(q.dtype), FP8_Q=q.dtype == FP8,
        FP8_DOT=fp8_dot, num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Top-k selection
# ---------------------------------------------------------------------------------------------

def _check_topk_inputs(scores, lengths, k) -> None:
    require(scores.dim() == 2 and scores.dtype == torch.float32,
            f"scores must be float32 [N, T], got {scores.dtype} {tuple(scores.shape)}")
    require(lengths.shape == (scores.shape[0],) and lengths.dtype in (torch.int32, torch.int64),
            f"lengths must be int32/int64 of shape {(scores.shape[0],)}, "
            f"got {lengths.dtype} {tuple(lengths.shape)}")
    require(lengths.device == scores.device, f"lengths on {lengths.device}, scores on {scores.device}")
    require(isinstance(k, int) and k >= 1, f"k must be a positive int, got {k!r}")


def topk_select(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """The k best tokens [N, k] int32 of each request, best first, -1 padding.

    torch.topk does not specify the order of equal values, so it runs on unique int64 keys instead:
    the high 32 bits order the float32 score (its bits with the magnitude flipped for negatives,
    -0.0 folded into +0.0), the low 32 bits hold 2^32 - 1 - t, so equal scores rank the lower index
    first. The result is exactly `reference.topk_select_ref` (a stable sort) for any k, on CPU and GPU.
    """
    _check_topk_inputs(scores, lengths, k)
    n, t = scores.shape
    o_t = torch.arange(t, device=scores.device)
    masked = torch.where(o_t[None, :] < lengths[:, None], scores, float("-inf"))       # [N, T]
    masked.masked_fill_(masked == 0, 0.0)
    keys = masked.view(torch.int32).to(torch.int64)
    del masked                                    # in place from here: prefill calls this on large [N, T]
    keys ^= (keys >> 31) & 0x7FFFFFFF             # signed order of the float order
    keys <<= 32
    keys |= (0xFFFFFFFF - o_t)[None, :]
    picked = keys.topk(min(k, t), dim=1, sorted=True).indices  # [N, min(k, T)]
    sel = torch.full((n, k), -1, dtype=torch.int32, device=scores.device)
    sel[:, :picked.shape[1]] = torch.where(picked < lengths[:, None], picked, -1).to(torch.int32)
    return sel


# how the prefill's top-k runs: "torch" (torch.topk on the floats, then `order_picks` and `place_ties`:
# the path results/notes/prefill.md measured) or "radix" (kernels_triton/topk.py's exact picks, then
# `order_picks`: tested, not yet timed on a GPU; benchmarks/bench_prefill_parts.py times both)
TOPK_METHODS = ("torch", "radix")
PREFILL_TOPK = "torch"


def topk_of_indexer_scores(scores: torch.Tensor, lengths: torch.Tensor, k: int,
                           method: str | None = None) -> torch.Tensor:
    """`topk_select`'s result for scores the indexer kernels wrote (-inf at t >= lengths[n]: other
    scores past a length would be picked, then dropped), faster (prefill). method (default
    PREFILL_TOPK) "torch": torch.topk on the floats, the picks ordered best first with ties to the
    lower id by `order_picks` (one sort of k unique keys per row), then the picks equal to the lowest
    one replaced by the lowest ids of that score (`place_ties`: torch.topk may have picked others);
    "radix": `radix_topk_picks`'s picks (exact: ties to the lower id already, scores past a length
    not read), ordered by `order_picks`. Nothing is read back to the host."""
    method = PREFILL_TOPK if method is None else method
    require(method in TOPK_METHODS, f"method={method!r}: expected one of {TOPK_METHODS}")
    _check_topk_inputs(scores, lengths, k)
    n, t = scores.shape
    if t == 0:
        return torch.full((n, k), -1, dtype=torch.int32, device=scores.device)
    if method == "radix":
        values, ids = radix_topk_picks(scores, lengths, k)
        # on the CPU the ordering in torch: the interpreter takes about 45 ms a row to run the sort kernel
        return (order_picks if scores.is_cuda else order_picks_ref)(values, ids, lengths, k)[0]
    values, ids = scores.topk(min(k, t), dim=1, sorted=False)                         # [N, k']
    if scores.is_cuda:
        sel, last, ties = order_picks(values, ids, lengths, k)
        place_ties(scores, last, ties, sel, values.shape[1])
    else:              # the same in torch (see above)
        sel, last, ties = order_picks_ref(values, ids, lengths, k)
        place_ties_ref(scores, last, ties, sel, values.shape[1])
    return sel


def order_picks(values: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, k: int):
    """The selection [N, k] int32 made of each row's top-k picks (values [N, k'] float32 and their
    token ids [N, k'] int64, k' <= k, in any order): best first, equal scores (+0.0 == -0.0) to the
    lower id, ids >= lengths[n] and the places past k' as -1 (`order_picks_ref` in torch). Also the
    lowest picked value [N] float32 and how many picks equal it [N] int32 (what `place_ties` replaces)."""
    n, picked = values.shape
    require(values.dtype == torch.float32 and ids.shape == values.shape and ids.dtype == torch.int64,
            f"values float32 and ids int64 of one shape [N, k'], got {values.dtype} {tuple(values.shape)} "
            f"and {ids.dtype} {tuple(ids.shape)}")
    require(1 <= picked <= k and lengths.shape == (n,) and lengths.device == values.device,
            f"{picked} picks for k={k}, lengths {tuple(lengths.shape)} on {lengths.device}")
    require(values.stride(1) == 1 and ids.stride(1) == 1, "values and ids need a contiguous last dim")
    sel = torch.empty((n, k), dtype=torch.int32, device=values.device)
    last = torch.empty((n,), dtype=torch.float32, device=values.device)
    ties = torch.empty((n,), dtype=torch.int32, device=values.device)
    if n:
        block_k = triton.next_power_of_2(k)
        _order_picks_kernel[(n,)](
            values, ids, lengths.contiguous(), sel, last, ties, values.stride(0), ids.stride(0), sel.stride(0), picked, k,
            BLOCK_K=block_k, num_warps=4 if block_k <= 2048 else 8,
        )
    return sel, last, ties


def place_ties(scores: torch.Tensor, last: torch.Tensor, ties: torch.Tensor, sel: torch.Tensor, picked: int) -> None:
    """In place: each row's last ties[n] of its `picked` ordered picks, sel[n, picked - ties[n] :
    picked], become the ties[n] lowest ids t whose score [N, T] float32 equals last[n] (+0.0 ==
    -0.0), in id order; rows whose last[n] is -inf are left as they are. One pass over the scores
    (`_place_ties_kernel`); `place_ties_ref` in torch."""
    require(scores.dim() == 2 and scores.dtype == torch.float32 and scores.stride(1) == 1,
            f"scores must be float32 [N, T] with a contiguous last dim, got {scores.dtype} {tuple(scores.shape)}")
    n, t = scores.shape
    require(last.shape == (n,) and last.dtype == torch.float32 and ties.shape == (n,) and ties.dtype == torch.int32,
            f"last must be float32 [{n}] and ties int32 [{n}], got {last.dtype} {tuple(last.shape)} and "
            f"{ties.dtype} {tuple(ties.shape)}")
    require(sel.dim() == 2 and sel.shape[0] == n and 1 <= picked <= sel.shape[1] and sel.stride(1) == 1,
            f"sel [{n}, >= {picked}] with a contiguous last dim, got {tuple(sel.shape)}")
    require(last.device == scores.device == ties.device == sel.device, "scores, last, ties and sel on one device")
    if n and t:
        _place_ties_kernel[(n,)](scores, last, ties, sel, scores.stride(0), sel.stride(0), t, picked,
                                 BLOCK_T=4096 if scores.is_cuda else 64, num_warps=8)


# torch references that are also the CPU path of `topk_of_indexer_scores` (see the module docstring)
def place_ties_ref(scores: torch.Tensor, last: torch.Tensor, ties: torch.Tensor, sel: torch.Tensor, picked: int) -> None:
    """`place_ties` in torch."""
    for row in torch.nonzero(last > float("-inf")).flatten().tolist():
        tied = torch.nonzero(scores[row] == last[row]).flatten()[:int(ties[row])]
        sel[row, picked - len(tied):picked] = tied.to(torch.int32)


def order_picks_ref(values: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, k: int):
    """`order_picks` in torch: the picks sorted by id, then stably by score, best first; the lowest
    pick and how many picks equal it."""
    n, picked = values.shape
    last = values.min(dim=1).values
    ties = (values == last[:, None]).sum(1).to(torch.int32)
    ids, order = ids.sort(dim=1)                                                       # by id, then stably
    values = values.masked_fill(values == 0, 0.0).gather(1, order)
    ids = ids.gather(1, values.sort(dim=1, descending=True, stable=True).indices)       # by score: ties by id
    sel = torch.full((n, k), -1, dtype=torch.int32, device=values.device)
    sel[:, :picked] = torch.where(ids < lengths[:, None], ids, -1).to(torch.int32)
    return sel, last, ties


def dsa_select(q, weights, keys, lengths, k: int, key_scale=None) -> torch.Tensor:
    """Indexer scores then top-k: the selection [N, k] int32 of token ids, -1 padding (e4m3 q and
    keys: `indexer_scores`'s default fp8_dot)."""
    return topk_select(indexer_scores(q, weights, keys, lengths, key_scale), lengths, k)


# ---------------------------------------------------------------------------------------------
# Prefill: the indexer over a chunk of queries, causality as lengths
# ---------------------------------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class PrefillIndexerConfig:
    """Tiles and launch shape of `_prefill_indexer_kernel`: `queries` resident queries a program (1, 2
    or 4), `block_t` keys a tile, `splits` programs along the keys per query block (None: enough to
    fill the GPU)."""
    block_t: int
    queries: int
    num_warps: int
    num_stages: int
    splits: int | None = None

    def __post_init__(self):
        require(self.block_t >= 16 and self.block_t == triton.next_power_of_2(self.block_t),
                f"block_t={self.block_t}: expected a power of 2 >= 16")
        require(self.queries in (1, 2, 4), f"queries={self.queries}: expected 1, 2 or 4")
        require(self.num_warps in (1, 2, 4, 8, 16), f"num_warps={self.num_warps}: expected 1, 2, 4, 8 or 16")
        require(self.num_stages >= 1, f"num_stages={self.num_stages}: expected >= 1")
        require(self.splits is None or (isinstance(self.splits, int) and self.splits >= 1),
                f"splits={self.splits!r}: expected None or an int >= 1")


def default_prefill_indexer_config(device: torch.device) -> PrefillIndexerConfig:
    """GPU: 4 queries a program, 64 keys a tile, 8 warps, 3 stages: of the configs probed, the fastest
    sum of 2048 queries over 32K keys and 512 over 128K (64 x 128 bf16 indexer; results/notes/prefill.md).
    The interpreter: 32-key tiles."""
    if device.type == "cuda":
        return PrefillIndexerConfig(block_t=64, queries=4, num_warps=8, num_stages=3)
    return PrefillIndexerConfig(block_t=32, queries=4, num_warps=4, num_stages=1)


def _check_prefill_indexer_inputs(q, weights, keys, start, key_scale) -> None:
    require(q.dim() == 3 and keys.dim() == 2, f"q must be [S, H_index, D] and keys [T, D], got shapes "
            f"{tuple(q.shape)} and {tuple(keys.shape)}")
    s, h, d = q.shape
    t = keys.shape[0]
    require(q.dtype in (*FLOAT_DTYPES, FP8), f"q dtype {q.dtype}: expected one of {FLOAT_DTYPES} or {FP8}")
    require(d >= 16 and d == triton.next_power_of_2(d), f"indexer head dim {d}: expected a power of 2 >= 16")
    require(keys.shape[1] == d and keys.dtype == q.dtype,
            f"keys {keys.dtype} {tuple(keys.shape)}: expected {q.dtype} [T, D={d}]")
    _check_key_scale(keys, keys.shape[:1], key_scale)
    require(weights.shape == (s, h) and weights.dtype.is_floating_point,
            f"weights {weights.dtype} {tuple(weights.shape)}: expected a float dtype of shape {(s, h)}")
    require(isinstance(start, int) and 0 <= start and start + s <= t,
            f"start={start!r}: queries at start .. start + {s} - 1 need start >= 0 and start + {s} <= T = {t}")
    for name, x in (("weights", weights), ("keys", keys), ("key_scale", key_scale)):
        if x is not None:
            require(x.device == q.device, f"{name} is on {x.device}, q on {q.device}")
    require(q.stride(-1) == 1 and keys.stride(-1) == 1,
            f"q and keys need a contiguous last dim, strides {q.stride()} and {keys.stride()}")


def prefill_indexer_splits(query_blocks: int, tiles: int, device: torch.device) -> int:
    """Programs along the keys per query block: about 4 a multiprocessor in all (1 off the GPU)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, triton.cdiv(4 * sms, query_blocks)))


def prefill_indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start: int,
                           config: PrefillIndexerConfig | None = None, key_scale: torch.Tensor | None = None,
                           fp8_dot: bool | None = None) -> torch.Tensor:
    """Lightning-indexer scores [S, T] float32 of S consecutive queries at positions start .. start +
    S - 1 over one request's keys [T, D]: query s scores tokens t < start + s + 1 (its causal
    length), -inf from there: `indexer_scores(q, weights, keys.expand(S, T, D), start + 1 +
    arange(S))` (the decode kernel) and `reference.indexer_scores_ref` within float32 rounding, the
    heads summed in another order (tests/test_dsa.py). q [S, H_index, D], weights [S, H_index], keys
    in q's dtype; e4m3 q and keys with key_scale [T] float32 and fp8_dot as `indexer_scores`'s."""
    _check_prefill_indexer_inputs(q, weights, keys, start, key_scale)
    fp8_dot = _fp8_dot(q, fp8_dot)
    cfg = config or default_prefill_indexer_config(q.device)
    s, h, d = q.shape
    t = keys.shape[0]
    out = torch.empty((s, t), dtype=torch.float32, device=q.device)
    if s == 0 or t == 0:
        return out
    query_blocks, tiles = triton.cdiv(s, cfg.queries), triton.cdiv(t, cfg.block_t)
    splits = min(tiles, cfg.splits or prefill_indexer_splits(query_blocks, tiles, q.device))
    tiles_per_split = triton.cdiv(tiles, splits)
    scale = key_scale if key_scale is not None else out  # never read without HAS_SCALE
    _prefill_indexer_kernel[(query_blocks, triton.cdiv(tiles, tiles_per_split))](
        q, weights, keys, scale, out,
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), keys.stride(0), scale.stride(0),
        out.stride(0), s, t, start, tiles_per_split,
        H=h, D=d, BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_T=cfg.block_t, QUERIES=cfg.queries,
        DOT_PRECISION=dot_precision(q.dtype), HAS_SCALE=key_scale is not None, FP8_Q=q.dtype == FP8,
        FP8_DOT=fp8_dot,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# the prefill's selection makes its [rows, T] scores this many elements at a time (about 6 bytes each
# at the peak, 30 in rows whose ties need the exact keys), so its workspace does not grow with the prompt
PREFILL_SELECT_ELEMENTS = 1 << 26


def dsa_prefill_select(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start: int, k: int,
                       max_elements: int = PREFILL_SELECT_ELEMENTS, key_scale: torch.Tensor | None = None,
                       fp8_dot: bool | None = None) -> torch.Tensor:
    """The selections [S, k] int32 (-1 padding) of one request's prefill chunk: q [S, H_index, D] and
    weights [S, H_index] of the tokens at positions start .. start + S - 1, keys [T, D] of its first
    T = start + S tokens. Query s selects among tokens 0 .. start + s as `dsa_select` does for a
    decode query of that length (causality is the lengths, no [S, T] mask is made), from the scores
    of `prefill_indexer_scores` (the decode indexer's within float32 rounding: a near-tie at the k-th
    place may pick another token), made for as many queries at a time as fit `max_elements`. The host
    never waits on the GPU here (a prefill piece beside decode steps must not stall their launches).
    e4m3 q and keys: key_scale [T] and fp8_dot as `prefill_indexer_scores`'s."""
    require(q.dim() == 3 and keys.dim() == 2, f"q must be [S, H_index, D] and keys [T, D], got shapes "
            f"{tuple(q.shape)} and {tuple(keys.shape)}")
    s, t = q.shape[0], keys.shape[0]
    require(isinstance(start, int) and 0 <= start and start + s == t,
            f"start={start!r}: a chunk of {s} queries over {t} keys starts at {t - s}")
    lengths = torch.arange(start + 1, t + 1, device=q.device)
    out = torch.empty((s, k), dtype=torch.int32, device=q.device)
    blocks = triton.cdiv(s, max(1, max_elements // max(1, t)))
    rows = triton.cdiv(s, max(1, blocks))    # equal blocks: no short one left at the end of a chunk
    for r in range(0, s, rows):
        part = slice(r, min(s, r + rows))
        scores = prefill_indexer_scores(q[part], weights[part], keys, start + r, key_scale=key_scale,
                                        fp8_dot=fp8_dot)
        out[part] = topk_of_indexer_scores(scores, lengths[part], k)
    return out


# ---------------------------------------------------------------------------------------------
# Sparse MLA decode
# ---------------------------------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class DecodeConfig:
    """Tile sizes and launch shape of `_sparse_mla_decode_kernel`."""
    block_h: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("block_h", "block_k"):
            value = getattr(self, name)
            require(value >= 16 and value == triton.next_power_of_2(value),
                    f"{name}={value}: expected a power of 2 >= 16")
        require(self.num_warps in (1, 2, 4, 8, 16), f"num_warps={self.num_warps}: expected 1, 2, 4, 8 or 16")
        require(self.num_stages >= 1, f"num_stages={self.num_stages}: expected >= 1")


def default_decode_config(num_heads: int, d_qk: int, dtype: torch.dtype) -> DecodeConfig:
    """Fixed (never autotuned) so that the same shapes always accumulate in the same order.

    bf16 at the model's shape (128 heads, D 576): 64 heads x 64 rows per step, 8 warps (two warp
    groups), 2 stages: 216 KiB of shared memory, 255 registers, no spills under Triton 3.6 (sm_90a,
    compiled offline; 3.9 spills 216 B), and faster than 32-row tiles (results/notes/attention.md).
    float32 (not a GPU target) gets tiles that do not spill.
    """
    block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    if dtype == torch.float32:
        return DecodeConfig(block_h=min(block_h, 32), block_k=16, num_warps=8, num_stages=2)
    block_k = 64
    num_warps = 8 if block_h * d_qk > 16384 else 4
    return DecodeConfig(block_h=block_h, block_k=block_k, num_warps=num_warps, num_stages=2)


def _smaller_config(config: DecodeConfig) -> DecodeConfig | None:
    """The next configuration to try when one does not fit the GPU's shared memory or registers."""
    if config.block_k > 16:
        return dataclasses.replace(config, block_k=config.block_k // 2)
    if config.block_h > 16:
        return dataclasses.replace(config, block_h=config.block_h // 2)
    return None


def split_plan(batch: int, heads: int, k: int, config: DecodeConfig, device: torch.device,
               num_splits: int | None = None) -> tuple[int, int]:
    """(chunk, splits): split k into `splits` chunks of `chunk` rows (a multiple of block_k).

    By default, split until the grid roughly fills the GPU (one program per SM), keeping at least
    4 tiles per split so the float32 partials stay small next to the rows read; 1 off the GPU.
    """
    if num_splits is None:
        programs = batch * triton.cdiv(heads, config.block_h)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        num_splits = max(1, min(sms // max(1, programs), k // (4 * config.block_k)))
    require(isinstance(num_splits, int) and num_splits >= 1,
            f"num_splits={num_splits!r}: expected an int >= 1")
    chunk = triton.cdiv(triton.cdiv(k, num_splits), config.block_k) * config.block_k
    return chunk, triton.cdiv(k, chunk)


def _check_decode_inputs(q, kv, rows, sm_scale, d_v, out, lse, row_base=None) -> None:
    require(q.dim() == 3, f"q must be [N, H, D], got shape {tuple(q.shape)}")
    n, h, d = q.shape
    require(q.dtype in FLOAT_DTYPES, f"q dtype {q.dtype}: expected one of {FLOAT_DTYPES}")
    require(0 < d_v < d, f"d_v={d_v}: expected 0 < d_v < D={d}")
    for name, size in (("d_v", d_v), ("D - d_v", d - d_v)):
        require(size >= 16 and size == triton.next_power_of_2(size),
                f"{name}={size}: expected a power of 2 >= 16")
    require(kv.dim() == 2 and kv.shape[1] == d, f"kv shape {tuple(kv.shape)}: expected [R, D={d}]")
    require(kv.dtype == q.dtype, f"kv dtype {kv.dtype}: expected {q.dtype} (as q)")
    require(kv.stride(-1) == 1, f"kv needs a contiguous last dim, strides {kv.stride()}")
    check_selection_inputs(q, kv, rows, sm_scale, d_v, out, lse, row_base)


def check_selection_inputs(q, kv, rows, sm_scale, d_v, out, lse, row_base) -> None:
    """The checks every sparse MLA decode shares, whatever its rows' format: q [N, H, D], rows int32
    [N, k >= 1], contiguous last dims, a positive finite scale, row_base int64 [N], one device, and
    out [N, H, d_v] / lse [N, H] if given (`hisparse.dsa.fp8` checks its FP8 rows, then these)."""
    n, h, _ = q.shape
    require(rows.dim() == 2 and rows.shape[0] == n and rows.dtype == torch.int32,
            f"rows must be int32 [N={n}, k], got {rows.dtype} {tuple(rows.shape)}")
    require(rows.shape[1] >= 1, "rows must select at least one entry per request (k >= 1)")
    require(q.stride(-1) == 1 and rows.stride(-1) == 1,
            f"q and rows need a contiguous last dim, strides {q.stride()} and {rows.stride()}")
    require(isinstance(sm_scale, float) and sm_scale > 0 and sm_scale != float("inf"),
            f"sm_scale={sm_scale!r}: expected a positive finite float")
    if row_base is not None:
        require(row_base.shape == (n,) and row_base.dtype == torch.int64 and row_base.stride(0) == 1,
                f"row_base must be a contiguous int64 [N={n}], got {row_base.dtype} {tuple(row_base.shape)} "
                f"stride {row_base.stride()}")
    for name, t in (("kv", kv), ("rows", rows), ("out", out), ("lse", lse), ("row_base", row_base)):
        if t is not None:
            require(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
    if out is not None:
        require(out.shape == (n, h, d_v) and out.dtype == q.dtype and out.stride(-1) == 1,
                f"out {out.dtype} {tuple(out.shape)}: expected {q.dtype} {(n, h, d_v)}, contiguous last dim")
    if lse is not None:
        require(lse.shape == (n, h) and lse.dtype == torch.float32,
                f"lse {lse.dtype} {tuple(lse.shape)}: expected float32 {(n, h)}")


_FITTED_CONFIGS: dict[tuple, DecodeConfig] = {}  # default configs that had to shrink to launch

# Which decode kernel `sparse_mla_decode` runs: "gluon" (Hopper only, and the faster there:
# results/attention.csv), "triton" (everywhere), or "auto": Gluon where `gluon_decode_unsupported`
# finds nothing against it, else Triton.
DECODE_BACKENDS = ("auto", "triton", "gluon")


# The Gluon kernel's tiles, as `split_plan` takes them (64 heads x 64 rows a program, 8 warps, 2 stages)
GLUON_TILES = DecodeConfig(block_h=dsa_gluon.BLOCK_H, block_k=dsa_gluon.BLOCK_K, num_warps=dsa_gluon.NUM_WARPS,
                           num_stages=dsa_gluon.NUM_STAGES)


def gluon_platform_unsupported(q: torch.Tensor, import_error: Exception | None) -> str | None:
    """Why no Gluon decode kernel (bf16 or FP8 rows) can run here for q, or None: each needs its module
    imported (`import_error` None), q on an sm_90 GPU and Triton 3.6, whose Gluon API they are written in."""
    if import_error is not None:
        return f"Triton {triton.__version__} has no usable Gluon ({import_error})"
    if not q.is_cuda:
        return f"q is on {q.device}, not a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"it needs an sm_90 (Hopper) GPU, this one is sm_{major}{minor}"
    if triton.__version__.split(".")[:2] != ["3", "6"]:
        return f"it is written against Triton 3.6's Gluon, this is {triton.__version__}"
    return None


def gluon_decode_unsupported(q: torch.Tensor, d_v: int) -> str | None:
    """Why the Gluon decode kernel cannot run q [N, H, D] with d_v value columns, or None if it can."""
    reason = gluon_platform_unsupported(q, dsa_gluon.GLUON_IMPORT_ERROR)
    if reason is not None:
        return reason
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q dtype {q.dtype}: it takes bf16 or fp16"
    if (d_v, q.shape[2] - d_v) != (512, 64):
        return f"rows of {d_v} + {q.shape[2] - d_v}: it takes 512 + 64 (MLA's latent and rope)"
    if q.shape[1] < dsa_gluon.BLOCK_H:
        return f"{q.shape[1]} heads: it runs {dsa_gluon.BLOCK_H} a program, so needs at least that many"
    return None


def decode_backend(q: torch.Tensor, d_v: int, backend: str = "auto", config: DecodeConfig | None = None) -> str:
    """The kernel `sparse_mla_decode` runs for these arguments: "gluon" or "triton" (resolving
    "auto"). Raises when "gluon" is asked for and cannot run."""
    require(backend in DECODE_BACKENDS, f"backend={backend!r}: expected one of {DECODE_BACKENDS}")
    if backend == "triton" or (backend == "auto" and config is not None):
        return "triton"
    reason = gluon_decode_unsupported(q, d_v)
    if backend == "gluon":
        require(config is None, f"config={config} is the Triton kernel's: the Gluon one takes none")
        require(reason is None, f"backend='gluon': the Gluon decode kernel cannot run this: {reason}")
    return "gluon" if reason is None else "triton"


def sparse_mla_decode(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, sm_scale: float, d_v: int = 512,
                      num_splits: int | None = None, config: DecodeConfig | None = None,
                      out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                      row_base: torch.Tensor | None = None, backend: str = "auto"):
    """Absorbed-MLA decode over selected rows: returns out [N, H, d_v] (q's dtype), lse [N, H] float32.

    q [N, H, D]; kv [R, D] (the hot cache or the resident pool viewed as rows; V = kv[:, :d_v]);
    rows [N, k] int32, read in order (-1 skipped), each naming row row_base[n] + rows[n, j] of kv
    (row_base [N] int64, default 0: a request's slot list or token ids index its own region
    directly); not range-checked, that would sync.
    A request with no valid row gets zeros and lse -inf. The k axis is split into `num_splits`
    chunks (default: `split_plan`) merged in order by a combine kernel. Equal inputs in equal order
    give bitwise-equal outputs whatever R and wherever the rows sit in kv (for one backend: the Gluon
    and Triton kernels accumulate in different orders). `backend` picks the kernel (`decode_backend`;
    default "auto"). Without `config`, the Triton kernel uses its default one; should
    it not fit this GPU, smaller tiles are tried and the one that launches is kept for the rest of
    the process (so results stay reproducible within a run).
    """
    _check_decode_inputs(q, kv, rows, sm_scale, d_v, out, lse, row_base)
    kernel = decode_backend(q, d_v, backend, config)
    n, h, d = q.shape
    out = out if out is not None else torch.empty((n, h, d_v), dtype=q.dtype, device=q.device)
    lse = lse if lse is not None else torch.empty((n, h), dtype=torch.float32, device=q.device)
    if n == 0 or h == 0:
        return out, lse
    if kernel == "gluon":
        launch_gluon_decode(q, kv, rows, row_base, out, lse, sm_scale, num_splits)
        return out, lse
    if config is not None:
        _launch_decode(q, kv, rows, row_base, out, lse, sm_scale, config, num_splits)
        return out, lse
    launch_fitted("sparse_mla_decode", (h, d, d_v, q.dtype, q.device), default_decode_config(h, d, q.dtype),
                  lambda cfg: _launch_decode(q, kv, rows, row_base, out, lse, sm_scale, cfg, num_splits))
    return out, lse


def launch_fitted(name: str, key: tuple, default: DecodeConfig, launch) -> None:
    """launch(config) with the config that fitted this key before, else `default`, shrunk
    (`_smaller_config`, with a warning) until the GPU has the resources for it; remembered per key."""
    cfg = _FITTED_CONFIGS.get(key) or default
    while True:
        try:
            launch(cfg)
            break
        except triton.runtime.errors.OutOfResources as exc:
            smaller = _smaller_config(cfg)
            if smaller is None:
                raise
            warnings.warn(f"{name}: {cfg} does not fit this GPU ({exc}); trying {smaller}")
            cfg = smaller
    _FITTED_CONFIGS[key] = cfg


def _launch_decode(q, kv, rows, row_base, out, lse, sm_scale: float, cfg: DecodeConfig,
                   num_splits: int | None) -> None:
    n, h, d = q.shape
    d_v = out.shape[2]
    k = rows.shape[1]
    chunk, splits = split_plan(n, h, k, cfg, q.device, num_splits)
    part, part_lse, split_strides = split_buffers(out, lse, splits)
    _sparse_mla_decode_kernel[(triton.cdiv(h, cfg.block_h), n, splits)](
        q, kv, rows, rows if row_base is None else row_base, part, part_lse,
        q.stride(0), q.stride(1), kv.stride(0), rows.stride(0), part.stride(0), part.stride(1),
        split_strides[0], part_lse.stride(0), part_lse.stride(1), split_strides[1],
        h, k, chunk, sm_scale * 1.4426950408889634,
        D_V=d_v, D_ROPE=d - d_v, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k,
        DOT_PRECISION=dot_precision(q.dtype), HAS_ROW_BASE=row_base is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        combine_splits(part, part_lse, out, lse)


def split_buffers(out: torch.Tensor, lse: torch.Tensor, splits: int):
    """Where a decode kernel writes: out [N, H, D_V] and lse [N, H] themselves for one split, else
    float32 partials [N, H, splits, D_V] and [N, H, splits] for `combine_splits`; with the split
    strides the kernel takes (0 for one split)."""
    if splits == 1:
        return out, lse, (0, 0)
    n, h, d_v = out.shape
    part = torch.empty((n, h, splits, d_v), dtype=torch.float32, device=out.device)
    part_lse = torch.empty((n, h, splits), dtype=torch.float32, device=out.device)
    return part, part_lse, (part.stride(2), part_lse.stride(2))


def combine_splits(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge a decode kernel's per-split partials into out and lse, in split order."""
    n, h, splits, d_v = part.shape
    _sparse_mla_combine_kernel[(n, h)](
        part, part_lse, out, lse,
        part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
        part_lse.stride(2), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        splits,
        D_V=d_v, BLOCK_S=triton.next_power_of_2(splits),
        num_warps=4,
    )


def sparse_mla_decode_gluon(q, kv, rows, sm_scale: float, row_base=None, d_v: int = 512, num_splits: int = 1,
                            out=None, lse=None, block_k: int = BLOCK_K, num_stages: int = NUM_STAGES):
    """`hisparse.dsa.ops.sparse_mla_decode` through the Gluon kernel alone (Hopper, bf16/fp16, 64 heads a
    program, block_k rows a tile, a ring of num_stages tiles): returns out [N, H, d_v] (q's dtype),
    lse [N, H] float32. Same argument conventions:
    q [N, H, D], kv [R, D] (V = kv[:, :d_v]), rows [N, k] int32 (-1 skipped), row_base [N] int64 or
    None. num_splits > 1 splits k into chunks merged by the Triton combine kernel (default 1: one
    program per (head block, request) reads all k rows). For other tile shapes than the default
    (`sparse_mla_decode` runs only that one) and for tests."""
    _check_decode_inputs(q, kv, rows, sm_scale, d_v, out, lse, row_base)
    reason = gluon_decode_unsupported(q, d_v)
    require(reason is None, f"the Gluon decode kernel cannot run this: {reason}")
    require(isinstance(num_splits, int) and num_splits >= 1, f"num_splits={num_splits!r}: expected an int >= 1")
    require(block_k in (32, 64, 128) and num_stages >= 2,
            f"block_k={block_k}, num_stages={num_stages}: expected block_k 32, 64 or 128 and num_stages >= 2")
    n, h, _ = q.shape
    out = out if out is not None else torch.empty((n, h, d_v), dtype=q.dtype, device=q.device)
    lse = lse if lse is not None else torch.empty((n, h), dtype=torch.float32, device=q.device)
    if n > 0 and h > 0:
        launch_gluon_decode(q, kv, rows, row_base, out, lse, sm_scale, num_splits, block_k, num_stages)
    return out, lse


def launch_gluon_decode(q, kv, rows, row_base, out, lse, sm_scale: float, num_splits: int | None,
                        block_k: int = BLOCK_K, num_stages: int = NUM_STAGES) -> None:
    """The launch alone, into out / lse, for inputs already checked (`sparse_mla_decode` and the
    launcher above): k split by `split_plan` (into num_splits chunks; None: its default)."""
    n, h, d = q.shape
    d_v = out.shape[2]
    k = rows.shape[1]
    tiles = DecodeConfig(block_h=BLOCK_H, block_k=block_k, num_warps=NUM_WARPS, num_stages=num_stages)
    chunk, splits = split_plan(n, h, k, tiles, q.device, num_splits)
    part, part_lse, split_strides = split_buffers(out, lse, splits)
    _sparse_mla_decode_gluon_kernel[(triton.cdiv(h, BLOCK_H), n, splits)](
        q, kv, rows, rows if row_base is None else row_base, part, part_lse,
        q.stride(0), q.stride(1), kv.stride(0), rows.stride(0), part.stride(0), part.stride(1),
        split_strides[0], part_lse.stride(0), part_lse.stride(1), split_strides[1],
        h, k, chunk, sm_scale * 1.4426950408889634,
        D_V=d_v, D_ROPE=d - d_v, BLOCK_H=BLOCK_H, BLOCK_K=block_k, HAS_ROW_BASE=row_base is not None,
        NUM_STAGES=num_stages, num_warps=NUM_WARPS,
    )
    if splits > 1:
        combine_splits(part, part_lse, out, lse)

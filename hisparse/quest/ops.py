"""Quest for HiSparse: page min/max metadata, page scores, top-page selection, attention over pages.

Each operation's launcher is here, its kernel in `kernels_triton/quest.py` and its plain-torch
reference (`*_ref`) in `hisparse/quest/reference.py`. Semantics follow the Quest paper (DESIGN section 5).

Layouts (PAGE = 16 tokens, D = head dim, HKV KV heads, HQ = GROUP * HKV query heads; query head
`hq` reads KV head `hq // GROUP`, as Hugging Face's `repeat_kv`):
- tokens: token t of a request lives in page t // PAGE at offset t % PAGE; `lengths [N]` (int32)
  counts the request's tokens, the newest included, at most P_MAX * PAGE (not checked: that would
  need a host sync). Length 0 marks a padded batch row: it selects nothing and its sparse-attention
  output is zero.
- metadata: `kmin, kmax [N, HKV, P_MAX, D]`, the element-wise min and max of the post-RoPE keys of each
  page, in the keys' dtype (min and max are exact in any dtype). Only pages below
  ceil(length / PAGE) are meaningful; the last one may be partial and is updated on every append.
- row: one per (page, KV head), `[2, PAGE, D]`: the page's PAGE keys, then its PAGE values. A row
  buffer `kv` is `[R, 2, PAGE, D]` or `[R, 2 * PAGE * D]`. Resident pool (one layer, one stream per
  (request, KV head)): row = (n * HKV + h) * P_MAX + page. Hot cache: row = stream * (B + 1) + slot.
  Token slots of a row past the request's length are never read.
- selection: `pages [N, HKV, K]` int32 (K = budget_tokens // PAGE), in ascending page order, -1
  padding at the end; `rows [N, HKV, K]` int32 aligned with it (-1 = skip).

Choices:
- Score: bound_i = sum_d max(q_id * kmax_d, q_id * kmin_d) per query head i (an upper bound of q_i . k
  for every key of the page). With GQA the score of a page for a KV head is the MAX of the bounds over
  the group's query heads: a page is worth reading if any head of the group may attend strongly to it
  (a sum would let one large-norm head outvote the others). So the selection is per KV head.
- Selection: the current (last, possibly partial) page always, plus the K - 1 best-scored other pages;
  ties go to the lower page index; requests with at most K pages select all of them. The output is in
  page order (the kernel needs no sort, and rows are read in address order).
- Attention reads the selected rows in the given order, in fixed splits whose count depends only on
  shapes, so hot-cache and resident runs over the same selection are bitwise equal (DESIGN section 6).
- Dense layers: the first DENSE_LAYERS layers attend over the whole context with `dense_attention`
  (torch SDPA over resident `k, v [N, HKV, T, D]`); only later layers use pages and selection.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton

from kernels_triton.quest import (
    _quest_attention_combine_kernel,
    _quest_attention_split_kernel,
    _quest_metadata_append_kernel,
    _quest_page_scores_kernel,
    _quest_select_pages_kernel,
)

PAGE = 16
DENSE_LAYERS = 2
MAX_SELECT_PAGES = 16384  # 256K tokens; the selection holds all of a request's scores in registers
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_dense_layer(layer: int) -> bool:
    """Quest leaves the first DENSE_LAYERS layers dense (their selections are close to random)."""
    return layer < DENSE_LAYERS


def _expect(t: torch.Tensor, name: str, shape: tuple, dtypes: tuple, device: torch.device | None = None):
    """Raise ValueError unless `t` has `shape` (None = any size), one of `dtypes`, and `device`."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != ts for s, ts in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} has shape {list(t.shape)}, expected {want}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (where the other inputs are)")


def _expect_inner_contiguous(t: torch.Tensor, name: str):
    """The last dim has stride 1 (rows and heads may be strided)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dim, got strides {t.stride()}")


def _group(hq: int, hkv: int) -> int:
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"query heads {hq} must be a positive multiple of KV heads {hkv}")
    return hq // hkv


# ---------------------------------------------------------------- metadata

def quest_metadata_from_keys(keys: torch.Tensor, lengths: torch.Tensor, max_pages: int):
    """Prefill: `kmin, kmax [N, HKV, max_pages, D]` from `keys [N, HKV, T, D]` (torch op).

    Tokens at or past `lengths[n]` are ignored; pages without tokens are zero.
    """
    _expect(keys, "keys", (None, None, None, None), FLOAT_DTYPES)
    n, hkv, t, d = keys.shape
    _expect(lengths, "lengths", (n,), (torch.int32,), keys.device)
    if max_pages * PAGE < t:
        raise ValueError(f"max_pages {max_pages} holds {max_pages * PAGE} tokens, keys have {t}")
    padded = F.pad(keys, (0, 0, 0, max_pages * PAGE - t)).view(n, hkv, max_pages, PAGE, d)
    pos = torch.arange(max_pages * PAGE, device=keys.device).view(max_pages, PAGE)
    valid = (pos < lengths.view(n, 1, 1).long()).view(n, 1, max_pages, PAGE, 1)
    kmin = padded.masked_fill(~valid, float("inf")).amin(dim=3)
    kmax = padded.masked_fill(~valid, float("-inf")).amax(dim=3)
    has_tokens = valid.any(dim=3)
    return kmin.where(has_tokens, 0), kmax.where(has_tokens, 0)


def check_append(kmin, kmax, key, positions):
    _expect(kmin, "kmin", (None, None, None, None), FLOAT_DTYPES)
    n, hkv, max_pages, d = kmin.shape
    _expect(kmax, "kmax", tuple(kmin.shape), (kmin.dtype,), kmin.device)
    if kmax.stride() != kmin.stride():
        raise ValueError(f"kmax strides {kmax.stride()} differ from kmin strides {kmin.stride()}")
    _expect(key, "key", (n, hkv, d), (kmin.dtype,), kmin.device)
    _expect(positions, "positions", (n,), (torch.int32,), kmin.device)
    for t, name in ((kmin, "kmin"), (key, "key")):
        _expect_inner_contiguous(t, name)


def quest_metadata_append(kmin: torch.Tensor, kmax: torch.Tensor, key: torch.Tensor,
                          positions: torch.Tensor) -> None:
    """Fold the new token's key `key [N, HKV, D]` at `positions [N]` (int32, -1 = skip) into the metadata,
    in place. A position opening a page (position % PAGE == 0) resets that page's min and max.
    Positions past the metadata's P_MAX pages are skipped (checking them would need a host sync)."""
    check_append(kmin, kmax, key, positions)
    n, hkv, _, d = kmin.shape
    _quest_metadata_append_kernel[(n, hkv)](
        kmin, kmax, key, positions,
        kmin.stride(0), kmin.stride(1), kmin.stride(2), key.stride(0), key.stride(1),
        kmin.shape[2],
        D=d, BLOCK_D=triton.next_power_of_2(d), PAGE=PAGE,
    )


# ---------------------------------------------------------------- page scores

def check_scores(q, kmin, kmax, lengths):
    _expect(q, "q", (None, None, None), FLOAT_DTYPES)
    n, hq, d = q.shape
    _expect(kmin, "kmin", (n, None, None, d), (q.dtype,), q.device)
    _expect(kmax, "kmax", tuple(kmin.shape), (q.dtype,), q.device)
    if kmax.stride() != kmin.stride():
        raise ValueError(f"kmax strides {kmax.stride()} differ from kmin strides {kmin.stride()}")
    _expect(lengths, "lengths", (n,), (torch.int32,), q.device)
    for t, name in ((q, "q"), (kmin, "kmin")):
        _expect_inner_contiguous(t, name)
    return _group(hq, kmin.shape[1])


def quest_page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                      lengths: torch.Tensor) -> torch.Tensor:
    """Page scores `[N, HKV, P_MAX]` float32 for queries `q [N, HQ, D]`; -inf past each request's pages."""
    group = check_scores(q, kmin, kmax, lengths)
    n, hkv, max_pages, d = kmin.shape
    out = torch.empty(n, hkv, max_pages, device=q.device, dtype=torch.float32)
    block_d = triton.next_power_of_2(d)
    block_p = min(triton.next_power_of_2(max_pages), max(1, 2048 // block_d))  # 16 x 128: 92 registers on sm_90
    _quest_page_scores_kernel[(n, hkv, triton.cdiv(max_pages, block_p))](
        q, kmin, kmax, lengths, out,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2),
        out.stride(0), out.stride(1),
        max_pages,
        GROUP=group, D=d, BLOCK_D=block_d, BLOCK_P=block_p, PAGE=PAGE,
        num_warps=4,
    )
    return out


# ---------------------------------------------------------------- selection

def check_select(scores, lengths, budget_tokens):
    _expect(scores, "scores", (None, None, None), (torch.float32,))
    _expect(lengths, "lengths", (scores.shape[0],), (torch.int32,), scores.device)
    _expect_inner_contiguous(scores, "scores")
    if budget_tokens < PAGE:
        raise ValueError(f"budget_tokens {budget_tokens} is under one page ({PAGE} tokens)")
    return budget_tokens // PAGE


def quest_select_pages(scores: torch.Tensor, lengths: torch.Tensor, budget_tokens: int) -> torch.Tensor:
    """Selected pages `[N, HKV, budget_tokens // PAGE]` int32 from `scores [N, HKV, P_MAX]` (see module
    doc; scores must not be NaN)."""
    k = check_select(scores, lengths, budget_tokens)
    n, hkv, max_pages = scores.shape
    if max_pages > MAX_SELECT_PAGES:
        raise ValueError(f"scores has {max_pages} pages, the selection kernel holds at most {MAX_SELECT_PAGES}")
    out = torch.empty(n, hkv, k, device=scores.device, dtype=torch.int32)
    block_p = triton.next_power_of_2(max_pages)
    _quest_select_pages_kernel[(n, hkv)](
        scores, lengths, out,
        scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
        max_pages,
        K=k, BLOCK_K=triton.next_power_of_2(k), BLOCK_P=block_p, PAGE=PAGE,
        num_warps=min(16, max(4, block_p // 512)),
    )
    return out


def quest_select(q, kmin, kmax, lengths, budget_tokens: int) -> torch.Tensor:
    """Scores then selection: the pages `[N, HKV, K]` each KV head reads this step."""
    return quest_select_pages(quest_page_scores(q, kmin, kmax, lengths), lengths, budget_tokens)


# ---------------------------------------------------------------- rows and pools

def resident_rows(pages: torch.Tensor, max_pages: int) -> torch.Tensor:
    """Rows of the resident pool `[N * HKV * max_pages, 2, PAGE, D]` for `pages [N, HKV, K]`; -1 stays."""
    _expect(pages, "pages", (None, None, None), (torch.int32,))
    n, hkv, _ = pages.shape
    stream = torch.arange(n * hkv, device=pages.device, dtype=torch.int64).view(n, hkv, 1)
    rows = stream * max_pages + pages.long()
    return torch.where(pages >= 0, rows, -1).to(torch.int32)


def pages_from_tokens(k: torch.Tensor, v: torch.Tensor, max_pages: int) -> torch.Tensor:
    """Resident pool `[N * HKV * max_pages, 2, PAGE, D]` from token-level `k, v [N, HKV, T, D]` (zero padded)."""
    _expect(k, "k", (None, None, None, None), FLOAT_DTYPES)
    n, hkv, t, d = k.shape
    _expect(v, "v", tuple(k.shape), (k.dtype,), k.device)
    if max_pages * PAGE < t:
        raise ValueError(f"max_pages {max_pages} holds {max_pages * PAGE} tokens, k has {t}")
    pad = (0, 0, 0, max_pages * PAGE - t)
    kp = F.pad(k, pad).view(n, hkv, max_pages, 1, PAGE, d)
    vp = F.pad(v, pad).view(n, hkv, max_pages, 1, PAGE, d)
    return torch.cat([kp, vp], dim=3).reshape(n * hkv * max_pages, 2, PAGE, d)


# ---------------------------------------------------------------- attention over pages

def check_attention(q, kv, rows, pages, lengths):
    _expect(q, "q", (None, None, None), FLOAT_DTYPES)
    n, hq, d = q.shape
    if kv.dim() == 2:
        if kv.shape[1] != 2 * PAGE * d:
            raise ValueError(f"kv rows hold {kv.shape[1]} elements, expected 2 * {PAGE} * {d}")
        if kv.stride(1) != 1:
            raise ValueError(f"kv rows must be contiguous, got strides {kv.stride()}")
        kv = kv.view(kv.shape[0], 2, PAGE, d)
    _expect(kv, "kv", (None, 2, PAGE, d), (q.dtype,), q.device)
    if kv.stride()[1:] != (PAGE * d, d, 1):
        raise ValueError(f"each kv row must be a contiguous [2, {PAGE}, {d}], got strides {kv.stride()}")
    _expect(rows, "rows", (n, None, None), (torch.int32,), q.device)
    _expect(pages, "pages", tuple(rows.shape), (torch.int32,), q.device)
    _expect(lengths, "lengths", (n,), (torch.int32,), q.device)
    for t, name in ((q, "q"), (rows, "rows"), (pages, "pages")):
        _expect_inner_contiguous(t, name)
    return kv, _group(hq, rows.shape[1])


def split_plan(n_streams: int, n_pages: int, device: torch.device, pages_per_iter: int = 2,
               splits: int | None = None) -> tuple[int, int]:
    """(splits, pages per split) of each page list. By default about four programs per SM run (one
    split on the CPU). It depends only on shapes and the device, so hot-cache and resident runs over
    the same selection split the same way."""
    if pages_per_iter < 1 or pages_per_iter & (pages_per_iter - 1):
        raise ValueError(f"pages_per_iter {pages_per_iter} must be a power of two")
    n_iters = max(1, triton.cdiv(n_pages, pages_per_iter))
    if splits is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        splits = max(1, min(n_iters, triton.cdiv(4 * sms, n_streams)))
    if not 1 <= splits <= n_iters:
        raise ValueError(f"splits {splits} must be in [1, {n_iters}] for {n_pages} pages, {pages_per_iter} per step")
    pages_per_split = triton.cdiv(n_iters, splits) * pages_per_iter
    return triton.cdiv(max(n_pages, 1), pages_per_split), pages_per_split


def quest_attention(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor,
                    lengths: torch.Tensor, scale: float | None = None, splits: int | None = None,
                    pages_per_iter: int = 2, num_warps: int = 4) -> torch.Tensor:
    """Decode attention `[N, HQ, D]` of `q [N, HQ, D]` over the selected pages.

    `rows [N, HKV, K]` index `kv` (row buffer, see module doc), `pages` are the page ids (positions
    past `lengths` are masked). `splits` (default: by SM count) cuts each page list into runs
    combined in a fixed order; any value gives the same result up to rounding. `pages_per_iter`
    pages are read per loop step by `num_warps` warps (tuning knobs: `bench_attention_quest --tune`;
    at D = 128 two pages per step need 138 registers on sm_90, four need 228, which halves occupancy).
    """
    kv, group = check_attention(q, kv, rows, pages, lengths)
    n, hq, d = q.shape
    hkv, k = rows.shape[1], rows.shape[2]
    splits, pages_per_split = split_plan(n * hkv, k, q.device, pages_per_iter, splits)
    scale = d ** -0.5 if scale is None else scale
    part_acc = torch.empty(n, hq, splits, d, device=q.device, dtype=torch.float32)
    part_max = torch.empty(n, hq, splits, device=q.device, dtype=torch.float32)
    part_sum = torch.empty(n, hq, splits, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    block_d = triton.next_power_of_2(d)
    _quest_attention_split_kernel[(n, hkv, splits)](
        q, kv, rows, pages, lengths, part_acc, part_max, part_sum,
        q.stride(0), q.stride(1), kv.stride(0), rows.stride(0), rows.stride(1),
        pages.stride(0), pages.stride(1),
        k, pages_per_split, splits, scale * math.log2(math.e),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=d, BLOCK_D=block_d,
        PAGE=PAGE, PAGES_PER_ITER=pages_per_iter, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=2,
    )
    _quest_attention_combine_kernel[(n, hq)](
        part_acc, part_max, part_sum, out,
        out.stride(0), out.stride(1), splits,
        D=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits),
    )
    return out


# ---------------------------------------------------------------- dense layers

def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """Dense decode attention `[N, HQ, D]` over resident `k, v [N, HKV, T, D]` (torch SDPA).

    The GROUP query heads of a KV head go in as GROUP query positions of one non-causal attention,
    which is exactly GQA decode without copying K or V. `lengths` (>= 1) masks positions past each
    request; None means all T positions are valid (and lets SDPA pick its fastest backend).
    """
    _expect(q, "q", (None, None, None), FLOAT_DTYPES)
    n, hq, d = q.shape
    _expect(k, "k", (n, None, None, d), (q.dtype,), q.device)
    _expect(v, "v", tuple(k.shape), (q.dtype,), q.device)
    group = _group(hq, k.shape[1])
    mask = None
    if lengths is not None:
        _expect(lengths, "lengths", (n,), (torch.int32,), q.device)
        mask = (torch.arange(k.shape[2], device=q.device) < lengths.view(n, 1)).view(n, 1, 1, -1)
    out = F.scaled_dot_product_attention(q.reshape(n, k.shape[1], group, d), k, v, attn_mask=mask, scale=scale)
    return out.reshape(n, hq, d)



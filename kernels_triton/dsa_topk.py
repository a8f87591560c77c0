"""Exact top-k of float32 score rows by radix select: DSA prefill's selection without torch.topk.

`radix_topk(scores, lengths, k)` returns, per row n, the k best of its first lengths[n] scores, best
first, equal scores (+0.0 == -0.0) to the lower index, -1 padding: exactly
`hisparse.dsa.ops.topk_select`'s selection (and `radix_topk_ref`, the same in plain torch). Unlike the
rest of kernels_triton this file holds its launcher and torch reference beside the kernel (plain torch
and triton; it imports nothing from hisparse).

The algorithm, one program per row (`_radix_topk_kernel`):
1. Each score maps to a uint32 key whose unsigned order is the float order (-0.0 folded into +0.0).
2. Narrowing passes, BITS = 11 bits of the key at a time from the top (11, 11, then the last 10): a
   pass reads the row's valid
   scores, histograms the next digit of the keys that share the prefix resolved so far (tl.histogram,
   2^BITS bins), and picks the bin b holding the `need`-th best (suffix sums): every key above b's
   prefix is in, `need` drops by their count. Passes stop when the bin holding the threshold is taken
   whole, holds at most CAPACITY keys, or the whole 32-bit key is resolved (at most 3 passes).
3. One write pass: keys whose prefix is above the bin are picks; keys in the bin are either taken
   whole, or ranked in index order against an exact threshold (ties to the lower index), or, when the
   bin holds at most CAPACITY keys with bits still unresolved, gathered to a scratch row and sorted in
   registers as unique int64 keys (score order, then 2^32 - 1 - index), of which the best `need` go in.
4. The row's min(k, length) picks are sorted best first in registers (the same int64 keys), -1 after.

What limits speed (H200): bytes read. Each pass reads 4 B per valid score; rows of real scores need
two narrowing passes (the first resolves sign, exponent and 2 mantissa bits, so the threshold's bin
still holds thousands of a 128K row; after 22 bits it holds a few, under CAPACITY) and the write
pass: 3 reads. N = 8192 rows of T = 131072: 3 x 4 B x 2^30 = 12.9 GB, about 2.7 ms at the 4.8 TB/s
spec (3.0 ms at the 4.3 TB/s copies measure); rows whose threshold is shared by more than CAPACITY
equal scores take 4 reads. The histogram is the compute: Triton 3.9 lowers tl.histogram to one
shared-memory atomic add per key (checked in the sm_90 PTX), so 2^11 bins cost no more per key than
2^8 and spread the first pass's keys, which crowd a few exponent bins, over more addresses (fewer
same-address conflicts). The scratch (CAPACITY int64 per row) and the sort of k int64 keys are small
beside the row (512 KB at T = 131072). One program per row: 196 registers a thread at 8 warps (no
spills, sm_90 compile), one program per SM. Not measured on a GPU yet: benchmarks/bench_topk.py times it.
"""
import torch
import triton
import triton.language as tl

BITS = 11               # key bits a narrowing pass resolves (2^BITS histogram bins; the last pass fewer)
CAPACITY = 4096         # a threshold bin of at most this many keys is gathered and sorted in registers


@triton.jit
def _order_key(b_s):
    """float32 -> uint32 whose unsigned order is the float order, -0.0 as +0.0 (NaN-free scores)."""
    b_s = tl.where(b_s == 0.0, 0.0, b_s)
    b_bits = b_s.to(tl.int32, bitcast=True)
    b_bits = b_bits ^ ((b_bits >> 31) & 0x7FFFFFFF)                  # signed int order of the float order
    return b_bits.to(tl.uint32, bitcast=True) ^ 0x80000000            # unsigned order


@triton.jit
def _unique_key(b_key, b_id):
    """int64 keys, unique per row, whose signed order is (score, then lower index first): the key's
    signed form in the high 32 bits, 2^32 - 1 - index in the low ones (as `topk_select` builds them)."""
    b_signed = (b_key ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)
    return (b_signed << 32) | (0xFFFFFFFF - b_id.to(tl.int64))


@triton.jit
def _unpack(b_unique):
    """`_unique_key`'s inverse: (index int32, score float32, -0.0 given back as +0.0)."""
    b_id = (0xFFFFFFFF - (b_unique & 0xFFFFFFFF)).to(tl.int32)
    b_signed = (b_unique >> 32).to(tl.int32)
    b_bits = b_signed ^ ((b_signed >> 31) & 0x7FFFFFFF)             # the order map is its own inverse
    return b_id, b_bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["T", "K"])
def _radix_topk_kernel(
    scores_ptr, len_ptr, ids_ptr, vals_ptr, scratch_ptr,
    stride_sn, stride_in, stride_vn, stride_cn,
    T, K,
    BITS: tl.constexpr, CAPACITY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """ids[n, :K] int32 and vals[n, :K] float32: row n's min(K, lengths[n]) best scores among its first
    lengths[n] (clamped to 0 .. T), best first, equal scores to the lower index; -1 and -inf after.
    scratch [N, CAPACITY] int64 holds the threshold bin's keys when they are gathered."""
    i_n = tl.program_id(0).to(tl.int64)
    p_row = scores_ptr + i_n * stride_sn
    p_ids = ids_ptr + i_n * stride_in
    p_vals = vals_ptr + i_n * stride_vn
    length = tl.minimum(tl.maximum(tl.load(len_ptr + i_n).to(tl.int64), 0), T).to(tl.int32)
    picks = tl.minimum(length, K)
    o_t = tl.arange(0, BLOCK_T)
    o_b = tl.arange(0, 1 << BITS)

    # narrowing: thr holds the threshold key's resolved bits (those set in hi), `need` the picks still
    # to take from the keys with that prefix (count of them). Rows of at most K scores take them all.
    thr = (length * 0).to(tl.uint32)
    hi = thr
    need = picks
    count = length
    shift = length * 0 + 32
    while (shift > 0) & (count > CAPACITY) & (need < count):
        shift = tl.maximum(shift - BITS, 0)       # a short last digit repeats resolved bits: harmless
        b_hist = tl.zeros([1 << BITS], dtype=tl.int32)
        for t0 in range(0, length, BLOCK_T):
            o = t0 + o_t
            m = o < length
            b_key = _order_key(tl.load(p_row + o, mask=m, other=0.0))                    # [BLOCK_T]
            m = m & (((b_key ^ thr) & hi) == 0)
            b_digit = ((b_key >> shift.to(tl.uint32)) & ((1 << BITS) - 1)).to(tl.int32)
            b_hist += tl.histogram(b_digit, 1 << BITS, mask=m)
        b_above = tl.cumsum(b_hist, axis=0, reverse=True)           # [2^BITS] candidates with digit >= b
        b = tl.sum((b_above >= need).to(tl.int32), axis=0) - 1     # the bin of the need-th best
        count = tl.sum(tl.where(o_b == b, b_hist, 0), axis=0)
        need -= tl.sum(tl.where(o_b == b, b_above, 0), axis=0) - count
        thr = thr | (b.to(tl.uint32) << shift.to(tl.uint32))
        hi = hi | ((thr * 0 + ((1 << BITS) - 1)) << shift.to(tl.uint32))

    # write pass: keys above the bin's prefix are in; the bin's keys are ranked in index order (taken
    # whole, or the first `need` of an exact threshold) or, unresolved and small, gathered to scratch
    gather = (need < count) & (shift > 0)
    limit = tl.where(gather, 0, need)                    # of the bin's keys in index order, those taken
    taken = length * 0
    seen = length * 0
    for t0 in range(0, length, BLOCK_T):
        o = t0 + o_t
        m = o < length
        b_s = tl.load(p_row + o, mask=m, other=0.0)
        b_key = _order_key(b_s)
        m_in = m & ((b_key & hi) == thr)
        b_rank = seen + tl.cumsum(m_in.to(tl.int32), axis=0) - 1
        m_take = (m & ((b_key & hi) > thr)) | (m_in & (b_rank < limit))
        b_pos = taken + tl.cumsum(m_take.to(tl.int32), axis=0) - 1
        tl.store(p_ids + b_pos, o, mask=m_take)
        tl.store(p_vals + b_pos, b_s, mask=m_take)
        tl.store(scratch_ptr + i_n * stride_cn + b_rank, _unique_key(b_key, o),
                 mask=m_in & ((o * 0 + gather.to(tl.int32)) != 0))
        taken += tl.sum(m_take.to(tl.int32), axis=0)
        seen += tl.sum(m_in.to(tl.int32), axis=0)
    tl.debug_barrier()                                   # the row's stores, seen by all its threads
    if gather:
        o_c = tl.arange(0, CAPACITY)
        b_cand = tl.load(scratch_ptr + i_n * stride_cn + o_c, mask=o_c < count, other=0)
        b_cand = tl.where(o_c < count, b_cand, tl.full([CAPACITY], -2**63, tl.int64))
        b_id, b_s = _unpack(tl.sort(b_cand, descending=True))             # [CAPACITY] best first
        m_c = o_c < need
        tl.store(p_ids + taken + o_c, b_id, mask=m_c)
        tl.store(p_vals + taken + o_c, b_s, mask=m_c)
        tl.debug_barrier()

    # the picks best first, -1 / -inf after
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < picks
    b_id = tl.load(p_ids + o_k, mask=m_k, other=0)
    b_s = tl.load(p_vals + o_k, mask=m_k, other=0.0)
    b_pick = tl.where(m_k, _unique_key(_order_key(b_s), b_id), tl.full([BLOCK_K], -2**63, tl.int64))
    b_id, b_s = _unpack(tl.sort(b_pick, descending=True))                 # [BLOCK_K] best first
    tl.debug_barrier()                                   # every thread's loads before any store
    tl.store(p_ids + o_k, tl.where(m_k, b_id, -1), mask=o_k < K)
    tl.store(p_vals + o_k, tl.where(m_k, b_s, float("-inf")), mask=o_k < K)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def radix_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, *, bits: int = BITS,
               capacity: int = CAPACITY, block_t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, k] int32, values [N, k] float32): each row's k best scores among its first lengths[n]
    (clamped to 0 .. T), best first, equal scores (+0.0 == -0.0) to the lower index, -1 and -inf after
    the min(k, lengths[n]) picks (values come back from the keys: -0.0 as +0.0); ids equal `hisparse.dsa.ops.topk_select(scores, lengths, k)`.
    scores float32 [N, T] without NaN, contiguous last dim; lengths int32/int64 [N] on its device.
    bits: key bits per narrowing pass (1 .. 12); capacity: the largest threshold bin sorted in
    registers (a power of two); block_t: scores per tile (a power of two; default 4096, capped at T)."""
    _require(isinstance(scores, torch.Tensor) and scores.dim() == 2 and scores.dtype == torch.float32,
             f"scores must be a float32 tensor [N, T], got {getattr(scores, 'dtype', type(scores))} "
             f"{tuple(getattr(scores, 'shape', ()))}")
    _require(scores.shape[1] == 0 or scores.stride(1) == 1,
             f"scores must have a contiguous last dim, got strides {scores.stride()}")
    n, t = scores.shape
    _require(isinstance(lengths, torch.Tensor) and lengths.shape == (n,)
             and lengths.dtype in (torch.int32, torch.int64),
             f"lengths must be int32/int64 of shape {(n,)}, got {getattr(lengths, 'dtype', type(lengths))} "
             f"{tuple(getattr(lengths, 'shape', ()))}")
    _require(lengths.device == scores.device, f"lengths on {lengths.device}, expected scores' device {scores.device}")
    _require(isinstance(k, int) and not isinstance(k, bool) and k >= 1, f"k must be a positive int, got {k!r}")
    _require(t < 2**31 - 1 and k < 2**31 - 1, f"T={t} and k={k} must fit int32 ids")
    _require(isinstance(bits, int) and 1 <= bits <= 12, f"bits must be an int in 1 .. 12, got {bits!r}")
    _require(isinstance(capacity, int) and capacity >= 1 and capacity & (capacity - 1) == 0,
             f"capacity must be a power of two, got {capacity!r}")
    _require(block_t is None or (isinstance(block_t, int) and block_t >= 1 and block_t & (block_t - 1) == 0),
             f"block_t must be a power of two, got {block_t!r}")
    ids = torch.empty((n, k), dtype=torch.int32, device=scores.device)
    values = torch.empty((n, k), dtype=torch.float32, device=scores.device)
    if n == 0:
        return ids, values
    if t == 0:
        return ids.fill_(-1), values.fill_(float("-inf"))
    scratch = torch.empty((n, capacity), dtype=torch.int64, device=scores.device)
    block_t = block_t or min(4096, triton.next_power_of_2(t))
    block_k = triton.next_power_of_2(k)
    _radix_topk_kernel[(n,)](
        scores, lengths, ids, values, scratch,
        scores.stride(0), ids.stride(0), values.stride(0), scratch.stride(0), t, k,
        BITS=bits, CAPACITY=capacity, BLOCK_T=block_t, BLOCK_K=block_k,
        num_warps=8 if max(block_t, block_k, capacity) >= 2048 else 4,
    )
    return ids, values


def radix_topk_ref(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`radix_topk` in plain torch: a stable descending sort of each row's valid scores (-0.0 as +0.0,
    so equal scores keep index order), the first k and their scores (-0.0 as +0.0), -1 and -inf after."""
    n, t = scores.shape
    valid = torch.arange(t, device=scores.device)[None, :] < lengths[:, None]
    ranked = scores.masked_fill(~valid, float("-inf")).masked_fill(scores == 0, 0.0)
    order = ranked.sort(dim=1, descending=True, stable=True).indices[:, :k]             # [N, min(k, T)]
    keep = order < lengths[:, None]
    ids = torch.full((n, k), -1, dtype=torch.int32, device=scores.device)
    values = torch.full((n, k), float("-inf"), dtype=torch.float32, device=scores.device)
    ids[:, :order.shape[1]] = torch.where(keep, order, -1).to(torch.int32)
    values[:, :order.shape[1]] = torch.where(keep, ranked.gather(1, order), float("-inf"))
    return ids, values

"""Sampling: the Gumbel-max pick over a sorted row's kept prefix (top_k, top_p, min_p), one program a row.

The row's values arrive sorted, largest first, with their vocabulary ids. What top_k, top_p and min_p
keep is a prefix of that order, so the program walks it a block at a time and stops at the first block
not wholly kept: the noise (a counter-based integer hash of the id under the row's keys) is made only
for the prefix, in registers, where torch would hash and write the whole [rows, V]. Its torch
reference is `hisparse.sampling.sample_tokens_ref`.
"""
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    """lowbias32 over uint64 lanes holding 32-bit values (products kept below 2**64, then masked)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _gumbel_pick_kernel(values, ids, row_key, other_key, temperature, top_p, top_k, min_p, out, V,
                        stride_v, stride_i, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    if tl.load(temperature + r) == 0.0:                # greedy rows take their argmax elsewhere
        tl.store(out + r, -1)
        return
    row_v, row_i = values + r * stride_v, ids + r * stride_i
    top = tl.load(row_v).to(tl.float32)
    total = tl.zeros([BLOCK], tl.float32)              # the softmax's normaliser, over the whole row
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        total += tl.exp(tl.load(row_v + offs, mask=offs < V, other=-float("inf")).to(tl.float32) - top)
    total_s = tl.sum(total, 0)
    p_cut, min_ratio = tl.load(top_p + r), tl.load(min_p + r)
    p_cut = tl.where(p_cut >= 1.0, float("inf"), p_cut)          # top_p 1: no cut (rounding could reach 1)
    k = tl.load(top_k + r).to(tl.int32)
    limit = tl.where(k > 0, tl.minimum(k, V), V)
    key = tl.load(row_key + r).to(tl.uint64)
    other = tl.load(other_key + r).to(tl.uint64)
    best = -float("inf")
    best_pos = 0
    carry = 0.0                                        # the mass of the positions before this block
    start = 0
    while start < limit:
        offs = start + tl.arange(0, BLOCK)
        inside = offs < limit
        v = tl.load(row_v + offs, mask=inside, other=-float("inf")).to(tl.float32)
        rel = tl.exp(v - top)
        p = rel / total_s
        ahead = carry + tl.cumsum(p, 0) - p
        keep = inside & (ahead < p_cut) & (rel >= min_ratio)
        vocab = tl.load(row_i + offs, mask=keep, other=0).to(tl.uint64)
        h = _mix32(((_mix32(vocab ^ key) + other) & 0xFFFFFFFF))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(keep, v - tl.log(-tl.log(u)), -float("inf"))
        block_best = tl.max(score, 0)
        block_pos = tl.min(tl.where(score == block_best, offs, V), 0)    # the first of equals, as argmax
        better = block_best > best
        best_pos = tl.where(better, block_pos, best_pos)
        best = tl.maximum(best, block_best)
        carry += tl.sum(p, 0)
        start = tl.where(tl.sum(keep.to(tl.int32), 0) == BLOCK, start + BLOCK, limit)   # a cut: stop
    tl.store(out + r, tl.load(row_i + best_pos))

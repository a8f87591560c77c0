"""Sampling without a sort: the kept set of a row is {z >= t} for one threshold t, found by bisection.

Four launches over z, the tempered row (float32 [R, V]); the row-wide passes split a row in chunks
of CHUNK ids (grid [R, chunks]) so that a batch of 64 rows fills the GPU:

- `_prepare_kernel` (per chunk): z = (logits + bias - presence * (count > 0) - frequency * count)
  / T (bias and penalties loaded only for the rows flagged `adjusted`; T 0 divides by 1), written
  out, with the chunk's max, the first id of that max, and its min.
- `_threshold_kernel` (per row): the row's max, min and greedy token from the chunks' partials, then
  t = max(t_k, t_p, t_min): t_min = max + log(min_p); t_k the largest float with at least top_k ids
  at or above it; t_p the largest float whose ids at or above it hold at least top_p of the softmax
  mass (sum of exp(z - max), in float32). t_k and t_p are bisected over the float's order-preserving
  integer key (at most 32 passes over the row, both searches in the same passes); a row with no
  top_k and top_p 1 makes no pass.
- `_pick_kernel` (per chunk): the Gumbel-max over {z >= t}: z + Gumbel noise from a counter-based
  integer hash of the id under the row's two keys (from its seed and token index); equal scores go to the lowest id.
- `_pick_reduce_kernel` (per row): the chunks' best, the lowest id among equals; greedy rows
  (T 0) take the argmax instead.

Ids tied with the threshold are kept (a sort's prefix could cut inside a tie group). The torch
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
def _key_of(x):
    """The int64 key of float32 x: keys order as the floats do (-0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _float_of(key):
    """The float32 whose `_key_of` is key (an int64 in int32's range)."""
    bits = key.to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _prepare_kernel(logits, bias, counts, presence, frequency, adjusted, temperature, z, part_max, part_arg,
                    part_min, V, stride_l, stride_b, stride_c, stride_z, CHUNKS, CHUNK: tl.constexpr):
    r, c = tl.program_id(0), tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)                            # [CHUNK] ids
    inside = offs < V
    r64 = r.to(tl.int64)
    x = tl.load(logits + r64 * stride_l + offs, mask=inside, other=0.0).to(tl.float32)
    if tl.load(adjusted + r) != 0:                                    # rows without bias or penalty skip 8 B/id
        b = tl.load(bias + r64 * stride_b + offs, mask=inside, other=0.0)
        n = tl.load(counts + r64 * stride_c + offs, mask=inside, other=0.0)
        x = x + b - tl.load(presence + r) * (n > 0).to(tl.float32) - tl.load(frequency + r) * n
    t = tl.load(temperature + r) + tl.zeros([CHUNK], tl.float32)       # [CHUNK]: div_rn does not broadcast
    x = tl.where(t == 0.0, x, tl.math.div_rn(x, tl.where(t == 0.0, 1.0, t)))   # IEEE division, as torch's
    tl.store(z + r64 * stride_z + offs, x, mask=inside)
    top = tl.max(tl.where(inside, x, -float("inf")), 0)
    tl.store(part_max + r * CHUNKS + c, top)
    tl.store(part_arg + r * CHUNKS + c, tl.min(tl.where(inside & (x == top), offs, V), 0))   # first of equals
    tl.store(part_min + r * CHUNKS + c, tl.min(tl.where(inside, x, float("inf")), 0))


@triton.jit
def _threshold_kernel(z, part_max, part_arg, part_min, temperature, top_p, top_k, min_p, greedy, threshold, V,
                      stride_z, CHUNKS, CHUNKS_P2: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    i_c = tl.arange(0, CHUNKS_P2)
    m_c = i_c < CHUNKS
    tops = tl.load(part_max + r * CHUNKS + i_c, mask=m_c, other=-float("inf"))
    top = tl.max(tops, 0)
    tl.store(greedy + r, tl.min(tl.load(part_arg + r * CHUNKS + i_c, mask=m_c & (tops == top), other=V), 0))
    if tl.load(temperature + r) == 0.0:                               # greedy: no threshold
        return
    bottom = tl.min(tl.load(part_min + r * CHUNKS + i_c, mask=m_c, other=float("inf")), 0)
    row = z + r.to(tl.int64) * stride_z
    # invariant of both searches: the key lo is feasible, the key hi is not; done when hi = lo + 1
    k = tl.load(top_k + r)
    p = tl.load(top_p + r)
    search_k = (k > 0) & (k < V)
    search_p = p < 1.0
    lo_k = _key_of(bottom)                                            # every id is >= bottom: V >= k ids
    hi_k = tl.where(search_k, _key_of(top) + 1, lo_k + 1)             # no id above top: 0 < k
    lo_p = lo_k
    hi_p = tl.where(search_p, _key_of(top) + 1, lo_p + 1)
    target = 0.0
    if search_p:                                                      # top_p of the whole row's mass
        total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            total += tl.exp(tl.load(row + offs, mask=offs < V, other=-float("inf")) - top)
        target = p * tl.sum(total, 0)
    while (hi_k - lo_k > 1) | (hi_p - lo_p > 1):
        mid_k = lo_k + (hi_k - lo_k) // 2
        mid_p = lo_p + (hi_p - lo_p) // 2
        t_k, t_p = _float_of(mid_k), _float_of(mid_p)
        above = tl.zeros([BLOCK], tl.int32)                           # ids >= t_k
        mass = tl.zeros([BLOCK], tl.float32)                          # their softmax mass >= t_p
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(row + offs, mask=offs < V, other=-float("inf"))
            above += (v >= t_k).to(tl.int32)
            mass += tl.where(v >= t_p, tl.exp(v - top), 0.0)
        fits_k = tl.sum(above, 0) >= k
        fits_p = tl.sum(mass, 0) >= target
        lo_k, hi_k = tl.where(fits_k, mid_k, lo_k), tl.where(fits_k, hi_k, mid_k)
        lo_p, hi_p = tl.where(fits_p, mid_p, lo_p), tl.where(fits_p, hi_p, mid_p)
    min_ratio = tl.load(min_p + r)
    t = tl.where(min_ratio > 0.0, top + tl.log(tl.maximum(min_ratio, 1e-30)), -float("inf"))   # t_min
    t = tl.where(search_k, tl.maximum(t, _float_of(lo_k)), t)
    t = tl.where(search_p, tl.maximum(t, _float_of(lo_p)), t)
    tl.store(threshold + r, t)


@triton.jit
def _pick_kernel(z, threshold, seed, index, temperature, part_score, part_id, V, stride_z, CHUNKS,
                 CHUNK: tl.constexpr):
    r, c = tl.program_id(0), tl.program_id(1)
    if tl.load(temperature + r) == 0.0:                               # greedy rows take their argmax
        tl.store(part_score + r * CHUNKS + c, -float("inf"))
        tl.store(part_id + r * CHUNKS + c, V)
        return
    offs = c * CHUNK + tl.arange(0, CHUNK)                            # [CHUNK] ids
    v = tl.load(z + r.to(tl.int64) * stride_z + offs, mask=offs < V, other=-float("inf"))
    keep = (offs < V) & (v >= tl.load(threshold + r))
    s = tl.load(seed + r).to(tl.uint64)                               # the row's keys, as `_row_keys`
    key = _mix32(_mix32(_mix32(s & 0xFFFFFFFF) ^ (s >> 32)) ^ (tl.load(index + r).to(tl.uint64) & 0xFFFFFFFF))
    other = _mix32(key ^ 0x9E3779B9)
    h = _mix32((_mix32(offs.to(tl.uint64) ^ key) + other) & 0xFFFFFFFF)
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    score = tl.where(keep, v - tl.log(-tl.log(u)), -float("inf"))
    best = tl.max(score, 0)
    tl.store(part_score + r * CHUNKS + c, best)
    tl.store(part_id + r * CHUNKS + c, tl.min(tl.where(keep & (score == best), offs, V), 0))


@triton.jit
def _pick_reduce_kernel(part_score, part_id, greedy, temperature, out, CHUNKS, CHUNKS_P2: tl.constexpr):
    r = tl.program_id(0)
    i_c = tl.arange(0, CHUNKS_P2)
    scores = tl.load(part_score + r * CHUNKS + i_c, mask=i_c < CHUNKS, other=-float("inf"))
    best = tl.max(scores, 0)
    pick = tl.min(tl.load(part_id + r * CHUNKS + i_c, mask=(i_c < CHUNKS) & (scores == best), other=2**31 - 1), 0)
    token = tl.where(tl.load(temperature + r) == 0.0, tl.load(greedy + r), pick)
    tl.store(out + r, token.to(tl.int64))

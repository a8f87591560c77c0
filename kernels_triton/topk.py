"""Exact top-k picks of float32 score rows (DSA's prefill selection): a Triton radix select, its
launcher `radix_topk_picks` and its torch reference `radix_topk_picks_ref`.

Unlike most of kernels_triton this file holds its launcher and reference beside the kernel (plain torch
and triton; it imports nothing from hisparse). The picks are `hisparse.dsa.ops.topk_select`'s set, in
no particular order: `hisparse.dsa.ops.order_picks` orders them.

Keys: each score maps to a uint32 whose unsigned order is `topk_select`'s order of the floats (the
high half of its int64 keys): -0.0 equal to +0.0, NaNs by their bits (above +inf when positive,
below -inf when negative). Scores at t >= lengths[n] count as -inf without being read, as
`topk_select` masks them, so a row has exactly k' = min(k, T) picks; equal keys go to the lower id.

The kernel, one program per row, keeps a key range [lo, hi] that holds the k'-th best key, with the
exact counts of keys above it and in it, and narrows it:
1. A guess: a strided sample of the row (T / 64 scores, sorted in registers) gives the range between
   the sample's keys MARGIN standard deviations of rank either side of where the k'-th best falls.
   One pass over the row (`_split`) checks it: it writes the ids of the keys above the range to the
   work row's picks and gathers those in it (about 48 sqrt(k'): 2,300 at k' 2048, at 32K or 128K)
   to the work row's candidates, at most CAP (default: 4096, or 2k' rounded up to a power of 2).
2. Radix passes: a 32-bin histogram of the range's keys (digits relative to lo) narrows the range
   32x a pass, over the row while the range holds more than CAP keys (the fallback: a guess that
   missed, 0.03-0.3% of rows in a simulation of the guess on random and position-trended scores at
   32K and 128K; or ties: 1.4-4% of rows of scores quantised to 0.25), then over the candidates,
   which are gathered again (in place) once few of them are left in the range.
3. When the range is one key, or every key in it is picked, a last `_split` takes the keys above it
   and the range's first `need` keys in id order (the ties to the lower ids); a gather pass then
   writes the picks' scores and int64 ids.
Why not three passes of 11-bit digits over the whole row (an earlier radix top-k here, 5x slower than
torch.topk: results/notes/investigations.md): Triton 3.6 lowers tl.histogram to one warp ballot per
digit bit and one popcount per bin a thread owns, so 2048 bins cost 2 popcounts a key, 32 bins one
popcount per 32 keys (experiments/tools/sass_topk.py counts them). The guess makes the usual row one
read of its scores plus a few small passes over its candidates.
"""
import torch
import triton
import triton.language as tl

CAPACITY = 4096         # candidate ids a row (at least): a range of at most this many keys is gathered
MARGIN = 3.0            # the guessed range's half-width, in standard deviations of the sample's rank
BINS = 32               # a radix pass's histogram: 5 bits of the range's width


@triton.jit
def _key(x):
    """float32 -> uint32 in `topk_select`'s order: +x to x | 2^31, -x to -x (two's complement of its
    bits), so -0.0 meets +0.0 at 2^31 and -inf is 2^23."""
    b = x.to(tl.int32, bitcast=True)
    m = b >> 31                                                     # 0, or -1 for a negative sign bit
    return ((b ^ (m | -2147483648)) - m).to(tl.uint32, bitcast=True)


@triton.jit
def _split_block(p_row, p_cand, p_work, t0, o_b, m, lo, hi, need, written, n_gt, n_in, KPAD, CAP,
                 DIRECT: tl.constexpr, ROW: tl.constexpr):
    """`_split` over one block: o_b [COLS, E // 4, 4] the block's candidate numbers, m which exist."""
    o = t0 + o_b
    if ROW:
        ids = o
    else:
        ids = tl.load(p_cand + o, mask=m, other=0)
    key = _key(tl.load(p_row + ids, mask=m, other=0.0))
    m_ge = m & (key >= lo)
    m_gt = m & (key > hi)                                          # within m_ge: hi >= lo
    # the ranks in id order, for both counts at once (above hi in the low 16 bits, in range in the
    # high ones): in registers along a thread's E ids, then one scan across the threads
    v = tl.where(m_gt, 1, tl.where(m_ge, 65536, 0))                                  # [COLS, E // 4, 4]
    s4 = tl.sum(v, axis=2)                                                             # [COLS, E // 4]
    s = tl.sum(s4, axis=1)                                                             # [COLS]
    c = (tl.cumsum(v, axis=2) + (tl.cumsum(s4, axis=1) - s4)[:, :, None]
         + (tl.cumsum(s, axis=0) - s)[:, None, None])                                 # inclusive
    if DIRECT:
        # above hi, or among the first `need` in range; in id order among themselves
        r_in = n_in + (c >> 16)
        m_out = m_ge & (m_gt | (r_in <= need))
        pos = (written + n_gt - 1) + (c & 0xFFFF) + tl.minimum(r_in, need)
    else:
        # a guess's counts may pass k' or CAP: the writes past the work row's end go to its last slot,
        # those past k' into the candidates (the guess is then too low, its candidates unused)
        m_out = m_ge
        pos = tl.where(m_gt, (written + n_gt - 1) + (c & 0xFFFF), (KPAD + n_in - 1) + (c >> 16))
        pos = tl.minimum(pos, KPAD + CAP)
        if not ROW:
            tl.debug_barrier()                         # in place: every id of the block read first
    tl.store(p_work + pos, ids, mask=m_out)
    total = tl.sum(s, axis=0)
    return n_gt + (total & 0xFFFF), n_in + (total >> 16)


@triton.jit
def _split(p_row, p_cand, p_work, n, lo, hi, need, written, KPAD, CAP,
           DIRECT: tl.constexpr, ROW: tl.constexpr, COLS: tl.constexpr, E: tl.constexpr):
    """One pass over n candidates in id order: the row's first n scores (ROW), or the row's scores at
    the n ids at p_cand. Ids of keys above hi go to the work row's picks at written, written + 1, ...;
    of those in [lo, hi], DIRECT, the first `need` are picks too (placed in id order among the others),
    else all go to the candidates p_cand = p_work + KPAD, at most CAP (in place when read from there:
    a write never passes the block being read). Returns the counts (above hi, in [lo, hi]).

    A block is [COLS, E // 4, 4] candidates, thread c (COLS = the program's threads) holding E
    consecutive ones: 16-byte loads of the full blocks, a scan in registers, one scan across the
    threads, and the scattered store's layout (one candidate a thread at a time, Triton's for a store
    without contiguity) is the same registers, so nothing crosses shared memory."""
    o_b = (tl.arange(0, COLS)[:, None, None] * E + tl.arange(0, E // 4)[None, :, None] * 4
           + tl.arange(0, 4)[None, None, :])
    n_gt = tl.zeros((), dtype=tl.int32)
    n_in = tl.zeros((), dtype=tl.int32)
    n_full = n // (COLS * E) * (COLS * E)
    m_all = tl.full([COLS, E // 4, 4], 1, tl.int1)
    for t0 in range(0, n_full, COLS * E):
        n_gt, n_in = _split_block(p_row, p_cand, p_work, t0, o_b, m_all, lo, hi, need, written, n_gt, n_in,
                                  KPAD, CAP, DIRECT=DIRECT, ROW=ROW)
    if n_full < n:
        n_gt, n_in = _split_block(p_row, p_cand, p_work, n_full, o_b, n_full + o_b < n, lo, hi, need, written, n_gt,
                                  n_in, KPAD, CAP, DIRECT=DIRECT, ROW=ROW)
    tl.debug_barrier()                                 # the work row, seen by every thread
    return n_gt, n_in


@triton.jit
def _histogram(p_row, p_cand, n, lo, hi, shift, ROW: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """[BINS] counts of the candidates' keys in [lo, hi] by (key - lo) >> shift."""
    o_b = tl.arange(0, BLOCK)
    hist = tl.zeros([BINS], dtype=tl.int32)
    for t0 in range(0, n, BLOCK):
        o = t0 + o_b
        m = o < n
        if ROW:
            ids = o
        else:
            ids = tl.load(p_cand + o, mask=m, other=0)
        key = _key(tl.load(p_row + ids, mask=m, other=0.0))
        m_in = m & (key >= lo) & (key <= hi)
        digit = tl.where(m_in, (key - lo) >> shift, 0).to(tl.int32)
        hist += tl.histogram(digit, BINS, mask=m_in)
    return hist


@triton.jit(do_not_specialize=["T", "K"])
def _radix_topk_kernel(
    scores_ptr, len_ptr, val_ptr, id_ptr, work_ptr,
    stride_sn, stride_vn, stride_in, stride_wn,
    T, K, KPAD, MARGIN,
    BLOCK: tl.constexpr, SBLOCK: tl.constexpr, SAMPLE: tl.constexpr, CAP: tl.constexpr, BINS: tl.constexpr,
    COLS: tl.constexpr, E: tl.constexpr,
):
    """Row n's K = min(k, T) picks into val[n, :K] float32 and id[n, :K] int64, in no particular order:
    the K best keys of its scores, those at t >= lengths[n] as -inf (ids lengths[n] .., value -inf,
    not read), equal keys to the lower id. work [N, KPAD + CAP + 16] int32: the picks' ids at [0, K),
    a range's candidates at [KPAD, KPAD + CAP) (KPAD: K rounded up to 16, for aligned loads), then
    the slot where a guess's writes past the row's end go."""
    i_n = tl.program_id(0).to(tl.int64)
    p_row = scores_ptr + i_n * stride_sn
    p_work = work_ptr + i_n * stride_wn
    p_cand = p_work + KPAD
    L = tl.minimum(tl.maximum(tl.load(len_ptr + i_n).to(tl.int64), 0), T).to(tl.int32)
    V = T - L                                                   # -inf keys past the length, not read
    KINF = 8388608                                             # _key(-inf)
    KMAX = 4294967295

    # the range [lo, hi] (int64 here, uint32 in the passes): `above` keys above it, `cnt` in it
    lo = tl.zeros((), dtype=tl.int64)
    hi = lo + KMAX
    above = tl.zeros((), dtype=tl.int32)
    cnt = above + T
    written = above                                            # ids of keys above hi in the work row
    src = above                                                # candidates: 0 the row, 1 the work row's
    n_src = L
    if K < T:
        if K < L:
            # the guess: the sample's keys at the ranks where the K-th best falls, +- MARGIN sigma
            o_s = tl.arange(0, SAMPLE)
            k_s = tl.sort(_key(tl.load(p_row + (o_s.to(tl.int64) * L) // SAMPLE)), descending=True)
            frac = K.to(tl.float32) / L.to(tl.float32)
            rank = SAMPLE * frac
            sigma = tl.sqrt(rank * (1.0 - frac))
            r_hi = tl.floor(rank - MARGIN * sigma - 1.0).to(tl.int32)
            r_lo = tl.ceil(rank + MARGIN * sigma + 1.0).to(tl.int32)
            hi = tl.where(r_hi >= 0, tl.max(tl.where(o_s == r_hi, k_s, 0), axis=0).to(tl.int64), KMAX)
            lo = tl.where(r_lo < SAMPLE, tl.max(tl.where(o_s == r_lo, k_s, 0), axis=0).to(tl.int64), 0)
        else:
            lo = lo + KINF                                     # every real key goes in but NaNs below -inf
            hi = lo
        n_gt, n_in = _split(p_row, p_cand, p_work, L, lo.to(tl.uint32), hi.to(tl.uint32), 0, 0, KPAD, CAP,
                            DIRECT=False, ROW=True, COLS=COLS, E=E)
        a = n_gt + tl.where(KINF > hi, V, 0)
        c = n_in + tl.where((lo <= KINF) & (KINF <= hi), V, 0)
        if a >= K:                                             # the K-th best is above the range
            lo = hi + 1
            hi = lo * 0 + KMAX
            cnt = a
        elif a + c < K:                                        # below it
            hi = lo - 1
            lo = lo * 0
            above = a + c
            cnt = T - above
        else:
            above = a
            cnt = c
            if n_in <= CAP:
                written = n_gt
                src = src * 0 + 1
                n_src = n_in

    # narrow until the range is one key or taken whole
    while (lo < hi) & (cnt > K - above):
        v_in = tl.where((lo <= KINF) & (KINF <= hi), V, 0)
        cnt_real = cnt - v_in
        if (src == 0) & (cnt_real <= CAP):
            n_gt, n_in = _split(p_row, p_cand, p_work, L, lo.to(tl.uint32), hi.to(tl.uint32), 0, 0, KPAD, CAP,
                                DIRECT=False, ROW=True, COLS=COLS, E=E)
            written = n_gt
            src = src * 0 + 1
            n_src = n_in
        elif (src == 1) & (n_src > 2 * cnt_real + SBLOCK):     # few left in range: gather them again
            n_gt, n_in = _split(p_row, p_cand, p_work, n_src, lo.to(tl.uint32), hi.to(tl.uint32), 0, written,
                                KPAD, CAP, DIRECT=False, ROW=False, COLS=COLS, E=E)
            written += n_gt
            n_src = n_in
        else:
            shift = tl.zeros((), dtype=tl.int64)
            while ((hi - lo) >> shift) >= BINS:
                shift += 1
            if src == 0:
                hist = _histogram(p_row, p_cand, L, lo.to(tl.uint32), hi.to(tl.uint32), shift.to(tl.uint32),
                                  ROW=True, BLOCK=BLOCK, BINS=BINS)
            else:
                hist = _histogram(p_row, p_cand, n_src, lo.to(tl.uint32), hi.to(tl.uint32), shift.to(tl.uint32),
                                  ROW=False, BLOCK=SBLOCK, BINS=BINS)
            o_bin = tl.arange(0, BINS)
            hist += tl.where(o_bin.to(tl.int64) == ((KINF - lo) >> shift), v_in, 0)
            ge = tl.cumsum(hist, axis=0, reverse=True)         # [BINS] keys in bins >= j
            b = tl.sum((above + ge >= K).to(tl.int32), axis=0) - 1      # the bin of the K-th best
            cnt = tl.sum(tl.where(o_bin == b, hist, 0), axis=0)
            above += tl.sum(tl.where(o_bin == b, ge, 0), axis=0) - cnt
            base = lo
            lo = base + (b.to(tl.int64) << shift)
            hi = tl.minimum(hi, base + ((b.to(tl.int64) + 1) << shift) - 1)

    # the picks: keys above the range and the range's first `need` in id order, then the -inf past L
    need = K - above
    if src == 0:
        _split(p_row, p_cand, p_work, L, lo.to(tl.uint32), hi.to(tl.uint32), need, 0, KPAD, CAP,
               DIRECT=True, ROW=True, COLS=COLS, E=E)
    else:
        _split(p_row, p_cand, p_work, n_src, lo.to(tl.uint32), hi.to(tl.uint32), need, written, KPAD, CAP,
               DIRECT=True, ROW=False, COLS=COLS, E=E)
    v_in = tl.where((lo <= KINF) & (KINF <= hi), V, 0)
    v_picks = tl.where(KINF > hi, V, tl.where(v_in > 0, tl.maximum(need - (cnt - v_in), 0), 0))
    o_k = tl.arange(0, SBLOCK)
    for j0 in range(0, K, SBLOCK):
        o = j0 + o_k
        m = o < K
        m_past = o >= K - v_picks                                  # the -inf past L, ids L ..
        ids = tl.where(m_past, L + o - (K - v_picks), tl.load(p_work + o, mask=m & ~m_past, other=0))
        x = tl.load(p_row + ids, mask=m & ~m_past, other=float("-inf"))
        tl.store(val_ptr + i_n * stride_vn + o, x, mask=m)
        tl.store(id_ptr + i_n * stride_in + o, ids.to(tl.int64), mask=m)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check(scores, lengths, k) -> None:
    _require(isinstance(scores, torch.Tensor) and scores.dim() == 2 and scores.dtype == torch.float32,
             f"scores must be float32 [N, T], got {getattr(scores, 'dtype', type(scores))} "
             f"{tuple(getattr(scores, 'shape', ()))}")
    n = scores.shape[0]
    _require(isinstance(lengths, torch.Tensor) and lengths.shape == (n,) and lengths.dtype in (torch.int32, torch.int64),
             f"lengths must be int32/int64 of shape {(n,)}, got {getattr(lengths, 'dtype', type(lengths))} "
             f"{tuple(getattr(lengths, 'shape', ()))}")
    _require(lengths.device == scores.device, f"lengths on {lengths.device}, scores on {scores.device}")
    _require(isinstance(k, int) and not isinstance(k, bool) and k >= 1, f"k must be a positive int, got {k!r}")


def radix_topk_picks(scores: torch.Tensor, lengths: torch.Tensor, k: int, *, capacity: int | None = None,
                     sample: int | None = None, margin: float = MARGIN, block: int | None = None):
    """Each row's k' = min(k, T) picks, (values [N, k'] float32, ids [N, k'] int64), in no particular
    order: exactly the set `hisparse.dsa.ops.topk_select(scores, lengths, k)` selects, with the places
    it pads with -1 (rows of fewer than k' scores) as ids >= lengths[n] and value -inf; values as in
    scores (-0.0 kept). `radix_topk_picks_ref` in torch.

    scores float32 [N, T] with a contiguous last dim, T <= 2^30 - 16; lengths int32/int64 [N] on its
    device (clamped to 0 .. T; scores past a length are not read). Keywords, for tests and probes:
    capacity (candidate ids a row; a power of 2, default CAPACITY or 2k' rounded up), sample (scores
    in the guess's sample, a power of 2; default T / 64 within 16 .. 2048), margin (the guess's
    half-width in standard deviations of rank; 0 guesses one key, rarely right), block (scores a
    program reads at once; a power of 2 up to 8192, at least 512 on a GPU (8 warps from 2048),
    default 2048 there, 32 in the interpreter)."""
    _check(scores, lengths, k)
    n, t = scores.shape
    _require(t <= 2**30 - 16, f"T={t}: expected T <= 2^30 - 16 (the work row's positions reach 2T + 13 in int32)")
    _require(t == 0 or scores.stride(1) == 1, f"scores need a contiguous last dim, strides {scores.stride()}")
    sample = sample or min(2048, max(16, triton.next_power_of_2(t // 64)))
    capacity = capacity or min(2**28, max(CAPACITY, triton.next_power_of_2(2 * min(k, t))))
    block = block or (2048 if scores.is_cuda else 32)
    for name, value, least, most in (("capacity", capacity, 16, 2**28), ("sample", sample, 16, 2**14),
                                     ("block", block, 512 if scores.is_cuda else 16, 8192)):
        _require(isinstance(value, int) and least <= value <= most and value & (value - 1) == 0,
                 f"{name}={value!r}: expected a power of 2 in {least} .. {most}")
    _require(isinstance(margin, (int, float)) and margin >= 0, f"margin={margin!r}: expected a number >= 0")
    picks = min(k, t)
    values = torch.empty((n, picks), dtype=torch.float32, device=scores.device)
    ids = torch.empty((n, picks), dtype=torch.int64, device=scores.device)
    if n == 0 or picks == 0:
        return values, ids
    kpad = triton.cdiv(picks, 16) * 16
    work = torch.empty((n, kpad + capacity + 16), dtype=torch.int32, device=scores.device)   # + a dump slot
    num_warps = 8 if block >= 2048 else 4
    # _split's block: the program's threads (COLS) times a thread's consecutive candidates (E, a multiple
    # of 4: 16-byte loads); interpreted, any split of the block
    cols, e = (32 * num_warps, block // (32 * num_warps)) if scores.is_cuda else (block // 4, 4)
    _radix_topk_kernel[(n,)](
        scores, lengths.contiguous(), values, ids, work,
        scores.stride(0), values.stride(0), ids.stride(0), work.stride(0),
        t, picks, kpad, float(margin),
        BLOCK=block, SBLOCK=min(block, 512), SAMPLE=sample, CAP=capacity, BINS=BINS, COLS=cols, E=e,
        num_warps=num_warps,
    )
    return values, ids


def radix_topk_picks_ref(scores: torch.Tensor, lengths: torch.Tensor, k: int):
    """`radix_topk_picks` in torch, best first: torch.topk of `topk_select`'s unique int64 keys (the
    float's order in the high half, 2^32 - 1 - t in the low one) over the scores, -inf past each length."""
    _check(scores, lengths, k)
    n, t = scores.shape
    o_t = torch.arange(t, device=scores.device)
    masked = torch.where(o_t[None, :] < lengths[:, None], scores, float("-inf"))       # [N, T]
    keys = masked.masked_fill(masked == 0, 0.0).view(torch.int32).to(torch.int64)
    keys ^= (keys >> 31) & 0x7FFFFFFF                             # signed order of the float order
    keys = (keys << 32) | (0xFFFFFFFF - o_t)[None, :]
    ids = keys.topk(min(k, t), dim=1).indices                      # [N, k']
    return masked.gather(1, ids), ids

"""DSA prefill top-k, reading fewer scores: a threshold no larger than each row's k-th best score
(the k-th largest of its group maxima), and the compaction of the scores at or above it.

Launchers and input checks live in `hisparse/dsa/ops.py` (`topk_threshold`, `topk_candidates`, used by
`topk_of_indexer_scores`); the torch references beside them are `topk_threshold_ref` and
`topk_candidates_ref`.
"""
import triton
import triton.language as tl


# T and the split's tiles change from chunk to chunk and from row block to row block: not
# specialised on, so that a prefill compiles these once, not again in the middle of a prompt
@triton.jit(do_not_specialize=["T", "TILES_PER_SPLIT"])
def _topk_group_max_kernel(
    scores_ptr, len_ptr, max_ptr,
    stride_sn, stride_mn,
    T, TILES_PER_SPLIT,
    GROUPS: tl.constexpr,
):
    """maxima[n, j * GROUPS + g] = the largest of row n's scores at t = g (mod GROUPS) in split j's
    span, over t < min(lengths[n], T) only; -inf where there is none. scores [N, T] float32,
    lengths [N] int32/int64, maxima [N, SPLITS * GROUPS] float32.

    Program (n, j) reads span j: TILES_PER_SPLIT tiles of GROUPS consecutive scores from
    j * TILES_PER_SPLIT * GROUPS, one running maximum per place in the tile. The groups (split,
    residue) are disjoint, so their maxima are distinct elements of the row: the k-th largest of
    them is at most the row's k-th largest score.
    """
    i_n = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    o_g = tl.arange(0, GROUPS)
    length = tl.minimum(tl.load(len_ptr + i_n), T)
    t_begin = i_split * TILES_PER_SPLIT * GROUPS
    t_end = tl.minimum(length, t_begin + TILES_PER_SPLIT * GROUPS)
    p_row = scores_ptr + i_n * stride_sn
    b_max = tl.full([GROUPS], float("-inf"), dtype=tl.float32)                 # [GROUPS]
    for t0 in range(t_begin, t_end, GROUPS):
        o_t = t0 + o_g
        b_s = tl.load(p_row + o_t, mask=o_t < t_end, other=float("-inf"))
        b_max = tl.maximum(b_max, b_s)
    tl.store(max_ptr + i_n * stride_mn + i_split * GROUPS + o_g, b_max)


@triton.jit(do_not_specialize=["T", "TILES_PER_SPLIT"])
def _topk_candidates_kernel(
    scores_ptr, len_ptr, tau_ptr, val_ptr, id_ptr, count_ptr,
    stride_sn, stride_cn,
    T, TILES_PER_SPLIT, WIDTH,
    BLOCK_T: tl.constexpr, SHARED: tl.constexpr,
):
    """Row n's candidates, the scores s[n, t] >= tau[n] at t < min(lengths[n], T), into the first
    places of its buffers values[n, :WIDTH] float32 and ids[n, :WIDTH] int32 (in no set order),
    and how many there are, count[n] int32 (zeroed before; it counts past WIDTH, where nothing
    is stored). scores [N, T] float32, lengths [N], tau [N] float32.

    Program (n, j) compacts span j (TILES_PER_SPLIT tiles of BLOCK_T scores from j *
    TILES_PER_SPLIT * BLOCK_T) one tile at a time; a running sum of the tile's mask gives each
    candidate its place after the tile's base: the program's own running count when it alone fills
    the row (SHARED false, one split), else one atomic add a tile that reserves the tile's places.
    """
    i_n = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    o_k = tl.arange(0, BLOCK_T)
    tau = tl.load(tau_ptr + i_n)
    length = tl.minimum(tl.load(len_ptr + i_n), T)
    t_begin = i_split * TILES_PER_SPLIT * BLOCK_T
    t_end = tl.minimum(length, t_begin + TILES_PER_SPLIT * BLOCK_T)
    p_row = scores_ptr + i_n * stride_sn
    p_val = val_ptr + i_n * stride_cn
    p_id = id_ptr + i_n * stride_cn
    running = tl.zeros([], dtype=tl.int32)
    for t0 in range(t_begin, t_end, BLOCK_T):
        o_t = t0 + o_k
        m_t = o_t < t_end
        b_s = tl.load(p_row + o_t, mask=m_t, other=float("-inf"))          # [BLOCK_T]
        b_in = (m_t & (b_s >= tau)).to(tl.int32)
        if SHARED:                   # other programs fill the row too: reserve this tile's places
            base = tl.atomic_add(count_ptr + i_n, tl.sum(b_in, axis=0), sem="relaxed")
        else:
            base = running
            running += tl.sum(b_in, axis=0)
        o_c = base + tl.cumsum(b_in, axis=0) - 1                             # each candidate's place
        m_c = (b_in != 0) & (o_c < WIDTH)
        tl.store(p_val + o_c, b_s, mask=m_c)
        tl.store(p_id + o_c, o_t.to(tl.int32), mask=m_c)
    if not SHARED:
        tl.store(count_ptr + i_n, running)

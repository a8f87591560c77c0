"""Place the resolve kernel's no-IO time: time copies of it that stop after each stage (GPU only).

    python -m scripts.ablate_resolve

`_ablate_kernel` is `kernels_triton/resolve.py`'s `_resolve_kernel_flat`, the default (miss-order
plan, K and B unspecialised, the packed free-slot scan), with an exit after stage STOP, each exit
storing a value that depends on the stage's results so the compiler keeps them: 0 launch only, 1
loads and the unit -> slot lookup, 2 the rank scan, 3 the marks (store, barrier, gather) and the
free-slot scan, 4 the new LRU order (slots and their units) and the victims read back, 5 the unit ->
slot map, plan and counters, 6 the whole kernel. Keep it in step with the kernel when the kernel
changes. One difference on purpose: the kernel clears the evicted units' map entries as soon as the
victims are known (stage 3, since e9d0f82adbc4); this copy clears them in stage 5, so that copies
stopping at 3 or 4 leave the map as it was (the premise below).
Each figure: the median over 30 replays of a CUDA graph of 8 calls with fresh selections, per call
(benchmarks/bench_resolve.py's workload), at k = 2048, B = 4096. Copies that stop before stage 4
leave the maps and the LRU order as the warm-up call (the production kernel) left them; those that
stop at 4 rewrite the LRU order but not the unit -> slot map. Either way each replay's hot units are
looked up in a map that still holds them, so they hit and the cold ones miss, as in the whole kernel.

Seen on the H200 (results/gpu_logs/c18bb0e_resolve_ablation.txt, the kernel before 700837c64487's
leaner one): stages 1, 3, 4 and 5 each cost 1 to 3 us at batch 64, whatever num_warps, and stage 5
grows with the misses; in-register alternatives to the
marks and the victim read-back (tl.histogram + tl.gather) took 50 to 340 us on Triton 3.6.
"""
import argparse
import statistics

import torch
import triton
import triton.language as tl

from benchmarks.bench_resolve import Point, Workload, point_state
from hisparse.resolve import resolve
from kernels_triton.resolve import _free_slot_ranks, _selection_ranks


@triton.jit(do_not_specialize=["K", "B"])
def _ablate_kernel(sel_ptr, stream_ptr, host_base_ptr, lru_unit_ptr, lru_ptr, unit_slot_ptr, mark_ptr,
                   epoch_ptr, slot_out_ptr, plan_unit_ptr, plan_slot_ptr, counts_ptr, stats_ptr, K, B,
                   K_PAD: tl.constexpr, B_PAD: tl.constexpr, STOP: tl.constexpr):
    # the kernel's path for a live stream with K == K_PAD and B == B_PAD (EVEN), the points timed here
    i_n = tl.program_id(0).to(tl.int64)
    stream = tl.load(stream_ptr + i_n)
    o_k = tl.arange(0, K_PAD)
    o_b = tl.arange(0, B_PAD)
    if STOP == 0:
        tl.store(counts_ptr + i_n * 2, stream)
        return
    i_s = stream.to(tl.int64)
    p_lru = lru_ptr + i_s * B
    p_lru_unit = lru_unit_ptr + i_s * B
    p_mark = mark_ptr + i_s * B
    p_map = unit_slot_ptr + tl.load(host_base_ptr + i_s)
    epoch = tl.load(epoch_ptr + i_s) + 1
    b_sel = tl.load(sel_ptr + i_n * K + o_k)
    b_order = tl.load(p_lru + o_b)
    b_order_unit = tl.load(p_lru_unit + o_b)
    m_sel = b_sel >= 0
    b_hit_slot = tl.load(p_map + b_sel, mask=m_sel, other=-1)
    if STOP == 1:
        tl.store(counts_ptr + i_n * 2, tl.sum(b_hit_slot, 0) + tl.sum(b_order_unit, 0))
        return
    m_hit = b_hit_slot >= 0
    m_miss = m_sel & (b_hit_slot < 0)
    hit_rank, miss_rank, n_hit, n_miss = _selection_ranks(m_hit, m_miss)
    if STOP == 2:
        tl.store(counts_ptr + i_n * 2, n_hit + tl.sum(b_order_unit, 0) + tl.sum(hit_rank + miss_rank, 0))
        return
    tl.store(p_mark + b_hit_slot, tl.zeros([K_PAD], dtype=tl.int32) + epoch, mask=m_hit)
    tl.debug_barrier()
    m_free = tl.load(p_mark + b_order) != epoch
    free_rank = _free_slot_ranks(m_free, True)
    m_victim = m_free & (free_rank < n_miss)
    if STOP == 3:
        kept = tl.sum(b_order_unit, 0) + tl.sum(free_rank, 0) + tl.sum(hit_rank + miss_rank, 0)
        tl.store(counts_ptr + i_n * 2, n_hit + kept)
        return
    n_untouched = B - n_hit - n_miss
    new_pos = tl.where(m_victim, n_untouched + free_rank, free_rank - n_miss)
    tl.store(p_lru + new_pos, b_order, mask=m_free)
    tl.store(p_lru_unit + new_pos, b_order_unit, mask=m_free & ~m_victim)
    tl.store(p_lru + n_untouched + n_miss + hit_rank, b_hit_slot, mask=m_hit)
    tl.store(p_lru_unit + n_untouched + tl.where(m_hit, n_miss + hit_rank, miss_rank), b_sel, mask=m_sel)
    tl.debug_barrier()
    b_victim = tl.load(p_lru + n_untouched + miss_rank, mask=m_miss, other=-1)
    tl.store(slot_out_ptr + i_n * K + o_k, tl.where(m_hit, b_hit_slot, b_victim))
    if STOP == 4:
        tl.store(counts_ptr + i_n * 2, n_hit + tl.sum(b_order_unit, 0))
        return
    tl.store(p_map + b_order_unit, tl.full([B_PAD], -1, dtype=tl.int32), mask=m_victim & (b_order_unit >= 0))
    tl.store(p_map + b_sel, b_victim, mask=m_miss)
    tl.store(plan_unit_ptr + i_n * K + miss_rank, b_sel, mask=m_miss)
    tl.store(plan_slot_ptr + i_n * K + miss_rank, b_victim, mask=m_miss)
    tl.store(counts_ptr + i_n * 2, n_hit)
    tl.store(counts_ptr + i_n * 2 + 1, n_miss)
    tl.store(epoch_ptr + i_s, epoch)
    if STOP == 5:
        return
    tl.atomic_add(stats_ptr + i_s * 2, n_hit.to(tl.int64), sem="relaxed")
    tl.atomic_add(stats_ptr + i_s * 2 + 1, n_miss.to(tl.int64), sem="relaxed")


def time_graph(fn, sels, work, reps=30, steps=8):
    """Median microseconds per call of fn(sel) over graph replays of `steps` calls."""
    for i in range(steps):
        fn(sels[i])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(steps):
            fn(sels[i])
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        sels.copy_(work.next(steps))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    return statistics.median(times)


def time_variant(p: Point, warps: int, stop: int | None, device) -> float:
    """Microseconds per call of the production resolve (stop None) or of the copy stopping at `stop`."""
    host = torch.empty(p.batch * p.context, 576, dtype=torch.float16, device=device)
    cache = torch.empty(p.batch, p.cache_slots + 1, 576, dtype=torch.float16, device=device)
    streams = torch.arange(p.batch, dtype=torch.int32, device=device)
    state = point_state(p, p.batch, device)
    work = Workload(p, device)
    sels = work.next(8)
    out = resolve(state, streams, sels[0], host, cache, fetch=False, num_warps=warps)

    def call(sel):
        if stop is None:
            resolve(state, streams, sel, host, cache, fetch=False, num_warps=warps, out=out)
            return
        _ablate_kernel[(p.batch,)](
            sel, streams, state.host_base, state.lru_unit, state.lru, state.unit_slot, state.slot_mark,
            state.epoch, out.slots, out.plan_unit, out.plan_slot, out.counts, state.stats, p.k, p.cache_slots,
            K_PAD=p.k, B_PAD=p.cache_slots, STOP=stop, num_warps=warps)
    return time_graph(call, sels, work)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("scripts.ablate_resolve times kernels in CUDA graphs: it needs a CUDA GPU, and none is here")
    device = torch.device("cuda")
    print(f"{'batch':>5} {'miss':>6} {'warps':>5} | {'resolve':>8} | " +
          " ".join(f"{'stop' + str(s):>6}" for s in range(7)) + "   (us per call)")
    for batch, miss in ((64, 0.001), (64, 0.2), (64, 1.0), (1, 0.2)):
        p = Point(batch, 2048, 4096, miss, 1152)
        for warps in (8, 16):
            times = [time_variant(p, warps, stop, device) for stop in [None] + list(range(7))]
            print(f"{batch:5d} {miss:6.3f} {warps:5d} | {times[0]:8.2f} | " +
                  " ".join(f"{t:6.2f}" for t in times[1:]), flush=True)


if __name__ == "__main__":
    main()

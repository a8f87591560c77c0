"""Resolve benchmark: time per call, split into probe-and-scan (no-IO) and IO, with achieved fetch
bandwidth beside the measured ceilings (DESIGN section 7). Writes rows to OUT/resolve.csv.

Workload with an exact miss rate: each stream's selection has h = k - c "hot" units, the same every
step (hits after the first step), and c = round(target_miss * k) "cold" units taken in turn from a
ring of R = B + k units, in a random order fixed per stream. A cold unit comes back only after R
insertions, so LRU has evicted it: every cold unit is a miss, and the context stays small
(h + R <= B + 2k units). Misses land at random places in each stream's host region.

Timing: S resolve calls with fresh selections are captured in one CUDA graph (as in a decode step);
the median replay time over S is the time per call. No-IO runs the same graph without the copy.
A sleep kernel holds the stream before each replay's start event, so that the replay is already
queued when the GPU reaches it: the figure is the GPU's time for the calls, not the host's launch
of the graph, which a decode step (one graph of thousands of kernels) does not pay per call (rows
before the sweep at 62479fe1c4fb include it). With PyTorch's capture (the default) every point is
timed past the graph-count switch (benchmarks.common.pass_graph_switch), as bench_prefetch's modes
are (before 62479fe1c4fb the sweep's first points ran before it).

    python -m benchmarks.bench_resolve                 # the full H200 sweep
    python -m benchmarks.bench_resolve --quick         # a tiny run (also on the CPU interpreter)
    python -m benchmarks.bench_resolve --decode-like   # probe-and-scan as a decode step meets it
    python -m benchmarks.bench_resolve --pages 64      # the page table's cost (target: at most 3%)

`--pages P` times the full call (with the copy) three ways per point, its host rows: as today (no page
table), through an identity page table of P-row pages, and through a shuffled one (each stream's
pages scattered over the pool), each beside the first: the page table's cost, against the target of
at most 3% (rows in OUT/resolve_pages.csv). Points: batch 8 and 64, k = 2048, B = 4096, the three
miss rates, 1152-byte rows.

`--decode-like` times the no-IO call where the sweep is kind to it, against how the decode loop
calls it (rows in OUT/resolve_layers.csv): there, L layers' streams take turns within a step, so
each call finds its streams' LRU order and unit -> slot map as the previous step left them, with
the other L - 1 layers' calls in between (and their state through L2), and each stream's units are
spread over its whole context (32K rows) rather than the h + B + k the sweep needs. Points: batch
8, 16 and 64, k = 2048, B = 4096, the three miss rates; at 1 layer with the sweep's context, at 1
layer over 32K, and at 61 layers (DeepSeek's count) over 32K.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.common import PINNED_BYTES_PER_S, pass_graph_switch
from hisparse.resolve import CacheState, resolve, write_rows
from hisparse.results import DEFAULT_OUT, OUT_HELP, append_rows, check_out_folder

PINNED_GBPS = PINNED_BYTES_PER_S / 1e9
RANDOM_ROWS_MPS = 39.0      # random rows over a large pinned pool, millions per second
STEPS_PER_GRAPH = 8
HOLD_CYCLES = 1 << 18       # GPU clock cycles the stream waits before a timed replay (130 us at 1.98 GHz)
PAGE_TABLES = ("none", "identity", "shuffled")
PAGE_TABLE_TARGET = 1.03    # the paged call's time over today's, at most


@dataclass(frozen=True)
class Point:
    batch: int
    k: int
    cache_slots: int
    target_miss: float
    row_bytes: int
    min_context: int = 0        # spread each stream's units over at least this many rows

    @property
    def cold(self) -> int:
        return max(1, round(self.target_miss * self.k))

    @property
    def context(self) -> int:
        return max(self.min_context, (self.k - self.cold) + self.cache_slots + self.k)


def sweep(quick: bool) -> list[Point]:
    if quick:
        return [Point(b, 16, 32, m, 64) for b in (1, 4) for m in (0.25, 1.0)]
    k = 2048
    main = [Point(b, k, r * k, m, 1152) for b, r, m in
            itertools.product((1, 4, 16, 64, 128), (1, 2, 3, 4), (0.001, 0.2, 1.0))]
    rows = [Point(b, k, 2 * k, m, rb) for rb, b, m in
            itertools.product((656, 8192, 40960), (8, 32), (0.2, 1.0))]
    return main + rows


class Workload:
    """Selections with an exact miss rate for one point (see the module docstring)."""

    def __init__(self, p: Point, device, seed=0):
        gen = torch.Generator().manual_seed(seed)
        perms = torch.stack([torch.randperm(p.context, generator=gen) for _ in range(p.batch)])
        self.hot = perms[:, :p.k - p.cold].to(device)                     # [N, h]
        self.ring = perms[:, p.k - p.cold:].to(device)                    # [N, R]
        self.shuffle = torch.randperm(p.k, generator=gen).to(device)      # selection order
        self.p, self.step = p, 0

    def next(self, steps: int) -> torch.Tensor:
        """Selections of the next `steps` steps: [steps, N, k] int32."""
        p, ring = self.p, self.ring.shape[1]
        t = torch.arange(self.step, self.step + steps, device=self.ring.device)
        pos = (t[:, None] * p.cold + torch.arange(p.cold, device=t.device)) % ring        # [steps, c]
        cold = self.ring[:, pos].permute(1, 0, 2)                                           # [steps, N, c]
        sel = torch.cat([self.hot.expand(steps, -1, -1), cold], dim=2)[:, :, self.shuffle]
        self.step += steps
        return sel.to(torch.int32).contiguous()


def time_calls(run, refresh, calls: int, reps: int, device) -> tuple[float, list]:
    """(median microseconds per call, the last run's results) of `run` (`calls` resolve calls): run
    once to warm up (compile, fill the hot units), then on a GPU captured in one CUDA graph and
    replayed `reps` times, on the CPU run `reps` times; `refresh()` writes fresh selections first."""
    outs = run()
    replay = None
    if device.type == "cuda":               # captured as the decode graphs are
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run()
        replay = graph.replay
    times = []
    for _ in range(reps):
        refresh()
        if replay is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOLD_CYCLES)          # the replay below is queued before `start` runs
            start.record()
            replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        else:
            t0 = time.perf_counter()
            outs = run()
            times.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(times), outs


def miss_counts(outs: list) -> tuple[int, int]:
    hits, misses = torch.stack([o.counts for o in outs]).sum((0, 1)).tolist()
    return hits, misses


def point_state(p: Point, num_streams: int, device, page_table: str = "none", page_rows: int = 1) -> CacheState:
    """An empty cache state of `num_streams` streams of p.cache_slots slots each, stream s holding
    p.context units from map row s * region (region: p.context in whole pages). page_table: "none"
    (map rows are host rows), "identity" or "shuffled" (pages of `page_rows` rows in a random order)."""
    region = -(-p.context // page_rows) * page_rows
    state = CacheState.empty(num_streams, p.cache_slots, num_streams * region, device,
                             page_rows=None if page_table == "none" else page_rows)
    state.host_base.copy_(torch.arange(num_streams, device=device) * region)
    if page_table == "shuffled":
        gen = torch.Generator().manual_seed(0)
        state.pages.page_of.copy_(torch.randperm(state.pages.page_of.numel(), generator=gen).to(torch.int32))
    return state


def time_point(p: Point, host: torch.Tensor, device, reps: int, page_table: str = "none", page_rows: int = 1,
               **opts) -> dict:
    """Median microseconds per resolve call, with and without the copy, and this point's misses.

    host: the pool viewed as [p.batch * p.context (in whole pages), row elements]."""
    row_elems = host.shape[1]
    streams = torch.arange(p.batch, dtype=torch.int32, device=device)
    cache = torch.empty(p.batch, p.cache_slots + 1, row_elems, dtype=host.dtype, device=device)
    result = {}
    for fetch in (False, True):
        state = point_state(p, p.batch, device, page_table, page_rows)
        work = Workload(p, device)
        sels = work.next(STEPS_PER_GRAPH)

        def run():
            return [resolve(state, streams, sels[i], host, cache, fetch=fetch, **opts)
                    for i in range(STEPS_PER_GRAPH)]

        us, outs = time_calls(run, lambda: sels.copy_(work.next(STEPS_PER_GRAPH)), STEPS_PER_GRAPH, reps, device)
        hits, misses = miss_counts(outs)
        result["total_us" if fetch else "noio_us"] = us
        result["miss_rate"] = misses / max(1, hits + misses)
        result["misses_per_call"] = misses / STEPS_PER_GRAPH
    return result


WRITES = ("none", "separate", "fused")


def time_decode_like(p: Point, layers: int, device, reps: int, write: str = "none") -> dict:
    """Median no-IO microseconds per call with `layers` layers' streams taking turns, as in a decode
    step: one state of layers x batch streams, layer l's calls on streams [l*batch, (l+1)*batch).
    write: with each call, the step's newest row of every stream (16-byte rows in a pinned host pool
    on a GPU) written as the decode loop did before (`write_rows`, then the resolve: "separate") or
    does now (`resolve(newest=...)`, one launch: "fused"); "none" times the resolve alone."""
    if write not in WRITES:
        raise ValueError(f"write={write!r}: expected one of {WRITES}")
    num_streams = layers * p.batch
    host = torch.zeros(1, 8, dtype=torch.float16, device=device)     # never read without IO
    if write != "none":                  # every stream's region, as host_base says; written, never read
        host = torch.zeros(num_streams * p.context, 8, dtype=torch.float16, pin_memory=device.type == "cuda")
        host = host if device.type == "cuda" else host.to(device)
    cache = torch.empty(num_streams, p.cache_slots + 1, 8, dtype=torch.float16, device=device)
    state = point_state(p, num_streams, device)
    streams = [torch.arange(layer * p.batch, (layer + 1) * p.batch, dtype=torch.int32, device=device)
               for layer in range(layers)]
    works = [Workload(p, device, seed=layer) for layer in range(layers)]
    new_units = torch.full((p.batch,), p.context - 1, dtype=torch.int64, device=device)
    new_rows = torch.randn(layers, p.batch, 8, device=device).to(torch.float16)

    def next_sels() -> torch.Tensor:
        return torch.stack([w.next(STEPS_PER_GRAPH) for w in works], dim=1)      # [steps, L, N, k]

    sels = next_sels()

    def call(i: int, layer: int):
        newest = None
        if write == "separate":
            write_rows(streams[layer], new_units, new_rows[layer], state.host_base, state.unit_slot, host, cache,
                       to_reserved=True)
        elif write == "fused":
            newest = new_units, new_rows[layer]
        return resolve(state, streams[layer], sels[i, layer], host, cache, fetch=False, newest=newest)

    def run():
        return [call(i, layer) for i in range(STEPS_PER_GRAPH) for layer in range(layers)]

    us, outs = time_calls(run, lambda: sels.copy_(next_sels()), STEPS_PER_GRAPH * layers, reps, device)
    hits, misses = miss_counts(outs)
    return {"noio_us": us, "miss_rate": misses / max(1, hits + misses)}


def decode_like(quick: bool) -> list[tuple[Point, int]]:
    """(point, layers) of `--decode-like` (see the module docstring)."""
    if quick:
        return [(Point(2, 16, 32, m, 16, min_context=c), layers)
                for m in (0.25, 1.0) for c, layers in ((0, 1), (256, 1), (256, 3))]
    return [(Point(b, 2048, 4096, m, 1152, min_context=c), layers)
            for b, m in itertools.product((8, 16, 64), (0.001, 0.2, 1.0))
            for c, layers in ((0, 1), (32768, 1), (32768, 61))]


def run_decode_like(args, device) -> None:
    reps = args.reps or (2 if args.quick else 10)
    if device.type == "cuda":
        pass_graph_switch()
    print(f"{'batch':>5} {'miss':>6} {'context':>8} {'layers':>6} | {'noio us':>8}", flush=True)
    points = decode_like(args.quick)
    for i, (p, layers) in enumerate(points):
        r = time_decode_like(p, layers, device, reps)
        params = dict(bench="resolve_layers", family="", mode="noio", batch=p.batch, context=p.context, k=p.k,
                      cache_slots=p.cache_slots, unit_bytes="", target_miss=p.target_miss, layers=layers)
        append_rows(f"{args.out}/resolve_layers.csv",
                    [{**params, "metric": "noio_us", "value": r["noio_us"], "unit": "us"},
                     {**params, "metric": "miss_rate", "value": r["miss_rate"], "unit": "fraction"}])
        print(f"{p.batch:5d} {r['miss_rate']:6.3f} {p.context:8d} {layers:6d} | {r['noio_us']:8.1f}   "
              f"[{i + 1}/{len(points)}]", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def page_points(quick: bool) -> list[Point]:
    """The points of `--pages` (see the module docstring)."""
    if quick:
        return [Point(1, 16, 32, 0.25, 64), Point(4, 16, 32, 1.0, 64)]
    return [Point(b, 2048, 4096, m, 1152) for b, m in itertools.product((8, 64), (0.001, 0.2, 1.0))]


def run_pages(args, device) -> None:
    """Each point's call through no page table, an identity one and a shuffled one (module docstring)."""
    reps, page_rows = args.reps or (2 if args.quick else 20), args.pages
    if device.type == "cuda":
        pass_graph_switch()
    points = page_points(args.quick)
    regions = {p: -(-p.context // page_rows) * page_rows for p in points}
    pool_bytes = max(p.batch * regions[p] * p.row_bytes for p in points)
    flat = torch.empty(pool_bytes // 2, dtype=torch.float16, pin_memory=device.type == "cuda")
    fill_random(flat, device)
    print(f"# pages of {page_rows} rows; target: the paged call at most {PAGE_TABLE_TARGET:.2f}x today's", flush=True)
    print(f"{'batch':>5} {'miss':>6} | " + " ".join(f"{t + ' us':>12}" for t in PAGE_TABLES) +
          " | identity/none shuffled/none (target <= {:.2f})".format(PAGE_TABLE_TARGET), flush=True)
    for i, p in enumerate(points):
        host = flat[:p.batch * regions[p] * (p.row_bytes // 2)].view(p.batch * regions[p], p.row_bytes // 2)
        results = {t: time_point(p, host, device, reps, page_table=t, page_rows=page_rows) for t in PAGE_TABLES}
        rows = []
        for table, r in results.items():
            params = dict(bench="resolve_pages", family="", mode="hisparse", batch=p.batch, context=p.context, k=p.k,
                          cache_slots=p.cache_slots, unit_bytes=p.row_bytes, target_miss=p.target_miss,
                          page_table=table, page_rows=page_rows)
            rows += [{**params, "metric": "total_us", "value": r["total_us"], "unit": "us"},
                     {**params, "metric": "noio_us", "value": r["noio_us"], "unit": "us"},
                     {**params, "metric": "miss_rate", "value": r["miss_rate"], "unit": "fraction"}]
        append_rows(f"{args.out}/resolve_pages.csv", rows)
        base = results["none"]["total_us"]
        ratios = [results[t]["total_us"] / base for t in PAGE_TABLES[1:]]
        verdict = "ok" if max(ratios) <= PAGE_TABLE_TARGET else "OVER TARGET"
        print(f"{p.batch:5d} {results['none']['miss_rate']:6.3f} | " +
              " ".join(f"{results[t]['total_us']:12.1f}" for t in PAGE_TABLES) +
              f" | {ratios[0]:8.3f} {ratios[1]:13.3f}   {verdict}   [{i + 1}/{len(points)}]", flush=True)


def rows_for(p: Point, r: dict) -> list[dict]:
    # the copy's share of the call; not measurable when it drowns in timing noise
    io_us = r["total_us"] - r["noio_us"]
    io_us = io_us if io_us > 0.05 * r["total_us"] else float("nan")
    moved = r["misses_per_call"] * p.row_bytes
    metrics = {
        "noio_us": (r["noio_us"], "us"),
        "total_us": (r["total_us"], "us"),
        "fetch_GBps": (moved / io_us / 1e3, "GB/s"),
        "fetch_Mrows_per_s": (r["misses_per_call"] / io_us, "Mrows/s"),
        "miss_rate": (r["miss_rate"], "fraction"),
    }
    params = dict(bench="resolve", family="", mode="hisparse", batch=p.batch, context=p.context, k=p.k,
                  cache_slots=p.cache_slots, unit_bytes=p.row_bytes, target_miss=p.target_miss,
                  plan_order="miss")
    return [{**params, "metric": m, "value": v, "unit": u} for m, (v, u) in metrics.items()]


def fill_random(flat: torch.Tensor, device) -> None:
    """Random bits in the pool (never time copies of zeros), drawn on the device in 256 MiB chunks."""
    chunk = 1 << 27
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk].view(torch.int16)
        part.copy_(torch.randint(-30000, 30000, part.shape, dtype=torch.int16, device=device))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    ap.add_argument("--quick", action="store_true", help="a tiny sweep, also runs on the CPU interpreter")
    ap.add_argument("--reps", type=int, default=None,
                    help="graph replays per point (default 20, --decode-like 10, --quick 2)")
    ap.add_argument("--decode-like", action="store_true",
                    help="time no-IO calls as the decode loop makes them instead (resolve_layers.csv)")
    ap.add_argument("--pages", type=int, default=None, metavar="P",
                    help="time the call through page tables of P-row pages beside today's (resolve_pages.csv)")
    args = ap.parse_args(argv)
    check_out_folder(ap, args.out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps {args.reps}: expected a positive integer")
    if device.type == "cpu" and not args.quick:
        ap.error("the full sweep needs a CUDA GPU (it pins a host pool of several GiB); use --quick on the CPU")
    if args.pages is not None and (args.pages < 1 or args.pages & (args.pages - 1)):
        ap.error(f"--pages {args.pages}: expected a power of two (rows a page)")
    if args.decode_like:
        run_decode_like(args, device)
        return
    if args.pages is not None:
        run_pages(args, device)
        return
    points = sweep(args.quick)
    if device.type == "cuda":
        pass_graph_switch()
    reps = args.reps or (2 if args.quick else 20)
    # one pinned pool for the whole sweep, sized for the largest point, viewed per row size
    pool_bytes = max(p.batch * p.context * p.row_bytes for p in points)
    print(f"# pinning a host pool of {pool_bytes / 2**30:.1f} GiB on {device}", flush=True)
    flat = torch.empty(pool_bytes // 2, dtype=torch.float16, pin_memory=device.type == "cuda")
    fill_random(flat, device)
    print(f"{'batch':>5} {'B/k':>4} {'miss':>6} {'row B':>6} | {'noio us':>8} {'total us':>9} | "
          f"{'fetch GB/s':>10} (limit {PINNED_GBPS}) {'Mrows/s':>8} (limit {RANDOM_ROWS_MPS:.0f})", flush=True)
    for i, p in enumerate(points):
        row_elems = p.row_bytes // 2
        host = flat[:p.batch * p.context * row_elems].view(p.batch * p.context, row_elems)
        r = time_point(p, host, device, reps)
        out = append_rows(f"{args.out}/resolve.csv", rows_for(p, r))
        gbps = out.loc[out.metric == "fetch_GBps", "value"].item()
        mrows = out.loc[out.metric == "fetch_Mrows_per_s", "value"].item()
        print(f"{p.batch:5d} {p.cache_slots / p.k:4.1f} {r['miss_rate']:6.3f} {p.row_bytes:6d} | "
              f"{r['noio_us']:8.1f} {r['total_us']:9.1f} | {gbps:10.1f} {'':12} {mrows:8.1f}   "
              f"[{i + 1}/{len(points)}]", flush=True)


if __name__ == "__main__":
    main()

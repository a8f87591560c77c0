"""Does a side-stream copy slow the kernels beside it, and through what? (GPU only)

    python -m scripts.copy_interference [--programs 4 16] [--batch 32 --hidden 1024] [--kernels 200]
        [--graphed] [--pool-gib 12 [--span-gib 0.25]] [--sorted] [--huge-pages | --vmm] [--evict-first]

Beside DSA's prefetch copies (4 programs), the decode step's compute ran 196 us a step slower at hidden
1024 batch 32, and only while a copy was in flight: kernels overlapping one ran 14-23% slower, the others
1-2% (results/gpu_logs/e343a3dfc6cc_timeline_prefetch_4_programs.txt). This separates the candidates.
Two chains of kernels are captured in CUDA graphs and timed alone and beside copies launched eagerly on
another stream (in the decode step they are captured with it: `--graphed`), repeated to outlast the chain:
- `small`: `--kernels` torch elementwise ops on a [batch, hidden] bf16 tensor, a few programs each,
  as the step's norms and residual adds;
- `gemm`: a tenth as many [batch, hidden] x [hidden, 4 hidden] products and back, as its projections.
The copies move `--rows` rows of `--row-bytes` from random rows of a pool of 16 x rows, or of
`--pool-gib` (each repeat its own rows, so that no repeat finds them in L2 within a run; `--span-gib
S`: from the pool's first S GiB only; `--sorted`: in address order; `--huge-pages`: a pool in 2 MiB
pages; `--vmm`: a pool made and mapped by cuMemCreate, hisparse.host_vmm; `--evict-first`: loads
and stores marked to leave L2 first) to random slots:
- `host`: `fetch_rows` at `--programs`, the prefetch copy, reading the rows zero-copy from pinned host
  memory;
- `device`: the same kernel, programs and tiles, reading the rows from device memory (it moves them
  faster: more bytes a microsecond beside the chain, none of them over PCIe);
- `engine`: the same bytes, contiguous, host to device by cudaMemcpyAsync (the copy engines: no
  multiprocessor, no zero-copy reads);
- `spin`: no copy, one thread spinning (torch.cuda._sleep) as long as the `host` copy takes: a kernel
  on another stream that loads nothing.
Reading the table: if `host` slows a chain and `device` does not, the copy's reads from the host slow
it, not the multiprocessors it holds nor the bytes it moves; if `engine` slows it too, the PCIe traffic
itself does; if `spin` does, any kernel running beside it does. Every time is a median over `--reps`
runs, each started after a GPU sleep long enough for the host to queue the whole run, so no launch is
timed. Printed per copy: its rate alone, and per chain the us alone (timed beside each copy's run,
against drift), beside the copy, their ratio, and whether the copies lasted the whole chain.
With `--graphed`, chain and copies are captured together in one graph, the copies on a branch that
forks at its start and joins at its end, as the decode step captures them. The copies then cover only
about GRAPHED_COVER of the chain alone (use a long chain: --kernels 2000), so that the graph's time is
the chain's, and each cell adds the chain's extra time per microsecond of copying ("/us"; in the
eager mode the ratio - 1) and per MB copied ("/MB": what moving a layer's rows costs the compute, for
comparing copies of different rates). Two caveats: the microseconds of copying are the copies' own,
timed alone and eagerly (no event marks their end inside a graph), and every replay of a graph copies
the same plans' rows. Each cell's graph is a new one, captured after the chains' own (on the H200,
once PyTorch has captured 4 graphs in a process, the graphs it captured, the chains' too, replay
slower: README); in the runs logged so far the `spin` and `engine` rows, whose graphs come after the
first copies', added nothing, so no such effect.
Found on the H200 (results/gpu_logs/c21295b4d6aa_copy_interference.txt): neither `spin` nor `engine`
slows the chains; `host` slows them more the larger its pool (graphed, 4 programs, small kernels: 0.2
us per MB from 0.28 GiB, 10.7-11.2 from 12 GiB), in 2 MiB pages or made by cuMemCreate as much, but
0.4 with its rows from the first 0.25 GiB of the 12 (e9882268f059_copy_interference_span_vmm.txt): the
rows' spread, not the memory pinned; `device` about as much per us as `host` from 12 GiB, and with
`--evict-first` a fifth of that, while `host` stays (e2a9e92ade46_copy_evict_first.txt). Rows in
address order cut the cost by more than half from 12 GiB here
(5a00a38e2dd7_timeline_prefetch_sorted_plans.txt), but not in the decode step. The cost goes with
the rows, not the bytes, for the small kernels: 18.9 MB from 12 GiB in rows of 1152 / 4608 / 9216
bytes cost them +10.2 / +2.4 / +0.3 us per MB; `--interleave 4` (per-layer copies of side-by-side
rows) cut it to a third at 4096 rows a copy, by 41% at 8192, by a tenth at 16384
(073bc99f94cc_copy_interference_row_size_interleave.txt, 4ae3eaf408d3_copy_interference_8192_rows_and_gpu_tests.txt).
"""
import argparse
import math
import statistics
import time
import weakref

import torch

from hisparse import host_vmm
from hisparse.host_pool import pinned_empty, unpin
from hisparse.resolve import fetch_rows
from scripts.ablate_decode import huge_page_kib

COPIES = ("host", "device", "engine", "spin")
PLANS = 16              # the pool holds this many copies' rows, each repeat copies the next plan's
SLEEP_CYCLES = 10**7    # about 5 ms at the H200's clock: the host queues a whole run meanwhile
GRAPHED_COVER = 0.5     # with --graphed, the copies run for about this share of the chain alone


def repeats_to_cover(chain_us: float, copy_us: float, margin: float = 1.5) -> int:
    """How many copies, back to back, run at least `margin` times as long as the chain."""
    if chain_us <= 0 or copy_us <= 0:
        raise ValueError(f"chain {chain_us} us, copy {copy_us} us: expected positive times")
    return max(1, math.ceil(margin * chain_us / copy_us))


class Copies:
    """Copies of `rows` rows of `row_bytes` bytes three ways, and a spin (COPIES); the method of each
    name launches one on the current stream. `host` and `device` move the rows of plan i (i = 0, 1, ...
    in turn; each plan random rows of a pool of `pool_rows`, default PLANS x rows) to random slots of
    `cache` [1, rows + 1, E]: slot plan_slot[0, j] gets pool row plan_units[i][0, j]. `engine` copies
    the pool's first rows, contiguous, into `staging`. span_rows: the plans' rows come from the pool's
    first span_rows only (at least PLANS x rows; default all of it). sorted_rows: each plan's rows in
    host-address order (the resolve's sort_plan), else in random order (a selection's). `pool` is host
    memory (pinned as the host pool pins it on a GPU machine, in 2 MiB pages with huge_pages, made by
    cuMemCreate with vmm), random
    values (a pool larger than the default is left as allocated: the copies' speed does not depend on
    the bytes); `pool_on_device` a copy of it in device memory."""

    def __init__(self, rows: int, row_bytes: int, programs: int, device, seed: int = 0, pool_rows: int = 0,
                 huge_pages: bool = False, sorted_rows: bool = False, span_rows: int = 0, vmm: bool = False,
                 evict_first: bool = False, interleave: int = 1):
        gen = torch.Generator().manual_seed(seed)
        elems = row_bytes // 2                                           # bf16 rows
        pool_rows = max(pool_rows, PLANS * rows)
        if device.type == "cuda":
            self.pool = pinned_empty(pool_rows, elems, torch.bfloat16, huge_pages=huge_pages, vmm=vmm)
            weakref.finalize(self, unpin, self.pool)
        else:
            self.pool = torch.empty(pool_rows, elems, dtype=torch.bfloat16)
        if pool_rows == PLANS * rows:
            self.pool.copy_(torch.randn(pool_rows, elems, generator=gen))
        self.pool_on_device = self.pool.to(device, copy=True)
        span_rows = min(pool_rows, max(span_rows, PLANS * rows)) if span_rows else pool_rows
        if interleave > 1:
            # plans interleave*g + j (j < interleave) read rows interleave*u + j of the same random u: as
            # per-layer copies over a layout keeping a unit's rows of `interleave` layers side by side
            units = torch.randperm(span_rows // interleave, generator=gen)[:PLANS // interleave * rows]
            lanes = torch.arange(interleave).view(1, interleave, 1)
            order = (units.view(-1, 1, rows) * interleave + lanes).to(torch.int32).view(PLANS, rows)
        else:
            order = torch.randperm(span_rows, generator=gen)[:PLANS * rows].to(torch.int32).view(PLANS, rows)
        if sorted_rows:
            order = order.sort(dim=1).values
        self.plan_units = [order[i][None].to(device) for i in range(PLANS)]
        self.cache = torch.zeros(1, rows + 1, elems, dtype=torch.bfloat16, device=device)
        self.staging = torch.empty(rows, elems, dtype=torch.bfloat16, device=device)
        self.plan_slot = torch.randperm(rows, generator=gen).to(torch.int32)[None].to(device)
        self.counts = torch.tensor([[0, rows]], dtype=torch.int32, device=device)
        self.streams = torch.zeros(1, dtype=torch.int32, device=device)
        self.host_base = torch.zeros(1, dtype=torch.int64, device=device)
        self.programs = programs
        self.evict_first = evict_first
        self.launched = 0
        self.spin_cycles = 0        # `spin`'s length: set to the `host` copy's once that is timed

    def align(self, n: int) -> None:
        """Make the next copy start a group of n plans (a multiple of n), as `--interleave n` needs."""
        self.launched = -(-self.launched // n) * n

    def _fetch(self, pool: torch.Tensor) -> None:
        plan = self.plan_units[self.launched % PLANS]
        self.launched += 1
        fetch_rows(plan, self.plan_slot, self.counts, self.streams, self.host_base, pool, self.cache, self.programs,
                   evict_first=self.evict_first)

    def host(self) -> None:
        self._fetch(self.pool)

    def device(self) -> None:
        self._fetch(self.pool_on_device)

    def engine(self) -> None:
        self.staging.copy_(self.pool[:self.staging.shape[0]], non_blocking=True)

    def spin(self) -> None:
        torch.cuda._sleep(self.spin_cycles)


def sleep_us() -> float:
    """How long the GPU sleeps SLEEP_CYCLES (us)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3


def timed(run, reps: int, side: torch.cuda.Stream, queue_us: float) -> tuple[float, float]:
    """Medians over `reps` runs of (us from the start to the current stream's end, to the side stream's
    end). Each run starts after a GPU sleep on the current stream, behind which `run()` queues its work
    (the side stream's after a wait on the start), so no launch is timed; a run the host takes longer
    than `queue_us` to queue is refused, since its launches would be."""
    main, ends = torch.cuda.current_stream(), ([], [])
    for _ in range(reps):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda._sleep(SLEEP_CYCLES)
        events[0].record(main)
        side.wait_event(events[0])
        queued = time.perf_counter()
        run()
        queued = (time.perf_counter() - queued) * 1e6
        if queued > queue_us:
            raise RuntimeError(f"queueing a run took {queued:.0f} us, more than the {queue_us:.0f} us the GPU "
                               "sleeps before it, so its launches would be timed: copy more --rows a launch")
        events[1].record(main)
        events[2].record(side)
        torch.cuda.synchronize()
        for times, end in zip(ends, events[1:]):
            times.append(events[0].elapsed_time(end) * 1e3)
    return statistics.median(ends[0]), statistics.median(ends[1])


def graphed(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (after one eager call, which warms up the kernels it launches)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def chains(batch: int, hidden: int, kernels: int, device) -> dict:
    """name -> the chain's kernels, a function: `small` (`kernels` elementwise kernels), `gemm`
    (kernels // 10 products)."""
    x = torch.randn(batch, hidden, device=device, dtype=torch.bfloat16)
    w_up = torch.randn(hidden, 4 * hidden, device=device, dtype=torch.bfloat16) / hidden ** 0.5
    w_down = torch.randn(4 * hidden, hidden, device=device, dtype=torch.bfloat16) / (4 * hidden) ** 0.5

    def small():
        y = x
        for _ in range(kernels // 2):
            y = y * 0.999 + 0.001                      # two elementwise kernels
        return y

    def gemm():
        y = x
        for _ in range(kernels // 20):
            y = (y @ w_up) @ w_down
        return y
    return {"small": small, "gemm": gemm}


def graphed_repeats(chain_us: float, copy_us: float) -> int:
    """--graphed: how many copies, back to back, run about GRAPHED_COVER of the chain (at least one;
    rounded down, so 35-50% of it for copies of a sixth of the chain or less)."""
    if chain_us <= 0 or copy_us <= 0:
        raise ValueError(f"chain {chain_us} us, copy {copy_us} us: expected positive times")
    return max(1, int(GRAPHED_COVER * chain_us / copy_us))


def cell(alone_us: float, beside_us: float, copies_end_us: float, repeats: int, copy_us: float,
         copy_mb: float | None, graphed: bool) -> str:
    """One table cell: the chain's us alone -> beside the copies (ratio), then '!' where the reading
    is off (eager: the copies, ending at `copies_end_us`, ended before the chain; graphed: `repeats`
    copies of `copy_us` each, timed alone, outlast the chain alone, so the graph's time is theirs),
    and with `graphed` the chain's extra us per us of copying and per MB copied (`copy_mb` MB a copy;
    None for the spin, which copies nothing). The copies' time is their eager time alone: inside the
    graph no event can mark their end."""
    off = repeats * copy_us > alone_us if graphed else copies_end_us < beside_us
    text = f"{alone_us:7.0f} -> {beside_us:7.0f} ({beside_us / alone_us:4.2f}){'!' if off else ' '}"
    if graphed:
        extra_us = beside_us - alone_us
        per_mb = f"{extra_us / (repeats * copy_mb):+5.2f}/MB" if copy_mb else "      -"
        text += f" {extra_us / (repeats * copy_us):+5.2f}/us {per_mb:>8}"
    return text


def with_copies_beside(chain, launch, repeats: int, side: torch.cuda.Stream, join: bool):
    """A function that runs `repeats` copies on `side` and the chain on the current stream, the copies
    forking from the current stream's work; with `join`, the current stream then waits for them (as
    a graph's capture needs; in an eager run that would time the copies as the chain)."""
    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(repeats):
                launch()
        chain()
        if join:
            main.wait_stream(side)
    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, nargs="+", default=[4, 16], help="the copy kernel's programs")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--kernels", type=int, default=200,
                    help="elementwise kernels in the small chain (at least 20; the GEMM chain has a tenth)")
    ap.add_argument("--rows", type=int, default=16384, help="rows a copy moves (default 16384)")
    ap.add_argument("--row-bytes", type=int, default=1152, help="bytes a row (default 1152, DSA's latent)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--pool-gib", type=float, default=0.0,
                    help="the host pool's size (GiB; default 16 copies' rows): the copies read random rows of it, "
                         "as a decode step's read rows of a pool of many GiB")
    ap.add_argument("--span-gib", type=float, default=0.0,
                    help="draw the copies' rows from the pool's first SPAN_GIB GiB only (default, or more than "
                         "the pool: all of it): a large pool pinned, a small part of it read")
    ap.add_argument("--sorted", action="store_true",
                    help="each copy reads its rows in host-address order (the resolve's sort_plan), not at random")
    ap.add_argument("--interleave", type=int, default=1,
                    help="N > 1: each N copies in a row read the rows N*u, N*u+1, ... of the same random units u "
                         "(per-layer copies of N layers whose rows of a unit lie side by side); a divisor of "
                         f"{PLANS}")
    ap.add_argument("--huge-pages", action="store_true",
                    help="back the host pool with 2 MiB pages (hisparse.host_pool.pinned_empty's huge_pages)")
    ap.add_argument("--vmm", action="store_true",
                    help="make the host pool with the driver's virtual memory API (hisparse.host_vmm), not "
                         "cudaHostRegister")
    ap.add_argument("--evict-first", action="store_true",
                    help="the copies' loads and stores marked to leave L2 first (fetch_rows' evict_first)")
    ap.add_argument("--graphed", action="store_true",
                    help="capture chain and copies in one graph, the copies on a forked branch (see above)")
    args = ap.parse_args(argv)
    bad = [f"--{name} {getattr(args, name)}" for name in ("batch", "hidden", "rows", "reps")
           if getattr(args, name) < 1] + [f"--programs {p}" for p in args.programs if p < 1]
    if bad:
        ap.error(f"{', '.join(bad)}: expected a positive count")
    if args.kernels < 20:
        ap.error(f"--kernels {args.kernels}: expected at least 20 (the GEMM chain has a tenth as many)")
    if args.row_bytes < 2 or args.row_bytes % 2:
        ap.error(f"--row-bytes {args.row_bytes}: expected a positive even number (rows of bf16)")
    for name in ("pool_gib", "span_gib"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a size >= 0 (0: the default)")
    pool_rows = max(int(args.pool_gib * 2**30) // args.row_bytes, PLANS * args.rows)
    if args.interleave < 1 or PLANS % args.interleave:
        ap.error(f"--interleave {args.interleave}: expected a divisor of {PLANS}")
    if args.huge_pages and args.vmm:
        ap.error("--huge-pages and --vmm: expected one of them (cuMemCreate picks its own pages)")
    if not torch.cuda.is_available():
        raise SystemExit("scripts.copy_interference times kernels beside copies on a CUDA GPU; none here")
    device = torch.device("cuda")
    side = torch.cuda.Stream()
    fns = chains(args.batch, args.hidden, args.kernels, device)
    graphs = {name: graphed(fn) for name, fn in fns.items()}
    sleep = min(sleep_us() for _ in range(3))       # the clock rises from idle over the first ones
    queue_us = 0.8 * sleep                           # the host's time to queue a run, with a margin
    print(f"batch {args.batch}, hidden {args.hidden}, {args.kernels} small kernels or {args.kernels // 10} GEMMs; "
          f"copies of {args.rows} rows of {args.row_bytes} bytes from a host pool of "
          f"{pool_rows * args.row_bytes / 2**30:.2f} GiB{f' (its first {args.span_gib} GiB)' if args.span_gib else ''}"
          f"{' in address order' if args.sorted else ''}"
          f"{f', {args.interleave} copies in a row reading adjacent rows of the same units' * (args.interleave > 1)}, "
          + ("captured with the chain in one graph, covering about half of it" if args.graphed else
             "launched eagerly beside the chain's graph, outlasting it")
          + "; us: alone -> beside (ratio), '!' where the copies "
          + ("outlast the chain alone (longer chains: --kernels), and the extra us per us and per MB of copying"
             if args.graphed else "ended before the chain"))
    width = 48 if args.graphed else 36
    print(f"{'copy':>8} {'programs':>8} {'GB/s':>6} | " + " | ".join(f"{name:>{width}}" for name in graphs), flush=True)
    copies = Copies(args.rows, args.row_bytes, args.programs[0], device, pool_rows=pool_rows,
                    huge_pages=args.huge_pages, sorted_rows=args.sorted,
                    span_rows=int(args.span_gib * 2**30) // args.row_bytes,     # one pool for every width
                    vmm=args.vmm, evict_first=args.evict_first, interleave=args.interleave)
    if args.huge_pages:
        print(f"   pool in huge pages: {huge_page_kib(copies.pool) / 2**20:.2f} GiB", flush=True)
    if args.vmm:
        print(f"   pool made by cuMemCreate: {host_vmm.mapping(copies.pool)}", flush=True)
    copy_mb = args.rows * args.row_bytes / 1e6
    for programs in args.programs:
        copies.programs = programs
        first = programs == args.programs[0]
        for name in COPIES if first else COPIES[:2]:        # the engine and the spin have no programs
            launch = getattr(copies, name)
            launch()                                                          # compiles the copy kernel
            copy_us = timed(launch, args.reps, side, queue_us)[0]
            if name == "host":
                copies.spin_cycles = round(SLEEP_CYCLES * copy_us / sleep)
            if first and name == COPIES[0]:
                # the first beside-runs of a process leave its later chains slower (on the H200 the small
                # chain's alone time went 199 -> 234 us after one): one round of each, untimed
                for graph in graphs.values():
                    timed(with_copies_beside(graph.replay, launch, 1, side, join=False), 3, side, queue_us)
            cells = []
            for chain, graph in zip(fns.values(), graphs.values()):
                alone_us = timed(graph.replay, args.reps, side, queue_us)[0]
                repeats = (graphed_repeats(alone_us, copy_us) if args.graphed
                           else repeats_to_cover(alone_us, copy_us))
                # with --interleave N, runs of N copies that start at a plan of a group, so that each run
                # reads its units' N side-by-side rows (the copies then may cover more of the chain)
                repeats = -(-repeats // args.interleave) * args.interleave
                copies.align(args.interleave)
                beside = with_copies_beside(chain if args.graphed else graph.replay, launch, repeats, side,
                                            join=args.graphed)
                run = graphed(beside).replay if args.graphed else beside
                beside_us, copies_end_us = timed(run, args.reps, side, queue_us)
                moved = None if name == "spin" else copy_mb
                cells.append(cell(alone_us, beside_us, copies_end_us, repeats, copy_us, moved, args.graphed))
            rate = "-" if name == "spin" else f"{copy_mb / copy_us * 1e3:.1f}"
            shown = programs if name in ("host", "device") else "-"
            print(f"{name:>8} {shown:>8} {rate:>6} | " + " | ".join(f"{c:>{width}}" for c in cells), flush=True)


if __name__ == "__main__":
    main()

"""Does a side-stream copy slow the kernels beside it, and through what? (GPU only)

    python -m scripts.copy_interference [--programs 4 16] [--batch 32 --hidden 1024] [--kernels 200]

Beside DSA's prefetch copies (4 programs), the decode step's compute ran 196 us a step slower at hidden
1024 batch 32, and the step's small kernels paid most, though 4 programs leave 128 multiprocessors free
(results/gpu_logs/e343a3dfc6cc_timeline_prefetch_4_programs.txt). This separates the candidates. Two
chains of kernels are captured in CUDA graphs and timed alone and beside a copy on another stream
that outlasts them:
- `small`: `--kernels` torch elementwise ops on a [batch, hidden] bf16 tensor, a few programs each,
  as the step's norms and residual adds;
- `gemm`: [batch, hidden] x [hidden, 4 hidden] products, as its projections.
The copies move `--rows` rows of `--row-bytes` from random rows of a pool to random slots:
- `host`: `fetch_rows` at `--programs`, the prefetch copy, reading the rows zero-copy from pinned host
  memory;
- `device`: the same kernel, programs and tiles, reading the rows from device memory;
- `engine`: the same bytes, contiguous, host to device by cudaMemcpyAsync (the copy engines: no
  multiprocessor, no zero-copy reads).
Reading the table: if `host` slows a chain and `device` does not, the copy's zero-copy reads are what
slows it, not the multiprocessors it holds; if `engine` slows it too, the PCIe traffic itself does.
Printed per chain: its us alone and beside each copy (the median of `--reps` replays), the ratio, and
each copy's rate alone.
"""
import argparse
import statistics

import torch

from hisparse.resolve import fetch_rows

COPIES = ("host", "device", "engine")


def repeats_to_cover(chain_us: float, copy_us: float, margin: float = 1.5) -> int:
    """How many copies, back to back, run at least `margin` times as long as the chain."""
    if chain_us <= 0 or copy_us <= 0:
        raise ValueError(f"chain {chain_us} us, copy {copy_us} us: expected positive times")
    return max(1, -(-int(margin * chain_us * 1000) // int(copy_us * 1000)))


def median_us(fn, reps: int, stream=None) -> float:
    """Median time of fn() (us) over `reps` calls, by events on `stream` (default: the current one)."""
    stream = stream or torch.cuda.current_stream()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graphed(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (after one eager call, which warms up the kernels it launches)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def chains(batch: int, hidden: int, kernels: int, device) -> dict:
    """name -> a graph of the chain's kernels."""
    x = torch.randn(batch, hidden, device=device, dtype=torch.bfloat16)
    w = torch.randn(hidden, 4 * hidden, device=device, dtype=torch.bfloat16) / hidden ** 0.5
    w_back = torch.randn(4 * hidden, hidden, device=device, dtype=torch.bfloat16) / hidden ** 0.5

    def small():
        y = x
        for _ in range(kernels // 2):
            y = y * 0.999 + 0.001                      # two elementwise kernels
        return y

    def gemm():
        y = x
        for _ in range(kernels // 20):
            y = (y @ w) @ w_back
        return y
    return {"small": graphed(small), "gemm": graphed(gemm)}


class Copies:
    """One copy of `rows` rows of `row_bytes` three ways (COPIES); the method of each name launches one
    on the current stream. `host` and `device` move random rows of a pool of 4 x rows to random slots of
    `cache` [1, rows + 1, E] (slot = plan_slot[0, i] gets pool row plan_unit[0, i]); `engine` copies
    the pool's first rows, contiguous, into `staging`. The pool is pinned on a GPU."""

    def __init__(self, rows: int, row_bytes: int, programs: int, device, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        elems = row_bytes // 2
        pool = torch.randn(4 * rows, elems, generator=gen).to(torch.bfloat16)
        self.pool = pool.pin_memory() if device.type == "cuda" else pool
        self.pool_on_device = pool.to(device)
        self.cache = torch.zeros(1, rows + 1, elems, dtype=torch.bfloat16, device=device)
        self.staging = torch.empty(rows, elems, dtype=torch.bfloat16, device=device)
        self.plan_unit = torch.randperm(4 * rows, generator=gen)[:rows].to(torch.int32)[None].to(device)
        self.plan_slot = torch.randperm(rows, generator=gen).to(torch.int32)[None].to(device)
        self.counts = torch.tensor([[0, rows]], dtype=torch.int32, device=device)
        self.streams = torch.zeros(1, dtype=torch.int32, device=device)
        self.host_base = torch.zeros(1, dtype=torch.int64, device=device)
        self.programs = programs

    def host(self) -> None:
        fetch_rows(self.plan_unit, self.plan_slot, self.counts, self.streams, self.host_base, self.pool, self.cache,
                   self.programs)

    def device(self) -> None:
        fetch_rows(self.plan_unit, self.plan_slot, self.counts, self.streams, self.host_base, self.pool_on_device,
                   self.cache, self.programs)

    def engine(self) -> None:
        self.staging.copy_(self.pool[:self.staging.shape[0]], non_blocking=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, nargs="+", default=[4, 16], help="the copy kernel's programs")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--kernels", type=int, default=200, help="kernels in a chain (small; a tenth as many GEMMs)")
    ap.add_argument("--rows", type=int, default=16384, help="rows a copy moves (default 16384)")
    ap.add_argument("--row-bytes", type=int, default=1152, help="bytes a row (default 1152, DSA's latent)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    bad = [f"--{name} {getattr(args, name)}" for name in ("batch", "hidden", "kernels", "rows", "reps")
           if getattr(args, name) < 1] + [f"--programs {p}" for p in args.programs if p < 1]
    if bad:
        ap.error(f"{', '.join(bad)}: expected a positive count")
    if args.row_bytes < 4 or args.row_bytes % 4:
        ap.error(f"--row-bytes {args.row_bytes}: expected a positive multiple of 4 (the copy moves 4-byte words)")
    if not torch.cuda.is_available():
        raise SystemExit("scripts.copy_interference times kernels beside copies on a CUDA GPU; none here")
    device = torch.device("cuda")
    side = torch.cuda.Stream()
    graphs = chains(args.batch, args.hidden, args.kernels, device)
    alone = {name: median_us(g.replay, args.reps) for name, g in graphs.items()}
    print(f"batch {args.batch}, hidden {args.hidden}; chains alone: "
          + ", ".join(f"{name} {us:.0f} us" for name, us in alone.items()))
    print(f"{'copy':>8} {'programs':>8} {'GB/s':>6} | " + " | ".join(f"{name + ' us':>10} {'x':>5}" for name in graphs))
    for programs in args.programs:
        launches = Copies(args.rows, args.row_bytes, programs, device)
        for name in COPIES if programs == args.programs[0] else COPIES[:2]:   # the engine's has no programs
            launch = getattr(launches, name)
            launch()
            copy_us = median_us(launch, args.reps)
            cells = []
            for chain, graph in graphs.items():
                repeats = repeats_to_cover(alone[chain], copy_us)

                def beside():
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(repeats):
                            launch()
                    graph.replay()
                us = median_us(beside, args.reps)
                torch.cuda.current_stream().wait_stream(side)
                cells.append(f"{us:10.0f} {us / alone[chain]:5.2f}")
            rate = args.rows * args.row_bytes / copy_us / 1e3
            shown = "-" if name == "engine" else programs
            print(f"{name:>8} {shown:>8} {rate:6.1f} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()

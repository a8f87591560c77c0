"""What every benchmark shares: the measured H200 ceilings its figures are printed beside, and one
timer (do_bench medians with quantiles on a GPU, wall clock on the CPU interpreter)."""
import statistics
import time

import torch
import triton

HBM_BYTES_PER_S = 4.3e12        # device-to-device copy, read + write counted (DESIGN section 7: 4.27 TB/s)
MMA_FLOPS_PER_S = 790e12        # bf16 8192^3 matrix product on random data, measured on this H200
PINNED_BYTES_PER_S = 55.4e9     # pinned host <-> device copy, each way (DESIGN section 7)


def timer_name(cudagraph: bool) -> str:
    """How `time_us` times, as result rows record it: "cudagraph" or "do_bench" on a GPU,
    "wall_clock" on the CPU (its p20 and p80 are then the min and max of 3 calls)."""
    if not torch.cuda.is_available():
        return "wall_clock"
    return "cudagraph" if cudagraph else "do_bench"


def time_us(fn, cudagraph: bool = False) -> tuple[float, float, float]:
    """Median, p20 and p80 of fn's time in microseconds (do_bench on the GPU, wall clock on the CPU).
    cudagraph: time graph replays (do_bench_cudagraph), which leaves out host launch overhead."""
    if torch.cuda.is_available():
        # do_bench_cudagraph runs fn on a stream of its own, which does not wait for the inputs being
        # made on the current one: unfinished rows read as garbage indices (an illegal address on the
        # H200 at DSA batch 128)
        torch.cuda.synchronize()
        if cudagraph:           # every timed graph on one side of the graph-count switch (below)
            pass_graph_switch()
        bench = triton.testing.do_bench_cudagraph if cudagraph else triton.testing.do_bench
        median, p20, p80 = bench(fn, quantiles=[0.5, 0.2, 0.8])
        return median * 1e3, p20 * 1e3, p80 * 1e3
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times), min(times), max(times)


# On the H200 (torch 2.11, driver 580), once PyTorch has captured 4 CUDA graphs in a process, every graph it
# captured replays slower (+2 ms per 61-layer decode step, the GPU idling between kernels; results/notes/
# graphs.md). Benchmarks that compare graphed runs pass that switch first, so every run sits on its slow side.
GRAPHS_BEFORE_SWITCH = 3
_graph_switch_passed = False


def pass_graph_switch() -> None:
    """Capture, replay and free GRAPHS_BEFORE_SWITCH one-kernel graphs, once per process, so that every
    graph captured later in this process runs on the same (slow) side of the switch above. GPU only."""
    global _graph_switch_passed
    if _graph_switch_passed:
        return
    x = torch.zeros(1024, device="cuda")
    for _ in range(GRAPHS_BEFORE_SWITCH):
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            x.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        del graph
    _graph_switch_passed = True


def print_table(rows: list[dict], times: dict) -> None:
    """One line per mode of an attention point: time, TFLOP/s and GB/s beside the ceilings, the
    roofline fraction, and the speed-up over torch_gather. rows: one point's metric rows."""
    by_mode = {}
    for r in rows:
        by_mode.setdefault(r["mode"], {})[r["metric"]] = r["value"]
    for mode, m in by_mode.items():
        speedup = times.get("torch_gather", float("nan")) / times[mode]
        r0 = next(r for r in rows if r["mode"] == mode)
        print(f"{r0['batch']:6d} {r0['context']:8d} {mode:13s} {m['us']:10.1f} "
              f"{m['TFLOPs']:8.1f}/{MMA_FLOPS_PER_S / 1e12:.0f} {m['GBps']:8.0f}/{HBM_BYTES_PER_S / 1e9:.0f} "
              f"{m['roofline_frac']:9.3f} {speedup:10.2f}")


def metric_rows(base: dict, us: float, flops: float, nbytes: float) -> list[dict]:
    """The attention metrics of one measurement: us, TFLOP/s, GB/s and roofline_frac, the roofline
    being the larger of FLOPs at the matrix rate and bytes at the HBM rate."""
    roofline_us = max(flops / MMA_FLOPS_PER_S, nbytes / HBM_BYTES_PER_S) * 1e6
    values = [("us", us, "us"), ("TFLOPs", flops / us * 1e-6, "TFLOP/s"), ("GBps", nbytes / us * 1e-3, "GB/s"),
              ("roofline_frac", roofline_us / us, "fraction")]
    return [{**base, "metric": m, "value": v, "unit": u} for m, v, u in values]

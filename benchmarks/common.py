"""What every benchmark shares: the measured H200 ceilings its figures are printed beside, and one
timer (do_bench medians with quantiles on a GPU, wall clock on the CPU interpreter)."""
import statistics
import time

import torch
import triton

HBM_BYTES_PER_S = 4.3e12        # device-to-device copy, read + write counted (DESIGN section 7: 4.27 TB/s)
MMA_FLOPS_PER_S = 790e12        # bf16 8192^3 matrix product on random data, measured on this H200
PINNED_BYTES_PER_S = 55.4e9     # pinned host <-> device copy, each way (DESIGN section 7)


def time_us(fn, cudagraph: bool = False) -> tuple[float, float, float]:
    """Median, p20 and p80 of fn's time in microseconds (do_bench on the GPU, wall clock on the CPU).
    cudagraph: time graph replays (do_bench_cudagraph), which leaves out host launch overhead."""
    if torch.cuda.is_available():
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

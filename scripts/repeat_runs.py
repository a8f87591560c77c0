"""Is the N-th decode run of a process slower than the first? GPU only.

    python -m scripts.repeat_runs [--runs 6] [--mode resident] [--pin-gib 0] [--keep-cache] [--pause-s 0]
                                  [--graphs-first 0 --graph-kernels 4000]
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m scripts.repeat_runs    # another allocator

Runs the sweep's decode point (61 layers, DSA geometry, context 32K, CUDA graph replays) --runs times
in one process, as a sweep or scripts/ablate_decode.py does, and prints each run's median step.

Why: on the H200 (results/gpu_logs/*_pin_cycles.txt, *_ablation_rotated.txt), in each of five
processes, the 4th decode run and every one after it took about 11.5% longer per step than the first
three (17.8 -> 19.8 ms at batch 16, hidden 1024), whatever its mode, with the SM clock at 1980 MHz
and no clock event reason. Pinning host memory between runs (4 or 34 GiB, cudaHostRegister or
torch's allocator) did not move it. A comparison across that switch is off by the switch, so compare
modes run on the same side of it (the ablation's rounds do). Options to look for the cause:
--pin-gib pins and frees that much host memory before every run after the first (the host pool's
way, cudaHostRegister); --keep-cache keeps PyTorch's cached GPU blocks between runs (the sweep gives
them back, so each run's tensors land at fresh addresses); --pause-s idles the GPU before every run
after the first (does the switch follow the run count or the time?). Each run also prints a probe
of the GPU alone, outside the decode loop: a bf16 matmul's TFLOP/s and a device copy's GB/s (does
the whole GPU slow down, or only the decode?), and the host's time in each step's graph launch.

Found so far (results/gpu_logs/b75adb1f6259_*): the switch comes at run 4 as the sweep runs, with
--keep-cache and with expandable segments; with the GPU idle 60 s before each run, run 2 (73 s after
run 1) was still fast, so it follows the run count, not the time. The probe did not slow down after
it, and under torch.profiler the 4th and 5th runs' kernels took no longer in all while their steps
did (+2.3 to 3.3 ms): the GPU waits between kernels. It follows the count of CUDA graphs the process
has captured, one per decode run (results/gpu_logs/cca64e5ac5eb_graph_count_switch.txt): after 1, 2
or 3 throwaway graphs (--graphs-first) the slow runs begin 1, 2 or 3 runs earlier, the 4th graph in
each case, and 3 graphs of one kernel each do it as 4000-kernel ones do (--graph-kernels 1), while one
graph of 16000 kernels does not. The host is not what the GPU waits for: it spends 0.02-0.05 ms in
each step's launch on both sides. scripts/graph_switch.py then found that PyTorch's captures are what
count, and the driver's do not: with HISPARSE_GRAPH_CAPTURE=driver (the decode graphs captured by
the driver; the throwaway graphs stay PyTorch's, 3 of them, so the switch is never set off) every run
here took 17.05 ms, against 19.1 (results/gpu_logs/28e3b17dcb64_graph_switch_pytorch_capture.txt).
benchmarks.common.pass_graph_switch puts every graph a benchmark times past the switch.
"""
import argparse
import statistics
import time

import torch

import experiments.sweep as sweep  # first: on a CPU it turns on Triton's interpreter
from benchmarks.common import throwaway_graphs  # noqa: E402
from hisparse.host_pool import pinned_empty, unpin  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=6, help="decode runs in this process (default 6)")
    ap.add_argument("--mode", default="resident", choices=["resident", "noio", "hisparse"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=32, help="timed steps per run, after 8 warm-up steps")
    ap.add_argument("--pin-gib", type=float, default=0.0,
                    help="pin and free this many GiB of host memory before each run after the first (default 0)")
    ap.add_argument("--keep-cache", action="store_true",
                    help="keep PyTorch's cached GPU blocks between runs (the sweep empties the cache)")
    ap.add_argument("--pause-s", type=float, default=0.0,
                    help="seconds the GPU idles before each run after the first (default 0)")
    ap.add_argument("--graphs-first", type=int, default=0,
                    help="capture, replay once and free this many graphs of 4000 small kernels before the first "
                         "run (default 0): is the switch the count of graphs a process has made?")
    ap.add_argument("--graph-kernels", type=int, default=4000,
                    help="kernels in each of those graphs (default 4000, about a 61-layer decode step's)")
    ap.add_argument("--graphs-how", choices=["replayed", "captured", "kept", "shared-pool"], default="replayed",
                    help="those graphs: captured, replayed once and freed (default); captured and freed, never "
                         "replayed; replayed and kept alive through the runs; or replayed and freed, all in one "
                         "memory pool")
    args = ap.parse_args(argv)
    counts = (args.runs, args.batch, args.steps, args.graph_kernels)
    if min(counts) < 1 or min(args.pin_gib, args.pause_s, args.graphs_first) < 0:
        raise SystemExit(f"--runs, --batch, --steps, --graph-kernels >= 1 and --pin-gib, --pause-s, --graphs-first "
                         f">= 0 expected, got {args.runs}, {args.batch}, {args.steps}, {args.graph_kernels}, "
                         f"{args.pin_gib}, {args.pause_s}, {args.graphs_first}")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.keep_cache:
        sweep.release_cached_memory = lambda: None      # run_decode calls it after every run
    model = sweep.build(dict(_index=0, kind="decode", model="dsa", layers=61, hidden=args.hidden,
                             workload="dsa_100k"), torch.device("cuda"))
    point = dict(mode=args.mode, context=args.context, workload="dsa_100k",
                 cache_slots=None if args.mode == "resident" else 4096)
    kept = throwaway_graphs(args.graphs_first, args.graph_kernels, replay=args.graphs_how != "captured",
                            keep=args.graphs_how == "kept", shared_pool=args.graphs_how == "shared-pool")
    if args.graphs_first:
        print(f"  made {args.graphs_first} graphs of {args.graph_kernels} kernels ({args.graphs_how}; "
              f"{len(kept)} kept)", flush=True)
    row_elems = 1 << 20                      # 2 MiB bf16 rows
    for run in range(1, args.runs + 1):
        if args.pin_gib and run > 1:
            start = time.time()
            unpin(pinned_empty(max(1, int(args.pin_gib * 2**30) // (2 * row_elems)), row_elems, torch.bfloat16))
            print(f"  pinned and freed {args.pin_gib:g} GiB in {time.time() - start:.0f} s", flush=True)
        if args.pause_s and run > 1:
            time.sleep(args.pause_s)
        torch.manual_seed(0)
        out = sweep.run_decode(model, point, args.batch, args.steps, graph=True, warmup_steps=8)
        step, launch = statistics.median(out.step_ms), statistics.median(out.launch_ms)
        print(f"{time.strftime('%H:%M:%S')} run {run}/{args.runs}: {args.mode} batch {args.batch}, median step "
              f"{step:6.2f} ms (host in its launch {launch:5.2f} ms), "
              f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved; "
              f"probe: {gpu_probe()}", flush=True)


def gpu_probe() -> str:
    """The GPU alone: a bf16 matmul's rate and a device-to-device copy's bandwidth (median of 20 each)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(1 << 30, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    matmul_ms = median_ms(lambda: a @ a)
    copy_ms = median_ms(lambda: dst.copy_(src))
    return f"matmul {2 * 8192**3 / matmul_ms / 1e9:.0f} TFLOP/s, copy {2 * src.numel() / copy_ms / 1e6:.0f} GB/s"


if __name__ == "__main__":
    main()

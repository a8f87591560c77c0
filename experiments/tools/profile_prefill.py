"""Where one prompt's prefill time goes: `benchmarks.bench_prefill`'s study model and prompt (the
kernel prefill, `fast=True`) under torch.profiler, kernels summed by name and by part, so a
prefill's seconds can be set beside its parts' rooflines (issue 32: DSA at 32K, 8.67 s against 8).

    python -m experiments.tools.profile_prefill [--family dsa] [--context 32768] [--chunk-size 4096] [--top 20]
    python -m experiments.tools.profile_prefill --quick      # the tiny model on the CPU: checks the tool only

Prints the prefill's wall time, the device time of its kernels (their sum; below the wall time when
the GPU waits on the host), the parts (PARTS: each kernel goes to the first whose pattern its name
matches) and the kernels with the most device time. On the CPU (--quick) the "kernels" are the
profiler's CPU ops, self time, so the parts there say nothing about a GPU. A warm-up prefill compiles
the kernels first; one profiled prefill follows.
"""
import argparse
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_prefill import build
from hisparse.dsa.fp8_index import INDEX_DTYPES

# part -> pattern of the kernel names it holds, first match wins (Triton kernels by their function
# names; torch's top-k and sorts; cuBLAS / CUTLASS matrix products; the rest is elementwise work,
# copies and reductions)
PARTS = (
    ("indexer scores", r"indexer"),
    ("top-k and ordering", r"topk|TopK|radix|sort|Sort|order_picks|place_ties|gatherTopK"),
    ("sparse attention", r"sparse_mla|mla_decode|flash|fmha|attention|_attn|nsa_|quest_"),
    ("matrix products", r"gemm|Gemm|GEMM|nvjet|xmma|cutlass|cublas|aten::mm|aten::bmm|aten::addmm|aten::matmul"),
    ("elementwise, copies, reductions", r"."),
)


def part_of(name: str) -> str:
    """The PARTS entry whose pattern matches a kernel's name first."""
    return next(part for part, pattern in PARTS if re.search(pattern, name))


def kernel_times(prof, on_gpu: bool) -> dict[str, tuple[float, int]]:
    """Kernel (GPU) or op (CPU, self time) name -> (total ms, calls), from a finished profile."""
    times = {}
    for e in prof.key_averages():       # self times: an op's kernels are not counted twice
        total = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if total > 0:
            times[e.key] = (total / 1e3, e.count)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("dsa", "quest", "nsa"), default="dsa")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens (default 32768; --quick: 100)")
    ap.add_argument("--chunk-size", type=int, default=4096,
                    help="prompt tokens per prefill chunk (default 4096, bench_prefill's)")
    ap.add_argument("--top", type=int, default=20, help="kernels listed by device time (default 20)")
    ap.add_argument("--index-dtype", choices=INDEX_DTYPES, default="bf16",
                    help="how DSA stores its indexer keys (default bf16; fp8: DeepSeek-V3.2's e4m3 keys)")
    ap.add_argument("--quick", action="store_true", help="the tiny model on the CPU (Triton's interpreter)")
    args = ap.parse_args(argv)
    if args.index_dtype != "bf16" and args.family != "dsa":
        ap.error(f"--index-dtype {args.index_dtype}: DSA's indexer keys only; pass --family dsa")
    context = args.context if args.context is not None else (100 if args.quick else 32768)
    for name, value in (("--context", context), ("--chunk-size", args.chunk_size), ("--top", args.top)):
        if value < 1:
            ap.error(f"{name} {value}: expected a positive integer")
    on_gpu = torch.cuda.is_available() and not args.quick
    if not on_gpu and not args.quick:
        ap.error("the full-size profile needs a CUDA GPU; --quick profiles the tiny model on the CPU")
    device = torch.device("cuda" if on_gpu else "cpu")
    chunk = min(args.chunk_size, 16) if args.quick else args.chunk_size
    model = build(args.family, args.quick, device)
    ids = torch.randint(0, model.config.vocab_size, (1, context), device=device)

    def prefill():
        state = model.new_state(1, context, **({"index_dtype": args.index_dtype} if args.family == "dsa" else {}))
        model.prefill(ids, state, chunk, fast=True, last_logits=True)
        if on_gpu:
            torch.cuda.synchronize()

    prefill()                                       # compiles the kernels
    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        prefill()
        wall = time.perf_counter() - start
    times = kernel_times(prof, on_gpu)
    total = sum(ms for ms, _ in times.values())
    parts = {part: 0.0 for part, _ in PARTS}
    for name, (ms, _) in times.items():
        parts[part_of(name)] += ms
    what = "kernels' device time" if on_gpu else "CPU ops' self time"
    print(f"{args.family} prefill of {context} tokens in chunks of {chunk} ({args.index_dtype} indexer keys) on {device}: {wall:.3f} s wall "
          f"(under the profiler), {total / 1e3:.3f} s of {what}")
    for part, ms in parts.items():
        print(f"  {ms / 1e3:9.3f} s  {ms / max(total, 1e-9):6.1%}  {part}")
    print(f"the {min(args.top, len(times))} kernels with the most time:")
    for name, (ms, calls) in sorted(times.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {ms / 1e3:9.3f} s  {calls:7d} calls  [{part_of(name)}]  {name[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

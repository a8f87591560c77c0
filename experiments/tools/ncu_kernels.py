"""One launch of a kernel for Nsight Compute to profile (GPU only): warm up, then one call between
cudaProfilerStart and cudaProfilerStop.

    ncu --profile-from-start off --set full --import-source yes --clock-control none -o OUT/resolve \\
        python -m experiments.tools.ncu_kernels resolve --miss 0.2
    ncu ... python -m experiments.tools.ncu_kernels dsa --batch 64

`resolve`: the no-IO resolve at k = 2048, B = 4096 (issue #2's point) on benchmarks/bench_resolve.py's
workload, after 40 calls have brought its cache to the steady miss rate. `dsa`: sparse MLA decode,
128 heads, k = 2048, context 32768 (issue #3's point), on benchmarks/bench_attention_dsa.py's inputs.
`benchmarks/gpu_suite.sh` runs both under ncu when NCU=1 and writes each report's details and per-
instruction source view as text.
"""
import argparse
import sys

import torch

from benchmarks.bench_attention_dsa import SM_SCALE, make_inputs
from benchmarks.bench_resolve import Point, Workload, point_state
from hisparse.dsa import ops as dsa
from hisparse.resolve import resolve


def resolve_call(args, device):
    p = Point(args.batch, 2048, 4096, args.miss, 1152)
    state = point_state(p, p.batch, device)
    streams = torch.arange(p.batch, dtype=torch.int32, device=device)
    host = torch.empty(1, 576, dtype=torch.bfloat16, device=device)             # never read without IO
    cache = torch.empty(p.batch, p.cache_slots + 1, 576, dtype=torch.bfloat16, device=device)
    work = Workload(p, device)
    sels = work.next(41)
    for i in range(40):
        resolve(state, streams, sels[i], host, cache, fetch=False)
    return lambda: resolve(state, streams, sels[40], host, cache, fetch=False)


def dsa_call(args, device):
    gen = torch.Generator(device=device).manual_seed(0)
    q, kv, rows = make_inputs(args.batch, 32768, 128, 2048, device, gen)
    dsa.sparse_mla_decode(q, kv, rows, SM_SCALE)
    return lambda: dsa.sparse_mla_decode(q, kv, rows, SM_SCALE)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=("resolve", "dsa"))
    ap.add_argument("--batch", type=int, default=64, help="requests (default 64)")
    ap.add_argument("--miss", type=float, default=0.2, help="resolve: target miss rate (default 0.2)")
    args = ap.parse_args(argv)
    if args.batch < 1 or not 0.0 < args.miss <= 1.0:
        ap.error(f"--batch {args.batch} --miss {args.miss}: expected a batch >= 1 and a miss rate in (0, 1]")
    if not torch.cuda.is_available():
        sys.exit("experiments.tools.ncu_kernels launches kernels for Nsight Compute on a CUDA GPU; none is available here")
    device = torch.device("cuda")
    call = (resolve_call if args.kernel == "resolve" else dsa_call)(args, device)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()

"""Does pinning and unpinning large host buffers slow the decode steps that run after it? GPU only.

    python -m scripts.pin_cycles [--batch 16] [--cycles 4] [--gib 34]

Runs the sweep's resident decode point (no host pool at all), then per cycle pins a host buffer of
--gib GiB as a host pool is pinned (cudaHostRegister, hisparse.host_pool.pinned_empty), runs the
point again while it is pinned, unpins and frees it, and runs the point once more. Prints each run's
median step. Why: in scripts/ablate_decode.py runs, every mode (resident included) became about
10% slower partway through a process, at the same GPU clock, after two or three host pools had been
pinned and freed; this separates the pinning from the modes.
"""
import argparse
import statistics
import time

import torch

from experiments.sweep import build, run_decode  # first: on a CPU it turns on Triton's interpreter
from hisparse.host_pool import pinned_empty, release_cached_memory, unpin  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--cycles", type=int, default=4, help="pin-and-free cycles (default 4)")
    ap.add_argument("--gib", type=float, default=34.0, help="GiB pinned per cycle (default 34: a batch-16 pool)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--torch-pin", action="store_true",
                    help="pin with torch.empty(pin_memory=True) (cudaHostAlloc) instead of cudaHostRegister")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.cycles < 0 or args.gib <= 0 or args.batch < 1:
        raise SystemExit(f"--cycles >= 0, --gib > 0 and --batch >= 1 expected, got {args.cycles}, {args.gib}, "
                         f"{args.batch}")
    model = build(dict(_index=0, kind="decode", model="dsa", layers=61, hidden=args.hidden, workload="dsa_100k"),
                  torch.device("cuda"))
    point = dict(mode="resident", context=args.context, workload="dsa_100k", cache_slots=None)

    def timed(label: str) -> None:
        torch.manual_seed(0)
        out = run_decode(model, point, args.batch, args.steps, graph=True, warmup_steps=8)
        print(f"{time.strftime('%H:%M:%S')} {label:>32}: resident median step "
              f"{statistics.median(out.step_ms):6.2f} ms", flush=True)

    timed("before any pinning")
    row_elems = 1 << 20                      # 2 MiB bf16 rows
    for c in range(1, args.cycles + 1):
        start = time.time()
        rows = int(args.gib * 2**30) // (2 * row_elems)
        if args.torch_pin:
            buf = torch.empty(rows, row_elems, dtype=torch.bfloat16, pin_memory=True)
        else:
            buf = pinned_empty(rows, row_elems, torch.bfloat16)
        print(f"  cycle {c}: pinned {args.gib:g} GiB in {time.time() - start:.0f} s", flush=True)
        timed(f"cycle {c}, while pinned")
        if not args.torch_pin:
            unpin(buf)
        del buf
        release_cached_memory()
        timed(f"cycle {c}, after unpinning")


if __name__ == "__main__":
    main()

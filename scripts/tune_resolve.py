"""Time resolve variants (kernel layout, warps) at k = 2048, B = 4096, batch 64 (issue #2's target,
at 0.1%, 20% and 100% misses) and at a few neighbours, to place the no-IO time. GPU only.

Variants: `vector` (the kernel specialised on K and B), `flat` (unspecialised, one layout, the free
slots ranked by one scan over B), `packed` (the default: flat, ranking the free slots with one scan over
half as many elements: packed_scan).

    python -m scripts.tune_resolve
    python -m scripts.tune_resolve --variants packed --warps 8    # the default kernel only
    python -m scripts.tune_resolve --newest    # the newest rows' write: its own launch or the resolve's
                                               # (the default kernel; --variants and --warps do not apply)
"""
import argparse
import itertools
import sys

import torch

from benchmarks.bench_resolve import WRITES, Point, fill_random, time_decode_like, time_point


VARIANTS = {"vector": dict(flat_layout=False, packed_scan=False), "flat": dict(flat_layout=True, packed_scan=False),
            "packed": dict(flat_layout=True, packed_scan=True)}


def time_newest_writes(device) -> None:
    """--newest: a decode step's per-layer write of the newest rows beside the resolve, as two launches
    (`write_rows`, then the resolve) and as one (`resolve(newest=...)`), against the resolve alone:
    61 layers' streams taking turns over 32K contexts, 20% misses, no IO (bench_resolve --decode-like)."""
    print(f"{'batch':>5} {'miss':>5} {'layers':>6} {'write':>9} | {'us per layer':>12}")
    for batch, write in itertools.product((8, 16, 64), WRITES):
        r = time_decode_like(Point(batch, 2048, 4096, 0.2, 1152, min_context=32768), 61, device, 10, write=write)
        print(f"{batch:5d} {r['miss_rate']:5.3f} {61:6d} {write:>9} | {r['noio_us']:12.1f}", flush=True)
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--newest", action="store_true",
                    help="time the newest rows' write beside the resolve instead (separate launch or fused)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                    help="the kernel variants to time (default: all)")
    ap.add_argument("--warps", nargs="+", type=int, default=[8, 16], help="warps per program (default: 8 16)")
    args = ap.parse_args(argv)
    if args.newest and (args.variants != list(VARIANTS) or args.warps != [8, 16]):
        ap.error("--newest times the default kernel: --variants and --warps do not apply")
    if any(w < 1 or w & (w - 1) for w in args.warps):
        ap.error(f"--warps {args.warps}: expected powers of two")
    if not torch.cuda.is_available():
        sys.exit("scripts.tune_resolve times kernels on a CUDA GPU, and none is available here "
                 "(python -m scripts.sass_resolve compares the variants' compiled code without one)")
    device = torch.device("cuda")
    if args.newest:
        time_newest_writes(device)
        return
    points = [Point(64, 2048, 4096, m, 1152) for m in (0.001, 0.2, 1.0)] + [
        Point(1, 2048, 4096, 0.2, 1152), Point(64, 2048, 2048, 0.2, 1152), Point(64, 2048, 8192, 0.2, 1152)]
    pool_bytes = max(p.batch * p.context * p.row_bytes for p in points)
    flat = torch.empty(pool_bytes // 2, dtype=torch.float16, pin_memory=True)
    fill_random(flat, device)
    print(f"{'batch':>5} {'B':>5} {'miss':>5} {'variant':>8} {'warps':>5} | {'noio us':>8} {'total us':>9}")
    for p in points:
        host = flat[:p.batch * p.context * 576].view(p.batch * p.context, 576)
        for name, warps in itertools.product(args.variants, args.warps):
            opts = VARIANTS[name]
            try:
                r = time_point(p, host, device, 10, num_warps=warps, **opts)
            except Exception as e:  # noqa: BLE001 - report and go on with the next variant
                print(p.batch, p.cache_slots, name, warps, "failed:", repr(e)[:200])
                continue
            print(f"{p.batch:5d} {p.cache_slots:5d} {p.target_miss:5.3f} {name:>8} {warps:5d} | "
                  f"{r['noio_us']:8.1f} {r['total_us']:9.1f}", flush=True)

if __name__ == "__main__":
    main()

"""Time resolve variants (kernel options) at one point, to place the no-IO time. GPU only.

    python -m scripts.tune_resolve
"""
import itertools

import torch

from benchmarks.bench_resolve import Point, fill_random, time_point


def main():
    device = torch.device("cuda")
    points = [Point(64, 2048, 4096, 0.2, 1152), Point(1, 2048, 4096, 0.2, 1152),
              Point(64, 2048, 2048, 0.2, 1152), Point(64, 2048, 8192, 0.2, 1152)]
    pool_bytes = max(p.batch * p.context * p.row_bytes for p in points)
    flat = torch.empty(pool_bytes // 2, dtype=torch.float16, pin_memory=True)
    fill_random(flat, device)
    print(f"{'batch':>5} {'B':>5} {'sort':>5} {'warps':>5} | {'noio us':>8} {'total us':>9}")
    for p in points:
        host = flat[:p.batch * p.context * 576].view(p.batch * p.context, 576)
        for sort, warps in itertools.product((False,), (8, 16)):
            try:
                r = time_point(p, host, device, 10, sort_plan=sort, num_warps=warps)
            except Exception as e:  # noqa: BLE001 - report and go on with the next variant
                print(p.batch, p.cache_slots, sort, warps, "failed:", repr(e)[:200])
                continue
            print(f"{p.batch:5d} {p.cache_slots:5d} {sort!s:>5} {warps:5d} | {r['noio_us']:8.1f} "
                  f"{r['total_us']:9.1f}", flush=True)


if __name__ == "__main__":
    main()

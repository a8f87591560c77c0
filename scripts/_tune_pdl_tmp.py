"""Temporary: the resolve with and without programmatic dependent launch (pdl), no IO."""
import torch
from benchmarks.bench_resolve import Point, fill_random, time_decode_like, time_point

device = torch.device("cuda")
points = [(Point(b, 2048, 4096, m, 1152), 1) for b, m in ((64, 1.0), (64, 0.2), (64, 0.001), (1, 1.0), (128, 1.0))]
points += [(Point(b, 2048, 4096, m, 1152, min_context=32768), layers)
           for b, m, layers in ((64, 1.0, 1), (64, 1.0, 61), (64, 0.2, 61), (16, 0.2, 61))]
pool_bytes = max(p.batch * p.context * p.row_bytes for p, layers in points if layers == 1)
flat = torch.empty(pool_bytes // 2, dtype=torch.float16, pin_memory=True)
fill_random(flat, device)
print(f"{'batch':>5} {'miss':>5} {'context':>7} {'layers':>6} | {'pdl off us':>22} | {'pdl on us':>22} | total off / on")
for p, layers in points:
    times, totals = {False: [], True: []}, {False: [], True: []}
    for r in range(2):
        for pdl in ((False, True) if r == 0 else (True, False)):
            if p.min_context == 0:
                host = flat[:p.batch * p.context * 576].view(p.batch * p.context, 576)
                res = time_point(p, host, device, 10, pdl=pdl)
                totals[pdl].append(res["total_us"])
            else:
                res = time_decode_like(p, layers, device, 10, pdl=pdl)
            times[pdl].append(res["noio_us"])
            torch.cuda.empty_cache()
    cols = [f"{min(times[s]):5.1f} ({' '.join(f'{t:.1f}' for t in times[s])})" for s in (False, True)]
    tot = " / ".join(f"{min(totals[s]):.1f}" for s in (False, True)) if totals[False] else ""
    print(f"{p.batch:5d} {p.target_miss:5.3f} {p.context:7d} {layers:6d} | {cols[0]:>22} | {cols[1]:>22} | {tot}", flush=True)

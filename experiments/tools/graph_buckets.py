"""Probe (issue 33 item 4): one padded decode graph against a graph per batch bucket, in the serving
setting, on the H200 where a process's 4th PyTorch graph capture slows every graph's replay.

    python -m experiments.tools.graph_buckets [--prompt 4096] [--steps 40]

One process, resident DSA at its real KV geometry (61 layers, hidden 1024), the model's own
selections. Times `Server.step()` (one decode step of the running requests, no prefill pending):
1. a server of 8 lanes (one padded graph, the process's 1st capture) with 8, 4, 2 and 1 requests;
2. servers of 4, 2 and 1 lanes (bucket graphs: captures 2, 3 and 4) at their full batch;
3. the 8-lane server with 2 requests and the 4-lane one with 4 again, now past the 4th capture.
"""
import argparse
import time

import torch

from experiments.sweep import build
from hisparse.serving import Request, Server


def timed_steps(server: Server, active: int, steps: int, prompt: int, gen: torch.Generator) -> float:
    """ms a step with `active` requests decoding (prefilled first, untimed)."""
    server.open()
    reqs = [server.submit(Request(torch.randint(0, 1000, (prompt,), generator=gen), 400))
            for _ in range(active)]
    while server._prefilling is not None or server.waiting or server._pending:
        server.step()
    for _ in range(3):
        server.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        server.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / steps * 1e3
    for r in reqs:
        server.cancel(r)
    server.close()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens of every request (4096)")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per line (40)")
    args = ap.parse_args()
    model = build(dict(kind="serving", model="dsa", layers=61, hidden=1024), torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    kw = dict(max_context=args.prompt + 512, graph=True, prefill_chunk=8192)
    rows = []
    padded = Server(model, "resident", lanes=8, **kw)
    for active in (8, 4, 2, 1):
        rows.append(("padded 8 lanes, capture 1", active, timed_steps(padded, active, args.steps, args.prompt, gen)))
    buckets = {}
    for capture, lanes in enumerate((4, 2, 1), start=2):
        buckets[lanes] = Server(model, "resident", lanes=lanes, **kw)
        rows.append((f"bucket {lanes} lanes, capture {capture}", lanes,
                     timed_steps(buckets[lanes], lanes, args.steps, args.prompt, gen)))
    rows.append(("padded 8 lanes, after capture 4", 2, timed_steps(padded, 2, args.steps, args.prompt, gen)))
    rows.append(("bucket 4 lanes, after capture 4", 4, timed_steps(buckets[4], 4, args.steps, args.prompt, gen)))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, prompt {args.prompt}, resident DSA 61 layers")
    print(f"{'graph':34s} {'batch':>5s} {'ms/step':>8s}")
    for name, active, ms in rows:
        print(f"{name:34s} {active:5d} {ms:8.2f}")


if __name__ == "__main__":
    main()

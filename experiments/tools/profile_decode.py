"""Where a decode step's GPU time goes, per mode: the sweep's decode point (DSA geometry, synthetic
selections) run under torch.profiler, kernels summed by name. GPU only.

    python -m experiments.tools.profile_decode [--modes resident noio] [--batch 16] [--context 32768] [--steps 8]
                                     [--hidden 1024]

Prints, per mode, the kernels with the most total device time (prefill included: it runs once, its
kernels are the random fills and the pool copies) and each one's time per decode step, so two modes
at the same batch can be told apart kernel by kernel (issue #6: noio within 3% of resident). A mode
may be named twice (`--modes resident noio resident noio`): the repeat shows the drift between runs.
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from experiments.sweep import build, run_decode

WARMUP_STEPS = 1


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["resident", "noio"], choices=["resident", "noio", "hisparse"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (7168: DeepSeek-V3's, 62 GB of weights)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps profiled (after 1 warm-up)")
    ap.add_argument("--graph", action="store_true", help="replay the captured graph (default: eager)")
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    study = dict(_index=0, kind="decode", model="dsa", layers=args.layers, hidden=args.hidden, workload="dsa_100k")
    model = build(study, torch.device("cuda"))
    for mode in args.modes:
        point = dict(mode=mode, context=args.context, workload="dsa_100k",
                     cache_slots=None if mode == "resident" else 4096)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = run_decode(model, point, args.batch, args.steps, args.graph, warmup_steps=WARMUP_STEPS)
        steps = args.steps + WARMUP_STEPS
        tpot = out.decode_s / max(out.timed_steps, 1) * 1e3
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        events.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events)
        print(f"== {mode}, batch {args.batch}, context {args.context}: tpot {tpot:.2f} ms; "
              f"{total / 1e3:.1f} ms of kernels in all (prefill and {steps} decode steps)")
        for e in events[:args.top]:
            per_step = e.device_time_total / steps / 1e3
            print(f"  {e.device_time_total / 1e3:9.2f} ms  {e.count:6d} calls  {per_step:7.3f} ms/step  {e.key[:90]}")
        del out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Where noio's time over resident goes in the decode loop: the sweep's decode point run in variants
that each change one thing, in rounds (every variant once per round, each round starting one
variant later), GPU only.

    python -m scripts.ablate_decode [--batch 16] [--hidden 1024] [--rounds 2] [--variants ...]
    python -m scripts.ablate_decode --quick     # a tiny model on the CPU (no graphs): smoke test

Variants (DSA geometry, synthetic selections, CUDA graph replays, as experiments/configs/h200.toml):
- resident:              every latent on the GPU, no resolve;
- noio:                  the oracle: resolve without the copy; each layer's newest row is still
                         written zero-copy into the pinned host pool (and the reserved slot);
- noio-device-pool:      noio with the host pool's rows in GPU memory, so that write lands on the
                         device (noio never reads the pool while decoding, so nothing else changes);
- noio-huge-pages:       noio with the pinned pool backed by 2 MiB pages (hisparse.host_pool.HUGE_PAGES);
- noio-step-writes:      noio with the host rows stored once per step (Engine(host_write="step"));
- noio-early-resolve:    that, with each resolve started on its own stream at the selection, so it
                         overlaps the query's projection (Engine(early_resolve=True));
- hisparse, hisparse-step-writes, hisparse-early-resolve: the real mode, with the copies, each way.
If noio-device-pool closes most of the gap to resident, the cost is the per-layer zero-copy write to
the host; if noio-huge-pages does too, its address translation; noio-step-writes is the candidate
fix. The gap left is the resolve (about 9.5 us per layer and step at batch 16 under the profiler:
results/gpu_logs/*_profile_decode_*.txt), which noio-early-resolve would hide.

Tokens are checked: resident and the hisparse variants must agree (exactness), and the noio
variants of one host_write with each other (noio's differ from resident's: its slots never receive
the missed rows; with step writes they do receive the newest one). Prints each run's time per
token (mean and median step) as it goes, then per variant the median over rounds, and the median
of its ratio to resident's in the same round; with --out, appends the rows to OUT/decode_ablation.csv,
each with its `run` (the how-manieth decode run of this process it was).

Seen on the H200 (batch 16, hidden 1024, 61 layers, context 32K; results/gpu_logs/*_ablation*.txt):
every run from a process's 4th on, resident's too, took about 11.5% longer per step than the first
three, at the same clock (scripts/repeat_runs.py). Compare variants within a round, away from that
switch: there, noio took 2.8-3.1% longer than resident, the host pool in GPU memory and the step
writes changed nothing, and the early resolve took 0.3% off.
"""
import argparse
import contextlib
import re
import statistics
import time

import torch

import experiments.sweep as sweep  # first: on a CPU it turns on Triton's interpreter
from experiments.sweep import build, run_decode  # noqa: E402
import hisparse.cache  # noqa: E402
import hisparse.host_pool as host_pool  # noqa: E402
from hisparse.host_pool import HostPool  # noqa: E402
from hisparse.results import append_rows, check_out_folder  # noqa: E402

# variant -> (mode, host_write, early_resolve)
VARIANTS = {"resident": ("resident", "layer", False), "noio": ("noio", "layer", False),
            "noio-device-pool": ("noio", "layer", False), "noio-huge-pages": ("noio", "layer", False),
            "noio-step-writes": ("noio", "step", False), "noio-early-resolve": ("noio", "step", True),
            "hisparse": ("hisparse", "layer", False), "hisparse-step-writes": ("hisparse", "step", False),
            "hisparse-early-resolve": ("hisparse", "step", True)}


class DevicePool(HostPool):
    """A host pool whose rows live in GPU memory: the same regions and writes, no PCIe."""

    def __init__(self, capacity_rows: int, row_elems: int, dtype: torch.dtype = torch.bfloat16,
                 pin: bool | None = None):
        super().__init__(capacity_rows, row_elems, dtype, pin=False)   # host rows allocated, never touched
        device = "cuda" if torch.cuda.is_available() else "cpu"    # --quick: the CPU's memory
        self.rows = torch.empty(capacity_rows, row_elems, dtype=dtype, device=device)


def huge_page_kib(t: torch.Tensor) -> int:
    """KiB of the mappings holding host tensor t that transparent huge pages back (/proc/self/smaps)."""
    start, inside, kib = t.data_ptr(), False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span[1], 16) <= start < int(span[2], 16)
            elif inside and line.startswith("AnonHugePages:"):
                kib += int(line.split()[1])
    return kib


@contextlib.contextmanager
def variant_setup(variant: str, pools: list):
    """The patches a variant runs under, undone after it; each pinned pool's (GiB, huge-page GiB) is
    appended to `pools` once pinned (pinning faults every page in)."""
    saved = hisparse.cache.HostPool, host_pool.HUGE_PAGES, host_pool.pinned_empty
    pin = host_pool.pinned_empty

    def pinned_and_counted(*args, **kwargs):
        t = pin(*args, **kwargs)
        pools.append((t.numel() * t.element_size() / 2**30, huge_page_kib(t) / 2**20))
        return t

    try:
        host_pool.pinned_empty = pinned_and_counted
        if variant == "noio-device-pool":
            hisparse.cache.HostPool = DevicePool
        if variant == "noio-huge-pages":
            host_pool.HUGE_PAGES = True
        yield
    finally:
        hisparse.cache.HostPool, host_pool.HUGE_PAGES, host_pool.pinned_empty = saved


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (7168: DeepSeek-V3's, 62 GB of weights)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per run (default 32)")
    ap.add_argument("--warmup-steps", type=int, default=8, help="graph replays before timing (default 8)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every variant, interleaved (default 2)")
    ap.add_argument("--out", help="folder: append rows to OUT/decode_ablation.csv")
    ap.add_argument("--quick", action="store_true", help="a tiny model on the CPU, eager (checks the script)")
    args = ap.parse_args(argv)
    if args.out:
        check_out_folder(ap, args.out)
    if args.rounds < 1 or args.batch < 1 or args.steps < 1:
        raise SystemExit(f"--rounds, --batch and --steps must be >= 1, got {args.rounds}, {args.batch}, {args.steps}")
    if args.quick:
        device, graph, workload, cache_slots = torch.device("cpu"), False, "tiny", 16
        study = dict(_index=0, kind="decode", model="tiny:deepseek_v32", workload=workload)
        args.context, args.steps, args.warmup_steps = 40, 3, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (--quick runs a tiny model on the CPU)")
        device, graph, workload, cache_slots = torch.device("cuda"), True, "dsa_100k", 4096
        study = dict(_index=0, kind="decode", model="dsa", layers=args.layers, hidden=args.hidden, workload=workload)
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            print(f"transparent huge pages: {f.read().strip()}", flush=True)
    except OSError:
        print("transparent huge pages: not offered by this kernel", flush=True)
    model = build(study, device)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    tokens = {}
    tpot = {v: [] for v in args.variants}
    for r in range(args.rounds):
        # each round starts one variant later, so no variant always runs first (or right after another)
        shift = r % len(args.variants)
        for variant in args.variants[shift:] + args.variants[:shift]:
            mode, host_write, early_resolve = VARIANTS[variant]
            point = dict(mode=mode, context=args.context, workload=workload,
                         cache_slots=None if mode == "resident" else cache_slots)
            pools = []
            torch.manual_seed(0)        # the same random prompt KV in every run, so a mode's tokens must agree
            with variant_setup(variant, pools):
                out = run_decode(model, point, args.batch, args.steps, graph=graph, warmup_steps=args.warmup_steps,
                                 host_write=host_write, early_resolve=early_resolve)
            group = "exact" if mode in ("resident", "hisparse") else host_write
            first = tokens.setdefault(group, (variant, out.tokens))
            if not torch.equal(out.tokens, first[1]):
                raise SystemExit(f"{variant} generated other tokens than {first[0]}: a variant must not change "
                                 f"what its mode computes")
            run = sweep.decode_runs          # which decode run of this process it was
            mean_ms = out.decode_s / out.timed_steps * 1e3
            median_ms = statistics.median(out.step_ms)
            tpot[variant].append(median_ms)
            pinned = "".join(f", pinned pool {gib:.1f} GiB ({huge:.1f} GiB in huge pages)" for gib, huge in pools)
            print(f"{time.strftime('%H:%M:%S')} run {run:2d}, round {r + 1}/{args.rounds} {variant:>20}: "
                  f"tpot {mean_ms:6.2f} ms, median step {median_ms:6.2f} ms"
                  f"{pinned}", flush=True)
            if args.out:
                base = dict(bench="decode_ablation", family="dsa", mode=variant, batch=args.batch,
                            context=args.context, k=model.config.index_topk, cache_slots=point["cache_slots"] or "",
                            layers=layers, hidden=hidden, workload=workload, new_tokens=args.steps,
                            warmup_steps=args.warmup_steps, round=r + 1, run=run)
                append_rows(f"{args.out}/decode_ablation.csv",
                            [dict(base, metric="tpot_ms", value=mean_ms, unit="ms"),
                             dict(base, metric="tpot_median_ms", value=median_ms, unit="ms")])
    print(f"== batch {args.batch}, hidden {hidden}, {layers} layers, context {args.context}: "
          f"median step over {args.rounds} rounds")
    for variant, values in tpot.items():
        ratios = [v / ref for v, ref in zip(values, tpot.get("resident", []))]
        vs = f"  {statistics.median(ratios) - 1:+.1%} vs resident (median over rounds of the same round's ratio)"
        print(f"  {variant:>20} {statistics.median(values):7.2f} ms" + (vs if ratios else ""))


if __name__ == "__main__":
    main()

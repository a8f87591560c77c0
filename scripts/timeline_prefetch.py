"""Where layer-wise prefetch loses time: one decode step's kernels on a timeline (GPU only).

    python -m scripts.timeline_prefetch [--batch 32] [--hidden 1024 --intermediate 2048] [--modes sync prefetch]
    python -m scripts.timeline_prefetch --no-profile --rounds 3 --steps 24 --modes prefetch prefetch_adjacent_rows noio

Runs bench_prefetch's DSA model and workload (8 layers, 1 anchor : 3 shared) under torch.profiler,
graphed, and prints for each mode, over the timed steps (median per step):
- the copies: the anchors' own (in line) and the shared layers' (in line with `sync`, on the side
  stream with `prefetch`), each with its duration and its rate (bytes from the run's miss rate, the
  untimed first step's misses included, so the rate reads high when that step misses more);
- the compute stream's idle gaps (over 2 us) and the kernel each one precedes: with prefetch, a
  gap before a shared layer's attention is its wait for its copy, the time prefetch failed to hide;
- one step's kernels in order, with start times from the step's first resolve (`--list`);
- with two modes or more, each mode's compute kernels (the copies left out) against the last
  mode's (noio, say): the time per step each (kernel, programs) gained, split between kernels of
  under SMALL_PROGRAMS programs and the rest, and the largest increases; so a mode that slows the
  compute says which kernels pay (at DSA's 4 copy programs the step's small kernels paid most:
  results/gpu_logs/e343a3dfc6cc_timeline_prefetch_4_programs.txt).
`--no-profile` times the modes only, in turn, `--rounds` times (the profiler slows every step), and
prints each mode's median time per step and its speed against the last mode's.
The side-stream copies are told from the anchors' in-line ones by their grid (at most the prefetch
width's programs). Kernel times are CUPTI's, so they include the graph's own scheduling.
Mode `noio_copies` (this script's own) is noio with the shared layers' copies made all the same, on
the side stream right after their anchor's resolve, as prefetch makes them, but with nothing waiting
for them until the step's end (their rows are not read: noio's attention reads its slots as they
are). Against noio it says what the copies alone cost the compute beside them, without prefetch's
waits and in-line anchor copies (on the H200 at hidden 1024 batch 32, as much as prefetch's
copies: results/gpu_logs/a9751032cbcd_timeline_noio_copies.txt). Mode `prefetch_sorted` is
prefetch with the anchors' miss plans in host-address order (their resolves sort them), so that every
copy reads its rows in that order (no less cost beside the compute, and 45 us a resolve for the sort:
results/gpu_logs/5a00a38e2dd7_timeline_prefetch_sorted_plans.txt). Mode `prefetch_anchor_overlap`
times a schedule, not a correct decode: prefetch with each anchor's own copy moved beside its
attention (`overlap_anchor_fetch`), what an attention reading its missed rows from the host as they
arrive could gain. Mode `prefetch_adjacent_rows` also times a layout, not a correct decode: prefetch
with the j-th shared layer of a group reading unit u from its anchor's host row u + j
(`read_beside_anchor`), so that a group's copies read neighbouring rows of the same units, as a host
layout keeping a unit's rows of a group's layers side by side would. An optimistic stand-in: there
each layer's rows would spread over the group's region, here over the anchor's; and here a shared
layer's unit u is the row of the layer before's unit u + 1, so where consecutive units miss, the
group's copies read some rows twice (results/gpu_logs/c5da752669d9_timeline_adjacent_rows.txt).
"""
import argparse
import collections
import contextlib
import gc
import json
import os
import statistics
import tempfile
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_prefetch import MODES, TYPES, build_family, workload
from benchmarks.common import PINNED_BYTES_PER_S, pass_graph_switch
from hisparse import runtime
from hisparse.engine import Engine
from hisparse.host_pool import release_cached_memory

GAP_US = 2.0
# this script's own modes (see the docstring): name -> (engine mode, prefetch)
OWN_MODES = {"noio_copies": ("noio", False), "prefetch_sorted": ("hisparse", True),
             "prefetch_anchor_overlap": ("hisparse", True), "prefetch_adjacent_rows": ("hisparse", True)}
# kernels of fewer programs than the step's large ones (the decode kernel and the projections launch
# 128-132 on the H200) are latency-bound: they gain time beside a copy for other reasons than a lack
# of multiprocessors
SMALL_PROGRAMS = 128


def with_attention(engine: Engine, tweak) -> None:
    """Call tweak(attention) on each sparse-attention object `engine` makes (one per `generate`)."""
    make_attention = engine.runtime.attention

    def attention(*args, **kwargs):
        att = make_attention(*args, **kwargs)
        tweak(att)
        return att
    engine.runtime.attention = attention


def sort_plans(att) -> None:
    """Mode `prefetch_sorted`: the anchors' miss plans in host-address order."""
    att.sort_plan = True


def detach_copies(engine: Engine):
    """Make `engine` (noio, DSA) run each anchor's shared-layer copies on a side stream, as prefetch
    does, with nothing waiting on them until the step's end (mode `noio_copies`). Returns a function
    that puts the model's own decode back (the model outlives the engine)."""
    side = runtime.side_stream(runtime.PREFETCH_PRIORITY)                 # as prefetch's
    model = engine.model
    decode = model.decode

    def copy_beside(att):
        plain = att._slots

        def slots(layer_idx, kv, selection):
            out = plain(layer_idx, kv, selection)
            if kv.anchor_layer is None and att.shared.get(layer_idx):
                plan = att._plans[layer_idx]
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for shared in att.shared[layer_idx]:
                        shared.cache.replay_plan(plan, shared.streams.view(-1), att.prefetch_programs)
            return out
        att._slots = slots
    with_attention(engine, copy_beside)

    def decode_then_join(*args, **kwargs):
        logits = decode(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        return logits
    model.decode = decode_then_join
    return lambda: delattr(model, "decode")          # holds the model, not the engine and its pool


def overlap_anchor_fetch(att) -> None:
    """Mode `prefetch_anchor_overlap` (timing only, inexact): an anchor's resolve makes its plan
    without copying, and its own copy runs on the side stream ahead of its shared layers' copies,
    beside its attention; the layer waits for it after the attention. The attention reads its slots
    before their rows arrive, so its output is wrong: the mode times the schedule an attention that
    read its missed rows straight from the host pool, as they arrive, would have (an estimate of
    what such a fused kernel could gain), and nothing else."""
    plain_slots, plain_attend, fetched = att._slots, att.attend, {}

    def slots(layer_idx, kv, selection):
        if kv.anchor_layer is not None or att.side is None:
            return plain_slots(layer_idx, kv, selection)
        newest = getattr(kv, "newest", None)
        plan = kv.cache.resolve(kv.streams.view(-1), selection, mode="noio", check_values=att.check_values,
                                out=att._plan_buffers(layer_idx, selection), newest=newest)
        kv.newest = None
        att.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(att.side):
            # as narrow as prefetch's: the attention's 128 programs keep their multiprocessors
            kv.cache.replay_plan(plan, kv.streams.view(-1), att.prefetch_programs)
            fetched.setdefault(layer_idx, torch.cuda.Event()).record(att.side)
            for shared in att.shared.get(layer_idx, []):
                shared.cache.replay_plan(plan, shared.streams.view(-1), att.prefetch_programs)
                shared.prefetched.record(att.side)
        return plan.slots

    def attend(layer_idx, *args, **kwargs):
        out = plain_attend(layer_idx, *args, **kwargs)
        if layer_idx in fetched:
            torch.cuda.current_stream().wait_event(fetched[layer_idx])
        return out
    att._slots, att.attend = slots, attend


def read_beside_anchor(att) -> None:
    """Mode `prefetch_adjacent_rows` (timing only, inexact): the j-th shared layer of each group
    (j = 1, 2, ...) reads and writes unit u at its anchor's host row u + j, so that the copies of a
    group read neighbouring rows of the same units. Its attention then reads another unit's latents:
    the mode times what a side-by-side host layout could save the compute beside the copies, nothing
    else. Its streams are never closed (the engine drops the whole cache), so their regions' bases
    need not be put back; the rows past an anchor's region belong to other streams of the same pool."""
    for shared in att.shared.values():
        for j, kv in enumerate(shared, 1):
            base = kv.cache.state.host_base
            base[kv.streams.long()] = base[kv.anchor_streams.long()] + j


def kernels_of(trace_path: str) -> list[dict]:
    """Kernel events of a chrome trace, sorted by start: name, start and end (us), grid programs."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        grid = e.get("args", {}).get("grid", [0, 0, 0])
        out.append(dict(name=e["name"], start=float(e["ts"]), end=float(e["ts"]) + float(e["dur"]),
                        programs=grid[0] * grid[1] * grid[2]))
    return sorted(out, key=lambda k: k["start"])


def short(name: str) -> str:
    """A kernel's name without its return type's, namespaces' and arguments' noise, for printing."""
    return name.replace("(anonymous namespace)::", "").split("(")[0].split("<")[0][:48]


def steps_of(kernels: list[dict], anchors: int) -> list[list[dict]]:
    """The kernels split into decode steps at the first anchor's resolve (every `anchors`-th resolve)."""
    starts = [i for i, k in enumerate(kernels) if "_resolve_kernel" in k["name"]][::anchors]
    return [kernels[a:b] for a, b in zip(starts, starts[1:])]


def analyse(step: list[dict], side_programs: int) -> dict:
    """One step's side-stream copies and in-line copies (start from the step's first kernel, duration),
    the compute stream's gaps over GAP_US (the next kernel's start, the gap, its name) and every kernel."""
    t0 = step[0]["start"]
    side = [k for k in step if "_fetch_rows_kernel" in k["name"] and k["programs"] <= side_programs]
    main = [k for k in step if k not in side]
    inline = [k for k in main if "_fetch_rows_kernel" in k["name"]]
    gaps, busy_until = [], main[0]["end"]
    for k in main[1:]:
        if k["start"] - busy_until > GAP_US:
            gaps.append((k["start"] - t0, k["start"] - busy_until, short(k["name"])))
        busy_until = max(busy_until, k["end"])
    span = lambda k: (k["start"] - t0, k["end"] - k["start"])                # noqa: E731
    # the compute: every kernel but the copies, full names. Not told by stream: CUPTI puts a graph's
    # kernels on the streams the graph launches on, and after a fork (prefetch) the main branch's
    # kernels came on several (H200, 4afa07c777f0)
    compute = [(k["name"], k["programs"], k["end"] - k["start"]) for k in main if k not in inline]
    return dict(t0=t0, step_us=step[-1]["end"] - t0, side=[span(k) for k in side], inline=[span(k) for k in inline],
                gaps=gaps, kernels=[(*span(k), k["programs"], short(k["name"])) for k in step], compute=compute)


def compute_us(steps: list[dict]) -> dict[tuple[str, int], float]:
    """Mean time per step (us) of each (kernel, programs) on the compute stream (`analyse`'s
    `compute`: the copies left out), keyed by the kernel's full name."""
    total: dict[tuple[str, int], float] = collections.defaultdict(float)
    for step in steps:
        for name, programs, dur in step["compute"]:
            total[(name, programs)] += dur
    return {key: us / len(steps) for key, us in total.items()}


def compare_compute(mode: dict, base: dict, top: int = 12) -> list[str]:
    """Lines comparing one mode's compute times (`compute_us`) with a base mode's: the total
    gained per step, split at SMALL_PROGRAMS, then the `top` largest gains (kernel, programs, base and
    mode us per step, gain, ratio)."""
    gain = {key: mode.get(key, 0.0) - base.get(key, 0.0) for key in mode.keys() | base.keys()}
    small = sum(g for (_, programs), g in gain.items() if programs < SMALL_PROGRAMS)
    lines = [f"{sum(mode.values()):8.0f} us per step against {sum(base.values()):.0f}: {sum(gain.values()):+.0f} "
             f"(kernels of under {SMALL_PROGRAMS} programs {small:+.0f}, the rest {sum(gain.values()) - small:+.0f}); "
             f"the largest gains (kernel, programs: base / this us per step):"]
    for (name, programs), g in sorted(gain.items(), key=lambda kv: -kv[1])[:top]:
        b, m = base.get((name, programs), 0.0), mode.get((name, programs), 0.0)
        ratio = f"x{m / b:.2f}" if b > 0 else "new"
        lines.append(f"  {g:+7.1f} us  {short(name):<48} {programs:6d}: {b:7.1f} / {m:7.1f}  {ratio}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8, help="decode steps (the first two, eager and upload, untimed)")
    ap.add_argument("--modes", nargs="+", default=["sync", "prefetch"], choices=list(MODES) + list(OWN_MODES))
    ap.add_argument("--list", action="store_true", help="also print the median step's kernels in order")
    ap.add_argument("--no-profile", action="store_true",
                    help="time the modes only, without the profiler (which slows every step), in turn --rounds times")
    ap.add_argument("--rounds", type=int, default=2, help="with --no-profile: rounds over the modes (default 2)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: expected a positive integer")
    if not torch.cuda.is_available():
        raise SystemExit("scripts.timeline_prefetch profiles the GPU's kernels; no CUDA GPU here")
    fam = SimpleNamespace(family="dsa", quick=False, hidden=args.hidden, intermediate=args.intermediate)
    model, geometry, k, unit_bytes, _ = build_family(fam, True)
    anchors = TYPES.count("full")
    trace = workload(args.context, args.steps + 1, k, args.batch, False, 0)
    prompts = [torch.zeros(args.context, dtype=torch.int64)] * args.batch
    width = runtime.prefetch_programs("dsa")
    pass_graph_switch()
    print(f"DSA, hidden {args.hidden}, batch {args.batch}, context {args.context}, k {k}, B {2 * k}, "
          f"{len(TYPES)} layers ({anchors} anchors), prefetch width {width} programs")

    def run(name: str, profiler):
        """One graphed generate in mode `name` under `profiler` (a context manager); its engine and output."""
        mode, prefetch = MODES[name] if name in MODES else OWN_MODES[name]
        engine = Engine(model, mode, cache_slots=None if mode == "resident" else 2 * k, prefetch=prefetch,
                        prefill="random")
        undo = lambda: None                                             # noqa: E731
        if name == "noio_copies":
            undo = detach_copies(engine)
        elif name == "prefetch_sorted":
            with_attention(engine, sort_plans)
        elif name == "prefetch_anchor_overlap":
            with_attention(engine, overlap_anchor_fetch)
        elif name == "prefetch_adjacent_rows":
            with_attention(engine, read_beside_anchor)
        try:
            with profiler:
                out = engine.generate(prompts, args.steps + 1, graph=True, keep_logits=False, replay=trace)
        finally:
            undo()                                  # the model's own decode back, even after a failure
        return engine, out

    if args.no_profile:
        tpot: dict[str, list[float]] = collections.defaultdict(list)
        for round_ in range(args.rounds):
            for name in args.modes:
                engine, out = run(name, contextlib.nullcontext())
                tpot[name].append(out.decode_s / out.timed_steps * 1e3)
                print(f"round {round_ + 1} {name}: {tpot[name][-1]:.3f} ms per step, miss rate {out.miss_rate:.3f}",
                      flush=True)
                del engine, out
                gc.collect()
                release_cached_memory()
        base = args.modes[-1]
        for name in args.modes:
            print(f"{name:>24}: {statistics.median(tpot[name]):.3f} ms per step (median of {args.rounds}), "
                  f"{statistics.median(tpot[base]) / statistics.median(tpot[name]):.3f} of {base}'s speed")
        return
    compute: dict[str, dict] = {}          # mode -> compute_us of its steps
    for name in args.modes:
        prof = profile(activities=[ProfilerActivity.CUDA])
        engine, out = run(name, prof)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            kernels = kernels_of(path)
        copy_bytes = out.miss_rate * k * unit_bytes * args.batch          # one layer's rows per step
        steps = [analyse(s, width) for s in steps_of(kernels, anchors)[2:]]
        tpot = out.decode_s / out.timed_steps * 1e3
        print(f"\n== {name}: {tpot:.2f} ms per step (timed), miss rate {out.miss_rate:.3f}, "
              f"{copy_bytes / 1e6:.2f} MB per layer copy ({copy_bytes / PINNED_BYTES_PER_S * 1e6:.0f} us at "
              f"{PINNED_BYTES_PER_S / 1e9:.1f} GB/s); {len(steps)} profiled steps")
        med = lambda xs: statistics.median(xs) if xs else float("nan")      # noqa: E731
        print(f"   step (first resolve to last kernel): {med([s['step_us'] for s in steps]):8.0f} us")
        for label, key in (("in-line copies", "inline"), ("side-stream copies", "side")):
            durs = [d for s in steps for _, d in s[key]]
            if durs:
                print(f"   {label:<20} {len(durs) / len(steps):4.1f} per step, {med(durs):6.0f} us each "
                      f"(median; {copy_bytes / med(durs) / 1e3:5.1f} GB/s), {sum(durs) / len(steps):6.0f} us per step")
        gap_total = [sum(g for _, g, _ in s["gaps"]) for s in steps]
        print(f"   compute gaps > {GAP_US:.0f} us: {med(gap_total):6.0f} us per step (median), before:")
        by_next: dict[str, list[float]] = {}
        for s in steps:
            for _, g, nxt in s["gaps"]:
                by_next.setdefault(nxt, []).append(g)
        for nxt, gs in sorted(by_next.items(), key=lambda kv: -sum(kv[1])):
            print(f"     {sum(gs) / len(steps):7.0f} us per step over {len(gs) / len(steps):4.1f} gaps: {nxt}")
        mid = sorted(steps, key=lambda s: s["step_us"])[len(steps) // 2]
        print("   median step's side copies (start, duration us):",
              ", ".join(f"({a:.0f}, {d:.0f})" for a, d in mid["side"]) or "none")
        print("   median step's gaps (next kernel's start, gap us, its name):",
              ", ".join(f"({a:.0f}, {g:.0f}, {n})" for a, g, n in mid["gaps"]) or "none")
        if args.list:
            for start, dur, progs, kname in mid["kernels"]:
                print(f"     {start:8.1f} {dur:7.1f} {progs:6d} {kname}")
        compute[name] = compute_us(steps)
        del engine, out, prof
        gc.collect()            # a patched attention's slots function refers back to it: a cycle
        release_cached_memory()
    base = args.modes[-1]
    for name in args.modes[:-1]:
        print(f"\n== compute kernels (the copies left out), {name} against {base}:")
        print("\n".join(compare_compute(compute[name], compute[base])))


if __name__ == "__main__":
    main()

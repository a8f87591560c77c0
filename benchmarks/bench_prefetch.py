"""Layer-wise prefetch benchmark: time per output token of the graphed decode step for `resident`,
`sync` (shared layers replay their anchor's miss plan in line), `prefetch` (on a side stream while
the layers in between compute) and `noio` (the oracle). Writes OUT/prefetch.csv.

Model: glm_moe_dsa with DSA's real KV geometry (128 heads, 512 + 64 latents, k = 2048, a 64 x 128
indexer) and a small rest (by default hidden 1024, dense MLPs of 2048), 8 layers of which 2 run the
indexer and 6 share it (1 full : 3 shared). Prefetch hides copies behind the layers in between, so
how much it can hide depends on their compute: `--hidden 7168 --intermediate 18432` gives the layers
DeepSeek-V3's hidden size and dense-MLP width (about 0.9 GB of weights per layer). Selections
replay the calibrated synthetic workload (`hisparse.synthetic` preset dsa_100k at this context;
the same selections for every request), each shared layer reusing its anchor's. The preset's
first layers select almost at random, as the first 2 of the real model's 61 do; by default
(`--random-layers 0`) the 8 layers stand for the layers past those, so the anchors miss at about
the preset's average rate. With `--random-layers 2`
layer 0, an anchor, selects at random and the anchors miss about 50% of the time (the rows of
earlier runs without a `random_layers` column). The prompt's KV is random (`prefill="random"`).
`io floor` is the time the rows copied per token take at the pinned-copy rate (55.4 GB/s): every
layer copies its anchor's misses, so it bounds tpot(sync) - tpot(noio) from below.

exposed_io_ms_per_token = tpot - tpot(noio). hidden_frac estimates the share of the shared layers'
miss time that prefetch hides: (exposed(sync) - exposed(prefetch)) / shared_io, with shared_io =
exposed(sync) x shared layers / layers (every layer moves the same rows: its anchor's plan); it is
left empty (NaN) when exposed(sync) is under 5% of tpot(noio), within timing noise.
`ceiling` (metric vs_noio_ceiling, prefetch rows) is the 'vs noio' prefetch would reach if it hid
every shared layer's copy without slowing the compute: the anchors' own copies stay in line (an
anchor fetches what its own attention reads next), at their share of the io floor, so
ceiling = tpot(noio) / (tpot(noio) + io floor x anchors / layers). An estimate at the pinned-copy
rate, not a bound: in-line zero-copy reads can run a little faster.

`--family quest` and `--family nsa` time the same four modes on a Llama-style Quest model (32 query
heads, 8 KV heads, head dim 128; token_budget 2048, k = 128 pages of 16 tokens) or an NSA model (32
query heads, 4 KV heads, head dim 128; k = 16 blocks of 64 tokens), 8 sparse layers in two groups of
4 sharing a selection (`quest_selection_group` / `selection_group` 4: 2 anchors, 6 shared layers),
B = 2k by default. Their selections replay the same synthetic generator, with dsa_100k's locality
(noise, drift, layer similarity) at their unit size, per KV head (`--workload synthetic`, the
default; rows say `workload` = "dsa_100k"): a stated locality, not a calibrated one, since no
published miss rates exist for these families. `--workload model` lets each layer group select
with the model itself over the random prompt KV instead, which misses far more often (random keys
give no locality; rows say "model").

Prefetch can be timed at several copy widths in one run (`--prefetch-programs 16 32 64`, beside one
resident, sync and noio run per batch); each prefetch row records its `prefetch_programs`,
`prefetch_priority` (the side stream's: normal) and `prefetch_rows` (the rows a copy program moves a
step; a width under 32 programs moves larger tiles, `hisparse.resolve.copy_tile`).

    python -m benchmarks.bench_prefetch [--out DIR] [--quick] [--hidden 7168 --intermediate 18432]
    python -m benchmarks.bench_prefetch --family quest|nsa [--batches 8 32]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import PINNED_BYTES_PER_S, pass_graph_switch
from hisparse import runtime
from hisparse.engine import Engine
from hisparse.host_pool import release_cached_memory
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import randomize_
from hisparse.resolve import copy_tile
from hisparse.results import DEFAULT_OUT, OUT_HELP, append_rows, check_out_folder
from hisparse.synthetic import (
    batch_workload,
    per_kv_head_config,
    per_kv_head_workload,
    preset,
)
from hisparse.traces import Trace, with_anchors

TYPES = ["full", "shared", "shared", "shared"] * 2
GEOMETRY = dict(model_type="glm_moe_dsa", vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                moe_intermediate_size=256, num_hidden_layers=len(TYPES), first_k_dense_replace=len(TYPES),
                indexer_types=TYPES, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_topk=2048,
                index_head_dim=128, index_n_heads=64, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, n_group=1, topk_group=1)
QUICK = dict(GEOMETRY, hidden_size=64, intermediate_size=96, num_attention_heads=4, kv_lora_rank=32,
             q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20, index_topk=8,
             index_head_dim=32, index_n_heads=8)
FAMILY_GROUP = 4           # quest / nsa: sparse layers per shared selection (8 layers: 2 anchors, 6 shared)
QUEST = dict(model_type="llama", vocab_size=1024, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
             head_dim=128, quest_dense_layers=0, quest_selection_group=FAMILY_GROUP)
# the quick runs (tests, the CPU): one anchor and the layer sharing its selection (half the interpreter's
# time of two such pairs, the same paths)
QUEST_QUICK = dict(QUEST, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, quest_selection_group=2)
NSA = dict(model_type="nsa", vocab_size=1024, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
           head_dim=128, selection_group=FAMILY_GROUP)
NSA_QUICK = dict(NSA, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, selection_group=2, num_selected_blocks=4, sliding_window=64)
QUEST_BUDGET, QUEST_QUICK_BUDGET = 2048, 48       # tokens: k = 128 pages, and 3 in the quick run
MEASURABLE_IO = 0.05      # exposed(sync) below this share of tpot(noio): no hidden_frac
MODES = {"resident": ("resident", False), "sync": ("hisparse", False), "prefetch": ("hisparse", True),
         "noio": ("noio", False)}


def workload(context: int, steps: int, k: int, batch: int, quick: bool, random_layers: int) -> Trace:
    """The calibrated synthetic selections of a batch, each request its own draw (`batch_workload`)."""
    cfg = (preset("tiny", context=context, steps=steps, k=k, layers=len(TYPES), random_layers=random_layers,
                  sinks=1, window=2) if quick
           else preset("dsa_100k", context=context, steps=steps, layers=len(TYPES), random_layers=random_layers))
    anchors = [max(j for j in range(i + 1) if TYPES[j] == "full") for i in range(len(TYPES))]
    return with_anchors(batch_workload(cfg, batch), anchors)


def build_family(args, gpu: bool):
    """(model, its config dict, k, bytes per unit, Engine options) of --family, random weights."""
    hidden = dict(hidden_size=args.hidden, intermediate_size=args.intermediate)
    geometry = {"dsa": (QUICK, dict(GEOMETRY, **hidden)), "quest": (QUEST_QUICK, dict(QUEST, **hidden)),
                "nsa": (NSA_QUICK, dict(NSA, **hidden))}[args.family][0 if args.quick else 1]
    model = build_model(config_from_dict(dict(geometry)))
    randomize_(model, seed=0)
    dtype = torch.bfloat16 if gpu else torch.float32
    model = model.to(device="cuda" if gpu else "cpu", dtype=dtype)
    cfg, elem = model.config, dtype.itemsize
    if args.family == "dsa":
        return model, geometry, cfg.index_topk, (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * elem, {}
    if args.family == "quest":
        budget = QUEST_QUICK_BUDGET if args.quick else QUEST_BUDGET
        return model, geometry, budget // 16, 2 * 16 * cfg.head_dim * elem, {"token_budget": budget}
    return model, geometry, cfg.num_selected_blocks, 2 * cfg.selection_block_size * cfg.head_dim * elem, {}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    ap.add_argument("--quick", action="store_true", help="a tiny model on the CPU (no graphs): smoke test")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="default 8 32 64 128 (dsa), 8 32 64 (quest, nsa: their resident KV is 8x / 4x larger "
                         "per token and layer)")
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens per request (default 32768)")
    ap.add_argument("--family", choices=["dsa", "quest", "nsa"], default="dsa",
                    help="dsa (default): glm_moe_dsa; quest, nsa: 8 layers in groups of 4 sharing a selection")
    ap.add_argument("--workload", choices=["synthetic", "model"], default="synthetic",
                    help="synthetic (default): replay the dsa_100k generator's selections (for quest and nsa at "
                         "their unit size, per KV head); model (quest, nsa): the model selects over random KV")
    ap.add_argument("--cache-slots", type=int, default=None,
                    help="B (default 2k: 4096 tokens for dsa, 256 pages for quest, 32 blocks for nsa)")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per run (default 24)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    ap.add_argument("--intermediate", type=int, default=2048, help="dense MLP width (default 2048)")
    ap.add_argument("--prefetch-programs", type=int, nargs="+", default=None,
                    help="programs of a prefetch copy (default the family's: "
                         f"{', '.join(f'{f} {n}' for f, n in runtime.PREFETCH_PROGRAMS_PER_FAMILY.items())}): "
                         "more fetch faster, fewer leave more multiprocessors to the layers it overlaps; "
                         "several values time prefetch once per value")
    ap.add_argument("--random-layers", type=int, default=0, choices=(0, 1, 2),
                    help="synthetic workload: how many of the 8 layers select at random, as a real model's first "
                         "2 do (default 0)")
    args = ap.parse_args(argv)
    check_out_folder(ap, args.out)
    if args.workload == "model" and args.family == "dsa":
        ap.error("--workload model: the dsa family replays its calibrated trace; model applies to quest and nsa")
    args.prefetch_programs = args.prefetch_programs or [runtime.prefetch_width(args.family)]
    bad = [n for n in args.prefetch_programs if n < 1]
    if bad:
        ap.error(f"--prefetch-programs {bad[0]}: expected a positive integer")
    # the prefetch runs: one per copy width; the other modes run once per batch
    variants = list(dict.fromkeys(args.prefetch_programs))
    bad = [n for n in (args.batches or []) + [args.context, args.steps] if n < 1]
    if bad:
        ap.error(f"--batches, --context and --steps must be positive, got {bad[0]}")
    for name in ("hidden", "intermediate"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: expected a positive size")
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: expected at least 2 (the first decode step compiles and is not timed)")
    gpu = torch.cuda.is_available() and not args.quick
    if not gpu and not args.quick:
        ap.error("the full-size run needs a CUDA GPU; --quick runs a tiny model on the CPU")
    if args.quick and (args.batches or any(getattr(args, name) != ap.get_default(name)
                                           for name in ("context", "steps", "hidden", "intermediate"))):
        ap.error("--quick sets its own --batches, --context, --steps, --hidden and --intermediate; leave them out")
    if args.batches is None:
        args.batches = [8, 32, 64, 128] if args.family == "dsa" else [8, 32, 64]
    if args.quick:     # contexts long enough for the synthetic selections (k + 2 units at least)
        args.batches, args.context, args.steps = [2], {"dsa": 40, "quest": 96, "nsa": 400}[args.family], 4
    model, geometry, k, unit_bytes, engine_options = build_family(args, gpu)
    layers = geometry["num_hidden_layers"]
    shared = sum(model.config.selection_anchor(i) != i for i in range(layers)) if args.family != "dsa" \
        else TYPES.count("shared")
    streams_per_layer = 1 if args.family == "dsa" else geometry["num_key_value_heads"]   # per request
    if args.cache_slots is None:
        args.cache_slots = 16 if args.quick and args.family == "dsa" else 2 * k
    if args.cache_slots < k:
        ap.error(f"--cache-slots {args.cache_slots}: the cache must hold one whole selection, k = {k}")
    try:        # the synthetic selections need room for k units at this context: checked before any run
        if args.family == "dsa":
            workload(args.context, args.steps + 1, k, 1, args.quick, args.random_layers)
        elif args.workload == "synthetic":
            unit_size = 16 if args.family == "quest" else model.config.selection_block_size
            per_kv_head_config("tiny" if args.quick else "dsa_100k", unit_size, args.context, args.steps + 1, k,
                               layers, streams_per_layer, args.random_layers)
    except ValueError as exc:
        ap.error(f"--context {args.context}: {exc}")
    print(f"{args.family} model: {layers} layers ({shared} shared), k={k}, B={args.cache_slots}, context "
          f"{args.context}, hidden {geometry['hidden_size']}, MLP {geometry['intermediate_size']}, "
          f"prefetch copy programs {variants}; on {'GPU' if gpu else 'CPU'}")
    print(f"{'batch':>5} {'mode':>18} | {'tpot ms':>8} {'tok/s':>9} {'exposed IO ms':>13} {'io floor ms':>11} "
          f"{'hidden':>7} {'miss':>6} {'vs noio':>8} {'ceiling':>8}")
    if gpu:     # every timed graph past the H200's graph-count switch (benchmarks.common), not only the 4th on
        pass_graph_switch()
    for batch in args.batches:
        if args.family == "dsa":
            trace = workload(args.context, args.steps + 1, k, batch, args.quick, args.random_layers)
        elif args.workload == "synthetic":
            unit_size = 16 if args.family == "quest" else model.config.selection_block_size
            trace = per_kv_head_workload(model.config, unit_size, args.context, args.steps + 1, k, batch,
                                         "tiny" if args.quick else "dsa_100k", args.random_layers)
        else:
            trace = None
        prompts = [torch.zeros(args.context, dtype=torch.int64)] * batch
        runs = [("resident", None), ("sync", None)] + [("prefetch", v) for v in variants] + [("noio", None)]
        tpot, misses = {}, {}
        for run in runs:
            mode, prefetch = MODES[run[0]]
            engine = Engine(model, mode, cache_slots=None if mode == "resident" else args.cache_slots,
                            prefetch=prefetch, prefill="random", prefetch_programs=run[1], **engine_options)
            out = engine.generate(prompts, args.steps + 1, graph=gpu, keep_logits=False, replay=trace)
            tpot[run] = out.decode_s / out.timed_steps * 1e3
            misses[run] = out.miss_rate
            del engine, out
            release_cached_memory()      # the next mode's host pool must fit
        sync, noio = tpot[("sync", None)], tpot[("noio", None)]
        rows = []
        for run in runs:
            name, variant = run
            exposed = tpot[run] - noio
            floor = misses[run] * k * unit_bytes * batch * streams_per_layer * layers / PINNED_BYTES_PER_S * 1e3
            hidden = ceiling = float("nan")
            if name == "prefetch":
                ceiling = noio / (noio + floor * (layers - shared) / layers)
                shared_io = (sync - noio) * shared / layers
                # a share of copies lost in timing noise means nothing: defined from 5% of the step
                measurable = sync - noio >= MEASURABLE_IO * noio
                hidden = (sync - tpot[run]) / shared_io if measurable else float("nan")
            metrics = {"tpot_ms": (tpot[run], "ms"), "tokens_per_s": (batch / tpot[run] * 1e3, "tokens/s"),
                       "exposed_io_ms_per_token": (exposed, "ms"), "miss_rate": (misses[run], "fraction")}
            if name == "prefetch":
                metrics["hidden_frac"] = (hidden, "fraction")
                metrics["vs_noio_ceiling"] = (ceiling, "fraction")
            programs, priority = (variant, "normal") if variant else ("", "")     # the side stream's priority
            tile_rows = copy_tile(unit_bytes // 4, programs)[1] if variant else ""   # rows a copy program moves a step
            workload_name = "model" if args.workload == "model" else ("tiny" if args.quick else "dsa_100k")
            rows += [dict(bench="prefetch", family=args.family, mode=name, batch=batch, context=args.context, k=k,
                          cache_slots="" if name == "resident" else args.cache_slots, unit_bytes=unit_bytes,
                          layers=layers, shared_layers=shared, hidden=geometry["hidden_size"],
                          intermediate=geometry["intermediate_size"], prefetch_programs=programs,
                          prefetch_rows=tile_rows,
                          prefetch_priority=priority, workload=workload_name,
                          random_layers=args.random_layers if args.workload == "synthetic" else "", metric=m,
                          value=v, unit=u)
                     for m, (v, u) in metrics.items()]
            label = name if variant is None or len(variants) == 1 else f"{name} {programs}"
            print(f"{batch:5d} {label:>18} | {tpot[run]:8.2f} {batch / tpot[run] * 1e3:9.0f} {exposed:13.2f} "
                  f"{floor:11.2f} {hidden:7.2f} {misses[run]:6.3f} {noio / tpot[run]:8.2f} {ceiling:8.2f}", flush=True)
        append_rows(f"{args.out}/prefetch.csv", rows)
    print("targets: hidden_frac >= 0.5 and prefetch throughput >= 0.85 of noio ('vs noio' column; 'ceiling': "
          "its value with every shared copy hidden)")


if __name__ == "__main__":
    main()

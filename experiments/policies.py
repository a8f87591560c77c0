"""Replacement policies on a calibrated synthetic workload.

    python -m experiments.policies [--out DIR] [--quick]

1. Calibrate the "dsa_100k" preset's two free parameters (noise, drift) on the two published miss
   rates of DESIGN section 7 (k = 2048, 100K-token prompt, 1000 steps, averaged over the model's
   layers): 30% when only the last selection is kept, 13.4% with LRU at B = 4096. Nothing else is fit.
2. Generate the trace and simulate every policy at B in {k, 1.5k, 2k, 3k, 4k}; what the other numbers
   come out as (FIFO, random, Belady at 4096, LRU at 8192, overlaps) are predictions, not tuned.
3. Append long-format rows to DIR/policies.csv: miss rates overall and per layer, per-step curves
   (`step` column), consecutive-step and adjacent-layer overlap, reuse-gap quantiles.

`--quick` runs the "tiny" preset without calibration (seconds; for tests).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from hisparse.policies import adjacent_layer_overlap, consecutive_overlap, gap_quantiles, reuse_gaps, simulate
from hisparse.results import append_rows, check_out_folder
from hisparse.synthetic import SyntheticConfig, generate, layer_weights, preset

PUBLISHED = {"last": 0.30, "lru": 0.134}   # DESIGN section 7: B = k and LRU at B = 2k = 4096
SLOT_FACTORS = (1.0, 1.5, 2.0, 3.0, 4.0)
SLOT_POLICIES = ("lru", "fifo", "random", "belady")
CURVES = (("last", 1.0), ("lru", 1.5), ("lru", 2.0), ("lru", 4.0), ("belady", 2.0))
QUANTILES = (0.5, 0.9, 0.99)


def layer_rates(cfg: SyntheticConfig, policy: str, cache_slots: int | None) -> np.ndarray:
    """float64 [layers]: miss rate of each layer of a freshly generated trace."""
    trace = generate(cfg)
    sel, stream_layer = trace.streams()
    return simulate(sel, policy, cache_slots).per_layer(stream_layer)


def solve_increasing(f, lo: float, hi: float, target: float, tol: float,
                     max_evals: int = 16) -> tuple[float, float]:
    """(x, f(x)) with x in [lo, hi] and f(x) ~= target, for an increasing f (Illinois regula falsi).

    Where the target lies outside [f(lo), f(hi)] the nearer end is returned: the caller checks f(x).
    """
    f_lo, f_hi = f(lo) - target, f(hi) - target
    if f_lo >= 0 or f_hi <= 0:
        return (lo, f_lo + target) if f_lo >= 0 else (hi, f_hi + target)
    side = 0
    for _ in range(max_evals):
        x = hi - f_hi * (hi - lo) / (f_hi - f_lo)
        fx = f(x) - target
        if abs(fx) < tol:
            break
        if fx < 0:
            lo, f_lo = x, fx
            f_hi = f_hi / 2 if side == -1 else f_hi
            side = -1
        else:
            hi, f_hi = x, fx
            f_lo = f_lo / 2 if side == 1 else f_lo
            side = 1
    return x, fx + target


def calibrate(base: SyntheticConfig, tol: float = 5e-4) -> SyntheticConfig:
    """`base` with noise and drift fit so the layer-weighted "last" (B = k) and LRU (B = 2k) miss rates
    equal PUBLISHED. The random layers do not depend on either parameter: they are measured once and
    their share taken off the targets; the two parameters are then fit on one regular layer.
    Raises ValueError when the model cannot reach the targets (noise in [0, 1], drift in [0, 0.2])."""
    lru_slots = 2 * base.k
    total, n_random = base.model_layers or base.layers, base.random_layers
    r_last = r_lru = 0.0
    if n_random:
        randoms = replace(base, layers=n_random, model_layers=None)
        r_last = layer_rates(randoms, "last", None).mean()
        r_lru = layer_rates(randoms, "lru", lru_slots).mean()
    goal_last = (PUBLISHED["last"] * total - n_random * r_last) / (total - n_random)
    goal_lru = (PUBLISHED["lru"] * total - n_random * r_lru) / (total - n_random)
    print(f"random layers: last {r_last:.4f}, LRU@{lru_slots} {r_lru:.4f}; regular-layer goals: last "
          f"{goal_last:.4f}, LRU@{lru_slots} {goal_lru:.4f}")
    one = replace(base, layers=1, random_layers=0, model_layers=None)
    fits = {}                                                  # drift -> (noise, last miss)

    def lru_miss(drift: float) -> float:
        def last_miss(noise: float) -> float:
            return layer_rates(replace(one, noise=noise, drift=drift), "last", None)[0]
        fits[drift] = solve_increasing(last_miss, 0.0, 1.0, goal_last, tol)
        miss = layer_rates(replace(one, noise=fits[drift][0], drift=drift), "lru", lru_slots)[0]
        print(f"  drift {drift:.5f}: noise {fits[drift][0]:.4f} -> last {fits[drift][1]:.4f}, "
              f"LRU@{lru_slots} {miss:.4f}", flush=True)
        return miss

    drift, lru = solve_increasing(lru_miss, 0.0, 0.2, goal_lru, tol)
    noise, last = fits[drift]
    if abs(last - goal_last) > 4 * tol or abs(lru - goal_lru) > 4 * tol:
        raise ValueError(f"{base} cannot reach the regular-layer goals last {goal_last:.4f}, LRU@{lru_slots} "
                         f"{goal_lru:.4f}: the closest fit (noise {noise:.4f}, drift {drift:.5f}) gives "
                         f"{last:.4f}, {lru:.4f}")
    return replace(base, noise=round(float(noise), 5), drift=round(float(drift), 6))


def study(cfg: SyntheticConfig, workload: str, calibrated: bool) -> list[dict]:
    """Every row of the study for one workload (module docstring, point 3). With `calibrated`, the
    two fitted points are marked "fit" and every other miss rate "prediction"."""
    start = time.perf_counter()
    trace = generate(cfg)
    elapsed = time.perf_counter() - start
    print(f"trace {tuple(trace.selections.shape)} generated [{elapsed:.1f} s]", flush=True)
    common = {"bench": "policies", "family": "synthetic", "workload": workload, "batch": cfg.batch,
              "context": cfg.context, "k": cfg.k, "steps": cfg.steps, "layers": cfg.layers,
              "model_layers": cfg.model_layers or cfg.layers, "noise": cfg.noise, "drift": cfg.drift}
    return (miss_rows(trace, cfg, common, calibrated) + overlap_rows(trace, cfg, common)
            + reuse_rows(trace, common) + newest_rows(trace, cfg, common))


def miss_rows(trace, cfg: SyntheticConfig, common: dict, calibrated: bool) -> list[dict]:
    """Miss rate of every policy and B: layer-weighted overall, per layer, and per step for CURVES."""
    sel, stream_layer = trace.streams()
    stream_w = layer_weights(cfg)[stream_layer]
    rows = []
    for policy, factor in [("last", 1.0)] + [(p, f) for p in SLOT_POLICIES for f in SLOT_FACTORS]:
        slots = int(factor * cfg.k)
        start = time.perf_counter()
        res = simulate(sel, policy, None if policy == "last" else slots)
        elapsed = time.perf_counter() - start
        overall = res.miss_rate(stream_w)
        role = None
        if calibrated:
            role = "fit" if (policy, factor) in (("last", 1.0), ("lru", 2.0)) else "prediction"
        base = {**common, "mode": policy, "cache_slots": slots, "metric": "miss_rate", "unit": "fraction"}
        rows.append({**base, "value": overall, "calibration": role,
                     "published": PUBLISHED[policy] if role == "fit" else None})
        rows += [{**base, "value": rate, "layer": layer}
                 for layer, rate in enumerate(res.per_layer(stream_layer))]
        if (policy, factor) in CURVES:
            per_step = (res.misses * stream_w).sum(1) / (res.accesses * stream_w).sum(1)
            rows += [{**base, "value": rate, "step": step} for step, rate in enumerate(per_step)]
        note = f" (published {PUBLISHED[policy]})" if role == "fit" else f" ({role})" if role else ""
        print(f"{policy:>6} B={slots:>6}: miss rate {overall:.4f}{note} [{elapsed:.1f} s]", flush=True)
    return rows


def overlap_rows(trace, cfg: SyntheticConfig, common: dict) -> list[dict]:
    """Consecutive-step overlap (layer-weighted and per layer) and adjacent-layer overlap per layer."""
    sel, stream_layer = trace.streams()
    stream_w = layer_weights(cfg)[stream_layer]
    base = {**common, "metric": "overlap", "unit": "fraction"}
    consecutive = consecutive_overlap(sel).mean(0)                              # [S]
    overall = float((consecutive * stream_w).sum() / stream_w.sum())
    rows = [{**base, "scope": "consecutive_step", "value": overall}]
    rows += [{**base, "scope": "consecutive_step", "layer": layer,
              "value": float(consecutive[stream_layer == layer].mean())} for layer in range(trace.layers)]
    adjacent = adjacent_layer_overlap(trace.selections)
    adjacent = adjacent.reshape(trace.steps, trace.layers - 1, -1).mean((0, 2))     # [layers - 1]
    rows += [{**base, "scope": "adjacent_layer", "layer": layer + 1, "value": float(adjacent[layer])}
             for layer in range(trace.layers - 1)]
    print(f"overlap: consecutive steps {overall:.4f}, adjacent layers (l-1, l) for l >= 1: "
          f"{np.round(adjacent, 3).tolist()}")
    return rows


def reuse_rows(trace, common: dict) -> list[dict]:
    """Per layer: share of first touches and quantiles of the step gap between reuses."""
    sel, stream_layer = trace.streams()
    rows = []
    for layer in range(trace.layers):
        gaps = reuse_gaps(sel[:, stream_layer == layer])
        rows.append({**common, "metric": "first_touch_frac", "unit": "fraction", "layer": layer,
                     "value": gaps[0] / gaps.sum()})
        rows += [{**common, "metric": "reuse_gap", "unit": "steps", "layer": layer, "quantile": q,
                  "value": int(v)} for q, v in zip(QUANTILES, gap_quantiles(gaps, QUANTILES))]
    return rows


def newest_units(trace) -> np.ndarray:
    """int64 [steps, S]: the unit of the newest token of each stream at each step (streams as
    `Trace.streams()` orders them: layer, request, KV head)."""
    steps = np.arange(trace.steps)[:, None]
    newest = -(-(trace.context[None, :] + steps + 1) // trace.unit_size) - 1               # [steps, batch]
    per_request = trace.selections.shape[3] if trace.selections.ndim == 5 else 1
    return np.tile(np.repeat(newest, per_request, axis=1), (1, trace.layers))


def newest_miss_share(trace, cache_slots: int, layer_w) -> float:
    """The share of LRU's misses (B = cache_slots, layers weighted by layer_w [layers]) that are the
    newest unit of their stream and step."""
    sel, stream_layer = trace.streams()
    stream_w = np.asarray(layer_w, float)[stream_layer]
    res = simulate(sel, "lru", cache_slots, keep_slots=True)
    newest_missed = (res.missed & (sel == newest_units(trace)[:, :, None])).sum(-1)        # [steps, S]
    return float((newest_missed * stream_w).sum() / (res.misses * stream_w).sum())


def newest_rows(trace, cfg: SyntheticConfig, common: dict) -> list[dict]:
    """What the newest-token policy knob (DESIGN section 3) can save, measured with LRU at B = 2k.

    The decode step writes the newest token's row to the host pool (and the reserved slot), then
    resolves the selection like any other: a selected newest unit misses once and is fetched back.
    Inserting it on write (write-allocate, served from the reserved slot) leaves the LRU state as it
    is and saves exactly those misses: their share of all misses is the knob's whole gain."""
    share = newest_miss_share(trace, 2 * cfg.k, layer_weights(cfg))
    print(f"newest token: {share:.4%} of LRU's misses at B={2 * cfg.k} (what write-allocate would save)")
    return [{**common, "bench": "newest_token", "mode": "lru", "cache_slots": 2 * cfg.k,
             "metric": "newest_miss_share", "unit": "fraction", "value": share}]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results", help="directory for policies.csv (default results/)")
    parser.add_argument("--quick", action="store_true", help="tiny preset, no calibration (seconds)")
    args = parser.parse_args(argv)
    check_out_folder(parser, args.out)
    start = time.perf_counter()
    if args.quick:
        workload, cfg = "tiny", preset("tiny")
    else:
        workload = "dsa_100k"
        cfg = calibrate(preset(workload))
        stored = preset(workload)
        print(f"calibrated: noise {cfg.noise}, drift {cfg.drift} (preset stores noise {stored.noise}, "
              f"drift {stored.drift}) [{time.perf_counter() - start:.0f} s]", flush=True)
    rows = study(cfg, workload, calibrated=not args.quick)
    path = Path(args.out) / "policies.csv"
    append_rows(path, rows)
    print(f"{len(rows)} rows -> {path} [{time.perf_counter() - start:.0f} s]")


if __name__ == "__main__":
    main()

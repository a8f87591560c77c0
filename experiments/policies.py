"""Replacement policies on a calibrated synthetic workload.

    python -m experiments.policies [--out DIR] [--calibrate | --quick]

1. The "dsa_100k" preset's four free parameters (noise, drift, persistence and the hot set's share)
   are `calibrate`'s fit to the four published miss rates (PUBLISHED: k = 2048, 100K-token prompt,
   1000 steps, averaged over the model's layers): 30% when only the last selection is kept, 13.4%
   with LRU at B = 4096 and 6.7% at B = 8192, 17.2% with FIFO at B = 4096. Nothing else is fit.
   The study runs the stored preset, the workload the other studies replay; `--calibrate` fits
   again from its values first (a minute on one core) and runs the fit.
2. Generate the trace and simulate every policy at B in {k, 1.5k, 2k, 3k, 4k}; what the other numbers
   come out as (random, Belady, LRU and FIFO between the fitted points, overlaps) are predictions.
3. Append long-format rows to DIR/policies.csv: miss rates overall and per layer, per-step curves
   (`step` column), consecutive-step and adjacent-layer overlap, reuse-gap quantiles. Rows of a
   calibrated workload say `calibration`: "fit" for the four fitted miss rates (with `published`),
   "prediction" for every other row. A table closes the run: the fitted points beside the published
   ones, and the predictions at B = 2k beside them.

`--quick` runs the "tiny" preset without calibration (seconds; for tests).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from hisparse.policies import (
    adjacent_layer_overlap,
    consecutive_overlap,
    gap_quantiles,
    reuse_gaps,
    simulate,
)
from hisparse.results import DEFAULT_OUT, OUT_HELP, append_rows, check_out_folder
from hisparse.synthetic import PRESETS, SyntheticConfig, generate, layer_weights, preset

# (policy, B / k) -> miss rate measured on GLM-5.1's DSA trace (DESIGN section 7)
PUBLISHED = {("last", 1.0): 0.30, ("lru", 2.0): 0.134, ("lru", 4.0): 0.067, ("fifo", 2.0): 0.172}
CALIBRATED = ("dsa_100k",)                 # presets whose stored parameters are `calibrate`'s fit
FITTED = ("noise", "drift", "persistence", "hot")
BOUNDS = ((0.0, 1.0), (0.0, 0.5), (0.0, 0.98), (0.0, 0.75))   # of each FITTED parameter
DIFF_STEPS = (0.01, 0.01, 0.02, 0.05)      # finite differences of the first Jacobian
SUMMARY = (("last", 1.0), ("lru", 2.0), ("lru", 4.0), ("fifo", 2.0), ("random", 2.0), ("belady", 2.0))
SLOT_FACTORS = (1.0, 1.5, 2.0, 3.0, 4.0)
SLOT_POLICIES = ("lru", "fifo", "random", "belady")
CURVES = (("last", 1.0), ("lru", 1.5), ("lru", 2.0), ("lru", 4.0), ("belady", 2.0))
QUANTILES = (0.5, 0.9, 0.99)


def published_point_rates(cfg: SyntheticConfig) -> np.ndarray:
    """float64 [len(PUBLISHED)]: the miss rate at each published point of a freshly generated trace,
    averaged over its simulated layers (unweighted)."""
    sel, stream_layer = generate(cfg).streams()
    return np.array([simulate(sel, policy, None if policy == "last" else int(factor * cfg.k))
                     .per_layer(stream_layer).mean() for policy, factor in PUBLISHED])


def solve_broyden(f, x0, goal, diff_steps, bounds, tol: float, max_evals: int = 24):
    """(x, f(x)) with every |f(x) - goal| < tol, for f of a few parameters with a well-conditioned
    Jacobian (Broyden's method from a finite-difference Jacobian at x0; steps clipped to `bounds`).
    After max_evals evaluations the best x seen is returned: the caller checks f(x)."""
    x, goal = np.asarray(x0, float), np.asarray(goal, float)
    lower, upper = np.array(bounds, float).T
    fx = f(x)
    if np.abs(fx - goal).max() < tol:
        return x, fx
    jac = np.stack([(f(x + h * e) - fx) / h for h, e in zip(diff_steps, np.eye(len(x)))], axis=1)
    best, evals = (x, fx), 1 + len(x)
    while np.abs(fx - goal).max() >= tol and evals < max_evals:
        step = np.clip(x + np.linalg.lstsq(jac, goal - fx, rcond=None)[0], lower, upper) - x
        if not step.any():
            break
        f_new = f(x + step)
        evals += 1
        jac += np.outer(f_new - fx - jac @ step, step) / (step @ step)
        x, fx = x + step, f_new
        if np.abs(fx - goal).max() < np.abs(best[1] - goal).max():
            best = (x, fx)
    return best


def fitted_config(base: SyntheticConfig, x) -> SyntheticConfig:
    """`base` with the FITTED parameters set to x."""
    return replace(base, **dict(zip(FITTED, map(float, x))))


def calibrate(base: SyntheticConfig, tol: float = 5e-4) -> SyntheticConfig:
    """`base` with FITTED (noise, drift, persistence, hot) fit so its layer-weighted miss rates at the
    PUBLISHED points equal theirs, starting from base's own values. The random layers depend on none
    of the three: they are measured once and their share taken off the targets; the parameters are
    then fit on one regular layer. Raises ValueError when the model cannot reach the targets."""
    total, n_random = base.model_layers or base.layers, base.random_layers
    random_rates = np.zeros(len(PUBLISHED))
    if n_random:
        random_rates = published_point_rates(replace(base, layers=n_random, model_layers=None))
    goals = (np.array(list(PUBLISHED.values())) * total - n_random * random_rates) / (total - n_random)
    points = ", ".join(f"{policy}@{int(factor * base.k)}" for policy, factor in PUBLISHED)
    print(f"random layers at {points}: {np.round(random_rates, 4).tolist()}; regular-layer goals: "
          f"{np.round(goals, 4).tolist()}")
    one = replace(base, layers=1, random_layers=0, model_layers=None)

    def regular_rates(x) -> np.ndarray:
        rates = published_point_rates(fitted_config(one, x))
        print(f"  {dict(zip(FITTED, np.round(x, 5).tolist()))} -> {np.round(rates, 4).tolist()}", flush=True)
        return rates

    if not ((goals > 0) & (goals < 1)).all():
        raise ValueError(f"{base} cannot reach the regular-layer goals {np.round(goals, 4).tolist()}: "
                         f"the random layers alone leave no share in (0, 1) for the others")
    x, rates = solve_broyden(regular_rates, [getattr(base, name) for name in FITTED], goals, DIFF_STEPS,
                             BOUNDS, tol)
    if np.abs(rates - goals).max() > 4 * tol:
        raise ValueError(f"{base} cannot reach the regular-layer goals {np.round(goals, 4).tolist()}: the "
                         f"closest fit {dict(zip(FITTED, np.round(x, 5).tolist()))} gives "
                         f"{np.round(rates, 4).tolist()}")
    return fitted_config(base, [round(float(v), 5) for v in x])


def is_calibrated(cfg: SyntheticConfig, workload: str) -> bool:
    """Whether `cfg` is the stored fit of a calibrated preset (CALIBRATED)."""
    return workload in CALIBRATED and cfg == PRESETS[workload]


def study(cfg: SyntheticConfig, workload: str, calibrated: bool = False) -> list[dict]:
    """Every row of the study for one workload (module docstring, point 3). Rows are marked fit /
    prediction when `calibrated` (cfg was just fit by `calibrate`) or cfg is a calibrated preset."""
    calibrated = calibrated or is_calibrated(cfg, workload)
    start = time.perf_counter()
    trace = generate(cfg)
    elapsed = time.perf_counter() - start
    print(f"trace {tuple(trace.selections.shape)} generated [{elapsed:.1f} s]", flush=True)
    common = {"bench": "policies", "family": "synthetic", "workload": workload, "batch": cfg.batch,
              "context": cfg.context, "k": cfg.k, "steps": cfg.steps, "layers": cfg.layers,
              "model_layers": cfg.model_layers or cfg.layers, "noise": cfg.noise, "drift": cfg.drift,
              "persistence": cfg.persistence, "hot": cfg.hot, "hot_rate": cfg.hot_rate,
              "hot_lifetime": cfg.hot_lifetime}
    rows = (miss_rows(trace, cfg, common, calibrated) + overlap_rows(trace, cfg, common)
            + reuse_rows(trace, common) + newest_rows(trace, cfg, common))
    if calibrated:
        for row in rows:
            row["calibration"] = "fit" if row.get("published") is not None else "prediction"
    print_summary(rows, cfg)
    return rows


def print_summary(rows: list[dict], cfg: SyntheticConfig) -> None:
    """The miss rates at the SUMMARY points beside the published ones (fit) or marked predictions."""
    overall = {(r["mode"], r["cache_slots"]): r for r in rows if r["metric"] == "miss_rate"
               and r["bench"] == "policies" and "layer" not in r and "step" not in r}
    print(f"{'policy':>8} {'B':>6} {'measured':>9} {'published':>9}  calibration")
    for policy, factor in SUMMARY:
        row = overall[(policy, int(factor * cfg.k))]
        published = row.get("published")
        shown = "-" if published is None else f"{published:.1%}"
        print(f"{policy:>8} {row['cache_slots']:>6} {row['value']:>9.2%} {shown:>9}  "
              f"{row.get('calibration', '-')}")


def miss_rows(trace, cfg: SyntheticConfig, common: dict, calibrated: bool) -> list[dict]:
    """Miss rate of every policy and B: layer-weighted overall, per layer, and per step for CURVES.
    With `calibrated`, the overall rows at the PUBLISHED points carry the published value."""
    sel, stream_layer = trace.streams()
    stream_w = layer_weights(cfg)[stream_layer]
    rows = []
    for policy, factor in [("last", 1.0)] + [(p, f) for p in SLOT_POLICIES for f in SLOT_FACTORS]:
        slots = int(factor * cfg.k)
        start = time.perf_counter()
        res = simulate(sel, policy, None if policy == "last" else slots)
        elapsed = time.perf_counter() - start
        overall = res.miss_rate(stream_w)
        published = PUBLISHED.get((policy, factor)) if calibrated else None
        base = {**common, "mode": policy, "cache_slots": slots, "metric": "miss_rate", "unit": "fraction"}
        rows.append({**base, "value": overall, "published": published})
        rows += [{**base, "value": rate, "layer": layer}
                 for layer, rate in enumerate(res.per_layer(stream_layer))]
        if (policy, factor) in CURVES:
            per_step = (res.misses * stream_w).sum(1) / (res.accesses * stream_w).sum(1)
            rows += [{**base, "value": rate, "step": step} for step, rate in enumerate(per_step)]
        note = (f" (fit, published {published})" if published is not None
                else " (prediction)" if calibrated else "")
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


def fitted_values(cfg: SyntheticConfig) -> dict:
    return {name: getattr(cfg, name) for name in FITTED}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument("--calibrate", action="store_true", help="fit dsa_100k again from its stored values, "
                      "then run the fit (the stored preset otherwise)")
    runs.add_argument("--quick", action="store_true", help="tiny preset, no calibration (seconds)")
    args = parser.parse_args(argv)
    check_out_folder(parser, args.out, host_only=True)    # a simulation on the host: its rows say cpu anywhere
    start = time.perf_counter()
    if args.quick:
        workload, cfg = "tiny", preset("tiny")
    else:
        workload, cfg = "dsa_100k", preset("dsa_100k")
        if args.calibrate:
            cfg = calibrate(cfg)
            print(f"calibrated: {fitted_values(cfg)} (the preset stores {fitted_values(preset(workload))}) "
                  f"[{time.perf_counter() - start:.0f} s]", flush=True)
    rows = study(cfg, workload, calibrated=not args.quick)
    path = Path(args.out) / "policies.csv"
    append_rows(path, rows)
    print(f"{len(rows)} rows -> {path} [{time.perf_counter() - start:.0f} s]")


if __name__ == "__main__":
    main()

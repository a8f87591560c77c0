"""Which stored result rows a reading stands for, shared by experiments.figures (the plots) and
benchmarks.summary (the headline table): the newest row of every point, and the serving study
across concurrency levels.
"""
from __future__ import annotations

import pandas as pd

# what a rerun of a point changes (the sweep's timed and warm-up steps and how it ran, with its place in
# its process, the attention timings' spread, the DSA decode kernel that ran: `kernel` in attention.csv,
# `attention_kernel` in the sweep's files; Gluon on Hopper since 6c44dc9ab649, rows before without them;
# the prefetch copy's tile, which its width sets)
RUN_COLUMNS = ("value", "unit", "timestamp", "commit", "torch", "triton", "new_tokens", "warmup_steps",
               "us_p20", "us_p80", "graph", "prefetch", "early_resolve", "run", "kernel", "attention_kernel",
               "prefetch_rows")


def newest_per_point(frame: pd.DataFrame, run_columns: tuple[str, ...] = RUN_COLUMNS) -> pd.DataFrame:
    """On the GPU of the newest row, the newest row of every point and metric: a sweep resumed at a
    later commit adds its points to the ones already there, and a rerun replaces a point."""
    stamp = pd.to_datetime(frame["timestamp"], utc=True, format="ISO8601")
    frame = frame[frame["gpu"] == frame.loc[stamp.idxmax(), "gpu"]]
    point = [c for c in frame.columns if c not in run_columns]
    order = stamp[frame.index].sort_values(kind="stable").index
    return frame.loc[order].drop_duplicates(point, keep="last").sort_index()


def serving_study(rows: pd.DataFrame) -> pd.DataFrame:
    """Of closed-loop serving rows, those of the study across concurrency levels: of the (input_len,
    output_len, prefill_chunk, kv_dtype, kv_budget_gib) run at two levels or more, the one with the newest row (a
    study resumed at a later commit keeps its earlier points); else the one with the most levels
    (a chunk-size study beside it has one level). Points run with prefill_overlap, disaggregated or prefix_cache, or with a number of
    requests per client other than the default 2, are left out: they are compared with their twins
    (benchmarks.summary), not drawn as the study."""
    rows = rows[rows.concurrency.notna()] if "concurrency" in rows else rows.iloc[0:0]
    for twin_key in ("prefill_overlap", "disaggregated", "prefix_cache", "requests_per_client"):
        if twin_key in rows:
            rows = rows[rows[twin_key].isna()]
    if rows.empty:
        return rows
    shape = [c for c in ("input_len", "output_len", "prefill_chunk", "kv_dtype", "kv_budget_gib") if c in rows]
    key = rows[shape].astype(object).fillna("-").astype(str).agg("/".join, axis=1)   # pandas 3: str keeps NaN
    levels = rows.groupby(key).concurrency.nunique()
    studies = levels[levels >= 2]
    if len(studies) > 1 and "timestamp" in rows:
        stamp = pd.to_datetime(rows["timestamp"], utc=True, format="ISO8601")
        return rows[key == stamp[key.isin(studies.index)].groupby(key).max().idxmax()]
    return rows[key == levels.idxmax()]

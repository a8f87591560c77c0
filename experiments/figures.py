"""Figures drawn from the long-format CSVs under results/ alone (DESIGN section 9); no kernel runs.

    python -m experiments.figures [--results DIR] [--out DIR] [--device NAME]   # default results/, results/figures/

Every figure is written as PNG and PDF. A CSV accumulates runs, on GPUs and on CPUs (the sweep's
default run on a machine without one): a figure draws a GPU's rows where its file has any, since the
real numbers come from a GPU, and the CPU's otherwise (and a full-size workload's over the "tiny"
test preset's); `--device NAME` (as the rows' `gpu` column names it, e.g. cpu) draws that device's.
Of those, each figure plots, per bench, the rows of the newest run's commit and GPU (for the files
later runs add points to, PER_POINT: the newest row of every point on the newest row's GPU), and names
them in its title. A figure whose file or metrics are not there yet is skipped with one printed line;
one whose file is not a results CSV (one the sweep's appends would refuse, or whose value or timestamp
does not read as one) is named with what is wrong on stderr, the other figures drawn, and the command
exits 1 at the end.
Figures are built with matplotlib's object API (no pyplot, no GUI backend): PNGs are rendered by Agg,
PDFs by the PDF backend, without a creation date, so a figure redrawn from the same rows is the same
file. Each figure function takes a DataFrame of rows and returns a `matplotlib.figure.Figure`, so
notebooks can call them too.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import textwrap
from functools import partial
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from hisparse.result_selection import RUN_COLUMNS, newest_per_point, serving_study
from hisparse.results import NotResultsCSV, stored_table

MODE_LABELS = {
    "resident": "resident", "hisparse": "hierarchical", "sync": "hierarchical",
    "prefetch": "hierarchical + prefetch", "noio": "no-IO oracle", "hybrid": "hybrid",
    "triton": "triton", "torch_gather": "torch gather", "dense": "dense (all keys)",
    "lru": "LRU", "fifo": "FIFO", "random": "random", "belady": "Belady (offline optimum)",
    "last": "last selection only (B = k)",
}
_LABELS = list(dict.fromkeys(MODE_LABELS.values()))
MODE_COLORS = {mode: f"C{_LABELS.index(label) % 10}" for mode, label in MODE_LABELS.items()}
LINE_STYLES = ("-", "--", ":", "-.")
DECODE_MODES = ("resident", "hisparse", "sync", "prefetch", "noio")
DECODE_KEYS = ("family", "mode", "cache_slots", "kv_dtype")   # what tells decode lines apart
PREFETCH_MODEL_KEYS = ("random_layers", "hidden", "intermediate")   # bench_prefetch's model options
ATTENTION_MODES = ("triton", "torch_gather", "dense")
# columns the figures compute with or place on an axis: a cell that is not a number refuses its file
NUMERIC_COLUMNS = ("batch", "context", "k", "cache_slots", "concurrency", "layers", "hidden", "intermediate",
                   "random_layers", "step", "target_miss", "kv_budget_gib", "run")


class MissingData(Exception):
    """The rows a figure needs are not in the results: the figure is skipped."""


class Refused(Exception):
    """Raised by draw_all once it has drawn what it could: `problems` names each CSV that is not a
    results file (NotResultsCSV) and what is wrong with it; `written`, the files it wrote."""

    def __init__(self, problems: dict[str, str], written: list[Path]):
        super().__init__("; ".join(f"{path} is not a results CSV: {why}" for path, why in problems.items()))
        self.problems, self.written = problems, written


# ----------------------------------------------------------------------------------------------
# rows


def newest(frame: pd.DataFrame) -> pd.DataFrame:
    """Per bench, the rows of the commit and GPU of the newest row (by timestamp)."""
    stamp = pd.to_datetime(frame["timestamp"], utc=True, format="ISO8601")
    keep = pd.Series(False, index=frame.index)
    for _, rows in frame.groupby("bench", sort=False):
        last = frame.loc[stamp[rows.index].idxmax()]
        keep |= (frame["bench"] == last["bench"]) & (frame["commit"] == last["commit"]) & (
            frame["gpu"] == last["gpu"])
    return frame[keep]


# files whose runs add points to earlier ones (the sweep resumes across commits; a benchmark rerun at
# a few batches or with another timer), read per point rather than per run; with the columns a rerun
# of a point may add or change in that file (bench_prefetch's variant: older rows lack it, and
# `default_prefetch_variant` keeps the default one only)
# hisparse.runtime's defaults for DSA (the figures draw DSA's prefetch rows), and DSA's earlier default
# copy widths (32 from 7bbb095b7367 to 5970ba755d44, then 16 until bb4a71085805): a point not run at
# the default is drawn from its newest run at an earlier default
PREFETCH_VARIANT = {"prefetch_programs": 4, "prefetch_priority": "normal"}
EARLIER_PREFETCH_PROGRAMS = (16, 32)
# (throughput.csv's batch is what the point's budget admitted, not part of the point: a rerun sized
# another way replaces the older batch's rows rather than being drawn beside them)
PER_POINT = {"decode.csv": (), "throughput.csv": ("batch",), "prefetch.csv": tuple(PREFETCH_VARIANT),
             "attention.csv": (), "serving.csv": ()}


def default_prefetch_variant(frame: pd.DataFrame) -> pd.DataFrame:
    """bench_prefetch's rows as the figures read them: prefetch with the default copy width and stream
    priority (or from before those were options; a point without a run at today's default width is
    read from its runs at earlier defaults, the newest of them), the other variants being tuning
    runs; runs from before `random_layers` had the first anchor select at random, as --random-layers
    2 does now.
    DSA's rows only: the figures draw the glm_moe_dsa model (`--family quest / nsa` rows are summed
    up by benchmarks/summary.py)."""
    if "random_layers" in frame:
        frame = frame.assign(random_layers=frame["random_layers"].fillna(2))
    keep = frame["family"].fillna("dsa") == "dsa" if "family" in frame else pd.Series(True, index=frame.index)
    if "prefetch_priority" in frame:
        priority = frame["prefetch_priority"]
        keep &= priority.isna() | (priority.astype(str) == PREFETCH_VARIANT["prefetch_priority"])
    if "prefetch_programs" in frame:
        programs = pd.to_numeric(frame["prefetch_programs"], errors="coerce")
        default = programs == PREFETCH_VARIANT["prefetch_programs"]
        keep &= programs.isna() | default | programs.isin(EARLIER_PREFETCH_PROGRAMS)
        # where a point has a run at today's default width, its runs at earlier ones give way
        point = [c for c in frame.columns if c not in RUN_COLUMNS + tuple(PREFETCH_VARIANT)]
        has_default = (default & keep).groupby([frame[c] for c in point], dropna=False).transform("any")
        keep &= default | ~has_default
    return frame[keep]


def default_decode_method(frame: pd.DataFrame) -> pd.DataFrame:
    """The sweep's decode rows as the figures read them: those run the default way, not the stored rows
    of the retired `early_resolve` variant (results/notes/investigations.md); a file holding only
    variant rows is drawn as it is."""
    if "early_resolve" not in frame:
        return frame
    default = frame[frame["early_resolve"].fillna(False).astype(str).str.lower() != "true"]
    return default if not default.empty else frame


def on_device(frames: dict[str, pd.DataFrame], device: str | None) -> dict[str, pd.DataFrame]:
    """Each file's rows of one device for the whole figure: `device` (a `gpu` value, e.g. "NVIDIA H200"
    or "cpu"), or by default any GPU's where one of the figure's files has some (real numbers come from
    a GPU), else the CPU's; a file without rows of it is left out, as a missing one is. Within a file, a
    full-size workload's rows over the "tiny" test preset's (the default sweep's smoke run) unless a
    device is named."""
    if device is None:
        any_gpu = any((frame["gpu"] != "cpu").any() for frame in frames.values())
        keep = {name: frame[(frame["gpu"] != "cpu") == any_gpu] for name, frame in frames.items()}
    else:
        keep = {name: frame[frame["gpu"] == device] for name, frame in frames.items()}
        if frames and all(frame.empty for frame in keep.values()):
            found = sorted({gpu for frame in frames.values() for gpu in frame["gpu"]})
            raise MissingData(f"{' and '.join(frames)} have no rows of device {device!r} (they have {found})")
    out = {}
    for name, frame in keep.items():
        if frame.empty:
            continue
        if device is None and "workload" in frame:
            full = frame["workload"] != "tiny"
            frame = frame[full] if full.any() else frame
        out[name] = frame
    return out


def read_csv(path: Path) -> pd.DataFrame:
    """The rows of the results CSV at `path`, as pandas reads them. NotResultsCSV where it is not one:
    what the appends refuse (hisparse.results.stored_table: not UTF-8 text, a header without bench,
    metric, value and unit, a row wider or narrower than it; a folder), a value or a NUMERIC_COLUMNS cell
    that is not a number, a timestamp that is not ISO 8601 (or none). MissingData where it has no rows or
    lacks a column the figures read."""
    if not path.is_file():        # read_results asks only whether it exists
        raise NotResultsCSV(path, "it is a folder, not a file" if path.is_dir() else "it is not a regular file")
    header, body, _ = stored_table(path)
    if not header:
        raise MissingData(f"{path} is empty")
    if not body:
        raise MissingData(f"{path} has no rows")
    try:
        frame = pd.read_csv(path, encoding="utf-8-sig")
    except (pd.errors.ParserError, ValueError) as exc:
        raise NotResultsCSV(path, f"pandas cannot read it ({exc})") from None
    lines = list(body)

    def refuse_where(bad: pd.Series, problem) -> None:
        if bad.any():
            first = bad.to_numpy().argmax()
            count = f" ({bad.sum()} such lines)" if bad.sum() > 1 else ""
            raise NotResultsCSV(path, problem(lines[first], frame.iloc[first]) + count)
    value = pd.to_numeric(frame["value"], errors="coerce")
    refuse_where(value.isna() & frame["value"].notna(),
                 lambda line, row: f"line {line}: value {row['value']!r} is not a number")
    for column in (c for c in NUMERIC_COLUMNS if c in frame):
        number = pd.to_numeric(frame[column], errors="coerce")
        refuse_where(number.isna() & frame[column].notna(),
                     lambda line, row: f"line {line}: {column} {row[column]!r} is not a number")
    if "timestamp" in frame:
        stamp = pd.to_datetime(frame["timestamp"], utc=True, format="ISO8601", errors="coerce")
        refuse_where(frame["timestamp"].isna(), lambda line, row: f"line {line} has no timestamp")
        refuse_where(stamp.isna(), lambda line, row: f"line {line}: timestamp {row['timestamp']!r} is not an "
                                                     f"ISO 8601 time")
    absent = [c for c in ("gpu", "commit", "timestamp") if c not in frame]
    if absent:
        raise MissingData(f"{path} has no {absent[0]!r} column (DESIGN section 9's long format)")
    return frame.assign(value=value)


def read_results(results: Path, names: tuple[str, ...], device: str | None = None) -> pd.DataFrame:
    """The rows of each CSV in `names` that exists under `results` (`read_csv`), on one device (`on_device`),
    concatenated: the newest run's (`newest`), or for PER_POINT files the newest row of each point
    (`newest_per_point`)."""
    frames = {}
    for name in names:
        if (results / name).exists():
            frames[str(results / name)] = read_csv(results / name)
    picked = []
    for path, frame in on_device(frames, device).items():
        name = Path(path).name
        if name == "prefetch.csv":
            frame = default_prefetch_variant(frame)
        elif name == "decode.csv":
            frame = default_decode_method(frame)
        picked.append(newest_per_point(frame, RUN_COLUMNS + PER_POINT[name]) if name in PER_POINT
                      else newest(frame))
    if not picked:
        raise MissingData(f"{' and '.join(str(results / n) for n in names)} not found")
    return pd.concat(picked, ignore_index=True)


def select(frame: pd.DataFrame, metrics, modes=None) -> pd.DataFrame:
    """Rows of `metrics` (and of `modes`, if given); MissingData names whatever is absent."""
    rows = frame[frame["metric"].isin(metrics)]
    if modes is not None:
        rows = rows[rows["mode"].isin(modes)]
    absent = [m for m in metrics if m not in set(rows["metric"])]
    if absent:
        scope = f" for modes {', '.join(modes)}" if modes is not None else ""
        raise MissingData(f"no rows of metric {', '.join(absent)}{scope}")
    return rows


def without(rows: pd.DataFrame, *columns: str) -> pd.DataFrame:
    """Rows where each of `columns` is empty (an overall value, not a per-layer or per-step one)."""
    for column in columns:
        if column in rows:
            rows = rows[rows[column].isna()]
    return rows


def provenance(rows: pd.DataFrame, width: int = 110) -> str:
    """'GPU, commit C' (or 'commits C1, C2') per GPU in `rows`, wrapped to `width` characters (a figure's
    title: about 13 a figure inch)."""
    parts = []
    for gpu, commits in rows.groupby("gpu", sort=False)["commit"]:
        commits = list(dict.fromkeys(commits))
        parts.append(f"{gpu}, commit{'s' if len(commits) > 1 else ''} {', '.join(map(str, commits))}")
    return "\n".join(textwrap.wrap("; ".join(parts), width=width))


# ----------------------------------------------------------------------------------------------
# drawing helpers


def new_figure(title: str, rows: pd.DataFrame, nrows: int, ncols: int) -> tuple[Figure, list]:
    fig = Figure(figsize=(4.3 * ncols, 3.3 * nrows + 0.6), layout="constrained")
    fig.suptitle(f"{title}\n{provenance(rows, width=int(13 * 4.3 * ncols))}", fontsize=10)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def tokens(n: float) -> str:
    return f"{n / 1024:g}K" if n >= 1024 else f"{n:g}"


def describe(column: str, value) -> str:
    """A key value as a legend reads it; empty where the parameter does not apply."""
    if pd.isna(value):
        return ""
    if column == "mode":
        return MODE_LABELS.get(value, value)
    if column == "context":
        return f"context {tokens(value)}"
    if column == "cache_slots":
        return f"B={int(value)}"
    if column == "layers":
        return f"{int(value)} layers"
    if column == "intermediate":
        return f"MLP {int(value)}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)                    # a column with empty cells reads as floats
    return f"{column} {value}"


def plot_lines(ax, rows: pd.DataFrame, x: str, keys: tuple[str, ...], marker: str = "o",
               by_mode: bool = True) -> None:
    """One line of value vs `x` per combination of `keys` (medians of repeated rows); only keys
    that vary appear in the labels. With `by_mode` a mode keeps its colour in every figure and the
    other keys change the line style. A line of one point gets a larger marker."""
    keys = [k for k in keys if k in rows and rows[k].nunique(dropna=False) > 1]
    only_mode = rows["mode"].iloc[0] if "mode" in rows and rows["mode"].nunique() == 1 else None
    points = rows.groupby(keys + [x], dropna=False)["value"].median().reset_index()
    groups = points.groupby(keys, dropna=False) if keys else [((), points)]
    styles = {}
    for key, line in groups:
        values = dict(zip(keys, key))
        label = ", ".join(filter(None, (describe(k, v) for k, v in values.items()))) or None
        style = {}
        if by_mode:
            rest = tuple(v for k, v in values.items() if k != "mode")
            style["linestyle"] = styles.setdefault(rest, LINE_STYLES[len(styles) % len(LINE_STYLES)])
            style["color"] = MODE_COLORS.get(values.get("mode", only_mode))
        single = len(line) == 1
        ax.plot(line[x], line["value"], marker="o" if single else marker, markersize=8 if single else 3,
                linewidth=1.5 if marker else 0.8, label=label, **style)
    if keys:
        place_legend(ax)


def place_legend(ax, inside_up_to: int = 4) -> None:
    """A short legend inside the axes; a longer one below them, where it hides no line."""
    if len(ax.get_legend_handles_labels()[0]) <= inside_up_to:
        ax.legend(fontsize=7)
    else:
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)


def log2_axis(ax, values, labels=str) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(values))
    ax.set_xticks(ticks, [labels(t) for t in ticks])
    ax.minorticks_off()


def panels_by(rows: pd.DataFrame, column: str) -> list:
    """(value, rows) per distinct value of `column`, or one panel of all rows when it is absent."""
    if column not in rows or rows[column].isna().all():
        return [(None, rows)]
    return list(rows.groupby(column, sort=True))


# ----------------------------------------------------------------------------------------------
# figures


METHOD_COLUMNS = ("new_tokens", "warmup_steps")   # how a decode point was timed
THROUGHPUT_METHOD = METHOD_COLUMNS + ("kv_budget_gib", "host_budget_gib")   # and the budgets it fills


def throughput_vs_context(frame: pd.DataFrame) -> Figure:
    """Peak generation throughput (best batch) vs input length, resident vs hierarchical (per cache
    size B where several were run); the gain printed is the best hierarchical over resident. Per
    family, only the runs timed and budgeted as its newest one (a rerun with other memory budgets
    or steps replaces the older runs rather than being drawn beside them)."""
    rows = select(frame, ["tokens_per_s"], ("resident", "hisparse"))
    if "family" in rows:
        rows = pd.concat([same_method_as_newest(part, THROUGHPUT_METHOD)
                          for _, part in rows.groupby("family", sort=False, dropna=False)])
    else:
        rows = same_method_as_newest(rows, THROUGHPUT_METHOD)
    keys = [k for k in DECODE_KEYS if k in rows] + ["context"]
    peak = rows.groupby(keys, dropna=False)["value"].max().reset_index()
    families = panels_by(peak, "family")
    fig, axes = new_figure("Peak throughput (best batch) vs input length", rows, 1, len(families))
    for ax, (family, part) in zip(axes[0], families):
        plot_lines(ax, part, "context", ("mode", "cache_slots", "kv_dtype"))
        kv = part["kv_dtype"].fillna("bf16") if "kv_dtype" in part else pd.Series("bf16", index=part.index)
        for fmt, rows_of_format in part.groupby(kv):   # each KV format's gain over its own resident
            wide = rows_of_format.pivot_table(index="context", columns="mode", values="value", aggfunc="max")
            if {"resident", "hisparse"} <= set(wide.columns):
                for context, line in wide.dropna().iterrows():   # bf16's above its line, others' below
                    ax.annotate(f"{line.hisparse / line.resident:.1f}x", (context, line.hisparse),
                                textcoords="offset points", xytext=(0, 5 if fmt == "bf16" else -11),
                                ha="center", fontsize=7)
        log2_axis(ax, part["context"], tokens)
        ax.set(title=family or "", xlabel="input length (tokens)", ylabel="tokens / s")
    return fig


def memory_per_request(frame: pd.DataFrame) -> Figure:
    """GPU memory per request vs context length."""
    rows = select(frame, ["hbm_bytes_per_request"], DECODE_MODES)
    rows = rows.assign(value=rows["value"] / 2**30)
    fig, axes = new_figure("GPU memory per request vs context length", rows, 1, 1)
    ax = axes[0][0]
    plot_lines(ax, rows, "context", DECODE_KEYS)
    log2_axis(ax, rows["context"], tokens)
    ax.set_yscale("log")
    ax.set(xlabel="context (tokens)", ylabel="HBM per request (GiB)")
    return fig


def same_method_as_newest(rows: pd.DataFrame, method: tuple[str, ...] = METHOD_COLUMNS) -> pd.DataFrame:
    """The rows timed as the newest one was (same `method` columns, empty counting as such)."""
    columns = [c for c in method if c in rows]
    if not columns or "timestamp" not in rows:
        return rows
    stamp = pd.to_datetime(rows["timestamp"], utc=True, format="ISO8601", errors="coerce")
    if stamp.isna().all():
        return rows
    newest = rows.iloc[stamp.reset_index(drop=True).idxmax()]     # skips rows without a timestamp
    keep = pd.Series(True, index=rows.index)
    for column in columns:
        keep &= rows[column].isna() if pd.isna(newest[column]) else rows[column] == newest[column]
    return rows[keep]


def tpot_and_throughput(frame: pd.DataFrame) -> Figure:
    """Time per output token and throughput vs batch: resident, hierarchical, with prefetch, no-IO;
    one column per model (`layers` and bench_prefetch's options, where the rows have them) and
    context. Within a column, only points timed as its newest row was (`new_tokens`, `warmup_steps`):
    a mode measured with another number of steps is left out rather than drawn beside it."""
    rows = select(frame, ["tpot_ms", "tokens_per_s"], DECODE_MODES)
    by = [c for c in ("layers", "context") + PREFETCH_MODEL_KEYS if c in rows and rows[c].notna().any()]
    panels = [(key, same_method_as_newest(part)) for key, part in
              (rows.groupby(by, sort=True, dropna=False) if by else [((), rows)])]
    drawn = pd.concat([part for _, part in panels])
    fig, axes = new_figure("Time per output token and throughput vs batch", drawn, 2, len(panels))
    for col, (key, part) in enumerate(panels):
        values = dict(zip(by, key if isinstance(key, tuple) else (key,)))
        size = ", ".join(filter(None, (describe(c, values[c]) for c in ("layers", "context") if c in values)))
        model = ", ".join(filter(None, (describe(c, values[c]) for c in PREFETCH_MODEL_KEYS if c in values)))
        title = "\n".join(filter(None, (size, model)))
        for ax, metric, label in zip(axes[:, col], ("tpot_ms", "tokens_per_s"), ("ms / token", "tokens / s")):
            mine = part[part["metric"] == metric]
            plot_lines(ax, mine, "batch", DECODE_KEYS)
            log2_axis(ax, mine["batch"])
            ax.set(title=title, xlabel="batch", ylabel=label)
    return fig


MEASURABLE_IO = 0.05    # benchmarks/bench_prefetch.py: no hidden share below this exposed(sync) / tpot(noio)


def prefetch_hiding(frame: pd.DataFrame) -> Figure:
    """Miss IO left exposed per token and the share prefetch hides, vs batch; a share is drawn only
    where the in-line copies cost at least 5% of the no-IO step (older rows computed it anyway)."""
    rows = select(frame, ["exposed_io_ms_per_token", "hidden_frac"])
    if "tpot_ms" in set(frame["metric"]):
        # the point; the prefetch variant is set on prefetch rows alone
        not_point = RUN_COLUMNS + ("metric", "mode", "cache_slots") + tuple(PREFETCH_VARIANT)
        at = [c for c in frame.columns if c not in not_point]
        sync = frame[(frame["metric"] == "exposed_io_ms_per_token") & (frame["mode"] == "sync")]
        noio = frame[(frame["metric"] == "tpot_ms") & (frame["mode"] == "noio")]
        share = sync.merge(noio, on=at, suffixes=("", "_noio")).assign(
            ok=lambda t: t["value"] >= MEASURABLE_IO * t["value_noio"])
        ok = rows[at].merge(share[at + ["ok"]], on=at, how="left")["ok"].fillna(True).to_numpy(bool)
        assert len(ok) == len(rows), "one sync and one noio row per point"
        rows = rows[(rows["metric"] != "hidden_frac").to_numpy() | ok]
    rows = rows[rows["mode"].isin(("sync", "prefetch", "hisparse"))]   # the modes that copy
    fig, axes = new_figure("Layer-wise prefetch: exposed IO and hidden share", rows, 1, 2)
    for ax, metric, label in zip(axes[0], ("exposed_io_ms_per_token", "hidden_frac"),
                                 ("exposed IO (ms / token)", "share of miss IO hidden")):
        mine = rows[rows["metric"] == metric]
        plot_lines(ax, mine, "batch", DECODE_KEYS + ("context", "layers", "workload") + PREFETCH_MODEL_KEYS)
        log2_axis(ax, mine["batch"])
        ax.set(xlabel="batch", ylabel=label)
    axes[0][1].axhline(0.5, color="gray", linewidth=0.8, linestyle=":", gid="reference")   # the target: half hidden
    return fig


def resolve_split(frame: pd.DataFrame) -> Figure:
    """Resolve time per call split into probe-and-scan (no-IO) and IO, vs B/k and vs batch, one
    column per miss rate. Rows: the most common row size, fetch in miss order."""
    rows = select(frame, ["noio_us", "total_us"])
    if "target_miss" not in rows:
        raise MissingData("resolve rows lack the target_miss column")
    if "plan_order" in rows:
        rows = rows[rows["plan_order"].fillna("miss") == "miss"]
    rows = rows[rows["unit_bytes"] == rows["unit_bytes"].mode()[0]]
    wide = rows.pivot_table(index=["batch", "k", "cache_slots", "target_miss"], columns="metric",
                            values="value").reset_index()
    wide["io_us"] = (wide["total_us"] - wide["noio_us"]).clip(lower=0)
    wide["ratio"] = wide["cache_slots"] / wide["k"]
    batch, ratio = wide["batch"].max(), 2.0 if (wide["ratio"] == 2).any() else wide["ratio"].min()
    misses = sorted(wide["target_miss"].unique())
    fig, axes = new_figure(f"Resolve time per call: probe-and-scan and IO (k={int(wide['k'].iloc[0])}, "
                           f"{int(rows['unit_bytes'].iloc[0])} B rows)", rows, 2, len(misses))
    for col, miss in enumerate(misses):
        at = wide[wide["target_miss"] == miss]
        for ax, x, fixed, title in ((axes[0][col], "ratio", at["batch"] == batch, f"batch {batch}"),
                                    (axes[1][col], "batch", at["ratio"] == ratio, f"B = {ratio:g}k")):
            bars = at[fixed].sort_values(x)
            where = range(len(bars))
            ax.bar(where, bars["noio_us"], label="probe and scan (no-IO)")
            ax.bar(where, bars["io_us"], bottom=bars["noio_us"], label="IO (total - no-IO)")
            ax.set_xticks(where, [f"{v:g}" for v in bars[x]])
            ax.set(title=f"miss {miss:.1%}, {title}", xlabel="B / k" if x == "ratio" else "batch",
                   ylabel="us per call")
    axes[0][0].legend(fontsize=7)
    return fig


def attention_kernels(frame: pd.DataFrame, metric: str = "us") -> Figure:
    """Attention kernels vs batch per family, triton vs torch gather vs dense, at the longest context
    the triton kernel was measured at."""
    rows = select(frame, [metric], ATTENTION_MODES)
    families = panels_by(rows, "family")
    fig, axes = new_figure(f"Sparse attention decode: {metric} vs batch", rows, 1, len(families))
    for ax, (family, part) in zip(axes[0], families):
        context = part.loc[part["mode"] == "triton", "context"].max()
        part = part[part["context"] == (context if pd.notna(context) else part["context"].max())]
        if "timer" in part:      # per mode and batch, graph replays (as the decode loop runs) if timed so
            order = (part["timer"] != "cudagraph").sort_values(kind="stable").index
            part = part.loc[order].drop_duplicates([c for c in ("mode", "batch", "kv_dtype") if c in part],
                                                   keep="first")
        plot_lines(ax, part, "batch", ("mode", "kv_dtype"))
        log2_axis(ax, part["batch"])
        if metric == "us":
            ax.set_yscale("log")
        ax.set(title=f"{family}, context {tokens(part['context'].iloc[0])}", xlabel="batch", ylabel=metric)
    return fig


def policy_miss_rates(frame: pd.DataFrame) -> Figure:
    """Miss rate vs cache size B / k per replacement policy, with the published points (fits)."""
    rows = without(select(frame, ["miss_rate"]), "layer", "step")
    rows = rows.assign(ratio=rows["cache_slots"] / rows["k"])
    workloads = panels_by(rows, "workload")
    fig, axes = new_figure("Miss rate vs cache size per policy", rows, 1, len(workloads))
    for ax, (workload, part) in zip(axes[0], workloads):
        plot_lines(ax, part, "ratio", ("mode",))
        if "published" in part and part["published"].notna().any():
            fits = part[part["published"].notna()]
            ax.scatter(fits["ratio"], fits["published"], marker="x", color="black", zorder=3,
                       label="published (fit)")
            ax.legend(fontsize=7)
        ax.set(title=f"{workload or ''} k={int(part['k'].iloc[0])}", xlabel="B / k", ylabel="miss rate")
    return fig


def miss_rate_vs_step(frame: pd.DataFrame) -> Figure:
    """Miss rate per decode step for several policies and cache sizes (step 0 starts empty)."""
    rows = select(frame, ["miss_rate"])
    if "step" not in rows or rows["step"].isna().all():
        raise MissingData("no per-step miss_rate rows (column step)")
    rows = rows[rows["step"].notna()]
    workloads = panels_by(rows, "workload")
    fig, axes = new_figure("Miss rate per decode step", rows, 1, len(workloads))
    for ax, (workload, part) in zip(axes[0], workloads):
        plot_lines(ax, part, "step", ("mode", "cache_slots"), marker="", by_mode=False)
        ax.set_yscale("log")
        ax.set(title=workload or "", xlabel="decode step", ylabel="miss rate")
    return fig


def serving_vs_concurrency(frame: pd.DataFrame) -> Figure:
    """The serving study (closed loop) against concurrency, per mode: output tokens/s, p50 and p99
    TTFT, p50 TPOT; each point's newest rows on the newest GPU, in process (rows sent over HTTP are
    left out), of the study `serving_study` picks. A graphed point that ran past its process's 4th
    graph capture (column `run` >= 4: on the H200 every replay about 11% slower, notes/graphs.md)
    is drawn hollow, marked gid "past_4th_graph"."""
    rows = serving_study(newest_per_point(in_process(frame)))
    panels = [("tokens_per_s", "output tokens / s"), ("ttft_ms_p50", "TTFT p50 (ms)"),
              ("ttft_ms_p99", "TTFT p99 (ms)"), ("tpot_ms_p50", "TPOT p50 (ms)")]
    rows = select(rows, [m for m, _ in panels])
    fig, axes = new_figure("Serving: closed loop of C clients", rows, 1, len(panels))
    past = rows.run.ge(4) & rows.graph.astype(str).eq("True") if {"run", "graph"} <= set(rows) else rows.metric.isna()
    for ax, (metric, label) in zip(axes[0], panels):
        plot_lines(ax, rows[rows.metric == metric], "concurrency", ("mode",))
        for mode, slow in rows[past & (rows.metric == metric)].groupby("mode"):
            ax.plot(slow.concurrency, slow.value, linestyle="none", marker="o", markersize=7, markerfacecolor="white",
                    markeredgecolor=MODE_COLORS.get(mode), gid="past_4th_graph")
        log2_axis(ax, rows["concurrency"], lambda c: f"{int(c)}")
        ax.set(xlabel="concurrent clients", ylabel=label)
    if past.any():
        fig.supxlabel("hollow: run past its process's 4th CUDA graph capture (every replay about 11% slower on "
                      "the H200)", fontsize=7)
    return fig


def in_process(rows: pd.DataFrame) -> pd.DataFrame:
    """Serving rows served in process (rows sent over HTTP, `transport` http, left out)."""
    return rows[rows.transport.isna() | (rows.transport == "process")] if "transport" in rows else rows


def newest_study(rows: pd.DataFrame, shape: tuple[str, ...]) -> pd.DataFrame:
    """The rows of the `shape` values (those columns present) of the newest row: one study's."""
    shape = [c for c in shape if c in rows]
    if not shape:
        return rows
    key = rows[shape].astype(object).fillna("-").astype(str).agg("/".join, axis=1)
    stamp = pd.to_datetime(rows["timestamp"], utc=True, format="ISO8601")
    return rows[key == key[stamp.idxmax()]]


def is_true(rows: pd.DataFrame, column: str) -> pd.Series:
    """Where a switch column (True or empty, as the sweep writes it) is set."""
    return rows[column].astype(str).eq("True") if column in rows else pd.Series(False, index=rows.index)


RATE_SHAPE = ("input_len", "output_len", "range_ratio", "num_prompts", "max_concurrency", "seed", "kv_budget_gib",
              "host_budget_gib", "prefill_chunk", "kv_dtype", "index_dtype", "model", "layers", "hidden", "workload")


def serving_vs_rate(frame: pd.DataFrame) -> Figure:
    """The bench_serving dialect's study (its random dataset at each `request_rate`, issue 58) against
    request rate: output tokens/s, TTFT and TPOT p50 and p99; a line per mode and setting, solid
    disaggregated (prefill elsewhere), dashed co-located. The newest study's points (its shape:
    `RATE_SHAPE`), in process; points with prefill beside decode or a prefix cache are left out. Rate
    inf (every request at once) is drawn right of the highest finite rate."""
    rows = in_process(frame)
    rows = rows[rows.request_rate.notna()] if "request_rate" in rows else rows.iloc[0:0]
    if "dataset" in rows:                                   # shared_document points carry request_rate too
        rows = rows[rows.dataset.isna() | (rows.dataset == "random")]
    rows = rows[~is_true(rows, "prefill_overlap") & ~is_true(rows, "prefix_cache")]
    if rows.empty:
        raise MissingData("no serving rows with request_rate (bench_serving's random dataset)")
    panels = [("tokens_per_s", "output tokens / s"), ("ttft_ms_p50", "TTFT p50 (ms)"), ("ttft_ms_p99", "TTFT p99 (ms)"),
              ("tpot_ms_p50", "TPOT p50 (ms)"), ("tpot_ms_p99", "TPOT p99 (ms)")]
    rows = select(rows, [m for m, _ in panels])
    rows = newest_study(rows, RATE_SHAPE)
    rates = sorted(set(rows.request_rate.astype(float)))
    finite = [r for r in rates if math.isfinite(r)]
    at = {r: r if math.isfinite(r) else 2 * max(finite, default=0.5) for r in rates}     # where inf is drawn
    first = rows.iloc[0]
    ratio = f", range ratio {first.range_ratio:g}" if "range_ratio" in rows and pd.notna(first.range_ratio) else ""
    title = (f"Serving: bench_serving random dataset, {tokens(first.input_len)} in, "
             f"{tokens(first.output_len)} out{ratio}")
    fig, axes = new_figure(title, rows, 1, len(panels))
    apart = is_true(rows, "disaggregated")
    for ax, (metric, label) in zip(axes[0], panels):
        shown = rows[rows.metric == metric]
        for (mode, disaggregated), line in shown.groupby([shown["mode"], apart[shown.index]], sort=False):
            points = line.groupby(line.request_rate.astype(float))["value"].median()
            ax.plot([at[r] for r in points.index], points.values, marker="o", markersize=3,
                    color=MODE_COLORS.get(mode), linestyle="-" if disaggregated else "--",
                    label=f"{MODE_LABELS.get(mode, mode)}, {'disaggregated' if disaggregated else 'co-located'}")
        ax.set_xscale("log")
        ax.set_xticks([at[r] for r in rates], [f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.set(xlabel="request rate (requests / s)", ylabel=label)
    place_legend(axes[0][0])                                  # the same lines in every panel: one legend
    return fig


TURN_METRIC = re.compile(r"(ttft_ms_p50|host_gib)_turn(\d+)")
TURN_SHAPE = ("first_len", "user_len", "output_len", "turns", "kv_budget_gib", "host_budget_gib", "prefill_chunk",
              "kv_dtype", "index_dtype", "model", "layers", "hidden", "workload")


def prefix_sharing(frame: pd.DataFrame) -> Figure:
    """The multi-turn study (issue 59) against turn: p50 TTFT of each turn's requests and the host
    pool's peak GiB while they ran (`host_gib_turn{t}`), a line per mode with the prefix cache (solid)
    and without (dashed); a row of panels per number of conversations. The newest study's points
    (`TURN_SHAPE`), in process."""
    rows = in_process(frame)
    rows = rows[rows.dataset == "multiturn"] if "dataset" in rows else rows.iloc[0:0]
    turn = rows.metric.str.fullmatch(TURN_METRIC.pattern)
    if rows.empty or not turn.any():
        raise MissingData("no multiturn rows of metric ttft_ms_p50_turn{t}, host_gib_turn{t}")
    rows = rows[turn]
    rows = newest_study(rows, TURN_SHAPE)
    parts = rows.metric.str.extract(TURN_METRIC.pattern)
    rows = rows.assign(quantity=parts[0], turn=parts[1].astype(int))
    first = rows.iloc[0]
    title = (f"Prefix sharing: multi-turn conversations, {tokens(first.first_len)} first prompt, "
             f"{tokens(first.user_len)} a message, {tokens(first.output_len)} an answer")
    groups = panels_by(rows, "conversations")
    fig, axes = new_figure(title, rows, len(groups), 2)
    shared = is_true(rows, "prefix_cache")
    for row, (conversations, group) in zip(axes, groups):
        for ax, (quantity, label) in zip(row, [("ttft_ms_p50", "TTFT p50 (ms)"), ("host_gib", "host GiB, peak (pool and prefix copies)")]):
            shown = group[group.quantity == quantity]
            for (mode, cached), line in shown.groupby([shown["mode"], shared[shown.index]], sort=False):
                points = line.groupby("turn")["value"].median()
                ax.plot(points.index, points.values, marker="o", markersize=3, color=MODE_COLORS.get(mode),
                        linestyle="-" if cached else "--",
                        label=f"{MODE_LABELS.get(mode, mode)}, {'prefix cache' if cached else 'no prefix cache'}")
            ax.set_xticks(sorted(set(shown.turn)))
            where = "" if conversations is None else f" ({int(conversations)} conversations)"
            ax.set(xlabel=f"turn{where}", ylabel=label)
            place_legend(ax)
    return fig


# name -> (CSV files it reads, function of their newest rows)
FIGURES = {
    "throughput_vs_context": (("throughput.csv",), throughput_vs_context),
    "memory_per_request": (("throughput.csv",), memory_per_request),
    "tpot_and_throughput": (("decode.csv", "prefetch.csv"), tpot_and_throughput),
    "prefetch_hiding": (("prefetch.csv",), prefetch_hiding),
    "resolve_split": (("resolve.csv",), resolve_split),
    "attention_us": (("attention.csv",), partial(attention_kernels, metric="us")),
    "attention_roofline": (("attention.csv",), partial(attention_kernels, metric="roofline_frac")),
    "policy_miss_rates": (("policies.csv",), policy_miss_rates),
    "miss_rate_vs_step": (("policies.csv",), miss_rate_vs_step),
    "serving_vs_concurrency": (("serving.csv",), serving_vs_concurrency),
    "serving_vs_rate": (("serving.csv",), serving_vs_rate),
    "prefix_sharing": (("serving.csv",), prefix_sharing),
}


def draw(name: str, results: str | Path = "results", device: str | None = None) -> Figure:
    """Figure `name` of FIGURES from the CSVs under `results` (`device`: see `on_device`);
    MissingData when its rows are absent."""
    files, function = FIGURES[name]
    return function(read_results(Path(results), files, device))


def draw_all(results: str | Path = "results", out: str | Path = "results/figures",
             device: str | None = None) -> list[Path]:
    """Write every figure that has its rows as OUT/NAME.png and .pdf, and return those files; print a
    line per figure (on stderr for one whose CSV is not a results file, naming it and what is wrong).
    Refused, after the other figures are drawn, where a CSV was not a results file."""
    if not Path(results).is_dir():
        raise MissingData(f"no results folder {results}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written, refused = [], {}
    for name in FIGURES:
        try:
            fig = draw(name, results, device)
        except MissingData as why:
            print(f"skipped {name}: {why}")
            continue
        except NotResultsCSV as why:
            print(f"refused {name}: {why}", file=sys.stderr)
            refused[why.path] = why.problem
            continue
        for suffix in (".png", ".pdf"):
            # no creation date in a PDF: a figure redrawn from the same rows is the same file
            fig.savefig(out / f"{name}{suffix}", dpi=150, metadata={"CreationDate": None} if suffix == ".pdf" else None)
            written.append(out / f"{name}{suffix}")
        print(f"wrote {out / name}.png and .pdf")
    if refused:
        raise Refused(refused, written)
    return written


def main(argv=None) -> int:
    """The command line: 0 once every figure is drawn or skipped, 1 where a CSV was refused."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results", help="folder of the result CSVs (default results/)")
    parser.add_argument("--out", default=None, help="folder for the figures (default RESULTS/figures/)")
    parser.add_argument("--device", default=None,
                        help="draw the rows of this device, as their gpu column names it (e.g. cpu); default: a "
                             "GPU's where a file has any, else the CPU's")
    args = parser.parse_args(argv)
    if not Path(args.results).is_dir():
        parser.error(f"--results {args.results}: no such folder (run python -m experiments.sweep first)")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a file, not a folder for the figures")   # figures import no torch
    try:
        draw_all(args.results, args.out or Path(args.results) / "figures", args.device)
    except Refused as err:
        for path in err.problems:
            print(f"error: {path} was refused: its figures are not drawn (move it aside or fix it)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Short table of the headline figures in a results folder, each beside its target.

    python -m benchmarks.summary results/
"""
import argparse
from pathlib import Path

import pandas as pd

from benchmarks.bench_prefill import TARGETS
from hisparse.result_selection import RUN_COLUMNS, newest_per_point, serving_study


def latest(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows of each benchmark's newest commit in the file. A results file accumulates runs, and the
    families in one file (attention.csv's, prefetch.csv's), and DSA's fp8 rows, are run separately, so
    each keeps its own."""
    keys = [c for c in ("bench", "family", "kv_dtype") if c in frame]   # DSA's fp8 rows are run apart too
    newest = frame.groupby(keys, dropna=False, sort=False).commit.transform("last") if keys else frame.commit.iloc[-1]
    return frame[frame.commit == newest]


def resolve_lines(frame: pd.DataFrame) -> list[str]:
    f = latest(frame)
    f = f[f.plan_order != "address"] if "plan_order" in f else f
    key = ["batch", "cache_slots", "target_miss", "unit_bytes"]
    wide = f.pivot_table(index=key, columns="metric", values="value").reset_index()
    lines = []
    noio = wide[(wide.batch == 64) & (wide.cache_slots == 4096)]
    if len(noio):
        lines.append(f"resolve noio_us, batch 64, k 2048, B 4096: max {noio.noio_us.max():.1f} us "
                     f"over miss rates (target <= 10)")
    mid = wide[(wide.unit_bytes == 1152) & (wide.target_miss == 0.2) & (wide.batch >= 16)]
    if len(mid):
        lines.append(f"resolve fetch, 1152 B rows, 20% misses, batch >= 16: min {mid.fetch_GBps.min():.1f} "
                     f"GB/s, max {mid.fetch_GBps.max():.1f} (target >= 40; pinned copy 55.4)")
    big = wide[(wide.unit_bytes >= 8192) & (wide.target_miss >= 0.2)]
    if len(big):
        lines.append(f"resolve fetch, rows >= 8 KB: min {big.fetch_GBps.min():.1f} GB/s, max "
                     f"{big.fetch_GBps.max():.1f} (target >= 45)")
    return lines


def attention_lines(frame: pd.DataFrame) -> list[str]:
    """Per family (and DSA's fp8 rows apart): the decode kernel's roofline fraction at batch >= 32
    (target 0.40; fp8 rows: goal 0.50, bar 0.41) and its speed-up over the torch gather. Mode
    `triton` is the kernel bench_attention_dsa's --backend picks (bf16 rows on Hopper: Gluon; fp8
    rows: the Triton FP8 kernel); fp8 rows' mode `gluon`, the Gluon FP8 kernel, gets a line of its own."""
    f = latest(frame)
    f = f.assign(kv_dtype=f["kv_dtype"].fillna("") if "kv_dtype" in f else "")
    lines = []
    for (family, kv), g in f.groupby(["family", "kv_dtype"]):
        name = f"{family} {kv}" if kv else family
        target = "goal >= 0.50, bar >= 0.41" if kv == "fp8" else "target >= 0.40"
        for mode in ("triton", "gluon"):                # the Gluon kernels (Hopper) where they ran
            frac = g[(g["mode"] == mode) & (g.metric == "roofline_frac") & (g.batch >= 32)]
            if len(frac):
                lines.append(f"attention {name}{' gluon' if mode == 'gluon' else ''}: roofline_frac at batch >= 32 "
                             f"min {frac.value.min():.2f} median {frac.value.median():.2f} ({target})")
        us = g[g.metric == "us"].pivot_table(index=["batch", "context"], columns="mode", values="value")
        if {"triton", "torch_gather"} <= set(us.columns):
            speed = (us.torch_gather / us.triton).dropna()
            lines.append(f"attention {name}: speed-up over torch_gather min {speed.min():.1f}x "
                         f"median {speed.median():.1f}x")
    return lines


def resolve_layers_lines(frame: pd.DataFrame) -> list[str]:
    """bench_resolve --decode-like: the no-IO call as the sweep times it, and as a decode step meets it."""
    f = latest(frame)
    noio = f[f.metric == "noio_us"].pivot_table(index=["batch", "target_miss"], columns=["layers", "context"],
                                                values="value")
    lines = []
    for (batch, miss), times in noio.iterrows():
        shown = ", ".join(f"{us:.1f} ({layers} layer{'s' if layers > 1 else ''}, context "
                          f"{f'{context // 1024}K' if context >= 1024 else context})"
                          for (layers, context), us in times.dropna().items())
        lines.append(f"resolve noio_us decode-like, batch {batch}, miss {miss:.1%}: {shown}")
    return lines


def as_read(value):
    """A CSV value as written: a column with empty cells reads its integers back as floats."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def prefetch_lines(frame: pd.DataFrame) -> list[str]:
    """Per point (batch and model) and prefetch variant: the share of the shared layers' miss time
    hidden, and prefetch's throughput over the no-IO oracle's at the same point, beside the value it
    would reach with every shared layer's copy hidden (bench_prefetch's ceiling, where recorded)."""
    f = latest(frame)
    point = [c for c in ("batch", "family", "context", "layers", "hidden", "intermediate", "random_layers") if c in f]
    variant = [c for c in ("prefetch_programs", "prefetch_priority", "prefetch_rows") if c in f]
    tpot = f[f.metric == "tpot_ms"]
    noio = tpot.loc[tpot["mode"] == "noio", point + ["value"]].rename(columns={"value": "noio"})
    table = tpot.loc[tpot["mode"] == "prefetch", point + variant + ["value"]].merge(noio, on=point, how="left")
    for metric in ("hidden_frac", "vs_noio_ceiling"):     # the ceiling: rows since it was recorded
        part = f.loc[(f["mode"] == "prefetch") & (f.metric == metric), point + variant + ["value"]]
        table = table.merge(part.rename(columns={"value": metric}), on=point + variant, how="left")
    varying = [c for c in point[1:] if table[c].nunique(dropna=False) > 1]   # several models in one run
    lines = []
    for _, row in table.iterrows():
        named = [f"{c.removeprefix('prefetch_')} {as_read(row[c])}" for c in variant if pd.notna(row[c])]
        named = [f"{c} {as_read(row[c])}" for c in varying if pd.notna(row[c])] + named
        label = " (" + ", ".join(named) + ")" if named else ""
        ceiling = f"; {row.vs_noio_ceiling:.2f} with every shared copy hidden" if pd.notna(row.vs_noio_ceiling) else ""
        lines.append(f"prefetch batch {as_read(row.batch)}{label}: "
                     f"hidden {row.hidden_frac:.2f} (target >= 0.5), {row.noio / row.value:.2f} of noio "
                     f"(target >= 0.85{ceiling})")
    return lines


def decode_ablation_lines(frame: pd.DataFrame) -> list[str]:
    """decode_ablation.csv (the archived ablate_decode script: results/notes/investigations.md): per
    point and variant, the median step over rounds, and in brackets the median over rounds of its
    ratio to resident's in the same round (issue #6: noio within 3% of resident)."""
    f = latest(frame)
    f = f[f.metric == "tpot_median_ms"]
    lines = []
    for (batch, hidden), rows in f.groupby(["batch", "hidden"], sort=False):
        by_round = rows.pivot_table(index="round", columns="mode", values="value", sort=False)
        ratios = by_round.div(by_round["resident"], axis=0) if "resident" in by_round else None
        shown = ", ".join(f"{mode} {by_round[mode].median():.2f}"
                          + (f" ({ratios[mode].median() - 1:+.1%})" if ratios is not None and mode != "resident"
                             else "")
                          for mode in by_round.columns)
        lines.append(f"decode ablation batch {batch}, hidden {hidden}, median ms per step: {shown} "
                     f"(target: noio within +3% of resident)")
    return lines


def prefill_lines(frame: pd.DataFrame) -> list[str]:
    """bench_prefill: per family and prompt length, the newest run's time, memory and roofline share
    beside the targets (DSA 32K <= 8 s, 128K <= 60 s, peak <= KV + 4 GiB; Quest 32K >= 0.4)."""
    f = frame[frame["mode"] == "model"]
    if (f.gpu != "cpu").any():                  # a GPU's rows, not a --quick run's beside them
        f = f[f.gpu != "cpu"]
    f = f.groupby(["family", "context", "metric"], sort=False).tail(1)
    wide = f.pivot_table(index=["family", "context"], columns="metric", values="value")
    lines = []
    for (family, context), row in wide.iterrows():
        target = TARGETS.get((family, int(context)), "")
        memory = f", peak {row.peak_gib:.1f} GiB (KV {row.kv_gib:.1f}; target <= KV + 4)" if family == "dsa" else ""
        size = f"{int(context) // 1024}K" if context >= 1024 else f"{int(context)} tokens"
        lines.append(f"prefill {family} {size}: {row.prefill_s:.2f} s, {row.roofline_frac:.2f} of "
                     f"the FLOP roofline{memory}" + (f" (target {target})" if target else ""))
    return lines


def with_commit(wide: pd.DataFrame, rows: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    """`wide` (a pivot of `rows` over `key`) with each point's commit beside its metrics, for `across`."""
    if "commit" not in rows or wide.empty:
        return wide
    return wide.join(rows.groupby(key, dropna=False).commit.last())


def with_placeholders(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """`frame` with "-" for the empty cells of `columns`, so that they can key a pivot (NaN keys drop)."""
    return frame.assign(**{c: frame[c].astype(object).where(frame[c].notna(), "-") for c in columns})


def across(row: pd.Series, twin: pd.Series) -> str:
    """Two rows compared in one ratio: their commits where they differ (the ratio then mixes every
    change between those trees with the one compared: rerun both on one tree), else ''."""
    a, b = row.get("commit"), twin.get("commit")
    return "" if a is None or b is None or a == b else f" [{a} against {b}]"


def serving_lines(frame: pd.DataFrame) -> list[str]:
    """The serving study (experiments.sweep kind serving, in process; each point's newest rows, the
    study `serving_study` picks): the targets of issue 33 per concurrency level: hisparse over resident output tokens/s (>= 1.6) and p50
    TTFT (>= 2x lower) at the two highest levels; at the lowest, TPOT p50 over resident's (hisparse
    <= 1.25, noio <= 1.03)."""
    f = frame[frame.gpu != "cpu"] if (frame.gpu != "cpu").any() else frame
    http = http_lines(f)
    if "transport" in f:
        f = f[f.transport.isna() | (f.transport == "process")]
    every = f[f.concurrency.notna()]
    newest = newest_per_point(every) if len(every) else every     # a study resumed across commits is one
    runs = serving_study(every[every.gpu == newest.gpu.iloc[0]]) if len(every) else every   # every run, for tpot
    every = newest
    f = serving_study(every)
    wide = f.pivot_table(index=["concurrency", "mode"], columns="metric", values="value")
    wide = with_commit(wide, f, ["concurrency", "mode"])
    levels = sorted({c for c, _ in wide.index})
    lines = []

    def ratio(level, mode, metric, over="resident"):
        try:
            return wide.loc[(level, mode), metric] / wide.loc[(level, over), metric]
        except KeyError:
            return float("nan")

    def trees(level, mode, over="resident"):
        both = [(level, m) for m in (mode, over)]
        return across(wide.loc[both[0]], wide.loc[both[1]]) if all(p in wide.index for p in both) else ""

    for level in levels[-2:] if len(levels) > 1 else []:
        missing = [mode for mode in ("hisparse", "resident") if (level, mode) not in wide.index]
        if missing:
            lines.append(f"serving {level:.0f} clients: {' and '.join(missing)} not measured yet "
                         f"(targets: tokens/s >= 1.6x, p50 TTFT >= 2x lower)")
            continue
        lanes = f"lanes {wide.loc[(level, 'hisparse'), 'lanes']:.0f} / {wide.loc[(level, 'resident'), 'lanes']:.0f}"
        if "running_batch_mean" in wide.columns:       # below its lanes: lanes waiting on a prefill, or the drain
            busy = [wide.loc[(level, mode), "running_batch_mean"] for mode in ("hisparse", "resident")]
            lanes += "" if pd.isna(busy).any() else f", running batch {busy[0]:.2f} / {busy[1]:.2f}"
        cap = prefill_serial_cap(wide, level, levels[0], f.output_len.max())
        cap = "" if cap != cap else f"; {cap:.2f}x with every lane busy and prefill alone between steps"
        lines.append(f"serving {level:.0f} clients: hisparse / resident output tokens/s "
                     f"{ratio(level, 'hisparse', 'tokens_per_s'):.2f}x (target >= 1.6{cap}), p50 TTFT "
                     f"{1 / ratio(level, 'hisparse', 'ttft_ms_p50'):.2f}x lower (target >= 2); {lanes}"
                     + trees(level, "hisparse"))

    def tpot(level, mode):
        """TPOT p50 over resident's, against resident's run on the same commit where there is one
        (resident's own time moves by several percent from one machine to the next), else its newest."""
        if (level, mode) not in wide.index:
            return "not measured yet"
        commit = wide.loc[(level, mode)].get("commit")
        twin = runs[(runs.concurrency == level) & (runs["mode"] == "resident") & (runs.metric == "tpot_ms_p50")]
        twin = twin[twin.commit == commit] if "commit" in twin else twin.iloc[0:0]
        if twin.empty:
            value = ratio(level, mode, "tpot_ms_p50")
            return "not measured yet" if value != value else f"{value:.3f}{trees(level, mode)}"
        return f"{wide.loc[(level, mode), 'tpot_ms_p50'] / float(twin.value.iloc[-1]):.3f}"

    if levels:
        low = levels[0]
        lines.append(f"serving {low:.0f} clients: TPOT p50 hisparse / resident {tpot(low, 'hisparse')} "
                     f"(target <= 1.25), noio / resident {tpot(low, 'noio')} (target <= 1.03)")
    two_each = every[every.requests_per_client.isna()] if "requests_per_client" in every else every
    return (lines + hybrid_lines(wide, levels) + longer_run_lines(every) + overlap_lines(two_each)
            + chunk_lines(two_each) + http)


def longer_run_lines(closed: pd.DataFrame) -> list[str]:
    """Per level run with a number of requests per client other than the default 2 (column
    requests_per_client; a longer run, e.g. 3): hisparse over resident output tokens/s (target >= 1.6)
    and p50 TTFT, the running batches, and the same ratio of the twin run with 2 each, where it exists.
    A closed loop ends with its last requests decoding on fewer lanes than it has; more requests per
    client shrink that drain's share of the run."""
    if "requests_per_client" not in closed or not closed.requests_per_client.notna().any():
        return []
    shape = [c for c in ("input_len", "output_len", "prefill_chunk", "kv_budget_gib", "kv_dtype", "model", "workload")
             if c in closed]
    f = with_placeholders(closed, [*shape, "requests_per_client"])
    f = f[f.prefill_overlap.isna()] if "prefill_overlap" in f else f
    key = ["concurrency", "requests_per_client", *shape]
    wide = with_commit(f.pivot_table(index=[*key, "mode"], columns="metric", values="value"), f, [*key, "mode"])

    def of(point, mode):
        return wide.loc[(*point, mode)] if (*point, mode) in wide.index else None

    lines = []
    for point in sorted({p[:-1] for p in wide.index if p[1] != "-"}):
        level, per_client, *rest = point
        hisparse, resident = of(point, "hisparse"), of(point, "resident")
        head = f"serving {level:.0f} clients, {per_client:.0f} requests each"
        if hisparse is None or resident is None:
            missing = " and ".join(m for m, r in (("hisparse", hisparse), ("resident", resident)) if r is None)
            lines.append(f"{head}: {missing} not measured yet (targets: tokens/s >= 1.6x, p50 TTFT >= 2x lower)")
            continue
        line = (f"{head}: hisparse / resident output tokens/s {hisparse.tokens_per_s / resident.tokens_per_s:.2f}x "
                f"(target >= 1.6), p50 TTFT {resident.ttft_ms_p50 / hisparse.ttft_ms_p50:.2f}x lower (target >= 2)"
                f"{across(hisparse, resident)}")
        if "running_batch_mean" in wide.columns and not pd.isna([hisparse.running_batch_mean,
                                                                  resident.running_batch_mean]).any():
            line += (f"; running batch {hisparse.running_batch_mean:.2f} of {hisparse.lanes:.0f} / "
                     f"{resident.running_batch_mean:.2f} of {resident.lanes:.0f}")
        twin = [of((level, "-", *rest), mode) for mode in ("hisparse", "resident")]
        if all(t is not None for t in twin):
            line += f"; 2 requests each: {twin[0].tokens_per_s / twin[1].tokens_per_s:.2f}x{across(twin[0], twin[1])}"
        lines.append(line)
    return lines


def overlap_lines(closed: pd.DataFrame) -> list[str]:
    """Per point run with prefill_overlap (issue 33: prefill in layer pieces beside the decode steps
    instead of alone between them; the newest run of each point): output tokens/s over resident's with
    overlap and over resident's without (the tokens/s target, >= 1.6, is the study's two highest
    levels'), over its own twin without overlap, and p50 TTFT and TPOT beside the twin's. Twins share
    clients, mode and the study's shape (lengths, chunk, budget, rows, model, workload); points without
    overlap have no pieces, so an overlapped point of any piece size has them as twins. Where resident
    ran without overlap at other chunks only, the line takes the fastest of those (the hardest
    comparison) and names its chunk."""
    if "prefill_overlap" not in closed or not closed.prefill_overlap.notna().any():
        return []
    shape = [c for c in ("input_len", "output_len", "prefill_chunk", "prefill_layers", "prefill_sms", "kv_budget_gib",
                         "kv_dtype", "model", "workload") if c in closed]
    f = with_placeholders(closed, shape)
    on = f.prefill_overlap.notna()
    key = ["concurrency", "mode", *shape]
    wide_on = with_commit(f[on].pivot_table(index=key, columns="metric", values="value"), f[on], key)
    wide_off = with_commit(f[~on].pivot_table(index=key, columns="metric", values="value"), f[~on], key)
    chunk_at = shape.index("prefill_chunk") if "prefill_chunk" in shape else None
    pieces_at = shape.index("prefill_layers") if "prefill_layers" in shape else None
    sms_at = shape.index("prefill_sms") if "prefill_sms" in shape else None

    def of(wide, level, mode, rest):
        return wide.loc[(level, mode, *rest)] if (level, mode, *rest) in wide.index else None

    def resident_off(level, rest):
        """(row, chunk named in the line or None) of resident without overlap: at the point's chunk,
        else the fastest at another."""
        exact = of(wide_off, level, "resident", rest)
        if exact is not None:
            return exact, None
        others = [(row, other[chunk_at]) for (lv, mode, *other), row in wide_off.iterrows()
                  if lv == level and mode == "resident"
                  and all(o == r for i, (o, r) in enumerate(zip(other, rest)) if i != chunk_at)]
        return max(others, key=lambda o: o[0].tokens_per_s) if others else (None, None)

    lines = []
    for (level, mode, *rest), r in wide_on.iterrows():
        plain = list(rest)
        for at in (pieces_at, sms_at):
            if at is not None:
                plain[at] = "-"                      # points without overlap have no pieces
        twin, (base, base_chunk), base_on = of(wide_off, level, mode, plain), resident_off(level, plain), \
            of(wide_on, level, "resident", rest)
        cells = [f"{r.tokens_per_s:.0f} tokens/s"]
        if mode != "resident" and base_on is not None:
            cells.append(f"{r.tokens_per_s / base_on.tokens_per_s:.2f}x resident's with overlap" + across(r, base_on))
        if mode != "resident" and base is not None:
            at = "" if base_chunk is None else f" at chunk {base_chunk:.0f}"
            cells.append(f"{r.tokens_per_s / base.tokens_per_s:.2f}x resident's without{at} (target >= 1.6)"
                         + across(r, base))
        if twin is not None:
            cells.append(f"{r.tokens_per_s / twin.tokens_per_s:.2f}x its own without; p50 TTFT {r.ttft_ms_p50:.0f} ms "
                         f"(without {twin.ttft_ms_p50:.0f}), TPOT {r.tpot_ms_p50:.1f} ms (without "
                         f"{twin.tpot_ms_p50:.1f})" + across(r, twin))
        pieces = "-" if pieces_at is None else rest[pieces_at]
        sms = "-" if sms_at is None else rest[sms_at]
        notes = ([] if pieces == "-" else [f"pieces of {pieces:.0f} layer{'s' if pieces != 1 else ''}"]) + \
            ([] if sms == "-" else [f"on {sms:.0f} SMs"])
        pieces_note = f" ({', '.join(notes)})" if notes else ""
        lines.append(f"serving {level:.0f} clients, {mode} with prefill_overlap{pieces_note}: " + ", ".join(cells))
    return lines


def hybrid_lines(wide: pd.DataFrame, levels: list[float]) -> list[str]:
    """Issue 34's targets where the study ran hybrid: output tokens/s at least 0.97x resident's at every
    level where resident admits every request (its lanes >= the clients), at least 0.95x hisparse's at
    the two highest levels."""
    lines = []
    for level in levels:
        if (level, "hybrid") not in wide.index:
            continue
        own = wide.loc[(level, "hybrid")]
        cells = []
        if (level, "resident") in wide.index and wide.loc[(level, "resident"), "lanes"] >= level:
            ratio = own.tokens_per_s / wide.loc[(level, "resident"), "tokens_per_s"]
            cells.append(f"{ratio:.3f}x resident's (target >= 0.97)" + across(own, wide.loc[(level, "resident")]))
        if level in levels[-2:] and (level, "hisparse") in wide.index:
            ratio = own.tokens_per_s / wide.loc[(level, "hisparse"), "tokens_per_s"]
            cells.append(f"{ratio:.3f}x hisparse's (target >= 0.95)" + across(own, wide.loc[(level, "hisparse")]))
        if cells:
            counts = "".join(f", {own[m]:.0f} {m.replace('_', ' ')}" for m in ("resident_admissions", "demotions")
                             if m in own and own[m] == own[m])
            lines.append(f"serving {level:.0f} clients: hybrid output tokens/s " + ", ".join(cells) + counts)
    return lines


def prefill_serial_cap(wide: pd.DataFrame, level: float, low: float, output_len: float) -> float:
    """Hisparse's output tokens/s over resident's at `level` clients if every step kept every lane busy,
    while every prefill runs alone and stalls the lanes (hisparse.serving's iteration): a run's span
    is then n prefills of P each plus n * (output_len - 1) / lanes decode steps of the mode's median
    step (ITL p50), n the level's requests. P: hisparse's TTFT p50 less its queueing p50 at `level`
    (a prompt's chunks and its first token, the run's own prefill), or where that was not measured the
    `low` level's resident's. An estimate from measured parts (lanes drain and fill in a real run), not
    a limit of the GPU: nan where a part was not measured."""
    try:
        at = (level, "hisparse") if (level, "hisparse") in wide.index else (low, "resident")
        prefill = (wide.loc[at, "ttft_ms_p50"] - wide.loc[at, "queue_ms_p50"]) / 1e3
        n = wide.loc[(level, "resident"), "requests"]
        span = {mode: n * prefill + n / wide.loc[(level, mode), "lanes"] * (output_len - 1)
                * wide.loc[(level, mode), "itl_ms_p50"] / 1e3 for mode in ("resident", "hisparse")}
    except KeyError:
        return float("nan")
    return span["resident"] / span["hisparse"]


def throughput_lines(frame: pd.DataFrame) -> list[str]:
    """The throughput study (experiments.sweep kind throughput; each point's newest rows, a GPU's where
    there are any): issue 34's targets for mode hybrid, DSA, its tokens/s at least 0.97x resident's at
    4K and at least 0.95x hisparse's (same cache_slots) at 64K and 128K, "not measured yet" where a
    mode's row is missing."""
    f = frame[frame.gpu != "cpu"] if (frame.gpu != "cpu").any() else frame
    f = f[(f.family == "dsa") & f.metric.isin(["tokens_per_s", "resident_requests"])]
    f = newest_per_point(f, RUN_COLUMNS + ("batch",)) if len(f) else f     # a rerun may size another batch
    kv = f["kv_dtype"].fillna("bf16") if "kv_dtype" in f else pd.Series("bf16", index=f.index)
    fp8 = f[(kv == "fp8") & (f.metric == "tokens_per_s")]
    f, counts = f[kv == "bf16"], f[(kv == "bf16") & (f.metric == "resident_requests")]
    f = f[f.metric == "tokens_per_s"]
    lines = []
    for context, over, target in ((4096, "resident", 0.97), (65536, "hisparse", 0.95), (131072, "hisparse", 0.95)):
        at = f[f.context == context]
        hybrid = at[at["mode"] == "hybrid"]
        size = f"{context // 1024}K"
        if hybrid.empty:
            lines.append(f"throughput {size}: hybrid / {over} tokens/s not measured yet (target >= {target})")
            continue
        row = hybrid.iloc[-1]
        base = at[at["mode"] == over]
        if over == "hisparse":
            base = base[base.cache_slots == row.cache_slots]
        if base.empty:
            lines.append(f"throughput {size}: {over} not measured yet beside hybrid (target: hybrid / {over} "
                         f"tokens/s >= {target})")
            continue
        resident = counts[(counts.context == context) & (counts["mode"] == "hybrid")]
        placed = f", {resident.value.iloc[-1]:.0f} of {row.batch:.0f} requests resident" if len(resident) else ""
        lines.append(f"throughput {size}: hybrid / {over} tokens/s {row.value / base.value.iloc[-1]:.3f}x "
                     f"(target >= {target}; batch {row.batch:.0f} / {base.batch.iloc[-1]:.0f}{placed})")
    return lines + fp8_throughput_lines(fp8, f)


def fp8_throughput_lines(fp8: pd.DataFrame, bf16: pd.DataFrame) -> list[str]:
    """Issue 36: per context with fp8 rows, hisparse over resident tokens/s beside the bf16 run's at the
    same context (the target at 128K: at least bf16's), with each run's batches."""
    def pair(frame, context):
        at = frame[frame.context == context]
        h, r = at[at["mode"] == "hisparse"], at[at["mode"] == "resident"]
        return (h.iloc[-1], r.iloc[-1]) if len(h) and len(r) else None
    lines = []
    for context in sorted(fp8.context.unique()):
        ours = pair(fp8, context)
        if ours is None:
            continue
        (h, r), theirs = ours, pair(bf16, context)
        line = (f"throughput fp8 {context // 1024}K: hisparse / resident tokens/s {h.value / r.value:.2f}x "
                f"(batch {h.batch:.0f} / {r.batch:.0f})")
        if theirs is not None:
            bh, br = theirs
            target = "; target >= bf16's" if context == 131072 else ""
            line += f", bf16 {bh.value / br.value:.2f}x (batch {bh.batch:.0f} / {br.batch:.0f}{target})"
        lines.append(line)
    return lines


def decode_lines(frame: pd.DataFrame) -> list[str]:
    """Issue 36's second throughput target from the decode study (DSA, graphed, each point's newest
    row on a GPU where there is one): per hidden size, context and batch run with fp8 rows, hisparse's
    TPOT over resident's in ms beside the same point's bf16 overhead (target: at least a third smaller)."""
    f = frame[frame.gpu != "cpu"] if (frame.gpu != "cpu").any() else frame
    f = f[(f.family == "dsa") & (f.metric == "tpot_ms") & f["mode"].isin(["resident", "hisparse"])]
    if "kv_dtype" not in f or not (f.kv_dtype == "fp8").any():
        return []
    f = newest_per_point(f.assign(kv_dtype=f.kv_dtype.fillna("bf16")))
    wide = f.pivot_table(index=["hidden", "context", "batch", "kv_dtype"], columns="mode", values="value", aggfunc="last")
    if not {"resident", "hisparse"} <= set(wide.columns):
        return []
    over = (wide.hisparse - wide.resident).unstack("kv_dtype")
    lines = []
    for (hidden, context, batch), row in over.iterrows():
        fp8, bf16 = row.get("fp8"), row.get("bf16")
        if pd.isna(fp8):
            continue
        line = (f"decode fp8, hidden {hidden:.0f}, {context // 1024:.0f}K, batch {batch:.0f}: hisparse TPOT over "
                f"resident +{fp8:.2f} ms")
        line += (", bf16 not measured at this point" if pd.isna(bf16)
                 else f", bf16 +{bf16:.2f} ms ({fp8 / bf16:.3f} of it; target <= 0.667)")
        lines.append(line)
    return lines


# what makes an HTTP row the twin of an in-process one (the rest is how each was measured)
TWIN = ["family", "model", "mode", "workload", "layers", "hidden", "cache_slots", "input_len", "output_len",
        "concurrency", "kv_budget_gib", "prefill_chunk", "prefill_overlap", "prefill_layers", "prefill_sms", "kv_dtype",
        "requests_per_client"]


def http_lines(frame: pd.DataFrame) -> list[str]:
    """Per point run both over HTTP (transport=http, `hisparse.serve.bench`) and in process: what
    HTTP adds to p50 TTFT and TPOT (issue 35), the newest run of each."""
    if "transport" not in frame or not (frame.transport == "http").any():
        return []
    f = newest_per_point(frame[frame.concurrency.notna()])
    f = f.assign(transport=f.transport.fillna("process"))
    keys = [c for c in TWIN if c in f]
    lines = []
    for point, rows in f.groupby(keys, dropna=False, sort=False):
        by = with_commit(rows.pivot_table(index="transport", columns="metric", values="value"), rows, ["transport"])
        if not {"http", "process"} <= set(by.index):
            continue
        web, own = by.loc["http"], by.loc["process"]
        point = dict(zip(keys, point))
        cells = [f"{name} p50 {web[m]:.1f} vs {own[m]:.1f} ms ({web[m] / own[m] - 1:+.1%})"
                 for name, m in (("TTFT", "ttft_ms_p50"), ("TPOT", "tpot_ms_p50"))]
        lines.append(f"serving over HTTP, {point['mode']} {point['concurrency']:.0f} clients, {point['input_len']:.0f} in / "
                     f"{point['output_len']:.0f} out: " + ", ".join(cells)
                     + f"; tokens/s {web['tokens_per_s'] / own['tokens_per_s']:.3f}x in-process" + across(web, own))
    return lines


def chunk_lines(closed: pd.DataFrame) -> list[str]:
    """Per (clients, mode, lengths) run at more than one prefill chunk (the newest run of each point, of
    any commit): p50 TTFT and TPOT, p99 of the
    gaps between tokens (ITL, where recorded) per chunk, the interleaving's trade-off (small chunks: decode steps wait less; large: a prompt prefills sooner)."""
    if "prefill_chunk" not in closed:
        return []
    if "prefill_overlap" in closed:                 # overlapped points: overlap_lines
        closed = closed[closed.prefill_overlap.isna()]
    lines = []
    wide = closed.pivot_table(index=["concurrency", "mode", "input_len", "output_len", "prefill_chunk"],
                              columns="metric", values="value")
    for (level, mode, n_in, n_out), rows in wide.groupby(level=[0, 1, 2, 3]):
        if len(rows) < 2:
            continue
        cells = [f"{chunk:.0f}: TTFT {r.ttft_ms_p50:.0f} / TPOT {r.tpot_ms_p50:.1f}"
                 + (f" / ITL p99 {r.itl_ms_p99:.0f}" if "itl_ms_p99" in r and r.itl_ms_p99 == r.itl_ms_p99 else "")
                 + " ms" for (*_, chunk), r in rows.iterrows()]
        lines.append(f"serving {level:.0f} clients, {mode}, {n_in:.0f} in / {n_out:.0f} out, p50 per prefill chunk: "
                     + "; ".join(cells))
    return lines


SUMMARIES = {"resolve.csv": resolve_lines, "resolve_layers.csv": resolve_layers_lines,
             "attention.csv": attention_lines, "prefetch.csv": prefetch_lines,
             "decode.csv": decode_lines, "decode_ablation.csv": decode_ablation_lines, "prefill.csv": prefill_lines,
             "serving.csv": serving_lines, "throughput.csv": throughput_lines}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="One line per target from the benchmark CSVs of a folder (a GPU "
                                             "run's $OUT, or results/).")
    ap.add_argument("folder", nargs="?", default="results", help="folder of the CSVs (default: results)")
    folder = ap.parse_args(argv).folder
    if not Path(folder).is_dir():
        ap.error(f"{folder}: no such folder")
    print("== summary of", folder)
    for name, fn in SUMMARIES.items():
        path = Path(folder) / name
        if path.exists():
            for line in fn(pd.read_csv(path)):
                print(line)


if __name__ == "__main__":
    main()

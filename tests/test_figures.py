"""Figures from results/: every figure function on small long-format frames built here, the choice of
the newest run, and the command line (skip lines, PNG and PDF files)."""
import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments import figures
from experiments.figures import MissingData

ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "commit": "c0ffee",
       "timestamp": "2026-11-29T12:00:00+00:00"}
REPO = Path(__file__).resolve().parent.parent


def frame(bench: str, records: list[dict], **env) -> pd.DataFrame:
    """Long-format rows of `bench`: each record holds at least metric and value."""
    return pd.DataFrame([{"bench": bench, "unit": "", **ENV, **env, **r} for r in records])


def lines(ax) -> dict[str, tuple[list, list]]:
    """The data lines of an axes by label (reference lines, gid 'reference', left out)."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines
            if line.get_gid() != "reference"}


def decode_frame(modes, metrics, contexts=(8192, 32768), batches=(1, 8)) -> pd.DataFrame:
    """Decode rows whose value encodes its parameters: value = 1000 * mode number + batch + context / 1024."""
    return frame("throughput", [
        {"family": "dsa", "mode": mode, "batch": b, "context": c, "metric": m, "value": 1000 * i + b + c / 1024}
        for (i, mode), c, b, m in itertools.product(enumerate(modes, 1), contexts, batches, metrics)])


def test_newest_keeps_each_bench_newest_commit_and_gpu():
    old = frame("resolve", [{"metric": "noio_us", "value": 1.0}], commit="old",
                timestamp="2026-11-28T10:00:00+00:00")
    new = frame("resolve", [{"metric": "noio_us", "value": 2.0}], commit="new", gpu="NVIDIA H100",
                timestamp="2026-11-29T10:00:00+00:00")
    other = frame("attention", [{"metric": "us", "value": 3.0}], commit="old",
                  timestamp="2026-11-27T10:00:00+00:00")
    # the older run listed last: the choice goes by timestamp, per bench
    picked = figures.newest(pd.concat([new, old, other], ignore_index=True))
    assert sorted(picked["value"]) == [2.0, 3.0]
    assert figures.provenance(picked[picked.bench == "resolve"]) == "NVIDIA H100, commit new"


def test_newest_per_point_keeps_a_resumed_sweeps_points_and_a_reruns_newest_row():
    first = frame("decode", [{"mode": "resident", "batch": b, "metric": "tpot_ms", "value": float(b)}
                             for b in (8, 16)], commit="a", timestamp="2026-11-29T10:00:00+00:00")
    resumed = frame("decode", [{"mode": "resident", "batch": 16, "metric": "tpot_ms", "value": 99.0},
                               {"mode": "noio", "batch": 8, "metric": "tpot_ms", "value": 7.0}],
                    commit="b", timestamp="2026-11-29T11:00:00+00:00")
    cpu = frame("decode", [{"mode": "noio", "batch": 4, "metric": "tpot_ms", "value": 1.0}], gpu="cpu",
                timestamp="2026-11-28T09:00:00+00:00")
    picked = figures.newest_per_point(pd.concat([resumed, cpu, first], ignore_index=True))
    got = {(r.mode, r.batch): (r.value, r.commit) for r in picked.itertuples()}
    assert got == {("resident", 8): (8.0, "a"), ("resident", 16): (99.0, "b"), ("noio", 8): (7.0, "b")}


def test_newest_per_point_replaces_a_point_rerun_with_its_place_in_the_process_recorded():
    """Rows from before the sweep recorded `run` (their place in their process) and a rerun that records
    it are one point: the rerun replaces the older row rather than being averaged with it."""
    old = frame("decode", [{"mode": "noio", "batch": 8, "metric": "tpot_ms", "value": 31.8}], commit="a",
                timestamp="2026-11-29T10:00:00+00:00")
    rerun = frame("decode", [{"mode": "noio", "batch": 8, "metric": "tpot_ms", "value": 29.5, "run": 3}],
                  commit="b", timestamp="2026-11-30T10:00:00+00:00")
    picked = figures.newest_per_point(pd.concat([old, rerun], ignore_index=True))
    assert picked["value"].tolist() == [29.5] and picked["commit"].tolist() == ["b"]


def test_newest_per_point_replaces_attention_rows_run_by_another_kernel():
    """DSA's `triton` mode is the project's decode kernel: rows that record which one ran (`kernel`)
    replace the point's older rows without the column, and the attention figure draws the newer."""
    old = frame("attention", [{"family": "dsa", "mode": "triton", "batch": 64, "context": 32768, "metric": "us",
                               "value": 151.0, "timer": "cudagraph"}], commit="a",
                timestamp="2026-11-29T10:00:00+00:00")
    new = frame("attention", [{"family": "dsa", "mode": "triton", "batch": 64, "context": 32768, "metric": "us",
                               "value": 112.0, "timer": "cudagraph", "kernel": "gluon"}], commit="b",
                timestamp="2026-11-30T10:00:00+00:00")
    picked = figures.newest_per_point(pd.concat([old, new], ignore_index=True))
    assert picked["value"].tolist() == [112.0] and picked["kernel"].tolist() == ["gluon"]
    assert list(lines(figures.attention_kernels(picked).axes[0]).values()) == [([64], [112.0])]


def test_select_names_what_is_missing():
    rows = decode_frame(["resident"], ["tokens_per_s"])
    with pytest.raises(MissingData, match="tpot_ms for modes resident, hisparse"):
        figures.select(rows, ["tokens_per_s", "tpot_ms"], ("resident", "hisparse"))
    with pytest.raises(MissingData, match="tokens_per_s"):
        figures.throughput_vs_context(decode_frame(["noio"], ["tokens_per_s"]))


def test_throughput_vs_context_plots_the_best_batch_and_the_gain():
    fig = figures.throughput_vs_context(decode_frame(["resident", "hisparse"], ["tokens_per_s", "tpot_ms"]))
    ax = fig.axes[0]
    got = lines(ax)
    assert got["resident"] == ([8192, 32768], [1016.0, 1040.0])       # batch 8 is the best
    assert got["hierarchical"] == ([8192, 32768], [2016.0, 2040.0])
    assert [t.get_text() for t in ax.texts] == ["2.0x", "2.0x"]
    assert "NVIDIA H200, commit c0ffee" in fig.get_suptitle()


def test_throughput_vs_context_sets_each_kv_format_beside_its_own_resident():
    """fp8 rows are lines of their own, and their gain is over fp8 resident, not over bf16's."""
    bf16 = decode_frame(["resident", "hisparse"], ["tokens_per_s"], contexts=(32768,))
    fp8 = bf16.assign(kv_dtype="fp8", value=bf16["value"] * [1.5, 1.5, 1.0, 1.0])    # fp8 resident 1.5x faster
    fig = figures.throughput_vs_context(pd.concat([bf16, fp8], ignore_index=True))
    ax = fig.axes[0]
    assert set(lines(ax)) == {"resident", "hierarchical", "resident, kv_dtype fp8", "hierarchical, kv_dtype fp8"}
    assert sorted(t.get_text() for t in ax.texts) == ["1.3x", "2.0x"]     # 2040 / 1560 and 2040 / 1040


@pytest.mark.parametrize("budget", ["kv_budget_gib", "host_budget_gib"])
def test_throughput_vs_context_draws_the_newest_runs_budgets_only(budget):
    """An older run timed the same way but under another memory budget (and faster, so a max over both
    would pick it) is left out; one under the same budgets is drawn beside the newest."""
    new = decode_frame(["resident", "hisparse"], ["tokens_per_s"]).assign(
        kv_budget_gib=24, host_budget_gib=88, new_tokens=32, warmup_steps=8, commit="beef",
        timestamp="2026-11-30T12:00:00+00:00")
    old = new.assign(value=10 * new["value"], commit="c0ffee", timestamp="2026-11-29T12:00:00+00:00")
    fig = figures.throughput_vs_context(pd.concat([old.assign(**{budget: 64}), new], ignore_index=True))
    assert lines(fig.axes[0])["resident"] == ([8192, 32768], [1016.0, 1040.0])
    assert "commit beef" in fig.get_suptitle() and "c0ffee" not in fig.get_suptitle()
    fig = figures.throughput_vs_context(pd.concat([old, new], ignore_index=True))
    assert lines(fig.axes[0])["resident"] == ([8192, 32768], [10160.0, 10400.0])    # same budgets: best of both


def test_throughput_vs_context_takes_the_newest_stamped_row_and_works_without_a_family_column():
    """A row without a timestamp is not taken for the newest; a frame without `family` is one panel."""
    new = decode_frame(["resident", "hisparse"], ["tokens_per_s"]).assign(kv_budget_gib=24, host_budget_gib=88)
    unstamped = new.assign(host_budget_gib=64, value=10 * new["value"], timestamp="")
    fig = figures.throughput_vs_context(pd.concat([unstamped, new], ignore_index=True).drop(columns="family"))
    assert lines(fig.axes[0])["resident"] == ([8192, 32768], [1016.0, 1040.0])


def test_decode_lines_per_cache_size_and_the_gain_of_the_best():
    resident = decode_frame(["resident"], ["tokens_per_s", "tpot_ms"])            # no cache_slots column
    small = decode_frame(["resident", "hisparse"], ["tokens_per_s", "tpot_ms"]).query("mode == 'hisparse'")
    small = small.assign(cache_slots=2048)
    rows = pd.concat([resident, small, small.assign(cache_slots=4096, value=2 * small["value"])])
    fig = figures.tpot_and_throughput(rows)
    assert set(lines(fig.axes[0])) == {"resident", "hierarchical, B=2048", "hierarchical, B=4096"}
    ax = figures.throughput_vs_context(rows).axes[0]
    assert [t.get_text() for t in ax.texts] == ["4.0x", "3.9x"]


def test_memory_per_request_in_gib():
    rows = decode_frame(["resident", "hisparse"], ["hbm_bytes_per_request"], batches=(1,))
    rows["value"] = rows["context"] * 2.0**20 * np.where(rows["mode"] == "resident", 1, 0.5)
    got = lines(figures.memory_per_request(rows).axes[0])
    assert got["resident"] == ([8192, 32768], [8.0, 32.0])
    assert got["hierarchical"] == ([8192, 32768], [4.0, 16.0])


def test_tpot_and_throughput_one_column_per_context_one_line_per_mode():
    modes = ["resident", "hisparse", "prefetch", "noio"]
    fig = figures.tpot_and_throughput(decode_frame(modes, ["tpot_ms", "tokens_per_s", "max_batch"]))
    assert len(fig.axes) == 4                                         # 2 metrics x 2 contexts
    got = lines(fig.axes[0])
    assert set(got) == {"resident", "hierarchical", "hierarchical + prefetch", "no-IO oracle"}
    assert got["no-IO oracle"] == ([1, 8], [4009.0, 4016.0])
    colors = {line.get_label(): line.get_color() for line in fig.axes[0].lines}
    assert len(set(colors.values())) == 4 and colors["resident"] == figures.MODE_COLORS["resident"]
    assert fig.axes[1].get_title() == "context 32K"


def test_prefetch_hiding():
    rows = decode_frame(["sync", "prefetch"], ["exposed_io_ms_per_token"], contexts=(32768,))
    hidden = decode_frame(["prefetch"], ["hidden_frac"], contexts=(32768,)).assign(value=0.5)
    fig = figures.prefetch_hiding(pd.concat([rows, hidden]))
    assert set(lines(fig.axes[0])) == {"hierarchical", "hierarchical + prefetch"}
    assert list(lines(fig.axes[1]).values()) == [([1, 8], [0.5, 0.5])]
    # with the no-IO step's time known, a share whose in-line copies cost under 5% of it is not drawn:
    # exposed(sync) = 1033 at batch 1 and 1040 at batch 8 (decode_frame's values) against tpot(noio)
    noio = decode_frame(["noio"], ["tpot_ms"], contexts=(32768,))
    noio["value"] = noio["batch"].map({1: 1033 / 0.04, 8: 1040 / 0.06})
    fig = figures.prefetch_hiding(pd.concat([rows, hidden, noio]))
    assert list(lines(fig.axes[1]).values()) == [([8], [0.5])]
    # two runs of one commit at the same batches (another workload): each point is judged on its own
    other = [t.assign(workload="other") for t in (rows, hidden, noio.assign(value=noio["value"] / 100))]
    fig = figures.prefetch_hiding(pd.concat([rows, hidden, noio, *other]))
    assert sorted(lines(fig.axes[1]).values()) == [([1, 8], [0.5, 0.5]), ([8], [0.5])]
    # a column set on the prefetch rows alone (bench_prefetch's prefetch_programs) keeps the filter
    fig = figures.prefetch_hiding(pd.concat([rows, hidden.assign(prefetch_programs=32), noio]))
    assert list(lines(fig.axes[1]).values()) == [([8], [0.5])]


def resolve_frame() -> pd.DataFrame:
    records = []
    for batch, ratio, miss, row_bytes, order in itertools.product(
            (1, 16, 64), (1, 2, 4), (0.2, 1.0), (1152, 8192), ("miss", "address")):
        if row_bytes == 8192 and ratio != 2 or order == "address" and row_bytes == 8192:
            continue
        noio = 30.0 + ratio
        total = noio + batch * miss * 10 + (1000 if order == "address" or row_bytes == 8192 else 0)
        params = {"family": None, "mode": "hisparse", "batch": batch, "k": 2048, "cache_slots": 2048 * ratio,
                  "unit_bytes": row_bytes, "target_miss": miss, "plan_order": order}
        records += [{**params, "metric": "noio_us", "value": noio}, {**params, "metric": "total_us", "value": total},
                    {**params, "metric": "fetch_GBps", "value": 50.0}]
    return frame("resolve", records)


def test_resolve_split_stacks_probe_and_io():
    fig = figures.resolve_split(resolve_frame())
    by_ratio, by_batch = fig.axes[0], fig.axes[2]                     # miss 0.2: vs B/k, vs batch
    assert by_ratio.get_title() == "miss 20.0%, batch 64"
    assert by_batch.get_title() == "miss 20.0%, B = 2k"
    def heights(ax) -> list:
        return [round(p.get_height(), 6) for p in ax.patches]
    # bars: probe-and-scan for each x, then IO on top; address-order and 8 KB rows left out
    assert heights(by_ratio) == [31.0, 32.0, 34.0, 128.0, 128.0, 128.0]
    assert heights(by_batch) == [32.0, 32.0, 32.0, 2.0, 32.0, 128.0]
    assert [t.get_text() for t in by_batch.get_xticklabels()] == ["1", "16", "64"]


def test_attention_kernels_per_family_at_the_longest_triton_context():
    records = [{"family": family, "mode": mode, "batch": b, "context": c, "metric": m, "value": b * c}
               for family in ("dsa", "quest") for mode in ("triton", "torch_gather", "dense", "triton_step")
               for b in (1, 4) for c in (8192, 65536) for m in ("us", "roofline_frac")
               if not (mode == "triton" and c == 65536 and family == "quest")]
    for metric in ("us", "roofline_frac"):
        fig = figures.attention_kernels(frame("attention", records), metric=metric)
        dsa, quest = fig.axes
        assert dsa.get_title() == "dsa, context 64K" and quest.get_title() == "quest, context 8K"
        assert set(lines(dsa)) == {"triton", "torch gather", "dense (all keys)"}
        assert lines(quest)["triton"] == ([1, 4], [8192, 4 * 8192])
        assert dsa.get_ylabel() == metric


def test_attention_kernels_prefer_graph_replays_where_both_timers_ran():
    records = [{"family": "nsa", "mode": mode, "batch": b, "context": 8192, "metric": "us", "timer": timer,
                "value": b * (1 if timer == "cudagraph" else 10)}
               for mode in ("triton", "torch_gather") for b in (1, 4) for timer in ("do_bench", "cudagraph")]
    only_do_bench = [dict(r, family="dsa") for r in records if r["timer"] == "do_bench"]
    partly = [dict(r, family="quest") for r in records if r["timer"] == "do_bench" or r["batch"] == 1]
    fig = figures.attention_kernels(frame("attention", records + only_do_bench + partly), metric="us")
    dsa, nsa, quest = fig.axes
    assert lines(nsa)["triton"] == ([1, 4], [1, 4])
    assert lines(dsa)["triton"] == ([1, 4], [10, 40])
    assert lines(quest)["triton"] == ([1, 4], [1, 40])        # per batch: graph replays where they ran


def test_read_results_keeps_earlier_points_of_a_benchmark_rerun_at_a_few_batches(tmp_path):
    """A rerun of one batch adds to the earlier run's rows (attention, prefetch), where the resolve
    sweep, always rerun whole, shows its newest run only."""
    first = frame("prefetch", [{"mode": "sync", "batch": b, "metric": "tpot_ms", "value": b} for b in (8, 32)])
    rerun = frame("prefetch", [{"mode": "sync", "batch": 128, "metric": "tpot_ms", "value": 128}],
                  commit="beef", timestamp="2026-11-29T13:00:00+00:00")
    pd.concat([first, rerun]).to_csv(tmp_path / "prefetch.csv", index=False)
    pd.concat([first.assign(bench="resolve"), rerun.assign(bench="resolve")]).to_csv(
        tmp_path / "resolve.csv", index=False)
    assert sorted(figures.read_results(tmp_path, ("prefetch.csv",))["batch"]) == [8, 32, 128]
    assert sorted(figures.read_results(tmp_path, ("resolve.csv",))["batch"]) == [128]
    # a rerun of an attention point (its timings' spread differs too) replaces the earlier row
    point = {"family": "nsa", "mode": "triton", "batch": 8, "context": 8192, "metric": "us", "timer": "cudagraph"}
    old = frame("attention", [dict(point, value=10.0, us_p20=9.0, us_p80=11.0)])
    new = frame("attention", [dict(point, value=7.0, us_p20=6.5, us_p80=7.5)], commit="beef",
                timestamp="2026-11-29T13:00:00+00:00")
    pd.concat([old, new]).to_csv(tmp_path / "attention.csv", index=False)
    assert figures.read_results(tmp_path, ("attention.csv",))["value"].tolist() == [7.0]


def test_a_throughput_point_rerun_at_another_batch_replaces_the_earlier_batchs_rows(tmp_path):
    """throughput.csv's batch is what the budget admitted: a rerun sized another way (a smaller batch
    here, as when the sizing came to count a run's decoded tokens) replaces the earlier rows, though
    they were faster, rather than being drawn as a second batch of the same point."""
    point = {"family": "dsa", "mode": "hisparse", "context": 32768, "cache_slots": 4096, "kv_budget_gib": 24,
             "metric": "tokens_per_s"}
    old = frame("throughput", [dict(point, batch=32, value=1003.0)])
    new = frame("throughput", [dict(point, batch=31, value=981.0)], commit="beef",
                timestamp="2026-11-29T13:00:00+00:00")
    pd.concat([old, new]).to_csv(tmp_path / "throughput.csv", index=False)
    picked = figures.read_results(tmp_path, ("throughput.csv",))
    assert picked[["batch", "value"]].values.tolist() == [[31, 981.0]]


def test_decode_rows_run_with_early_resolve_are_drawn_only_where_nothing_else_was(tmp_path):
    """The stored rows of the retired `early_resolve` variant (newer here) do not replace the default
    runs' points; a file with only such rows is drawn as it is."""
    point = {"family": "dsa", "mode": "hisparse", "batch": 8, "context": 32768, "metric": "tpot_ms"}
    default = frame("decode", [dict(point, value=19.4)])                       # older, without the column
    early = frame("decode", [dict(point, value=20.4, early_resolve=True), dict(point, batch=16, value=25.0,
                  early_resolve=True)], commit="beef", timestamp="2026-11-29T13:00:00+00:00")
    pd.concat([default, early]).to_csv(tmp_path / "decode.csv", index=False)
    assert figures.read_results(tmp_path, ("decode.csv",))["value"].tolist() == [19.4]
    early.to_csv(tmp_path / "decode.csv", index=False)
    assert sorted(figures.read_results(tmp_path, ("decode.csv",))["value"]) == [20.4, 25.0]


def policies_frame() -> pd.DataFrame:
    common = {"family": "synthetic", "workload": "tiny", "k": 32, "metric": "miss_rate"}
    records = [{**common, "mode": "last", "cache_slots": 32, "value": 0.3, "published": 0.3}]
    records += [{**common, "mode": policy, "cache_slots": 32 * f, "value": rate / f}
                for policy, rate in (("lru", 0.2), ("belady", 0.1)) for f in (1, 2)]
    records += [{**common, "mode": "lru", "cache_slots": 64, "layer": 0, "value": 0.9}]
    records += [{**common, "mode": "lru", "cache_slots": 64, "step": s, "value": 1 / (s + 1)} for s in range(5)]
    records += [{**common, "metric": "overlap", "scope": "consecutive_step", "value": 0.8}]
    return frame("policies", records)


def test_policy_miss_rates_uses_only_overall_rows():
    fig = figures.policy_miss_rates(policies_frame())
    got = lines(fig.axes[0])
    assert got["LRU"] == ([1.0, 2.0], [0.2, 0.1])                      # not the per-layer or per-step rows
    assert got["last selection only (B = k)"] == ([1.0], [0.3])
    assert fig.axes[0].get_title() == "tiny k=32"


def test_miss_rate_vs_step():
    got = lines(figures.miss_rate_vs_step(policies_frame()).axes[0])
    assert list(got.values()) == [([0, 1, 2, 3, 4], [1, 1 / 2, 1 / 3, 1 / 4, 1 / 5])]
    with pytest.raises(MissingData, match="per-step"):
        figures.miss_rate_vs_step(policies_frame().drop(columns="step"))


def test_command_line_writes_what_it_can_and_says_what_it_skips(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    policies_frame().to_csv(results / "policies.csv", index=False)
    figures.main(["--results", str(results)])
    out = capsys.readouterr().out.splitlines()
    assert f"skipped resolve_split: {results / 'resolve.csv'} not found" in out
    assert sum(line.startswith("skipped") for line in out) == len(figures.FIGURES) - 2
    written = sorted(p.name for p in (results / "figures").iterdir())
    assert written == ["miss_rate_vs_step.pdf", "miss_rate_vs_step.png", "policy_miss_rates.pdf",
                       "policy_miss_rates.png"]
    assert (results / "figures" / "policy_miss_rates.png").read_bytes()[:4] == b"\x89PNG"


def test_the_committed_results_draw(tmp_path, capsys):
    """Every figure is drawn or skipped for a reason; the committed policy study is drawn."""
    written = figures.draw_all(REPO / "results", tmp_path)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(figures.FIGURES)
    for name, line in zip(figures.FIGURES, out):
        assert line.startswith((f"wrote {tmp_path / name}.png", f"skipped {name}: ")), line
    assert {tmp_path / "policy_miss_rates.pdf", tmp_path / "miss_rate_vs_step.png"} <= set(written)


def test_prefetch_rows_read_older_runs_as_random_first_layers_and_the_default_variant(tmp_path):
    """bench_prefetch rows without random_layers were runs with a random first anchor (--random-layers 2);
    the figures show prefetch with the default copy width and priority (or rows from before those
    options), a later run of that variant replacing an earlier one; other variants are tuning runs."""
    def run(value, **columns):
        return [{"mode": "prefetch", "batch": 8, "metric": m, "value": value, **columns}
                for m in ("tpot_ms", "tokens_per_s")]
    width = figures.PREFETCH_VARIANT["prefetch_programs"]
    old = frame("prefetch", run(1.0))
    capped = frame("prefetch", run(2.0, prefetch_programs=width), commit="beef", timestamp="2026-11-29T13:00:00+00:00")
    new = frame("prefetch", run(3.0, random_layers=0, prefetch_programs=width), commit="cafe",
                timestamp="2026-11-29T14:00:00+00:00")
    tuning = frame("prefetch", run(4.0, random_layers=0, prefetch_programs=128, prefetch_priority="normal"),
                   commit="cafe", timestamp="2026-11-29T14:00:00+00:00")
    high = frame("prefetch", run(5.0, random_layers=0, prefetch_programs=width, prefetch_priority="high"),
                 commit="cafe", timestamp="2026-11-29T14:00:00+00:00")
    pd.concat([old, capped, new, tuning, high]).to_csv(tmp_path / "prefetch.csv", index=False)
    got = figures.read_results(tmp_path, ("prefetch.csv",)).sort_values("value")   # the default variant only
    assert got["value"].tolist() == [2.0, 2.0, 3.0, 3.0]
    assert got["random_layers"].tolist() == [2, 2, 0, 0]
    fig = figures.tpot_and_throughput(got.assign(layers=8, context=32768))
    assert [ax.get_title() for ax in fig.axes[:2]] == ["8 layers, context 32K\nrandom_layers 0",
                                                       "8 layers, context 32K\nrandom_layers 2"]


def test_a_prefetch_point_not_run_at_todays_width_is_read_from_its_run_at_an_earlier_default(tmp_path):
    """A point run at today's default copy width and at an earlier default (in the same run, the
    earlier one written last) is drawn at today's; a point run only at earlier defaults is drawn
    from the newest of those runs; a tuning width is not drawn."""
    width, (earlier, earliest) = figures.PREFETCH_VARIANT["prefetch_programs"], figures.EARLIER_PREFETCH_PROGRAMS

    def run(batch, programs, value):
        return [{"mode": "prefetch", "batch": batch, "metric": m, "value": value, "random_layers": 0,
                 "prefetch_programs": programs, "prefetch_priority": "normal"} for m in ("tpot_ms", "tokens_per_s")]
    before = frame("prefetch", run(64, earliest, 5.0) + run(16, earlier, 7.0), timestamp="2026-11-29T10:00:00+00:00")
    rows = frame("prefetch", run(8, width, 1.0) + run(8, earlier, 2.0) + run(32, earlier, 3.0) + run(32, 128, 4.0)
                 + run(64, earlier, 6.0) + run(16, earliest, 8.0) + run(128, earliest, 9.0),
                 timestamp="2026-11-30T10:00:00+00:00")
    pd.concat([before, rows]).to_csv(tmp_path / "prefetch.csv", index=False)
    got = figures.read_results(tmp_path, ("prefetch.csv",))
    assert sorted(set(zip(got["batch"], got["value"]))) == [(8, 1.0), (16, 8.0), (32, 3.0), (64, 6.0), (128, 9.0)]
    assert len(got) == 10                                  # two metrics a point


def test_time_per_token_columns_leave_out_points_timed_another_way():
    """A mode measured with other step counts than the column's newest rows is not drawn beside them."""
    new = decode_frame(["resident", "noio"], ["tpot_ms", "tokens_per_s"], contexts=(32768,)).assign(
        new_tokens=32, warmup_steps=8, timestamp="2026-11-29T14:00:00+00:00")
    old = decode_frame(["hisparse"], ["tpot_ms", "tokens_per_s"], contexts=(32768,))   # no such columns
    fig = figures.tpot_and_throughput(pd.concat([old, new]))
    assert set(lines(fig.axes[0])) == {"resident", "no-IO oracle"}
    fig = figures.tpot_and_throughput(pd.concat([old, new.assign(new_tokens=16)]).assign(new_tokens=16, warmup_steps=8))
    assert set(lines(fig.axes[0])) == {"resident", "hierarchical", "no-IO oracle"}


def test_the_figures_default_prefetch_variant_is_the_runtimes():
    """The variant the figures draw is what bench_prefetch runs by default: DSA's copy width
    (hisparse.runtime) on the side stream of normal priority (the one it has)."""
    from hisparse import runtime
    assert figures.PREFETCH_VARIANT == {"prefetch_programs": runtime.prefetch_width("DSA"),
                                        "prefetch_priority": "normal"}


def test_a_gpus_rows_are_drawn_over_newer_cpu_rows_unless_asked(tmp_path, capsys):
    """The sweep's default run on a CPU adds rows to files that hold a GPU's (and smoke-test policy
    rows beside the full study's): the figures keep drawing the GPU's and the full study's (--device
    cpu draws the CPU's newest); an empty file, a header-only file and a missing folder are said
    plainly; a figure redrawn from the same rows is the same file."""
    gpu = frame("prefetch", [{"mode": "sync", "batch": 8, "metric": "tpot_ms", "value": 1.0}])
    cpu = frame("prefetch", [{"mode": "sync", "batch": 2, "metric": "tpot_ms", "value": 9.0}], gpu="cpu",
                commit="c0ffee", timestamp="2026-11-30T09:00:00+00:00")
    pd.concat([gpu, cpu]).to_csv(tmp_path / "prefetch.csv", index=False)
    assert figures.read_results(tmp_path, ("prefetch.csv",))["batch"].tolist() == [8]
    assert figures.read_results(tmp_path, ("prefetch.csv",), device="cpu")["batch"].tolist() == [2]
    with pytest.raises(MissingData, match=r"have no rows of device 'TPU' \(they have \['NVIDIA H200', 'cpu'\]\)"):
        figures.read_results(tmp_path, ("prefetch.csv",), device="TPU")
    # one device for a whole figure: a file without its rows is left out, not mixed in
    gpu.assign(bench="decode").to_csv(tmp_path / "decode.csv", index=False)
    cpu.to_csv(tmp_path / "prefetch.csv", index=False)
    both = ("decode.csv", "prefetch.csv")
    assert figures.read_results(tmp_path, both)["bench"].tolist() == ["decode"]
    assert figures.read_results(tmp_path, both, device="cpu")["bench"].tolist() == ["prefetch"]
    pd.concat([gpu, cpu]).to_csv(tmp_path / "prefetch.csv", index=False)
    (tmp_path / "decode.csv").write_text("")
    with pytest.raises(MissingData, match="decode.csv is empty"):
        figures.read_results(tmp_path, ("decode.csv",))
    gpu.head(0).to_csv(tmp_path / "resolve.csv", index=False)
    with pytest.raises(MissingData, match="resolve.csv has no rows"):
        figures.read_results(tmp_path, ("resolve.csv",))
    # the policy study (always on a CPU): the full-size workload's rows over a newer smoke run's
    full = policies_frame().assign(gpu="cpu", workload="dsa_100k")
    smoke = policies_frame().assign(gpu="cpu", commit="beef", timestamp="2026-11-30T09:00:00+00:00", value=0.5)
    pd.concat([full, smoke]).to_csv(tmp_path / "policies.csv", index=False)
    assert set(figures.read_results(tmp_path, ("policies.csv",))["workload"]) == {"dsa_100k"}
    assert set(figures.read_results(tmp_path, ("policies.csv",), device="cpu")["workload"]) == {"tiny"}
    figures.draw_all(tmp_path, tmp_path / "figures")        # each figure drawn or skipped, none raising
    assert "skipped resolve_split: " in capsys.readouterr().out
    pdf = (tmp_path / "figures" / "policy_miss_rates.pdf").read_bytes()
    figures.draw_all(tmp_path, tmp_path / "figures")
    assert (tmp_path / "figures" / "policy_miss_rates.pdf").read_bytes() == pdf
    with pytest.raises(SystemExit):
        figures.main(["--results", str(tmp_path / "nowhere")])
    assert "--results " in capsys.readouterr().err and not (tmp_path / "nowhere").exists()
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit):
        figures.main(["--results", str(tmp_path), "--out", str(tmp_path / "afile")])
    assert "--out " in capsys.readouterr().err and (tmp_path / "afile").read_text() == ""
    # a file that is not in the long format: its figures are skipped, naming the column, the others drawn
    policies_frame().drop(columns="timestamp").to_csv(tmp_path / "policies.csv", index=False)
    figures.draw_all(tmp_path, tmp_path / "figures")
    assert "skipped policy_miss_rates: " in (out := capsys.readouterr().out) and "no 'timestamp' column" in out


def throughput_rows() -> pd.DataFrame:
    """Rows that draw both figures of throughput.csv."""
    return decode_frame(["resident", "hisparse"], ["tokens_per_s", "hbm_bytes_per_request"])


def damaged(text: str, line: int, column: str, cell: str) -> str:
    """`text` (a CSV) with the cell of `column` on `line` (1: the header) set to `cell`."""
    rows = text.splitlines()
    at = rows[0].split(",").index(column)
    fields = rows[line - 1].split(",")
    rows[line - 1] = ",".join(fields[:at] + [cell] + fields[at + 1:])
    return "\n".join(rows) + "\n"


DAMAGES = {
    "garbage-bytes": (lambda text: b"\x89PNG\r\n\x1a\n\x00\xff" + text.encode(),
                      "it is not UTF-8 text (byte 0x89 at offset 0)"),
    "ragged-rows": (lambda text: (text + "throughput,dsa,resident,1\n" + text.splitlines()[1] + ",x\n").encode(),
                    "line 18 has 4 fields, the header 13 (2 such lines)"),
    "text-value": (lambda text: damaged(text, 3, "value", "fast").encode(), "line 3: value 'fast' is not a number"),
    "bad-timestamp": (lambda text: damaged(text, 4, "timestamp", "yesterday").encode(),
                      "line 4: timestamp 'yesterday' is not an ISO 8601 time"),
    "empty-timestamp": (lambda text: damaged(damaged(text, 5, "timestamp", ""), 6, "timestamp", "").encode(),
                        "line 5 has no timestamp (2 such lines)"),
    "text-context": (lambda text: damaged(text, 3, "context", "long").encode(), "line 3: context 'long' is not a number"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_file_that_is_not_a_results_csv_is_named_on_stderr_and_the_other_figures_drawn(tmp_path, capsys, damage):
    """A CSV that the appends would refuse, or whose value or timestamp the figures cannot read, is
    named with what is wrong on stderr; the figures of the other files are drawn, and the command
    fails at the end."""
    write, problem = DAMAGES[damage]
    results = tmp_path / "results"
    results.mkdir()
    policies_frame().to_csv(results / "policies.csv", index=False)
    (results / "throughput.csv").write_bytes(write(throughput_rows().to_csv(index=False)))
    assert figures.main(["--results", str(results)]) == 1
    out, err = capsys.readouterr()
    message = f"{results / 'throughput.csv'} is not a results CSV: {problem}"
    assert f"refused throughput_vs_context: {message}" in err.splitlines()
    assert f"refused memory_per_request: {message}" in err.splitlines()
    assert f"error: {results / 'throughput.csv'} was refused: its figures are not drawn" in err
    assert sorted(p.name for p in (results / "figures").iterdir()) == [
        "miss_rate_vs_step.pdf", "miss_rate_vs_step.png", "policy_miss_rates.pdf", "policy_miss_rates.png"]
    assert len(out.splitlines()) == len(figures.FIGURES) - 2 and "throughput.csv" not in out
    with pytest.raises(figures.Refused) as refused:          # draw_all, as notebooks call it, says so too
        figures.draw_all(results, tmp_path / "again")
    assert refused.value.problems == {str(results / "throughput.csv"): problem}
    assert {p.name for p in refused.value.written} == {"policy_miss_rates.png", "policy_miss_rates.pdf",
                                                       "miss_rate_vs_step.png", "miss_rate_vs_step.pdf"}


@pytest.mark.parametrize("damage", ["folder", "text-concurrency"])
def test_a_folder_named_as_a_csv_or_a_text_concurrency_is_named_and_the_other_figures_drawn(tmp_path, capsys, damage):
    """Each used to stop the command with a traceback (IsADirectoryError; a TypeError comparing the text
    with numbers) before the other figures were drawn."""
    results = tmp_path / "results"
    results.mkdir()
    policies_frame().to_csv(results / "policies.csv", index=False)
    records = [{"family": "dsa", "mode": mode, "concurrency": c, "metric": m, "value": 10 * c}
               for mode in ("resident", "hisparse") for c in (2, 8)
               for m in ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50")]
    if damage == "folder":
        (results / "serving.csv").mkdir()
        problem = "it is a folder, not a file"
    else:
        records[5]["concurrency"] = "eight"
        frame("serving", records).to_csv(results / "serving.csv", index=False)
        problem = "line 7: concurrency 'eight' is not a number"
    assert figures.main(["--results", str(results)]) == 1
    out, err = capsys.readouterr()
    assert f"refused serving_vs_concurrency: {results / 'serving.csv'} is not a results CSV: {problem}" in err
    assert sorted(p.name for p in (results / "figures").iterdir()) == [
        "miss_rate_vs_step.pdf", "miss_rate_vs_step.png", "policy_miss_rates.pdf", "policy_miss_rates.png"]


def test_good_files_exit_zero_and_a_byte_order_mark_is_read(tmp_path, capsys):
    """A CSV saved with a UTF-8 byte-order mark (a spreadsheet's "CSV UTF-8") is read as any other."""
    text = throughput_rows().to_csv(index=False)
    (tmp_path / "throughput.csv").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert figures.main(["--results", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert f"wrote {tmp_path / 'figures' / 'throughput_vs_context'}.png and .pdf" in out and err == ""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "throughput.csv").write_text(text)
    assert figures.read_results(tmp_path, ("throughput.csv",)).equals(figures.read_results(plain, ("throughput.csv",)))


def test_the_command_exits_non_zero_where_a_file_was_refused(tmp_path):
    (tmp_path / "resolve.csv").write_text("bench,metric,value,unit,gpu,commit,timestamp\nresolve,noio_us,slow,us,cpu,c,"
                                          "2026-11-29T12:00:00+00:00\n")
    run = subprocess.run([sys.executable, "-m", "experiments.figures", "--results", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True)
    assert run.returncode == 1, run.stderr
    assert f"{tmp_path / 'resolve.csv'} is not a results CSV: line 2: value 'slow' is not a number" in run.stderr


def test_serving_vs_concurrency_one_line_per_mode_without_http_rows():
    records = [{"family": "dsa", "mode": mode, "concurrency": c, "metric": m, "value": 100 * i + c}
               for (i, mode), c, m in itertools.product(enumerate(["resident", "hisparse"], 1), (2, 8),
                                                        ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50"))]
    http = [dict(records[0], value=-1.0, transport="http")]
    fig = figures.serving_vs_concurrency(frame("serving", records + http))
    got = lines(fig.axes[0])
    assert got["resident"] == ([2, 8], [102, 108]) and got["hierarchical"] == ([2, 8], [202, 208])
    assert len(fig.axes) == 4


def test_serving_points_past_the_4th_graph_are_drawn_hollow():
    """A graphed point whose run was its process's 4th graph or later gets a hollow marker over its
    line's point (and the figure a note); the others, and an ungraphed run 5, none."""
    records = [{"family": "dsa", "mode": mode, "concurrency": c, "metric": m, "value": 10 * c + i, "graph": graph,
                "run": run}
               for i, (mode, graph, run) in enumerate([("resident", True, 1), ("hybrid", True, 4)])
               for c in (2, 8) for m in ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50")]
    records += [dict(r, mode="hisparse", graph=False, run=5) for r in records if r["mode"] == "resident"]
    fig = figures.serving_vs_concurrency(frame("serving", records))
    hollow = [line for line in fig.axes[0].lines if line.get_gid() == "past_4th_graph"]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [2, 8] and list(hollow[0].get_ydata()) == [21, 81]
    assert any("4th CUDA graph" in t.get_text() for t in fig.texts)
    plain = figures.serving_vs_concurrency(frame("serving", [dict(r, run=1) for r in records]))
    assert not [line for line in plain.axes[0].lines if line.get_gid() == "past_4th_graph"]
    assert not any("4th CUDA graph" in t.get_text() for t in plain.texts)


def test_serving_studies_at_two_budgets_are_not_mixed():
    """Two studies of one shape under different GPU budgets are two studies (their lanes differ): the
    one with the newest row is drawn, alone, even where both ran the same levels and modes."""
    def rows(budget, levels, value, stamp):
        return [{"family": "dsa", "mode": mode, "concurrency": c, "metric": "tokens_per_s", "value": value,
                 "input_len": 16384, "output_len": 2048, "kv_budget_gib": budget, "timestamp": stamp}
                for mode in ("resident", "hisparse") for c in levels]
    older = rows(5, (1, 8), 1.0, "2026-12-01T00:00:00+00:00")
    newer = rows(4, (2, 8), 2.0, "2026-12-02T00:00:00+00:00")
    study = figures.serving_study(frame("serving", older + newer))
    assert set(study.kv_budget_gib) == {4} and sorted(set(study.concurrency)) == [2, 8]
    assert set(study.value) == {2.0}
    assert set(figures.serving_study(frame("serving", older + newer[:1])).kv_budget_gib) == {5}
    longer = [dict(r, requests_per_client=3, timestamp="2026-12-03T00:00:00+00:00", value=3.0) for r in newer]
    study = figures.serving_study(frame("serving", older + newer + longer))
    assert set(study.value) == {2.0} and study.requests_per_client.isna().all()   # a longer run is not the study


def test_serving_study_resumed_at_a_later_commit_keeps_its_earlier_points(tmp_path):
    """serving.csv is read per point: a sweep that resumes at a later commit adds its levels and modes
    to the earlier ones (the newest run's commit alone drew only the points it added)."""
    def rows(mode, levels, commit, stamp):
        return [{"family": "dsa", "mode": mode, "concurrency": c, "metric": m, "value": 10 * c, "commit": commit,
                 "timestamp": stamp} for c in levels for m in ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50")]
    earlier = rows("resident", (1, 2, 8), "aaa", "2026-12-01T00:00:00+00:00") + rows("hisparse", (1, 2), "aaa",
                                                                                  "2026-12-01T00:00:00+00:00")
    later = rows("hisparse", (8,), "bbb", "2026-12-02T00:00:00+00:00")
    frame("serving", earlier + later).to_csv(tmp_path / "serving.csv", index=False)
    fig = figures.draw("serving_vs_concurrency", tmp_path)
    got = lines(fig.axes[0])
    assert got["resident"] == ([1, 2, 8], [10, 20, 80]) and got["hierarchical"] == ([1, 2, 8], [10, 20, 80])


RATE_METRICS = ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")


def rate_records() -> list[dict]:
    """bench_serving-dialect rows: value = 1000 * mode number + 100 if disaggregated + the rate's place (0, 1, 2)."""
    return [{"family": "dsa", "mode": mode, "request_rate": rate, "input_len": 32768, "output_len": 2048,
             "range_ratio": 0.5, "num_prompts": 64, "disaggregated": True if apart else None, "metric": m,
             "value": 1000 * i + 100 * apart + place}
            for (i, mode), apart, (place, rate), m in itertools.product(
                enumerate(["resident", "hisparse", "hybrid"], 1), (True, False), enumerate([1.0, 4.0, float("inf")]),
                RATE_METRICS)]


def test_serving_vs_rate_one_line_per_mode_and_setting_solid_where_disaggregated():
    """Five panels against request rate (inf right of 4, at 8); a line per mode and setting, in the
    mode's colour, solid disaggregated and dashed co-located. Rows over HTTP, with a prefix cache, of a
    shared document (request_rate too) or of a closed loop are not drawn."""
    records = rate_records()
    strays = [dict(records[0], value=-1.0, transport="http"), dict(records[0], value=-2.0, prefix_cache=True),
              dict(records[0], value=-3.0, dataset="shared_document"),
              dict(records[0], value=-4.0, request_rate=None, concurrency=2)]
    fig = figures.serving_vs_rate(frame("serving", records + strays))
    assert len(fig.axes) == 5 and [ax.get_ylabel() for ax in fig.axes][3:] == ["TPOT p50 (ms)", "TPOT p99 (ms)"]
    for ax in fig.axes:
        got = lines(ax)
        assert len(got) == 6
        assert got["resident, disaggregated"] == ([1.0, 4.0, 8.0], [1100, 1101, 1102])
        assert got["hierarchical, co-located"] == ([1.0, 4.0, 8.0], [2000, 2001, 2002])
        assert got["hybrid, disaggregated"][1] == [3100, 3101, 3102]
        style = {line.get_label(): (line.get_linestyle(), line.get_color()) for line in ax.lines}
        assert style["hybrid, disaggregated"] == ("-", figures.MODE_COLORS["hybrid"])
        assert style["hybrid, co-located"] == ("--", figures.MODE_COLORS["hybrid"])
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "4", "inf"]


def test_serving_vs_rate_draws_the_newest_study_and_skips_without_rate_rows():
    older = [dict(r, input_len=16384, value=-1.0, timestamp="2026-11-01T00:00:00+00:00") for r in rate_records()]
    fig = figures.serving_vs_rate(frame("serving", older + rate_records()))
    assert min(min(y) for _, y in lines(fig.axes[0]).values()) == 1000
    with pytest.raises(MissingData, match="no serving rows with request_rate"):
        figures.serving_vs_rate(frame("serving", [{"mode": "hisparse", "concurrency": 2, "metric": m, "value": 1.0}
                                                  for m in RATE_METRICS]))


def turn_records(conversations=(16,)) -> list[dict]:
    """Multiturn rows: value = 100 * (2 if a prefix cache else 1) + 10 * conversations // 16 + turn, for
    TTFT; host GiB the same over 100."""
    return [{"family": "dsa", "mode": mode, "dataset": "multiturn", "conversations": c, "turns": 3, "first_len": 8192,
             "user_len": 256, "output_len": 512, "prefix_cache": True if cached else None,
             "metric": f"{quantity}_turn{t}", "value": (100 * (1 + cached) + 10 * (c // 16) + t) / scale}
            for mode, cached in (("hisparse", True), ("hisparse", False), ("resident", False))
            for c in conversations for t in (1, 2, 3)
            for quantity, scale in (("ttft_ms_p50", 1), ("host_gib", 100))]


def test_prefix_sharing_draws_ttft_and_host_gib_against_turn_with_and_without_the_cache():
    """Two panels a number of conversations; a line per mode and cache setting, solid with the prefix
    cache, dashed without; other metrics and other datasets' rows left out."""
    strays = [dict(turn_records()[0], metric="ttft_ms_p50_later_turns", value=-1.0),
              dict(turn_records()[0], dataset="shared_document", value=-2.0)]
    fig = figures.prefix_sharing(frame("serving", turn_records((16, 32)) + strays))
    assert len(fig.axes) == 4
    ttft, host = lines(fig.axes[0]), lines(fig.axes[1])
    assert set(ttft) == {"hierarchical, prefix cache", "hierarchical, no prefix cache", "resident, no prefix cache"}
    assert ttft["hierarchical, prefix cache"] == ([1, 2, 3], [211, 212, 213])
    assert ttft["resident, no prefix cache"] == ([1, 2, 3], [111, 112, 113])
    assert host["hierarchical, no prefix cache"] == ([1, 2, 3], [1.11, 1.12, 1.13])
    assert lines(fig.axes[2])["hierarchical, prefix cache"][1] == [221, 222, 223]       # 32 conversations
    style = {line.get_label(): line.get_linestyle() for line in fig.axes[0].lines}
    assert style == {"hierarchical, prefix cache": "-", "hierarchical, no prefix cache": "--",
                     "resident, no prefix cache": "--"}
    assert fig.axes[2].get_xlabel() == "turn (32 conversations)" and fig.axes[1].get_ylabel() == "host GiB, peak (pool and prefix copies)"
    with pytest.raises(MissingData, match="no multiturn rows"):
        figures.prefix_sharing(frame("serving", rate_records()))


def test_the_command_line_draws_the_rate_and_turn_figures_where_their_rows_are(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    frame("serving", rate_records() + turn_records()).to_csv(results / "serving.csv", index=False)
    assert figures.main(["--results", str(results)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"wrote {results / 'figures' / 'serving_vs_rate'}.png and .pdf" in out
    assert f"wrote {results / 'figures' / 'prefix_sharing'}.png and .pdf" in out
    frame("serving", rate_records()).to_csv(results / "serving.csv", index=False)
    figures.main(["--results", str(results), "--out", str(tmp_path / "f")])
    assert "skipped prefix_sharing: no multiturn rows of metric ttft_ms_p50_turn{t}, host_gib_turn{t}" in \
        capsys.readouterr().out.splitlines()
    frame("serving", turn_records()).to_csv(results / "serving.csv", index=False)
    figures.main(["--results", str(results), "--out", str(tmp_path / "g")])
    assert "skipped serving_vs_rate: no serving rows with request_rate (bench_serving's random dataset)" in \
        capsys.readouterr().out.splitlines()

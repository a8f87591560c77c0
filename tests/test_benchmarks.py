"""Every benchmark's --quick run (tiny shapes through the interpreter) writes its rows: the CSV columns
the figures and the README read. The runs go through each module's `__main__` block, as `python -m`
runs it, in this process (a fresh one spends seconds on imports); one runs in a fresh process, where
the benchmarks package itself chooses Triton's interpreter."""
import importlib
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
CASES = {   # benchmark -> (CSV it writes, metrics it must hold)
    "resolve": ("resolve.csv", {"noio_us", "total_us", "fetch_GBps", "miss_rate"}),
    "attention_dsa": ("attention.csv", {"us", "TFLOPs", "GBps", "roofline_frac"}),
    "attention_nsa": ("attention.csv", {"us", "roofline_frac"}),
    "attention_quest": ("attention.csv", {"us", "roofline_frac"}),
    "prefetch": ("prefetch.csv", {"tpot_ms", "tokens_per_s", "exposed_io_ms_per_token", "hidden_frac",
                                  "vs_noio_ceiling"}),
    "prefill": ("prefill.csv", {"prefill_s", "tokens_per_s", "peak_gib", "kv_gib", "roofline_frac"}),
    "sampling": ("sampling.csv", {"step_ms", "argmax_ms", "sample_ms", "overhead_frac"}),
    "moe": ("moe.csv", {"us", "GBps", "weight_GB", "roofline_frac"}),
    "prefill_parts": ("prefill_parts.csv", {"us", "TFLOPs", "GBps", "roofline_frac"}),
}
# the quick runs' own options, to make them shorter still where a benchmark has them: the rows are the
# same columns (prefill: one of the quick run's two contexts)
QUICK_ARGS = {"prefill": ["--contexts", "40"]}
FRESH = "attention_dsa"     # the quick run made in a fresh process (the shortest)


def parser_exit(capsys, monkeypatch, module: str, *argv: str) -> tuple[int, str]:
    """`python -m module *argv` run in this process up to its exit: (exit status, stderr). For the
    refusals a parser makes before any work (the status and message a fresh process gives, without its
    seconds of imports); a command that went on to run instead fails the caller's pytest.raises."""
    main = importlib.import_module(module).main
    monkeypatch.setattr(sys, "argv", [module, *argv])     # main() parses sys.argv, as `python -m` gives it
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main()
    return done.value.code, capsys.readouterr().err


def run_as_main(monkeypatch, module: str, *argv: str) -> None:
    """`python -m module *argv` in this process: the module's code run afresh as `__main__`, with the
    sys.argv `python -m` gives it (Triton's interpreter was chosen on the tests' first import, as
    the benchmarks package chooses it in a fresh process: test_a_quick_run_works_from_a_fresh_process)."""
    monkeypatch.setattr(sys, "argv", [module, *argv])
    monkeypatch.delitem(sys.modules, module, raising=False)       # run, not re-imported (and no runpy warning)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def check_quick_rows(name, out: Path) -> pd.DataFrame:
    csv, metrics = CASES[name]
    rows = pd.read_csv(out / csv)
    assert metrics <= set(rows.metric), f"{name}: missing {metrics - set(rows.metric)}"
    assert rows.value.notna().any() and (rows.gpu == "cpu").all() and rows.commit.notna().all()
    return rows


# bench_prefetch's quick run is test_prefetch_variants_each_get_their_rows's (with two copy widths)
@pytest.mark.parametrize("name", sorted(set(CASES) - {FRESH, "prefetch"}))
def test_quick_run_writes_its_rows(name, tmp_path, monkeypatch):
    run_as_main(monkeypatch, f"benchmarks.bench_{name}", "--quick", "--out", str(tmp_path), *QUICK_ARGS.get(name, []))
    check_quick_rows(name, tmp_path)


def test_a_quick_run_works_from_a_fresh_process(tmp_path):
    """`python -m benchmarks.bench_NAME --quick` from a fresh process with no TRITON_INTERPRET set: the
    benchmarks package imports kernels_triton first, which chooses the interpreter before anything
    imports triton (every bench_NAME runs after that package import)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # kernels_triton chooses it itself
    run = subprocess.run([sys.executable, "-m", f"benchmarks.bench_{FRESH}", "--quick", "--out", str(tmp_path)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    check_quick_rows(FRESH, tmp_path)


@pytest.mark.parametrize("family,k,unit_bytes,workload", [("quest", 3, 2 * 16 * 16 * 4, "synthetic"),
                                                         ("nsa", 4, 2 * 64 * 16 * 4, "model")])
def test_prefetch_on_quest_and_nsa_models_with_shared_selections(tmp_path, monkeypatch, family, k, unit_bytes,
                                                                 workload):
    """--family quest / nsa: the four modes on a model whose layers share a selection (--quick: an anchor
    and one shared layer), replayed per KV head from the synthetic generator or made by the model itself;
    rows name the family, its k, unit size and workload; the figures, drawn for DSA, leave them out. Each
    family runs one workload (the workload's branch is the same for both; the quick NSA run takes half a
    minute here)."""
    run_as_main(monkeypatch, "benchmarks.bench_prefetch", "--quick", "--family", family, "--workload", workload,
                "--out", str(tmp_path))
    rows = pd.read_csv(tmp_path / "prefetch.csv")
    assert (rows.family == family).all() and (rows.workload == ("model" if workload == "model" else "tiny")).all()
    assert (rows.k == k).all() and (rows.unit_bytes == unit_bytes).all()
    assert (rows.layers == 2).all() and (rows.shared_layers == 1).all()
    assert sorted(rows[rows.metric == "tpot_ms"]["mode"]) == ["noio", "prefetch", "resident", "sync"]
    assert (rows[(rows.metric == "miss_rate") & (rows["mode"] != "resident")].value > 0).all()
    from experiments.figures import default_prefetch_variant
    assert default_prefetch_variant(rows).empty


def test_prefetch_variants_each_get_their_rows(tmp_path, capsys, monkeypatch):
    """The quick run (DSA), with several copy widths (each passed as the Engine's prefetch_programs):
    its rows, and one prefetch run (and hidden share) per width, on the side stream's one priority."""
    run_as_main(monkeypatch, "benchmarks.bench_prefetch", "--quick", "--out", str(tmp_path),
                "--prefetch-programs", "8", "32")
    rows = check_quick_rows("prefetch", tmp_path)
    hidden = rows[rows.metric == "hidden_frac"]
    assert sorted(zip(hidden.prefetch_programs, hidden.prefetch_priority)) == [(8, "normal"), (32, "normal")]
    from hisparse.resolve import copy_tile  # each prefetch row records its copy's tile
    words = int(rows.unit_bytes.iloc[0]) // 4
    assert sorted(set(zip(hidden.prefetch_programs, hidden.prefetch_rows))) == [
        (8, copy_tile(words, 8)[1]), (32, copy_tile(words, 32)[1])]
    assert copy_tile(words, 8)[1] > copy_tile(words, 32)[1]
    assert rows.loc[rows["mode"] != "prefetch", "prefetch_rows"].isna().all()
    assert sorted(rows[rows.metric == "tpot_ms"]["mode"]) == ["noio"] + ["prefetch"] * 2 + ["resident", "sync"]
    # the ceiling: noio's step plus the anchors' copies (2 of 8 layers here) at the pinned-copy rate
    from benchmarks.common import PINNED_BYTES_PER_S
    def value(mode, metric):
        return rows[(rows["mode"] == mode) & (rows.metric == metric)].value.iloc[0]
    first = rows.iloc[0]
    anchor_io_ms = (value("prefetch", "miss_rate") * first.k * first.unit_bytes * first.batch
                    * (first.layers - first.shared_layers) / PINNED_BYTES_PER_S * 1e3)
    noio = value("noio", "tpot_ms")
    ceiling = rows[rows.metric == "vs_noio_ceiling"].value
    # compared as 1 / ceiling - 1 = anchors' io / noio: on the CPU the copies are a tiny share of the step
    assert len(ceiling) == 2 and (ceiling < 1).all()
    assert np.allclose(1 / ceiling - 1, anchor_io_ms / noio, rtol=1e-6, atol=0)
    code, err = parser_exit(capsys, monkeypatch, "benchmarks.bench_prefetch", "--quick", "--prefetch-programs", "0")
    assert code == 2 and "--prefetch-programs 0: expected a positive integer" in err
    code, err = parser_exit(capsys, monkeypatch, "benchmarks.bench_prefetch", "--quick", "--prefetch-priority", "high")
    assert code == 2 and "unrecognized arguments: --prefetch-priority high" in err


def test_resolve_decode_like_points_keep_their_miss_rates(tmp_path, monkeypatch):
    """--decode-like: layers' streams taking turns in one state, units spread over a longer context;
    the workload's exact miss rate holds at every point."""
    run_as_main(monkeypatch, "benchmarks.bench_resolve", "--quick", "--decode-like", "--out", str(tmp_path))
    rows = pd.read_csv(tmp_path / "resolve_layers.csv")
    assert sorted(set(zip(rows.layers, rows.context))) == [(1, 48), (1, 60), (1, 256), (3, 256)]
    misses = rows[rows.metric == "miss_rate"]
    assert (misses.value - misses.target_miss).abs().max() < 1e-9
    assert (rows[rows.metric == "noio_us"].value > 0).all()


def test_resolve_decode_like_with_the_newest_rows_written_both_ways():
    """bench_resolve's decode-like timing with the newest rows written in a launch of their own or by
    the resolve: the same selections, so the same misses, and a bad choice named."""
    from benchmarks.bench_resolve import WRITES, Point, time_decode_like
    p = Point(2, 16, 32, 0.25, 16, min_context=64)
    rates = {w: time_decode_like(p, 2, torch.device("cpu"), 1, write=w)["miss_rate"] for w in WRITES}
    assert len(set(rates.values())) == 1 and rates["none"] > 0, rates
    with pytest.raises(ValueError, match="write='both': expected one of"):
        time_decode_like(p, 2, torch.device("cpu"), 1, write="both")


def test_summary_prefetch_lines_name_each_variant_beside_its_targets():
    from benchmarks import summary

    def row(mode, metric, value, **variant):
        return dict(bench="prefetch", mode=mode, batch=32, metric=metric, value=value, commit="c", **variant)
    frame = pd.DataFrame([row("noio", "tpot_ms", 5.0), row("sync", "tpot_ms", 8.0),
                          row("prefetch", "tpot_ms", 6.0, prefetch_programs=32.0, prefetch_priority="high"),
                          row("prefetch", "hidden_frac", 0.6, prefetch_programs=32.0, prefetch_priority="high"),
                          row("prefetch", "tpot_ms", 6.25, prefetch_programs=128.0, prefetch_priority="high"),
                          row("prefetch", "hidden_frac", 0.4, prefetch_programs=128.0, prefetch_priority="high"),
                          row("prefetch", "vs_noio_ceiling", 0.9, prefetch_programs=32.0, prefetch_priority="high")])
    assert summary.prefetch_lines(frame) == [
        "prefetch batch 32 (programs 32, priority high): hidden 0.60 (target >= 0.5), 0.83 of noio (target >= 0.85; "
        "0.90 with every shared copy hidden)",
        "prefetch batch 32 (programs 128, priority high): hidden 0.40 (target >= 0.5), 0.80 of noio (target >= 0.85)"]


def test_summary_prefetch_lines_keep_two_models_of_one_run_apart():
    from benchmarks import summary
    rows = []
    for hidden, noio in ((1024, 4.0), (7168, 5.0)):
        rows += [dict(mode="noio", batch=32, hidden=hidden, metric="tpot_ms", value=noio, commit="c"),
                 dict(mode="prefetch", batch=32, hidden=hidden, metric="tpot_ms", value=2 * noio, commit="c"),
                 dict(mode="prefetch", batch=32, hidden=hidden, metric="hidden_frac", value=hidden / 1e4, commit="c")]
    assert summary.prefetch_lines(pd.DataFrame(rows)) == [
        "prefetch batch 32 (hidden 1024): hidden 0.10 (target >= 0.5), 0.50 of noio (target >= 0.85)",
        "prefetch batch 32 (hidden 7168): hidden 0.72 (target >= 0.5), 0.50 of noio (target >= 0.85)"]


def test_summary_decode_ablation_lines_give_each_variants_median_beside_residents():
    """decode_ablation.csv (archived rows of the retired ablation script): per point, each variant's
    median step over rounds and, in brackets, the median of its ratio to resident's in the same round."""
    from benchmarks import summary
    rows = [dict(bench="decode_ablation", mode=mode, batch=2, hidden=64, round=r, metric=metric, value=value,
                 commit="c")
            for r, scale in enumerate((1.0, 1.1, 1.2))
            for mode, ms in (("resident", 4.0), ("noio", 4.2), ("noio-device-pool", 4.0))
            for metric, value in (("tpot_ms", 9.9), ("tpot_median_ms", ms * scale))]
    assert summary.decode_ablation_lines(pd.DataFrame(rows)) == [
        "decode ablation batch 2, hidden 64, median ms per step: resident 4.40, noio 4.62 (+5.0%), "
        "noio-device-pool 4.40 (+0.0%) (target: noio within +3% of resident)"]


def test_bench_prefetch_refuses_bad_sizes_before_any_run(capsys, tmp_path):
    from benchmarks import bench_prefetch
    (tmp_path / "afile").write_text("")
    for argv, message in ([["--quick", "--cache-slots", "4"], "--cache-slots 4: the cache must hold one whole "
                                                              "selection, k = 8"],
                          [["--quick", "--batches", "2", "4"], "--quick sets its own --batches"],
                          [["--workload", "model"], "--workload model: the dsa family replays"],
                          [["--steps", "1"], "--steps 1: expected at least 2"],
                          [["--quick", "--out", str(tmp_path / "afile")], "is a file, not a folder"]):
        with pytest.raises(SystemExit):
            bench_prefetch.main(argv)
        assert message in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench_prefetch.main([])
        assert "the full-size run needs a CUDA GPU" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == ""


def test_every_command_with_an_out_folder_refuses_a_file_before_its_run(tmp_path, capsys, monkeypatch):
    """The benchmarks and studies that write result CSVs check --out first (not at the first write,
    after the run): a file there is the parser's error, and the file is left as it was."""
    (tmp_path / "afile").write_text("keep")
    for module in ("benchmarks.bench_resolve", "benchmarks.bench_attention_dsa", "benchmarks.bench_attention_nsa",
                   "benchmarks.bench_attention_quest", "experiments.policies"):
        code, err = parser_exit(capsys, monkeypatch, module, "--quick", "--out", str(tmp_path / "afile"))
        assert code == 2 and "is a file, not a folder for the result CSVs" in err, module
    assert (tmp_path / "afile").read_text() == "keep"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where the Gluon kernel cannot run (no GPU)")
def test_bench_attention_dsa_refuses_the_gluon_backend_where_it_cannot_run(tmp_path, capsys, monkeypatch):
    code, err = parser_exit(capsys, monkeypatch, "benchmarks.bench_attention_dsa", "--quick", "--backend", "gluon",
                            "--out", str(tmp_path))
    assert code == 2, err[-2000:]
    assert "--backend gluon: the Gluon decode kernel cannot run here: " in err
    assert not list(tmp_path.iterdir()), "nothing may run or be written"


def test_bench_attention_dsa_fp8_refuses_what_it_does_not_time(tmp_path, capsys, monkeypatch):
    code, err = parser_exit(capsys, monkeypatch, "benchmarks.bench_attention_dsa", "--quick", "--kv-dtype", "fp8",
                            "--indexer", "--out", str(tmp_path))
    assert code == 2 and "--kv-dtype fp8 times the Triton FP8 kernel" in err, err[-2000:]
    assert not list(tmp_path.iterdir())


def test_fp8_attention_rows_are_summarised_apart_from_bf16_ones():
    """attention.csv with bf16 rows of one commit and fp8 rows of a later one: each keeps its line
    (and its target), neither hides the other; the Gluon FP8 kernel's rows get a line of their own."""
    from benchmarks.summary import attention_lines
    base = dict(bench="attention", family="dsa", mode="triton", batch=64, context=32768, metric="roofline_frac",
                gpu="NVIDIA H200")
    frame = pd.DataFrame([dict(base, commit="old", value=0.41), dict(base, commit="new", kv_dtype="fp8", value=0.30),
                          dict(base, commit="new", kv_dtype="fp8", mode="gluon", value=0.27),
                          dict(base, commit="new", kv_dtype="fp8", mode="gluon", batch=16, value=0.1)])
    assert attention_lines(frame) == [
        "attention dsa: roofline_frac at batch >= 32 min 0.41 median 0.41 (target >= 0.40)",
        "attention dsa fp8: roofline_frac at batch >= 32 min 0.30 median 0.30 (goal >= 0.50, bar >= 0.41)",
        "attention dsa fp8 gluon: roofline_frac at batch >= 32 min 0.27 median 0.27 (goal >= 0.50, bar >= 0.41)"]


def test_gpu_suite_draws_a_serving_sweeps_selections_before_the_sweep(tmp_path):
    """benchmarks/gpu_suite.sh with SWEEP_ARGS runs the sweep into $OUT/sweep and logs it (here a tiny
    serving study, on the CPU: no tests, no benchmarks). With --draw-cache among them the draws are
    made by a --draw-only sweep started beside the tests, so the sweep itself draws nothing."""
    root = Path(__file__).resolve().parents[1]
    config = tmp_path / "serving.toml"
    config.write_text('[[study]]\nkind = "serving"\nmodel = "tiny:deepseek_v32"\nlayers = 1\nmodes = ["hisparse"]\n'
                      'cache_slots = 16\ninput_len = 24\noutput_len = 3\nconcurrency = [1]\n'
                      'requests_per_client = 1\nkv_budget_gib = 0.000035\nprefill_chunk = 32\nworkload = "tiny"\n')
    env = dict(os.environ, TESTS="none", HOST_GROW_GIB="0", OUT=str(tmp_path / "out"), PYTHON=sys.executable,
               SWEEP_ARGS=f"--config {config} --draw-cache {tmp_path / 'draws'}")
    done = subprocess.run(["bash", "benchmarks/gpu_suite.sh", "none"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    log = (tmp_path / "out" / "gpu_log.txt").read_text()
    assert f"== experiments.sweep --config {config} --draw-cache {tmp_path / 'draws'} --out" in log
    assert "draws of 1 requests" in log and "drawing" not in log.split("== experiments.sweep")[1]
    assert len(list((tmp_path / "draws").glob("*.npy"))) == 1
    rows = pd.read_csv(tmp_path / "out" / "sweep" / "serving.csv")
    assert len(rows) > 0 and set(rows["bench"]) == {"serving"}


def test_gpu_suite_says_when_it_has_no_ncu_and_fails(tmp_path):
    """NCU=1 without Nsight Compute: the log says so and the suite's status is a failure (PATH holds only
    the tools the suite calls, so an installed ncu is not found; $PYTHON names this interpreter)."""
    root = Path(__file__).resolve().parents[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "tee", "tail", "grep", "tr", "ls", "cat", "timeout", "mkdir", "kill", "sleep"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    env = dict(os.environ, TESTS="none", HOST_GROW_GIB="0", NCU="1", OUT=str(tmp_path / "out"), PATH=str(bin_dir),
               PYTHON=sys.executable)
    done = subprocess.run([shutil.which("bash"), "benchmarks/gpu_suite.sh", "none"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    if Path("/opt/nvidia/nsight-compute").exists():
        pytest.skip("an ncu under /opt/nvidia/nsight-compute is found whatever PATH holds")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "NCU=1: no ncu (Nsight Compute)" in (tmp_path / "out" / "gpu_log.txt").read_text()


NCU_COLUMNS = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb",'
               '"stall_wait","stall_long_sb (Not Issued)"')
NCU_SOURCE_VIEW = '"Kernel Name","_k",\n' + NCU_COLUMNS + '''
"0x0","      LDC R1, c[0x0][0x28]","2","4","0","2","0"
"0x10","      LDG.E R2, desc[UR4][R2.64]","0","8","0","0","0"
"0x20","  @P0   ISETP.GT.AND P1, PT, R2, 0x1, PT","6","8","5","1","5"
"0x30","      EXIT","0","4","0","0","0"
'''


def test_ncu_summary_reads_the_source_view(tmp_path, capsys):
    """experiments/tools/ncu_summary.py on a CSV shaped as ncu writes it: instructions per warp (the first
    instruction runs once per warp), stall shares, the hottest instruction with its main reason."""
    from experiments.tools import ncu_summary
    path = tmp_path / "k.sass.csv"
    path.write_text(NCU_SOURCE_VIEW)
    ncu_summary.main([str(path), "--top", "2"])
    out = capsys.readouterr().out
    assert "4 SASS instructions, 4 warps, 6 instructions issued per warp, the most executed ones 2 times" in out
    assert "ISETP.GT.AND 2" in out and "LDG.E 2" in out         # the guard predicate (@P0) stripped
    assert "long_sb 0.625, wait 0.375" in out
    assert "0.750 long_sb          @P0   ISETP.GT.AND" in out


def test_ncu_kernels_names_its_kernels_and_needs_a_gpu(capsys):
    from experiments.tools import ncu_kernels
    with pytest.raises(SystemExit):
        ncu_kernels.main(["attention"])
    assert "invalid choice: 'attention'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ncu_kernels.main(["resolve", "--miss", "2"])
    assert "--batch 64 --miss 2.0: expected a batch >= 1 and a miss rate in (0, 1]" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="on a CUDA GPU; none is available here"):
            ncu_kernels.main(["resolve"])


def test_summary_prints_each_prefill_point_beside_its_target():
    from benchmarks.summary import prefill_lines
    """The newest GPU rows of each (family, context): an older run, the reference's rows and a --quick run's
    CPU rows in the same file are left out."""
    gpu = "NVIDIA H200"
    runs = (("dsa", 32768, "old", "model", 2.0, gpu), ("dsa", 32768, "new", "model", 1.0, gpu),
            ("dsa", 32768, "new", "reference", 50.0, gpu), ("quest", 32768, "new", "model", 1.0, gpu),
            ("dsa", 40, "quick", "model", 3.0, "cpu"))
    rows = [dict(bench="prefill", family=f, mode=m, context=c, metric=metric, value=v, commit=commit, gpu=gpu)
            for f, c, commit, m, scale, gpu in runs
            for metric, v in (("prefill_s", 5.0 * scale), ("roofline_frac", 0.3 / scale), ("peak_gib", 4.0),
                              ("kv_gib", 2.5))]
    lines = prefill_lines(pd.DataFrame(rows))
    assert lines == ["prefill dsa 32K: 5.00 s, 0.30 of the FLOP roofline, peak 4.0 GiB (KV 2.5; target <= KV + 4) "
                     "(target prefill_s <= 8 (goal 4))",
                     "prefill quest 32K: 5.00 s, 0.30 of the FLOP roofline (target roofline_frac >= 0.4)"]


def test_summary_states_what_http_adds_beside_the_in_process_twin():
    from benchmarks.summary import http_lines
    point = dict(bench="serving", family="dsa", model="dsa", mode="hisparse", workload="dsa_100k", layers=61,
                 hidden=1024, cache_slots=4096, input_len=16384, output_len=1024, concurrency=8, kv_budget_gib=4,
                 prefill_chunk=8192, gpu="NVIDIA H200", commit="abc", timestamp="2026-12-01T10:00:00")
    own = {"ttft_ms_p50": 4000.0, "tpot_ms_p50": 20.0, "tokens_per_s": 100.0}
    web = {"ttft_ms_p50": 4100.0, "tpot_ms_p50": 20.5, "tokens_per_s": 98.0}
    rows = [dict(point, transport=None, metric=m, value=v) for m, v in own.items()]
    rows += [dict(point, transport="http", metric=m, value=v) for m, v in web.items()]
    rows += [dict(point, concurrency=2, transport=None, metric=m, value=v) for m, v in own.items()]  # no twin
    assert http_lines(pd.DataFrame(rows)) == [
        "serving over HTTP, hisparse 8 clients, 16384 in / 1024 out: TTFT p50 4100.0 vs 4000.0 ms (+2.5%), "
        "TPOT p50 20.5 vs 20.0 ms (+2.5%); tokens/s 0.980x in-process"]
    assert http_lines(pd.DataFrame(rows[:3])) == []


def test_a_serving_study_resumed_at_a_later_commit_is_read_whole():
    """Levels 1 and 2 at one commit, 3 and 8 resumed at a later one, and an HTTP row newer still: the
    targets read all four levels of the in-process study."""
    from benchmarks.summary import serving_lines
    shape = dict(bench="serving", input_len=1024, output_len=256, prefill_chunk=512, gpu="NVIDIA H200")
    rows = []
    for level, commit, stamp in ((1, "a", "2026-12-01T10:00:00"), (2, "a", "2026-12-01T10:10:00"),
                                 (3, "b", "2026-12-02T10:00:00"), (8, "b", "2026-12-02T10:10:00")):
        for mode, tpot in (("resident", 20.0), ("hisparse", 22.0 if level == 1 else 30.0)):
            rows += [dict(shape, mode=mode, concurrency=level, metric=m, value=v, commit=commit, timestamp=stamp)
                     for m, v in (("tokens_per_s", 10.0 * level), ("tpot_ms_p50", tpot), ("ttft_ms_p50", 100.0),
                                  ("lanes", 2.0))]
    rows.append(dict(shape, mode="hisparse", concurrency=8, metric="tokens_per_s", value=1.0, commit="c",
                     timestamp="2026-12-03T10:00:00", transport="http"))
    lines = serving_lines(pd.DataFrame(rows))
    assert [line.split(":")[0] for line in lines[:3]] == ["serving 3 clients", "serving 8 clients", "serving 1 clients"]
    assert "TPOT p50 hisparse / resident 1.100" in lines[2]
    # resident at 1 client rerun later on another machine (slower): hisparse's TPOT is still read
    # against resident's run of its own commit; noio, run beside the rerun, against the rerun
    later = dict(shape, concurrency=1, metric="tpot_ms_p50", commit="d", timestamp="2026-12-04T10:00:00")
    rows += [dict(later, mode="resident", value=25.0), dict(later, mode="noio", value=24.0)]
    assert ("serving 1 clients: TPOT p50 hisparse / resident 1.100 (target <= 1.25), noio / resident 0.960 "
            "(target <= 1.03)") in serving_lines(pd.DataFrame(rows))


def test_summary_prints_the_serving_targets():
    from benchmarks.summary import serving_lines
    values = {("resident", 2): (60, 20, 1000, 1), ("hisparse", 2): (58, 22, 1000, 2), ("noio", 2): (60, 20.4, 1000, 2),
              ("resident", 8): (80, 40, 9000, 4), ("hisparse", 8): (160, 50, 3000, 8),
              ("resident", 16): (80, 40, 20000, 4), ("hisparse", 16): (120, 60, 10000, 9)}
    shape = dict(bench="serving", input_len=1024, output_len=256, prefill_chunk=512, gpu="NVIDIA H200")
    rows = [dict(shape, mode=mode, concurrency=c, metric=m, value=v, commit="abc", timestamp="2026-12-01T10:00:00")
            for (mode, c), vals in values.items()
            for m, v in zip(("tokens_per_s", "tpot_ms_p50", "ttft_ms_p50", "lanes"), vals)]
    rows += [dict(shape, mode=mode, concurrency=8, metric="running_batch_mean", value=v, commit="abc",
                  timestamp="2026-12-01T10:00:00") for mode, v in (("hisparse", 6.5), ("resident", 4.0))]
    # a chunk study of an earlier commit (one level, two chunks) and a rerun of one of its points
    chunks = {(512, "2026-11-30T10:00:00"): (900, 30, 50), (2048, "2026-11-30T10:00:00"): (700, 35, 400),
              (2048, "2026-11-30T11:00:00"): (650, 34, 420)}
    rows += [dict(shape, output_len=64, prefill_chunk=chunk, mode="hisparse", concurrency=2, metric=m, value=v,
                  commit="old", timestamp=stamp)
             for (chunk, stamp), vals in chunks.items()
             for m, v in zip(("ttft_ms_p50", "tpot_ms_p50", "itl_ms_p99"), vals)]
    lines = serving_lines(pd.DataFrame(rows))
    assert lines == [
        "serving 8 clients: hisparse / resident output tokens/s 2.00x (target >= 1.6), p50 TTFT 3.00x lower "
        "(target >= 2); lanes 8 / 4, running batch 6.50 / 4.00",
        "serving 16 clients: hisparse / resident output tokens/s 1.50x (target >= 1.6), p50 TTFT 2.00x lower "
        "(target >= 2); lanes 9 / 4",
        "serving 2 clients: TPOT p50 hisparse / resident 1.100 (target <= 1.25), noio / resident 1.020 (target <= 1.03)",
        "serving 2 clients, hisparse, 1024 in / 64 out, p50 per prefill chunk: 512: TTFT 900 / TPOT 30.0 / ITL p99 50 "
        "ms; 2048: TTFT 650 / TPOT 34.0 / ITL p99 420 ms"]
    three_each = [dict(row, requests_per_client=3, value=10 * row["value"]) for row in rows if row["output_len"] == 64]
    assert lines[-1] in serving_lines(pd.DataFrame(rows + three_each))     # a 3-per-client twin is not averaged in
    without_noio = serving_lines(pd.DataFrame([row for row in rows if row["mode"] != "noio"]))
    assert ("serving 2 clients: TPOT p50 hisparse / resident 1.100 (target <= 1.25), noio / resident not measured yet "
            "(target <= 1.03)") in without_noio


def test_summary_sets_a_run_of_more_requests_per_client_beside_its_twin():
    """Points with requests_per_client (3 here) are not the study: each level gets its own line, the
    tokens/s and TTFT ratios with the running batches, and the ratio of its twin run with 2 each; a
    level where a mode is missing says so."""
    from benchmarks.summary import serving_lines
    shape = dict(bench="serving", input_len=1024, output_len=100, prefill_chunk=512, gpu="NVIDIA H200",
                 commit="abc", timestamp="2026-12-02T10:00:00")
    values = {("resident", 8, None): (80, 9000, 2, 2.0), ("hisparse", 8, None): (120, 3000, 5, 4.0),
              ("resident", 1, None): (50, 1000, 1, 1.0), ("hisparse", 1, None): (48, 1000, 1, 1.0),
              ("resident", 8, 3): (80, 12000, 2, 2.0), ("hisparse", 8, 3): (140, 3000, 5, 4.8),
              ("hisparse", 6, 3): (130, 2000, 5, 4.5)}
    rows = [dict(shape, mode=mode, concurrency=level, requests_per_client=per_client, metric=m, value=v)
            for (mode, level, per_client), vals in values.items()
            for m, v in zip(("tokens_per_s", "ttft_ms_p50", "lanes", "running_batch_mean"), vals)]
    lines = serving_lines(pd.DataFrame(rows))
    assert any(line.startswith("serving 8 clients: hisparse / resident output tokens/s 1.50x") for line in lines)
    assert ("serving 6 clients, 3 requests each: resident not measured yet (targets: tokens/s >= 1.6x, p50 TTFT "
            ">= 2x lower)") in lines
    assert ("serving 8 clients, 3 requests each: hisparse / resident output tokens/s 1.75x (target >= 1.6), p50 TTFT "
            "4.00x lower (target >= 2); running batch 4.80 of 5 / 2.00 of 2; 2 requests each: 1.50x") in lines


def test_summary_prints_the_prefill_bound_estimate_hybrid_targets_and_unmeasured_modes():
    """With prefill time, step times, lanes and requests measured, the tokens/s target gets the
    estimate beside it, n P + n (out - 1) / lanes x ITL p50 per mode: at 4 clients resident
    8 x 1 s + 8 / 2 x 99 x 10 ms = 11.96 s, hisparse 8 x 1 + 8 / 4 x 99 x 12 ms = 10.376 s: 1.15x
    (P: hisparse's TTFT less its queueing at that level, 3 s - 2 s). Hybrid gets 0.97x resident's
    where resident admits every request (lanes >= clients: 1 and 2) and 0.95x hisparse's at the two
    highest levels; a level missing a mode says so instead of printing nan; a ratio of rows from two
    commits names them (hybrid at 2 clients ran on another tree)."""
    from benchmarks.summary import serving_lines
    shape = dict(bench="serving", input_len=1024, output_len=100, prefill_chunk=512, gpu="NVIDIA H200",
                 commit="abc", timestamp="2026-12-02T10:00:00")
    tokens = {("resident", 1): 50, ("hisparse", 1): 48, ("noio", 1): 50, ("hybrid", 1): 49,
              ("resident", 2): 80, ("hisparse", 2): 78, ("hybrid", 2): 80,
              ("resident", 4): 80, ("hisparse", 4): 90, ("hybrid", 4): 88.2, ("resident", 8): 80}
    rows = []
    for (mode, level), value in tokens.items():
        lanes = min(level, 2) if mode == "resident" else level
        metrics = dict(tokens_per_s=value, tpot_ms_p50=15.3 if mode == "hisparse" else 15.0,
                       ttft_ms_p50=1000.0 if level < 4 else (9000.0 if mode == "resident" else 3000.0),
                       queue_ms_p50=2000.0 if (mode, level) == ("hisparse", 4) else 0.0, lanes=lanes, requests=2 * level,
                       itl_ms_p50=10.0 if mode == "resident" else 12.0)
        if mode == "hybrid":
            metrics.update(resident_admissions=level, demotions=level // 4)
        tree = dict(commit="def") if (mode, level) == ("hybrid", 2) else {}
        rows += [dict(shape, mode=mode, concurrency=level, metric=m, value=v, **tree) for m, v in metrics.items()]
    assert serving_lines(pd.DataFrame(rows)) == [
        "serving 4 clients: hisparse / resident output tokens/s 1.12x (target >= 1.6; 1.15x with every lane busy "
        "and prefill alone between steps), p50 TTFT 3.00x lower (target >= 2); lanes 4 / 2",
        "serving 8 clients: hisparse not measured yet (targets: tokens/s >= 1.6x, p50 TTFT >= 2x lower)",
        "serving 1 clients: TPOT p50 hisparse / resident 1.020 (target <= 1.25), noio / resident 1.000 (target <= 1.03)",
        "serving 1 clients: hybrid output tokens/s 0.980x resident's (target >= 0.97), 1 resident admissions, "
        "0 demotions",
        "serving 2 clients: hybrid output tokens/s 1.000x resident's (target >= 0.97) [def against abc], 2 resident "
        "admissions, 0 demotions",
        "serving 4 clients: hybrid output tokens/s 0.980x hisparse's (target >= 0.95), 4 resident admissions, "
        "1 demotions"]


def test_summary_prints_hybrid_throughput_beside_its_targets_and_unmeasured_points():
    """Throughput study rows (DSA): hybrid over resident at 4K (>= 0.97) and over hisparse at the same
    cache_slots at 64K and 128K (>= 0.95), with the batches and requests placed resident; a point
    without hybrid's, or without the mode it is measured against, says so instead of printing nan; a
    CPU row and an older run of a point are not read, nor fp8 rows."""
    from benchmarks.summary import throughput_lines
    shape = dict(bench="throughput", family="dsa", model="dsa", workload="dsa_100k", gpu="NVIDIA H200", commit="abc",
                 timestamp="2026-12-02T10:00:00", kv_budget_gib=24)
    runs = [("resident", 4096, None, 72, 1000.0), ("hybrid", 4096, 4096, 72, 980.0),
            ("hisparse", 65536, 4096, 19, 400.0), ("hybrid", 65536, 4096, 19, 392.0),
            ("hisparse", 65536, 2048, 19, 100.0), ("hybrid", 131072, 4096, 10, 200.0)]
    rows = [dict(shape, mode=m, context=c, cache_slots=b, batch=n, metric="tokens_per_s", value=v)
            for m, c, b, n, v in runs]
    rows += [dict(shape, mode="hybrid", context=c, cache_slots=4096, batch=n, metric="resident_requests", value=r)
             for c, n, r in ((4096, 72, 72), (65536, 19, 1), (131072, 10, 0))]
    rows.append(dict(rows[1], value=1.0, timestamp="2026-12-01T10:00:00"))          # an older run of the point
    rows.append(dict(rows[1], value=5.0, gpu="cpu", timestamp="2026-12-03T10:00:00"))
    rows.append(dict(rows[0], value=1.0, kv_dtype="fp8"))
    assert throughput_lines(pd.DataFrame(rows)) == [
        "throughput 4K: hybrid / resident tokens/s 0.980x (target >= 0.97; batch 72 / 72, 72 of 72 requests resident)",
        "throughput 64K: hybrid / hisparse tokens/s 0.980x (target >= 0.95; batch 19 / 19, 1 of 19 requests resident)",
        "throughput 128K: hisparse not measured yet beside hybrid (target: hybrid / hisparse tokens/s >= 0.95)"]
    assert throughput_lines(pd.DataFrame(rows[:1])) == [
        "throughput 4K: hybrid / resident tokens/s not measured yet (target >= 0.97)",
        "throughput 64K: hybrid / hisparse tokens/s not measured yet (target >= 0.95)",
        "throughput 128K: hybrid / hisparse tokens/s not measured yet (target >= 0.95)"]


def test_summary_sets_fp8_throughput_beside_the_bf16_run_at_each_context():
    """fp8 throughput rows (issue 36): hisparse over resident per context with both modes, beside the
    bf16 rows' ratio where the context has them (the target at 128K); a context missing a mode is left out."""
    from benchmarks.summary import throughput_lines
    shape = dict(bench="throughput", family="dsa", model="dsa", workload="dsa_100k", gpu="NVIDIA H200", commit="abc",
                 timestamp="2026-12-02T10:00:00", kv_budget_gib=24, cache_slots=4096, metric="tokens_per_s")
    runs = [("bf16", "resident", 131072, 2, 100.0), ("bf16", "hisparse", 131072, 10, 300.0),
            ("fp8", "resident", 131072, 3, 150.0), ("fp8", "hisparse", 131072, 11, 330.0),
            ("fp8", "resident", 204800, 2, 100.0), ("fp8", "hisparse", 204800, 7, 250.0),
            ("fp8", "hisparse", 32768, 37, 900.0)]
    rows = [dict(shape, kv_dtype=kv, mode=m, context=c, batch=n, value=v) for kv, m, c, n, v in runs]
    assert throughput_lines(pd.DataFrame(rows))[3:] == [
        "throughput fp8 128K: hisparse / resident tokens/s 2.20x (batch 11 / 3), bf16 3.00x (batch 10 / 2; "
        "target >= bf16's)",
        "throughput fp8 200K: hisparse / resident tokens/s 2.50x (batch 7 / 2)"]


def test_summary_sets_the_fp8_decode_overhead_beside_bf16s():
    """decode.csv (issue 36): hisparse's TPOT over resident's with fp8 rows beside the bf16 rows' at
    the same hidden, context and batch; a point without bf16's says so; no fp8 rows, no lines."""
    from benchmarks.summary import decode_lines
    shape = dict(bench="decode", family="dsa", gpu="NVIDIA H200", commit="abc", timestamp="2026-12-02T10:00:00",
                 hidden=1024, context=32768, metric="tpot_ms")
    runs = [(None, "resident", 32, 19.0), (None, "hisparse", 32, 31.0), (None, "noio", 32, 20.0),
            ("fp8", "resident", 32, 18.0), ("fp8", "hisparse", 32, 24.0),
            ("fp8", "resident", 16, 15.0), ("fp8", "hisparse", 16, 17.5)]
    rows = [dict(shape, kv_dtype=kv, mode=m, batch=b, value=v) for kv, m, b, v in runs]
    assert decode_lines(pd.DataFrame(rows)) == [
        "decode fp8, hidden 1024, 32K, batch 16: hisparse TPOT over resident +2.50 ms, bf16 not measured at this point",
        "decode fp8, hidden 1024, 32K, batch 32: hisparse TPOT over resident +6.00 ms, bf16 +12.00 ms (0.500 of it; "
        "target <= 0.667)"]
    assert decode_lines(pd.DataFrame(rows[:3])) == []


def test_summary_sets_each_overlapped_serving_point_beside_its_twins():
    """prefill_overlap rows: tokens/s over resident's with overlap and without, and over the mode's own
    run without, TTFT and TPOT beside the twin's; the study's target lines read the rows without
    overlap only (the overlapped ones, newer, are not taken for the study)."""
    from benchmarks.summary import serving_lines
    shape = dict(bench="serving", input_len=1024, output_len=100, prefill_chunk=512, gpu="NVIDIA H200")
    values = {("resident", 4, None): 100, ("hisparse", 4, None): 130, ("resident", 8, None): 100,
              ("hisparse", 8, None): 140, ("resident", 8, True): 110, ("hisparse", 8, True): 176}
    rows = []
    for (mode, level, overlap), tokens in values.items():
        stamp = "2026-12-02T10:00:00" if overlap else "2026-12-01T10:00:00"
        rows += [dict(shape, mode=mode, concurrency=level, prefill_overlap=overlap, metric=m, value=v, commit="a",
                      timestamp=stamp)
                 for m, v in (("tokens_per_s", tokens), ("ttft_ms_p50", 1000.0 if overlap else 2000.0),
                              ("tpot_ms_p50", 22.0 if overlap else 20.0), ("lanes", 4.0))]
    # an fp8 run of the same shape is no twin of the bf16 ones
    rows += [dict(r, kv_dtype="fp8", value=r["value"] * 3) for r in rows if r["prefill_overlap"] is None]
    lines = serving_lines(pd.DataFrame(rows))
    assert "hisparse / resident output tokens/s 1.40x" in lines[1]
    assert lines[-2:] == [
        "serving 8 clients, hisparse with prefill_overlap: 176 tokens/s, 1.60x resident's with overlap, 1.76x "
        "resident's without (target >= 1.6), 1.26x its own without; p50 TTFT 1000 ms (without 2000), TPOT "
        "22.0 ms (without 20.0)",
        "serving 8 clients, resident with prefill_overlap: 110 tokens/s, 1.10x its own without; p50 TTFT 1000 ms "
        "(without 2000), TPOT 22.0 ms (without 20.0)"]
    # pieces of one layer: beside the same chunk's twins without overlap (they have no pieces); at a
    # chunk where resident ran without overlap at two other chunks only, the faster of those, named
    one = dict(shape, prefill_layers=1, mode="hisparse", concurrency=8, prefill_overlap=True, commit="a",
               timestamp="2026-12-03T10:00:00")
    small = dict(one, prefill_chunk=128)
    slow = dict(shape, prefill_chunk=4096, mode="resident", concurrency=8, prefill_overlap=None, commit="a",
                timestamp="2026-11-30T10:00:00")
    metrics = (("tokens_per_s", 180.0), ("ttft_ms_p50", 3000.0), ("tpot_ms_p50", 21.0), ("lanes", 4.0))
    rows += [dict(p, metric=m, value=v) for p in (one, small) for m, v in metrics]
    rows += [dict(slow, metric=m, value=50.0 if m == "tokens_per_s" else v) for m, v in metrics]
    lines = serving_lines(pd.DataFrame(rows))
    assert lines[-5] == ("serving 8 clients, hisparse with prefill_overlap (pieces of 1 layer): 180 tokens/s, "
                         "1.80x resident's without at chunk 512 (target >= 1.6)")
    assert lines[-4] == ("serving 8 clients, hisparse with prefill_overlap (pieces of 1 layer): 180 tokens/s, "
                         "1.80x resident's without (target >= 1.6), 1.29x its own without; p50 TTFT 3000 ms "
                         "(without 2000), TPOT 21.0 ms (without 20.0)")
    assert lines[-3].startswith("serving 8 clients, hisparse with prefill_overlap: 176 tokens/s")
    assert lines[-1].startswith("serving 8 clients, resident, 1024 in / 100 out, p50 per prefill chunk")   # 2 chunks ran
    # pieces in a green context of 64 SMs, on another tree: twins without overlap (no SMs to name),
    # each ratio across the two trees naming both commits
    green = dict(shape, prefill_sms=64, mode="hisparse", concurrency=8, prefill_overlap=True, commit="b",
                 timestamp="2026-12-04T10:00:00")
    rows += [dict(green, metric=m, value=v) for m, v in metrics]
    assert ("serving 8 clients, hisparse with prefill_overlap (on 64 SMs): 180 tokens/s, 1.80x resident's without "
            "(target >= 1.6) [b against a], 1.29x its own without; p50 TTFT 3000 ms (without 2000), TPOT 21.0 ms "
            "(without 20.0) [b against a]") in serving_lines(pd.DataFrame(rows))


def test_prefill_parts_refuses_methods_that_disagree(tmp_path, monkeypatch):
    """bench_prefill_parts checks that a part's methods give the same bits before timing them: a top-k
    method off by one pick stops the run, naming the part and method, and writes no rows."""
    from benchmarks import bench_prefill_parts as bench
    real = bench.topk_of_indexer_scores

    def off_by_one(scores, lengths, k, method):
        sel = real(scores, lengths, k, method)
        if method == "radix":
            sel[0, 0] += 1
        return sel

    monkeypatch.setattr(bench, "topk_of_indexer_scores", off_by_one)
    with pytest.raises(SystemExit, match="topk at T = 256: method radix differs"):
        bench.main(["--quick", "--out", str(tmp_path)])
    assert not (tmp_path / "prefill_parts.csv").exists()


@pytest.mark.parametrize("config,message", [("16,x", "expected four integers"),
                                            ("16,3,4,1", "queries=3: expected 1, 2 or 4")])
def test_prefill_parts_refuses_a_bad_indexer_config(capsys, monkeypatch, config, message):
    """--indexer-configs: a config that is not four integers, or that the indexer refuses, stops the
    parser before any work, naming the value and what was expected."""
    code, err = parser_exit(capsys, monkeypatch, "benchmarks.bench_prefill_parts", "--quick",
                            "--indexer-configs", config)
    assert code == 2 and repr(config) in err and message in err

"""Every benchmark's --quick run (tiny shapes through the interpreter) works from a fresh process and
writes its rows: the CSV columns the figures and the README read."""
import os
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
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_quick_run_writes_its_rows(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # the benchmark sets it itself
    run = subprocess.run([sys.executable, "-m", f"benchmarks.bench_{name}", "--quick", "--out", str(tmp_path)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    csv, metrics = CASES[name]
    rows = pd.read_csv(tmp_path / csv)
    assert metrics <= set(rows.metric), f"{name}: missing {metrics - set(rows.metric)}"
    assert rows.value.notna().any() and (rows.gpu == "cpu").all() and rows.commit.notna().all()


@pytest.mark.parametrize("family,k,unit_bytes,workload", [("quest", 3, 2 * 16 * 16 * 4, "synthetic"),
                                                         ("quest", 3, 2 * 16 * 16 * 4, "model"),
                                                         ("nsa", 4, 2 * 64 * 16 * 4, "synthetic")])
def test_prefetch_on_quest_and_nsa_models_with_shared_selections(tmp_path, family, k, unit_bytes, workload):
    """--family quest / nsa: the four modes on a model whose layers share a selection, replayed per KV
    head from the synthetic generator or made by the model itself; rows name the family, its k, unit
    size and workload; the figures, drawn for DSA, leave them out."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_prefetch", "--quick", "--family", family,
                          "--workload", workload, "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "prefetch.csv")
    assert (rows.family == family).all() and (rows.workload == ("model" if workload == "model" else "tiny")).all()
    assert (rows.k == k).all() and (rows.unit_bytes == unit_bytes).all() and (rows.shared_layers == 2).all()
    assert sorted(rows[rows.metric == "tpot_ms"]["mode"]) == ["noio", "prefetch", "resident", "sync"]
    assert (rows[(rows.metric == "miss_rate") & (rows["mode"] != "resident")].value > 0).all()
    from experiments.figures import default_prefetch_variant
    assert default_prefetch_variant(rows).empty


def test_prefetch_variants_each_get_their_rows(tmp_path):
    """Several copy widths and priorities in one run: one prefetch run (and hidden share) per pair."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_prefetch", "--quick", "--out", str(tmp_path),
                          "--prefetch-programs", "8", "32", "--prefetch-priority", "normal", "high"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "prefetch.csv")
    hidden = rows[rows.metric == "hidden_frac"]
    assert sorted(zip(hidden.prefetch_programs, hidden.prefetch_priority)) == [
        (8, "high"), (8, "normal"), (32, "high"), (32, "normal")]
    from hisparse.resolve import copy_tile          # each prefetch row records its copy's tile
    words = int(rows.unit_bytes.iloc[0]) // 4
    assert sorted(set(zip(hidden.prefetch_programs, hidden.prefetch_rows))) == [
        (8, copy_tile(words, 8)[1]), (32, copy_tile(words, 32)[1])]
    assert copy_tile(words, 8)[1] > copy_tile(words, 32)[1]
    assert rows.loc[rows["mode"] != "prefetch", "prefetch_rows"].isna().all()
    assert sorted(rows[rows.metric == "tpot_ms"]["mode"]) == ["noio"] + ["prefetch"] * 4 + ["resident", "sync"]
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
    assert len(ceiling) == 4 and (ceiling < 1).all()
    assert np.allclose(1 / ceiling - 1, anchor_io_ms / noio, rtol=1e-6, atol=0)
    bad = subprocess.run([sys.executable, "-m", "benchmarks.bench_prefetch", "--quick", "--prefetch-programs", "0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--prefetch-programs 0: expected a positive integer" in bad.stderr


def test_resolve_decode_like_points_keep_their_miss_rates(tmp_path):
    """--decode-like: layers' streams taking turns in one state, units spread over a longer context;
    the workload's exact miss rate holds at every point."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_resolve", "--quick", "--decode-like",
                          "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "resolve_layers.csv")
    assert sorted(set(zip(rows.layers, rows.context))) == [(1, 48), (1, 60), (1, 256), (3, 256)]
    misses = rows[rows.metric == "miss_rate"]
    assert (misses.value - misses.target_miss).abs().max() < 1e-9
    assert (rows[rows.metric == "noio_us"].value > 0).all()


def test_resolve_decode_like_with_the_newest_rows_written_both_ways():
    """scripts/tune_resolve.py --newest's timing: the newest rows written in a launch of their own or
    by the resolve; the same selections, so the same misses, and a bad choice named."""
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


def test_decode_ablation_quick_run_writes_every_variant(tmp_path):
    """scripts/ablate_decode.py on a tiny model: each variant's rows, and (the script checks it) each
    noio variant generates noio's tokens, so no variant changes what the step computes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "scripts.ablate_decode", "--quick", "--batch", "2", "--rounds", "1",
                          "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "decode_ablation.csv")
    from scripts.ablate_decode import VARIANTS
    assert sorted(rows["mode"].unique()) == sorted(VARIANTS)
    assert set(rows.metric) == {"tpot_ms", "tpot_median_ms"} and (rows.value > 0).all()
    # each run numbered in the order this process made it, the variants in their listed order
    runs = rows.drop_duplicates("run")
    assert runs.run.tolist() == list(range(1, len(VARIANTS) + 1)) and runs["mode"].tolist() == list(VARIANTS)
    from benchmarks import summary
    [line] = summary.decode_ablation_lines(rows)
    assert line.startswith("decode ablation batch 2, hidden 64, median ms per step: resident ")
    assert all(f"{v} " in line for v in VARIANTS) and line.count("%)") == len(VARIANTS) - 1


def test_decode_ablation_patches_are_undone():
    import hisparse.cache
    import hisparse.host_pool as host_pool
    from scripts.ablate_decode import DevicePool, variant_setup
    before = hisparse.cache.HostPool, host_pool.HUGE_PAGES, host_pool.pinned_empty
    with variant_setup("noio-device-pool", []):
        assert hisparse.cache.HostPool is DevicePool
    with pytest.raises(KeyError), variant_setup("noio-huge-pages", []):
        assert host_pool.HUGE_PAGES is True
        raise KeyError("a failed run")
    assert (hisparse.cache.HostPool, host_pool.HUGE_PAGES, host_pool.pinned_empty) == before


def test_repeat_runs_refuses_bad_arguments_and_a_cpu_clearly():
    """scripts/repeat_runs.py (GPU only): bad counts named before anything is built; no GPU said plainly."""
    from scripts import repeat_runs
    expected = (r"--runs, --batch, --steps, --graph-kernels >= 1 and --pin-gib, --pause-s, --graphs-first >= 0 "
                r"expected, got ")
    with pytest.raises(SystemExit, match=expected + "0, 16, 32, 4000, 0.0, 0.0, 0"):
        repeat_runs.main(["--runs", "0"])
    with pytest.raises(SystemExit, match=expected + "6, 16, 32, 4000, 0.0, -1.0, 0"):
        repeat_runs.main(["--pause-s", "-1"])
    with pytest.raises(SystemExit, match=expected + "6, 16, 32, 4000, 0.0, 0.0, -2"):
        repeat_runs.main(["--graphs-first", "-2"])
    with pytest.raises(SystemExit, match=expected + "6, 16, 32, 0, 0.0, 0.0, 0"):
        repeat_runs.main(["--graph-kernels", "0"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            repeat_runs.main([])


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


def test_every_command_with_an_out_folder_refuses_a_file_before_its_run(tmp_path):
    """The benchmarks and studies that write result CSVs check --out first (not at the first write,
    after the run): a file there is the parser's error, and the file is left as it was."""
    (tmp_path / "afile").write_text("keep")
    for module in ("benchmarks.bench_resolve", "benchmarks.bench_attention_dsa", "benchmarks.bench_attention_nsa",
                   "benchmarks.bench_attention_quest", "experiments.policies"):
        done = subprocess.run([sys.executable, "-m", module, "--quick", "--out", str(tmp_path / "afile")], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and "is a file, not a folder for the result CSVs" in done.stderr, module
    assert (tmp_path / "afile").read_text() == "keep"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where the Gluon kernel cannot run (no GPU)")
def test_bench_attention_dsa_refuses_the_gluon_backend_where_it_cannot_run(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_attention_dsa", "--quick", "--backend", "gluon",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--backend gluon: the Gluon decode kernel cannot run here: " in done.stderr
    assert not list(tmp_path.iterdir()), "nothing may run or be written"


def test_gpu_suite_runs_a_sweep_into_its_out_folder(tmp_path):
    """scripts/gpu_suite.sh with SWEEP_ARGS runs the sweep into $OUT/sweep (here the default config's
    policy study, on the CPU: no tests, no benchmarks) and logs it."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TESTS="none", HOST_GROW_GIB="0", SWEEP_ARGS="--kind policies", OUT=str(tmp_path))
    done = subprocess.run(["bash", "scripts/gpu_suite.sh", "none"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "sweep" / "policies.csv")
    assert len(rows) > 0 and "policies" in set(rows["bench"])
    assert "== experiments.sweep --kind policies --out" in (tmp_path / "gpu_log.txt").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks how the suite reports a timeline that cannot run")
def test_gpu_suite_runs_the_timeline_into_its_out_folder_and_reports_a_failure(tmp_path):
    """TIMELINE_ARGS runs scripts/timeline_prefetch.py into $OUT/timeline_prefetch.txt, INTERFERENCE=1
    scripts/copy_interference.py into $OUT/copy_interference.txt; on a CPU both refuse, which the log
    shows and the suite's status reports."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TESTS="none", HOST_GROW_GIB="0", TIMELINE_ARGS="--batch 2 --modes prefetch",
               INTERFERENCE="1", INTERFERENCE_ARGS="--programs 4", OUT=str(tmp_path / "out"))
    done = subprocess.run([shutil.which("bash"), "scripts/gpu_suite.sh", "none"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    log = (tmp_path / "out" / "gpu_log.txt").read_text()
    assert "== timeline_prefetch --batch 2 --modes prefetch" in log and "no CUDA GPU here" in log
    assert "no CUDA GPU here" in (tmp_path / "out" / "timeline_prefetch.txt").read_text()
    assert "== copy_interference --programs 4" in log and "on a CUDA GPU; none here" in log
    assert "on a CUDA GPU; none here" in (tmp_path / "out" / "copy_interference.txt").read_text()


def test_gpu_suite_says_when_it_has_no_ncu_and_fails(tmp_path):
    """NCU=1 without Nsight Compute: the log says so and the suite's status is a failure (PATH holds only
    what bash, python3 and nvidia-smi need, so an installed ncu is not found)."""
    root = Path(__file__).resolve().parents[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("python3", "bash", "tee", "tail", "grep", "tr", "ls", "cat", "timeout", "mkdir", "kill", "sleep"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    env = dict(os.environ, TESTS="none", HOST_GROW_GIB="0", NCU="1", OUT=str(tmp_path / "out"), PATH=str(bin_dir))
    done = subprocess.run([shutil.which("bash"), "scripts/gpu_suite.sh", "none"], cwd=root, env=env,
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
    """scripts/ncu_summary.py on a CSV shaped as ncu writes it: instructions per warp (the first
    instruction runs once per warp), stall shares, the hottest instruction with its main reason."""
    from scripts import ncu_summary
    path = tmp_path / "k.sass.csv"
    path.write_text(NCU_SOURCE_VIEW)
    ncu_summary.main([str(path), "--top", "2"])
    out = capsys.readouterr().out
    assert "4 SASS instructions, 4 warps, 6 instructions issued per warp, the most executed ones 2 times" in out
    assert "ISETP.GT.AND 2" in out and "LDG.E 2" in out         # the guard predicate (@P0) stripped
    assert "long_sb 0.625, wait 0.375" in out
    assert "0.750 long_sb          @P0   ISETP.GT.AND" in out


def test_ncu_kernels_names_its_kernels_and_needs_a_gpu(capsys):
    from scripts import ncu_kernels
    with pytest.raises(SystemExit):
        ncu_kernels.main(["attention"])
    assert "invalid choice: 'attention'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ncu_kernels.main(["resolve", "--miss", "2"])
    assert "--batch 64 --miss 2.0: expected a batch >= 1 and a miss rate in (0, 1]" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="on a CUDA GPU; none is available here"):
            ncu_kernels.main(["resolve"])


def test_timeline_prefetch_finds_side_copies_and_the_computes_waits(tmp_path):
    """scripts/timeline_prefetch.py on a chrome trace shaped as torch.profiler writes it: steps split
    at the first anchor's resolve, side-stream copies told from in-line ones by their grid, and a gap
    in the compute stream named by the kernel it precedes."""
    import json
    from scripts import timeline_prefetch as tp
    events, t = [], 100.0

    def kernel(name, dur, grid, gap=0.0, stream=7):
        nonlocal t
        t += gap
        events.append({"cat": "kernel", "name": name, "ts": t, "dur": dur, "args": {"grid": grid, "stream": stream}})
        t += dur
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1.0})       # not a kernel: ignored
    for i in range(3):                 # 3 steps of 2 anchors; the side copy runs beside the anchor's MLP
        for _ in range(2):
            kernel("_resolve_kernel", 10 + 2 * i, [32, 1, 1])               # 20 us a step, then 24: 22 on average
            t -= 2 * i
            kernel("_fetch_rows_kernel", 100, [32, 256, 1])                  # the anchor's own, in line
            kernel("_fetch_rows_kernel", 150, [4, 1, 1], stream=9)           # a shared layer's, capped
            t -= 150                                                         # ... overlapping the next
            kernel("mlp_kernel", 50, [128, 1, 1])
            t -= 40
            kernel("norm_kernel", 10, [128, 1, 1], stream=8)     # inside the MLP's span: no gap after it
                                                                 # (on a stream of the graph's own: compute)
            t += 30
            kernel("_sparse_mla_decode_gluon_kernel", 40, [128, 1, 1], gap=120)   # waits for the copy
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    kernels = tp.kernels_of(str(path))
    assert len(kernels) == 36 and kernels[0]["programs"] == 32
    steps = tp.steps_of(kernels, anchors=2)
    assert [len(s) for s in steps] == [12, 12]          # the last step has no next resolve to end it
    step = tp.analyse(steps[0], side_programs=4)
    assert step["side"] == [(110.0, 150.0), (430.0, 150.0)]
    assert step["inline"] == [(10.0, 100.0), (330.0, 100.0)]
    assert step["gaps"] == [(280.0, 120.0, "_sparse_mla_decode_gluon_kernel"),
                            (600.0, 120.0, "_sparse_mla_decode_gluon_kernel")]
    # the compute stream's kernels per step, copies left out, and one mode's gains over another's
    times = tp.compute_us([tp.analyse(s, side_programs=4) for s in steps])
    assert times == {("_resolve_kernel", 32): 22.0, ("mlp_kernel", 128): 100.0, ("norm_kernel", 128): 20.0,
                     ("_sparse_mla_decode_gluon_kernel", 128): 80.0}
    slower = {("_resolve_kernel", 32): 28.0, ("mlp_kernel", 128): 99.0, ("norm_kernel", 128): 21.0,
              ("_sparse_mla_decode_gluon_kernel", 128): 80.0,
              ("void at::native::(anonymous namespace)::k<2>(int)", 2): 3.0}     # shortened when printed
    base = {**times, ("base_only_kernel", 64): 2.0}
    lines = tp.compare_compute(slower, base, top=2)
    assert lines[0].startswith("     231 us per step against 224: +7 (kernels of under 128 programs +7, the rest +0)")
    assert "+6.0 us  _resolve_kernel" in lines[1] and lines[1].endswith("22.0 /    28.0  x1.27")
    assert "+3.0 us  void at::native::k " in lines[2] and lines[2].endswith("new") and len(lines) == 3
    assert "-2.0 us  base_only_kernel" in tp.compare_compute(slower, base)[-1]      # gains sorted, losses last
    if not torch.cuda.is_available():
        for argv in ([], ["--modes", "noio_copies", "prefetch_sorted", "noio"]):     # its own modes are choices
            with pytest.raises(SystemExit, match="no CUDA GPU here"):
                tp.main(argv)


def test_copy_interference_checks_its_arguments_and_sizes_its_copies(capsys):
    """scripts/copy_interference.py: bad counts and row sizes are refused by name before any GPU work,
    the copies are repeated to outlast the chain they run beside, and a CPU is told it needs a GPU."""
    from scripts import copy_interference as ci
    for argv, message in ((["--programs", "4", "0"], "--programs 0: expected a positive count"),
                          (["--rows", "-1"], "--rows -1: expected a positive count"),
                          (["--kernels", "10"], "--kernels 10: expected at least 20"),
                          (["--row-bytes", "1151"], "--row-bytes 1151: expected a positive even number"),
                          (["--pool-gib", "-1"], "--pool-gib -1.0: expected a size >= 0"),
                          (["--span-gib", "-2"], "--span-gib -2.0: expected a size >= 0"),
                          (["--huge-pages", "--vmm"], "--huge-pages and --vmm: expected one of them"),
                          (["--interleave", "3"], "--interleave 3: expected a divisor of 16")):
        with pytest.raises(SystemExit):
            ci.main(argv)
        assert message in capsys.readouterr().err
    copies = ci.Copies(rows=8, row_bytes=12, programs=2, device=torch.device("cpu"))
    assert copies.pool_on_device.data_ptr() != copies.pool.data_ptr()
    slots = copies.plan_slot[0].long()
    for plan, name in enumerate(("host", "device", "host")):   # each launch copies the next plan's rows
        copies.cache.zero_()
        getattr(copies, name)()
        assert torch.equal(copies.cache[0, slots], copies.pool[copies.plan_units[plan][0].long()]), name
    assert len({tuple(p[0].tolist()) for p in copies.plan_units}) == ci.PLANS    # distinct rows each
    copies.engine()
    assert torch.equal(copies.staging, copies.pool[:8])
    large = ci.Copies(rows=8, row_bytes=12, programs=2, device=torch.device("cpu"), pool_rows=1000)
    assert large.pool.shape == (1000, 6) and max(int(p.max()) for p in large.plan_units) >= 128   # beyond 16 x 8
    large.host()                          # a larger pool is left as allocated: compare bits, not values
    got = large.cache[0, large.plan_slot[0].long()].view(torch.int16)
    assert torch.equal(got, large.pool[large.plan_units[0][0].long()].view(torch.int16))
    ordered = ci.Copies(rows=8, row_bytes=12, programs=2, device=torch.device("cpu"), pool_rows=1000, sorted_rows=True)
    assert all(bool((p[0][1:] > p[0][:-1]).all()) for p in ordered.plan_units)          # host-address order
    assert not all(bool((p[0][1:] > p[0][:-1]).all()) for p in large.plan_units)
    marked = ci.Copies(rows=8, row_bytes=12, programs=2, device=torch.device("cpu"), evict_first=True)
    marked.host()                                             # the rows marked to leave L2 first: same copy
    assert torch.equal(marked.cache[0, marked.plan_slot[0].long()], marked.pool[marked.plan_units[0][0].long()])
    spanned = ci.Copies(rows=8, row_bytes=12, programs=2, device=torch.device("cpu"), pool_rows=1000, span_rows=200)
    assert spanned.pool.shape[0] == 1000 and max(int(p.max()) for p in spanned.plan_units) < 200
    woven = ci.Copies(rows=8, row_bytes=12, programs=2, device=torch.device("cpu"), pool_rows=1000, interleave=4)
    rows = torch.stack([p[0] for p in woven.plan_units]).view(ci.PLANS // 4, 4, 8)    # [groups, copy, row]
    assert torch.equal(rows - rows[:, :1], torch.arange(4).view(1, 4, 1).expand_as(rows))    # adjacent rows
    assert bool((rows[:, 0] % 4 == 0).all()) and int(rows.max()) < 1000
    assert len(set(rows[:, 0].flatten().tolist())) == 32                           # distinct units throughout
    woven.host()
    woven.align(4)                                            # the next copy starts a group of 4 plans
    assert woven.launched == 4 and woven.plan_units[woven.launched % ci.PLANS][0][0] % 4 == 0
    assert torch.equal(woven.cache[0, woven.plan_slot[0].long()].view(torch.int16),
                       woven.pool[woven.plan_units[0][0].long()].view(torch.int16))
    assert ci.graphed_repeats(2316.0, 401.0) == 2             # 0.5 x 2316 us: 2 copies of 401, rounded down
    assert ci.graphed_repeats(100.0, 300.0) == 1              # at least one (the cell then says '!')
    with pytest.raises(ValueError, match="expected positive times"):
        ci.graphed_repeats(0.0, 300.0)
    # cells: alone -> beside (ratio), '!' where the reading is off, and graphed the extra per us and per MB
    assert ci.cell(200.0, 250.0, 300.0, 3, 100.0, None, graphed=False) == "    200 ->     250 (1.25) "
    assert ci.cell(200.0, 250.0, 240.0, 3, 100.0, None, graphed=False).endswith("(1.25)!")   # copies ended first
    graphed = ci.cell(1000.0, 1100.0, 0.0, 2, 250.0, 10.0, graphed=True)      # 100 us over 500 us, 20 MB
    assert graphed == "   1000 ->    1100 (1.10)  +0.20/us +5.00/MB"
    assert ci.cell(1000.0, 1100.0, 0.0, 1, 1200.0, 10.0, graphed=True).split()[3] == "(1.10)!"   # outlasts it
    assert ci.cell(1000.0, 1010.0, 0.0, 2, 250.0, None, graphed=True).endswith("+0.02/us        -")  # the spin
    assert ci.repeats_to_cover(900.0, 300.0) == 5            # 1.5 x 900 us = 1350 us: 5 copies of 300
    assert ci.repeats_to_cover(100.0, 300.0) == 1
    assert ci.repeats_to_cover(1.0, 0.0001) == 15000          # no rounding of tiny times to zero
    with pytest.raises(ValueError, match="expected positive times"):
        ci.repeats_to_cover(100.0, 0.0)
    if not torch.cuda.is_available():
        for argv in ([], ["--graphed"]):
            with pytest.raises(SystemExit, match="on a CUDA GPU; none here"):
                ci.main(argv)

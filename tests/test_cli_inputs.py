"""Command lines refuse bad values by name before any work, and summarise what they were asked to."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_summary_prints_each_attention_family_from_its_own_latest_run(capsys):
    """results/attention.csv's newest run is DSA's alone: NSA's and Quest's lines come from theirs."""
    from benchmarks import summary
    summary.main([str(REPO / "results")])
    out = capsys.readouterr().out
    for family in ("dsa", "nsa", "quest"):
        assert f"attention {family}: roofline_frac at batch >= 32" in out, family
        assert f"attention {family}: speed-up over torch_gather" in out, family


def test_count_step_ops_counts_the_last_of_n_decode_steps_and_refuses_none(tmp_path):
    """A subprocess with no GPU visible (the tool counts the interpreter's launches, which
    kernels_triton chooses on import where no GPU is visible); its temporary checkpoint goes under
    this test's folder (TMPDIR), not /tmp."""
    script = """
from experiments.tools import count_step_ops as c
entered, enter = [], c.StepCounter.__enter__
c.StepCounter.__enter__ = lambda self: entered.append(1) or enter(self)
try:
    c.main(["--steps", "0"])
except SystemExit as exc:
    print("exit", exc.code)
c.main(["--steps", "1"])
print("decode steps", len(entered))
"""
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--steps 0: expected at least 1 decode step" in run.stderr and "exit 2" in run.stdout
    assert "decode steps 3" in run.stdout                  # one per mode
    resident = next(line for line in run.stdout.splitlines() if line.startswith("resident "))
    assert int(resident.split()[1]) > 0 and int(resident.split()[2]) > 0, resident


def test_bench_prefetch_refuses_model_sizes_it_would_ignore_or_cannot_build(capsys):
    from benchmarks import bench_prefetch
    for argv, message in ((["--quick", "--hidden", "7168"], "--quick sets its own --batches, --context, --steps, "
                                                            "--hidden and --intermediate"),
                          (["--quick", "--intermediate", "18432"], "--quick sets its own"),
                          (["--hidden", "0"], "--hidden 0: expected a positive size"),
                          (["--intermediate", "-1"], "--intermediate -1: expected a positive size")):
        with pytest.raises(SystemExit):
            bench_prefetch.main(argv)
        assert message in capsys.readouterr().err


def test_demo_refuses_sizes_it_cannot_run(capsys):
    from hisparse import demo
    for argv, message in ((["--cache-slots", "10"], "--cache-slots 10: expected at least k = 32"),
                          (["--cache-slots", "0"], "--cache-slots 0: expected at least k = 32"),
                          (["--steps", "0"], "--steps 0: expected at least 1 decode step"),
                          (["--row-bytes", "0"], "--row-bytes 0: expected a positive even number"),
                          (["--row-bytes", "3"], "--row-bytes 3: expected a positive even number")):
        with pytest.raises(SystemExit):
            demo.main(argv)
        assert message in capsys.readouterr().err


def test_make_tiny_refuses_more_shards_than_tensors_before_writing_anything(tmp_path, capsys):
    """Shards beyond the tensor count would be empty safetensors files (and index entries to nothing)."""
    from hisparse.make_tiny import main as make_tiny
    from hisparse.models.tiny import write_tiny_checkpoint
    with pytest.raises(SystemExit):
        make_tiny(["--family", "llama", "--out", str(tmp_path / "new"), "--shards", "1000"])
    count = int(re.search(r"--shards 1000: a tiny llama checkpoint holds (\d+) tensors: expected at most that many "
                          r"shards", capsys.readouterr().err).group(1))
    assert not (tmp_path / "new").exists(), "nothing may be written"
    old = write_tiny_checkpoint("llama", tmp_path / "old", shards=2)
    before = sorted(p.name for p in old.iterdir())
    with pytest.raises(SystemExit):            # --force would first delete the old shards
        make_tiny(["--family", "llama", "--out", str(old), "--shards", str(count + 1), "--force"])
    assert f"holds {count} tensors" in capsys.readouterr().err
    assert sorted(p.name for p in old.iterdir()) == before
    with pytest.raises(ValueError, match=rf"shards = {count + 1}: the checkpoint holds {count} tensors"):
        write_tiny_checkpoint("llama", tmp_path / "direct", shards=count + 1)
    assert not (tmp_path / "direct").exists()
    make_tiny(["--family", "llama", "--out", str(tmp_path / "each"), "--shards", str(count)])   # one tensor each
    assert len(list((tmp_path / "each").glob("*.safetensors"))) == count

"""experiments.sweep: configs validated before anything runs, rows appended, interrupted sweeps resume."""
import re
import textwrap

import numpy as np
import pandas as pd
import pytest
import torch

from experiments import sweep
from hisparse.synthetic import fill_draw_cache, request_draws

TINY = """
[[study]]
kind = "decode"
model = "tiny:deepseek_v32"
modes = ["resident", "hisparse"]
cache_slots = 8
contexts = [24]
batches = [2]
new_tokens = 3
warmup_steps = 2
workload = "tiny"

[[study]]
kind = "throughput"
model = "tiny:deepseek_v32"
modes = ["resident", "hisparse"]
cache_slots = 8
contexts = [24]
kv_budget_gib = 0.0001
max_batch = 3
new_tokens = 2
workload = "tiny"
"""


def write(tmp_path, text):
    path = tmp_path / "sweep.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_runs_appends_and_resumes(tmp_path, capsys):
    config, out = write(tmp_path, TINY), str(tmp_path / "results")
    assert sweep.main(["--config", config, "--out", out]) == 0
    decode = pd.read_csv(tmp_path / "results" / "decode.csv")
    assert set(decode["mode"]) == {"resident", "hisparse"}
    assert {"tokens_per_s", "tpot_ms", "tpot_median_ms", "hbm_bytes_per_request", "miss_rate"} <= set(decode.metric)
    assert (decode.new_tokens == 3).all() and (decode.warmup_steps == 2).all()
    assert not decode.graph.any() and not decode.prefetch.any()       # how it ran: eager on a CPU, no prefetch
    assert (decode.k == 8).all() and decode.commit.notna().all() and (decode.gpu == "cpu").all()
    assert (decode.attention_kernel == "triton").all(), "off Hopper DSA decodes with the Triton kernel"
    assert (decode.decode_backend == "auto").all() and "early_resolve" not in decode
    runs = decode.drop_duplicates("run").run           # each decode point's run in this process, in order
    assert len(runs) == 2 and runs.is_monotonic_increasing and runs.iloc[1] == runs.iloc[0] + 1
    tput = pd.read_csv(tmp_path / "results" / "throughput.csv")
    batches = tput[tput.metric == "max_batch"].set_index("mode").value
    assert batches["hisparse"] >= batches["resident"], "hot slots must fit at least as many requests"
    by_gpu = tput[tput.metric == "max_batch_gpu_budget"].set_index("mode").value
    assert (by_gpu >= batches).all() and (tput.kv_budget_gib == 0.0001).all()
    host = tput[tput.metric == "host_bytes_per_request"].set_index("mode").value
    assert host["resident"] == 0 and host["hisparse"] > 0
    assert_sized_by_what_runs_hold(tput, 0.0001)
    rows = len(decode)
    capsys.readouterr()
    assert sweep.main(["--config", config, "--out", out]) == 0          # resumed: nothing left to run
    assert "4 points, 4 already in" in capsys.readouterr().out
    assert sweep.main(["--config", config, "--out", out, "--kind", "decode", "--dry-run"]) == 0
    assert "2 points, 2 already in" in capsys.readouterr().out      # the decode study alone
    assert len(pd.read_csv(tmp_path / "results" / "decode.csv")) == rows
    assert sweep.main(["--config", config, "--out", out, "--force"]) == 0
    assert len(pd.read_csv(tmp_path / "results" / "decode.csv")) == 2 * rows


@pytest.mark.parametrize("edit,message", [
    (("kind = \"decode\"", "kind = \"decodes\""), "study 0: kind = 'decodes': expected one of"),
    (("batches = [2]", "batches = [2]\nbatch_size = 4"), "study 0 \\(decode\\): unknown key 'batch_size'"),
    (("modes = [\"resident\", \"hisparse\"]\ncache_slots = 8\ncontexts",
      "modes = [\"resident\", \"offload\"]\ncache_slots = 8\ncontexts"), "modes = \\['resident', 'offload'\\]"),
    (("cache_slots = 8\ncontexts = [24]\nbatches", "cache_slots = 4\ncontexts = [24]\nbatches"),
     "cache_slots 4 is smaller than the model's k = 8"),
    (("contexts = [24]\nbatches", "contexts = [0]\nbatches"), "contexts = \\[0\\]: expected a positive integer"),
    (("workload = \"tiny\"\n\n", "workload = \"zipf\"\n\n"), "workload = 'zipf': expected 'model' or a preset"),
    (("model = \"tiny:deepseek_v32\"\nmodes = [\"resident\", \"hisparse\"]\ncache_slots = 8\ncontexts = [24]\nb",
      "model = \"tiny:llama\"\nmodes = [\"resident\", \"hisparse\"]\ncache_slots = 8\ncontexts = [24]\nb"),
     r"contexts = \[24\]: workload 'tiny': context=24 tokens \(2 units at step 0\) is too short for k=3"),
    (("model = \"tiny:deepseek_v32\"", "model = \"tiny:mistral\""), "the sweep runs DSA and Quest families"),
    (("warmup_steps = 2", "warmup_steps = 0"), "warmup_steps = 0: expected one positive integer"),
    (("warmup_steps = 2", "warmup_steps = [2]"), "warmup_steps = \\[2\\]: expected one positive integer"),
    (("modes = [\"resident\", \"hisparse\"]\ncache_slots = 8\ncontexts",
      "modes = 5\ncache_slots = 8\ncontexts"), "modes = 5: expected a list of"),
    (("model = \"tiny:deepseek_v32\"", "model = 5"), "model = 5: expected a string"),
    (("workload = \"tiny\"\n\n", "workload = [\"tiny\"]\n\n"), "workload = \\['tiny'\\]: expected"),
    (("warmup_steps = 2", "warmup_steps = 2\ngraph = \"no\""), "graph = 'no': expected true or false"),
    (("warmup_steps = 2", "warmup_steps = 2\nlayers = 0"), "layers = 0: expected one positive integer"),
    (("warmup_steps = 2", "warmup_steps = 2\nprefetch = true"),
     "prefetch = true needs layers that share a selection .* model 'tiny:deepseek_v32' has none"),
    (("warmup_steps = 2", "warmup_steps = 2\ndecode_backend = \"cuda\""),
     r"decode_backend = 'cuda': expected one of \('auto', 'triton', 'gluon'\)"),
    (("warmup_steps = 2", "warmup_steps = 2\nearly_resolve = true"), "unknown key 'early_resolve'"),
    (("warmup_steps = 2", "warmup_steps = 2\nhidden = 64"),
     "hidden = 64 sizes the 'dsa', 'dsa_v32_ep8' and 'quest' models; model 'tiny:deepseek_v32' has its own: drop hidden"),
    (("max_batch = 3", "max_batch = [3]"), "max_batch = \\[3\\]: expected one positive integer"),
    (("max_batch = 3", "max_batch = 0"), "max_batch = 0: expected one positive integer$"),
    (("kind = \"decode\"", "kind = [\"decode\"]"), "study 0: kind = \\['decode'\\]: expected one of"),
    (("cache_slots = 8\ncontexts = [24]\nbatches", "cache_slots = [8, 2000000]\ncontexts = [24]\nbatches"),
     "cache_slots 2000000 exceeds the supported 1048576"),
    (("kv_budget_gib = 0.0001", "kv_budget_gib = true"), "kv_budget_gib = True: expected a positive, finite number"),
    (("kv_budget_gib = 0.0001", "kv_budget_gib = inf"), "kv_budget_gib = inf: expected a positive, finite number"),
    (("\n[[study]]\nkind = \"decode\"", "\nstduy = 1\n\n[[study]]\nkind = \"decode\""),
     "unknown top-level key 'stduy': a config holds only \\[\\[study\\]\\] tables"),
    (("modes = [\"resident\", \"hisparse\"]\ncache_slots = 8\ncontexts",
      "modes = [\"resident\", \"resident\"]\ncache_slots = 8\ncontexts"),
     r"study 0 \(decode\): modes = \['resident', 'resident'\] lists 'resident' twice: its points would run twice "
     r"and write duplicate rows"),
    (("contexts = [24]\nbatches", "contexts = [24, 24]\nbatches"), r"contexts = \[24, 24\] lists 24 twice"),
    (("batches = [2]", "batches = [2, 1, 2]"), r"batches = \[2, 1, 2\] lists 2 twice"),
    (("cache_slots = 8\ncontexts = [24]\nbatches", "cache_slots = [8, 9, 8]\ncontexts = [24]\nbatches"),
     r"study 0 \(decode\): cache_slots = \[8, 9, 8\] lists 8 twice"),
    (("modes = [\"resident\", \"hisparse\"]\ncache_slots = 8\ncontexts",
      "modes = [\"resident\", \"hybrid\"]\ncache_slots = 8\ncontexts"),
     r"study 0 \(decode\): modes = .*expected a list of \('resident', 'hisparse', 'noio'\) \(hybrid: throughput and serving studies only\)"),
    (("model = \"tiny:deepseek_v32\"\nmodes = [\"resident\", \"hisparse\"]\ncache_slots = 8\ncontexts = [24]\nkv_budget",
      "model = \"tiny:llama\"\nmodes = [\"hybrid\"]\ncache_slots = 8\ncontexts = [24]\nkv_budget"),
     r"study 1 \(throughput\): mode hybrid in a throughput study \(the fixed-batch Engine\) is built for DSA models "
     r"so far; model 'tiny:llama' is quest"),
], ids=["kind", "unknown-key", "mode", "slots-below-k", "context", "workload", "quest-context", "family", "warmup",
        "warmup-list", "modes-int", "model-int", "workload-list", "graph-string", "layers-0", "prefetch-unshared",
        "decode-backend", "early-resolve-gone", "hidden-tiny", "max-batch-list", "max-batch-0", "kind-list", "slots-above-max",
        "budget-bool", "budget-inf", "top-level-key", "modes-twice", "contexts-twice", "batches-twice",
        "slots-twice", "hybrid-decode", "hybrid-throughput-quest"])
def test_bad_configs_fail_before_running(tmp_path, capsys, edit, message):
    old, new = edit
    assert old in TINY
    config = write(tmp_path, TINY.replace(old, new, 1))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "results")]) == 2
    assert not list(tmp_path.glob("results/*.csv")), "nothing may run or be written"

    assert re.search(message, capsys.readouterr().err)


def test_a_checkpoint_of_another_family_an_out_file_and_a_single_study_table_are_refused(tmp_path, capsys):
    from hisparse.models.tiny import write_tiny_checkpoint
    llama = write_tiny_checkpoint("llama", str(tmp_path / "llama"))
    config = write(tmp_path, TINY.replace('model = "tiny:deepseek_v32"', f'model = "{llama}"', 1))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "results"), "--dry-run"]) == 2
    assert "has model_type 'llama': the sweep runs DSA models" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert sweep.main(["--config", write(tmp_path, TINY), "--out", str(tmp_path / "afile")]) == 2
    assert "--out " in capsys.readouterr().err and (tmp_path / "afile").read_text() == ""
    one_table = TINY.split("\n\n[[study]]")[0].replace("[[study]]", "[study]")
    assert sweep.main(["--config", write(tmp_path, one_table), "--dry-run"]) == 2
    assert "write [[study]], not [study]" in capsys.readouterr().err


def test_a_checkpoint_without_weights_and_a_damaged_results_file_are_refused(tmp_path, capsys):
    from hisparse.models.tiny import write_tiny_checkpoint
    ckpt = write_tiny_checkpoint("deepseek_v32", str(tmp_path / "dsa"))
    for weights in (tmp_path / "dsa").glob("*.safetensors"):
        weights.unlink()
    config = write(tmp_path, TINY.replace('model = "tiny:deepseek_v32"', f'model = "{ckpt}"', 1))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "results"), "--dry-run"]) == 2
    assert "has a config.json but no *.safetensors weights" in capsys.readouterr().err
    out = tmp_path / "damaged"
    out.mkdir()
    header = "bench,metric,value,unit,gpu\n"
    for text, message in (("", "is not a results CSV"), ("a,b\n1,2\n", "has no 'gpu' column"),
                          (header + "decode,tpot,1,ms,cpu,\n", "line 2 has 6 fields, the header 5")):
        (out / "decode.csv").write_text(text)
        assert sweep.main(["--config", write(tmp_path, TINY), "--out", str(out)]) == 2
        assert message in capsys.readouterr().err and (out / "decode.csv").read_text() == text
        assert not (out / "throughput.csv").exists(), "nothing may run"


def test_a_config_that_is_not_utf8_is_named_not_a_traceback(tmp_path, capsys):
    """A Latin-1 TOML config (or checkpoint config.json) used to raise UnicodeDecodeError."""
    config = tmp_path / "latin1.toml"
    config.write_bytes(TINY.replace('kind = "decode"', '# caf\xe9\nkind = "decode"', 1).encode("latin-1"))
    assert sweep.main(["--config", str(config), "--dry-run"]) == 2
    at = TINY.index('kind = "decode"') + 5
    assert f"error: {config}: not UTF-8 text (byte 0xe9 at offset {at}): a TOML file is UTF-8" in capsys.readouterr().err
    from hisparse.models.tiny import write_tiny_checkpoint
    ckpt = write_tiny_checkpoint("deepseek_v32", str(tmp_path / "dsa"))
    (tmp_path / "dsa" / "config.json").write_bytes(b'{"model_type": "deepseek_v32", "x": "caf\xe9"}')
    config = write(tmp_path, TINY.replace('model = "tiny:deepseek_v32"', f'model = "{ckpt}"', 1))
    assert sweep.main(["--config", config, "--dry-run"]) == 2
    assert "config.json: not UTF-8 text (byte 0xe9 at offset 40): a JSON file is UTF-8" in capsys.readouterr().err


def test_one_context_or_batch_may_be_written_without_a_list(tmp_path, capsys):
    config = write(tmp_path, TINY.replace("contexts = [24]\nbatches = [2]", "contexts = 24\nbatches = 2", 1))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "r"), "--dry-run"]) == 0
    assert "4 points, 0 already in" in capsys.readouterr().out


def test_a_tiny_model_of_another_layer_count_is_another_point():
    study = {"kind": "decode", "model": "tiny:deepseek_v32", "modes": ["resident"], "contexts": [24], "batches": [2]}
    default, deeper = sweep.points(study)[0], sweep.points(dict(study, layers=3))[0]
    assert "layers" not in default and deeper["layers"] == 3
    done = pd.DataFrame([dict(default, gpu="cpu", metric="tpot_ms", value=1.0)])
    assert sweep.already_done(done, default, "cpu") and not sweep.already_done(done, deeper, "cpu")
    assert sweep.model_config(dict(study, layers=3))["num_hidden_layers"] == 3


def test_dry_run_lists_points_and_runs_nothing(tmp_path, capsys):
    assert sweep.main(["--config", write(tmp_path, TINY), "--out", str(tmp_path / "r"), "--dry-run"]) == 0
    assert "4 points, 0 already in" in capsys.readouterr().out
    assert not (tmp_path / "r").exists()


def test_default_config_is_valid():
    studies = sweep.tomllib.loads(sweep.DEFAULT_CONFIG.read_text())["study"]
    sweep.validate(studies)
    for name in ("h200.toml", "h200_quest.toml", "h200_repeat.toml"):
        sweep.validate(sweep.tomllib.loads((sweep.DEFAULT_CONFIG.parent / name).read_text())["study"])


def test_the_modes_of_one_context_and_batch_run_back_to_back():
    """Points compared with each other (noio vs resident within 3%) run one after another."""
    study = {"kind": "decode", "model": "dsa", "modes": ["resident", "hisparse", "noio"], "contexts": [4096, 32768],
             "batches": [8, 16], "cache_slots": [2048, 4096]}
    got = [(p["context"], p["batch"], p["mode"], p["cache_slots"]) for p in sweep.points(study)]
    assert got[:5] == [(4096, 8, "resident", None), (4096, 8, "hisparse", 2048), (4096, 8, "hisparse", 4096),
                       (4096, 8, "noio", 2048), (4096, 8, "noio", 4096)]
    assert len(got) == len(set(got)) == 2 * 2 * 5
    throughput = dict(study, kind="throughput", kv_budget_gib=24)
    assert [(p["context"], p["mode"]) for p in sweep.points(throughput)][:5] == [
        (4096, "resident"), (4096, "hisparse"), (4096, "hisparse"), (4096, "noio"), (4096, "noio")]


def test_models_are_made_where_they_run_with_the_same_weights(monkeypatch):
    """build() allocates the weights on the run's device (a DSA-sized model would not fit the host in
    float32) and gives the weights the host-made model had."""
    import torch
    seen = []

    def build_model_seeing_where(config):
        seen.append((torch.empty(0).device.type, torch.get_default_dtype()))
        return build_model(config)

    from hisparse.models.config import config_from_dict
    from hisparse.models.loading import build_model
    from hisparse.models.tiny import randomize_
    study = {"_index": 0, "kind": "decode", "model": "tiny:glm_moe_dsa"}
    model = sweep.build(study, torch.device("cpu"))
    host_made = build_model(config_from_dict(sweep.model_config(study)))
    randomize_(host_made, seed=0)
    theirs = host_made.state_dict()
    assert all(torch.equal(t, theirs[name]) for name, t in model.state_dict().items())
    monkeypatch.setattr(sweep, "build_model", build_model_seeing_where)
    on_meta = sweep.build(study, torch.device("meta"))
    assert seen == [("meta", torch.float32)], "the layers are made on the device, not moved there"
    assert {t.device.type for t in on_meta.state_dict().values()} == {"meta"}
    assert torch.get_default_dtype() == torch.float32 and torch.empty(0).device.type == "cpu"


@pytest.mark.parametrize("spec,model_type", [("dsa", "deepseek_v32"), ("quest", "llama")])
def test_the_named_full_scale_models_are_built(spec, model_type):
    """"dsa" and "quest" (the h200 configs' models) are built from their geometry, at the study's size
    (on the meta device: no memory)."""
    study = {"_index": 0, "kind": "throughput", "model": spec, "layers": 3, "hidden": 256}
    model = sweep.build(study, torch.device("meta"))
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == (model_type, 3, 256)
    assert {t.device.type for t in model.state_dict().values()} == {"meta"}


def test_a_dsa_model_of_another_size_is_another_point():
    import pandas as pd
    study = {"kind": "decode", "model": "dsa", "layers": 61, "modes": ["resident"], "contexts": [32768],
             "batches": [8]}
    small, large = sweep.points(dict(study, hidden=1024))[0], sweep.points(dict(study, hidden=7168))[0]
    done = pd.DataFrame([dict(small, gpu="NVIDIA H200", metric="tpot_ms", value=16.0)])
    assert sweep.already_done(done, small, "NVIDIA H200")
    assert not sweep.already_done(done, large, "NVIDIA H200")
    assert sweep.points(study)[0]["hidden"] == 1024, "the dsa model's default size is part of its points"


def test_runs_per_process_goes_on_in_fresh_processes(tmp_path, capsys, monkeypatch):
    """--runs-per-process 1: every decode run (the decode study's two points, the throughput study's
    hisparse one: each process starts a fresh one) is its process's first (the H200's 4th-run switch
    never comes), and the resumed sweep still runs every point once."""
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    throughput_modes = 'modes = ["resident", "hisparse"]\ncache_slots = 8\ncontexts = [24]\nkv_budget'
    assert TINY.count(throughput_modes) == 1
    config = write(tmp_path, TINY.replace(throughput_modes, throughput_modes.replace('"resident", ', '')))
    out = str(tmp_path / "results")
    run = subprocess.run([sys.executable, "-m", "experiments.sweep", "--config", config, "--out", out,
                          "--runs-per-process", "1"], cwd=repo, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("going on in a fresh one") == 2
    assert run.stdout.rstrip().endswith(f"draw figures with python -m experiments.figures --results {out}")
    decode = pd.read_csv(tmp_path / "results" / "decode.csv")
    tput = pd.read_csv(tmp_path / "results" / "throughput.csv")
    assert sorted(decode.drop_duplicates("mode")["mode"]) == ["hisparse", "resident"]
    assert (decode.run == 1).all() and (tput.dropna(subset=["run"]).run == 1).all()
    assert tput[tput.metric == "tokens_per_s"]["mode"].tolist() == ["hisparse"]
    twice = TINY.split("\n\n[[study]]")[0]
    twice = write(tmp_path, twice + "\n" + twice.replace("new_tokens = 3", "new_tokens = 5"))
    capsys.readouterr()         # refused before anything runs: in this process, parsing sys.argv as the command does
    monkeypatch.setattr(sys, "argv", ["experiments.sweep", "--config", twice, "--out", str(tmp_path / "r2"),
                                      "--runs-per-process", "1"])
    assert sweep.main() == 2
    assert "two studies share a point" in capsys.readouterr().err and not (tmp_path / "r2").exists()
    for argv, message in ((["--runs-per-process", "0"], "expected a positive integer"),
                          (["--runs-per-process", "2", "--force"], "which --force would start over"),
                          (["--runs-per-process", "2"], "use it from the command line")):
        with pytest.raises(SystemExit):
            sweep.main(["--config", config, "--out", out, *argv])
        assert message in capsys.readouterr().err


QUEST = """
[[study]]
kind = "decode"
model = "tiny:llama"
modes = ["resident", "hisparse", "noio"]
cache_slots = 6
contexts = [64]
batches = [2]
new_tokens = 3
workload = "tiny"

[[study]]
kind = "throughput"
model = "tiny:llama"
modes = ["resident", "hisparse"]
cache_slots = 6
contexts = [256]
kv_budget_gib = 0.0002
max_batch = 4
new_tokens = 2
workload = "tiny"
"""


def test_decode_backend_runs_every_mode_with_that_kernel_and_is_recorded(tmp_path, capsys):
    """decode_backend = "triton": every mode of a DSA study decodes with the Triton kernel, and its rows
    record the backend asked for beside the kernel that ran; a point stored with another backend runs
    again."""
    one = TINY.split("[[study]]")[1]
    out = str(tmp_path / "results")
    config = write(tmp_path, "[[study]]" + one.replace('workload = "tiny"\n', 'workload = "tiny"\n'
                                                       'decode_backend = "triton"\n', 1))
    assert sweep.main(["--config", config, "--out", out]) == 0
    decode = pd.read_csv(tmp_path / "results" / "decode.csv")
    assert set(decode["mode"]) == {"resident", "hisparse"} and decode.value.notna().all()
    assert (decode.decode_backend == "triton").all() and (decode.attention_kernel == "triton").all()
    capsys.readouterr()
    assert sweep.main(["--config", write(tmp_path, "[[study]]" + one), "--out", out, "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "2 points, 0 already in" in said and "2 of them stored from runs made another way" in said


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Gluon kernel may run on this GPU")
def test_a_gluon_backend_that_cannot_run_here_is_refused_before_any_point(tmp_path, capsys):
    one = TINY.split("[[study]]")[1]
    config = write(tmp_path, "[[study]]" + one.replace('workload = "tiny"\n', 'workload = "tiny"\n'
                                                       'decode_backend = "gluon"\n', 1))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "results")]) == 2
    assert 'decode_backend = "gluon" cannot run here: ' in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


def test_run_settings_record_the_decode_backend_for_dsa_points_only():
    study = {"new_tokens": 3, "warmup_steps": 1, "decode_backend": "triton"}
    dsa = sweep.run_settings(study, {"bench": "decode", "family": "dsa", "mode": "hisparse"}, on_gpu=False)
    assert dsa == dict(new_tokens=3, warmup_steps=1, graph=False, prefetch=False, decode_backend="triton")
    default = sweep.run_settings({"new_tokens": 3, "warmup_steps": 1}, {"bench": "decode", "family": "dsa",
                                                                      "mode": "resident"}, on_gpu=False)
    assert default["decode_backend"] == "auto" and "early_resolve" not in default
    quest = sweep.run_settings({"new_tokens": 3, "warmup_steps": 1}, {"bench": "decode", "family": "quest",
                                                                    "mode": "hisparse"}, on_gpu=False)
    assert "decode_backend" not in quest and "early_resolve" not in quest


def test_attention_kernel_is_what_dsa_decode_picks_for_the_models_query(monkeypatch):
    """Rows record the DSA decode kernel `sparse_mla_decode` picks for the model's query shape, dtype and
    device (here made to admit Gluon, and then asked about the real shape); Quest models say triton."""
    from types import SimpleNamespace

    from hisparse.dsa import ops as dsa
    asked = []
    monkeypatch.setattr(dsa, "gluon_decode_unsupported", lambda q, d_v: asked.append((tuple(q.shape), d_v)))
    weight = torch.zeros(2, 2, dtype=torch.bfloat16)
    dsa_model = SimpleNamespace(config=SimpleNamespace(model_type="deepseek_v32", num_attention_heads=128,
                                                       kv_lora_rank=512, qk_rope_head_dim=64),
                                model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=weight)))
    assert sweep.attention_kernel(dsa_model) == "gluon" and asked == [((1, 128, 576), 512)]
    assert sweep.attention_kernel(dsa_model, "gluon") == "gluon"
    assert sweep.attention_kernel(dsa_model, "triton") == "triton"           # the study's decode_backend
    quest_model = SimpleNamespace(config=SimpleNamespace(model_type="llama"), model=dsa_model.model)
    assert sweep.attention_kernel(quest_model) == "triton"
    assert sweep.attention_kernel(dsa_model, kv_dtype="fp8") == "triton"   # fp8 rows: the FP8 kernels
    from hisparse.dsa import fp8
    monkeypatch.setattr(fp8, "fp8_gluon_unsupported", lambda q, kv: None)
    assert sweep.attention_kernel(dsa_model, kv_dtype="fp8") == "gluon"
    assert sweep.attention_kernel(dsa_model, "triton", "fp8") == "triton"


def test_quest_studies_run_per_kv_head_in_pages(tmp_path):
    """A Quest model in the sweep: k = token_budget // 16 pages (48 tokens: 3), a unit is one KV head's
    page, selections replay the synthetic workload per KV head; its throughput rows say what a request
    keeps on the host."""
    out = str(tmp_path / "results")
    assert sweep.main(["--config", write(tmp_path, QUEST), "--out", out]) == 0
    decode = pd.read_csv(tmp_path / "results" / "decode.csv")
    assert (decode.family == "quest").all() and (decode.k == 3).all() and (decode.token_budget == 48).all()
    assert (decode.unit_bytes == 2 * 16 * 16 * 4).all()              # keys and values of 16 tokens, head dim 16, fp32
    assert (decode[decode.metric == "miss_rate"].value > 0).all()
    tput = pd.read_csv(tmp_path / "results" / "throughput.csv")
    host = tput[tput.metric == "host_bytes_per_request"].set_index("mode").value
    pages = -(-(256 + 2 + 1 + 1) // 16)          # the prompt, new_tokens, the warm-up step and one more
    assert host["resident"] == 0 and host["hisparse"] == pages * 16 * 2 * 2 * 16 * 4     # 1 Quest layer of 2 KV heads
    assert_sized_by_what_runs_hold(tput, 0.0002)


def test_fp8_rows_are_sized_and_stamped_as_they_run(tmp_path, capsys):
    """kv_dtype = "fp8" (a DSA checkpoint with 512 + 64 latents): the throughput batch is sized by the
    bytes its 656-byte rows then hold; rows carry kv_dtype and unit_bytes 656; other families and
    Gluon are refused before anything runs."""
    from hisparse.models.tiny import write_tiny_checkpoint
    ckpt = write_tiny_checkpoint("deepseek_v32", tmp_path / "ckpt", kv_lora_rank=512, qk_rope_head_dim=64,
                                 index_head_dim=64, num_hidden_layers=1)
    study = f"""
    [[study]]
    kind = "throughput"
    model = "{ckpt}"
    modes = ["resident", "hisparse"]
    cache_slots = 8
    contexts = [24]
    kv_budget_gib = 0.0004
    max_batch = 3
    new_tokens = 1
    warmup_steps = 1
    workload = "tiny"
    kv_dtype = "fp8"
    """
    assert sweep.main(["--config", write(tmp_path, study), "--out", str(tmp_path / "r")]) == 0
    tput = pd.read_csv(tmp_path / "r" / "throughput.csv")
    assert set(tput.kv_dtype) == {"fp8"} and set(tput.unit_bytes) == {656} and set(tput.attention_kernel) == {"triton"}
    assert_sized_by_what_runs_hold(tput, 0.0004)
    host = tput[tput.metric == "host_bytes_per_request"].set_index("mode").value
    assert host["hisparse"] == (24 + 1 + 1 + 1) * 656                  # one layer: a row per token, as stored
    for bad, message in ((study.replace(f'model = "{ckpt}"', 'model = "tiny:llama"'), "kv_dtype applies to DSA models"),
                         (study.replace('"fp8"', '"fp16"'), "kv_dtype = 'fp16': expected one of ('bf16', 'fp8')"),
                         (study.replace(f'model = "{ckpt}"', 'model = "tiny:deepseek_v32"'),
                          'kv_dtype = "fp8": kv_dtype=\'fp8\' stores 512 latent + 64 RoPE values')):
        capsys.readouterr()
        assert sweep.main(["--config", write(tmp_path, bad), "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err
        assert not list(tmp_path.glob("x/*.csv"))


def assert_sized_by_what_runs_hold(tput: pd.DataFrame, kv_budget_gib: float) -> None:
    """The batch the GPU budget fits is sized by the bytes a request then holds (measured by the runs
    the budget let run, cache state included): that many fit, one more would not."""
    held = tput[tput.metric == "hbm_bytes_per_request"].set_index("mode").value
    fits = tput[tput.metric == "max_batch_gpu_budget"].set_index("mode").value[held.index]
    assert "hisparse" in held.index and (held > 0).all()
    assert (fits * held <= kv_budget_gib * 2**30).all() and ((fits + 1) * held > kv_budget_gib * 2**30).all()


@pytest.mark.parametrize("edit,message", [
    (('workload = "tiny"\n', 'workload = "tiny"\ntoken_budget = 8\n'), "token_budget = 8: expected an integer of "
                                                                      "at least one 16-token page"),
    (("cache_slots = 6\ncontexts = [64]", "cache_slots = 2\ncontexts = [64]"),
     "cache_slots 2 is smaller than the model's k = 3"),
], ids=["budget-under-a-page", "slots-below-k"])
def test_bad_quest_studies_fail_before_running(tmp_path, capsys, edit, message):
    config = write(tmp_path, QUEST.replace(*edit, 1))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "results")]) == 2
    assert re.search(message, capsys.readouterr().err) and not list(tmp_path.glob("results/*.csv"))
    backend = write(tmp_path, QUEST.replace('workload = "tiny"\n', 'workload = "tiny"\ndecode_backend = "triton"\n',
                                            1))
    assert sweep.main(["--config", backend, "--dry-run"]) == 2
    assert "decode_backend applies to DSA models (the sparse MLA decode kernel); model 'tiny:llama' is quest" \
        in capsys.readouterr().err
    dsa = write(tmp_path, TINY.replace('workload = "tiny"\n', 'workload = "tiny"\ntoken_budget = 64\n', 1))
    assert sweep.main(["--config", dsa, "--dry-run"]) == 2
    assert "token_budget applies to Quest models" in capsys.readouterr().err


def test_a_point_stored_from_a_run_made_another_way_runs_again(tmp_path, capsys):
    """Run settings are not part of a point, but a config asking for other ones (here new_tokens)
    must not skip the point silently: it runs again, and the dry run says why."""
    out = str(tmp_path / "results")
    one = TINY.split("[[study]]")[1]
    assert sweep.main(["--config", write(tmp_path, "[[study]]" + one), "--out", out]) == 0
    capsys.readouterr()
    assert sweep.main(["--config", write(tmp_path, "[[study]]" + one), "--out", out, "--dry-run"]) == 0
    assert "2 points, 2 already in" in capsys.readouterr().out
    longer = "[[study]]" + one.replace("new_tokens = 3", "new_tokens = 4")
    assert sweep.main(["--config", write(tmp_path, longer), "--out", out, "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "2 points, 0 already in" in said and "2 of them stored from runs made another way" in said
    assert sweep.main(["--config", write(tmp_path, longer), "--out", out]) == 0
    decode = pd.read_csv(tmp_path / "results" / "decode.csv")
    assert sorted(decode.drop_duplicates(["mode", "new_tokens"]).new_tokens) == [3, 3, 4, 4]


def test_help_lists_every_key_of_every_kind(capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--help"])
    said = capsys.readouterr().out
    for kind, keys in sweep.KEYS.items():
        block = re.search(rf"^  {kind}:\n((?:    .*\n?)*)", said, re.M).group(1)
        listed = set(re.findall(r"^    (\w+)\*?", block, re.M))
        assert listed == keys - {"kind"}, kind
    assert "max_batch       largest batch tried; serving: the most lanes (256)" in said and "contexts*" in said


def test_a_model_with_shared_indexer_layers_is_sized_by_what_its_runs_hold(tmp_path):
    """glm_moe_dsa's shared layers keep no indexer keys of their own: the sizing counts the anchors' only."""
    shared = TINY.split("[[study]]")[2].replace("tiny:deepseek_v32", "tiny:glm_moe_dsa")
    out = str(tmp_path / "results")
    assert sweep.main(["--config", write(tmp_path, "[[study]]" + shared), "--out", out]) == 0
    assert_sized_by_what_runs_hold(pd.read_csv(tmp_path / "results" / "throughput.csv"), 0.0001)


def _damaged_checkpoint(path, damage: str):
    """A tiny DSA checkpoint (two shards) with one tensor dropped, reshaped, or a shard unreadable."""
    from safetensors.torch import load_file, save_file

    from hisparse.models.tiny import write_tiny_checkpoint
    ckpt = write_tiny_checkpoint("deepseek_v32", path, shards=2)
    shard = sorted(ckpt.glob("*.safetensors"))[1]
    tensors = load_file(shard)
    name = "model.layers.1.self_attn.kv_a_layernorm.weight"
    assert name in tensors
    if damage == "missing":
        del tensors[name]
    elif damage == "misshapen":
        tensors[name] = torch.zeros(tensors[name].numel() + 1)
    else:
        shard.write_bytes(b"not safetensors")
        return ckpt, shard.name
    save_file(tensors, shard, metadata={"format": "pt"})
    return ckpt, name


@pytest.mark.parametrize("damage,message", [
    ("missing", r"checkpoint lacks tensors: \['{name}'\] \(1 in all\)$"),
    ("misshapen", r"tensor {name} in model-00002-of-00002\.safetensors has shape \[33\], expected \[32\] from "
                  r"config\.json"),
    ("unreadable", r".*/model-00002-of-00002\.safetensors is not a readable safetensors file"),
], ids=["missing", "misshapen", "unreadable"])
def test_a_checkpoint_with_a_missing_or_misshapen_tensor_is_refused_before_any_study_runs(tmp_path, capsys, damage,
                                                                                            message):
    """The checkpoint study comes second: its fault must stop the sweep before the first study runs,
    and the dry run must catch it too. Only headers are read (names, shapes), no weights."""
    ckpt, name = _damaged_checkpoint(tmp_path / "dsa", damage)
    first = TINY.split("\n\n[[study]]")[0]
    config = write(tmp_path, first + "\n\n" + first.replace('model = "tiny:deepseek_v32"', f'model = "{ckpt}"'))
    for dry in (["--dry-run"], []):
        assert sweep.main(["--config", config, "--out", str(tmp_path / "results"), *dry]) == 2
        err = capsys.readouterr().err
        assert re.search(rf"study 1 \(decode\): checkpoint {re.escape(repr(str(ckpt)))}: " + message.format(
            name=re.escape(name)), err, re.M), err
        assert not (tmp_path / "results").exists(), "nothing may run"


def test_a_whole_checkpoint_passes_validation_and_runs(tmp_path):
    from hisparse.models.tiny import write_tiny_checkpoint
    ckpt = write_tiny_checkpoint("deepseek_v32", tmp_path / "dsa", shards=2)
    first = TINY.split("\n\n[[study]]")[0].replace('model = "tiny:deepseek_v32"', f'model = "{ckpt}"')
    study = sweep.tomllib.loads(first)["study"]
    sweep.validate(study)
    assert [p["model"] for p in sweep.points(study[0])] == [str(ckpt)] * 2


def test_run_decode_replays_a_draw_of_its_own_for_every_request(monkeypatch):
    """A synthetic workload's batch is batch_workload's: request b replays its own draw (seed), not
    a copy of request 0's."""
    from hisparse.synthetic import batch_workload, preset
    replays = []

    class RecordingEngine:
        def __init__(self, model, mode, **settings):
            self.anchors = list(range(model.config.num_hidden_layers))

        def generate(self, prompts, new_tokens, replay=None, **settings):
            replays.append(replay)
            return "ran"

    monkeypatch.setattr(sweep, "Engine", RecordingEngine)
    model = sweep.build({"_index": 0, "kind": "decode", "model": "tiny:deepseek_v32"}, torch.device("cpu"))
    point = {"context": 24, "workload": "tiny", "mode": "hisparse", "cache_slots": 8}
    assert sweep.run_decode(model, point, batch=3, new_tokens=2, graph=False, warmup_steps=1) == "ran"
    sel = replays[0].selections                                      # [steps, layers, batch, k]
    assert sel.shape[2] == 3 and (sel[:, :, 0] != sel[:, :, 1]).any() and (sel[:, :, 1] != sel[:, :, 2]).any()
    config = model.config
    expected = batch_workload(preset("tiny", context=24, steps=3, k=config.index_topk,
                                     layers=config.num_hidden_layers, sinks=1, window=2), 3)
    assert (sel == expected.selections).all()


# prompts of 60 tokens in 2 chunks (the interpreter's prefill takes about 0.06 s a token here), one
# request per client; a budget (about 37 KB) of one resident lane, or two hierarchical ones and the
# prefill workspace
SERVING_BUDGET, CHUNK = "kv_budget_gib = 0.000035", "prefill_chunk = 32"
SERVING = f"""
[[study]]
kind = "serving"
model = "tiny:deepseek_v32"
layers = 1
modes = ["resident", "hisparse"]
cache_slots = 16
input_len = 60
output_len = 3
concurrency = [2]
requests_per_client = 1
{SERVING_BUDGET}
{CHUNK}
workload = "tiny"
"""


def test_a_hybrid_serving_study_writes_its_counts(tmp_path):
    """mode hybrid in a serving study: its rows carry how many requests were admitted resident and
    how many were demoted, as requests, beside the serving metrics. Under this budget (twice the
    study's) the two lanes' spare streams hold both requests' runs: every request stays resident."""
    config = write(tmp_path, SERVING.replace('modes = ["resident", "hisparse"]', 'modes = ["hybrid"]').replace(
        SERVING_BUDGET, "kv_budget_gib = 0.00007"))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "o")]) == 0
    rows = pd.read_csv(tmp_path / "o" / "serving.csv").set_index("metric")
    assert set(rows["mode"]) == {"hybrid"} and rows.loc["output_tokens", "value"] == 6
    assert rows.loc["resident_admissions", "unit"] == rows.loc["demotions", "unit"] == "requests"
    assert rows.loc["lanes", "value"] == 2 and rows.loc["resident_admissions", "value"] == 2
    assert rows.loc["demotions", "value"] == 0


QUEST_SERVING = """
[[study]]
kind = "serving"
model = "tiny:llama"
modes = ["hybrid"]
cache_slots = 4
token_budget = 48
input_len = 120
output_len = 3
concurrency = [2]
requests_per_client = 1
kv_budget_gib = 0.001
prefill_chunk = 64
workload = "model"
"""


def test_a_hybrid_serving_study_runs_a_quest_model(tmp_path):
    """Serving studies take mode hybrid in every family: a tiny Quest model, its own selections, both
    requests resident (room for their runs under this budget), every decode step the all-resident one."""
    config = write(tmp_path, QUEST_SERVING)
    assert sweep.main(["--config", config, "--out", str(tmp_path / "o")]) == 0
    rows = pd.read_csv(tmp_path / "o" / "serving.csv").set_index("metric")
    assert rows.loc["output_tokens", "value"] == 6 and rows.loc["resident_admissions", "value"] == 2
    assert rows.loc["resident_steps", "unit"] == "steps" and rows.loc["resident_steps", "value"] >= 2


def test_a_serving_study_of_one_token_out_runs(tmp_path):
    """output_len = 1 (the untimed warm-up request asks for no more than the point's own)."""
    config = write(tmp_path, SERVING.replace("output_len = 3", "output_len = 1").replace(
        'modes = ["resident", "hisparse"]', 'modes = ["hisparse"]'))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "o")]) == 0
    rows = pd.read_csv(tmp_path / "o" / "serving.csv")
    assert rows[rows.metric == "output_tokens"].value.tolist() == [2]


def test_a_serving_sweep_with_a_draw_cache_draws_every_request_first(tmp_path, capsys):
    """--draw-cache: the sweep draws every serving request's selections in one batch before any point
    runs, and the rows equal those of a run without the cache."""
    config = write(tmp_path, SERVING.replace('modes = ["resident", "hisparse"]', 'modes = ["hisparse"]'))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "a"), "--draw-cache", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "drawing 2 of 2 requests' selections" in out and out.index("drawing") < out.index("[1/1]")
    assert len(list((tmp_path / "d").glob("*.npy"))) == 2
    assert sweep.main(["--config", config, "--out", str(tmp_path / "b")]) == 0
    cached, plain = (pd.read_csv(tmp_path / d / "serving.csv") for d in ("a", "b"))
    for metric in ("output_tokens", "miss_rate", "lanes"):
        assert (cached[cached.metric == metric].value.values == plain[plain.metric == metric].value.values).all()


def test_only_runs_the_points_it_names_and_refuses_an_unknown_key(tmp_path, capsys):
    """--only mode=hisparse: the hisparse point runs, resident's does not, and a later sweep without
    --only finds only resident's to run; values joined by commas are alternatives; an unknown key or a
    malformed pair is refused before anything runs."""
    config = write(tmp_path, SERVING)
    out = tmp_path / "o"
    assert sweep.main(["--config", config, "--out", str(out), "--dry-run", "--only", "mode=resident,hisparse",
                       "--only", "concurrency=2"]) == 0
    assert "--only mode=resident,hisparse concurrency=2: 2 of them" in capsys.readouterr().out
    assert sweep.main(["--config", config, "--out", str(out), "--dry-run", "--only", "mode=noio,hisparse"]) == 0
    assert "--only mode=noio,hisparse: 1 of them" in capsys.readouterr().out
    assert sweep.main(["--config", config, "--out", str(out), "--only", "mode=hisparse", "--only", "concurrency=2"]) == 0
    assert "--only mode=hisparse concurrency=2: 1 of them" in capsys.readouterr().out
    assert set(pd.read_csv(out / "serving.csv")["mode"]) == {"hisparse"}
    assert sweep.main(["--config", config, "--out", str(out), "--dry-run"]) == 0
    listed = capsys.readouterr().out
    assert "2 points, 1 already" in listed and "'mode': 'resident'" in listed and "'mode': 'hisparse'" not in listed
    assert sweep.main(["--config", config, "--out", str(tmp_path / "p"), "--only", "modes=hisparse"]) == 2
    assert "no point has the key 'modes'" in capsys.readouterr().err and not (tmp_path / "p").exists()
    assert sweep.main(["--config", config, "--out", str(tmp_path / "p"), "--only", "concurrency=7,9"]) == 2
    assert ("--only concurrency=7,9: no point has concurrency 7 or 9; its points have 2"
            in capsys.readouterr().err) and not (tmp_path / "p").exists()
    with pytest.raises(SystemExit):
        sweep.main(["--config", config, "--out", str(tmp_path / "p"), "--only", "hisparse"])
    assert "--only 'hisparse': expected KEY=VALUE" in capsys.readouterr().err


def test_draw_only_fills_the_cache_and_runs_no_point(tmp_path, capsys):
    """--draw-only: every request's draw lands in the cache, no row is written, and the sweep after it
    draws nothing; without --draw-cache it is refused before anything runs."""
    config = write(tmp_path, SERVING.replace('modes = ["resident", "hisparse"]', 'modes = ["hisparse"]'))
    args = ["--config", config, "--out", str(tmp_path / "o"), "--draw-cache", str(tmp_path / "d")]
    assert sweep.main(args + ["--draw-only"]) == 0
    assert "draws of 2 requests" in capsys.readouterr().out
    assert len(list((tmp_path / "d").glob("*.npy"))) == 2 and not (tmp_path / "o" / "serving.csv").exists()
    assert sweep.main(args) == 0
    assert "drawing" not in capsys.readouterr().out and (tmp_path / "o" / "serving.csv").exists()
    with pytest.raises(SystemExit):
        sweep.main(["--config", config, "--out", str(tmp_path / "p"), "--draw-only"])
    assert "--draw-only fills the draw cache: name it with --draw-cache DIR" in capsys.readouterr().err


def test_serving_draws_kept_in_a_cache_are_the_drawn_ones(tmp_path, capsys, monkeypatch):
    """--draw-cache: the selections read back equal the ones drawn without it; a later call with more
    requests draws only the new ones; a changed preset field draws afresh under another name; filling
    a cache that holds every draw reads none of them."""
    config = sweep.build(dict(kind="serving", model="tiny:deepseek_v32", layers=2), torch.device("meta")).config
    plain = request_draws("tiny", config, 40, 4, 3)
    assert len(plain) == 3 and all(d.shape == (3, 2, config.index_topk) and d.is_contiguous() for d in plain)
    assert not torch.equal(plain[0], plain[1]), "requests share one draw: the checks below could not tell them apart"
    cached = request_draws("tiny", config, 40, 4, 2, cache=tmp_path)
    assert all(map(torch.equal, cached, plain[:2])) and len(cached) == 2 and len(list(tmp_path.glob("*.npy"))) == 2
    out = capsys.readouterr().out
    assert "drawing 2 of 2" in out and "drew 1/2 requests' selections" in out and "drew 2/2" in out
    again = request_draws("tiny", config, 40, 4, 3, cache=tmp_path)
    assert len(again) == 3 and all(map(torch.equal, again, plain)) and "drawing 1 of 3" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.part.npy"))
    longer = request_draws("tiny", config, 41, 4, 1, cache=tmp_path)
    assert len(list(tmp_path.glob("*.npy"))) == 4 and not torch.equal(longer[0], plain[0])
    assert "drawing 1 of 1" in capsys.readouterr().out
    loads = []
    monkeypatch.setattr(np, "load", lambda *a, **kw: loads.append(a))
    fill_draw_cache("tiny", config, 40, 4, 3, tmp_path)          # every draw there: none is read
    assert not loads and "drawing" not in capsys.readouterr().out


def test_a_shared_indexer_layer_replays_its_anchors_draw(tmp_path):
    """glm_moe_dsa's layer 1 shares layer 0's indexer: its draw is layer 0's, cached or not; the full
    layers keep their own."""
    config = sweep.build(dict(kind="serving", model="tiny:glm_moe_dsa", layers=3), torch.device("meta")).config
    assert config.indexer_types == ["full", "shared", "full"]
    plain = request_draws("tiny", config, 40, 4, 2)
    cached = request_draws("tiny", config, 40, 4, 2, cache=tmp_path)
    for draw, again in zip(plain, cached, strict=True):
        assert torch.equal(draw, again) and draw.is_contiguous()
        assert torch.equal(draw[:, 1], draw[:, 0]) and not torch.equal(draw[:, 2], draw[:, 0])


@pytest.mark.parametrize("edit,message", [
    (("concurrency = [2]", "concurrency = [2]\nrates = [1.0]"),
     r"give concurrency \(closed loop\), rates \(open loop\) or request_rate .*, one of them; this study gives "
     r"\['concurrency', 'rates'\]"),
    (("concurrency = [2]", "rates = [0.0]"), r"rates = \[0.0\]: expected a positive number"),
    (("cache_slots = 16", "cache_slots = [16, 32]"), r"cache_slots = \[16, 32\]: a serving study takes one B"),
    (("output_len = 3", "output_len = 0"), "output_len = 0: expected one positive integer"),
    (("model = \"tiny:deepseek_v32\"\nlayers = 1", "model = \"tiny:llama\""),
     "workload = 'tiny': a serving study replays a preset on DSA models"),
], ids=["both-loads", "rate-0", "two-slots", "output-0", "quest-preset"])
def test_bad_serving_studies_fail_before_running(tmp_path, capsys, edit, message):
    assert_refused(tmp_path, capsys, SERVING, edit, message)


def assert_refused(tmp_path, capsys, config: str, edit: tuple[str, str], message: str) -> None:
    """The config with one edit fails before running: exit 2, no rows, `message` on stderr."""
    old, new = edit
    assert old in config
    assert sweep.main(["--config", write(tmp_path, config.replace(old, new, 1)), "--out", str(tmp_path / "o")]) == 2
    assert not list(tmp_path.glob("o/*.csv"))
    assert re.search(message, capsys.readouterr().err)


DIALECT = SERVING.replace("concurrency = [2]\nrequests_per_client = 1", """request_rate = [inf, 20.0]
num_prompts = 3
range_ratio = 0.5
max_concurrency = 2
seed = 1""").replace('modes = ["resident", "hisparse"]', 'modes = ["hisparse"]').replace('workload = "tiny"',
                                                                                          'workload = "model"')


def test_a_request_rate_study_runs_the_random_dataset_and_its_points_carry_it(tmp_path, capsys):
    """bench_serving's random dataset in process: per rate, num_prompts requests of the drawn lengths
    served (the output tokens are the drawn ones), the workload's keys as columns, the dialect's
    figures as rows; a rerun finds every point done, and a rates point is not done by these rows."""
    from hisparse.serving.workload import RandomWorkload
    config, out = write(tmp_path, DIALECT), tmp_path / "o"
    assert sweep.main(["--config", config, "--out", str(out)]) == 0
    rows = pd.read_csv(out / "serving.csv")
    assert sorted(rows.request_rate.unique()) == [20.0, float("inf")]
    for column, value in (("num_prompts", 3), ("range_ratio", 0.5), ("max_concurrency", 2), ("seed", 1),
                          ("input_len", 60), ("output_len", 3)):
        assert rows[column].unique().tolist() == [value], column
    assert rows.concurrency.isna().all() and rows.rate.isna().all()
    drawn = RandomWorkload(60, 3, 3, 0.5, 20.0, 2, 1).requests(97)
    for _, one in rows.groupby("request_rate"):
        value = dict(zip(one.metric, one.value))
        assert value["requests"] == 3 and value["output_tokens"] == sum(r.max_new_tokens for r in drawn)
        assert value["lanes"] <= 2 and value["running_batch_max"] <= 2
        for metric in ("request_throughput", "input_throughput", "ttft_ms_mean", "latency_ms_mean", "tokens_per_s"):
            assert value[metric] > 0, metric
    assert sweep.main(["--config", config, "--out", str(out), "--dry-run"]) == 0
    assert "2 points, 2 already in" in capsys.readouterr().out
    done = sweep.done_points(out / "serving.csv")
    open_loop = {"bench": "serving", "mode": "hisparse", "concurrency": None, "rate": 20.0, "input_len": 60}
    assert not sweep.already_done(done, open_loop, "cpu")


@pytest.mark.parametrize("edit,message", [
    (("request_rate = [inf, 20.0]", "request_rate = [0, inf]"),
     r"request_rate = \[0, inf\]: expected a positive number"),
    (("request_rate = [inf, 20.0]", "request_rate = [inf, inf]"), r"request_rate = \[inf, inf\] lists inf twice"),
    (("range_ratio = 0.5", "range_ratio = 0"), r"range_ratio = 0: expected a number in \(0, 1\]"),
    (("num_prompts = 3", "num_prompts = 0"), r"num_prompts = 0: expected a positive integer"),
    (("max_concurrency = 2", "max_concurrency = 0"), r"max_concurrency = 0: expected a positive integer"),
    (("seed = 1", "seed = -1"), r"seed = -1: expected an integer in \[0, "),
    (("request_rate = [inf, 20.0]", "concurrency = [2]"), r"num_prompts = 3 belongs to a request_rate study"),
    (('workload = "model"', 'workload = "tiny"'), r"range_ratio = 0.5 with workload = 'tiny': a preset's draws"),
], ids=["rate-0", "rate-twice", "ratio-0", "prompts-0", "cap-0", "seed-neg", "with-concurrency", "ratio-preset"])
def test_bad_request_rate_studies_fail_before_running(tmp_path, capsys, edit, message):
    assert_refused(tmp_path, capsys, DIALECT, edit, message)


def test_a_serving_study_admits_by_memory_writes_its_rows_and_runs_prefill_overlap_both_ways(tmp_path, capsys):
    """Under one GPU budget resident holds one lane, hisparse two (each point prints its lanes before it
    serves); every request served; rows per (mode, concurrency) with the serving metrics.
    prefill_overlap = [false, true]: each mode runs both ways, the same tokens out; the overlapped
    points' rows say prefill_overlap True, the others leave it empty (the rows of a study without the
    key, checked above), and a rerun finds every point done (a point without overlap is not done by its
    overlapped twin's rows, nor the other way)."""
    config = write(tmp_path, SERVING.replace(CHUNK, CHUNK + '\nprefill_overlap = [false, true]'))
    out = tmp_path / "o"
    assert sweep.main(["--config", config, "--out", str(out)]) == 0
    rows = pd.read_csv(out / "serving.csv")
    wide = rows[rows.prefill_overlap.isna()].pivot_table(index="mode", columns="metric", values="value")
    assert wide.loc["resident", "lanes"] == 1 and wide.loc["hisparse", "lanes"] == 2
    printed = capsys.readouterr().out                   # each point says its lanes before it serves
    assert printed.count("serving: 1 lanes of") == 2 and printed.count("serving: 2 lanes of") == 2
    assert "under 3.5e-05 GiB" in printed
    assert (wide["requests"] == 2).all() and (wide["output_tokens"] == 6).all()
    assert {"tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "running_batch_mean",
            "queue_ms_p50", "peak_gpu_gib"} <= set(wide.columns)
    assert set(rows.concurrency) == {2} and set(rows.input_len) == {60} and set(rows.output_len) == {3}
    assert (wide["peak_gpu_gib"] * 2**30 <= 0.000035 * 2**30).all()
    tokens = rows[rows.metric == "output_tokens"]
    assert len(tokens) == 4 and (tokens.value == 6).all()
    assert tokens.prefill_overlap.isna().sum() == 2 and tokens.prefill_overlap.dropna().astype(bool).all()
    done = sweep.done_points(out / "serving.csv")
    study = sweep.tomllib.loads((tmp_path / "sweep.toml").read_text())["study"]
    sweep.validate(study)
    points = sweep.points(study[0])
    assert sum("prefill_overlap" in p for p in points) == 2
    assert all(sweep.already_done(done, p, "cpu") for p in points)
    plain = done[done.prefill_overlap.isna()]
    assert not any(sweep.already_done(plain, p, "cpu") for p in points if "prefill_overlap" in p)
    overlapped = done[done.prefill_overlap.notna()]
    assert not any(sweep.already_done(overlapped, p, "cpu") for p in points if "prefill_overlap" not in p)


def test_a_disaggregated_serving_study_marks_its_rows_and_reports_the_prefill_apart(tmp_path):
    """disaggregated = [false, true]: each mode runs both ways; the disaggregated points' rows say so
    and carry the prefill's own time (prefill_elsewhere_ms_p50), the others leave both empty."""
    config = write(tmp_path, SERVING.replace(CHUNK, CHUNK + "\ndisaggregated = [false, true]"))
    out = tmp_path / "o"
    assert sweep.main(["--config", config, "--out", str(out)]) == 0
    rows = pd.read_csv(out / "serving.csv")
    apart = rows[rows.disaggregated.notna()]
    assert set(apart["mode"]) == {"resident", "hisparse"} and apart.disaggregated.astype(bool).all()
    assert (apart.query("metric == 'prefill_elsewhere_ms_p50'").value > 0).sum() == 2
    assert rows[rows.disaggregated.isna()].query("metric == 'prefill_elsewhere_ms_p50'").empty
    assert (rows.query("metric == 'output_tokens'").value == 6).all()


def test_disaggregated_with_prefill_overlap_fails_before_running(tmp_path, capsys):
    config = write(tmp_path, SERVING.replace(CHUNK, CHUNK + "\ndisaggregated = true\nprefill_overlap = true"))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "o")]) == 2
    assert "disaggregated = true prefills off the decode GPU's clock" in capsys.readouterr().err


def test_prefill_layers_sizes_the_overlapped_pieces_and_marks_their_rows(tmp_path):
    """prefill_layers = 1 and prefill_sms = 8 with prefill_overlap = [false, true]: the overlapped point
    runs in pieces of one layer (the same tokens out; no green context without a GPU) and its rows say
    prefill_layers 1 and prefill_sms 8; the plain point's rows leave both empty, and an overlapped
    point of the default pieces (4) is not done by them."""
    study = CHUNK + '\nprefill_overlap = [false, true]\nprefill_layers = 1\nprefill_sms = 8'
    config = write(tmp_path, SERVING.replace(CHUNK, study).replace('"resident", ', ''))
    out = tmp_path / "o"
    assert sweep.main(["--config", config, "--out", str(out)]) == 0
    tokens = pd.read_csv(out / "serving.csv").query("metric == 'output_tokens'")
    assert len(tokens) == 2 and (tokens.value == 6).all()
    assert tokens.prefill_overlap.isna().equals(tokens.prefill_layers.isna())
    assert (tokens.prefill_layers.dropna() == 1).all() and tokens.prefill_layers.notna().sum() == 1
    assert tokens.prefill_overlap.isna().equals(tokens.prefill_sms.isna()) and (tokens.prefill_sms.dropna() == 8).all()
    default = sweep.tomllib.loads((tmp_path / "sweep.toml").read_text())["study"]
    del default[0]["prefill_layers"], default[0]["prefill_sms"]
    sweep.validate(default)
    four = [p for p in sweep.points(default[0]) if "prefill_overlap" in p]
    assert four and not any("prefill_layers" in p for p in four)
    assert not any(sweep.already_done(sweep.done_points(out / "serving.csv"), p, "cpu") for p in four)


@pytest.mark.parametrize("study,message", [
    ("prefill_layers = 1", r"prefill_layers = 1 sizes the pieces of prefill_overlap = true points, and this study has none"),
    ("prefill_overlap = true\nprefill_layers = 0", r"prefill_layers = 0: expected one positive integer"),
    ("prefill_sms = 8", r"prefill_sms = 8 confines the pieces of prefill_overlap = true points, and this study has none"),
    ("prefill_overlap = true\nprefill_sms = 0", r"prefill_sms = 0: expected one positive integer"),
], ids=["without-overlap", "zero", "sms-without-overlap", "sms-zero"])
def test_bad_prefill_layers_or_sms_fails_before_running(tmp_path, capsys, study, message):
    config = write(tmp_path, SERVING.replace(CHUNK, f'{CHUNK}\n{study}'))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "o")]) == 2
    assert not list(tmp_path.glob("o/*.csv")) and re.search(message, capsys.readouterr().err)


def test_a_point_is_not_done_by_rows_that_differ_in_an_optional_key():
    """kv_dtype, prefill_overlap, prefill_layers, prefill_sms, requests_per_client and transport: a point without the
    key is done only by rows that leave it empty (a bf16 point not by its fp8 twin's rows, an in-process one not by
    HTTP rows, a run of 2 requests per client not by one of 3)."""
    point = {"bench": "serving", "mode": "hisparse", "concurrency": 8}
    row = dict(point, gpu="g", metric="tokens_per_s", value=1.0)
    for key, value in (("kv_dtype", "fp8"), ("prefill_overlap", True), ("prefill_layers", 1), ("prefill_sms", 64),
                       ("requests_per_client", 3), ("transport", "http")):
        done = pd.DataFrame([dict(row, **{key: value})])
        assert not sweep.already_done(done, point, "g"), key
        assert sweep.already_done(done, dict(point, **{key: value}), "g"), key
        assert sweep.already_done(pd.DataFrame([dict(row, **{key: None})]), point, "g"), key


def test_a_closed_loop_point_carries_requests_per_client_where_it_is_not_the_default(tmp_path):
    """requests_per_client = 1 (not the default 2): each closed-loop point and its rows carry it, and the
    point runs that many requests a client; with the default the points leave the key out, as the rows
    from before it existed; an open-loop (rates) point never carries it."""
    config = write(tmp_path, SERVING.replace('"resident", ', ''))
    out = tmp_path / "o"
    assert sweep.main(["--config", config, "--out", str(out)]) == 0
    rows = pd.read_csv(out / "serving.csv")
    assert (rows.requests_per_client == 1).all() and rows.query("metric == 'requests'").value.tolist() == [2.0]
    studies = sweep.tomllib.loads(SERVING.replace("requests_per_client = 1", "requests_per_client = 2"))["study"]
    open_loop = {k: v for k, v in studies[0].items() if k != "concurrency"}
    studies.append(dict(open_loop, requests_per_client=3, rates=[1.0]))
    sweep.validate(studies)
    assert not any("requests_per_client" in p for s in studies for p in sweep.points(s))
    three = dict(studies[0], requests_per_client=3)
    assert {p["requests_per_client"] for p in sweep.points(three)} == {3}


@pytest.mark.parametrize("value,message", [
    ("1", r"prefill_overlap = 1: expected true, false or a list of them"),
    ("[true, true]", "prefill_overlap"),
], ids=["not-bool", "twice"])
def test_bad_prefill_overlap_fails_before_running(tmp_path, capsys, value, message):
    config = write(tmp_path, SERVING.replace(CHUNK, f'{CHUNK}\nprefill_overlap = {value}'))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "o")]) == 2
    assert not list(tmp_path.glob("o/*.csv")) and re.search(message, capsys.readouterr().err)


def test_prefill_overlap_is_refused_for_a_quest_model(tmp_path, capsys):
    config = write(tmp_path, QUEST_SERVING.replace('workload = "model"', 'workload = "model"\nprefill_overlap = true'))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "o")]) == 2
    assert "prefill_overlap = true is built for DSA models; model 'tiny:llama' is quest" in capsys.readouterr().err


def test_graphs_of_counts_a_graphed_hybrid_serving_run_twice():
    """--runs-per-process counts graphs: a graphed hybrid server captures its mixed step and its
    all-resident step, so a process starting one must have room for two below the 4th capture."""
    from experiments.sweep import graphs_of
    serving = {"bench": "serving", "mode": "hybrid"}
    assert graphs_of(serving, True) == 2
    assert graphs_of(serving, False) == 1 and graphs_of(dict(serving, mode="hisparse"), True) == 1
    assert graphs_of({"bench": "decode", "mode": "hisparse"}, True) == 1
    assert graphs_of({"bench": "policies"}, False) == 0


def test_the_sweep_starts_a_fresh_process_before_a_graphed_hybrid_run_would_be_the_4th_graph(tmp_path):
    """The serving points carry no graph key (a run setting): the sweep reads it from the study. With
    --runs-per-process 3, a graphed hybrid point after a hybrid one (2 + 2 graphs) goes to a fresh
    process; after one resident point (1 + 2) it stays."""
    study = sweep.tomllib.loads(textwrap.dedent(SERVING).replace('modes = ["resident", "hisparse"]',
                                                                 'modes = ["hybrid"]\ngraph = true'))["study"]
    sweep.validate(study)
    point = sweep.points(study[0])[0]
    assert "graph" not in point
    assert sweep.over_limit(2, study[0], point, True, 3) and not sweep.over_limit(1, study[0], point, True, 3)
    assert not sweep.over_limit(2, study[0], point, False, 3)       # no graphs on the CPU: one run


def test_the_default_sweep_writes_to_out_and_leaves_the_committed_results_alone(tmp_path, monkeypatch, capsys):
    """Without --out the rows go to out/ (the README's first command: git ignores it, and says so);
    --out results is refused on a machine without a GPU before any point runs (the committed
    results hold GPU rows only); every file under results/ keeps its bytes and mtime throughout."""
    import hashlib

    from hisparse.results import COMMITTED_RESULTS, PACKAGE_ROOT

    def snapshot():
        return {p: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
                for p in sorted(COMMITTED_RESULTS.rglob("*")) if p.is_file()}
    before = snapshot()
    monkeypatch.chdir(PACKAGE_ROOT)                    # where the README's command runs
    assert sweep.main(["--dry-run"]) == 0
    assert "already in out/ (git ignores it)" in capsys.readouterr().out
    config = write(tmp_path, TINY)
    if not torch.cuda.is_available():
        assert sweep.main(["--config", config, "--out", "results"]) == 2
        assert "--out results is the committed results, which hold GPU rows only" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert sweep.main(["--config", config]) == 0
    assert "done: rows appended under out/" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"decode.csv", "throughput.csv"}
    assert snapshot() == before


# a serving study, and TINY's throughput study with a host pool that holds two of its requests
CAPS = """
[[study]]
kind = "serving"
model = "tiny:deepseek_v32"
modes = ["resident", "hisparse"]
cache_slots = 8
input_len = 60
output_len = 3
concurrency = [2]
kv_budget_gib = 0.0001
host_budget_gib = 0.00005
workload = "tiny"
""" + TINY[TINY.index("[[study]]\nkind = \"throughput\""):].replace("max_batch = 3", "host_budget_gib = 0.00004\nmax_batch = 3")


def test_each_point_prints_its_admitted_batch_what_caps_it_and_its_ratio_to_residents(tmp_path, capsys):
    """Serving at max_context 63: resident's lane (60480 bytes) fits once in 0.0001 GiB; hisparse's
    (29748) twice beside its workspace and slot map, but the host pool holds one request's 189 rows;
    2 clients, 2 lanes at most. Throughput at 24 tokens (+ 4 decoded): resident 3 by the GPU budget and
    max_batch, hisparse 2 by the host pool."""
    assert sweep.main(["--config", write(tmp_path, CAPS), "--out", str(tmp_path / "o")]) == 0
    printed = capsys.readouterr().out
    assert "serving: 1 lanes of 0.000 GiB, a prefill workspace of 0.000 GiB, under 0.0001 GiB; admits 1, capped by " \
           "the GPU budget (GPU budget 1, max lanes 2)\n" in printed
    assert "serving: 2 lanes of 0.000 GiB, a prefill workspace of 0.000 GiB, under 0.0001 GiB; admits 1, capped by " \
           "the host RAM (GPU budget 2, max lanes 2, host RAM 1); 1.00x resident's 1\n" in printed
    assert "throughput: batch 3 at 24 tokens, capped by the GPU budget and the max lanes (GPU budget 3, max " \
           "lanes 3)\n" in printed
    assert "throughput: batch 2 at 24 tokens, capped by the host RAM (GPU budget 6, max lanes 3, host RAM 2); " \
           "0.67x resident's 3\n" in printed


def test_a_hybrid_batch_the_two_budgets_bound_together_says_so():
    assert sweep.cap_text({"GPU budget": 9, "max lanes": 256, "host RAM": 5}, 7) == \
        "capped by the GPU and host budgets together (GPU budget 9, max lanes 256, host RAM 5)"


MULTITURN = SERVING.replace("input_len = 60\n", "").replace("concurrency = [2]\nrequests_per_client = 1", """dataset = "multiturn"
conversations = [2]
turns = 2
first_len = 60
user_len = 4""").replace('modes = ["resident", "hisparse"]', 'modes = ["hisparse"]')
SHARED_DOCUMENT = SERVING.replace("input_len = 60\n", "").replace("concurrency = [2]\nrequests_per_client = 1", """dataset = "shared_document"
document_len = 56
question_len = 4
request_rate = [inf]
num_prompts = 3
max_concurrency = 2""").replace('modes = ["resident", "hisparse"]', 'modes = ["hisparse"]')


def test_a_multiturn_study_serves_its_conversations_and_its_points_carry_them(tmp_path, capsys):
    """conversations x turns requests served (each answer output_len tokens), a closed loop of one
    client per conversation; the rows carry dataset, its keys and input_len, the longest prompt; a
    rerun finds the point done, and a random point of those lengths is not done by these rows."""
    config, out = write(tmp_path, MULTITURN), tmp_path / "o"
    assert sweep.main(["--config", config, "--out", str(out)]) == 0
    rows = pd.read_csv(out / "serving.csv")
    for column, value in (("dataset", "multiturn"), ("conversations", 2), ("turns", 2), ("first_len", 60),
                          ("user_len", 4), ("input_len", 60 + 3 + 4), ("output_len", 3)):
        assert rows[column].unique().tolist() == [value], column
    assert rows.concurrency.isna().all() and rows.rate.isna().all() and "request_rate" not in rows
    value = dict(zip(rows.metric, rows.value))
    assert value["requests"] == 4 and value["output_tokens"] == 12 and value["lanes"] <= 2
    assert sweep.main(["--config", config, "--out", str(out), "--dry-run"]) == 0
    assert "1 points, 1 already in" in capsys.readouterr().out
    done = sweep.done_points(out / "serving.csv")
    random_point = {"bench": "serving", "mode": "hisparse", "concurrency": 2, "rate": None, "input_len": 67}
    assert not sweep.already_done(done, random_point, "cpu")


def test_a_shared_document_study_serves_its_questions(tmp_path):
    config, out = write(tmp_path, SHARED_DOCUMENT), tmp_path / "o"
    assert sweep.main(["--config", config, "--out", str(out)]) == 0
    rows = pd.read_csv(out / "serving.csv")
    for column, value in (("dataset", "shared_document"), ("document_len", 56), ("question_len", 4),
                          ("input_len", 60), ("num_prompts", 3)):
        assert rows[column].unique().tolist() == [value], column
    value = dict(zip(rows.metric, rows.value))
    assert value["requests"] == 3 and value["output_tokens"] == 9


def test_shared_prefix_points_draw_each_request_at_its_length(tmp_path, capsys):
    """With --draw-cache --draw-only, a multiturn study draws every turn's length: one file per
    (conversation, turn) here."""
    config = write(tmp_path, MULTITURN)
    assert sweep.main(["--config", config, "--out", str(tmp_path / "o"), "--draw-cache", str(tmp_path / "d"),
                       "--draw-only"]) == 0
    assert len(list((tmp_path / "d").glob("*.npy"))) == 4 and "draws of 4 requests" in capsys.readouterr().out


@pytest.mark.parametrize("config,edit,message", [
    (MULTITURN, ('dataset = "multiturn"', 'dataset = "chat"'), r"dataset = 'chat': expected one of"),
    (MULTITURN, ("turns = 2\n", ""), r"missing key 'turns' \(dataset = 'multiturn'\)"),
    (MULTITURN, ("turns = 2", "turns = 0"), r"turns = 0: expected one positive integer"),
    (MULTITURN, ("conversations = [2]", "conversations = [2]\nconcurrency = [2]"),
     r"concurrency = \[2\]: a dataset = 'multiturn' study's load is conversations"),
    (MULTITURN, ("turns = 2", "turns = 2\ninput_len = 60"), r"input_len = 60: .* its longest prompt, 67: drop it"),
    (MULTITURN, ("turns = 2", "turns = 2\ndocument_len = 9"), r"document_len = 9 belongs to a dataset = "
                                                               r"'shared_document' study; this one is 'multiturn'"),
    (SERVING, ("concurrency = [2]", "concurrency = [2]\nturns = 3"), r"turns = 3 belongs to a dataset = 'multiturn'"),
    (SHARED_DOCUMENT, ("request_rate = [inf]\n", ""), r"missing key 'request_rate' \(dataset = 'shared_document'"),
    (SHARED_DOCUMENT, ("num_prompts = 3", "num_prompts = 3\nrange_ratio = 0.5"),
     r"range_ratio = 0.5: a shared_document study's lengths are fixed"),
], ids=["dataset", "no-turns", "turns-0", "concurrency", "input_len", "other-key", "random-turns", "no-rate",
        "ratio"])
def test_bad_shared_prefix_studies_fail_before_running(tmp_path, capsys, config, edit, message):
    assert_refused(tmp_path, capsys, config, edit, message)


def test_a_multiturn_study_with_prefix_cache_reuses_each_conversations_pages(tmp_path):
    """prefix_cache = [false, true]: with sharing, each conversation's second turn finds its first
    turn's two whole pages cached (2 x 128 tokens hit, 2 x 9 prefilled); without, nothing is."""
    text = MULTITURN.replace("first_len = 60", "first_len = 130").replace(SERVING_BUDGET, "kv_budget_gib = 0.002")
    config, out = write(tmp_path, text + "\nprefix_cache = [false, true]\n"), tmp_path / "o"
    assert sweep.main(["--config", config, "--out", str(out)]) == 0
    rows = pd.read_csv(out / "serving.csv")
    shared = dict(zip(*rows[rows.prefix_cache.notna()][["metric", "value"]].T.values))
    assert shared["prefix_hit_tokens"] == 2 * 128 and shared["requests"] == 4
    assert shared["ttft_ms_p50_later_turns"] > 0 and shared["ttft_ms_p99_later_turns"] >= shared["ttft_ms_p50_later_turns"]
    assert shared["prefill_tokens"] == 2 * 130 + 2 * (137 - 128)
    assert "prefix_hit_tokens" not in set(rows[rows.prefix_cache.isna()].metric)
    alone = dict(zip(*rows[rows.prefix_cache.isna()][["metric", "value"]].T.values))
    unit = dict(zip(rows.metric, rows.unit))
    row_bytes = 192                                      # the tiny model's 96 bf16 values a latent row
    for value in (shared, alone):                        # per turn: turn 2 is all the later turns here
        assert unit["ttft_ms_p50_turn1"] == "ms" and unit["host_gib_turn1"] == "GiB"
        assert value["ttft_ms_p50_turn2"] == value["ttft_ms_p50_later_turns"] and value["ttft_ms_p50_turn1"] > 0
        assert "ttft_ms_p50_turn3" not in value
        assert max(value["host_gib_turn1"], value["host_gib_turn2"]) == value["peak_host_gib"]
    # host rows at iterations' ends: without sharing one request's region (the next is admitted as the
    # last leaves): 133 rows in turn 1, 140 in turn 2; with, 64-row pages, 5 at most: a conversation's
    assert [alone[f"host_gib_turn{t}"] * 2**30 / row_bytes for t in (1, 2)] == [133, 140]
    # 2 cached beside the other's 3 (turn 1), then both conversations' 2 and one request's private page;
    # beside them, the index's host copies of the cached pages' indexer keys: both conversations' two
    # pages (256 tokens, 128 bytes a token over the model's indexer layers), held from turn 1's end on
    assert [shared[f"host_gib_turn{t}"] * 2**30 for t in (1, 2)] == [5 * 64 * row_bytes + 256 * 128] * 2


def test_prefix_cache_with_disaggregated_fails_before_running(tmp_path, capsys):
    config = write(tmp_path, SERVING.replace(CHUNK, CHUNK + "\nprefix_cache = true\ndisaggregated = [false, true]"))
    assert sweep.main(["--config", config, "--out", str(tmp_path / "o")]) == 2
    assert "prefix_cache = true caches prefixes on the server that prefills; disaggregated" in capsys.readouterr().err

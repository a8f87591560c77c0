"""experiments.study_model: DeepSeek-V3.2's per-GPU weight bytes in an EP8 deployment, the study model
dsa_v32_ep8 that reads them per decode step, and the config that runs it."""
import math
import re
import textwrap

import pytest
import torch

from experiments import study_model as sm
from experiments import sweep
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model

GB = 1e9


def test_the_deployments_bytes_follow_the_published_config():
    """One GPU's share: 32 routed experts of 3 FP8 [2048, 7168] matrices in each of 58 MoE layers, the
    rest whole; a step's routed reads follow the experts the 8 GPUs' tokens reach."""
    parts = sm.deployment_parts()
    expert = 3 * (2048 * 7168 + 16 * 56 * 4)                 # 16 x 56 blocks of float32 scales a matrix
    assert parts["routed_experts"] == 58 * 32 * expert
    assert parts["shared_experts"] == 58 * expert
    assert parts["dense_mlp"] == 3 * 3 * (18432 * 7168 + 144 * 56 * 4)
    assert parts["lm_head"] == parts["embedding"] == 129280 * 7168 * 2
    assert sm.deployment_held_bytes() == sum(parts.values())
    assert sm.deployment_held_bytes() / sm.GIB == pytest.approx(94.73, abs=0.01)
    assert sm.distinct_experts(1) == pytest.approx(32 * (1 - (31 / 32) ** 8))      # 7.18 of 32
    assert sm.distinct_experts(64) == pytest.approx(32, abs=1e-3)
    reads = [sm.deployment_step_bytes(b) for b in (1, 8, 32, 64)]
    assert reads == sorted(reads) and reads[-1] < sm.deployment_held_bytes() - parts["embedding"] + 1
    assert [round(r / GB, 1) for r in reads] == [36.4, 89.1, 99.8, 99.9]
    assert sm.KV_BUDGET_GIB == math.floor(sm.kv_budget_gib("H200"))
    assert sm.kv_budget_gib("H100") < 0, "an H100 cannot hold one GPU's share of the FP8 weights"


def test_the_study_model_builds_at_a_tiny_size_and_its_step_bytes_match_the_formula():
    """layers and hidden overridable: 3 dense layers then MoE, on the CPU; the bytes read off its
    tensors are the formula's, eager (the experts reached) and under graphs (every expert)."""
    study = {"_index": 0, "kind": "serving", "model": sm.STUDY_MODEL, "layers": 4, "hidden": 64}
    model = sweep.build(study, torch.device("cpu"))
    cfg = model.config
    assert cfg.mlp_layer_types == ["dense", "dense", "dense", "sparse"]
    assert (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.index_topk, cfg.vocab_size) == (128, 512, 2048, 129280)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (9, 2)
    for batch in (1, 3, 27):
        for every in (False, True):
            got = sm.model_step_bytes(model, batch, every)
            assert got == pytest.approx(sm.config_step_bytes(cfg, batch, every, elem=4), rel=1e-12)
    assert sm.model_step_bytes(model, 1) < sm.model_step_bytes(model, 1, every_expert=True)


def test_at_full_size_its_step_reads_what_one_gpu_of_the_deployment_reads():
    """On the meta device in bf16: every expert read (a CUDA-graph step) is the deployment's step at a
    large batch within 0.1%; eager, the experts reached follow its curve within 3% from b = 8 on."""
    with torch.device("meta"):
        model = build_model(config_from_dict(sm.study_config())).to(torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert held == pytest.approx(sm.deployment_held_bytes(), rel=1e-3)
    assert sm.model_step_bytes(model, 64, every_expert=True) == pytest.approx(sm.deployment_step_bytes(64), rel=1e-3)
    for batch in (8, 16, 32, 64):
        assert sm.model_step_bytes(model, batch) == pytest.approx(sm.deployment_step_bytes(batch), rel=0.03)
    assert sm.config_step_bytes(model.config, 8) == pytest.approx(sm.model_step_bytes(model, 8), rel=1e-12)


def test_the_config_validates_and_lists_its_points_on_the_cpu(tmp_path, capsys):
    config = sweep.DEFAULT_CONFIG.parent / "h200_serving_disagg.toml"
    assert sweep.main(["--config", str(config), "--out", str(tmp_path / "o"), "--dry-run"]) == 0
    assert "24 points, 0 already in" in capsys.readouterr().out
    study = sweep.tomllib.loads(config.read_text())["study"]
    sweep.validate(study)
    points = sweep.points(study[0])
    assert {p["model"] for p in points} == {sm.STUDY_MODEL}
    assert {p["mode"] for p in points} == {"resident", "hisparse", "hybrid"}
    assert {(p["layers"], p["hidden"], p["kv_budget_gib"]) for p in points} == {(61, 7168, sm.KV_BUDGET_GIB)}
    assert len({p["request_rate"] for p in points}) >= 4 and {p["range_ratio"] for p in points} == {0.5}
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("edit,message", [
    ("hidden = 7168", r"hidden = 0: expected one positive integer"),
    ("kv_budget_gib = 36", r"kv_budget_gib = -1: expected a positive"),
])
def test_bad_study_model_studies_fail_before_running(tmp_path, capsys, edit, message):
    text = textwrap.dedent(f"""
        [[study]]
        kind = "throughput"
        model = "{sm.STUDY_MODEL}"
        modes = ["resident"]
        contexts = [4096]
        hidden = 7168
        kv_budget_gib = 36
        """)
    bad = text.replace(edit, edit.split("=")[0] + ("= 0" if "hidden" in edit else "= -1"))
    path = tmp_path / "bad.toml"
    path.write_text(bad)
    assert sweep.main(["--config", str(path), "--out", str(tmp_path / "o")]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_its_kv_budget_defaults_to_what_an_h200_has_left():
    study = [{"kind": "throughput", "model": sm.STUDY_MODEL, "modes": ["resident"], "contexts": [4096]},
             {"kind": "throughput", "model": "dsa", "modes": ["resident"], "contexts": [4096]}]
    with pytest.raises(sweep.ConfigError, match="missing key 'kv_budget_gib'"):
        sweep.validate(study)                        # the other models keep it required
    sweep.validate(study[:1])
    assert study[0]["kv_budget_gib"] == sm.KV_BUDGET_GIB == 36

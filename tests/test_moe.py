"""The routed experts' two paths: sparse (eager; a host sync picks the experts in use) and every
expert on every token (inside a CUDA graph: two matrix products over the stacked weights). Same sum;
the graphed path adds the experts in float32, the sparse one in x's dtype."""
import pandas as pd
import pytest
import torch
from engine_checks import assert_bitwise

from benchmarks.bench_moe import MODES, loop_every_expert, main as bench_moe_main

from hisparse.engine import Engine
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.moe import Experts, MoE
from hisparse.models.tiny import TINY_CONFIGS, randomize_


def random_moe(seed: int = 0) -> tuple[MoE, torch.Generator]:
    """The tiny deepseek_v32's MoE with 8 routed experts in 2 groups, random float32 weights."""
    config = config_from_dict(dict(TINY_CONFIGS["deepseek_v32"], n_routed_experts=8, n_group=2))
    moe = MoE(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return moe, gen


def test_every_expert_path_equals_the_sparse_one():
    moe, gen = random_moe()
    x = torch.randn(13, moe.experts.gate_up_proj.shape[2], generator=gen)
    with torch.no_grad():
        weights, ids = moe.gate(x)
        sparse = moe.experts(x, ids, weights)
        dense = moe.experts.every_expert(x, ids, weights)
    assert ids.unique().numel() > 1, "the tokens must spread over several experts"
    # float32 products over 13 tokens or over one expert's few: rounding may differ in the last bits
    assert torch.allclose(dense, sparse, rtol=1e-5, atol=1e-5), (dense - sparse).abs().max()
    assert sparse.abs().min() > 0, "every token gets its experts' output"


def test_every_expert_in_bf16_is_the_per_expert_loop_summed_with_one_rounding():
    """bf16 as on the GPU: the batched path and the per-expert loop it replaced (bench_moe's baseline)
    agree to bf16's rounding; against a float64 reference the batched one (a float32 sum over experts,
    rounded once) is on average at least as close as the loop (rounded to bf16 after every expert)."""
    moe, gen = random_moe()
    x = torch.randn(27, moe.experts.gate_up_proj.shape[2], generator=gen)
    with torch.no_grad():
        weights, ids = moe.gate(x)
        truth = moe.experts.double().every_expert(x.double(), ids, weights.double())
        experts = moe.experts.bfloat16()
        batched = experts.every_expert(x.bfloat16(), ids, weights)
        loop = loop_every_expert(experts, x.bfloat16(), ids, weights)
    assert batched.dtype == torch.bfloat16 and batched.shape == x.shape
    scale = truth.abs().max()
    assert (batched.double() - truth).abs().max() < 0.02 * scale, "batched bf16 far from float64"
    assert torch.allclose(batched.float(), loop.float(), rtol=0.02, atol=0.02 * float(scale))
    assert (batched.double() - truth).abs().mean() <= (loop.double() - truth).abs().mean()


def test_every_expert_refuses_a_non_contiguous_weight_rather_than_copying_it():
    moe, gen = random_moe()
    x = torch.randn(3, moe.experts.gate_up_proj.shape[2], generator=gen)
    weights, ids = moe.gate(x)
    with torch.no_grad():
        # the same values held [E, H, 2I] and seen transposed: equal, but not the stacked layout
        moe.experts.gate_up_proj = torch.nn.Parameter(moe.experts.gate_up_proj.transpose(1, 2).contiguous()
                                                      .transpose(1, 2))
        with pytest.raises(ValueError, match=r"experts.gate_up_proj \(8, 64, 64\) has strides .* expected the contiguous"):
            moe.experts.every_expert(x, ids, weights)
        assert moe.experts(x, ids, weights).shape == x.shape, "the sparse path takes any layout"


def test_bench_moe_quick_run_writes_every_mode(tmp_path):
    bench_moe_main(["--quick", "--batches", "2", "--out", str(tmp_path)])
    rows = pd.read_csv(tmp_path / "moe.csv")
    assert set(rows["mode"]) == set(MODES) and (rows["batch"] == 2).all()
    assert {"us", "GBps", "weight_GB", "roofline_frac"} <= set(rows.metric)
    assert (rows.value > 0).all() and (rows.gpu == "cpu").all()
    weight = rows[rows.metric == "weight_GB"].set_index("mode").value
    assert weight["graph_batched"] == weight["graph_loop"] >= weight["eager_sparse"]


@pytest.mark.gpu
def test_moe_model_graphed_hisparse_bitwise_resident(monkeypatch):
    """Not yet run on a GPU: the MoE layers of the tiny deepseek_v32 inside the decode graph."""
    calls = []
    every_expert = Experts.every_expert
    monkeypatch.setattr(Experts, "every_expert", lambda self, *a: calls.append(1) or every_expert(self, *a))
    model = build_model(config_from_dict(dict(TINY_CONFIGS["deepseek_v32"])))
    randomize_(model, seed=0)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (40, 23)]
    k = model.config.index_topk
    eager = Engine(model, "resident").generate(prompts, 32)
    assert not calls, "eager decode takes the sparse path"
    graphed = Engine(model, "resident").generate(prompts, 32, graph=True)
    assert calls, "the captured step runs every expert"
    hier = Engine(model, "hisparse", cache_slots=k).generate(prompts, 32, graph=True)
    assert_bitwise(graphed, hier, "hisparse against resident, graphed")
    assert hier.misses > 0
    # steps 2.. replay the graph (every expert), eager runs the routed ones only: equal up to rounding
    # while the tokens agree
    same = int((graphed.tokens == eager.tokens).all(0).long().cumprod(0).sum())
    assert same > 2, "the graphed run left the eager one at once"
    for step in range(2, same):
        assert torch.allclose(graphed.logits[step], eager.logits[step], rtol=0.05, atol=0.05), step


@pytest.mark.gpu
def test_every_expert_captured_in_a_graph_at_the_study_models_shape():
    """Not yet run on a GPU: one MoE layer of dsa_v32_ep8's shape (hidden 7168, 9 experts of 2896, bf16)
    captured at an odd batch; the replay takes the batched path and matches the per-expert loop."""
    from experiments.study_model import study_config
    calls = []
    moe = MoE(config_from_dict(study_config(layers=4))).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02, generator=torch.Generator("cuda").manual_seed(0))
        x = torch.randn(27, 7168, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))
        moe(x)                                  # warm-up outside the graph (cuBLAS handles, allocator)
        every_expert = moe.experts.every_expert
        moe.experts.every_expert = lambda *a: calls.append(1) or every_expert(*a)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        weights, ids = moe.gate(x)
        loop = loop_every_expert(moe.experts, x, ids, weights) + moe.shared_experts(x)
    assert calls, "the captured layer runs the batched path"
    assert not out.isnan().any()
    scale = float(loop.abs().max())
    assert torch.allclose(out.float(), loop.float(), rtol=0.02, atol=0.02 * scale), (out - loop).abs().max()


def test_bench_moe_builds_the_study_models_moe():
    """bench_moe keeps its own copy of the study model's MoE sizes (benchmarks do not import experiments)."""
    from benchmarks import bench_moe
    from experiments import study_model
    assert (bench_moe.EXPERTS, bench_moe.EXPERTS_PER_TOKEN, bench_moe.EXPERT_INTERMEDIATE, bench_moe.STUDY_HIDDEN) == \
        (study_model.EXPERTS, study_model.EXPERTS_PER_TOKEN, study_model.EXPERT_INTERMEDIATE, study_model.V32["hidden_size"])

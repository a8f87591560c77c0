"""The decode loop on the GPU with DSA's real KV geometry (128 heads, 512 + 64 latents, k = 2048,
a 64 x 128 indexer) and a small rest (2 layers, hidden 1024, dense MLPs): resident and hisparse
give bitwise-equal logits and tokens over 64 decode steps, eager and graph-replayed, B = k and 2k."""
import collections

import pytest
import torch
from engine_checks import assert_bitwise

from hisparse import runtime
from hisparse.engine import Engine
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import randomize_

pytestmark = pytest.mark.gpu

GEOMETRY = dict(model_type="deepseek_v32", vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                moe_intermediate_size=256, num_hidden_layers=2, first_k_dense_replace=2,
                num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                qk_nope_head_dim=128, v_head_dim=128, index_topk=2048, index_head_dim=128, index_n_heads=64,
                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1)


@pytest.fixture(scope="module")
def model():
    m = build_model(config_from_dict(dict(GEOMETRY)))
    randomize_(m, seed=0)
    return m.to(device="cuda", dtype=torch.bfloat16)


def test_hisparse_bitwise_resident_eager_and_graph(model):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1024, (n,), generator=gen) for n in (4100, 6000, 2500, 8000)]
    runs = {
        "resident": Engine(model, "resident", chunk_size=1024).generate(prompts, 65),
        "resident-graph": Engine(model, "resident", chunk_size=1024).generate(prompts, 65, graph=True),
        "hisparse-B=k": Engine(model, "hisparse", cache_slots=2048, chunk_size=1024).generate(prompts, 65),
        "hisparse-B=2k-graph": Engine(model, "hisparse", cache_slots=4096, chunk_size=1024).generate(
            prompts, 65, graph=True),
        "hisparse-B=k-graph-step-writes": Engine(model, "hisparse", cache_slots=2048, chunk_size=1024,
                                                 host_write="step").generate(prompts, 65, graph=True),
        "hisparse-B=k-graph-early-resolve": Engine(model, "hisparse", cache_slots=2048, chunk_size=1024,
                                                   host_write="step", early_resolve=True).generate(
            prompts, 65, graph=True),
        "hisparse-B=k-eager-early-resolve": Engine(model, "hisparse", cache_slots=2048, chunk_size=1024,
                                                   host_write="step", early_resolve=True).generate(prompts, 65),
    }
    base = runs["resident"]
    for name, out in runs.items():
        assert_bitwise(base, out, name)
    assert runs["hisparse-B=k"].misses > 0
    # the hot slots per request do not grow with the context; the resident latents do
    assert runs["hisparse-B=k"].kv_bytes_per_request < base.kv_bytes_per_request


def count_driver_calls(monkeypatch) -> collections.Counter:
    """The CUDA driver's functions called through hisparse.cuda_driver from now on, counted by name."""
    from hisparse import cuda_driver
    driver, calls = cuda_driver.driver(), collections.Counter()

    class Spy:
        def __getattr__(self, name):
            fn = getattr(driver, name)

            def counted(*args):
                calls[name] += 1
                return fn(*args)
            return counted
    monkeypatch.setattr(cuda_driver, "driver", Spy)
    return calls


def shared_layers_model_and_prompts():
    """A 6-layer glm_moe_dsa on the GPU whose layers 1, 2 and 5 share their anchor's selection (layer 3:
    an anchor with no shared layer), and three prompts of 2100-5000 tokens."""
    types = ["full", "shared", "shared", "full", "full", "shared"]
    m = build_model(config_from_dict(dict(GEOMETRY, model_type="glm_moe_dsa", num_hidden_layers=6,
                                          first_k_dense_replace=6, indexer_types=types)))
    randomize_(m, seed=1)
    m = m.to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    return m, [torch.randint(0, 1024, (n,), generator=gen) for n in (3000, 5000, 2100)]


@pytest.mark.parametrize("priority", runtime.PREFETCH_PRIORITIES)
def test_prefetch_bitwise_with_shared_layers_graphed(priority, monkeypatch):
    """glm_moe_dsa with shared layers: prefetch on (side stream of either priority, inside the CUDA
    graph; with the host rows stored per layer or once per step, and the resolve started early on a
    stream of its own), off, and resident give bitwise-equal logits and tokens."""
    monkeypatch.setattr(runtime, "PREFETCH_PRIORITY", priority)
    m, prompts = shared_layers_model_and_prompts()
    base = Engine(m, "resident", chunk_size=1024).generate(prompts, 65, graph=True)
    runs = [(False, "layer", False), (True, "layer", False), (True, "step", False), (True, "step", True),
            (False, "step", True)]
    for prefetch, host_write, early in runs if priority == "normal" else runs[1:2]:
        out = Engine(m, "hisparse", cache_slots=2048, chunk_size=1024, prefetch=prefetch, host_write=host_write,
                     early_resolve=early).generate(prompts, 65, graph=True)
        name = f"prefetch={prefetch}, host_write={host_write}, early_resolve={early}"
        assert_bitwise(base, out, name)
        assert out.misses > 0
        assert out.prefetched_layers == (3 if prefetch else 0), "prefetch must run on the side stream"


def test_driver_capture_replays_the_same_decode_with_prefetch(monkeypatch):
    """HISPARSE_GRAPH_CAPTURE=driver's path (each decode graph captured by the driver's stream capture,
    its allocations in a MemPool of its own) gives resident's tokens and logits, with prefetch's side
    stream and an early resolve's stream joined inside the capture; and a graph that draws random
    numbers is refused (by PyTorch 2.11, whose message this does not pin: it differs across versions)."""
    from hisparse import graph_flags
    monkeypatch.setattr(graph_flags, "CAPTURE", "driver")
    m, prompts = shared_layers_model_and_prompts()
    base = Engine(m, "resident", chunk_size=1024).generate(prompts, 33)
    calls = count_driver_calls(monkeypatch)
    for prefetch, early in ((False, False), (True, False), (True, True)):
        out = Engine(m, "hisparse", cache_slots=2048, chunk_size=1024, prefetch=prefetch, host_write="step",
                     early_resolve=early).generate(prompts, 33, graph=True)
        assert_bitwise(base, out, f"prefetch={prefetch}, early_resolve={early}")
        assert out.misses > 0 and out.prefetched_layers == (3 if prefetch else 0)
    assert calls["cuStreamBeginCapture_v2"] == calls["cuGraphInstantiateWithFlags"] == 3, dict(calls)
    replay, x = graph_flags.capture(lambda: torch.ones(4, device="cuda") * 2)
    replay()
    assert torch.equal(x, torch.full((4,), 2.0, device="cuda"))
    with pytest.raises(RuntimeError):
        graph_flags.capture(lambda: torch.rand(4, device="cuda"))
    replay, y = graph_flags.capture(lambda: torch.ones(4, device="cuda") + 2)     # capturing works after it
    replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full((4,), 3.0, device="cuda"))


def test_prefetch_side_stream_priorities():
    """"high" is a stream of higher priority (a lower number) than "normal", which is CUDA's default."""
    assert runtime.side_stream("normal").priority == 0
    assert runtime.side_stream("high").priority < 0


@pytest.mark.parametrize("flags", [0, 9])
def test_graph_flags_replay_the_same_decode(model, flags, monkeypatch):
    """HISPARSE_GRAPH_FLAGS's path (the decode graph instantiated by the driver with those flags and
    replayed with cuGraphLaunch, once per step but the first, which runs eagerly) gives the eager
    decode's tokens and logits."""
    from hisparse import graph_flags
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1024, (n,), generator=gen) for n in (3000, 2100)]
    base = Engine(model, "resident", chunk_size=1024).generate(prompts, 9)
    calls = count_driver_calls(monkeypatch)
    monkeypatch.setattr(graph_flags, "FLAGS", flags)
    monkeypatch.setattr(graph_flags, "CAPTURE", "torch")
    out = Engine(model, "hisparse", cache_slots=2048, chunk_size=1024).generate(prompts, 9, graph=True)
    assert calls["cuGraphInstantiateWithFlags"] == 1 and calls["cuGraphLaunch"] >= 6, dict(calls)
    assert_bitwise(base, out, "driver-instantiated graph")

"""The decode loop on the GPU with DSA's real KV geometry (128 heads, 512 + 64 latents, k = 2048,
a 64 x 128 indexer) and a small rest (2 layers, hidden 1024, dense MLPs): resident and hisparse
give bitwise-equal logits and tokens over 64 decode steps, eager and graph-replayed, B = k and 2k;
with shared layers, prefetch on the side stream at any copy width; with either decode kernel."""
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
        "hisparse-B=k-graph": Engine(model, "hisparse", cache_slots=2048, chunk_size=1024).generate(
            prompts, 65, graph=True),
    }
    base = runs["resident"]
    for name, out in runs.items():
        assert_bitwise(base, out, name)
    assert runs["hisparse-B=k"].misses > 0
    # the hot slots per request do not grow with the context; the resident latents do
    assert runs["hisparse-B=k"].kv_bytes_per_request < base.kv_bytes_per_request


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


def test_prefetch_bitwise_with_shared_layers_graphed():
    """glm_moe_dsa with shared layers: prefetch on (the side stream inside the CUDA graph, at the
    family's copy width and at others given to the engine), off, and resident give bitwise-equal
    logits and tokens."""
    m, prompts = shared_layers_model_and_prompts()
    base = Engine(m, "resident", chunk_size=1024).generate(prompts, 65, graph=True)
    for prefetch, programs in ((False, None), (True, None), (True, 1), (True, 32)):
        engine = Engine(m, "hisparse", cache_slots=2048, chunk_size=1024, prefetch=prefetch, prefetch_programs=programs)
        assert engine.prefetch_programs == (programs or runtime.PREFETCH_PROGRAMS_PER_FAMILY["DSA"])
        out = engine.generate(prompts, 65, graph=True)
        name = f"prefetch={prefetch}, prefetch_programs={programs}"
        assert_bitwise(base, out, name)
        assert out.misses > 0
        assert out.prefetched_layers == (3 if prefetch else 0), "prefetch must run on the side stream"


@pytest.mark.parametrize("backend", ["triton", "gluon"])
def test_each_decode_backend_is_bitwise_resident_graphed(model, backend):
    """decode_backend picks the sparse MLA decode kernel for every layer: hisparse (B = k, graphed)
    gives the resident run's logits and tokens bitwise with either kernel (each against a resident
    run with the same one: the two kernels accumulate in different orders)."""
    from hisparse.dsa.ops import gluon_decode_unsupported
    cfg = model.config
    q = torch.empty(1, cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=torch.bfloat16,
                    device="cuda")
    if backend == "gluon" and gluon_decode_unsupported(q, cfg.kv_lora_rank) is not None:
        pytest.skip(f"the Gluon decode kernel cannot run here: {gluon_decode_unsupported(q, cfg.kv_lora_rank)}")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1024, (n,), generator=gen) for n in (3000, 2100)]
    base = Engine(model, "resident", chunk_size=1024, decode_backend=backend).generate(prompts, 17)
    out = Engine(model, "hisparse", cache_slots=2048, chunk_size=1024, decode_backend=backend).generate(
        prompts, 17, graph=True)
    assert_bitwise(base, out, f"decode_backend={backend}")
    assert out.misses > 0

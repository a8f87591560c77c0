"""The Quest decode loop on the GPU at a real GQA geometry (32 query heads, 8 KV heads, head dim 128,
bf16) with a small rest (4 layers: 2 dense, 2 Quest; hidden 1024): resident, hisparse and noio over
64 decode steps, eager and graph-replayed, B = k and 2k pages; hisparse gives bitwise the resident
run's logits and tokens."""
import pytest
import torch
from engine_checks import check_hisparse_against_resident_on_gpu, check_shared_selections_on_gpu

from hisparse.engine import Engine
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import randomize_

pytestmark = pytest.mark.gpu

GEOMETRY = dict(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)
BUDGET = 2048                    # tokens: k = 128 pages per KV head
K = BUDGET // 16
LENGTHS = (4100, 6000, 2500, 8000)


def quest_model(family: str, seed: int):
    m = build_model(config_from_dict(dict(GEOMETRY, model_type=family)))
    randomize_(m, seed=seed)
    return m.to(device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quest_hisparse_bitwise_resident_eager_and_graph(family):
    model = quest_model(family, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1024, (n,), generator=gen) for n in LENGTHS]

    def engine(mode, slots):
        return Engine(model, mode, cache_slots=slots, chunk_size=1024, token_budget=BUDGET)
    check_hisparse_against_resident_on_gpu(engine, prompts, K)


def test_quest_shared_selections_prefetch_bitwise_resident_graphed():
    """quest_selection_group 2 over 6 layers (2 dense; Quest layers 2-3 and 4-5 share a selection):
    the shared layers' copies in line and, with prefetch, on the side stream inside the captured graph."""
    model = build_model(config_from_dict(dict(GEOMETRY, model_type="llama", num_hidden_layers=6,
                                              quest_selection_group=2)))
    randomize_(model, seed=1)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1024, (n,), generator=gen) for n in LENGTHS]

    def engine(mode, slots, prefetch):
        return Engine(model, mode, cache_slots=slots, chunk_size=1024, token_budget=BUDGET, prefetch=prefetch)
    check_shared_selections_on_gpu(engine, prompts, K, shared_layers=2)

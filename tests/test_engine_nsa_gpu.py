"""The NSA decode loop on the GPU at the paper's sizes (compressed blocks 32 / stride 16, 16 selected
blocks of 64 tokens, a 512-token window) with a GQA geometry of 32 query heads, 4 KV heads, head
dim 128, bf16, and a small rest (2 layers, hidden 1024): resident, hisparse and noio over 64 decode
steps, eager and graph-replayed, B = k and 2k blocks; hisparse gives bitwise the resident run's
logits and tokens."""
import pytest
import torch
from engine_checks import check_hisparse_against_resident_on_gpu, check_shared_selections_on_gpu

from hisparse.engine import Engine
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import randomize_

pytestmark = pytest.mark.gpu

GEOMETRY = {"model_type": "nsa", "vocab_size": 1024, "hidden_size": 1024, "intermediate_size": 2048,
            "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
K = 16                           # num_selected_blocks (the default)
LENGTHS = (4100, 6000, 2500, 8000)


def nsa_model(seed: int):
    m = build_model(config_from_dict(GEOMETRY))
    randomize_(m, seed=seed)
    return m.to(device="cuda", dtype=torch.bfloat16)


def test_nsa_hisparse_bitwise_resident_eager_and_graph():
    model = nsa_model(seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1024, (n,), generator=gen) for n in LENGTHS]

    def engine(mode, slots):
        return Engine(model, mode, cache_slots=slots, chunk_size=1024)
    check_hisparse_against_resident_on_gpu(engine, prompts, K)


def test_nsa_shared_selection_prefetch_bitwise_resident_graphed():
    """selection_group 2 over 4 layers (layers 0-1 and 2-3 share a selection): the shared layers'
    copies in line and, with prefetch, on the side stream inside the captured graph."""
    m = build_model(config_from_dict(dict(GEOMETRY, num_hidden_layers=4, selection_group=2)))
    randomize_(m, seed=1)
    model = m.to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1024, (n,), generator=gen) for n in LENGTHS]

    def engine(mode, slots, prefetch):
        return Engine(model, mode, cache_slots=slots, chunk_size=1024, prefetch=prefetch)
    check_shared_selections_on_gpu(engine, prompts, K, shared_layers=2)

"""The decode loop for Quest models (llama, qwen3): hierarchical pages give bitwise the resident
run's logits and tokens, on tiny checkpoints through the Triton kernels (the interpreter on a CPU).

The tiny models have 3 layers: two dense (resident KV in every mode) and one Quest layer with 2 KV
heads, so 2 streams per request. A 48-token budget selects K = 3 pages per KV head; the prompts
(64 and 21 tokens) grow to 88 and 45 tokens over 24 decode steps, so pages are really selected,
evicted and fetched again (at B = k more fetches than pages: 21 of 18 for llama), a page opens at
the first step, and the short request selects fewer than K pages for a while (padding, to step 11)."""
import functools

import pytest
import torch
from engine_checks import (
    assert_bitwise,
    assert_newest_units_written_through,
    assert_noio_wrote_only_shared_newest_units,
    assert_prefetch_in_line,
    assert_torch_steps_agree,
    assert_unit_run,
    check_hisparse_against_resident_on_gpu,
    check_shared_selections_on_gpu,
    check_traces_replay_exactly,
    lockstep_after_every_step,
    prefetch_settings,
)

from hisparse.engine import Engine
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model, load_model
from hisparse.models.tiny import randomize_, write_tiny_checkpoint
from hisparse.quest.ops import PAGE
from hisparse.quest.reference import PagedKV, TorchQuestAttention
from hisparse.quest.runtime import HierQuestKV, QuestKV, new_cache
from hisparse.synthetic import SyntheticConfig, split_kv_heads
from hisparse.synthetic import generate as generate_trace
from hisparse.traces import Trace

PROMPT_LENGTHS = (64, 21)
BUDGET = 48                      # tokens: K = 3 pages per KV head
K = BUDGET // PAGE
STEPS = 25                       # new tokens: the prefill's token, then 24 decode steps
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """tiny_model(family, **overrides): a tiny checkpoint (seed 3, config keys overridable) written
    under pytest's temporary folder and loaded, once per module and arguments."""
    @functools.cache
    def load(family: str, **overrides):
        path = write_tiny_checkpoint(family, tmp_path_factory.mktemp(family), seed=3, **overrides)
        return load_model(path, dtype=torch.float32, device=DEVICE)
    return load


def prompts(seed=0, vocab=97):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in PROMPT_LENGTHS]


# llama and qwen3 differ in their projections alone (qwen3 normalises q and k; checked against
# transformers in tests/test_models.py): the cache and the kernels take the same path in both, so each
# family runs one B, and both B run. At B = 2k (6 slots) no page is evicted, over 24 steps (the pages
# reach 6 and 3) as over 12: it runs 12, to 76 and 33 tokens (the short request pads to step 11 and
# opens a page at step 12)
RUNS = {"llama": (1, STEPS), "qwen3": (2, 13)}          # family: (B / k, new tokens)


@pytest.fixture(scope="module")
def resident_run(tiny_model):
    """resident_run(family): the family's resident run of its RUNS new tokens, once per module."""
    @functools.cache
    def run(family: str):
        return Engine(tiny_model(family), "resident", token_budget=BUDGET).generate(prompts(), RUNS[family][1])
    return run


@pytest.mark.parametrize("family", list(RUNS), ids=["llama-B=k", "qwen3-B=2k"])
def test_hisparse_is_bitwise_resident(tiny_model, resident_run, family):
    (slots_per_k, steps), model, base = RUNS[family], tiny_model(family), resident_run(family)
    engine = Engine(model, "hisparse", cache_slots=slots_per_k * K, token_budget=BUDGET)
    out = engine.generate(prompts(), steps)
    assert_unit_run(engine, base, out, PROMPT_LENGTHS, steps, PAGE, heavy_eviction=slots_per_k == 1)


def test_dense_layers_stay_resident_and_noio_copies_nothing(tiny_model):
    model = tiny_model("llama")
    noio = Engine(model, "noio", cache_slots=K, token_budget=BUDGET)
    out = noio.generate(prompts(), new_tokens=2)           # one decode step: the same selection
    first = Engine(model, "hisparse", cache_slots=K, token_budget=BUDGET)
    ref = first.generate(prompts(), new_tokens=2)
    assert (out.hits, out.misses) == (ref.hits, ref.misses) and out.misses > 0
    assert noio.cache.slots[:, :-1].abs().sum() == 0, "no-IO must fetch no row"
    assert first.cache.slots[:, :-1].abs().sum() > 0
    # one stream per (request, Quest layer, KV head); the two dense layers are not in the cache
    assert first.cache.max_streams == len(PROMPT_LENGTHS) * 1 * model.config.num_key_value_heads
    capacity = max(PROMPT_LENGTHS) + 2
    first.cache = new_cache(model, len(PROMPT_LENGTHS), capacity, K)
    state, _ = first._prefill(prompts(), capacity)
    assert [type(kv) for kv in state.layers] == [PagedKV, PagedKV, HierQuestKV]
    resident, _ = Engine(model, "resident", token_budget=BUDGET)._prefill(prompts(), capacity)
    assert [type(kv) for kv in resident.layers] == [PagedKV, PagedKV, QuestKV]
    assert torch.equal(state.layers[2].kmin, resident.layers[2].kmin)        # bounds stay resident


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kernel_step_agrees_with_the_torch_quest_step(tiny_model, resident_run, family, monkeypatch):
    """The kernels' decode step against the model's torch Quest step (hisparse.quest.reference)."""
    model, ours = tiny_model(family), resident_run(family)
    steps = 8
    monkeypatch.setattr(model, "sparse_attention", TorchQuestAttention(BUDGET))    # restored after the test
    capacity = max(PROMPT_LENGTHS) + steps
    assert_torch_steps_agree(model, ours, prompts(), capacity, steps, DEVICE)


def test_random_prefill_runs(tiny_model):
    out = Engine(tiny_model("qwen3"), "hisparse", cache_slots=K, token_budget=BUDGET,
                 prefill="random").generate(prompts(), new_tokens=3)
    assert out.tokens.shape == (2, 3) and out.misses > 0


def test_bad_inputs_are_refused(tiny_model):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=rf"cache_slots B={K - 1} is smaller than the selection size k={K} "
                                         r"\(token_budget // 16 pages\)"):
        Engine(model, "hisparse", cache_slots=K - 1, token_budget=BUDGET)
    with pytest.raises(ValueError, match="needs cache_slots"):
        Engine(model, "hisparse", token_budget=BUDGET)
    with pytest.raises(ValueError, match="token_budget 8 is under one page"):
        Engine(model, "resident", token_budget=8)
    with pytest.raises(ValueError, match="this Quest model .* has none"):
        Engine(model, "hisparse", cache_slots=K, token_budget=BUDGET, prefetch=True)
    with pytest.raises(ValueError, match=r"decode_backend='gluon' picks DSA's sparse MLA decode kernel; this "
                                         r"Quest model \(QuestModel\) has none"):
        Engine(model, "hisparse", cache_slots=K, token_budget=BUDGET, decode_backend="gluon")
    with pytest.raises(ValueError, match=r"prefetch_programs must be an int >= 1 .*, got 0"):
        Engine(model, "hisparse", cache_slots=K, token_budget=BUDGET, prefetch_programs=0)
    engine = Engine(model, "hisparse", cache_slots=K, token_budget=BUDGET)
    paged_in_blocks = generate_trace(SyntheticConfig(context=256, steps=4, k=K, layers=3, batch=4, sinks=1, window=1,
                                                     random_layers=0, unit_size=64))
    with pytest.raises(ValueError, match=r"does not fit this run: expected \{.*'unit_size': 16\}, got \{.*"
                                         r"'unit_size': 64\}"):
        engine.generate([torch.arange(64) % 97] * 2, 3, replay=split_kv_heads(paged_in_blocks, 2))
    assert engine.cache is None
    with pytest.raises(ValueError, match="token_budget applies to Quest models"):
        Engine(tiny_model("deepseek_v32"), "resident", token_budget=BUDGET)
    dense = tiny_model("llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match="no Quest layer"):
        Engine(dense, "hisparse", cache_slots=K, token_budget=BUDGET).generate(prompts(), 2)


@pytest.fixture(scope="module")
def shared_model(tiny_model):
    """shared_model(group=2): 5 layers: two dense, then Quest layers 2 and 3 attending over layer 2's
    selection, and layer 4 alone (quest_selection_group 2); the same weights as group 1, where each
    selects its own."""
    return lambda group=2: tiny_model("llama", num_hidden_layers=5, quest_selection_group=group)


def shared_to_anchor(model) -> dict[int, int]:
    """The shared layer 3's streams -> layer 2's, in the same (request, KV head) order: the engine
    opens the Quest layers' streams layer by layer (layers 2, 3, 4)."""
    per_layer = len(PROMPT_LENGTHS) * model.config.num_key_value_heads
    return {per_layer + j: j for j in range(per_layer)}


def test_shared_selections_are_bitwise_resident_in_lockstep_with_the_anchor(shared_model):
    """quest_selection_group 2: layer 3 attends over layer 2's pages with no resolve of its own,
    replaying layer 2's miss plan (in line, and through the prefetch path, which on a CPU is in line
    too, so there only briefly); bitwise the resident run, the shared layer's slots in lockstep with its anchor's.
    17 decode steps: the long prompt opens a page at the first and at the last (positions 64 and 80), the
    short one selects fewer than K pages (padding) to step 11 and opens a page at step 12 (position 32).
    In line, the lockstep is checked after every step, B = k: victim slots are reused (more misses than
    pages), so a shared layer's copies must follow every eviction of its anchor's."""
    model, new_tokens = shared_model(), 18
    assert [model.config.selection_anchor(i) for i in range(5)] == [0, 1, 2, 2, 4]
    base = Engine(model, "resident", token_budget=BUDGET).generate(prompts(), new_tokens)
    own = Engine(shared_model(1), "resident", token_budget=BUDGET).generate(prompts(), 2)   # prefill (dense), 1 step
    assert not torch.equal(own.logits[1], base.logits[1]), "sharing the selection must change the model"
    heads = model.config.num_key_value_heads
    for prefetch in prefetch_settings(DEVICE):
        engine = Engine(model, "hisparse", cache_slots=K, token_budget=BUDGET, prefetch=prefetch)
        if prefetch:
            out = engine.generate(prompts(), new_tokens)
        else:
            with lockstep_after_every_step(model, engine) as checked:
                out = engine.generate(prompts(), new_tokens)
            anchor_streams = checked[0].layers[2].streams.view(-1).long()
            pages = sum(engine.cache.stream_len[s] for s in anchor_streams.tolist())
            assert int(engine.cache.stats[anchor_streams, 1].sum()) > pages, "slots were reused: pages fetched again"
        assert_bitwise(base, out, f"prefetch={prefetch}")
        assert_newest_units_written_through(engine.cache, shared_to_anchor(model))
        # the shared layer's streams do no resolve work, and count their anchor's hits and misses
        per_layer = engine.cache.stats.cpu().view(3, len(PROMPT_LENGTHS), heads, 2)   # streams open layer by layer
        assert (per_layer[1] == 0).all() and (per_layer[[0, 2]].sum(-1) > 0).all()
        anchor, alone = per_layer[0].sum((0, 1)), per_layer[2].sum((0, 1))
        assert (out.hits, out.misses) == (int(2 * anchor[0] + alone[0]), int(2 * anchor[1] + alone[1]))
    if DEVICE == "cpu":
        assert_prefetch_in_line(Engine(model, "hisparse", cache_slots=K, token_budget=BUDGET, prefetch=True),
                                Engine(model, "resident", token_budget=BUDGET), prompts())
    capacity = max(PROMPT_LENGTHS) + new_tokens
    engine.cache = None
    engine.cache = engine.runtime.new_cache(len(PROMPT_LENGTHS), capacity, K)
    state, _ = engine._prefill(prompts(), capacity)
    assert (state.layers[3].anchor_layer, state.layers[4].anchor_layer) == (2, None)
    assert torch.equal(state.layers[3].anchor_streams, state.layers[2].streams)
    assert state.layers[3].kmin is None and state.layers[2].kmin is not None, "a shared layer keeps no bounds"


def test_shared_selections_noio_copies_nothing(shared_model):
    model = shared_model()
    noio = Engine(model, "noio", cache_slots=K, token_budget=BUDGET)
    out = noio.generate(prompts(), new_tokens=2)
    ref = Engine(model, "hisparse", cache_slots=K, token_budget=BUDGET).generate(prompts(), new_tokens=2)
    assert (out.hits, out.misses) == (ref.hits, ref.misses) and out.misses > 0
    assert_noio_wrote_only_shared_newest_units(noio.cache, shared_to_anchor(model))


def test_bad_selection_group_is_refused(tmp_path):
    with pytest.raises(ValueError, match="config quest_selection_group must be a positive int, found 0"):
        write_tiny_checkpoint("llama", tmp_path, quest_selection_group=0)


def test_traces_record_and_replay_per_kv_head(tiny_model, tmp_path):
    """Quest selections recorded per (request, layer, KV head) replay bitwise (the dense layers'
    rows are -1); a synthetic trace drives hisparse as it drives resident, with the LRU simulator's
    misses (two 64-token prompts, B = k)."""
    model = tiny_model("llama")
    cfg, dense = model.config, model.config.quest_dense_layers
    lengths, new_tokens = (64, 64), 9
    synthetic = split_kv_heads(generate_trace(SyntheticConfig(
        context=lengths[0], steps=new_tokens - 1, k=K, layers=cfg.num_hidden_layers,
        batch=len(lengths) * cfg.num_key_value_heads, sinks=1, window=1, random_layers=0, noise=1.0,
        unit_size=PAGE)), cfg.num_key_value_heads)
    synthetic.selections[:, :dense] = -1           # dense layers select nothing
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in lengths]
    check_traces_replay_exactly(model, prompts, new_tokens, K, tmp_path, synthetic, token_budget=BUDGET)
    on_dense = Trace(synthetic.selections.copy(), "synthetic", PAGE, synthetic.context, synthetic.layer_anchor)
    on_dense.selections[:, 0] = synthetic.selections[:, dense]           # a dense layer that selects
    engine = Engine(model, "hisparse", cache_slots=K, token_budget=BUDGET)
    with pytest.raises(ValueError, match=rf"selects units on layers 0..{dense - 1}, which this model keeps dense"):
        engine.generate(prompts, new_tokens, replay=on_dense)
    assert engine.cache is None


# -- on a GPU --------------------------------------------------------------------------------------
# The Quest decode loop on the GPU at a real GQA geometry (32 query heads, 8 KV heads, head dim 128,
# bf16) with a small rest (4 layers: 2 dense, 2 Quest; hidden 1024): resident, hisparse and noio over
# 64 decode steps, eager and graph-replayed, B = k and 2k pages; hisparse gives bitwise the resident
# run's logits and tokens.

GEOMETRY = dict(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)
GPU_BUDGET = 2048                    # tokens: k = 128 pages per KV head
GPU_K = GPU_BUDGET // 16
LENGTHS = (4100, 6000, 2500, 8000)


def quest_model(family: str, seed: int):
    m = build_model(config_from_dict(dict(GEOMETRY, model_type=family)))
    randomize_(m, seed=seed)
    return m.to(device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quest_hisparse_bitwise_resident_eager_and_graph(family):
    model = quest_model(family, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1024, (n,), generator=gen) for n in LENGTHS]

    def engine(mode, slots):
        return Engine(model, mode, cache_slots=slots, chunk_size=1024, token_budget=GPU_BUDGET)
    check_hisparse_against_resident_on_gpu(engine, prompts, GPU_K)


@pytest.mark.gpu
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
        return Engine(model, mode, cache_slots=slots, chunk_size=1024, token_budget=GPU_BUDGET, prefetch=prefetch)
    check_shared_selections_on_gpu(engine, prompts, GPU_K, shared_layers=2)

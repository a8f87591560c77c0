"""The decode loop for NSA models: hierarchical selection blocks give bitwise the resident run's
logits and tokens, on a tiny checkpoint through the Triton kernels (the interpreter on a CPU).

The tiny model has one NSA layer with 2 KV heads (2 streams per request), the kernels' block sizes
(compressed 32 / stride 16, selection blocks of 64), 4 selected blocks per KV head and a 64-token
window (short, to keep interpreter runs fast). The long prompt (508 tokens, 8 blocks, 9 at the end)
leaves a real choice besides the forced blocks (0 and the two newest), so blocks are evicted and
fetched again at B = k; it opens a block at position 512, at the 5th decode step (so within the
shared-selection runs' steps too, with steps after it). The short one (31 tokens) starts with no
compressed block and one selection block (the selection is padded with -1) and completes its first
compressed block (at 32 tokens, the first of the 9 decode steps; compressing each newest block as
the tokens come is tests/test_nsa.py's test_compress_newest_from_ring_matches_full_compression, over
three of them).

The prompt's KV comes from the eager reference prefill (prefill="reference"; random KV in
test_random_prefill_runs): the subject here is the decode loop, and the prefill is one for every
mode, as the Engine's default one through the kernels is, which in the interpreter took half of each
run and most of this file's time (some 30x the reference's at 508 tokens). The kernel prefill is
checked against the reference, selection groups included, and with hisparse decoding after it, in
tests/test_prefill.py."""
import functools

import numpy as np
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
from hisparse.nsa.ops import SEL_BLOCK
from hisparse.nsa.reference import TorchNsaAttention
from hisparse.nsa.runtime import HierNsaKV, NsaBlocksKV
from hisparse.synthetic import SyntheticConfig, split_kv_heads
from hisparse.synthetic import generate as generate_trace
from hisparse.traces import Trace

PROMPT_LENGTHS = (508, 31)
N_SELECT = 4                     # k: selection blocks per KV head and step
TINY = {"num_hidden_layers": 1, "num_selected_blocks": N_SELECT, "sliding_window": 64}
STEPS = 10                       # new tokens: the prefill's token, then 9 decode steps (to 517 and 40 tokens)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PREFILL = "reference"            # every run's prefill (the module docstring)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """tiny_model(**overrides): the tiny NSA checkpoint (TINY, keys overridable), written under pytest's
    temporary folder and loaded once per module."""
    @functools.cache
    def load(**overrides):
        path = write_tiny_checkpoint("nsa", tmp_path_factory.mktemp("nsa"), seed=3, **dict(TINY, **overrides))
        return load_model(path, dtype=torch.float32, device=DEVICE)
    return load


def prompts(seed=0, vocab=97):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def resident_run(tiny_model):
    return Engine(tiny_model(), "resident", prefill=PREFILL).generate(prompts(), STEPS)


def test_hisparse_is_bitwise_resident(tiny_model, resident_run):
    """B = k over the 9 decode steps (blocks evicted and fetched again); B = 2k over 2 (slots past k,
    the reserved slot after them, hits on the second step): the LRU at B = 2k over many steps is the
    resolve's, the same for every family (tests/test_resolve.py, the DSA and Quest engine tests)."""
    model = tiny_model()
    engine = Engine(model, "hisparse", cache_slots=N_SELECT, prefill=PREFILL)
    out = engine.generate(prompts(), STEPS)
    assert_unit_run(engine, resident_run, out, PROMPT_LENGTHS, STEPS, SEL_BLOCK, heavy_eviction=True)
    wide = Engine(model, "hisparse", cache_slots=2 * N_SELECT, prefill=PREFILL)
    out = wide.generate(prompts(), 3)
    base = Engine(model, "resident", prefill=PREFILL).generate(prompts(), 3)
    assert_unit_run(wide, base, out, PROMPT_LENGTHS, 3, SEL_BLOCK, heavy_eviction=False)


def test_noio_resolves_the_same_but_copies_nothing_and_the_rest_stays_resident(tiny_model):
    model = tiny_model()
    noio = Engine(model, "noio", cache_slots=N_SELECT, prefill=PREFILL)
    out = noio.generate(prompts(), new_tokens=2)           # one decode step: the same selection
    first = Engine(model, "hisparse", cache_slots=N_SELECT, prefill=PREFILL)
    ref = first.generate(prompts(), new_tokens=2)
    assert (out.hits, out.misses) == (ref.hits, ref.misses) and out.misses > 0
    assert noio.cache.slots[:, :-1].abs().sum() == 0, "no-IO must fetch no row"
    assert first.cache.slots[:, :-1].abs().sum() > 0
    assert first.cache.max_streams == len(PROMPT_LENGTHS) * model.config.num_key_value_heads
    capacity = max(PROMPT_LENGTHS) + 2
    first.cache = first.runtime.new_cache(len(PROMPT_LENGTHS), capacity, N_SELECT)
    hier, _ = first._prefill(prompts(), capacity)
    resident, _ = Engine(model, "resident", prefill=PREFILL)._prefill(prompts(), capacity)
    assert [type(kv) for kv in hier.layers] == [HierNsaKV] and [type(kv) for kv in resident.layers] == [NsaBlocksKV]
    for name in ("window_keys", "window_values", "compressed_keys", "compressed_values"):
        assert torch.equal(getattr(hier.layers[0], name), getattr(resident.layers[0], name)), name
    assert hier.layers[0].pool is None
    resident_bytes = Engine(model, "resident", prefill=PREFILL).generate(prompts(), 2).kv_bytes_per_request
    assert out.kv_bytes_per_request < resident_bytes


def test_kernel_step_agrees_with_the_torch_nsa_step(tiny_model, resident_run, monkeypatch):
    """The kernels' decode step against the model's torch NSA step (hisparse.nsa.reference)."""
    model, ours = tiny_model(), resident_run
    steps = 8
    monkeypatch.setattr(model, "sparse_attention", TorchNsaAttention(model.config))    # restored after the test
    capacity = max(PROMPT_LENGTHS) + STEPS                 # the engine's: the same selection blocks
    assert_torch_steps_agree(model, ours, prompts(), capacity, steps, DEVICE, fast=False)


SHARED_STEPS = 8               # new tokens of the shared-selection runs (two layers: twice the work per step);
                               # the 5th step's input, at position 512, opens a block; two steps follow


def shared_to_anchor(model) -> dict[int, int]:
    """Layer 1's streams -> layer 0's, in the same (request, KV head) order (streams open layer by layer)."""
    per_layer = len(PROMPT_LENGTHS) * model.config.num_key_value_heads
    return {per_layer + j: j for j in range(per_layer)}


def test_shared_selection_is_bitwise_resident_in_lockstep_with_the_anchor(tiny_model, monkeypatch):
    """selection_group 2 over 2 layers: layer 1 attends over layer 0's blocks (with its own compressed
    and window branches) and replays layer 0's miss plan, in line and through the prefetch path (in
    line too on a CPU, so there only briefly); bitwise the resident run; the shared streams do no
    resolve work. In line at B = k (slots reused: blocks fetched again), after every step each slot of
    layer 1's streams holds its own row of the block layer 0's slot holds; and the kernels' shared
    step agrees with the torch reference's."""
    model = tiny_model(num_hidden_layers=2, selection_group=2)
    base = Engine(model, "resident", prefill=PREFILL).generate(prompts(), SHARED_STEPS)
    own = Engine(tiny_model(num_hidden_layers=2), "resident", prefill=PREFILL).generate(prompts(), 1)  # prefill logits
    assert not torch.equal(own.logits[0], base.logits[0]), "sharing the selection must change the model"
    heads = model.config.num_key_value_heads
    for prefetch in prefetch_settings(DEVICE):
        engine = Engine(model, "hisparse", cache_slots=N_SELECT, prefetch=prefetch, prefill=PREFILL)
        if prefetch:
            out = engine.generate(prompts(), SHARED_STEPS)
        else:
            with lockstep_after_every_step(model, engine) as checked:
                out = in_line = engine.generate(prompts(), SHARED_STEPS)
            [state] = checked
            assert (state.layers[1].anchor_layer, state.layers[0].anchor_layer) == (0, None)
            anchor_streams = state.layers[0].streams.view(-1).long()
            blocks = sum(engine.cache.stream_len[s] for s in anchor_streams.tolist())
            assert int(engine.cache.stats[anchor_streams, 1].sum()) > blocks, "slots were reused: blocks fetched again"
        assert_bitwise(base, out, f"prefetch={prefetch}")
        assert_newest_units_written_through(engine.cache, shared_to_anchor(model))
        per_layer = engine.cache.stats.cpu().view(2, len(PROMPT_LENGTHS), heads, 2)
        assert (per_layer[1] == 0).all() and (per_layer[0].sum(-1) > 0).all()
        assert (out.hits, out.misses) == tuple(int(x) for x in 2 * per_layer[0].sum((0, 1)))
    if DEVICE == "cpu":
        assert_prefetch_in_line(Engine(model, "hisparse", cache_slots=N_SELECT, prefetch=True, prefill=PREFILL),
                                Engine(model, "resident", prefill=PREFILL), prompts())
    monkeypatch.setattr(model, "sparse_attention", TorchNsaAttention(model.config))    # restored after the test
    capacity = max(PROMPT_LENGTHS) + SHARED_STEPS            # the engine's
    assert_torch_steps_agree(model, in_line, prompts(), capacity, SHARED_STEPS, DEVICE, fast=False)


def test_shared_selection_noio_copies_nothing(tiny_model):
    model = tiny_model(num_hidden_layers=2, selection_group=2)
    noio = Engine(model, "noio", cache_slots=N_SELECT, prefill=PREFILL)
    out = noio.generate(prompts(), new_tokens=2)
    ref = Engine(model, "hisparse", cache_slots=N_SELECT, prefill=PREFILL).generate(prompts(), new_tokens=2)
    assert (out.hits, out.misses) == (ref.hits, ref.misses) and out.misses > 0
    assert_noio_wrote_only_shared_newest_units(noio.cache, shared_to_anchor(model))


def test_random_prefill_runs(tiny_model):
    out = Engine(tiny_model(), "hisparse", cache_slots=N_SELECT, prefill="random").generate(prompts(), 3)
    assert out.tokens.shape == (2, 3) and out.misses > 0


def test_bad_inputs_are_refused_before_anything_is_built(tiny_model):
    model = tiny_model()
    with pytest.raises(ValueError, match=rf"cache_slots B={N_SELECT - 1} is smaller than the selection size "
                                         rf"k={N_SELECT} \(num_selected_blocks\)"):
        Engine(model, "hisparse", cache_slots=N_SELECT - 1)
    with pytest.raises(ValueError, match="needs cache_slots"):
        Engine(model, "noio")
    with pytest.raises(ValueError, match="token_budget applies to Quest models; an NSA model"):
        Engine(model, "resident", token_budget=64)
    with pytest.raises(ValueError, match="this NSA model .* has none"):
        Engine(model, "hisparse", cache_slots=N_SELECT, prefetch=True)
    with pytest.raises(ValueError, match=r"decode_backend='triton' picks DSA's sparse MLA decode kernel; this "
                                         r"NSA model \(NsaModel\) has none"):
        Engine(model, "resident", decode_backend="triton")
    with pytest.raises(ValueError, match=r"prefetch_programs must be an int >= 1 .*, got 2\.5"):
        Engine(model, "hisparse", cache_slots=N_SELECT, prefetch_programs=2.5)
    engine = Engine(model, "hisparse", cache_slots=N_SELECT)
    dsa_shaped = generate_trace(SyntheticConfig(context=450, steps=4, k=N_SELECT, layers=1, batch=2, sinks=1,
                                                window=2, random_layers=0, unit_size=SEL_BLOCK))
    with pytest.raises(ValueError, match=r"does not fit this run: expected \{.*'kv_heads': 2, .*got \{.*"
                                         r"'kv_heads': None"):
        engine.generate([torch.arange(450) % 97] * 2, 3, replay=dsa_shaped)
    assert engine.cache is None
    with pytest.raises(ValueError, match="built for selection_block_size 64, the model's is 32"):
        Engine(tiny_model(selection_block_size=32), "resident")
    with pytest.raises(ValueError, match="sliding_window must be >= 32, the model's is 16"):
        Engine(tiny_model(sliding_window=16), "resident")
    with pytest.raises(ValueError, match="config selection_group must be a positive int, found 0"):
        tiny_model(selection_group=0)


def test_traces_record_and_replay_per_kv_head(tiny_model, tmp_path):
    """NSA selections recorded per (request, layer, KV head) replay bitwise; a synthetic trace drives
    hisparse as it drives resident, with the LRU simulator's misses (two 450-token prompts, B = k)."""
    model, heads = tiny_model(), tiny_model().config.num_key_value_heads
    lengths, new_tokens = (450, 450), 5
    synthetic = split_kv_heads(generate_trace(SyntheticConfig(
        context=lengths[0], steps=new_tokens - 1, k=N_SELECT, layers=1, batch=len(lengths) * heads, sinks=1,
        window=2, random_layers=0, noise=1.0, unit_size=SEL_BLOCK)), heads)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in lengths]
    a = check_traces_replay_exactly(model, prompts, new_tokens, N_SELECT, tmp_path, synthetic,  # hisparse, B = k
                                    prefill=PREFILL)
    # a trace held in another memory order replays the same (the kernels take contiguous selections)
    fortran = Trace(np.asfortranarray(synthetic.selections), "synthetic", SEL_BLOCK, synthetic.context,
                    synthetic.layer_anchor)
    assert not synthetic.selections.flags.f_contiguous and fortran.selections.flags.f_contiguous
    b = Engine(model, "hisparse", cache_slots=N_SELECT, prefill=PREFILL).generate(prompts, new_tokens, replay=fortran)
    assert_bitwise(a, b, "a Fortran-ordered trace")


# -- on a GPU --------------------------------------------------------------------------------------
# The NSA decode loop on the GPU at the paper's sizes (compressed blocks 32 / stride 16, 16 selected
# blocks of 64 tokens, a 512-token window) with a GQA geometry of 32 query heads, 4 KV heads, head
# dim 128, bf16, and a small rest (2 layers, hidden 1024): resident, hisparse and noio over 64 decode
# steps, eager and graph-replayed, B = k and 2k blocks; hisparse gives bitwise the resident run's
# logits and tokens.

GEOMETRY = {"model_type": "nsa", "vocab_size": 1024, "hidden_size": 1024, "intermediate_size": 2048,
            "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
K = 16                           # num_selected_blocks (the default)
LENGTHS = (4100, 6000, 2500, 8000)


def nsa_model(seed: int):
    m = build_model(config_from_dict(GEOMETRY))
    randomize_(m, seed=seed)
    return m.to(device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
def test_nsa_hisparse_bitwise_resident_eager_and_graph():
    model = nsa_model(seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1024, (n,), generator=gen) for n in LENGTHS]

    def engine(mode, slots):
        return Engine(model, mode, cache_slots=slots, chunk_size=1024)
    check_hisparse_against_resident_on_gpu(engine, prompts, K)


@pytest.mark.gpu
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

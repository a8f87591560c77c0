"""The decode loop: hierarchical KV gives bitwise the resident run's logits and tokens, on tiny
checkpoints through the Triton kernels (the interpreter on a CPU).

The prompt's KV: test_hisparse_is_bitwise_resident's runs and the decode-backend test take it from the
Engine's default prefill, the model's kernels (prefill="model"); the other tests, whose subject is the
decode loop and the Engine's bookkeeping, from the eager reference prefill (prefill="reference": one
prefill for every mode, as the kernel one is, and some 100x cheaper in the interpreter). The kernel
prefill is checked against the reference, and with hisparse decoding after it, in tests/test_prefill.py."""
import functools
import re

import numpy as np
import pytest
import torch
from engine_checks import assert_bitwise, tiny_loader

from hisparse import runtime
from hisparse.dsa.reference import TorchDsaAttention
from hisparse.engine import Engine, check_prompts
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import randomize_
from hisparse.policies import simulate_trace
from hisparse.resolve import MAX_K, MAX_SLOTS
from hisparse.synthetic import SyntheticConfig
from hisparse.synthetic import generate as generate_trace
from hisparse.traces import load_trace, with_anchors

PROMPT_LENGTHS = (27, 5)   # requests of different lengths, one shorter than k (few: the interpreter is slow)
NEW_TOKENS = 21            # the long runs': the prefill's token, then 20 decode steps


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PREFILL = "reference"      # the prefill of the tests but the main bitwise and decode-backend ones (the docstring)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """tiny_model(family): the family's tiny checkpoint, loaded once per module."""
    return tiny_loader(tmp_path_factory, DEVICE)


@pytest.fixture(scope="module")
def resident_run(tiny_model):
    """resident_run(family): the resident run the long hisparse runs are compared against."""
    @functools.cache
    def run(family: str):
        return Engine(tiny_model(family), "resident").generate(prompts(), new_tokens=NEW_TOKENS)
    return run


@pytest.fixture(params=["deepseek_v32", "glm_moe_dsa"])
def model(request, tiny_model):
    return tiny_model(request.param)


def prompts(seed=0, vocab=97):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("family,slots_per_k", [("deepseek_v32", 1), ("deepseek_v32", 2), ("glm_moe_dsa", 1)],
                         ids=["dsv32-B=k", "dsv32-B=2k", "glm-B=k"])
def test_hisparse_is_bitwise_resident(tiny_model, resident_run, family, slots_per_k):
    """20 decode steps; glm_moe_dsa has a shared layer replaying its anchor's miss plan (in line;
    on a side stream with prefetch, which needs a GPU: the tests marked gpu below)."""
    model, resident = tiny_model(family), resident_run(family)
    k = model.config.index_topk
    out = Engine(model, "hisparse", cache_slots=slots_per_k * k).generate(prompts(), new_tokens=NEW_TOKENS)
    assert len(out.logits) == NEW_TOKENS
    assert_bitwise(resident, out, f"{family}, B = {slots_per_k}k")
    assert out.misses > 0 and out.hits > 0
    if slots_per_k == 1:
        assert out.miss_rate > 0.2, "B = k must evict heavily"


def test_noio_resolves_the_same_but_copies_nothing(model):
    k = model.config.index_topk
    noio = Engine(model, "noio", cache_slots=k, prefill=PREFILL)
    out = noio.generate(prompts(), new_tokens=2)    # one decode step: the selection is the same
    first = Engine(model, "hisparse", cache_slots=k, prefill=PREFILL).generate(prompts(), new_tokens=2)
    assert (out.hits, out.misses) == (first.hits, first.misses)
    # streams open layer by layer; a shared layer's write-through of its newest row is no fetch
    batch = len(PROMPT_LENGTHS)
    anchor_streams = [i * batch + b for i, a in enumerate(noio.anchors) if a == i for b in range(batch)]
    assert noio.cache.slots[anchor_streams, :-1].abs().sum() == 0, "no-IO must fetch no row"


def test_kernel_step_agrees_with_the_torch_reference_step(model, monkeypatch):
    """The kernels' decode step against the model's torch step (transformers' semantics)."""
    engine = Engine(model, "resident", prefill=PREFILL)
    ours = engine.generate(prompts(), new_tokens=6)
    monkeypatch.setattr(model, "sparse_attention", TorchDsaAttention())    # restored after the test
    state, _ = engine._prefill([p.to(model.model.embed_tokens.weight.device) for p in prompts()],
                               capacity=max(PROMPT_LENGTHS) + 6)
    tokens = ours.tokens[:, 0].to(state.lengths.device)
    for step in range(1, 6):
        logits = model.decode(tokens, state).float().cpu()
        err = (logits - ours.logits[step]).norm() / ours.logits[step].norm()
        assert err < 1e-4, f"step {step}: relative error {err:.2e}"
        tokens = ours.tokens[:, step].to(state.lengths.device)


def test_warmup_steps_are_left_out_of_the_timing_and_the_tokens_are_the_same(model):
    base = Engine(model, "resident", prefill=PREFILL).generate(prompts(), new_tokens=6, keep_logits=False)
    warm = Engine(model, "resident", prefill=PREFILL).generate(prompts(), new_tokens=6, keep_logits=False,
                                                               warmup_steps=3)
    assert torch.equal(base.tokens, warm.tokens)
    assert (base.timed_steps, warm.timed_steps) == (4, 2)     # steps 2..5 and 4..5 of 1..5
    assert len(warm.step_ms) == 2 and all(ms > 0 for ms in warm.step_ms)
    assert sum(warm.step_ms) <= warm.decode_s * 1e3
    # the step's call lies inside its marks (on a CPU the step runs in the call)
    assert len(warm.launch_ms) == 2 and all(0 < launch <= ms for launch, ms in zip(warm.launch_ms, warm.step_ms))
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 1 .* got 0"):
        Engine(model, "resident", prefill=PREFILL).generate(prompts(), new_tokens=6, warmup_steps=0)


def test_bad_inputs_are_refused_before_any_state(model, monkeypatch):
    k = model.config.index_topk
    with pytest.raises(ValueError, match=rf"cache_slots B={k - 1} is smaller than the selection size k={k}"):
        Engine(model, "hisparse", cache_slots=k - 1)
    with pytest.raises(ValueError, match="needs cache_slots"):
        Engine(model, "hisparse")
    with pytest.raises(ValueError, match="mode must be one of"):
        Engine(model, "offload", cache_slots=k)
    with pytest.raises(ValueError, match="prefetch applies to mode 'hisparse'"):
        Engine(model, "resident", prefetch=True)
    if "shared" not in model.config.indexer_types:
        with pytest.raises(ValueError, match="this DSA model .* has none"):
            Engine(model, "hisparse", cache_slots=k, prefetch=True)
    engine = Engine(model, "hisparse", cache_slots=k, max_context=20)
    with pytest.raises(ValueError, match="a prompt of 27 tokens plus 4 new ones exceeds max_context=20"):
        engine.generate(prompts(), new_tokens=4)
    assert engine.cache is None, "nothing may be allocated for a refused call"
    with pytest.raises(ValueError, match="token id 97 out of range"):
        engine.generate([[1, 2, 97]], new_tokens=2)
    refused = [
        (lambda: Engine(model, "hisparse", cache_slots=MAX_SLOTS + 1), rf"cache_slots B={MAX_SLOTS + 1} exceeds"),
        (lambda: Engine(model, "hisparse", cache_slots=k + 0.5), r"cache_slots must be an int .* got \d+\.5"),
        (lambda: Engine(model, "resident", max_context=0), "max_context must be an int >= 1 .* got 0"),
        (lambda: Engine(model, "resident", chunk_size=0), "chunk_size must be an int >= 1 .* got 0"),
        (lambda: Engine(model, "hisparse", cache_slots=k, prefetch_programs=0),
         r"prefetch_programs must be an int >= 1 \(programs of the prefetch copy\), got 0"),
        (lambda: Engine(model, "resident", decode_backend="cuda"),
         r"decode_backend='cuda': expected one of \('auto', 'triton', 'gluon'\)"),
        (lambda: engine.generate(torch.arange(5), 2), r"a Tensor of shape \(5,\) \(one prompt: wrap it in a list\)"),
        (lambda: engine.generate([torch.ones(2, 5, dtype=torch.int64)], 2), r"prompt 0 must be a 1-D .* \(2, 5\)"),
        (lambda: engine.generate([[1.0, 2.5]], 2), "prompt 0 holds 1.0 at position 0: token ids must be integers"),
        (lambda: engine.generate([torch.tensor([1.0, 2.5])], 2), "prompt 0 holds torch.float32 values"),
        (lambda: engine.generate(prompts(), 2.0), "new_tokens must be an int >= 1, got 2.0"),
    ]
    for call, message in refused:
        with pytest.raises(ValueError, match=message):
            call()
    assert engine.cache is None
    batch = torch.tensor([[1, 2, 3], [4, 5, 6]])          # a [batch, len] tensor is a batch of prompts
    resident = Engine(model, "resident", prefill=PREFILL)
    assert torch.equal(resident.generate(batch, 2).tokens, resident.generate([[1, 2, 3], [4, 5, 6]], 2).tokens)
    with monkeypatch.context() as patch:                 # a selection larger than the kernel's scan holds
        patch.setattr(model.config, "index_topk", MAX_K + 1)
        with pytest.raises(ValueError, match=rf"k={MAX_K + 1} .* exceeds the {MAX_K} the resolve kernel supports"):
            Engine(model, "hisparse", cache_slots=MAX_K + 1)


@pytest.mark.parametrize("prompt,message", [
    ([5, None, 7], "prompt 1 holds None at position 1: token ids must be integers"),
    ([5, "7"], "prompt 1 holds '7' at position 1: token ids must be integers"),
    ([5, True], "prompt 1 holds True at position 1: token ids must be integers"),
    ((5, 2.0), "prompt 1 holds 2.0 at position 1: token ids must be integers"),
], ids=["none", "str", "bool", "float"])
def test_prompts_name_an_id_that_is_not_an_integer(prompt, message):
    """None used to be a RuntimeError about dtype inference, True read as token 1."""
    with pytest.raises(ValueError, match=re.escape(message)):
        check_prompts([[1, 2], prompt])
    assert [t.tolist() for t in check_prompts([[1, np.int64(2)], (3, torch.tensor(4))])] == [[1, 2], [3, 4]]


def test_cache_slots_must_be_an_int_in_every_mode(tiny_model):
    """True is not 1 slot, 8.0 not 8: refused in the modes that cache and in resident, which has no slots."""
    model = tiny_model("deepseek_v32")
    k = model.config.index_topk
    for mode in ("hisparse", "noio", "resident"):
        for slots in (True, float(k), str(k)):
            with pytest.raises(ValueError, match=rf"cache_slots must be an int \(B >= k = {k}\), got {slots!r}"):
                Engine(model, mode, cache_slots=slots)
    assert Engine(model, "hisparse", cache_slots=torch.tensor(k)).cache_slots == k
    assert Engine(model, "resident", cache_slots=k).cache_slots == k


def test_a_failed_run_keeps_no_cache_and_restores_the_models_attention(model, monkeypatch):
    own = model.sparse_attention
    engine = Engine(model, "hisparse", cache_slots=model.config.index_topk, prefill=PREFILL)
    engine.generate(prompts(), new_tokens=2)
    assert engine.cache is not None and model.sparse_attention is own

    def failing_prefill(*args, **kwargs):
        assert engine.cache is not None, "the cache is built before the prefill"
        raise RuntimeError("prefill failed")
    monkeypatch.setattr(engine, "_prefill", failing_prefill)
    with pytest.raises(RuntimeError, match="prefill failed"):
        engine.generate(prompts(), new_tokens=2)
    assert engine.cache is None, "a half-built cache (and its pinned host pool) must not be kept"
    assert model.sparse_attention is own


def test_recorded_selections_replay_to_the_same_run(tiny_model, tmp_path):
    """Record a run's selections, save and load them, replay them in place of the indexer."""
    model = tiny_model("glm_moe_dsa")
    engine = Engine(model, "hisparse", cache_slots=model.config.index_topk, prefill=PREFILL)
    writer = engine.trace_writer(prompts())
    recorded = engine.generate(prompts(), new_tokens=9, record=writer)
    writer.save(tmp_path / "run.safetensors")
    trace = load_trace(tmp_path / "run.safetensors")
    assert trace.selections.shape == (8, 3, len(PROMPT_LENGTHS), model.config.index_topk)
    assert (trace.layer_anchor == [0, 0, 2]).all()       # the shared layer reuses layer 0's selection
    replayed = Engine(model, "hisparse", cache_slots=model.config.index_topk, prefill=PREFILL).generate(
        prompts(), new_tokens=9, replay=trace)
    assert_bitwise(recorded, replayed, "replayed trace")
    assert (recorded.hits, recorded.misses) == (replayed.hits, replayed.misses)


def test_replayed_trace_misses_equal_the_simulator(tiny_model):
    """A synthetic trace with locality drives the decode loop; its measured misses, step by step,
    are the LRU simulator's on the same trace."""
    model = tiny_model("deepseek_v32")
    k = model.config.index_topk
    cfg = SyntheticConfig(context=20, steps=12, k=k, layers=3, batch=2, sinks=1, window=2, random_layers=1)
    trace = generate_trace(cfg)                     # deepseek_v32: every layer is its own anchor
    equal_prompts = [torch.arange(20) % 97, (torch.arange(20) * 7) % 97]
    for cache_slots in (k, 2 * k):
        out = Engine(model, "hisparse", cache_slots=cache_slots, prefill=PREFILL).generate(
            equal_prompts, new_tokens=13, replay=trace)
        simulated = simulate_trace(trace, "lru", cache_slots)
        assert out.misses_per_step == simulated.misses.sum(1).tolist()
        assert out.miss_rate == pytest.approx(simulated.miss_rate())
        assert (simulated.misses.sum(1)[1:] > 0).any(), f"B = {cache_slots}: no miss past the first step"
    with pytest.raises(ValueError, match="trace has 12 steps, 30 new tokens need 29"):
        Engine(model, "hisparse", cache_slots=k, prefill=PREFILL).generate(equal_prompts, new_tokens=30, replay=trace)
    with pytest.raises(ValueError, match=r"trace context \[20, 20\] differs from the prompt lengths"):
        Engine(model, "hisparse", cache_slots=k, prefill=PREFILL).generate(prompts(), new_tokens=3, replay=trace)
    glm = tiny_model("glm_moe_dsa")
    with pytest.raises(ValueError, match=r"trace layer anchors \[0, 1, 2\] differ from the model's \[0, 0, 2\]"):
        Engine(glm, "hisparse", cache_slots=k, prefill=PREFILL).generate(equal_prompts, new_tokens=3, replay=trace)
    fitted = with_anchors(trace, [0, 0, 2])
    out = Engine(glm, "hisparse", cache_slots=k, prefill=PREFILL).generate(equal_prompts, new_tokens=13, replay=fitted)
    assert out.misses_per_step == simulate_trace(fitted, "lru", k).misses.sum(1).tolist()


def test_prefetch_width_is_the_familys_unless_the_engine_is_given_one(tiny_model, monkeypatch):
    """prefetch_programs: the prefetch copy's width, the family's measured one by default; an Engine
    argument sets another, which reaches the run's attention; anything but an int >= 1 is refused."""
    from hisparse import runtime
    from hisparse.dsa.runtime import KernelDsaAttention
    assert [runtime.prefetch_width(f) for f in ("DSA", "nsa", "Quest")] == [4, 32, 32]
    assert runtime.prefetch_width("quest", 64) == 64
    assert KernelDsaAttention().prefetch_programs == 4
    assert KernelDsaAttention(prefetch_programs=64).prefetch_programs == 64
    with pytest.raises(ValueError, match=r"family 'mamba': expected one of \('DSA', 'NSA', 'Quest'\)"):
        runtime.prefetch_width("mamba")
    for bad in (0, -4, 2.0, True, "16"):
        with pytest.raises(ValueError, match=r"prefetch_programs must be an int >= 1 .*, got " + re.escape(repr(bad))):
            runtime.prefetch_width("DSA", bad)
        with pytest.raises(ValueError, match=r"prefetch_programs must be an int >= 1"):
            KernelDsaAttention(prefetch_programs=bad)
    model = tiny_model("glm_moe_dsa")
    k = model.config.index_topk
    assert Engine(model, "hisparse", cache_slots=k).prefetch_programs == 4
    engine = Engine(model, "hisparse", cache_slots=k, prefetch=True, prefetch_programs=16, prefill=PREFILL)
    made, attention = [], engine.runtime.attention
    monkeypatch.setattr(engine.runtime, "attention", lambda *a, **kw: made.append(attention(*a, **kw)) or made[-1])
    out = engine.generate(prompts(), new_tokens=2)          # a CPU copies in line, whatever the width
    assert [att.prefetch_programs for att in made] == [16]
    assert out.prefetched_layers == (1 if DEVICE == "cuda" else 0)      # glm_moe_dsa's one shared layer
    assert_bitwise(Engine(model, "resident", prefill=PREFILL).generate(prompts(), new_tokens=2), out,
                   "prefetch_programs=16")


def test_decode_backend_picks_the_dsa_decode_kernel(tiny_model):
    """decode_backend="triton" runs the Triton kernel, as "auto" does off Hopper: the same run bitwise;
    "gluon" where the Gluon kernel cannot run (here: a CPU) is refused at the first decode step with
    the reason, and the model keeps its own attention."""
    model = tiny_model("deepseek_v32")
    k = model.config.index_topk
    base = Engine(model, "hisparse", cache_slots=k).generate(prompts(), new_tokens=3)
    out = Engine(model, "hisparse", cache_slots=k, decode_backend="triton").generate(prompts(), new_tokens=3)
    assert_bitwise(base, out, "decode_backend=triton")
    assert Engine(model, "resident", decode_backend="gluon").runtime.decode_backend == "gluon"
    if not torch.cuda.is_available():
        own = model.sparse_attention
        engine = Engine(model, "hisparse", cache_slots=k, decode_backend="gluon")
        with pytest.raises(ValueError, match=r"backend='gluon': the Gluon decode kernel cannot run this: "):
            engine.generate(prompts(), new_tokens=2)
        assert engine.cache is None and model.sparse_attention is own


def test_an_anchor_layers_newest_latents_wait_for_its_resolve(device):
    """A DSA anchor layer's decode write leaves its latents to the layer's resolve (one launch fewer);
    a second write before that resolve is a fault of the caller, refused rather than a row lost, and
    a resolve that refuses its call keeps them for the retry."""
    from hisparse.cache import HierarchicalKVCache
    from hisparse.dsa.runtime import HierMlaKV, KernelDsaAttention
    cache = HierarchicalKVCache(2, 4, host_rows=64, row_elems=3, dtype=torch.float32, device=device)
    ids = [cache.open_stream(32) for _ in range(2)]
    for s in ids:
        cache.append(s, torch.randn(8, 3).to(device))
    streams = torch.tensor(ids, dtype=torch.int32, device=device)
    kv = HierMlaKV(latent=None, index_keys=None, cache=cache, host_streams=ids, streams=streams,
                   row_base=cache.row_base(streams))
    cache.advance(ids)
    positions, latent = torch.tensor([[8], [8]], device=device), torch.randn(2, 1, 3).to(device)
    kv.write(positions, latent, None)
    assert kv.newest is not None and not torch.equal(cache.host.rows[8], latent[0, 0].cpu())   # not yet written
    with pytest.raises(RuntimeError, match="never written"):
        kv.write(positions, latent, None)
    attention = KernelDsaAttention("noio", check_values=True)
    sel = torch.tensor([[9, -1], [0, 1]], dtype=torch.int32, device=device)                    # unit 9 not there
    with pytest.raises(ValueError, match="out of range"):
        attention._slots(0, kv, sel)
    assert kv.newest is not None, "a refused resolve keeps the rows"
    attention._slots(0, kv, torch.tensor([[8, 0], [1, -1]], dtype=torch.int32, device=device))
    assert kv.newest is None
    if cache.slots.is_cuda:
        torch.cuda.synchronize()
    for b, s in enumerate(ids):
        assert torch.equal(cache.host.rows[int(cache.state.host_base[s]) + 8], latent[b, 0].cpu())
        assert torch.equal(cache.slots[s, cache.reserved_slot], latent[b, 0])


# -- on a GPU --------------------------------------------------------------------------------------
# The decode loop on the GPU with DSA's real KV geometry (128 heads, 512 + 64 latents, k = 2048,
# a 64 x 128 indexer) and a small rest (2 layers, hidden 1024, dense MLPs): resident and hisparse
# give bitwise-equal logits and tokens over 64 decode steps, eager and graph-replayed, B = k and 2k;
# with shared layers, prefetch on the side stream at any copy width; with either decode kernel.

GEOMETRY = dict(model_type="deepseek_v32", vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                moe_intermediate_size=256, num_hidden_layers=2, first_k_dense_replace=2,
                num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                qk_nope_head_dim=128, v_head_dim=128, index_topk=2048, index_head_dim=128, index_n_heads=64,
                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1)


@pytest.fixture(scope="module")
def real_model():
    m = build_model(config_from_dict(dict(GEOMETRY)))
    randomize_(m, seed=0)
    return m.to(device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
def test_hisparse_bitwise_resident_eager_and_graph(real_model):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1024, (n,), generator=gen) for n in (4100, 6000, 2500, 8000)]
    runs = {
        "resident": Engine(real_model, "resident", chunk_size=1024).generate(prompts, 65),
        "resident-graph": Engine(real_model, "resident", chunk_size=1024).generate(prompts, 65, graph=True),
        "hisparse-B=k": Engine(real_model, "hisparse", cache_slots=2048, chunk_size=1024).generate(prompts, 65),
        "hisparse-B=2k-graph": Engine(real_model, "hisparse", cache_slots=4096, chunk_size=1024).generate(
            prompts, 65, graph=True),
        "hisparse-B=k-graph": Engine(real_model, "hisparse", cache_slots=2048, chunk_size=1024).generate(
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


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "gluon"])
def test_each_decode_backend_is_bitwise_resident_graphed(real_model, backend):
    """decode_backend picks the sparse MLA decode kernel for every layer: hisparse (B = k, graphed)
    gives the resident run's logits and tokens bitwise with either kernel (each against a resident
    run with the same one: the two kernels accumulate in different orders)."""
    from hisparse.dsa.ops import gluon_decode_unsupported
    cfg = real_model.config
    q = torch.empty(1, cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=torch.bfloat16,
                    device="cuda")
    if backend == "gluon" and gluon_decode_unsupported(q, cfg.kv_lora_rank) is not None:
        pytest.skip(f"the Gluon decode kernel cannot run here: {gluon_decode_unsupported(q, cfg.kv_lora_rank)}")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1024, (n,), generator=gen) for n in (3000, 2100)]
    base = Engine(real_model, "resident", chunk_size=1024, decode_backend=backend).generate(prompts, 17)
    out = Engine(real_model, "hisparse", cache_slots=2048, chunk_size=1024, decode_backend=backend).generate(
        prompts, 17, graph=True)
    assert_bitwise(base, out, f"decode_backend={backend}")
    assert out.misses > 0


def test_the_fourth_graph_capture_of_a_process_warns_once(monkeypatch):
    """count_graph_capture (Engine and Server call it before each capture): the process's 4th capture
    warns that replays are slower from there on; the 3rd and the 5th do not."""
    import warnings
    monkeypatch.setattr(runtime, "graph_captures", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runtime.count_graph_capture() == 3
    with pytest.warns(RuntimeWarning, match="4th decode-step CUDA graph.*slower from here on"):
        assert runtime.count_graph_capture() == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runtime.count_graph_capture() == 5

"""Mode hybrid in the fixed-batch engine (DSA): the first requests resident in one run of the cache's
streams, as many as the GPU budget allows, the others hierarchical; one decode step over both, bitwise
the resident run's (tiny checkpoints, the Triton interpreter on a CPU). The throughput study's batch
rule (`experiments.sweep.hybrid_batch`) is checked here too."""
import functools
import textwrap
import types

import pandas as pd
import pytest
import torch
from engine_checks import assert_bitwise, tiny_loader

from experiments import sweep
from hisparse.cache import HierarchicalKVCache
from hisparse.dsa.runtime import DsaRuntime
from hisparse.engine import GIB, Engine

PROMPT_LENGTHS = (27, 5, 19)      # one shorter than k = 8
NEW_TOKENS = 7
SLOTS = 8                         # B = k: the hierarchical requests evict heavily
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """tiny_model(family): the family's tiny checkpoint, loaded once per module."""
    return tiny_loader(tmp_path_factory, DEVICE)


def prompts(seed=0, vocab=97):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def resident_run(tiny_model):
    """resident_run(family, graph=False): the all-resident run every hybrid run is compared against."""
    @functools.cache
    def run(family: str, graph: bool = False):
        return Engine(tiny_model(family), "resident", prefill="reference").generate(prompts(), NEW_TOKENS, graph=graph)
    return run


def budget_for(model, resident: int, capacity: int = max(PROMPT_LENGTHS) + NEW_TOKENS) -> float:
    """kv_budget_gib of exactly `resident` resident requests beside the others' hierarchical bytes."""
    runtime = Engine(model, "hybrid", cache_slots=SLOTS, kv_budget_gib=1.0).runtime
    return (runtime.hybrid_bytes(resident, len(PROMPT_LENGTHS) - resident, capacity, SLOTS) + 0.5) / GIB


def counting_resolves(monkeypatch) -> list:
    calls = []
    resolve = HierarchicalKVCache.resolve

    def counted(self, streams, *args, **kw):
        calls.append(streams.tolist())
        return resolve(self, streams, *args, **kw)

    monkeypatch.setattr(HierarchicalKVCache, "resolve", counted)
    return calls


@pytest.mark.parametrize("family,resident", [("deepseek_v32", 1), ("glm_moe_dsa", 2)], ids=["dsv32-1of3", "glm-2of3"])
def test_hybrid_mixes_resident_and_hierarchical_requests_bitwise_as_resident(tiny_model, resident_run, family, resident,
                                                                              monkeypatch):
    """A budget for `resident` resident requests: the first that many are resident (their streams -1
    in every resolve), the others resolve and miss; tokens and logits are bitwise resident's
    (glm_moe_dsa: a shared layer replays its anchor's plan); the bytes held are the placement's."""
    model = tiny_model(family)
    calls = counting_resolves(monkeypatch)
    engine = Engine(model, "hybrid", cache_slots=SLOTS, prefill="reference", kv_budget_gib=budget_for(model, resident))
    out = engine.generate(prompts(), NEW_TOKENS)
    assert out.resident_requests == resident and out.resident_steps == 0
    assert_bitwise(resident_run(family), out, f"{family}, {resident} of 3 resident")
    assert out.misses > 0 and out.hits > 0, "the hierarchical requests must read through their caches"
    assert calls and all(s[:resident] == [-1] * resident and min(s[resident:]) >= 0 for s in calls), calls[:2]
    held = out.kv_bytes_per_request * len(PROMPT_LENGTHS)
    capacity = max(PROMPT_LENGTHS) + NEW_TOKENS
    assert held == engine.runtime.hybrid_bytes(resident, 3 - resident, capacity, SLOTS) <= engine.kv_budget


def test_an_all_resident_batch_takes_the_resident_step(tiny_model, resident_run, monkeypatch):
    """A budget every request fits resident in: no stream with cache state, no resolve, every step the
    all-resident one, bitwise resident's, within resident's bytes and one stream's rounding."""
    model = tiny_model("deepseek_v32")
    calls = counting_resolves(monkeypatch)
    engine = Engine(model, "hybrid", cache_slots=SLOTS, prefill="reference", kv_budget_gib=budget_for(model, 3))
    out = engine.generate(prompts(), NEW_TOKENS)
    assert out.resident_requests == 3 and out.resident_steps == NEW_TOKENS - 1
    assert calls == [] and (out.hits, out.misses) == (0, 0)
    assert engine.cache.state_streams == 0 and engine.cache.max_streams > 0
    resident = resident_run("deepseek_v32")
    assert_bitwise(resident, out, "all resident")
    row = engine.runtime.row_bytes
    assert resident.kv_bytes_per_request * 3 <= out.kv_bytes_per_request * 3 \
        < resident.kv_bytes_per_request * 3 + (SLOTS + 1) * row + 4


def test_no_resident_request_is_hisparse(tiny_model, resident_run):
    """A budget of hisparse's bytes alone: every request hierarchical, the hisparse step (no resident
    mask), with hisparse's hits and misses."""
    model = tiny_model("deepseek_v32")
    out = Engine(model, "hybrid", cache_slots=SLOTS, prefill="reference",
                 kv_budget_gib=budget_for(model, 0)).generate(prompts(), NEW_TOKENS)
    hisparse = Engine(model, "hisparse", cache_slots=SLOTS, prefill="reference").generate(prompts(), NEW_TOKENS)
    assert out.resident_requests == 0 and (out.hits, out.misses) == (hisparse.hits, hisparse.misses)
    assert out.kv_bytes_per_request == hisparse.kv_bytes_per_request
    assert_bitwise(resident_run("deepseek_v32"), out, "none resident")


def test_the_placement_never_exceeds_the_budget(tiny_model):
    """Over budgets at each edge from hisparse's bytes to past every request resident: the most resident requests
    whose bytes fit (one more would not), never fewer as the budget grows; each run holds exactly
    those bytes (measured), within the budget. Below hisparse's bytes: a clear error before any launch."""
    model = tiny_model("deepseek_v32")
    capacity = max(PROMPT_LENGTHS) + 3
    runtime = Engine(model, "hybrid", cache_slots=SLOTS, kv_budget_gib=1.0).runtime
    need = [runtime.hybrid_bytes(r, 3 - r, capacity, SLOTS) for r in range(4)]
    assert need == sorted(need) and len(set(need)) == 4, need     # at B = k a resident request costs more
    last = -1
    for budget in sorted({need[0], need[3] + 1000} | {n + d for n in need[1:] for d in (-1, 0)}):   # each edge
        engine = Engine(model, "hybrid", cache_slots=SLOTS, prefill="random", kv_budget_gib=(budget + 0.5) / GIB)
        out = engine.generate(prompts(), 3, keep_logits=False)
        r = out.resident_requests
        assert need[r] <= budget and (r == 3 or need[r + 1] > budget) and r >= last, (budget, r, need)
        assert out.kv_bytes_per_request * 3 == need[r]
        last = r
    assert last == 3
    engine = Engine(model, "hybrid", cache_slots=SLOTS, kv_budget_gib=(need[0] - 1) / GIB)
    model.prefill = None                    # any launch would fail otherwise: the check comes first
    try:
        with pytest.raises(ValueError, match=f"holds no placement of 3 requests of {capacity} tokens: all "
                                             f"hierarchical they take {need[0]} bytes"):
            engine.generate(prompts(), 3)
    finally:
        del model.prefill


def test_bad_hybrid_arguments_are_refused(tiny_model):
    model = tiny_model("deepseek_v32")
    with pytest.raises(ValueError, match="mode 'hybrid' needs kv_budget_gib"):
        Engine(model, "hybrid", cache_slots=SLOTS)
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match=f"kv_budget_gib must be a positive, finite number of GiB, got {bad!r}"):
            Engine(model, "hybrid", cache_slots=SLOTS, kv_budget_gib=bad)
    with pytest.raises(ValueError, match="kv_budget_gib places mode 'hybrid''s requests; mode 'hisparse' takes none"):
        Engine(model, "hisparse", cache_slots=SLOTS, kv_budget_gib=1.0)
    with pytest.raises(ValueError, match="mode 'hybrid' needs cache_slots"):
        Engine(model, "hybrid", kv_budget_gib=1.0)
    with pytest.raises(ValueError, match="mode must be one of .*'hybrid'.*, got 'hybird'"):
        Engine(model, "hybird")
    with pytest.raises(ValueError, match="mode 'hybrid' is built for DSA models .* this Quest model"):
        Engine(tiny_model("llama"), "hybrid", cache_slots=4, token_budget=48, kv_budget_gib=1.0)


def test_run_only_streams_hold_rows_and_no_cache_state():
    """HierarchicalKVCache(run_only_streams=n): n more streams after the ones with cache state, for runs
    only: open_stream never gives one, take_runs does, and they add rows but no state."""
    cache = HierarchicalKVCache(max_streams=2, cache_slots=4, host_rows=16, row_elems=3, dtype=torch.float32,
                                device="cpu", run_only_streams=3)
    plain = HierarchicalKVCache(max_streams=2, cache_slots=4, host_rows=16, row_elems=3, dtype=torch.float32,
                                device="cpu")
    assert (cache.max_streams, cache.state_streams, tuple(cache.slots.shape)) == (5, 2, (2, 5, 3))
    assert cache.gpu_rows.shape == (25, 3) and cache.state.lru.shape == plain.state.lru.shape
    assert [cache.open_stream(4), cache.open_stream(4)] == [0, 1]
    with pytest.raises(RuntimeError, match="all 2 streams with cache state are open or in runs"):
        cache.open_stream(4)
    assert cache.take_runs(3) == [2] and cache.free_streams() == 0
    with pytest.raises(ValueError, match="run_only_streams must be an int >= 0"):
        HierarchicalKVCache(1, 4, 16, 3, device="cpu", run_only_streams=-1)


def fake_dsa(layers=61):
    """DeepSeek-V3.2's KV geometry as the throughput study sizes it, without weights."""
    from hisparse.models.config import config_from_dict
    study = {"kind": "throughput", "model": "dsa", "layers": layers, "hidden": 1024}
    weight = torch.empty(1, dtype=torch.bfloat16)
    return types.SimpleNamespace(config=config_from_dict(sweep.model_config(study)),
                                 model=types.SimpleNamespace(embed_tokens=types.SimpleNamespace(weight=weight)))


@pytest.mark.parametrize("context,budget,expect", [(4096, 24, "resident"), (32768, 24, "hisparse"),
                                                   (32768, 40, "hisparse+resident"), (131072, 24, "hisparse")])
def test_the_throughput_batch_rule(context, budget, expect):
    """hybrid_batch at DeepSeek's sizes under the H200 study's budgets: at 4K resident's batch, every
    request resident; at 32K and 128K hisparse's batch, and the GPU budget hisparse leaves spare holds
    resident requests where it can (40 GiB at 32K, where the host budget caps hisparse's batch); the
    placement is the largest that fits."""
    model = fake_dsa()
    study = dict(kind="throughput", model="dsa", kv_budget_gib=budget, host_budget_gib=88, max_batch=128,
                 new_tokens=32, warmup_steps=8)
    point = dict(mode="hybrid", context=context, cache_slots=4096)
    capacity = context + sweep.generated_tokens(32, 8)
    batch, resident = sweep.hybrid_batch(model, study, point, capacity)
    res, his = (sweep.largest_batch(model, study, point, mode, capacity)[0] for mode in ("resident", "hisparse"))
    assert batch == max(res, his)
    runtime = DsaRuntime(model)
    if expect == "resident":
        assert res >= his and (batch, resident) == (res, res)
    else:
        assert his > res and batch == his and (resident > 0) == (expect == "hisparse+resident"), resident
    assert runtime.hybrid_bytes(resident, batch - resident, capacity, 4096) <= budget * GIB
    if resident < batch:
        assert runtime.hybrid_bytes(resident + 1, batch - resident - 1, capacity, 4096) > budget * GIB


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [1, 3], ids=["mixed", "all-resident"])
def test_hybrid_graphed_is_bitwise_resident_graphed(tiny_model, resident_run, resident):
    """The graphed twin: one captured step over resident and hierarchical requests (or the all-resident
    step), bitwise resident's graphed run."""
    model = tiny_model("glm_moe_dsa")
    out = Engine(model, "hybrid", cache_slots=SLOTS, prefill="reference",
                 kv_budget_gib=budget_for(model, resident)).generate(prompts(), NEW_TOKENS, graph=True)
    assert out.resident_requests == resident and out.resident_steps == (NEW_TOKENS - 1) * (resident == 3)
    assert_bitwise(resident_run("glm_moe_dsa", graph=True), out, f"graphed, {resident} of 3 resident")


def test_a_hybrid_throughput_study_writes_its_rows_and_resident_requests(tiny_model, tmp_path, capsys):
    """The sweep's throughput kind with mode hybrid: rows like the other modes' plus resident_requests,
    the batch the larger of resident's and hisparse's (a budget for 2 of 4 resident: hisparse fits 4 at
    most, max_batch); a Quest model's hybrid study is refused."""
    runtime = DsaRuntime(tiny_model("deepseek_v32"))
    budget = (runtime.hybrid_bytes(2, 2, 24 + sweep.generated_tokens(2, 1), 8) + 0.5) / GIB
    study = """
    [[study]]
    kind = "throughput"
    model = "tiny:deepseek_v32"
    modes = ["resident", "hisparse", "hybrid"]
    cache_slots = 8
    contexts = [24]
    kv_budget_gib = BUDGET
    max_batch = 4
    new_tokens = 2
    workload = "tiny"
    """
    config = tmp_path / "sweep.toml"
    config.write_text(textwrap.dedent(study).replace("BUDGET", repr(budget)))
    assert sweep.main(["--config", str(config), "--out", str(tmp_path / "r")]) == 0
    tput = pd.read_csv(tmp_path / "r" / "throughput.csv")
    wide = tput.pivot_table(index="mode", columns="metric", values="value")
    assert wide.loc["hybrid", "max_batch"] == max(wide.loc["resident", "max_batch"], wide.loc["hisparse", "max_batch"])
    assert (wide.loc["hybrid", "resident_requests"], wide.loc["hybrid", "max_batch"]) == (2, 4), wide.loc["hybrid"]
    assert {"tokens_per_s", "hbm_bytes_per_request", "miss_rate"} <= set(tput[tput["mode"] == "hybrid"].metric)
    assert wide.loc["hybrid", "hbm_bytes_per_request"] * 4 <= budget * GIB
    quest = textwrap.dedent(study).replace("tiny:deepseek_v32", "tiny:llama").replace("BUDGET", "0.001")
    config.write_text(quest)
    assert sweep.main(["--config", str(config), "--dry-run"]) == 2
    assert "(the fixed-batch Engine) is built for DSA models so far; model 'tiny:llama' is quest" in capsys.readouterr().err

"""Checks shared by the decode-loop tests of the families (imported by tests/test_engine_*.py)."""
import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hisparse.models.base import stack_states


class _Ops(TorchDispatchMode):
    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def tiny_loader(tmp_path_factory, device):
    """load(family): the family's tiny checkpoint (seed 3) written under pytest's temporary folder and
    loaded in float32 on `device`, once per family (for a module-scoped fixture)."""
    from hisparse.models.loading import load_model
    from hisparse.models.tiny import write_tiny_checkpoint

    @functools.cache
    def load(family: str):
        path = write_tiny_checkpoint(family, tmp_path_factory.mktemp(family), seed=3)
        return load_model(path, dtype=torch.float32, device=device)
    return load


@contextlib.contextmanager
def host_reads():
    """Inside the block, record the ops that read a tensor's value on the host (`_local_scalar_dense`:
    `int(t)`, `.item()`, a 0-d index): yields the list, filled when the block ends. On a GPU each is a
    sync, and a CUDA graph capture refuses it; on the CPU the same ops show, so a CPU test finds them."""
    seen, reads = [], []
    with _Ops(seen):
        yield reads
    reads += [f for f in seen if "_local_scalar_dense" in f]


def assert_bitwise(base, out, name: str = "") -> None:
    """`out` has exactly `base`'s tokens and, step by step, logits."""
    assert len(out.logits) == len(base.logits) > 0, f"{name}: {len(out.logits)} steps of logits, want "\
                                                     f"{len(base.logits)}"
    for step, (a, b) in enumerate(zip(base.logits, out.logits)):
        assert torch.equal(a, b), f"{name}: logits differ at step {step}"
    assert torch.equal(base.tokens, out.tokens), name


def assert_newest_units_written_through(cache, map_streams: dict[int, int] | None = None) -> None:
    """Each stream's newest unit (page, block): host row == reserved slot == its cached copy, if cached;
    map_streams: stream -> the stream whose slot map places its copy (a shared layer's anchor)."""
    for stream in sorted(cache._open):
        base, unit = int(cache.state.host_base[stream]), cache.stream_len[stream] - 1
        host = cache.host.rows[base + unit].to(cache.slots.device)
        assert torch.equal(cache.slots[stream, cache.reserved_slot], host), f"stream {stream}: reserved slot"
        mapped = (map_streams or {}).get(stream, stream)
        slot = int(cache.state.unit_slot[int(cache.state.host_base[mapped]) + unit])
        if slot >= 0:
            assert torch.equal(cache.slots[stream, slot], host), f"stream {stream}: stale cached copy"


def assert_lockstep(cache, layers) -> None:
    """Every slot of a shared layer's stream holds that stream's row of the unit its anchor stream's
    slot holds: the anchor's slot maps place the shared layer's pages too. Fails where `layers` holds no
    shared layer."""
    shared = [kv for kv in layers if getattr(kv, "anchor_layer", None) is not None]
    assert shared, "no shared layer to check (resident, dense or anchor layers only)"
    for kv in shared:
        for stream, anchor in zip(kv.streams.view(-1).tolist(), kv.anchor_streams.view(-1).tolist()):
            held = dict(zip(cache.state.lru[anchor].tolist(), cache.state.lru_unit[anchor].tolist()))
            base = int(cache.state.host_base[stream])
            assert any(u >= 0 for u in held.values())
            for slot, unit in held.items():
                if unit >= 0:
                    row = cache.host.rows[base + unit].to(cache.slots.device)
                    assert torch.equal(cache.slots[stream, slot], row), \
                        f"stream {stream} slot {slot}: not its row of unit {unit}, which the anchor holds there"


@contextlib.contextmanager
def lockstep_after_every_step(model, engine):
    """Inside the block, every decode step of `model` (as `engine` runs it) is followed by
    `assert_lockstep` over that step's layers, so a shared layer that lags its anchor's eviction by a
    step fails; yields a list that receives the decode state once it is checked."""
    states, decode = [], model.decode

    def decode_then_check(tokens, state):
        logits = decode(tokens, state)
        assert_lockstep(engine.cache, state.layers)
        states[:] = [state]
        return logits
    model.decode = decode_then_check
    try:
        yield states
    finally:
        del model.decode                # the class's method again


def assert_noio_wrote_only_shared_newest_units(cache, map_streams: dict[int, int]) -> None:
    """After a noio run of one decode step (later steps write anchors' newest units through too): no
    slot but the reserved one was filled, except in a shared layer's streams (`map_streams`: stream ->
    its anchor's), where exactly one holds the newest unit's write-through, in the slot the anchor's
    map gives that unit: the step's token, as in the reserved slot (noio copied no row there, and the
    write stores the token alone unless it opens the unit)."""
    slots = cache.slots
    for stream in range(slots.shape[0]):
        filled = [s for s in range(slots.shape[1] - 1) if slots[stream, s].abs().sum() > 0]
        if stream in map_streams:
            anchor, newest = map_streams[stream], cache.stream_len[stream] - 1
            assert filled == [int(cache.state.unit_slot[int(cache.state.host_base[anchor]) + newest])], stream
            written = slots[stream, filled[0]] != 0
            assert torch.equal(slots[stream, filled[0]][written], slots[stream, -1][written])
        else:
            assert filled == [], f"stream {stream}: no-IO must fetch no row"


def assert_unit_run(engine, base, out, prompt_lengths, new_tokens: int, unit_tokens: int, heavy_eviction: bool):
    """A hisparse run of a per-KV-head family (units of `unit_tokens` tokens, one sparse layer) against
    its resident `base`: bitwise equal; each (request, KV head) stream holds every unit its request
    reached; hits and misses both, and with heavy eviction (B = k) more fetches than units; the newest
    units written through."""
    assert_bitwise(base, out)
    units = [-(-(n + new_tokens - 1) // unit_tokens) for n in prompt_lengths]     # per request, at the end
    heads = engine.model.config.num_key_value_heads
    assert engine.cache.stream_len == [u for u in units for _ in range(heads)]   # (request, KV head) streams
    assert out.hits > 0 and out.misses > 0
    if heavy_eviction:       # more fetches than units: units were evicted and fetched again
        assert out.misses > heads * sum(units)
    assert_newest_units_written_through(engine.cache)


def assert_torch_steps_agree(model, ours, prompts, capacity: int, steps: int, device, fast: bool = True) -> None:
    """Decode `steps - 1` steps with the model's own torch attention (set by the caller) after a
    per-request prefill, feeding `ours`' tokens: each step's logits within 1e-4 of `ours`'. fast: the
    prefill `ours` ran after, the kernels' (the Engine's default, prefill="model") or, False, the
    reference's (prefill="reference")."""
    singles = []
    for prompt in prompts:
        state = model.new_state(1, capacity)
        model.prefill(prompt.to(device)[None], state, fast=fast)     # the engine's prefill: the steps alone differ
        singles.append(state)
    state = stack_states(singles)
    tokens = ours.tokens[:, 0].to(device)
    for step in range(1, steps):
        logits = model.decode(tokens, state).float().cpu()
        err = (logits - ours.logits[step]).norm() / ours.logits[step].norm()
        assert err < 1e-4, f"step {step}: relative error {err:.2e}"
        tokens = ours.tokens[:, step].to(device)


def check_hisparse_against_resident_on_gpu(engine, prompts, k: int, new_tokens: int = 65) -> None:
    """engine(mode, slots) -> Engine. hisparse (B = k and 2k, eager and graphed) and a graphed resident
    run give the eager resident run's logits and tokens bitwise; B = k both hits and misses, the same
    counts eager and graphed; the hot state per request is smaller than the resident one; noio runs."""
    base = engine("resident", None).generate(prompts, new_tokens)
    runs = {
        "resident-graph": engine("resident", None).generate(prompts, new_tokens, graph=True),
        "hisparse-B=k": engine("hisparse", k).generate(prompts, new_tokens),
        "hisparse-B=2k-graph": engine("hisparse", 2 * k).generate(prompts, new_tokens, graph=True),
        "hisparse-B=k-graph": engine("hisparse", k).generate(prompts, new_tokens, graph=True),
        # graph replays before timing starts, and one timed interval per step after them
        "hisparse-B=k-graph-warm": engine("hisparse", k).generate(prompts, new_tokens, graph=True, warmup_steps=4),
    }
    for name, out in runs.items():
        assert_bitwise(base, out, name)
    hier, graphed = runs["hisparse-B=k"], runs["hisparse-B=k-graph"]
    warm = runs["hisparse-B=k-graph-warm"]
    assert len(warm.step_ms) == warm.timed_steps == new_tokens - 5 and min(warm.step_ms) > 0
    assert hier.misses > 0 and hier.hits > 0
    assert (graphed.hits, graphed.misses) == (hier.hits, hier.misses)
    assert hier.kv_bytes_per_request < base.kv_bytes_per_request      # hot units do not grow with context
    noio = engine("noio", k).generate(prompts, new_tokens, graph=True)
    assert noio.tokens.shape == base.tokens.shape and noio.misses > 0


def prefetch_settings(device) -> tuple[bool, ...]:
    """The prefetch settings a shared-selection test runs in full: off and on with a GPU; off alone on
    a CPU, where prefetch has no side stream and copies in line, the same path (so a second full
    run there would repeat the first; `assert_prefetch_in_line` checks that in a short one)."""
    return (False, True) if torch.device(device).type == "cuda" else (False,)


def assert_prefetch_in_line(engine, resident, prompts) -> None:
    """On a CPU, an engine with prefetch on copies in line: two new tokens give the resident engine's
    bitwise (a run of the same length: capacity can change float rounding), and no copy ran on a side
    stream (check_shared_selections_on_gpu runs prefetch in full)."""
    out = engine.generate(prompts, 2)
    assert out.prefetched_layers == 0
    assert_bitwise(resident.generate(prompts, 2), out, "prefetch on, in line on a CPU")


def check_shared_selections_on_gpu(engine, prompts, k: int, shared_layers: int, new_tokens: int = 65) -> None:
    """engine(mode, slots, prefetch) -> Engine of a model whose layers share selections. hisparse at
    B = k with the shared layers' copies in line and, with prefetch, on the side stream (eager and
    inside the captured graph) gives the resident run's logits and tokens bitwise, with the same
    hits and misses each way; `shared_layers` layers' copies ran on the side stream; a graphed noio
    run (shared layers, nothing to copy: no fork) runs."""
    base = engine("resident", None, False).generate(prompts, new_tokens)
    counts = set()
    for prefetch in (False, True):
        for graph in (False, True):
            out = engine("hisparse", k, prefetch).generate(prompts, new_tokens, graph=graph)
            assert_bitwise(base, out, f"prefetch={prefetch}, graph={graph}")
            assert out.prefetched_layers == (shared_layers if prefetch else 0)
            counts.add((out.hits, out.misses))
    assert len(counts) == 1 and min(next(iter(counts))) > 0
    noio = engine("noio", k, False).generate(prompts, new_tokens, graph=True)
    assert noio.tokens.shape == base.tokens.shape and noio.misses > 0


def check_traces_replay_exactly(model, prompts, new_tokens: int, k: int, tmp_path, synthetic, **engine_kw):
    """Selection traces of a per-KV-head family (NSA, Quest); returns the hisparse run (B = k) that
    `synthetic` drove, for a caller's further replays of it to compare against.
    - A resident run's recorded selections, saved and loaded, replay to that run bitwise, in resident
      and in hisparse mode (B = k), one selection per (request, layer, KV head).
    - `synthetic` (a trace whose selections the model would not make) drives hisparse bitwise as it
      drives resident, and hisparse misses, step by step, what the LRU simulator misses on it."""
    from hisparse.engine import Engine
    from hisparse.policies import simulate_trace
    from hisparse.traces import load_trace

    engine = Engine(model, "resident", **engine_kw)
    writer = engine.trace_writer(prompts)
    recorded = engine.generate(prompts, new_tokens, record=writer)
    writer.save(tmp_path / "run.safetensors")
    trace = load_trace(tmp_path / "run.safetensors")
    cfg, runtime = model.config, engine.runtime
    assert trace.selections.shape == (new_tokens - 1, cfg.num_hidden_layers, len(prompts),
                                      cfg.num_key_value_heads, k)
    assert (trace.family, trace.unit_size) == (runtime.family.lower(), runtime.unit_size)
    for mode in ("resident", "hisparse"):
        slots = {"cache_slots": k} if mode == "hisparse" else {}
        out = Engine(model, mode, **slots, **engine_kw).generate(prompts, new_tokens, replay=trace)
        assert_bitwise(recorded, out, f"the recorded run replayed in {mode} mode")
    base = Engine(model, "resident", **engine_kw).generate(prompts, new_tokens, replay=synthetic)
    assert not torch.equal(base.tokens, recorded.tokens), "the synthetic trace must change the run"
    out = Engine(model, "hisparse", cache_slots=k, **engine_kw).generate(prompts, new_tokens, replay=synthetic)
    assert_bitwise(base, out, "a synthetic trace, hisparse against resident")
    assert out.misses_per_step == simulate_trace(synthetic, "lru", k).misses.sum(1).tolist()
    assert sum(out.misses_per_step) > 0
    return out

"""Synthetic selection traces with the locality of real sparse attention, and their named presets.

The model, per request and layer, at decode step t with n_t = ceil((context + t + 1) / unit_size) units:
- `sinks`: the first units are always selected (attention sinks).
- `window`: the last units are always selected (the recent window, newest unit included).
- the other h = k - sinks - window units are the top-h scores z(u) + noise * e_t(u) over the rest:
  z(u) ~ N(0, 1) is how heavy a unit is, e_t(u) ~ N(0, 1) fresh every step. Units near the threshold
  drop out and come back after gaps (reuse after gaps); larger `noise` means more churn per step.
- `persistence` and `drift`: a unit's z is sqrt(persistence) * a lasting part, drawn once, plus
  sqrt(1 - persistence) * a fading part that each step is redrawn with (about) probability `drift`.
  So heavy hitters drift on two scales: a redraw moves a unit by a step of the fading part only
  (every 1 / drift steps on average), and units with a large lasting part keep coming back, after
  gaps of many steps, which a larger cache catches; persistence 0 makes each redraw a new unit
  (an arrival that no cache size avoids), persistence near 1 keeps the heavy set almost fixed.
- `layer_similarity`: each unit's z and e of a layer are, with this probability (drawn once per
  unit), those of the previous layer; so adjacent layers share about that share of their selections.
- `hot`, `hot_rate`, `hot_lifetime`: a long-lived hot set. Each regular layer keeps a share `hot` of
  its h heavy hitters' count, round(hot * h) units of the context, hot (a document's key passages), so
  the share holds whatever k a caller sets: while hot, a unit is selected each step with
  probability `hot_rate`, whatever its score, and passed over otherwise; it stays hot for about
  `hot_lifetime` steps (geometric), then cools back to its score and a new unit of the context, drawn
  uniformly, takes its place. Re-selected after short gaps for thousands of steps, such a unit stays
  in an LRU cache and is evicted by FIFO once per turn of the cache whenever that step passes it
  over: the set widens FIFO's miss rate over LRU's. Hotness is a property of a unit's own value, so
  tied layers share it (and its coin flips) as they share z. `hot` = 0 (the default) draws nothing
  for it and leaves every trace as it was.
- `random_layers`: the first layers pick their h units uniformly at random every step.
- `model_layers`: the layer count of the network the simulated layers stand for (random layers
  count once, the other simulated layers share the rest equally); see `layer_weights`.

Generation is vectorised over layers in torch: per step one top-h per layer over the units whose z
could reach the threshold (e is clipped at 5, so the others cannot). The requests of a batch are
drawn side by side, one thread each.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from hisparse.traces import Trace


@dataclass(slots=True)
class SyntheticConfig:
    """Parameters of the generator (module docstring); sizes in units, k per selection."""
    context: int
    steps: int
    k: int
    layers: int
    batch: int = 1
    sinks: int = 4
    window: int = 64
    noise: float = 0.2
    drift: float = 0.0
    persistence: float = 0.0
    hot: float = 0.0
    hot_rate: float = 0.5
    hot_lifetime: float = 2000.0
    layer_similarity: float = 0.85
    random_layers: int = 2
    model_layers: int | None = None
    unit_size: int = 1
    seed: int = 0

    def __post_init__(self):
        ints = ("context", "steps", "k", "layers", "batch", "sinks", "window", "random_layers", "unit_size", "seed")
        for name in ints + (("model_layers",) if self.model_layers is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("noise", "drift", "persistence", "hot", "hot_rate", "hot_lifetime", "layer_similarity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not 0 <= self.seed < 2 ** 32:  # request_seed(seed, request) stays exact
            raise ValueError(f"seed must be in 0 .. 2**32 - 1, got {self.seed}")
        for name in ("context", "steps", "k", "layers", "batch", "unit_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sinks < 0 or self.window < 0 or self.sinks + self.window >= self.k:
            raise ValueError(f"sinks={self.sinks} and window={self.window} must be >= 0 and leave room in "
                             f"k={self.k} for heavy hitters")
        first_units = -(-(self.context + 1) // self.unit_size)
        if first_units < self.k + self.sinks + self.window:
            raise ValueError(f"context={self.context} tokens ({first_units} units at step 0) is too short "
                             f"for k={self.k}: need at least k + sinks + window units")
        if not 0 <= self.random_layers <= self.layers:
            raise ValueError(f"random_layers={self.random_layers} must be in 0..layers={self.layers}")
        if self.noise < 0 or not 0 <= self.drift <= 1 or not 0 <= self.layer_similarity <= 1:
            raise ValueError(f"need noise >= 0 and drift, layer_similarity in [0, 1], got noise="
                             f"{self.noise}, drift={self.drift}, layer_similarity={self.layer_similarity}")
        if not 0 <= self.persistence < 1:     # 1 would leave drift nothing to move
            raise ValueError(f"persistence must be in [0, 1), got {self.persistence}")
        if not 0 <= self.hot < 1:
            raise ValueError(f"hot (the hot set's share of the heavy hitters) must be in [0, 1), got {self.hot}")
        if not 0 < self.hot_rate <= 1:
            raise ValueError(f"hot_rate must be in (0, 1], got {self.hot_rate}")
        if self.hot_lifetime < 1:
            raise ValueError(f"hot_lifetime must be >= 1 step, got {self.hot_lifetime}")
        if self.model_layers is not None and self.model_layers < self.layers:
            raise ValueError(f"model_layers={self.model_layers} must be >= the simulated layers="
                             f"{self.layers}")
        if self.model_layers is not None and self.random_layers == self.layers < self.model_layers:
            raise ValueError("with only random layers simulated, model_layers has no layers to stand for "
                             "the rest")

    def hot_units(self) -> int:
        """The hot set's size in each regular layer: round(hot * h), h = k - sinks - window."""
        return round(self.hot * (self.k - self.sinks - self.window))


PRESETS = {
    # DESIGN section 7's setting: DSA, k = 2048, a 100K-token prompt, 1000 decode steps; 8 simulated
    # layers stand for the model's 61, of which the first 2 select almost at random. noise (per-step
    # churn around the selection threshold), drift (how often a unit's fading part is redrawn),
    # persistence (the share of a unit's weight that never changes) and hot (the long-lived hot set's
    # share of the heavy hitters) are what experiments.policies.calibrate fit to the four published miss rates on
    # GLM-5.1's trace: 30% keeping only the last selection (B = k), 13.4% and 6.7% with LRU at
    # B = 4096 and 8192, 17.2% with FIFO at B = 4096. hot_rate 0.8 and hot_lifetime 2000 are not fit
    # (the four points cannot tell them from hot; at hot_rate 0.5 no fit exists): they and every other
    # field were set before the fit; everything else the preset gives is a prediction
    # (results/notes/policies.md).
    "dsa_100k": SyntheticConfig(context=100_000, steps=1000, k=2048, layers=8, random_layers=2,
                                model_layers=61, noise=0.15209, drift=0.29764, persistence=0.81363,
                                hot=0.28636, hot_rate=0.8, hot_lifetime=2000.0),
    # the same shape at test size
    "tiny": SyntheticConfig(context=400, steps=30, k=32, layers=4, random_layers=1, sinks=2, window=4),
}


def preset(name: str, **overrides) -> SyntheticConfig:
    """A named preset, with fields replaced by `overrides`."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def layer_weights(cfg: SyntheticConfig) -> np.ndarray:
    """float64 [layers]: how many of the model's layers each simulated layer stands for."""
    weights = np.ones(cfg.layers)
    if cfg.model_layers is not None:
        regular = cfg.layers - cfg.random_layers
        weights[cfg.random_layers:] = (cfg.model_layers - cfg.random_layers) / regular
    return weights


def request_seed(base_seed: int, request: int) -> int:
    """The seed of request `request` of a batch drawn from `base_seed`: base_seed * 1_000_003 + request,
    distinct for every pair with base_seed < 2**32 and request < 1_000_003 (an exact int below 2**52)."""
    for name, value, bound in (("base_seed", base_seed, 2 ** 32), ("request", request, 1_000_003)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < bound:
            raise ValueError(f"{name} must be an int in 0 .. {bound - 1}, got {value!r}")
    return int(base_seed) * 1_000_003 + int(request)


def generate(cfg: SyntheticConfig) -> Trace:
    """A trace [steps, layers, batch, k] following `cfg`; the same config gives the same trace.
    Request r is its own draw, the one `request_trace` gives for seed request_seed(cfg.seed, r)."""
    return _trace(cfg, [request_seed(cfg.seed, r) for r in range(cfg.batch)])


def draw_requests(cfg: SyntheticConfig, seeds: list[int]) -> Trace:
    """A trace [steps, layers, len(seeds), k]: request j is request_trace(cfg, cfg.context, cfg.steps,
    seeds[j]), the requests drawn side by side on the host's cores."""
    if not seeds:
        raise ValueError("seeds must name at least one request")
    return _trace(replace(cfg, batch=len(seeds)), [int(s) for s in seeds])


def batch_workload(cfg: SyntheticConfig, batch: int, seed: int | None = None) -> Trace:
    """A replay trace of `batch` requests [steps, layers, batch, k], each its own draw of `cfg`'s
    workload: request b is request_trace(cfg, cfg.context, cfg.steps, request_seed(seed, b)), with
    `seed` defaulting to cfg.seed. (`generate` of cfg with that batch and seed.)"""
    return generate(replace(cfg, batch=batch, seed=cfg.seed if seed is None else seed))


def request_draws(workload: str, model_config, input_len: int, output_len: int, count: int,
                  cache: str | Path | None = None) -> list[torch.Tensor]:
    """`count` requests' own draws of preset `workload` for a DSA model (its layer count and k =
    index_topk) after prompts of input_len tokens: request i's is int32 [output_len - 1, layers, k],
    the draw of seed request_seed(0, i), as `batch_workload`. A "shared" layer gets its anchor's (the
    last "full" one before it). At 61 layers and k = 2048 a draw takes tens of seconds, drawn on the
    host's cores side by side. With `cache` (a folder) each request's draw is kept there as a .npy
    file named by its seed and a hash of its config, of this file and of numpy's and torch's
    versions, so later calls (other points, processes, a server) read it instead of drawing it again;
    each cached draw is read once into its own array (1 GB at 61 layers and 2K out), never stacked
    with the others. Without a cache the draws are made side by side in one array and then copied
    apart, twice their size at the peak."""
    cfg = _request_config(workload, model_config, input_len, output_len)
    seeds = [request_seed(0, i) for i in range(count)]
    if cache is None:
        drawn = draw_requests(cfg, seeds).selections                        # [steps, layers, count, k]
        draws = [drawn[:, :, i] for i in range(count)]
    else:
        draws = [np.load(f) for f in _cached_draw_files(cfg, seeds, Path(cache))]
    anchors, last_full = [], 0
    for i, kind in enumerate(model_config.indexer_types):
        last_full = i if kind == "full" else last_full
        anchors.append(last_full)
    no_shared = anchors == list(range(cfg.layers))                          # every layer its own: no copy
    return [torch.from_numpy(np.ascontiguousarray(d if no_shared else d[:, anchors])) for d in draws]


def fill_draw_cache(workload: str, model_config, input_len: int, output_len: int, count: int,
                    cache: str | Path) -> None:
    """Draw into `cache` every one of `count` requests' draws that `request_draws` would read from it
    and it lacks, all side by side (one batch uses the host's cores; request by request does not);
    the draws already there are not read."""
    _cached_draw_files(_request_config(workload, model_config, input_len, output_len),
                       [request_seed(0, i) for i in range(count)], Path(cache))


def _request_config(workload: str, model_config, input_len: int, output_len: int) -> SyntheticConfig:
    over = dict(k=model_config.index_topk, layers=model_config.num_hidden_layers, context=input_len,
                steps=max(1, output_len - 1))
    if workload == "tiny":
        over.update(sinks=1, window=2)
    return preset(workload, **over)


def _cached_draw_files(cfg: SyntheticConfig, seeds: list[int], cache: Path) -> list[Path]:
    """The .npy file in `cache` of each seed's draw [steps, layers, k] of `cfg`, the missing ones drawn
    together and written first (to a temporary name, then renamed: an interrupted write leaves no
    half file)."""
    fields = json.dumps(asdict(replace(cfg, batch=1, seed=0)), sort_keys=True)
    streams = f"numpy {np.__version__} torch {torch.__version__}"         # whose random streams make the draws
    tag = hashlib.sha1(fields.encode() + streams.encode() + Path(__file__).read_bytes()).hexdigest()[:12]
    cache.mkdir(parents=True, exist_ok=True)
    files = [cache / f"draw_{tag}_{seed}.npy" for seed in seeds]
    missing = [(seed, f) for seed, f in zip(seeds, files) if not f.exists()]
    if missing:
        print(f"  drawing {len(missing)} of {len(seeds)} requests' selections into {cache}/", flush=True)
        start = time.perf_counter()
        drawn = _trace(replace(cfg, batch=len(missing)), [seed for seed, _ in missing], progress=lambda done: print(
            f"  drew {done}/{len(missing)} requests' selections, {time.perf_counter() - start:.0f} s", flush=True)
        ).selections
        for j, (_, f) in enumerate(missing):
            part = f.with_suffix(f".{os.getpid()}.part.npy")          # this process's own, then renamed
            np.save(part, np.ascontiguousarray(drawn[:, :, j]))
            part.rename(f)
    return files


def request_trace(cfg: SyntheticConfig, context: int, steps: int, seed: int) -> Trace:
    """One request's trace [steps, layers, 1, k] for a serving scheduler: `cfg`'s workload (k, layers,
    locality) drawn with `seed` over `steps` decode steps after a prompt of `context` tokens. The
    same arguments give the same trace; request b of `batch_workload` is the one of seed
    request_seed(base, b). Raises ValueError when the context is too short for k."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed must be an int in 0 .. 2**63 - 1, got {seed!r}")
    return _trace(replace(cfg, context=context, steps=steps, batch=1), [int(seed)])


def _trace(cfg: SyntheticConfig, seeds: list[int], progress=None) -> Trace:
    """The trace of one request per seed (cfg.batch of them), each drawn by `_generate_request`;
    `progress(done)` is called as each request's draw finishes (in any order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the per-step ops are small: intra-op threads only add contention, and
    try:                      # requests drawn side by side (torch and numpy release the GIL) scale better
        with ThreadPoolExecutor(max(1, min(len(seeds), os.cpu_count() or 1))) as pool:
            futures = [pool.submit(_generate_request, cfg, seed) for seed in seeds]
            for done, _ in enumerate(as_completed(futures), 1):
                if progress is not None:
                    progress(done)
            sel = np.stack([f.result() for f in futures], axis=2)
    finally:
        torch.set_num_threads(threads)
    source = json.dumps({"generator": "hisparse.synthetic", **asdict(cfg), "request_seeds": seeds})
    return Trace(sel, "synthetic", cfg.unit_size, np.full(cfg.batch, cfg.context, dtype=np.int64),
                 np.arange(cfg.layers), source=source)


def _generate_request(cfg: SyntheticConfig, seed: int) -> np.ndarray:
    """int32 [steps, layers, k] for the request of `seed` (its three streams, and a fourth for the hot
    set when there is one, spawned from it, so no two seeds share one)."""
    states = np.random.SeedSequence(seed).generate_state(4 if cfg.hot_units() else 3, np.uint64).tolist()
    noise_seed, layers_seed, rng_seed = states[:3]     # the first three words do not depend on the count
    g_noise = torch.Generator().manual_seed(noise_seed)
    g_layers = torch.Generator().manual_seed(layers_seed)
    rng = np.random.default_rng(rng_seed)
    units = -(-(cfg.context + np.arange(cfg.steps) + 1) // cfg.unit_size)        # n_t, [steps]
    total = int(units[-1])
    regular = cfg.layers - cfg.random_layers
    own = torch.randn(regular, total, generator=g_layers)                   # each layer's own z, [regular, units]
    tied = torch.rand(regular, total, generator=g_layers) < cfg.layer_similarity
    root = _tie_roots(tied)                # z[l, u] = own[root[l, u], u]: a tied unit shows the layer below's
    flat = (root * total + torch.arange(total)).view(-1)   # z = own.view(-1)[flat]: faster than gather(0, root)
    shown = (root == torch.arange(regular)[:, None]).view(-1).nonzero().squeeze(1)  # own's entries z shows (flat)
    lasting, fading = math.sqrt(cfg.persistence), math.sqrt(1 - cfg.persistence)
    if cfg.persistence > 0:                # own = lasting * its lasting part + fading * the part drift redraws
        base = torch.randn(regular, total, generator=g_layers)
        own = lasting * base + fading * own
    peak = _peak(own, shown, total)
    hot = _HotSet(cfg, int(units[0]), regular, total, states[3]) if cfg.hot_units() and regular else None
    out = np.empty((cfg.steps, cfg.layers, cfg.k), dtype=np.int32)
    out[:, :, :cfg.sinks] = np.arange(cfg.sinks)
    threshold = -np.inf
    for t, n in enumerate(units.tolist()):
        out[t, :, cfg.sinks:cfg.sinks + cfg.window] = np.arange(n - 1, n - cfg.window - 1, -1)
        heavy = out[t, :, cfg.sinks + cfg.window:]                               # [layers, h]
        for layer in range(cfg.random_layers):
            heavy[layer] = cfg.sinks + rng.choice(n - cfg.sinks - cfg.window, heavy.shape[1], replace=False)
        if not regular:
            continue
        if cfg.drift > 0:
            redrawn = torch.from_numpy(rng.integers(0, total, (regular, rng.binomial(total, cfg.drift))))
            fresh = fading * torch.from_numpy(rng.standard_normal(redrawn.shape, dtype=np.float32))
            own.scatter_(1, redrawn, fresh + lasting * base.gather(1, redrawn) if cfg.persistence > 0 else fresh)
            peak = _peak(own, shown, total)
        if hot is None:
            heavy[cfg.random_layers:], threshold = _heavy_hitters(peak, own, flat, cfg, n, threshold, g_noise)
        else:
            live = hot.scores(own, n, t)
            heavy[cfg.random_layers:], threshold = _heavy_hitters(_peak(live, shown, total), live, flat, cfg, n,
                                                                  threshold, g_noise)
    return out


_HOT_SCORE = 1e4   # above (or, negated, below) any z + noise * e: a hot unit's coin flip decides alone


class _HotSet:
    """The hot units of each regular layer's own values (module docstring): [regular, hot_units] ids,
    drawn uniformly from the prompt's units [sinks, first_units - window), each replaced by a new one
    of the context [sinks, n - window) when it cools (probability 1 / hot_lifetime a step)."""

    def __init__(self, cfg: SyntheticConfig, first_units: int, regular: int, total: int, seed: int):
        self.cfg, self.rng = cfg, np.random.default_rng(seed)
        span = first_units - cfg.window - cfg.sinks
        self.units = np.stack([cfg.sinks + self.rng.choice(span, cfg.hot_units(), replace=False) for _ in range(regular)])
        self.offset = np.arange(regular)[:, None] * total                 # row starts in own.view(-1)

    def scores(self, own: torch.Tensor, n: int, t: int) -> torch.Tensor:
        """A copy of own [regular, units] whose hot entries are +_HOT_SCORE (selected at step t, which
        has n units) or -_HOT_SCORE (passed over), after the units that cooled were replaced."""
        cfg = self.cfg
        if t:
            for row, i in zip(*(self.rng.random(self.units.shape) < 1 / cfg.hot_lifetime).nonzero()):
                new = self.units[row, i]
                while new in self.units[row]:                              # a unit not hot in this layer yet
                    new = cfg.sinks + self.rng.integers(n - cfg.window - cfg.sinks)
                self.units[row, i] = new
        picked = self.rng.random(self.units.shape) < cfg.hot_rate
        live = own.clone()
        live.view(-1)[torch.from_numpy((self.offset + self.units).ravel())] = torch.from_numpy(
            np.where(picked, _HOT_SCORE, -_HOT_SCORE).astype(np.float32).ravel())
        return live


_NOISE_CLIP = 5.0  # e is clipped to +-5: no effect on the statistics (p < 1e-6), lets units far
                   # below the selection threshold skip their noise draw


def _peak(own, shown, units):
    """float [units]: each unit's largest z over the layers, from the entries of `own` that z shows
    (`shown`: their flat positions; about 1 in 6 at layer_similarity 0.85, so this reads fewer entries
    than gathering z and its amax(0))."""
    return torch.full((units,), -math.inf).scatter_reduce_(0, shown % units, own.view(-1).index_select(0, shown), "amax")


def _heavy_hitters(peak, own, flat, cfg, n, threshold, g_noise):
    """Top-h of z + noise * e over the eligible units [sinks, n - window) of each regular layer.

    Only units with z above (last step's threshold - margin - noise * clip) in some layer draw noise;
    if a layer's threshold falls below what the skipped units could reach, the step reruns over all
    units. Returns the selected units int [regular, h] (by score) and this step's lowest threshold.
    `own` [regular, units] holds each layer's own z, `flat` maps it onto z (z = own.view(-1)[flat]) and
    `peak` [units] is z's largest value over the layers.
    """
    h = cfg.k - cfg.sinks - cfg.window
    eligible = peak[cfg.sinks:n - cfg.window]

    def top(cand):
        e = torch.randn(own.shape[0], len(cand), generator=g_noise).clamp_(-_NOISE_CLIP, _NOISE_CLIP)
        column = torch.zeros(own.shape[1], dtype=torch.int64)              # unit -> its column of e (others: any)
        column[cfg.sinks + cand] = torch.arange(len(cand))
        # each layer's own score, then tied: the same floats as z + noise * (e tied), without gathering e
        score = own + cfg.noise * e.index_select(1, column)                # [regular, units]
        score = score.view(-1).index_select(0, flat).view_as(own)         # tied units share their z and noise
        vals, pos = torch.topk(score.index_select(1, cfg.sinks + cand), h, dim=1)
        return (cfg.sinks + cand.take(pos)).numpy(), float(vals[:, -1].min())

    cut = threshold - 0.1 - cfg.noise * _NOISE_CLIP
    cand = (eligible > cut).nonzero().squeeze(1)                           # units above cut in some layer
    if len(cand) >= h:
        chosen, lowest = top(cand)
        if lowest > cut + cfg.noise * _NOISE_CLIP:
            return chosen, lowest
    return top(torch.arange(len(eligible)))


def _tie_roots(tied: torch.Tensor) -> torch.Tensor:
    """int64 [layers, units]: the layer whose own value each (layer, unit) shows, given `tied`
    [layers, units] (layer l shows layer l-1's where tied[l]; layer 0 its own)."""
    root = torch.zeros(tied.shape, dtype=torch.int64)
    for layer in range(1, tied.shape[0]):
        torch.where(tied[layer], root[layer - 1], torch.tensor(layer), out=root[layer])
    return root


def split_kv_heads(trace: Trace, kv_heads: int) -> Trace:
    """A trace of batch * kv_heads requests as one of batch requests with kv_heads KV heads each:
    request b's heads are rows b * kv_heads .. (b + 1) * kv_heads - 1 (NSA, Quest: one selection per
    KV head). The rows of one request must share its context."""
    if trace.kv_heads is not None or kv_heads < 1 or trace.batch % kv_heads:
        raise ValueError(f"{trace} cannot be split into {kv_heads} KV heads per request: expected a trace "
                         f"without a KV-head axis and a batch divisible by {kv_heads}")
    context = trace.context.reshape(-1, kv_heads)
    if (context != context[:, :1]).any():
        raise ValueError(f"the {kv_heads} rows of each request must share a context, got {trace.context.tolist()}")
    steps, layers, rows, k = trace.selections.shape
    sel = trace.selections.reshape(steps, layers, rows // kv_heads, kv_heads, k)
    return Trace(sel, trace.family, trace.unit_size, context[:, 0].copy(), trace.layer_anchor, source=trace.source)


def per_kv_head_config(preset_name: str, unit_size: int, context: int, steps: int, k: int, layers: int,
                       kv_heads: int, random_layers: int = 0) -> SyntheticConfig:
    """The generator config of `per_kv_head_workload` (one request's KV heads); raises ValueError
    when the context is too short for k."""
    window = 1 if preset_name == "tiny" else max(2, 64 // unit_size)
    return preset(preset_name, context=context, steps=steps, k=k, layers=layers, random_layers=random_layers,
                  batch=kv_heads, unit_size=unit_size, sinks=1, window=window, model_layers=None)


def per_kv_head_workload(config, unit_size: int, context: int, steps: int, k: int, batch: int,
                         preset_name: str = "dsa_100k", random_layers: int = 0, seed: int = 0) -> Trace:
    """A replay trace for a per-KV-head family (Quest, NSA) model of `config`: the preset's locality
    at `unit_size` tokens per unit, one selection per (request, layer, KV head); every request its own
    draw (request b's head h is row b * kv_heads + h of `batch_workload` from `seed`); each shared layer
    its anchor's (`config.selection_anchor`); Quest's dense layers select nothing (-1). The first unit
    and the newest ones (64 tokens, at least 2 units; 1 for the "tiny" preset) are always selected."""
    from hisparse.traces import with_anchors
    heads, layers = config.num_key_value_heads, config.num_hidden_layers
    gen = per_kv_head_config(preset_name, unit_size, context, steps, k, layers, heads, random_layers)
    sel = batch_workload(gen, batch * heads, seed).selections           # [steps, layers, batch * heads, k]
    sel[:, :getattr(config, "quest_dense_layers", 0)] = -1
    trace = Trace(sel, "synthetic", unit_size, [context] * (batch * heads), list(range(layers)), source=str(gen))
    return with_anchors(split_kv_heads(trace, heads), [config.selection_anchor(i) for i in range(layers)])

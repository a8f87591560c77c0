"""The synthetic generator's fast paths draw exactly what its direct formulation draws (z and the noise
tied by gathers along the layers), which made the stored draws: the same units, in the same order.
The long-lived hot set: validated, off by default without a trace changing, and it widens FIFO's
miss rate over LRU's by what evicting each hot unit once per turn of the cache gives."""
import hashlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from hisparse import synthetic
from hisparse.policies import simulate
from hisparse.synthetic import SyntheticConfig, generate, preset


def _direct_heavy_hitters(z, root, cfg, n, threshold, g_noise):
    """`synthetic._heavy_hitters` written directly, on z [regular, units] and root (`_tie_roots`)."""
    h, clip = cfg.k - cfg.sinks - cfg.window, synthetic._NOISE_CLIP
    eligible = z[:, cfg.sinks:n - cfg.window]

    def top(cand):
        e = torch.randn(eligible.shape[0], len(cand), generator=g_noise).clamp_(-clip, clip)
        e = e.gather(0, root.index_select(1, cfg.sinks + cand))
        vals, pos = torch.topk(eligible.index_select(1, cand) + cfg.noise * e, h, dim=1)
        return (cfg.sinks + cand[pos]).numpy(), float(vals[:, -1].min())

    cut = threshold - 0.1 - cfg.noise * clip
    cand = (eligible > cut).any(0).nonzero().squeeze(1)
    if len(cand) >= h:
        chosen, lowest = top(cand)
        if lowest > cut + cfg.noise * clip:
            return chosen, lowest
    return top(torch.arange(eligible.shape[1]))


@pytest.mark.parametrize("overrides", [
    {},                                                              # the fitted drift and persistence
    {"drift": 0.0, "persistence": 0.0, "random_layers": 0},
    {"layer_similarity": 0.0, "unit_size": 4, "context": 12_000},
    {"layer_similarity": 1.0, "drift": 1.0},
    {"noise": 5.0, "context": 300, "k": 200},                        # the candidate filter reruns over all units
    {"hot": 0.2, "hot_lifetime": 3.0},                                # hot units pinned above and below the rest
])
def test_heavy_hitters_match_the_direct_formulation(monkeypatch, overrides):
    fast, steps = synthetic._heavy_hitters, []

    def checked(peak, own, flat, cfg, n, threshold, g_noise):
        root = flat.view_as(own) // own.shape[1]
        z = own.gather(0, root)
        assert torch.equal(peak, z.amax(0))
        direct = torch.Generator().set_state(g_noise.get_state())
        expected = _direct_heavy_hitters(z, root, cfg, n, threshold, direct)
        got = fast(peak, own, flat, cfg, n, threshold, g_noise)
        assert np.array_equal(got[0], expected[0]) and got[1] == expected[1]
        assert torch.equal(g_noise.get_state(), direct.get_state())          # the same noise drawn
        steps.append(n)
        return got

    monkeypatch.setattr(synthetic, "_heavy_hitters", checked)
    cfg = preset("dsa_100k", **{"layers": 6, "context": 3000, "steps": 8, "k": 256, **overrides})
    synthetic._generate_request(cfg, 7)
    assert len(steps) == cfg.steps


# Drawn before the hot set existed (commit db83f80): with hot = 0 a trace is bitwise what it was.
PINNED = SyntheticConfig(context=3000, steps=12, k=128, layers=4, random_layers=1, batch=2, noise=0.17,
                         drift=0.2, persistence=0.85, seed=3)
PINNED_SHA256 = "d2d9f5473600eb4cbf64a1ba7d4383f8a14a494771a1ef0edebd5a760669de1f"


def test_hot_set_off_by_default_leaves_traces_unchanged():
    assert PINNED.hot == 0
    assert hashlib.sha256(generate(PINNED).selections.tobytes()).hexdigest() == PINNED_SHA256
    # the hot set's rate and lifetime mean nothing while it is off
    off = SyntheticConfig(**{**{f: getattr(PINNED, f) for f in PINNED.__slots__}, "hot_rate": 0.9, "hot_lifetime": 7.0})
    assert hashlib.sha256(generate(off).selections.tobytes()).hexdigest() == PINNED_SHA256


@pytest.mark.parametrize("field, value, message", [
    ("hot", -0.1, r"hot \(the hot set's share of the heavy hitters\) must be in \[0, 1\), got -0.1"),
    ("hot", 1.0, r"hot \(the hot set's share of the heavy hitters\) must be in \[0, 1\), got 1.0"),
    ("hot", "0.2", "hot must be a finite number, got '0.2'"),
    ("hot_rate", 0.0, r"hot_rate must be in \(0, 1\], got 0.0"),
    ("hot_rate", 1.5, r"hot_rate must be in \(0, 1\], got 1.5"),
    ("hot_rate", float("nan"), "hot_rate must be a finite number, got nan"),
    ("hot_lifetime", 0.5, "hot_lifetime must be >= 1 step, got 0.5"),
    ("hot_lifetime", float("inf"), "hot_lifetime must be a finite number, got inf"),
])
def test_hot_set_fields_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        preset("tiny", **{field: value})


def test_hot_set_is_a_share_of_the_heavy_hitters_and_random_layers_have_none():
    assert preset("dsa_100k").hot_units() == 567                            # of 2048 - 4 - 64
    assert preset("dsa_100k", k=512).hot_units() == round(0.28636 * 444)   # a caller's k keeps the share
    random_only = preset("tiny", layers=2, random_layers=2, model_layers=None, hot=0.3)
    assert generate(random_only).selections.shape == (30, 2, 1, 32)


def test_hot_units_are_selected_at_their_rate_and_tied_layers_share_them():
    cfg = SyntheticConfig(context=5000, steps=400, k=64, layers=2, random_layers=0, sinks=2, window=6,
                          noise=5.0, drift=1.0, layer_similarity=1.0, hot=10 / 56, hot_rate=0.3, hot_lifetime=1e6)
    sel = generate(cfg).selections[:, :, 0]                                 # [steps, layers, k]
    assert np.array_equal(sel[:, 0], sel[:, 1])                             # layer 1 is tied to layer 0 on every unit
    counts = np.bincount(sel[:, 0, cfg.sinks + cfg.window:].ravel(), minlength=cfg.context + cfg.steps)
    hot = np.argsort(counts)[-10:]             # scores redrawn with noise 5 every step: nothing else recurs
    assert cfg.hot_units() == 10 and counts[np.argsort(counts)[-11]] < 20
    np.testing.assert_allclose(counts[hot].mean() / cfg.steps, cfg.hot_rate, atol=0.03)  # 4000 flips: sd 0.007


def test_hot_set_widens_fifo_over_lru_by_one_eviction_per_turn():
    """Heavy hitters redrawn every step (noise 5, drift 1 over 20K units) almost never recur, so FIFO
    and LRU miss alike (sinks and window are hits in both). A hot unit selected every other step
    stays in LRU (it would have to be skipped (B - k) / m = 4 steps in a row, 1 in 16, to sink to
    the tail), but FIFO evicts it once per turn of the cache (B fills, B / m steps at m misses a
    step), whether or not it was just used, and it misses when next selected: hot units add about
    hot * m / B misses a step to FIFO's. The test asks for at least 0.4 of that (measured: 0.6)."""
    base = SyntheticConfig(context=20_000, steps=200, k=64, layers=2, random_layers=0, sinks=2, window=6,
                           noise=5.0, drift=1.0)
    slots, gaps = 4 * base.k, {}
    for hot in (0, 24):                                                     # units of h = 56
        sel, _ = generate(replace(base, hot=hot / 56)).streams()
        lru, fifo = simulate(sel, "lru", slots), simulate(sel, "fifo", slots)
        gaps[hot] = fifo.miss_rate() - lru.miss_rate()
        misses_per_step = fifo.misses.mean()
    assert abs(gaps[0]) < 0.002, gaps
    assert gaps[24] > 0.4 * 24 * misses_per_step / slots / base.k, (gaps, misses_per_step)

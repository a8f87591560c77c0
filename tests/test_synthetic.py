"""The synthetic generator's fast paths draw exactly what its direct formulation draws (z and the noise
tied by gathers along the layers), which made the stored draws: the same units, in the same order."""
import numpy as np
import pytest
import torch

from hisparse import synthetic
from hisparse.synthetic import preset


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

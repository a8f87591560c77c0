"""Building blocks shared by the three families: RMSNorm, rotary embeddings, gated MLP, attention.

Each follows the Hugging Face eager implementation operation by operation (same dtype casts), so
float32 logits agree to rounding.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the Llama / DeepSeek MLP."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(params: dict, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scaling for `default`, `llama3` and `yarn` RoPE (as transformers)."""
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    factor = params["factor"]
    old_len = params["original_max_position_embeddings"]
    if kind == "llama3":
        low_factor, high_factor = params["low_freq_factor"], params["high_freq_factor"]
        low_wavelen, high_wavelen = old_len / low_factor, old_len / high_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_factor) / (high_factor - low_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


def mla_softmax_scale(params: dict, qk_head_dim: int) -> float:
    """DeepSeek's softmax scale: qk_head_dim^-0.5, times mscale_all_dim^2 under yarn."""
    scale = qk_head_dim ** -0.5
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        scale *= _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


class Rotary(nn.Module):
    """cos/sin tables per position, `cat(freqs, freqs)` layout, as transformers' rotary embedding."""

    def __init__(self, params: dict, dim: int):
        super().__init__()
        self.params, self.dim = params, dim
        inv_freq, self.scaling = rope_inv_freq(params, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def materialize(self, device: torch.device) -> None:
        """Recompute the table on `device` (after building the model on the meta device)."""
        with torch.device("cpu"):
            self.inv_freq = rope_inv_freq(self.params, self.dim)[0].to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved (half-split) RoPE; cos/sin broadcast against x."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved-pair RoPE, output de-interleaved (as transformers)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """Eager attention: q [..., S, D], k [..., T, D], v [..., T, Dv], mask True where allowed."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)

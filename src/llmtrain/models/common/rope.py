"""Rotary position embeddings (RoPE) and ALiBi slopes.

RoPE here is computed from ``position_ids`` on the fly: the module keeps only the inverse frequencies (a
non-persistent buffer of ``rotary_dim / 2`` floats, recomputed by ``init_weights`` so a meta-device build
works) and turns positions into cos/sin once per forward. Positions can therefore restart per document in a
packed sequence, run past the training length in generation, and be any shape ``[B, T]``.

Two layouts of the rotated pairs exist in the wild and both are supported:

* half (Llama / Qwen as stored by Hugging Face): dimension ``i`` pairs with ``i + rotary_dim / 2``;
* interleaved (GLM-4, Meta's original Llama code): dimension ``2i`` pairs with ``2i + 1``.

Only the first ``rotary_dim`` dimensions of a head are rotated (GLM-4 rotates half of each head); the rest
pass through. Frequency scaling: none, ``linear`` (positions divided by ``factor``) and Llama 3.1's
``llama3`` (long wavelengths divided by ``factor``, a smooth ramp between ``low_freq_factor`` and
``high_freq_factor``), with the same float arithmetic as the reference so logits match to ~1e-6.

ALiBi (Baichuan 2 13B) adds ``slope_h * (j - i)`` to the attention score of query ``i`` and key ``j``; the
slopes follow Press et al.: a geometric sequence for the largest power of two <= heads, then every other
slope of the doubled sequence for the rest.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device | None = None
) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` (fp32), with optional linear or Llama 3 scaling."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponent)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies; maps positions ``[B, T]`` to ``(cos, sin)`` of ``[B, T, rotary_dim/2]``."""

    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.rotary_dim, self.theta, self.scaling = rotary_dim, theta, scaling
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim, theta, scaling), persistent=False)

    def reset_buffers(self, device: torch.device | None = None) -> None:
        """Recompute ``inv_freq`` (after ``to_empty``, whose buffers hold garbage)."""
        self.inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling, device=device)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.float().to(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq  # [B, T, rotary_dim/2]
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x`` [B, T, H, head_dim]; cos/sin are [B, T, R/2]."""
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)  # [B, T, 1, R/2]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]  # [B, T, H, R/2] each
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def alibi_slopes(num_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """ALiBi slopes ``[num_heads]`` (Press et al. 2022; the recipe Baichuan 2 13B uses)."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two_slopes(closest)
    if closest != num_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device=device)

"""Rotary position embeddings (RoPE) with every frequency scaling Hugging Face uses, and ALiBi slopes.

RoPE here is computed from ``position_ids`` on the fly: the module keeps only the inverse frequencies (a
non-persistent buffer of ``rotary_dim / 2`` floats, recomputed by ``reset_buffers`` so a meta-device build
works) and turns positions into cos/sin once per forward. Positions can therefore restart per document in a
packed sequence, run past the training length in generation, and be any shape ``[B, T]``.

Two layouts of the rotated pairs exist in the wild and both are supported:

* half (Llama / Qwen as stored by Hugging Face): dimension ``i`` pairs with ``i + rotary_dim / 2``;
* interleaved (GLM-4, Meta's original Llama code): dimension ``2i`` pairs with ``2i + 1``.

Only the first ``rotary_dim`` dimensions of a head are rotated (GLM-4 rotates half of each head); the rest
pass through. Frequency scaling (``rope_scaling["rope_type"]``), each with the float arithmetic of
transformers' ``modeling_rope_utils`` so logits match to ~1e-6:

* ``linear``   every inverse frequency divided by ``factor`` (position interpolation);
* ``dynamic``  NTK-aware: once a forward's largest position + 1 exceeds ``max_position_embeddings`` the base
  grows to ``theta * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2))`` (recomputed per forward from the
  positions, without state: transformers keeps the largest length seen so far, so its later shorter forwards
  can differ);
* ``yarn``     interpolation for long wavelengths, extrapolation for short ones, a linear ramp between
  ``beta_fast`` and ``beta_slow`` rotations, cos/sin scaled by ``attention_factor`` (default
  ``0.1 * ln(factor) + 1``, or the ``mscale`` / ``mscale_all_dim`` ratio);
* ``llama3``   Llama 3.1: long wavelengths divided by ``factor``, a smooth ramp between ``low_freq_factor``
  and ``high_freq_factor``;
* ``longrope`` per-dimension ``short_factor`` / ``long_factor`` (long once the largest position + 1 exceeds
  ``original_max_position_embeddings``), cos/sin scaled by ``attention_factor``.

:func:`normalize_rope_scaling` checks a ``rope_scaling`` value (from YAML or config.json) and returns the one
dict form the model reads; a setting it does not know is refused, never dropped.

ALiBi (Baichuan 2 13B) adds ``slope_h * (j - i)`` to the attention score of query ``i`` and key ``j``; the
slopes follow Press et al.: a geometric sequence for the largest power of two <= heads, then every other
slope of the doubled sequence for the rest.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmtrain.errors import ConfigError

# rope_type -> (required keys, optional keys) besides rope_type itself.
ROPE_SCALING_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "longrope": (
        ("short_factor", "long_factor", "original_max_position_embeddings"),
        ("factor", "attention_factor"),
    ),
}
OFF_SPELLINGS = ("none", "off", "default")
"""Strings that turn RoPE scaling off explicitly (``rope_scaling: null`` in YAML means "the flavor's")."""


def normalize_rope_scaling(
    value: Any,
    max_positions: int | None = None,
    rotary_dim: int | None = None,
    where: str = "model.rope_scaling",
) -> dict[str, Any] | None:
    """None (no scaling), a number (linear factor), an off spelling or a mapping -> a checked dict copy or None.

    ``max_positions`` fills ``original_max_position_embeddings`` where a type needs it and it is absent (as
    transformers does); ``rotary_dim`` checks the length of longrope's factor lists. ``where`` names the key in
    messages (``model.rope_scaling`` or ``config.json rope_scaling``)."""
    if value is None or (isinstance(value, str) and value.lower() in OFF_SPELLINGS):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise ConfigError(
            f"{where} must be null, none (off), a number (linear factor) or a mapping like {{rope_type: llama3, "
            f"factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192}}; got "
            f"{value!r}."
        )
    if not isinstance(value, dict):
        if not value > 0:
            raise ConfigError(f"{where} factor must be positive, got {value!r}.")
        return {"rope_type": "linear", "factor": float(value)}
    scaling = dict(value)
    legacy = scaling.pop("type", None)
    kind = (
        scaling.pop("rope_type", None) or legacy or ("llama3" if "low_freq_factor" in scaling else "linear")
    )
    if kind == "default":
        if scaling:
            raise ConfigError(
                f"{where} of type default takes no parameters, got {', '.join(sorted(scaling))}."
            )
        return None
    if kind not in ROPE_SCALING_KEYS:
        raise ConfigError(
            f"{where}.rope_type {kind!r} is not supported; supported: default (none), "
            f"{', '.join(ROPE_SCALING_KEYS)}."
        )
    required, optional = ROPE_SCALING_KEYS[kind]
    if "original_max_position_embeddings" in required and "original_max_position_embeddings" not in scaling:
        if max_positions is not None:
            scaling["original_max_position_embeddings"] = max_positions
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ConfigError(f"{where} of type {kind} lacks {', '.join(missing)}.")
    unknown = sorted(set(scaling) - set(required) - set(optional))
    if unknown:
        raise ConfigError(
            f"{where} of type {kind} has {', '.join(unknown)}, which llmtrain does not implement (known: "
            f"{', '.join(required + optional)}); remove it or convert the model with a tool that applies it."
        )
    for key in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "attention_factor",
        "beta_fast",
        "beta_slow",
    ):
        v = scaling.get(key)
        if (
            key in scaling
            and v is not None
            and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0)
        ):
            raise ConfigError(f"{where}.{key} must be a positive number, got {v!r}.")
    original = scaling.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        raise ConfigError(
            f"{where}.original_max_position_embeddings must be a positive integer, got {original!r}."
        )
    if kind == "llama3" and not float(scaling["high_freq_factor"]) > float(scaling["low_freq_factor"]):
        raise ConfigError(f"{where}.high_freq_factor must be larger than low_freq_factor.")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            v = scaling[key]
            ok = isinstance(v, list) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in v
            )
            if not ok or (rotary_dim is not None and len(v) != rotary_dim // 2):
                need = f" of {rotary_dim // 2} numbers (rotary_dim / 2)" if rotary_dim is not None else ""
                raise ConfigError(f"{where}.{key} must be a list{need}, got {v!r}.")
    return {"rope_type": kind, **scaling}


def _exponents(rotary_dim: int, device: torch.device | None) -> torch.Tensor:
    """``[0, 2, ..., d - 2] / d`` in fp32 (the exponent of theta for each rotated pair)."""
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    d: int, theta: float, s: dict[str, Any], max_positions: int, device: torch.device | None
) -> tuple[torch.Tensor, float]:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / original
    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = float(_mscale(factor, m) / _mscale(factor, m_all)) if m and m_all else _mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, d, 2).to(device=device, dtype=torch.float) / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp.to(device=device, dtype=torch.float)  # 1: extrapolate (high frequency), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_context = float(s["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_attention_factor(s: dict[str, Any], max_positions: int) -> float:
    """LongRoPE's cos/sin scale: ``attention_factor``, else ``sqrt(1 + ln f / ln original)`` (1 for f <= 1)."""
    original = s["original_max_position_embeddings"]
    factor = s.get("factor")
    if factor is None:
        factor = max_positions / original
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_parameters(
    rotary_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_positions: int = 2048,
    device: torch.device | None = None,
    long: bool = False,
) -> tuple[torch.Tensor, float]:
    """``(inverse frequencies [rotary_dim // 2] fp32, attention factor)`` at rest (dynamic: up to
    ``max_positions``; longrope: the short factors unless ``long``)."""
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "yarn":
        assert scaling is not None
        return _yarn(rotary_dim, theta, scaling, max_positions, device)
    inv_freq = 1.0 / (theta ** _exponents(rotary_dim, device))
    if scaling is None or kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "longrope":
        ext = torch.tensor(
            scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device=device
        )
        return 1.0 / (ext * theta ** _exponents(rotary_dim, device)), longrope_attention_factor(
            scaling, max_positions
        )
    raise ValueError(f"unknown rope_type {kind!r}")  # normalize_rope_scaling refuses it first


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device | None = None
) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` (fp32) at rest; see :func:`rope_parameters`."""
    return rope_parameters(rotary_dim, theta, scaling, device=device)[0]


def dynamic_inv_freq(
    rotary_dim: int, theta: float, factor: float, max_positions: int, seq_len: torch.Tensor
) -> torch.Tensor:
    """Dynamic NTK inverse frequencies for a forward whose largest position + 1 is ``seq_len`` (an int64 tensor,
    so no host sync); the base is computed in fp32 as transformers does."""
    seq = torch.maximum(seq_len, torch.tensor(max_positions, dtype=seq_len.dtype, device=seq_len.device))
    base = theta * ((factor * seq / max_positions) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return 1.0 / (base ** _exponents(rotary_dim, seq_len.device))


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies; maps positions ``[B, T]`` to ``(cos, sin)`` of ``[B, T, rotary_dim/2]``."""

    def __init__(
        self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int = 2048
    ) -> None:
        super().__init__()
        self.rotary_dim, self.theta, self.scaling = rotary_dim, theta, scaling
        self.max_positions = max_positions
        self.kind = (scaling or {}).get("rope_type", "default")
        inv_freq, self.attention_factor = rope_parameters(rotary_dim, theta, scaling, max_positions)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if self.kind == "longrope":
            long, _ = rope_parameters(rotary_dim, theta, scaling, max_positions, long=True)
            self.register_buffer("inv_freq_long", long, persistent=False)

    def reset_buffers(self, device: torch.device | None = None) -> None:
        """Recompute the frequency buffers (after ``to_empty``, whose buffers hold garbage)."""
        self.inv_freq = rope_parameters(
            self.rotary_dim, self.theta, self.scaling, self.max_positions, device
        )[0]
        if self.kind == "longrope":
            args = (self.rotary_dim, self.theta, self.scaling, self.max_positions, device)
            self.inv_freq_long = rope_parameters(*args, long=True)[0]

    def _inv_freq(self, position_ids: torch.Tensor) -> torch.Tensor:
        inv_freq = self.inv_freq.float().to(position_ids.device)
        if self.kind not in ("dynamic", "longrope"):
            return inv_freq
        assert self.scaling is not None
        seq_len = position_ids.max().to(torch.int64) + 1  # stays on the device (no sync)
        if self.kind == "dynamic":
            args = (self.rotary_dim, self.theta, float(self.scaling["factor"]), self.max_positions)
            return torch.where(seq_len > self.max_positions, dynamic_inv_freq(*args, seq_len), inv_freq)
        long = self.inv_freq_long.float().to(position_ids.device)
        return torch.where(seq_len > self.scaling["original_max_position_embeddings"], long, inv_freq)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self._inv_freq(position_ids)  # [B, T, rotary_dim/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:  # yarn / longrope scale cos and sin (the attention temperature)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin


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

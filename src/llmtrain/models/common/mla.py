"""Multi-head latent attention (DeepSeek-V2/V3): keys and values from a compressed latent, a shared rotary key.

One forward over ``x [B, T, dim]`` with ``H`` heads (parameter names torchtitan's, the HF names in
``models/deepseek/hf.py``)::

    q        = wq(x)                      or  wq_b(q_norm(wq_a(x)))   (q_lora_rank > 0)   [B, T, H, nope + rope]
    latent   = kv_norm(wkv_a(x))                                                        [B, T, kv_lora_rank]
    k_rope   = RoPE(wk_rope(x))           one rotary key shared by every head            [B, T, 1, rope]
    q_rope   = RoPE(q[..., nope:])
    -- the KV cache stores (latent, k_rope) per position: kv_lora_rank + rope numbers, not 2 x H x head dims --
    k_nope, v = split(wkv_b(latent))                                                    [B, S, H, nope], [B, S, H, v]
    out      = wo(softmax(q . [k_nope, k_rope] * scale) v)

Hugging Face stores ``wkv_a`` and ``wk_rope`` as one ``kv_a_proj_with_mqa`` ``[kv_lora_rank + rope, dim]``; they
are kept apart here so a tensor-parallel plan can treat the rotary key on its own (its gradient sums over all
heads, so it needs a reduction over the TP ranks that the latent, reduced inside ``wkv_b``'s column shard, does
not: ``models/deepseek/tp.py``).

As in transformers' ``DeepseekV3Attention``: the latent and query norms use eps 1e-6 whatever ``rms_norm_eps``
is, ``rope_interleaved`` (HF ``rope_interleave``, default true) rotates adjacent pairs of the rotary dims, and
the softmax scale is ``(nope + rope) ** -0.5`` times ``mscale ** 2`` with ``mscale = 0.1 * mscale_all_dim *
ln(factor) + 1`` for yarn RoPE scaling that sets ``mscale_all_dim`` (DeepSeek-V3: factor 40, so 1.87x); the
yarn cos/sin factor (``mscale / mscale_all_dim``, 1 for DeepSeek-V3) is the rotary embedding's own.

Under context parallel (distributed/context_parallel.py) each rank projects its own chunks, rotates the
queries and the rotary key at their global positions, and all-gathers the compressed KV (the latent and the
rotary key: ``kv_lora_rank + rope`` numbers per position, one all-gather) rather than the expanded keys and
values (``H x (nope + rope + v)``); every rank then expands all positions with ``wkv_b`` for its local queries,
and the gather's backward reduce-scatters the latent's gradient.

The value heads are zero-padded to the query / key head width (or, when wider, the queries and keys to
theirs) before ``scaled_dot_product_attention`` and the output cut back: the fused kernels want one head width
(CPU's flash kernel, CUDA's flash), and without it SDPA falls back to the math kernel on CPU, which keeps the
``B x H x T x S`` probabilities for backward (at 256 tokens twice the rest of a debug block).

The local number of heads is read from the projected shapes, so a column-wise shard of ``wq``/``wq_b`` and
``wkv_b`` (and a row-wise ``wo``) works unchanged. :func:`check_mla_args` validates the fields at resolution.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.attention import AttentionMask, sdpa_mask
from llmtrain.models.common.kv_cache import KVCache
from llmtrain.models.common.layers import RMSNorm
from llmtrain.models.common.rope import apply_rope

LATENT_NORM_EPS = 1e-6
"""transformers' DeepseekV3RMSNorm default, used for q_a_layernorm and kv_a_layernorm (not rms_norm_eps)."""


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1): YaRN's attention temperature."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(args: TransformerArgs) -> float:
    """``(qk_nope + qk_rope) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under such yarn scaling."""
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    s = args.rope_scaling or {}
    if s.get("rope_type") == "yarn" and s.get("mscale_all_dim"):
        scale *= yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"])) ** 2
    return scale


class MultiHeadLatentAttention(nn.Module):
    """MLA with optional query compression and a KV cache of the latent (see the module docstring)."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        d, h = args.hidden_size, args.num_heads
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        qk = self.nope + self.rope_dim
        self.rope_interleaved = args.rope_interleaved
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if args.q_lora_rank:
            self.wq_a = nn.Linear(d, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, h * qk, bias=False)
        else:
            self.wq = nn.Linear(d, h * qk, bias=False)
        self.wkv_a = nn.Linear(d, args.kv_lora_rank, bias=False)
        self.wk_rope = nn.Linear(d, self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, d, bias=False)
        self.softmax_scale = mla_softmax_scale(args)
        self.context_parallel: Any = None  # distributed/context_parallel.py sets it: the gathered latent

    def reset_buffers(self, device: torch.device | None = None) -> None:
        """No buffers (the rotary tables are the model's); kept for ``Transformer.init_weights``."""

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: AttentionMask,
        cache: KVCache | None = None,
        layer_key: str = "",
    ) -> torch.Tensor:
        assert rope is not None, "MLA needs the rotary embedding (check_mla_args refuses alibi)"
        bsz, seqlen, _ = x.shape
        cos, sin = rope
        if self.wq is not None:
            q = self.wq(x)
        else:
            assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, -1, self.nope + self.rope_dim)  # [B, T, H_local, nope + rope]
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, self.rope_interleaved)
        latent = self.kv_norm(self.wkv_a(x))  # [B, T, r]
        k_rope = apply_rope(self.wk_rope(x).view(bsz, seqlen, 1, -1), cos, sin, self.rope_interleaved)
        if cache is not None:  # the cache holds the latent and the rotary key: [B, 1, past + T, r | rope]
            latent_all, k_rope_all = cache.update(layer_key, latent[:, None], k_rope.transpose(1, 2))
            latent, k_rope = latent_all[:, 0], k_rope_all.transpose(1, 2)  # [B, S, r], [B, S, 1, rope]
        if self.context_parallel is not None:  # every CP rank's latent and rotary key (mask: the model's)
            latent, k_rope = self.context_parallel.gather_latent(latent, k_rope)  # [B, T, r], [B, T, 1, rope]
        kv = self.wkv_b(latent)  # [B, S, H_local * (nope + v)]
        kv = kv.view(bsz, kv.shape[1], -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, S, H_local, nope], [B, S, H_local, v]
        k = torch.cat(
            (k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1
        )  # [B, S, H_local, nope+rope]
        q = torch.cat((q_nope, q_rope), dim=-1)
        width = self.nope + self.rope_dim
        if self.v_dim < width:  # one head width for all three, so that the fused kernel serves it (below)
            v = F.pad(v, (0, width - self.v_dim))
        elif self.v_dim > width:  # zeros in q and k change no score (the scale is explicit)
            q, k = F.pad(q, (0, self.v_dim - width)), F.pad(k, (0, self.v_dim - width))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H_local, T or S, .]
        attn_mask = sdpa_mask(mask, q.dtype)  # the forward's shared additive mask
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=mask.is_causal and attn_mask is None,
            scale=self.softmax_scale,
        )  # [B, H_local, T, max(nope + rope, v)]
        return self.wo(out.transpose(1, 2)[..., : self.v_dim].reshape(bsz, seqlen, -1))


def check_mla_args(values: dict[str, Any]) -> None:
    """Validate the MLA fields of a resolved argument dict; with MLA set ``head_dim`` (the rotary width) and
    ``num_kv_heads`` (every head has its own keys). ConfigError naming the ``model.*`` key otherwise."""
    from llmtrain.errors import ConfigError

    keys = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for key in keys:
        v = values.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"model.{key} must be an integer >= 0, got {v!r}.")
    if not values.get("kv_lora_rank"):
        stray = [f"model.{k}" for k in keys[1:] if values.get(k)]
        if stray:
            raise ConfigError(
                f"{', '.join(stray)} {'is' if len(stray) == 1 else 'are'} set but model.kv_lora_rank is 0: these "
                "configure multi-head latent attention, which kv_lora_rank > 0 turns on."
            )
        return
    rope, heads = values.get("qk_rope_head_dim", 0), values["num_heads"]
    if rope < 2 or rope % 2 or not values.get("v_head_dim"):
        raise ConfigError(
            f"multi-head latent attention (model.kv_lora_rank {values['kv_lora_rank']}) needs an even "
            f"model.qk_rope_head_dim >= 2 and a model.v_head_dim > 0 (got {rope!r} and "
            f"{values.get('v_head_dim')!r}); DeepSeek-V3 uses 64 and 128."
        )
    for key, want in (("head_dim", rope), ("num_kv_heads", heads)):
        if values.get(key) is not None and values[key] != want:
            raise ConfigError(
                f"model.{key} {values[key]} conflicts with multi-head latent attention, where it is {want} "
                f"({'qk_rope_head_dim' if key == 'head_dim' else 'num_heads'}); leave model.{key} unset."
            )
        values[key] = want
    off = {
        "position_embedding": ("rope", values.get("position_embedding", "rope")),
        "partial_rotary_factor": (1.0, values.get("partial_rotary_factor", 1.0)),
        "qkv_bias": (False, values.get("qkv_bias", False)),
        "attention_out_bias": (False, values.get("attention_out_bias", False)),
        "qk_norm": (False, values.get("qk_norm", False)),
        "sliding_window": (0, values.get("sliding_window", 0)),
    }
    bad = [f"model.{k} {got!r} (needs {want!r})" for k, (want, got) in off.items() if got != want]
    if bad:
        raise ConfigError(
            f"multi-head latent attention (model.kv_lora_rank > 0) does not combine with {', '.join(bad)}; "
            "llmtrain's MLA is DeepSeek-V3's: RoPE on the qk_rope_head_dim dims, no attention biases, no QK-norm, "
            "no sliding window."
        )

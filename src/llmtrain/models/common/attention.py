"""Grouped-query self-attention through ``scaled_dot_product_attention``, with document masks and ALiBi.

The masks are decided once per forward by :func:`build_masks` (the one constructor: full + sliding, SDPA or
FlexAttention per ``model.attention``) and shared by all layers. With flex (models/common/flex.py) they are
block masks, ALiBi a score mod, and nothing below applies; the dense SDPA masks of :func:`build_attention_mask`:

* plain causal training / prefill: no tensor at all, ``is_causal=True`` so SDPA can pick flash kernels;
* packed documents (``document_ids [B, T]``): a block-causal boolean mask ``[B, 1, T, T]`` (query i sees
  key j iff j <= i and both carry the same document id);
* incremental decoding with a KV cache: one new token needs no mask; a chunk of several new tokens after
  cached ones gets an offset causal mask ``[1, 1, Tq, Tk]``;
* ALiBi adds ``slope_h * (j - i)`` to the scores and -inf where the boolean mask forbids. Only the index
  difference enters, so a document packed behind others gets the same bias as when it stands alone.
* sliding window ``w`` (Mistral, Qwen): a second mask, ``AttentionMask.sliding``, also forbids keys with
  ``j <= i - w`` (Hugging Face's ``kv_idx > q_idx - w``), a banded causal boolean mask for SDPA; blocks built
  with ``sliding=True`` use it. While every key is inside the window (``past + T <= w``) it is the plain
  causal mask itself, so short sequences keep the fused causal kernels. With a KV cache the cache keeps every
  position and the band hides the old ones (decoding one token past the window gets a ``[1, 1, 1, Tk]`` mask).
* one additive mask per forward: SDPA turns a boolean mask into an additive one (0 where allowed, -inf
  where not, the query dtype) on every call, and autograd saves that copy, so each layer would keep its own
  ``Tq x Tk`` tensor. :func:`build_masks` builds it once (``AttentionMask.additive``, and the sliding twin's),
  in the dtype the queries will have (:func:`query_dtype`: autocast's, else the hidden states'), and every
  layer passes that same tensor (:func:`sdpa_mask`), so autograd saves one tensor shared by all layers. The
  numbers are SDPA's own conversion, so bitwise the same. It is built by the caller of the blocks
  (``Transformer.forward``; under context parallel ``ContextParallel.masks``), never inside a block, which
  ``torch.compile`` may wrap. A mask of another dtype than the queries (an eval without the autocast it was
  built under) falls back to the boolean mask, converted by SDPA per call. ALiBi keeps its per-layer bias
  (it has a head dimension), flex its block masks.

The attention never trusts ``args.num_heads`` at run time: it infers the local number of query and key/value
heads from the projected shapes, so a tensor-parallel plan that shards ``wq/wk/wv`` column-wise (and ``wo``
row-wise) works unchanged. ALiBi's ``alibi_slopes`` buffer ``[num_heads]`` must then be sharded like the
heads by that plan: it sets ``alibi_heads`` (this rank's ``(start, stop)`` query heads), and the buffer, here
and whenever :meth:`Attention.reset_buffers` recomputes it, holds only those heads' slopes. GQA is SDPA's own ``enable_gqa``: query head h reads kv head ``h // (num_heads /
num_kv_heads)`` (the Hugging Face ``repeat_kv`` order) without materialising repeated keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.flex import FlexMask, choose_attention, document_block_mask, flex_attend
from llmtrain.models.common.kv_cache import KVCache
from llmtrain.models.common.layers import RMSNorm
from llmtrain.models.common.rope import alibi_slopes, apply_rope


@dataclass
class AttentionMask:
    """How every layer masks attention in one forward (see the module docstring)."""

    is_causal: bool
    allowed: torch.Tensor | None = None
    """Boolean ``[B or 1, 1, Tq, Tk]``; True where query i may attend to key j."""
    rel_pos: torch.Tensor | None = None
    """``[Tq, Tk]`` fp32 key index minus query index (ALiBi only)."""
    additive: torch.Tensor | None = None
    """``allowed`` as SDPA's additive mask (0 / -inf, the queries' dtype), one tensor for every layer."""
    sliding: AttentionMask | None = None
    """The same mask restricted to the sliding window (None: the model has no window)."""
    flex: FlexMask | None = None
    """FlexAttention's block mask (models/common/flex.py); when set, ``allowed`` is None and unused."""


def build_attention_mask(
    q_len: int,
    past_len: int,
    document_ids: torch.Tensor | None,
    alibi: bool,
    device: torch.device,
    window: int = 0,
) -> AttentionMask:
    """Mask for ``q_len`` new queries after ``past_len`` cached keys (0 without a cache); ``window`` > 0 also
    hides keys ``window`` or more positions behind the query."""
    k_len = past_len + q_len
    q_idx = torch.arange(past_len, k_len, device=device)  # absolute query positions [Tq]
    k_idx = torch.arange(k_len, device=device)  # [Tk]
    allowed: torch.Tensor | None = None
    if document_ids is not None:
        if past_len:
            raise ValueError("document_ids cannot be combined with a KV cache that already holds tokens")
        same_doc = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
        allowed = (same_doc & (k_idx[None, :] <= q_idx[:, None]))[:, None]  # [B, 1, T, T]
    elif (past_len > 0 or alibi) and q_len > 1:
        allowed = (k_idx[None, :] <= q_idx[:, None])[None, None]  # [1, 1, Tq, Tk]
    if 0 < window < k_len:  # some key falls out of some query's window
        band = (k_idx[None, :] > q_idx[:, None] - window)[None, None]  # [1, 1, Tq, Tk]
        causal = (k_idx[None, :] <= q_idx[:, None])[None, None]
        allowed = band & (allowed if allowed is not None else causal)
    is_causal = allowed is None and q_len > 1
    rel_pos = (k_idx[None, :] - q_idx[:, None]).float() if alibi else None
    return AttentionMask(is_causal=is_causal, allowed=allowed, rel_pos=rel_pos)


def query_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the attention's queries get from hidden states ``x``: autocast's when it is on for ``x``'s
    device (the projections run in it), else ``x``'s own (the weights')."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def with_additive(mask: AttentionMask, dtype: torch.dtype | None) -> AttentionMask:
    """``mask`` (and its sliding twin) with ``additive`` set: SDPA's conversion of ``allowed`` in ``dtype``,
    ``zeros.masked_fill(~allowed, -inf)``. Nothing without a boolean mask, with ALiBi (its bias is built per
    layer) or without a ``dtype``."""
    if dtype is not None and mask.allowed is not None and mask.rel_pos is None:
        zeros = torch.zeros(mask.allowed.shape, dtype=dtype, device=mask.allowed.device)
        mask.additive = zeros.masked_fill_(~mask.allowed, float("-inf"))
    if mask.sliding is not None:
        with_additive(mask.sliding, dtype)
    return mask


def sdpa_mask(mask: AttentionMask, dtype: torch.dtype) -> torch.Tensor | None:
    """SDPA's ``attn_mask`` for queries of ``dtype``: the shared additive mask, or (another dtype, the fallback)
    the boolean one, which SDPA converts on this call."""
    if mask.additive is not None and mask.additive.dtype == dtype:
        return mask.additive
    return mask.allowed


def build_masks(
    q_len: int,
    past_len: int,
    document_ids: torch.Tensor | None,
    alibi: bool,
    device: torch.device,
    window: int = 0,
    impl: str = "sdpa",
    q_positions: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionMask:
    """Every mask of one forward (full and, with a ``window``, sliding) for attention ``impl`` = ``model.attention``
    (auto, sdpa, flex: :func:`~llmtrain.models.common.flex.choose_attention`). Flex masks are block masks over
    ``past_len + q_len`` keys; ``q_positions`` (flex only) places the queries among them (context parallel).
    With ``dtype`` (the queries', :func:`query_dtype`) dense masks also get their shared additive mask."""
    k_len = past_len + q_len
    if choose_attention(impl, document_ids, past_len, device) == "flex":
        mask = AttentionMask(
            is_causal=False, flex=document_block_mask(document_ids, q_len, k_len, device, 0, q_positions)
        )
        if 0 < window < k_len:
            flex = document_block_mask(document_ids, q_len, k_len, device, window, q_positions)
            mask.sliding = AttentionMask(is_causal=False, flex=flex)
        return mask
    mask = build_attention_mask(q_len, past_len, document_ids, alibi, device)
    if 0 < window < k_len:  # else every key is inside the window: the full mask is the same
        mask.sliding = build_attention_mask(q_len, past_len, document_ids, alibi, device, window)
    return with_additive(mask, dtype)


class Attention(nn.Module):
    """Multi-head attention with GQA, optional qkv / output bias, QK-norm, (partial) RoPE or ALiBi, a KV cache."""

    def __init__(self, args: TransformerArgs, sliding: bool = False) -> None:
        super().__init__()
        d, hd = args.hidden_size, args.head_dim
        self.sliding = sliding  # attends through ``mask.sliding`` (the window) when the forward has one
        self.head_dim = hd
        self.rope_interleaved = args.rope_interleaved
        self.wq = nn.Linear(d, args.num_heads * hd, bias=args.qkv_bias)
        self.wk = nn.Linear(d, args.num_kv_heads * hd, bias=args.qkv_bias)
        self.wv = nn.Linear(d, args.num_kv_heads * hd, bias=args.qkv_bias)
        self.wo = nn.Linear(args.num_heads * hd, d, bias=args.attention_out_bias)
        self.q_norm = RMSNorm(hd, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(hd, args.rms_norm_eps) if args.qk_norm else None
        self.alibi = args.position_embedding == "alibi"
        self.num_heads_total = args.num_heads
        self.alibi_heads: tuple[int, int] = (0, args.num_heads)  # query heads held here; a TP plan narrows it
        self.context_parallel: Any = None  # distributed/context_parallel.py sets it: the gathered K/V
        self.record_qk = False  # train/health.py turns it on for a log step: keep the attention-logit bound
        self.qk_bound: torch.Tensor | None = None  # the step's largest bound so far (:meth:`_record_bound`)
        if self.alibi:
            self.register_buffer("alibi_slopes", alibi_slopes(args.num_heads), persistent=False)

    def reset_buffers(self, device: torch.device | None = None) -> None:
        """Recompute the ALiBi slopes of the held heads (non-persistent, so garbage after ``to_empty``)."""
        if self.alibi:
            start, stop = self.alibi_heads
            self.alibi_slopes = alibi_slopes(self.num_heads_total, device=device)[start:stop]  # [H_local]

    @torch.no_grad()
    def _record_bound(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Keep the step's largest ``max |q| * max |k| / sqrt(head_dim)`` (an upper bound of every attention
        logit, which fused SDPA kernels never materialise), taken per sequence and per key/value head group
        (the queries of a group attend only its keys, in their own sequence): ``q [B, H, Tq, hd]``, ``k [B, KV,
        Tk, hd]`` after the KV cache / context-parallel gather. Per group, so a tensor-parallel rank (whole
        groups) or a data- or context-parallel one gets the same numbers as one process; the max over ranks is
        taken by train/health.py."""
        kv = k.shape[1]
        q_max = q.norm(dim=-1).amax(dim=-1).view(q.shape[0], kv, -1).amax(dim=-1)  # [B, KV]
        k_max = k.norm(dim=-1).amax(dim=-1)  # [B, KV]
        bound = (q_max.float() * k_max.float()).amax() / self.head_dim**0.5
        self.qk_bound = bound if self.qk_bound is None else torch.maximum(self.qk_bound, bound)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: AttentionMask,
        cache: KVCache | None = None,
        layer_key: str = "",
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        hd = self.head_dim
        if self.sliding and mask.sliding is not None:
            mask = mask.sliding
        q = self.wq(x).view(bsz, seqlen, -1, hd)  # [B, T, H_local, hd]
        k = self.wk(x).view(bsz, seqlen, -1, hd)  # [B, T, KV_local, hd]
        v = self.wv(x).view(bsz, seqlen, -1, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            cos, sin = rope
            q = apply_rope(q, cos, sin, self.rope_interleaved)
            k = apply_rope(k, cos, sin, self.rope_interleaved)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, hd]
        if cache is not None:
            k, v = cache.update(layer_key, k, v)  # [B, KV_local, past + T, hd]
        if self.context_parallel is not None:  # local queries vs every CP rank's keys (mask: the model's)
            k, v = self.context_parallel.gather_kv(k, v)
        if self.record_qk and not torch.compiler.is_compiling():  # health metric (train/health.py)
            self._record_bound(q, k)
        # Grouped-query attention inside SDPA (no repeated K/V copies in memory): ~15% faster attention on CPU.
        gqa = q.shape[1] != k.shape[1]

        if mask.flex is not None:  # block-sparse FlexAttention (ALiBi as a score mod)
            out = flex_attend(q, k, v, mask.flex, self.alibi_slopes if self.alibi else None)
            return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
        attn_mask = sdpa_mask(mask, q.dtype)
        if self.alibi:
            assert mask.rel_pos is not None
            slopes = self.alibi_slopes.to(device=q.device, dtype=torch.float32)
            bias = slopes[:, None, None] * mask.rel_pos[None]  # [H_local, Tq, Tk]
            if mask.allowed is not None:
                bias = bias.masked_fill(~mask.allowed, float("-inf"))  # [B or 1, H_local, Tq, Tk]
            attn_mask = bias.to(q.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=mask.is_causal and attn_mask is None, enable_gqa=gqa
        )  # [B, H_local, T, hd]
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)  # [B, T, H_local * hd]
        return self.wo(out)

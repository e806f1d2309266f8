"""FlexAttention for packed documents: a block-sparse mask built once per batch from document ids.

The dense path (attention.py) hands SDPA a boolean ``[B, 1, T, T]`` mask: O(T^2) memory per sample, and an
explicit mask keeps SDPA off its flash kernels. Here the same rule is a *mask mod* (query i sees key j iff
``j <= i``, both in the same document, and, for a sliding window ``w``, ``j > i - w``) from which
``create_block_mask`` records, per 128 x 128 tile, whether it is empty, full or partial: O((T/128)^2) memory,
and ``flex_attention`` skips the empty tiles (about half the causal work, most of it between documents).
ALiBi is a *score mod* adding ``slope_h * (j - i)``. Query positions may be given explicitly
(``q_positions``, absolute positions of the local queries among the keys): the hook for context parallel,
whose ranks hold load-balanced, non-contiguous query chunks and the gathered keys of the whole sequence.

Where it runs (torch 2.13): on CUDA the block mask and the attention are compiled (``torch.compile``; eager
flex materialises the full score matrix). On CPU flex runs forward only (no CPU backward in torch 2.13:
"FlexAttention does not support backward on CPU"), compiled in ~35 s cold per shape: tests use it eagerly
and without gradients. ``model.attention: auto`` therefore picks flex only on CUDA and only for batches with
document masks (:func:`choose_attention`); plain causal batches stay on SDPA's fused causal kernels.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from llmtrain.errors import ConfigError

COMPILE_ON_CPU = False
"""Compile flex on CPU too (forward only there; ~35 s per shape cold). bench/long_context.py sets it."""


@dataclass
class FlexMask:
    """One forward's FlexAttention mask: the block mask and, when not ``arange(Tq)``, the queries' positions."""

    block: Any  # torch.nn.attention.flex_attention.BlockMask
    q_positions: torch.Tensor | None = None


def flex_supported(device: torch.device) -> bool:
    """Whether flex can train here (forward and backward): CUDA only on torch 2.13."""
    return device.type == "cuda"


def choose_attention(
    setting: str, document_ids: torch.Tensor | None, past_len: int, device: torch.device
) -> str:
    """``sdpa`` or ``flex`` for ``model.attention`` = ``setting`` (auto, sdpa, flex) in one forward. A KV cache
    that already holds tokens (decoding) always uses SDPA."""
    if past_len > 0 or setting == "sdpa":
        return "sdpa"
    if setting == "flex":
        return "flex"
    if setting != "auto":
        raise ConfigError(f"model.attention: {setting!r} is not one of auto, sdpa, flex.")
    return "flex" if document_ids is not None and flex_supported(device) else "sdpa"


@cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def document_block_mask(
    document_ids: torch.Tensor | None,
    q_len: int,
    k_len: int,
    device: torch.device,
    window: int = 0,
    q_positions: torch.Tensor | None = None,
) -> FlexMask:
    """Block mask of causal (+ same document with ``document_ids [B, Tk]``, + ``window``) attention of ``q_len``
    queries at ``q_positions`` (default ``arange(q_len)``) over ``k_len`` keys."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        qp = q if q_positions is None else q_positions[q]
        ok = kv <= qp
        if document_ids is not None:
            ok = ok & (document_ids[b, qp] == document_ids[b, kv])
        if window > 0:
            ok = ok & (kv > qp - window)
        return ok

    batch = document_ids.shape[0] if document_ids is not None else 1
    build = _compiled(create_block_mask) if device.type == "cuda" or COMPILE_ON_CPU else create_block_mask
    block = build(mask_mod, batch, None, q_len, k_len, device=device)
    return FlexMask(block=block, q_positions=q_positions)


def flex_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: FlexMask,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``flex_attention`` of ``q [B, H, Tq, hd]`` over ``k, v [B, KV, Tk, hd]`` (GQA when KV < H) under
    ``mask``; ``alibi_slopes [H]`` adds ALiBi's ``slope_h * (j - i)``. Compiled on CUDA, eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    score_mod = None
    if alibi_slopes is not None:
        slopes, q_pos = alibi_slopes.to(device=q.device, dtype=torch.float32), mask.q_positions

        def score_mod(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
            qp = qi if q_pos is None else q_pos[qi]
            return score + slopes[h] * (kv - qp)

    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cuda" or COMPILE_ON_CPU:
        return _compiled(flex_attention)(q, k, v, score_mod=score_mod, block_mask=mask.block, enable_gqa=gqa)
    with warnings.catch_warnings():  # eager (CPU reference): "called without torch.compile()" is expected
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask.block, enable_gqa=gqa)

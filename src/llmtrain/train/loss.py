"""Cross-entropy over the output projection in token chunks, so ``[tokens, vocab]`` logits never live whole.

The plain loss (``TokenLoss`` in train/step.py) takes the model's logits ``[B, T, vocab]``: at a 128K vocabulary
and 8K tokens per micro-batch that is 4 GB of fp32 logits plus as much again for their gradient. Here the
model stops before its head and :func:`chunked_head_loss` runs ``head(h[chunk])`` -> fp32 cross-entropy
(summed, ignore index -100, label smoothing) one chunk of ``chunk_tokens`` tokens at a time, each chunk under
non-reentrant activation checkpointing: autograd keeps only the chunk's input (a view of ``h``), and backward
recomputes that chunk's logits, so forward and backward each hold one chunk's logits at a time. The price is
one more head matmul per token (the recompute). The head is called as a module, so a Baichuan ``NormHead``,
tied embeddings (gradients of both uses add up in the shared weight) and FSDP's root wrapping work unchanged.

Under ``train.compile`` (``compiled=True``, the rule of distributed/parallelize.py: not with tensor parallel) the
cross-entropy itself runs as one compiled function, :func:`token_cross_entropy` under ``torch.compile``: the
fp32 cast, log-softmax and NLL fuse into one kernel forward and one backward (eager runs five passes over the
``[tokens, vocab]`` logits). Same result up to float rounding (tests/test_loss_compile.py).

``train.loss_chunk_tokens``: 0 = off, N > 0 = chunks of N tokens, None (default) = automatic, i.e.
:data:`AUTO_CHUNK_TOKENS` when the vocabulary has at least :data:`AUTO_MIN_VOCAB` entries and the layout has
neither tensor nor pipeline parallelism (both compute the loss elsewhere: TP's head returns replicated
logits from a sequence-sharded input, PP's last stage calls the plain loss on its output; an explicit N > 0
with either is refused by resolve/validate.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

AUTO_CHUNK_TOKENS = 2048
AUTO_MIN_VOCAB = 65536


def resolve_loss_chunk(setting: int | None, vocab_size: int, tp: int = 1, pp: int = 1) -> int:
    """Chunk size the trainer uses for ``train.loss_chunk_tokens`` = ``setting`` (0: the plain loss)."""
    if setting is None:
        return AUTO_CHUNK_TOKENS if vocab_size >= AUTO_MIN_VOCAB and tp == 1 and pp == 1 else 0
    return int(setting)


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Summed fp32 cross-entropy of ``logits [..., vocab]`` against ``labels [...]`` (ignore index -100)."""
    return F.cross_entropy(
        logits.float().flatten(0, -2), labels.flatten(), reduction="sum", ignore_index=-100,
        label_smoothing=label_smoothing,
    )  # fmt: skip


@functools.cache
def _compiled_cross_entropy() -> Callable[..., torch.Tensor]:
    return torch.compile(token_cross_entropy)  # made on first use, once per process


def cross_entropy_fn(compiled: bool) -> Callable[..., torch.Tensor]:
    """:func:`token_cross_entropy`, or its one compiled instance (shared, so its graphs are made once)."""
    return _compiled_cross_entropy() if compiled else token_cross_entropy


def _chunk_loss(
    h: torch.Tensor, labels: torch.Tensor, head: nn.Module, label_smoothing: float, compiled: bool
) -> torch.Tensor:
    logits = head(h)  # [chunk, vocab], freed when the chunk is done
    return cross_entropy_fn(compiled)(logits, labels, label_smoothing)


def chunked_head_loss(
    h: torch.Tensor, head: nn.Module, labels: torch.Tensor, chunk_tokens: int, label_smoothing: float = 0.0,
    compiled: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Summed fp32 cross-entropy of ``head(h)`` against ``labels`` (``h [B, T, dim]``, ``labels [B, T]``),
    ``chunk_tokens`` tokens at a time; equal to ``TokenLoss()(head(h), labels)`` up to summation order."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    flat_h, flat_labels = h.flatten(0, -2), labels.flatten()  # [N, dim], [N]
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, flat_h.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        part = checkpoint(
            _chunk_loss,
            flat_h[start:stop],
            flat_labels[start:stop],
            head,
            label_smoothing,
            compiled,
            use_reentrant=False,
            preserve_rng_state=False,
        )
        total = total + part
    return total


class HeadLoss:
    """The callable a :class:`~llmtrain.models.Transformer` forward takes as ``head_loss``: it gets the final
    hidden states, the output module and the labels, and returns the summed loss instead of logits."""

    def __init__(self, chunk_tokens: int, label_smoothing: float = 0.0, compiled: bool = False) -> None:
        self.chunk_tokens, self.label_smoothing, self.compiled = chunk_tokens, label_smoothing, compiled

    def __call__(self, h: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        return chunked_head_loss(h, head, labels, self.chunk_tokens, self.label_smoothing, self.compiled)

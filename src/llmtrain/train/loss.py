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

``train.z_loss`` (PaLM, Chowdhery et al. 2022, "z-loss"): the summed loss also gets ``coef * log(Z)^2`` per
target token, ``log Z = logsumexp(logits)``, which keeps the softmax normaliser near 1 and the logits from
drifting. It is computed inside the same function as the cross-entropy, so the chunked loss adds it per chunk
and still never holds the full ``[tokens, vocab]`` logits; its gradient, ``2 coef log Z softmax(logits)``, comes
from autograd through the recomputed chunk like the cross-entropy's. Ignored targets (-100) contribute nothing.
:class:`LogitStats` collects the output logits' sum of squares and count (on log steps only) for the health
metric ``logit_rms`` (train/health.py), from the chunks as they pass, also without keeping them.

``train.loss_chunk_tokens``: 0 = off, N > 0 = chunks of N tokens, None (default) = automatic, i.e.
:data:`AUTO_CHUNK_TOKENS` when the vocabulary has at least :data:`AUTO_MIN_VOCAB` entries, under every layout.
Under tensor parallel the chunks run on vocabulary-sharded logits: the final norm's sequence-sharded output is
gathered once (as the head would gather it), each chunk's head matmul gives this rank's ``V / tp`` columns and
the loss-parallel cross-entropy (train/vocab_parallel.py) its summed loss, so a TP rank holds ``chunk x V / tp``
logits at a time. Under pipeline parallel the last stage's forward gets the pipeline micro-batch's labels and
returns its summed loss (distributed/pipeline.py ``PipelineRunner._head_loss``), so the schedule's loss
function only scales it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from llmtrain.train.vocab_parallel import (
    is_vocab_sharded,
    sharded_square_sum,
    squares,
    vocab_parallel_cross_entropy,
)

AUTO_CHUNK_TOKENS = 2048
AUTO_MIN_VOCAB = 65536


def resolve_loss_chunk(setting: int | None, vocab_size: int) -> int:
    """Chunk size the trainer uses for ``train.loss_chunk_tokens`` = ``setting`` (0: the plain loss)."""
    if setting is None:
        return AUTO_CHUNK_TOKENS if vocab_size >= AUTO_MIN_VOCAB else 0
    return int(setting)


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, z_loss: float = 0.0
) -> torch.Tensor:
    """Summed fp32 cross-entropy of ``logits [..., vocab]`` against ``labels [...]`` (ignore index -100), plus
    ``z_loss * sum(logsumexp(logits)^2)`` over the targets that are not ignored when ``z_loss`` > 0. Logits
    sharded over the vocabulary (tensor parallel's head) take the loss-parallel path, never gathered
    (train/vocab_parallel.py)."""
    if is_vocab_sharded(logits):
        return vocab_parallel_cross_entropy(logits, labels, label_smoothing, z_loss)
    flat = logits.float().flatten(0, -2)  # [N, vocab]
    flat_labels = labels.flatten()
    loss = F.cross_entropy(
        flat, flat_labels, reduction="sum", ignore_index=-100, label_smoothing=label_smoothing
    )
    if z_loss > 0:
        log_z = torch.logsumexp(flat, dim=-1)  # [N]
        loss = loss + z_loss * (log_z.square() * (flat_labels != -100)).sum()
    return loss


class LogitStats:
    """Sums of squares and counts of output logits, one entry per loss call (detached, on the device; no sync
    until read)."""

    def __init__(self) -> None:
        self.entries: list[tuple[torch.Tensor, int]] = []

    def add(self, logits: torch.Tensor) -> None:
        self.entries.append((square_sum(logits), logits.numel()))

    def add_sum(self, sumsq: torch.Tensor, count: int) -> None:
        self.entries.append((sumsq.detach(), count))

    def take(self, last: int | None = None) -> tuple[float, int]:
        """``(sum of squares, count)`` of the last ``last`` entries (None: all), then reset. A pipeline's last
        stage passes its micro-batch count: on its first step torch's shape inference calls the loss first on
        uninitialised tensors (distributed/pipeline.py)."""
        entries = self.entries if last is None else self.entries[-last:]
        out = (float(sum(float(e[0]) for e in entries)), sum(e[1] for e in entries))
        self.entries = []
        return out


def square_sum(logits: torch.Tensor) -> torch.Tensor:
    """Sum of the squared logits (detached, fp32); vocabulary-sharded ones summed over their TP ranks."""
    if is_vocab_sharded(logits):
        return sharded_square_sum(logits)
    return squares(logits)


@functools.cache
def _compiled_cross_entropy() -> Callable[..., torch.Tensor]:
    return torch.compile(token_cross_entropy)  # made on first use, once per process


def cross_entropy_fn(compiled: bool) -> Callable[..., torch.Tensor]:
    """:func:`token_cross_entropy`, or its one compiled instance (shared, so its graphs are made once)."""
    return _compiled_cross_entropy() if compiled else token_cross_entropy


def _chunk_loss(
    h: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Module,
    label_smoothing: float,
    compiled: bool,
    z_loss: float = 0.0,
    with_sumsq: bool = False,
) -> torch.Tensor:
    logits = head(h)  # [chunk, vocab], freed when the chunk is done
    loss = cross_entropy_fn(compiled)(logits, labels, label_smoothing, z_loss)
    if with_sumsq:  # [loss, sum of squared logits]: only the loss carries a gradient
        return torch.stack([loss, square_sum(logits)])
    return loss


def chunked_head_loss(
    h: torch.Tensor, head: nn.Module, labels: torch.Tensor, chunk_tokens: int, label_smoothing: float = 0.0,
    compiled: bool = False, z_loss: float = 0.0, stats: LogitStats | None = None,
) -> torch.Tensor:  # fmt: skip
    """Summed fp32 cross-entropy (plus the z-loss) of ``head(h)`` against ``labels`` (``h [B, T, dim]``,
    ``labels [B, T]``), ``chunk_tokens`` tokens at a time; equal to ``TokenLoss()(head(h), labels)`` up to
    summation order. ``stats`` (if given) receives the logits' sum of squares and count."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    h = _replicated(h)
    flat_h, flat_labels = h.flatten(0, -2), labels.flatten()  # [N, dim], [N]
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    sumsq = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, flat_h.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        part = checkpoint(
            _chunk_loss,
            flat_h[start:stop],
            flat_labels[start:stop],
            head,
            label_smoothing,
            compiled,
            z_loss,
            stats is not None,
            use_reentrant=False,
            preserve_rng_state=False,
        )
        if stats is not None:
            sumsq = sumsq + part[1]
            part = part[0]
        total = total + part
    if stats is not None:  # one entry per loss call (a pipeline's health takes its last n_mb calls)
        stats.add_sum(sumsq, flat_h.shape[0] * int(getattr(head, "out_features", 0) or 0))
    return total


def _replicated(h: torch.Tensor) -> torch.Tensor:
    """``h`` whole on every rank: a sequence-parallel DTensor (``Shard(1)``, tensor parallel's final norm) is
    all-gathered once here, as the head would gather it, so that it can be cut into token chunks; its gradient
    is reduce-scattered back by DTensor's autograd."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(h, DTensor) and any(not isinstance(p, Replicate) for p in h.placements):
        return h.redistribute(placements=[Replicate()] * h.device_mesh.ndim)
    return h


class HeadLoss:
    """The callable a :class:`~llmtrain.models.Transformer` forward takes as ``head_loss``: it gets the final
    hidden states, the output module and the labels, and returns the summed loss instead of logits."""

    def __init__(
        self,
        chunk_tokens: int,
        label_smoothing: float = 0.0,
        compiled: bool = False,
        z_loss: float = 0.0,
        stats: LogitStats | None = None,
    ) -> None:
        self.chunk_tokens, self.label_smoothing, self.compiled = chunk_tokens, label_smoothing, compiled
        self.z_loss, self.stats = z_loss, stats

    def __call__(self, h: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        return chunked_head_loss(
            h, head, labels, self.chunk_tokens, self.label_smoothing, self.compiled, self.z_loss, self.stats
        )

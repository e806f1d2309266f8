"""Cross-entropy on vocabulary-sharded logits (loss parallel under tensor parallelism), never gathering them.

Under TP the output projection is column-parallel over the vocabulary (models/common/parallelize.py
``top_plan``): each TP rank computes the logits of its own vocabulary slice, a ``DTensor`` ``Shard(-1)``
``[B, T, V]`` whose local part is ``[B, T, V / tp]``. Gathering them (the trainer before this module) made
every TP rank hold the whole ``[tokens, V]`` in fp32 plus its gradient: 188 GiB per rank on torchtitan's
Llama 3 70B 2-D layout. Here each rank keeps its slice and the softmax normaliser is assembled with two small
all-reduces over the TP group (Megatron-LM's ``vocab_parallel_cross_entropy``, torchtitan's
``loss_parallel``), per row ``[tokens]``:

* ``m = max_r max_j x_j`` (MAX): the shift that keeps ``exp`` finite; the result does not depend on it;
* ``[x_t - m, sum_j exp(x_j - m), sum_j (x_j - m)]`` (SUM): the target's shifted logit (only the rank that
  holds the target contributes), the normaliser, and (for label smoothing) the logits' sum.

Then per row ``log Z = m + log S``, ``nll = log Z - x_t`` and, with label smoothing ``e`` over ``V`` classes
(``F.cross_entropy``'s definition), ``(1 - e) nll + e (log Z - sum_j x_j / V)``; the z-loss (train/loss.py)
adds ``c log Z^2``. Rows whose label is -100 count nothing. The result is the summed loss, the same scalar on
every TP rank, as the replicated logits gave.

Backward is written out instead of taken through autograd (torch's ``loss_parallel`` has no label smoothing
and its z-loss would need ``logsumexp`` of a sharded DTensor): ``d/dx_j = g (p_j (1 + 2 c log Z) - (1 - e)
[j = t] - e / V)`` on the local slice, where ``p`` is the softmax, kept from forward in place of the shifted
logits. So the loss holds one fp32 ``[tokens, V / tp]`` tensor between forward and backward (plus the
16-bit logits while forward runs), and backward turns that same tensor into the gradient in place.
Exactness against ``F.cross_entropy`` on the gathered logits: tests/test_vocab_parallel.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_vocab_sharded(logits: torch.Tensor) -> bool:
    """Whether ``logits`` is a DTensor sharded over its last (vocabulary) dimension on a 1-D mesh."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(logits, DTensor) or logits.device_mesh.ndim != 1:
        return False
    placement = logits.placements[0]
    return isinstance(placement, Shard) and placement.dim in (-1, logits.dim() - 1)


def _local_vocab(logits: Any) -> tuple[torch.Tensor, int, int, Any]:
    """(local logits ``[..., V / tp]`` (differentiable), first vocabulary id of the slice, V, TP group)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = logits.device_mesh
    _, offset = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
    return logits.to_local(), int(offset[-1]), int(logits.shape[-1]), mesh.get_group()


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,  # [N, Vl] this rank's slice of the logits
        labels: torch.Tensor,  # [N] global vocabulary ids, -100 ignored
        start: int,
        vocab: int,
        group: Any,
        label_smoothing: float,
        z_loss: float,
    ) -> torch.Tensor:
        width = local.shape[-1]
        m = local.detach().amax(dim=-1).float()  # [N]
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x = (
            local.detach().to(torch.float32, copy=True).sub_(m[:, None])
        )  # [N, Vl] fp32 shifted logits (a copy)
        valid = labels != -100
        idx = labels - start
        mine = valid & (idx >= 0) & (idx < width)  # rows whose target is in this slice
        idx = torch.where(mine, idx, torch.zeros_like(idx))
        stats = torch.stack(
            [
                x.gather(1, idx[:, None])[:, 0] * mine,
                torch.zeros_like(m),
                x.sum(dim=-1) if label_smoothing > 0 else torch.zeros_like(m),
            ]
        )  # [3, N]
        x.exp_()
        stats[1] = x.sum(dim=-1)
        dist.all_reduce(stats, group=group)
        target, norm, total = stats[0], stats[1], stats[2]
        log_norm = norm.log()  # log Z - m
        per_row = log_norm - target  # nll
        if label_smoothing > 0:
            per_row = (1 - label_smoothing) * per_row + label_smoothing * (log_norm - total / vocab)
        log_z = log_norm + m
        if z_loss > 0:
            per_row = per_row + z_loss * log_z.square()
        x.div_(norm[:, None])  # the softmax, kept for backward
        ctx.save_for_backward(x, idx, mine, valid, log_z)
        ctx.label_smoothing, ctx.z_loss, ctx.vocab, ctx.dtype = label_smoothing, z_loss, vocab, local.dtype
        return (per_row * valid).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        probs, idx, mine, valid, log_z = ctx.saved_tensors
        e, c = ctx.label_smoothing, ctx.z_loss
        g = probs  # [N, Vl], overwritten in place: the graph is freed after this call
        if c > 0:
            g.mul_((1 + 2 * c * log_z)[:, None])
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, idx] -= (1 - e) * mine.to(g.dtype)
        if e > 0:
            g.sub_(e / ctx.vocab)
        g.mul_((valid.to(g.dtype) * grad)[:, None])
        return g.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, z_loss: float = 0.0
) -> torch.Tensor:
    """Summed cross-entropy (plus the z-loss) of vocabulary-sharded ``logits`` (a DTensor ``[..., V]``,
    ``Shard(-1)``) against ``labels [...]`` (ignore index -100): ``token_cross_entropy`` of the gathered
    logits, without gathering them. The same plain scalar on every rank of the logits' mesh."""
    local, start, vocab, group = _local_vocab(logits)
    return _VocabParallelCE.apply(
        local.flatten(0, -2), labels.flatten(), start, vocab, group, float(label_smoothing), float(z_loss)
    )


SQUARES_BLOCK = 1 << 22
"""Elements per block of :func:`squares` at most (16 MiB in fp32); at most an eighth of the tensor."""


def squares(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``t`` (detached) in fp32, a block of rows at a time (:data:`SQUARES_BLOCK`): the
    fp32 copy and the squares of one block live at once, not of all ``t`` (the logits' health figure: at 16 bits whole copies would be
    the loss's peak). ``torch.linalg.vector_norm(t, dtype=float32)`` would need no copy but is off by ~1e-4
    relative on bf16 input on this torch."""
    flat = t.detach().reshape(-1, t.shape[-1]) if t.dim() else t.detach().reshape(1, 1)
    rows = max(1, min(SQUARES_BLOCK // max(flat.shape[-1], 1), -(-flat.shape[0] // 8)))  # <= 1/8 of t
    total = torch.zeros((), dtype=torch.float32, device=t.device)
    for block in flat.split(rows):
        total += block.float().square().sum()
    return total


def sharded_square_sum(logits: torch.Tensor) -> torch.Tensor:
    """Sum of squares of vocabulary-sharded ``logits`` over all their entries (detached; one all-reduce)."""
    local, _, _, group = _local_vocab(logits.detach())
    out = squares(local)
    dist.all_reduce(out, group=group)
    return out

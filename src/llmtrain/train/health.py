"""Per-layer health metrics of a log step: gradient and parameter norms per block, the attention-logit bound,
the output logits' RMS and the share of non-finite gradient values (one small all-reduce, every rank).

Keys of the metrics row (``metrics.jsonl``, TensorBoard ``train/<key>``, ``llmtrain report``'s heat-map):

* ``grad_norm/layer_NN``   L2 norm of block NN's gradients (before clipping, after the loss scale is undone);
* ``param_norm/layer_NN``  L2 norm of block NN's parameters (the weights this step's gradients were taken at);
* ``max_layer_grad_norm``  the largest of the per-block gradient norms;
* ``attn_logit_bound``     the largest ``max |q| * max |k| / sqrt(head_dim)`` of the step, taken per layer,
  sequence and key/value head group (``Attention._record_bound``): an upper bound of every attention logit
  (SDPA's fused kernels never materialise the logits, so the bound is what a cheap metric can have; with
  QK-norm it is at most ``sqrt(head_dim)`` times the two norms' largest gains); the same in every layout;
  absent for MLA blocks and under ``train.compile``;
* ``logit_rms``            root mean square of the output logits of the step (every micro-batch, every rank);
* ``nonfinite_frac``       non-finite gradient values / gradient values, over the steps since the previous log
  row: 0 unless the loss scaler (or the non-finite guard) skipped a step, whose gradients are then counted.

Cost: nothing on steps that are not logged. On a log step, one pass over the local gradient and parameter
shards (norms, as clipping already does), the logits' squares inside the loss (chunk by chunk under the chunked
loss) and one ``all_reduce`` of a float64 vector ``[2 L + 4 + world_size]`` (under tensor parallel one more,
over the TP group, of the norm weights' gradients, which are partial sums there: :func:`_summed_partials`).
The norms are computed from the already-reduced gradients each rank holds: a shard of a DTensor counts once
per distinct shard (its value is divided by the ranks holding the same shard: the data-parallel replicas, a
TP-replicated norm weight), a plain tensor once per pipeline stage, so the sum over all ranks is exactly the squared norm of the whole tensor. The
bound's per-rank maxima ride in ``world_size`` slots of the same vector (a sum of one non-zero slot per rank).
Every rank gets the same numbers, so the stability guard (``stability.watch``) decides alike on all of them.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.config.survival import HEALTH_METRICS
from llmtrain.train.loss import LogitStats

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
HEALTH_KEYS = HEALTH_METRICS  # the names (and stability.watch's rule) live in config/survival.py


def layer_key(prefix: str, layer: int, num_layers: int) -> str:
    """``grad_norm/layer_03``: zero-padded to the model's depth (at least two digits) so names sort."""
    return f"{prefix}/layer_{layer:0{max(2, len(str(num_layers - 1)))}d}"


def _copies(t: torch.Tensor, stage_ranks: int) -> int:
    """Ranks of one pipeline stage that hold the same piece of ``t`` (replicas of a DTensor shard, or every
    rank of the stage for a plain tensor)."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return stage_ranks
    distinct = 1
    for dim, placement in enumerate(t.placements):  # type: ignore[attr-defined]
        # FSDP over a TP shard of the same dim is a _StridedShard, which is no Shard (is_shard() is False)
        if placement.is_shard() or type(placement).__name__ == "_StridedShard":
            distinct *= mesh.size(dim)
    return max(stage_ranks // distinct, 1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _summed_partials(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The local values of ``grads``, where a DTensor gradient that is still a partial sum over a mesh dim (a
    tensor-parallel norm weight's, computed from this rank's sequence slice: ``Partial`` until the optimizer
    reads it) has its pieces summed: one all-reduce per (mesh, dim) of all such gradients, flattened together
    (under TP the norm weights only, a few ``hidden_size`` vectors per layer). The sum is then replicated over
    that dim, which :func:`_copies` counts as copies."""
    out: list[torch.Tensor | None] = [None if g is None else _local(g) for g in grads]
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        placements = getattr(g, "placements", ())
        dims = tuple(d for d, pl in enumerate(placements) if pl.is_partial())
        if dims:
            groups.setdefault((id(g.device_mesh), dims), []).append(i)  # type: ignore[union-attr]
    for (_, dims), idx in groups.items():
        mesh = grads[idx[0]].device_mesh  # type: ignore[union-attr]
        flat = torch.cat([out[i].reshape(-1).double() for i in idx])  # type: ignore[union-attr]
        for d in dims:
            dist.all_reduce(flat, group=mesh.get_group(d))
        for i, piece in zip(idx, flat.split([out[i].numel() for i in idx]), strict=True):  # type: ignore[union-attr]
            out[i] = piece
    return out


class HealthMonitor:
    """Collects one log step's health figures of this rank's model and reduces them (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        num_layers: int,
        world_size: int,
        pp_size: int = 1,
        loss_calls: int | None = None,
    ) -> None:
        self.model, self.num_layers, self.world_size = model, num_layers, world_size
        self.loss_calls = loss_calls  # a pipeline's micro-batches: the step's loss calls (LogitStats.take)
        self.stage_ranks = max(world_size // max(pp_size, 1), 1)
        self.stats = LogitStats()
        self._nonfinite = 0.0  # non-finite gradient values since the last log row (de-duplicated, local)
        self._values = 0.0  # gradient values looked at since the last log row (de-duplicated, local)
        self._step_values: float | None = None
        self._grads: torch.Tensor | None = None  # [2 L]: squared grad norms, squared param norms (local)

    # ---- every step (cheap: a number)
    def step_values(self, params: list[nn.Parameter]) -> None:
        """Count one step's gradient values (for ``nonfinite_frac``); the count is computed once."""
        if self._step_values is None:
            self._step_values = sum(
                _local(p.grad).numel() / _copies(p.grad, self.stage_ranks)
                for p in params
                if p.grad is not None
            )
        self._values += self._step_values

    @torch.no_grad()
    def count_nonfinite(self, params: list[nn.Parameter]) -> None:
        """A skipped step: count its non-finite gradient values (a pass over the gradients, on such steps only)."""
        for p in params:
            if p.grad is not None:
                g = _local(p.grad)
                self._nonfinite += float((~torch.isfinite(g)).sum()) / _copies(p.grad, self.stage_ranks)

    # ---- log steps
    def record(self, on: bool) -> None:
        """Start (or stop) recording the attention's q/k norms and the logits' squares for this step."""
        for module in self.model.modules():
            if hasattr(module, "record_qk"):
                setattr(module, "record_qk", on)  # noqa: B010  (models/common/attention.py's switch)
                setattr(module, "qk_bound", None)  # noqa: B010
        self.stats = LogitStats()

    @torch.no_grad()
    def take_norms(self) -> None:
        """Per-layer squared gradient and parameter norms of the local shards (before clipping)."""
        n = self.num_layers
        device = next(self.model.parameters()).device
        sums = torch.zeros(2 * n, dtype=torch.float64, device=device)
        layered = [
            (int(m.group(1)), p) for name, p in self.model.named_parameters() if (m := _LAYER.search(name))
        ]
        grads = _summed_partials([p.grad for _, p in layered])
        for (layer, p), g in zip(layered, grads, strict=True):
            copies = _copies(p, self.stage_ranks)
            sums[n + layer] += _local(p.detach()).double().square().sum() / copies
            if g is not None and p.grad is not None:
                sums[layer] += g.double().square().sum() / _copies(p.grad, self.stage_ranks)
        self._grads = sums

    def _qk_bound(self) -> float:
        bounds = [float(b) for m in self.model.modules() if (b := getattr(m, "qk_bound", None)) is not None]
        return max(bounds, default=0.0)

    @torch.no_grad()
    def reduce(self, rank: int) -> dict[str, Any]:
        """The row's health keys (one all-reduce when there are several ranks); resets the interval counters."""
        n = self.num_layers
        device = next(self.model.parameters()).device
        sums = (
            self._grads if self._grads is not None else torch.zeros(2 * n, dtype=torch.float64, device=device)
        )
        sumsq, count = self.stats.take(self.loss_calls)
        extra = torch.tensor(
            [sumsq, count, self._nonfinite, self._values], dtype=torch.float64, device=device
        )
        slots = torch.zeros(self.world_size, dtype=torch.float64, device=device)
        slots[rank] = self._qk_bound()
        vec = torch.cat([sums, extra, slots])
        if self.world_size > 1 and dist.is_initialized():
            dist.all_reduce(vec)
        values = vec.tolist()
        self.record(False)
        self._grads, self._nonfinite, self._values = None, 0.0, 0.0
        row: dict[str, Any] = {}
        grad_norms = [math.sqrt(max(v, 0.0)) for v in values[:n]]
        for i in range(n):
            row[layer_key("grad_norm", i, n)] = grad_norms[i]
        for i in range(n):
            row[layer_key("param_norm", i, n)] = math.sqrt(max(values[n + i], 0.0))
        row["max_layer_grad_norm"] = max(grad_norms) if grad_norms else 0.0
        sumsq, count, nonfinite, seen = values[2 * n : 2 * n + 4]
        bound = max(values[2 * n + 4 :], default=0.0)
        if bound > 0:
            row["attn_logit_bound"] = bound
        if count > 0:
            row["logit_rms"] = math.sqrt(sumsq / count)
        row["nonfinite_frac"] = nonfinite / seen if seen > 0 else 0.0
        return row

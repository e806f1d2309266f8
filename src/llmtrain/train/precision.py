"""Mixed precision: autocast contexts and a dynamic loss scaler that shares its overflow check with clipping.

``fp32`` runs plain; ``bf16`` runs the forward under ``torch.autocast(dtype=bfloat16)`` with fp32 master weights;
``fp16`` also scales the loss. Under FSDP the blocks' weights are also gathered in that dtype
(``MixedPrecisionPolicy``, distributed/parallelize.py): autocast's casts of them are then no-ops, its op-level
policy (which ops run in 16 bits) is unchanged, and the gradients FSDP returns are fp32 shards, so
:meth:`LossScaler.unscale_` and :func:`grad_norm_` work on fp32 as before. The scaler here does not wrap the optimizer (unlike ``torch.amp.GradScaler``):
after backward the trainer unscales the gradients in place, computes the global gradient norm once, and that
one number decides everything. A non-finite norm means an overflow somewhere, on any rank, because the norm is
reduced over all of them; so every rank skips the same step and backs off the same scale, with no extra
collective (the hang ``GradScaler`` has under tensor parallel cannot happen). The same norm is logged and used
for clipping.

Dynamic scaling follows the usual rule (Micikevicius et al. 2018; Megatron, DeepSpeed): halve on overflow,
double after ``window`` consecutive good steps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch

from llmtrain.config.schema import TrainConfig

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The forward-pass context for ``precision``."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=PRECISIONS[precision])


class LossScaler:
    """Loss scale for fp16 (dynamic or fixed); a no-op scale of 1 for fp32/bf16.

    Counts ``skipped_steps`` (non-finite gradients) in every precision, so the stability guard can read it.
    """

    def __init__(
        self,
        enabled: bool,
        dynamic: bool = True,
        init_scale: float = 2.0**16,
        window: int = 1000,
        min_scale: float = 1.0,
    ):
        self.enabled = enabled
        self.dynamic = dynamic and enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.window = window
        self.min_scale = min_scale
        self.good_steps = 0
        self.skipped_steps = 0

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> LossScaler:
        if cfg.precision != "fp16":
            return cls(enabled=False)
        if isinstance(cfg.loss_scale, str):
            return cls(
                enabled=True, dynamic=True, init_scale=cfg.initial_loss_scale, window=cfg.loss_scale_window
            )
        return cls(enabled=True, dynamic=False, init_scale=float(cfg.loss_scale))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> None:
        if not self.enabled:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, grad_norm: float) -> bool:
        """Record one step given the (unscaled) global grad norm; return True if the step must be skipped."""
        if math.isfinite(grad_norm):
            self.good_steps += 1
            if self.dynamic and self.good_steps >= self.window:
                self.scale *= 2.0
                self.good_steps = 0
            return False
        self.skipped_steps += 1
        self.good_steps = 0
        if self.dynamic:
            self.scale = max(self.scale / 2.0, self.min_scale)
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.good_steps = int(sd["good_steps"])
        self.skipped_steps = int(sd["skipped_steps"])


def _mesh_key(t: torch.Tensor) -> object:
    mesh = getattr(t, "device_mesh", None)
    # a tensor with a device_mesh is a DTensor
    return None if mesh is None else (id(mesh), tuple(str(p) for p in cast("DTensor", t).placements))


@torch.no_grad()
def grad_norm_(
    params: Iterable[torch.nn.Parameter], max_norm: float | None, pp_group: object | None = None
) -> float:
    """Global L2 norm of the gradients (before clipping); clip in place to ``max_norm`` when it is finite.

    Works for plain tensors and for DTensors sharded over any mix of meshes (FSDP, TP, FSDP x TP): gradients
    are grouped by mesh and placements, each group's norm is reduced over its own mesh (``full_tensor``), the
    squares are summed, and under pipeline parallel summed over the stages (``pp_group``). Every rank gets the
    same number, so every rank takes the same skip / clip decision.
    """
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(_mesh_key(g), []).append(g)
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float().to(device) ** 2
    if pp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt().item()
    if max_norm and math.isfinite(total) and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for group in groups.values():
            torch._foreach_mul_(group, coef)
    return total

"""Mixed precision: autocast contexts and a dynamic loss scaler that shares its overflow check with clipping.

``fp32`` runs plain; ``bf16`` runs the forward under ``torch.autocast(dtype=bfloat16)`` with fp32 master weights;
``fp16`` also scales the loss. The scaler here does not wrap the optimizer (unlike ``torch.amp.GradScaler``):
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

import torch

from llmtrain.config.schema import TrainConfig

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


@torch.no_grad()
def grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float | None) -> float:
    """Global L2 norm of the gradients (before clipping); clip in place to ``max_norm`` when it is finite.

    Single-device here; the distributed version (per-mesh partial norms, reduced) plugs in with the same contract.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads, 2.0)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0).item()
    if max_norm and math.isfinite(total) and total > max_norm:
        torch._foreach_mul_(grads, max_norm / (total + 1e-6))
    return total

"""Learning-rate schedules as pure functions of the step.

The LR of optimizer step ``s`` (1-based: the first update is step 1) depends on nothing but ``s`` and the config,
so resuming needs no scheduler state and the value at any step can be checked against its closed form:

- warmup (``s <= warmup_steps``): ``lr * s / warmup_steps``
- then, with progress ``p = clamp((s - warmup_steps) / decay_steps, 0, 1)``:
  - ``cosine``:   ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``
  - ``linear``:   ``lr - (lr - min_lr) * p``
  - ``constant``: ``lr``
  - ``wsd``:      ``lr`` while ``p <= 1 - f``, then linear from ``lr`` to ``min_lr`` over the last fraction ``f``
    (warmup-stable-decay, as in MiniCPM / OLMo-core's WSD), ``f = wsd_decay_fraction``.

The last step of the decay (``s = warmup_steps + decay_steps``) lands exactly on ``min_lr``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from llmtrain.config.schema import TrainConfig

DECAY_STYLES = ("cosine", "linear", "constant", "wsd")


@dataclass(frozen=True)
class LRSchedule:
    """Warmup followed by a decay from ``lr`` to ``min_lr``; call it with the 1-based step."""

    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str = "cosine"
    wsd_decay_fraction: float = 0.2

    def __call__(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        p = min(max((step - self.warmup_steps) / max(self.decay_steps, 1), 0.0), 1.0)
        return self.min_lr + (self.lr - self.min_lr) * decay_factor(
            self.decay_style, p, self.wsd_decay_fraction
        )


def decay_factor(style: str, p: float, wsd_fraction: float) -> float:
    """Fraction of (lr - min_lr) remaining at decay progress ``p`` in [0, 1]."""
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    if style == "linear":
        return 1.0 - p
    if style == "constant":
        return 1.0
    if style == "wsd":
        start = 1.0 - wsd_fraction
        return 1.0 if p <= start else 1.0 - (p - start) / wsd_fraction
    raise ValueError(f"unknown decay_style {style!r}; valid: {', '.join(DECAY_STYLES)}")


def build_lr_schedule(cfg: TrainConfig) -> Callable[[int], float]:
    """The schedule of a single-stage run described by ``train``."""
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else max(cfg.max_steps - cfg.warmup_steps, 1)
    min_lr = cfg.lr if cfg.decay_style == "constant" else cfg.min_lr
    return LRSchedule(
        lr=cfg.lr,
        min_lr=min_lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=decay_steps,
        decay_style=cfg.decay_style,
        wsd_decay_fraction=cfg.wsd_decay_fraction,
    )

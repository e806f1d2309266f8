"""Optimizer construction: AdamW with decoupled weight decay on matrices only.

Parameters with fewer than two dimensions (norm weights, biases) get no weight decay, as in GPT-3, Llama and
OLMo. The kernel is chosen by ``train.optimizer_impl``: ``fused`` (one kernel for all parameters; CUDA and, on
recent torch, CPU), ``foreach`` (multi-tensor), ``single`` (the for-loop reference), or ``auto`` (fused where
the device supports it, else foreach). All three compute the same update as ``torch.optim.AdamW``.
"""

from __future__ import annotations

import torch
from torch import nn

from llmtrain.config.schema import TrainConfig
from llmtrain.errors import ConfigError

OPTIMIZERS = ("adamw",)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices (decayed) and everything else (not decayed). Order follows named_parameters()."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _impl_kwargs(impl: str, device_type: str) -> dict:
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "single":
        return {"foreach": False}
    if impl == "auto":
        return {"fused": True} if device_type in ("cuda", "cpu") else {"foreach": True}
    raise ConfigError(f"train.optimizer_impl: {impl!r} is not valid; use auto, fused, foreach or single.")


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str = "cpu") -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters; the LR is set by the trainer every step from the schedule."""
    if cfg.optimizer.lower() not in OPTIMIZERS:
        raise ConfigError(
            f"train.optimizer: {cfg.optimizer!r} is not supported; valid: {', '.join(OPTIMIZERS)}."
        )
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **_impl_kwargs(cfg.optimizer_impl, device_type),
    )

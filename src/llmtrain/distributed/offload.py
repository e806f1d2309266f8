"""Activation offload (``recompute.mode: offload``): the tensors autograd saves inside each transformer block
go to host memory during forward and come back for backward.

The mechanism is torch's saved-tensor hooks, as in ``torch.autograd.graph.save_on_cpu``: pack copies the tensor
into a host buffer (pinned on CUDA, so the copy is asynchronous), unpack copies it back to its device. Unlike
``save_on_cpu``, parameters and views of them (leaves that require grad, FSDP's unsharded parameters
included) are not copied:
they stay on the device anyway. The hooks are entered by a forward pre-hook and left by a forward hook
(``always_call``) of each block, so module and parameter names (checkpoints, name-seeded init) are unchanged;
they are registered on the module that sits in ``model.layers`` after compile (the compiled block runs inside
the hooks, its saved tensors are packed like eager ones), before FSDP.

Cost: every saved activation crosses PCIe twice per step (about 2 x the block's activation bytes; overlapped
with compute only as far as the copy engine allows); saving: the blocks' activations on the device, leaving
each block's parameters and the tensors in flight. On a CPU-only machine the device *is* host memory: the
hooks still copy (so tests see real packing and unpacking) but save nothing. :class:`OffloadStats` counts what
was packed, for tests and ``llmtrain check``'s memory line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn


@dataclass
class OffloadStats:
    """What the hooks moved since the model was built (cumulative)."""

    packed: int = 0
    """Tensors copied to host memory."""
    bytes: int = 0
    """Their bytes."""
    kept: int = 0
    """Saved tensors left where they were (parameters, views of them, non-dense strided views)."""


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its memory exactly once in some dimension order (a permuted contiguous tensor)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _Hooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, stats: OffloadStats, pin: bool) -> None:
        def pack(t: torch.Tensor) -> Any:
            base = t._base if t._base is not None else t  # a linear saves its weight as a transposed view
            if base.is_leaf and base.requires_grad:  # a parameter (or a view of one): on the device anyway
                stats.kept += 1
                return t
            if not _dense(t):  # an expanded or strided view: rare and small, keep it
                stats.kept += 1
                return t
            # Same strides: compiled (inductor) backward graphs assert the layout of what they saved.
            host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=pin, device="cpu")
            host.copy_(t, non_blocking=pin)
            stats.packed += 1
            stats.bytes += t.numel() * t.element_size()
            return (t.device, host)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin)

        super().__init__(pack, unpack)


def apply_offload(model: nn.Module, device_type: str) -> OffloadStats:
    """Offload the saved activations of every block in ``model.layers``; returns the (shared) counters."""
    stats = OffloadStats()
    pin = device_type == "cuda"
    for block in cast(nn.ModuleDict, model.layers).values():
        hooks = _Hooks(stats, pin)

        def enter(module: nn.Module, args: Any, hooks: _Hooks = hooks) -> None:
            hooks.__enter__()

        def leave(module: nn.Module, args: Any, out: Any, hooks: _Hooks = hooks) -> None:
            hooks.__exit__(None, None, None)

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave, always_call=True)
    setattr(model, "activation_offload", stats)  # noqa: B010  (the counters, for tests and reports)
    return stats

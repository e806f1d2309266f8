"""Which gradients the cross-group sum covers, and how: FSDP2's all-reduce hook, or one explicit all-reduce.

Every parameter's gradient must be summed across the replica groups exactly once per step.

* FSDP2's all-reduce hook (HSDP-style: it runs on the reduce-scattered shard of each FSDP unit) covers the
  parameters of the model's FSDP units: :func:`hook_coverage` lists them from the units' parameter groups.
* Everything else is summed after the backward by :func:`sum_grads`, in one flat all-reduce: the parameters of
  a model without FSDP, expert weights that FSDP leaves out (expert parallel with one expert replica per group:
  ``distributed/expert_parallel.py`` passes them as ``ignored_params``), and, under pipeline parallelism, every
  parameter. A pipeline schedule reduces each stage's FSDP units once per schedule run, and the ``keep``
  policy runs the schedule once per slot (ft/data.py), so groups computing different numbers of slots would
  call the hook a different number of times; the stage shells' own units (embedding, norm, head) are not
  submodules of the rank model either. Likewise with ``keep`` over three or more groups
  (``ft.layout.fsdp_hook_sums``): ZeRO-3 reduces every micro-batch, and survivors may cover different numbers of
  a missing group's slots. After the schedule the tied head's copy has no gradient (it takes the
  embedding's before the optimizer step, distributed/pipeline.py), so it is summed once, as the embedding.

:func:`hook_coverage` asserts that the two sets are disjoint and together the model's whole trainable set.
A parameter without a gradient in one group (an expert no token was routed to) is summed as zeros, and gets
the sum wherever any group had a gradient (a presence flag travels in the same all-reduce), so every group
ends with the same gradients and the optimizers stay bitwise equal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The FSDP2 units (``fully_shard``-ed modules) among ``model``'s modules."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _unit_params(unit: FSDPModule) -> list[nn.Parameter]:
    """The parameters ``unit``'s FSDP parameter group reduces (looked up on their modules: ``to_empty``
    replaces the parameter objects after ``fully_shard``)."""
    group = unit._get_fsdp_state()._fsdp_param_group
    if group is None:
        return []
    out = []
    for fp in group.fsdp_params:
        info = fp._module_info
        out.append(getattr(info.module, info.param_name))
    return out


def hook_coverage(model: nn.Module, hooks: bool) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(covered by FSDP's all-reduce hook, summed explicitly)``: see the module docstring. ``hooks`` False
    (``ft.layout.fsdp_hook_sums``: pipelined, or ``keep`` over three or more groups): every gradient explicitly."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not hooks:
        return [], params
    covered: dict[int, nn.Parameter] = {}
    for unit in fsdp_units(model):
        for p in _unit_params(unit):
            assert id(p) not in covered, "a parameter in two FSDP units would be summed twice"
            if p.requires_grad:
                covered[id(p)] = p
    explicit = [p for p in params if id(p) not in covered]
    ids = {id(p) for p in params}
    assert set(covered) <= ids and len(covered) + len(explicit) == len(params), (
        "the cross-group gradient sum must cover every trainable parameter exactly once"
    )
    return list(covered.values()), explicit


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def sum_grads(params: list[nn.Parameter], all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Sum the local gradients (shards) of ``params`` across the groups with one ``all_reduce`` (in place)."""
    if not params:
        return
    locals_ = [_local(p.grad) if p.grad is not None else None for p in params]
    shapes = [_local(p) for p in params]
    device = shapes[0].device
    flags = torch.tensor([g is not None for g in locals_], dtype=torch.float32, device=device)
    flat = torch.cat(
        [(g if g is not None else torch.zeros_like(w)).reshape(-1).float() for g, w in zip(locals_, shapes)]
        + [flags]
    )
    all_reduce(flat)
    offset = 0
    present = flat[-len(params) :].tolist()
    for p, g, w, seen in zip(params, locals_, shapes, present):
        n = w.numel()
        summed = flat[offset : offset + n].view(w.shape)
        offset += n
        if g is not None:
            g.copy_(summed)
        elif seen > 0:  # another group had a gradient for it: this group takes the sum too
            local = summed.to(w.dtype).clone()
            if isinstance(p, DTensor):
                p.grad = DTensor.from_local(
                    local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            else:
                p.grad = local

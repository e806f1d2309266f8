"""Tensor parallel for MoE blocks: every TP rank routes the same tokens, the experts are split by hidden units.

Megatron's "copy to / reduce from the tensor-parallel region", applied per expert. One MoE block under TP
(``T`` the sequence, ``tp`` ranks, sequence parallel between the blocks)::

    x [B, T/tp, D]  --all-gather-->  x [B, T, D]  replicated: the router (NoParallel) scores and chooses
                                                  identically on every rank; aux loss and loads are exact
    routed experts  w1 / w3 [E, H/tp, D] (Shard(1)), w2 [E, D, H/tp] (Shard(2)): each rank runs its slice of
                    every expert's hidden units on the same rows
                    rows -> f (forward identity, backward all-reduce) -> SwiGLU slice -> g (forward all-reduce,
                    backward identity) -> full expert outputs, weighted and summed per token as on one device
    shared experts  ColwiseParallel w1 / w3, RowwiseParallel w2 to Replicate (the dense styles: their DTensor
                    backward already reduces the input gradient); Qwen2-MoE's shared_gate replicated
    out [B, T, D]   replicated  --local slice-->  [B, T/tp, D] (its backward all-gathers the gradient)

Why this way: every tensor outside the routed experts is replicated and receives the full gradient on every
rank (the output's backward all-gathers the whole gradient, ``f`` sums the expert rows' partial input
gradients), so the router, the shared gate and the aux loss keep their one-device semantics and nothing in
``moe.py`` changes: :class:`ExpertTP` hooks ``GroupedExperts`` from outside (its ``_local`` reads the shard).
Communication per MoE block (N tokens, M <= top_k x N kept assignments), forward: all-gather of ``x [N, D]``,
all-reduce of the expert rows ``[M, D]`` (``g``) and, with shared experts, of their output ``[N, D]``;
backward: all-gather of the output gradient ``[N, D]``, all-reduce of the expert rows' input gradient
``[M, D]`` (``f``) and, with shared experts, of their input gradient ``[N, D]``.

:class:`FeedForwardTP` sits at ``feed_forward`` in a block plan and picks the dense plan or this one by the
module it finds (DeepSeek-V3 and ``moe.every`` mix dense and MoE blocks). With expert parallel as well, the
routed experts are left to ``distributed/expert_parallel.py`` (applied first: it marks them), which places the
weights on its expert mesh and runs ``f`` / ``g`` around its all-to-all dispatch, in that order; everything
else in the block keeps this plan. The degrees TP needs (``moe_hidden_size % tp``) are ``llmtrain.moe_rules``'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

from llmtrain.models.common.moe import GroupedExperts, MoE


class SumGradOverGroup(torch.autograd.Function):
    """``f``: identity forward; backward sums the gradient over ``group`` (each TP rank saw a hidden slice;
    also the replicated MLA projections, models/deepseek/tp.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceOverGroup(torch.autograd.Function):
    """``g``: forward sums the partial expert outputs over ``group`` (the TP group); backward identity (also
    the expert-parallel combine under TP, distributed/expert_parallel.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ExpertTP(ParallelStyle):
    """Shard ``GroupedExperts`` by hidden units over the TP mesh and wrap its rows in ``f`` / ``g``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, GroupedExperts)
        if getattr(module, "expert_parallel", 1) > 1:  # expert parallel owns these experts and their TP hooks
            return module
        for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):  # w1 / w3 [E, H, D], w2 [E, D, H]
            param = getattr(module, name)
            sharded = distribute_tensor(param.data, device_mesh, [Shard(dim)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        group = device_mesh.get_group()

        def copy_in(mod: nn.Module, args: tuple) -> tuple:
            x, counts = args
            return SumGradOverGroup.apply(x, group), counts

        def reduce_out(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            return ReduceOverGroup.apply(out, group)

        module.register_forward_pre_hook(copy_in)
        module.register_forward_hook(reduce_out)
        module.tensor_parallel = device_mesh.size()  # type: ignore[assignment]  # marker (a plain int)
        return module


def moe_plan(replicated: type[ParallelStyle]) -> dict[str, ParallelStyle]:
    """Plan of one MoE module's children, relative to the MoE (``replicated``: the plan's style for whole
    parameters, ``parallelize.NoParallel``); the MoE's own input/output styles are :class:`FeedForwardTP`'s."""
    return {
        "router.gate": replicated(),
        "experts": ExpertTP(),
        "shared_experts.w1": ColwiseParallel(),
        "shared_experts.w3": ColwiseParallel(),
        "shared_experts.w2": RowwiseParallel(output_layouts=Replicate()),
        "shared_gate": replicated(),
    }


def dense_plan() -> dict[str, ParallelStyle]:
    """Plan of a dense SwiGLU's children: column-parallel in, row-parallel out with a reduce-scatter."""
    return {
        "w1": ColwiseParallel(),
        "w3": ColwiseParallel(),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
    }


class FeedForwardTP(ParallelStyle):
    """The ``feed_forward`` of a block: the dense plan for a SwiGLU, the MoE plan above for an ``MoE``.

    Both all-gather the sequence-parallel input; a dense SwiGLU takes it as a DTensor (its column-parallel
    projections reduce the input gradient), an MoE as a local replicated tensor whose output is sliced back to
    ``Shard(1)``. ``replicated``: the style for parameters kept whole (``parallelize.NoParallel``).
    """

    def __init__(self, replicated: type[ParallelStyle]) -> None:
        super().__init__()
        self.replicated = replicated

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        moe = isinstance(module, MoE)
        PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=moe
        )._apply(module, device_mesh)
        if not moe:
            return parallelize_module(module, device_mesh, dense_plan())
        PrepareModuleOutput(
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True
        )._apply(module, device_mesh)
        plan = {k: v for k, v in moe_plan(self.replicated).items() if _has(module, k)}
        return parallelize_module(module, device_mesh, plan)


def _has(module: nn.Module, path: str) -> bool:
    """Whether ``path`` names a submodule of ``module`` (shared experts and their gate are optional)."""
    found: nn.Module | None = module
    for part in path.split("."):
        found = getattr(found, part, None)
        if not isinstance(found, nn.Module):
            return False
    return True

"""Expert parallel: shard each MoE block's routed experts over the data-parallel ranks, all-to-all dispatch.

Layout (torchtitan's, restricted to ``ep == dp``): EP borrows the data-parallel ranks, it does not multiply
the world size. Each rank keeps ``num_experts / ep`` experts: ``experts.w1/w2/w3`` become DTensors
``Shard(0)`` on the 1-D ep mesh (the data-parallel ranks), so DCP saves and reshards them like any other
sharded tensor and ``init_weights`` gives each rank its slice of the full seeded draw. Every other parameter
(attention, norms, router, shared experts) stays FSDP-sharded / replicated over dp as usual; FSDP is told to
ignore the expert weights (``expert_params``).

The ``MoE`` module is unchanged; ``apply_ep`` hooks its ``experts`` submodule from outside. The MoE hands the
experts the tokens of its local micro-batch sorted by global expert with ``counts [E]``; the hooks::

    pre-hook   all-to-all counts [E] -> how many rows each source rank sends each local expert
               all-to-all rows: rank r receives the rows for its experts from every rank ([src, expert] order),
               regroup them by local expert (stable sort) -> experts run on (rows, local counts [E / ep])
    post-hook  undo the regrouping, all-to-all the rows back to their source ranks, in the original order

Gradients: the all-to-all is an autograd function (its backward is the reverse all-to-all). The trainer
multiplies each rank's loss by dp to undo FSDP's gradient averaging; expert weights are not reduced by FSDP
(each rank's expert gradient already sums the contributions of every rank's tokens), so the combine's
backward divides the incoming gradient by ``grad_divisor`` (= dp) and the dispatch's backward multiplies it
back: expert gradients come out exact, token gradients unchanged.

``parallel.enable_alltoall``: the dispatch is always the all-to-all above (gloo and NCCL both implement
``all_to_all_single``); the key is informational. Not supported, refused by :mod:`llmtrain.feasibility` before
anything is built (``llmtrain/moe_rules.py``: ep_without_moe, ep_equals_dp, ep_hsdp, ep_experts,
ep_with_tp): ep != dp, HSDP meshes with EP, expert parallel together with tensor parallel, a model without MoE
blocks, a number of experts ep does not divide. (Tensor parallel alone splits every expert by hidden units over
the TP ranks instead, ``models/common/moe_tp.py``; combining both would need ``[dp, tp]`` expert DTensors and
the TP ``f``/``g`` hooks ordered inside the dispatch/combine ones: not built.) With pipeline parallel each stage
module's experts are sharded over the data-parallel ranks of its stage (``parallelize`` runs per stage module),
which dispatch in the same schedule order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from llmtrain.models.common.moe import GroupedExperts, moe_layers

if TYPE_CHECKING:
    from llmtrain.distributed.parallel_dims import ParallelDims


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows [M, D] with autograd; backward is the reverse exchange x ``grad_mult``."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, grad_mult):
        ctx.splits, ctx.group, ctx.grad_mult = (out_splits, in_splits), group, grad_mult
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        if ctx.grad_mult != 1.0:
            grad_in = grad_in * ctx.grad_mult
        return grad_in, None, None, None, None


class _Dispatcher:
    """The pre/post forward hooks of one ``GroupedExperts`` (state of the call in flight between them)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, num_experts: int, grad_divisor: float) -> None:
        self.group, self.ep, self.local = group, ep, num_experts // ep
        self.grad_divisor = grad_divisor
        self.state: tuple | None = None

    def dispatch(self, module: nn.Module, args: tuple) -> tuple:
        x, counts = args  # [M, D] sorted by global expert, [E]
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)  # [ep * E_local]
        send_splits = counts.view(self.ep, self.local).sum(1).tolist()
        recv_by_src = recv_counts.view(self.ep, self.local)  # [src rank, local expert]
        recv_splits = recv_by_src.sum(1).tolist()
        rows = _AllToAll.apply(x, recv_splits, send_splits, self.group, self.grad_divisor)  # [R, D]
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.local, device=x.device).repeat(self.ep), recv_counts
        )
        perm = torch.argsort(expert_of_row, stable=True)  # [R] group rows by local expert
        self.state = (perm, send_splits, recv_splits)
        return rows[perm], recv_by_src.sum(0)

    def combine(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        assert self.state is not None  # set by dispatch, the pre-hook of this forward
        perm, send_splits, recv_splits = self.state
        self.state = None
        rows = torch.empty_like(out).index_copy_(0, perm, out)  # back to [src rank, expert] order
        return _AllToAll.apply(rows, send_splits, recv_splits, self.group, 1.0 / self.grad_divisor)


def ep_mesh_for(dims: ParallelDims, world: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of the data-parallel ranks that experts are sharded over. The layout was checked by
    :mod:`llmtrain.feasibility` (ep == dp, no TP / CP, no HSDP): one of dp_shard / dp_replicate is 1."""
    return world["dp_shard"] if dims.dp_shard > 1 else world["dp_replicate"]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, grad_divisor: float) -> None:
    """Shard every MoE block's experts over ``ep_mesh`` (model on the meta device) and hook their forward.

    ``grad_divisor``: the factor by which the trainer pre-multiplies the loss (dp when FSDP is on).
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = ep_mesh.size()
    for moe in moe_layers(model):  # (MoE blocks exist and num_experts % ep == 0: llmtrain.feasibility)
        experts: GroupedExperts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        hooks = _Dispatcher(ep_mesh.get_group(), ep, experts.num_experts, grad_divisor)
        experts.register_forward_pre_hook(hooks.dispatch)
        experts.register_forward_hook(hooks.combine)
        # marker for expert_params / logging (torch types Module.__setattr__ for Tensor | Module values only)
        experts.expert_parallel = ep  # type: ignore[assignment]


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    """Parameters sharded by :func:`apply_ep` (FSDP must ignore them)."""
    return {
        p
        for m in model.modules()
        if isinstance(m, GroupedExperts) and getattr(m, "expert_parallel", 1) > 1
        for p in m.parameters()
    }

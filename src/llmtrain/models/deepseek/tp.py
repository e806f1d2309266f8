"""Tensor-parallel plan of DeepSeek-V3's multi-head latent attention (the rest is the common plan).

Megatron-style with sequence parallel, as ``models/common/parallelize.py``: the attention input is
all-gathered (``Replicate``), ``wq`` / ``wq_b`` and ``wkv_b`` are column-parallel (each rank holds its heads),
``wo`` row-parallel with a reduce-scatter back to ``Shard(1)``. The low-rank down projections and their norms
(``wq_a``, ``q_norm``, ``wkv_a``, ``kv_norm``, ``wk_rope``) are small and computed whole on every TP rank
(:class:`Replicated`: replicated DTensor parameters, local tensors in and out).

Gradients of those replicated parts must be the full ones on every rank. The latent and the query latent feed
a column-parallel projection, whose input takes the sum over ranks in its backward (DTensor ``from_local``
of a ``Replicate`` input all-reduces the partial gradient), so their gradients are complete. The rotary key is
different: it is broadcast to the rank's local heads inside the attention, so its gradient covers only those
heads; :class:`Replicated` with ``reduce_grad`` adds the all-reduce over the TP group on its output.

The feed-forward is the common plan's: with experts, ``moe_tp.FeedForwardTP`` gives the first dense blocks the
dense plan and the DeepSeekMoE blocks the MoE one (routing, group limits, the selection bias and the aux loss
on replicated scores; routed experts split by hidden units; the shared experts column/row-parallel). Per MLA
layer the TP communication is the dense attention's: all-gather of the input, reduce-scatter of ``wo``'s
output, plus the rotary key's gradient all-reduce (``[B, T, qk_rope_head_dim]``) in backward.
Imported on first use only (``torch.distributed.tensor``); the family spec wraps it in a ``TPPlan``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.moe_tp import SumGradOverGroup
from llmtrain.models.common.parallelize import block_plan as common_block_plan
from llmtrain.models.common.parallelize import top_plan as common_top_plan


class Replicated(ParallelStyle):
    """A module computed whole on every TP rank: parameters become ``Replicate`` DTensors; the input may be a
    local tensor or a DTensor (made ``Replicate``), the output is local. ``reduce_grad``: the output's consumers
    see only this rank's heads, so its gradient is summed over the TP ranks (see the module docstring)."""

    def __init__(self, reduce_grad: bool = False) -> None:
        super().__init__()
        self.reduce_grad = reduce_grad

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))

        def input_fn(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            out = []
            for x in inputs:
                if isinstance(x, DTensor):
                    x = x.redistribute(mesh, [Replicate()])
                elif isinstance(x, torch.Tensor):
                    x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                out.append(x)
            return tuple(out)

        group = device_mesh.get_group()
        reduce_grad = self.reduce_grad

        def output_fn(mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
            out = out.to_local() if isinstance(out, DTensor) else out
            return SumGradOverGroup.apply(out, group) if reduce_grad else out

        # torch types input_fn as returning None, but a returned tuple replaces the inputs (forward pre-hook)
        return distribute_module(module, device_mesh, partition, input_fn, output_fn)  # type: ignore[arg-type]


def block_plan(args: TransformerArgs) -> dict[str, ParallelStyle]:
    """Plan of one DeepSeek block (MLA + dense or MoE feed-forward), relative to the block."""
    plan = {
        k: v
        for k, v in common_block_plan(args).items()
        if not k.startswith("attention.") or k == "attention.wo"
    }
    plan["attention.wo"] = RowwiseParallel(output_layouts=Shard(1))
    if args.q_lora_rank:
        plan["attention.wq_a"] = Replicated()
        plan["attention.q_norm"] = Replicated()
        plan["attention.wq_b"] = ColwiseParallel()
    else:
        plan["attention.wq"] = ColwiseParallel()
    plan["attention.wkv_a"] = Replicated()
    plan["attention.kv_norm"] = Replicated()
    plan["attention.wkv_b"] = ColwiseParallel()
    plan["attention.wk_rope"] = Replicated(reduce_grad=True)
    return plan


def top_plan(args: TransformerArgs, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """Embedding, final norm and output: the common plan."""
    return common_top_plan(args, loss_parallel)

"""Tensor-parallel plans as data: module path -> ``ParallelStyle`` (Megatron-style TP with sequence parallel).

Between blocks the residual stream is sharded along the sequence (``Shard(1)``, sequence parallel): norms run
on their sequence slice, then each attention / feed-forward input is all-gathered (``Replicate``), the
column-parallel projections (``wq wk wv``, ``w1 w3``) produce local heads / local hidden units, and the
row-parallel ones (``wo``, ``w2``) reduce-scatter back to ``Shard(1)``. The embedding is row-parallel over the
vocabulary and the output projection column-parallel over the vocabulary: its logits stay sharded over the
vocabulary (a DTensor ``Shard(-1)``, torchtitan's loss-parallel plan), so each TP rank holds ``V / tp`` of
them (``parallel.loss_parallel``, default true; false gathers them whole); the loss runs on the shards
(train/vocab_parallel.py), and a caller that needs whole logits (evaluation,
eval/forward.py) calls ``full_tensor()``. Parameters
that stay whole on every TP rank (QK-norm weights) become replicated DTensors through :class:`NoParallel`, so
the optimizer and gradient clipping see DTensors only (mixing plain tensors and DTensors fails in foreach ops).

Tied input/output embeddings: both styles shard the ``[vocab, dim]`` weight as ``Shard(0)``, so after the plan
the two modules re-share one DTensor parameter (``distributed/parallelize.apply_tp``); autograd then sums the
gradients of both uses into it, as on one device. ALiBi: :class:`ShardAlibiHeads` narrows each attention's
slopes to the heads its rank holds (the ALiBi bias is per head, so no communication is needed).

The plan is the same for every family because every family uses the same module names (GLM and Qwen2 have
qkv biases, which the column-wise style shards with their weights). It reaches the trainer as a field of the
family, ``FamilySpec.tp_plan`` (``models/common/family.COMMON_TP_PLAN`` wraps :func:`block_plan` and
:func:`top_plan`); a family that needs another plan gives its own ``TPPlan``. Which tensor-parallel degrees a
model admits (heads, KV heads, FFN width, sequence length) is decided by ``llmtrain.feasibility``.

MoE models put :class:`~llmtrain.models.common.moe_tp.FeedForwardTP` at ``feed_forward``: it applies the
dense feed-forward plan above to a dense block and the MoE plan (tokens all-gathered and routed identically
on every rank, routed experts split by hidden units, shared experts column/row-parallel) to an MoE block.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.attention import Attention
from llmtrain.models.common.moe_tp import FeedForwardTP


class NoParallel(ParallelStyle):
    """Replicate a module's parameters as DTensors; its inputs and outputs stay plain local tensors.

    ``input_layout`` says how the local input relates to the global one. QK-norm sees this rank's heads only,
    so its input is ``Shard(2)`` of ``[B, T, heads, head_dim]``: the weight gradient is then reduced over the
    TP ranks (every head contributes), not taken from the local heads alone.
    """

    def __init__(self, input_layout: Placement | None = None) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))

        layout = self.input_layout

        def input_fn(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(
                DTensor.from_local(x, mesh, [layout], run_check=False) if hasattr(x, "shape") else x
                for x in inputs
            )

        def output_fn(mod: nn.Module, out, mesh: DeviceMesh):
            return out.to_local() if isinstance(out, DTensor) else out

        # torch types input_fn as returning None, but a returned tuple replaces the inputs (forward pre-hook)
        return distribute_module(module, device_mesh, partition, input_fn, output_fn)  # type: ignore[arg-type]


class ShardAlibiHeads(ParallelStyle):
    """Give an ALiBi attention the slopes of its own query heads only (no communication, nothing distributed).

    ``ColwiseParallel`` on ``wq`` leaves TP rank ``r`` the contiguous heads ``[r * H/tp, (r + 1) * H/tp)``; this
    style records that range in ``attention.alibi_heads`` and narrows the ``alibi_slopes`` buffer ``[H]`` to
    ``[H/tp]``, so ``reset_buffers`` (after ``to_empty``) recomputes the same slice.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, Attention)  # the plan puts this style on "attention" only
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        local = module.num_heads_total // tp
        start, stop = rank * local, (rank + 1) * local
        module.alibi_heads = (start, stop)
        module.alibi_slopes = module.alibi_slopes[start:stop]  # [H/tp]; meta before materialisation
        return module


class Chain(ParallelStyle):
    """Apply several styles to one module, in order (a plan maps each module path to a single style)."""

    def __init__(self, *styles: ParallelStyle) -> None:
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module


def block_plan(args: TransformerArgs) -> dict[str, ParallelStyle]:
    """Plan of one TransformerBlock, relative to the block."""
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        # attention(x, rope, mask, cache, layer_key): only x changes layout
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    if args.num_experts:  # MoE blocks (and the dense ones among them): models/common/moe_tp.py
        plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward")}
        plan["feed_forward"] = FeedForwardTP(NoParallel)
    if args.post_norms:  # sandwich / dssn: input is wo's / w2's Shard(1) output; the residual add stays local
        plan["attention_post_norm"] = SequenceParallel(use_local_output=True)
        plan["ffn_post_norm"] = SequenceParallel(use_local_output=True)
    if args.qk_norm:
        plan["attention.q_norm"] = NoParallel(input_layout=Shard(2))  # [B, T, local heads, head_dim]
        plan["attention.k_norm"] = NoParallel(input_layout=Shard(2))
    if args.position_embedding == "alibi":  # the slopes follow the heads of wq's column shard
        plan["attention"] = Chain(plan["attention"], ShardAlibiHeads())
    return plan


def top_plan(args: TransformerArgs, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """Plan of the modules around the blocks (embedding, final norm, output). ``loss_parallel``
    (``parallel.loss_parallel``): the logits stay a vocabulary-sharded DTensor; else they are gathered whole."""
    output = (
        ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        if loss_parallel
        else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    )
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": output,
    }

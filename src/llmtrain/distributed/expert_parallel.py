"""Expert parallel: shard each MoE block's routed experts over an expert mesh, all-to-all dispatch.

Layout (Megatron's "expert data parallel" and "expert tensor parallel", on a second mesh over the same ranks,
as DESIGN.md asks). EP does not multiply the world size: within one pipeline stage the ``dp x cp x tp`` ranks
(flattened in the world mesh's order ``dp_replicate, dp_shard, cp, tp``) are regrouped as::

    expert mesh  (pp, edp, ep, etp)      edp x ep x etp = dp_replicate x dp_shard x cp x tp

* ``etp`` (expert tensor parallel, :func:`llmtrain.moe_rules.expert_tp`): ``tp`` when ``ep`` divides
  ``dp x cp``, so EP is drawn from the data-parallel ranks and each expert's hidden units are split over the
  TP ranks as ``models/common/moe_tp.py`` does without EP (Megatron's expert-TP); ``1`` otherwise, so EP is
  drawn from the ``dp x cp x tp`` ranks and every expert is whole (Megatron / NeMo's DeepSeek-V3 layout, EP 64
  over DP 32 x TP 2).
* ``ep``: the ranks an all-to-all dispatch spans; each holds ``num_experts / ep`` experts.
* ``edp`` (expert data parallel): ``edp`` groups hold replicas of the same experts. With ZeRO 1-3 the
  experts get their own ``fully_shard`` over the ``edp`` slice of the expert mesh (:func:`apply_expert_fsdp`,
  nested inside the block's; the weights become ``(edp, ep, etp)`` DTensors), so FSDP reduces their
  gradients over the replicas and shards their states; with ZeRO 0 every replica keeps its experts whole and
  a gradient hook sums each micro-batch's expert gradient over ``edp`` before it is accumulated
  (:class:`_ReplicaGradSum`). The data-parallel FSDP of the blocks ignores the expert weights.

The expert weights ``w1/w3 [E, H, D]``, ``w2 [E, D, H]`` become DTensors on the 2-D ``(ep, etp)`` sub-mesh:
``[Shard(0), Shard(1)]`` / ``[Shard(0), Shard(2)]`` with expert-TP, ``[Shard(0), Replicate()]`` without, so DCP
saves and reshards them like any other sharded tensor (replicas over ``edp`` are written once) and
``init_weights`` gives each rank its slice of the full seeded draw.

The ``MoE`` module is unchanged; :func:`apply_ep` hooks its ``experts`` submodule from outside. The MoE hands
the experts its tokens sorted by global expert with ``counts [E]``; under TP every TP rank routes the same
(all-gathered) tokens. The hooks, in this order::

    pre   [tp > 1]      f: identity; backward sums the rows' gradient over TP (moe_tp.SumGradOverGroup)
          [etp 1, tp>1] keep this TP rank's contiguous 1/tp of the rows (their counts recomputed)
          all-to-all counts [E] -> how many rows each ep rank sends each local expert
          all-to-all rows: rank r receives the rows of its experts from every ep rank ([src, expert] order),
          regroup them by local expert (stable sort) -> experts run on (rows, local counts [E / ep])
    post  undo the regrouping, all-to-all the rows back to their source ranks, in the original order
          [etp 1, tp>1] zero rows for the other TP ranks' share
          [tp > 1]      g: all-reduce over the TP group (the hidden slices' partial outputs, or the row shares)

Gradients: the all-to-all is an autograd function (its backward is the reverse all-to-all). The trainer
multiplies each rank's loss by dp (x cp) to undo FSDP's gradient averaging; the blocks' FSDP does not reduce
the expert weights, so the combine's backward divides the incoming gradient by ``grad_divisor`` (that
multiplier; divided by ``edp`` when the experts' own FSDP averages over the replicas) and the dispatch's
backward multiplies it back: the expert gradient of an ep group is the exact sum over its ranks' tokens, the
``edp`` reduction adds the other groups', and token gradients are unchanged.

``parallel.enable_alltoall``: the dispatch is always the all-to-all above (gloo and NCCL both implement
``all_to_all_single``); the key is informational. Refused before anything is built (``llmtrain/moe_rules.py``
and ``feasibility.degree_problems``): a model without MoE blocks, an ``ep`` that does not divide
``dp x cp x tp`` or ``num_experts``. Under context parallel the EP group may span CP ranks (each dispatches
its own sequence chunks' tokens; the MoE block sums its micro-batch statistics over CP). With pipeline
parallel each stage's experts live on that stage's ranks (the ``pp`` dim of the expert mesh) and dispatch in
the same schedule order on every rank of the stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from llmtrain.models.common.moe import GroupedExperts, moe_layers
from llmtrain.models.common.moe_tp import ReduceOverGroup, SumGradOverGroup
from llmtrain.moe_rules import expert_tp

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
    """The pre/post forward hooks of one ``GroupedExperts`` (state of the call in flight between them).

    ``tp_group``: the TP group when tp > 1 (f / g around the dispatch); ``rows``: (this TP rank, tp) when the
    experts are whole (expert-TP 1) under TP, so each TP rank dispatches its share of the rows."""

    def __init__(
        self, group: dist.ProcessGroup, ep: int, num_experts: int, grad_divisor: float,
        tp_group: dist.ProcessGroup | None = None, rows: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        self.group, self.ep, self.num_experts, self.local = group, ep, num_experts, num_experts // ep
        self.grad_divisor = grad_divisor
        self.tp_group, self.rows = tp_group, rows
        self.state: tuple | None = None

    def dispatch(self, module: nn.Module, args: tuple) -> tuple:
        x, counts = args  # [M, D] sorted by global expert, [E]
        if self.tp_group is not None:
            x = SumGradOverGroup.apply(x, self.tp_group)
        share = None
        if self.rows is not None:  # this TP rank's contiguous share of the sorted rows
            rank, n = self.rows
            m = x.shape[0]
            start, stop = m * rank // n, m * (rank + 1) // n
            expert_of_row = torch.repeat_interleave(torch.arange(self.num_experts, device=x.device), counts)
            counts = torch.bincount(expert_of_row[start:stop], minlength=self.num_experts).to(counts.dtype)
            x, share = x[start:stop], (start, m - stop)
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
        self.state = (perm, send_splits, recv_splits, share)
        return rows[perm], recv_by_src.sum(0)

    def combine(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        assert self.state is not None  # set by dispatch, the pre-hook of this forward
        perm, send_splits, recv_splits, share = self.state
        self.state = None
        rows = torch.empty_like(out).index_copy_(0, perm, out)  # back to [src rank, expert] order
        y = _AllToAll.apply(rows, send_splits, recv_splits, self.group, 1.0 / self.grad_divisor)
        if share is not None:  # zeros where the other TP ranks' shares go
            y = F.pad(y, (0, 0, *share))
        if self.tp_group is not None:
            y = ReduceOverGroup.apply(y, self.tp_group)
        return y


_MESHES: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}  # id(world) -> (world, its expert mesh)


def expert_mesh(dims: ParallelDims, world: DeviceMesh) -> DeviceMesh:
    """The 4-D expert mesh ``(pp, edp, ep, etp)`` over the ranks of ``world`` (the module docstring), built
    once per world mesh (building one creates process groups: a collective call on every rank)."""
    cached = _MESHES.get(id(world))
    if cached is not None and cached[0] is world:
        return cached[1]
    etp = expert_tp(dims)
    edp = dims.dp * dims.cp * dims.tp // (dims.ep * etp)  # (ep, etp divide it: llmtrain.feasibility)
    ranks = world.mesh.reshape(dims.pp, edp, dims.ep, etp)
    mesh = DeviceMesh(world.device_type, ranks, mesh_dim_names=("pp", "edp", "ep", "etp"))
    _MESHES[id(world)] = (world, mesh)
    return mesh


class _ReplicaGradSum:
    """Forward pre-hook of ``GroupedExperts`` that gives each expert weight a gradient hook summing every
    incoming gradient (a DTensor, before it is accumulated into ``.grad``) over ``group``: the ``edp`` replicas.

    Registered on the first forward, not in :func:`apply_ep`: materialising the meta model (``to_empty``)
    swaps the parameters' tensors and drops hooks registered before it. Once per parameter object."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.hooked: dict[int, nn.Parameter] = {}  # id -> the parameter (kept alive so the id is not reused)

    def __call__(self, module: nn.Module, args: tuple) -> None:
        for param in module.parameters(recurse=False):
            if self.hooked.get(id(param)) is not param:
                param.register_hook(self._sum)
                self.hooked[id(param)] = param

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = grad.to_local().clone() if isinstance(grad, DTensor) else grad.clone()
        dist.all_reduce(local, group=self.group)
        if not isinstance(grad, DTensor):
            return local
        return DTensor.from_local(
            local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
        )


def fsdp_over_edp(dims: ParallelDims, zero_stage: int) -> bool:
    """Whether the experts are FSDP-sharded over their ``edp`` replicas (:func:`apply_expert_fsdp`): with ZeRO
    1-3 and more than one replica; otherwise (ZeRO 0, or one replica) the replicas' gradients are summed by
    :class:`_ReplicaGradSum` and every replica keeps its experts whole."""
    etp = expert_tp(dims)
    return zero_stage >= 1 and dims.dp * dims.cp * dims.tp // (dims.ep * etp) > 1


def apply_ep(
    model: nn.Module, dims: ParallelDims, world: DeviceMesh, grad_divisor: float, fsdp_edp: bool = False
) -> None:
    """Shard every MoE block's experts over the expert mesh (model on the meta device) and hook their forward.

    ``grad_divisor``: the factor by which the trainer pre-multiplies the loss (dp when FSDP is on).
    ``fsdp_edp``: :func:`apply_expert_fsdp` will shard the experts over ``edp`` (its reduction averages over
    the replicas, so the combine divides by ``grad_divisor / edp`` instead, and no replica hook is needed).
    Run before tensor parallel: ``moe_tp.ExpertTP`` then leaves these experts alone (the TP hooks are part of
    the dispatch here, in the order the module docstring shows).
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = expert_mesh(dims, world)
    ep, etp, edp = mesh["ep"].size(), mesh["etp"].size(), mesh["edp"].size()
    if fsdp_edp:
        grad_divisor = grad_divisor / edp
    weights_mesh = mesh["ep", "etp"]
    tp_group = world["tp"].get_group() if dims.tp > 1 else None
    rows = (world["tp"].get_local_rank(), dims.tp) if dims.tp > 1 and etp == 1 else None
    hidden_dim = {"w1": 1, "w3": 1, "w2": 2}  # w1 / w3 [E, H, D], w2 [E, D, H]
    for moe in moe_layers(model):  # (MoE blocks exist and num_experts % ep == 0: llmtrain.feasibility)
        experts: GroupedExperts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            placements = [Shard(0), Shard(hidden_dim[name]) if etp > 1 else Replicate()]
            sharded = distribute_tensor(param.data, weights_mesh, placements, src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        hooks = _Dispatcher(
            mesh["ep"].get_group(), ep, experts.num_experts, grad_divisor, tp_group=tp_group, rows=rows
        )
        if edp > 1 and not fsdp_edp:
            experts.register_forward_pre_hook(_ReplicaGradSum(mesh["edp"].get_group()))
        experts.register_forward_pre_hook(hooks.dispatch)
        experts.register_forward_hook(hooks.combine)
        # markers for expert_params / moe_tp.ExpertTP / logging (torch types Module.__setattr__ for Tensor |
        # Module values only)
        experts.expert_parallel = ep  # type: ignore[assignment]


def apply_expert_fsdp(
    model: nn.Module, dims: ParallelDims, world: DeviceMesh, zero_stage: int, cpu_offload: bool,
    device_type: str, mp_policy: object | None,
) -> None:  # fmt: skip
    """``fully_shard`` every expert-parallel ``GroupedExperts`` over its ``edp`` mesh (dim 0 of the local
    experts; the ``(ep, etp)`` DTensor layout is kept, both meshes being slices of one expert mesh, as FSDP2
    requires), before the blocks are sharded: the blocks' ``fully_shard`` then leaves these parameters to it.
    Resharding, CPU offload and the 16-bit policy ``mp_policy`` are the blocks' (``distributed/parallelize.py``
    passes its ``mixed_precision``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs: dict = {"mesh": expert_mesh(dims, world)["edp"], "reshard_after_forward": zero_stage >= 3}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type != "cpu")
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for m in model.modules():
        if isinstance(m, GroupedExperts) and getattr(m, "expert_parallel", 1) > 1:
            fully_shard(m, **kwargs)


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    """Parameters sharded by :func:`apply_ep` (the data-parallel FSDP must ignore them)."""
    return {
        p
        for m in model.modules()
        if isinstance(m, GroupedExperts) and getattr(m, "expert_parallel", 1) > 1
        for p in m.parameters()
    }

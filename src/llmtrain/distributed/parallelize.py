"""Apply the parallel layout to a model built on the meta device, from outside the model.

Fixed order (torchtitan's): [fp8 swap] -> tensor parallel -> activation recompute -> compile -> FSDP. With
``train.fp8`` the blocks' linear layers first become torchao's ``Float8Linear`` (distributed/float8.py: before
TP, compile and FSDP; tensorwise under FSDP all-gathers the weights in fp8). The model is still on
the meta device; the trainer materializes it afterwards (``to_empty`` + ``init_weights``), so no rank ever holds
more than its shard.

ZeRO stages on FSDP2 (``fully_shard`` per transformer block, then the root):

=====  ====================================  =====================================================
stage  what is sharded over data parallel    how
=====  ====================================  =====================================================
0      nothing (plain data parallel)         FSDP2 on a (replicate=dp, shard=1) mesh: gradients are
                                             all-reduced, every rank holds everything (DDP semantics)
1      optimizer states                      realised as stage 2 (below): FSDP2 reduce-scatters
                                             gradients, so sharding them with the optimizer states
                                             costs no extra communication (reduce-scatter + all-gather
                                             = one all-reduce, as in DeepSpeed's ZeRO-1/2)
2      optimizer states + gradients          ``reshard_after_forward=False``: parameters stay gathered
                                             from forward to backward
3      + parameters                          ``reshard_after_forward=True``: gathered per block,
                                             freed after use
=====  ====================================  =====================================================

HSDP (``parallel.data_parallel_replicate`` > 1): shard within groups, replicate across them (2-D mesh).
Under gradient accumulation the reductions run once per optimizer step for stages 0-2 and for the replicate
dim of HSDP, per micro-batch for ZeRO-3's reduce-scatter unless ``parallel.reduce_grads: per_step``: the
switches are set per micro-batch by the train step (distributed/grad_sync.py, which also gives the memory).
``parallel.cpu_offload`` adds FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and optimizer states live
in host memory; the optimizer step runs on the CPU).

Precision (``train.precision`` bf16 / fp16, :func:`mixed_precision`): the blocks are sharded with FSDP2's
``MixedPrecisionPolicy(param_dtype=<run dtype>, reduce_dtype=fp32, cast_forward_inputs=False)``; the forward
still runs under ``torch.autocast`` (train/precision.py), whose casts of these already-16-bit weights are then
no-ops. So the 16-bit weight a matmul saves for backward is FSDP's gathered copy, freed after each block under
ZeRO-3 and gathered again in backward, instead of an autocast copy held for the whole forward; the
all-gathers move 2 bytes per parameter. The values are the ones autocast computed (both round fp32 to
nearest-even), gradients are reduced and accumulated in fp32 (FSDP2 keeps the unsharded sum of deferred
micro-batches in ``reduce_dtype``). What changes: the norm weights, which autocast left in fp32, enter the
forward rounded to 16 bits and their gradients are rounded to 16 bits before the fp32 reduction (as every
matmul weight's already was); a norm applied to a 16-bit tensor (qwen3's q/k norms) then returns 16 bits.
The root (embedding, final norm, head) is not cast: the embedding output, hence the residual stream, stays
fp32, and autocast still casts the head. Expert-parallel experts sharded over their replicas (ZeRO 1-3, more
than one replica: distributed/expert_parallel.py) get the blocks' policy; those outside FSDP keep autocast's
casts.

Which layouts may be built is decided by :mod:`llmtrain.feasibility` alone (config validation refuses the
others before anything is built); :func:`parallelize` only asserts it once more with the same function and
message (:func:`~llmtrain.feasibility.require_feasible`), for callers that skipped validation. One layout
rule changes what is built instead of refusing it: with tensor parallel, ``train.compile`` is skipped (per-block
compile + TP fails in backward on this torch; the feasibility warning ``tp_compile`` says so). The TP plan of
a model is a field of its family (``FamilySpec.tp_plan``), not a registry here. Imports go one way: the
pipeline builder (``distributed/pipeline.py``) uses this module, never the reverse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from llmtrain.config.schema import Config
from llmtrain.distributed.parallel_dims import ParallelDims
from llmtrain.errors import ConfigError
from llmtrain.feasibility import ZERO_BUBBLE_SCHEDULES, require_feasible
from llmtrain.models import Transformer, get_family

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, loss_parallel: bool = True) -> None:
    """Shard attention heads, MLP hidden units and the vocabulary over ``tp_mesh`` (with sequence parallel);
    ``loss_parallel``: the head's logits stay sharded over the vocabulary (models/common/parallelize.py)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    args = model.args
    plan = get_family(args.family).tp_plan
    # A pipeline stage lacks the embedding or the head (None): plan only the modules it has.
    top = {k: v for k, v in plan.top(args, loss_parallel).items() if getattr(model, k, None) is not None}
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan.block(args))
    if args.tie_word_embeddings and model.tok_embeddings is not None and model.output is not None:
        # Each style distributed its own copy of the shared [vocab, dim] weight, both Shard(0) over the
        # vocabulary: share the embedding's DTensor again (gradients of both uses then add up in it).
        emb, out = cast(DTensor, model.tok_embeddings.weight), cast(DTensor, model.output.weight)
        if emb.placements != out.placements:
            raise ConfigError(
                f"model.tie_word_embeddings with tensor_parallel: the {args.family} TP plan shards the "
                f"embedding as {emb.placements} and the output as {out.placements}; tying needs one layout."
            )
        model.tie_weights()


def apply_recompute(model: Transformer, mode: str, every: int) -> None:
    """Wrap blocks in activation checkpointing: all of them (full) or one in ``every`` (selective)."""
    if mode in ("none", "offload"):  # offload: saved-tensor hooks after compile (distributed/offload.py)
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, (key, block) in enumerate(list(model.layers.items())):
        if mode == "full" or i % every == 0:
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)


MIXED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The precisions whose blocks FSDP2 gathers in 16 bits (:func:`mixed_precision`)."""


def mixed_precision(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for the blocks of a ``precision`` run (see the module docstring); None for fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = MIXED_DTYPES.get(precision)
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def apply_fsdp(
    model: Transformer,
    dp_mesh: DeviceMesh,
    zero_stage: int,
    cpu_offload: bool,
    device_type: str,
    ignored_params: set | None = None,
    precision: str = "fp32",
) -> None:
    """``fully_shard`` each block, then the root, with the stage's resharding policy. ``ignored_params``
    (expert-parallel experts, already sharded) are left alone by FSDP. Under bf16/fp16 the blocks (not the
    root) get :func:`mixed_precision`'s policy."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs: dict = {"mesh": dp_mesh, "reshard_after_forward": zero_stage >= 3}
    if ignored_params:
        kwargs["ignored_params"] = ignored_params
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type != "cpu")
    policy = mixed_precision(precision)
    block_kwargs = {**kwargs, "mp_policy": policy} if policy is not None else kwargs
    for block in model.layers.values():
        fully_shard(block, **block_kwargs)
    fully_shard(model, **kwargs)


def dp_mesh_for(dims: ParallelDims, world: DeviceMesh, zero_stage: int) -> DeviceMesh:
    """The mesh FSDP2 shards/replicates over: 2-D (replicate, shard) for HSDP and for stage 0, else 1-D. Under
    context parallel the shard dim is the flattened ``dp_shard x cp`` (CP ranks hold replicas: they shard)."""
    if dims.cp > 1:
        import warnings

        with warnings.catch_warnings():  # slicing a flattened dim from the root mesh: deprecated, still works
            warnings.simplefilter("ignore")
            return world["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else world["dp_shard_cp"]
    if zero_stage == 0 or dims.dp_replicate > 1:
        return world["dp_replicate", "dp_shard"]
    return world["dp_shard"]


def compiles(cfg: Config, dims: ParallelDims) -> bool:
    """Whether ``train.compile`` is carried out: the blocks and the loss (train/loss.py); not with TP, nor with
    the zero-bubble pipeline schedules (feasibility warnings ``tp_compile``, ``pp_compile_zero_bubble``)."""
    zero_bubble = dims.pp > 1 and cfg.parallel.schedule in ZERO_BUBBLE_SCHEDULES
    return bool(cfg.train.compile) and dims.tp == 1 and not zero_bubble


def parallelize(
    model: Transformer, cfg: Config, dims: ParallelDims, world: DeviceMesh | None, device_type: str
) -> bool:
    """Apply [fp8] -> TP -> recompute -> compile -> FSDP as configured. Returns True when FSDP wraps the model
    (its gradient reduction then averages over the data-parallel ranks)."""
    require_feasible(cfg, dims.world_size, model.args)  # validation already refused the others
    model.attention_impl = cfg.model.attention  # sdpa | flex | auto, per forward (models/common/flex.py)
    # CP ranks' gradients are reduced by FSDP over dp_shard x cp; with parallel.cpu_offload and dp x cp 1 (TP
    # or PP alone) FSDP wraps over a 1-rank data-parallel mesh: its offload policy is what offloads.
    fsdp = dims.dp > 1 or dims.cp > 1 or (cfg.parallel.cpu_offload and world is not None)
    if cfg.train.fp8 != "none":  # module swap first: TP, recompute, compile and FSDP see Float8Linear
        from llmtrain.distributed.float8 import apply_float8

        apply_float8(model, cfg, device_type, fsdp_all_gather=fsdp and dims.dp_shard > 1)
    expert_params: set = set()
    experts_fsdp = False  # experts FSDP-sharded over their edp replicas (distributed/expert_parallel.py)
    if dims.ep > 1:  # experts on the expert mesh, before TP (which leaves them alone) and FSDP (ignores them)
        from llmtrain.distributed import expert_parallel

        assert world is not None
        experts_fsdp = fsdp and expert_parallel.fsdp_over_edp(dims, cfg.parallel.effective_zero_stage())
        # grad_divisor: the trainer's loss multiplier under FSDP (dp, x cp under context parallel: train/step.py)
        divisor = dims.dp * dims.cp
        expert_parallel.apply_ep(model, dims, world, grad_divisor=divisor, fsdp_edp=experts_fsdp)
        expert_params = expert_parallel.expert_params(model)
    if dims.tp > 1:
        assert world is not None
        apply_tp(model, world["tp"], cfg.parallel.loss_parallel)
    if dims.cp > 1:  # sequence split, K/V all-gather in attention (distributed/context_parallel.py)
        from llmtrain.distributed.context_parallel import apply_cp

        assert world is not None
        apply_cp(model, world["cp"])
        if cfg.train.fp8 != "none":  # fp8 scales over the whole sequence (distributed/float8.py)
            from llmtrain.distributed.float8 import apply_context_parallel

            apply_context_parallel(model, world["cp"])
    apply_recompute(model, cfg.recompute.mode, cfg.recompute.every)
    if compiles(cfg, dims):  # with TP the blocks run eagerly (feasibility warning tp_compile)
        for key, block in list(model.layers.items()):
            model.layers[key] = cast(nn.Module, torch.compile(block))  # an OptimizedModule wrapping block
    if cfg.recompute.mode == "offload":  # hooks on the (compiled) blocks, names unchanged, before FSDP
        from llmtrain.distributed.offload import apply_offload

        apply_offload(model, device_type)
    if fsdp:
        assert world is not None
        zero = cfg.parallel.effective_zero_stage()
        # Under PP, zero-bubble schedules give wrong gradients with reshard_after_forward=True on this torch
        # (docs: pipeline parallel): stage modules keep parameters gathered from forward to backward.
        resharding = min(zero, 2) if dims.pp > 1 else zero
        if experts_fsdp:  # their own FSDP over the expert replicas, nested inside the blocks'
            expert_parallel.apply_expert_fsdp(
                model,
                dims,
                world,
                resharding,
                cfg.parallel.cpu_offload,
                device_type,
                mixed_precision(cfg.train.precision),
            )
            expert_params = set()
        apply_fsdp(
            model, dp_mesh_for(dims, world, zero), resharding, cfg.parallel.cpu_offload, device_type,
            ignored_params=expert_params, precision=cfg.train.precision,
        )  # fmt: skip
    return fsdp

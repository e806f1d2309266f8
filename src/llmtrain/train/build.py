"""Building a run: every part a :class:`~llmtrain.train.trainer.Trainer` needs, made before the first step.

:func:`build_run` goes once through the order the parts depend on each other::

    device + process group -> data (the tokenizer fixes the vocabulary) -> the resolved run (derived figures,
    the stage plan, the run's length: stages' total or the epochs cap) -> <run_dir>/config.yaml
    -> meshes -> model on the meta device, parallelized from outside (FSDP / TP / PP / EP), materialized, seeded
    -> optimizer, LR schedule, loss scaler -> batches (one stage, or the curriculum of stages)
    -> monitoring and survival parts (timer, stragglers, profiler, events, guard, faults, checkpointer)
    -> the checkpoint to resume from (or model.init_from)

The config as written is never changed: the resolved run's config is a copy whose ``train.max_steps`` is the
run's real length, and that copy is what is saved and what the trainer reads. The parts come back as one plain
record (:class:`RunParts`); nothing here runs a training step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from llmtrain.config.schema import Config
from llmtrain.data.describe import DatasetInfo, describe_dataset
from llmtrain.data.loader import BatchIterator, build_datasets
from llmtrain.distributed.device import init_distributed, init_local_group, resolve_device
from llmtrain.distributed.parallelize import compiles, parallelize
from llmtrain.ft.layout import first_group
from llmtrain.models import Transformer, build_model
from llmtrain.models.common.moe import MoEStepStats
from llmtrain.resolve.run import ResolvedRun, resolve_run
from llmtrain.resolve.stages import StagedLR
from llmtrain.train.checkpoint import Checkpointer, ResumeChoice
from llmtrain.train.checkpoint.layout import root_of_run
from llmtrain.train.curriculum import Curriculum, recompute_superset
from llmtrain.train.fault import FaultInjector
from llmtrain.train.optim import build_optimizer
from llmtrain.train.precision import LossScaler
from llmtrain.train.rundir import RunLock, write_resolved_config
from llmtrain.train.schedule import build_lr_schedule
from llmtrain.train.stability import EventLog, HostSnapshot, StabilityGuard
from llmtrain.train.step import TokenLoss, TrainStep
from llmtrain.train.straggler import StragglerMonitor
from llmtrain.train.timing import ProfilerWindow, StepTimer


@dataclass
class RunParts:
    """Everything :func:`build_run` made (see the module docstring for the order)."""

    run: ResolvedRun
    device: torch.device
    world_size: int
    rank: int
    run_dir: Path
    train_samples: Any
    valid_samples: Any
    eos_id: int
    dp_group: Any
    dp_rank: int
    dp_size: int
    model: torch.nn.Module
    pipeline: Any
    fsdp: bool
    optimizer: torch.optim.Optimizer
    lr_at: Any
    scaler: LossScaler
    curriculum: Curriculum | None
    batches: BatchIterator
    step_fn: TrainStep
    timer: StepTimer
    stragglers: StragglerMonitor
    profiler: ProfilerWindow
    events: EventLog
    guard: StabilityGuard
    snapshot: HostSnapshot
    faults: FaultInjector
    checkpointer: Checkpointer
    resume: ResumeChoice
    lock: RunLock | None
    """Rank 0's lock on the run directory (released by ``Trainer.close`` / the end of ``fit``)."""


def build_run(cfg: Config) -> RunParts:
    """Build every part of the run described by ``cfg`` (which is not modified)."""
    device = resolve_device(cfg.run.device_target)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    world_size = init_distributed(device.type, cfg.run.dist_timeout_s)
    rank = dist.get_rank() if world_size > 1 else 0
    run_dir = Path(cfg.run.output_dir)

    # Data first: the tokenizer fixes the vocabulary when the config leaves it open.
    train_samples, valid_samples = build_datasets(cfg)
    data = describe_dataset(cfg.data.datasets[0].path, cfg.data.tokenizer, "data.datasets[0].path")
    run = resolve_run(cfg, world_size, cast(int, data.vocab_size), len(train_samples))
    first = first_group()  # replica groups (ft/): the run's lock and config.yaml are group 0's
    # one live run per run directory and per checkpoint directory (train/rundir.py)
    ckpt_root = root_of_run(run_dir, cfg.checkpoint.save_dir)
    lock = RunLock(run_dir, ckpt_root).acquire() if rank == 0 and first else None
    try:
        if rank == 0 and first:
            write_resolved_config(run.cfg, run_dir)
        return _build_parts(run, device, world_size, rank, run_dir, train_samples, valid_samples, data, lock)
    except BaseException:  # nothing of this run will use the directory: free it
        if lock is not None:
            lock.release()
        raise


def _build_parts(
    run: ResolvedRun, device: torch.device, world_size: int, rank: int, run_dir: Path, train_samples: Any,
    valid_samples: Any, data: DatasetInfo, lock: RunLock | None,
) -> RunParts:  # fmt: skip
    """The parts after the data and the resolved run (the module docstring's order, from the meshes on)."""
    cfg, d = run.cfg, run.derived

    # Layout: one mesh per parallel dimension; this rank's data-parallel slice.
    dims = d.dims
    assert dims is not None  # derive() always sets it
    local_mesh = world_size == 1 and cfg.parallel.cpu_offload  # FSDP's offload policy needs a (1-rank) mesh
    if local_mesh:
        init_local_group(device.type, cfg.run.dist_timeout_s)
    meshes = dims.build_meshes(device.type) if world_size > 1 or local_mesh else None
    dp_group = meshes["dp"].get_group() if meshes and dims.dp > 1 else None
    dp_rank = meshes["dp"].get_local_rank() if meshes and dp_group is not None else 0

    # Model: built on meta, parallelized from outside, materialized on the device, seeded init.
    layout_cfg = recompute_superset(cfg, run.stages)  # stages that switch recompute: every block wrapped once
    model = build_model(d.model_args, device="meta")
    loss = TokenLoss(cfg.train.label_smoothing, compiled=compiles(layout_cfg, dims))
    pipeline = None  # pipeline parallel: the model is this rank's pruned model (distributed/pipeline.py)
    if dims.pp > 1:
        from llmtrain.distributed.pipeline import PipelineRunner

        assert meshes is not None  # pp > 1 means more than one process
        pipeline = PipelineRunner(layout_cfg, dims, meshes, model, device, loss)
        # this rank's stage: the Transformer with the other stages' layers pruned away
        model, fsdp = cast(Transformer, pipeline.model), pipeline.fsdp
    else:
        fsdp = parallelize(model, layout_cfg, dims, meshes["world"] if meshes else None, device.type)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.train.seed)

    optimizer = build_optimizer(model, cfg.train, device.type)
    scaler = LossScaler.from_config(cfg.train)
    curriculum = Curriculum(cfg, run.stages, dp_rank, dims.dp) if run.stages else None
    if curriculum is not None:
        lr_at: Any = StagedLR(
            curriculum.plans, cfg.train.warmup_steps, cfg.train.lr, cfg.train.wsd_decay_fraction
        )
        batches = curriculum.batches
    else:
        lr_at = build_lr_schedule(cfg.train)
        batches = BatchIterator(train_samples, d.global_batch, d.micro_batch_size, dp_rank, dims.dp)

    # Monitoring (train/timing.py, train/straggler.py) and survival (stability guard, faults, checkpoints).
    timer = StepTimer(device)
    log = cfg.logging
    stragglers = StragglerMonitor(world_size, device, log.straggler_margin, log.straggler_patience)
    profiler = ProfilerWindow(run_dir, rank, log.profile_every, log.profile_steps, device.type)
    events = EventLog(run_dir, echo=None, enabled=rank == 0)
    faults = FaultInjector(cfg.fault, run_dir, rank, d.model_args.vocab_size)
    moe = MoEStepStats(d.model_args.bias_update_rate) if d.model_args.num_experts else None
    step_fn = TrainStep(
        model, optimizer, scaler, loss, device, timer, faults,
        dp_group=dp_group, pipeline=pipeline, moe=moe, grad_scale=float(dims.dp) if fsdp else 1.0,
        world_size=world_size,
    )  # fmt: skip
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, device.type)
    checkpointer.fault_hook = faults.during_save
    return RunParts(
        run=run, device=device, world_size=world_size, rank=rank, run_dir=run_dir,
        train_samples=train_samples, valid_samples=valid_samples, eos_id=cast(int, data.eos_id),
        dp_group=dp_group, dp_rank=dp_rank, dp_size=dims.dp, model=model, pipeline=pipeline, fsdp=fsdp,
        optimizer=optimizer, lr_at=lr_at, scaler=scaler, curriculum=curriculum, batches=batches,
        step_fn=step_fn, timer=timer, stragglers=stragglers, profiler=profiler, events=events,
        guard=StabilityGuard(cfg.stability), snapshot=HostSnapshot(int(cfg.stability.snapshot_max_gb * 2**30)),
        faults=faults, checkpointer=checkpointer, resume=checkpointer.select_resume(), lock=lock,
    )  # fmt: skip

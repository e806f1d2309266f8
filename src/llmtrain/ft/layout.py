"""The replica layout of a config: R groups of ``world / R`` ranks, validated before anything starts.

A job of ``world`` ranks with ``fault_tolerance.replicas: R`` is R groups of ``world / R`` ranks. Inside a group
the layout is the configured one, derived for the group's ranks (``parallel.data_parallel: -1`` takes the
group's ranks); across groups the data-parallel degree is multiplied by R. ``train.batch_size`` stays the
global batch of all groups: each group reads ``batch_size / R`` samples per step (its slice, ft/data.py).

:func:`check_group` is the rule for one group (``resolve.validate`` calls it with the group's world size, in
every trainer and in ``check``/``launch`` before anything is spawned); :func:`group_world` splits a job's world
size; :func:`layout_lines` is what ``llmtrain check`` prints. Each problem is one ConfigError naming the key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from llmtrain.config.schema import Config
from llmtrain.errors import ConfigError

REPLICA_ENV = "LLMTRAIN_REPLICA_ID"
"""Set by ``llmtrain launch --replicas`` for every rank of a group: the group's replica id (0 .. R-1)."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""The lighthouse's address (http://HOST:PORT), torchft's own variable; ``fault_tolerance.lighthouse`` wins."""


def fsdp_hook_sums(pipelined: bool, policy: str, replicas: int) -> bool:
    """Whether FSDP2's all-reduce hook may carry the cross-group gradient sum (ft/grads.py): only when every group
    calls it equally often in a step, because each call is one collective across the groups. A pipeline schedule
    reduces each stage once per schedule run, and ``keep`` runs the schedule once per slot a group covers; without
    pipelining, ZeRO-3 reduces every micro-batch, and ``keep`` over three or more groups can leave survivors
    covering different numbers of a missing group's slots. In those cases every gradient is summed once, after
    the backward (``sum_grads``). The planner costs the same choice (plan/replicas.py)."""
    return not pipelined and not (policy == "keep" and replicas > 2)


def first_group() -> bool:
    """True outside replica groups and in group 0 (which writes metrics.jsonl and holds the run's lock)."""
    return os.environ.get(REPLICA_ENV, "0") == "0"


@dataclass(frozen=True)
class ReplicaLayout:
    """Where this process sits: ``replica_id`` of ``replicas`` groups, each of ``group_world`` ranks."""

    replicas: int
    replica_id: int
    group_world: int

    @staticmethod
    def from_env(cfg: Config, group_world: int) -> ReplicaLayout:
        """This process's layout from ``LLMTRAIN_REPLICA_ID`` (ConfigError when it is missing or out of range)."""
        raw = os.environ.get(REPLICA_ENV)
        replicas = cfg.fault_tolerance.replicas
        if raw is None or not raw.isdigit() or int(raw) >= replicas:
            raise ConfigError(
                f"fault_tolerance.enabled: true, but ${REPLICA_ENV} is {raw!r}: it must be this group's replica "
                f"id, 0 .. {replicas - 1}. Start the job with `llmtrain launch CONFIG --nproc-per-node N "
                f"--replicas {replicas}`, which sets it for each group."
            )
        return ReplicaLayout(replicas, int(raw), group_world)


def group_world(cfg: Config, world_size: int) -> int:
    """The ranks of one group of a job of ``world_size`` ranks; ConfigError when R does not divide it."""
    replicas = cfg.fault_tolerance.replicas
    if world_size % replicas or world_size < replicas:
        raise ConfigError(
            f"fault_tolerance.replicas = {replicas} does not divide the world size {world_size} (nodes x "
            f"--nproc-per-node): every replica group needs the same number of ranks. Use a divisor of "
            f"{world_size}, or change the number of processes."
        )
    return world_size // replicas


def check_group(cfg: Config, world_size: int) -> None:
    """ConfigError when one group of ``world_size`` ranks cannot serve ``cfg``'s fault_tolerance section."""
    ft = cfg.fault_tolerance
    if not ft.enabled:
        return
    from llmtrain.ft.version import require_pinned
    from llmtrain.resolve.derived import resolve_grad_accum

    if ft.min_replicas > ft.replicas:
        raise ConfigError(
            f"fault_tolerance.min_replicas = {ft.min_replicas} is more than fault_tolerance.replicas = "
            f"{ft.replicas}: no step could ever commit. Use 1 .. {ft.replicas}."
        )
    if cfg.fault.replica >= ft.replicas:
        raise ConfigError(
            f"fault.replica = {cfg.fault.replica} names no group of fault_tolerance.replicas = {ft.replicas}; "
            f"use 0 .. {ft.replicas - 1} (or -1: every group)."
        )
    kills = cfg.fault.kill_replicas
    if kills and (len(kills) != len(cfg.fault.kill_at_step) or max(kills) >= ft.replicas):
        raise ConfigError(
            f"fault.kill_replicas = {kills} must name one group (0 .. {ft.replicas - 1}) for each of "
            f"fault.kill_at_step = {cfg.fault.kill_at_step}, in order."
        )
    if cfg.stages:  # the one layout replica groups do not serve (pipeline, context and expert parallel do)
        raise ConfigError(
            "fault_tolerance.enabled: true cannot serve stages: (a staged curriculum): each stage switches "
            "the batch arithmetic and the data mixture, which the replica groups' slices of the global batch do "
            "not follow yet. Use one stage (move the stage's settings to train:/data:), or switch fault "
            "tolerance off (torchrun's elastic restart)."
        )
    from llmtrain.distributed.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(cfg.parallel, world_size)
    resolve_grad_accum(cfg.train, dims.dp)  # the group's own arithmetic, with train's message
    per_pass = cfg.train.micro_batch_size * dims.dp * ft.replicas
    if cfg.train.batch_size % per_pass:
        raise ConfigError(
            f"train.batch_size {cfg.train.batch_size} (the global batch of all replica groups) is not divisible "
            f"by train.micro_batch_size {cfg.train.micro_batch_size} x data parallel {dims.dp} per group x "
            f"fault_tolerance.replicas {ft.replicas} = {per_pass}: each group reads an equal slice. Use a "
            f"multiple of {per_pass}."
        )
    if dims.pp > 1:  # a schedule run takes one group's slot (ft/data.py; keep runs it once per slot)
        from llmtrain.feasibility import pipeline_microbatches, schedule_name

        n_mb = pipeline_microbatches(cfg, dims.dp * ft.replicas)
        slot = cfg.train.batch_size // (dims.dp * ft.replicas)
        if slot % n_mb or (schedule_name(cfg.parallel) == "1f1b" and n_mb < dims.pp):
            raise ConfigError(
                f"parallel.pipeline_parallel {dims.pp} with fault_tolerance.replicas {ft.replicas}: each "
                f"pipeline rank runs the schedule on its group's slot of {slot} sequences (train.batch_size "
                f"{cfg.train.batch_size} / data parallel {dims.dp} / replicas {ft.replicas}) in {n_mb} pipeline "
                "micro-batches (parallel.micro_batch_num, or slot / train.micro_batch_size when it is 1), which "
                f"must divide the slot{' and be at least pipeline_parallel (1f1b)' if n_mb < dims.pp else ''}. "
                "Raise train.batch_size or set parallel.micro_batch_num to fit."
            )
    require_pinned()


def layout_lines(cfg: Config, world_size: int) -> list[tuple[str, str]]:
    """``llmtrain check``'s lines for a job of ``world_size`` ranks (nothing when fault tolerance is off)."""
    ft = cfg.fault_tolerance
    if not ft.enabled:
        return []
    from llmtrain.distributed.parallel_dims import ParallelDims

    g = world_size // ft.replicas
    per_group = cfg.train.batch_size // ft.replicas
    dp, micro = ParallelDims.from_config(cfg.parallel, g).dp, cfg.train.micro_batch_size
    accum = per_group // max(dp * micro, 1)
    return [
        ("replica groups", f"{ft.replicas} x {g} ranks (ranks {g} x r .. {g} x r + {g - 1} form group r)"),
        ("per group", f"{per_group} samples of the global batch {cfg.train.batch_size} per step (micro {micro} x "
                      f"DP {dp} x accumulation {accum}; the derived figures above are one group's layout)"),
        ("quorum", f"at least {ft.min_replicas} group(s); missing group: {ft.batch_policy} "
                   f"({'survivors compute its slice' if ft.batch_policy == 'keep' else 'its slice is skipped'})"),
        ("timeouts", f"heartbeat {ft.heartbeat_timeout_s:g} s, quorum {ft.quorum_timeout_s:g} s, "
                     f"collectives {ft.timeout_s:g} s"),
    ]  # fmt: skip

"""Typed config of the survival features, re-exported by ``config.schema`` (the one place that composes the
sections): the loss-spike / NaN guard (``stability:``, train/stability.py) and injected faults for tests and drills
(``fault:``, train/fault.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from llmtrain.errors import ConfigError

HEALTH_METRICS = ("max_layer_grad_norm", "attn_logit_bound", "logit_rms", "nonfinite_frac")
"""The scalar health figures of the log steps (train/health.py), besides the per-layer ones."""
PER_LAYER_METRIC = re.compile(r"^(grad_norm|param_norm)/layer_\d{2,}$")
"""``grad_norm/layer_03``, ``param_norm/layer_11``: the per-layer figures as metrics.jsonl names them."""


def check_watch(watch: list[str], where: str = "") -> None:
    """ConfigError for the first ``stability.watch`` entry that no step produces (``where``: a stage prefix)."""
    for i, name in enumerate(watch):
        if not (name in ("loss", "grad_norm", *HEALTH_METRICS) or PER_LAYER_METRIC.match(str(name))):
            raise ConfigError(
                f"{where}stability.watch[{i}]: {name!r} is not one of loss, grad_norm, {', '.join(HEALTH_METRICS)}, "
                "grad_norm/layer_NN or param_norm/layer_NN (NN the block index as metrics.jsonl writes it, zero-"
                "padded to the model's depth, two digits at least: grad_norm/layer_03)."
            )


@dataclass
class StabilityConfig:
    """Loss-spike and NaN guard: detection rules, rollback and data skipping (train/stability.py)."""

    enabled: bool = True
    """Watch the run at all."""
    rule: Literal["mad", "sigma", "ratio"] = "mad"
    """Spike rule: mad (median + k * MAD), sigma (mean + k * std) or ratio (r x the recent median)."""
    watch: list[str] = field(default_factory=lambda: ["loss"])
    """Metrics the rule is applied to: loss, grad_norm, or any health metric of the log steps (train/health.py:
    max_layer_grad_norm, attn_logit_bound, logit_rms, nonfinite_frac, grad_norm/layer_NN, param_norm/layer_NN),
    which are looked at on the steps that log them (every train.log_steps)."""
    window: int = 50
    """Good steps in the rolling window of statistics."""
    min_history: int = 20
    """Good steps needed before spikes are looked for."""
    k: float = 6.0
    """Threshold of the mad and sigma rules, in robust standard deviations."""
    ratio: float = 2.0
    """Threshold of the ratio rule: anomalous above ratio x the window median."""
    min_rel_increase: float = 0.05
    """An anomaly must also exceed the window median by this fraction of it."""
    consecutive: int = 3
    """Anomalous steps in a row that make a spike (the seed: 10 steps above 2x)."""
    max_nonfinite_steps: int = 5
    """NaN/Inf steps in a row (each skipped) that force a rollback."""
    max_rollbacks: int = 5
    """Rollbacks allowed in a run; one more is give_up."""
    skip_batches: int = 0
    """Global batches to skip after the restored checkpoint; 0 skips exactly up to the detecting step."""
    margin_steps: int = 0
    """Restore a checkpoint at least this many steps before the first anomalous step (PaLM: ~100)."""
    lr_factor: float = 1.0
    """Multiply the LR by this after a rollback (1.0: unchanged)..."""
    lr_factor_steps: int = 0
    """... for this many steps after the restored step."""
    snapshot_max_gb: float = 4.0
    """Keep the newest checkpoint's state in host memory when it is at most this large (0: never)."""


@dataclass
class FaultConfig:
    """Injected faults for tests and drills (train/fault.py). Empty = no faults."""

    kill_at_step: list[int] = field(default_factory=list)
    """Kill ``rank`` with SIGKILL at the start of these steps."""
    hang_at_step: list[int] = field(default_factory=list)
    """Hang ``rank`` (sleep ``hang_seconds``) at the start of these steps."""
    hang_seconds: float = 3600.0
    """How long an injected hang sleeps (the watchdog should fire first)."""
    nan_at_step: list[int] = field(default_factory=list)
    """Poison the loss (nan_target: loss) or a gradient (grad) with NaN at these steps."""
    nan_target: Literal["loss", "grad"] = "loss"
    """Where the NaN goes: loss or grad."""
    spike_at_step: list[int] = field(default_factory=list)
    """Corrupt the batch tokens (random labels) at these steps: a loss spike."""
    spike_steps: int = 1
    """Consecutive steps corrupted from each spike_at_step."""
    crash_in_save_at_step: list[int] = field(default_factory=list)
    """Truncate a data file of the checkpoint being written at these steps, then SIGKILL (before commit)."""
    corrupt_checkpoint_at_step: list[int] = field(default_factory=list)
    """After committing the checkpoint of these steps, damage one of its .distcp files."""
    corrupt_mode: Literal["flip", "truncate"] = "flip"
    """flip (one byte changed) or truncate (half the file)."""
    rank: int = 0
    """The rank that is killed, hung or gets the NaN (-1: every rank)."""
    replica: int = -1
    """With fault_tolerance: the replica group whose ``rank`` is killed, hung or poisoned (-1: every group)."""
    kill_replicas: list[int] = field(default_factory=list)
    """With fault_tolerance: the group killed at each kill_at_step, in order (empty: ``replica`` for all)."""
    slow_rank: int = -1
    """Slow this rank down on every step by sleeping slow_seconds before it (straggler drills; -1: none)."""
    slow_seconds: float = 0.0
    """Sleep per step of slow_rank."""
    slow_when: Literal["always", "degraded"] = "always"
    """Which steps of slow_rank sleep: always (every step), or degraded (with fault_tolerance: only the steps
    whose quorum is short of groups, so the survivors of a kill are paced until the restarted group rejoins,
    and the full steps run at full speed; a replica drill's runway is then (steps left) x slow_seconds)."""
    seed: int = 0
    """Seed of the corrupted tokens."""


@dataclass
class FaultToleranceConfig:
    """Replica groups (torchft): the job is ``replicas`` groups, each with the configured layout inside; the
    gradients are averaged across the groups present at each step, a group whose rank dies is dropped from the
    quorum while the others keep stepping, and a restarted group heals live from a peer (src/llmtrain/ft/).
    Started by ``llmtrain launch CONFIG --nproc-per-node N --replicas R``; needs the ft extra."""

    enabled: bool = False
    """Run as replica groups (``llmtrain launch --replicas R`` switches it on)."""
    replicas: int = 1
    """Number of replica groups; the world size (nodes x nproc-per-node) must be a multiple of it."""
    min_replicas: int = 1
    """Fewest groups that may commit a step; with fewer, the survivors wait for a group to (re)join."""
    batch_policy: Literal["shrink", "keep"] = "shrink"
    """While a group is missing: shrink (the groups present step on their own slices of the global batch; the
    missing slices are recorded as skipped samples in events.jsonl) or keep (the survivors also compute the
    missing slices, so the global batch and the LR schedule stay as configured)."""
    heartbeat_timeout_s: float = 1.0
    """A group that sent no heartbeat to the lighthouse for this long is dropped from the next quorum."""
    join_timeout_s: float = 5.0
    """How long a quorum waits for a healthy group that has not asked to join yet (0: not at all)."""
    quorum_timeout_s: float = 60.0
    """How long a step waits for its quorum (with fewer than min_replicas groups alive it waits this long)."""
    timeout_s: float = 10.0
    """Timeout of the cross-group process group's collectives, the commit vote and the live heal's transfer."""
    lighthouse: str | None = None
    """HOST:PORT of the lighthouse (None: the one `llmtrain launch` starts, passed as TORCHFT_LIGHTHOUSE)."""

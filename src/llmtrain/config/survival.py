"""Typed config of the survival features, re-exported by ``config.schema`` (the one place that composes the
sections): the loss-spike / NaN guard (``stability:``, train/stability.py) and injected faults for tests and drills
(``fault:``, train/fault.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class StabilityConfig:
    """Loss-spike and NaN guard: detection rules, rollback and data skipping (train/stability.py)."""

    enabled: bool = True
    """Watch the run at all."""
    rule: Literal["mad", "sigma", "ratio"] = "mad"
    """Spike rule: mad (median + k * MAD), sigma (mean + k * std) or ratio (r x the recent median)."""
    watch: list[Literal["loss", "grad_norm"]] = field(default_factory=lambda: ["loss"])
    """Metrics the rule is applied to: loss and/or grad_norm."""
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
    slow_rank: int = -1
    """Slow this rank down on every step by sleeping slow_seconds before it (straggler drills; -1: none)."""
    slow_seconds: float = 0.0
    """Sleep per step of slow_rank."""
    seed: int = 0
    """Seed of the corrupted tokens."""

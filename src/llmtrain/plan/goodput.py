"""Goodput under failures: the fraction of wall time that makes progress, restart-from-checkpoint vs replica groups.

``llmtrain plan CONFIG --failures MTBF_HOURS_PER_DEVICE``. With N devices that each fail independently every
``MTBF`` hours, the job sees a failure every ``MTBF / N`` hours (rate ``lam = N / MTBF``). Per failure:

* restart from the newest checkpoint (torchrun's elastic restart): every rank stops; the job restarts
  (``restart_s``), reads the checkpoint (``load_s``) and recomputes the steps since the save, on average half a
  save interval (``interval_s / 2``). Lost per failure: ``restart_s + load_s + interval_s / 2``.
* replica groups (``fault_tolerance``, R groups): the survivors lose the heartbeat timeout, the one step in
  flight and the heal (the live transfer of one device's state, ``heal_s``, during which the quorum waits); the
  failed group's devices are missing for its restart and load, a 1/R share of the job's capacity. Lost per
  failure: ``heartbeat_s + step_s + heal_s + (restart_s + load_s) / R``.

Both pay the blocking part of each save, ``save_s`` per ``interval_s``. Goodput = ``1 - save_s / interval_s -
lam * lost_per_failure`` (never below 0). Everything is seconds; the inputs the planner does not know come from
the defaults below (docs/planner.md, "Goodput under failures", checks them against the Llama 3 paper).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RESTART_S = 300.0
"""Job restart without the checkpoint read: scheduler, process start, framework and communicator init (at
thousands of devices several minutes; Llama 3 reports restarts as the bulk of its interruption cost)."""
STORAGE_READ_GBS = 1.0
"""Checkpoint read bandwidth per device from shared storage, GB/s (all ranks read at once)."""
HEARTBEAT_S = 1.0
"""fault_tolerance.heartbeat_timeout_s's default."""


@dataclass(frozen=True)
class Goodput:
    """The two estimates and what they were computed from (all seconds, except the rates)."""

    failures_per_hour: float
    interval_s: float
    save_s: float
    restart_s: float
    load_s: float
    heal_s: float
    step_s: float
    replicas: int
    lost_restart_s: float
    lost_replicas_s: float
    restart: float
    replica_groups: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def estimate(
    devices: int,
    mtbf_hours_per_device: float,
    step_s: float,
    interval_s: float,
    state_bytes_per_device: float,
    link_gbs: float,
    replicas: int,
    save_s: float = 0.0,
    restart_s: float = RESTART_S,
    read_gbs: float = STORAGE_READ_GBS,
    heartbeat_s: float = HEARTBEAT_S,
) -> Goodput:
    """The module docstring's two goodputs. ``state_bytes_per_device``: the checkpoint's bytes per device
    (parameters + optimizer states); ``link_gbs``: the bandwidth a heal transfer gets per device."""
    lam = devices / mtbf_hours_per_device / 3600.0  # failures per second
    load_s = state_bytes_per_device / (read_gbs * 1e9)
    heal_s = state_bytes_per_device / (link_gbs * 1e9)
    lost_restart = restart_s + load_s + interval_s / 2
    lost_replicas = heartbeat_s + step_s + heal_s + (restart_s + load_s) / max(replicas, 1)
    overhead = save_s / interval_s if interval_s > 0 else 0.0

    def good(lost: float) -> float:
        return max(0.0, 1.0 - overhead - lam * lost)

    return Goodput(
        failures_per_hour=lam * 3600, interval_s=interval_s, save_s=save_s, restart_s=restart_s, load_s=load_s,
        heal_s=heal_s, step_s=step_s, replicas=replicas, lost_restart_s=lost_restart,
        lost_replicas_s=lost_replicas, restart=good(lost_restart), replica_groups=good(lost_replicas),
    )  # fmt: skip


def lines(g: Goodput) -> list[str]:
    """The plan table's lines."""
    return [
        f"failures:          {g.failures_per_hour:.3g} per hour (one every {60 / g.failures_per_hour:.1f} min)"
        if g.failures_per_hour > 0
        else "failures:          none",
        f"restart from ckpt: goodput {g.restart:.1%} (lost per failure {g.lost_restart_s:,.0f} s: restart "
        f"{g.restart_s:,.0f} + load {g.load_s:,.0f} + half a save interval {g.interval_s / 2:,.0f})",
        f"replica groups:    goodput {g.replica_groups:.1%} (R = {g.replicas}; lost per failure "
        f"{g.lost_replicas_s:,.0f} s: heal {g.heal_s:.1f} + step {g.step_s:.1f} + the group's restart / R)",
    ]


def for_plan(cfg: Any, result: Any, cluster: Any, mtbf_hours_per_device: float) -> Goodput:
    """The estimate for a planned run: its step time, save interval (``checkpoint.save_steps`` or
    ``save_minutes``; none: the whole run), checkpoint bytes per device (parameters + optimizer states), the
    inter-node link for a heal, and R = ``fault_tolerance.replicas`` when enabled, else the data-parallel
    degree (each data-parallel replica its own group)."""
    c, r = cfg, result
    step_s = float(r.time.total)
    ck = c.checkpoint
    if ck.save_steps:
        interval = ck.save_steps * step_s
    elif ck.save_minutes:
        interval = ck.save_minutes * 60.0
    else:
        interval = c.train.max_steps * step_s
    lay = r.layout
    replicas = c.fault_tolerance.replicas if c.fault_tolerance.enabled else lay.dp_replicate * lay.dp_shard
    return estimate(
        devices=int(cluster.num_devices), mtbf_hours_per_device=mtbf_hours_per_device, step_s=step_s,
        interval_s=interval, state_bytes_per_device=float(r.memory.parameters + r.memory.optimizer_states),
        link_gbs=float(cluster.device.inter_node_bw_gbs), replicas=max(int(replicas), 1),
    )  # fmt: skip

"""Straggler detection: every log step each rank's busy time per step is gathered, slow ranks are named.

In synchronous training every rank's *wall* step time is the same (the fast ranks wait for the slow one inside
the next collective), so what is compared is the **busy time**: the step time minus the time spent waiting in
the collectives the trainer brackets (``timing.busy_seconds``). A rank whose busy time exceeds the median of
all ranks by more than ``logging.straggler_margin`` (0.2 = 20%) for ``logging.straggler_patience`` log steps
in a row is reported once per streak: a ``straggler`` event ``{rank, host, step_time, median, step}`` and a
console line. Hostnames are gathered once at start (``all_gather_object``); every log step gathers one small
tensor per rank ``[busy_s, memory_current_bytes, memory_peak_bytes]`` (float64, on the training device so it
also works with NCCL). The whole component is inert on one process.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class RankFigures:
    """What one gather returns: per-rank busy seconds per step and memory, and any stragglers found now."""

    step_time_s: list[float]
    memory_current_bytes: list[int]
    memory_peak_bytes: list[int]
    median: float
    stragglers: list[dict]


class StragglerMonitor:
    """Gathers per-rank figures at log steps and tracks slow-rank streaks (see the module docstring)."""

    def __init__(
        self,
        world_size: int,
        device: torch.device | str = "cpu",
        margin: float = 0.2,
        patience: int = 3,
        group: object | None = None,
    ):
        self.world_size = world_size
        self.device = torch.device(device)
        self.margin, self.patience = float(margin), max(int(patience), 1)
        self.group = group
        self.distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
        host = socket.gethostname()
        self.hosts = [host] * world_size
        if self.distributed:
            gathered: list[str | None] = [None] * world_size
            dist.all_gather_object(gathered, host, group=group)
            self.hosts = [str(h) for h in gathered]
        self.streak = [0] * world_size

    def gather(self, step: int, busy_s: float, mem_current: float, mem_peak: float) -> RankFigures:
        """Collective on every rank at the same log step; returns the same figures everywhere."""
        mine = torch.tensor([busy_s, float(mem_current), float(mem_peak)], dtype=torch.float64)
        if self.distributed:
            mine = mine.to(self.device)
            rows = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(rows, mine, group=self.group)
            table = torch.stack(rows).cpu()  # [world, 3]
        else:
            table = mine.unsqueeze(0)  # [1, 3]
        times = [float(x) for x in table[:, 0]]
        return RankFigures(
            step_time_s=times,
            memory_current_bytes=[int(x) for x in table[:, 1]],
            memory_peak_bytes=[int(x) for x in table[:, 2]],
            median=statistics.median(times),
            stragglers=self.observe(step, times),
        )

    def observe(self, step: int, times: list[float]) -> list[dict]:
        """Update the streaks with one log step's per-rank times; return the stragglers that just qualified."""
        if len(times) < 2:
            return []
        median = statistics.median(times)
        found = []
        for rank, t in enumerate(times):
            if median > 0 and t > median * (1.0 + self.margin):
                self.streak[rank] += 1
                if self.streak[rank] == self.patience:  # once per streak
                    found.append(
                        {
                            "rank": rank,
                            "host": self.hosts[rank],
                            "step_time": t,
                            "median": median,
                            "slower_by": t / median - 1.0,
                            "step": step,
                        }  # fmt: skip
                    )
            else:
                self.streak[rank] = 0
        return found

"""Where a step's time goes: a cheap phase timer, a periodic profiler window, and memory figures.

:class:`StepTimer` is a state machine, not a set of stopwatches: at every moment exactly one phase is current
and a phase switch charges the time since the previous switch to the phase being left. Nested brackets
(communication inside the compute bracket) therefore pause the outer phase instead of counting twice, and the
phases of an interval always add up to its wall time (the ``other`` phase is whatever no bracket claimed:
the stability guard, logging, validation, checkpoint saves). The phases the trainer brackets::

    data      fetching the step's micro-batches (and injected faults that run before the step)
    compute   forward, backward, unscale, clip and the optimizer step, including FSDP's and TP's own
              collectives, which run inside the modules and overlap compute (timing them needs hooks)
    comm_dp   the trainer's explicit data-parallel all-reduces (token count, loss sum) - time a rank spends
              here is mostly waiting for slower ranks
    comm_norm the global grad-norm reduction over the model's meshes (with the local norm, one pass over the
              gradients; only when world_size > 1 - on one process the norm is compute)
    comm_ctrl small control collectives every step (the preemption flag all-reduce)
    eval      downstream evaluation of eval.tasks (train/callbacks.py DownstreamEvalCallback)
    other     the rest of the loop

"comm" in the metrics is the sum of the ``comm_*`` phases: *exposed* communication the trainer issues itself,
never the overlapped FSDP traffic. On the CPU a switch costs one ``time.perf_counter()``; on CUDA each switch
also records a CUDA event on the current stream and the events are resolved (one ``synchronize``) only when
:meth:`StepTimer.collect` is called at a log step, so the GPU queue is never drained between log steps.

:class:`ProfilerWindow` runs ``torch.profiler`` for ``logging.profile_steps`` steps every
``logging.profile_every`` steps, writes a chrome trace to ``<run_dir>/profile/`` and a JSON summary of the
time spent in collective ops (gloo/nccl/c10d kernels, by op name; process groups cannot be told apart in the
profiler's aggregate, so "by group" is by op name). :func:`memory_stats` is the one source of the memory fields of
a metrics row: current and peak memory, capacity, and the peak as a fraction of the capacity.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

PHASES = ("data", "compute", "comm_dp", "comm_norm", "comm_ctrl", "eval", "other")
COLLECTIVE_MARKERS = ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_gather", "allgather",
                      "reduce_scatter", "_reduce_scatter", "broadcast", "all_to_all", "alltoall")  # fmt: skip


class StepTimer:
    """Charges wall time to one current phase at a time (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = True, clock: Any = None):
        self.clock = clock or time.perf_counter  # injectable for tests
        self.device = torch.device(device)
        self.enabled = enabled
        self.use_events = self.device.type == "cuda" and torch.cuda.is_available()
        self._phase = "other"
        self._seconds: dict[str, float] = defaultdict(float)
        self._steps = 0
        self._t = self.clock()
        self._marks: list[tuple[str, Any]] = []  # CUDA: (phase that starts, event)
        if self.use_events:
            self._marks.append(("other", self._event()))

    def _event(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _switch(self, phase: str) -> str:
        """Make ``phase`` current; return the phase that was current."""
        previous = self._phase
        if phase == previous:
            return previous
        if self.use_events:
            self._marks.append((phase, self._event()))
        else:
            now = self.clock()
            self._seconds[previous] += now - self._t
            self._t = now
        self._phase = phase
        return previous

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the time inside the block to ``name`` (the enclosing phase resumes afterwards)."""
        if not self.enabled:
            yield
            return
        previous = self._switch(name)
        try:
            yield
        finally:
            self._switch(previous)

    def step_done(self) -> None:
        self._steps += 1

    def reset(self) -> None:
        """Forget the interval so far (after a rollback)."""
        self.collect()

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last collect (every phase of PHASES present) and ``steps``."""
        if self.use_events:
            end = self._event()
            end.synchronize()
            marks = [*self._marks, (self._phase, end)]
            for (phase, start), (_, stop) in zip(marks, marks[1:]):
                self._seconds[phase] += start.elapsed_time(stop) / 1000.0
            self._marks = [(self._phase, end)]
        else:
            now = self.clock()
            self._seconds[self._phase] += now - self._t
            self._t = now
        out = {p: self._seconds.get(p, 0.0) for p in PHASES}
        out["steps"] = self._steps
        self._seconds = defaultdict(float)
        self._steps = 0
        return out


def split_fractions(seconds: dict[str, float]) -> dict[str, float]:
    """Metrics-row fields: time_{data,compute,comm,eval,other}_frac (sum 1) and the comm split per kind."""
    total = sum(seconds.get(p, 0.0) for p in PHASES)
    if total <= 0:
        return {}
    comm = sum(seconds.get(p, 0.0) for p in PHASES if p.startswith("comm"))
    out = {
        "time_data_frac": seconds.get("data", 0.0) / total,
        "time_compute_frac": seconds.get("compute", 0.0) / total,
        "time_comm_frac": comm / total,
        "time_eval_frac": seconds.get("eval", 0.0) / total,
        "time_other_frac": seconds.get("other", 0.0) / total,
    }
    for p in PHASES:
        if p.startswith("comm_"):
            out[f"time_{p}_frac"] = seconds.get(p, 0.0) / total
    return out


def busy_seconds(seconds: dict[str, float]) -> float:
    """Time per step a rank spent working (everything but waiting in the bracketed collectives)."""
    steps = max(int(seconds.get("steps", 1)), 1)
    return sum(seconds.get(p, 0.0) for p in PHASES if not p.startswith("comm")) / steps


# ---------------------------------------------------------------------------------------------- memory
def _device_module(device_type: str) -> Any:
    mod = getattr(torch, device_type, None) if device_type in ("cuda", "npu") else None
    return mod if mod is not None and mod.is_available() else None


def memory_stats(device_type: str) -> dict[str, float]:
    """The memory fields of a metrics row: current and peak bytes of this process on its device, capacity, and
    peak / capacity.

    Accelerators (cuda, npu): allocated / max allocated by the caching allocator, capacity from mem_get_info.
    CPU (and an accelerator type whose runtime is not available): resident set size (/proc/self/statm) and peak
    RSS (getrusage), capacity = physical RAM. Fields: ``memory_current_bytes``, ``memory_peak_bytes``,
    ``memory_bytes`` (the peak again, the row's historical name for it), and when the capacity is known
    ``memory_capacity_bytes`` and ``memory_frac``.
    """
    mod = _device_module(device_type)
    if mod is not None:
        current, peak = int(mod.memory_allocated()), int(mod.max_memory_allocated())
        try:
            capacity = int(mod.mem_get_info()[1])
        except Exception:  # some backends do not report a capacity
            capacity = 0
    else:
        page = os.sysconf("SC_PAGE_SIZE")
        try:
            current = int(Path("/proc/self/statm").read_text().split()[1]) * page
        except OSError:
            current = 0
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        peak = max(peak, current)
        capacity = page * os.sysconf("SC_PHYS_PAGES")
    out: dict[str, float] = {"memory_current_bytes": current, "memory_peak_bytes": peak, "memory_bytes": peak}
    if capacity > 0:
        out["memory_capacity_bytes"] = capacity
        out["memory_frac"] = peak / capacity
    return out


# ---------------------------------------------------------------------------------------------- profiler
class ProfilerWindow:
    """``torch.profiler`` over ``steps`` steps every ``every`` steps (inert when either is 0)."""

    def __init__(self, run_dir: str | Path, rank: int, every: int, steps: int, device_type: str):
        self.dir = Path(run_dir) / "profile"
        self.rank, self.every, self.steps = rank, int(every or 0), int(steps or 0)
        self.device_type = device_type
        self.enabled = self.every > 0 and self.steps > 0
        self._prof: Any = None
        self._first = 0

    def before_step(self, step: int) -> None:
        """Start a window when ``step`` (the step about to run) opens one."""
        if not self.enabled or self._prof is not None or step % self.every != 0:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if self.device_type == "cuda" and torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=acts, record_shapes=False)
        self._prof.__enter__()
        self._first = step

    def after_step(self, step: int) -> dict | None:
        """Close the window after its last step; return the summary written (None otherwise)."""
        if self._prof is None or step < self._first + self.steps - 1:
            return None
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = f"step{self._first:08d}-{step:08d}_rank{self.rank}"
        trace = self.dir / f"{stem}.trace.json"
        prof.export_chrome_trace(str(trace))
        summary = {"first_step": self._first, "last_step": step, "rank": self.rank, "trace": str(trace)}
        summary.update(collective_summary(prof.key_averages(), step - self._first + 1))
        (self.dir / f"{stem}.summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def close(self) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None


def collective_summary(averages: Any, steps: int) -> dict:
    """Per collective op name: calls and total microseconds (self time on the host, device time if any)."""
    ops: dict[str, dict[str, float]] = {}
    total_us = 0.0
    for avg in averages:
        name = str(avg.key)
        if not any(m in name.lower() for m in COLLECTIVE_MARKERS):
            continue
        dev = float(getattr(avg, "self_device_time_total", 0.0) or 0.0)
        us = dev if dev > 0 else float(avg.cpu_time_total)
        ops[name] = {"calls": int(avg.count), "total_us": us}
        total_us += us
    return {"collectives": ops, "collective_us_per_step": total_us / max(steps, 1)}

"""Faults: injection for tests and drills, a hang watchdog, and preemption signals.

:class:`FaultInjector` reads a ``fault:`` config section (:class:`FaultConfig`) and exposes hooks the trainer
calls at fixed points of a step; each fault fires at most once per run, recorded (fsynced) in
``<run_dir>/faults_fired_rank{r}.json`` *before* it fires, so a job restarted after an injected kill or hang does not
hit the same fault again::

    batch = faults.before_step(step, batch)        # kill (SIGKILL self), hang (sleep), spike (corrupt tokens)
    loss = faults.poison_loss(step, loss)          # NaN in the loss
    faults.after_backward(step, model)             # NaN in a gradient
    checkpointer.fault_hook = faults.during_save   # crash mid-save: partial file, then SIGKILL
    faults.after_save(step, path)                  # corrupt or truncate a committed checkpoint file

:class:`HangWatchdog` is a daemon thread: when no ``beat()`` arrived for ``timeout_s``, it dumps every thread's
Python stack (faulthandler) to ``<run_dir>/hang_rank{r}.txt`` and, after a grace of up to 2 s (so the ranks blocked
on this one reach their own timeout and dump as well), ends the process with ``os._exit`` (non-zero),
so torchrun's elastic agent restarts the job, which resumes from the newest valid checkpoint.
:class:`PreemptionHandler` turns SIGTERM/SIGINT into a flag the trainer checks after each step (save, then
exit); a second signal restores the default handler and re-delivers it, so an impatient Ctrl-C still kills.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.config.schema import FaultConfig
from llmtrain.errors import HANG_EXIT_CODE
from llmtrain.ft.layout import REPLICA_ENV
from llmtrain.train.checkpoint.layout import data_files, step_of

KINDS = ("kill", "hang", "nan", "spike", "crash_in_save", "corrupt_checkpoint")


def damage_file(path: str | Path, mode: str = "flip") -> None:
    """Flip one byte in the middle of ``path``, or truncate it to half its size."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        if mode == "truncate":
            f.truncate(size // 2)
        else:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([(byte[0] if byte else 0) ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


class FaultInjector:
    """The hooks of the module docstring; inert (every hook a pass-through) when nothing is configured."""

    def __init__(
        self, cfg: FaultConfig | None, run_dir: str | Path, rank: int = 0, vocab_size: int | None = None
    ):
        self.cfg = cfg if cfg is not None else FaultConfig()
        self.rank = rank
        self.vocab_size = vocab_size
        # replica groups (ft/): rank r of group g is "replica g, rank r"; each group keeps its own record
        raw = os.environ.get(REPLICA_ENV)
        self.replica = int(raw) if raw is not None and raw.isdigit() else None
        group = f"_replica{self.replica}" if self.replica is not None else ""
        self.record = Path(run_dir) / f"faults_fired{group}_rank{rank}.json"
        self.fired: set[str] = set(json.loads(self.record.read_text())) if self.record.exists() else set()
        self.degraded = False  # replica groups: this step's quorum is short of groups (set by ft/replicas.py)

    def _due(
        self, kind: str, step: int, steps: list[int], every_rank: bool = False, replica: int | None = None
    ) -> bool:
        if step not in steps or (not every_rank and self.cfg.rank not in (-1, self.rank)):
            return False
        want = self.cfg.replica if replica is None else replica  # the group (replica groups only)
        if self.replica is not None and want not in (-1, self.replica):
            return False
        key = f"{kind}@{step}"
        if key in self.fired:
            return False
        self.fired.add(key)
        tmp = self.record.with_suffix(".tmp")  # whole-file rewrite, fsynced, atomic rename
        with open(tmp, "w") as f:
            json.dump(sorted(self.fired), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.record)
        return True

    # ---- step hooks
    def before_step(self, step: int, batch: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        kills, groups = self.cfg.kill_at_step, self.cfg.kill_replicas  # groups: one per kill, or none
        group = groups[kills.index(step)] if groups and step in kills else None
        if self._due("kill", step, kills, replica=group):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("hang", step, self.cfg.hang_at_step):
            time.sleep(self.cfg.hang_seconds)
        slow = self.cfg.slow_when == "always" or self.degraded  # degraded: a replica drill's survivors only
        if self.cfg.slow_seconds > 0 and self.cfg.slow_rank == self.rank and slow:  # a straggler drill
            time.sleep(self.cfg.slow_seconds)
        starts = [s for s in self.cfg.spike_at_step if s <= step < s + max(self.cfg.spike_steps, 1)]
        if starts and self._due("spike", step, [step], every_rank=True):
            return [self._corrupt(mb, step, i) for i, mb in enumerate(batch)]
        return batch

    def _corrupt(self, mb: dict[str, torch.Tensor], step: int, index: int) -> dict[str, torch.Tensor]:
        """Random labels (and inputs): same on every rank for a given (seed, step, micro-batch, rank)."""
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 1009 + index * 31 + self.rank)
        labels = mb["labels"]
        high = self.vocab_size or int(labels.max()) + 1
        out = dict(mb)
        out["labels"] = torch.where(
            labels == -100, labels, torch.randint(0, high, labels.shape, generator=gen)
        )
        out["input_ids"] = torch.randint(0, high, mb["input_ids"].shape, generator=gen)
        return out

    def poison_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.cfg.nan_target == "loss" and self._due("nan", step, self.cfg.nan_at_step):
            return loss * float("nan")
        return loss

    def after_backward(self, step: int, model: torch.nn.Module) -> None:
        if self.cfg.nan_target == "grad" and self._due("nan", step, self.cfg.nan_at_step):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.view(-1)[0] = float("nan")
                    return

    # ---- checkpoint hooks
    def during_save(self, event: str, tmp_dir: Path) -> None:
        """``Checkpointer.fault_hook``: a crash after the data write, before the commit (a partial file)."""
        step = step_of(tmp_dir)
        if event == "written" and self._due("crash_in_save", step, self.cfg.crash_in_save_at_step, True):
            files = data_files(tmp_dir)
            if files:
                damage_file(files[0], "truncate")
            os.kill(os.getpid(), signal.SIGKILL)

    def after_save(self, step: int, path: str | Path) -> None:
        if self.rank == 0 and self._due(
            "corrupt_checkpoint", step, self.cfg.corrupt_checkpoint_at_step, True
        ):
            files = data_files(path)
            if files:
                damage_file(files[0], self.cfg.corrupt_mode)


class HangWatchdog:
    """A daemon thread that ends a hung process with its stacks on disk (see the module docstring)."""

    def __init__(
        self,
        run_dir: str | Path,
        rank: int,
        timeout_s: float,
        exit_code: int = HANG_EXIT_CODE,
        poll_s: float = 0.5,
    ):
        self.path = Path(run_dir) / f"hang_rank{rank}.txt"
        self.rank, self.timeout_s, self.exit_code = rank, float(timeout_s), exit_code
        self.poll_s = min(poll_s, max(self.timeout_s / 4, 0.01))
        self._last = time.monotonic()
        self._step: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)

    def start(self) -> HangWatchdog:
        self._last = time.monotonic()
        self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        """Call once per step (and around long known operations) to reset the timer."""
        self._last, self._step = time.monotonic(), step

    def stop(self) -> None:
        """Stop and join the thread (it wakes within ``poll_s``)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                with open(self.path, "w") as f:
                    f.write(
                        f"rank {self.rank}: no progress for {idle:.1f} s (timeout {self.timeout_s} s) after "
                        f"step {self._step}; pid {os.getpid()}; stacks of every thread:\n"
                    )
                    f.flush()
                    faulthandler.dump_traceback(file=f, all_threads=True)
                    f.flush()
                    os.fsync(f.fileno())
                # The peers blocked on this rank time out within a poll or two of it: stay (blocked) long enough
                # for their watchdogs to dump too, or this exit would end their wait with an error first.
                time.sleep(min(2.0, self.timeout_s))
                os._exit(self.exit_code)


class PreemptionHandler:
    """SIGTERM/SIGINT -> ``requested``; the trainer checks ``should_stop()`` after each step."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> PreemptionHandler:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # a second signal: stop waiting for a clean exit
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        self.received = signum

    @property
    def requested(self) -> bool:
        return self.received is not None

    def should_stop(self, group: Any = None) -> bool:
        """True on every rank once any rank got a signal (one small all-reduce when distributed)."""
        flag = torch.tensor(1.0 if self.requested else 0.0)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

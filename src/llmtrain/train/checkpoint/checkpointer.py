"""The checkpointing component the training loop calls: when to save, what to resume from, and the rest handed
to the save/load mechanism (``store.CheckpointStore``) it owns.

When to save (:meth:`Checkpointer.should_save`): every ``checkpoint.save_steps`` steps, and when
``checkpoint.save_minutes`` passed since the last save started (rank 0's clock, broadcast, so every rank saves
at the same step).

What to resume from (:meth:`Checkpointer.select_resume`): ``resume: auto`` walks committed checkpoints newest
first and takes the first whose checksums verify; every skipped one is reported with its reason
(:class:`ResumeChoice`), so the trainer can log an event. Rank 0 decides and broadcasts, so every rank agrees. An
explicit ``resume: PATH`` that fails verification is an error (no silent fallback from what the user asked
for); ``resume: none`` is a fresh start, refused in a folder that holds committed checkpoints unless
``checkpoint.overwrite`` (``llmtrain train --overwrite``) says to start over: those are then replaced by this run's
first commit (kept until then, and never resumed or rolled back to). A ``step_*`` entry that is a symbolic link
is never resumed from, rotated or replaced; :attr:`ResumeChoice.notes` names it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from llmtrain.config.schema import CheckpointConfig
from llmtrain.errors import CheckpointError
from llmtrain.train.checkpoint import layout
from llmtrain.train.checkpoint._process import is_dist, rank
from llmtrain.train.checkpoint.store import CheckpointStore


@dataclass
class ResumeChoice:
    """The checkpoint to resume from (None: fresh start) and the newer ones rejected, with reasons."""

    path: Path | None
    rejected: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was left alone or will be replaced (symbolic links, checkpoints superseded by ``overwrite``)."""

    def messages(self) -> list[str]:
        return [f"checkpoint {p} skipped: {why}; falling back to an older one" for p, why in self.rejected]


class Checkpointer:
    """Decides when to save and what to resume from; saves, commits, rotates, verifies and loads through its
    :class:`CheckpointStore` (``store``).

    ``fault_hook(event, tmp_dir)``, when set, is called with ``"written"`` after the data of a save is on disk
    and before the commit (the fault injector kills the process there to simulate a crash mid-save).
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, device_type: str = "cpu"):
        self.cfg = cfg
        self.store = CheckpointStore(cfg, layout.root_of_run(run_dir, cfg.save_dir), device_type)
        self.store.on_staged = self._saved
        self.dir = self.store.dir
        self.device_type = device_type
        self.save_minutes = float(getattr(cfg, "save_minutes", 0) or 0)
        self.resume_notes: list[str] = []
        self._last_save_time = time.time()

    @property
    def fault_hook(self) -> Callable[[str, Path], None] | None:
        return self.store.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Callable[[str, Path], None] | None) -> None:
        self.store.fault_hook = hook

    @property
    def threads(self) -> int:
        return self.store.threads

    # ---- what to resume from
    def committed(self) -> list[Path]:
        """Committed checkpoints, oldest first."""
        return self.store.committed()

    def latest(self) -> Path | None:
        return self.store.latest()

    def verify(self, path: str | Path) -> str | None:
        """None if ``path`` verifies (cached per process), else the reason it does not."""
        return self.store.verify(path)

    def latest_valid(self) -> ResumeChoice:
        """Newest committed checkpoint that verifies; newer ones that do not are listed with reasons."""
        rejected: list[tuple[str, str]] = []
        for path in reversed(self.committed()):
            reason = self.verify(path)
            if reason is None:
                return ResumeChoice(path, rejected)
            rejected.append((str(path), reason))
        return ResumeChoice(None, rejected)

    def select_resume(self) -> ResumeChoice:
        """What ``checkpoint.resume`` points at. Rank 0 decides and broadcasts, so every rank agrees."""
        resume = str(self.cfg.resume)
        if resume == "none":
            return self._fresh_start()
        if resume != "auto":
            path = Path(resume)
            if not layout.is_committed(path):
                raise CheckpointError(
                    f"checkpoint.resume: {resume!r} is not a committed checkpoint directory (no {layout.MARKER} "
                    f"file); use 'auto', 'none' or a path like {layout.step_dir(self.dir, 100)}."
                )
            reason = self.verify(path)
            if reason is not None:
                raise CheckpointError(
                    f"checkpoint.resume: {resume!r} fails verification: {reason}. Use 'auto' to take the "
                    "newest valid checkpoint instead."
                )
            return ResumeChoice(path, notes=self._link_notes())
        choice = self.latest_valid() if rank() == 0 else None
        if choice is not None:
            choice.notes = self._link_notes()
        if is_dist():
            box = [choice]
            dist.broadcast_object_list(box, src=0)
            choice = box[0]
        assert choice is not None  # rank 0's choice; the other ranks receive it above
        if choice.path is None and choice.rejected:  # every rank raises the same error
            raise self._none_usable(choice.rejected)
        if is_dist() and choice.path is not None:
            self.store.mark_verified(choice.path)
        self.resume_notes = choice.messages()
        return choice

    def _link_notes(self) -> list[str]:
        return [
            f"{p} is a symbolic link: left alone (never resumed from, rotated or replaced)"
            for p in layout.symlinked(self.dir)
        ]

    def _fresh_start(self) -> ResumeChoice:
        """``resume: none``: a fresh start, refused over committed checkpoints unless ``overwrite`` (rank 0
        looks, every rank gets its answer)."""
        found = (self.committed(), self._link_notes()) if rank() == 0 else None
        if is_dist():
            box = [found]
            dist.broadcast_object_list(box, src=0)
            found = box[0]
        assert found is not None
        old, notes = found
        if not old:
            return ResumeChoice(None, notes=notes)
        steps = ", ".join(str(layout.step_of(p)) for p in old)
        if not bool(getattr(self.cfg, "overwrite", False)):
            raise CheckpointError(
                f"checkpoint.resume is none, but {self.dir} holds {len(old)} committed checkpoint(s) (steps "
                f"{steps}) of an earlier run; starting over there would replace them. Use checkpoint.resume: auto "
                "to continue that run, set run.output_dir (or checkpoint.save_dir) to a new folder, or pass "
                "--overwrite (checkpoint.overwrite: true) to start over and replace them. The checkpoints were left as "
                "they are."
            )
        self.store.supersede(old)
        notes.append(
            f"checkpoint.overwrite: starting over; the {len(old)} committed checkpoint(s) in {self.dir} (steps "
            f"{steps}) are replaced by this run's first checkpoint (kept until then, never resumed from)"
        )
        return ResumeChoice(None, notes=notes)

    def _none_usable(self, rejected: list[tuple[str, str]]) -> CheckpointError:
        reasons = "; ".join(f"{p}: {why}" for p, why in rejected)
        return CheckpointError(
            f"checkpoint.resume is auto, but none of the {len(rejected)} committed checkpoints in {self.dir} "
            f"is usable ({reasons}). Nothing was resumed or deleted. Restore them from a copy, or set "
            "checkpoint.resume: none with --overwrite (checkpoint.overwrite: true) to start over (the unusable "
            "checkpoints are then replaced)."
        )

    def after_failed_load(self, choice: ResumeChoice, error: CheckpointError) -> ResumeChoice:
        """The newest valid checkpoint older than ``choice.path``, which verified but failed to load (a data file
        that is not plain tensors, an unreadable file). Only under ``resume: auto``: a checkpoint the user named
        fails as such. Every rank sees the same load failure (DCP gathers them), so every rank walks the same
        list here and agrees."""
        if str(self.cfg.resume) != "auto" or choice.path is None:
            raise error
        rejected = [*choice.rejected, (str(choice.path), str(error))]
        step = layout.step_of(choice.path)
        for path in reversed([p for p in self.committed() if layout.step_of(p) < step]):
            reason = self.verify(path)
            if reason is None:
                return ResumeChoice(path, rejected, choice.notes)
            rejected.append((str(path), reason))
        raise self._none_usable(rejected)

    def resume_path(self) -> Path | None:
        """The checkpoint to resume from, None for a fresh start; skipped ones are in ``resume_notes``."""
        return self.select_resume().path

    # ---- when to save
    def should_save(self, step: int) -> bool:
        """True every ``save_steps`` steps and when ``save_minutes`` passed since the last save (rank 0's clock)."""
        if self.cfg.save_steps and step % self.cfg.save_steps == 0:
            return True
        if self.save_minutes <= 0:
            return False
        due = torch.tensor(float(time.time() - self._last_save_time >= 60.0 * self.save_minutes))
        if is_dist():
            dist.broadcast(due, src=0)
        return bool(due.item())

    def _saved(self) -> None:
        """The store captured a save's state: the wall-clock interval restarts here."""
        self._last_save_time = time.time()

    # ---- the mechanism
    def save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict
    ) -> Path:
        """Write a checkpoint of ``step`` and commit it before returning; every rank calls this."""
        return self.store.save(step, model, optimizer, trainer_state)

    def save_async(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict
    ) -> None:
        """Stage the state and return; the write and the commit finish in the background (see ``wait``)."""
        self.store.save_async(step, model, optimizer, trainer_state)

    @property
    def pending(self) -> bool:
        return self.store.pending

    def poll(self) -> Path | None:
        """Non-blocking: the path committed by a finished async save (once), else None."""
        return self.store.poll()

    def wait(self) -> Path | None:
        """Block until the async save in flight (if any) is committed on every rank; the committed path."""
        return self.store.wait()

    def close(self, finish: bool, timeout_s: float = 60.0) -> bool:
        """End of the run: finish or abandon the save in flight (see ``CheckpointStore.close``)."""
        return self.store.close(finish, timeout_s)

    def load(
        self,
        path: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        verify: bool = True,
        allow_extra: bool = False,
    ) -> dict:
        """Load model (and optimizer) state in place; return the trainer state and restore this rank's RNG
        (``allow_extra``: the model is one pipeline stage of the checkpoint's model)."""
        return self.store.load(path, model, optimizer, verify, allow_extra)

"""The save/load mechanism: DCP for tensors, JSON for the rest; sync or async writes, commit, rotation, load.

What to save and when, and what to resume from, is decided elsewhere (``policy``); this module only does it.

Commit protocol (rank 0, after every rank's data is on disk): trainer_state.json -> checksums.json -> COMMITTED,
each fsynced, the directory fsynced, then ``step_N.tmp`` is renamed to ``step_N`` and the parent fsynced. A crash
at any point leaves either the previous checkpoints untouched or a ``.tmp`` directory that is ignored (the names
and the atomic file operations are ``layout``'s; the checksums are ``integrity``'s). Rotation uncommits and
renames at once; the bytes are deleted by a background thread that ``wait()`` (and the next commit) joins.

Async save (``save_async`` then ``poll``/``wait``): with a process group, ``dcp.async_save`` runs on a gloo
group of its own (sharing the training group aborts gloo, see the notes in ../shared); without one, the state is
staged to a CPU copy (``staging.stage_to_cpu``, buffers reused from save to save) and written by a plain thread.
Either way the commit runs in a background thread only after the write finished; training is blocked only
while the state is staged. ``poll`` agrees on "done" across ranks (MIN all-reduce), so no rank waits alone in
the commit barrier while the others train on.
"""

from __future__ import annotations

import errno
import json
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from llmtrain.config.schema import CheckpointConfig
from llmtrain.errors import CheckpointError, exception_chain, os_error_text
from llmtrain.train.checkpoint import integrity, layout
from llmtrain.train.checkpoint._process import barrier, is_dist, quiet_single_process, rank
from llmtrain.train.checkpoint.rng import rng_state, set_rng_state
from llmtrain.train.checkpoint.safe_load import load_state
from llmtrain.train.checkpoint.staging import stage_to_cpu
from llmtrain.train.checkpoint.state_schema import content_problem


@dataclass
class _PendingSave:
    step: int
    tmp: Path
    final: Path
    thread: threading.Thread
    error: BaseException | None = None
    started: float = field(default_factory=time.time)


class CheckpointStore:
    """Writes (sync or async), commits, rotates, verifies and loads the checkpoints under ``root``.

    ``fault_hook(event, tmp_dir)``, when set, is called with ``"written"`` after the data of a save is on disk
    and before the commit (the fault injector kills the process there to simulate a crash mid-save).
    ``on_staged()``, when set, is called once a save's state has been captured (the time a save counts from).
    """

    def __init__(self, cfg: CheckpointConfig, root: str | Path, device_type: str = "cpu"):
        self.cfg = cfg  # keep_checkpoint_max is read at each rotation
        self.dir = Path(root)
        self.device_type = device_type
        self.threads = max(int(getattr(cfg, "write_threads", 2) or 1), 1)
        self.fault_hook: Callable[[str, Path], None] | None = None
        self.on_staged: Callable[[], None] | None = None
        self._verified: set[Path] = set()
        self._pending: _PendingSave | None = None
        self._group: Any = None
        self._staging: dict[str, torch.Tensor] = {}
        self._purger: threading.Thread | None = None  # deletes rotated-out checkpoints in the background
        self._superseded: list[Path] = []  # an earlier run's checkpoints that checkpoint.overwrite replaces
        self.on_note: Callable[[str], None] | None = None  # told what rotation left alone or replaced
        self._links_noted: set[Path] = set()

    def _writer(self, tmp: Path) -> FileSystemWriter:
        return integrity.ChecksummingWriter(str(tmp), thread_count=self.threads, sync_files=True)

    # ---- discovery and verification
    def committed(self) -> list[Path]:
        """Committed checkpoints, oldest first (not those :meth:`supersede` set aside)."""
        return [p for p in layout.committed(self.dir) if p not in self._superseded]

    def supersede(self, paths: list[Path]) -> None:
        """``checkpoint.overwrite``: an earlier run's checkpoints, kept until this run's first commit replaces
        them (retired then, see ``_rotate``), and never resumed or rolled back to in between."""
        self._superseded = list(paths)

    def _note(self, text: str) -> None:
        if self.on_note is not None:
            self.on_note(text)

    def latest(self) -> Path | None:
        c = self.committed()
        return c[-1] if c else None

    def verify(self, path: str | Path) -> str | None:
        """None if ``path`` verifies (cached per process), else the reason it does not."""
        path = Path(path).resolve()
        if path in self._verified:
            return None
        reason = integrity.verify_checkpoint(path, self.threads) or content_problem(path)
        if reason is None:
            self._verified.add(path)
        return reason

    def mark_verified(self, path: str | Path) -> None:
        """Trust ``path`` without hashing it here (another rank verified it)."""
        self._verified.add(Path(path).resolve())

    # ---- save
    def _prepare(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
        self.wait()  # one save in flight at a time
        tmp, final = layout.tmp_dir(self.dir, step), layout.step_dir(self.dir, step)
        layout.refuse_symlink(tmp)  # every rank, before the barrier: nothing is written through a link
        layout.refuse_symlink(final)
        if rank() == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        barrier()
        state = tensor_state(model, optimizer)
        layout.write_json(layout.rng_file(tmp, rank()), rng_state(self.device_type))
        if self.on_staged is not None:
            self.on_staged()
        return tmp, final, state

    def save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict
    ) -> Path:
        """Write a checkpoint of ``step`` and commit it before returning; every rank calls this."""
        tmp, final, state = self._prepare(step, model, optimizer)
        try:
            with quiet_single_process():
                dcp.save(state, storage_writer=self._writer(tmp))
            barrier()
            if rank() == 0:
                self._commit(step, tmp, final, trainer_state)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            failure = save_failure(step, tmp, e)
            if failure is None:
                raise
            raise failure from e
        barrier()
        return final

    def save_async(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict
    ) -> None:
        """Stage the state and return; the write and the commit finish in the background (see ``wait``)."""
        tmp, final, state = self._prepare(step, model, optimizer)
        trainer_state = json.loads(
            json.dumps(trainer_state)
        )  # a snapshot: the trainer keeps mutating its own
        if is_dist():
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            future = dcp.async_save(state, storage_writer=self._writer(tmp), process_group=self._group)
            assert isinstance(future, Future)  # an AsyncSaveResponse only comes with an async_stager

            def write() -> None:
                future.result()
        else:
            staged = stage_to_cpu(state, self._staging, self.threads)

            def write() -> None:
                with quiet_single_process():
                    dcp.save(staged, storage_writer=self._writer(tmp))

        pending = _PendingSave(step, tmp, final, thread=None)  # type: ignore[arg-type]

        def run() -> None:
            try:
                write()
                if rank() == 0:
                    self._commit(step, tmp, final, trainer_state)
            except BaseException as e:  # re-raised in wait()
                pending.error = e

        pending.thread = threading.Thread(target=run, name=f"ckpt-save-{step}", daemon=True)
        self._pending = pending
        pending.thread.start()

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def poll(self) -> Path | None:
        """Non-blocking: the path committed by a finished async save (once), else None."""
        if self._pending is None:
            return None
        done = not self._pending.thread.is_alive()
        if is_dist() and dist.get_world_size() > 1:
            # Every rank must agree: a rank that finished alone would wait in _finish's barrier while the
            # others go on into the next step's collectives (deadlock). MIN over the default group (main
            # thread only; the saving threads use the checkpoint group).
            device = None  # the default group's backend: gloo (CPU tensors) or nccl / hccl (device tensors)
            if self.device_type != "cpu":
                index = torch.get_device_module(self.device_type).current_device()
                device = torch.device(self.device_type, index)
            flag = torch.tensor([int(done)], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            done = bool(flag.item())
        if not done:
            return None
        return self._finish(join_purge=False)  # a deletion still running is no reason to block training

    def wait(self) -> Path | None:
        """Block until the async save in flight (if any) is committed on every rank, and rotated-out checkpoints
        are deleted; the committed path, or None."""
        return self._finish(join_purge=True)

    def _finish(self, join_purge: bool) -> Path | None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.thread.join()  # its commit may start a purge: join that after this
        if join_purge:
            self._join_purge()
        if pending is None:
            return None
        barrier(self._group)
        if pending.error is not None:
            failure = save_failure(pending.step, pending.tmp, pending.error) or CheckpointError(
                f"asynchronous save of step {pending.step} to {pending.tmp} failed: {pending.error!r}; "
                "the previous checkpoints are untouched."
            )
            raise failure from pending.error
        return pending.final

    def close(self, finish: bool, timeout_s: float = 60.0) -> bool:
        """End of the run: finish (``finish``) or abandon the save in flight, then join the purge thread.

        An abandoned save is never committed: its ``.tmp`` directory is cleared by the next run's rotation. After
        an error the saving thread is given ``timeout_s`` to end by itself (it may wait on a peer that failed);
        returns False when a thread is still running then, so the caller ends the process without the
        interpreter's shutdown (see ``distributed.device.shutdown_distributed``)."""
        if finish:
            self.wait()
            return True
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.thread.join(timeout_s)
            if pending.thread.is_alive():
                return False
        if self._purger is not None:
            self._purger.join(timeout_s)
            if self._purger.is_alive():
                return False
            self._purger = None
        return True

    def _commit(self, step: int, tmp: Path, final: Path, trainer_state: dict) -> None:
        """Rank 0, after every rank's files are written: state, checksums, marker, rename, rotate."""
        if self.fault_hook is not None:
            self.fault_hook("written", tmp)
        self._join_purge()  # one deletion at a time, and none racing a re-save of the same step
        layout.write_json(layout.trainer_state_file(tmp), trainer_state)
        integrity.write_checksums(tmp, self.threads)
        layout.write_marker(tmp, step)
        layout.publish(tmp, final)
        self._verified.add(final.resolve())
        self._rotate(keep_path=final)

    def _rotate(self, keep_path: Path | None = None) -> None:
        """Keep the newest ``keep_checkpoint_max`` committed checkpoints and always ``keep_path`` (the one just
        committed, valid by construction); clear stale ``.tmp``/``.trash`` directories of crashed saves."""
        keep = max(int(self.cfg.keep_checkpoint_max), 1)
        in_flight = self._pending.tmp if self._pending is not None else None
        own_tmp = layout.tmp_dir_of(keep_path) if keep_path is not None else None
        doomed = layout.stale(self.dir, keep=(in_flight, own_tmp))
        superseded, self._superseded = self._superseded, []
        replaced = [p for p in superseded if layout.owned(p) and layout.is_committed(p)]
        if replaced:
            self._note(
                f"checkpoint.overwrite: {len(replaced)} checkpoint(s) of the earlier run replaced "
                f"({', '.join(p.name for p in replaced)})"
            )
        for old in [*replaced, *self.committed()[:-keep]]:
            if keep_path is None or old.resolve() != keep_path.resolve():
                try:
                    doomed.append(layout.retire(old))  # uncommitted now; the bytes go in the background
                except CheckpointError as e:  # its .trash name is a symbolic link: both left alone
                    self._note(str(e))
        for link in layout.symlinked(self.dir):
            if link not in self._links_noted:
                self._links_noted.add(link)
                self._note(
                    f"{link} is a symbolic link: left alone by the rotation (never followed or deleted)"
                )
        if doomed:
            self._purger = threading.Thread(target=layout.rmtree_all, args=(doomed,), name="ckpt-purge")
            self._purger.start()

    def _join_purge(self) -> None:
        if self._purger is not None:
            self._purger.join()
            self._purger = None

    # ---- load
    def load(
        self,
        path: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        verify: bool = True,
        allow_extra: bool = False,
    ) -> dict:
        """Load model (and optimizer) state in place; return the trainer state and restore this rank's RNG.
        ``allow_extra``: the model is one pipeline stage (the checkpoint holds the other stages' layers too)."""
        path = Path(path)
        if not layout.is_committed(path):
            raise CheckpointError(f"{path} is not a committed checkpoint (no {layout.MARKER} file).")
        if verify and layout.checksums_file(path).exists():
            reason = self.verify(path)
        else:  # no checksums to go by: the content is still checked before anything is restored
            reason = content_problem(path)
        if reason is not None:
            raise CheckpointError(f"{path} fails verification: {reason}.")
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        own = [list(g["params"]) for g in state["optim"]["param_groups"]] if optimizer is not None else []
        head_copy = _head_copy_state(model, state)
        load_state(path, state, allow_extra)
        if head_copy is not None:
            _restore_head_copy_state(state, *head_copy)
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
        if optimizer is not None:
            # The saved groups' parameter lists are one rank's of the saving layout (a pipeline stage's head
            # copy of a tied embedding, ``output.weight``, would then be asked for state): this layout's own.
            groups = state["optim"]["param_groups"]
            if len(groups) == len(own):
                for group, params in zip(groups, own):
                    group["params"] = params
            set_optimizer_state_dict(model, optimizer, state["optim"])
        rng_file = layout.rng_file(path, rank())
        if rng_file.exists():
            set_rng_state(json.loads(rng_file.read_text()), self.device_type)
        return json.loads(layout.trainer_state_file(path).read_text())


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The tensors of a checkpoint: model and optimizer state dicts (sharded where the model is). The one
    definition, shared by the on-disk save and the live heal of a replica group (ft/state.py)."""
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


_EMB, _HEAD = "tok_embeddings.weight", "output.weight"


def _head_copy_state(model: torch.nn.Module, state: dict) -> tuple[dict, bool] | None:
    """A pipeline stage's head copy of a tied embedding (``distributed/pipeline.TiedEmbedding``) has the
    embedding's optimizer state (identical updates), which a one-process checkpoint holds only under the
    embedding's name: read it from there. Returns (the copy's state, whether this rank holds the embedding)."""
    optim = state.get("optim", {}).get("state", {})
    if not getattr(model, "pipeline_untied", False) or _HEAD not in optim:
        return None
    head = optim.pop(_HEAD)
    emb_here = _EMB in optim
    if not emb_here:
        optim[_EMB] = head
    return head, emb_here


def _restore_head_copy_state(state: dict, head: dict, emb_here: bool) -> None:
    optim = state["optim"]["state"]
    if emb_here:  # (ZBV: one rank holds both) the copy's state equals the embedding's
        head = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optim[_EMB].items()}
    else:
        head = optim.pop(_EMB)
    optim[_HEAD] = head


def save_failure(step: int, tmp: Path, error: BaseException) -> CheckpointError | None:
    """The one message for a save the filesystem refused: the folder, the system's reason (a full disk named as
    such; torch's zip writer reports one as "unexpected pos"), and that nothing committed was touched; the partial
    ``.tmp`` is removed (it also frees the space). None for any other error (a bug: raised as it is, its ``.tmp``
    left for the next rotation)."""
    folder = tmp.parent
    os_errors = [e for e in exception_chain(error) if isinstance(e, OSError)]
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = -1
    full = any(e.errno in (errno.ENOSPC, errno.EDQUOT) for e in os_errors) or (
        0 <= free < 16 * 1024 * 1024 and "unexpected pos" in "".join(str(e) for e in exception_chain(error))
    )
    if full:
        reason = f"the disk holding {folder} is full ({free / 2**20:.1f} MiB free): free space or set checkpoint.save_dir elsewhere"
    elif os_errors:
        reason = os_error_text(os_errors[0]).rstrip(".")
    else:
        return None
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return CheckpointError(
        f"saving the checkpoint of step {step} failed: {reason}. The partial {tmp.name} was removed; the "
        "checkpoints committed before it are untouched."
    )

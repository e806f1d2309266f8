"""The on-disk layout of checkpoints: every file and directory name, and the atomic file operations on them.

This module alone formats and parses checkpoint names; everything else asks it (``step_dir(root, 100)``,
``step_of(path)``, ``committed(root)``). Layout under ``checkpoint.save_dir`` (default
``<run.output_dir>/checkpoints``)::

    step_00000100/            one committed checkpoint
      .metadata, __*_*.distcp   DCP: model and optimizer state (sharded, reshardable on load)
      trainer_state.json        step, schedule position, loss scaler, data-loader state, config hash (rank 0)
      rng_rank{r}.json          RNG states of rank r (python, numpy, torch CPU, accelerator)
      checksums.json            size and SHA-256 of every file above, written after them
      __{r}_sha256.json         (only until the commit) digests rank r computed while writing its data files
      COMMITTED                 written last; a directory without it is not a checkpoint
    step_00000200.tmp/        a save in progress (or one that crashed); never resumed from, removed later
    step_00000050.trash/      a rotated-out checkpoint, uncommitted, being deleted

Deleting (rotation) removes the marker first and renames to ``.trash`` before ``rmtree`` (:func:`retire`), so a
checkpoint is never half-deleted: it is either whole and committed or not a checkpoint at all. Every small file
is written with :func:`write_json` (fsynced) and directories are fsynced with :func:`fsync_dir`.

Only real directories are llmtrain's: a ``step_*`` entry that is a symbolic link (to a shared folder, another
run's checkpoint) is never listed as committed, rotated, cleared, replaced or changed in place (:func:`owned`);
:func:`symlinked` names them so the caller can say they were left alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "COMMITTED"
CHECKSUMS = "checksums.json"
TRAINER_STATE = "trainer_state.json"
METADATA = ".metadata"  # DCP's metadata file
DATA_SUFFIX = ".distcp"  # DCP's data files
SIDECAR_SUFFIX = "sha256.json"  # __{rank}_sha256.json: digests computed while writing
TMP_SUFFIX = ".tmp"
TRASH_SUFFIX = ".trash"
DEFAULT_SUBDIR = "checkpoints"  # under the run directory when checkpoint.save_dir is not set


# ----------------------------------------------------------------------------- names
def root_of_run(run_dir: str | Path, save_dir: str | Path | None = None) -> Path:
    """The directory holding a run's checkpoints: ``save_dir`` if set, else ``<run_dir>/checkpoints``."""
    return Path(save_dir) if save_dir else Path(run_dir) / DEFAULT_SUBDIR


def run_dir_of(ckpt_dir: str | Path) -> Path:
    """The run directory of a checkpoint in the default place (``RUN_DIR/checkpoints/step_N``)."""
    return Path(ckpt_dir).parent.parent


def step_name(step: int) -> str:
    return f"step_{int(step):08d}"


def step_dir(root: str | Path, step: int) -> Path:
    """Where the committed checkpoint of ``step`` lives."""
    return Path(root) / step_name(step)


def tmp_dir(root: str | Path, step: int) -> Path:
    """Where the save of ``step`` is written before its commit."""
    return Path(root) / (step_name(step) + TMP_SUFFIX)


def tmp_dir_of(ckpt_dir: Path) -> Path:
    """The ``.tmp`` directory a checkpoint was written in before its commit."""
    return ckpt_dir.with_name(ckpt_dir.name + TMP_SUFFIX)


def trash_dir(ckpt_dir: Path) -> Path:
    return ckpt_dir.with_name(ckpt_dir.name + TRASH_SUFFIX)


def is_step_dir(path: str | Path) -> bool:
    """True when the name of ``path`` is a checkpoint name (``step_NNNNNNNN``; committed or not)."""
    return STEP_DIR.match(Path(path).name) is not None


def step_of(path: str | Path) -> int:
    """The step of a checkpoint directory or of a save in progress (``.../step_00000100``, ``step_00000100.tmp``
    -> 100); ValueError for any other name."""
    name = Path(path).name
    m = STEP_DIR.match(name[: -len(TMP_SUFFIX)] if name.endswith(TMP_SUFFIX) else name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint directory (expected a name like {step_name(100)})")
    return int(m.group(1))


def marker_file(ckpt_dir: str | Path) -> Path:
    return Path(ckpt_dir) / MARKER


def checksums_file(ckpt_dir: str | Path) -> Path:
    return Path(ckpt_dir) / CHECKSUMS


def trainer_state_file(ckpt_dir: str | Path) -> Path:
    return Path(ckpt_dir) / TRAINER_STATE


def rng_file(ckpt_dir: str | Path, rank: int) -> Path:
    return Path(ckpt_dir) / f"rng_rank{rank}.json"


def sidecar_file(ckpt_dir: str | os.PathLike, prefix: str) -> Path:
    """The digests file of a writer whose data files start with ``prefix`` (DCP's ``__{rank}_``)."""
    return Path(ckpt_dir) / f"{prefix}{SIDECAR_SUFFIX}"


def sidecars(ckpt_dir: str | Path) -> list[Path]:
    return sorted(Path(ckpt_dir).glob(f"__*_{SIDECAR_SUFFIX}"))


def is_data_file(name: str | Path) -> bool:
    return str(name).endswith(DATA_SUFFIX)


def data_files(ckpt_dir: str | Path) -> list[Path]:
    return sorted(Path(ckpt_dir).glob(f"*{DATA_SUFFIX}"))


# ----------------------------------------------------------------------------- discovery
def marker_matches(ckpt_dir: str | Path, step: int) -> bool:
    """True when the marker holds what :func:`write_marker` wrote for ``step``."""
    try:
        return marker_file(ckpt_dir).read_text(encoding="ascii") == f"step {step}\n"
    except (OSError, UnicodeDecodeError):
        return False


def owned(path: str | Path) -> bool:
    """True when ``path`` is a real directory (not a symbolic link): only those does llmtrain delete or replace."""
    p = Path(path)
    return not p.is_symlink() and p.is_dir()


def symlinked(root: str | Path) -> list[Path]:
    """``step_*`` entries under ``root`` that are symbolic links (never followed, deleted or replaced)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_symlink())


def is_committed(ckpt_dir: str | Path) -> bool:
    """True when ``ckpt_dir`` carries the marker (it still has to verify to be resumed from)."""
    return marker_file(ckpt_dir).exists()


def committed(root: str | Path) -> list[Path]:
    """Committed checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_step_dir(p) and owned(p) and is_committed(p)]
    return sorted(found, key=step_of)


def stale(root: str | Path, keep: tuple[Path | None, ...] = ()) -> list[Path]:
    """``.tmp`` / ``.trash`` directories under ``root`` (crashed saves, unfinished deletions), except ``keep``."""
    out = []
    for path in Path(root).glob("step_*.t*"):
        if path.suffix in (TMP_SUFFIX, TRASH_SUFFIX) and path not in keep and owned(path):
            out.append(path)
    return out


# ----------------------------------------------------------------------------- durable writes and deletes
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_marker(ckpt_dir: Path, step: int) -> None:
    """Commit ``ckpt_dir``: the marker, fsynced, then the directory fsynced."""
    with open(marker_file(ckpt_dir), "w") as f:
        f.write(f"step {step}\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(ckpt_dir)


def refuse_symlink(path: Path) -> None:
    """CheckpointError when ``path`` is a symbolic link: llmtrain never replaces or deletes through one."""
    if path.is_symlink():
        from llmtrain.errors import CheckpointError

        raise CheckpointError(
            f"{path} is a symbolic link (to {os.readlink(path)}); llmtrain replaces and deletes only the "
            "checkpoint directories it wrote, so it leaves this one alone and does not save over it. Move the "
            "link out of the checkpoint folder, or set checkpoint.save_dir to another folder."
        )


def publish(tmp: Path, final: Path) -> None:
    """Rename a committed ``.tmp`` directory to its step name (replacing an older one) and fsync the parent."""
    refuse_symlink(final)
    if final.exists():
        delete(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def retire(ckpt_dir: Path) -> Path:
    """Uncommit and move out of the step_N namespace (never a half-deleted checkpoint); the caller deletes the
    returned ``.trash`` directory, possibly in the background. A symbolic link is refused (never followed)."""
    trash = trash_dir(ckpt_dir)
    refuse_symlink(ckpt_dir)
    refuse_symlink(trash)
    marker_file(ckpt_dir).unlink(missing_ok=True)
    fsync_dir(ckpt_dir)
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(ckpt_dir, trash)
    return trash


def delete(ckpt_dir: Path) -> None:
    shutil.rmtree(retire(ckpt_dir), ignore_errors=True)


def rmtree_all(paths: list[Path]) -> None:
    for path in paths:
        if owned(path):  # never through a symbolic link
            shutil.rmtree(path, ignore_errors=True)

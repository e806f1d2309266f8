"""The work folder of ``prepare`` (``.PREFIX.work/`` or ``PREFIX.partitions/I-of-N/``): claimed, trusted, removed.

``prepare`` keeps its resumable state in a work folder and removes it when done. It only ever reuses or
removes a folder it created itself: creating one puts the marker file :data:`MARKER` in it (the folder is made
under a temporary name with the marker inside, then renamed, so a folder without a marker is never one that
``prepare`` is still setting up). A folder of that name without the marker (a user's own, or one made by a
much older llmtrain) is refused, naming it, and left untouched.

``state.json`` in the folder records which run the work belongs to (the digest of everything that changes the
output). A state file that is missing, unreadable, or not the JSON object ``prepare`` writes (damaged: garbage
bytes, wrong types) is treated like a state of another run: the folder is ours, so its work is discarded and
started again, and the run says so.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from llmtrain.data.manifest import write_json_atomic
from llmtrain.errors import DataError

MARKER = ".llmtrain-prepare-work"
MARKER_FORMAT = "llmtrain.prepare-work"
STATE = "state.json"


def owned(workdir: Path) -> bool:
    """Whether ``workdir`` carries the marker of a folder ``prepare`` created."""
    try:
        mark = json.loads((workdir / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(mark, dict) and mark.get("format") == MARKER_FORMAT


def _refuse(workdir: Path) -> DataError:
    return DataError(
        f"The work folder '{workdir}' exists but was not created by `llmtrain prepare` (it has no {MARKER} "
        f"marker), so prepare will neither reuse nor remove it; it is left untouched. Move or remove it, or "
        f"choose another --output."
    )


def _create(workdir: Path) -> None:
    """Make ``workdir`` with its marker in one rename; a folder someone else made meanwhile is kept."""
    tmp = workdir.parent / f".{workdir.name}.new-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_json_atomic(tmp / MARKER, {"format": MARKER_FORMAT, "about": "made by llmtrain prepare"})
        tmp.rename(workdir)
    except OSError:  # a full disk; or the folder made meanwhile by a concurrent task of the same run
        shutil.rmtree(tmp, ignore_errors=True)
        if not workdir.is_dir():
            raise
        if not owned(workdir):
            raise _refuse(workdir) from None


def read_state(workdir: Path) -> dict | None:
    """The ``state.json`` object, or None when it is missing or damaged."""
    try:
        state = json.loads((workdir / STATE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("key"), str) else None


def claim(workdir: Path, key: str, identity: dict, say: Callable[[str], None] | None = None) -> None:
    """Make ``workdir`` this run's work folder: created with its marker, or reused when it is ours and its
    state is this run's (``key``), or emptied and restarted when it is ours and holds other or damaged state.
    DataError, before anything is written, when the folder exists without the marker."""
    if workdir.exists():
        if not workdir.is_dir() or not owned(workdir):
            raise _refuse(workdir)
        state = read_state(workdir)
        if state is None or state["key"] != key:
            if say is not None and (workdir / STATE).exists() and state is None:
                say(f"prepare: the work state '{workdir / STATE}' is damaged; starting this work again")
            shutil.rmtree(workdir)
    if not workdir.exists():
        _create(workdir)
    write_json_atomic(workdir / STATE, {"key": key, "identity": identity})


def remove(workdir: Path) -> None:
    """Remove ``workdir`` if it is one ``prepare`` created (never a folder without the marker)."""
    if workdir.is_dir() and owned(workdir):
        shutil.rmtree(workdir, ignore_errors=True)

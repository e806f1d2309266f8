"""Where an export lands: a new folder built next to the target and renamed into place, never a partial one.

The target ``OUT`` must be absent, an empty directory, or an earlier export of ours: a directory holding
:data:`MARKER` (``llmtrain_export.json``) whose ``files`` list covers everything in it. Anything else (a file,
a folder with a user's own config.json or any file the marker does not list) is refused with a
FileSystemError and left byte-identical.

:func:`publish` yields a temporary sibling ``.OUT.tmp-PID`` to write into; on success it writes the marker
there and renames the folder onto ``OUT`` (an earlier export is first renamed aside, then deleted, so no file
of it survives: no stale shard next to a new index). On any failure the temporary folder is removed and
``OUT`` (absent or the previous export) is untouched; an OSError becomes one message naming the path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmtrain.errors import FileSystemError, os_error_text

MARKER = "llmtrain_export.json"


def _marker_files(path: Path) -> list[str] | None:
    """The ``files`` an export marker in ``path`` lists, or None when there is no valid marker."""
    try:
        data = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) and data.get("producer") == "llmtrain" else None
    return files if isinstance(files, list) and all(isinstance(f, str) for f in files) else None


def check_target(out: Path) -> str:
    """``new``, ``empty`` or ``ours`` for a usable target; FileSystemError (exit 2) for anything else (the
    current directory or a folder above it included: renaming it would pull the ground from under the shell)."""
    here, there = Path.cwd().resolve(), Path(os.path.abspath(out)).resolve()
    if there == here or there in here.parents or not there.name:
        raise FileSystemError(
            f"export target {out} is the current directory or a folder above it ({there}); an export replaces "
            "its target folder whole. Name a new folder, e.g. `--to hf ./hf-export`."
        )
    if not out.exists() and not out.is_symlink():
        return "new"
    if not out.is_dir() or out.is_symlink():
        raise FileSystemError(
            f"export target {out} exists and is not a directory; choose a new folder name or remove it."
        )
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return "empty"
    listed = _marker_files(out)
    if listed is None:
        raise FileSystemError(
            f"export target {out} is a non-empty folder that llmtrain did not write (no {MARKER}; it holds "
            f"{', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}); it is left untouched. Choose a new "
            "or empty folder."
        )
    foreign = [e for e in entries if e not in listed and e != MARKER]
    if foreign:
        raise FileSystemError(
            f"export target {out} is an earlier llmtrain export but also holds {', '.join(foreign[:5])}, which "
            f"its {MARKER} does not list; replacing the folder would delete them, so it is left untouched. Move "
            "those files out or choose another folder."
        )
    return "ours"


def write_marker(folder: Path, info: dict[str, Any]) -> Path:
    """Write the export marker listing every file now in ``folder``."""
    files = sorted(p.name for p in folder.iterdir() if p.name != MARKER)
    path = folder / MARKER
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"producer": "llmtrain", **info, "files": files}, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path


def _io_errno(e: BaseException) -> int | None:
    """The errno of an I/O failure a library reports as its own exception type (safetensors' SafetensorError:
    "... I/O error: No space left on device (os error 28)"), or None."""
    m = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
    return int(m.group(1)) if m else None


@contextmanager
def publish(out: str | Path, info: dict[str, Any]) -> Iterator[Path]:
    """Yield a temporary folder; on success mark it and move it onto ``out`` (see the module docstring)."""
    out = Path(os.path.abspath(out))  # `.`-free: the temporary sibling needs the folder's own name
    kind = check_target(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # ours: a leftover of this very process id
        tmp.mkdir()
    except OSError as e:
        raise FileSystemError(f"cannot create the export folder next to {out}: {os_error_text(e)}") from None
    try:
        yield tmp
        write_marker(tmp, info)
        _fsync_dir(tmp)
        if kind == "ours":
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:  # absent, or an empty directory (rename replaces an empty directory atomically)
            os.replace(tmp, out)
        _fsync_dir(out.parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileSystemError(
            f"export to {out} failed: {os_error_text(e)} Nothing was changed at {out}."
        ) from None
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        code = _io_errno(e)
        if code is not None:  # safetensors' own wrapping of a full disk, a quota ...
            os_error = OSError(code, os.strerror(code), str(tmp))
            raise FileSystemError(
                f"export to {out} failed: {os_error_text(os_error)} Nothing was changed at {out}."
            ) from None
        raise


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

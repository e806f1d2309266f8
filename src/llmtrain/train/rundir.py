"""Who owns a run directory: one live run per ``run.output_dir``, and only files llmtrain can prove it wrote.

:class:`RunLock` — rank 0 of a run holds an exclusive ``flock`` on ``<run_dir>/.llmtrain.lock`` from the time the
run is built until it ends; the file names the owner (host, pid, start time). A second run on the same
directory (another process on this host, or on another host of a shared file system that honours ``flock``)
is refused with a ConfigError naming that owner, before it writes anything. The operating system drops the lock
when its process dies, so a crashed, killed or preempted run leaves no stale lock: the file stays, the lock on
it does not. Within one process the lock is re-entrant (several trainers over one directory, one after the
other, as tests and notebooks do).

:func:`write_resolved_config` — ``<run_dir>/config.yaml`` is the resolved config of the run. It starts with
:data:`RESOLVED_HEADER`; a ``config.yaml`` without it (the user's own file) is never replaced.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

from llmtrain.config.loader import save_config
from llmtrain.config.schema import Config
from llmtrain.errors import ConfigError

LOCK_NAME = ".llmtrain.lock"
RESOLVED_HEADER = (
    "# llmtrain: the resolved config of this run, written by llmtrain (edit the YAML you ran instead)\n"
)

_held: dict[Path, tuple[IO[str], int]] = {}  # lock path -> (open file, holders in this process)


class RunLock:
    """The exclusive lock of one run directory (see the module docstring); ``release()`` is idempotent."""

    def __init__(self, run_dir: str | Path):
        self.path = (Path(run_dir) / LOCK_NAME).resolve()
        self._held = False

    def acquire(self) -> RunLock:
        if self.path in _held:
            f, n = _held[self.path]
            _held[self.path] = (f, n + 1)
            self._held = True
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the life of the run
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            owner = f.read().strip() or "an unknown process"
            f.close()
            raise ConfigError(
                f"run.output_dir {self.path.parent} is in use by another run ({owner}): two runs writing one "
                "directory would replace each other's checkpoints and interleave metrics.jsonl. Wait for it to "
                "end, stop it, or give this run another run.output_dir."
            ) from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}) + "\n")
        f.flush()
        _held[self.path] = (f, 1)
        self._held = True
        return self

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        f, n = _held[self.path]
        if n > 1:
            _held[self.path] = (f, n - 1)
            return
        del _held[self.path]
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        f.close()


def write_resolved_config(cfg: Config, run_dir: Path) -> Path:
    """Write ``cfg`` to ``<run_dir>/config.yaml`` (atomically), unless a config.yaml of the user's is there."""
    path = run_dir / "config.yaml"
    if path.is_file():
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline()
        if first != RESOLVED_HEADER:
            raise ConfigError(
                f"{path} exists and was not written by llmtrain (its first line is not the resolved-config "
                "header); llmtrain writes the run's resolved config there and never replaces a file of yours. "
                "Move that file out of the run directory, or set run.output_dir to another directory."
            )
    elif path.exists():
        raise ConfigError(
            f"{path} is a directory (or not a regular file); remove it or set another run.output_dir."
        )
    save_config(cfg, path, header=RESOLVED_HEADER)
    return path

"""Who owns a run directory: one live run per ``run.output_dir`` and per checkpoint directory, and only files
llmtrain can prove it wrote.

:class:`RunLock` — rank 0 of a run holds an exclusive ``flock`` on ``<run_dir>/.llmtrain.lock`` and on
``<checkpoint root>/.llmtrain.lock`` (``checkpoint.save_dir``, or ``<run_dir>/checkpoints``) from the time the
run is built until it ends; each file names the owner (host, pid, start time). The directories are resolved
first (symbolic links followed), so two paths to one folder are one lock, and a lock file that is itself a
symbolic link is refused, never followed. A second run on the same run directory, or with the same checkpoint
directory under another run directory (another process on this host, or on another host of a shared file
system that honours ``flock``), is refused with a ConfigError naming that owner, before it writes anything. The
operating system drops the lock when its process dies, so a crashed, killed or preempted run leaves no stale
lock: the file stays, the lock on it does not. Within one process the lock is re-entrant (several trainers over
one directory, one after the other, as tests and notebooks do). Taking and releasing are not cut in half by a
Ctrl-C or SIGTERM (:func:`_signals_deferred`): a lock file this process made is always either held and
remembered, so that ``release()`` removes it, or gone.

The same lock serves ``llmtrain prepare``, one live owner per ``--output`` (:meth:`RunLock.for_output`): the file is ``.PREFIX.llmtrain.lock`` beside the output, and it is removed when the
lock is released (a prepared folder holds only the dataset); a contender that opened the file just before its
removal sees that it was removed and takes the lock on a new one.

:func:`write_resolved_config` — ``<run_dir>/config.yaml`` is the resolved config of the run. It starts with
:data:`RESOLVED_HEADER`; a ``config.yaml`` without it (the user's own file) is never replaced.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from llmtrain.config.loader import save_config
from llmtrain.config.schema import Config
from llmtrain.errors import ConfigError

LOCK_NAME = ".llmtrain.lock"
RESOLVED_HEADER = (
    "# llmtrain: the resolved config of this run, written by llmtrain (edit the YAML you ran instead)\n"
)

_held: dict[Path, tuple[IO[str], int, bool]] = {}  # lock path -> (open file, holders in this process, tidy)


@dataclass(frozen=True)
class _Claim:
    """One lock file to hold, and how a refusal names it."""

    directory: Path  # the locked folder, as the user named it (created if missing, resolved when taken)
    label: str  # what is locked, as the user named it: "run.output_dir runs/x"
    owner_kind: str  # "run", "`llmtrain prepare`"
    harm: str  # what two owners would do to each other
    fix: str  # what the user can do instead
    name: str = LOCK_NAME  # the lock file's name in the folder
    tidy: bool = False  # remove the file when released

    @property
    def path(self) -> Path:
        """The lock file in the folder's real path (after every symbolic link); the folder is made if missing."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return self.directory.resolve() / self.name


class RunLock:
    """The exclusive lock of one run directory and its checkpoint directory (see the module docstring);
    ``release()`` is idempotent."""

    def __init__(self, run_dir: str | Path, checkpoint_dir: str | Path | None = None):
        self.path = (Path(run_dir) / LOCK_NAME).resolve()  # the run directory's lock file
        self._claims = [
            _Claim(Path(run_dir), f"run.output_dir {run_dir}", "run",
                   "two runs writing one directory would replace each other's checkpoints and interleave "
                   "metrics.jsonl", "give this run another run.output_dir"),
        ]  # fmt: skip
        if checkpoint_dir is not None:
            self._claims.append(
                _Claim(Path(checkpoint_dir), f"the checkpoint directory {checkpoint_dir} of this run", "run",
                       "two runs sharing checkpoints would resume from and rotate away each other's checkpoints",
                       "give this run another checkpoint.save_dir (unset: <run.output_dir>/checkpoints)")
            )  # fmt: skip
        self._taken: list[Path] = []

    @classmethod
    def for_output(cls, output: str | Path, label: str | None = None) -> RunLock:
        """The lock of ``llmtrain prepare`` on the dataset ``output`` (a prefix): ``.PREFIX.llmtrain.lock`` beside
        it, removed when released; ``label`` names it in a refusal (default ``--output PREFIX``)."""
        out = Path(output)
        lock = cls(out.parent)
        lock._claims = [
            _Claim(out.parent, label or f"--output {output}", "`llmtrain prepare`",
                   "two of them writing one output would delete each other's work folder and publish a mix",
                   "choose another --output", name=f".{out.name}{LOCK_NAME}", tidy=True),
        ]  # fmt: skip
        lock.path = out.parent.resolve() / lock._claims[0].name
        return lock

    def acquire(self) -> RunLock:
        if self._taken:
            return self
        try:
            with _signals_deferred():  # a Ctrl-C held back here is raised on leaving it: released below
                for claim in self._claims:
                    path = claim.path
                    if path not in self._taken:  # a checkpoint directory that is the run directory: one lock
                        _take(path, claim)
                        self._taken.append(path)
                self.path = self._taken[0]
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        with _signals_deferred():
            while self._taken:
                _drop(self._taken.pop())


_DEFERRED = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold back SIGINT and SIGTERM while the body runs (main thread only, where Python runs its signal
    handlers), then deliver them again to the handlers that were in place. Without it a Ctrl-C between creating
    a tidy lock file and remembering it leaves the file behind (seen once in CI, two-worker ``prepare``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    before = {s: signal.getsignal(s) for s in _DEFERRED}
    if any(h is None for h in before.values()):  # a handler not set from Python: nothing to restore it to
        yield
        return
    for s in _DEFERRED:
        signal.signal(s, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def _take(path: Path, claim: _Claim) -> None:
    """Hold the lock file ``path`` (re-entrant in this process); ConfigError naming the owner when another holds
    it."""
    if path in _held:
        f, n, tidy = _held[path]
        _held[path] = (f, n + 1, tidy)
        return
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(
                    f"{path} is a symbolic link: llmtrain keeps the lock of {claim.label} there and does not "
                    "follow links it did not make. Remove the link."
                ) from None
            raise
        f = os.fdopen(fd, "r+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = f.read().strip() or "an unknown process"
            f.close()
            raise ConfigError(
                f"{claim.label} is in use by another {claim.owner_kind} ({owner}): {claim.harm}. Wait for it to "
                f"end, stop it, or {claim.fix}."
            ) from None
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()  # its holder removed the file as we opened it (a tidy lock): take the new one
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}) + "\n")
    f.flush()
    _held[path] = (f, 1, claim.tidy)


def _drop(path: Path) -> None:
    f, n, tidy = _held[path]
    if n > 1:
        _held[path] = (f, n - 1, tidy)
        return
    del _held[path]
    if tidy:  # removed while still held: whoever opened it meanwhile sees another inode and retries
        try:
            os.unlink(path)
        except OSError:
            pass
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

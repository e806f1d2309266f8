"""User-facing errors.

Everything a user can get wrong (a config key, a file, a value) raises a subclass of :class:`LLMTrainError`
with one paragraph that names the file, key or value and says what would be valid. The CLI prints the message
without a traceback and exits with code 2.
"""

from __future__ import annotations

import errno
import os

# Exit codes of `llmtrain train` / `launch` besides an error's own (docs/reliability.md, "Ending a run").
PREEMPTED_EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: stopped on a signal, saved; the same command resumes
HANG_EXIT_CODE = 124  # the hang watchdog ended a rank that made no progress


class LLMTrainError(Exception):
    """Base class of errors caused by user input; the CLI turns them into exit code 2."""

    exit_code = 2


class ConfigError(LLMTrainError):
    """A config file, key or value is invalid or inconsistent."""


class DataError(LLMTrainError):
    """An input file, dataset prefix or tokenizer is missing, malformed or inconsistent."""


class CheckpointError(LLMTrainError):
    """A checkpoint is missing, incomplete or does not match the run."""


class FileSystemError(LLMTrainError):
    """A path cannot be read or written: missing, a file where a folder belongs, no permission, disk full."""


# errno -> what would fix it (the message of every OSError that reaches the command line).
_OS_HINTS = {
    errno.ENOSPC: "the disk is full: free space there or point the output elsewhere",
    errno.EDQUOT: "the disk quota is exhausted: free space there or point the output elsewhere",
    errno.EFBIG: "the file grew past the size this process may write (ulimit -f) or the filesystem allows",
    errno.EROFS: "the filesystem is read-only: choose a writable location",
    errno.EACCES: "permission denied: choose a location you may write, or fix its permissions",
    errno.EPERM: "operation not permitted: choose a location you may write, or fix its permissions",
    errno.EISDIR: "it is a directory where a file is needed: remove it or choose another name",
    errno.ENOTDIR: "a part of the path is a file where a directory is needed: remove it or choose another path",
    errno.ENOENT: "it does not exist",
    errno.EEXIST: "it already exists",
    errno.ENOTEMPTY: "the directory is not empty",
}


def os_error_text(e: OSError) -> str:
    """One sentence for an OSError: the path(s), what the system said, and what would fix it."""
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None) or "a file"
    said = e.strerror or str(e)
    hint = _OS_HINTS.get(e.errno or -1)
    if e.errno == errno.EEXIST and e.filename is not None and os.path.isfile(e.filename):
        hint = "it is a file where a directory is needed: remove it or choose another path"
    return f"{paths}: {said}" + (f" ({hint})." if hint and hint != said.lower() else ".")


def user_message(error: BaseException) -> tuple[str, int] | None:
    """(message, exit code) for an error that is the user's or the system's to fix (no traceback), else None."""
    if isinstance(error, LLMTrainError):
        return str(error), error.exit_code
    for cause in exception_chain(error):  # torch wraps OSErrors in RuntimeErrors
        if isinstance(cause, OSError) and not isinstance(cause, BrokenPipeError):
            return os_error_text(cause), FileSystemError.exit_code
    return None


def exception_chain(error: BaseException) -> list[BaseException]:
    """``error`` first, then its causes and contexts, and the per-rank failures a torch distributed-checkpoint
    exception carries (``failures``: rank -> (exception, traceback)), each once."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop(0)
        if any(e is x for x in seen):
            continue
        seen.append(e)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for x in failures.values():
                x = x[0] if isinstance(x, tuple) and x else x
                if isinstance(x, BaseException):
                    todo.append(x)
    return seen

"""User-facing errors.

Everything a user can get wrong (a config key, a file, a value) raises a subclass of :class:`LLMTrainError`
with one paragraph that names the file, key or value and says what would be valid. The CLI prints the message
without a traceback and exits with code 2.
"""

from __future__ import annotations

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

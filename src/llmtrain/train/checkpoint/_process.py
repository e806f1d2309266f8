"""Process-group helpers shared by the checkpoint modules: every function works with and without a group.

Checkpoints are written by every rank and committed by rank 0; on a single process (tests, generation, export)
there is no process group at all, and DCP warns on every call then, which :func:`quiet_single_process` silences.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; single-process use is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def barrier(group: Any = None) -> None:
    if is_dist():
        dist.barrier(group=group)

"""``llmtrain <argv>`` with this process's first replica-group step started late on rank 1.

Rank 1 sleeps ``LATE_RANK_SECONDS`` before its first ``ReplicaSet.start_step``: the two ranks of a group then
start their clocks for the job's first quorum that far apart (as a slow import or data load on one rank under
load does). Used by tests/test_replicas.py; the delay is injected here, in the test, not through the config.
"""

from __future__ import annotations

import os
import sys
import time

import llmtrain.ft.replicas as replicas
from llmtrain.cli import main

_start_step = replicas.ReplicaSet.start_step
_late: list[bool] = []


def start_step(self, trainer) -> None:  # type: ignore[no-untyped-def]
    if not _late and os.environ.get("RANK") == "1":
        time.sleep(float(os.environ["LATE_RANK_SECONDS"]))
    _late.append(True)
    _start_step(self, trainer)


replicas.ReplicaSet.start_step = start_step  # type: ignore[method-assign]
sys.exit(main(sys.argv[1:]))

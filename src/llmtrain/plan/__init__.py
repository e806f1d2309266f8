"""``llmtrain plan``: memory, step time, MFU and cost of a run before it starts, and a search for the best layout.

* :mod:`~llmtrain.plan.catalog` — devices (data in ``devices.yaml``, user-extensible) and ``--cluster``.
* :mod:`~llmtrain.plan.memory` — itemised bytes per device under each ZeRO stage, recompute mode and schedule.
* :mod:`~llmtrain.plan.timing` — step time: FLOPs at a device efficiency plus the communication of each dim.
* :mod:`~llmtrain.plan.search` — evaluate one layout; enumerate and rank the valid ones.
* :mod:`~llmtrain.plan.cli` — plan one run and print it (table or ``--json``, ``--claim`` checks); the flags of
  ``llmtrain plan`` are in :mod:`llmtrain.commands.plan`.
"""

from llmtrain.plan.catalog import Cluster, Device, load_catalog, parse_cluster
from llmtrain.plan.memory import Layout, MemoryEstimate, estimate_memory
from llmtrain.plan.search import PlanResult, evaluate, layout_from_config, search
from llmtrain.plan.timing import Efficiency, StepTime, estimate_step_time

__all__ = [
    "Cluster", "Device", "Efficiency", "Layout", "MemoryEstimate", "PlanResult", "StepTime", "estimate_memory",
    "estimate_step_time", "evaluate", "layout_from_config", "load_catalog", "parse_cluster", "search",
]  # fmt: skip

"""``llmtrain plan``: memory, step time, MFU and cost of a run before it starts, and a search for the best layout.

* :mod:`~llmtrain.plan.catalog` — devices (data in ``devices.yaml``, user-extensible) and ``--cluster``.
* :mod:`~llmtrain.plan.layout` — a layout, its engine (this trainer or Megatron-style), what each pipeline rank
  holds (chunks, dense and expert parameters).
* :mod:`~llmtrain.plan.memory` — itemised bytes per device under each ZeRO stage, recompute mode and schedule.
* :mod:`~llmtrain.plan.long_context` — context parallel as the trainer runs it (gathered K/V, dense mask), the
  chunked loss's logits, activation offload's host bytes and copies.
* :mod:`~llmtrain.plan.gemm` — GEMM time as a function of the matrix shape; the GEMMs of one block.
* :mod:`~llmtrain.plan.timing` — step time: GEMMs, attention, element-wise traffic, the communication of each
  dim, the pipeline's slowest stage.
* :mod:`~llmtrain.plan.search` — evaluate one layout; enumerate and rank the valid ones.
* :mod:`~llmtrain.plan.cli` — plan one run and print it (table or ``--json``, ``--claim`` checks); the flags of
  ``llmtrain plan`` are in :mod:`llmtrain.commands.plan`.
"""

from llmtrain.plan.catalog import Cluster, Device, load_catalog, parse_cluster
from llmtrain.plan.layout import Layout
from llmtrain.plan.memory import MemoryEstimate, estimate_memory
from llmtrain.plan.search import PlanResult, evaluate, layout_from_config, search
from llmtrain.plan.timing import Efficiency, StepTime, estimate_step_time

__all__ = [
    "Cluster", "Device", "Efficiency", "Layout", "MemoryEstimate", "PlanResult", "StepTime", "estimate_memory",
    "estimate_step_time", "evaluate", "layout_from_config", "load_catalog", "parse_cluster", "search",
]  # fmt: skip

"""What replica groups (``fault_tolerance``, torchft: src/llmtrain/ft/) add to a plan: the cross-group gradient
all-reduce, and the memory it and the live heal take.

A job with ``fault_tolerance.replicas: R`` is R groups of ``world / R`` ranks (ft/layout.py); the planner's
:class:`~llmtrain.plan.layout.Layout` holds one group's degrees and ``replicas = R``. Group ``r`` is ranks
``r x G .. r x G + G - 1`` (``G`` = :attr:`Layout.group_world`), so rank ``i`` of every group forms one
cross-group ring of R members ``G`` ranks apart: across nodes as soon as a group fills a node.

**Time** (ft/replicas.py, ft/grads.py): every parameter's gradient is summed across the groups once per
reduction, on the rank's own shard, in the trainer's gradient dtype (fp32 under this trainer):

* *hooked*: FSDP2's all-reduce hook runs on each FSDP unit's reduce-scattered shard (HSDP-style), inside FSDP's
  reduce path, so it overlaps the rest of the backward as the reduce-scatter does (the planner adds it to the
  data-parallel reduction and applies the same overlap rule; the last unit's share is exposed). It covers the
  FSDP units' parameters when there is no pipeline parallelism (and not ``keep`` over three or more groups:
  ``ft.layout.fsdp_hook_sums``): the blocks' dense parameters, and the experts
  when FSDP shards them (no EP, or EP with ZeRO >= 1 and expert replicas ``edp > 1``).
* *explicit*: the gradients no hook covers (all of them under pipeline parallelism or without FSDP, i.e. with
  ``dp x cp`` = 1 in a group; experts that FSDP leaves out) are summed after the backward in one flat fp32 all-reduce (``sum_grads``): exposed.

A ring all-reduce of ``n`` bytes over R members moves ``2 (R - 1) / R n`` per rank
(:func:`~llmtrain.plan.timing.group_bandwidth` for the R members ``G`` apart).

**Memory** (:func:`replica_memory_bytes`, for plan/memory.py): on the device, the flat fp32 buffer of the
explicit all-reduce (4 bytes per explicit gradient element, plus one presence flag per parameter, ignored)
while it runs after the backward; in host memory, the live heal's copy: torchft's default ``HTTPTransport``
copies the sending rank's state (parameters and optimizer state, ft/state.py) to host memory to serve it, and
the healed rank receives it in host memory before loading it onto the device: one rank state per rank of the
sender and of the receiver, transiently.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.ft.layout import fsdp_hook_sums
from llmtrain.plan.layout import Layout

GRAD_BYTES_FT = 4
"""Bytes per gradient element in the cross-group sum: this trainer's fp32 gradients (and ``sum_grads``'s fp32
flat buffer)."""


@dataclass(frozen=True)
class ReplicaSplit:
    """Gradient elements of one rank's shard summed across the groups: by FSDP's hook or explicitly."""

    hooked: float
    explicit: float


def replica_split(lay: Layout, dense: float, expert: float) -> ReplicaSplit:
    """Split one rank's ``dense`` / ``expert`` parameters (before ZeRO sharding, ``plan.layout.rank_params``) into
    the shard elements the FSDP hook all-reduces and the ones ``sum_grads`` all-reduces after the backward."""
    if lay.replicas <= 1:
        return ReplicaSplit(0.0, 0.0)
    dense_shard = dense / lay.shard_degree
    expert_shard = expert / lay.expert_shard_degree
    fsdp = lay.dp > 1 or lay.cp > 1 or lay.offload  # distributed/parallelize.py: FSDP wraps the model
    hooks = fsdp_hook_sums(lay.pp > 1, lay.replica_policy, lay.replicas)
    if not hooks or not fsdp:  # no hook runs: everything after the backward, explicitly (ft/grads.py)
        return ReplicaSplit(0.0, dense_shard + expert_shard)
    experts_in_fsdp = lay.ep == 1 or lay.expert_fsdp
    if experts_in_fsdp:
        return ReplicaSplit(dense_shard + expert_shard, 0.0)
    return ReplicaSplit(dense_shard, expert_shard)


def replica_all_reduce_bytes(lay: Layout, dense: float, expert: float) -> tuple[float, float]:
    """(hooked, explicit) bytes one rank all-reduces across the groups per reduction."""
    split = replica_split(lay, dense, expert)
    return GRAD_BYTES_FT * split.hooked, GRAD_BYTES_FT * split.explicit


def replica_memory_bytes(lay: Layout, dense: float, expert: float, state_bytes: float) -> dict[str, float]:
    """What replica groups add to one rank's memory: ``device``: the explicit all-reduce's flat fp32 buffer
    (transient, after the backward, while the gradients are live); ``host``: the live heal's copy of the rank's
    state (``state_bytes``: its parameters and optimizer state, as the checkpoint holds them), held by the
    sending and the receiving rank during a heal. Zeros without replica groups."""
    if lay.replicas <= 1:
        return {"device": 0.0, "host": 0.0}
    return {"device": GRAD_BYTES_FT * replica_split(lay, dense, expert).explicit, "host": state_bytes}


__all__ = ["ReplicaSplit", "replica_all_reduce_bytes", "replica_memory_bytes", "replica_split"]

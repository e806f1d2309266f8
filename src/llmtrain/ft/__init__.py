"""Replica groups with torchft: a failed device drops its group from the quorum, the others keep stepping.

The job is ``fault_tolerance.replicas`` groups. Inside a group the layout is today's (FSDP / TP as configured,
one torchrun per group); across groups the gradients are summed through torchft's managed process group,
HSDP-style: FSDP2's all-reduce hook runs it on each reduce-scattered gradient shard (a group without FSDP
all-reduces its gradients after the backward). Each step starts with a quorum (the lighthouse decides which
groups are in); a group that lags (restarted after a crash) heals live from a peer with the same state the
on-disk checkpoint holds, then steps with the others. A step that a dying group did not finish is not
committed anywhere and is taken again by the survivors.

Modules, each small:

    layout     the replica layout of a config: validation (one clear error) and the lines ``check`` prints
    version    the torchft build this code is pinned to, and the check that the installed one is it
    lighthouse the embedded lighthouse ``llmtrain launch`` starts, and the reachability check of a remote one
    data       each group's disjoint slice of every global batch; committed-only accounting; keep / shrink
    state      the live-heal state: the checkpoint's own state definition, as local shards
    replicas   the per-step protocol the trainer calls (quorum, heal, commit vote, events)
"""

from llmtrain.ft.layout import REPLICA_ENV, ReplicaLayout

__all__ = ["REPLICA_ENV", "ReplicaLayout"]

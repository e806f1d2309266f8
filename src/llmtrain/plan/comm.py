"""Communication time of the planner: ring collectives and all-to-all over a cluster's links, the data-parallel /
ZeRO traffic of one rank per step, and the replica groups' cross-group all-reduce (plan/timing.py puts them on
the critical path; docs/planner.md "Time model").

A collective over ``g`` ranks moves ``(g - 1) / g`` of the buffer per rank (ring), twice for an all-reduce, at
``link_efficiency`` of :func:`group_bandwidth`.
"""

from __future__ import annotations

from llmtrain.plan.calibration import Efficiency
from llmtrain.plan.catalog import Cluster
from llmtrain.plan.layout import MASTER_BYTES, Layout
from llmtrain.plan.replicas import replica_all_reduce_bytes


def group_bandwidth(cluster: Cluster, size: int, stride: int, eff: Efficiency) -> float:
    """Bytes/s per rank of a ring collective over ``size`` ranks spaced ``stride`` apart in rank order.

    Inside one node: the intra-node link. Across nodes, a ring with ``k`` members in each node crosses each node
    boundary once per channel, and NCCL spreads its channels over the NICs; the other groups of the same
    layout run concurrently on the node's other NICs, so each group gets ``k`` NICs: ``min(intra, k x inter)``
    (a pure data-parallel ring with all 8 GPUs of a node: 8 NICs; one GPU per node, e.g. DP under TP8: 1).
    """
    dev = cluster.device
    if size * stride <= cluster.devices_per_node:
        return dev.intra_node_bw_gbs * 1e9 * eff.link_efficiency
    per_node = max(1, min(size, cluster.devices_per_node // max(stride, 1)))
    return min(dev.intra_node_bw_gbs, per_node * dev.inter_node_bw_gbs) * 1e9 * eff.link_efficiency


def collective(nbytes: float, size: int, bw: float, eff: Efficiency, kind: str = "ag") -> float:
    """Ring time of an all-gather / reduce-scatter ("ag"/"rs") or all-reduce ("ar") of ``nbytes``."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if kind == "ar" else 1.0
    return factor * (size - 1) / size * nbytes / bw + eff.latency_s


def all_to_all(nbytes: float, size: int, stride: int, cluster: Cluster, eff: Efficiency) -> float:
    """One all-to-all of ``nbytes`` per rank over ``size`` ranks ``stride`` apart (intra / inter in parallel)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    dev = cluster.device
    inside = min(size, max(1, cluster.devices_per_node // stride))
    intra = (inside - 1) / size * nbytes / (dev.intra_node_bw_gbs * 1e9 * eff.link_efficiency)
    inter = (size - inside) / size * nbytes / (dev.inter_node_bw_gbs * 1e9 * eff.link_efficiency)
    return max(intra, inter) + eff.latency_s


def dp_traffic(
    lay: Layout, cluster: Cluster, dense: float, expert: float, eff: Efficiency
) -> tuple[float, float, float]:
    """(gather once per step, reduce once per step, traffic per micro-batch) in seconds, one rank."""
    t, cp = lay.tp, lay.cp
    mega = lay.bf16_weights
    fsdp = dense + (expert if lay.ep == 1 else 0.0)  # under EP the experts have their own group, below
    pbytes = lay.act_bytes if mega else MASTER_BYTES  # gathered parameter dtype
    gbytes = lay.grad_bytes  # reduced gradient dtype: the buffer's (Megatron-LM grad_reduce_in_fp32)
    shard = lay.dp_shard * cp if lay.zero_stage > 0 else 1
    rep = lay.dp_replicate if lay.zero_stage > 0 else lay.dp * cp
    shard_bw = group_bandwidth(cluster, shard, t, eff)
    rep_bw = group_bandwidth(cluster, rep, t * shard, eff)
    if lay.zero_stage == 0:
        reduce = collective(gbytes * fsdp, rep, rep_bw, eff, "ar")
        gather = 0.0
    else:
        gather = collective(pbytes * fsdp, shard, shard_bw, eff)
        reduce = collective(gbytes * fsdp, shard, shard_bw, eff, "rs")
        reduce += collective(gbytes * fsdp / shard, rep, rep_bw, eff, "ar")
    edp = lay.edp if lay.ep > 1 else 1  # experts under EP: their replicas, ranks ep x etp apart
    replica_mb = 0.0
    if edp > 1:
        edp_bw = group_bandwidth(cluster, edp, lay.ep * lay.etp, eff)
        if lay.expert_fsdp:  # their own FSDP over the replicas: gathered, gradients reduce-scattered
            gather += collective(pbytes * expert, edp, edp_bw, eff)
            reduce += collective(gbytes * expert, edp, edp_bw, eff, "rs")
        else:  # ZeRO-0: every replica keeps them whole; this trainer sums each micro-batch's expert gradient
            summed = collective(gbytes * expert, edp, edp_bw, eff, "ar")  # over the replicas (a hook)
            if mega:
                reduce += summed
            else:
                replica_mb = summed
    mode = lay.grad_sync
    if lay.zero_stage == 3 and lay.reshards_after_forward:  # gathered for forward and again for backward
        per_mb = 2 * gather
        if mode == "per_microbatch":
            return 0.0, 0.0, per_mb + reduce
        if mode == "replicate_per_step":
            rs = collective(gbytes * fsdp, shard, shard_bw, eff, "rs")
            return 0.0, reduce - rs, per_mb + rs
        return 0.0, reduce, per_mb
    if mode == "per_microbatch":
        if lay.megatron_engine and lay.zero_stage < 3:  # whole weights: gathered once, after the optimizer
            return gather, 0.0, reduce + replica_mb
        return 0.0, 0.0, gather + reduce + replica_mb
    return gather, reduce, replica_mb


def replica_traffic(
    lay: Layout, cluster: Cluster, dense: float, expert: float, eff: Efficiency
) -> tuple[float, float]:
    """(hooked, explicit) seconds of the cross-group all-reduce of one rank's gradient shards per reduction
    (:mod:`~llmtrain.plan.replicas`): over ``replicas`` members ``group_world`` ranks apart."""
    if lay.replicas <= 1:
        return 0.0, 0.0
    hooked_b, explicit_b = replica_all_reduce_bytes(lay, dense, expert)
    bw = group_bandwidth(cluster, lay.replicas, lay.group_world, eff)
    return (
        collective(hooked_b, lay.replicas, bw, eff, "ar"),
        collective(explicit_b, lay.replicas, bw, eff, "ar"),
    )

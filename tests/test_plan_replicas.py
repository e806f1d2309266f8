"""The planner with replica groups (``fault_tolerance.replicas``): one group's layout, the cross-group all-reduce
of the gradient shards by hand, and the printed groups (plan/replicas.py)."""

from __future__ import annotations

import os

import pytest

from llmtrain.config.loader import load_config
from llmtrain.plan.catalog import load_catalog, parse_cluster
from llmtrain.plan.layout import rank_params, rank_shapes
from llmtrain.plan.replicas import replica_all_reduce_bytes, replica_memory_bytes
from llmtrain.plan.search import evaluate, layout_from_config
from llmtrain.plan.timing import Efficiency

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "configs/seed/100b_32card.yaml")
SMALL = ["model.flavor=8b", "model.seq_length=4096", "train.batch_size=32", "train.micro_batch_size=1",
         "parallel.data_parallel=-1", "parallel.pipeline_parallel=1", "parallel.context_parallel=1",
         "parallel.expert_parallel=1"]  # fmt: skip
FT = ["fault_tolerance.enabled=true", "fault_tolerance.replicas=2"]


def _plan(overrides: list[str], cluster: str):
    cfg, _ = load_config(BASE, SMALL + overrides)
    cl = parse_cluster(cluster, load_catalog())
    lay, margs, tokens = layout_from_config(cfg, cl.num_devices)
    return lay, margs, tokens, evaluate(margs, lay, cl, tokens, bool(cfg.train.compile)), cl


def test_hooked_all_reduce_by_hand():
    """2 groups of 8 H100 (one node each), ZeRO-2 over the group's 8 ranks: every rank all-reduces its fp32
    gradient shard (N / 8 elements) with the same rank of the other group, one node away: 2 (R - 1) / R x 4 N / 8
    bytes over one NIC at 0.8 x 50 GB/s, plus the collective latency; inside FSDP's reduce path (overlapped)."""
    lay, margs, tokens, res, cl = _plan(
        FT + ["parallel.tensor_parallel=1", "parallel.zero_stage=2"], "16xh100@2"
    )
    assert (lay.replicas, lay.group_world, lay.world_size, lay.dp) == (2, 8, 16, 8)
    assert tokens == 32 * 4096 and lay.grad_accum == 32 // 2 // 8  # each group reads batch / R
    assert lay.describe().startswith("2 replica groups x [tp1 pp1 dp8")
    [shape] = rank_shapes(margs, lay)
    dense, expert = rank_params(margs, lay, shape)
    hooked, explicit = replica_all_reduce_bytes(lay, dense, expert)
    assert (hooked, explicit) == (4 * dense / 8, 0.0)
    eff = Efficiency()
    by_hand = 2 * (2 - 1) / 2 * hooked / (50e9 * 0.8) + eff.latency_s
    assert res.time.parts["replica_all_reduce"] == pytest.approx(by_hand, rel=1e-12)
    # the same group planned alone (8 devices, its batch slice): the all-reduce is the only difference in the
    # data-parallel traffic, and it runs once per step in the reduction
    _, _, _, alone, _ = _plan(["train.batch_size=16", "parallel.tensor_parallel=1", "parallel.zero_stage=2"],
                              "8xh100")  # fmt: skip
    assert res.time.dp_total - alone.time.dp_total == pytest.approx(by_hand, rel=1e-9)
    assert res.time.compute == pytest.approx(alone.time.compute, rel=1e-12)
    assert res.tokens_per_s_per_device <= alone.tokens_per_s_per_device
    mem = replica_memory_bytes(lay, dense, expert, state_bytes=12.0 * dense / 8)
    assert mem == {"device": 0.0, "host": 12.0 * dense / 8}  # no explicit buffer: every gradient is hooked


def test_explicit_all_reduce_is_exposed():
    """One rank per group's data parallel (TP 8 in a node): no FSDP, so the groups' sum runs after the backward
    in one flat fp32 all-reduce of the rank's TP shard (ft/grads.sum_grads), all of it exposed."""
    lay, margs, _, res, _ = _plan(FT + ["parallel.tensor_parallel=8", "parallel.zero_stage=0"], "16xh100@2")
    assert (lay.dp, lay.tp, lay.replicas) == (1, 8, 2)
    [shape] = rank_shapes(margs, lay)
    dense, expert = rank_params(margs, lay, shape)
    hooked, explicit = replica_all_reduce_bytes(lay, dense, expert)
    assert (hooked, explicit) == (0.0, 4 * dense)
    by_hand = explicit / (50e9 * 0.8) + Efficiency().latency_s
    assert res.time.dp_exposed == pytest.approx(by_hand, rel=1e-12)  # no other data-parallel traffic
    assert replica_memory_bytes(lay, dense, expert, 0.0)["device"] == 4 * dense


def test_keep_over_three_groups_sums_after_the_backward():
    """``keep`` over 3 groups: survivors may cover different numbers of a missing group's slots, so FSDP's hook
    (one collective per reduction) is not used; the same ZeRO-2 layout as the hooked case sums every gradient
    shard after the backward (ft.layout.fsdp_hook_sums, the trainer's rule too). ``shrink`` keeps the hook."""
    from llmtrain.ft.layout import fsdp_hook_sums

    assert [fsdp_hook_sums(False, "keep", r) for r in (2, 3, 4)] == [True, False, False]
    assert fsdp_hook_sums(False, "shrink", 3) and not fsdp_hook_sums(True, "shrink", 2)
    three = FT[:1] + ["fault_tolerance.replicas=3", "train.batch_size=48", "parallel.tensor_parallel=1",
                      "parallel.zero_stage=2"]  # fmt: skip
    for policy, split in (("keep", (0.0, 1.0)), ("shrink", (1.0, 0.0))):
        lay, margs, _, _, _ = _plan([*three, f"fault_tolerance.batch_policy={policy}"], "24xh100@3")
        assert (lay.replicas, lay.dp, lay.replica_policy) == (3, 8, policy)
        [shape] = rank_shapes(margs, lay)
        dense, expert = rank_params(margs, lay, shape)
        hooked, explicit = replica_all_reduce_bytes(lay, dense, expert)
        assert (hooked, explicit) == (split[0] * 4 * dense / 8, split[1] * 4 * dense / 8)


def test_plan_prints_the_groups(capsys):
    from llmtrain.cli import main as cli_main

    args = ["plan", BASE, *SMALL, *FT, "parallel.tensor_parallel=1", "parallel.zero_stage=2", "--cluster",
            "16xh100@2"]  # fmt: skip
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "replica groups: 2 x 8 ranks (ranks 8 x r .. 8 x r + 7 form group r" in text
    assert "layout: 2 replica groups x [tp1 pp1 dp8" in text

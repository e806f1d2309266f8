"""The planner on composed layouts: expert layouts costed by training's own expert-TP rule, and ``--search`` over
EP and CP x PP whose best plan ``llmtrain check`` accepts (issue 28).

Hand-computed bytes for one MoE block of a tiny model (h 64, 4 heads of 16, 2 KV heads, 8 experts of width 32,
top-2, vocabulary 512, one layer) on 8 ranks, tp 2:

* EP 4 over DP 2 x TP 2: 4 does not divide dp 2, so ``moe_rules.expert_tp`` gives etp 1 (whole experts, EP
  drawn from the TP ranks too), edp = 2 x 2 / 4 = 1;
* expert-TP: dp 4, EP 4: etp = tp = 2, edp = 4 x 2 / (4 x 2) = 1;
* replicas: dp 4, EP 2: etp 2, edp = 4 x 2 / (2 x 2) = 2, the experts FSDP-sharded over the two replicas.
"""

from __future__ import annotations

import json

import pytest

from llmtrain.cli import main as cli_main
from llmtrain.models import TransformerArgs
from llmtrain.moe_rules import expert_tp
from llmtrain.plan import Layout, estimate_memory, load_catalog, parse_cluster
from llmtrain.plan.comm import all_to_all
from llmtrain.plan.gemm import block_gemm_time
from llmtrain.plan.layout import rank_params, rank_shapes
from llmtrain.plan.timing import Efficiency, estimate_step_time

SEED_100B = "configs/seed/100b_32card.yaml"
H, E, K, HM, V, SEQ = 64, 8, 2, 32, 512, 64
ROUTED = E * 3 * H * HM  # 49,152 routed-expert parameters in the block
# dense parameters on one TP rank of 2: attention (wq 64x64, wk/wv 64x32, wo 64x64) / 2 + 2 norms + router,
# the embedding 512 x 64 / 2, the final norm + output projection 64 + 512 x 64 / 2
DENSE_TP2 = 12288 // 2 + 2 * H + H * E + V * H // 2 + H + V * H // 2  # 39,616

ARGS = TransformerArgs(hidden_size=H, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=256, vocab_size=V, seq_length=SEQ, num_experts=E, top_k=K,
                       moe_hidden_size=HM)  # fmt: skip

# name: (dp, ep, etp, edp, routed-expert parameters per device, ZeRO shard degree of the experts at zero 2)
CASES = {
    "ep_over_dp_x_tp": (2, 4, 1, 1, ROUTED // 4, 1),
    "expert_tp": (4, 4, 2, 1, ROUTED // 8, 1),
    "replicas": (4, 2, 2, 2, ROUTED // 4, 2),
}


def _layout(dp: int, ep: int, zero: int = 2) -> Layout:
    return Layout(tp=2, ep=ep, dp_shard=dp, zero_stage=zero, seq_length=SEQ, micro_batch_size=1)


@pytest.mark.parametrize("name", list(CASES))
def test_expert_bytes_by_hand(name):
    dp, ep, etp, edp, expert, de = CASES[name]
    lay = _layout(dp, ep)
    assert (lay.etp, lay.edp) == (etp, edp)
    assert lay.etp == expert_tp(lay)  # training's rule, the one place
    assert lay.edp * lay.ep * lay.etp == dp * lay.tp  # the expert mesh covers the stage's dp x cp x tp ranks
    (shape,) = rank_shapes(ARGS, lay)
    assert rank_params(ARGS, lay, shape) == (DENSE_TP2, expert)
    mem = estimate_memory(ARGS, lay)
    assert mem.details["expert_parameters_per_device"] == expert / de
    # AdamW's two fp32 moments of the rank's shard: the blocks over dp, the experts over their replicas
    assert mem.optimizer_states == 8 * (DENSE_TP2 / dp + expert / de)
    assert mem.parameters == 4 * (DENSE_TP2 / dp + expert / de)
    # the all-to-all buffers (fp32 rows, send + receive): each TP rank dispatches its own T / 2 tokens with
    # whole experts, all T tokens with expert-TP (every TP rank routes the same gathered tokens)
    rows = SEQ * K * H * (1 / 2 if etp == 1 else 1)
    assert mem.details["moe_dispatch_buffers"] == 2 * rows * 4


@pytest.mark.parametrize("name", list(CASES))
def test_expert_gradients_by_hand(name):
    """This trainer at ZeRO-2 without accumulation: fp32 gradients sharded as the states are (the blocks over dp,
    the experts over their replicas), plus one block's unsharded gradient before its reduce-scatter."""
    dp, ep, etp, edp, expert, de = CASES[name]
    mem = estimate_memory(ARGS, _layout(dp, ep))
    assert mem.gradients == 4 * (DENSE_TP2 / dp + expert / de)
    block = (12288 + 0) / 2 + 2 * H + H * E + expert  # the MoE block's dense part on a TP rank + its experts
    assert mem.details["unsharded_gradients"] == 4 * block


@pytest.mark.parametrize("name", ["ep_over_dp_x_tp", "expert_tp"])
def test_expert_bytes_by_hand_megatron(name):
    """The published MoE recipes' engine (Megatron-Core, distributed optimizer) on the same layouts: bf16 weights
    and gradient buffer of every local parameter (experts whole on their EP x ETP rank), the fp32 master and
    Adam's moments sharded (experts over their edp = 1 replicas: whole); each TP rank dispatches its own T / 2
    sequence-parallel rows (all-to-all before the expert-TP all-gather), bf16 send + receive buffers; one MoE
    block's saved bytes per token counted term by term."""
    dp, ep, etp, edp, expert, de = CASES[name]
    lay = Layout(
        tp=2, ep=ep, dp_shard=dp, zero_stage=1, seq_length=SEQ, micro_batch_size=1, engine="megatron"
    )
    assert (lay.etp, lay.edp, lay.expert_shard_degree) == (etp, edp, de)
    mem = estimate_memory(ARGS, lay)
    whole, sharded = DENSE_TP2 + expert, DENSE_TP2 / dp + expert / de
    assert mem.parameters == 2 * whole + 4 * sharded
    assert mem.gradients == 2 * whole
    assert mem.optimizer_states == 8 * sharded
    rows = SEQ / 2 * K * H  # T / tp tokens x top-k copies x h, both layouts
    assert mem.details["moe_dispatch_buffers"] == 2 * rows * 2
    # norms 2 x (input + output bf16 + rstd), q k v o + logsumexp, router (fp32 scores, index/weight bytes),
    # per routed row the dispatched copy (a h), the experts' hidden states (3 a H) and the fp32 routing weight
    # the activation is scaled by (Megatron-Core >= 0.13 keeps no expert output for the combine), over tp = 2
    per_token = (2 * (2 * 2 * H + 4) + 2 * ((4 + 2 * 2) * 16 + 64) + 4 * 4 + 4 * E + 12 * K
                 + K * (2 * H + 3 * 2 * HM + 4)) / 2  # fmt: skip
    assert per_token == 812
    assert mem.details["activations_per_moe_layer"] == SEQ * per_token


def test_expert_zero0_keeps_replicas_whole():
    lay = _layout(4, 2, zero=0)
    assert lay.edp == 2 and not lay.expert_fsdp and lay.expert_shard_degree == 1
    mem = estimate_memory(ARGS, lay)
    assert mem.optimizer_states == 8 * (DENSE_TP2 + ROUTED // 4)


def test_expert_gemm_flops_by_hand():
    """Every layout does the same expert work per rank: T k tokens through three GEMMs of h x H over tp."""
    # attention / 2, the router, the experts / 2
    per_token = 64 * 32 + 2 * 64 * 16 + 32 * 64 + H * E + K * 3 * H * HM // 2
    dev = parse_cluster("8xh100", load_catalog()).device
    for dp, ep, *_ in CASES.values():
        _, flops = block_gemm_time(ARGS, _layout(dp, ep), dev, SEQ, True, Efficiency().gemm)
        assert flops == pytest.approx(6 * SEQ * per_token, rel=1e-12)


def test_all_to_all_over_the_ep_group_by_hand():
    cluster = parse_cluster("8xh100", load_catalog())
    dev, eff = cluster.device, Efficiency()
    bw = dev.intra_node_bw_gbs * 1e9 * eff.link_efficiency
    for dp, ep, etp, *_ in CASES.values():
        lay = _layout(dp, ep)
        rows = SEQ * K * H * (1 / 2 if etp == 1 else 1)
        # fp32 dispatch + bf16 combine, (ep - 1) / ep of it leaving the rank, all peers in the node
        one = (ep - 1) / ep * (rows * 4 + rows * 2) / bw + 2 * eff.latency_s
        both = all_to_all(rows * 4, ep, etp, cluster, eff) + all_to_all(rows * 2, ep, etp, cluster, eff)
        assert both == pytest.approx(one, rel=1e-12)
        st = estimate_step_time(ARGS, lay, cluster, fused=False)
        assert st.ep_comm == pytest.approx(2 * one, rel=1e-12)  # forward and backward, one micro-batch


def _search_then_check(capsys, overrides: list[str], cluster: str, world: int) -> dict:
    assert cli_main(["plan", SEED_100B, *overrides, "--cluster", cluster, "--search", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["search"]["top"][0]
    assert best["memory_per_device_bytes"]["total"] < best["memory_capacity_bytes"]
    assert cli_main(["check", SEED_100B, *overrides, *best["overrides"], "--world-size", str(world)]) == 0
    capsys.readouterr()
    return best


DEEPSEEK_V3 = ["model.model_type=deepseek_v3", "model.flavor=671b", "model.seq_length=4096",
               "parallel.tensor_parallel=1", "parallel.pipeline_parallel=16", "parallel.expert_parallel=64",
               "parallel.data_parallel=-1", "train.batch_size=15360", "parallel.schedule=zbv",
               "parallel.virtual_stages=2"]  # fmt: skip
LLAMA3_405B = ["model.flavor=405b", "model.seq_length=8192", "parallel.tensor_parallel=8",
               "parallel.pipeline_parallel=16", "parallel.data_parallel=-1", "train.batch_size=2048"]  # fmt: skip


def test_deepseek_v3_on_2048_h800_best_plan_trains(capsys):
    best = _search_then_check(capsys, DEEPSEEK_V3, "2048xH800", 2048)
    assert "ep" in best["layout"]  # an expert-parallel layout wins for the MoE model
    assert best["memory_per_device_bytes"]["total"] < 80e9  # under the H800's 80 GB


def test_llama3_405b_on_16k_h100_best_plan_trains(capsys):
    best = _search_then_check(capsys, LLAMA3_405B, "16384xH100", 16384)
    assert best["memory_per_device_bytes"]["total"] < 80e9


def test_mindformers_deepseek3_fixture_plans(capsys):
    assert cli_main(["plan", "tests/fixtures/mindformers/deepseek3_671b.yaml", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "tp4" in out["layout"] and "ep8" in out["layout"]
    assert out["step_time_s"] > 0 and out["memory_per_device_bytes"]["total"] > 0


def test_search_enumerates_expert_parallel():
    """Every divisor of the expert count that divides dp x cp x tp is a candidate EP, each validated by training's
    rules (8 experts on 8 devices: 1, 2, 4, 8; EP 4 with tp 2 x dp 2 is whole experts, expert-TP 1)."""
    from llmtrain.config.loader import load_config
    from llmtrain.plan.search import candidate_layouts, layout_from_config

    cfg = load_config(SEED_100B, ["train.compile=false", "model.flavor=debug", "model.moe.num_experts=8",
                                  "model.moe.top_k=2", "model.seq_length=256", "train.batch_size=16",
                                  "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1"])[0]  # fmt: skip
    cl = parse_cluster("8xh100", load_catalog())
    base, args, tokens = layout_from_config(cfg, cl.num_devices)
    cands = candidate_layouts(args, base, cl, tokens // base.seq_length)
    assert {c.ep for c in cands} == {1, 2, 4, 8}
    assert any(c.ep == 4 and c.tp == 2 and c.dp == 2 and c.etp == 1 for c in cands)
    assert any(c.ep > 1 and c.cp > 1 for c in cands)

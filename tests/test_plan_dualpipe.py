"""The planner's DualPipe pieces (issue 30: DeepSeek-V3 as its technical report ran it): the dualpipev schedule's
activations against torch's own DualPipeV order, the expert all-to-all overlap (``--ep-overlap``) and the FP8
activation caching of the Megatron-style engines, each by hand; and the flags' refusals.

The run itself (2,048 H800, within the MoE bound) is tests/test_plan_published.py's ``deepseek-v3``; the
trainer's own peak under ``dualpipev`` is tests/test_plan_measured.py's ``pp2_dualpipev``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmtrain.config.schema import ModelConfig
from llmtrain.errors import ConfigError
from llmtrain.models import resolve_model_args
from llmtrain.plan import Layout, estimate_memory, load_catalog, parse_cluster
from llmtrain.plan.activations import in_flight, layer_activation_bytes
from llmtrain.plan.calibration import Efficiency
from llmtrain.plan.timing import estimate_step_time


def _torch_peak(pp: int, m: int, rank: int) -> int:
    """Chunk micro-batches rank ``rank`` holds at once in torch's DualPipeV order: from its forward to its full
    backward, or to its weight step when the backward is split (the input step keeps the graph)."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV
    from torch.distributed.pipelining.schedules import _ComputationType as C

    sched = object.__new__(ScheduleDualPipeV)  # the order only: the generator reads these two numbers
    sched.pp_group_size, sched._n_microbatches = pp, m
    live: set[tuple[int, int]] = set()
    peak = 0
    for action in sched._calculate_single_rank_operations(rank):
        if action is None:
            continue
        subs = action.sub_actions if action.computation_type == C.OVERLAP_F_B else (action,)
        for a in subs:
            key = (a.stage_index, a.microbatch_index)
            if a.computation_type == C.FORWARD:
                live.add(key)
                peak = max(peak, len(live))
            elif a.computation_type in (C.FULL_BACKWARD, C.BACKWARD_WEIGHT):
                live.discard(key)
    return peak


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 32), (16, 120)])
def test_dualpipev_in_flight_is_torchs_order(pp, m):
    """DeepSeek's table gives DualPipeV "PP + 1" activations over its PP = 2 x ranks stages; torch's order holds
    2 pp + 1 chunks on every rank (zbv: 2 pp), which the planner counts as pp + 1/2 whole-rank micro-batches."""
    lay = Layout(pp=pp, grad_accum=m, schedule="dualpipev", virtual_stages=2)
    for rank in range(pp):
        assert _torch_peak(pp, m, rank) == 2 * pp + 1
        assert in_flight(lay, rank) == pytest.approx((2 * pp + 1) / 2)
    assert in_flight(replace(lay, schedule="zbv"), 0) == pp


MOE = resolve_model_args(ModelConfig(model_type="qwen3", flavor="30b_a3b", seq_length=4096))
CLUSTER = parse_cluster("64xh100", load_catalog())
BASE = Layout(pp=4, ep=8, dp_shard=16, zero_stage=1, grad_accum=32, seq_length=4096, engine="megatron",
              schedule="dualpipev", virtual_stages=2)  # fmt: skip


def test_ep_overlap_hides_the_all_to_all_behind_compute_on_the_sms_it_leaves():
    """Per micro-batch on the slowest rank: the compute runs on 112 of 132 SMs (x 132 / 112) and the all-to-all
    is exposed only where it outlasts it."""
    eff = Efficiency()
    plain = estimate_step_time(MOE, BASE, CLUSTER, True)
    over = estimate_step_time(MOE, replace(BASE, ep_overlap=True), CLUSTER, True)
    assert eff.ep_overlap_sms == pytest.approx(20 / 132)
    assert plain.ep_comm > 0
    assert over.compute == pytest.approx(plain.compute * 132 / 112)
    assert over.ep_comm == pytest.approx(max(0.0, plain.ep_comm - over.compute))
    assert over.total < plain.total
    slow_eff = replace(
        eff, link_efficiency=eff.link_efficiency / 20
    )  # links 20x slower: the all-to-all outlasts
    slow = estimate_step_time(MOE, replace(BASE, ep_overlap=True), CLUSTER, True, slow_eff)
    plain_slow = estimate_step_time(MOE, BASE, CLUSTER, True, slow_eff)
    assert slow.ep_comm == pytest.approx(plain_slow.ep_comm - slow.compute) and slow.ep_comm > 0


def test_fp8_caching_and_module_recompute_by_hand():
    """A MoE block's bytes per token in the megatron engine: each linear input as its FP8 copy under train.fp8,
    the SwiGLU input too with act_fp8_input_store; layernorm drops the norm outputs, moe_act the experts'
    activation output."""
    h, k, hm, e, s = MOE.hidden_size, MOE.top_k, MOE.moe_hidden_size, MOE.num_experts, MOE.shared_experts
    qkv = (MOE.num_heads + 2 * MOE.num_kv_heads) * MOE.head_dim
    o = MOE.num_heads * MOE.head_dim  # (Qwen3's q / k norms: no term of their own in the megatron engine)

    def by_hand(lin: int, act_in: int, norm_out: bool, act_out: bool) -> float:
        norms = 2 * (2 * h + (lin * h if norm_out else 0) + 4)
        attention = 2 * qkv + lin * o + 4 * MOE.num_heads
        rows = k * (lin * h + (2 * act_in + (lin if act_out else 0)) * hm + 4)
        return norms + attention + 4 * e + 12 * k + rows + (2 * act_in + lin) * s * hm

    lay = replace(BASE, pp=1, schedule="1f1b", virtual_stages=1)
    assert layer_activation_bytes(MOE, lay, True) == by_hand(2, 2, True, True)
    fp8 = replace(lay, fp8="tensorwise")
    assert layer_activation_bytes(MOE, fp8, True) == by_hand(1, 2, True, True)
    store = replace(fp8, act_fp8_input_store=True, recompute_modules=("layernorm", "moe_act"))
    assert layer_activation_bytes(MOE, store, True) == by_hand(1, 1, False, False)
    assert estimate_memory(MOE, store).activations < estimate_memory(MOE, fp8).activations


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"ep_overlap": True, "engine": "llmtrain"}, "--ep-overlap hides"),
        ({"ep_overlap": True, "ep": 1}, "expert_parallel > 1 (got 1)"),
        ({"ep_overlap": True, "schedule": "gpipe", "virtual_stages": 1}, "schedule gpipe"),
        ({"act_fp8_input_store": True}, "train.fp8 (got none)"),
        ({"act_fp8_input_store": True, "fp8": "tensorwise", "engine": "torchtitan"}, "(got torchtitan)"),
    ],
)
def test_flags_refused_where_they_mean_nothing(change, needle):
    with pytest.raises(ConfigError) as e:
        replace(BASE, **change)
    assert needle in str(e.value)

"""The planner against the trainer's own peak on CPU, layout by layout (issue 30): every parallel axis and the
compositions the parity tests run (tests/test_parallel.py, test_pipeline.py, test_context_parallel.py,
test_compose.py, test_compose_moe.py, test_deepseek.py), each trained by the real trainer under torchrun
(gloo) and measured with torch's MemTracker over one step after two (``tests/distributed/worker.py``
``memory_peak``: the peak bytes of live tensors on each rank: parameters, gradients, optimizer states,
activations, temporaries; the smaller of two steps' peaks, so that one step's late asynchronous free on one
rank does not count as the layout's: seen once at +20% on DP 2 x TP 2; for MoE the smaller is also the
better-balanced routing, the other step up to 9% higher). The planner's figure (``estimate_memory(...).total``,
its worst rank) is compared with the largest rank's peak: within 10% for every layout.

Model sizes are the debug flavors at 256 tokens, micro-batch 2, 4 micro-batches per step in all (so that
attention, the logits and the optimizer states all weigh in); fp32 as the parity tests run, one bf16 run.
The zero-bubble schedules (``zero_bubble``, ``zbv``, ``dualpipev``) are measured without MemTracker's module tracking (its
hooks turn their input-only ``autograd.grad`` into an error), which counts only tensors made under the tracker:
a lower bound. ``KNOWN_MISSES`` lists a layout still beyond 10%, asserted to stay beyond it, with its reason (the
interleaved zero-bubble schedule was 31% under until plan/zero_bubble.py played torch's order). The one-process and two-rank checks by hand (ZeRO-3, ZeRO-2, TP 2,
each recompute mode) are ``tests/test_plan.py``'s.
"""

from __future__ import annotations

import sys

import pytest

from llmtrain.config import config_from_dict
from llmtrain.plan import estimate_memory
from llmtrain.plan.search import layout_from_config
from test_parallel import WORKER, base, launch

sys.path.insert(0, str(WORKER.parent))
from worker import merge  # noqa: E402  (the worker's own rule: the config each variant trains)

BOUND = 0.10
QWEN_MOE = {"model_type": "qwen3", "flavor": "debug_moe"}
DEEPSEEK = {"model_type": "deepseek_v3", "flavor": "debug"}
PP = {"pipeline_parallel": 2, "schedule": "1f1b"}
V4K = {"vocab_size": 4096}  # logits-heavy: the head's logits outweigh the rest of the debug model
CHUNK = {"loss_chunk_tokens": 128}
LAYOUTS: dict[int, dict[str, dict]] = {  # world -> name -> sections over the base config
    2: {
        "zero3_dp2": {"parallel": {"zero_stage": 3}},
        "zero1_dp2": {"parallel": {"zero_stage": 1}},
        "tp2": {"parallel": {"tensor_parallel": 2}},
        "pp2_1f1b": {"parallel": PP},
        "pp2_gpipe": {"parallel": {**PP, "schedule": "gpipe"}},
        "pp2_dualpipev": {"model": {"num_layers": 4},
                          "parallel": {**PP, "schedule": "dualpipev", "virtual_stages": 2}},
        "cp2": {"parallel": {"context_parallel": 2}},
        "zero3_dp2_selective": {"parallel": {"zero_stage": 3}, "recompute": {"mode": "selective"}},
        # issue 41: logits-heavy (vocab 4096): loss parallel, the gathered head it replaced, the chunked loss
        # under TP and on the last pipeline stage
        "tp2_v4k": {"model": V4K, "parallel": {"tensor_parallel": 2}},
        "tp2_v4k_gathered": {"model": V4K, "parallel": {"tensor_parallel": 2, "loss_parallel": False}},
        "tp2_v4k_chunked": {"model": V4K, "parallel": {"tensor_parallel": 2}, "train": CHUNK},
        "pp2_v4k_chunked": {"model": V4K, "parallel": PP, "train": CHUNK},
    },
    4: {
        "dp2_tp2": {"parallel": {"zero_stage": 3, "tensor_parallel": 2}},
        "dp2_tp2_bf16": {"parallel": {"zero_stage": 3, "tensor_parallel": 2}, "train": {"precision": "bf16"}},
        "dp2_tp2_full": {"parallel": {"zero_stage": 3, "tensor_parallel": 2}, "recompute": {"mode": "full"}},
        "hsdp_2x2": {"parallel": {"zero_stage": 3, "data_parallel_replicate": 2}},
        "tp2_pp2": {"parallel": {**PP, "tensor_parallel": 2}},
        "dp2_pp2": {"parallel": {**PP, "zero_stage": 3}},
        "pp2_interleaved": {"model": {"num_layers": 4},
                            "parallel": {**PP, "schedule": "interleaved_1f1b", "virtual_stages": 2, "zero_stage": 3}},
        "pp2_zero_bubble": {"model": {"num_layers": 4},
                            "parallel": {**PP, "schedule": "zero_bubble", "virtual_stages": 2, "zero_stage": 3}},
        "pp2_zbv": {"model": {"num_layers": 4},
                    "parallel": {**PP, "schedule": "zbv", "virtual_stages": 2, "zero_stage": 3}},
        "cp2_tp2": {"parallel": {"context_parallel": 2, "tensor_parallel": 2}},
        "cp2_pp2": {"parallel": {**PP, "context_parallel": 2}},
        "qwen3_dp2_tp2": {"model": {"model_type": "qwen3"}, "parallel": {"zero_stage": 3, "tensor_parallel": 2}},
        "moe_ep2_dp4": {"model": QWEN_MOE, "parallel": {"zero_stage": 3, "expert_parallel": 2}},
        "moe_ep4_tp2": {"model": QWEN_MOE, "parallel": {"zero_stage": 3, "tensor_parallel": 2, "expert_parallel": 4}},
        "moe_ep2_pp2": {"model": {**QWEN_MOE, "num_layers": 4}, "parallel": {**PP, "expert_parallel": 2}},
        "dp2_tp2_v4k_bf16": {"model": V4K, "parallel": {"zero_stage": 3, "tensor_parallel": 2},
                             "train": {"precision": "bf16"}},
        "tp2_pp2_v4k_chunked": {"model": V4K, "parallel": {**PP, "tensor_parallel": 2}, "train": CHUNK},
        "deepseek_dp4": {"model": DEEPSEEK, "parallel": {"zero_stage": 3}},
        "deepseek_ep2_tp2": {"model": DEEPSEEK,
                             "parallel": {"zero_stage": 3, "tensor_parallel": 2, "expert_parallel": 2}},
    },
}  # fmt: skip


NO_MODULE_HOOKS = {"pp2_zero_bubble", "pp2_zbv", "pp2_dualpipev"}
KNOWN_MISSES: dict[str, tuple[float, str]] = {  # name -> (bound on |planned / measured - 1|, why)
    "deepseek_ep2_tp2": (
        0.13,
        "the same ~0.77 MB over-count as before loss parallel (9.41 planned vs 8.62 MB "
        "measured with parallel.loss_parallel false, +9.2%), now of a total 2.1 MB smaller "
        "(+11.7%): the one-layer all-to-all buffers are counted at the loss's peak, where "
        "they are freed; counting them only where a MoE layer runs lowers Qwen3-MoE "
        "EP4 x TP2 to -12.7%, whose ranks' peaks differ by 16% with the routing",
    ),
}


def _base(prefix: str) -> dict:
    cfg = base(prefix, "llama3")
    cfg["model"]["seq_length"] = 256
    cfg["train"].update(batch_size=8, micro_batch_size=2)
    return cfg


@pytest.fixture(scope="module")
def measured(tiny_corpus, tmp_path_factory) -> dict[int, dict]:
    out = {}
    for world, layouts in LAYOUTS.items():
        spec = {"base": _base(tiny_corpus), "steps": 2,
                "variants": {n: {**v, "memory_peak": "no_module_hooks" if n in NO_MODULE_HOOKS else True}
                             for n, v in layouts.items()}}  # fmt: skip
        out[world] = launch(world, spec, tmp_path_factory.mktemp(f"mem{world}"))
    return out


@pytest.mark.parametrize("world,name", [(w, n) for w, layouts in LAYOUTS.items() for n in layouts])
def test_planned_memory_is_the_trainers_peak(measured, tiny_corpus, world, name, capsys):
    over = LAYOUTS[world][name]
    cfg = config_from_dict(merge(_base(tiny_corpus), over))
    lay, args, _ = layout_from_config(cfg, world, cfg.recompute.mode)
    planned = estimate_memory(args, lay).total
    peaks = [r["Total"] for r in measured[world][name]["memory_peak"]]
    err = planned / max(peaks) - 1
    with capsys.disabled():
        print(f"\n  {name:<20} world {world}: measured {max(peaks):>10,} B (ranks {min(peaks):,}..{max(peaks):,}), "
              f"planned {planned:>12,.0f} B  {err:+.1%}")  # fmt: skip
    bound = KNOWN_MISSES.get(name, (BOUND, ""))[0]
    assert abs(err) <= bound, f"{name}: planned {planned:.0f} B, measured peaks {peaks}"
    if name in KNOWN_MISSES:
        assert abs(err) > BOUND, f"{name} is now within {BOUND:.0%}: remove it from KNOWN_MISSES"


def test_zero_bubble_order_is_torchs():
    """plan/zero_bubble.py plays torch's own interleaved zero-bubble order; for 2 ranks x 2 chunks and 2
    micro-batches (the measured layout above) rank 0 runs each weight step right after its input step, while the
    head rank (stage 3) delays its first W past the second micro-batch's I: two head micro-batches held."""
    from llmtrain.plan.zero_bubble import order

    plan = order(2, 2, 2)
    assert plan is not None
    assert (
        " ".join(f"{k}{s}.{m}" for k, s, m in plan[0])
        == "F0.0 F0.1 F2.0 F2.1 I2.0 W2.0 I2.1 W2.1 I0.0 W0.0 I0.1 W0.1"
    )
    assert (
        " ".join(f"{k}{s}.{m}" for k, s, m in plan[1])
        == "F1.0 F1.1 F3.0 I3.0 F3.1 I3.1 W3.0 I1.0 W3.1 I1.1 W1.0 W1.1"
    )

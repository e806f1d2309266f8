"""Tensor parallel for MoE models and multi-head latent attention (models/common/moe_tp.py, models/deepseek/tp.py).

TP2 under two gloo processes computes what one process computes, for every MoE family: qwen3 debug_moe
(ungated shared expert, aux loss and aux-loss-free bias, capacity 1.25 so tokens are dropped; also with full
recompute, where the f / g hooks re-run in backward), mixtral debug (no shared expert, sliding window), qwen2
debug_moe (two shared experts behind Qwen2-MoE's shared_expert_gate), deepseek_v3 debug (MLA with query
compression, a dense block then a DeepSeekMoE block: group-limited sigmoid routing, shared expert, bias): 3 steps,
fp32, clipping active, losses within 1e-5, grad norms within 1e-3 (relative), the logged aux loss within 1e-5
(relative) and the load figure (max / mean tokens per expert) equal to the single process's, so neither is
multiplied by the TP degree. One launch runs these five (the worker merges each variant's model section), a
second one ZeRO-3 DP2 x TP2 on 4 ranks for deepseek_v3. The plan puts every parameter where the design says
(routed experts ``Shard(1)`` / ``Shard(2)``, router and latent projections replicated, MLA heads and shared
experts column/row-parallel; checked in-process on a 1-rank gloo group).
``llmtrain check`` passes MoE with tensor_parallel 2 (and with expert_parallel too: tests/test_compose_moe.py)
and names the refusal that is left: an expert width TP does not divide (``tp_moe_ffn``).
"""

from __future__ import annotations

import copy

import pytest
import yaml

from llmtrain.cli import main as cli_main
from llmtrain.config import config_from_dict
from llmtrain.train.trainer import Trainer
from test_parallel import base as parallel_base  # tests/ is on sys.path under pytest
from test_parallel import close, launch

STEPS = 3
NO_DROPS = {
    "capacity_factor": None
}  # explicit: the worker merges each variant's model over the launch's base
GROUPS: dict[str, dict] = {  # group -> model section over test_parallel's base
    "qwen3_moe": {"model_type": "qwen3", "flavor": "debug_moe", "moe": {"capacity_factor": 1.25}},
    "mixtral": {"model_type": "mixtral", "flavor": "debug", "moe": NO_DROPS},
    "qwen2_moe": {"model_type": "qwen2", "flavor": "debug_moe", "moe": NO_DROPS},
    "deepseek_v3": {"model_type": "deepseek_v3", "flavor": "debug", "moe": NO_DROPS},
}
VARIANTS = {  # world -> {group:layout: parallel overrides}
    2: {
        **{f"{g}:tp2": {"parallel": {"tensor_parallel": 2}} for g in GROUPS},
        "qwen3_moe:tp2_recompute": {"parallel": {"tensor_parallel": 2}, "recompute": {"mode": "full"}},
    },
    4: {"deepseek_v3:dp2_tp2_zero3": {"parallel": {"tensor_parallel": 2, "zero_stage": 3}}},
}


def group_config(prefix: str, group: str) -> dict:
    cfg = parallel_base(prefix, GROUPS[group]["model_type"])
    cfg["model"].update(copy.deepcopy(GROUPS[group]))
    return cfg


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory) -> dict[str, dict[str, list[float]]]:
    out = {}
    for group in GROUPS:
        cfg = group_config(tiny_corpus, group)
        cfg["run"]["output_dir"] = str(tmp_path_factory.mktemp(f"ref-{group}"))
        t = Trainer(config_from_dict(cfg))
        steps = [t.train_step() for _ in range(STEPS)]
        t.metrics.close()
        out[group] = {
            k: [s[k] for s in steps] for k in ("loss", "grad_norm", "moe_aux_loss", "moe_load_max_over_mean")
        }
        assert all(g > 0.05 for g in out[group]["grad_norm"])  # clipping (0.05) really acts
        assert all(a > 0.5 for a in out[group]["moe_aux_loss"])  # the aux loss is on and its gradient flows
    return out


@pytest.mark.slow  # one gloo launch each: ~20 s (2 ranks), ~20 s (4 ranks) on an idle 2-core machine
@pytest.mark.parametrize("world", [2, 4])
def test_moe_and_mla_tensor_parallel_match_single_process(world, tiny_corpus, reference, tmp_path):
    variants = {n: {**v, "model": copy.deepcopy(GROUPS[n.split(":")[0]])} for n, v in VARIANTS[world].items()}
    spec = {"base": group_config(tiny_corpus, "qwen3_moe"), "steps": STEPS, "variants": variants}
    results = launch(world, spec, tmp_path)
    assert set(results) == set(variants)
    for name, r in results.items():
        ref = reference[name.split(":")[0]]
        close(name, r, ref)
        for a, b in zip(r["moe_aux_loss"], ref["moe_aux_loss"], strict=True):  # not multiplied by tp
            assert abs(a - b) <= 1e-5 * b, (name, r["moe_aux_loss"], ref["moe_aux_loss"])
        assert r["moe_load_max_over_mean"] == ref["moe_load_max_over_mean"], name  # the same routing


def test_check_accepts_moe_with_tensor_parallel(tiny_corpus, tmp_path, capsys):
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(group_config(tiny_corpus, "qwen3_moe")), encoding="utf-8")

    def check(world: int, *overrides: str) -> tuple[int, str]:
        rc = cli_main(["check", str(path), *overrides, "--world-size", str(world)])
        out = capsys.readouterr()
        assert "Traceback" not in out.err
        return rc, out.err

    rc, err = check(2, "parallel.tensor_parallel=2")
    assert rc == 0 and err == ""
    rc, err = check(4, "parallel.tensor_parallel=2", "parallel.zero_stage=3")
    assert rc == 0 and err == ""
    rc, err = check(4, "parallel.tensor_parallel=2", "parallel.expert_parallel=2", "parallel.zero_stage=3")
    assert rc == 0 and err == ""  # EP x TP: tests/test_compose_moe.py
    rc, err = check(2, "parallel.tensor_parallel=2", "model.moe.moe_hidden_size=63")
    assert rc == 2 and "model.moe.moe_hidden_size 63 is not divisible by parallel.tensor_parallel 2" in err
    assert "(1, 3, 7, 9, 21, 63)" in err


def test_plan_places_every_parameter(tmp_path):
    """deepseek_v3 debug (block 0 dense, block 1 MoE) and qwen2 debug_moe (shared expert gate) after ``apply_tp``
    on a 1-rank TP mesh: each parameter's placement is the design's, and every parameter is a DTensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from llmtrain.distributed.parallelize import apply_tp
    from llmtrain.models import build_model, get_family

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        placements = {}
        for family, flavor in (("deepseek_v3", "debug"), ("qwen2", "debug_moe")):
            model = build_model(get_family(family).flavor_args(flavor))  # meta device
            apply_tp(model, mesh)
            for name, p in model.named_parameters():
                assert isinstance(p, DTensor), (family, name)
                placements[f"{family}:{name}"] = p.placements
        rep, col, row = (Replicate(),), (Shard(0),), (Shard(1),)
        want = {
            "deepseek_v3:layers.0.feed_forward.w1.weight": col,  # the dense block: the dense plan
            "deepseek_v3:layers.0.feed_forward.w2.weight": row,
            "deepseek_v3:layers.1.feed_forward.router.gate.weight": rep,
            "deepseek_v3:layers.1.feed_forward.experts.w1": (Shard(1),),  # [E, H, D] by hidden units
            "deepseek_v3:layers.1.feed_forward.experts.w3": (Shard(1),),
            "deepseek_v3:layers.1.feed_forward.experts.w2": (Shard(2),),  # [E, D, H]
            "deepseek_v3:layers.1.feed_forward.shared_experts.w1.weight": col,
            "deepseek_v3:layers.1.feed_forward.shared_experts.w2.weight": row,
            "deepseek_v3:layers.1.attention.wq_a.weight": rep,
            "deepseek_v3:layers.1.attention.q_norm.weight": rep,
            "deepseek_v3:layers.1.attention.wq_b.weight": col,  # heads
            "deepseek_v3:layers.1.attention.wkv_a.weight": rep,  # the latent: per token
            "deepseek_v3:layers.1.attention.kv_norm.weight": rep,
            "deepseek_v3:layers.1.attention.wk_rope.weight": rep,  # the shared rotary key
            "deepseek_v3:layers.1.attention.wkv_b.weight": col,
            "deepseek_v3:layers.1.attention.wo.weight": row,
            "qwen2:layers.0.feed_forward.shared_gate.weight": rep,
            "qwen2:layers.0.feed_forward.experts.w2": (Shard(2),),
            "qwen2:layers.0.attention.wq.bias": col,
        }
        assert {k: placements[k] for k in want} == want
    finally:
        dist.destroy_process_group()

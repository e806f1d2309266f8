"""Context parallel composes with MoE models, expert parallel and DeepSeek's multi-head latent attention.

One 4-rank gloo launch (tests/distributed/worker.py) runs every layout, 3 steps each, fp32, clipping active
(0.05, below the natural norm), seq 64, 2 layers; each is compared with a single-process run of the same model
and batches (``test_parallel.close``: losses within 1e-5, grad norms within 1e-3 relative), and the logged
``moe_aux_loss`` within 1e-5 (relative) and ``moe_load_max_over_mean`` equal to the single process's: the MoE
block's micro-batch statistics (expert counts, the aux loss's f_i and P_i, the aux-free bias loads) are summed
over the CP ranks (models/common/moe.py). Both flavors train the aux-free bias (bias_update_rate 0.001), so a
load summed over only half the sequence would move the bias differently and the losses with it. Layouts:

* ``qwen3_moe:cp2_dp2``: CP 2 x DP 2 (ZeRO 3) without EP.
* ``qwen3_moe_cap:cp2_dp2``: the same with ``capacity_factor 1.0``, ``drop_policy probs`` and an aux loss 50x
  the flavor's (0.5, so its gradient weighs in the grad norm): the drops are decided on the whole micro-batch;
  with full recompute (the CP all-reduce and all-gathers of the MoE block re-run inside backward).
* ``qwen3_moe:cp2_ep2``: CP 2 x DP 2 with EP 2 drawn from the DP x CP ranks (each EP group is a CP pair).
* ``deepseek:cp2_ep2`` and ``deepseek:cp2_tp2``: DeepSeek-V3's debug flavor (MLA with the latent and rotary
  key all-gathered over CP, sigmoid group-limited routing, a shared expert, the selection bias): CP 2 x DP 2
  (ZeRO 3) with EP 2 drawn from the DP x CP ranks, and CP 2 x TP 2. ``deepseek:cp2_ep2`` is saved after step
  3: its Hugging Face export (``llmtrain export``, in process) equals the single process's export of step 3:
  identical config.json, generation config and tokenizer files, the same tensor names and shapes, every tensor
  the same AdamW update (``test_compose_moe.assert_same_export``, ``conftest.assert_same_adam_update``: the
  runs differ only by the order of their sums).
* ``qwen3_moe_pp:cp2_pp2``: 4 layers, CP 2 x PP 2 (1F1B, 4 micro-batches): the pipeline rank's aux-loss weight
  counts whole micro-batches' tokens (summed over CP); the logged MoE figures cover the logging rank's stage
  only, so only losses and grad norms are compared.

``llmtrain check`` accepts each layout (exit 0).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import yaml

from llmtrain.cli import main as cli_main
from test_compose_moe import assert_same_export, ckpt_of, close_moe, run_single
from test_parallel import base as parallel_base
from test_parallel import launch

STEPS = 3
QWEN_MOE = {"model_type": "qwen3", "flavor": "debug_moe"}
DEEPSEEK = {"model_type": "deepseek_v3", "flavor": "debug"}
CAPACITY = {"capacity_factor": 1.0, "drop_policy": "probs", "aux_loss_coef": 0.5}
GROUPS: dict[str, dict] = {  # group -> model section over test_parallel's base
    "qwen3_moe": QWEN_MOE,
    "qwen3_moe_cap": {**QWEN_MOE, "moe": CAPACITY},
    "deepseek": DEEPSEEK,
    "qwen3_moe_pp": {**QWEN_MOE, "num_layers": 4},
}
LAYOUTS: dict[str, dict] = {  # group:layout -> parallel section (world 4)
    "qwen3_moe:cp2_dp2": {"context_parallel": 2, "zero_stage": 3},
    "qwen3_moe_cap:cp2_dp2": {"context_parallel": 2, "zero_stage": 3},
    "qwen3_moe:cp2_ep2": {"context_parallel": 2, "zero_stage": 3, "expert_parallel": 2},
    "deepseek:cp2_ep2": {"context_parallel": 2, "zero_stage": 3, "expert_parallel": 2},
    "deepseek:cp2_tp2": {"context_parallel": 2, "tensor_parallel": 2},
    "qwen3_moe_pp:cp2_pp2": {
        "context_parallel": 2,
        "pipeline_parallel": 2,
        "schedule": "1f1b",
        "micro_batch_num": 4,
    },
}
EXPORTED = "deepseek:cp2_ep2"  # saved after the steps: its Hugging Face export is the single process's
LR = 3e-3  # test_parallel.base's peak learning rate


def group_config(prefix: str, group: str) -> dict:
    cfg = parallel_base(prefix, "qwen3")
    cfg["model"] = {**cfg["model"], "seq_length": 64, **copy.deepcopy(GROUPS[group])}
    return cfg


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory) -> dict[str, list[dict]]:
    """Single-process steps of every group (the exported one checkpointed after them, in ``dir``)."""
    out = {}
    for group in GROUPS:
        root = tmp_path_factory.mktemp(f"ref-{group}")
        exported = group == EXPORTED.split(":")[0]
        steps = run_single(group_config(tiny_corpus, group), root, STEPS, STEPS if exported else ())
        assert all(s["grad_norm"] > 0.05 for s in steps)  # clipping (0.05) really acts
        out[group] = steps
        if exported:
            out["dir"] = root
    return out


@pytest.mark.slow  # one 4-rank gloo launch, 6 layouts
def test_cp_moe_layouts_match_single_process(tiny_corpus, reference, tmp_path):
    variants = {name: {"model": GROUPS[name.split(":")[0]], "parallel": p} for name, p in LAYOUTS.items()}
    variants["qwen3_moe_cap:cp2_dp2"]["recompute"] = {"mode": "full"}  # CP collectives re-run in backward
    run = tmp_path / "run-exported"
    variants[EXPORTED].update({"run": {"output_dir": str(run)}, "save_after_steps": True})
    spec = {"base": group_config(tiny_corpus, "qwen3_moe"), "steps": STEPS, "variants": variants}
    results = launch(4, spec, tmp_path)
    assert set(results) == set(variants)
    for name, r in results.items():
        close_moe(name, r, reference[name.split(":")[0]], "pipeline_parallel" in LAYOUTS[name])
    ref_ckpt = ckpt_of(reference["dir"], STEPS)
    assert_same_export(EXPORTED, ckpt_of(run, STEPS), ref_ckpt, tmp_path, lr_sum=STEPS * LR)


def test_check_accepts_cp_moe_layouts(tiny_corpus, tmp_path, capsys):
    for name, parallel in LAYOUTS.items():
        path = tmp_path / f"{name.replace(':', '_')}.yaml"
        cfg = group_config(tiny_corpus, name.split(":")[0])
        cfg["parallel"] = parallel
        path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
        rc = cli_main(["check", str(path), "--world-size", "4"])
        err = capsys.readouterr().err
        assert rc == 0 and "Traceback" not in err, (name, err)


def test_capacity_drops_under_cp_are_one_process_drops():
    """The whole-micro-batch drop decision of ``MoE._cp_kept`` (no process group: a fake two-rank CP whose
    gather returns both ranks' parts) keeps, on each rank, exactly its positions of one process's kept set."""
    import torch

    from llmtrain.distributed.context_parallel import local_index
    from llmtrain.models.common.moe import MoE, kept_assignments

    bsz, seq, k, experts, cp = 2, 16, 2, 4, 2
    gen = torch.Generator().manual_seed(0)
    picks = [torch.randperm(experts, generator=gen)[:k] for _ in range(bsz * seq)]
    chosen = torch.stack(picks).view(bsz, seq, k)
    weights = torch.rand(bsz, seq, k, generator=gen)
    counts = torch.bincount(chosen.flatten(), minlength=experts)
    for policy in ("position", "probs"):
        whole = kept_assignments(chosen.flatten(), weights.flatten(), counts, 9, policy)  # 9 < 16 per expert
        keep = torch.zeros(chosen.numel(), dtype=torch.bool)
        keep[whole] = True
        assert not keep.all()  # something is dropped
        for rank in range(cp):
            idx = local_index(seq, cp, rank)

            class FakeCP:
                size = cp

                @staticmethod
                def sequence(x: torch.Tensor) -> torch.Tensor:
                    return chosen if x.dtype == chosen.dtype else weights

                @staticmethod
                def local_part(x: torch.Tensor, idx: torch.Tensor = idx) -> torch.Tensor:
                    return x[:, idx]

            moe = SimpleNamespace(top_k=k, drop_policy=policy, context_parallel=FakeCP)
            local_e = chosen[:, idx].flatten()
            shape = torch.Size([bsz, seq // cp, 64])
            order = MoE._cp_kept(moe, local_e, weights[:, idx].flatten(), counts, 9, shape)  # type: ignore[arg-type]
            assert torch.equal(local_e[order], torch.sort(local_e[order], stable=True).values)  # by expert
            assert sorted(order.tolist()) == keep.view(bsz, seq, k)[:, idx].flatten().nonzero()[:, 0].tolist()

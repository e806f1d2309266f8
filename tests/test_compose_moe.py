"""Expert layouts compose with every axis: EP inside DP, EP with HSDP, EP x TP (expert-TP, and EP drawn from the
DP x TP ranks with whole experts), EP x PP, MoE and DeepSeek's MLA under PP x TP (distributed/expert_parallel.py).

One 4-rank and one 8-rank gloo launch run every layout, 3 steps each, fp32, clipping active (0.05, below the
natural norm), seq 64, 2 layers per pipeline stage; each is compared with a single-process run of the same
model and batches (``test_parallel.close``: losses within 1e-5, grad norms within 1e-3 relative). Without
pipeline parallel the logged ``moe_aux_loss`` is within 1e-5 (relative) and the load figure equal to the
single process's (under PP both cover the logging rank's stage only, docs/parallelism.md). ``qwen3_moe`` is
the flavor with a shared expert and the aux-loss-free selection bias (which Hugging Face's Qwen3-MoE lacks, so
export refuses it); ``qwen3_moe_hf`` the exportable one (``debug_moe_hf``). Layouts (world 4):

* ``qwen3_moe_hf:ep2_hsdp``: HSDP 2 x 2 (ZeRO 3), EP 2 over the shard dim: two expert replicas, the experts
  FSDP-sharded over them (edp).
* ``qwen3_moe_hf_mb1:ep2_dp4`` (ZeRO 3: experts FSDP-sharded over edp) and ``qwen3_moe_mb1:ep2_dp4_zero0``
  (whole replicas, their gradients summed by a hook per micro-batch): EP 2 inside DP 4 with two micro-batches
  per rank; the reference has micro-batches of 1 (the aux loss is per micro-batch).
* ``qwen3_moe:ep4_tp2``: DP 2 x TP 2 with EP 4 drawn from all four ranks, expert-TP 1 (DeepSeek-V3's layout).
* ``deepseek:ep2_tp2``: DP 2 x TP 2, EP 2 over DP and every expert's hidden units over TP (MLA, group routing,
  shared expert, bias).
* ``qwen3_moe_hf_pp:ep2_pp2``, ``qwen3_moe_hf_pp:pp2_tp2``, ``deepseek_pp:pp2_tp2`` (4 layers, 1F1B).
* ``qwen3_moe_hf:ep2_tp2``: EP 2 x TP 2; its checkpoint resumed on one process gives steps 4-6 within the
  parity rule of the uninterrupted run.
* Checkpoints across layouts, a chain in the launch (``CHAIN``): the single process's step-3 checkpoint
  resumed as ``qwen3_moe_hf:ep4_tp2_resumed`` (EP 4 over DP 2 x TP 2, expert-TP 1: steps 4-6, saved), that
  resumed as ``..._cp2_tp2_resumed`` (CP 2 x TP 2: steps 7-9, saved), that as ``..._ep2_tp2_resumed`` (EP 2 x
  TP 2 with expert-TP 2: steps 10-12); each link's steps by the parity rule of the uninterrupted
  single-process run. (The dense chain, 8-rank DP2 x TP2 x PP2 -> 1 process -> 4-rank CP2 x TP2, is
  tests/test_compose.py's.)
* Hugging Face export: every layout in ``EXPORTED`` (EP 2 x TP 2, EP with HSDP, EP 2 inside DP 4, EP 2 x PP 2,
  MoE under PP 2 x TP 2, MLA under PP 2 x TP 2: after step 3; EP 4 over DP 2 x TP 2: after step 6) is saved,
  exported on one process (``llmtrain export``, in process) and compared with the single process's export of
  the same step (``assert_same_export``): identical config.json, generation config and tokenizer files, the
  same tensor names and shapes, every tensor the same AdamW update (``conftest.assert_same_adam_update``: the
  runs differ only by the order of their sums, so Adam's own bound applies).
* world 8: ``qwen3_moe:ep2_tp2_dp4`` (expert-TP 2 experts FSDP-sharded over their two replicas: a 3-D expert
  DTensor) and ``qwen3_moe_pp:ep2_pp2_tp2_dp2`` (four axes at once).

``llmtrain check`` accepts each layout (and MindFormers' deepseek3 671B layout, EP 8 x TP 4 on 1024 ranks, and
Megatron's EP over DP x TP) and refuses, with exit 2 and the divisors to use, an EP that does not divide.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from conftest import assert_same_adam_update  # tests/ is on sys.path under pytest
from llmtrain.cli import main as cli_main
from llmtrain.config import config_from_dict
from llmtrain.train.trainer import Trainer
from test_parallel import base as parallel_base
from test_parallel import close, launch, per_step

STEPS = 3
MORE = STEPS  # steps after a resume (the resumed layout in the launch takes STEPS steps too)
LR = 3e-3  # test_parallel.base's peak learning rate
QWEN_MOE = {"model_type": "qwen3", "flavor": "debug_moe"}
# the exportable flavor: no shared expert, no aux-loss-free selection bias (Qwen3-MoE has neither)
QWEN_MOE_HF = {"model_type": "qwen3", "flavor": "debug_moe_hf"}
DEEPSEEK = {"model_type": "deepseek_v3", "flavor": "debug"}
GROUPS: dict[str, dict] = {  # group -> sections over test_parallel's base (model: its full section here)
    "qwen3_moe": {"model": QWEN_MOE},
    "qwen3_moe_mb1": {"model": QWEN_MOE, "train": {"micro_batch_size": 1}},
    "qwen3_moe_pp": {"model": {**QWEN_MOE, "num_layers": 4}},
    "deepseek": {"model": DEEPSEEK},
    "deepseek_pp": {"model": {**DEEPSEEK, "num_layers": 4}},
    "qwen3_moe_hf": {"model": QWEN_MOE_HF},
    "qwen3_moe_hf_mb1": {"model": QWEN_MOE_HF, "train": {"micro_batch_size": 1}},
    "qwen3_moe_hf_pp": {"model": {**QWEN_MOE_HF, "num_layers": 4}},
}
PP = {"pipeline_parallel": 2, "schedule": "1f1b"}
LAYOUTS: dict[str, dict] = {  # group:layout -> parallel section (world 4, or the world that WORLD names)
    "qwen3_moe_hf:ep2_hsdp": {"zero_stage": 3, "data_parallel_replicate": 2, "expert_parallel": 2},
    "qwen3_moe_hf_mb1:ep2_dp4": {"zero_stage": 3, "expert_parallel": 2},
    "qwen3_moe_mb1:ep2_dp4_zero0": {"zero_stage": 0, "expert_parallel": 2},
    "qwen3_moe:ep4_tp2": {"zero_stage": 3, "tensor_parallel": 2, "expert_parallel": 4},
    "deepseek:ep2_tp2": {"zero_stage": 3, "tensor_parallel": 2, "expert_parallel": 2},
    "qwen3_moe_hf_pp:ep2_pp2": {**PP, "micro_batch_num": 2, "zero_stage": 2, "expert_parallel": 2},
    "qwen3_moe_hf_pp:pp2_tp2": {**PP, "micro_batch_num": 4, "tensor_parallel": 2},
    "deepseek_pp:pp2_tp2": {**PP, "micro_batch_num": 4, "tensor_parallel": 2},
    "qwen3_moe_hf:ep2_tp2": {"zero_stage": 3, "tensor_parallel": 2, "expert_parallel": 2},
    "qwen3_moe_hf:ep4_tp2_resumed": {"zero_stage": 3, "tensor_parallel": 2, "expert_parallel": 4},
    "qwen3_moe_hf:cp2_tp2_resumed": {"context_parallel": 2, "tensor_parallel": 2},
    "qwen3_moe_hf:ep2_tp2_resumed": {"zero_stage": 3, "tensor_parallel": 2, "expert_parallel": 2},
    "qwen3_moe:ep2_tp2_dp4": {"zero_stage": 3, "tensor_parallel": 2, "expert_parallel": 2},
    "qwen3_moe_pp:ep2_pp2_tp2_dp2": {**PP, "micro_batch_num": 2, "tensor_parallel": 2, "expert_parallel": 2},
}
WORLD = {"qwen3_moe:ep2_tp2_dp4": 8, "qwen3_moe_pp:ep2_pp2_tp2_dp2": 8}  # the others: 4 ranks
SAVED = "qwen3_moe_hf:ep2_tp2"
# The chain of resumes in the 4-rank launch: each layout resumes the checkpoint the one before it saved after
# its steps (the first: the single process's step-3 checkpoint) and takes the next STEPS steps.
CHAIN = ("qwen3_moe_hf:ep4_tp2_resumed", "qwen3_moe_hf:cp2_tp2_resumed", "qwen3_moe_hf:ep2_tp2_resumed")
RESUMED = CHAIN[0]
START = {name: (i + 1) * STEPS for i, name in enumerate(CHAIN)}  # layout -> the step it resumes at (else 0)
# Layouts saved after their steps whose Hugging Face export is compared with the single process's: one of each
# kind (the fresh ones at step STEPS, the resumed EP over DP x TP one at 2 x STEPS).
EXPORTED = (SAVED, "qwen3_moe_hf:ep2_hsdp", "qwen3_moe_hf_mb1:ep2_dp4", "qwen3_moe_hf_pp:ep2_pp2",
            "qwen3_moe_hf_pp:pp2_tp2", "deepseek_pp:pp2_tp2", RESUMED)  # fmt: skip


def group_config(prefix: str, group: str) -> dict:
    cfg = parallel_base(prefix, "qwen3")
    cfg["model"] = {**cfg["model"], "seq_length": 64, **copy.deepcopy(GROUPS[group]["model"])}
    cfg["train"].update(GROUPS[group].get("train", {}))
    return cfg


def run_single(cfg: dict, out: Path, steps: int, save_at: int | tuple[int, ...] = ()) -> list[dict]:
    """``steps`` steps on one process into the run directory ``out``; a checkpoint after each step counted in
    ``save_at`` (counted from this call's first step)."""
    cfg = copy.deepcopy(cfg)
    cfg["run"]["output_dir"] = str(out)
    t = Trainer(config_from_dict(cfg))
    results = []
    for step in range(1, steps + 1):
        results.append(t.train_step())
        if step in ((save_at,) if isinstance(save_at, int) else save_at):
            t.save()
            t.checkpointer.wait()
    t.metrics.close()
    return results


def ckpt_of(run_dir: Path, step: int) -> Path:
    """The checkpoint of ``step`` in the default place of run directory ``run_dir``."""
    return run_dir / "checkpoints" / f"step_{step:08d}"


_REF_EXPORTS: dict[Path, Path] = {}  # single-process checkpoint -> its export (each exported once a session)


def assert_same_export(name: str, ckpt: Path, ref_ckpt: Path, out: Path, lr_sum: float) -> None:
    """``llmtrain export`` (in process) of the checkpoint ``ckpt``, saved by the layout ``name``, equals that
    of the single process's checkpoint ``ref_ckpt`` of the same step: the same files, every one but the
    weights (config.json, generation_config.json, the tokenizer's) byte for byte, the same tensor names and
    shapes, every tensor the same AdamW update (``conftest.assert_same_adam_update``; ``lr_sum``: the sum of
    the step sizes so far: the runs differ only by the order of their sums). Exported under ``out``."""
    from safetensors.torch import load_file

    got_dir = out / f"hf-{name.replace(':', '-')}"
    assert cli_main(["export", str(ckpt), "--to", "hf", str(got_dir)]) == 0, name
    want_dir = _REF_EXPORTS.get(ref_ckpt)
    if want_dir is None:
        want_dir = out / f"hf-single-{ref_ckpt.parent.parent.name}-{ref_ckpt.name}"
        assert cli_main(["export", str(ref_ckpt), "--to", "hf", str(want_dir)]) == 0, ref_ckpt
        _REF_EXPORTS[ref_ckpt] = want_dir
    files = sorted(p.name for p in got_dir.iterdir())
    assert files == sorted(p.name for p in want_dir.iterdir()), name
    assert "model.safetensors" in files, (name, files)
    for file in files:
        if file not in ("model.safetensors", "llmtrain_export.json"):  # the marker names the source
            assert (got_dir / file).read_bytes() == (want_dir / file).read_bytes(), (name, file)
    got, want = (load_file(str(d / "model.safetensors")) for d in (got_dir, want_dir))
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}, name
    assert_same_adam_update(name, got, want, lr_sum=lr_sum)


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory) -> dict[str, list[dict]]:
    """Single-process steps of every group, a checkpoint after STEPS (the saved group: STEPS + MORE steps, the
    chain's too, and a checkpoint after 2 x STEPS as well)."""
    out = {}
    for group in GROUPS:
        saved = group == SAVED.split(":")[0]
        root = tmp_path_factory.mktemp(f"ref-{group}")
        n = max(STEPS + MORE, *(s + STEPS for s in START.values())) if saved else STEPS
        exported = any(name.split(":")[0] == group for name in EXPORTED)
        steps = run_single(group_config(tiny_corpus, group), root, n, (STEPS, 2 * STEPS) if exported else ())
        assert all(s["grad_norm"] > 0.05 for s in steps)  # clipping (0.05) really acts
        out[group] = steps
        out[f"{group}:dir"] = root  # type: ignore[assignment]
    return out


def moe_figures(steps: list[dict]) -> dict[str, list[float]]:
    return {k: [s[k] for s in steps] for k in ("moe_aux_loss", "moe_load_max_over_mean")}


def close_moe(name: str, got: dict, ref: list[dict], pipelined: bool) -> None:
    """The parity rule (``close``) and, without pipeline parallel (where the logged MoE figures cover the logging
    rank's stage only), the aux loss within 1e-5 relative and the same per-step load figure (the same routing)."""
    close(name, got, per_step(ref))
    if pipelined:
        return
    want = moe_figures(ref)
    for a, b in zip(got["moe_aux_loss"], want["moe_aux_loss"], strict=True):
        assert abs(a - b) <= 1e-5 * b, (name, got["moe_aux_loss"], want["moe_aux_loss"])
    assert got["moe_load_max_over_mean"] == want["moe_load_max_over_mean"], name


@pytest.mark.slow  # a gloo launch each: 35-50 s (4 ranks, 13 layouts), 30-40 s (8 ranks, 2) on 2 busy cores
@pytest.mark.parametrize("world", [4, 8])
def test_expert_layouts_match_single_process(world, tiny_corpus, reference, tmp_path):
    variants = {}
    for name, parallel in LAYOUTS.items():
        if WORLD.get(name, 4) == world:
            sections = copy.deepcopy(GROUPS[name.split(":")[0]])
            variants[name] = {**sections, "parallel": parallel}
    runs = {name: tmp_path / f"run-{name.replace(':', '-')}" for name in variants}
    for name in variants:
        if name in EXPORTED or name in CHAIN:  # saved after the steps, into its own run directory
            variants[name].update({"run": {"output_dir": str(runs[name])}, "save_after_steps": True})
    ref_dir = reference[f"{SAVED.split(':')[0]}:dir"]
    for i, name in enumerate(CHAIN if world == 4 else ()):
        previous = ckpt_of(ref_dir, STEPS) if i == 0 else ckpt_of(runs[CHAIN[i - 1]], START[name])
        variants[name]["checkpoint"] = {"resume": str(previous)}
    spec = {"base": group_config(tiny_corpus, "qwen3_moe"), "steps": STEPS, "variants": variants}
    results = launch(world, spec, tmp_path)
    assert set(results) == set(variants)
    for name, r in results.items():
        group, start = name.split(":")[0], START.get(name, 0)
        ref = reference[group][start : start + STEPS]
        close_moe(name, r, ref, "pipeline_parallel" in LAYOUTS[name])

    # Each saved layout's checkpoint exports what the single process exports at the same step (the same AdamW
    # steps; the routed experts are in it) ...
    for name in EXPORTED:
        if name in variants:
            step = START.get(name, 0) + STEPS
            ref_ckpt = ckpt_of(reference[f"{name.split(':')[0]}:dir"], step)
            assert_same_export(name, ckpt_of(runs[name], step), ref_ckpt, tmp_path, lr_sum=step * LR)
    if SAVED not in variants:
        return
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf-qwen3_moe_hf-ep2_tp2" / "model.safetensors"))
    assert any(".mlp.experts." in k for k in exported)  # the routed experts are in it

    # ... and the EP2 x TP2 one resumes on one process: the next steps are the uninterrupted run's.
    cfg = group_config(tiny_corpus, SAVED.split(":")[0])
    cfg["checkpoint"]["resume"] = str(ckpt_of(runs[SAVED], STEPS))
    resumed = run_single(cfg, tmp_path / "resumed", MORE)
    after = reference[SAVED.split(":")[0]][STEPS : STEPS + MORE]
    close(f"{SAVED} -> 1 process", per_step(resumed), per_step(after))


def test_check_accepts_expert_layouts_and_refuses_what_cannot_divide(tiny_corpus, tmp_path, capsys):
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(group_config(tiny_corpus, "qwen3_moe")), encoding="utf-8")

    def check(world: int, *overrides: str, config: Path = path) -> tuple[int, str]:
        rc = cli_main(["check", str(config), *overrides, "--world-size", str(world)])
        out = capsys.readouterr()
        assert "Traceback" not in out.err
        return rc, out.err

    for name, parallel in LAYOUTS.items():
        model = GROUPS[name.split(":")[0]]["model"]
        over = [f"model.{k}={v}" for k, v in model.items()]
        over += [f"parallel.{k}={v}" for k, v in parallel.items()]
        rc, err = check(WORLD.get(name, 4), *over)
        assert rc == 0, (name, err)
    rc, err = check(4, "parallel.expert_parallel=3")
    assert rc == 2 and "parallel.expert_parallel 3 must divide data-parallel x context-parallel x " in err
    assert "(4 x 1 x 1 = 4)" in err and "use one of 1, 2, 4." in err
    rc, err = check(8, "parallel.tensor_parallel=2", "parallel.expert_parallel=8")  # 4 experts
    assert rc == 2 and "model.moe.num_experts 4 is not divisible by parallel.expert_parallel 8" in err

    # MindFormers' deepseek3 671B layout (EP 8 over DP 16, TP 4 as expert-TP) and Megatron / NeMo's DeepSeek-V3
    # one (EP drawn from DP x TP: here EP 64 over DP 16 x TP 4, whole experts).
    deepseek3 = Path(__file__).parent / "fixtures" / "mindformers" / "deepseek3_671b.yaml"
    assert check(1024, config=deepseek3)[0] == 0
    assert check(1024, "parallel.expert_parallel=64", config=deepseek3)[0] == 0
    rc, err = check(1024, "parallel.expert_parallel=128", config=deepseek3)
    assert rc == 2 and "(16 x 1 x 4 = 64)" in err


def test_expert_mesh_regroups_the_stage_ranks():
    """The expert mesh's (edp, ep, etp) groups for the tested layouts, from the degrees alone (no process
    group: the ranks are the world mesh's row-major numbering)."""
    from llmtrain.distributed.parallel_dims import ParallelDims
    from llmtrain.moe_rules import expert_tp

    def groups(**kw: int) -> tuple[int, list[list[int]]]:
        dims = ParallelDims(**{"dp_replicate": 1, "tp": 1, "pp": 1, "cp": 1, **kw})
        etp = expert_tp(dims)
        edp = dims.dp * dims.cp * dims.tp // (dims.ep * etp)
        ranks = torch.arange(dims.world_size).reshape(dims.pp, edp, dims.ep, etp)
        return etp, ranks.transpose(2, 3).reshape(-1, dims.ep).tolist()  # one row per ep group

    assert groups(dp_shard=4, ep=2, world_size=4) == (1, [[0, 1], [2, 3]])  # edp 2: {0, 2}, {1, 3} replicas
    assert groups(dp_shard=2, tp=2, ep=2, world_size=4) == (2, [[0, 2], [1, 3]])  # EP over DP, expert-TP 2
    assert groups(dp_shard=2, tp=2, ep=4, world_size=4) == (1, [[0, 1, 2, 3]])  # EP over DP x TP
    assert groups(dp_shard=2, pp=2, ep=2, world_size=4) == (1, [[0, 1], [2, 3]])  # one group per stage

"""Multi-stage runs (stages:): LR targets at stage ends, per-stage mixtures measured from the loader's own
accounting, settings that change at a boundary, config errors at load time, and a run killed in stage 2 that
resumes to the same final parameters as an uninterrupted run."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml

from llmtrain.config import config_from_dict
from llmtrain.errors import ConfigError
from llmtrain.resolve.stages import StagedLR, resolve_stages, stage_at
from llmtrain.train.curriculum import Curriculum


@pytest.fixture(scope="module")
def corpora(tiny_corpus, tmp_path_factory) -> list[str]:
    """Three datasets sharing tiny_corpus's tokenizer: [tiny_corpus, other stdlib modules, more of them]."""
    from llmtrain.data.prep.prepare import prepare

    tok = glob.glob(tiny_corpus + "*.tokenizer.json")[0]
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))
    out = [tiny_corpus]
    for name, chosen in (("b", files[12:22]), ("c", files[22:30])):
        prefix = str(tmp_path_factory.mktemp("stages") / name)
        prepare(chosen, prefix, tokenizer=tok, log=None)
        out.append(prefix)
    return out


def base(datasets: list[str], out: str, stages: list[dict], **train) -> dict:
    return {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32},
        "train": {
            "batch_size": 4,
            "micro_batch_size": 2,
            "max_steps": 100,
            "lr": 1e-3,
            "min_lr": 1e-5,
            "warmup_steps": 2,
            "log_steps": 1,
            "eval_steps": 0,
            "seed": 5,
            **train,
        },
        "data": {"datasets": [{"path": datasets[0], "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 0, "keep_checkpoint_max": 20},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"eval_iters": 1, "at_start": False},
        "run": {"device_target": "cpu", "output_dir": out, "threads": 1},
        "stages": stages,
    }


RECIPE = [  # the seed's recipe: 70% / 20% / 10% of the tokens, LR to 1/10 then 1/100 of the peak
    {"name": "general", "fraction": 0.7, "lr_end": 1.0, "lr_schedule": "constant"},
    {"name": "reasoning", "fraction": 0.2, "lr_end": 0.1, "lr_schedule": "cosine"},
    {"name": "anneal", "fraction": 0.1, "lr_end": 0.01, "lr_schedule": "linear"},
]


@pytest.mark.parametrize("shapes", [("constant", "cosine", "linear"), ("wsd", "linear", "cosine")])
def test_lr_at_each_stage_end_is_the_configured_fraction(shapes, tmp_path):
    stages = [{**s, "lr_schedule": shape} for s, shape in zip(RECIPE, shapes)]
    cfg = config_from_dict(base(["unused"], str(tmp_path), stages))
    paths, plans = resolve_stages(cfg)
    assert [(p.start_step, p.end_step) for p in plans] == [(0, 70), (70, 90), (90, 100)]
    lr = StagedLR(plans, cfg.train.warmup_steps, cfg.train.lr, cfg.train.wsd_decay_fraction)
    for plan, frac in zip(plans, (1.0, 0.1, 0.01)):
        assert abs(lr(plan.end_step) - frac * 1e-3) < 1e-9
        assert stage_at(plans, plan.end_step) is plan
    assert lr(1) == pytest.approx(0.5e-3) and lr(2) == pytest.approx(1e-3)  # warmup
    assert lr(71) < 1e-3 and lr(80) > lr(89) > 1e-4  # reasoning decays from the peak toward 1/10
    if shapes[1] == "cosine":  # the closed form mid-stage: half way through the cosine
        assert abs(lr(80) - (1e-4 + 0.9e-3 * 0.5)) < 1e-12


def test_stage_lengths_from_tokens_and_steps(tmp_path):
    stages = [
        {"name": "a", "steps": 7},
        {"name": "b", "tokens": 1000, "overrides": {"model.seq_length": 64}},  # 4 x 64 = 256 tokens/step
        {"name": "c", "fraction": 0.1},
    ]
    cfg = config_from_dict(base(["unused"], str(tmp_path), stages))
    _, plans = resolve_stages(cfg)
    assert [p.steps for p in plans] == [7, 4, 10]  # ceil(1000/256) = 4; 0.1 x 100 steps x 128 / 128 = 10
    assert plans[1].cfg.model.seq_length == 64 and plans[2].cfg.model.seq_length == 32
    assert all(p.cfg.train.max_steps == 21 for p in plans)


@pytest.mark.parametrize(
    "stages, needle",
    [
        ([{"name": "a", "steps": 3, "overrides": {"model.hidden_size": 64}}], "model.hidden_size"),
        ([{"name": "a", "steps": 3, "overrides": {"parallel.expert_parallel": 2}}], "cannot change"),
        ([{"name": "a", "steps": 3, "fraction": 0.5}], "exactly one length"),
        ([{"name": "a", "steps": 3}, {"name": "a", "steps": 3}], "unique"),
        (
            [{"name": "a", "steps": 3, "lr_schedule": "cosinus"}],
            "lr_schedule: 'cosinus' is not one of constant, linear, cosine, wsd",
        ),
        ([{"name": "a", "steps": 3, "overrides": {"train.lrr": 1}}], "train.lr"),
    ],
)
def test_bad_stages_are_config_errors_at_load(stages, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):  # at load, or when resolved
        resolve_stages(config_from_dict(base(["unused"], str(tmp_path), stages)))


def test_per_stage_proportions_follow_the_weights(corpora, tmp_path):
    a, b, c = corpora
    stages = [
        {"name": "s1", "steps": 150, "datasets": [{"path": a, "weight": 0.7}, {"path": b, "weight": 0.3}]},
        {"name": "s2", "steps": 150, "datasets": [{"path": b, "weight": 0.25}, {"path": c, "weight": 0.75}]},
        {"name": "s3", "steps": 150, "datasets": [{"path": a, "weight": 1}, {"path": c, "weight": 1}]},
    ]
    cfg = config_from_dict(base(corpora, str(tmp_path), stages))
    cur = Curriculum(cfg, resolve_stages(cfg))
    expected = [{a: 0.7, b: 0.3}, {b: 0.25, c: 0.75}, {a: 0.5, c: 0.5}]
    for k, want in enumerate(expected):
        for _ in range(cur.plan.steps):
            cur.batches.next_step()
        got = cur.stage_tokens()
        total = sum(got.values())
        assert total == 150 * 4 * 32  # concat windows: every sample is seq_length input tokens
        for path in (a, b, c):
            assert abs(got[path] / total - want.get(path, 0.0)) < 0.01, (k, got)
        if k < 2:
            cur.advance()
    # run totals are the sum of the stages; a dataset's sample stream continues across stages (no repeats)
    assert sum(cur.consumed_tokens().values()) == 3 * 150 * 4 * 32
    counts = cur.blend(2).offsets
    assert counts[0] == cur.blend(0).source_counts(600)[0]


def test_resume_mid_stage_restores_the_same_batches(corpora, tmp_path):
    a, b, c = corpora
    stages = [
        {"name": "s1", "steps": 5, "datasets": [{"path": a, "weight": 1}, {"path": b, "weight": 1}]},
        {
            "name": "s2",
            "steps": 5,
            "datasets": [{"path": c, "weight": 1}],
            "overrides": {"model.seq_length": 16},
        },
    ]
    cfg = config_from_dict(base(corpora, str(tmp_path), stages))
    first = Curriculum(cfg, resolve_stages(cfg))
    for _ in range(5):
        first.batches.next_step()
    first.advance()
    first.batches.next_step()
    state = json.loads(json.dumps(first.state_dict()))
    want = first.batches.next_step()
    second = Curriculum(cfg, resolve_stages(cfg))
    second.load_state_dict(state)
    got = second.batches.next_step()
    assert got[0]["input_ids"].shape == (2, 16)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(got, want))
    assert second.consumed_tokens() == first.consumed_tokens()


def test_trainer_follows_the_plan_resolved_from_the_config_as_written(corpora, tmp_path):
    """A fraction is of the configured train.max_steps; the trainer then runs the plan's total. The plan must
    not be resolved again from the updated max_steps (0.05 x 7 steps would round to an empty stage)."""
    from llmtrain.train.trainer import Trainer

    stages = [{"name": "a", "fraction": 0.05}, {"name": "b", "steps": 2}]  # 5 + 2 of max_steps 100
    t = Trainer(config_from_dict(base(corpora, str(tmp_path), stages)))
    assert t.cfg.train.max_steps == 7
    assert [(p.start_step, p.end_step) for p in t.curriculum.plans] == [(0, 5), (5, 7)]
    t.metrics.close()


def run_cli(cfg: dict, path: Path) -> subprocess.CompletedProcess:
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "llmtrain", "train", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    from llmtrain.models import build_model
    from llmtrain.train.checkpoint import load_model_weights

    resolved = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    from llmtrain.resolve import derive

    model = build_model(derive(resolved, vocab_size=512).model_args, device="cpu")
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    load_model_weights(last, model)
    return {k: v.clone() for k, v in model.state_dict().items()}


def last_losses(run_dir: Path) -> dict[int, tuple[float, str]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: (r["loss"], r["stage"]) for r in rows if "loss" in r}


def test_staged_run_changes_settings_and_resumes_exactly_after_a_kill(corpora, tmp_path):
    a, b, c = corpora
    stages = [
        {"name": "general", "steps": 4, "datasets": [{"path": a, "weight": 0.5}, {"path": b, "weight": 0.5}]},
        {
            "name": "reasoning",
            "steps": 4,
            "lr_end": 0.1,
            "datasets": [{"path": c, "weight": 1.0}],
            "overrides": {"model.seq_length": 48, "train.micro_batch_size": 4, "recompute.mode": "full"},
        },
        {"name": "anneal", "steps": 3, "lr_end": 0.01, "overrides": {"train.grad_clip_norm": 0.5}},
    ]
    runs = {}
    # SIGKILL in stage 2 (step 7 of 11: resumes from step 6, mid-stage), then at step 9 (resumes from the
    # boundary checkpoint of step 8); each time the same command again resumes
    for name, fault in (("straight", {}), ("killed", {"kill_at_step": [7, 9]})):
        cfg = base(corpora, str(tmp_path / name), stages)
        cfg["checkpoint"]["save_steps"] = 2
        cfg["fault"] = fault
        p = run_cli(cfg, tmp_path / f"{name}.yaml")
        for _ in fault.get("kill_at_step", []):
            assert p.returncode != 0
            assert not (tmp_path / name / "checkpoints" / "step_00000011").exists()
            p = run_cli(cfg, tmp_path / f"{name}.yaml")
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        runs[name] = tmp_path / name
    straight, killed = (final_state(runs[n]) for n in ("straight", "killed"))
    assert straight.keys() == killed.keys()
    assert all(torch.equal(straight[k], killed[k]) for k in straight)
    losses = last_losses(runs["straight"])
    assert losses == last_losses(runs["killed"])
    assert [losses[s][1] for s in range(1, 12)] == ["general"] * 4 + ["reasoning"] * 4 + ["anneal"] * 3
    events = [json.loads(x) for x in (runs["killed"] / "events.jsonl").read_text().splitlines()]
    kinds = [(e["event"], e.get("stage")) for e in events if e["event"].startswith("stage_")]
    assert ("stage_end", "general") in kinds and ("stage_start", "anneal") in kinds
    assert [e["step"] for e in events if e["event"] == "resumed"] == [6, 8]
    ends = {e["stage"]: e for e in events if e["event"] == "stage_end"}
    assert ends["reasoning"]["tokens"][c] == 4 * 4 * 48  # 4 steps x batch 4 x seq 48, all from c
    boundary = {p.name for p in (runs["straight"] / "checkpoints").glob("step_*")}
    assert {"step_00000004", "step_00000008"} <= boundary  # a checkpoint at every boundary
    rows = [json.loads(x) for x in (runs["straight"] / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert abs(lr[4] - 1e-3) < 1e-12 and abs(lr[8] - 1e-4) < 1e-12 and abs(lr[11] - 1e-5) < 1e-12


def test_check_and_plan_accept_the_70b_recipe():
    recipe = Path(__file__).resolve().parents[1] / "configs" / "recipes" / "three_stage_70b.yaml"
    env = {**os.environ, "WORLD_SIZE": ""}
    out = subprocess.run(
        [sys.executable, "-m", "llmtrain", "check", str(recipe)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("# stages", 1)[1]
    lines = [x.split() for x in table.strip().splitlines()[1:4]]
    assert [x[0] for x in lines] == ["general", "reasoning", "anneal"]
    assert [x[1] for x in lines] == ["1-140000", "140001-180000", "180001-200000"]  # 70 / 20 / 10 %
    assert "world size:        64" in out.stdout
    plan = subprocess.run(
        [sys.executable, "-m", "llmtrain", "plan", str(recipe)], capture_output=True, text=True, env=env
    )
    assert plan.returncode == 0, plan.stderr
    assert "fits                                     yes" in plan.stdout

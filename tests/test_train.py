"""End to end on the CPU: loss falls, metrics and artifacts are written, resume reproduces the same losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmtrain.config import config_from_dict
from llmtrain.train.trainer import Trainer


def tiny_config(prefix: str, out: Path, **train) -> dict:
    return {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 64},
        "train": {
            "batch_size": 8,
            "micro_batch_size": 4,
            "max_steps": 12,
            "lr": 3e-3,
            "min_lr": 3e-4,
            "warmup_steps": 3,
            "log_steps": 1,
            "eval_steps": 6,
            "seed": 7,
            **train,
        },
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 4, "keep_checkpoint_max": 2},
        "logging": {"progress_bar": False, "tensorboard": True, "plot": True},
        "eval": {"eval_iters": 2},
        "run": {"device_target": "cpu", "output_dir": str(out)},
    }


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


def test_loss_falls_and_artifacts(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    cfg = config_from_dict(tiny_config(tiny_corpus, out, max_steps=30, eval_steps=15))
    Trainer(cfg).fit()
    r = rows(out)
    steps = [x for x in r if "loss" in x]
    assert len(steps) == 30
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "loss_scale", "mfu", "memory_bytes"):
        assert key in steps[0], key
    vals = [x["val_loss"] for x in r if "val_loss" in x]
    assert len(vals) == 3  # step 0, 15, 30
    assert vals[-1] < vals[0] - 0.6, vals  # a 512-token vocab starts near ln(512) = 6.24
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.6
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "config.yaml").exists()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_00000028", "step_00000030"]  # keep_checkpoint_max 2, plus the final save


class Crash(RuntimeError):
    pass


def test_resume_gives_identical_losses(tiny_corpus, tmp_path, monkeypatch):
    ref_dir, crash_dir = tmp_path / "ref", tmp_path / "crash"
    ref = Trainer(config_from_dict(tiny_config(tiny_corpus, ref_dir)))
    ref.fit()

    original = Trainer.train_step

    def crashing(self):
        if self.step == 9:  # after the checkpoint of step 8, one step into the next interval
            raise Crash
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", crashing)
    with pytest.raises(Crash):
        Trainer(config_from_dict(tiny_config(tiny_corpus, crash_dir))).fit()
    monkeypatch.setattr(Trainer, "train_step", original)
    resumed = Trainer(config_from_dict(tiny_config(tiny_corpus, crash_dir)))
    assert resumed.step == 8
    resumed.fit()
    assert train_losses(crash_dir) == train_losses(ref_dir)  # exact, every step 1..12
    for (n, a), b in zip(ref.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), n


def test_fp16_dynamic_loss_scale_runs(tiny_corpus, tmp_path):
    out = tmp_path / "fp16"
    cfg = config_from_dict(
        tiny_config(tiny_corpus, out, max_steps=3, precision="fp16", initial_loss_scale=2.0**40)
    )
    cfg.checkpoint.save_steps = 0
    cfg.checkpoint.save_at_end = False
    Trainer(cfg).fit()
    steps = [x for x in rows(out) if "loss" in x]
    # 2**40 overflows fp16 (max 65504) in backward: the first steps are skipped and the scale backs off
    assert steps[0]["skipped_steps"] >= 1
    assert steps[-1]["loss_scale"] < 2.0**40
    assert all(x["loss"] == x["loss"] for x in steps)  # finite, not NaN


def test_train_cli_bad_override_exits_2(tiny_corpus, tmp_path):
    cfg = tmp_path / "c.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump(tiny_config(tiny_corpus, tmp_path / "r")))
    p = subprocess.run(
        [sys.executable, "-m", "llmtrain.cli", "train", str(cfg), "train.lrr=1"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2
    assert "train.lr" in p.stderr and "Traceback" not in p.stderr


def test_epochs_cap_the_run(tiny_corpus, tmp_path):
    cfg = config_from_dict(tiny_config(tiny_corpus, tmp_path / "ep", max_steps=10**6, epochs=1))
    t = Trainer(cfg)
    assert t.cfg.train.max_steps == len(t.train_samples) // 8
    assert t.lr_at(t.cfg.train.max_steps) == pytest.approx(3e-4)  # the schedule decays over the capped run


def test_generate_cli_is_deterministic(tiny_corpus, tmp_path, capsys):
    from llmtrain.cli import main

    out = tmp_path / "gen"
    cfg = config_from_dict(tiny_config(tiny_corpus, out, max_steps=4))
    Trainer(cfg).fit()
    capsys.readouterr()
    argv = ["generate", str(out), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main([*argv[:-2], "--temperature", "0.9", "--seed", "3"]) == 0
    sampled = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first  # greedy is deterministic
    assert first.startswith("def ") and len(first) > len("def \n")
    assert sampled.startswith("def ")
    # a checkpoint directory works as well as the run directory
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    assert (
        main(["generate", str(ckpt), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]) == 0
    )
    assert capsys.readouterr().out == first
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2


def test_cpu_offload_on_one_process(tiny_corpus, tmp_path):
    """parallel.cpu_offload on one process: FSDP2's offload policy over a one-rank group and mesh. The losses
    are the plain run's (a one-rank reduce-scatter is a copy: every step within float32 rounding), and its
    step-3 checkpoint resumes in a plain one-process run with the uninterrupted run's next losses."""
    import torch.distributed as dist

    def cfg(out: Path, offload: bool, resume: str = "auto"):
        c = config_from_dict(tiny_config(tiny_corpus, out, max_steps=6, eval_steps=0))
        c.parallel.cpu_offload = offload
        c.checkpoint.save_steps = 3
        c.checkpoint.resume = resume
        c.logging.tensorboard = c.logging.plot = False
        return c

    Trainer(cfg(tmp_path / "plain", False)).fit()
    try:
        off = Trainer(cfg(tmp_path / "offload", True))
        off.fit()
        assert dist.is_initialized() and dist.get_world_size() == 1  # the one-rank group FSDP wrapped over
        assert off.fsdp
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    plain, offload = train_losses(tmp_path / "plain"), train_losses(tmp_path / "offload")
    assert sorted(offload) == list(range(1, 7))
    for step in plain:
        assert offload[step] == pytest.approx(plain[step], rel=0, abs=1e-5), step
    # the offload run's step-3 checkpoint, resumed without offload, continues like the uninterrupted run
    resumed_dir = tmp_path / "resumed"
    c = cfg(resumed_dir, False, resume=str(tmp_path / "offload" / "checkpoints" / "step_00000003"))
    resumed = Trainer(c)
    assert resumed.step == 3
    resumed.fit()
    got = train_losses(resumed_dir)
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(plain[step], rel=0, abs=1e-5), step

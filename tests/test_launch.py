"""`llmtrain launch` end to end, and resume across layouts: ZeRO-3 DP2 (steps 1-4) -> TP2 (5-8) -> one process
(9-12) reproduces the losses of an uninterrupted single-process run (1e-5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from llmtrain.config import config_from_dict
from llmtrain.train.trainer import Trainer


def cfg_dict(prefix: str, out: Path, max_steps: int) -> dict:
    return {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32},
        "train": {
            "batch_size": 8,
            "micro_batch_size": 2,
            "max_steps": max_steps,
            "decay_steps": 12,
            "lr": 3e-3,
            "warmup_steps": 2,
            "seed": 5,
            "log_steps": 1,
            "eval_steps": 0,
        },
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 4, "keep_checkpoint_max": 3, "resume": "auto"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": False, "eval_iters": 1},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1},
    }


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def launch(cfg_file: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llmtrain.cli", "launch", str(cfg_file), "--nproc-per-node", "2", *extra]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


def test_resume_across_layouts(tiny_corpus, tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    Trainer(config_from_dict(cfg_dict(tiny_corpus, ref_dir, 12))).fit()
    ref = losses(ref_dir)

    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg_dict(tiny_corpus, run_dir, 4)))
    p = launch(cfg_file, "parallel.zero_stage=3")
    assert p.returncode == 0, p.stderr[-4000:]
    assert "--standalone" in p.stdout
    p = launch(cfg_file, "parallel.tensor_parallel=2", "train.max_steps=8")
    assert p.returncode == 0, p.stderr[-4000:]
    Trainer(config_from_dict({**cfg_dict(tiny_corpus, run_dir, 12)})).fit()  # back to one process
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert abs(got[step] - ref[step]) < 1e-5, (step, got[step], ref[step])


def test_launch_rejects_bad_layout_before_spawning(tiny_corpus, tmp_path):
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg_dict(tiny_corpus, tmp_path / "r", 4)))
    p = launch(cfg_file, "parallel.tensor_parallel=3")
    assert p.returncode == 2 and "tensor_parallel" in p.stderr and "Traceback" not in p.stderr
    assert "launch:" not in p.stdout  # nothing was started

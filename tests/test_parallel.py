"""Every layout computes what one process computes: losses within 1e-5 and grad norms within 1e-3 (relative)
of a single-process run of the same model and batches, 5 steps, fp32, clipping active (threshold below the
natural norm). Two families: llama3 and qwen3 (QK-norm, so the NoParallel path of the TP plan is exercised)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.config import config_from_dict
from llmtrain.train.trainer import Trainer

WORKER = Path(__file__).parent / "distributed" / "worker.py"
STEPS = 5
FAMILIES = ("llama3", "qwen3")


def base(prefix: str, family: str) -> dict:
    return {
        "model": {"model_type": family, "flavor": "debug", "seq_length": 32, "tie_word_embeddings": False},
        "train": {
            "batch_size": 8,
            "micro_batch_size": 2,
            "max_steps": 20,
            "lr": 3e-3,
            "warmup_steps": 2,
            "grad_clip_norm": 0.05,
            "seed": 11,
            "log_steps": 1,
        },
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 0, "save_at_end": False, "resume": "none"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": False},
        "run": {"device_target": "cpu", "output_dir": "unused", "threads": 1},
    }


def variants(world: int) -> dict[str, dict]:
    if world == 2:
        return {
            "zero0_dp2": {"parallel": {"zero_stage": 0}},
            "zero1_dp2": {"parallel": {"zero_stage": 1}},
            "zero2_dp2": {"parallel": {"zero_stage": 2}},
            "zero3_dp2": {"parallel": {"zero_stage": 3}},
            "tp2": {"parallel": {"tensor_parallel": 2}},
            "zero3_dp2_recompute": {"parallel": {"zero_stage": 3}, "recompute": {"mode": "full"}},
            "zero3_dp2_selective": {"parallel": {"zero_stage": 3}, "recompute": {"mode": "selective"}},
            "zero3_dp2_offload": {"parallel": {"zero_stage": 3, "cpu_offload": True}},
        }
    return {
        "zero3_dp4": {"parallel": {"zero_stage": 3}},
        "hsdp_2x2": {"parallel": {"zero_stage": 3, "data_parallel_replicate": 2}},
        "dp2_tp2": {"parallel": {"zero_stage": 3, "tensor_parallel": 2}},
    }


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory) -> dict[str, dict]:
    out = {}
    for family in FAMILIES:
        cfg = base(tiny_corpus, family)
        cfg["run"]["output_dir"] = str(tmp_path_factory.mktemp(f"ref-{family}"))
        t = Trainer(config_from_dict(cfg))
        steps = [t.train_step() for _ in range(STEPS)]
        t.metrics.close()
        out[family] = {"loss": [s["loss"] for s in steps], "grad_norm": [s["grad_norm"] for s in steps]}
        assert all(g > 0.05 for g in out[family]["grad_norm"])  # so clipping really acts
    return out


def launch(world: int, spec: dict, tmp: Path) -> dict:
    spec_file, out_file = tmp / f"spec{world}.json", tmp / f"out{world}.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        str(WORKER),
        str(spec_file),
        str(out_file),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(out_file.read_text())


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_process(world, tiny_corpus, reference, tmp_path):
    vs = {f"{fam}:{name}": v for fam in FAMILIES for name, v in variants(world).items()}
    results = {}
    for family in FAMILIES:  # one launch per (family, world size)
        spec = {
            "base": base(tiny_corpus, family),
            "steps": STEPS,
            "variants": {n.split(":", 1)[1]: v for n, v in vs.items() if n.startswith(family + ":")},
        }
        for name, r in launch(world, spec, tmp_path).items():
            results[f"{family}:{name}"] = r
    assert set(results) == set(vs)
    for name, r in results.items():
        ref = reference[name.split(":")[0]]
        for a, b in zip(r["loss"], ref["loss"]):
            assert abs(a - b) < 1e-5, (name, r["loss"], ref["loss"])
        for a, b in zip(r["grad_norm"], ref["grad_norm"]):
            assert abs(a - b) <= 1e-3 * b, (name, r["grad_norm"], ref["grad_norm"])

"""Every layout computes what one process computes: losses within 1e-5 and grad norms within 1e-3 (relative)
of a single-process run of the same model and batches, 3 steps, fp32, clipping active (threshold below the
natural norm). Models: llama3 (untied and tied input/output embeddings: the tied weight is ONE DTensor under
TP), qwen3 (QK-norm, so the NoParallel path of the TP plan is exercised) and baichuan2 with ALiBi (slopes
sliced to each TP rank's heads), and llama3 with DSSN + TinyInit + QK-norm (issue 32: one run per layout group,
its per-layer health figures checked too). One torchrun launch per (family, world size) runs every variant of that
family; the reference runs once per (family, model overrides).

Also: a pipeline stage's pruned model loads its own layers from a Hugging Face export (``init_from_hf``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmtrain.config import config_from_dict
from llmtrain.errors import CheckpointError
from llmtrain.models import FAMILIES, build_model
from llmtrain.models.hf_io import init_from_hf, save_hf
from llmtrain.train.trainer import Trainer

WORKER = Path(__file__).parent / "distributed" / "worker.py"
STEPS = 3
# model group -> (family, model overrides); every parallel variant names its group, the reference runs per group
MODELS: dict[str, tuple[str, dict]] = {
    "llama3": ("llama3", {}),
    "llama3_tied": ("llama3", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "baichuan2_alibi": ("baichuan2", {"flavor": "debug_alibi"}),
    # issue 32: DSSN + TinyInit + QK-norm, one run per layout group (FSDP, TP, FSDP x TP); health figures checked
    "llama3_dssn": ("llama3", {"norm_scheme": "dssn", "init": "tinyinit", "qk_norm": True}),
}


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


TP2_CHUNKED = {"parallel": {"tensor_parallel": 2}, "train": {"loss_chunk_tokens": 24}}


def variants(world: int) -> dict[str, dict]:
    """``group:layout`` -> parallel overrides (the group's model overrides are added in ``launch_specs``)."""
    if world == 2:
        layouts = {
            "zero0_dp2": {"parallel": {"zero_stage": 0}},
            "zero1_dp2": {"parallel": {"zero_stage": 1}},
            "zero2_dp2": {"parallel": {"zero_stage": 2}},
            "zero3_dp2": {"parallel": {"zero_stage": 3}},
            "tp2": {"parallel": {"tensor_parallel": 2}},
            "zero3_dp2_recompute": {"parallel": {"zero_stage": 3}, "recompute": {"mode": "full"}},
            "zero3_dp2_selective": {"parallel": {"zero_stage": 3}, "recompute": {"mode": "selective"}},
            "zero3_dp2_offload": {"parallel": {"zero_stage": 3, "cpu_offload": True}},
        }
        out = {f"{g}:{n}": v for g in ("llama3", "qwen3") for n, v in layouts.items()}
        out["llama3_tied:tp2"] = layouts["tp2"]
        out["llama3_tied:zero3_dp2"] = layouts["zero3_dp2"]
        out["baichuan2_alibi:tp2"] = layouts["tp2"]
        out["llama3_dssn:zero3_dp2"] = layouts["zero3_dp2"]
        out["llama3_dssn:tp2"] = layouts["tp2"]
        # the chunked loss under TP (vocabulary-sharded chunks, 64 tokens in chunks of 24), tied head included
        out["llama3:tp2_chunked"] = out["llama3_tied:tp2_chunked"] = TP2_CHUNKED
        return out
    layouts = {
        "zero3_dp4": {"parallel": {"zero_stage": 3}},
        "hsdp_2x2": {"parallel": {"zero_stage": 3, "data_parallel_replicate": 2}},
        "dp2_tp2": {"parallel": {"zero_stage": 3, "tensor_parallel": 2}},
    }
    out = {f"{g}:{n}": v for g in ("llama3", "qwen3") for n, v in layouts.items()}
    out["llama3_tied:dp2_tp2"] = layouts["dp2_tp2"]
    out["llama3_dssn:dp2_tp2"] = layouts["dp2_tp2"]
    out["llama3:dp2_tp2_chunked"] = {**layouts["dp2_tp2"], "train": {"loss_chunk_tokens": 24}}
    return out


def launch_specs(world: int, prefix: str) -> dict[str, dict]:
    """family -> worker spec holding every variant of that family (one launch each)."""
    specs: dict[str, dict] = {}
    for name, over in variants(world).items():
        family, model_over = MODELS[name.split(":")[0]]
        spec = specs.setdefault(family, {"base": base(prefix, family), "steps": STEPS, "variants": {}})
        spec["variants"][name] = {**over, "model": dict(model_over)}
    return specs


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory) -> dict[str, dict]:
    """Single-process losses and grad norms of every model group."""
    out = {}
    for group, (family, model_over) in MODELS.items():
        cfg = base(tiny_corpus, family)
        cfg["model"].update(model_over)
        cfg["run"]["output_dir"] = str(tmp_path_factory.mktemp(f"ref-{group}"))
        t = Trainer(config_from_dict(cfg))
        steps = [t.train_step() for _ in range(STEPS)]
        t.metrics.close()
        out[group] = {"loss": [s["loss"] for s in steps], "grad_norm": [s["grad_norm"] for s in steps]}
        out[group]["health"] = [s["health"] for s in steps]
        assert all(g > 0.05 for g in out[group]["grad_norm"])  # so clipping really acts
    # The overrides change the model: each group is its own reference, not a copy of another.
    assert out["llama3_tied"]["loss"][0] != out["llama3"]["loss"][0]
    return out


def launch(world: int, spec: dict, tmp: Path, tag: str = "") -> dict:
    """Run the worker once under torchrun (also used by test_moe.py and test_pipeline.py)."""
    spec_file, out_file = tmp / f"spec{world}{tag}.json", tmp / f"out{world}{tag}.json"
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


def close(name: str, got: dict, ref: dict) -> None:
    """The parity rule of every layout test (also test_pipeline, test_context_parallel, test_moe, test_moe_tp,
    test_families, test_deepseek): per step, loss within 1e-5 and grad norm within 1e-3 relative of ``ref``
    (``{"loss": [...], "grad_norm": [...]}``), the same number of steps."""
    for a, b in zip(got["loss"], ref["loss"], strict=True):
        assert abs(a - b) < 1e-5, (name, got["loss"], ref["loss"])
    for a, b in zip(got["grad_norm"], ref["grad_norm"], strict=True):
        assert abs(a - b) <= 1e-3 * b, (name, got["grad_norm"], ref["grad_norm"])


def close_health(name: str, got: list[dict], ref: list[dict]) -> None:
    """The health figures of a layout (train/health.py: one all-reduce over the shards) against one process,
    per step: per-layer gradient norms by the grad-norm rule (1e-3 relative), parameter norms, logit RMS and
    the attention-logit bound within 1e-5 relative (the same numbers summed in another order)."""
    assert len(got) == len(ref), name
    for g, r in zip(got, ref, strict=True):
        assert g.keys() == r.keys(), (name, sorted(set(g) ^ set(r)))
        for key, want in r.items():
            tol = 1e-3 if key.startswith("grad_norm/") or key == "max_layer_grad_norm" else 1e-5
            assert abs(g[key] - want) <= tol * abs(want) + 1e-12, (name, key, g[key], want)


def per_step(steps: list[dict]) -> dict:
    """``{"loss": [...], "grad_norm": [...]}`` of a list of ``train_step`` results (a reference for close)."""
    return {"loss": [s["loss"] for s in steps], "grad_norm": [s["grad_norm"] for s in steps]}


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_process(world, tiny_corpus, reference, tmp_path):
    results = {}
    for family, spec in launch_specs(world, tiny_corpus).items():  # one launch per (family, world size)
        results.update(launch(world, spec, tmp_path, tag=f"_{family}"))
    assert set(results) == set(variants(world))
    for name, r in results.items():
        ref = reference[name.split(":")[0]]
        assert len(r["loss"]) == STEPS
        close(name, r, ref)
        if name.startswith("llama3_dssn:"):
            close_health(name, r["health"], ref["health"])


def test_pruned_stage_model_loads_its_layers_from_hf(tmp_path):
    """init_from_hf on a pipeline-pruned model (what distributed/pipeline.py leaves on a rank) takes the
    layers it holds and skips the others', yet still names a key that the pruned model itself misses."""
    args = dataclasses.replace(FAMILIES["llama3"].flavor_args("debug"), num_layers=4, seq_length=32)
    src = build_model(args, device="meta")
    src.to_empty(device="cpu")
    src.init_weights(seed=5)
    save_hf(src.state_dict(), args, tmp_path / "hf")
    want = src.state_dict()

    for keep, first, last in ((("0", "1"), True, False), (("2", "3"), False, True)):
        stage = build_model(args, device="meta")
        for key in [k for k in stage.layers if k not in keep]:
            del stage.layers[key]
        if not first:
            stage.tok_embeddings = None
        if not last:
            stage.norm, stage.output = None, None
        stage.to_empty(device="cpu")
        stage.init_weights(seed=9)  # different weights: the load must overwrite every one of them
        init_from_hf(stage, tmp_path / "hf")
        got = stage.state_dict()
        expected = {k for k in want if k.startswith("layers.") and k.split(".")[1] in keep}
        expected |= {"tok_embeddings.weight"} if first else {"norm.weight", "output.weight"}
        assert set(got) == expected
        for k, v in got.items():
            assert torch.equal(v, want[k]), k

    # Strict about the model's own keys: a directory lacking one of the stage's layers is refused.
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if not k.startswith("model.layers.3.")}, str(tmp_path / "x.st"))
    (tmp_path / "hf" / "model.safetensors").unlink()
    (tmp_path / "x.st").rename(tmp_path / "hf" / "model.safetensors")
    with pytest.raises((CheckpointError, RuntimeError), match="layers.3"):
        init_from_hf(stage, tmp_path / "hf")

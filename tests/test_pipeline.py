"""Pipeline parallel computes what one process computes.

Every schedule (gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv), an uneven layer split, PP x TP and PP x DP
(ZeRO-3): losses within 1e-5 and grad norms within 1e-3 (relative) of a single-process run of the same model
(debug flavor with 4 layers) and batches, 3 steps, fp32, clipping active. Two families (llama3, qwen3), one
torchrun launch per (family, world size); llama3 with DSSN + TinyInit + QK-norm rides in the 2-rank launch (its
per-layer health figures checked too). Also: validation through the pipeline equals the single-process
validation of the same sequences; a PP2 checkpoint resumes in a single process with the same next losses (and
the same parameter names); bad layouts are ConfigErrors (no torchrun needed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtrain.config import config_from_dict
from llmtrain.errors import ConfigError
from llmtrain.resolve.validate import validate
from llmtrain.train.trainer import Trainer
from test_parallel import base, close, close_health, launch

STEPS = 3
RESUME_STEPS = 2
FAMILIES = ("llama3", "qwen3")
PP = {"pipeline_parallel": 2, "micro_batch_num": 4}
# issue 32: DSSN + TinyInit + QK-norm through the interleaved schedule (layers on two chunks per rank), its
# per-layer health figures (every stage's layers, the last stage's logits) checked against one process too
DSSN = {"model_type": "llama3", "norm_scheme": "dssn", "init": "tinyinit", "qk_norm": True}
CHUNKED = {"loss_chunk_tokens": 24}
GROUPS = {**{f: {"model_type": f} for f in FAMILIES}, "llama3_dssn": DSSN}


def pp_base(prefix: str, family: str) -> dict:
    """test_parallel's base run with 4 layers (so 2 stages x 2 virtual stages have a layer each)."""
    cfg = base(prefix, family)
    cfg["model"]["num_layers"] = 4
    return cfg


def variants(world: int, ckpt_dir: str) -> dict[str, dict]:
    if world == 2:
        return {
            "pp2_gpipe": {"parallel": {**PP, "schedule": "gpipe"}, "validate": True},
            "pp2_interleaved_1f1b": {"parallel": {**PP, "schedule": "interleaved_1f1b", "virtual_stages": 2}},
            "pp2_zero_bubble": {"parallel": {**PP, "schedule": "zero_bubble", "virtual_stages": 2}},
            "pp2_zbv": {"parallel": {**PP, "schedule": "zbv", "virtual_stages": 2}, "validate": True},
            "pp2_dualpipev": {"parallel": {**PP, "schedule": "dualpipev", "virtual_stages": 2}},
            "pp2_uneven_1f1b": {"parallel": {**PP, "pipeline_layers": [1, 3]}},
            # train.compile under PP: compiled blocks on each stage, the compiled loss on the last one
            "pp2_1f1b_compile": {"parallel": {**PP, "schedule": "1f1b"}, "train": {"compile": True}},
            # the chunked loss on the last stage (chunks of 24 of a pipeline micro-batch's 64 tokens)
            "pp2_1f1b_chunked": {"parallel": {**PP, "schedule": "1f1b"}, "train": CHUNKED},
            "pp2_zero_bubble_chunked": {
                "parallel": {**PP, "schedule": "zero_bubble", "virtual_stages": 2},
                "train": CHUNKED,
            },
            "pp2_dualpipev_chunked": {
                "parallel": {**PP, "schedule": "dualpipev", "virtual_stages": 2},
                "train": CHUNKED,
            },
            "pp2_1f1b": {  # also checkpointed: resumed in a single process below
                "parallel": {**PP, "schedule": "1f1b"},
                "checkpoint": {"save_dir": ckpt_dir},
                "save_after_steps": True,
            },
        }
    return {
        "pp2_tp2": {"parallel": {**PP, "tensor_parallel": 2}},
        "pp2_tp2_chunked": {"parallel": {**PP, "tensor_parallel": 2}, "train": CHUNKED},
        "pp2_dp2_zero3": {"parallel": {**PP, "zero_stage": 3}},
    }


def run_single(cfg: dict, steps: int) -> tuple[Trainer, dict]:
    t = Trainer(config_from_dict(cfg))
    outs = [t.train_step() for _ in range(steps)]
    r = {"loss": [o["loss"] for o in outs], "grad_norm": [o["grad_norm"] for o in outs]}
    return t, {**r, "health": [o["health"] for o in outs]}


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory) -> dict[str, dict]:
    """Single-process losses / grad norms of STEPS + RESUME_STEPS steps, and the validation loss after STEPS."""
    out = {}
    for family, model in GROUPS.items():
        cfg = pp_base(tiny_corpus, model["model_type"])
        cfg["model"].update(model)
        # The pipeline evaluates a whole global batch (8 sequences) per eval iteration, the plain loop one
        # micro-batch (2): 4 plain iterations read the same sequences as 1 pipeline iteration.
        cfg["eval"]["eval_iters"] = 4
        cfg["run"]["output_dir"] = str(tmp_path_factory.mktemp(f"ref-{family}"))
        t, r = run_single(cfg, STEPS)
        r["val_loss"] = t.validate()["val_loss"]
        more = [t.train_step() for _ in range(RESUME_STEPS)]
        r["loss_after"] = [o["loss"] for o in more]
        t.metrics.close()
        assert all(g > 0.05 for g in r["grad_norm"])  # so clipping really acts
        out[family] = r
    return out


def all_variants(world: int, tmp: Path) -> dict[str, dict]:
    """Both families in one launch: ``family:variant`` overrides the base (llama3) model_type."""
    out = {}
    for family in FAMILIES:
        for name, v in variants(world, str(tmp / f"ckpt-{family}")).items():
            out[f"{family}:{name}"] = {**v, "model": {"model_type": family}}
    if world == 2:
        out["llama3_dssn:pp2_interleaved_1f1b"] = {**out["llama3:pp2_interleaved_1f1b"], "model": dict(DSSN)}
        out["llama3_dssn:pp2_interleaved_chunked"] = {
            **out["llama3_dssn:pp2_interleaved_1f1b"],
            "train": CHUNKED,
        }
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_matches_single_process(world, tiny_corpus, reference, tmp_path):
    vs = all_variants(world, tmp_path)
    base = pp_base(tiny_corpus, "llama3")
    base["eval"]["eval_iters"] = 1
    results = launch(world, {"base": base, "steps": STEPS, "variants": vs}, tmp_path)  # one launch
    assert set(results) == set(vs)
    for name, r in results.items():
        ref = reference[name.split(":")[0]]
        close(name, r, ref)
        if name.startswith("llama3_dssn:"):
            close_health(name, r["health"], ref["health"])
        if "val_loss" in r:
            assert abs(r["val_loss"] - ref["val_loss"]) < 1e-5, (name, r["val_loss"], ref["val_loss"])
    if world == 4:
        return
    for family in FAMILIES:  # PP2 checkpoint -> single process: the next losses continue the reference run
        step_dir = tmp_path / f"ckpt-{family}" / f"step_{STEPS:08d}"
        assert (step_dir / "COMMITTED").exists()
        cfg = pp_base(tiny_corpus, family)
        cfg["run"]["output_dir"] = str(tmp_path / f"resume-{family}")
        cfg["checkpoint"] = {**cfg["checkpoint"], "resume": str(step_dir), "save_dir": str(step_dir.parent)}
        t = Trainer(config_from_dict(cfg))
        assert t.step == STEPS
        losses = [t.train_step()["loss"] for _ in range(RESUME_STEPS)]
        t.metrics.close()
        for a, b in zip(losses, reference[family]["loss_after"], strict=True):
            assert abs(a - b) < 1e-5, (family, losses, reference[family]["loss_after"])


# ----------------------------------------------------------------------------- config errors (no torchrun)
def _cfg(tiny_corpus: str, num_layers: int = 4, micro_batch_size: int = 2, **parallel) -> object:
    cfg = pp_base(tiny_corpus, "llama3")
    cfg["train"]["micro_batch_size"] = micro_batch_size
    cfg["model"]["num_layers"] = num_layers
    cfg["parallel"] = {**PP, **parallel}
    return config_from_dict(cfg)


@pytest.mark.parametrize(
    ("parallel", "world", "needle"),
    [
        (
            {"virtual_stages": 2, "schedule": "zbv", "num_layers": 6},
            2,
            "not divisible by pipeline_parallel 2",
        ),
        ({"pipeline_layers": [1, 2]}, 2, "sum to model.num_layers 4"),
        ({"pipeline_layers": [1, 1, 2]}, 2, "must list 2 layer counts"),
        ({"micro_batch_num": 3}, 4, "not divisible by data-parallel size 2 x 3 pipeline micro-batches"),
        ({"micro_batch_num": 1, "micro_batch_size": 8}, 2, "1f1b needs 1 pipeline micro-batches"),
        ({"schedule": "gpipe", "virtual_stages": 2}, 2, "runs one stage per rank"),
        ({"schedule": "zbv"}, 2, "exactly 2 stage chunks per rank"),
        ({"schedule": "dualpipev"}, 2, "dualpipev places exactly 2 stage chunks per rank"),
        (
            {"schedule": "dualpipev", "virtual_stages": 2, "micro_batch_num": 2, "micro_batch_size": 4},
            2,
            "dualpipev needs 2 pipeline micro-batches (parallel.micro_batch_num",
        ),
        (
            {"schedule": "zero_bubble", "virtual_stages": 2, "micro_batch_num": 5},
            2,
            "multiple of its 2 rounds",
        ),
    ],
)
def test_bad_pipeline_layouts_are_config_errors(parallel, world, needle, tiny_corpus):
    with pytest.raises(ConfigError) as e:
        validate(_cfg(tiny_corpus, **parallel), world_size=world)
    assert needle in str(e.value), str(e.value)


def test_tied_embeddings_validate(tiny_corpus):
    """Tied embeddings under PP train (parity: tests/test_compose_rules.py); context parallel under PP too
    (tests/test_compose.py)."""
    cfg = pp_base(tiny_corpus, "llama3")
    cfg["model"]["tie_word_embeddings"] = True
    cfg["parallel"] = dict(PP)
    validate(config_from_dict(cfg), world_size=2)


def test_even_and_uneven_split_names(tiny_corpus):
    """Stage placement and the parameter names of the pruned rank model (full-model FQNs)."""
    from llmtrain.distributed.pipeline import (
        layers_per_stage,
        pipeline_microbatches,
        split_model,
        stage_ids,
    )
    from llmtrain.models import build_model, resolve_model_args

    cfg = _cfg(tiny_corpus, schedule="zbv", virtual_stages=2)
    assert layers_per_stage(4, cfg.parallel) == [1, 1, 1, 1]
    cfg.parallel.micro_batch_num = 1  # the default: one pipeline micro-batch per accumulation step
    assert pipeline_microbatches(cfg, dp=1) == 4 and pipeline_microbatches(cfg, dp=2) == 2
    assert [stage_ids(r, cfg.parallel) for r in (0, 1)] == [[0, 3], [1, 2]]
    cfg = _cfg(tiny_corpus, schedule="interleaved_1f1b", virtual_stages=2, pipeline_layers=[0, 2, 1, 1])
    assert [stage_ids(r, cfg.parallel) for r in (0, 1)] == [[0, 2], [1, 3]]
    args = resolve_model_args(cfg.model, vocab_size=512)
    model, parts = split_model(build_model(args, device="meta"), [1, 3], layers_per_stage(4, cfg.parallel))
    names = {n for n, _ in model.named_parameters()}
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {"0", "1", "3"}
    assert not any(n.startswith("tok_embeddings") for n in names) and "output.weight" in names
    assert [list(p.layers) for p in parts] == [["0", "1"], ["3"]]
    assert parts[0].output is None and parts[1].output is model.output  # shared, not copied

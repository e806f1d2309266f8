"""Every dense axis composes: three axes at once on 8 ranks, context parallel under pipeline parallel (every
schedule), and context parallel with compile, FP8 and CPU offload, each computing what one process computes.

Parity rule (``test_parallel.close``): losses within 1e-5 and grad norms within 1e-3 (relative) of a
single-process run of the same model and batches: llama3 debug flavor with 4 layers (2 per pipeline rank),
seq 64, packed short documents with the document mask on (so each pipeline micro-batch needs its own mask under
context parallel), fp32, clipping active, 3 steps. One torchrun launch per world size runs every variant:

* 8 ranks (slow: 8 processes on 2 cores): DP2 x TP2 x PP2 with ZeRO 3 (which under PP runs as 2, the
  ``pp_zero3`` advice); CP2 x TP2 x PP2.
* 4 ranks: CP2 x PP2 with the 1F1B, interleaved 1F1B, zero-bubble and ZBV schedules; and CP2 x TP2 resuming
  the chain below.
* 2 ranks: CP2 with ``train.compile``, with ``train.fp8`` (tensorwise, torchao's emulated fp8 GEMMs as
  tests/test_grad_sync.py, against a single-process fp8 run: step 1 by the parity rule, step 2 within
  fp8's own sensitivity, see ``close_fp8``) and with ``parallel.cpu_offload``.

Checkpoints across layouts, a chain: the 8-rank DP2 x TP2 x PP2 run's checkpoint (step 3) resumed on one
process (steps 4-6, checkpointed), that checkpoint resumed as the 4-rank CP2 x TP2 (steps 7-9); each link's
losses and grad norms by the parity rule of the uninterrupted single-process run. (The MoE continuation, ...
-> CP2 x TP2 -> EP2 x TP2, is tests/test_compose_moe.py's ``CHAIN``: an MoE cannot resume a dense model.)

Hugging Face export: each layout in ``EXPORTED`` (DP2 x TP2 x PP2, CP2 x TP2 x PP2, CP2 x PP2 1F1B, CP2 with
CPU offload) is saved after step 3, exported on one process (``llmtrain export``, in process) and compared
with the single process's export of step 3 (``test_compose_moe.assert_same_export``): identical config.json,
generation config and tokenizer files, the same tensor names and shapes, every tensor the same AdamW update
(``conftest.assert_same_adam_update``: the runs differ only by the order of their sums).

Also: the per-micro-batch masks of the pipeline stage hook (no processes); ``llmtrain check`` accepts every
layout above (exit 0) and refuses, with exit 2 and a sentence, degrees that do not divide.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from llmtrain import cli
from llmtrain.config import config_from_dict
from llmtrain.distributed import float8
from llmtrain.distributed.context_parallel import ContextParallel
from llmtrain.train.trainer import Trainer
from test_compose_moe import assert_same_export, ckpt_of
from test_context_parallel import base as cp_base
from test_context_parallel import packed_corpus  # noqa: F401  (the fixture: short packed documents)
from test_parallel import close, launch, per_step

STEPS = 3
PP = {"pipeline_parallel": 2, "micro_batch_num": 4, "schedule": "1f1b"}
LAYOUTS8 = {
    "dp2_tp2_pp2_zero3": {**PP, "tensor_parallel": 2, "zero_stage": 3},
    "cp2_tp2_pp2": {**PP, "context_parallel": 2, "tensor_parallel": 2},
}
LAYOUTS4 = {
    "cp2_pp2_1f1b": {**PP, "context_parallel": 2},
    "cp2_pp2_interleaved": {**PP, "context_parallel": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2},
    "cp2_pp2_zero_bubble": {**PP, "context_parallel": 2, "schedule": "zero_bubble", "virtual_stages": 2},
    "cp2_pp2_zbv": {**PP, "context_parallel": 2, "schedule": "zbv", "virtual_stages": 2},
}
LAYOUTS2 = {  # (parallel, train) overrides
    "cp2_compile": ({"context_parallel": 2}, {"compile": True}),
    "cp2_fp8": ({"context_parallel": 2}, {"fp8": "tensorwise"}),
    "cp2_cpu_offload": ({"context_parallel": 2, "cpu_offload": True}, {}),
}
RESUMED = {"context_parallel": 2, "tensor_parallel": 2}  # the chain's 4-rank link (resumes step 2 x STEPS)
LR = 3e-3  # test_context_parallel.base's peak learning rate
# Layouts saved after their steps whose Hugging Face export is compared with the single process's at STEPS.
EXPORTED = ("dp2_tp2_pp2_zero3", "cp2_tp2_pp2", "cp2_pp2_1f1b", "cp2_cpu_offload")


def run_base(prefix: str) -> dict:
    cfg = cp_base(prefix, "llama3")
    cfg["model"].update({"num_layers": 4, "seq_length": 64})
    return cfg


def single(
    prefix: str,
    out: Path,
    steps: int,
    fp8: str = "none",
    resume: str | None = None,
    perturb: float = 0.0,
    validate_at: int = 0,
    save_at: int = 0,
) -> dict:
    """One process: ``steps`` steps (from the checkpoint ``resume``); ``perturb``: every initial weight times
    ``1 + perturb x N(0, 1)`` first (a last-bit change at 1e-7, fp32's epsilon); ``validate_at``: the
    validation loss after that many steps (4 eval iterations of one micro-batch: the sequences of one
    pipeline eval iteration, which evaluates a whole global batch); ``save_at``: a checkpoint after that many
    steps (into ``out``'s default place)."""
    cfg = run_base(prefix)
    cfg["eval"]["eval_iters"] = 4
    cfg["train"]["fp8"] = fp8
    cfg["run"]["output_dir"] = str(out)
    if resume:
        cfg["checkpoint"] = {**cfg["checkpoint"], "resume": resume}
    before = float8.EMULATE
    float8.EMULATE = fp8 != "none"
    try:
        t = Trainer(config_from_dict(cfg))
        if perturb:
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for param in t.model.parameters():
                    param.mul_(1 + perturb * torch.randn(param.shape, generator=gen))
        start, outs, val = t.step, [], None
        for i in range(steps):
            outs.append(t.train_step())
            if i + 1 == validate_at:
                val = t.validate()["val_loss"]
            if i + 1 == save_at:
                t.save()
                t.checkpointer.wait()
        r = per_step(outs)
        t.metrics.close()
    finally:
        float8.EMULATE = before
    return {**r, "start": start, "val_loss": val}


@pytest.fixture(scope="module")
def reference(packed_corpus, tmp_path_factory) -> dict:  # noqa: F811
    """One process: 3 x STEPS steps in fp32, checkpointed after STEPS (the first STEPS the parity reference,
    the next what a resume at STEPS must continue with, the last what the chain's resume at 2 x STEPS must);
    STEPS steps in emulated fp8, and again from last-bit perturbed weights."""
    root = tmp_path_factory.mktemp("ref")
    fp32 = single(packed_corpus, root, 3 * STEPS, validate_at=STEPS, save_at=STEPS)
    assert all(g > 0.05 for g in fp32["grad_norm"])  # clipping at 0.05 really acts
    first = {k: fp32[k][:STEPS] for k in ("loss", "grad_norm")}
    first["val_loss"] = fp32["val_loss"]
    after = {k: fp32[k][STEPS : 2 * STEPS] for k in ("loss", "grad_norm")}
    after2 = {k: fp32[k][2 * STEPS :] for k in ("loss", "grad_norm")}
    fp8 = single(packed_corpus, tmp_path_factory.mktemp("ref-fp8"), STEPS, fp8="tensorwise")
    assert max(abs(a - b) for a, b in zip(fp8["loss"], first["loss"])) > 1e-5  # fp8 really quantizes
    nudged = single(
        packed_corpus, tmp_path_factory.mktemp("ref-fp8-nudged"), STEPS, "tensorwise", perturb=1e-7
    )
    keys = ("loss", "grad_norm")
    return {
        "fp32": first, "after": after, "after2": after2, "ckpt": ckpt_of(root, STEPS),
        "fp8": {k: fp8[k] for k in keys}, "fp8_nudged": {k: nudged[k] for k in keys},
    }  # fmt: skip


def close_fp8(name: str, got: dict, ref: dict, nudged: dict) -> None:
    """fp8 under context parallel against one process. Step 1 by the parity rule: its scales are the
    one-process scales (amax reduced over CP; per rank, the loss is 1e-4 off). From step 2 on, within twice
    the drift a last-bit change of the initial weights causes in one process: a tensor-wise scale 448 / amax
    moves with the amax's last bit, re-rounding many fp8 values at once, and CP computes attention in another
    order (last bits), so no layout but pure data parallel can hold 1e-5 there (measured: 1e-7 nudge -> 2e-4).
    Step 2 only: past it two last-bit-different fp8 runs diverge chaotically (the nudged drift grows ~3x a step:
    1.7e-4 at step 2, 5.4e-4 at step 3 in the TP2 runs), so one nudged sample no longer bounds another run;
    a wrong scale shows at step 1 already (1e-4 off), and step 2 still has a 20x margin (TP2: 9e-6)."""
    close(name, {k: v[:1] for k, v in got.items()}, {k: v[:1] for k, v in ref.items()})
    drift = abs(nudged["loss"][1] - ref["loss"][1])
    assert abs(got["loss"][1] - ref["loss"][1]) <= max(2 * drift, 1e-5), (name, got, ref, nudged)


def spec(prefix: str, variants: dict) -> dict:
    cfg = run_base(prefix)
    cfg["eval"]["eval_iters"] = 1  # (under PP one eval iteration is a whole global batch)
    return {"base": cfg, "steps": STEPS, "variants": variants}


def saved(variants: dict, tmp: Path) -> dict[str, Path]:
    """The EXPORTED variants among ``variants`` save after their steps into their own run directories under
    ``tmp``: name -> the checkpoint (step STEPS)."""
    out = {}
    for name in set(EXPORTED) & set(variants):
        run = tmp / f"run-{name}"
        variants[name].update(run={"output_dir": str(run)}, save_after_steps=True)
        out[name] = ckpt_of(run, STEPS)
    return out


def assert_exports_match(results: dict, ckpts: dict[str, Path], reference: dict, tmp: Path) -> None:
    for name, ckpt in ckpts.items():
        assert name in results and (ckpt / "COMMITTED").exists(), name
        assert_same_export(name, ckpt, reference["ckpt"], tmp, lr_sum=STEPS * LR)


@pytest.fixture(scope="module")
def launched8(packed_corpus, tmp_path_factory) -> tuple[dict, dict[str, Path]]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("compose8")
    variants: dict[str, dict] = {name: {"parallel": p} for name, p in LAYOUTS8.items()}
    ckpts = saved(variants, tmp)
    return launch(8, spec(packed_corpus, variants), tmp), ckpts


@pytest.fixture(scope="module")
def resumed_single(launched8, packed_corpus, reference, tmp_path_factory) -> tuple[dict, Path]:  # noqa: F811
    """The chain's second link: the 8-rank DP2 x TP2 x PP2 checkpoint (step STEPS) resumed on one process for
    STEPS steps, checkpointed after them (what the 4-rank CP2 x TP2 link resumes)."""
    out = tmp_path_factory.mktemp("resumed-single")
    r = single(packed_corpus, out, STEPS, resume=str(launched8[1]["dp2_tp2_pp2_zero3"]), save_at=STEPS)
    return r, ckpt_of(out, 2 * STEPS)


@pytest.mark.slow  # one 8-process launch on 2 cores
def test_three_axes_on_8_ranks_match_single_process(launched8, reference, tmp_path):
    results, ckpts = launched8
    assert set(results) == set(LAYOUTS8) == set(ckpts)
    for name, r in results.items():
        close(name, r, reference["fp32"])
    assert_exports_match(results, ckpts, reference, tmp_path)


@pytest.mark.slow  # one 4-process launch; resumes the 8-rank checkpoint's one-process continuation
def test_cp_under_pp_and_resume_as_cp_tp_match_single_process(
    resumed_single,
    packed_corpus,  # noqa: F811
    reference,
    tmp_path,
):
    variants: dict[str, dict] = {name: {"parallel": p} for name, p in LAYOUTS4.items()}
    variants["cp2_pp2_1f1b"]["validate"] = True  # validation through the stages under CP
    variants["resumed_cp2_tp2"] = {"parallel": RESUMED, "checkpoint": {"resume": str(resumed_single[1])}}
    ckpts = saved(variants, tmp_path)
    results = launch(4, spec(packed_corpus, variants), tmp_path)
    assert set(results) == set(variants)
    for name in LAYOUTS4:
        close(name, results[name], reference["fp32"])
    val, want = results["cp2_pp2_1f1b"]["val_loss"], reference["fp32"]["val_loss"]
    assert abs(val - want) < 1e-5, (val, want)
    close("8 ranks -> 1 process -> resumed_cp2_tp2", results["resumed_cp2_tp2"], reference["after2"])
    assert_exports_match(results, ckpts, reference, tmp_path)


def test_8_rank_checkpoint_resumes_on_one_process(resumed_single, reference):
    r, ckpt = resumed_single
    assert r["start"] == STEPS and (ckpt / "COMMITTED").exists()
    close("resumed_single", r, reference["after"])


def test_cp_with_compile_fp8_and_cpu_offload_match_single_process(packed_corpus, reference, tmp_path):  # noqa: F811
    pytest.importorskip("torchao", reason="train.fp8 needs torchao (the fp8 / dev extra)")
    variants = {name: {"parallel": p, "train": t} for name, (p, t) in LAYOUTS2.items()}
    variants["cp2_fp8"]["fp8_emulate"] = True
    ckpts = saved(variants, tmp_path)
    results = launch(2, spec(packed_corpus, variants), tmp_path)
    assert set(results) == set(variants)
    for name, r in results.items():
        if "fp8" in name:
            close_fp8(name, r, reference["fp8"], reference["fp8_nudged"])
        else:
            close(name, r, reference["fp32"])
    assert_exports_match(results, ckpts, reference, tmp_path)


def test_stage_hook_builds_each_micro_batch_mask():
    """Under PP each stage forward gets the masks of its own pipeline micro-batch: the pre-hook's masks, from
    the schedule's slices of the keyword arguments, equal those ``shard`` builds from that micro-batch alone
    (and the two micro-batches' masks differ: their documents do)."""
    seq, cp = 16, 2
    docs = torch.cumsum((torch.rand(4, seq, generator=torch.Generator().manual_seed(5)) < 0.3).long(), dim=1)
    full = {"input_ids": torch.arange(seq).repeat(4, 1), "labels": torch.arange(seq).repeat(4, 1),
            "position_ids": torch.arange(seq).repeat(4, 1), "document_ids": docs}  # fmt: skip
    for rank in range(cp):
        hooked = ContextParallel(None, cp, rank, alibi=False, window=5)
        local = hooked.local(full, document_mask=True)
        masks = []
        for rows in (slice(0, 2), slice(2, 4)):  # two pipeline micro-batches of 2 sequences
            hooked.stage_pre_hook(
                None, (), {"position_ids": local["position_ids"][rows], "document_ids": docs[rows]}
            )
            alone = ContextParallel(None, cp, rank, alibi=False, window=5)
            alone.shard({k: v[rows] for k, v in full.items()}, document_mask=True)
            for sliding in (False, True):
                got, want = hooked.mask(sliding), alone.mask(sliding)
                assert got.allowed is not None and want.allowed is not None
                assert torch.equal(got.allowed, want.allowed)
            masks.append(hooked.mask(False).allowed)
        assert not torch.equal(masks[0], masks[1])


# ----------------------------------------------------------------------------- llmtrain check (no torchrun)
def check(tmp_path: Path, prefix: str, world: int, parallel: dict, train: dict | None = None) -> int:
    """``llmtrain check`` (the CLI's exit code) of the test run with these degrees on ``world`` processes; fp8
    on a CUDA target (on a CPU target ``check`` refuses fp8 for the device, not for the layout)."""
    cfg = run_base(prefix)
    cfg["parallel"] = parallel
    cfg["train"].update(train or {})
    if cfg["train"].get("fp8", "none") != "none":
        cfg["run"]["device_target"] = "cuda"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return cli.main(["check", str(path), "--world-size", str(world)])


ACCEPTED = [(8, p, {}) for p in LAYOUTS8.values()] + [(4, p, {}) for p in LAYOUTS4.values()]
ACCEPTED += [(4, RESUMED, {})] + [(2, p, t) for p, t in LAYOUTS2.values()]


@pytest.mark.parametrize("world, parallel, train", ACCEPTED)
def test_check_accepts_the_composed_layouts(world, parallel, train, packed_corpus, tmp_path, capsys):  # noqa: F811
    assert check(tmp_path, packed_corpus, world, parallel, train) == 0, capsys.readouterr().err
    if parallel.get("zero_stage") == 3 and parallel.get("pipeline_parallel", 1) > 1:  # said, not hidden
        assert "ZeRO stage 3 under pipeline_parallel 2 runs as stage 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "world, parallel, needle",
    [
        (16, {**PP, "context_parallel": 2, "tensor_parallel": 4},
         "model.num_kv_heads 2 is not divisible by parallel.tensor_parallel 4"),
        (8, {**PP, "context_parallel": 2, "tensor_parallel": 2, "virtual_stages": 3,
             "schedule": "interleaved_1f1b", "micro_batch_num": 6},
         "model.num_layers 4 is fewer than the pipeline stages"),
        (8, {**PP, "context_parallel": 3}, "is not divisible by tensor_parallel 1 x pipeline_parallel 2 x"),
        (12, {**PP, "context_parallel": 3, "data_parallel": 2},
         "model.seq_length 64 must be divisible by 2 x parallel.context_parallel 3 = 6"),
        (8, {**PP, "context_parallel": 2, "tensor_parallel": 2, "micro_batch_num": 3},
         "not divisible by data-parallel size 1 x 3 pipeline micro-batches"),
    ],
)  # fmt: skip
def test_check_refuses_what_does_not_divide(world, parallel, needle, packed_corpus, tmp_path, capsys):  # noqa: F811
    assert check(tmp_path, packed_corpus, world, parallel) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err

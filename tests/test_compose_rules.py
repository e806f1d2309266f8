"""Layouts the feasibility rules used to refuse, now trained with the parity rule (``test_parallel.close``):
losses within 1e-5 and grad norms within 1e-3 (relative) of one process. One 2-process launch runs them all:

* Tied input / output embeddings under pipeline parallel (``pipeline.TiedEmbedding``: the last stage's head
  is a copy of the first stage's embedding, gradients summed, both updated alike): PP2 with 1F1B, interleaved
  1F1B and ZBV (whose rank 0 holds both the first and the last stage). The 1F1B run's checkpoint resumed on one
  process, and the one-process checkpoint resumed as PP2 (1F1B, ZBV), continue the uninterrupted run.
* FP8 (tensorwise, torchao's emulated fp8 GEMMs as tests/test_grad_sync.py) under tensor parallel 2, against a
  one-process fp8 run: step 1 by the parity rule (the scales are the one-process scales: the amax of a sharded
  weight or activation is a DTensor reduction over TP), step 2 within fp8's own sensitivity to last-bit
  differences (``test_compose.close_fp8``: twice the drift a 1e-7 nudge of the initial weights causes).

* ``train.compile`` with the interleaved 1F1B schedule under PP2, and with the zero-bubble schedule (the warning
  ``pp_compile_zero_bubble``: the zero-bubble schedules cannot run compiled blocks on this torch, so the blocks
  and the loss run eagerly; formerly a refusal).

* ``parallel.cpu_offload`` with TP2 and with PP2 alone (data_parallel x context_parallel 1): FSDP wraps over
  a 1-rank data-parallel mesh for its offload policy (refused before issue 28; one process still is).

Model: llama3 debug, 4 layers, seq 64, packed documents, fp32, clipping at 0.05 (it acts), 3 steps; tied
embeddings for the tied pipeline runs, untied (as test_compose's references) for fp8, compile and offload.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtrain.config import config_from_dict
from llmtrain.train.trainer import Trainer
from test_compose import close_fp8
from test_compose import single as single_untied
from test_context_parallel import base as cp_base
from test_context_parallel import packed_corpus  # noqa: F401  (the fixture: short packed documents)
from test_parallel import close, launch, per_step

STEPS = 3
PP = {"pipeline_parallel": 2, "micro_batch_num": 4, "schedule": "1f1b"}
TIED_PP = {
    "tied_pp2_1f1b": PP,
    "tied_pp2_interleaved": {**PP, "schedule": "interleaved_1f1b", "virtual_stages": 2},
    "tied_pp2_zbv": {**PP, "schedule": "zbv", "virtual_stages": 2},
}
COMPILE_PP = {  # compiled blocks with interleaved 1F1B; with zero bubble the warning's eager blocks
    "pp2_interleaved_compile": {"parallel": TIED_PP["tied_pp2_interleaved"], "train": {"compile": True},
                                "model": {"tie_word_embeddings": False}},
    "pp2_zero_bubble_compile": {"parallel": {**PP, "schedule": "zero_bubble", "virtual_stages": 2},
                                "train": {"compile": True}, "model": {"tie_word_embeddings": False}},
}  # fmt: skip
OFFLOAD = {  # parallel.cpu_offload with data_parallel x context_parallel 1: FSDP over a 1-rank mesh
    "tp2_cpu_offload": {"parallel": {"tensor_parallel": 2, "cpu_offload": True}},
    "pp2_cpu_offload": {"parallel": {**PP, "cpu_offload": True}},
}
FP8_TP = {"tp2_fp8": {"parallel": {"tensor_parallel": 2}, "train": {"fp8": "tensorwise"}, "fp8_emulate": True,
                      "model": {"tie_word_embeddings": False}}}  # fmt: skip


def run_base(prefix: str) -> dict:
    cfg = cp_base(prefix, "llama3")
    cfg["model"].update({"num_layers": 4, "seq_length": 64, "tie_word_embeddings": True})
    cfg["eval"]["eval_iters"] = 1
    return cfg


def single(prefix: str, out: Path, steps: int, resume: str | None = None, save_at: int = 0) -> dict:
    """One process, tied embeddings, ``steps`` steps (from the checkpoint ``resume``; saving one after
    ``save_at`` steps)."""
    cfg = run_base(prefix)
    cfg["run"]["output_dir"] = str(out)
    if resume:
        cfg["checkpoint"] = {**cfg["checkpoint"], "resume": resume}
    t = Trainer(config_from_dict(cfg))
    assert t.model.output.weight is t.model.tok_embeddings.weight  # one process: one tensor
    start, outs = t.step, []
    for i in range(steps):
        outs.append(t.train_step())
        if i + 1 == save_at:
            t.save()
            t.checkpointer.wait()
    t.metrics.close()
    return {**per_step(outs), "start": start}


@pytest.fixture(scope="module")
def reference(packed_corpus, tmp_path_factory) -> dict:  # noqa: F811
    """One process, tied, 2 x STEPS steps (checkpointed after STEPS): the first STEPS the parity reference, the
    rest what a resume at STEPS must continue with; untied emulated fp8, and again from nudged weights."""
    out = tmp_path_factory.mktemp("ref-tied")
    r = single(packed_corpus, out, 2 * STEPS, save_at=STEPS)
    assert all(g > 0.05 for g in r["grad_norm"])  # clipping at 0.05 really acts
    ckpt = sorted(out.rglob(f"step_{STEPS:08d}"))
    assert len(ckpt) == 1, ckpt
    keys = ("loss", "grad_norm")
    ref = {"ckpt": str(ckpt[0]), **{k: {m: r[m][sl] for m in keys} for k, sl in
           (("first", slice(0, STEPS)), ("after", slice(STEPS, None)))}}  # fmt: skip
    untied = single_untied(packed_corpus, tmp_path_factory.mktemp("untied"), STEPS)
    ref["untied"] = {m: untied[m] for m in keys}
    for name, nudge in (("fp8", 0.0), ("fp8_nudged", 1e-7)):
        f = single_untied(packed_corpus, tmp_path_factory.mktemp(name), STEPS, "tensorwise", perturb=nudge)
        ref[name] = {m: f[m] for m in keys}
    return ref


@pytest.mark.slow  # one 2-process launch: three pipeline runs, two resumes, fp8 x TP
def test_refused_once_now_match_single_process(packed_corpus, reference, tmp_path):  # noqa: F811
    pytest.importorskip("torchao", reason="train.fp8 needs torchao (the fp8 / dev extra)")
    variants: dict[str, dict] = {name: {"parallel": p} for name, p in TIED_PP.items()}
    ckpt = tmp_path / "ckpt"
    variants["tied_pp2_1f1b"].update(checkpoint={"save_dir": str(ckpt)}, save_after_steps=True)
    for name in ("1f1b", "zbv"):  # the one-process checkpoint resumed as PP2 (ZBV: rank 0 holds both copies)
        variants[f"resumed_pp2_{name}"] = {"parallel": TIED_PP[f"tied_pp2_{name}"],
                                           "checkpoint": {"resume": reference["ckpt"]}}  # fmt: skip
    variants.update(FP8_TP)
    variants.update(COMPILE_PP)
    variants.update({k: {**v, "model": {"tie_word_embeddings": False}} for k, v in OFFLOAD.items()})
    results = launch(2, {"base": run_base(packed_corpus), "steps": STEPS, "variants": variants}, tmp_path)
    assert set(results) == set(variants)
    for name, r in results.items():
        if name in FP8_TP:
            close_fp8(name, r, reference["fp8"], reference["fp8_nudged"])
        elif name in COMPILE_PP or name in OFFLOAD:
            close(name, r, reference["untied"])
        else:
            close(name, r, reference["after" if name.startswith("resumed") else "first"])
    resumed = single(packed_corpus, tmp_path / "resumed", STEPS, resume=str(ckpt / f"step_{STEPS:08d}"))
    assert resumed["start"] == STEPS
    close("tied_pp2 -> 1 process", resumed, reference["after"])

"""``llmtrain demo``: the first thing a newcomer runs, end to end on the CPU in a few minutes.

1. corpus: the running Python's own standard-library sources (present on every machine), or ``--input`` files;
2. ``prepare``: train a byte-level BPE tokenizer on them, tokenize, write Megatron ``.bin/.idx`` + manifest;
3. ``train``: the ``demo`` flavor from the packaged ``configs/demo.yaml`` (checkpoints, metrics, loss plot);
   with lm-eval installed (``pip install llmtrain[eval]``) the shipped ``stdlib_ppl`` task (held-out
   standard-library packages, llmtrain/eval/stdlib_tasks.py) is scored before the first step and after the
   last, a few seconds each, unless the config already sets ``eval.tasks``;
4. ``generate``: a sample from the final checkpoint.

A second ``llmtrain demo`` with the same output directory reuses the prepared data and resumes training from
the newest checkpoint (``checkpoint.resume: auto``).

This module is the demo (:func:`run_demo`); the command's flags are in :mod:`llmtrain.commands.demo`.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import sysconfig
import time
from importlib import resources
from pathlib import Path

import torch

from llmtrain.errors import DataError

# 16 held-out passages of stdlib_ppl: a few seconds on 2 cores, and a clear drop after training
DEMO_TASKS, DEMO_LIMIT = ("stdlib_ppl",), 16
DEMO_SCORES = (("eval/stdlib_ppl/bits_per_byte", "stdlib_ppl bits/byte"),)


def stdlib_sources() -> list[str]:
    """The top-level modules of this interpreter's standard library (about 5 MB of Python)."""
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))
    if not files:
        raise DataError("could not find the Python standard library's sources; pass --input FILES instead.")
    return files


def run_demo(
    output_dir: str | Path,
    inputs: list[str] | None = None,
    vocab_size: int = 4096,
    prompt: str = "def ",
    overrides: list[str] | tuple[str, ...] = (),
) -> None:
    """Prepare ``inputs`` (None: :func:`stdlib_sources`), train and sample into ``output_dir``, printing the
    steps and where the results are (the module docstring has the stages)."""
    from llmtrain.config import load_config
    from llmtrain.data.manifest import manifest_path
    from llmtrain.data.prep.prepare import prepare
    from llmtrain.generate import generate
    from llmtrain.resolve import validate
    from llmtrain.train.sample import load_for_generation
    from llmtrain.train.trainer import Trainer

    t0 = time.time()
    out = Path(output_dir)
    prefix = out / "data" / "corpus"
    if manifest_path(str(prefix)).exists():
        print(f"[1/3] reusing prepared data {prefix}")
    else:
        inputs = inputs or stdlib_sources()
        print(f"[1/3] preparing {len(inputs)} files -> {prefix} (training a {vocab_size}-token BPE)")
        prefix.parent.mkdir(parents=True, exist_ok=True)
        prepare(inputs, str(prefix), train_tokenizer=vocab_size, workers=1)

    cfg_file = resources.files("llmtrain") / "configs" / "demo.yaml"
    with resources.as_file(cfg_file) as path:
        cfg, notes = load_config(
            path,
            [f"data.datasets=[{{path: '{prefix}', weight: 1.0}}]", f"run.output_dir={out}", *overrides],
        )
    if cfg.run.threads is None:
        cfg.run.threads = max(torch.get_num_threads(), 1)
    downstream = not cfg.eval.tasks and importlib.util.find_spec("lm_eval") is not None
    if downstream:  # scored at step 0 (eval.at_start) and at the last step
        cfg.eval.tasks, cfg.eval.downstream_steps = list(DEMO_TASKS), cfg.train.max_steps
        cfg.eval.limit = DEMO_LIMIT
    validate(cfg, world_size=1, require_data=True)
    out = Path(cfg.run.output_dir)  # an override may have moved the run
    print(f"[2/3] training the '{cfg.model.flavor}' flavor for {cfg.train.max_steps} steps -> {out}")
    trainer = Trainer(cfg, notes=notes)
    result = trainer.fit()

    print("[3/3] sampling from the final checkpoint")
    model, tok, ckpt = load_for_generation(out)
    ids = generate(
        model,
        tok.encode(prompt),
        80,
        temperature=0.8,
        top_k=40,
        eos_id=tok.eos_id,
        generator=torch.Generator().manual_seed(0),
    )
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    print("-" * 72)
    print(prompt + tok.decode(ids))
    print("-" * 72)
    if vals:
        print(f"validation loss {vals[0]:.3f} -> {vals[-1]:.3f} (drop {vals[0] - vals[-1]:.3f} nats)")
    for key, what in DEMO_SCORES:
        scored = [r for r in rows if key in r]
        if len(scored) >= 2:
            first, last = scored[0], scored[-1]
            print(
                f"downstream    : {what} {first[key]:.3f} -> {last[key]:.3f} (lm-eval, {cfg.eval.limit} held-out "
                f"stdlib passages; scored in {first['eval/time_s']:.1f} s and {last['eval/time_s']:.1f} s)"
            )
    if not downstream and not cfg.eval.tasks:
        print(
            "downstream    : not scored, lm-evaluation-harness is not installed: `make demo` installs it, or "
            "pip install 'llmtrain[eval]' to score a shipped lm-eval task before and after training"
        )
    print(f"run directory : {out}")
    print(f"checkpoint    : {ckpt}")
    print(f"metrics       : {out / 'metrics.jsonl'}  (TensorBoard: {out / 'tensorboard'})")
    print(f"loss plot     : {out / 'loss.png'}")
    print(f"sample again  : llmtrain generate {out} --prompt 'import '")
    print(f"done in {time.time() - t0:.0f} s (step {result['step']})")

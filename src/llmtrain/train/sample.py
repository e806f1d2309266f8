"""Sampling from a run: the newest checkpoint's model and tokenizer, and a prompt continued with them.

:func:`load_for_generation` takes a run directory (holding config.yaml and checkpoints/) or one checkpoint
directory inside it; the tokenizer is the run's first dataset's: its copy next to the dataset, else
``data.tokenizer`` (a Megatron dataset has no copy; ``llmtrain.data.describe`` decides). ``llmtrain generate``,
``demo`` and ``export`` load models this way. :func:`sample_from_run` is ``llmtrain generate``: the prompt
continued by :func:`llmtrain.generate.generate` (KV-cached decoding); the flags are in
:mod:`llmtrain.commands.generate`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from llmtrain.errors import CheckpointError


def load_for_generation(run_dir: str | Path):
    """(model, tokenizer, checkpoint path) for the newest checkpoint of ``run_dir``."""
    from llmtrain.config import load_config
    from llmtrain.config.schema import ParallelConfig
    from llmtrain.data.describe import describe_dataset
    from llmtrain.data.tokenizer import load_tokenizer
    from llmtrain.models import build_model
    from llmtrain.resolve import derive
    from llmtrain.train.checkpoint import Checkpointer, is_committed, load_model_weights, run_dir_of

    path = Path(run_dir)
    ckpt = None
    if is_committed(path):  # a checkpoint directory: RUN_DIR/checkpoints/step_N
        ckpt, path = path, run_dir_of(path)
    if not (path / "config.yaml").exists():
        raise CheckpointError(
            f"{run_dir}: no config.yaml here; pass a run directory written by `llmtrain train`."
        )
    cfg, _ = load_config(path / "config.yaml")
    cfg.run.output_dir = str(path)
    cfg.checkpoint.resume = "auto"
    checkpointer = Checkpointer(cfg.checkpoint, path)
    if ckpt is None:  # the newest checkpoint that verifies, saying which newer ones were skipped and why
        choice = checkpointer.latest_valid()
        if choice.path is None:
            if not choice.rejected:
                raise CheckpointError(f"{path}: no committed checkpoint under {checkpointer.dir}.")
            reasons = "; ".join(f"{p}: {why}" for p, why in choice.rejected)
            raise CheckpointError(f"{path}: no checkpoint under {checkpointer.dir} verifies ({reasons}).")
        for message in choice.messages():
            print(f"llmtrain: {message}", file=sys.stderr)
        ckpt = choice.path
    else:
        reason = checkpointer.verify(ckpt)
        if reason is not None:
            raise CheckpointError(
                f"{ckpt} fails verification: {reason}. Pass the run directory to use its newest valid checkpoint."
            )
    prefix = cfg.data.datasets[0].path
    data = describe_dataset(prefix, cfg.data.tokenizer, "data.datasets[0].path")
    check_tokenizer(ckpt, data)
    tok = load_tokenizer(str(data.tokenizer_path()))
    # one process, whatever layout the run trained with (a TP / PP / EP run's parallel section does not derive
    # on one process); the model's arguments do not depend on it, and the checkpoint loads under any layout
    one = dataclasses.replace(cfg, parallel=ParallelConfig())
    args = derive(one, world_size=1, vocab_size=data.vocab_size).model_args
    model = build_model(args, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    load_model_weights(ckpt, model)
    model.eval()
    return model, tok, ckpt


def tokenizer_record(cfg) -> dict:
    """What a checkpoint records of the tokenizer it was trained with (``trainer_state.json``'s ``tokenizer``):
    the sha256, vocabulary size and file of the run's first dataset's tokenizer (the one generate, export and
    eval decode with)."""
    from llmtrain.data.describe import describe_dataset

    specs = cfg.data.datasets or [d for stage in cfg.stages for d in stage.datasets]
    data = describe_dataset(specs[0].path, cfg.data.tokenizer, "data.datasets[0].path")
    return {"sha256": data.tokenizer_sha256, "vocab_size": data.vocab_size, "file": data.tokenizer_file}


def check_tokenizer(ckpt: Path, data) -> None:
    """DataError naming both when the checkpoint ``ckpt`` was trained with another tokenizer than the one
    the run's dataset ``data`` (a :class:`~llmtrain.data.describe.DatasetInfo`) has now (the dataset was
    re-prepared with another tokenizer); a checkpoint that records none (an older llmtrain's) is used with a
    warning."""
    import json

    from llmtrain.errors import DataError

    try:
        state = json.loads((Path(ckpt) / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        state = None  # verification read it already; nothing more to say here
    record = state.get("tokenizer") if isinstance(state, dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        print(
            f"llmtrain: warning: {ckpt} does not record the tokenizer it was trained with (written by an older "
            f"llmtrain); decoding with {data.tokenizer_file} (the dataset {data.prefix}'s) unchecked.",
            file=sys.stderr,
        )
        return
    if data.tokenizer_sha256 is not None and record["sha256"] != data.tokenizer_sha256:
        raise DataError(
            f"{ckpt} was trained with the tokenizer {record.get('file')} (sha256 {record['sha256'][:16]}..., "
            f"vocabulary {record.get('vocab_size')}), but the run's dataset {data.prefix} now has "
            f"{data.tokenizer_file} (sha256 {data.tokenizer_sha256[:16]}..., vocabulary {data.vocab_size}): it "
            "was re-prepared with another tokenizer, and the model's token ids would be decoded wrongly. Point "
            "data.datasets in the run's config.yaml back at a dataset prepared with the training tokenizer."
        )


def sample_from_run(
    run_dir: str | Path,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int,
) -> str:
    """``prompt`` and its continuation sampled from the newest checkpoint of ``run_dir`` (``seed`` fixes the
    draws; ``temperature`` 0 is greedy)."""
    from llmtrain.generate import generate

    model, tok, _ = load_for_generation(run_dir)
    gen = torch.Generator().manual_seed(seed)
    ids = tok.encode(prompt)
    trained = model.args.seq_length
    if len(ids) + max_new_tokens > trained:
        print(
            f"llmtrain: warning: the prompt ({len(ids)} tokens) plus --max-new-tokens {max_new_tokens} is longer "
            f"than the {trained} tokens the model was trained on (model.seq_length); the text past that is "
            "likely poor.",
            file=sys.stderr,
        )
    out = generate(
        model,
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=tok.eos_id,
        generator=gen,
    )
    return prompt + tok.decode(out)

"""``llmtrain export CKPT_OR_RUN_DIR --to hf OUT``: a checkpoint as a Hugging Face model directory.

The source is a run directory (its newest committed checkpoint is used) or one checkpoint directory inside it;
the model is rebuilt from the run's ``config.yaml`` exactly as ``llmtrain generate`` does, its weights loaded
from DCP without a process group (any saved layout reshards to one process), and written by
``models.hf_io.save_hf``: safetensors (sharded above ``--max-shard-gb``), config.json, generation_config.json
and the run's tokenizer. ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` then gives our logits.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmtrain.errors import ConfigError

FORMATS = ("hf",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="run directory, or a checkpoint directory (…/checkpoints/step_N)")
    parser.add_argument("--to", default="hf", help="output format: hf (Hugging Face safetensors)")
    parser.add_argument("out", help="output directory")
    parser.add_argument("--max-shard-gb", type=float, default=4.0, help="largest safetensors file")


def export_hf(source: str | Path, out: str | Path, max_shard_bytes: int = 4 << 30) -> list[Path]:
    """Export ``source`` (run or checkpoint directory) to the HF directory ``out``; returns the files written."""
    from llmtrain.models.hf_io import save_hf
    from llmtrain.train.sample import load_for_generation

    model, tok, _ = load_for_generation(source)
    return save_hf(
        model.state_dict(),
        model.args,
        out,
        tokenizer_file=tok.path,
        eos_id=tok.eos_id,
        bos_id=tok.bos_id,
        max_shard_bytes=max_shard_bytes,
    )


def main(args: argparse.Namespace) -> int:
    if args.to not in FORMATS:
        raise ConfigError(f"export --to {args.to!r} is not supported; valid: {', '.join(FORMATS)}.")
    if args.max_shard_gb <= 0:
        raise ConfigError(f"export --max-shard-gb must be positive, got {args.max_shard_gb}.")
    files = export_hf(args.source, args.out, int(args.max_shard_gb * (1 << 30)))
    total = sum(f.stat().st_size for f in files)
    print(f"exported {args.source} -> {args.out}: {len(files)} files, {total / 1e6:.1f} MB")
    for f in files:
        print(f"  {f.name}")
    return 0

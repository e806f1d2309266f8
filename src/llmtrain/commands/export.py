"""``llmtrain export CKPT_OR_RUN_DIR --to hf OUT [--dtype fp32|bf16|fp16]``: a checkpoint as a Hugging Face model
directory.

Checks the flags, calls :func:`llmtrain.export.export_hf` (see that package: what is written, the dtype
default, the atomic placement) and prints the files written.
"""

from __future__ import annotations

import argparse

from llmtrain.commands.flags import float_in
from llmtrain.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="run directory, or a checkpoint directory (…/checkpoints/step_N)")
    parser.add_argument("--to", default="hf", help="output format: hf (Hugging Face safetensors)")
    parser.add_argument("out", help="output directory: new, empty, or an earlier export (replaced whole)")
    parser.add_argument(
        "--max-shard-gb", type=float_in(0, low_open=True), default=4.0, help="largest safetensors file (GiB)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="weights dtype: fp32, bf16 or fp16 (default: the imported model's dtype for an init_from: hf: "
        "run, else fp32, the master weights' dtype)",
    )


def main(args: argparse.Namespace) -> int:
    from llmtrain.export import DTYPES, FORMATS, export_hf

    if args.to not in FORMATS:
        raise ConfigError(f"export --to {args.to!r} is not supported; valid: {', '.join(FORMATS)}.")
    if args.max_shard_gb <= 0:
        raise ConfigError(f"export --max-shard-gb must be positive, got {args.max_shard_gb}.")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ConfigError(f"export --dtype {args.dtype!r} is not supported; valid: {', '.join(DTYPES)}.")
    shard_bytes = max(
        1, int(min(args.max_shard_gb, 2.0**62 / (1 << 30)) * (1 << 30))
    )  # finite, > 0: the flag
    files = export_hf(args.source, args.out, shard_bytes, args.dtype)
    total = sum(f.stat().st_size for f in files)
    print(f"exported {args.source} -> {args.out}: {len(files)} files, {total / 1e6:.1f} MB")
    for f in files:
        print(f"  {f.name}")
    return 0

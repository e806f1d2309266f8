"""``llmtrain prepare``: raw text -> cleaned, filtered, deduplicated, tokenized, packed Megatron shards.

    llmtrain prepare --input PATHS... --output PREFIX (--tokenizer FILE | --train-tokenizer VOCAB_SIZE)
        [--config RUN.yaml] [--clean] [--filter] [--dedup none|exact|near] [--pack concat|bestfit]
        [--seq-length T] [--num-shards N] [--workers N] [--on-error raise|skip] [--rejects FILE]
        [--partition I/N] [--text-key text] [--eos-token TOKEN] [--max-documents N] [--overwrite]
        [--mindrecord-field input_ids]
        [--engine local|ray] [--ray-address ADDR] [--partitions P] [--buckets B] [--stage S [--task K]]
    llmtrain prepare --plan PATHS... [--tokenizer FILE] [--dedup ...] [--plan-cores 1,16,64] [--plan-hours 12]

``--dedup`` runs the staged path (``data/prep/stages``): ``--engine`` picks where its tasks run, ``--stage S
--task K`` runs one task for a scheduler (scripts/prepare_staged_slurm.sh), ``--plan`` only estimates the time
and disk of a run from rates measured on a sample of the inputs. The flags, merged over the ``data.prepare`` section of ``--config`` (a flag given wins), become the arguments
of :func:`llmtrain.data.prep.prepare.prepare`, which does the work (stages, resume, partitions: see there).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from llmtrain.commands.flags import int_at_least, output_prefix
from llmtrain.errors import ConfigError

if TYPE_CHECKING:
    from llmtrain.data.prep.job import Partition


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the ``prepare`` subcommand (flags override the ``data.prepare`` section of ``--config``)."""
    a = parser.add_argument
    a(
        "--input",
        nargs="+",
        metavar="PATH",
        help="jsonl/txt/parquet files (.gz/.zst), globs, dirs; or a MindRecord dataset (NAME.mindrecord, NAME0)",
    )
    a(
        "--output",
        metavar="PREFIX",
        type=output_prefix,
        help="writes PREFIX[_NNNNN].bin/.idx, manifest, report",
    )
    a("--tokenizer", metavar="FILE", help="tokenizer.json (HF tokenizers) or .model (SentencePiece)")
    a(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB_SIZE",
        help="train a byte-level BPE on the inputs instead",
    )
    a("--config", metavar="YAML", help="run config whose data.prepare section sets the stages")
    a("--text-key", default="text", help="JSON field / parquet column holding the text (default: text)")
    a("--workers", type=int, default=1, help="worker processes (default: 1)")
    a("--eos-token", help="token appended after each document (default: the tokenizer's EOS)")
    a("--max-documents", type=int, help="stop after this many input documents")
    a("--clean", action="store_true", default=None, help="normalize Unicode, control chars, whitespace")
    a("--mojibake", action="store_true", default=None, help="also repair UTF-8 decoded as cp1252")
    a("--filter", action="store_true", default=None, help="Gopher quality/repetition filters")
    a("--dedup", choices=["none", "exact", "near"], help="deduplication (default: none)")
    a("--pack", choices=["concat", "bestfit"], help="packing (default: concat)")
    a("--seq-length", type=int, help="sample length to pack for (default: 2048)")
    a("--num-shards", type=int_at_least(1), help="number of .bin/.idx shards (default: 1)")
    a("--on-error", choices=["raise", "skip"], help="malformed input: stop with an error, or skip and count")
    a("--rejects", metavar="FILE", help="write rejected documents with reasons to this jsonl file")
    a(
        "--partition",
        metavar="I/N",
        help="process partition I of N (0-based); join them with `llmtrain merge`",
    )
    a("--overwrite", action="store_true", help="replace an existing dataset made with another tokenizer")
    a(
        "--mindrecord-field",
        metavar="NAME",
        help="MindRecord input: the field of token ids, one pre-packed sample per row (default: input_ids)",
    )
    g = parser.add_argument_group("staged dedup (the path of --dedup; docs/data.md)").add_argument
    g(
        "--engine",
        choices=["local", "ray"],
        help="where the stage tasks run (default: local, --workers processes)",
    )
    g("--ray-address", metavar="ADDR", help="join this Ray cluster (default: a local Ray of --workers CPUs)")
    g(
        "--partitions",
        type=int_at_least(1),
        metavar="P",
        help="tasks of stages 1 and 4 (default: from files, workers)",
    )
    g(
        "--buckets",
        type=int_at_least(1),
        metavar="B",
        help="hash buckets of band keys: tasks of stage 2 (default: P)",
    )
    g("--stage", type=int, choices=range(1, 6), metavar="S", help="run only stage S: 1 screen, 2 pairs, 3 components, "
      "4 tokenize, 5 write (a scheduler's job)")  # fmt: skip
    g("--task", type=int_at_least(0), metavar="K", help="with --stage: run only task K (an array index)")
    g("--plan", nargs="+", metavar="PATH", help="estimate time and disk for these inputs, then exit")
    g("--plan-cores", default="1,16,64,256,1024", metavar="N,N..", help="core counts --plan prints")
    g("--plan-hours", type=float, default=12.0, metavar="H", help="--plan: cores needed to finish in H hours")


FLAG_OPTIONS = ("text_key", "clean", "mojibake", "filter", "dedup", "pack", "seq_length", "num_shards",
                "on_error", "rejects")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """Run ``prepare`` (or, with ``--plan``, its estimate) from parsed flags; returns the exit code."""
    from llmtrain.data.prep.prepare import prepare

    if args.plan:
        from llmtrain.data.prep.stages.plan import print_plan

        print_plan(args.plan, args, _options(args))
        return 0
    if not args.input or not args.output:
        raise ConfigError(
            "prepare needs --input PATHS... and --output PREFIX (or --plan PATHS... for an estimate only)."
        )
    prepare(
        inputs=args.input,
        output=args.output,
        tokenizer=args.tokenizer,
        train_tokenizer=args.train_tokenizer,
        workers=args.workers,
        eos_token=args.eos_token,
        max_documents=args.max_documents,
        options=_options(args),
        partition=parse_partition(args.partition) if args.partition else None,
        overwrite=args.overwrite,
        mindrecord_field=args.mindrecord_field,
        stages={k: getattr(args, k) for k in STAGE_FLAGS if getattr(args, k) is not None} or None,
    )
    return 0


STAGE_FLAGS = ("engine", "ray_address", "partitions", "buckets", "stage", "task")


def _options(args: argparse.Namespace):
    """The PrepareOptions of the flags over the ``data.prepare`` section of ``--config``."""
    from llmtrain.data.prep.pipeline import options_from

    section: dict = {}
    if args.config:
        section = _prepare_section(args.config)
    for name in FLAG_OPTIONS:
        if name == "text_key" and args.text_key == "text" and "text_key" in section:
            continue  # the flag's default does not override the config
        if getattr(args, name, None) is not None:
            section[name] = getattr(args, name)
    return options_from(section)


def _prepare_section(path: str) -> dict:
    """The ``data.prepare`` mapping of a run config (bounded safe YAML); ConfigError naming the file otherwise."""
    from pathlib import Path

    from llmtrain.config.loader import check_section, read_yaml
    from llmtrain.data.prep.pipeline import PrepareOptions

    data = read_yaml(Path(path)).get("data") or {}
    section = data.get("prepare") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(section or {}, dict):
        raise ConfigError(f"--config {path}: data.prepare must be a mapping of prepare options.")
    # types and number ranges as for any config section (config/ranges.py): no num_shards 1e9 loop
    return check_section(PrepareOptions, dict(section or {}), "data.prepare.", f"--config {path}")


def parse_partition(text: str) -> Partition:
    """``"I/N"`` -> Partition(I, N); ConfigError unless 0 <= I < N."""
    from llmtrain.data.prep.job import Partition

    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ConfigError(f"--partition {text!r}: expected I/N with 0 <= I < N, for example 0/4.")
    return Partition(i, n)

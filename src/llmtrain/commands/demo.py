"""``llmtrain demo [--input FILES] [--output-dir DIR] [--vocab-size N] [--prompt TEXT] [overrides]``.

The first thing a newcomer runs, end to end on the CPU in a few minutes: prepare (the stdlib sources, or
``--input``), train the ``demo`` flavor, sample; :func:`llmtrain.demo.run_demo` does it (see that module).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", nargs="+", default=None, help="text/jsonl files (default: the stdlib sources)"
    )
    parser.add_argument("--output-dir", default="runs/demo", help="run directory (default: runs/demo)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary trained on the corpus")
    parser.add_argument("--prompt", default="def ", help="prompt of the sample printed at the end")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.max_steps=50")


def main(args: argparse.Namespace) -> int:
    from llmtrain.demo import run_demo

    run_demo(args.output_dir, args.input, args.vocab_size, args.prompt, args.overrides)
    return 0

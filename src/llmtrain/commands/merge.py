"""``llmtrain merge``: join the partitions written by ``prepare --partition I/N`` into one dataset.

    llmtrain merge --output PREFIX [--num-shards N] [--pack concat|bestfit] [--seq-length T] [--keep-partitions]

Calls :func:`llmtrain.data.prep.merge.merge` (cross-partition dedup, packing, sharding: see there).
"""

from __future__ import annotations

import argparse

from llmtrain.commands.flags import int_at_least


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the ``merge`` subcommand."""
    parser.add_argument("--output", required=True, metavar="PREFIX", help="the --output given to prepare")
    parser.add_argument("--num-shards", type=int_at_least(1), help="shards to write (default: prepare's)")
    parser.add_argument("--pack", choices=["concat", "bestfit"], help="packing (default: prepare's)")
    parser.add_argument(
        "--seq-length", type=int_at_least(1), help="sample length for packing (default: prepare's)"
    )
    parser.add_argument("--keep-partitions", action="store_true", help="keep PREFIX.partitions/ afterwards")


def main(args: argparse.Namespace) -> int:
    """Run ``merge`` from parsed flags; returns the exit code."""
    from llmtrain.data.prep.merge import merge

    merge(args.output, args.num_shards, args.pack, args.seq_length, keep_partitions=args.keep_partitions)
    return 0

"""``llmtrain check CONFIG.yaml [section.key=value ...] [--world-size N]``: validate a config, print it resolved.

Prints the resolved config, the derived figures and the adapter's notes and warnings; what is checked and
printed, and where the world size comes from, is :func:`llmtrain.check.print_check`'s (see that module).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (native sections or the MindFormers flat layout)")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value",
        help="dotted overrides in native names, applied after the file (e.g. train.lr=1e-3)",
    )  # fmt: skip
    parser.add_argument(
        "--world-size", type=int, default=None,
        help="number of processes to check for (default: $WORLD_SIZE, else the product of the degrees)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from llmtrain.check import print_check

    print_check(args.config, args.overrides, args.world_size)
    return 0

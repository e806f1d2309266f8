"""Argument types shared by the commands: a bad number or path is refused by argparse (exit 2, the flag named,
what would be valid) before anything runs, instead of being taken as a default or failing later."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def float_in(low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """A finite number in [low, high] (``low_open``: (low, high])."""
    shown = (
        f"{'(' if low_open else '['}{low:g}, {high:g}]"
        if high != math.inf
        else f"{'>' if low_open else '>='} {low:g}"
    )

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {shown}, got {text!r}") from None
        if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
            raise argparse.ArgumentTypeError(f"expected a finite number {shown}, got {text!r}")
        return value

    parse.__name__ = f"number {shown}"
    return parse


def output_prefix(text: str) -> str:
    """A dataset prefix: a non-empty file name part (``''`` or ``dir/`` would write hidden files ``.bin``...)."""
    if not text.strip() or text.endswith(("/", "\\")) or text.rstrip("/").endswith("/."):
        raise argparse.ArgumentTypeError(
            f"expected a path prefix such as data/corpus (files corpus.bin, corpus.idx, ... are written), got {text!r}"
        )
    return text


def node_range(text: str) -> str:
    """``N`` or ``MIN:MAX`` with 1 <= MIN <= MAX (torchrun's --nnodes), kept as written."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low, high = 0, 0
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(
            f"expected a node count N >= 1 or an elastic range MIN:MAX with 1 <= MIN <= MAX, got {text!r}"
        )
    return text

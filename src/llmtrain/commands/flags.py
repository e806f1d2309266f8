"""Argument types shared by the commands: a bad number or path is refused by argparse (exit 2, the flag named,
what would be valid) before anything runs, instead of being taken as a default or failing later."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer >= ``low`` (and <= ``high`` where given)."""
    shown = f">= {low}" if high is None else f"in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {shown}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected an integer {shown}, got {value}")
        return value

    parse.__name__ = f"integer {shown}"
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


def name_token(text: str) -> str:
    """A rendezvous id or host name: non-empty, letters, digits and ``._-:`` only (no spaces, no slashes)."""
    if not re.fullmatch(r"[A-Za-z0-9._:\[\]-]+", text or ""):
        raise argparse.ArgumentTypeError(
            f"expected a non-empty name of letters, digits and . _ - : (no spaces or slashes), got {text!r}"
        )
    return text


RDZV_NUMBERS = ("join_timeout", "last_call_timeout", "close_timeout", "timeout", "read_timeout",
                "keep_alive_interval", "keep_alive_max_attempt", "heartbeat_timeout")  # fmt: skip
RDZV_BOOLS = ("is_host", "use_agent_store")


def rdzv_conf(text: str) -> str:
    """torchrun's ``--rdzv-conf``: ``key=value,...`` with the timeouts and counts of :data:`RDZV_NUMBERS`
    finite numbers > 0 and :data:`RDZV_BOOLS` true/false; kept as written."""
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise argparse.ArgumentTypeError(
                f"expected key=value[,key=value...] (e.g. join_timeout=600,last_call_timeout=30), got {text!r}"
            )
        if key in RDZV_NUMBERS:
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if not 0 < number < math.inf:
                raise argparse.ArgumentTypeError(f"{key} must be a finite number > 0, got {value!r}")
        elif key in RDZV_BOOLS and value.lower() not in ("true", "false", "1", "0"):
            raise argparse.ArgumentTypeError(f"{key} must be true or false, got {value!r}")
    return text


def check_launch_flags(args: argparse.Namespace) -> None:
    """The launch flags that only mean something together: a single-node launch (``--nnodes 1``, no
    ``--master-addr``) uses no rendezvous, so ``--run-id``, ``--rdzv-conf``, ``--master-port`` and a
    ``--node-rank`` other than 0 would be ignored: refused; so is ``--connect-timeout`` without a remote host to
    wait for (``--master-addr`` or ``--lighthouse``); a static job's ``--node-rank`` must be below ``--nnodes``."""
    from llmtrain.errors import ConfigError

    single = args.nnodes in ("1", "1:1") and args.master_addr is None
    if single:
        used = (
            ("--run-id", args.run_id),
            ("--rdzv-conf", args.rdzv_conf),
            ("--master-port", args.master_port),
        )
        for flag, value in used:
            if value is not None:
                raise ConfigError(
                    f"launch {flag} {value!r} is used only by a multi-node rendezvous (--nnodes N or MIN:MAX with "
                    "--master-addr); a single-node launch would ignore it: remove it."
                )
    remote = args.master_addr is not None or getattr(args, "lighthouse", None) is not None
    if args.connect_timeout is not None and not remote:
        raise ConfigError(
            f"launch --connect-timeout {args.connect_timeout:g} is the wait for a remote --master-addr or "
            "--lighthouse to answer; this launch has neither, so it would be ignored: remove it."
        )
    high = int(args.nnodes.split(":")[-1])
    if args.node_rank is not None and args.node_rank >= high:
        raise ConfigError(
            f"launch --node-rank {args.node_rank} is not below --nnodes {args.nnodes}: node ranks run from 0 to "
            f"{high - 1}."
        )


# The seed's `run_llm_pretrain.py` / `run_mindformer.py` flags (pretrain.sh: `mpirun -n N python
# run_llm_pretrain.py --config X --dataset_dir D --save_dir S --load_ckpt C`): each one that has a config key
# becomes a dotted override placed before the user's own (so an explicit `section.key=value` wins); the rest are
# refused by name with the llmtrain equivalent. Underscore and dash spellings are both accepted.
SEED_FLAGS = {
    "save_dir": ("checkpoint.save_dir", "where checkpoints go (checkpoint.save_dir)"),
    "load_ckpt": ("checkpoint.resume", "checkpoint directory to start from (checkpoint.resume=PATH)"),
    "dataset_dir": ("data.datasets", "dataset prefix, or a directory holding exactly one (data.datasets)"),
    "auto_resume": ("checkpoint.resume", "True: resume from the newest checkpoint (checkpoint.resume=auto)"),
}
REFUSED_SEED_FLAGS = {
    "use_parallel": "the layout comes from the parallel: section and the launcher's world size",
    "run_mode": "`llmtrain train` trains; evaluation is `llmtrain eval`, generation `llmtrain generate`",
}


def add_seed_flags(parser: argparse.ArgumentParser) -> None:
    """``--config`` and the seed's flags of :data:`SEED_FLAGS` / :data:`REFUSED_SEED_FLAGS` on ``parser``."""
    parser.add_argument(
        "--config", dest="config_flag", default=None, help="YAML config file (the seed's spelling)"
    )
    for name, (_, text) in SEED_FLAGS.items():
        parser.add_argument(
            f"--{name}", f"--{name.replace('_', '-')}", dest=f"seed_{name}", default=None, help=text
        )
    for name in REFUSED_SEED_FLAGS:
        parser.add_argument(
            f"--{name}",
            f"--{name.replace('_', '-')}",
            dest=f"seed_{name}",
            default=None,
            help=argparse.SUPPRESS,
        )


def _truth(flag: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    from llmtrain.errors import ConfigError

    raise ConfigError(f"--{flag} {text!r}: expected True or False.")


def _dataset_prefix(path: str) -> str:
    """``--dataset_dir``: a dataset prefix as is, or the one prefix (``*.idx``) inside a directory."""
    import os
    from pathlib import Path

    from llmtrain.errors import ConfigError

    p = Path(path)
    if not p.is_dir():
        return path  # a prefix (PREFIX.bin / .idx): checked with the rest of the data section
    prefixes = sorted({str(f)[: -len(".idx")] for f in p.glob("*.idx")})
    if len(prefixes) == 1:
        return prefixes[0]
    found = ", ".join(os.path.basename(x) for x in prefixes[:5]) or "none"
    raise ConfigError(
        f"--dataset_dir {path}: expected a dataset prefix (PREFIX.bin + PREFIX.idx, as `llmtrain prepare "
        f"--output` writes) or a directory holding exactly one; found {len(prefixes)} prefixes there ({found}). "
        "List several with their weights in data.datasets: [{path: PREFIX, weight: W}, ...]."
    )


def seed_flag_overrides(args: argparse.Namespace) -> tuple[str, list[str]]:
    """(config file, overrides) from the positional config or ``--config`` and the seed's flags."""
    import json

    from llmtrain.errors import ConfigError

    config, flag = getattr(args, "config", None), getattr(args, "config_flag", None)
    overrides = list(getattr(args, "overrides", []))
    # with --config, argparse takes the first dotted override for the positional CONFIG: give it back
    if flag is not None and config is not None and "=" in config:
        config, overrides = None, [config, *overrides]
    if config is not None and flag is not None:
        raise ConfigError(f"the config is given twice ({config} and --config {flag}); give it once.")
    config = config if config is not None else flag
    if config is None:
        raise ConfigError(
            "no config file: give it as `llmtrain train CONFIG.yaml` or `--config CONFIG.yaml`."
        )
    for name, why in REFUSED_SEED_FLAGS.items():
        if getattr(args, f"seed_{name}", None) is not None:
            raise ConfigError(f"--{name} has no llmtrain equivalent: {why}. Remove it.")
    out: list[str] = []
    if getattr(args, "seed_auto_resume", None) is not None:
        auto = _truth("auto_resume", args.seed_auto_resume)
        out.append(f"checkpoint.resume={'auto' if auto else 'none'}")
    if getattr(args, "seed_load_ckpt", None) is not None:
        out.append(f"checkpoint.resume={json.dumps(args.seed_load_ckpt)}")
    if getattr(args, "seed_save_dir", None) is not None:
        out.append(f"checkpoint.save_dir={json.dumps(args.seed_save_dir)}")
    if getattr(args, "seed_dataset_dir", None) is not None:
        prefix = _dataset_prefix(args.seed_dataset_dir)
        out.append(f"data.datasets={json.dumps([{'path': prefix, 'weight': 1.0}])}")
    return config, [*out, *overrides]

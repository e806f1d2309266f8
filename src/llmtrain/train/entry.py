"""``llmtrain train CONFIG.yaml [section.key=value ...]``: validate, then run the trainer.

Works as a plain process or under ``torchrun`` (the launcher sets RANK/WORLD_SIZE).
"""

from __future__ import annotations

import argparse
import json
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-3 run.output_dir=runs/x"
    )


def main(args: argparse.Namespace) -> int:
    from llmtrain.config import load_config, validate
    from llmtrain.train.trainer import Trainer

    cfg, notes = load_config(args.config, args.overrides)
    warnings = validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")), require_data=True)
    trainer = Trainer(cfg, notes=[*notes, *warnings])
    result = trainer.fit()
    print(json.dumps({"run_dir": str(trainer.run_dir), **result}))
    return 0

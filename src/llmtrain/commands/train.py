"""``llmtrain train CONFIG.yaml [section.key=value ...]``: validate, then run the trainer.

Works as a plain process or under ``torchrun`` (the launcher sets RANK/WORLD_SIZE). However the run ends, it
ends the same way: the trainer's background work is finished (success, preemption) or abandoned (an error),
its threads are joined, and the process groups are destroyed before the interpreter shuts down
(``shutdown_distributed``: a gloo worker thread outliving the interpreter aborts the process). Exit codes
(docs/reliability.md): 0 finished, 2 bad input, 3 diverged (the stability guard gave up), 75 preempted (saved;
run the same command again to resume), 124 hang watchdog; 1 for anything else.

The rank comes from whichever launcher started the process (torchrun, mpirun, srun:
:func:`llmtrain.distributed.env.rank_env`). The seed's ``run_llm_pretrain.py`` flags are accepted where they map
onto config keys (``--config``, ``--save_dir``, ``--load_ckpt``, ``--dataset_dir``, ``--auto_resume``; see
:func:`llmtrain.commands.flags.add_seed_flags`), so ``mpirun -n N llmtrain train --config X --save_dir D`` works
as the seed's launch line did. ``--overwrite`` (``checkpoint.overwrite=true``) is the explicit word that lets
``checkpoint.resume: none`` (or the seed's ``--auto_resume False``) start over in an output folder that holds
committed checkpoints; without it such a start is refused (exit 2) and nothing is changed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import TYPE_CHECKING

from llmtrain.commands.flags import add_seed_flags, seed_flag_overrides
from llmtrain.errors import PREEMPTED_EXIT_CODE

if TYPE_CHECKING:
    from llmtrain.train.trainer import Trainer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None, help="YAML config file (or --config FILE)")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-3 run.output_dir=runs/x"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="with checkpoint.resume: none, start over in an output folder that holds committed checkpoints (they "
        "are replaced by this run's first checkpoint); the same as checkpoint.overwrite=true",
    )
    add_seed_flags(parser)


def main(args: argparse.Namespace) -> int:
    from llmtrain.distributed.orphan import stop_with_parent

    stop_with_parent()  # under torchrun: a worker whose agent died stops by itself (distributed/orphan.py)
    from llmtrain.config import load_config
    from llmtrain.distributed.device import shutdown_distributed
    from llmtrain.distributed.env import rank_env
    from llmtrain.resolve import validate
    from llmtrain.train.trainer import Trainer

    config, overrides = seed_flag_overrides(args)
    if getattr(args, "overwrite", False):  # before the user's own overrides: an explicit key=value wins
        overrides = ["checkpoint.overwrite=true", *overrides]
    world_size = rank_env().world_size  # torchrun, mpirun or srun: sets RANK, WORLD_SIZE, ... for env://
    cfg, notes = load_config(config, overrides)
    warnings = validate(cfg, world_size=world_size, require_data=True)
    trainer = None
    try:
        trainer = Trainer(cfg, notes=[*notes, *warnings])
        result = trainer.fit()
        trainer.close(ok=True)
    except BaseException as e:
        clean = _close_quietly(trainer)
        if (
            not clean
        ):  # a thread still runs (e.g. a save waiting on a failed peer): skip the interpreter's shutdown
            _hard_exit(e)
        shutdown_distributed(barrier=False)
        raise
    shutdown_distributed(barrier=True)
    print(json.dumps({"run_dir": str(trainer.run_dir), **result}), flush=True)
    return PREEMPTED_EXIT_CODE if result.get("preempted") else 0


def _close_quietly(trainer: Trainer | None) -> bool:
    """The error path's close: never masks the error that is ending the run."""
    if trainer is None:
        return True
    try:
        return trainer.close(ok=False)
    except Exception:  # the original error is what the user must see
        return False


def _hard_exit(error: BaseException) -> None:
    """End the process now (``os._exit``), after saying why: used only when a background thread would not stop."""
    from llmtrain.errors import user_message

    known = user_message(error)
    if known is not None:
        code = known[1]
        sys.stderr.write(f"llmtrain train: error: {known[0]}\n")  # one write: ranks share a pipe
        sys.stderr.flush()
    else:
        code = 130 if isinstance(error, KeyboardInterrupt) else 1
        traceback.print_exception(error)
    print(
        "llmtrain train: a background thread did not stop; exiting without waiting for it.", file=sys.stderr
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

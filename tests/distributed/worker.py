"""Runs under torchrun: trains several parallel layouts of the same run, one after another, in one launch.

    python -m torch.distributed.run --standalone --nproc-per-node N worker.py SPEC.json OUT.json

SPEC: {"base": config dict, "steps": k, "variants": {name: nested overrides}}. For every variant every rank
builds a Trainer (sharing the process group) and takes k steps; rank 0 writes {name: {"loss": [...],
"grad_norm": [...]}} to OUT. Launching once per world size keeps the suite fast (torch import ~2 s/process).
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile

import torch
import torch.distributed as dist

from llmtrain.config import config_from_dict
from llmtrain.distributed.device import shutdown_distributed
from llmtrain.train.trainer import Trainer


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    torch.set_num_threads(1)
    results = {}
    for name, over in spec["variants"].items():
        over = dict(over)
        save_after = over.pop("save_after_steps", False)  # True: checkpoint after the steps (resume tests)
        with_val = over.pop("validate", False)  # True: also report the validation loss after the steps
        dump = over.pop("dump_state", None)  # PATH: rank 0 torch.saves the full (gathered) model state dict
        cfg = merge(spec["base"], over)
        cfg["run"]["output_dir"] = tempfile.mkdtemp(prefix=f"parity-{name}-")
        trainer = Trainer(config_from_dict(cfg))
        outs = [trainer.train_step() for _ in range(spec["steps"])]
        results[name] = {"loss": [o["loss"] for o in outs], "grad_norm": [o["grad_norm"] for o in outs]}
        if save_after:
            trainer.save()
            trainer.checkpointer.wait()
        if with_val:
            results[name]["val_loss"] = trainer.validate()["val_loss"]
        if dump:
            state = {k: getattr(v, "full_tensor", v.detach)() for k, v in trainer.model.state_dict().items()}
            if dist.get_rank() == 0:
                torch.save(state, dump)
        trainer.metrics.close()
        dist.barrier()
    if dist.get_rank() == 0:
        json.dump(results, open(sys.argv[2], "w"))
    shutdown_distributed(barrier=True)  # the trainer's own exit: every rank, then every group destroyed


if __name__ == "__main__":
    main()

"""Runs under torchrun: trains several parallel layouts of the same run, one after another, in one launch.

    python -m torch.distributed.run --standalone --nproc-per-node N worker.py SPEC.json OUT.json

SPEC: {"base": config dict, "steps": k, "variants": {name: nested overrides}}. For every variant every rank
builds a Trainer (sharing the process group) and takes k steps; rank 0 writes {name: {"loss": [...],
"grad_norm": [...], "step_s": [...]}} to OUT (step_s: rank 0's wall seconds per step, for the record).
Launching once per world size keeps the suite fast (torch import ~2 s/process).

Variant options (popped before the config is merged): ``count_comm`` (True: the bytes every collective of
torch.distributed's API moves, per step and per call name, from wrapped real calls: ``CommCounter``),
``fp8_emulate`` (True: torchao's emulated fp8 GEMMs, so train.fp8 runs on CPU), ``memory_peak`` (True: two more
steps under torch's MemTracker, the model and optimizer tracked; every rank's peak bytes of live tensors, the
smaller of the two, in ``memory_peak``; ``"no_module_hooks"``: without its module tracking, for the zero-bubble
schedules), plus those below.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time

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


class CommCounter:
    """Wraps torch.distributed's collectives (the names FSDP2 and the trainer call through ``dist.``) and sums
    the bytes of each call's largest tensor: the full payload (all-reduce: the tensor; reduce-scatter: its
    input; all-gather: its output). ``counting`` switches it on only around the train steps."""

    NAMES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
             "all_gather_single", "all_to_all_single", "broadcast")  # fmt: skip

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.counting = False
        for name in self.NAMES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            if self.counting:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                size = max((t.numel() * t.element_size() for t in tensors), default=0)
                self.bytes[name] = self.bytes.get(name, 0) + size
                self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted

    def take(self) -> dict:
        out = {"bytes": dict(self.bytes), "calls": dict(self.calls)}
        self.bytes.clear()
        self.calls.clear()
        return out


def step_peak(trainer: Trainer, module_hooks: bool = True) -> list[dict[str, int]]:
    """Every rank's peak bytes of live tensors over a training step (MemTracker, as tests/test_plan.py measures
    one process; the smaller of two steps): ``Total`` and its split by kind at that moment as MemTracker labels
    them (without module tracking activations and temporaries are one kind)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        """A root module called again in the same step (the next micro-batch, the next pipeline micro-batch)
        starts its per-module statistics afresh; the global peak, the figure read here, is kept. No gradient
        hooks on the parameters (they only label gradients, which are counted as allocated anyway)."""

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):  # noqa: ANN001, ANN202
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

        def _pre_fw_hook(self, module, inputs):  # noqa: ANN001, ANN202
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                self.memory_tracking.pop(module, None)
                super()._pre_fw_hook(module, inputs)

    class _NoModules:
        """Stands in for MemTracker's module tracker where the zero-bubble schedules run: their input-only
        ``autograd.grad`` refuses the module hooks' gradient hooks. Without hooks only the tensors made under
        the tracker are counted (module inputs made elsewhere are not): a lower bound."""

        is_bw = False
        parents = {"Global"}

        def register_user_hooks(self, *hooks: object) -> None: ...

        def clear_user_hooks(self) -> None: ...

        def __enter__(self) -> _NoModules:
            return self

        def __exit__(self, *args: object) -> None: ...

    snaps = []
    # the smaller of two steps' peaks: one step's late asynchronous free is not the layout's
    for _ in range(2):
        tracker = StepTracker()
        if not module_hooks:
            tracker._mod_tracker = _NoModules()  # type: ignore[assignment]
        tracker.track_external(trainer.model, trainer.optimizer)
        with tracker:
            trainer.train_step()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
        snaps.append({str(k): int(v) for k, v in peak.items()})
    snap = min(snaps, key=lambda s: s["Total"])
    if not dist.is_initialized():  # one process: no group to gather over
        return [snap]
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, snap)
    return peaks


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    torch.set_num_threads(1)
    results = {}
    counter = None
    for name, over in spec["variants"].items():
        over = dict(over)
        count_comm = over.pop("count_comm", False)
        if over.pop("fp8_emulate", False):
            from llmtrain.distributed import float8

            float8.EMULATE = True
        if count_comm and counter is None:
            counter = CommCounter()
        save_after = over.pop("save_after_steps", False)  # True: checkpoint after the steps (resume tests)
        with_val = over.pop("validate", False)  # True: also report the validation loss after the steps
        mem_peak = over.pop("memory_peak", False)
        dump = over.pop("dump_state", None)  # PATH: rank 0 torch.saves the full (gathered) model state dict
        cfg = merge(spec["base"], over)
        out_dir = over.get("run", {}).get("output_dir")  # a variant may name its run directory (export tests)
        cfg["run"]["output_dir"] = out_dir or tempfile.mkdtemp(prefix=f"parity-{name}-")
        trainer = Trainer(config_from_dict(cfg))
        outs, comm, step_s = [], [], []
        for _ in range(spec["steps"]):
            if counter is not None:
                counter.counting = count_comm
            start = time.perf_counter()
            outs.append(trainer.train_step())
            step_s.append(time.perf_counter() - start)
            if counter is not None:
                counter.counting = False
                comm.append(counter.take())
        results[name] = {"loss": [o["loss"] for o in outs], "grad_norm": [o["grad_norm"] for o in outs]}
        results[name]["step_s"] = step_s  # rank 0's wall time of each step (for the record, not asserted)
        if outs[0].get("health"):  # the log steps' per-layer health figures (train/health.py)
            results[name]["health"] = [o["health"] for o in outs]
        for key in ("moe_aux_loss", "moe_load_max_over_mean"):  # MoE runs: the logged balance figures
            if key in outs[0]:
                results[name][key] = [o[key] for o in outs]
        if count_comm:
            results[name]["comm"] = comm
        if mem_peak:
            results[name]["memory_peak"] = step_peak(trainer, module_hooks=mem_peak != "no_module_hooks")
        if save_after:
            trainer.save()
            trainer.checkpointer.wait()
        if with_val:
            results[name]["val_loss"] = trainer.validate()["val_loss"]
        if dump:
            state = {k: getattr(v, "full_tensor", v.detach)() for k, v in trainer.model.state_dict().items()}
            if not dist.is_initialized() or dist.get_rank() == 0:
                torch.save(state, dump)
        trainer.metrics.close()
        if dist.is_initialized():  # one process (bench/tp_loss_memory.py's reference) has no group
            dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        json.dump(results, open(sys.argv[2], "w"))
    shutdown_distributed(barrier=True)  # the trainer's own exit: every rank, then every group destroyed


if __name__ == "__main__":
    main()

"""Stability guard: skip non-finite steps, detect loss / grad-norm spikes, plan rollbacks, log every decision.

The trainer feeds :class:`StabilityGuard` once per step with ``(step, loss, grad_norm)`` and acts on the
returned :class:`Decision`:

* ``ok``        nothing to do.
* ``skip``      the loss or gradient norm is NaN/Inf: do not apply the update (the fp16 loss scaler's overflow
                path already skips it); counted. ``max_nonfinite_steps`` in a row turn into a rollback.
* ``rollback``  a spike: ``consecutive`` steps in a row were anomalous under the configured rule. The trainer
                asks :meth:`StabilityGuard.plan` for a :class:`RollbackPlan` (which checkpoint to restore, how
                many batches to skip, an LR factor for a while) and executes it.
* ``give_up``   more than ``max_rollbacks`` rollbacks: stop with the report in ``Decision.reason``.

``watch`` names the metrics: ``loss``, ``grad_norm`` (every step) or any health metric of train/health.py
(``max_layer_grad_norm``, ``grad_norm/layer_03``, ``attn_logit_bound``, ``logit_rms``, ...; all-reduced, the same
on every rank), which exist on log steps only and are judged on those steps.

Spike rules (``rule``), each applied to the metrics in ``watch`` over a window of the last ``window`` *good*
steps (anomalous and skipped steps never enter the window, so a spike does not raise its own baseline):

* ``mad``    value > median + k * 1.4826 * MAD (robust to the noise of a decaying curve);
* ``sigma``  value > mean + k * std;
* ``ratio``  value > r * median, the seed's "N consecutive steps above r x the recent level".

A value counts as anomalous only above ``min_history`` good steps and by more than ``min_rel_increase`` of the
baseline, so a flat, nearly noiseless curve does not trip on a tiny MAD. :class:`HostSnapshot` keeps the newest
good state in host memory (when it fits) so a rollback need not read disk; :class:`EventLog` appends every
decision to ``<run_dir>/events.jsonl`` and echoes it to the console. Everything here is CPU-side bookkeeping:
no collectives; the trainer feeds the same (all-reduced) loss on every rank, so every rank decides alike.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from llmtrain.config.schema import StabilityConfig
from llmtrain.config.survival import check_watch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

OK, SKIP, ROLLBACK, GIVE_UP = "ok", "skip", "rollback", "give_up"
RULES = ("mad", "sigma", "ratio")


@dataclass
class Decision:
    action: str
    step: int
    reason: str = ""
    values: dict[str, float] = field(default_factory=dict)
    first_bad_step: int | None = None

    @property
    def ok(self) -> bool:
        return self.action == OK


@dataclass
class RollbackPlan:
    """Where to go back to and what to skip, from the spike and the checkpoints available."""

    restore_step: int
    skip_batches: int
    lr_factor: float
    lr_until_step: int
    detected_step: int
    first_bad_step: int

    def lr_scale(self, step: int) -> float:
        """Multiplier of the scheduled LR at ``step`` (1.0 outside the lowered window)."""
        return self.lr_factor if self.restore_step < step <= self.lr_until_step else 1.0


def plan_rollback(
    cfg: StabilityConfig, first_bad_step: int, detected_step: int, available_steps: list[int]
) -> RollbackPlan | None:
    """Newest available step at or before ``first_bad_step - 1 - margin_steps`` (state after that step is
    pre-spike), the batches to skip from there (through the detecting step unless ``skip_batches`` is set) and
    the LR window; None when no checkpoint is old enough."""
    limit = first_bad_step - 1 - cfg.margin_steps
    candidates = [s for s in available_steps if s <= limit]
    if not candidates:
        return None
    restore = max(candidates)
    skip = cfg.skip_batches if cfg.skip_batches > 0 else detected_step - restore
    return RollbackPlan(
        restore_step=restore,
        skip_batches=int(skip),
        lr_factor=float(cfg.lr_factor),
        lr_until_step=restore
        + int(cfg.lr_factor_steps),  # steps restart at restore; skipped data is not steps
        detected_step=detected_step,
        first_bad_step=first_bad_step,
    )


class StabilityGuard:
    """Per-step decisions (see the module docstring); ``state_dict`` survives resume (not rollback)."""

    def __init__(self, cfg: StabilityConfig | None = None):
        cfg = cfg if cfg is not None else StabilityConfig()
        if cfg.rule not in RULES:
            raise ValueError(f"stability.rule {cfg.rule!r} is not one of {', '.join(RULES)}")
        check_watch(cfg.watch)
        self.cfg = cfg
        self.history: dict[str, deque[float]] = {m: deque(maxlen=cfg.window) for m in cfg.watch}
        self.bad_run = 0  # anomalous steps in a row
        self._streak: set[str] = set()  # the metrics that were anomalous in the current run of bad steps
        self.first_bad_step: int | None = None
        self.nonfinite_run = 0
        self.skipped_steps = 0
        self.rollbacks = 0
        self.active_plan: RollbackPlan | None = None

    def reconfigure(self, cfg: StabilityConfig) -> None:
        """New thresholds (a stage boundary); the statistics seen so far are kept (the newest ``window``)."""
        if cfg.rule not in RULES:
            raise ValueError(f"stability.rule {cfg.rule!r} is not one of {', '.join(RULES)}")
        check_watch(cfg.watch)
        old = self.history
        self.cfg = cfg
        self.history = {m: deque(old.get(m, ()), maxlen=cfg.window) for m in cfg.watch}

    # ---- the per-step call
    def observe(
        self, step: int, loss: float, grad_norm: float | None = None, metrics: dict[str, Any] | None = None
    ) -> Decision:
        """Decide on step ``step``; ``metrics`` are the step's health figures (train/health.py; log steps only),
        of which the watched ones are judged like the loss (a non-finite one is not added to the window)."""
        values = {"loss": float(loss)}
        if grad_norm is not None:
            values["grad_norm"] = float(grad_norm)
        if not self.cfg.enabled:
            return Decision(OK, step, values=values)
        if not all(math.isfinite(v) for v in values.values()):
            self.skipped_steps += 1
            self.nonfinite_run += 1
            self.first_bad_step = self.first_bad_step if self.nonfinite_run > 1 else step
            if self.nonfinite_run >= self.cfg.max_nonfinite_steps:
                why = f"{self.nonfinite_run} non-finite steps in a row"
                return self._rollback(step, why, values)
            return Decision(SKIP, step, "non-finite loss or gradient norm", values)
        self.nonfinite_run = 0
        for m, v in (metrics or {}).items():
            if m in self.history and isinstance(v, (int, float)) and math.isfinite(v):
                values[m] = float(v)
        anomalies = [m for m in self.history if m in values and self._anomalous(m, values[m])]
        if not anomalies:
            # a streak of a log-step metric is not broken by the steps in between, which do not carry it
            if not self._streak or self._streak & values.keys():
                self.bad_run, self.first_bad_step, self._streak = 0, None, set()
            for m, h in self.history.items():
                if m in values:
                    h.append(values[m])
            return Decision(OK, step, values=values)
        self._streak |= set(anomalies)
        self.bad_run += 1
        if self.bad_run == 1:
            self.first_bad_step = step
        if self.bad_run >= self.cfg.consecutive:
            detail = ", ".join(f"{m} {values[m]:.4g} vs level {self.level(m):.4g}" for m in anomalies)
            return self._rollback(step, f"spike: {self.bad_run} anomalous steps in a row ({detail})", values)
        return Decision(OK, step, f"anomalous ({', '.join(anomalies)}), {self.bad_run} in a row", values)

    def _rollback(self, step: int, why: str, values: dict[str, float]) -> Decision:
        first = self.first_bad_step if self.first_bad_step is not None else step
        self.bad_run, self.nonfinite_run, self.first_bad_step, self._streak = 0, 0, None, set()
        if self.rollbacks >= self.cfg.max_rollbacks:
            report = (
                f"{why} at step {step}, after {self.rollbacks} rollbacks (stability.max_rollbacks = "
                f"{self.cfg.max_rollbacks}); {self.skipped_steps} non-finite steps skipped in total. The run "
                "is unstable: lower train.lr, enable z-loss / QK-norm, or check the data near this step."
            )
            return Decision(GIVE_UP, step, report, values, first)
        self.rollbacks += 1
        return Decision(ROLLBACK, step, why, values, first)

    # ---- statistics
    def level(self, metric: str) -> float:
        h = self.history[metric]
        return statistics.median(h) if h else float("nan")

    def _anomalous(self, metric: str, value: float) -> bool:
        h = self.history[metric]
        if len(h) < max(self.cfg.min_history, 2):
            return False
        med = statistics.median(h)
        if value <= med + abs(med) * self.cfg.min_rel_increase:
            return False
        if self.cfg.rule == "ratio":
            return value > self.cfg.ratio * med
        if self.cfg.rule == "sigma":
            return value > statistics.fmean(h) + self.cfg.k * statistics.pstdev(h)
        mad = statistics.median(abs(x - med) for x in h)
        return value > med + self.cfg.k * 1.4826 * mad

    # ---- rollback bookkeeping
    def plan(self, decision: Decision, available_steps: list[int]) -> RollbackPlan | None:
        """The RollbackPlan for a ``rollback`` decision; remembered so ``lr_scale`` applies it."""
        first = decision.first_bad_step if decision.first_bad_step is not None else decision.step
        plan = plan_rollback(self.cfg, first, decision.step, available_steps)
        self.active_plan = plan
        return plan

    def lr_scale(self, step: int) -> float:
        return self.active_plan.lr_scale(step) if self.active_plan is not None else 1.0

    def state_dict(self) -> dict:
        return {
            "history": {m: list(h) for m, h in self.history.items()},
            "bad_run": self.bad_run,
            "first_bad_step": self.first_bad_step,
            "nonfinite_run": self.nonfinite_run,
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
            "active_plan": asdict(self.active_plan) if self.active_plan is not None else None,
        }

    def load_state_dict(self, sd: dict) -> None:
        for m, values in sd.get("history", {}).items():
            if m in self.history:
                self.history[m].clear()
                self.history[m].extend(values)
        self.bad_run = int(sd.get("bad_run", 0))
        self.first_bad_step = sd.get("first_bad_step")
        self.nonfinite_run = int(sd.get("nonfinite_run", 0))
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        self.rollbacks = int(sd.get("rollbacks", 0))
        plan = sd.get("active_plan")
        self.active_plan = RollbackPlan(**plan) if plan else None


class EventLog:
    """Appends one JSON object per decision to ``<run_dir>/events.jsonl`` and echoes a line to the console."""

    def __init__(self, run_dir: str | Path, echo: Callable[[str], None] | None = print, enabled: bool = True):
        self.path = Path(run_dir) / "events.jsonl"
        self.echo = echo
        self.enabled = enabled

    def write(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), "event": event, **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        if self.echo is not None:
            detail = " ".join(f"{k}={v}" for k, v in fields.items())
            self.echo(f"[{event}] {detail}")


def _tensor_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _copy_to_host(obj: Any) -> Any:
    """Deep copy with every tensor on the CPU; a DTensor keeps only its local shard (and its layout)."""
    import torch

    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local"):  # DTensor: this rank's shard plus what rebuilds it
            dt = cast("DTensor", obj)
            return (
                "dtensor",
                dt.to_local().detach().to("cpu", copy=True),
                dt.device_mesh,
                dt.placements,
                dt.shape,
                dt.stride(),
            )
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _copy_to_host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_to_host(v) for v in obj]
    return obj


def _copy_from_host(obj: Any, device: Any) -> Any:
    import torch

    if isinstance(obj, tuple) and len(obj) == 6 and obj[0] == "dtensor":
        from torch.distributed.tensor import DTensor

        _, local, mesh, placements, shape, stride = obj
        return DTensor.from_local(local.to(mesh.device_type), mesh, placements, shape=shape, stride=stride)
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=True)
    if isinstance(obj, dict):
        return {k: _copy_from_host(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_from_host(v, device) for v in obj]
    return obj


class HostSnapshot:
    """The newest good state (model, optimizer, RNG, trainer state) in host memory, for a rollback that does
    not wait on disk. ``capture`` is a no-op (returns False) when the state exceeds ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.step: int | None = None
        self._state: dict[str, Any] | None = None

    def capture(self, step: int, model: Any, optimizer: Any, trainer_state: dict) -> bool:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from llmtrain.train.checkpoint import rng_state

        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        if _tensor_bytes(state) > self.max_bytes:
            self.step, self._state = None, None
            return False
        device = next(iter(model.parameters())).device
        self._state = {
            **_copy_to_host(state),
            "trainer": json.loads(json.dumps(trainer_state)),
            "rng": rng_state(device.type),
        }
        self.step = step
        return True

    def restore(self, model: Any, optimizer: Any) -> dict:
        """Put the snapshot back in place (and this rank's RNG); returns its trainer state."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        from llmtrain.train.checkpoint import set_rng_state

        if self._state is None:
            raise RuntimeError("HostSnapshot.restore called without a captured snapshot")
        device = next(iter(model.parameters())).device
        set_model_state_dict(model, _copy_from_host(self._state["model"], device))
        set_optimizer_state_dict(model, optimizer, _copy_from_host(self._state["optim"], device))
        set_rng_state(self._state["rng"], device.type)
        return json.loads(json.dumps(self._state["trainer"]))

"""Callbacks: the per-step features around the loop, each a small class with hooks the trainer calls.

``Trainer.fit`` (train/trainer.py) calls, in this order::

    run_start                              once, before the first step
    step_start(step)                       before each step
    step_end(out)                          right after the step, before the stability guard looks at it
    step_done(out)                         the guard kept the step (ok or skip); not after a rollback
    log(row)                               a metrics row was written (rank 0 writes; every rank is called)
    checkpoint(step, path)                 a checkpoint was committed (sync or async)
    stage_change(plan)                     a new stage became active
    rollback()                             the loop went back to an earlier state
    train_end                              the last step is done (not after an error or a preemption)
    close(ok)                              always, last: stop threads, release resources

Adding a per-step feature is one class here (or in its own module) plus one line in :func:`default_callbacks`.
The preemption callback stops the loop by setting ``trainer.preempted`` (the loop then saves and returns).

**The rule for collectives:** every hook is called on every rank, in the order of the callback list, at the
same step. A callback that runs a collective (an all-reduce, a gather, a save) must run it on every rank,
unconditionally: decide from values that are equal on every rank (the step, the config, an all-reduced flag),
never from rank-local ones (the clock, rank 0's files), and never under ``if rank == 0``. Rank 0 alone may only
write files and print. The stability guard and rollback are not callbacks: they change the loop's control flow.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from llmtrain.train.fault import HangWatchdog, PreemptionHandler
from llmtrain.train.timing import busy_seconds, memory_stats, split_fractions

if TYPE_CHECKING:
    from llmtrain.resolve.stages import StagePlan
    from llmtrain.train.trainer import Trainer


class Callback:
    """Base class: every hook does nothing."""

    def run_start(self, trainer: Trainer) -> None: ...
    def step_start(self, trainer: Trainer, step: int) -> None: ...
    def step_end(self, trainer: Trainer, out: dict) -> None: ...
    def step_done(self, trainer: Trainer, out: dict) -> None: ...
    def log(self, trainer: Trainer, row: dict) -> None: ...
    def checkpoint(self, trainer: Trainer, step: int, path: Any) -> None: ...
    def stage_change(self, trainer: Trainer, plan: StagePlan) -> None: ...
    def rollback(self, trainer: Trainer) -> None: ...
    def train_end(self, trainer: Trainer) -> None: ...
    def close(self, trainer: Trainer, ok: bool) -> None: ...


class ProfilerCallback(Callback):
    """``logging.profile_every``/``profile_steps``: a torch.profiler window (train/timing.py ProfilerWindow)."""

    def step_start(self, trainer: Trainer, step: int) -> None:
        trainer.profiler.before_step(step)

    def step_end(self, trainer: Trainer, out: dict) -> None:
        profiled = trainer.profiler.after_step(trainer.step)
        if profiled is not None:
            trainer.events.write("profile", step=trainer.step, trace=profiled["trace"],
                                 collective_us_per_step=profiled["collective_us_per_step"])  # fmt: skip

    def close(self, trainer: Trainer, ok: bool) -> None:
        trainer.profiler.close()


class WatchdogCallback(Callback):
    """``run.hang_timeout_s``: the hang watchdog thread, fed once per step (train/fault.py)."""

    def __init__(self) -> None:
        self.watchdog: HangWatchdog | None = None

    def run_start(self, trainer: Trainer) -> None:
        timeout = trainer.cfg.run.hang_timeout_s
        if timeout:
            self.watchdog = HangWatchdog(trainer.run_dir, trainer.rank, timeout).start()

    def step_end(self, trainer: Trainer, out: dict) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(trainer.step)

    def close(self, trainer: Trainer, ok: bool) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()  # joins the thread
            self.watchdog = None


class MetricsCallback(Callback):
    """Every ``train.log_steps`` steps (and the last): one metrics row with throughput, MFU, the time split,
    memory and the per-rank figures (the straggler gather is a collective: every rank is here)."""

    def __init__(self) -> None:
        self._t: float | None = None  # the interval starts at the next step (after run_start's validation)
        self._tokens, self._step = 0, 0

    def step_start(self, trainer: Trainer, step: int) -> None:
        if self._t is None:
            self._t, self._tokens, self._step = time.time(), trainer.tokens_seen, trainer.step
            trainer.timer.reset()

    def rollback(self, trainer: Trainer) -> None:
        self._t = None

    def step_done(self, trainer: Trainer, out: dict) -> None:
        log_steps = max(trainer.stage_cfg.train.log_steps, 1)  # a stage may change it
        if trainer.step % log_steps and trainer.step != trainer.max_steps:
            return
        now = time.time()  # intervals run log block to log block (logging time included)
        monitor = self._monitor_fields(trainer)  # right after `now`: the timer's interval ends with it
        dt = now - (self._t or now)
        tps = (trainer.tokens_seen - self._tokens) / max(dt, 1e-9)
        row = {
            "step": trainer.step,
            "loss": out["loss"],
            "lr": out["lr"],
            "grad_norm": out["grad_norm"],
            "loss_scale": trainer.scaler.scale,
            "skipped_steps": trainer.scaler.skipped_steps,
            "tokens_per_s": tps,
            "mfu": trainer.derived.flops_per_token * tps / (trainer.peak_flops * trainer.world_size),
            "step_time_s": dt / max(trainer.step - self._step, 1),
            "tokens_seen": trainer.tokens_seen,
            "stage": trainer.stage_name,
            "consumed_tokens": trainer.consumed_tokens(),
            **{k: v for k, v in out.items() if k.startswith("moe_") or k == "replicas"},  # replicas: groups
            **out.get("health", {}),  # per-layer norms, logit RMS, ... of the log step (train/health.py)
            **monitor,
        }
        trainer.log_row(row)
        self._t, self._tokens, self._step = now, trainer.tokens_seen, trainer.step

    @staticmethod
    def _monitor_fields(trainer: Trainer) -> dict:
        """The time split, memory, per-rank busy times (all ranks call it: the gather is a collective)."""
        seconds = trainer.timer.collect()
        mem = memory_stats(trainer.device.type)
        with trainer.timer.phase("comm_ctrl"):
            ranks = trainer.stragglers.gather(
                trainer.step, busy_seconds(seconds), mem["memory_current_bytes"], mem["memory_peak_bytes"]
            )
        for found in ranks.stragglers:
            trainer.events.write("straggler", **found)
        steps = max(int(seconds.pop("steps")), 1)
        return {
            **split_fractions(seconds),
            "time_phase_s": {k: v / steps for k, v in seconds.items()},
            **mem,
            "rank_step_time_s": ranks.step_time_s,
            "rank_memory_peak_bytes": ranks.memory_peak_bytes,
        }


class ValidationCallback(Callback):
    """Validation loss at the start (``eval.at_start``), every ``train.eval_steps`` steps, and at the end."""

    def run_start(self, trainer: Trainer) -> None:
        if trainer.cfg.eval.at_start and trainer.step == 0:
            trainer.log_validation()

    def step_done(self, trainer: Trainer, out: dict) -> None:
        if self._due(trainer):
            trainer.log_validation()

    def train_end(self, trainer: Trainer) -> None:
        if not self._due(trainer):  # the last step's validation already ran
            trainer.log_validation()

    @staticmethod
    def _due(trainer: Trainer) -> bool:
        every = trainer.stage_cfg.train.eval_steps
        return bool(every) and trainer.step % every == 0


class DownstreamEvalCallback(Callback):
    """``eval.tasks`` scored with lm-eval every ``eval.downstream_steps`` steps of the active stage, before the
    first step (with ``eval.at_start``) and at the end (llmtrain/eval/). One metrics row per evaluation
    (``eval/<task>/<metric>`` and ``..._stderr``, ``eval/time_s``), a ``downstream_eval`` event, the time in the
    ``eval`` phase of the split. Under a parallel layout (FSDP / ZeRO, TP, EP, PP) every rank runs the same
    requests through :class:`llmtrain.eval.forward.LayoutForward` (the model's collectives match) and rank 0
    alone records (``trainer.log_row`` and the event log write on rank 0 only); context parallel is refused by
    resolve/validate.py."""

    def __init__(self) -> None:
        self._tokenizer: Any = None
        self._last: int | None = None  # the step scored last

    @staticmethod
    def _on(trainer: Trainer) -> bool:
        ev = trainer.stage_cfg.eval
        return bool(ev.tasks) and ev.downstream_steps > 0

    def run_start(self, trainer: Trainer) -> None:
        if self._on(trainer) and trainer.cfg.eval.at_start and trainer.step == 0:
            self._score(trainer)

    def step_done(self, trainer: Trainer, out: dict) -> None:
        if self._on(trainer) and trainer.step % trainer.stage_cfg.eval.downstream_steps == 0:
            self._score(trainer)

    def train_end(self, trainer: Trainer) -> None:
        if self._on(trainer) and self._last != trainer.step:
            self._score(trainer)

    def _score(self, trainer: Trainer) -> None:
        from llmtrain.eval.run import evaluate, metric_fields, run_tokenizer
        from llmtrain.train.precision import PRECISIONS

        ev, precision = trainer.stage_cfg.eval, trainer.stage_cfg.train.precision
        if self._tokenizer is None:
            self._tokenizer = run_tokenizer(trainer.cfg)
        dtype = None if precision == "fp32" else PRECISIONS[precision]
        forward = None
        if trainer.world_size > 1:  # every rank calls the model with the same inputs
            from llmtrain.eval.forward import LayoutForward

            forward = LayoutForward(
                trainer.model, dtype, tensor_parallel=trainer.cfg.parallel.tensor_parallel,
                pipeline=trainer.pipeline,
            )  # fmt: skip
        t0 = time.time()
        with trainer.timer.phase("eval"):
            results = evaluate(
                trainer.model, self._tokenizer, ev.tasks, ev.limit, ev.num_fewshot, ev.batch_size,
                autocast_dtype=dtype, env_info=False, progress=False, forward=forward,
            )  # fmt: skip
        seconds = time.time() - t0
        self._last = trainer.step
        fields = metric_fields(results)
        trainer.log_row({"step": trainer.step, **fields, "eval/time_s": seconds})
        trainer.events.write(
            "downstream_eval", step=trainer.step, tasks=list(ev.tasks), seconds=round(seconds, 3)
        )


class StageCallback(Callback):
    """Multi-stage runs: at the last step of a stage (not the last stage) close it, start the next, checkpoint."""

    def run_start(self, trainer: Trainer) -> None:
        c = trainer.curriculum
        if c is not None and trainer.step == 0:  # later stages announce themselves at their boundary
            trainer.announce_stage(c.plan)

    def step_done(self, trainer: Trainer, out: dict) -> None:
        c = trainer.curriculum
        if c is None or trainer.step != c.plan.end_step or c.index == len(c.plans) - 1:
            return
        trainer.stage_summary()
        trainer.enter_stage(c.advance())
        trainer.save()

    def train_end(self, trainer: Trainer) -> None:
        if trainer.step == trainer.max_steps:
            trainer.stage_summary()


class CheckpointCallback(Callback):
    """``checkpoint.save_steps`` / ``save_minutes``: save when due (unless this step already saved, e.g. at a
    stage boundary), log async commits as they land, and the final save (``checkpoint.save_at_end``)."""

    def step_done(self, trainer: Trainer, out: dict) -> None:
        if trainer.saved_step != trainer.step and trainer.checkpointer.should_save(trainer.step):
            trainer.save()
        committed = trainer.checkpointer.poll()
        if committed is not None:
            trainer.committed(committed)

    def train_end(self, trainer: Trainer) -> None:
        trainer.wait_checkpoint()  # an async save of this very step may still be in flight
        latest = trainer.checkpointer.latest()
        if trainer.cfg.checkpoint.save_at_end and (
            latest is None or latest != trainer.checkpoint_dir(trainer.step)
        ):
            trainer.save()
        trainer.wait_checkpoint()


class PreemptionCallback(Callback):
    """SIGTERM/SIGINT on any rank: every rank stops after the same step (one all-reduce per step)."""

    def __init__(self) -> None:
        self.handler = PreemptionHandler()

    def run_start(self, trainer: Trainer) -> None:
        self.handler.install()

    def step_done(self, trainer: Trainer, out: dict) -> None:
        with trainer.timer.phase("comm_ctrl"):
            stop = self.handler.should_stop()
        if stop:
            trainer.preempted = str(self.handler.received)

    def close(self, trainer: Trainer, ok: bool) -> None:
        self.handler.uninstall()


def default_callbacks() -> list[Callback]:
    """The callbacks of every run, in hook order (see the module docstring for the rule on collectives)."""
    return [
        ProfilerCallback(),
        WatchdogCallback(),
        MetricsCallback(),
        ValidationCallback(),
        DownstreamEvalCallback(),
        StageCallback(),
        CheckpointCallback(),
        PreemptionCallback(),
    ]

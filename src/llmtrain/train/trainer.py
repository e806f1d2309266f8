"""The training loop, readable top to bottom.

``Trainer(cfg)`` gets its parts from :func:`llmtrain.train.build.build_run` (process group, data, the resolved
run, model parallelized from outside, optimizer, batches, checkpointer ...) and resumes from a checkpoint when
``checkpoint.resume`` says so; ``fit()`` runs the steps. A step's numbers are :class:`~llmtrain.train.step.
TrainStep`'s business (forward, loss normalised by the global batch's tokens, backward, clipping, optimizer).
Around each step the callbacks of train/callbacks.py do the rest — profiler, hang watchdog, metrics rows and
the per-rank figures, validation, stage switches, checkpoint timing, preemption — in a fixed order on every
rank. The stability guard stays in the loop because it changes the control flow: after each step it decides
ok / skip / rollback / give up (a rollback restores the newest good state and skips the data window of the
spike). Every decision goes to ``<run_dir>/events.jsonl``.

The config is never modified: ``self.cfg`` is the resolved run's config (``train.max_steps`` is the run's real
length) and ``self.stage_cfg`` the active stage's (the same object in a one-stage run).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from llmtrain.config import config_to_dict
from llmtrain.config.schema import Config
from llmtrain.errors import CheckpointError, LLMTrainError
from llmtrain.ft.layout import first_group
from llmtrain.plan.peak import peak_tflops, runtime_device_name
from llmtrain.resolve import derive
from llmtrain.resolve.stages import SINGLE_STAGE, StagePlan
from llmtrain.train.build import build_run
from llmtrain.train.callbacks import Callback, default_callbacks
from llmtrain.train.checkpoint import step_dir, step_of
from llmtrain.train.checkpoint.state_schema import content_problem
from llmtrain.train.curriculum import set_recompute
from llmtrain.train.metrics import MetricsLogger, plot_losses
from llmtrain.train.sample import tokenizer_record


class TrainingDiverged(LLMTrainError):
    """The stability guard gave up (too many rollbacks); the report says why."""

    exit_code = 3


def config_hash(cfg_dict: dict) -> str:
    return hashlib.sha256(json.dumps(cfg_dict, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Trainer:
    """The trainer: one process of a run (alone, or one rank under torchrun)."""

    def __init__(self, cfg: Config, notes: list[str] | None = None, callbacks: list[Callback] | None = None):
        parts = build_run(cfg)
        self.run = parts.run
        self.cfg = self.stage_cfg = parts.run.cfg
        self.derived = parts.run.derived
        self.device, self.world_size, self.rank, self.run_dir = (
            parts.device,
            parts.world_size,
            parts.rank,
            parts.run_dir,
        )
        self.train_samples, self.valid_samples, self.eos_id = (
            parts.train_samples,
            parts.valid_samples,
            parts.eos_id,
        )
        self.dp_rank, self.dp_size = parts.dp_rank, parts.dp_size
        self.model, self.pipeline, self.fsdp = parts.model, parts.pipeline, parts.fsdp
        self.optimizer, self.lr_at, self.scaler = parts.optimizer, parts.lr_at, parts.scaler
        self.curriculum, self.batches, self.step_fn = parts.curriculum, parts.batches, parts.step_fn
        self.timer, self.stragglers, self.profiler = parts.timer, parts.stragglers, parts.profiler
        self.events, self.guard, self.snapshot = parts.events, parts.guard, parts.snapshot
        self.faults, self.checkpointer, self.lock = parts.faults, parts.checkpointer, parts.lock
        self.callbacks = default_callbacks() if callbacks is None else callbacks
        self.step, self.tokens_seen = 0, 0
        self._tokenizer = tokenizer_record(self.cfg)  # what the checkpoints record of the tokenizer
        self.saved_step: int | None = None  # the step of the newest save started by this process
        self.preempted: str | None = None  # set by the preemption callback: the signal received
        self.last_val: dict = {}
        self.stage_name = SINGLE_STAGE
        self._stage_losses: list[float] = []  # first and latest loss of the active stage
        self._stage_t0 = time.time()
        if self.curriculum is not None:
            self.enter_stage(self.curriculum.plan, announce=False)

        choice = parts.resume
        try:
            while choice.path is not None:
                try:
                    self._load(choice.path)
                    break
                except CheckpointError as e:  # verified, yet unreadable: the next older one (resume: auto)
                    choice = self.checkpointer.after_failed_load(choice, e)
            if choice.path is None and cfg.model.init_from:
                self._init_from(cfg.model.init_from)
        except BaseException:  # this trainer will not run: free the run directory
            if self.lock is not None:
                self.lock.release()
            raise
        self.replicas = None  # fault_tolerance: this process's replica group (ft/replicas.py)
        if self.cfg.fault_tolerance.enabled:  # before the first event: every row is tagged with the group
            from llmtrain.ft.replicas import attach

            self.replicas = attach(self)
        # replica groups: every group's rank 0 may write; each row by the step's quorum's first group (metrics.py)
        self.metrics = MetricsLogger(
            self.run_dir, self.cfg.logging, self.max_steps, self.step, enabled=self.rank == 0,
            run_config=config_to_dict(self.cfg) if self.cfg.logging.wandb else None,
            writer=self.replicas.writes_run_files if self.replicas is not None else None, primary=first_group(),
        )  # fmt: skip
        self.events.echo = self.metrics.message
        for text in self.metrics.salvaged:  # damaged lines of metrics/events.jsonl set aside, never fatal
            self.events.write("log_damaged", reason=text)
        for note in [*(notes or []), *self.run.notes] if first_group() else []:  # once, not once per group
            self.metrics.message(f"note: {note}")
        for message in choice.messages():
            self.events.write("checkpoint_fallback", reason=message)
        for message in choice.notes:  # symbolic links left alone, checkpoints an overwrite replaces
            self.events.write("checkpoint_notice", reason=message)
        self.checkpointer.store.on_note = lambda text: self.events.write("checkpoint_notice", reason=text)
        if choice.path is not None:
            self.events.write("resumed", step=self.step, path=str(choice.path))
            self._note_reshard()
        self.peak_flops = (
            peak_tflops(self.device, self.cfg.train.precision, self.cfg.logging.peak_tflops) * 1e12
        )

    @property
    def max_steps(self) -> int:
        return self.run.max_steps

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        self.model.train()
        dims = self.derived.dims
        assert dims is not None  # derive() always sets it
        self.events.write(
            "run_start", step=self.step, max_steps=self.max_steps, world_size=self.world_size,
            num_params=self.derived.num_params, layout=dims.mesh_shape(),
            hosts=self.stragglers.hosts, device=self.device.type,
            device_name=runtime_device_name(self.device) or self.device.type,
        )  # fmt: skip
        ok = False
        try:
            self._emit("run_start")
            while self.step < self.max_steps and self.preempted is None:
                self._emit("step_start", self.step + 1)
                out = self.train_step()
                self._emit("step_end", out)
                decision = self.guard.observe(self.step, out["loss"], out["grad_norm"], out.get("health"))
                if not decision.ok:
                    self.events.write(
                        decision.action, step=self.step, reason=decision.reason, **decision.values
                    )
                    if decision.action == "give_up":
                        raise TrainingDiverged(decision.reason)
                    if decision.action == "rollback":
                        self._rollback(decision)
                        self._emit("rollback")
                        continue
                self._stage_losses = [*self._stage_losses[:1], out["loss"]]
                self._emit("step_done", out)
            if self.preempted is not None:  # every rank agreed to stop after this step: save it, then return
                if self.saved_step != self.step:
                    self.save()
                self.wait_checkpoint()
                self.events.write("preempted", step=self.step, signal=self.preempted)
            else:
                self._emit("train_end")
            ok = True
        finally:
            self._emit("close", ok)
        self.metrics.close()
        if self.lock is not None:
            self.lock.release()
        if self.preempted is not None:
            return {"step": self.step, "preempted": True}
        writes = self.replicas is None or self.replicas.writes_run_files()  # replica groups: one group plots
        if self.cfg.logging.plot and self.rank == 0 and writes:
            plot_losses(self.metrics.path, self.run_dir / "loss.png")
        return {"step": self.step, **self.last_val}

    def _emit(self, hook: str, *args: object) -> None:
        """Call ``hook`` of every callback, in order (every rank, same order: see train/callbacks.py)."""
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def train_step(self) -> dict:
        """One optimizer step (train/step.py) at the schedule's learning rate (and the guard's factor). With
        replica groups the step starts with a quorum (a lagging group heals there) and is taken again when it
        did not commit (a group died during it)."""
        while True:
            if self.replicas is not None:
                self.replicas.start_step(self)
            step = self.step + 1
            lr = self.lr_at(step) * self.guard.lr_scale(step)
            out = self.step_fn.run(self.stage_cfg, step, lr, self.batches)
            if self.replicas is None or self.replicas.end_step(self, out):
                break
        self.step += 1
        self.tokens_seen += out["tokens"]
        return out

    def forward_loss(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed token loss of one micro-batch (no backward)."""
        return self.step_fn.forward_loss(self.stage_cfg, mb)

    def validate(self) -> dict:
        """Mean loss and perplexity over ``eval.eval_iters`` held-out micro-batches (same batches every time)."""
        return self.step_fn.validate(
            self.stage_cfg, self.derived, self.valid_samples, self.dp_rank, self.dp_size
        )

    def log_validation(self) -> dict:
        val = self.validate()
        if val:
            self.log_row({"step": self.step, **val})
            self.last_val = val
        return val

    def log_row(self, row: dict) -> None:
        """Write a metrics row (rank 0's sinks) and tell the callbacks."""
        self.metrics.log(row)
        self._emit("log", row)

    def close(self, ok: bool) -> bool:
        """End of the run, finished or failed: the save in flight finished (``ok``) or abandoned, background
        threads joined, metrics and TensorBoard closed. False when a thread would not stop (the caller then
        ends the process without the interpreter's shutdown)."""
        try:
            clean = self.checkpointer.close(finish=ok)
        finally:
            self.profiler.close()
            self.metrics.close()
            if self.lock is not None:
                self.lock.release()
        return clean

    # ------------------------------------------------------------------ stages
    def consumed_tokens(self) -> dict[str, int]:
        """Tokens drawn from each dataset path by all ranks since the run began."""
        if self.curriculum is not None:
            return self.curriculum.consumed_tokens()
        return dict(self.batches.consumed_tokens)

    def enter_stage(self, plan: StagePlan, announce: bool = True) -> None:
        """Make ``plan``'s settings current: its config, batch arithmetic, batches, guard and recompute."""
        assert self.curriculum is not None  # a staged run has a curriculum
        self.stage_cfg = plan.cfg
        self.stage_name = plan.name
        self.derived = derive(plan.cfg, self.world_size, vocab_size=self.derived.model_args.vocab_size)
        self.batches = self.curriculum.batches
        self.guard.reconfigure(plan.cfg.stability)
        if hasattr(self.model, "layers"):
            set_recompute(self.model, plan.cfg.recompute.mode, plan.cfg.recompute.every)
        self._stage_losses, self._stage_t0 = [], time.time()
        if announce:
            self.announce_stage(plan)
            self._emit("stage_change", plan)

    def announce_stage(self, plan: StagePlan) -> None:
        c = self.curriculum
        assert c is not None  # a staged run has a curriculum
        self.events.write(
            "stage_start", stage=plan.name, step=self.step, end_step=plan.end_step, lr_end=plan.lr_end,
            mixture={p: w for p, w in zip(c.paths, plan.weights) if w > 0},
        )  # fmt: skip

    def stage_summary(self) -> None:
        """The ``stage_end`` event and console line: tokens per dataset, first and last loss, time."""
        c = self.curriculum
        losses = self._stage_losses or [float("nan")]
        tokens = c.stage_tokens() if c is not None else dict(self.batches.consumed_tokens)
        self.events.write(
            "stage_end", stage=self.stage_name, step=self.step, tokens=tokens, loss_start=losses[0],
            loss_end=losses[-1], time_s=round(time.time() - self._stage_t0, 3),
        )  # fmt: skip

    def _rollback(self, decision) -> None:
        """Go back to the newest good state before the spike and skip the data window that caused it."""
        self.wait_checkpoint()
        available = [step_of(p) for p in self.checkpointer.committed()]
        if self.snapshot.step is not None:
            available.append(self.snapshot.step)
        plan = self.guard.plan(decision, sorted(set(available)))
        if plan is None:
            raise TrainingDiverged(
                f"{decision.reason} at step {decision.step}, and no checkpoint precedes it."
            )
        if self.snapshot.step == plan.restore_step:
            state, source = self.snapshot.restore(self.model, self.optimizer), "host memory"
        else:
            path = self.checkpoint_dir(plan.restore_step)
            state, source = (
                self.checkpointer.load(
                    path, self.model, self.optimizer, allow_extra=self.pipeline is not None
                ),
                str(path),
            )
        self._restore_trainer_state(state, guard=False)
        self.batches.consumed_samples += plan.skip_batches * self.derived.global_batch
        self.events.write(
            "rollback_done", step=self.step, source=source, skipped_batches=plan.skip_batches,
            skipped_samples=plan.skip_batches * self.derived.global_batch, lr_factor=plan.lr_factor,
            lr_until_step=plan.lr_until_step, detected_step=plan.detected_step,
        )  # fmt: skip

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_dir(self, step: int) -> Path:
        return step_dir(self.checkpointer.dir, step)

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "scaler": self.scaler.state_dict(),
            "data": self.curriculum.state_dict() if self.curriculum else self.batches.state_dict(),
            "guard": self.guard.state_dict(),
            "config_hash": config_hash(config_to_dict(self.cfg)),
            "world_size": self.world_size,
            "grad_accum": self.derived.grad_accum,
            "tokenizer": self._tokenizer,  # checked by generate / export / eval (train/sample.py)
        }

    def committed(self, path: Path) -> None:
        """A checkpoint was committed: the event, and the callbacks' hook."""
        step = step_of(path)
        self.events.write("checkpoint", step=step, path=str(path))
        self._emit("checkpoint", step, path)

    def wait_checkpoint(self) -> None:
        """Wait for the asynchronous save in flight (if any); its commit goes to events.jsonl."""
        committed = self.checkpointer.wait()
        if committed is not None:
            self.committed(committed)

    def save(self) -> None:
        """Checkpoint now (in the background with checkpoint.async_save); keep a host copy for rollbacks."""
        state = self.trainer_state()
        self.saved_step = self.step
        if self.replicas is not None and not self.replicas.writes_run_files():
            return  # replica groups: the first group of the quorum writes the run's checkpoints
        if self.cfg.checkpoint.async_save:
            self.wait_checkpoint()  # one save in flight: the previous one commits first (and is logged)
            self.checkpointer.save_async(self.step, self.model, self.optimizer, state)
        else:
            path = self.checkpointer.save(self.step, self.model, self.optimizer, state)
            self.committed(path)
            self.faults.after_save(self.step, path)
        if self.stage_cfg.stability.enabled and self.stage_cfg.stability.snapshot_max_gb > 0:
            self.snapshot.capture(self.step, self.model, self.optimizer, state)

    def _load(self, path: Path) -> None:
        stages = len(self.curriculum.plans) if self.curriculum is not None else None
        problem = content_problem(path, stages)  # every field, against this run, before anything is restored
        if problem is not None:
            raise CheckpointError(f"{path} cannot be resumed: {problem}.")
        state = self.checkpointer.load(
            path, self.model, self.optimizer, allow_extra=self.pipeline is not None
        )
        self._restore_trainer_state(state, guard=True)
        self._loaded_layout = (state.get("world_size"), state.get("grad_accum"))

    def _note_reshard(self) -> None:
        """A resume on another world size (an elastic job that lost or gained nodes): say so in events.jsonl.
        The global batch is fixed by the config, so gradient accumulation absorbs the change."""
        old_world, old_accum = getattr(self, "_loaded_layout", (None, None))
        if old_world is not None and old_world != self.world_size:
            self.events.write(
                "resharded", step=self.step, from_world=old_world, to_world=self.world_size,
                from_grad_accum=old_accum, grad_accum=self.derived.grad_accum,
                global_batch=self.derived.global_batch,
            )  # fmt: skip

    def _restore_trainer_state(self, state: dict, guard: bool) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.scaler.load_state_dict(state["scaler"])
        if self.curriculum is not None:
            self.curriculum.load_state_dict(state["data"])
            self.enter_stage(self.curriculum.plan, announce=False)
        else:
            self.batches.load_state_dict(state["data"])
        if guard and "guard" in state:  # a rollback keeps the guard's memory of what happened
            self.guard.load_state_dict(state["guard"])

    def _init_from(self, source: str) -> None:
        """model.init_from: hf:PATH (a Hugging Face directory, safetensors) or a checkpoint directory."""
        if source.startswith("hf:"):
            from llmtrain.models.hf_io import init_from_hf

            init_from_hf(self.model, source[3:])
        else:
            from llmtrain.train.checkpoint import load_model_weights

            load_model_weights(source, self.model)

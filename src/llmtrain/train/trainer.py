"""The training loop, readable top to bottom.

``Trainer(cfg)`` builds everything from the config (data, model on the meta device then materialized with a
seeded init, optimizer, LR schedule, loss scaler, checkpointer, metrics) and resumes from a checkpoint when
``checkpoint.resume`` says so; ``fit()`` runs the steps. One step::

    lr <- schedule(step)
    for each micro-batch of this rank:  loss_sum / tokens_in_global_batch -> (scaled) backward
    unscale -> global grad norm (pre-clip, logged) -> skip the step if not finite, else clip + optimizer step

The loss is normalised by the number of target tokens of the whole global batch (not averaged per micro-batch),
so gradient accumulation and data parallelism compute exactly the single-process gradient. After each step
the stability guard decides ok / skip / rollback / give up (a rollback restores the newest good state and
skips the data window of the spike). Validation, checkpointing (sync or async, with a host copy for fast
rollbacks), fault injection, preemption and the hang watchdog are components called from the loop; every
decision goes to ``<run_dir>/events.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain.config import config_to_dict, derive, save_config
from llmtrain.config.schema import Config
from llmtrain.config.stages import SINGLE_STAGE, StagedLR, StagePlan, resolve_stages
from llmtrain.data.loader import BatchIterator, build_datasets
from llmtrain.data.manifest import read_manifest
from llmtrain.distributed.device import init_distributed, resolve_device
from llmtrain.distributed.parallelize import parallelize
from llmtrain.errors import LLMTrainError
from llmtrain.models import build_model
from llmtrain.models.common.moe import MoEStepStats
from llmtrain.train.checkpoint import Checkpointer
from llmtrain.train.curriculum import Curriculum, recompute_superset, set_recompute
from llmtrain.train.fault import FaultInjector, HangWatchdog, PreemptionHandler
from llmtrain.train.metrics import PEAK_TFLOPS, MetricsLogger, memory_bytes, plot_losses
from llmtrain.train.optim import build_optimizer
from llmtrain.train.precision import LossScaler, autocast, grad_norm_
from llmtrain.train.schedule import build_lr_schedule
from llmtrain.train.stability import EventLog, HostSnapshot, StabilityGuard
from llmtrain.train.straggler import StragglerMonitor
from llmtrain.train.timing import ProfilerWindow, StepTimer, busy_seconds, memory_stats, split_fractions


class TrainingDiverged(LLMTrainError):
    """The stability guard gave up (too many rollbacks); the report says why."""

    exit_code = 3


def config_hash(cfg_dict: dict) -> str:
    return hashlib.sha256(json.dumps(cfg_dict, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Trainer:
    """The trainer: one process of a run (alone, or one rank under torchrun)."""

    def __init__(self, cfg: Config, notes: list[str] | None = None):
        self.cfg = cfg
        self.device = resolve_device(cfg.run.device_target)
        self.device_type = self.device.type
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.world_size = init_distributed(self.device_type, cfg.run.dist_timeout_s)
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self.run_dir = Path(cfg.run.output_dir)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")

        # Data first: the tokenizer fixes the vocabulary when the config leaves it open.
        # The stage plan, resolved once from the config as written (a fraction is of the configured
        # train.max_steps, which is then replaced by the plan's total); data.datasets defaults to stage 0's mix.
        stages = resolve_stages(cfg) if cfg.stages else None
        self.train_samples, self.valid_samples = build_datasets(cfg)
        manifest = read_manifest(cfg.data.datasets[0].path)
        self.eos_id = manifest["tokenizer"]["eos_id"]
        self.derived = derive(cfg, world_size=self.world_size, vocab_size=manifest["tokenizer"]["vocab_size"])
        d = self.derived
        notes = list(notes or [])
        if stages is not None:  # the stage plan fixes the run's length
            total = stages[1][-1].end_step
            if total != cfg.train.max_steps:
                notes.append(f"stages: {total} steps in all (train.max_steps was {cfg.train.max_steps}).")
            cfg.train.max_steps = total
        elif cfg.train.epochs:  # the seed's epoch count caps the run (max_steps still applies)
            epoch_steps = max(cfg.train.epochs * len(self.train_samples) // d.global_batch, 1)
            if epoch_steps < cfg.train.max_steps:
                notes.append(
                    f"train.epochs {cfg.train.epochs} caps the run at {epoch_steps} steps "
                    f"(train.max_steps was {cfg.train.max_steps})."
                )
                cfg.train.max_steps = epoch_steps

        # Layout: one mesh per parallel dimension; this rank's data-parallel slice.
        dims = d.dims
        meshes = dims.build_meshes(self.device_type) if self.world_size > 1 else None
        self.dp_group = meshes["dp"].get_group() if meshes and dims.dp > 1 else None
        self.dp_rank = meshes["dp"].get_local_rank() if self.dp_group is not None else 0
        self.dp_size = dims.dp

        # Model: built on meta, parallelized from outside, materialized on the device, seeded init.
        layout_cfg = recompute_superset(cfg, stages)  # stages that switch recompute: every block wrapped once
        self.model = build_model(d.model_args, device="meta")
        self.pipeline = (
            None  # pipeline parallel: self.model is this rank's pruned model (distributed/pipeline.py)
        )
        if dims.pp > 1:
            from llmtrain.distributed.pipeline import PipelineRunner

            self.pipeline = PipelineRunner(layout_cfg, dims, meshes, self.model, self.device, self.loss_fn)
            self.model, self.fsdp = self.pipeline.model, self.pipeline.fsdp
        else:
            self.fsdp = parallelize(
                self.model, layout_cfg, dims, meshes["world"] if meshes else None, self.device_type
            )
        self.model.to_empty(device=self.device)
        self.model.init_weights(seed=cfg.train.seed)
        # FSDP averages gradients over the data-parallel ranks; the loss is pre-multiplied to undo it.
        self.grad_scale = float(self.dp_size) if self.fsdp else 1.0
        # MoE: aux-loss gradient scale per micro-batch, load figures, aux-free bias (models/common/moe.py).
        self.moe = MoEStepStats(d.model_args.bias_update_rate) if d.model_args.num_experts else None

        self.optimizer = build_optimizer(self.model, cfg.train, self.device_type)
        self.lr_at = build_lr_schedule(cfg.train)
        self.scaler = LossScaler.from_config(cfg.train)
        self.base_cfg = cfg
        self.curriculum = Curriculum(cfg, stages, self.dp_rank, self.dp_size) if stages else None
        if self.curriculum is not None:
            self.lr_at = StagedLR(
                self.curriculum.plans, cfg.train.warmup_steps, cfg.train.lr, cfg.train.wsd_decay_fraction
            )
        else:
            self.batches = BatchIterator(
                self.train_samples, d.global_batch, d.micro_batch_size, self.dp_rank, self.dp_size
            )
        self.step = 0
        self.tokens_seen = 0
        # Monitoring (train/timing.py, train/straggler.py): phase timer, per-rank figures, profiler window.
        self.timer = StepTimer(self.device)
        log = cfg.logging
        self.stragglers = StragglerMonitor(
            self.world_size, self.device, log.straggler_margin, log.straggler_patience
        )
        self.profiler = ProfilerWindow(
            self.run_dir, self.rank, log.profile_every, log.profile_steps, self.device_type
        )

        # Survival: stability guard, fault injection (drills), checkpoints with fallback to the previous one.
        self.events = EventLog(self.run_dir, echo=None, enabled=self.rank == 0)
        self.guard = StabilityGuard(cfg.stability)
        self.stage_name = SINGLE_STAGE
        self._stage_losses: list[float] = []  # first and latest loss of the active stage
        self._stage_t0 = time.time()
        if self.curriculum is not None:
            self._enter_stage(self.curriculum.plan)
        self.snapshot = HostSnapshot(int(cfg.stability.snapshot_max_gb * 2**30))
        self.faults = FaultInjector(cfg.fault, self.run_dir, self.rank, d.model_args.vocab_size)
        self.checkpointer = Checkpointer(cfg.checkpoint, self.run_dir, self.device_type)
        self.checkpointer.fault_hook = self.faults.during_save
        choice = self.checkpointer.select_resume()
        if choice.path is not None:
            self._load(choice.path)
        elif cfg.model.init_from:
            self._init_from(cfg.model.init_from)
        self.metrics = MetricsLogger(
            self.run_dir,
            cfg.logging,
            cfg.train.max_steps,
            self.step,
            enabled=self.rank == 0,
            run_config=config_to_dict(cfg) if cfg.logging.wandb else None,
        )
        self.events.echo = self.metrics.message
        for note in notes:
            self.metrics.message(f"note: {note}")
        for message in choice.messages():
            self.events.write("checkpoint_fallback", reason=message)
        if choice.path is not None:
            self.events.write("resumed", step=self.step, path=str(choice.path))
            self._note_reshard()
        self.peak_flops = (cfg.logging.peak_tflops or PEAK_TFLOPS.get(self.device_type, 1.0)) * 1e12

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (identity on one rank)."""
        if self.dp_group is not None:
            with self.timer.phase("comm_dp"):
                dist.all_reduce(t, group=self.dp_group)
        return t

    # ------------------------------------------------------------------ one step
    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy (fp32); the caller divides by the global batch's target tokens."""
        return F.cross_entropy(
            logits.float().flatten(0, 1),
            labels.flatten(),
            reduction="sum",
            ignore_index=-100,
            label_smoothing=self.cfg.train.label_smoothing,
        )

    def forward_loss(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        mb = {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
        doc_ids = mb["document_ids"] if self.cfg.model.document_mask else None
        pos_ids = mb["position_ids"] if self.cfg.model.document_mask else None
        with autocast(self.cfg.train.precision, self.device_type):
            logits = self.model(mb["input_ids"], position_ids=pos_ids, document_ids=doc_ids)
        return self.loss_fn(logits, mb["labels"])

    def train_step(self) -> dict:
        cfg = self.cfg.train
        step = self.step + 1
        lr = self.lr_at(step) * self.guard.lr_scale(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        timer = self.timer  # phases: train/timing.py (comm inside compute pauses compute)
        with timer.phase("data"):
            micro_batches = self.faults.before_step(step, self.batches.next_step())
            local_tokens = sum(int((mb["labels"] != -100).sum()) for mb in micro_batches)
        n_tokens = int(self._dp_sum(torch.tensor(local_tokens, device=self.device)).item())
        with timer.phase("compute"):
            loss_sum = torch.zeros((), device=self.device)
            if self.pipeline is not None:  # the schedule runs forward/backward of every micro-batch
                scale = self.scaler.scale_loss(torch.tensor(self.grad_scale / n_tokens)).item()
                loss_sum = self.pipeline.train_step(
                    micro_batches, scale, lambda loss: self.faults.poison_loss(step, loss)
                )
                micro_batches = []
            for mb in micro_batches:
                if self.moe is not None:
                    self.moe.start(self.model, mb, self.scaler.scale * (self.grad_scale / n_tokens))
                loss = self.faults.poison_loss(step, self.forward_loss(mb))
                if self.moe is not None:
                    self.moe.end(self.model)
                self.scaler.scale_loss(loss * (self.grad_scale / n_tokens)).backward()
                loss_sum += loss.detach()
            self.faults.after_backward(step, self.model)
            params = [p for p in self.model.parameters() if p.grad is not None]
            self.scaler.unscale_(params)
            with timer.phase("comm_norm" if self.world_size > 1 else "compute"):
                pp_group = self.pipeline.pp_group if self.pipeline is not None else None
                grad_norm = grad_norm_(params, cfg.grad_clip_norm, pp_group)
            skipped = self.scaler.update(grad_norm)
            if not skipped:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            moe = self.moe.finish(self.model, self._dp_sum, n_tokens, not skipped) if self.moe else {}
        self.step += 1
        self.tokens_seen += n_tokens
        loss_value = self._dp_sum(loss_sum.float()).item() / n_tokens
        timer.step_done()
        return {
            "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "skipped": skipped, "tokens": n_tokens, **moe,
        }  # fmt: skip

    @torch.no_grad()
    def validate(self) -> dict:
        """Mean loss and perplexity over ``eval.eval_iters`` held-out micro-batches (same batches every time)."""
        if len(self.valid_samples) == 0:
            return {}
        self.model.eval()
        mbs = self.derived.micro_batch_size
        # Under PP each eval iteration is one forward-only pass of the schedule over a whole global batch
        # (the pipeline's fixed micro-batch shape): eval_iters then covers global_batch / (micro_batch_size x
        # dp) times the sequences of the plain loop.
        per_iter = self.derived.global_batch if self.pipeline is not None else mbs * self.dp_size
        it = BatchIterator(self.valid_samples, per_iter, mbs, self.dp_rank, self.dp_size)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, target tokens]
        for _ in range(self.cfg.eval.eval_iters):
            step_mbs = it.next_step()
            if self.pipeline is not None:
                sums[0] += self.pipeline.eval_loss(step_mbs).double()
                sums[1] += sum(int((mb["labels"] != -100).sum()) for mb in step_mbs)
                step_mbs = []
            for mb in step_mbs:
                sums[0] += self.forward_loss(mb).double()
                sums[1] += int((mb["labels"] != -100).sum())
        self.model.train()
        total, count = self._dp_sum(sums).tolist()
        val_loss = total / max(count, 1)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    def _log_validation(self) -> dict:
        val = self.validate()
        if val:
            self.metrics.log({"step": self.step, **val})
        return val

    def _monitor_fields(self) -> dict:
        """Metrics-row fields of a log step: the time split, memory, per-rank busy times (all ranks call it)."""
        seconds = self.timer.collect()
        mem = memory_stats(self.device_type)
        with self.timer.phase("comm_ctrl"):
            ranks = self.stragglers.gather(
                self.step, busy_seconds(seconds), mem["memory_current_bytes"], mem["memory_peak_bytes"]
            )
        for found in ranks.stragglers:
            self.events.write("straggler", **found)
        steps = max(int(seconds.pop("steps")), 1)
        return {
            **split_fractions(seconds),
            "time_phase_s": {k: v / steps for k, v in seconds.items()},
            **mem,
            "rank_step_time_s": ranks.step_time_s,
            "rank_memory_peak_bytes": ranks.memory_peak_bytes,
        }

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        cfg = self.cfg
        max_steps, log_steps = cfg.train.max_steps, max(cfg.train.log_steps, 1)
        last_val: dict = {}
        if cfg.eval.at_start and self.step == 0:
            last_val = self._log_validation()
        self.model.train()
        preempt = PreemptionHandler().install()
        watchdog = (
            HangWatchdog(self.run_dir, self.rank, cfg.run.hang_timeout_s).start()
            if cfg.run.hang_timeout_s
            else None
        )
        t_last, tokens_last, step_last = time.time(), self.tokens_seen, self.step
        self.events.write(
            "run_start", step=self.step, max_steps=max_steps, world_size=self.world_size,
            num_params=self.derived.num_params, layout=self.derived.dims.mesh_shape(),
            hosts=self.stragglers.hosts, device=self.device_type,
        )  # fmt: skip
        self.timer.reset()
        c = self.curriculum
        if c is not None and self.step == 0:  # later stages announce themselves at their boundary
            self.events.write(
                "stage_start", stage=c.plan.name, step=self.step, end_step=c.plan.end_step,
                lr_end=c.plan.lr_end, mixture={p: w for p, w in zip(c.paths, c.plan.weights) if w > 0},
            )  # fmt: skip
        try:
            while self.step < max_steps:
                log_steps = max(self.cfg.train.log_steps, 1)  # a stage may change it
                self.profiler.before_step(self.step + 1)
                out = self.train_step()
                profiled = self.profiler.after_step(self.step)
                if profiled is not None:
                    self.events.write("profile", step=self.step, trace=profiled["trace"],
                                      collective_us_per_step=profiled["collective_us_per_step"])  # fmt: skip
                if watchdog is not None:
                    watchdog.beat(self.step)
                decision = self.guard.observe(self.step, out["loss"], out["grad_norm"])
                if not decision.ok:
                    self.events.write(
                        decision.action, step=self.step, reason=decision.reason, **decision.values
                    )
                    if decision.action == "rollback":
                        self._rollback(decision)
                        t_last, tokens_last, step_last = time.time(), self.tokens_seen, self.step
                        self.timer.reset()
                        continue
                    if decision.action == "give_up":
                        raise TrainingDiverged(decision.reason)
                self._stage_losses = [*self._stage_losses[:1], out["loss"]]
                if self.step % log_steps == 0 or self.step == max_steps:
                    now = time.time()  # intervals run log block to log block (logging time included)
                    dt = now - t_last
                    tps = (self.tokens_seen - tokens_last) / max(dt, 1e-9)
                    monitor = self._monitor_fields()  # a collective: every rank is here at this step
                    self.metrics.log(
                        {
                            "step": self.step,
                            "loss": out["loss"],
                            "lr": out["lr"],
                            "grad_norm": out["grad_norm"],
                            "loss_scale": self.scaler.scale,
                            "skipped_steps": self.scaler.skipped_steps,
                            "tokens_per_s": tps,
                            "mfu": self.derived.flops_per_token * tps / (self.peak_flops * self.world_size),
                            "step_time_s": dt / max(self.step - step_last, 1),
                            "tokens_seen": self.tokens_seen,
                            "stage": self.stage_name,
                            "consumed_tokens": self.consumed_tokens(),
                            "memory_bytes": memory_bytes(self.device_type),
                            **{k: v for k, v in out.items() if k.startswith("moe_")},
                            **monitor,
                        }
                    )
                    t_last, tokens_last, step_last = now, self.tokens_seen, self.step
                if self.cfg.train.eval_steps and self.step % self.cfg.train.eval_steps == 0:
                    last_val = self._log_validation()
                if not self._stage_boundary() and self.checkpointer.should_save(self.step):
                    self.save()
                committed = self.checkpointer.poll()
                if committed is not None:
                    self.events.write("checkpoint", step=int(committed.name[5:]), path=str(committed))
                with self.timer.phase("comm_ctrl"):
                    stop = preempt.should_stop()
                if stop:
                    self.save()
                    self._wait_checkpoint()
                    self.events.write("preempted", step=self.step, signal=str(preempt.received))
                    self.metrics.close()
                    return {"step": self.step, "preempted": True}
            if self.step == max_steps:
                self._stage_summary()
            if not (self.cfg.train.eval_steps and self.step % self.cfg.train.eval_steps == 0):
                last_val = self._log_validation()
            self._wait_checkpoint()  # an async save of this very step may still be in flight
            if cfg.checkpoint.save_at_end and self.checkpointer.latest() != self._ckpt_dir(self.step):
                self.save()
            self._wait_checkpoint()
        finally:
            preempt.uninstall()
            self.profiler.close()
            if watchdog is not None:
                watchdog.stop()
        self.metrics.close()
        if cfg.logging.plot and self.rank == 0:
            plot_losses(self.metrics.path, self.run_dir / "loss.png")
        return {"step": self.step, **last_val}

    def close(self, ok: bool) -> bool:
        """End of the run, finished or failed: the save in flight finished (``ok``) or abandoned, background
        threads joined, metrics and TensorBoard closed. False when a thread would not stop (the caller then
        ends the process without the interpreter's shutdown)."""
        try:
            clean = self.checkpointer.close(finish=ok)
        finally:
            self.profiler.close()
            self.metrics.close()
        return clean

    # ------------------------------------------------------------------ stages
    def consumed_tokens(self) -> dict[str, int]:
        """Tokens drawn from each dataset path by all ranks since the run began."""
        if self.curriculum is not None:
            return self.curriculum.consumed_tokens()
        return dict(self.batches.consumed_tokens)

    def _enter_stage(self, plan: StagePlan) -> None:
        """Make ``plan``'s settings current: its config, batch arithmetic, batches, guard and recompute."""
        self.cfg = plan.cfg
        self.stage_name = plan.name
        self.derived = derive(plan.cfg, self.world_size, vocab_size=self.derived.model_args.vocab_size)
        self.batches = self.curriculum.batches
        self.guard.reconfigure(plan.cfg.stability)
        if hasattr(self.model, "layers"):
            set_recompute(self.model, plan.cfg.recompute.mode, plan.cfg.recompute.every)
        self._stage_losses, self._stage_t0 = [], time.time()

    def _stage_boundary(self) -> bool:
        """After the last step of a stage that is not the last: close it, start the next, checkpoint."""
        c = self.curriculum
        if c is None or self.step != c.plan.end_step or c.index == len(c.plans) - 1:
            return False
        self._stage_summary()
        nxt = c.advance()
        self._enter_stage(nxt)
        self.events.write(
            "stage_start", stage=nxt.name, step=self.step, end_step=nxt.end_step, lr_end=nxt.lr_end,
            mixture={p: w for p, w in zip(c.paths, nxt.weights) if w > 0},
        )  # fmt: skip
        self.save()
        return True

    def _stage_summary(self) -> None:
        """The ``stage_end`` event and console line: tokens per dataset, first and last loss, time."""
        c = self.curriculum
        losses = self._stage_losses or [float("nan")]
        tokens = c.stage_tokens() if c is not None else dict(self.batches.consumed_tokens)
        self.events.write(
            "stage_end", stage=self.stage_name, step=self.step, tokens=tokens, loss_start=losses[0],
            loss_end=losses[-1], time_s=round(time.time() - self._stage_t0, 3),
        )  # fmt: skip

    def _rollback(self, decision) -> None:  # noqa: ANN001
        """Go back to the newest good state before the spike and skip the data window that caused it."""
        self._wait_checkpoint()
        available = [int(p.name[5:]) for p in self.checkpointer.committed()]
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
            path = self._ckpt_dir(plan.restore_step)
            state, source = self.checkpointer.load(path, self.model, self.optimizer), str(path)
        self._restore_trainer_state(state, guard=False)
        self.batches.consumed_samples += plan.skip_batches * self.derived.global_batch
        self.events.write(
            "rollback_done",
            step=self.step,
            source=source,
            skipped_batches=plan.skip_batches,
            skipped_samples=plan.skip_batches * self.derived.global_batch,
            lr_factor=plan.lr_factor,
            lr_until_step=plan.lr_until_step,
            detected_step=plan.detected_step,
        )

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_dir(self, step: int) -> Path:
        return self.checkpointer.dir / f"step_{step:08d}"

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "scaler": self.scaler.state_dict(),
            "data": self.curriculum.state_dict() if self.curriculum else self.batches.state_dict(),
            "guard": self.guard.state_dict(),
            "config_hash": config_hash(config_to_dict(self.base_cfg)),
            "world_size": self.world_size,
            "grad_accum": self.derived.grad_accum,
        }

    def _wait_checkpoint(self) -> None:
        """Wait for the asynchronous save in flight (if any); its commit goes to events.jsonl."""
        committed = self.checkpointer.wait()
        if committed is not None:
            self.events.write("checkpoint", step=int(committed.name[5:]), path=str(committed))

    def save(self) -> None:
        """Checkpoint now (in the background with checkpoint.async_save); keep a host copy for rollbacks."""
        state = self.trainer_state()
        if self.cfg.checkpoint.async_save:
            self._wait_checkpoint()  # one save in flight: the previous one commits first (and is logged)
            self.checkpointer.save_async(self.step, self.model, self.optimizer, state)
        else:
            path = self.checkpointer.save(self.step, self.model, self.optimizer, state)
            self.events.write("checkpoint", step=self.step, path=str(path))
            self.faults.after_save(self.step, path)
        if self.cfg.stability.enabled and self.cfg.stability.snapshot_max_gb > 0:
            self.snapshot.capture(self.step, self.model, self.optimizer, state)

    def _load(self, path: Path) -> None:
        state = self.checkpointer.load(path, self.model, self.optimizer)
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
            self._enter_stage(self.curriculum.plan)
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

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
from llmtrain.data.loader import BatchIterator, build_datasets
from llmtrain.data.manifest import read_manifest
from llmtrain.distributed.device import init_distributed, resolve_device
from llmtrain.distributed.parallelize import parallelize
from llmtrain.errors import LLMTrainError
from llmtrain.models import build_model
from llmtrain.train.checkpoint import Checkpointer
from llmtrain.train.fault import FaultInjector, HangWatchdog, PreemptionHandler
from llmtrain.train.metrics import PEAK_TFLOPS, MetricsLogger, memory_bytes, plot_losses
from llmtrain.train.optim import build_optimizer
from llmtrain.train.precision import LossScaler, autocast, grad_norm_
from llmtrain.train.schedule import build_lr_schedule
from llmtrain.train.stability import EventLog, HostSnapshot, StabilityGuard


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
        self.train_samples, self.valid_samples = build_datasets(cfg)
        manifest = read_manifest(cfg.data.datasets[0].path)
        self.eos_id = manifest["tokenizer"]["eos_id"]
        self.derived = derive(cfg, world_size=self.world_size, vocab_size=manifest["tokenizer"]["vocab_size"])
        d = self.derived
        notes = list(notes or [])
        if cfg.train.epochs:  # the seed's epoch count caps the run (max_steps still applies)
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
        self.model = build_model(d.model_args, device="meta")
        self.fsdp = parallelize(self.model, cfg, dims, meshes["world"] if meshes else None, self.device_type)
        self.model.to_empty(device=self.device)
        self.model.init_weights(seed=cfg.train.seed)
        # FSDP averages gradients over the data-parallel ranks; the loss is pre-multiplied to undo it.
        self.grad_scale = float(self.dp_size) if self.fsdp else 1.0

        self.optimizer = build_optimizer(self.model, cfg.train, self.device_type)
        self.lr_at = build_lr_schedule(cfg.train)
        self.scaler = LossScaler.from_config(cfg.train)
        self.batches = BatchIterator(
            self.train_samples, d.global_batch, d.micro_batch_size, self.dp_rank, self.dp_size
        )
        self.step = 0
        self.tokens_seen = 0

        # Survival: stability guard, fault injection (drills), checkpoints with fallback to the previous one.
        self.events = EventLog(self.run_dir, echo=None, enabled=self.rank == 0)
        self.guard = StabilityGuard(cfg.stability)
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
            self.run_dir, cfg.logging, cfg.train.max_steps, self.step, enabled=self.rank == 0
        )
        self.events.echo = self.metrics.message
        for note in notes:
            self.metrics.message(f"note: {note}")
        for message in choice.messages():
            self.events.write("checkpoint_fallback", reason=message)
        if choice.path is not None:
            self.events.write("resumed", step=self.step, path=str(choice.path))
        self.peak_flops = (cfg.logging.peak_tflops or PEAK_TFLOPS.get(self.device_type, 1.0)) * 1e12

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (identity on one rank)."""
        if self.dp_group is not None:
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
        micro_batches = self.faults.before_step(step, self.batches.next_step())
        local_tokens = sum(int((mb["labels"] != -100).sum()) for mb in micro_batches)
        n_tokens = int(self._dp_sum(torch.tensor(local_tokens, device=self.device)).item())
        loss_sum = torch.zeros((), device=self.device)
        for mb in micro_batches:
            loss = self.faults.poison_loss(step, self.forward_loss(mb))
            self.scaler.scale_loss(loss * (self.grad_scale / n_tokens)).backward()
            loss_sum += loss.detach()
        self.faults.after_backward(step, self.model)
        params = [p for p in self.model.parameters() if p.grad is not None]
        self.scaler.unscale_(params)
        grad_norm = grad_norm_(params, cfg.grad_clip_norm)
        skipped = self.scaler.update(grad_norm)
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += n_tokens
        loss_value = self._dp_sum(loss_sum.float()).item() / n_tokens
        return {"loss": loss_value, "lr": lr, "grad_norm": grad_norm, "skipped": skipped, "tokens": n_tokens}

    @torch.no_grad()
    def validate(self) -> dict:
        """Mean loss and perplexity over ``eval.eval_iters`` held-out micro-batches (same batches every time)."""
        if len(self.valid_samples) == 0:
            return {}
        self.model.eval()
        mbs = self.derived.micro_batch_size
        it = BatchIterator(self.valid_samples, mbs * self.dp_size, mbs, self.dp_rank, self.dp_size)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, target tokens]
        for _ in range(self.cfg.eval.eval_iters):
            for mb in it.next_step():
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
        try:
            while self.step < max_steps:
                out = self.train_step()
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
                        continue
                    if decision.action == "give_up":
                        raise TrainingDiverged(decision.reason)
                if self.step % log_steps == 0 or self.step == max_steps:
                    dt = time.time() - t_last
                    tps = (self.tokens_seen - tokens_last) / max(dt, 1e-9)
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
                            "consumed_tokens": dict(self.batches.consumed_tokens),
                            "memory_bytes": memory_bytes(self.device_type),
                        }
                    )
                    t_last, tokens_last, step_last = time.time(), self.tokens_seen, self.step
                if cfg.train.eval_steps and self.step % cfg.train.eval_steps == 0:
                    last_val = self._log_validation()
                if self.checkpointer.should_save(self.step):
                    self.save()
                committed = self.checkpointer.poll()
                if committed is not None:
                    self.events.write("checkpoint", step=int(committed.name[5:]), path=str(committed))
                if preempt.should_stop():
                    self.save()
                    self.checkpointer.wait()
                    self.events.write("preempted", step=self.step, signal=str(preempt.received))
                    self.metrics.close()
                    return {"step": self.step, "preempted": True}
            if not (cfg.train.eval_steps and self.step % cfg.train.eval_steps == 0):
                last_val = self._log_validation()
            if cfg.checkpoint.save_at_end and self.checkpointer.latest() != self._ckpt_dir(self.step):
                self.save()
            self.checkpointer.wait()
        finally:
            preempt.uninstall()
            if watchdog is not None:
                watchdog.stop()
        self.metrics.close()
        if cfg.logging.plot and self.rank == 0:
            plot_losses(self.metrics.path, self.run_dir / "loss.png")
        return {"step": self.step, **last_val}

    def _rollback(self, decision) -> None:  # noqa: ANN001
        """Go back to the newest good state before the spike and skip the data window that caused it."""
        self.checkpointer.wait()
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
            "data": self.batches.state_dict(),
            "guard": self.guard.state_dict(),
            "config_hash": config_hash(config_to_dict(self.cfg)),
        }

    def save(self) -> None:
        """Checkpoint now (in the background with checkpoint.async_save); keep a host copy for rollbacks."""
        state = self.trainer_state()
        if self.cfg.checkpoint.async_save:
            self.checkpointer.save_async(self.step, self.model, self.optimizer, state)
        else:
            path = self.checkpointer.save(self.step, self.model, self.optimizer, state)
            self.events.write("checkpoint", step=self.step, path=str(path))
            self.faults.after_save(self.step, path)
        if self.cfg.stability.enabled and self.cfg.stability.snapshot_max_gb > 0:
            self.snapshot.capture(self.step, self.model, self.optimizer, state)

    def _load(self, path: Path) -> None:
        self._restore_trainer_state(self.checkpointer.load(path, self.model, self.optimizer), guard=True)

    def _restore_trainer_state(self, state: dict, guard: bool) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.scaler.load_state_dict(state["scaler"])
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

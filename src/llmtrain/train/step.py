"""One optimizer step and validation: forward, loss, backward, clipping, the optimizer (OLMo-core's TrainModule).

:class:`TrainStep` owns what touches the model's numbers; the loop (train/trainer.py) owns when. One step::

    for each micro-batch of this rank:  loss_sum / tokens_in_global_batch -> (scaled) backward
    unscale -> global grad norm (pre-clip, logged) -> skip the step if not finite, else clip + optimizer step

The loss is normalised by the number of target tokens of the whole global batch (not averaged per micro-batch),
so gradient accumulation and data parallelism compute exactly the single-process gradient. FSDP averages
gradients over the data-parallel ranks, so the loss is pre-multiplied by their number (``grad_scale``) to undo
it. Under gradient accumulation FSDP reduces once per optimizer step, on the last micro-batch (ZeRO 0-2 and
the replicate dim of HSDP; ZeRO 3 with ``parallel.reduce_grads: per_step``): distributed/grad_sync.py. With
``train.fp8: tensorwise`` under FSDP the fp8 weight scales of the next step's all-gather are computed once
after the optimizer step (distributed/float8.py). Under pipeline parallelism the schedule runs forward and backward of every micro-batch itself
(distributed/pipeline.py); with MoE the router's load figures and aux-free bias update ride along
(models/common/moe.py). Settings a stage may change (label smoothing, precision, clipping, document masks)
are read from the config passed in, so a stage switch is a different argument, not a mutation. Under context
parallel each micro-batch is split here (distributed/context_parallel.py): the token count stays the unsplit
batch's, each rank's loss sums its own tokens, the reported loss is summed over CP and ``grad_scale`` x cp
undoes FSDP's average over the flattened dp_shard x cp mesh.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.distributed as dist

from llmtrain.config.schema import Config
from llmtrain.data.loader import BatchIterator
from llmtrain.distributed import context_parallel, float8, grad_sync
from llmtrain.resolve.derived import Derived
from llmtrain.train.fault import FaultInjector
from llmtrain.train.health import HealthMonitor
from llmtrain.train.loss import HeadLoss, LogitStats, cross_entropy_fn, resolve_loss_chunk
from llmtrain.train.precision import LossScaler, autocast, grad_norm_
from llmtrain.train.timing import StepTimer


class TokenLoss:
    """Summed token cross-entropy in fp32 (ignore index -100); the caller divides by the global batch's target
    tokens. ``label_smoothing`` follows the active stage. ``chunk_tokens`` > 0 (``train.loss_chunk_tokens``
    resolved, train/loss.py) makes :meth:`TrainStep.forward_loss` compute it inside the model's forward in
    token chunks, never holding ``[tokens, vocab]`` logits."""

    def __init__(self, label_smoothing: float = 0.0, chunk_tokens: int = 0, compiled: bool = False):
        self.label_smoothing = float(label_smoothing)
        self.chunk_tokens = int(chunk_tokens)
        self.compiled = compiled  # train.compile: the cross-entropy runs compiled (train/loss.py)
        self.z_loss = 0.0  # train.z_loss of the active stage while training; 0 in validation
        self.stats: LogitStats | None = None  # set on log steps: the logits' RMS (train/health.py)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.stats is not None:
            self.stats.add(logits)
        return cross_entropy_fn(self.compiled)(logits, labels, self.label_smoothing, self.z_loss)


class TrainStep:
    """Forward/backward/optimizer of one step and validation, for this rank's (parallelized) model."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: LossScaler,
        loss: TokenLoss,
        device: torch.device,
        timer: StepTimer,
        faults: FaultInjector,
        *,
        dp_group: Any,
        pipeline: Any,
        moe: Any,
        grad_scale: float,
        world_size: int,
    ):
        self.model, self.optimizer, self.scaler, self.loss_fn = model, optimizer, scaler, loss
        self.device, self.timer, self.faults = device, timer, faults
        self.dp_group, self.pipeline, self.moe = dp_group, pipeline, moe
        self.grad_scale, self.world_size = grad_scale, world_size
        self.cp = context_parallel.find(model)  # context parallel: set by distributed/parallelize.py
        if self.cp is not None:  # FSDP averages over dp x cp ranks, the loss is a sum over all of them
            self.grad_scale *= self.cp.size
        self._sync: grad_sync.GradSync | None = None  # built on the first step (it needs cfg.parallel)
        self._sync_built = False
        self.health: HealthMonitor | None = None  # per-layer health metrics of log steps (train/health.py)
        self.replicas: Any = None  # fault_tolerance: the group's ft.replicas.ReplicaSet (set by ft.attach)

    def replica_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the replica groups of this step's quorum (identity without fault_tolerance)."""
        return self.replicas.sum_(t) if self.replicas is not None else t

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (identity on one rank)."""
        if self.dp_group is not None:
            with self.timer.phase("comm_dp"):
                dist.all_reduce(t, group=self.dp_group)
        return t

    def moe_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Expert loads and aux loss summed over the data-parallel ranks and the replica groups (the aux-free
        bias update then sees the global batch's counts, as on one process)."""
        return self.replica_sum(self.dp_sum(t))

    def forward_loss(self, cfg: Config, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        self.loss_fn.label_smoothing = float(cfg.train.label_smoothing)
        mb = {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
        if self.cp is not None:  # this rank's sequence chunks; the attention mask is set for all keys
            mb = self.cp.shard(mb, cfg.model.document_mask)
        doc_ids = mb["document_ids"] if cfg.model.document_mask and self.cp is None else None
        pos_ids = mb["position_ids"] if cfg.model.document_mask or self.cp is not None else None
        vocab = int(getattr(getattr(self.model, "args", None), "vocab_size", 0))
        chunk = resolve_loss_chunk(cfg.train.loss_chunk_tokens, vocab)
        self.loss_fn.chunk_tokens = chunk
        with autocast(cfg.train.precision, self.device.type):
            if chunk:  # the model runs the chunked loss on its final hidden states (train/loss.py)
                head_loss = HeadLoss(
                    chunk, self.loss_fn.label_smoothing, self.loss_fn.compiled, self.loss_fn.z_loss,
                    self.loss_fn.stats,
                )  # fmt: skip
                return self.model(
                    mb["input_ids"], position_ids=pos_ids, document_ids=doc_ids, labels=mb["labels"],
                    head_loss=head_loss,
                )  # fmt: skip
            logits = self.model(mb["input_ids"], position_ids=pos_ids, document_ids=doc_ids)
        return self.loss_fn(logits, mb["labels"])

    def run(self, cfg: Config, step: int, lr: float, batches: BatchIterator) -> dict:
        """Take optimizer step ``step`` at learning rate ``lr`` on the next global batch of ``batches``."""
        self.loss_fn.label_smoothing = float(cfg.train.label_smoothing)
        self.loss_fn.z_loss = float(cfg.train.z_loss)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        timer = self.timer  # phases: train/timing.py (comm inside compute pauses compute)
        with timer.phase("data"):
            micro_batches = self.faults.before_step(step, batches.next_step())
            local_tokens = sum(int((mb["labels"] != -100).sum()) for mb in micro_batches)
        n_tokens = int(self.replica_sum(self.dp_sum(torch.tensor(local_tokens, device=self.device))).item())
        health = self._health()
        log_step = step % max(cfg.train.log_steps, 1) == 0 or step == cfg.train.max_steps
        if log_step:  # the logits' squares and the attention's q/k norms of this step (train/health.py)
            health.record(True)
            self.loss_fn.stats = health.stats
        with timer.phase("compute"):
            loss_sum = self.forward_backward(cfg, step, micro_batches, n_tokens, batches)
            self.faults.after_backward(step, self.model)
            if self.replicas is not None:  # replica groups without FSDP's hook: sum gradients across groups
                self.replicas.sync_grads(self.model)
            params = [p for p in self.model.parameters() if p.grad is not None]
            self.scaler.unscale_(params)
            health.step_values(params)
            if log_step:
                health.take_norms()  # per-layer norms before clipping, no communication
            with timer.phase("comm_norm" if self.world_size > 1 else "compute"):
                pp_group = self.pipeline.pp_group if self.pipeline is not None else None
                grad_norm = grad_norm_(params, cfg.train.grad_clip_norm, pp_group)
            if not math.isfinite(grad_norm):
                health.count_nonfinite(params)
            skipped = self.scaler.update(grad_norm)
            committed = self.replicas.should_commit() if self.replicas is not None else True  # ft/replicas.py
            if not skipped and committed:
                if self.pipeline is not None:  # tied embeddings: the head's copy takes the final gradient
                    self.pipeline.before_optimizer_step()
                self.optimizer.step()
                float8.after_optimizer_step(self.model, cfg.train.fp8)
            self.optimizer.zero_grad(set_to_none=True)
            moe = (
                self.moe.finish(self.model, self.moe_sum, n_tokens, not skipped and committed)
                if self.moe
                else {}
            )
        self.loss_fn.stats = None
        with timer.phase("comm_ctrl" if self.world_size > 1 else "compute"):
            rank = dist.get_rank() if dist.is_initialized() else 0
            health_row = health.reduce(rank) if log_step else {}
        loss_sum = self.cp.sum_(loss_sum.float()) if self.cp is not None else loss_sum
        loss_value = self.replica_sum(self.dp_sum(loss_sum.float())).item() / n_tokens
        timer.step_done()
        return {
            "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "skipped": skipped, "tokens": n_tokens, **moe,
            "health": health_row, "committed": committed, **(self.replicas.row() if self.replicas else {}),
        }  # fmt: skip

    def forward_backward(
        self, cfg: Config, step: int, micro_batches: list[dict], n_tokens: int, batches: BatchIterator
    ) -> torch.Tensor:
        """Forward and backward of this step's micro-batches, each loss scaled by ``grad_scale / n_tokens`` (the
        global batch's target tokens), through the pipeline schedule under PP; returns the summed loss."""
        loss_sum = torch.zeros((), device=self.device)
        if self.pipeline is not None:  # the schedule runs forward/backward of every micro-batch
            scale = self.scaler.scale_loss(torch.tensor(self.grad_scale / n_tokens)).item()
            # replica groups: one schedule run per slot (keep computes missing groups' slots too; the
            # gradients accumulate), as the schedule takes a fixed number of micro-batches (ft/data.py)
            runs = (
                cast(Any, batches).split_slots(micro_batches)
                if self.replicas is not None
                else [micro_batches]
            )
            for run in runs:
                loss_sum = loss_sum + self.pipeline.train_step(
                    run, scale, lambda loss: self.faults.poison_loss(step, loss)
                )
            return loss_sum
        # the layout is fixed for the run: one switch, built on first use (under PP the schedule switches it)
        if not self._sync_built:
            self._sync = grad_sync.for_model(self.model, cfg.parallel)
            self._sync_built = True
        for i, mb in enumerate(micro_batches):
            if self._sync is not None:  # reduce gradients on the last micro-batch only
                self._sync.before_micro_batch(i, len(micro_batches))
            if self.moe is not None:
                self.moe.start(self.model, mb, self.scaler.scale * (self.grad_scale / n_tokens))
            loss = self.faults.poison_loss(step, self.forward_loss(cfg, mb))
            if self.moe is not None:
                self.moe.end(self.model)
            self.scaler.scale_loss(loss * (self.grad_scale / n_tokens)).backward()
            loss_sum += loss.detach()
        return loss_sum

    def _health(self) -> HealthMonitor:
        """The health monitor of this rank's model, built on first use."""
        if self.health is None:
            pp = dist.get_world_size(self.pipeline.pp_group) if self.pipeline is not None else 1
            calls = self.pipeline.n_mb if self.pipeline is not None else None
            layers = int(getattr(getattr(self.model, "args", None), "num_layers", 0))
            self.health = HealthMonitor(self.model, layers, self.world_size, pp, calls)
        return self.health

    @torch.no_grad()
    def validate(self, cfg: Config, derived: Derived, valid_samples: Any, dp_rank: int, dp_size: int) -> dict:
        """Mean loss and perplexity over ``eval.eval_iters`` held-out micro-batches (same batches every time)."""
        if len(valid_samples) == 0:
            return {}
        self.loss_fn.label_smoothing = float(cfg.train.label_smoothing)  # the pipeline calls it directly
        self.loss_fn.z_loss, self.loss_fn.stats = 0.0, None  # val_loss is the cross-entropy alone
        self.model.eval()
        mbs = derived.micro_batch_size
        # Under PP each eval iteration is one forward-only pass of the schedule over a whole global batch
        # (the pipeline's fixed micro-batch shape): eval_iters then covers global_batch / (micro_batch_size x
        # dp) times the sequences of the plain loop.
        per_iter = derived.global_batch if self.pipeline is not None else mbs * dp_size
        it = BatchIterator(valid_samples, per_iter, mbs, dp_rank, dp_size)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, target tokens]
        for _ in range(cfg.eval.eval_iters):
            step_mbs = it.next_step()
            if self.pipeline is not None:
                sums[0] += self.pipeline.eval_loss(step_mbs).double()
                sums[1] += sum(int((mb["labels"] != -100).sum()) for mb in step_mbs)
                step_mbs = []
            for mb in step_mbs:
                sums[0] += self.forward_loss(cfg, mb).double()
                sums[1] += int((mb["labels"] != -100).sum())
        self.model.train()
        if self.cp is not None:  # each CP rank summed its own tokens' losses (the counts are whole batches')
            sums[0] = self.cp.sum_(sums[0].clone())
        total, count = self.dp_sum(sums).tolist()
        val_loss = total / max(count, 1)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

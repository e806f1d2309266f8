"""The per-step protocol of a replica group: quorum, live heal, cross-group sums, commit vote, events.

:func:`attach` (called by the trainer when ``fault_tolerance.enabled``) builds torchft's ``Manager`` over a
reconfigurable gloo/NCCL process group spanning the groups, registers the live state (ft/state.py) for healing,
installs the cross-group gradient all-reduce (FSDP2's all-reduce hook on every FSDP module: it runs on each
reduce-scattered shard, HSDP-style; the gradients no hook covers, all of them under pipeline parallel, are
all-reduced after the backward: ft/grads.py), wraps the
batches (ft/data.py) and adds a callback for the ``run_end`` fingerprint. The trainer then calls, per step::

    replicas.start_step(trainer)      # quorum (a lagging group heals here: its step jumps to the peers')
    ... TrainStep.run: replicas.sum_(token count, loss), gradient hook, replicas.should_commit() ...
    replicas.end_step(trainer, out)   # False: not committed (a group died during it); the step is taken again

Gradients are *summed* across groups, and the loss is normalised by the token count of all groups present
(``sum_``), so a full quorum computes the single-process gradient of the global batch, and ``keep`` (the
survivors compute the missing slices) computes it too. Events (``events.jsonl``, each row with ``replica``):
``quorum`` and ``replica_lost`` / ``replica_joined`` when the membership changes (written by the first group of
the quorum), ``heal`` (by the healed group: the slowest rank's seconds, the bytes of all its ranks),
``samples_skipped`` (shrink), ``step_retried``, and one ``run_end`` per group with ``state_sha256``. The first
group of each step's quorum writes the run's files (:meth:`ReplicaSet.writes_run_files`): the checkpoint and the
step's ``metrics.jsonl`` row (with ``replicas``), so the metrics go on while group 0 is down.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.errors import LLMTrainError
from llmtrain.ft.data import ReplicaBatches
from llmtrain.ft.grads import fsdp_units, hook_coverage, sum_grads
from llmtrain.ft.layout import LIGHTHOUSE_ENV, ReplicaLayout, fsdp_hook_sums
from llmtrain.ft.lighthouse import LIGHTHOUSE_LOST_EXIT_CODE
from llmtrain.ft.state import live_state, load_live_state, state_bytes, state_sha256
from llmtrain.train.callbacks import Callback
from llmtrain.train.stability import EventLog


class LighthouseLost(LLMTrainError):
    """No quorum could be formed: the lighthouse stopped answering (exit code 76, docs/reliability.md)."""

    exit_code = LIGHTHOUSE_LOST_EXIT_CODE


class ReplicaEventLog(EventLog):
    """The run's event log, every row tagged with this group's replica id."""

    def __init__(self, base: EventLog, replica: int):
        super().__init__(base.path.parent, echo=base.echo, enabled=base.enabled)
        self.replica = replica

    def write(self, event: str, **fields: Any) -> None:
        super().write(event, replica=self.replica, **fields)


class ReplicaCallback(Callback):
    """``run_end``: this group's step and the fingerprint of its parameters and optimizer state; at the close,
    torchft's manager is shut down."""

    def train_end(self, trainer: Any) -> None:
        digest = state_sha256(trainer.model, trainer.optimizer)
        trainer.events.write("run_end", step=trainer.step, state_sha256=digest)

    def close(self, trainer: Any, ok: bool) -> None:
        if trainer.replicas is not None:  # torchft's servers and threads (its quorum, heal transport)
            trainer.replicas.close()


def _store(group_rank: int, group_world: int) -> tuple[str, int]:
    """A fresh TCPStore for this group's manager (rank 0 hosts it; its address travels over the group)."""
    box: list[Any] = [None]
    if group_rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        _store.keep = store  # type: ignore[attr-defined]  # alive as long as the process
        box[0] = (socket.gethostname(), store.port)
    if group_world > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _group_all(flag: bool, device: torch.device) -> bool:
    """``flag`` on every rank of this group (the default process group is the group's ranks). Each rank of a
    group must take the same quorums (torchft's quorum waits for all of them), so a decision made on a rank's own
    clock is first agreed on: one rank leaving a wait loop while another takes one more quorum stalls that rank
    until ``quorum_timeout_s`` (seen as LighthouseLost under load, when the ranks' clocks started seconds apart)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _group_total(size: int, seconds: float, device: torch.device) -> tuple[int, float]:
    """The heal of the whole group: ``size`` summed over the group's ranks (each received its own shards), the
    slowest rank's ``seconds`` (the default process group is the group's ranks)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return size, seconds
    total = torch.tensor([size], dtype=torch.int64, device=device)
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return int(total.item()), float(slowest.item())


class ReplicaSet:
    """torchft's manager for this group, and the hooks of the module docstring."""

    def __init__(self, trainer: Any, layout: ReplicaLayout):
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        ft = trainer.cfg.fault_tolerance
        self.layout, self.policy = layout, ft.batch_policy
        self.trainer = trainer
        group_rank = dist.get_rank() if dist.is_initialized() else 0
        host, port = _store(group_rank, layout.group_world)
        timeout = timedelta(seconds=ft.timeout_s)
        pg_cls = ProcessGroupNCCL if trainer.device.type == "cuda" else ProcessGroupGloo
        lighthouse = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if lighthouse and "://" not in lighthouse:
            lighthouse = f"http://{lighthouse}"
        self._healed: dict[str, Any] | None = None
        self.manager = Manager(
            pg=pg_cls(timeout=timeout), load_state_dict=self._load, state_dict=self._state,
            min_replica_size=ft.min_replicas, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), connect_timeout=timeout,
            rank=group_rank, world_size=layout.group_world, store_addr=host, store_port=port,
            lighthouse_addr=lighthouse, replica_id=f"replica{layout.replica_id:04d}", init_sync=False,
        )  # fmt: skip
        if trainer.step:  # resumed from a checkpoint: the quorum compares steps
            self.manager.load_state_dict({"step": trainer.step, "batches_committed": 0})
        self.participants, self.position = layout.replicas, layout.replica_id
        self.members: list[int] | None = None
        self._install_hooks(trainer.model)

    # ---- heal (torchft calls these on the quorum's thread, inside start_quorum)
    def _state(self) -> dict[str, Any]:
        return live_state(self.trainer)

    def _load(self, state: dict[str, Any]) -> None:
        load_live_state(self.trainer, state)
        self._healed = {"bytes": state_bytes(state["tensors"]), "step": self.trainer.step}

    # ---- gradients
    def _install_hooks(self, model: torch.nn.Module) -> None:
        """FSDP2's all-reduce hook on every FSDP unit of ``model`` (where ``fsdp_hook_sums`` allows); the parameters
        no hook reduces are summed by :meth:`sync_grads`."""
        pipelined = getattr(self.trainer.step_fn, "pipeline", None) is not None
        ft = self.trainer.cfg.fault_tolerance
        hooks = fsdp_hook_sums(pipelined, ft.batch_policy, ft.replicas)
        hooked, self._explicit = hook_coverage(model, hooks)
        if hooked:
            for m in fsdp_units(model):
                m.set_all_reduce_hook(self._all_reduce_hook)

    def _all_reduce_hook(self, output: torch.Tensor) -> None:
        self.manager.allreduce(output, reduce_op=dist.ReduceOp.SUM).wait()

    def sync_grads(self, model: torch.nn.Module) -> None:
        """After the backward: sum the gradients no FSDP hook reduced (all of them without FSDP or under
        pipeline parallel; expert parameters outside FSDP) across the groups, in one all-reduce."""
        if self._explicit:
            sum_grads(self._explicit, self.sum_)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the groups of this step's quorum (in place; returned)."""
        self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM).wait()
        return t

    def should_commit(self) -> bool:
        return bool(self.manager.should_commit())

    # ---- the step
    def start_step(self, trainer: Any) -> None:
        t0 = time.time()
        before = trainer.step
        self._quorum()
        if self.members is None and trainer.step == 0:  # a fresh job starts with all its groups (or the
            deadline = t0 + trainer.cfg.fault_tolerance.quorum_timeout_s  # ones there by the quorum timeout)
            while self.manager.num_participants() < self.layout.replicas and _group_all(
                time.time() < deadline, trainer.device
            ):
                time.sleep(0.1)
                self._quorum()
        self.participants = max(self.manager.num_participants(), 1)
        self.position = self.manager.participating_rank() or 0
        trainer.batches.begin(self.participants, self.position)
        trainer.faults.degraded = self.participants < self.layout.replicas  # fault.slow_when: degraded
        healed_now = self._healed is not None
        if self._healed is not None:  # every rank of the group healed (torchft heals a group as a whole)
            healed, self._healed = self._healed, None
            size, seconds = _group_total(healed["bytes"], time.time() - t0, trainer.device)
            trainer.events.write(
                "heal", step=trainer.step, from_step=before, seconds=round(seconds, 3), bytes=size
            )
        if self.members is None:  # this process's first quorum, before any group passes it (the mask's sum):
            # the metrics files are repaired by the group that starts a run's writing, never by one that
            # rejoins a live run (it healed): the others are appending to them (train/metrics.py)
            for text in trainer.metrics.start(trainer.step, repair=not healed_now and self.position == 0):
                trainer.events.write("log_damaged", reason=text)
        mask = torch.zeros(self.layout.replicas, dtype=torch.float32)
        mask[self.layout.replica_id] = 1.0
        members = [i for i, v in enumerate(self.sum_(mask).tolist()) if v > 0]
        # One group writes a change: the lowest one that saw the previous quorum too (a job's first quorum:
        # the lowest member), so a group that just (re)joined never reports its own arrival.
        previous = self.members
        if previous is not None:
            witnesses = sorted(set(members) & set(previous))
        else:  # this process's first quorum: a group that healed in it is the one that joined
            witnesses = [] if healed_now else members
        if members != previous and witnesses and witnesses[0] == self.layout.replica_id:
            old = set(previous or [])
            for r in sorted(old - set(members)):
                trainer.events.write("replica_lost", step=trainer.step, lost=r, members=members)
            for r in sorted(set(members) - old) if previous is not None else []:
                trainer.events.write("replica_joined", step=trainer.step, joined=r, members=members)
            trainer.events.write(
                "quorum", step=trainer.step, members=members, participants=self.participants,
                quorum_id=int(getattr(self.manager, "_quorum_id", -1)),
            )  # fmt: skip
        self.members = members

    def _quorum(self) -> None:
        """torchft's quorum; LighthouseLost when the lighthouse cannot be reached (ft/lighthouse.py)."""
        try:
            self.manager.start_quorum()
        except Exception as e:  # torchft raises RuntimeError / its own errors from the quorum thread
            raise LighthouseLost(
                f"replica group {self.layout.replica_id}: no quorum ({type(e).__name__}: {str(e)[:300]}). The "
                "lighthouse is gone or unreachable: this group stops here; the run resumes from its newest "
                "checkpoint once a lighthouse runs again (rerun the same `llmtrain launch` command)."
            ) from e

    def end_step(self, trainer: Any, out: dict) -> bool:
        committed = bool(out.get("committed", True))
        skipped = trainer.batches.end_step(committed)
        step = trainer.step + 1
        if not committed:
            trainer.events.write("step_retried", step=step, participants=self.participants)
        elif skipped and self.position == 0:
            ranges = [trainer.batches.slot_range(j) for j in skipped]
            trainer.events.write(
                "samples_skipped", step=step, slots=skipped, samples=[[r.start, r.stop] for r in ranges],
                count=sum(len(r) for r in ranges),
            )  # fmt: skip
        return committed

    def writes_run_files(self) -> bool:
        """The first group of the step's quorum (the lowest live replica id) writes the run's files: its
        checkpoints and each step's metrics row (validation, TensorBoard, the loss plot)."""
        return self.position == 0

    def row(self) -> dict[str, int]:
        """Fields of the step's metrics row."""
        return {"replicas": self.participants}

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def attach(trainer: Any) -> ReplicaSet:
    """Switch ``trainer`` to replica groups (see the module docstring); returns the ReplicaSet."""
    layout = ReplicaLayout.from_env(trainer.cfg, trainer.world_size)
    trainer.events = ReplicaEventLog(trainer.events, layout.replica_id)
    replicas = ReplicaSet(trainer, layout)
    batches = trainer.batches
    batches.dp_rank, batches.dp_size = batches.dp_rank, batches.dp_size * layout.replicas
    trainer.batches = ReplicaBatches(
        batches, layout.replicas, trainer.dp_size, trainer.cfg.fault_tolerance.batch_policy
    )
    trainer.step_fn.replicas = replicas
    trainer.callbacks.append(ReplicaCallback())
    return replicas

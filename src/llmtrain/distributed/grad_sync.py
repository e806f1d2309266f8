"""Data-parallel gradient reduction under gradient accumulation: once per optimizer step, not per micro-batch.

FSDP2 reduces a module's gradients in its post-backward hook, so by default every micro-batch's backward
reduce-scatters (and on a replicate dim all-reduces) the whole gradient, and accumulating k micro-batches
moves k times the data-parallel bytes of one. ``parallel.reduce_grads`` chooses (:func:`sync_mode`):

==============  ===========================================================================================
auto            ZeRO 0-2: ``per_step``. ZeRO 3: the shard dim reduce-scatters every micro-batch (gradients stay
                sharded, the point of ZeRO-3); the replicate dim of HSDP all-reduces once per step
per_step        every stage reduces once per step, on the last micro-batch
per_microbatch  every micro-batch reduces (the trainer before this switch; the parity tests' reference)
==============  ===========================================================================================

How, before micro-batch i of k (on the root FSDP module, recursively; :class:`GradSync`):

* per_step: ``set_requires_gradient_sync(i == k - 1)``. FSDP2 keeps each parameter's unsharded gradient and
  adds the next micro-batch's into it; the last backward reduces the sum once. ZeRO 0-2 also
  ``set_reshard_after_backward(i == k - 1)``: their parameters stay gathered between micro-batches, so the
  all-gather runs once per step as well (they are gathered from forward to backward anyway: no extra peak).
  ZeRO 0 is FSDP2 on a (replicate = dp, shard = 1) mesh (distributed/parallelize.py), so this is the
  all-reduce of plain data parallelism, DDP's ``no_sync``.
* ZeRO 3 + HSDP under auto: ``set_requires_all_reduce(i == k - 1)``: each micro-batch reduce-scatters within
  its shard group into a sharded partial sum (one extra sharded gradient), the last one all-reduces it
  across the replicas.

Memory of per_step: between micro-batches every rank holds the full (unsharded) gradient of every FSDP
parameter, 4 bytes x parameters (the trainer keeps fp32 parameters; under bf16/fp16 FSDP2's policy computes
each micro-batch's gradient in 16 bits and adds it into an fp32 sum, its ``reduce_dtype``). ZeRO 0
and 1 hold it anyway; ZeRO 2 gives up its gradient sharding while it accumulates (the sharded gradient
exists after the last micro-batch only: use ``per_microbatch`` to keep it, at k x the reduce-scatter bytes);
ZeRO 3 with ``per_step`` adds 4 bytes x parameters to its ~(16 / dp) bytes per parameter, which is why it is
not its default. Without accumulation (one micro-batch) every mode is the same.

Pipeline parallel is not handled here: torch's schedules switch FSDP's gradient sync themselves, reducing on
each stage's last micro-batch. Expert-parallel expert weights are outside the blocks' FSDP: with ep equal to
the data-parallel size their gradients are exact by construction; with expert replicas (ep smaller) they are
reduced over the replicas by their own FSDP (ZeRO >= 1) or a gradient hook (ZeRO 0), distributed/expert_parallel.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from llmtrain.config.schema import ParallelConfig

if TYPE_CHECKING:
    from torch import nn

Mode = Literal["per_step", "replicate_per_step", "per_microbatch"]


def sync_mode(p: ParallelConfig) -> Mode:
    """What ``parallel.reduce_grads`` means for this layout: ``per_step`` (no reduction before the last
    micro-batch), ``replicate_per_step`` (ZeRO-3 HSDP: reduce-scatter per micro-batch, all-reduce per step) or
    ``per_microbatch``."""
    if p.reduce_grads == "per_step":
        return "per_step"
    if p.reduce_grads == "per_microbatch":
        return "per_microbatch"
    if p.effective_zero_stage() < 3:
        return "per_step"
    return "replicate_per_step" if p.data_parallel_replicate > 1 else "per_microbatch"


class GradSync:
    """Switches FSDP2's gradient reduction of one (FSDP-wrapped) model per micro-batch; see the module doc."""

    def __init__(self, model: nn.Module, mode: Mode, zero_stage: int):
        self.model, self.mode = model, mode
        self.keep_gathered = mode == "per_step" and zero_stage < 3
        self._deferred = False  # whether the switches are off now (a micro-batch that does not reduce)

    def before_micro_batch(self, index: int, count: int) -> None:
        """Call before the forward of micro-batch ``index`` of ``count``: reduce only on the last one."""
        last = index == count - 1
        if self.mode == "per_microbatch" or (last and not self._deferred):
            return
        from torch.distributed.fsdp import FSDPModule

        root = self.model
        assert isinstance(root, FSDPModule)  # for_model hands out a GradSync only then
        if self.mode == "per_step":
            root.set_requires_gradient_sync(last)
        else:
            root.set_requires_all_reduce(last)
        if self.keep_gathered:
            root.set_reshard_after_backward(last)
        self._deferred = not last


def for_model(model: nn.Module, p: ParallelConfig) -> GradSync | None:
    """A :class:`GradSync` when ``model`` is FSDP-wrapped (dp > 1) and the mode defers a reduction, else None."""
    from torch.distributed.fsdp import FSDPModule

    mode = sync_mode(p)
    if not isinstance(model, FSDPModule) or mode == "per_microbatch":
        return None
    return GradSync(model, mode, p.effective_zero_stage())

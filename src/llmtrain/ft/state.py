"""The live-heal state: what a lagging replica group receives from a peer, defined as the on-disk checkpoint.

A checkpoint is the model and optimizer state dicts (``train.checkpoint.store.tensor_state``, sharded where the
model is), every rank's RNG state (``train.checkpoint.rng``) and the trainer state (``Trainer.trainer_state``:
step, tokens seen, loss scaler, data position, stability guard). The live state is the same three parts, sent
rank to rank by torchft's checkpoint transport (rank r of the healthy group to rank r of the lagging one): the
groups have the same layout, so each rank's shards are exactly the ones it holds. Sharded tensors (DTensors)
travel as their local shards and are rebuilt on the receiver with its own mesh and placements.

The sender's tensors are not copied: the transfer finishes inside the step's quorum, before any group can pass
the step's cross-group gradient all-reduce (which waits for the healed group), so no optimizer step changes
them in between. :func:`state_sha256` is the fingerprint the ``run_end`` event carries: parameters and
optimizer state of the whole group, equal on every live group.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from llmtrain.train.checkpoint.rng import rng_state, set_rng_state
from llmtrain.train.checkpoint.store import tensor_state


def _local(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its local shard (dicts and lists walked)."""
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_local(v) for v in obj)
    return obj


def _rebuild(received: Any, template: Any) -> Any:
    """``received`` (local shards) as the ``template``'s DTensors (same mesh and placements)."""
    if isinstance(template, DTensor):
        return DTensor.from_local(
            received, template.device_mesh, template.placements, run_check=False,
            shape=template.shape, stride=template.stride(),
        )  # fmt: skip
    if isinstance(template, dict) and isinstance(received, dict):
        return {k: _rebuild(v, template[k]) if k in template else v for k, v in received.items()}
    if isinstance(template, list | tuple) and isinstance(received, list | tuple):
        return type(received)(_rebuild(v, t) for v, t in zip(received, template))
    return received


def live_state(trainer: Any) -> dict[str, Any]:
    """This rank's part of the group's state, as a checkpoint would hold it."""
    return {
        "tensors": _local(tensor_state(trainer.model, trainer.optimizer)),
        "rng": rng_state(trainer.device.type),
        "trainer": trainer.trainer_state(),
    }


def load_live_state(trainer: Any, state: dict[str, Any]) -> None:
    """Make ``trainer`` the sender's: weights, optimizer, RNG, step, data position, scaler, guard."""
    template = tensor_state(trainer.model, trainer.optimizer)
    tensors = _rebuild(state["tensors"], template)
    set_model_state_dict(trainer.model, tensors["model"], options=StateDictOptions(strict=True))
    set_optimizer_state_dict(trainer.model, trainer.optimizer, tensors["optim"])
    set_rng_state(state["rng"], trainer.device.type)
    trainer._restore_trainer_state(state["trainer"], guard=True)


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (the heal event's figure)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(state_bytes(v) for v in obj)
    return 0


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        h.update(obj.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            _feed(h, obj[k])
    elif isinstance(obj, list | tuple):
        for v in obj:
            _feed(h, v)
    else:
        h.update(repr(obj).encode())


def state_sha256(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: Any = None) -> str:
    """SHA-256 of the group's parameters and optimizer state: each rank hashes its own shards, the ranks'
    digests are hashed in rank order (a collective of the group when it has several ranks)."""
    state = _local(tensor_state(model, optimizer))
    h = hashlib.sha256()
    _feed(h, state["model"])
    _feed(h, state["optim"]["state"])
    digest = h.hexdigest()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        digests: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(digests, digest, group=group)
        return hashlib.sha256("".join(digests).encode()).hexdigest()
    return digest

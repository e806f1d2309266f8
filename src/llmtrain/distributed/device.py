"""Devices: cpu (gloo), cuda (nccl), npu (Ascend, torch_npu + hccl, imported only when asked for).

``run.device_target`` accepts the seed's spellings too (Ascend -> npu, GPU -> cuda, CPU -> cpu). ``auto`` picks
cuda when a CUDA device is present, else cpu (an Ascend machine says npu explicitly, so torch_npu is never
imported by surprise).
"""

from __future__ import annotations

import os

import torch

from llmtrain.errors import ConfigError

ALIASES = {"ascend": "npu", "npu": "npu", "gpu": "cuda", "cuda": "cuda", "cpu": "cpu", "auto": "auto"}
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def normalize_device_target(target: str) -> str:
    """Map a config spelling to cpu / cuda / npu / auto; ConfigError for anything else."""
    key = str(target).strip().lower()
    if key not in ALIASES:
        raise ConfigError(
            f"run.device_target: {target!r} is not a known device; valid: auto, cpu, cuda (or GPU), npu (or Ascend)."
        )
    return ALIASES[key]


def resolve_device(target: str) -> torch.device:
    """The torch.device this process trains on (with the local rank's index on accelerators)."""
    kind = normalize_device_target(target)
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("run.device_target is cuda but no CUDA device is visible; use cpu or auto.")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device)
        except ImportError as e:
            raise ConfigError(
                "run.device_target is npu (Ascend) but torch_npu is not installed; install the torch_npu build "
                "matching your CANN version, or use cpu/cuda."
            ) from e
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]  # torch.npu: registered by torch_npu
        return torch.device("npu", local_rank)
    return torch.device("cpu")


def init_distributed(device_type: str, timeout_s: int) -> int:
    """Join the default process group when launched with WORLD_SIZE > 1 (torchrun); return the world size.

    Idempotent: a process group that already exists (several trainers in one process, tests) is reused.
    """
    import datetime

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group(backend=BACKENDS[device_type], timeout=datetime.timedelta(seconds=timeout_s))
    return world_size


def init_local_group(device_type: str, timeout_s: int) -> None:
    """Join a one-rank process group (an in-memory store, no launcher) unless a group exists already.

    FSDP2 wraps a model over a device mesh, and a mesh needs a process group; ``parallel.cpu_offload`` is FSDP2's
    offload policy, so a one-process run that offloads runs FSDP over this one-rank group (every collective is
    a local copy). The group lives as long as the process, as torchrun's does: ``shutdown_distributed`` ends it.
    """
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=BACKENDS[device_type], store=store, rank=0, world_size=1, timeout=timeout)


def shutdown_distributed(barrier: bool) -> None:
    """Leave every process group before the interpreter shuts down (see docs/reliability.md, "Ending a run").

    A collective's work object holds its tensors, whose last reference gloo's worker thread may drop just after
    the main thread returned from the collective. If that happens once the interpreter is finalizing, the
    thread's GIL acquire ends it with ``pthread_exit`` inside a C++ destructor and the process aborts
    (``terminate called without an active exception``, SIGABRT): exit -6 after a run that had finished.
    ``destroy_process_group`` shuts every group down (subgroups first, the default group last) and joins their
    worker threads while the interpreter is whole. ``barrier`` (on success) first waits for every rank, so no
    rank leaves while a peer still expects it in a collective; after an error it is skipped, since a failed
    peer may never arrive.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if barrier:
            dist.barrier()
    finally:
        dist.destroy_process_group()

"""Checkpoints: torch distributed checkpoint (DCP) for tensors, JSON for everything else.

Layout under ``checkpoint.save_dir`` (default ``<run.output_dir>/checkpoints``)::

    step_00000100/            one committed checkpoint
      .metadata, __*_*.distcp   DCP: model and optimizer state (sharded, reshardable on load)
      trainer_state.json        step, schedule position, loss scaler, data-loader state, config hash (rank 0)
      rng_rank{r}.json          RNG states of rank r (python, numpy, torch CPU, accelerator)
      COMMITTED                 written last; a directory without it is not a checkpoint
    step_00000200.tmp/        a save in progress (or one that crashed); never resumed from, removed later

A save writes into ``step_N.tmp``, writes ``COMMITTED``, then renames the directory: a crash leaves no
directory that looks complete. ``keep_checkpoint_max`` newest committed checkpoints are kept.

Loading never unpickles arbitrary objects: DCP's ``.metadata`` file is a pickle, so it is read with an
unpickler that accepts only DCP's own metadata classes, and non-tensor values go through
``torch.load(weights_only=True)``. Hardening (async saves, checksums, fallback to the previous checkpoint,
wall-clock saves) builds on this module.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from llmtrain.config.schema import CheckpointConfig
from llmtrain.errors import CheckpointError

STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "COMMITTED"


# ----------------------------------------------------------------------------- safe loading of DCP metadata
class _MetadataUnpickler(pickle.Unpickler):
    """Accept only the classes DCP's metadata is made of."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "Path"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which is not allowed; refusing to load."
        )


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is unpickled with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any):  # noqa: ANN201
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:  # noqa: ANN001
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ----------------------------------------------------------------------------- RNG states as JSON
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(device_type: str) -> dict:
    """RNG states of this process as JSON-safe values."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": _b64(torch.get_rng_state()),
    }
    if device_type == "cuda" and torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict, device_type: str) -> None:
    v, s, g = state["python"]
    random.setstate((v, tuple(s), g))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and device_type == "cuda":
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


# ----------------------------------------------------------------------------- the checkpointer
@contextmanager
def _quiet_single_process():
    """DCP warns on every call without a process group; single-process use is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


class Checkpointer:
    """Saves, rotates, finds and loads checkpoints of one run."""

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, device_type: str = "cpu"):
        self.cfg = cfg
        self.dir = Path(cfg.save_dir) if cfg.save_dir else Path(run_dir) / "checkpoints"
        self.device_type = device_type

    # ---- discovery
    def committed(self) -> list[Path]:
        """Committed checkpoints, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if STEP_DIR.match(p.name) and (p / MARKER).exists()]
        return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))

    def latest(self) -> Path | None:
        c = self.committed()
        return c[-1] if c else None

    def resume_path(self) -> Path | None:
        """What ``checkpoint.resume`` points at: None for a fresh start."""
        resume = str(self.cfg.resume)
        if resume == "none":
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        if not (path / MARKER).exists():
            raise CheckpointError(
                f"checkpoint.resume: {resume!r} is not a committed checkpoint directory (no {MARKER} file); "
                f"use 'auto', 'none' or a path like {self.dir}/step_00000100."
            )
        return path

    # ---- save
    def save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict
    ) -> Path:
        """Write a checkpoint of ``step`` atomically; every rank calls this."""
        final = self.dir / f"step_{step:08d}"
        tmp = self.dir / f"step_{step:08d}.tmp"
        rank = _rank()
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        _barrier()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        with _quiet_single_process():
            dcp.save(state, checkpoint_id=str(tmp))
        _write_json(tmp / f"rng_rank{rank}.json", rng_state(self.device_type))
        _barrier()
        if rank == 0:
            _write_json(tmp / "trainer_state.json", trainer_state)
            (tmp / MARKER).write_text(f"step {step}\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._rotate()
        _barrier()
        return final

    def _rotate(self) -> None:
        keep = max(int(self.cfg.keep_checkpoint_max), 1)
        for old in self.committed()[:-keep]:
            # Remove the marker first: an interrupted delete leaves an uncommitted directory, never a broken one.
            (old / MARKER).unlink(missing_ok=True)
            shutil.rmtree(old, ignore_errors=True)

    # ---- load
    def load(self, path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        """Load model (and optimizer) state in place; return the trainer state and restore this rank's RNG."""
        path = Path(path)
        if not (path / MARKER).exists():
            raise CheckpointError(f"{path} is not a committed checkpoint (no {MARKER} file).")
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        with _quiet_single_process():
            dcp.load(state, storage_reader=_safe_reader(path), planner=SafeLoadPlanner())
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optim"])
        rng_file = path / f"rng_rank{_rank()}.json"
        if rng_file.exists():
            set_rng_state(json.loads(rng_file.read_text()), self.device_type)
        return json.loads((path / "trainer_state.json").read_text())


def _safe_reader(path: Path) -> SafeFileSystemReader:
    """A reader for ``path`` whose metadata has been vetted (a clear CheckpointError instead of a DCP trace)."""
    reader = SafeFileSystemReader(str(path))
    try:
        reader.read_metadata()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint metadata ({e}).") from e
    return reader


def load_model_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load only the model weights of a checkpoint (for generation and export); no process group needed."""
    path = Path(path)
    state = {"model": get_model_state_dict(model)}
    with _quiet_single_process():
        dcp.load(state, storage_reader=_safe_reader(path), planner=SafeLoadPlanner())
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))

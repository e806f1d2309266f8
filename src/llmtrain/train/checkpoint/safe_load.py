"""Loading never unpickles arbitrary objects.

DCP's ``.metadata`` file is a pickle, so :class:`SafeFileSystemReader` reads it with an unpickler that accepts
only DCP's own metadata classes (and torch dtypes, sizes, paths); anything else is a CheckpointError before a
single object is built. Non-tensor values stored in the data files go through ``torch.load(weights_only=True)``
(:class:`SafeLoadPlanner`). :func:`load_model_weights` is the model-only load used by generation, export and
stage hand-over; it needs no process group (any saved layout reshards to one process).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from llmtrain.errors import CheckpointError
from llmtrain.train.checkpoint._process import quiet_single_process


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

    def read_metadata(self, *args: Any, **kwargs: Any):
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

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_reader(path: Path) -> tuple[SafeFileSystemReader, Any]:
    """A reader for ``path`` and its metadata, vetted (a clear CheckpointError instead of a DCP trace)."""
    reader = SafeFileSystemReader(str(path))
    try:
        metadata = reader.read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint metadata ({e}).") from e
    return reader, metadata


def check_model_shape(path: Path, metadata: Any, model_state: dict, allow_extra: bool = False) -> None:
    """CheckpointError unless the checkpoint's model tensors are the model's: same names, same global shapes.

    A layout change (FSDP / TP / DP size) reshards and passes; an architecture change (layers, widths, heads,
    vocabulary, experts) would load partly or fail inside DCP, so it is named here instead. ``allow_extra``: a
    pipeline stage holds only its own layers, so the checkpoint may have more."""
    meta = metadata.state_dict_metadata
    saved = {
        k[len("model.") :]: tuple(m.size)
        for k, m in meta.items()
        if k.startswith("model.") and hasattr(m, "size")
    }
    ours = {k: tuple(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(ours) - set(saved))
    extra = [] if allow_extra else sorted(set(saved) - set(ours))
    shapes = [f"{k} {list(saved[k])} in the checkpoint, {list(ours[k])} here" for k in sorted(set(ours) & set(saved))
              if saved[k] != ours[k]]  # fmt: skip
    if not (missing or extra or shapes):
        return
    parts = []
    for label, items in (("missing from the checkpoint", missing), ("only in the checkpoint", extra),
                         ("different shapes", shapes)):  # fmt: skip
        if items:
            parts.append(f"{len(items)} {label} ({', '.join(items[:4])}{', ...' if len(items) > 4 else ''})")
    raise CheckpointError(
        f"{path} holds a model of another shape than this run's: {'; '.join(parts)}. Layout changes (FSDP, TP, "
        "data-parallel size) reshard on load, architecture changes do not: set the model section as in the run "
        "that wrote the checkpoint (its config.yaml), or give this run another run.output_dir."
    )


def load_state(path: Path, state: dict, allow_extra: bool = False) -> None:
    """``dcp.load`` of ``state`` (in place) from ``path`` through the vetted reader and the safe planner, after
    :func:`check_model_shape` of ``state["model"]`` against the same metadata (read once here)."""
    reader, metadata = safe_reader(path)
    check_model_shape(path, metadata, state["model"], allow_extra)
    with quiet_single_process():
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())


def load_model_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load only the model weights of a checkpoint (for generation and export); no process group needed."""
    path = Path(path)
    state = {"model": get_model_state_dict(model)}
    load_state(path, state)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))

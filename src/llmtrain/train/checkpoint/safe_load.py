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

from llmtrain.errors import CheckpointError, exception_chain
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
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{path}: cannot read the checkpoint metadata ({type(e).__name__}: a damaged or foreign file)."
        ) from e
    problem = storage_problem(path, metadata)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}; refusing to load.")
    return reader, metadata


def storage_problem(path: Path, metadata: Any) -> str | None:
    """Why the storage entries of DCP ``metadata`` would read outside checkpoint ``path`` (or past a file's end),
    None when every one names a plain file directly inside it: DCP opens ``path / relative_path``, so a
    ``../x``, an absolute path, a sub-folder or a symlink would read a file the checkpoint does not own."""
    storage = getattr(metadata, "storage_data", None)
    if storage is None:
        return None
    if not isinstance(storage, dict):
        return "the checkpoint metadata's storage table is not a mapping (damaged)"
    sizes: dict[str, int] = {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
            return f"the checkpoint metadata names the data file {name!r}, which is not a file inside {path.name}"
        if name not in sizes:
            f = path / name
            if f.is_symlink() or not f.is_file():
                return f"the checkpoint metadata names {name}, which is not a plain file inside {path.name}"
            sizes[name] = f.stat().st_size
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length))
        if not ok or offset + length > sizes[name]:  # type: ignore[operator]
            return (
                f"the checkpoint metadata reads {name} at offset {offset!r}, length {length!r}, past its end"
            )
    return None


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
    :func:`check_model_shape` of ``state["model"]`` against the same metadata (read once here). Whatever fails
    while reading the tensors is a CheckpointError naming the checkpoint."""
    reader, metadata = safe_reader(path)
    check_model_shape(path, metadata, state["model"], allow_extra)
    try:
        with quiet_single_process():
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        raise CheckpointError(f"{path}: reading its tensors failed: {_read_failure(e)}.") from e


def _read_failure(error: BaseException) -> str:
    """What went wrong inside ``dcp.load``, in our words: torch's own text about unpickling advises turning the
    weights-only protection off, which must never be shown as the way out."""
    for e in exception_chain(error):
        if isinstance(e, CheckpointError):
            return str(e)
        if isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e):
            return "a data file holds something other than plain tensors (refused without unpickling it)"
        if isinstance(e, OSError):
            return f"{e.filename or 'a data file'}: {e.strerror or e}"
        if isinstance(e, EOFError):
            return "a data file ends early (truncated)"
    return f"{type(error).__name__} (a damaged data file)"


def load_model_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load only the model weights of a checkpoint (for generation and export); no process group needed."""
    path = Path(path)
    state = {"model": get_model_state_dict(model)}
    load_state(path, state)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))

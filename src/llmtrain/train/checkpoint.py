"""Checkpoints: torch distributed checkpoint (DCP) for tensors, JSON for everything else; atomic and checksummed.

Layout under ``checkpoint.save_dir`` (default ``<run.output_dir>/checkpoints``)::

    step_00000100/            one committed checkpoint
      .metadata, __*_*.distcp   DCP: model and optimizer state (sharded, reshardable on load)
      trainer_state.json        step, schedule position, loss scaler, data-loader state, config hash (rank 0)
      rng_rank{r}.json          RNG states of rank r (python, numpy, torch CPU, accelerator)
      checksums.json            size and SHA-256 of every file above, written after them
      __{r}_sha256.json         (only until the commit) digests rank r computed while writing its data files
      COMMITTED                 written last; a directory without it is not a checkpoint
    step_00000200.tmp/        a save in progress (or one that crashed); never resumed from, removed later

Commit protocol (rank 0, after every rank's data is on disk): trainer_state.json -> checksums.json -> COMMITTED,
each fsynced, the directory fsynced, then ``step_N.tmp`` is renamed to ``step_N`` and the parent fsynced. A crash
at any point leaves either the previous checkpoints untouched or a ``.tmp`` directory that is ignored. Deleting
(rotation) removes the marker first and renames to ``.trash`` before ``rmtree``, so a checkpoint is never
half-deleted: it is either whole and committed or not a checkpoint at all.

Write path: ``ChecksummingWriter`` hashes each ``.distcp`` file while writing it and starts its write-back every
32 MiB, so the commit reads back only the small files (the data is never re-read) and the final fsync has little
left to wait for. Rotation uncommits and renames at once; the bytes are deleted by a background thread that
``wait()`` (and the next commit) joins.

``resume: auto`` walks committed checkpoints newest first and takes the first whose checksums verify; every
skipped one is reported with its reason (``select_resume``), so the trainer can log an event. An explicit
``resume: PATH`` that fails verification is an error (no silent fallback from what the user asked for).

Async save (``save_async`` then ``poll``/``wait``): with a process group, ``dcp.async_save`` runs on a gloo
group of its own (sharing the training group aborts gloo, see the notes in ../shared); without one, the state is
staged to a CPU copy and written by a plain thread. Either way the commit runs in a background thread only
after the write finished; training is blocked only while the state is staged.

Loading never unpickles arbitrary objects: DCP's ``.metadata`` file is a pickle, so it is read with an
unpickler that accepts only DCP's own metadata classes, and non-tensor values go through
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
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
CHECKSUMS = "checksums.json"
SIDECAR_SUFFIX = "sha256.json"  # __{rank}_sha256.json: digests computed while writing


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


# ----------------------------------------------------------------------------- SHA-256 while writing
class _HashingStream(io.RawIOBase):
    """A binary file opened for writing that feeds every byte it writes to SHA-256 on the way to the disk.

    DCP writes a ``.distcp`` file front to back (``write``/``tell``/``fileno``/``flush`` only), so the digest is
    the file's. A ``seek`` or ``truncate`` would break that, so it marks the digest unusable (the commit then
    re-reads the file). ``hashlib`` and the unbuffered write both release the GIL on large buffers, so DCP's
    writer threads hash and write in parallel.

    Every ``WRITEBACK_BYTES`` the kernel is asked to start writing the range just written to the disk
    (``posix_fadvise(DONTNEED)`` starts write-back of dirty pages and waits for nothing), so the disk works
    while the next bytes are serialized and hashed, and the final fsync has little left to wait for."""

    WRITEBACK_BYTES = 32 << 20

    def __init__(self, path: Path):
        super().__init__()
        self._f = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close()
        self.sha = hashlib.sha256()
        self.nbytes = 0
        self.linear = True
        self._flushed = 0  # bytes [0, _flushed) have been handed to write-back

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.sha.update(view)
        done = 0
        while done < len(view):  # a raw write may be short
            done += self._f.write(view[done:])
        self.nbytes += done
        if self.nbytes - self._flushed >= self.WRITEBACK_BYTES and self.linear:
            try:  # only a hint: without it (other OS, file systems that refuse it) the final fsync does it all
                os.posix_fadvise(
                    self._f.fileno(), self._flushed, self.nbytes - self._flushed, os.POSIX_FADV_DONTNEED
                )
            except (AttributeError, OSError):
                pass
            self._flushed = self.nbytes
        return done

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        self.linear = False
        return self._f.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        self.linear = False
        return self._f.truncate(size)

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


class _HashingFileSystem(FileSystem):
    """DCP's local file system, except that ``.distcp`` data files are hashed as they are written."""

    def __init__(self) -> None:
        self.digests: dict[str, dict] = {}  # file name -> {"bytes", "sha256"}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):  # noqa: ANN201
        path = Path(path)
        if "w" not in mode or not path.name.endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _HashingStream(path) as stream:
            yield stream
            if stream.linear:
                with self._lock:
                    self.digests[path.name] = {"bytes": stream.nbytes, "sha256": stream.sha.hexdigest()}


class ChecksummingWriter(FileSystemWriter):
    """FileSystemWriter that hashes its data files while writing them (no second read for the checksums).

    After this rank's files are written (and fsynced) it leaves their digests in ``__{r}_sha256.json`` next to
    them, before DCP gathers the write results, so rank 0 finds every rank's sidecar when it commits."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

    def write_data(self, plan: Any, planner: Any) -> Any:  # noqa: ANN401
        future = super().write_data(plan, planner)
        future.wait()  # the file system writer is synchronous; surface its errors here
        _write_json(Path(self.path) / f"{plan.storage_data.prefix}{SIDECAR_SUFFIX}", dict(self.fs.digests))
        return future


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


# ----------------------------------------------------------------------------- files: fsync, checksums, delete
@contextmanager
def _quiet_single_process():
    """DCP warns on every call without a process group; single-process use is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier(group: Any = None) -> None:
    if _dist():
        dist.barrier(group=group)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def _hash_files(paths: list[Path], threads: int) -> list[str]:
    """SHA-256 of each path; hashlib releases the GIL on large chunks, so threads overlap."""
    if threads <= 1 or len(paths) <= 1:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(sha256_file, paths))


def _read_sidecars(ckpt_dir: Path) -> tuple[dict[str, dict], list[Path]]:
    """Digests the writers computed while writing (``__{r}_sha256.json`` of every rank), and those files."""
    known: dict[str, dict] = {}
    sidecars = sorted(ckpt_dir.glob(f"__*_{SIDECAR_SUFFIX}"))
    for path in sidecars:
        try:
            known.update(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass  # unreadable: those files are hashed from disk instead
    return known, sidecars


def write_checksums(ckpt_dir: Path, threads: int = 2) -> dict:
    """Record size and SHA-256 of every file of ``ckpt_dir`` (except the marker and this file) in
    ``checksums.json``. Data files whose digest was computed while writing (and whose size on disk matches
    the bytes hashed) are not read again; every other file is hashed from disk. The sidecars are removed."""
    known, sidecars = _read_sidecars(ckpt_dir)
    skip = {MARKER, CHECKSUMS, *(p.name for p in sidecars)}
    paths = [p for p in sorted(ckpt_dir.iterdir()) if p.is_file() and p.name not in skip]
    files: dict[str, dict] = {}
    todo = []
    for p in paths:
        size, got = p.stat().st_size, known.get(p.name)
        if isinstance(got, dict) and got.get("bytes") == size and isinstance(got.get("sha256"), str):
            files[p.name] = {"bytes": size, "sha256": got["sha256"]}
        else:
            todo.append(p)
    for p, d in zip(todo, _hash_files(todo, threads)):
        files[p.name] = {"bytes": p.stat().st_size, "sha256": d}
    record = {"algorithm": "sha256", "files": {name: files[name] for name in sorted(files)}}
    for p in sidecars:
        p.unlink()
    _write_json(ckpt_dir / CHECKSUMS, record)
    return record


def verify_checkpoint(ckpt_dir: str | Path, threads: int = 2) -> str | None:
    """None when ``ckpt_dir`` is a committed checkpoint whose files match checksums.json, else the reason."""
    path = Path(ckpt_dir)
    if not (path / MARKER).exists():
        return f"no {MARKER} marker (an interrupted or deleted save)"
    try:
        record = json.loads((path / CHECKSUMS).read_text())
        files = record["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{CHECKSUMS} is missing or unreadable ({e.__class__.__name__})"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, {want['bytes']} expected (truncated or overwritten)"
    names = list(files)
    for name, digest in zip(names, _hash_files([path / n for n in names], threads)):
        if digest != files[name]["sha256"]:
            return f"{name} fails its SHA-256 check (corrupted)"
    if not any(name.endswith(".distcp") for name in files) or ".metadata" not in files:
        return "the checksums list no DCP data or metadata file"
    return None


def _retire(ckpt_dir: Path) -> Path:
    """Uncommit and move out of the step_N namespace (never a half-deleted checkpoint); the caller deletes the
    returned ``.trash`` directory, possibly in the background."""
    (ckpt_dir / MARKER).unlink(missing_ok=True)
    _fsync_dir(ckpt_dir)
    trash = ckpt_dir.with_name(ckpt_dir.name + ".trash")
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(ckpt_dir, trash)
    return trash


def _delete(ckpt_dir: Path) -> None:
    shutil.rmtree(_retire(ckpt_dir), ignore_errors=True)


def _rmtree_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _staging_buffers(
    obj: Any,
    cache: dict[str, torch.Tensor],
    copies: list[tuple[torch.Tensor, torch.Tensor]],
    prefix: str = "",
) -> Any:
    """``obj`` with every tensor replaced by its (reused) CPU buffer; the copies to make go into ``copies``."""
    if isinstance(obj, torch.Tensor):
        buf = cache.get(prefix)
        if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
            buf = cache[prefix] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
        copies.append((buf, obj.detach()))
        return buf
    if isinstance(obj, dict):
        return {k: _staging_buffers(v, cache, copies, f"{prefix}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_staging_buffers(v, cache, copies, f"{prefix}/{i}") for i, v in enumerate(obj))
    return obj


def _stage_to_cpu(obj: Any, cache: dict[str, torch.Tensor], threads: int = 1) -> Any:
    """A CPU copy of a (nested) state dict, so training can overwrite the originals during the write. Buffers
    are kept in ``cache`` and reused by the next save (fresh allocations cost page faults, often more than the
    copy itself); the caller makes sure the previous write finished first. ``copy_`` releases the GIL, so
    ``threads`` threads copy different tensors at once (the training loop is blocked for this copy)."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    staged = _staging_buffers(obj, cache, copies)
    if threads <= 1 or len(copies) <= 1:
        for dst, src in copies:
            dst.copy_(src)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda pair: pair[0].copy_(pair[1]), copies))
    return staged


# ----------------------------------------------------------------------------- resume choice and pending saves
@dataclass
class ResumeChoice:
    """The checkpoint to resume from (None: fresh start) and the newer ones rejected, with reasons."""

    path: Path | None
    rejected: list[tuple[str, str]] = field(default_factory=list)

    def messages(self) -> list[str]:
        return [f"checkpoint {p} skipped: {why}; falling back to an older one" for p, why in self.rejected]


@dataclass
class _PendingSave:
    step: int
    tmp: Path
    final: Path
    thread: threading.Thread
    error: BaseException | None = None
    started: float = field(default_factory=time.time)


class Checkpointer:
    """Saves (sync or async), commits, rotates, verifies, finds and loads checkpoints of one run.

    ``fault_hook(event, tmp_dir)``, when set, is called with ``"written"`` after the data of a save is on disk
    and before the commit (the fault injector kills the process there to simulate a crash mid-save).
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, device_type: str = "cpu"):
        self.cfg = cfg
        self.dir = Path(cfg.save_dir) if cfg.save_dir else Path(run_dir) / "checkpoints"
        self.device_type = device_type
        self.save_minutes = float(getattr(cfg, "save_minutes", 0) or 0)
        self.fault_hook: Callable[[str, Path], None] | None = None
        self.resume_notes: list[str] = []
        self._verified: set[Path] = set()
        self._pending: _PendingSave | None = None
        self._group: Any = None
        self._last_save_time = time.time()
        self.threads = max(int(getattr(cfg, "write_threads", 2) or 1), 1)
        self._staging: dict[str, torch.Tensor] = {}
        self._purger: threading.Thread | None = None  # deletes rotated-out checkpoints in the background

    def _writer(self, tmp: Path) -> FileSystemWriter:
        return ChecksummingWriter(str(tmp), thread_count=self.threads, sync_files=True)

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

    def verify(self, path: str | Path) -> str | None:
        """None if ``path`` verifies (cached per process), else the reason it does not."""
        path = Path(path).resolve()
        if path in self._verified:
            return None
        reason = verify_checkpoint(path, self.threads)
        if reason is None:
            self._verified.add(path)
        return reason

    def latest_valid(self) -> ResumeChoice:
        """Newest committed checkpoint that verifies; newer ones that do not are listed with reasons."""
        rejected: list[tuple[str, str]] = []
        for path in reversed(self.committed()):
            reason = self.verify(path)
            if reason is None:
                return ResumeChoice(path, rejected)
            rejected.append((str(path), reason))
        return ResumeChoice(None, rejected)

    def select_resume(self) -> ResumeChoice:
        """What ``checkpoint.resume`` points at. Rank 0 decides and broadcasts, so every rank agrees."""
        resume = str(self.cfg.resume)
        if resume == "none":
            return ResumeChoice(None)
        if resume != "auto":
            path = Path(resume)
            if not (path / MARKER).exists():
                raise CheckpointError(
                    f"checkpoint.resume: {resume!r} is not a committed checkpoint directory (no {MARKER} "
                    f"file); use 'auto', 'none' or a path like {self.dir}/step_00000100."
                )
            reason = self.verify(path)
            if reason is not None:
                raise CheckpointError(
                    f"checkpoint.resume: {resume!r} fails verification: {reason}. Use 'auto' to take the "
                    "newest valid checkpoint instead."
                )
            return ResumeChoice(path)
        choice = self.latest_valid() if _rank() == 0 else None
        if _dist():
            box = [choice]
            dist.broadcast_object_list(box, src=0)
            choice = box[0]
            if choice.path is not None:
                self._verified.add(Path(choice.path).resolve())
        self.resume_notes = choice.messages()
        return choice

    def resume_path(self) -> Path | None:
        """The checkpoint to resume from, None for a fresh start; skipped ones are in ``resume_notes``."""
        return self.select_resume().path

    # ---- when to save
    def should_save(self, step: int) -> bool:
        """True every ``save_steps`` steps and when ``save_minutes`` passed since the last save (rank 0's clock)."""
        if self.cfg.save_steps and step % self.cfg.save_steps == 0:
            return True
        if self.save_minutes <= 0:
            return False
        due = torch.tensor(float(time.time() - self._last_save_time >= 60.0 * self.save_minutes))
        if _dist():
            dist.broadcast(due, src=0)
        return bool(due.item())

    # ---- save
    def _paths(self, step: int) -> tuple[Path, Path]:
        return self.dir / f"step_{step:08d}.tmp", self.dir / f"step_{step:08d}"

    def _prepare(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
        self.wait()  # one save in flight at a time
        tmp, final = self._paths(step)
        if _rank() == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        _barrier()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        _write_json(tmp / f"rng_rank{_rank()}.json", rng_state(self.device_type))
        self._last_save_time = time.time()
        return tmp, final, state

    def save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict
    ) -> Path:
        """Write a checkpoint of ``step`` and commit it before returning; every rank calls this."""
        tmp, final, state = self._prepare(step, model, optimizer)
        with _quiet_single_process():
            dcp.save(state, storage_writer=self._writer(tmp))
        _barrier()
        if _rank() == 0:
            self._commit(step, tmp, final, trainer_state)
        _barrier()
        return final

    def save_async(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict
    ) -> None:
        """Stage the state and return; the write and the commit finish in the background (see ``wait``)."""
        tmp, final, state = self._prepare(step, model, optimizer)
        trainer_state = json.loads(
            json.dumps(trainer_state)
        )  # a snapshot: the trainer keeps mutating its own
        if _dist():
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            future = dcp.async_save(state, storage_writer=self._writer(tmp), process_group=self._group)

            def write() -> None:
                future.result()
        else:
            staged = _stage_to_cpu(state, self._staging, self.threads)

            def write() -> None:
                with _quiet_single_process():
                    dcp.save(staged, storage_writer=self._writer(tmp))

        pending = _PendingSave(step, tmp, final, thread=None)  # type: ignore[arg-type]

        def run() -> None:
            try:
                write()
                if _rank() == 0:
                    self._commit(step, tmp, final, trainer_state)
            except BaseException as e:  # noqa: BLE001 - re-raised in wait()
                pending.error = e

        pending.thread = threading.Thread(target=run, name=f"ckpt-save-{step}", daemon=True)
        self._pending = pending
        pending.thread.start()

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def poll(self) -> Path | None:
        """Non-blocking: the path committed by a finished async save (once), else None."""
        if self._pending is None:
            return None
        done = not self._pending.thread.is_alive()
        if _dist() and dist.get_world_size() > 1:
            # Every rank must agree: a rank that finished alone would wait in _finish's barrier while the
            # others go on into the next step's collectives (deadlock). MIN over the default group (main
            # thread only; the saving threads use the checkpoint group).
            device = None  # the default group's backend: gloo (CPU tensors) or nccl / hccl (device tensors)
            if self.device_type != "cpu":
                index = torch.get_device_module(self.device_type).current_device()
                device = torch.device(self.device_type, index)
            flag = torch.tensor([int(done)], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            done = bool(flag.item())
        if not done:
            return None
        return self._finish(join_purge=False)  # a deletion still running is no reason to block training

    def wait(self) -> Path | None:
        """Block until the async save in flight (if any) is committed on every rank, and rotated-out checkpoints
        are deleted; the committed path, or None."""
        return self._finish(join_purge=True)

    def _finish(self, join_purge: bool) -> Path | None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.thread.join()  # its commit may start a purge: join that after this
        if join_purge:
            self._join_purge()
        if pending is None:
            return None
        _barrier(self._group)
        if pending.error is not None:
            raise CheckpointError(
                f"asynchronous save of step {pending.step} to {pending.tmp} failed: {pending.error!r}; "
                "the previous checkpoints are untouched."
            ) from pending.error
        return pending.final

    def close(self, finish: bool, timeout_s: float = 60.0) -> bool:
        """End of the run: finish (``finish``) or abandon the save in flight, then join the purge thread.

        An abandoned save is never committed: its ``.tmp`` directory is cleared by the next run's rotation. After
        an error the saving thread is given ``timeout_s`` to end by itself (it may wait on a peer that failed);
        returns False when a thread is still running then, so the caller ends the process without the
        interpreter's shutdown (see ``distributed.device.shutdown_distributed``)."""
        if finish:
            self.wait()
            return True
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.thread.join(timeout_s)
            if pending.thread.is_alive():
                return False
        if self._purger is not None:
            self._purger.join(timeout_s)
            if self._purger.is_alive():
                return False
            self._purger = None
        return True

    def _commit(self, step: int, tmp: Path, final: Path, trainer_state: dict) -> None:
        """Rank 0, after every rank's files are written: state, checksums, marker, rename, rotate."""
        if self.fault_hook is not None:
            self.fault_hook("written", tmp)
        self._join_purge()  # one deletion at a time, and none racing a re-save of the same step
        _write_json(tmp / "trainer_state.json", trainer_state)
        write_checksums(tmp, self.threads)
        with open(tmp / MARKER, "w") as f:
            f.write(f"step {step}\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():
            _delete(final)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        self._verified.add(final.resolve())
        self._rotate(keep_path=final)

    def _rotate(self, keep_path: Path | None = None) -> None:
        """Keep the newest ``keep_checkpoint_max`` committed checkpoints and always ``keep_path`` (the one just
        committed, valid by construction); clear stale ``.tmp``/``.trash`` directories of crashed saves."""
        keep = max(int(self.cfg.keep_checkpoint_max), 1)
        in_flight = self._pending.tmp if self._pending is not None else None
        doomed = []
        for stale in self.dir.glob("step_*.t*"):
            if stale.suffix in (".tmp", ".trash") and stale != in_flight and stale.is_dir():
                if keep_path is not None and stale.name == keep_path.name + ".tmp":
                    continue
                doomed.append(stale)
        for old in self.committed()[:-keep]:
            if keep_path is None or old.resolve() != keep_path.resolve():
                doomed.append(_retire(old))  # uncommitted now; the bytes go in the background
        if doomed:
            self._purger = threading.Thread(target=_rmtree_all, args=(doomed,), name="ckpt-purge")
            self._purger.start()

    def _join_purge(self) -> None:
        if self._purger is not None:
            self._purger.join()
            self._purger = None

    # ---- load
    def load(
        self,
        path: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        verify: bool = True,
    ) -> dict:
        """Load model (and optimizer) state in place; return the trainer state and restore this rank's RNG."""
        path = Path(path)
        if not (path / MARKER).exists():
            raise CheckpointError(f"{path} is not a committed checkpoint (no {MARKER} file).")
        if verify and (path / CHECKSUMS).exists():
            reason = self.verify(path)
            if reason is not None:
                raise CheckpointError(f"{path} fails verification: {reason}.")
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
    except (OSError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint metadata ({e}).") from e
    return reader


def load_model_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load only the model weights of a checkpoint (for generation and export); no process group needed."""
    path = Path(path)
    state = {"model": get_model_state_dict(model)}
    with _quiet_single_process():
        dcp.load(state, storage_reader=_safe_reader(path), planner=SafeLoadPlanner())
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))

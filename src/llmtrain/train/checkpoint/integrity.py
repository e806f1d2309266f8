"""Integrity of checkpoints: SHA-256 of every file, computed while writing where possible, and verification.

Write path: :class:`ChecksummingWriter` hashes each ``.distcp`` file while writing it and starts its write-back
every 32 MiB, so the commit reads back only the small files (the data is never re-read) and the final fsync has
little left to wait for. Each rank leaves the digests of its data files in a sidecar (``__{r}_sha256.json``);
at the commit :func:`write_checksums` merges them, hashes whatever has no trusted digest (a size that differs
from the bytes hashed means the file changed afterwards: it is re-read), records everything in
``checksums.json`` and removes the sidecars.

:func:`verify_checkpoint` is what ``resume: auto`` relies on: the marker, then sizes (cheap: catches
truncation), then every digest, then that DCP's data and metadata are present at all. It returns the reason a
checkpoint fails, so callers can report why one was skipped.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from llmtrain.train.checkpoint import layout
from llmtrain.train.checkpoint.layout import CHECKSUMS, MARKER, METADATA


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
        self._f = open(path, "wb", buffering=0)  # closed in close()
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
    def create_stream(self, path: str | os.PathLike, mode: str):
        path = Path(path)
        if "w" not in mode or not layout.is_data_file(path.name):
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

    fs: _HashingFileSystem

    def __init__(self, path: str | os.PathLike, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        future.wait()  # the file system writer is synchronous; surface its errors here
        layout.write_json(layout.sidecar_file(self.path, plan.storage_data.prefix), dict(self.fs.digests))
        return future


# ----------------------------------------------------------------------------- checksums.json
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
    sidecars = layout.sidecars(ckpt_dir)
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
    layout.write_json(layout.checksums_file(ckpt_dir), record)
    return record


def verify_checkpoint(ckpt_dir: str | Path, threads: int = 2) -> str | None:
    """None when ``ckpt_dir`` is a committed checkpoint whose files match checksums.json, else the reason."""
    path = Path(ckpt_dir)
    if not layout.is_committed(path):
        return f"no {MARKER} marker (an interrupted or deleted save)"
    try:
        record = json.loads(layout.checksums_file(path).read_text())
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
    if not any(layout.is_data_file(name) for name in files) or METADATA not in files:
        return "the checksums list no DCP data or metadata file"
    return None

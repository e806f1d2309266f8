"""Stage 1 of the staged dedup, per partition: read, clean, filter, hash; bucket the keys on disk.

The partition's units are read in order (``readers``; a slice ``r`` of ``m`` of a file keeps its non-blank
records ``r, r + m, ...``), in chunks screened by :func:`~llmtrain.data.prep.pipeline.screen_chunk` (the same
cleaning, filters, digest and MinHash as the one-process path). Written to ``s1/p-PPPPP/`` (see ``layout``):

* ``texts.bin`` + ``docs.npz``: the kept texts (UTF-8, back to back), their global ids and byte offsets;
* ``sigs.bin``: their 16-bit signatures [K, P] (rows fixed-size, so stage 2 reads any one by its row);
* ``band-BBBBB.bin``: one row ``(band key, id, location)`` (3 x int64) per kept document and band, in the
  bucket of the key; ``exact-BBBBB.bin`` the same for the digests. Rows are buffered and appended bucket by
  bucket, so memory is a chunk plus the buffer, whatever the partition size;
* ``rejects.jsonl`` (+ ``rejects.ids.npy``): documents removed by cleaning or the filters, when rejects are
  asked for (the duplicates are added in stage 4, in id order).

The counters (documents read, input errors skipped, rejected per reason) are in the task's marker. An input
error raises here (``--on-error raise``) with the reader's message naming file and line; with ``skip`` it is
counted (a truncated file once, by its first slice, though every slice meets it).
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from llmtrain.data.prep.job import PartCounters
from llmtrain.data.prep.parts import chunk_records
from llmtrain.data.prep.pipeline import KEPT, screen_chunk
from llmtrain.data.prep.readers import READERS, file_kind
from llmtrain.data.prep.stages.layout import (
    SHIFT,
    StageContext,
    bucket_of,
    publish,
    save_npy,
    save_npz,
    tmp_path,
)

FLUSH_ROWS = 1 << 20  # bucket rows buffered before they are appended to the bucket files (24 MB)
Item = tuple[str, Path, int, int]  # (text, file, line, global id)


def _records(ctx: StageContext, k: int, errors: dict | None) -> Iterator[Item]:
    """The partition's documents in input order, with their ids."""
    for f, r, m in ctx.plan.partitions[k]:
        path = Path(ctx.plan.files[f])
        keep: Callable[[], bool] | None = None
        if m > 1:
            seen = itertools.count()

            def keep(seen=seen, r=r, m=m) -> bool:
                return next(seen) % m == r

        mine: dict | None = None if errors is None else {}
        for text, p, line in READERS[file_kind(path)](path, ctx.options.text_key, mine, keep):
            yield text, p, line, (f << SHIFT) | line
        if errors is not None and mine is not None:
            if r > 0:  # every slice of a truncated file meets the damage; the first one counts it
                mine.pop("truncated_file", None)
            for reason, n in mine.items():
                errors[reason] = errors.get(reason, 0) + n


class _Buckets:
    """Rows ``(key, id, location)`` buffered, then appended to ``NAME-BBBBB.bin`` by bucket."""

    def __init__(self, folder: Path, name: str, buckets: int):
        self.folder, self.name, self.buckets = folder, name, buckets
        self.blocks: list[np.ndarray] = []
        self.buffered = 0
        self.written: set[int] = set()

    def path(self, b: int) -> Path:
        return self.folder / f"{self.name}-{b:05d}.bin"

    def add(self, keys: np.ndarray, ids: np.ndarray, locs: np.ndarray) -> None:
        rows = np.stack([keys.astype(np.uint64).view(np.int64), ids, locs], axis=1)  # [M, 3]
        self.blocks.append(rows)
        self.buffered += len(rows)
        if self.buffered >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        if not self.blocks:
            return
        rows = np.concatenate(self.blocks)
        self.blocks, self.buffered = [], 0
        bucket = bucket_of(rows[:, 0].view(np.uint64), self.buckets)
        order = np.argsort(bucket, kind="stable")
        bounds = np.searchsorted(bucket[order], np.arange(self.buckets + 1))
        for b in np.flatnonzero(np.diff(bounds)).tolist():
            with open(tmp_path(self.path(b)), "ab") as f:
                f.write(rows[order[bounds[b] : bounds[b + 1]]].tobytes())
            self.written.add(b)

    def paths(self) -> list[Path]:
        self.flush()
        return [self.path(b) for b in sorted(self.written)]


def screen_task(ctx: StageContext, k: int) -> dict:
    """Stage 1 of partition ``k`` (see the module docstring); returns the task's figures."""
    opts = ctx.options
    out = ctx.s1(k)
    if out.exists():  # left by an attempt that did not finish (it has no marker)
        shutil.rmtree(out)
    out.mkdir(parents=True)
    counters = PartCounters()
    errors: dict | None = {} if opts.on_error == "skip" else None
    items: Iterator[Item] = _records(ctx, k, errors)
    if ctx.max_documents is not None:  # the plan has one partition then: the limit is over all inputs
        items = itertools.islice(items, ctx.max_documents)
    bands = _Buckets(out, "band", ctx.plan.buckets) if ctx.near else None
    exact = _Buckets(out, "exact", ctx.plan.buckets) if ctx.exact else None
    texts_path, sigs_path = out / "texts.bin", out / "sigs.bin"
    rejects = out / "rejects.jsonl"
    ids: list[np.ndarray] = []
    lengths: list[np.ndarray] = []  # blocks of [K] byte lengths (8 bytes per kept document)
    reject_ids: list[int] = []
    rows = chars = 0
    with (
        open(tmp_path(texts_path), "wb") as tf,
        open(tmp_path(sigs_path), "wb") as sf,
        open(tmp_path(rejects), "w", encoding="utf-8") as rf,
    ):
        for chunk in chunk_records(items):
            s = screen_chunk([c[0] for c in chunk], opts)
            kept = [j for j, st in enumerate(s.status) if st == KEPT]
            kid = np.asarray([chunk[j][3] for j in kept], dtype=np.int64)  # [K]
            loc = (np.int64(k) << np.int64(SHIFT)) | (rows + np.arange(len(kept), dtype=np.int64))  # [K]
            encoded = [text.encode("utf-8") for text in s.texts]
            tf.write(b"".join(encoded))
            lengths.append(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))
            if s.sigs is not None and bands is not None and s.bands is not None:
                sf.write(np.ascontiguousarray(s.sigs, dtype=np.uint16).tobytes())
                nb = s.bands.shape[1]
                bands.add(s.bands.reshape(-1), np.repeat(kid, nb), np.repeat(loc, nb))
            if s.digests is not None and exact is not None:
                exact.add(s.digests, kid, loc)
            ids.append(kid)
            rows += len(kept)
            counters.read += len(chunk)
            chars += sum(len(c[0]) for c in chunk)
            for j, status in enumerate(s.status):
                if status != KEPT:
                    counters.reject(status)
                    text, path, line, gid = chunk[j]
                    if opts.rejects is not None:
                        row = {"reason": status, "file": str(path), "line": line, "text": text}
                        rf.write(json.dumps(row, ensure_ascii=False) + "\n")
                        reject_ids.append(gid)
    counters.errors = dict(errors or {})
    counters.kept = rows
    offsets = np.zeros(rows + 1, dtype=np.int64)
    if lengths:
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    written = save_npz(out / "docs.npz", ids=np.concatenate(ids) if ids else np.zeros(0, np.int64),
                       offsets=offsets)  # fmt: skip
    written += save_npy(out / "rejects.ids.npy", np.asarray(reject_ids, dtype=np.int64))
    files = [texts_path, sigs_path, rejects]
    files += bands.paths() if bands is not None else []
    files += exact.paths() if exact is not None else []
    written += publish(files)
    return {"docs_in": counters.read, "docs_out": rows, "chars_in": chars, "bytes": written,
            "counters": counters.to_json()}  # fmt: skip

"""The document loop of ``prepare``: every input file into a finished part, in input order.

Each input file ``k`` is read (``readers``) as records ``(text, file, line)``, cut into chunks of at most
:data:`CHUNK_DOCUMENTS` documents / :data:`CHUNK_CHARS` characters, and each chunk is cleaned, filtered, hashed
and tokenized by :func:`~llmtrain.data.prep.pipeline.process_chunk`: in this process for ``--workers 1``, or
in a pool of spawned worker processes (:func:`start_pool`) with at most ``2 N`` chunks in flight, consumed in
submission order. The stateful steps run here, in input order, so the output is byte-identical for any worker
count: the dedup decisions (:class:`~llmtrain.data.prep.dedup.DedupIndex`), the partition filter (every N-th
non-blank record over all files) and the ``--max-documents`` limit. Kept documents and their dedup rows go to
the part's :class:`~llmtrain.data.prep.shards.PartWriter`, rejected ones (with their reason) to its rejects
file; a partition's part also gets the kept documents' ids (``part-NNNNN.ids.npy``: ``file << 40 | line``, by
which ``merge`` restores input order); the part's :class:`~llmtrain.data.prep.job.PartCounters` are
committed with it, last.

A part already finished by an earlier run with the same job is not redone: its counters are read back and
its dedup rows are replayed into the index, so the parts after it decide exactly as in one uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import multiprocessing as mp
import os
import signal
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.pool import Pool
from pathlib import Path
from typing import TypeVar

import numpy as np

from llmtrain.data.indexed import optimal_dtype
from llmtrain.data.manifest import write_json_atomic
from llmtrain.data.prep.dedup import DedupIndex
from llmtrain.data.prep.job import PartCounters, PrepareJob
from llmtrain.data.prep.pipeline import KEPT, ChunkResult, PrepareOptions, cached_tokenizer, process_chunk
from llmtrain.data.prep.readers import READERS, file_kind
from llmtrain.data.prep.shards import PartWriter, load_part_index, part_done, part_prefix
from llmtrain.data.prep.stages.layout import SHIFT, save_npy
from llmtrain.data.tokenizer import Tokenizer
from llmtrain.errors import DataError

T = TypeVar("T", bound=tuple)
CHUNK_DOCUMENTS = 256  # documents per worker task
CHUNK_CHARS = 1 << 18  # ... or fewer when they add up to this many characters (small: even load at the end)
POOL_STOP_TIMEOUT_S = 10.0  # stop_pool: how long Pool.terminate may take before the workers are killed

Record = tuple[str, Path, int]  # (text, input file, line or record number)


@dataclass
class PartsRun:
    """What the parts of one run share, besides the job: the tokenizer, the work folder, the worker pool, the
    dedup index, and the input position reached so far (advanced part by part, in input order)."""

    tok: Tokenizer
    workdir: Path
    pool: Pool | None
    index: DedupIndex | None
    ordinal: int = 0
    """Non-blank input records seen so far over all files (the partition filter's position)."""
    read: int = 0
    """Documents read so far over all files (for ``max_documents``)."""


def start_pool(job: PrepareJob) -> Pool | None:
    """The worker pool of ``--workers N`` (None for one worker: it runs in-process), started first so that the
    workers import the pipeline and load the tokenizer while this process loads its own copy. Spawned, not
    forked: this process may run tokenizers' thread pool (training) or torch's, which a fork copies broken;
    forking measured no faster (the workers' start overlaps the main process's own tokenizer load).

    Ctrl-C is this process's alone: the workers are spawned with SIGINT blocked (a spawned process inherits the
    signal mask of the thread that starts it, and so does the pool's own thread that replaces a dead worker), so
    a Ctrl-C at the terminal, which reaches every process of the foreground group, never raises
    KeyboardInterrupt in a worker (no tracebacks, and no worker dies holding the pool's queue lock, on which
    ``Pool.terminate`` would then wait forever). This process stops them: :func:`stop_pool`. A SIGINT that
    arrives while the mask is up is not lost: it stays pending, or Python's handler runs it from another thread."""
    if job.workers == 1:
        return None
    # multiprocessing starts its resource tracker at the first spawn and then unblocks SIGINT in this thread
    # (SIG_UNBLOCK, not a restore): start it before the mask goes up
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return mp.get_context("spawn").Pool(
            job.workers, initializer=_worker_init, initargs=(job.tokenizer, job.eos_token)
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def stop_pool(pool: Pool, timeout_s: float = POOL_STOP_TIMEOUT_S) -> None:
    """End ``pool``'s workers within about ``timeout_s`` (after an error or a Ctrl-C as after success):
    ``Pool.terminate`` in a helper thread, then SIGKILL to any worker still alive (terminate can block on a
    queue lock that a killed worker held) and the pool is given up."""
    stopper = threading.Thread(target=pool.terminate, name="prepare-pool-stop", daemon=True)
    stopper.start()
    stopper.join(timeout_s)
    if stopper.is_alive():
        for proc in mp.active_children():  # this process's children: the pool's workers
            proc.kill()
        stopper.join(timeout_s)


def _worker_init(tokenizer: str | None, eos_token: str | None) -> None:
    """Worker initializer: SIGINT ignored (the main process ends the pool, see :func:`start_pool`); one
    tokenizer thread per worker process, so ``--workers N`` uses N cores (not N thread pools of all cores each;
    with ``--workers 1`` the tokenizer runs in-process with its own pool); then load the tokenizer before the
    first chunk arrives. A tokenizer that fails to load is reported by the main process, which loads it too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    if tokenizer is not None:
        try:
            cached_tokenizer(tokenizer, eos_token)
        except Exception:  # the main process raises the clear error
            pass


def _process(opts: PrepareOptions, tok_path: str, eos_token: str | None, texts: list[str]) -> ChunkResult:
    return process_chunk(texts, opts, tok_path, eos_token)


def chunk_records(records: Iterable[T]) -> Iterator[list[T]]:
    """Records (text first) in chunks of at most CHUNK_DOCUMENTS records or about CHUNK_CHARS characters."""
    chunk: list[T] = []
    chars = 0
    for rec in records:
        chunk.append(rec)
        chars += len(rec[0])
        if len(chunk) >= CHUNK_DOCUMENTS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _results(
    chunks: Iterator[list[Record]], job: PrepareJob, run: PartsRun
) -> Iterator[tuple[list[Record], ChunkResult]]:
    """(chunk records, ChunkResult) in order, computed in-process or by the pool (<= 2N in flight)."""
    opts, tok, pool = job.options, run.tok, run.pool
    if pool is None:
        for chunk in chunks:
            yield chunk, process_chunk([r[0] for r in chunk], opts, tok.path, job.eos_token, tok)
        return
    task = functools.partial(_process, opts, tok.path, job.eos_token)
    pending: deque = deque()
    for chunk in chunks:
        pending.append((chunk, pool.apply_async(task, ([r[0] for r in chunk],))))
        if len(pending) >= 2 * job.workers:  # the pool's size (start_pool)
            c, r = pending.popleft()
            yield c, r.get()
    while pending:
        c, r = pending.popleft()
        yield c, r.get()


def run_parts(job: PrepareJob, files: list[Path], tok: Tokenizer, pool: Pool | None) -> list[PartCounters]:
    """Process every input file into a finished part of ``job.workdir``; returns the parts' counters."""
    opts = job.options
    index = None
    if opts.dedup != "none":
        index = DedupIndex(dataclasses.replace(opts.minhash, near=opts.dedup == "near"))
    run = PartsRun(tok, job.workdir, pool, index)
    counters: list[PartCounters] = []
    for k, path in enumerate(files):
        done = part_done(run.workdir, k)
        if done is not None:
            if index is not None:
                try:
                    load_part_index(run.workdir, k, index)
                except Exception as e:  # np.load of a damaged .npz raises many kinds (zip, pickle, shape)
                    raise DataError(
                        f"The work file '{part_prefix(run.workdir, k)}.dedup.npz' is damaged ({type(e).__name__}: "
                        f"{e}); the work folder '{run.workdir}' is removed, so running the same command again "
                        f"redoes the work."
                    ) from None
            c = PartCounters.from_json(done)
            run.ordinal, run.read = c.ordinal, c.read_total
            counters.append(c)
            continue
        writer = None
        if job.max_documents is not None and run.read >= job.max_documents:
            c = PartCounters()
        else:
            c, writer = _run_part(k, path, job, run)
        run.read += c.read
        c.ordinal, c.read_total = run.ordinal, run.read
        counters.append(c)
        if writer is not None:
            writer.commit(c.to_json())
        else:
            write_json_atomic(Path(f"{part_prefix(run.workdir, k)}.json"), c.to_json())  # empty part marker
    return counters


def _run_part(k: int, path: Path, job: PrepareJob, run: PartsRun) -> tuple[PartCounters, PartWriter]:
    """Process input file ``k`` into part ``k``; returns its counters and the writer, ready to commit."""
    opts = job.options
    c = PartCounters()
    errors: dict[str, int] | None = {} if opts.on_error == "skip" else None
    keep = None
    if job.partition is not None:
        i, n = job.partition

        def keep() -> bool:
            run.ordinal += 1
            return (run.ordinal - 1) % n == i

    records = READERS[file_kind(path)](path, opts.text_key, errors, keep)
    if job.max_documents is not None:
        records = itertools.islice(records, job.max_documents - run.read)
    writer = PartWriter(run.workdir, k, optimal_dtype(run.tok.vocab_size), opts.rejects is not None)
    ids: list[np.ndarray] | None = [] if job.partition is not None else None  # blocks of [K] int64
    try:
        for chunk, res in _results(chunk_records(records), job, run):
            kept = np.asarray([r == KEPT for r in res.status], dtype=bool)  # [N] passed clean + filters
            if run.index is not None:  # dedup decisions, one document at a time in input order
                rows = kept.nonzero()[0].tolist()
                for j, reason in zip(rows, run.index.check_many(res.digests, res.bands, res.sigs, rows)):
                    if reason:
                        res.status[j] = reason
                        kept[j] = False
            if ids is not None:  # each kept document's global id: file << SHIFT | line, for merge's order
                lines = np.fromiter((r[2] for r in chunk), dtype=np.int64, count=len(chunk))
                ids.append((k << SHIFT) | lines[kept])
            tokens = res.tokens
            if not kept.all():  # drop the tokens of documents tokenized but then found duplicates
                tokens = tokens[np.repeat(kept, res.lengths)]
            writer.add_many(tokens, res.lengths[kept],
                            None if res.digests is None else res.digests[kept],
                            None if res.bands is None else res.bands[kept],
                            None if res.sigs is None else res.sigs[kept])  # fmt: skip
            c.read += len(chunk)
            c.kept += int(kept.sum())
            c.tokens += int(tokens.size)
            if kept.all():
                continue
            for j in (~kept).nonzero()[0].tolist():
                reason = res.status[j]
                c.reject(reason)
                text, fpath, line = chunk[j]
                writer.reject(text, reason, fpath, line)
        if ids is not None:  # written before the part's counters, which mark it finished
            all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
            save_npy(Path(f"{part_prefix(run.workdir, k)}.ids.npy"), all_ids)
    except BaseException:
        writer.abort()
        raise
    c.errors = dict(errors or {})
    return c, writer


def collect_rejects(workdir: Path, parts: int, target: str | None) -> Path | None:
    """Concatenate the parts' rejects into a temporary file beside ``target``; returns it (None without
    ``target``). The caller renames it onto ``target`` once the dataset is published (and removes it)."""
    if target is None:
        return None
    tmp = Path(target).with_name(f".{Path(target).name}.tmp-{os.getpid()}")
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as out:
            for k in range(parts):
                p = Path(f"{part_prefix(workdir, k)}.rejects.jsonl")
                if p.is_file():
                    out.write(p.read_bytes())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp

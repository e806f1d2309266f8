"""``llmtrain prepare``: raw text -> cleaned, filtered, deduplicated, tokenized, packed Megatron shards.

    llmtrain prepare --input PATHS... --output PREFIX (--tokenizer FILE | --train-tokenizer VOCAB_SIZE)
        [--config RUN.yaml] [--clean] [--filter] [--dedup none|exact|near] [--pack concat|bestfit]
        [--seq-length T] [--num-shards N] [--workers N] [--on-error raise|skip] [--rejects FILE]
        [--partition I/N] [--text-key text] [--eos-token TOKEN] [--max-documents N] [--overwrite]

Stages, each switchable (``data.prepare`` in a run config, or the flags; see ``pipeline.PrepareOptions``)::

    read (readers) -> clean (clean) -> quality filters (filters) -> tokenize      [worker processes]
      -> exact + near dedup (dedup.DedupIndex) -> part files                       [main process, input order]
      -> pack (pack) -> N shards + manifest + report (shards.write_dataset)         [at the end, or in merge]

Workers receive chunks of documents and return arrays; chunks are consumed in submission order with at most
``2 N`` in flight, so the output is byte-identical for any ``--workers`` and memory is bounded (the dedup
index grows by ~1.5 KB per kept document; bestfit packs buffers of 4M tokens). Threads: each worker process
runs the tokenizer single-threaded (``TOKENIZERS_PARALLELISM=false``), so ``--workers N`` uses N cores;
``--workers 1`` tokenizes in-process with the library's own thread pool.

Resumable and atomic: every input file becomes a finished *part* in ``.PREFIX.work/`` (``shards``); a killed
run rerun with the same arguments skips finished parts (the dedup index is rebuilt from their signatures). The
final shards and manifest are renamed into place, manifest last. An input error (``--on-error raise``)
removes the work folder and leaves any previous dataset at PREFIX untouched; ``--on-error skip`` counts it. A
failed write (a full disk) publishes nothing: the previous dataset stays byte for byte, the finished parts stay
for the rerun. The work folder is one ``prepare`` created (``workdir``: a marker file); a folder of that name
without the marker is refused and never reused or removed, and a damaged ``state.json`` restarts the work.
One live ``prepare`` per output: it holds ``.PREFIX.llmtrain.lock`` beside it (train/rundir.py's RunLock; a
second one exits 2 naming the owner). Ctrl-C ends the worker pool within a bound (``parts.stop_pool``) with
exit 130, and the finished parts stay for the rerun.

``--partition I/N`` processes every N-th document (by position among all non-blank input records) into
``PREFIX.partitions/I-of-N/`` and stops there; ``llmtrain merge --output PREFIX`` joins the N partitions back
into input order (by each document's id), removing duplicates across partitions (phase 2 of the two-phase
dedup), and packs and shards them: without near dedup, the shards of one process, byte for byte.

With ``--dedup`` (and no ``--partition``) the run takes the staged path (``stages/``): per-partition screening,
per-bucket candidate pairs, connected components, per-partition tokenizing, each a resumable task with bounded
memory, on ``--engine local`` (``--workers N`` processes) or ``--engine ray``; ``--stage S --task K`` runs one
task for a scheduler. ``--partition I/N`` keeps the two-phase path above.

A MindRecord input (``NAME.mindrecord`` or ``NAME0``: MindSpore token rows, every shard of the dataset) skips
all text stages: ``mindrecord`` reads its rows (``--mindrecord-field``, default ``input_ids``) and writes each
as one pre-packed sample.

This module is the command's algorithm: :func:`prepare` (the :class:`~llmtrain.data.prep.job.PrepareJob` it
makes, the resume check against an existing output, and the final write); the flags are in
:mod:`llmtrain.commands.prepare`. The job and its counters are in ``job``, the document loop (chunks, worker
pool, dedup decisions, part writing) in ``parts``, tokenizer training in ``tokenizer_training``.
"""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import time
from collections.abc import Callable
from multiprocessing.pool import Pool
from pathlib import Path

from llmtrain.data.indexed import optimal_dtype
from llmtrain.data.manifest import manifest_path, read_manifest, tokenizer_copy_name, write_json_atomic
from llmtrain.data.prep.job import Partition, PrepareJob, stage_report
from llmtrain.data.prep.mindrecord import DEFAULT_FIELD, ShardHeader, check_request, convert, find_inputs
from llmtrain.data.prep.outputs import check_outputs
from llmtrain.data.prep.parts import collect_rejects, run_parts, start_pool, stop_pool
from llmtrain.data.prep.pipeline import PrepareOptions, cached_tokenizer, options_from
from llmtrain.data.prep.readers import expand_inputs, iter_documents
from llmtrain.data.prep.shards import iter_part_batches, write_dataset
from llmtrain.data.prep.stages.layout import StageSettings, staged_settings
from llmtrain.data.prep.stages.run import run_stages
from llmtrain.data.prep.tokenizer_training import TRAINED_EOS, train_on_documents
from llmtrain.data.prep.workdir import claim, remove
from llmtrain.data.samples import digest
from llmtrain.data.tokenizer import Tokenizer, load_tokenizer
from llmtrain.errors import ConfigError, DataError, FileSystemError
from llmtrain.train.rundir import RunLock


def prepare(
    inputs: list[str],
    output: str,
    tokenizer: str | None = None,
    train_tokenizer: int | None = None,
    text_key: str | None = None,
    workers: int = 1,
    eos_token: str | None = None,
    max_documents: int | None = None,
    log: Callable[[str], None] | None = print,
    options: PrepareOptions | dict | None = None,
    partition: tuple[int, int] | None = None,
    overwrite: bool = False,
    mindrecord_field: str | None = None,
    stages: StageSettings | dict | None = None,
) -> dict:
    """Turn ``inputs`` into the dataset ``output`` (a prefix); returns its manifest (or, with ``partition``, the
    partition's summary). See the module docstring for the stages, resume and partitions. MindRecord inputs
    (token rows, ``mindrecord_field`` naming the field) are converted by :func:`_prepare_mindrecord`.
    ``stages`` (engine, partitions, buckets, one stage or task): the staged path (``stages/run.py``), which is
    also the default with dedup (without ``partition``); with ``stage`` 1-4 it returns that stage's summary."""
    opts = options_from(options)
    if text_key is not None:
        opts = dataclasses.replace(opts, text_key=text_key)
    shards = find_inputs([str(i) for i in inputs])
    staged = staged_settings(stages, opts, partition, mindrecord=shards is not None)
    if shards is not None:
        return _prepare_mindrecord(
            shards, str(output), opts, tokenizer, train_tokenizer, eos_token, max_documents, partition,
            overwrite, mindrecord_field or DEFAULT_FIELD, log,
        )  # fmt: skip
    if mindrecord_field is not None:
        raise ConfigError(
            f"--mindrecord-field {mindrecord_field!r} applies to MindRecord inputs only, and none of the inputs "
            f"({', '.join(map(str, inputs))}) is a MindRecord file."
        )
    job = PrepareJob(
        inputs=tuple(str(i) for i in inputs),
        output=str(output),
        options=opts,
        tokenizer=tokenizer,
        train_tokenizer=train_tokenizer,
        eos_token=eos_token,
        workers=workers,
        max_documents=max_documents,
        partition=Partition(*partition) if partition is not None else None,
        overwrite=overwrite,
        log=log,
    )
    pool = start_pool(job) if staged is None else None  # the staged path starts its own engine
    try:
        return _prepare(job, pool, staged)
    finally:
        if pool is not None:
            stop_pool(pool)  # bounded, also after a Ctrl-C (parts.start_pool: the workers ignore SIGINT)


def _prepare(job: PrepareJob, pool: Pool | None, staged: StageSettings | None = None) -> dict:
    """Run ``job`` (its worker pool already started): resume check, parts (or the ``staged`` dedup's
    stages), then the dataset or partition."""
    start = time.perf_counter()
    output, opts = job.output, job.options
    files = expand_inputs(list(job.inputs))
    check_outputs(output, files, opts.rejects, dataset=job.partition is None)  # before anything is written
    given = None  # the given tokenizer, loaded first: a bad file fails before anything is written
    if job.tokenizer is not None:
        given = cached_tokenizer(job.tokenizer, job.eos_token)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    lock = _output_lock(job, staged)  # one live prepare per output, before anything is written
    try:
        return _prepare_locked(job, pool, staged, files, given, start)
    finally:
        if lock is not None:
            lock.release()


def _output_lock(job: PrepareJob, staged: StageSettings | None) -> RunLock | None:
    """The one-owner lock of ``job``'s output (train/rundir.py's RunLock, held until the run ends): a second
    ``prepare`` into the same output, or the same partition, is refused with exit 2 naming the owner. A single
    ``--stage`` / ``--task`` of a scheduled run shares the output with its sibling tasks: no lock."""
    if staged is not None and staged.stage is not None:
        return None
    if job.partition is not None:
        i, n = job.partition
        return RunLock.for_output(
            f"{job.output}.partitions/{i}_of_{n}", f"--output {job.output} --partition {i}/{n}"
        ).acquire()
    return RunLock.for_output(job.output).acquire()


def _prepare_locked(
    job: PrepareJob, pool: Pool | None, staged: StageSettings | None, files: list[Path], given: Tokenizer | None,
    start: float,
) -> dict:  # fmt: skip
    """:func:`_prepare` once the output is this run's (its lock held)."""
    output, opts = job.output, job.options
    identity = job.identity(files, given.sha256 if given is not None else None)
    key = digest(identity)
    if job.partition is None and manifest_path(output).is_file():
        old = read_manifest(output)
        if old.get("prepare", {}).get("key") == key:
            remove(job.workdir)  # a run stopped between publishing and clearing its work folder
            job.say(f"prepare: {output} is already complete for these arguments; nothing to do")
            return old
        new_sha = identity["tokenizer"]
        if new_sha and old["tokenizer"].get("sha256") != new_sha and not job.overwrite:
            raise DataError(
                f"Output '{output}' already holds a dataset made with another tokenizer (sha256 "
                f"{str(old['tokenizer'].get('sha256'))[:12]}, this run's is {new_sha[:12]}); shards of two "
                f"tokenizers must not mix. Choose another --output, or pass --overwrite to replace it."
            )
    workdir = job.workdir
    try:
        claim(workdir, key, identity, job.say)  # a folder prepare did not create is refused, never reused
    except OSError as e:
        raise _write_failed(e, output, workdir) from None
    rejects_tmp = None
    try:
        tok = given or _tokenizer(job, files, workdir)
        parts_dir, parts = workdir, len(files)
        if staged is None:
            report = stage_report(run_parts(job, files, tok, pool), opts)
            batches = iter_part_batches(workdir, len(files))
        else:
            result = run_stages(job, files, tok, staged, workdir)
            if result.summary is not None:  # one stage or task of a scheduled run: the work folder stays
                return result.summary
            assert result.report is not None and result.batches is not None and result.parts_dir is not None
            report, batches, parts_dir, parts = result.report, result.batches, result.parts_dir, result.parts
        if report["stages"]["tokenize"]["out"] == 0:
            raise DataError(
                f"No documents found in the inputs ({', '.join(map(str, job.inputs))}): every file was empty, "
                f"every document was removed by the filters or dedup, or a directory held no .jsonl/.txt/.parquet "
                f"files."
            )
        extra = {"inputs": [str(f) for f in files], "prepare": {"key": key, "options": opts.identity()},
                 "report": report}  # fmt: skip
        if job.partition is not None:
            summary = {**extra, "partition": list(job.partition), "parts": len(files),
                       "tokenizer": _tok_entry(tok, output), "tokenizer_copy": Path(tok.path).name}  # fmt: skip
            if Path(tok.path).parent != workdir:
                shutil.copyfile(tok.path, workdir / Path(tok.path).name)
            write_json_atomic(workdir / "done.json", summary)
            job.say(f"prepare: partition {job.partition.index}/{job.partition.count} done -> {workdir}")
            return summary
        rejects_tmp = collect_rejects(parts_dir, parts, opts.rejects)  # written in full before the dataset
        manifest = write_dataset(
            output,
            batches,
            optimal_dtype(tok.vocab_size),
            opts.pack,
            opts.seq_length,
            opts.num_shards,
            _tok_entry(tok, output),
            Path(tok.path),
            extra,
        )
        if rejects_tmp is not None and opts.rejects is not None:
            rejects_tmp.replace(opts.rejects)
    except DataError:
        if staged is None or staged.stage is None:  # a scheduled task leaves the other tasks' work alone
            remove(workdir)
        raise
    except OSError as e:  # a full disk, a folder that refuses writes: nothing published, the work is kept
        raise _write_failed(e, output, workdir) from None
    finally:
        if rejects_tmp is not None:
            rejects_tmp.unlink(missing_ok=True)
    remove(workdir)
    secs = time.perf_counter() - start
    job.say(
        f"prepare: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens ({manifest['dtype']}) "
        f"from {len(files)} file(s) in {secs:.1f}s -> {output} ({len(manifest['shards'])} shard(s)); "
        f"report: {output}.report.txt"
    )
    return manifest


def _write_failed(e: OSError, output: str, workdir: Path) -> FileSystemError:
    """The error of a write that failed (a full disk...) before the dataset was published."""
    old = f"the dataset already at {output} is unchanged" if manifest_path(output).is_file() else "no dataset"
    return FileSystemError(
        f"prepare --output {output}: writing failed ({e.strerror or e}{f': {e.filename}' if e.filename else ''})."
        f" Nothing was published ({old}); the finished work in '{workdir}' is kept, so the same command, rerun "
        f"once there is space, resumes it."
    )


def _prepare_mindrecord(
    shards: list[ShardHeader],
    output: str,
    opts: PrepareOptions,
    tokenizer: str | None,
    train_tokenizer: int | None,
    eos_token: str | None,
    max_documents: int | None,
    partition: tuple[int, int] | None,
    overwrite: bool,
    field: str,
    log: Callable[[str], None] | None,
) -> dict:
    """``prepare`` of MindRecord ``shards``: their token rows as pre-packed samples (see ``mindrecord``)."""
    check_request(opts, train_tokenizer, partition)
    if tokenizer is None:
        raise DataError(
            f"MindRecord input '{shards[0].path}' holds token ids: pass the tokenizer they were made with as "
            f"--tokenizer FILE (tokenizer.json or .model)."
        )
    if max_documents is not None and max_documents < 1:
        raise DataError(f"--max-documents must be at least 1, got {max_documents}.")
    check_outputs(output, [h.path for h in shards], None)  # before anything is written
    tok = cached_tokenizer(tokenizer, eos_token)
    lock = RunLock.for_output(output).acquire()  # one live prepare per output (see _output_lock)
    try:
        return convert(
            shards, output, tok, _tok_entry(tok, output), field, opts, max_documents, overwrite, log
        )
    finally:
        lock.release()


def _tok_entry(tok: Tokenizer, output: str) -> dict:
    return {
        "file": tokenizer_copy_name(output, tok.path),
        "kind": tok.kind,
        "sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
    }


def _tokenizer(job: PrepareJob, files: list[Path], workdir: Path) -> Tokenizer:
    """The tokenizer trained on the inputs (``--train-tokenizer``), kept in ``workdir`` for a resumed run."""
    trained = workdir / "trained.tokenizer.json"
    assert job.train_tokenizer is not None  # a job without a tokenizer file trains one (PrepareJob checks)
    if not trained.is_file():
        job.say(
            f"prepare: training a byte-level BPE tokenizer of {job.train_tokenizer} entries on the inputs"
        )
        tmp = workdir / ".trained.tmp.json"
        texts = itertools.islice(iter_documents(files, job.options.text_key), job.max_documents)
        train_on_documents(texts, job.train_tokenizer, str(tmp))
        tmp.replace(trained)
    eos = job.eos_token if job.eos_token not in (None, TRAINED_EOS) else TRAINED_EOS
    return load_tokenizer(str(trained), eos)

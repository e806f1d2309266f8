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
removes the work folder and leaves any previous dataset at PREFIX untouched; ``--on-error skip`` counts it.

``--partition I/N`` processes every N-th document (by position among all non-blank input records) into
``PREFIX.partitions/I-of-N/`` and stops there; ``llmtrain merge --output PREFIX`` joins the N partitions in
order, removing duplicates across partitions (phase 2 of the two-phase dedup), and packs and shards them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import multiprocessing as mp
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import yaml

from llmtrain.data.dedup import DedupIndex
from llmtrain.data.indexed import optimal_dtype
from llmtrain.data.manifest import manifest_path, read_manifest, tokenizer_copy_name, write_json_atomic
from llmtrain.data.pipeline import KEPT, PrepareOptions, cached_tokenizer, options_from, process_chunk
from llmtrain.data.readers import READERS, expand_inputs, file_kind, iter_documents
from llmtrain.data.samples import digest
from llmtrain.data.shards import (
    PartWriter,
    iter_part_batches,
    load_part_index,
    part_done,
    write_dataset,
)
from llmtrain.data.tokenizer import TRAINED_EOS, Tokenizer, load_tokenizer, train_bpe
from llmtrain.errors import ConfigError, DataError

CHUNK_DOCUMENTS = 256  # documents per worker task
CHUNK_CHARS = 1 << 18  # ... or fewer when they add up to this many characters (small: even load at the end)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the ``prepare`` subcommand (flags override the ``data.prepare`` section of ``--config``)."""
    a = parser.add_argument
    a(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="jsonl/txt/parquet files (.gz/.zst), globs, dirs",
    )
    a("--output", required=True, metavar="PREFIX", help="writes PREFIX[_NNNNN].bin/.idx, manifest, report")
    a("--tokenizer", metavar="FILE", help="tokenizer.json (HF tokenizers) or .model (SentencePiece)")
    a(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB_SIZE",
        help="train a byte-level BPE on the inputs instead",
    )
    a("--config", metavar="YAML", help="run config whose data.prepare section sets the stages")
    a("--text-key", default="text", help="JSON field / parquet column holding the text (default: text)")
    a("--workers", type=int, default=1, help="worker processes (default: 1)")
    a("--eos-token", help="token appended after each document (default: the tokenizer's EOS)")
    a("--max-documents", type=int, help="stop after this many input documents")
    a("--clean", action="store_true", default=None, help="normalize Unicode, control chars, whitespace")
    a("--mojibake", action="store_true", default=None, help="also repair UTF-8 decoded as cp1252")
    a("--filter", action="store_true", default=None, help="Gopher quality/repetition filters")
    a("--dedup", choices=["none", "exact", "near"], help="deduplication (default: none)")
    a("--pack", choices=["concat", "bestfit"], help="packing (default: concat)")
    a("--seq-length", type=int, help="sample length to pack for (default: 2048)")
    a("--num-shards", type=int, help="number of .bin/.idx shards (default: 1)")
    a("--on-error", choices=["raise", "skip"], help="malformed input: stop with an error, or skip and count")
    a("--rejects", metavar="FILE", help="write rejected documents with reasons to this jsonl file")
    a(
        "--partition",
        metavar="I/N",
        help="process partition I of N (0-based); join them with `llmtrain merge`",
    )
    a("--overwrite", action="store_true", help="replace an existing dataset made with another tokenizer")


FLAG_OPTIONS = ("text_key", "clean", "mojibake", "filter", "dedup", "pack", "seq_length", "num_shards",
                "on_error", "rejects")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """Run ``prepare`` from parsed flags; returns the exit code."""
    section: dict = {}
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
        section = dict((raw.get("data") or {}).get("prepare") or {})
    for name in FLAG_OPTIONS:
        if name == "text_key" and args.text_key == "text" and "text_key" in section:
            continue  # the flag's default does not override the config
        if getattr(args, name, None) is not None:
            section[name] = getattr(args, name)
    prepare(
        inputs=args.input,
        output=args.output,
        tokenizer=args.tokenizer,
        train_tokenizer=args.train_tokenizer,
        workers=args.workers,
        eos_token=args.eos_token,
        max_documents=args.max_documents,
        options=options_from(section),
        partition=parse_partition(args.partition) if args.partition else None,
        overwrite=args.overwrite,
    )
    return 0


def parse_partition(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N); ConfigError unless 0 <= I < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ConfigError(f"--partition {text!r}: expected I/N with 0 <= I < N, for example 0/4.")
    return i, n


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
) -> dict:
    """Turn ``inputs`` into the dataset ``output`` (a prefix); returns its manifest (or, with ``partition``, the
    partition's summary). See the module docstring for the stages, resume and partitions."""
    opts = options_from(options)
    if text_key is not None:
        opts.text_key = text_key
    if (tokenizer is None) == (train_tokenizer is None):
        raise DataError(
            "prepare needs exactly one of --tokenizer FILE (an existing tokenizer.json or .model) and "
            f"--train-tokenizer VOCAB_SIZE (train a byte-level BPE on the inputs); got "
            f"{'both' if tokenizer is not None else 'neither'}."
        )
    if workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}.")
    if max_documents is not None and max_documents < 1:
        raise DataError(f"--max-documents must be at least 1, got {max_documents}.")
    if partition is not None and train_tokenizer is not None:
        raise DataError(
            "--partition needs --tokenizer: partitions must share one tokenizer, not train their own."
        )
    pool = _start_pool(workers, tokenizer, eos_token)
    try:
        return _prepare(inputs, output, tokenizer, train_tokenizer, workers, eos_token, max_documents, log, opts,
                        partition, overwrite, pool)  # fmt: skip
    finally:
        if pool is not None:
            pool.terminate()


def _prepare(inputs, output, tokenizer, train_tokenizer, workers, eos_token, max_documents, log, opts, partition,
             overwrite, pool) -> dict:  # fmt: skip
    start = time.perf_counter()
    files = expand_inputs(list(inputs))
    given = cached_tokenizer(tokenizer, eos_token) if tokenizer is not None else None  # fails before writing
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    identity = {
        "inputs": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "tokenizer": given.sha256 if given is not None else None,
        "train_tokenizer": train_tokenizer,
        "eos_token": eos_token,
        "max_documents": max_documents,
        "options": opts.identity(),
        "partition": list(partition) if partition else None,
    }
    key = digest(identity)
    if partition is None and manifest_path(output).is_file():
        old = read_manifest(output)
        if old.get("prepare", {}).get("key") == key:
            if log:
                log(f"prepare: {output} is already complete for these arguments; nothing to do")
            return old
        new_sha = identity["tokenizer"]
        if new_sha and old["tokenizer"].get("sha256") != new_sha and not overwrite:
            raise DataError(
                f"Output '{output}' already holds a dataset made with another tokenizer (sha256 "
                f"{str(old['tokenizer'].get('sha256'))[:12]}, this run's is {new_sha[:12]}); shards of two "
                f"tokenizers must not mix. Choose another --output, or pass --overwrite to replace it."
            )
    workdir = (
        Path(f"{output}.partitions") / f"{partition[0]}-of-{partition[1]}"
        if partition
        else out.parent / f".{out.name}.work"
    )
    state = workdir / "state.json"
    if workdir.exists() and (not state.is_file() or json.loads(state.read_text()).get("key") != key):
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(state, {"key": key, "identity": identity})
    try:
        tok = given or _tokenizer(files, train_tokenizer, eos_token, opts, workdir, max_documents, log)
        counters = _run_parts(files, tok, eos_token, opts, pool, workdir, max_documents, partition)
        report = _report(counters, opts)
        if report["stages"]["tokenize"]["out"] == 0:
            raise DataError(
                f"No documents found in the inputs ({', '.join(map(str, inputs))}): every file was empty, every "
                f"document was removed by the filters or dedup, or a directory held no .jsonl/.txt/.parquet files."
            )
        extra = {"inputs": [str(f) for f in files], "prepare": {"key": key, "options": opts.identity()},
                 "report": report}  # fmt: skip
        if partition is not None:
            summary = {**extra, "partition": list(partition), "parts": len(files),
                       "tokenizer": _tok_entry(tok, output), "tokenizer_copy": Path(tok.path).name}  # fmt: skip
            if Path(tok.path).parent != workdir:
                shutil.copyfile(tok.path, workdir / Path(tok.path).name)
            write_json_atomic(workdir / "done.json", summary)
            if log:
                log(f"prepare: partition {partition[0]}/{partition[1]} done -> {workdir}")
            return summary
        manifest = write_dataset(
            output,
            iter_part_batches(workdir, len(files)),
            optimal_dtype(tok.vocab_size),
            opts.pack,
            opts.seq_length,
            opts.num_shards,
            _tok_entry(tok, output),
            Path(tok.path),
            extra,
        )
        _collect_rejects(workdir, len(files), opts.rejects)
    except DataError:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    if log:
        secs = time.perf_counter() - start
        log(
            f"prepare: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens ({manifest['dtype']}) "
            f"from {len(files)} file(s) in {secs:.1f}s -> {output} ({len(manifest['shards'])} shard(s)); "
            f"report: {output}.report.txt"
        )
    return manifest


def _tok_entry(tok: Tokenizer, output: str) -> dict:
    return {
        "file": tokenizer_copy_name(output, tok.path),
        "kind": tok.kind,
        "sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
    }


def _tokenizer(files, train_tokenizer, eos_token, opts, workdir, max_documents, log) -> Tokenizer:
    trained = workdir / "trained.tokenizer.json"
    if not trained.is_file():
        if log:
            log(f"prepare: training a byte-level BPE tokenizer of {train_tokenizer} entries on the inputs")
        tmp = workdir / ".trained.tmp.json"
        _train(
            itertools.islice(iter_documents(files, opts.text_key), max_documents), train_tokenizer, str(tmp)
        )
        tmp.replace(trained)
    return load_tokenizer(str(trained), eos_token if eos_token not in (None, TRAINED_EOS) else TRAINED_EOS)


def _train(texts: Iterable[str], vocab_size: int, out_path: str) -> None:
    """train_bpe, re-raising a DataError hit while the Rust trainer was pulling documents."""
    errors: list[BaseException] = []

    def guarded() -> Iterator[str]:
        try:
            yield from texts
        except Exception as e:  # surfaced after training; the trainer would otherwise wrap it
            errors.append(e)

    train_bpe(guarded(), vocab_size, out_path)
    if errors:
        raise errors[0]


def _chunks(records: Iterable[tuple]) -> Iterator[list[tuple]]:
    chunk: list[tuple] = []
    chars = 0
    for rec in records:
        chunk.append(rec)
        chars += len(rec[0])
        if len(chunk) >= CHUNK_DOCUMENTS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _start_pool(workers: int, tokenizer: str | None, eos_token: str | None):
    """The worker pool of ``--workers N`` (None for one worker: it runs in-process), started first so that the
    workers import the pipeline and load the tokenizer while this process loads its own copy. Spawned, not
    forked: this process may run tokenizers' thread pool (training) or torch's, which a fork copies broken;
    forking measured no faster (the workers' start overlaps the main process's own tokenizer load)."""
    if workers == 1:
        return None
    return mp.get_context("spawn").Pool(workers, initializer=_worker_init, initargs=(tokenizer, eos_token))


def _worker_init(tokenizer: str | None, eos_token: str | None) -> None:
    """Worker initializer: one tokenizer thread per worker process, so ``--workers N`` uses N cores (not N
    thread pools of all cores each; with ``--workers 1`` the tokenizer runs in-process with its own pool); then
    load the tokenizer before the first chunk arrives. A tokenizer that fails to load is reported by the main
    process, which loads it too."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    if tokenizer is not None:
        try:
            cached_tokenizer(tokenizer, eos_token)
        except Exception:  # noqa: BLE001 (the main process raises the clear error)
            pass


def _process(opts, tok_path, eos_token, texts):
    return process_chunk(texts, opts, tok_path, eos_token)


def _results(chunks: Iterator[list[tuple]], tok: Tokenizer, eos_token, opts, pool) -> Iterator[tuple]:
    """(chunk records, ChunkResult) in order, computed in-process or by the pool (<= 2N in flight)."""
    if pool is None:
        for chunk in chunks:
            yield chunk, process_chunk([r[0] for r in chunk], opts, tok.path, eos_token, tok)
        return
    task = functools.partial(_process, opts, tok.path, eos_token)
    pending: deque = deque()
    for chunk in chunks:
        pending.append((chunk, pool.apply_async(task, ([r[0] for r in chunk],))))
        if len(pending) >= 2 * pool._processes:
            c, r = pending.popleft()
            yield c, r.get()
    while pending:
        c, r = pending.popleft()
        yield c, r.get()


def _run_parts(files, tok, eos_token, opts, pool, workdir, max_documents, partition) -> list[dict]:
    """Process every input file into a finished part; returns the parts' counters."""
    index = None
    if opts.dedup != "none":
        index = DedupIndex(dataclasses.replace(opts.minhash, near=opts.dedup == "near"))
    ordinal, read = [0], 0  # non-blank records seen (partitioning), documents read (max_documents)
    counters: list[dict] = []
    for k, path in enumerate(files):
        done = part_done(workdir, k)
        if done is not None:
            if index is not None:
                load_part_index(workdir, k, index)
            ordinal[0], read = done["ordinal"], done["read_total"]
            counters.append(done)
            continue
        if max_documents is not None and read >= max_documents:
            c = _empty_counters()
        else:
            c = _run_part(k, path, tok, eos_token, opts, pool, workdir, index, ordinal, read, max_documents,
                          partition)  # fmt: skip
        read += c["read"]
        c["ordinal"], c["read_total"] = ordinal[0], read
        counters.append(c)
        if c.get("_writer") is not None:
            c.pop("_writer").commit({k2: v for k2, v in c.items()})
        else:
            write_json_atomic(Path(f"{workdir}/part-{k:05d}.json"), c)  # empty part marker
    return counters


def _empty_counters() -> dict:
    return {"read": 0, "errors": {}, "rejected": {}, "exact_duplicate": 0, "near_duplicate": 0, "kept": 0,
            "tokens": 0}  # fmt: skip


def _run_part(k, path, tok, eos_token, opts, pool, workdir, index, ordinal, read, max_documents, partition):
    c = _empty_counters()
    errors: dict | None = {} if opts.on_error == "skip" else None
    keep = None
    if partition is not None:
        i, n = partition

        def keep() -> bool:
            ordinal[0] += 1
            return (ordinal[0] - 1) % n == i

    records = READERS[file_kind(path)](path, opts.text_key, errors, keep)
    if max_documents is not None:
        records = itertools.islice(records, max_documents - read)
    writer = PartWriter(workdir, k, optimal_dtype(tok.vocab_size), opts.rejects is not None)
    try:
        for chunk, res in _results(_chunks(records), tok, eos_token, opts, pool):
            kept = np.asarray([r == KEPT for r in res.status], dtype=bool)  # [N] passed clean + filters
            if index is not None:  # dedup decisions, one document at a time in input order
                rows = kept.nonzero()[0].tolist()
                for j, reason in zip(rows, index.check_many(res.digests, res.bands, res.sigs, rows)):
                    if reason:
                        res.status[j] = reason
                        kept[j] = False
            tokens = res.tokens
            if not kept.all():  # drop the tokens of documents tokenized but then found duplicates
                tokens = tokens[np.repeat(kept, res.lengths)]
            writer.add_many(tokens, res.lengths[kept],
                            None if res.digests is None else res.digests[kept],
                            None if res.bands is None else res.bands[kept],
                            None if res.sigs is None else res.sigs[kept])  # fmt: skip
            c["read"] += len(chunk)
            c["kept"] += int(kept.sum())
            c["tokens"] += int(tokens.size)
            if kept.all():
                continue
            for j in (~kept).nonzero()[0].tolist():
                reason = res.status[j]
                if reason in ("exact_duplicate", "near_duplicate"):
                    c[reason] += 1
                else:
                    c["rejected"][reason] = c["rejected"].get(reason, 0) + 1
                text, fpath, line = chunk[j]
                writer.reject(text, reason, fpath, line)
    except BaseException:
        writer.abort()
        raise
    c["errors"] = dict(errors or {})
    c["_writer"] = writer
    return c


def _report(parts: list[dict], opts: PrepareOptions) -> dict:
    """Documents in/out per stage, summed over the parts."""
    total = _empty_counters()
    for c in parts:
        for key in ("read", "exact_duplicate", "near_duplicate", "kept", "tokens"):
            total[key] += c[key]
        for key in ("errors", "rejected"):
            for reason, n in c[key].items():
                total[key][reason] = total[key].get(reason, 0) + n
    empty = total["rejected"].pop("empty", 0)
    filtered = sum(total["rejected"].values())
    dups = total["exact_duplicate"] + total["near_duplicate"]
    read = total["read"]
    return {
        "errors_skipped": total["errors"],
        "stages": {
            "read": {"in": read + sum(total["errors"].values()), "out": read, "removed": total["errors"]},
            "clean": {"in": read, "out": read - empty, "removed": {"empty": empty} if empty else {}},
            "filter": {"in": read - empty, "out": read - empty - filtered, "removed": total["rejected"]},
            "dedup": {
                "in": read - empty - filtered,
                "out": total["kept"],
                "removed": {k: total[k] for k in ("exact_duplicate", "near_duplicate") if total[k]},
            },
            "tokenize": {"in": total["kept"], "out": total["kept"], "removed": {}},
        },  # fmt: skip
        "duplicates_removed": dups,
        "tokens": total["tokens"],
        "enabled": {"clean": opts.clean, "filter": opts.filter, "dedup": opts.dedup, "pack": opts.pack},
    }


def _collect_rejects(workdir: Path, parts: int, target: str | None) -> None:
    """Concatenate the parts' rejects into ``target`` (atomically)."""
    if target is None:
        return
    tmp = Path(f"{target}.tmp")
    with open(tmp, "wb") as out:
        for k in range(parts):
            p = workdir / f"part-{k:05d}.rejects.jsonl"
            if p.is_file():
                out.write(p.read_bytes())
    tmp.replace(target)

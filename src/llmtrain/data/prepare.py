"""``llmtrain prepare``: raw text -> tokenized Megatron shard + manifest + tokenizer copy.

    llmtrain prepare --input FILES... --output PREFIX (--tokenizer FILE | --train-tokenizer VOCAB_SIZE)
                     [--text-key text] [--workers N] [--eos-token TOKEN] [--max-documents N]

Pipeline (one pass over the inputs, two when a tokenizer is trained first)::

    expand_inputs -> iter_documents -> chunks of documents -> encode_batch (main process or N workers)
      -> ids + [EOS] per document -> IndexedDatasetWriter -> PREFIX.bin / .idx -> manifest

Output is atomic: everything is written under hidden temporary names (``.NAME.tmp-PID.*``) in the output folder
and renamed into place only when complete, the manifest last (its presence marks a finished dataset); any error
or interrupt removes the temporary files. With ``--workers N`` chunks are encoded in a process pool (each worker
loads the tokenizer once, memoised) and written back in submission order, so the output is byte-identical to
``--workers 1``; at most ``2 N`` chunks are in flight, so memory stays bounded on any corpus size.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import multiprocessing as mp
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from llmtrain import __version__
from llmtrain.data.indexed import IndexedDatasetWriter, bin_path, idx_path, optimal_dtype
from llmtrain.data.manifest import FORMAT, VERSION, manifest_path, tokenizer_copy_name, write_json_atomic
from llmtrain.data.readers import expand_inputs, iter_documents
from llmtrain.data.tokenizer import TRAINED_EOS, Tokenizer, load_tokenizer, sha256_file, train_bpe
from llmtrain.errors import DataError

CHUNK_DOCUMENTS = 256  # documents per encode_batch call / worker task
CHUNK_CHARS = 4 << 20  # ... or fewer when they add up to this many characters


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the ``prepare`` subcommand."""
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="jsonl/txt files (optionally .gz), other text files, or directories",
    )
    parser.add_argument(
        "--output",
        required=True,
        metavar="PREFIX",
        help="writes PREFIX.bin, PREFIX.idx, PREFIX.manifest.json and the tokenizer copy",
    )
    parser.add_argument(
        "--tokenizer", metavar="FILE", help="tokenizer.json (HF tokenizers) or .model (SentencePiece)"
    )
    parser.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB_SIZE",
        help="train a byte-level BPE of this vocabulary size on the inputs instead",
    )
    parser.add_argument(
        "--text-key", default="text", help="JSON field holding the document text (default: text)"
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    parser.add_argument(
        "--eos-token", help="token appended after each document (default: the tokenizer's EOS)"
    )
    parser.add_argument("--max-documents", type=int, help="stop after this many documents")


def main(args: argparse.Namespace) -> int:
    """Run ``prepare`` from parsed flags; returns the exit code."""
    prepare(
        inputs=args.input,
        output=args.output,
        tokenizer=args.tokenizer,
        train_tokenizer=args.train_tokenizer,
        text_key=args.text_key,
        workers=args.workers,
        eos_token=args.eos_token,
        max_documents=args.max_documents,
    )
    return 0


def prepare(
    inputs: list[str],
    output: str,
    tokenizer: str | None = None,
    train_tokenizer: int | None = None,
    text_key: str = "text",
    workers: int = 1,
    eos_token: str | None = None,
    max_documents: int | None = None,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Tokenize ``inputs`` into the dataset ``output`` (a prefix); returns the manifest written."""
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
    start = time.perf_counter()
    files = expand_inputs(list(inputs))
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = str(out.parent / f".{out.name}.tmp-{os.getpid()}")
    tok_source = tokenizer if tokenizer is not None else "trained.json"
    tmp_tok = Path(f"{tmp_prefix}.tokenizer{'.model' if tok_source.endswith('.model') else '.json'}")
    tmp_paths = [bin_path(tmp_prefix), idx_path(tmp_prefix), tmp_tok, manifest_path(tmp_prefix)]

    def documents() -> Iterator[str]:
        return itertools.islice(iter_documents(files, text_key), max_documents)

    writer: IndexedDatasetWriter | None = None
    try:
        if tokenizer is not None:
            tok = load_tokenizer(tokenizer, eos_token)
            shutil.copyfile(tokenizer, tmp_tok)
        else:
            if log:
                log(
                    f"prepare: training a byte-level BPE tokenizer of {train_tokenizer} entries on the inputs"
                )
            tok = _train(documents(), train_tokenizer, str(tmp_tok), eos_token)
        writer = IndexedDatasetWriter(tmp_prefix, optimal_dtype(tok.vocab_size))
        eos = np.asarray([tok.eos_id], dtype=np.int64)
        for ids in _encode_all(documents(), tok, eos_token, workers):
            writer.add_document(np.concatenate([np.asarray(ids, dtype=np.int64), eos]))
        writer.finalize()
        if writer.num_documents == 0:
            raise DataError(
                f"No documents found in the inputs ({', '.join(map(str, inputs))}): every file was empty or a "
                f"directory held no *.jsonl / *.txt (or .gz) files."
            )
        manifest = _manifest(output, tmp_prefix, tok, tok_source, writer, files)
        write_json_atomic(manifest_path(tmp_prefix), manifest)
        _publish(tmp_prefix, output, tmp_tok)
    finally:
        if writer is not None:
            writer.close()
        for p in tmp_paths:
            p.unlink(missing_ok=True)
    if log:
        secs = time.perf_counter() - start
        log(
            f"prepare: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens ({manifest['dtype']}) "
            f"from {len(files)} file(s) in {secs:.1f}s -> {output}.bin, {output}.idx, {output}.manifest.json, "
            f"{Path(output).parent / manifest['tokenizer']['file']}"
        )
    return manifest


def _train(texts: Iterable[str], vocab_size: int, out_path: str, eos_token: str | None) -> Tokenizer:
    """train_bpe, re-raising a DataError hit while the Rust trainer was pulling documents."""
    errors: list[BaseException] = []

    def guarded() -> Iterator[str]:
        try:
            yield from texts
        except Exception as e:  # surfaced after training; the trainer would otherwise wrap it
            errors.append(e)

    tok = train_bpe(guarded(), vocab_size, out_path)
    if errors:
        raise errors[0]
    return load_tokenizer(out_path, eos_token) if eos_token not in (None, TRAINED_EOS) else tok


def _chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    chars = 0
    for text in texts:
        chunk.append(text)
        chars += len(text)
        if len(chunk) >= CHUNK_DOCUMENTS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


@functools.lru_cache(maxsize=2)
def _worker_tokenizer(path: str, eos_token: str | None) -> Tokenizer:
    """The tokenizer of a worker process, loaded on its first task and reused after."""
    return load_tokenizer(path, eos_token)


def _encode_chunk(path: str, eos_token: str | None, texts: list[str]) -> list[list[int]]:
    return _worker_tokenizer(path, eos_token).encode_batch(texts)


def _encode_all(
    texts: Iterable[str], tok: Tokenizer, eos_token: str | None, workers: int
) -> Iterator[list[int]]:
    """Token ids of each text, in input order, encoded in-process or by ``workers`` processes."""
    if workers == 1:
        for chunk in _chunks(texts):
            yield from tok.encode_batch(chunk)
        return
    # spawn: the parent may already run tokenizers' thread pool (training), which fork would copy broken.
    with mp.get_context("spawn").Pool(workers) as pool:
        task = functools.partial(_encode_chunk, tok.path, eos_token)
        pending: deque = deque()
        for chunk in _chunks(texts):
            pending.append(pool.apply_async(task, (chunk,)))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


def _manifest(
    output: str,
    tmp_prefix: str,
    tok: Tokenizer,
    tok_source: str,
    writer: IndexedDatasetWriter,
    files: list[Path],
) -> dict:
    def entry(path: Path, final: Path) -> dict:
        return {"name": final.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}

    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {
            "file": tokenizer_copy_name(output, tok_source),
            "kind": tok.kind,
            "sha256": tok.sha256,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "bos_id": tok.bos_id,
        },
        "dtype": writer.dtype.name,
        "documents": writer.num_documents,
        "tokens": writer.num_tokens,
        "files": {
            "bin": entry(bin_path(tmp_prefix), bin_path(output)),
            "idx": entry(idx_path(tmp_prefix), idx_path(output)),
        },
        "inputs": [str(f) for f in files],
        "created_by": f"llmtrain {__version__}",
    }


def _publish(tmp_prefix: str, output: str, tmp_tok: Path) -> None:
    """Rename the finished files into place; the old manifest goes first and the new one comes last."""
    manifest_path(output).unlink(missing_ok=True)
    for suffix in (".tokenizer.json", ".tokenizer.model"):
        Path(f"{output}{suffix}").unlink(missing_ok=True)
    os.replace(bin_path(tmp_prefix), bin_path(output))
    os.replace(idx_path(tmp_prefix), idx_path(output))
    os.replace(tmp_tok, Path(output).parent / tokenizer_copy_name(output, str(tmp_tok)))
    os.replace(manifest_path(tmp_prefix), manifest_path(output))

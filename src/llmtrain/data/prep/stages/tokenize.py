"""Stage 4 of the staged dedup, per partition: drop the duplicates, tokenize, write a part; then the stream the
dataset is written from (stage 5).

A task reads its partition's kept texts from stage 1 (``texts.bin``, ``docs.npz``) a chunk at a time, skips
the rows stage 3 dropped, tokenizes the rest with :func:`~llmtrain.data.prep.pipeline.tokenize_texts` (EOS
appended, the shard dtype's range check) and writes ``s4/part-PPPPP`` through
:class:`~llmtrain.data.prep.shards.PartWriter` (atomic, its counters last), with ``part-PPPPP.ids.npy``, the
ids of its documents. Rejects (when asked for): the filter rejects of stage 1 and the duplicates, merged in
id order (a duplicate's text is its cleaned text).

:func:`staged_batches` is the document stream of the whole dataset in input order: the parts one after the
other, except the interleaved slices of one file, which are merged by id (their ids held for that one file).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from llmtrain.data.indexed import optimal_dtype
from llmtrain.data.prep.job import PartCounters
from llmtrain.data.prep.parts import CHUNK_CHARS, CHUNK_DOCUMENTS
from llmtrain.data.prep.pipeline import cached_tokenizer, tokenize_texts
from llmtrain.data.prep.shards import PartWriter, iter_merged, iter_part_batches, part_prefix
from llmtrain.data.prep.stages.layout import LOW, SHIFT, StageContext, save_npy


def _drops(ctx: StageContext, k: int, n: int) -> np.ndarray:
    """[n] int8 per kept row of stage 1: 0 keep, 1 exact duplicate, 2 near duplicate."""
    out = np.zeros(n, dtype=np.int8)
    if ctx.options.dedup == "none":
        return out
    with np.load(ctx.s3() / f"drops-{k:05d}.npz") as z:
        out[z["rows"]] = np.where(z["exact"], 1, 2)
    return out


def _chunks(offsets: np.ndarray) -> Iterator[tuple[int, int]]:
    """Row ranges of at most CHUNK_DOCUMENTS documents or about CHUNK_CHARS bytes."""
    i, n = 0, len(offsets) - 1
    while i < n:
        j = int(np.searchsorted(offsets, offsets[i] + CHUNK_CHARS, side="right")) - 1
        j = min(max(j, i + 1), i + CHUNK_DOCUMENTS, n)
        yield i, j
        i = j


def tokenize_task(ctx: StageContext, k: int) -> dict:
    """Stage 4 of partition ``k``; returns the task's figures."""
    s1 = ctx.s1(k)
    with np.load(s1 / "docs.npz") as z:
        ids, offsets = z["ids"], z["offsets"]
    drops = _drops(ctx, k, len(ids))
    screened = ctx.done(1, k)
    assert screened is not None  # run.py checks stage 1 before stage 4 starts
    counters = PartCounters.from_json(screened["counters"])
    tok = cached_tokenizer(ctx.tokenizer, ctx.eos_token)
    with_rejects = ctx.options.rejects is not None
    writer = PartWriter(ctx.s4(), k, optimal_dtype(tok.vocab_size), with_rejects)
    try:
        dup_rejects: list[tuple[int, str, str]] = []  # (id, reason, text)
        chars = 0
        with open(s1 / "texts.bin", "rb") as f:
            for i, j in _chunks(offsets):
                data = f.read(int(offsets[j] - offsets[i]))
                cut = (offsets[i : j + 1] - offsets[i]).tolist()
                texts = [data[a:b].decode("utf-8") for a, b in zip(cut, cut[1:])]
                chars += sum(map(len, texts))
                keep = drops[i:j] == 0
                lengths, tokens = tokenize_texts([t for t, x in zip(texts, keep) if x], tok, ctx.tokenizer)
                writer.add_many(tokens, lengths, None, None, None)
                counters.tokens += int(tokens.size)
                for r in np.flatnonzero(~keep).tolist():
                    reason = "exact_duplicate" if drops[i + r] == 1 else "near_duplicate"
                    counters.reject(reason)
                    if with_rejects:
                        dup_rejects.append((int(ids[i + r]), reason, texts[r]))
        counters.kept = int((drops == 0).sum())
        if with_rejects:
            _write_rejects(ctx, s1, writer, dup_rejects)
        bytes_ids = save_npy(Path(f"{part_prefix(ctx.s4(), k)}.ids.npy"), ids[drops == 0])
        writer.commit(counters.to_json())
    except BaseException:
        writer.abort()
        raise
    prefix = part_prefix(ctx.s4(), k)
    written = bytes_ids + sum(Path(f"{prefix}{s}").stat().st_size for s in (".bin", ".idx"))
    return {"docs_in": len(ids), "docs_out": counters.kept, "tokens": counters.tokens,
            "chars_in": chars, "bytes": written}  # fmt: skip


def _write_rejects(ctx: StageContext, s1: Path, writer: PartWriter, dups: list[tuple[int, str, str]]) -> None:
    """The partition's rejects in id order: stage 1's filter rejects merged with the duplicates."""
    assert writer.rejects is not None
    filtered = np.load(s1 / "rejects.ids.npy")
    lines = (s1 / "rejects.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    d = 0
    for gid, line in zip(filtered.tolist(), lines):
        while d < len(dups) and dups[d][0] < gid:
            _dup(ctx, writer, dups[d])
            d += 1
        writer.rejects.write(line)
    for item in dups[d:]:
        _dup(ctx, writer, item)


def _dup(ctx: StageContext, writer: PartWriter, item: tuple[int, str, str]) -> None:
    gid, reason, text = item
    writer.reject(text, reason, Path(ctx.plan.files[gid >> SHIFT]), gid & LOW)


def staged_batches(ctx: StageContext) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The dataset's documents in input order, as ``(tokens, lengths)`` batches (``shards.write_dataset``)."""
    groups = ctx.plan.groups()
    if all(len(g) == 1 for g in groups):  # no file was sliced: the parts are in order
        yield from iter_part_batches(ctx.s4(), len(ctx.plan.partitions))
        return
    for group in groups:
        yield from _merged(ctx.s4(), group)


def _merged(folder: Path, parts: list[int]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The documents of ``parts`` (each in id order) merged into one id order, in batches."""
    ids = [np.load(f"{part_prefix(folder, k)}.ids.npy") for k in parts]
    return iter_merged([part_prefix(folder, k) for k in parts], ids)

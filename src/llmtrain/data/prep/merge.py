"""``llmtrain merge``: join the partitions written by ``prepare --partition I/N`` into one dataset.

    llmtrain merge --output PREFIX [--num-shards N] [--pack concat|bestfit] [--seq-length T] [--keep-partitions]

Two-phase deduplication across partitions:

1. each ``prepare --partition I/N`` run (one node of a Slurm array, say) cleans, filters, deduplicates *within*
   its partition and records, for every kept document, its exact digest, LSH band keys and MinHash signature
   (``part-*.dedup.npz`` in ``PREFIX.partitions/I-of-N/``);
2. ``merge`` puts the partitions' documents back into input order and replays their signatures, in that
   order, through one :class:`~llmtrain.data.prep.dedup.DedupIndex`, dropping every document that duplicates
   (exactly, or near: a shared band and estimated Jaccard >= the threshold) a document kept earlier. Only
   signatures are compared; no text is re-read.

Input order. A partition keeps every N-th non-blank record, and every kept document's part records its global
id ``file << 40 | line`` (``part-*.ids.npy``, the staged dedup's ids). The merge takes the input files one at a
time and interleaves the N partitions' parts of that file by id (:func:`~llmtrain.data.prep.shards.iter_merged`),
so the merged stream is the one-process stream: without dedup, and with ``--dedup exact`` (equal digests are an
equivalence: the first copy in input order survives, here as in the one-process staged rule), N partitions
plus ``merge`` write the same shard bytes as one ``prepare`` of the same inputs and options. With ``--dedup
near`` the guarantee is the index's (no kept pair is a near duplicate), but the kept set can differ from one
process on chains ``a ~ b ~ c`` (``a``, ``c`` not similar, in that input order): with ``b`` in one partition and
``a``, ``c`` in another, that partition keeps ``a`` and ``c``, the merge drops ``b`` for ``a`` and keeps both,
while the one-process staged rule keeps only the lowest id of each connected component, ``a``. Partitions written before the ids existed (no ``part-*.ids.npy``) are joined in
partition order, as before.

Packing and sharding happen here, once, over the merged stream. All partitions must be finished
(``done.json``) and share one tokenizer, one prepare configuration and one input list.

This module is the merge (:func:`merge`); the command's flags are in :mod:`llmtrain.commands.merge`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from llmtrain.data.indexed import optimal_dtype
from llmtrain.data.prep.dedup import DedupIndex
from llmtrain.data.prep.outputs import check_outputs
from llmtrain.data.prep.pipeline import options_from
from llmtrain.data.prep.shards import (
    cross_part_keep,
    iter_merged,
    iter_part_batches,
    part_done,
    part_prefix,
    write_dataset,
)
from llmtrain.data.prep.workdir import remove
from llmtrain.errors import ConfigError, DataError


def find_partitions(output: str) -> list[Path]:
    """The partition folders of ``output`` in order; DataError if any is missing or unfinished."""
    root = Path(f"{output}.partitions")
    dirs = sorted(root.glob("*-of-*")) if root.is_dir() else []
    if not dirs:
        raise DataError(
            f"No partitions found under '{root}'. Run `llmtrain prepare --output {output} --partition I/N ...` "
            f"for every I in 0..N-1 first."
        )
    counts = {d.name.split("-of-")[1] for d in dirs}
    n = int(counts.pop()) if len(counts) == 1 and next(iter(counts)).isdigit() else -1
    if n < 1 or {d.name for d in dirs} != {f"{i}-of-{n}" for i in range(n)}:
        raise DataError(
            f"'{root}' holds partitions {sorted(d.name for d in dirs)}, expected exactly 0-of-{n} .. {n - 1}-of-{n}; "
            f"remove stale ones or run the missing ones."
        )
    ordered = [root / f"{i}-of-{n}" for i in range(n)]
    unfinished = [d.name for d in ordered if not (d / "done.json").is_file()]
    if unfinished:
        raise DataError(
            f"Partitions {unfinished} of '{output}' are not finished (no done.json); rerun them with the same "
            f"arguments (finished input files are skipped), then merge."
        )
    return ordered


def _read_done(folder: Path) -> dict:
    """A partition's ``done.json`` summary; DataError naming it when it is not one of ours."""
    path = folder / "done.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        summary = e
    needed = ("tokenizer", "prepare", "parts", "report", "inputs", "tokenizer_copy")
    if not isinstance(summary, dict) or any(k not in summary for k in needed):
        raise DataError(
            f"{path} is damaged (not the JSON summary `prepare --partition` writes, with {', '.join(needed)}); "
            f"rerun that partition with the same arguments, then merge."
        )
    problem = _done_problem(summary, folder)
    if problem:
        raise DataError(
            f"{path} is damaged ({problem}); rerun that partition with the same arguments, then merge."
        )
    return summary


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _done_problem(summary: dict, folder: Path) -> str | None:
    """What is wrong with a ``done.json`` whose keys are all there (types, its partition, its part files)."""
    tok, prep, report = summary["tokenizer"], summary["prepare"], summary["report"]
    if (
        not isinstance(tok, dict)
        or not isinstance(tok.get("sha256"), str)
        or not _is_int(tok.get("vocab_size"))
    ):
        return "tokenizer is not {sha256: text, vocab_size: integer, ...}"
    if not isinstance(prep, dict) or not isinstance(prep.get("options"), dict):
        return "prepare.options is not an object"
    if not isinstance(report, dict) or not isinstance(report.get("stages"), dict):
        return "report.stages is not an object"
    inputs = summary["inputs"]
    if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
        return "inputs is not a list of file names"
    if not _is_int(summary["parts"]):
        return f"parts = {summary['parts']!r} is not an integer >= 0"
    name = summary.get("partition")
    if name is not None and (
        not isinstance(name, list) or len(name) != 2 or f"{name[0]}-of-{name[1]}" != folder.name
    ):
        return f"it describes partition {name!r}, not {folder.name} (copied from another folder?)"
    copy = summary["tokenizer_copy"]
    if not isinstance(copy, str) or not copy or "/" in copy or not (folder / copy).is_file():
        return f"its tokenizer copy {copy!r} is missing"
    for k in range(summary["parts"]):  # a part that kept documents must still have its token files
        prefix = part_prefix(folder, k)
        counters = part_done(folder, k)
        kept = counters.get("kept", 0) if isinstance(counters, dict) else 0
        missing = [e for e in (".bin", ".idx") if not Path(f"{prefix}{e}").is_file()]
        if isinstance(kept, int) and kept > 0 and missing:
            return f"part {k} kept {kept} documents but {prefix.name}{missing[0]} is missing"
    return None


def merge(
    output: str,
    num_shards: int | None = None,
    pack: str | None = None,
    seq_length: int | None = None,
    keep_partitions: bool = False,
    log=print,
) -> dict:
    """Join the finished partitions of ``output``; returns the manifest written."""
    if seq_length is not None and seq_length < 1 or num_shards is not None and num_shards < 1:
        raise ConfigError(
            f"merge: --seq-length and --num-shards must be at least 1, got {seq_length} and {num_shards}."
        )
    find_partitions(output)  # there is something to merge (before the lock creates its folder)
    lock = _lock(output)
    try:
        return _merge(output, num_shards, pack, seq_length, keep_partitions, log)
    finally:
        lock.release()
        _drop_partitions_root(output)


def _lock(output: str):
    """The one-owner lock of ``PREFIX.partitions`` (train/rundir.py's RunLock on that folder): a second merge
    into the same prefix is refused, naming the merge that holds it."""
    from llmtrain.train.rundir import RunLock

    lock = RunLock(f"{output}.partitions")
    try:
        return lock.acquire()
    except ConfigError:
        try:
            owner = lock.path.read_text(encoding="utf-8").strip() or "an unknown process"
        except OSError:
            owner = "an unknown process"
        raise DataError(
            f"merge --output {output}: another merge of {output}.partitions is running ({owner}); two merges "
            "into one prefix would write over each other's shards. Wait for it to end."
        ) from None


def _drop_partitions_root(output: str) -> None:
    """Remove ``PREFIX.partitions`` when nothing but the lock file is left in it."""
    from llmtrain.train.rundir import LOCK_NAME

    root = Path(f"{output}.partitions")
    try:
        if root.is_dir() and [p.name for p in root.iterdir()] == [LOCK_NAME]:
            (root / LOCK_NAME).unlink()
            root.rmdir()
    except OSError:
        pass


def _merge(
    output: str, num_shards: int | None, pack: str | None, seq_length: int | None, keep_partitions: bool, log
) -> dict:
    """:func:`merge` under the lock."""
    dirs = find_partitions(output)  # again: a merge that just ended removed them
    check_outputs(output, [], None)  # the merged dataset replaces only a dataset of ours
    done = [_read_done(d) for d in dirs]
    first = done[0]
    for d, summary in zip(dirs, done):
        if summary["tokenizer"]["sha256"] != first["tokenizer"]["sha256"]:
            raise DataError(
                f"Partition '{d}' was tokenized with another tokenizer than '{dirs[0]}' (sha256 "
                f"{summary['tokenizer']['sha256'][:12]} vs {first['tokenizer']['sha256'][:12]}); rerun it."
            )
        if summary["prepare"]["options"] != first["prepare"]["options"]:
            raise DataError(f"Partition '{d}' was prepared with other options than '{dirs[0]}'; rerun it.")
        if summary["inputs"] != first["inputs"]:
            raise DataError(
                f"Partition '{d}' was prepared from other inputs than '{dirs[0]}' ({len(summary['inputs'])} vs "
                f"{len(first['inputs'])} files, first difference: "
                f"{next((a, b) for a, b in zip([*summary['inputs'], None], [*first['inputs'], None]) if a != b)}); "
                f"every partition must read the same --input list. Rerun it."
            )
        if summary["parts"] != first["parts"]:
            raise DataError(
                f"Partition '{d}' has {summary['parts']} parts, '{dirs[0]}' {first['parts']}: they were not "
                "prepared from the same inputs; rerun it."
            )
    opts = options_from(first["prepare"]["options"])
    # the dataset written: the partitions' options with the merge's own packing and shard count
    opts = dataclasses.replace(
        opts,
        pack=pack or opts.pack,
        seq_length=opts.seq_length if seq_length is None else seq_length,
        num_shards=opts.num_shards if num_shards is None else num_shards,
    )
    index = None
    if opts.dedup != "none":
        index = DedupIndex(dataclasses.replace(opts.minhash, near=opts.dedup == "near"))
    counters: dict = {}

    parts = first["parts"]
    ordered = all(
        Path(f"{part_prefix(d, k)}.ids.npy").is_file() or not Path(f"{part_prefix(d, k)}.bin").is_file()
        for d in dirs
        for k in range(parts)
    )

    def documents():
        if not ordered:  # partitions of an older llmtrain: no ids, partition order
            for d, summary in zip(dirs, done):
                yield from iter_part_batches(d, summary["parts"], index, counters)
            return
        for k in range(parts):  # input file k: its N parts interleaved by id
            yield from _file_batches([part_prefix(d, k) for d in dirs], index, counters)

    report = _merged_report([s["report"] for s in done], counters)
    tok = first["tokenizer"]
    manifest = write_dataset(
        output,
        documents(),
        optimal_dtype(tok["vocab_size"]),
        opts.pack,
        opts.seq_length,
        opts.num_shards,
        tok,
        dirs[0] / first["tokenizer_copy"],
        {
            "inputs": first["inputs"],
            "prepare": {**first["prepare"], "options": opts.identity()},
            "report": report,
        },
    )
    manifest["report"]["cross_partition"] = counters
    if not keep_partitions:  # only the folders prepare created (with its marker); the root when then empty
        for d in dirs:
            remove(d)  # the root goes once the lock is released (merge)
    if log:
        log(
            f"merge: {len(dirs)} partitions -> {manifest['documents']:,} documents, {manifest['tokens']:,} tokens, "
            f"{sum(counters.values()):,} cross-partition duplicates removed -> {output}"
        )
    return manifest


def _file_batches(prefixes: list[Path], index: DedupIndex | None, counters: dict):
    """The documents of one input file's parts ``prefixes`` (one per partition) in input order, dropping those
    that repeat a document kept before them (``index``: the merge's, fed in input order)."""
    prefixes = [p for p in prefixes if Path(f"{p}.bin").is_file()]  # a part may be empty (--max-documents)
    if not prefixes:
        return
    ids = [np.load(f"{p}.ids.npy") for p in prefixes]
    keep = None
    if index is not None:
        order = np.argsort(np.concatenate(ids), kind="stable")  # [D] merged position -> concatenated row
        rows: dict[str, list[np.ndarray]] = {"digests": [], "bands": [], "sigs": []}
        for p in prefixes:
            with np.load(f"{p}.dedup.npz") as z:
                for key in rows:
                    if key in z:
                        rows[key].append(z[key])
        digests, bands, sigs = (np.concatenate(rows[key])[order] if rows[key] else None for key in rows)
        keep = cross_part_keep(index, counters, digests, bands, sigs)
    yield from iter_merged(prefixes, ids, keep)


def _merged_report(reports: list[dict], cross: dict) -> dict:
    """Sum the partitions' stage counts; the cross-partition duplicates are a removal of the dedup stage."""
    stages: dict = {}
    for r in reports:
        for name, row in r["stages"].items():
            acc = stages.setdefault(name, {"in": 0, "out": 0, "removed": {}})
            acc["in"] += row["in"]
            acc["out"] += row["out"]
            for k, v in row["removed"].items():
                acc["removed"][k] = acc["removed"].get(k, 0) + v
    report: dict = {"stages": stages, "partitions": len(reports), "cross_partition": cross}
    report["errors_skipped"] = {}
    for r in reports:
        for k, v in r.get("errors_skipped", {}).items():
            report["errors_skipped"][k] = report["errors_skipped"].get(k, 0) + v
    return report

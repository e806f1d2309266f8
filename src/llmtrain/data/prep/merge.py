"""``llmtrain merge``: join the partitions written by ``prepare --partition I/N`` into one dataset.

    llmtrain merge --output PREFIX [--num-shards N] [--pack concat|bestfit] [--seq-length T] [--keep-partitions]

Two-phase deduplication across partitions:

1. each ``prepare --partition I/N`` run (one node of a Slurm array, say) cleans, filters, deduplicates *within*
   its partition and records, for every kept document, its exact digest, LSH band keys and MinHash signature
   (``part-*.dedup.npz`` in ``PREFIX.partitions/I-of-N/``);
2. ``merge`` replays those signatures through one :class:`~llmtrain.data.prep.dedup.DedupIndex`, partition 0
   first, and drops every document that duplicates (exactly, or near: a shared band and estimated Jaccard >= the
   threshold) a document kept earlier in the order. Only signatures are compared; no text is re-read.

The result satisfies the same guarantee as a single-process run (no two kept documents are duplicates by the
index's rule); which copy of a duplicate pair survives follows the partition order instead of the input order.
Packing and sharding happen here, once, over the merged stream. All partitions must be finished (``done.json``)
and share one tokenizer and one prepare configuration.

This module is the merge (:func:`merge`); the command's flags are in :mod:`llmtrain.commands.merge`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from llmtrain.data.indexed import optimal_dtype
from llmtrain.data.prep.dedup import DedupIndex
from llmtrain.data.prep.outputs import check_outputs
from llmtrain.data.prep.pipeline import options_from
from llmtrain.data.prep.shards import iter_part_batches, write_dataset
from llmtrain.data.prep.workdir import remove
from llmtrain.errors import DataError


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
    needed = ("tokenizer", "prepare", "parts", "report")
    if not isinstance(summary, dict) or any(k not in summary for k in needed):
        raise DataError(
            f"{path} is damaged (not the JSON summary `prepare --partition` writes, with {', '.join(needed)}); "
            f"rerun that partition with the same arguments, then merge."
        )
    return summary


def merge(
    output: str,
    num_shards: int | None = None,
    pack: str | None = None,
    seq_length: int | None = None,
    keep_partitions: bool = False,
    log=print,
) -> dict:
    """Join the finished partitions of ``output``; returns the manifest written."""
    dirs = find_partitions(output)
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
    opts = options_from(_options(first["prepare"]["options"]))
    index = None
    if opts.dedup != "none":
        index = DedupIndex(dataclasses.replace(opts.minhash, near=opts.dedup == "near"))
    counters: dict = {}

    def documents():
        for d, summary in zip(dirs, done):
            yield from iter_part_batches(d, summary["parts"], index, counters)

    report = _merged_report([s["report"] for s in done], counters)
    tok = first["tokenizer"]
    manifest = write_dataset(
        output,
        documents(),
        optimal_dtype(tok["vocab_size"]),
        pack or opts.pack,
        seq_length or opts.seq_length,
        num_shards or opts.num_shards,
        tok,
        dirs[0] / first["tokenizer_copy"],
        {
            "inputs": sorted({i for s in done for i in s["inputs"]}),
            "prepare": first["prepare"],
            "report": report,
        },
    )
    manifest["report"]["cross_partition"] = counters
    if not keep_partitions:  # only the folders prepare created (with its marker); the root when then empty
        for d in dirs:
            remove(d)
        try:
            Path(f"{output}.partitions").rmdir()
        except OSError:
            pass
    if log:
        log(
            f"merge: {len(dirs)} partitions -> {manifest['documents']:,} documents, {manifest['tokens']:,} tokens, "
            f"{sum(counters.values()):,} cross-partition duplicates removed -> {output}"
        )
    return manifest


def _options(identity: dict) -> dict:
    return {k: v for k, v in identity.items()}


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

"""On-disk outputs of ``prepare``: resumable intermediate parts, and the final shards + manifest + report.

Parts. ``prepare`` works through its input files one at a time; each file becomes a *part* in a work folder
(``.PREFIX.work/`` next to the output, or ``PREFIX.partitions/I-of-N/`` for ``--partition``)::

    part-00003.bin / .idx     the kept documents of input file 3, tokenized, one sequence each, EOS appended
    part-00003.dedup.npz      their exact digests, LSH band keys and 16-bit MinHash signatures
    part-00003.ids.npy        their global ids, file << 40 | line (partitions: merge's input order)
    part-00003.rejects.jsonl  rejected documents and reasons (when rejects are requested)
    part-00003.json           counters of the part; written last, its presence marks the part finished

A part is written under temporary names and renamed when complete, so a killed run leaves only finished parts
and a rerun with the same arguments (``state.json`` holds their digest) skips them. Parts always hold unpacked
documents: packing and sharding happen once, at the end (or in ``merge``), over the whole ordered stream.

Final dataset. :func:`write_dataset` packs the document stream (``pack``), deals the packed groups
round-robin to ``num_shards`` Megatron writers (``PREFIX.bin/.idx`` for one shard, ``PREFIX_00000.bin/.idx``...
for several), then writes ``PREFIX.manifest.json`` (per-shard sizes and sha256, tokenizer identity, packing,
the full prepare config, the report) and ``PREFIX.report.txt``, all under temporary names, renamed into place
with the manifest last.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from llmtrain import __version__
from llmtrain.data.indexed import IndexedDataset, IndexedDatasetWriter, bin_path, check_index, idx_path
from llmtrain.data.manifest import FORMAT, VERSION, manifest_path, read_manifest, sealed, write_json_atomic
from llmtrain.data.prep.dedup import DedupIndex
from llmtrain.data.prep.pack import ConcatPacker, make_packer
from llmtrain.data.tokenizer import sha256_file
from llmtrain.errors import DataError


def part_prefix(workdir: Path, k: int) -> Path:
    return workdir / f"part-{k:05d}"


def part_done(workdir: Path, k: int) -> dict | None:
    """Counters of finished part ``k``, or None (also when its counters file is damaged: the part is redone,
    its other files being replaced by the new ones)."""
    from llmtrain.data.prep.job import PartCounters

    p = Path(f"{part_prefix(workdir, k)}.json")
    try:
        obj = json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None
        if obj is not None:
            PartCounters.from_json(obj)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return obj


class PartWriter:
    """Writes one part atomically: documents stream to temporary files, :meth:`commit` renames them."""

    def __init__(self, workdir: Path, k: int, dtype: np.dtype, with_rejects: bool):
        self.final = part_prefix(workdir, k)
        self.tmp = workdir / f".tmp-{k:05d}-{os.getpid()}"
        self.writer = IndexedDatasetWriter(str(self.tmp), dtype)
        self.digests: list[np.ndarray] = []  # blocks of [K] uint64
        self.bands: list[np.ndarray] = []  # blocks of [K, B] uint64
        self.sigs: list[np.ndarray] = []  # blocks of [K, P] uint16
        self.rejects = open(f"{self.tmp}.rejects.jsonl", "w", encoding="utf-8") if with_rejects else None

    def add_many(self, tokens: np.ndarray, lengths: np.ndarray, digests, bands, sigs) -> None:
        """Documents back to back (``tokens`` in the part dtype, EOS included) and their dedup rows [K, ...]."""
        self.writer.add_documents(tokens, lengths)
        if digests is not None:
            self.digests.append(np.asarray(digests, dtype=np.uint64))
        if bands is not None:
            self.bands.append(bands)
            self.sigs.append(sigs)

    def reject(self, text: str, reason: str, path: Path, line: int) -> None:
        if self.rejects is not None:
            row = {"reason": reason, "file": str(path), "line": line, "text": text}
            self.rejects.write(json.dumps(row, ensure_ascii=False) + "\n")

    def commit(self, counters: dict) -> None:
        self.writer.finalize()
        if self.rejects is not None:
            self.rejects.close()
        digests = np.concatenate(self.digests) if self.digests else np.zeros(0, np.uint64)
        with open(f"{self.tmp}.dedup.npz", "wb") as f:
            if self.bands:
                np.savez(f, digests=digests, bands=np.concatenate(self.bands), sigs=np.concatenate(self.sigs))
            else:
                np.savez(f, digests=digests)
        for suffix in (".bin", ".idx", ".dedup.npz") + ((".rejects.jsonl",) if self.rejects else ()):
            os.replace(f"{self.tmp}{suffix}", f"{self.final}{suffix}")
        write_json_atomic(Path(f"{self.final}.json"), counters)

    def abort(self) -> None:
        self.writer.close()
        if self.rejects is not None:
            self.rejects.close()
        for p in self.tmp.parent.glob(f"{self.tmp.name}*"):
            p.unlink(missing_ok=True)


def load_part_index(workdir: Path, k: int, index: DedupIndex) -> None:
    """Add the kept documents of finished part ``k`` to ``index`` (a resumed run rebuilds its state)."""
    if not Path(f"{part_prefix(workdir, k)}.dedup.npz").is_file():
        return
    with np.load(f"{part_prefix(workdir, k)}.dedup.npz") as z:
        digests = z["digests"]
        bands, sigs = (z["bands"], z["sigs"]) if "bands" in z else (None, None)
    for i in range(max(len(digests), 0 if bands is None else len(bands))):
        index.add(
            int(digests[i]) if len(digests) else None,
            None if bands is None else bands[i],
            None if sigs is None else sigs[i],
        )


def iter_part_batches(
    workdir: Path,
    parts: int,
    index: DedupIndex | None = None,
    counters: dict | None = None,
    batch_tokens: int = 1 << 20,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The documents of parts ``0..parts-1`` in order, as batches ``(tokens, lengths)``: about
    ``batch_tokens`` tokens back to back and the length of each document [D]. Read with plain file reads (not a
    memory map, whose touched pages would stay in the process's resident memory), so memory stays bounded by the
    batch whatever the part size. With ``index``, cross-part duplicates are dropped (merge)."""
    for k in range(parts):
        prefix = part_prefix(workdir, k)
        if not bin_path(prefix).is_file():
            continue  # an empty part (--max-documents reached before this file)
        try:
            check_index(prefix)
            ds = IndexedDataset(str(prefix))
        except DataError as e:
            raise DataError(
                f"The work file of input {k} is damaged ({e}); the work folder '{workdir}' is removed, so running "
                f"the same command again redoes the work."
            ) from None
        sizes = ds.sizes.astype(np.int64)  # [D] one sequence per document in a part
        keep = None if index is None else _part_keep(prefix, index, counters)
        ends = np.cumsum(sizes)  # [D]
        with open(bin_path(prefix), "rb") as f:
            i = 0
            while i < len(sizes):
                base = int(ends[i - 1]) if i else 0
                j = max(int(np.searchsorted(ends, base + batch_tokens, side="right")), i + 1)
                tokens = np.fromfile(f, dtype=ds.dtype, count=int(ends[j - 1]) - base)
                lengths = sizes[i:j]
                if keep is not None and not keep[i:j].all():
                    tokens = tokens[np.repeat(keep[i:j], lengths)]
                    lengths = lengths[keep[i:j]]
                yield tokens, lengths
                i = j


MERGE_DOCUMENTS = 4096  # documents per batch of a merged stream (:func:`iter_merged`)


def iter_merged(
    prefixes: list[Path], ids: list[np.ndarray], keep: np.ndarray | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The documents of the parts ``prefixes`` (part ``j`` holding one document per id of ``ids[j]``, in id
    order) merged into one id order, in batches ``(tokens, lengths)``; ``keep`` ([D] bool in that merged order)
    drops documents. Memory: the ids and sizes of these parts plus one batch. The staged dedup merges the
    slices of one file with it, ``merge`` the partitions of one input file."""
    source = np.concatenate([np.full(len(x), j, dtype=np.int64) for j, x in enumerate(ids)])
    source = source[np.argsort(np.concatenate(ids), kind="stable")]  # [D] the part of each document in order
    sizes = [IndexedDataset(str(p)).sizes.astype(np.int64) for p in prefixes]
    dtype = IndexedDataset(str(prefixes[0])).dtype
    files = [open(bin_path(p), "rb") for p in prefixes]
    taken = [0] * len(prefixes)
    try:
        for i in range(0, len(source), MERGE_DOCUMENTS):
            block = source[i : i + MERGE_DOCUMENTS]
            pieces: list[list[np.ndarray]] = []
            for j in range(len(prefixes)):  # each part's next documents, read in one go
                n = int((block == j).sum())
                lens = sizes[j][taken[j] : taken[j] + n]
                taken[j] += n
                tokens = np.fromfile(files[j], dtype=dtype, count=int(lens.sum()))
                pieces.append(np.split(tokens, np.cumsum(lens)[:-1]) if n else [])
            cursor = [0] * len(prefixes)
            docs = []
            kept = np.ones(len(block), dtype=bool) if keep is None else keep[i : i + MERGE_DOCUMENTS]
            for j, k in zip(block.tolist(), kept.tolist()):
                if k:
                    docs.append(pieces[j][cursor[j]])
                cursor[j] += 1
            if docs:
                yield np.concatenate(docs), np.asarray([len(d) for d in docs], dtype=np.int64)
    finally:
        for f in files:
            f.close()


def cross_part_keep(
    index: DedupIndex,
    counters: dict | None,
    digests: np.ndarray | None,
    bands: np.ndarray | None = None,
    sigs: np.ndarray | None = None,
) -> np.ndarray:
    """[D] bool: which of these documents (dedup rows in order) repeat no document kept before them in
    ``index`` (recording the kept ones), counting the others in ``counters`` as ``cross_partition_*``."""
    reasons = index.check_many(digests if digests is not None and len(digests) else None, bands, sigs)
    keep = np.asarray([r is None for r in reasons], dtype=bool)
    if counters is not None:
        for reason in filter(None, reasons):
            counters[f"cross_partition_{reason}"] = counters.get(f"cross_partition_{reason}", 0) + 1
    return keep


def _part_keep(prefix: Path, index: DedupIndex, counters: dict | None) -> np.ndarray:
    """[D] bool: the documents of a part that repeat no document of the parts before (recording the kept)."""
    with np.load(f"{prefix}.dedup.npz") as z:
        digests = z["digests"]
        bands, sigs = (z["bands"], z["sigs"]) if "bands" in z else (None, None)
    return cross_part_keep(index, counters, digests, bands, sigs)


def shard_prefixes(output: str, num_shards: int) -> list[str]:
    """``[PREFIX]`` for one shard, else ``[PREFIX_00000, PREFIX_00001, ...]``."""
    return [output] if num_shards == 1 else [f"{output}_{i:05d}" for i in range(num_shards)]


def _tmp(prefix: str) -> str:
    p = Path(prefix)
    return str(p.parent / f".{p.name}.tmp-{os.getpid()}")


def write_dataset(
    output: str,
    batches: Iterable[tuple[np.ndarray, np.ndarray]],
    dtype: np.dtype,
    pack: str,
    seq_length: int,
    num_shards: int,
    tokenizer_entry: dict,
    tokenizer_file: Path,
    extra: dict,
) -> dict:
    """Pack the documents of ``batches`` (``(tokens, lengths)`` as from :func:`iter_part_batches`), write the
    shards, manifest and report of ``output``; returns the manifest."""
    finals = shard_prefixes(output, num_shards)
    tmps = [_tmp(p) for p in finals]
    writers = [IndexedDatasetWriter(t, dtype) for t in tmps]
    tmp_manifest, tmp_report = manifest_path(_tmp(output)), Path(f"{_tmp(output)}.report.txt")
    tmp_tok = Path(f"{_tmp(output)}.tokenizer{Path(tokenizer_file).suffix}")
    try:
        shutil.copyfile(tokenizer_file, tmp_tok)
        packer = make_packer(pack, seq_length)
        n = 0
        for tokens, lengths in batches:
            if len(lengths) == 0:
                continue
            tokens = tokens.astype(dtype, copy=False)
            if pack == "concat":  # one sequence per document, dealt round-robin: whole batches at once
                assert isinstance(packer, ConcatPacker)
                packer.add_lengths(lengths)
                _deal(writers, n, tokens, lengths)
                n += len(lengths)
                continue
            for doc in np.split(tokens, np.cumsum(lengths[:-1])):
                for group in packer.add(doc):
                    _write_group(writers[n % num_shards], group, pack)
                    n += 1
        for group in packer.flush():
            _write_group(writers[n % num_shards], group, pack)
            n += 1
        for w in writers:
            w.finalize()
        shards = [_shard_entry(final, tmp, w) for final, tmp, w in zip(finals, tmps, writers)]
        report = {**extra.get("report", {}), "pack": packer.stats.as_dict(packer.capacity)}
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": tokenizer_entry,
            "dtype": np.dtype(dtype).name,
            "documents": sum(s["documents"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "files": shards[0]["files"] if num_shards == 1 else {},
            "shards": shards,
            "packing": {"mode": pack, "seq_length": seq_length, **extra.get("packing", {})},
            "inputs": extra.get("inputs", []),
            "prepare": extra.get("prepare", {}),
            "report": report,
            "created_by": f"llmtrain {__version__}",
        }
        tmp_report.write_text(format_report(output, manifest), encoding="utf-8")
        manifest = sealed(manifest)
        write_json_atomic(tmp_manifest, manifest)
        _publish(output, finals, tmps, tmp_tok, tokenizer_entry["file"], tmp_report, tmp_manifest)
        return manifest
    finally:
        for w in writers:
            w.close()
        for t in tmps:
            bin_path(t).unlink(missing_ok=True)
            idx_path(t).unlink(missing_ok=True)
        for p in (tmp_manifest, tmp_report, tmp_tok):
            p.unlink(missing_ok=True)


def _deal(writers: list[IndexedDatasetWriter], n: int, tokens: np.ndarray, lengths: np.ndarray) -> None:
    """Documents ``n, n + 1, ...`` (one sequence each) to shard ``document % len(writers)``."""
    if len(writers) == 1:
        writers[0].add_documents(tokens, lengths)
        return
    shard = ((n + np.arange(len(lengths))) % len(writers)).astype(np.int32)  # [D]
    token_shard = np.repeat(shard, lengths)  # [T]
    for s, w in enumerate(writers):
        w.add_documents(tokens[token_shard == s], lengths[shard == s])


def _write_group(writer: IndexedDatasetWriter, group: list[np.ndarray], pack: str) -> None:
    if pack == "concat" or len(group) == 1:
        writer.add_document(group[0] if len(group) == 1 else np.concatenate(group))
    else:
        writer.add_document(np.concatenate(group), [len(s) for s in group])


def _shard_entry(final: str, tmp: str, w: IndexedDatasetWriter) -> dict:
    def entry(path: Path, name: Path) -> dict:
        return {"name": name.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}

    return {
        "name": Path(final).name,
        "documents": w.num_documents,
        "sequences": w.num_sequences,
        "tokens": w.num_tokens,
        "files": {"bin": entry(bin_path(tmp), bin_path(final)), "idx": entry(idx_path(tmp), idx_path(final))},
    }


def _publish(
    output, finals, tmps, tmp_tok: Path, tok_name: str, tmp_report: Path, tmp_manifest: Path
) -> None:
    """Rename into place: the old manifest (and shards it lists) go first, the new manifest comes last."""
    out = Path(output)
    old = manifest_path(output)
    stale: list[Path] = []
    if old.is_file():
        try:
            for s in read_manifest(output).get("shards", []):
                stale += [out.parent / s["files"]["bin"]["name"], out.parent / s["files"]["idx"]["name"]]
        except Exception:  # an unreadable old manifest is simply replaced
            pass
    old.unlink(missing_ok=True)
    for p in stale:
        p.unlink(missing_ok=True)
    for suffix in (".tokenizer.json", ".tokenizer.model"):
        Path(f"{output}{suffix}").unlink(missing_ok=True)
    for final, tmp in zip(finals, tmps):
        os.replace(bin_path(tmp), bin_path(final))
        os.replace(idx_path(tmp), idx_path(final))
    os.replace(tmp_tok, out.parent / tok_name)
    os.replace(tmp_report, Path(f"{output}.report.txt"))
    os.replace(tmp_manifest, manifest_path(output))


def format_report(output: str, manifest: dict) -> str:
    """The human-readable report: documents in/out per stage, duplicates, tokens, truncation, padding, input
    errors skipped, and for the staged dedup (``report.staged``) its plan and per-stage figures."""
    r = manifest["report"]
    lines = [f"llmtrain prepare report: {output}", ""]
    stages = r.get("stages", {})
    for name, row in stages.items():
        detail = ", ".join(f"{k} {v:,}" for k, v in sorted(row.get("removed", {}).items()))
        lines.append(
            f"  {name:<10} in {row['in']:>12,}  out {row['out']:>12,}" + (f"  ({detail})" if detail else "")
        )
    p = r["pack"]
    lines += [
        "",
        f"  tokens {manifest['tokens']:,} in {len(manifest['shards'])} shard(s), dtype {manifest['dtype']}",
        f"  packing {manifest['packing']['mode']} (seq_length {manifest['packing']['seq_length']}): "
        f"{p['samples']:,} samples, truncated documents {p['truncated_documents']:,} "
        f"({100 * p['truncation_rate']:.2f}%), padding {p['padding_tokens']:,} tokens "
        f"({100 * p['padding_rate']:.2f}%)",
    ]
    if r.get("errors_skipped"):
        skipped = ", ".join(f"{k} {v:,}" for k, v in sorted(r["errors_skipped"].items()))
        lines.append(f"  input errors skipped (--on-error skip): {skipped}")
    if "staged" in r:
        lines += ["", *_staged_lines(r["staged"], manifest)]
    return "\n".join(lines) + "\n"


# stage -> (unit of "in", key, unit of "out", key) in the report's staged section
_STAGED_IO = {
    "screen": ("documents", "docs_in", "documents", "docs_out"),
    "pairs": ("key rows", "rows_in", "pairs", "pairs"),
    "components": ("pairs", "pairs_in", "components", "components"),
    "tokenize": ("documents", "docs_in", "documents", "docs_out"),
}


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _staged_lines(staged: dict, manifest: dict) -> list[str]:
    """The staged dedup's section of the report: the plan, then one row per stage (tasks, in, out, bytes
    written, driver wall / summed task / CPU seconds, the largest peak RSS of a task), the write stage from the
    manifest, and the figures that fit no column (candidates, nodes, dropped by kind, tokens, resumed tasks)."""
    head = (
        f"  staged dedup: {_plural(staged['partitions'], 'partition')} x {_plural(staged['buckets'], 'bucket')}, "
        f"engine {staged['engine']}, {_plural(staged['workers'], 'worker')}"
    )
    if "engine_seconds" in staged:
        head += f" (engine start {staged['engine_seconds']:.1f} s)"
    lines = [
        head,
        f"    {'stage':<14}{'tasks':>6}  {'in':<20} {'out':<20} {'bytes written':>14} {'wall s':>8} "
        f"{'task s':>8} {'CPU s':>8}  peak RSS/task",
    ]
    notes, resumed = [], []
    number = {"screen": 1, "pairs": 2, "components": 3, "tokenize": 4}
    for name, row in staged["stages"].items():
        unit_in, key_in, unit_out, key_out = _STAGED_IO[name]
        wall = f"{row['wall_seconds']:.2f}" if "wall_seconds" in row else "-"
        lines.append(
            f"    {number[name]} {name:<12}{row['tasks']:>6,}  {f'{row.get(key_in, 0):,} {unit_in}':<20} "
            f"{f'{row.get(key_out, 0):,} {unit_out}':<20} {row['bytes']:>14,} {wall:>8} "
            f"{row['seconds']:>8.2f} {row['cpu_seconds']:>8.2f}  {row['peak_rss_mb_max']:,.1f} MB"
        )
        if row.get("resumed"):
            resumed.append(f"{name} {row['resumed']:,}")
        if name == "pairs" and "candidates" in row:
            notes.append(f"pairs: {row['candidates']:,} candidate checks")
        if name == "components":
            notes.append(
                f"components: {row.get('nodes', 0):,} documents in pairs, {row.get('dropped', 0):,} dropped "
                f"(exact {row.get('exact_duplicate', 0):,}, near {row.get('near_duplicate', 0):,})"
            )
        if name == "tokenize":
            notes.append(f"tokenize: {row.get('tokens', 0):,} tokens")
    shards = manifest["shards"]
    written = sum(f["bytes"] for sh in shards for f in sh["files"].values())
    docs = f"{manifest['documents']:,} documents"
    lines.append(
        f"    5 {'write':<12}{1:>6}  {docs:<20} "
        f"{_plural(len(shards), 'shard'):<20} {written:>14,} {'-':>8} {'-':>8} {'-':>8}  -"
    )
    if resumed:
        notes.append(f"tasks finished before this run: {', '.join(resumed)}")
    return lines + [f"    {n}" for n in notes]

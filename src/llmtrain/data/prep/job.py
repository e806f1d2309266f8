"""What one ``prepare`` run is, and what it counts.

:class:`PrepareJob` is the whole request, immutable and validated on construction: the inputs as given, the
output prefix, the tokenizer (a file, or a vocabulary size to train), the stage settings
(:class:`~llmtrain.data.prep.pipeline.PrepareOptions`: text key, cleaning, filters, dedup, packing, shards,
on-error mode, rejects file), the worker count, the document limit and the partition. Everything that changes
the output is in :meth:`PrepareJob.identity`, whose digest keys the resumable work folder and the manifest.

:class:`PartCounters` are the counts of one *part* (one input file): documents read, rejected per reason,
dropped as duplicates, kept, and their tokens; with the record position reached after the part, so a
resumed run continues the partition and ``--max-documents`` where the finished parts left off. They are saved
as the part's ``part-NNNNN.json`` (its presence marks the part finished; the field order is the file's key
order) and summed by :func:`stage_report` into the manifest's report: documents in and out of each stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from llmtrain.data.prep.pipeline import PrepareOptions
from llmtrain.errors import DataError


class Partition(NamedTuple):
    """``--partition I/N``: this run keeps every N-th non-blank input record, starting at record I."""

    # the names shadow tuple.index() / tuple.count(), which mypy refuses in a NamedTuple; they are the
    # CLI's I/N and are read by name (job.partition.index), so they stay
    index: int  # type: ignore[assignment]
    count: int  # type: ignore[assignment]


@dataclass(frozen=True)
class PrepareJob:
    """One ``llmtrain prepare`` run (see the module docstring); construction raises DataError when invalid."""

    inputs: tuple[str, ...]
    """Input files, globs and folders, as given (expanded when the job runs)."""
    output: str
    """Dataset prefix: PREFIX[_NNNNN].bin/.idx, PREFIX.manifest.json, PREFIX.report.txt."""
    options: PrepareOptions = field(default_factory=PrepareOptions)
    """The stages and their settings (the ``data.prepare`` section, after the flags)."""
    tokenizer: str | None = None
    """An existing tokenizer file (tokenizer.json or SentencePiece .model); or None with ``train_tokenizer``."""
    train_tokenizer: int | None = None
    """Vocabulary size of a byte-level BPE to train on the inputs; or None with ``tokenizer``."""
    eos_token: str | None = None
    """Token appended after each document (None: the tokenizer's EOS)."""
    workers: int = 1
    """Worker processes (1: everything in this process)."""
    max_documents: int | None = None
    """Stop after this many input documents (None: all)."""
    partition: Partition | None = None
    """Process only this partition, into PREFIX.partitions/I-of-N/ (joined later by ``merge``)."""
    overwrite: bool = False
    """Replace an existing dataset at ``output`` made with another tokenizer."""
    log: Callable[[str], None] | None = field(default=print, compare=False, repr=False)
    """Where progress lines go (None: silent)."""

    def __post_init__(self) -> None:
        if (self.tokenizer is None) == (self.train_tokenizer is None):
            raise DataError(
                "prepare needs exactly one of --tokenizer FILE (an existing tokenizer.json or .model) and "
                f"--train-tokenizer VOCAB_SIZE (train a byte-level BPE on the inputs); got "
                f"{'both' if self.tokenizer is not None else 'neither'}."
            )
        if self.workers < 1:
            raise DataError(f"--workers must be at least 1, got {self.workers}.")
        if self.max_documents is not None and self.max_documents < 1:
            raise DataError(f"--max-documents must be at least 1, got {self.max_documents}.")
        if self.partition is not None and self.train_tokenizer is not None:
            raise DataError(
                "--partition needs --tokenizer: partitions must share one tokenizer, not train their own."
            )

    @property
    def workdir(self) -> Path:
        """The work folder of the parts: ``.PREFIX.work/`` beside the output, or the partition's folder."""
        if self.partition is not None:
            return Path(f"{self.output}.partitions") / f"{self.partition.index}-of-{self.partition.count}"
        out = Path(self.output)
        return out.parent / f".{out.name}.work"

    def say(self, message: str) -> None:
        """Report a progress line through ``log``."""
        if self.log:
            self.log(message)

    def identity(self, files: list[Path], tokenizer_sha256: str | None) -> dict:
        """Everything that changes the output: the expanded ``files`` (path, size, modification time), the
        given tokenizer's sha256, and the settings."""
        return {
            "inputs": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
            "tokenizer": tokenizer_sha256,
            "train_tokenizer": self.train_tokenizer,
            "eos_token": self.eos_token,
            "max_documents": self.max_documents,
            "options": self.options.identity(),
            "partition": list(self.partition) if self.partition else None,
        }


DUPLICATE_REASONS = ("exact_duplicate", "near_duplicate")


@dataclass
class PartCounters:
    """The counts of one part (see the module docstring); the fields are ``part-NNNNN.json``, in order."""

    read: int = 0
    """Documents read from the file (non-blank records of this partition, within ``max_documents``)."""
    errors: dict[str, int] = field(default_factory=dict)
    """Malformed input records skipped (``on_error: skip``), by kind."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Documents removed by cleaning (``empty``) or a quality filter, by reason, in order of first sight."""
    exact_duplicate: int = 0
    """Documents dropped as exact duplicates of a kept one."""
    near_duplicate: int = 0
    """Documents dropped as near duplicates of a kept one."""
    kept: int = 0
    """Documents written to the part."""
    tokens: int = 0
    """Their tokens, EOS included."""
    ordinal: int = 0
    """Non-blank input records seen by the end of this part, over all files (the partition position)."""
    read_total: int = 0
    """Documents read by the end of this part, over all files (for ``max_documents``)."""

    def reject(self, reason: str) -> None:
        """Count a document removed for ``reason`` (a duplicate kind, or a cleaning/filter reason)."""
        if reason in DUPLICATE_REASONS:
            setattr(self, reason, getattr(self, reason) + 1)
        else:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def add(self, other: PartCounters) -> None:
        """Add the document counts of ``other`` (not its positions)."""
        self.read += other.read
        self.exact_duplicate += other.exact_duplicate
        self.near_duplicate += other.near_duplicate
        self.kept += other.kept
        self.tokens += other.tokens
        for mine, theirs in ((self.errors, other.errors), (self.rejected, other.rejected)):
            for reason, n in theirs.items():
                mine[reason] = mine.get(reason, 0) + n

    def to_json(self) -> dict:
        """The ``part-NNNNN.json`` object."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> PartCounters:
        """Counters read back from a finished part's ``part-NNNNN.json``; ValueError when ``obj`` is not what
        :meth:`to_json` writes (a damaged file: other keys, wrong types, negative counts)."""
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(obj, dict) or sorted(obj) != sorted(names):
            raise ValueError("not the counters of a part")

        def count(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        for name in names:
            v = obj[name]
            ok = (
                isinstance(v, dict) and all(isinstance(k, str) and count(n) for k, n in v.items())
                if name in ("errors", "rejected")
                else count(v)
            )
            if not ok:
                raise ValueError(f"part counter {name!r} is {v!r}")
        return cls(**obj)


def stage_report(parts: list[PartCounters], opts: PrepareOptions) -> dict:
    """Documents in/out per stage, summed over the parts."""
    total = PartCounters()
    for c in parts:
        total.add(c)
    rejected = dict(total.rejected)
    empty = rejected.pop("empty", 0)
    filtered = sum(rejected.values())
    read = total.read
    dups = {k: getattr(total, k) for k in DUPLICATE_REASONS if getattr(total, k)}
    return {
        "errors_skipped": total.errors,
        "stages": {
            "read": {"in": read + sum(total.errors.values()), "out": read, "removed": total.errors},
            "clean": {"in": read, "out": read - empty, "removed": {"empty": empty} if empty else {}},
            "filter": {"in": read - empty, "out": read - empty - filtered, "removed": rejected},
            "dedup": {"in": read - empty - filtered, "out": total.kept, "removed": dups},
            "tokenize": {"in": total.kept, "out": total.kept, "removed": {}},
        },
        "duplicates_removed": total.exact_duplicate + total.near_duplicate,
        "tokens": total.tokens,
        "enabled": {"clean": opts.clean, "filter": opts.filter, "dedup": opts.dedup, "pack": opts.pack},
    }

"""Verifying a dataset before training: its files are the bytes its manifest pins, its token ids fit the vocabulary.

Choice (issue 14): **a full pass once, then a stamp.** The first time a dataset is used (``llmtrain check``,
``train``, ``generate``...), every ``.bin`` and ``.idx`` of every shard is read once, sequentially: its sha256
is compared with the manifest's, and the same pass takes the smallest and largest token id of each ``.bin``.
When all is well, ``PREFIX.verified.json`` is written next to the dataset (atomically; it is llmtrain's own
file, and a file of that name that llmtrain did not write is never overwritten)::

    {"format": "llmtrain.verified", "version": 1,
     "files": {"NAME.bin": {"bytes", "mtime_ns", "sha256", "min_id", "max_id"}, "NAME.idx": {...}}, ...}

A later start trusts a file whose size, ``mtime_ns``, inode and ``ctime_ns`` equal the stamp's (and whose
manifest sha256 equals the stamp's): one ``stat`` per file, no read. The inode and the ctime bind the stamp to
the file itself: a copy put in its place (same size, ``touch -d`` back to the old mtime) has another inode, and
any write, rename or ``touch`` moves the ctime, which no user can set back. A stamp entry without them (an older
llmtrain) is verified again. Any other file is hashed again. Results are also memoised in the
process, so ``train`` (which validates, then builds the loader) hashes at most once even where the stamp cannot
be written (a read-only dataset folder: there the full pass runs on every start). Cost: one read of the data at
disk speed, sha256 about 1-2 GB/s per core, so ~1 s per GB once; datasets are never hashed on every start.

What is caught, before the first step: any change made through the filesystem to a ``.bin`` or ``.idx`` of a
manifest dataset, same size or not (a flipped byte anywhere), since writing a file moves its ``mtime_ns``; a
token id outside ``[0, vocab_size)`` of the tokenizer (``model.vocab_size`` when the manifest records none),
which would otherwise end in an IndexError deep in the embedding; an index that does not describe its ``.bin``
(negative lengths, pointers past the end or not back to back, document indices unsorted or out of range, a
float dtype, counts that disagree with the file sizes: ``indexed.check_index``, run in the same first pass and
recorded in the stamp's ``.idx`` entry as ``sequences``), which matters most for a Megatron dataset, whose
files no manifest pins. What is not caught: corruption below the
filesystem after the stamp (bit rot, a bad disk), and changes on a filesystem that does not keep inodes and
ctimes (some network filesystems report fixed ones); a change while a run is going (the files are memory-mapped at the start). A
Megatron dataset has no manifest, so no reference checksum: its pass cannot tell a damaged file from a
regenerated one. Its sha256 is still recorded (stamped) and enters the run's data fingerprint, so resuming a
run on changed Megatron data is refused like resuming on a changed manifest dataset; its ids are bound-checked.

A manifest without its seal (``manifest_sha256``: older, hand-written, or edited with the seal removed) vouches
for nothing, so it is verified like a foreign dataset: its vocabulary and EOS are compared with the tokenizer file
(its copy, else ``data.tokenizer``), and a claim the tokenizer does not back is refused; every manifest's claims
must be sane on their own (``manifest.tokenizer_claims_problem``: the EOS id inside the vocabulary).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmtrain.data.describe import DatasetInfo, tokenizer_facts
from llmtrain.data.indexed import bin_path, check_index, idx_path, read_header
from llmtrain.data.manifest import is_sealed, write_json_atomic
from llmtrain.data.tokenizer import sha256_file
from llmtrain.errors import DataError

STAMP_FORMAT = "llmtrain.verified"
STAMP_VERSION = 1
CHUNK_BYTES = 1 << 23  # 8 MiB per read: a multiple of every token size


@dataclass(frozen=True)
class FileCheck:
    """One verified file: its size, mtime, inode and ctime and sha256 when verified, and for a ``.bin`` its id
    range."""

    bytes: int
    mtime_ns: int
    sha256: str
    min_id: int | None = None
    max_id: int | None = None
    sequences: int | None = None
    """For a ``.idx``: its sequence count, recorded once :func:`llmtrain.data.indexed.check_index` passed (a
    stamp entry without it, from an older llmtrain, is verified again)."""
    inode: int | None = None
    """``st_ino`` when verified: a file put in its place (a copy, a rename) has another one."""
    ctime_ns: int | None = None
    """``st_ctime_ns`` when verified: every write, rename, chmod or ``touch`` moves it, and it cannot be set back."""


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What binds a stamp entry to a file: size, mtime, inode, ctime."""
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


_MEMO: dict[tuple, FileCheck] = {}  # (resolved path, size, mtime_ns, inode, ctime_ns, dtype) -> check
_INDEX_MEMO: set[tuple] = set()  # (.idx, .bin) (resolved path, size, mtime_ns) pairs whose structure passed


def stamp_path(prefix: str) -> Path:
    """``PREFIX.verified.json``."""
    return Path(f"{prefix}.verified.json")


def verify_dataset(info: DatasetInfo, where: str, vocab_size: int | None = None) -> dict[str, str]:
    """Verify every file of dataset ``info`` (``where``: its config key); ``{file name: sha256}``.

    DataError naming the file when a sha256 differs from the manifest's, naming the dataset, the id and the
    vocabulary when a token id is out of range. ``vocab_size`` bounds the ids when the description has none."""
    folder = Path(info.prefix).parent
    stamp, writable = _read_stamp(info.prefix)
    checks: dict[str, FileCheck] = {}
    for shard, entry in info.shards:
        files = (entry or {}).get("files") or {}
        for kind, path in (("bin", bin_path(shard)), ("idx", idx_path(shard))):
            expected = (files.get(kind) or {}).get("sha256")
            name = os.path.relpath(path, folder)
            checks[name] = _check_file(path, kind == "bin", info, expected, stamp.get(name), where)
        _check_structure(shard, folder, checks, stamp, info.prefix, where)
    limit = info.vocab_size if info.vocab_size is not None else vocab_size
    for name, c in checks.items():
        if limit is None or c.max_id is None or c.min_id is None:
            continue
        if c.max_id >= limit or c.min_id < 0:
            bad = c.max_id if c.max_id >= limit else c.min_id
            raise DataError(
                f"{where} = '{info.prefix}': token id {bad} in '{folder / name}' is outside the vocabulary of "
                f"{limit} tokens (valid ids 0..{limit - 1}; the file's ids span {c.min_id}..{c.max_id}). The "
                f"dataset was made with another tokenizer than "
                f"{'data.tokenizer' if info.manifest is None else 'its manifest records'}: set data.tokenizer to "
                f"the tokenizer it was made with, or prepare it again."
            )
    _check_tokenizer_copy(info, where)
    _check_unsealed(info, where)
    fresh = {n: c for n, c in checks.items() if stamp.get(n) != _record(c)}
    if fresh and writable:
        _write_stamp(info.prefix, checks)
    return {n: c.sha256 for n, c in checks.items()}


def _check_structure(
    shard: str, folder: Path, checks: dict[str, FileCheck], stamp: dict[str, dict], prefix: str, where: str
) -> None:
    """The index of ``shard`` is consistent with itself and its ``.bin`` (``check_index``): checked once, when
    either file is not the one the stamp vouches for, then recorded in the ``.idx`` entry (``sequences``)."""
    names = [os.path.relpath(p, folder) for p in (bin_path(shard), idx_path(shard))]
    if all(stamp.get(n) == _record(checks[n]) for n in names):
        return  # both files as stamped, and the stamp was written after this check passed
    key = tuple((str(p.resolve()), *_identity(st)) for p in (bin_path(shard), idx_path(shard))
                for st in [p.stat()])  # fmt: skip
    if key not in _INDEX_MEMO:
        try:
            check_index(shard)
        except DataError as e:
            raise DataError(f"{where} = '{prefix}': {e}") from None
        _INDEX_MEMO.add(key)
    checks[names[1]] = dataclasses.replace(checks[names[1]], sequences=read_header(shard)[1])


def _check_tokenizer_copy(info: DatasetInfo, where: str) -> None:
    """The manifest's tokenizer copy (what ``generate`` and ``export`` decode with) still has its sha256: a small
    file, hashed on every use."""
    if info.manifest is None or not info.tokenizer_file or not info.tokenizer_sha256:
        return
    path = Path(info.tokenizer_file)
    if path.is_file() and sha256_file(path) != info.tokenizer_sha256:
        raise DataError(
            f"{where} = '{info.prefix}': the tokenizer copy '{path}' does not match the sha256 its manifest "
            "records (damaged or replaced); restore it from the tokenizer the dataset was made with, or prepare "
            "the dataset again."
        )


def _check_unsealed(info: DatasetInfo, where: str) -> None:
    """A manifest without its seal is verified like a foreign dataset: its vocabulary and EOS must be the
    tokenizer file's (the copy next to it, else ``data.tokenizer``) where one is on this machine."""
    if info.manifest is None or is_sealed(info.manifest):
        return
    if not info.tokenizer_file or not Path(info.tokenizer_file).is_file():
        return  # nothing to compare with: the claims were checked on their own (manifest.read_manifest)
    facts = tokenizer_facts(info.tokenizer_file)
    for key, claimed, actual in (("vocab_size", info.vocab_size, facts.vocab_size),
                                 ("eos_id", info.eos_id, facts.eos_id)):  # fmt: skip
        if claimed is not None and claimed != actual:
            raise DataError(
                f"{where} = '{info.prefix}': its manifest has no seal (manifest_sha256), so it is verified like a "
                f"foreign dataset, and its tokenizer.{key} {claimed} is not the tokenizer's ({actual}, "
                f"{info.tokenizer_file}). Restore the manifest from a copy, or prepare the dataset again."
            )


def _check_file(
    path: Path, is_bin: bool, info: DatasetInfo, expected: str | None, stamped: dict | None, where: str
) -> FileCheck:
    """The check of one file: from the stamp when its size and mtime still match, else from one full read."""
    try:
        st = path.stat()
    except OSError as e:
        raise DataError(f"{where} = '{info.prefix}': cannot read '{path}' ({e}).") from None
    if stamped is not None:
        try:
            cached = FileCheck(**stamped)
        except TypeError:  # a stamp entry of another shape: verify again
            cached = None
        if (
            cached is not None
            and (cached.bytes, cached.mtime_ns, cached.inode, cached.ctime_ns) == _identity(st)
            and (expected is None or cached.sha256 == expected)
            and (not is_bin or cached.max_id is not None or st.st_size == 0)
            and (is_bin or cached.sequences is not None)
        ):
            return cached
    key = (str(path.resolve()), *_identity(st), info.dtype.name if is_bin else "")
    check = _MEMO.get(key) or _full_pass(path, info.dtype if is_bin else None, st, where, info.prefix)
    if expected is not None and check.sha256 != expected:
        raise DataError(
            f"{where} = '{info.prefix}': the file '{path}' does not match its manifest: its sha256 is "
            f"{check.sha256[:16]}..., {info.prefix}.manifest.json says {expected[:16]}... ({st.st_size} bytes). "
            f"The file was changed or damaged after `llmtrain prepare` wrote it; restore it or run prepare again."
        )
    _MEMO[key] = check
    return check


def _full_pass(path: Path, dtype: np.dtype | None, st: os.stat_result, where: str, prefix: str) -> FileCheck:
    """sha256 of ``path`` and, for a ``.bin`` (``dtype`` given), its smallest and largest token id: one read."""
    if dtype is not None and st.st_size % dtype.itemsize:
        raise DataError(
            f"{where} = '{prefix}': '{path}' has {st.st_size} bytes, not a whole number of {dtype.name} tokens "
            f"(the dtype of its index): it is truncated or not this dataset's token file."
        )
    h = hashlib.sha256()
    lo: int | None = None
    hi: int | None = None
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            if dtype is not None and n:
                ids = np.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize)
                a, b = int(ids.min()), int(ids.max())
                lo, hi = (a, b) if lo is None or hi is None else (min(lo, a), max(hi, b))
    return FileCheck(
        st.st_size, st.st_mtime_ns, h.hexdigest(), lo, hi, inode=st.st_ino, ctime_ns=st.st_ctime_ns
    )


def _record(c: FileCheck) -> dict:
    return dataclasses.asdict(c)


def _read_stamp(prefix: str) -> tuple[dict[str, dict], bool]:
    """(the stamp's file records, whether llmtrain may write the stamp); a foreign file of that name is left
    alone and not trusted."""
    path = stamp_path(prefix)
    if not path.exists():
        return {}, True
    try:
        stamp = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {}, False
    if not isinstance(stamp, dict) or stamp.get("format") != STAMP_FORMAT:
        return {}, False
    files = stamp.get("files") if stamp.get("version") == STAMP_VERSION else None
    return ({k: v for k, v in files.items() if isinstance(v, dict)} if isinstance(files, dict) else {}), True


def _write_stamp(prefix: str, checks: dict[str, FileCheck]) -> None:
    """Write ``PREFIX.verified.json`` through a temporary file; a folder that refuses writes is no error."""
    from llmtrain import __version__

    stamp = {
        "format": STAMP_FORMAT,
        "version": STAMP_VERSION,
        "about": "written by llmtrain after it read these files in full (llmtrain.data.verify); delete it to "
        "verify again",
        "files": {name: _record(c) for name, c in sorted(checks.items())},
        "created_by": f"llmtrain {__version__}",
    }
    try:
        write_json_atomic(stamp_path(prefix), stamp)
    except OSError:
        pass  # read-only dataset folder: verified again on the next start (memoised within this process)

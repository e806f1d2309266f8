"""Raw-text readers: turn ``prepare``'s ``--input`` paths into a stream of ``(text, file, line)`` records.

Inputs are expanded once, up front (:func:`expand_inputs`), into an ordered list of files, so the document
order (and therefore every shard) is a pure function of the command line:

* a directory is searched recursively for ``*.jsonl``, ``*.txt``, ``*.parquet`` and their ``.gz`` / ``.zst``
  forms, in sorted path order; a glob (``data/*.jsonl.gz``) expands to its sorted matches;
* ``*.jsonl[.gz|.zst]``: one JSON object per line, the document is its ``text_key`` field; blank lines skipped;
* ``*.parquet``: the ``text_key`` column, read one row group at a time (needs ``pyarrow``, imported lazily;
  ``pip install llmtrain[data]``); a parquet file is compressed inside, so ``.parquet.gz/.zst`` is an error;
* ``*.txt[.gz|.zst]`` and any other file named explicitly (``*.py``, ``*.md``...): the whole file is one document.

Everything streams: a jsonl file is read line by line through the decompressor, a parquet file row group by
row group, so memory stays bounded whatever the input size (a ``.txt`` document is one string by definition).

``.zst`` needs ``zstandard`` (imported lazily, ``pip install llmtrain[data]``).

Every malformed input is a :class:`DataError` naming the file and line (parquet: row): invalid UTF-8, a line that
is not a JSON object, a missing or non-string text field (parquet: a missing column, a null), a truncated or
corrupt ``.gz`` / ``.zst`` / ``.parquet``. With ``on_error="skip"`` the bad line (or the rest of a truncated
file) is skipped instead and counted in the ``errors`` dict passed in (reason -> count), which ``prepare`` puts
in its report.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.errors import DataError

if TYPE_CHECKING:
    from zstandard import ZstdDecompressionObj

DIRECTORY_PATTERNS = tuple(
    f"*.{kind}{comp}" for kind in ("jsonl", "txt", "parquet") for comp in ("", ".gz", ".zst")
)
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)
# zstd input is read ZSTD_READ bytes at a time and decompressed ZSTD_FEED bytes per step, so one step's output
# is a few KB for text and at most ~32 MiB even for a pathological file (zstd expands at most ~32,000x: a 128 KiB
# block costs >= 4 bytes). Measured: ~480 MB/s of output on text (zstandard's stream_reader: ~600 MB/s).
ZSTD_READ = 64 << 10
ZSTD_FEED = 1 << 10
PARQUET_BATCH = 1024  # rows turned into Python strings at a time (the row group itself is in Arrow memory)
Record = tuple[str, Path, int]  # (document text, file, 1-based line; 0 for whole-file documents)


def expand_inputs(inputs: list[str]) -> list[Path]:
    """The input files in reading order; DataError for a path or glob that matches nothing."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = {f for pattern in DIRECTORY_PATTERNS for f in p.rglob(pattern) if f.is_file()}
            files.extend(sorted(found, key=lambda f: f.relative_to(p).as_posix()))
        elif p.is_file():
            files.append(p)
        elif glob.has_magic(item) and (matches := sorted(glob.glob(item, recursive=True))):
            files.extend(Path(m) for m in matches if Path(m).is_file())
        else:
            raise DataError(
                f"Input '{item}' does not exist. --input takes .jsonl/.txt/.parquet files (optionally .gz or "
                f".zst), other text files (one document each), globs or directories containing such files."
            )
    return files


def file_kind(path: Path) -> str:
    """``jsonl``, ``parquet`` or ``text`` (whole file is one document), from the name without ``.gz``/``.zst``."""
    name = path.name
    for comp in (".gz", ".zst"):
        name = name.removesuffix(comp)
    if name.endswith(".jsonl"):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def _open_binary(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.name.endswith(".zst"):
        return io.BufferedReader(_ZstdReader(path, _import_zstandard(path)), buffer_size=ZSTD_READ)
    return open(path, "rb")


def _import_zstandard(path: Path):
    try:
        import zstandard
    except ImportError:
        raise DataError(
            f"Input '{path}' is zstd-compressed but the 'zstandard' package is not installed; "
            f"`pip install llmtrain[data]` (or `pip install zstandard`) or decompress it (zstd -d '{path}')."
        ) from None
    return zstandard


class _ZstdReader(io.RawIOBase):
    """A ``.zst`` file (one or more frames) as a stream of decompressed bytes.

    zstandard's own ``stream_reader`` returns the readable part of a truncated file and then a clean EOF, so the
    rest of the file would vanish without an error. ``decompressobj`` reports ``eof`` at the end of each frame:
    if the input ends inside a frame this raises EOFError, the same error a truncated ``.gz`` gives. Input is
    fed ``ZSTD_FEED`` bytes at a time, so memory holds at most the output of that many compressed bytes.
    """

    def __init__(self, path: Path, zstandard):
        self._file = open(path, "rb")  # closed in close()
        self._dctx = zstandard.ZstdDecompressor()
        # decompressor of the current frame; None between frames
        self._frame: ZstdDecompressionObj | None = None
        self._in = memoryview(b"")  # compressed bytes read but not yet fed
        self._out = memoryview(b"")  # decompressed bytes not yet returned

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            if not self._in:
                self._in = memoryview(self._file.read(ZSTD_READ))
                if not self._in:
                    if self._frame is not None:
                        raise EOFError("compressed file ended inside a zstd frame")
                    return 0
            data, self._in = self._in[:ZSTD_FEED], self._in[ZSTD_FEED:]
            self._out = memoryview(self._decompress(data))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress(self, data: memoryview | bytes) -> bytes:
        parts = []
        while data:
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            parts.append(self._frame.decompress(data))
            data = b""
            if self._frame.eof:  # frame complete; what follows it is the next frame
                data, self._frame = self._frame.unused_data, None
        return b"".join(parts)

    def close(self) -> None:
        self._file.close()
        super().close()


def _compression_errors() -> tuple[type[BaseException], ...]:
    try:
        import zstandard

        return (*_GZIP_ERRORS, zstandard.ZstdError)
    except ImportError:
        return _GZIP_ERRORS


def _compression_name(path: Path) -> str:
    return "zstd" if path.name.endswith(".zst") else "gzip"


def _skip_or_raise(errors: dict | None, reason: str, message: str) -> None:
    """Count ``reason`` when skipping (``errors`` is a dict), else raise ``message``."""
    if errors is None:
        raise DataError(message)
    errors[reason] = errors.get(reason, 0) + 1


def _parse_line(raw: bytes, path: Path, line_no: int, text_key: str) -> str:
    """The text of one jsonl line; DataError naming file, line and what is wrong."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"Input '{path}' line {line_no} is not valid UTF-8 (byte {e.start} of the line); "
            f"inputs must be UTF-8 encoded (or pass --on-error skip)."
        ) from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(
            f"Input '{path}' line {line_no} is not valid JSON ({e.msg} at column {e.colno}); each line of a "
            f'.jsonl file must be one JSON object like {{"{text_key}": "..."}} (or pass --on-error skip).'
        ) from None
    except (
        RecursionError,
        ValueError,
    ) as e:  # nesting deeper than the parser's stack; an int of > 4300 digits
        what = (
            "nests arrays/objects too deeply to parse"
            if isinstance(e, RecursionError)
            else f"is unreadable ({e})"
        )
        raise DataError(
            f"Input '{path}' line {line_no} is not valid JSON for prepare: it {what}; each line of a .jsonl file "
            f'must be one JSON object like {{"{text_key}": "..."}} (or pass --on-error skip).'
        ) from None
    if not isinstance(record, dict) or text_key not in record:
        keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"Input '{path}' line {line_no} has no '{text_key}' field (found: {keys}); pass --text-key with the "
            f"field that holds the document text (or --on-error skip)."
        )
    text = record[text_key]
    if not isinstance(text, str):
        raise DataError(
            f"Input '{path}' line {line_no}: field '{text_key}' is a {type(text).__name__}, not a string; every "
            f"document's text must be a JSON string."
        )
    if "\\u" in line:  # only a \uXXXX escape can smuggle a lone UTF-16 surrogate into valid UTF-8 JSON
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(
                f"Input '{path}' line {line_no}: field '{text_key}' holds a lone surrogate "
                f"(\\u{ord(text[e.start]):04x} at character {e.start}), an escape of half a UTF-16 pair that is "
                f"not Unicode text; fix the writer of the file (or pass --on-error skip)."
            ) from None
    return text


def _reason(message: str) -> str:
    for key, reason in (("surrogate", "invalid_unicode"), ("UTF-8", "invalid_utf8"), ("valid JSON", "invalid_json"),
                        ("field", "missing_key")):  # fmt: skip
        if key in message:
            return reason
    return "bad_record"


def read_jsonl(
    path: Path, text_key: str, errors: dict | None = None, keep: Callable[[], bool] | None = None
) -> Iterator[Record]:
    """Records of a JSON-lines file; ``keep()`` is asked per non-blank line (partitioning) before parsing."""
    line_no = 0
    try:
        with _open_binary(path) as f:
            for line_no, raw in enumerate(f, start=1):  # line_no is used after the loop
                if not raw.strip() or (keep is not None and not keep()):
                    continue
                try:
                    text = _parse_line(raw, path, line_no, text_key)
                except DataError as e:
                    _skip_or_raise(errors, _reason(str(e)), str(e))
                    continue
                if text:
                    yield text, path, line_no
    except _compression_errors() as e:
        _skip_or_raise(
            errors,
            "truncated_file",
            f"Input '{path}' is a truncated or corrupt {_compression_name(path)} file: decompression failed after "
            f"line {line_no} ({e}). Re-download or re-compress it, or pass --on-error skip to keep the lines "
            f"before the damage.",
        )


def read_text(
    path: Path, text_key: str, errors: dict | None = None, keep: Callable[[], bool] | None = None
) -> Iterator[Record]:
    """The whole file as one document (``text_key`` is unused)."""
    if keep is not None and not keep():
        return
    try:
        with _open_binary(path) as f:
            data = f.read()
    except _compression_errors() as e:
        _skip_or_raise(
            errors,
            "truncated_file",
            f"Input '{path}' is a truncated or corrupt {_compression_name(path)} file: decompression failed "
            f"after line 0 ({e}). Re-download or re-compress it, or pass --on-error skip.",
        )
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = data.count(b"\n", 0, e.start) + 1
        _skip_or_raise(
            errors,
            "invalid_utf8",
            f"Input '{path}' line {line_no} is not valid UTF-8 (byte offset {e.start} of the file); inputs must "
            f"be UTF-8 encoded (or pass --on-error skip).",
        )
        return
    if text:
        yield text, path, 0


def _import_parquet(path: Path):
    """``(pyarrow, pyarrow.parquet)``, imported only when a parquet file is read."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(
            f"Input '{path}' is a parquet file but 'pyarrow' is not installed; `pip install llmtrain[data]` (or "
            f"`pip install pyarrow`) or convert it to jsonl."
        ) from None
    return pyarrow, pyarrow.parquet


def read_parquet(
    path: Path, text_key: str, errors: dict | None = None, keep: Callable[[], bool] | None = None
) -> Iterator[Record]:
    """The ``text_key`` column of a parquet file, one row group at a time; ``line`` is the 1-based row.

    Per row, like a jsonl line: a null or non-string value is ``missing_key``, invalid UTF-8 ``invalid_utf8``;
    a missing column is ``missing_key`` for every row. A damaged file, or a damaged row group, is
    ``truncated_file`` and ends the file (skip mode keeps the row groups before the damage).
    """
    if path.name.endswith((".gz", ".zst")):
        raise DataError(
            f"Input '{path}': a parquet file is compressed inside (per page) and is read by random access, so it "
            f"cannot be wrapped in .gz/.zst; decompress it to a plain .parquet file."
        )
    pa, pq = _import_parquet(path)
    damaged = (pa.ArrowException, OSError)  # ArrowInvalid for a bad footer, OSError for a bad page header
    try:
        pf = pq.ParquetFile(path)
    except damaged as e:
        _skip_or_raise(
            errors,
            "truncated_file",
            f"Input '{path}' is not a readable parquet file ({e}). Re-download or re-write it, or pass "
            f"--on-error skip.",
        )
        return
    with pf:
        names = pf.schema_arrow.names
        if text_key not in names:
            message = (
                f"Input '{path}' has no column '{text_key}' (columns: {names[:20]}"
                f"{' ...' if len(names) > 20 else ''}); pass --text-key with the column that holds the document "
                f"text (or --on-error skip)."
            )
            if errors is None:
                raise DataError(message)
            for _ in range(pf.metadata.num_rows):  # every row lacks the text, as jsonl lines would
                if keep is None or keep():
                    errors["missing_key"] = errors.get("missing_key", 0) + 1
            return
        row = 0
        for group in range(pf.num_row_groups):
            try:
                column = pf.read_row_group(group, columns=[text_key]).column(0)
            except damaged as e:
                _skip_or_raise(
                    errors,
                    "truncated_file",
                    f"Input '{path}' is a corrupt parquet file: row group {group} (after row {row}) cannot be "
                    f"read ({e}). Re-download or re-write it, or pass --on-error skip to keep the rows before it.",
                )
                return
            for chunk in column.chunks:
                for start in range(0, len(chunk), PARQUET_BATCH):
                    for value in _string_values(pa, chunk.slice(start, PARQUET_BATCH)):
                        row += 1
                        if keep is not None and not keep():
                            continue
                        if isinstance(value, str):
                            if value:
                                yield value, path, row
                        elif isinstance(value, UnicodeDecodeError):
                            _skip_or_raise(
                                errors,
                                "invalid_utf8",
                                f"Input '{path}' row {row}: column '{text_key}' is not valid UTF-8 (byte "
                                f"{value.start} of the value); inputs must be UTF-8 encoded (or pass --on-error "
                                f"skip).",
                            )
                        else:
                            kind = "null" if value is None else f"of type {type(value).__name__}"
                            _skip_or_raise(
                                errors,
                                "missing_key",
                                f"Input '{path}' row {row}: column '{text_key}' is {kind}, not a string; every "
                                f"document's text must be a string (or pass --on-error skip).",
                            )


def _string_values(pa, batch) -> list:
    """Python values of an Arrow array; a string that is not valid UTF-8 becomes its UnicodeDecodeError.

    Arrow does not validate UTF-8 when reading parquet, so ``to_pylist`` can fail on one bad row; the batch is
    then decoded row by row to find it.
    """
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        values: list = []
        for raw in batch.cast(pa.large_binary()).to_pylist():
            try:
                values.append(None if raw is None else raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                values.append(e)
        return values


READERS: dict[str, Callable[..., Iterator[Record]]] = {
    "jsonl": read_jsonl,
    "text": read_text,
    "parquet": read_parquet,
}


def iter_records(
    files: list[Path],
    text_key: str = "text",
    errors: dict | None = None,
    keep: Callable[[], bool] | None = None,
) -> Iterator[Record]:
    """All non-empty documents of ``files`` in order, as ``(text, file, line)``; see the module docstring."""
    for path in files:
        yield from READERS[file_kind(path)](path, text_key, errors, keep)


def iter_documents(files: list[Path], text_key: str = "text") -> Iterator[str]:
    """All non-empty document texts of ``files`` in order (errors raise)."""
    for text, _, _ in iter_records(files, text_key):
        yield text

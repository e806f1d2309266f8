"""Raw-text readers: turn ``prepare``'s ``--input`` paths into a stream of ``(text, file, line)`` records.

Inputs are expanded once, up front (:func:`expand_inputs`), into an ordered list of files, so the document
order (and therefore every shard) is a pure function of the command line:

* a directory is searched recursively for ``*.jsonl``, ``*.txt``, ``*.parquet`` and their ``.gz`` / ``.zst``
  forms, in sorted path order; a glob (``data/*.jsonl.gz``) expands to its sorted matches;
* ``*.jsonl[.gz|.zst]``: one JSON object per line, the document is its ``text_key`` field; blank lines skipped;
* ``*.parquet``: the ``text_key`` column, read one row group at a time (needs ``pyarrow``, imported lazily);
* ``*.txt[.gz|.zst]`` and any other file named explicitly (``*.py``, ``*.md``...): the whole file is one document.

Everything streams: a jsonl file is read line by line through the decompressor, a parquet file row group by
row group, so memory stays bounded whatever the input size (a ``.txt`` document is one string by definition).

Every malformed input is a :class:`DataError` naming the file and line: invalid UTF-8, a line that is not a JSON
object, a missing or non-string text field, a truncated or corrupt ``.gz`` / ``.zst``. With
``on_error="skip"`` the bad line (or the rest of a truncated file) is skipped instead and counted in the
``errors`` dict passed in (reason -> count), which ``prepare`` puts in its report.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from llmtrain.errors import DataError

DIRECTORY_PATTERNS = tuple(
    f"*.{kind}{comp}" for kind in ("jsonl", "txt", "parquet") for comp in ("", ".gz", ".zst")
)
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)
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
        try:
            import zstandard
        except ImportError:
            raise DataError(
                f"Input '{path}' is zstd-compressed but the 'zstandard' package is not installed; "
                f"`pip install zstandard` or decompress it (zstd -d '{path}')."
            ) from None
        raw = open(path, "rb")  # noqa: SIM115 (closed with the reader)
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")  # noqa: SIM115


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
    return text


def _reason(message: str) -> str:
    for key, reason in (("UTF-8", "invalid_utf8"), ("valid JSON", "invalid_json"), ("field", "missing_key")):
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
            for line_no, raw in enumerate(f, start=1):  # noqa: B007 (line_no is used after the loop)
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


def read_parquet(
    path: Path, text_key: str, errors: dict | None = None, keep: Callable[[], bool] | None = None
) -> Iterator[Record]:
    """The ``text_key`` column of a parquet file, one row group at a time; ``line`` is the 1-based row."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"Input '{path}' is a parquet file but 'pyarrow' is not installed; `pip install pyarrow` or convert "
            f"it to jsonl."
        ) from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError on a damaged file
        _skip_or_raise(errors, "truncated_file", f"Input '{path}' is not a readable parquet file ({e}).")
        return
    if text_key not in pf.schema_arrow.names:
        raise DataError(
            f"Input '{path}' has no column '{text_key}' (columns: {pf.schema_arrow.names[:8]}); pass --text-key."
        )
    row = 0
    for group in range(pf.num_row_groups):
        for text in pf.read_row_group(group, columns=[text_key]).column(0).to_pylist():
            row += 1
            if keep is not None and not keep():
                continue
            if not isinstance(text, str):
                if text is not None:
                    _skip_or_raise(
                        errors, "missing_key", f"Input '{path}' row {row}: '{text_key}' is not a string."
                    )
                continue
            if text:
                yield text, path, row


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

"""Raw-text readers: turn ``prepare``'s ``--input`` paths into a stream of document strings.

Inputs are expanded once, up front (:func:`expand_inputs`), into an ordered list of files, so the document
order (and therefore the token shard) is a pure function of the command line:

* a directory is searched recursively for ``*.jsonl``, ``*.txt`` and their ``.gz``, in sorted path order;
* ``*.jsonl[.gz]``: one JSON object per line, the document is its ``text_key`` field; blank lines are skipped;
* ``*.txt[.gz]``: the whole file is one document;
* any other file named explicitly (``*.py``, ``*.md``...) is plain text, one document per file.

Every malformed input raises :class:`DataError` naming the file and line: a missing path, invalid UTF-8, a line
that is not a JSON object, a missing or non-string text field, a truncated or corrupt ``.gz``. Empty documents
(``""``) are skipped. The later clean/dedup pipeline plugs in as a filter over :func:`iter_documents`; new
formats (parquet, zstd) add a reader to ``READERS``.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from llmtrain.errors import DataError

DIRECTORY_PATTERNS = ("*.jsonl", "*.jsonl.gz", "*.txt", "*.txt.gz")
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


def expand_inputs(inputs: list[str]) -> list[Path]:
    """The input files in reading order; DataError for a path that does not exist."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = {f for pattern in DIRECTORY_PATTERNS for f in p.rglob(pattern) if f.is_file()}
            files.extend(sorted(found, key=lambda f: f.relative_to(p).as_posix()))
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(
                f"Input '{item}' does not exist. --input takes .jsonl/.txt files (optionally .gz), other text "
                f"files (one document each) or directories containing .jsonl/.txt files."
            )
    return files


def file_kind(path: Path) -> str:
    """``jsonl`` or ``text`` (whole file is one document), from the name with any ``.gz`` removed."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return "jsonl" if name.endswith(".jsonl") else "text"


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")  # noqa: SIM115


def _gz_error(path: Path, line: int, err: Exception) -> DataError:
    return DataError(
        f"Input '{path}' is a truncated or corrupt gzip file: decompression failed after line {line} ({err}). "
        f"Re-download or re-compress it (gzip -t '{path}' checks a file)."
    )


def read_jsonl(path: Path, text_key: str) -> Iterator[str]:
    """Documents of a JSON-lines file (``text_key`` field of each non-blank line)."""
    line_no = 0
    try:
        with _open_binary(path) as f:
            for line_no, raw in enumerate(f, start=1):  # noqa: B007 (line_no is used after the loop)
                if not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"Input '{path}' line {line_no} is not valid UTF-8 (byte {e.start} of the line); "
                        f"inputs must be UTF-8 encoded."
                    ) from None
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"Input '{path}' line {line_no} is not valid JSON ({e.msg} at column {e.colno}); each line "
                        f'of a .jsonl file must be one JSON object like {{"{text_key}": "..."}}.'
                    ) from None
                if not isinstance(record, dict) or text_key not in record:
                    keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
                    raise DataError(
                        f"Input '{path}' line {line_no} has no '{text_key}' field (found: {keys}); pass "
                        f"--text-key with the field that holds the document text."
                    )
                text = record[text_key]
                if not isinstance(text, str):
                    raise DataError(
                        f"Input '{path}' line {line_no}: field '{text_key}' is a {type(text).__name__}, not a "
                        f"string; every document's text must be a JSON string."
                    )
                if text:
                    yield text
    except _GZIP_ERRORS as e:
        raise _gz_error(path, line_no, e) from None


def read_text(path: Path, text_key: str) -> Iterator[str]:
    """The whole file as one document (``text_key`` is unused)."""
    try:
        with _open_binary(path) as f:
            data = f.read()
    except _GZIP_ERRORS as e:
        raise _gz_error(path, 0, e) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"Input '{path}' line {line_no} is not valid UTF-8 (byte offset {e.start} of the file); inputs must "
            f"be UTF-8 encoded."
        ) from None
    if text:
        yield text


READERS: dict[str, Callable[[Path, str], Iterator[str]]] = {"jsonl": read_jsonl, "text": read_text}


def iter_documents(files: list[Path], text_key: str = "text") -> Iterator[str]:
    """All non-empty documents of ``files`` in order."""
    for path in files:
        yield from READERS[file_kind(path)](path, text_key)

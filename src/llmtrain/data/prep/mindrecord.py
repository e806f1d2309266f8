"""MindRecord input for ``prepare``: a MindSpore dataset of token-id rows -> llmtrain shards (no mindspore).

The layout, as MindSpore 2.x's ``FileWriter`` writes it (measured facts in ``shared/notes/mindrecord.md``):

* A dataset ``NAME`` is a data file ``NAME``, or ``NAME0`` ... ``NAME{N-1}`` for N shards, each with an SQLite
  index ``NAME.db`` beside it. The index is not read: the data file's header and pages are enough.
* Data file: bytes 0-7 are a little-endian u64 length L, bytes 8..8+L a JSON header (zero-padded up to
  ``header_size``) with ``page_size``, ``shard_id``, ``shard_addresses`` (file names of all shards, in order),
  ``schema[0]`` (``schema``: field -> ``{"type", "shape"}``; ``blob_fields``) and ``page``, one entry per page
  (``page_id``, ``page_type`` RAW_DATA or BLOB_DATA, blob pages' ``start_row_id``/``end_row_id``,
  ``page_size`` = bytes used). Page k starts at byte ``header_size + k * page_size`` (a sparse file; the last
  page is cut to its used length).
* A page is rows back to back, each a little-endian u64 length and its bytes. Blob pages hold the array
  fields; raw pages the scalar fields as msgpack maps (never decoded: only blob fields are read). A blob row
  is its one field's bytes or, with several blob fields, each field as a big-endian u64 length and its bytes,
  in ``blob_fields`` order. Rows run in order over a shard's blob pages, and the dataset is shard 0's rows,
  then shard 1's, ...: ``FileReader``'s order, not the write order (FileWriter splits each batch into runs).
* int32/int64 arrays are compressed: a big-endian u32 count n, ceil(n / 4) bytes of 2-bit width codes (most
  significant first: 0 int8, 1 int16, 2 int32, 3 int64), then each value little-endian signed in its width.

Reading is page by page (seek + read of one page's used bytes): memory is one page plus the output batch.
Every offset and length is checked against the file and its page first; a truncated or corrupt file is a
DataError naming the file and the damage, and nothing is published at the output (``write_dataset`` writes
under temporary names). Encrypted files and files written with MindSpore's optional hash check are not
supported.

Conversion (:func:`convert`): each row is ONE pre-packed sample. MindFormers writes ``seq_length + 1`` ids per
row; the rows go through ``write_dataset``'s ``bestfit`` path, whose sequences the loader serves one per
sample (``BinSamples``): a row of exactly ``seq_length + 1`` ids is one full bin, never split, joined, padded
or reordered. The manifest says ``packing = {"mode": "bestfit", "seq_length": row length - 1, "prepacked":
"mindrecord"}``. Rows of different lengths are a DataError, not padded bins: the packer would join short rows
into shared bins, and MindFormers cannot batch such rows either.
"""

from __future__ import annotations

import glob
import itertools
import json
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmtrain.data.indexed import optimal_dtype
from llmtrain.data.manifest import manifest_path, read_manifest
from llmtrain.data.prep.pipeline import PrepareOptions
from llmtrain.data.prep.readers import expand_inputs
from llmtrain.data.prep.shards import write_dataset
from llmtrain.data.samples import digest
from llmtrain.data.tokenizer import Tokenizer
from llmtrain.errors import ConfigError, DataError

DEFAULT_FIELD = "input_ids"
MAX_HEADER_BYTES = 128 << 20  # MindSpore's upper bound on header_size
NAME_PATTERN = re.compile(r"\.mindrecord\d*$")
HEADER_KEYS = (b'"header_size"', b'"shard_addresses"', b'"page_size"')
INT_TYPES = ("int32", "int64")
WIDTH_DTYPES: tuple[np.dtype, ...] = (
    np.dtype("<i1"),
    np.dtype("<i2"),
    np.dtype("<i4"),
    np.dtype("<i8"),
)  # by width code
BATCH_TOKENS = 1 << 20  # tokens per batch handed to write_dataset
# prepare options that have no meaning for token rows: (field, flag spelling)
TEXT_OPTIONS = (("text_key", "--text-key"), ("clean", "--clean"), ("mojibake", "--mojibake"),
                ("filter", "--filter"), ("dedup", "--dedup"), ("pack", "--pack"),
                ("on_error", "--on-error"), ("rejects", "--rejects"))  # fmt: skip


@dataclass(frozen=True)
class BlobPage:
    """One BLOB_DATA page of a shard: its id, its rows ``[start_row, end_row)`` and its used bytes."""

    page_id: int
    start_row: int
    end_row: int
    used: int


@dataclass(frozen=True)
class ShardHeader:
    """What the reader needs from one data file's header (checked on construction by :func:`read_header`)."""

    path: Path
    size: int  # file size in bytes
    header_size: int
    page_size: int
    shard_id: int
    shard_addresses: list[str]
    schema: dict  # field -> {"type": ..., "shape": [...]}
    blob_fields: list[str]
    pages: list[BlobPage]  # in row order

    @property
    def rows(self) -> int:
        return self.pages[-1].end_row if self.pages else 0


def _corrupt(path: Path, what: str) -> DataError:
    return DataError(
        f"MindRecord file '{path}' is truncated or corrupt: {what}. Copy the file again (every shard "
        f"NAME0..NAME{{N-1}} of the dataset) or regenerate it with MindSpore's FileWriter."
    )


def _read_at(f, offset: int, n: int) -> bytes:
    """``n`` bytes at ``offset`` of open file ``f`` (every read of a data file goes through here)."""
    f.seek(offset)
    return f.read(n)


def is_mindrecord(path: Path) -> bool:
    """Whether ``path`` is a MindRecord data file: by content (a u64 length then a JSON header naming
    ``header_size`` / ``shard_addresses`` / ``page_size``), or by name (``*.mindrecord``, ``*.mindrecordK``).
    """
    if NAME_PATTERN.search(path.name):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(8 + 512)
    except OSError:
        return False
    if len(head) < 10 or struct.unpack("<Q", head[:8])[0] < 2 or not head[8:].startswith(b"{"):
        return False
    return any(key in head[8:] for key in HEADER_KEYS)


def read_header(path: Path) -> ShardHeader:
    """The checked header of data file ``path``; DataError naming the file for anything inconsistent."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = _read_at(f, 0, 8)
        if len(head) < 8:
            raise _corrupt(path, f"it has {size} bytes, fewer than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or 8 + n > min(size, MAX_HEADER_BYTES):
            raise _corrupt(path, f"its header length {n} runs past the end of the file ({size} bytes)")
        raw = _read_at(f, 8, n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: bad JSON, a 4300+ digit int
        raise _corrupt(path, f"its {n}-byte JSON header does not parse ({str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "its header is not a JSON object")
    if missing := [
        k for k in ("header_size", "page_size", "page", "schema", "shard_addresses") if k not in header
    ]:
        raise _corrupt(path, f"its header lacks {missing} (keys present: {sorted(header)[:12]})")
    header_size, page_size = header["header_size"], header["page_size"]
    if not _int(header_size) or header_size < 8 + n or not _int(page_size) or page_size < 1:
        raise _corrupt(path, f"header_size {header_size!r} / page_size {page_size!r} are not valid sizes")
    schema = header["schema"]
    if not isinstance(schema, list) or not schema or not isinstance(schema[0], dict):
        raise _corrupt(path, "its header's 'schema' is not a non-empty list")
    fields, blob_fields = schema[0].get("schema"), schema[0].get("blob_fields", [])
    if not isinstance(fields, dict) or not isinstance(blob_fields, list):
        raise _corrupt(path, "its header's schema[0] has no 'schema' object / 'blob_fields' list")
    addresses = header["shard_addresses"]
    if not isinstance(addresses, list) or not addresses or not all(isinstance(a, str) for a in addresses):
        raise _corrupt(path, "its header's 'shard_addresses' is not a list of file names")
    shard_id = header.get("shard_id", 0)
    if not _int(shard_id) or not 0 <= shard_id < len(addresses):
        raise _corrupt(path, f"shard_id {shard_id!r} is not one of its {len(addresses)} shard_addresses")
    pages = _blob_pages(path, header["page"], header_size, page_size, size)
    return ShardHeader(path, size, header_size, page_size, shard_id, addresses, fields, blob_fields, pages)


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _blob_pages(path: Path, entries: object, header_size: int, page_size: int, size: int) -> list[BlobPage]:
    """The BLOB_DATA pages in row order; every page (raw ones too) checked to lie inside the file, and the
    blob pages to continue each other's rows."""
    if not isinstance(entries, list):
        raise _corrupt(path, "its header's 'page' is not a list")
    keys = ("page_id", "page_type", "start_row_id", "end_row_id", "page_size")
    pages: list[BlobPage] = []
    seen: set[int] = set()
    for e in entries:
        if not isinstance(e, dict) or any(k not in e for k in keys):
            raise _corrupt(path, f"a page entry {str(e)[:120]} lacks one of {list(keys)}")
        p = BlobPage(e["page_id"], e["start_row_id"], e["end_row_id"], e["page_size"])
        if not all(_int(v) for v in (p.page_id, p.start_row, p.end_row, p.used)):
            raise _corrupt(path, f"page entry {e} has a non-integer or negative field")
        end = header_size + p.page_id * page_size + p.used
        if p.used > page_size:
            raise _corrupt(path, f"page {p.page_id} uses {p.used} bytes of a {page_size}-byte page")
        if end > size:
            raise _corrupt(path, f"page {p.page_id} ends at byte {end}, past the end of the file ({size})")
        if p.page_id in seen:
            raise _corrupt(path, f"two page entries have page_id {p.page_id} (they would share its bytes)")
        seen.add(p.page_id)
        if e["page_type"] == "BLOB_DATA":
            pages.append(p)
    pages.sort(key=lambda p: p.page_id)
    row = 0
    for p in pages:
        if p.start_row != row or p.end_row < p.start_row:
            raise _corrupt(path, f"blob page {p.page_id} has rows {p.start_row}..{p.end_row}, not from {row}")
        if p.end_row == p.start_row or p.used == 0:  # MindSpore's writer opens a page for a row, never empty
            raise _corrupt(
                path,
                f"blob page {p.page_id} is empty ({p.end_row - p.start_row} rows in {p.used} bytes; MindSpore "
                f"writes a page only for the rows it holds, so its rows or bytes were lost",
            )
        row = p.end_row
    return pages


def _field_error(path: Path, field: str, header: ShardHeader, problem: str) -> DataError:
    present = ", ".join(f"{k} ({_describe(v)})" for k, v in header.schema.items())
    return DataError(
        f"MindRecord file '{path}': field '{field}' {problem}. Fields present: {present or 'none'}. Pass "
        f"--mindrecord-field with the field of token ids, a 1-D int32 or int64 array (MindFormers: "
        f"input_ids)."
    )


def _describe(spec: object) -> str:
    """``int32 [-1]`` for an array field, ``int32`` for a scalar."""
    if not isinstance(spec, dict):
        return repr(spec)
    return f"{spec.get('type')} {spec['shape']}" if "shape" in spec else str(spec.get("type"))


def check_field(header: ShardHeader, field: str) -> str:
    """The type (int32 or int64) of token field ``field``; DataError listing the fields present otherwise."""
    spec = header.schema.get(field)
    if spec is None:
        raise _field_error(header.path, field, header, "is not in the schema")
    if not isinstance(spec, dict) or spec.get("type") not in INT_TYPES:
        kind = spec.get("type") if isinstance(spec, dict) else spec
        raise _field_error(header.path, field, header, f"has type {kind!r}, not an integer array")
    shape = spec.get("shape")
    if not isinstance(shape, list) or len(shape) != 1 or field not in header.blob_fields:
        raise _field_error(header.path, field, header, f"is a {spec['type']} of shape {shape}, not 1-D")
    return str(spec["type"])


def decode_ints(buf: memoryview, wide: bool = True) -> np.ndarray:
    """The int64 values of a compressed integer array (see the module docstring); ValueError if the bytes
    are not one (``wide=False``: an int32 field, where the int64 width code cannot occur)."""
    if len(buf) < 4:
        raise ValueError(f"{len(buf)} bytes, fewer than the 4-byte element count")
    n = int.from_bytes(buf[:4], "big")
    ncode = (n + 3) // 4
    if 4 + ncode > len(buf):
        raise ValueError(f"{n} elements need {ncode} bytes of width codes, only {len(buf) - 4} follow")
    packed = np.frombuffer(buf, np.uint8, ncode, 4)  # [ncode]
    codes = np.stack([packed >> 6, (packed >> 4) & 3, (packed >> 2) & 3, packed & 3], axis=1).reshape(-1)[:n]
    widths = np.left_shift(1, codes.astype(np.int64))  # [n] bytes of each element
    body = np.frombuffer(buf, np.uint8, offset=4 + ncode)
    if int(widths.sum()) != len(body):
        raise ValueError(f"the width codes of {n} values say {int(widths.sum())} bytes, {len(body)} follow")
    if not wide and n and int(codes.max()) == 3:
        raise ValueError("an int32 array holds an int64 width code")
    if n == 0:
        return np.zeros(0, np.int64)
    first = int(codes[0])
    if bool((codes == first).all()):  # the usual case: every element in one width
        return body.view(WIDTH_DTYPES[first]).astype(np.int64)
    out = np.empty(n, np.int64)
    starts = np.cumsum(widths) - widths  # [n] byte offset of each element
    for code, dtype in enumerate(WIDTH_DTYPES):
        m = codes == code
        if m.any():
            idx = starts[m][:, None] + np.arange(dtype.itemsize)  # [k, width]
            out[m] = body[idx].view(dtype).reshape(-1)
    return out


def _field_bytes(blob: memoryview, index: int, count: int) -> memoryview:
    """Field ``index`` of a blob row of ``count`` blob fields; ValueError when the lengths do not add up."""
    if count == 1:
        return blob
    pos, found = 0, None
    for k in range(count):
        if pos + 8 > len(blob):
            raise ValueError(f"the row ends inside the length of blob field {k}")
        n = int.from_bytes(blob[pos : pos + 8], "big")
        if n > len(blob) - pos - 8:
            raise ValueError(f"blob field {k} claims {n} bytes, {len(blob) - pos - 8} are left in the row")
        if k == index:
            found = blob[pos + 8 : pos + 8 + n]
        pos += 8 + n
    if pos != len(blob):
        raise ValueError(f"{len(blob) - pos} bytes follow the row's {count} blob fields")
    assert found is not None
    return found


def iter_rows(headers: list[ShardHeader], field: str) -> Iterator[tuple[ShardHeader, int, np.ndarray]]:
    """``(shard, row, ids)`` of every row of ``field`` (int64 [n]), shard by shard, page by page."""
    for h in headers:
        wide = check_field(h, field) == "int64"
        index, count = h.blob_fields.index(field), len(h.blob_fields)
        with open(h.path, "rb") as f:
            for page in h.pages:
                data = _read_at(f, h.header_size + page.page_id * h.page_size, page.used)
                if len(data) != page.used:
                    raise _corrupt(h.path, f"blob page {page.page_id} ends past the end of the file")
                mv, pos = memoryview(data), 0
                for row in range(page.start_row, page.end_row):
                    where = f"row {row} (blob page {page.page_id})"
                    if pos + 8 > page.used:
                        raise _corrupt(h.path, f"{where}: the page ends inside the row's length")
                    n = int.from_bytes(mv[pos : pos + 8], "little")
                    pos += 8
                    if n > page.used - pos:
                        raise _corrupt(h.path, f"{where}: its length {n} runs past its page")
                    try:
                        ids = decode_ints(_field_bytes(mv[pos : pos + n], index, count), wide)
                    except ValueError as e:
                        raise _corrupt(h.path, f"{where}: bad blob / compressed-int encoding ({e})") from None
                    pos += n
                    yield h, row, ids
                if pos != page.used:
                    raise _corrupt(
                        h.path, f"blob page {page.page_id}: {page.used - pos} bytes after its rows"
                    )


def dataset_shards(header: ShardHeader) -> list[ShardHeader]:
    """Every shard of the dataset ``header`` belongs to, in shard order: its ``shard_addresses`` next to it,
    else (renamed files) ``NAME0..NAME{N-1}`` from its own name; DataError for a missing or foreign shard."""
    folder, count = header.path.parent, len(header.shard_addresses)
    paths = [folder / Path(a).name for a in header.shard_addresses]
    if not all(p.is_file() for p in paths):
        digits = re.search(r"\d+$", header.path.name)
        if count == 1:
            paths = [header.path]
        elif digits and int(digits.group()) == header.shard_id:
            stem = header.path.name[: digits.start()]
            renamed = [folder / f"{stem}{k}" for k in range(count)]
            paths = renamed if all(p.is_file() for p in renamed) else paths
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataError(
            f"MindRecord file '{header.path}' is shard {header.shard_id} of {count}, but shard file(s) "
            f"{missing[:4]} do not exist; a MindRecord dataset is read whole: keep all its shards in one "
            f"folder."
        )
    out = []
    for k, p in enumerate(paths):
        h = header if p.resolve() == header.path.resolve() else read_header(p)
        same = (h.schema, h.blob_fields, len(h.shard_addresses)) == (header.schema, header.blob_fields, count)
        if h.shard_id != k or not same:
            raise DataError(
                f"MindRecord file '{p}' should be shard {k} of the {count} shards of '{header.path}', but "
                f"its header says shard {h.shard_id} of {len(h.shard_addresses)}, "
                f"{'same' if same else 'another'} schema; the shard files of two datasets were mixed."
            )
        out.append(h)
    return out


def find_inputs(inputs: list[str]) -> list[ShardHeader] | None:
    """The shards of the MindRecord datasets named by ``inputs`` (files or globs), in order; None when no
    input is a MindRecord file. Their ``.db`` index files may be among the inputs; other files are a
    ConfigError (MindRecord and text inputs do not mix)."""
    candidates: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_file():
            candidates.append(p)
        elif not p.exists() and glob.has_magic(item):
            candidates.extend(Path(m) for m in sorted(glob.glob(item, recursive=True)) if Path(m).is_file())
    if not any(is_mindrecord(p) for p in candidates):
        return None
    files = expand_inputs(inputs)
    data = [f for f in files if is_mindrecord(f)]
    index = {f.with_name(f"{f.name}.db") for f in data}
    if others := [f for f in files if f not in data and f not in index]:
        raise ConfigError(
            f"--input mixes MindRecord files ({', '.join(map(str, data[:3]))}) with other files "
            f"({', '.join(map(str, others[:3]))}); MindRecord rows are token ids, converted on their own: "
            f"prepare them in a separate run and blend the datasets with data.datasets."
        )
    shards: list[ShardHeader] = []
    seen: set[Path] = set()
    for f in data:
        if f.resolve() in seen:
            continue
        for h in dataset_shards(read_header(f)):
            if h.path.resolve() not in seen:
                seen.add(h.path.resolve())
                shards.append(h)
    return shards


def check_request(opts: PrepareOptions, train_tokenizer: int | None, partition: object) -> None:
    """ConfigError when a MindRecord input comes with options that only apply to text."""
    default = PrepareOptions()
    given = [flag for name, flag in TEXT_OPTIONS if getattr(opts, name) != getattr(default, name)]
    given += ["--train-tokenizer"] if train_tokenizer is not None else []
    given += ["--partition"] if partition is not None else []
    if given:
        raise ConfigError(
            f"{', '.join(given)} do(es) not apply to a MindRecord input: its rows are token ids, already "
            f"cleaned, tokenized and packed, and are converted as they are. Remove them (also from "
            f"data.prepare of --config), and pass the tokenizer the ids were made with as --tokenizer."
        )


def _batches(
    rows: Iterator[tuple[ShardHeader, int, np.ndarray]], length: int, vocab_size: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(tokens, lengths)`` batches of ~BATCH_TOKENS for ``write_dataset``; DataError for a row of another
    length or with an id outside ``[0, vocab_size)``."""
    block: list[np.ndarray] = []
    for h, row, ids in rows:
        if len(ids) != length:
            raise DataError(
                f"MindRecord file '{h.path}' row {row} has {len(ids)} token ids where the rows before it "
                f"have {length}: every row must be one pre-packed sample of seq_length + 1 ids (as "
                f"MindFormers' preprocessing writes them). Regenerate the dataset with one fixed row length."
            )
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise DataError(
                f"MindRecord file '{h.path}' row {row} holds token id {bad} (position "
                f"{int(np.argmax(ids == bad))}), outside the tokenizer's vocabulary [0, {vocab_size}); pass "
                f"the tokenizer these ids were made with as --tokenizer."
            )
        block.append(ids)
        if len(block) * length >= BATCH_TOKENS:
            yield np.concatenate(block), np.full(len(block), length, np.int64)
            block = []
    if block:
        yield np.concatenate(block), np.full(len(block), length, np.int64)


def convert(
    shards: list[ShardHeader],
    output: str,
    tok: Tokenizer,
    tok_entry: dict,
    field: str,
    opts: PrepareOptions,
    max_rows: int | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Write the rows of ``field`` of ``shards`` as the dataset ``output``, one pre-packed sample per row;
    returns its manifest. ``opts.seq_length``, when not the default, must equal the row length - 1."""
    say = log or (lambda _: None)
    types = {check_field(h, field) for h in shards}
    given = None if opts.seq_length == PrepareOptions().seq_length else opts.seq_length  # the default: unset
    identity = {
        "mindrecord": [[str(h.path.resolve()), h.size, h.path.stat().st_mtime_ns] for h in shards],
        "field": field, "tokenizer": tok.sha256, "eos_id": tok.eos_id, "max_rows": max_rows,
        "seq_length": given, "num_shards": opts.num_shards,
    }  # fmt: skip
    key = digest(identity)
    if manifest_path(output).is_file():
        old = read_manifest(output)
        if old.get("prepare", {}).get("key") == key:
            say(f"prepare: {output} is already complete for these arguments; nothing to do")
            return old
        if old["tokenizer"].get("sha256") != tok.sha256 and not overwrite:
            raise DataError(
                f"Output '{output}' already holds a dataset made with another tokenizer (sha256 "
                f"{str(old['tokenizer'].get('sha256'))[:12]}, this run's is {tok.sha256[:12]}); shards of "
                f"two tokenizers must not mix. Choose another --output, or pass --overwrite to replace it."
            )
    rows = itertools.islice(iter_rows(shards, field), max_rows)
    first = next(rows, None)
    if first is None:
        raise DataError(f"MindRecord dataset '{shards[0].path}' has no rows in field '{field}'.")
    length = len(first[2])
    if length < 2 or (given is not None and length != given + 1):
        raise DataError(
            f"MindRecord file '{first[0].path}' row {first[1]} has {length} token ids: a pre-packed row "
            f"holds seq_length + 1 ids, at least 2"
            + (f", and --seq-length {given} needs {given + 1}." if given is not None else ".")
        )
    total = min(sum(h.rows for h in shards), max_rows or 1 << 62)
    source = {"shards": [h.path.name for h in shards], "field": field, "field_type": sorted(types),
              "rows": total, "row_length": length, "prepacked": True}  # fmt: skip
    options = {"source": "mindrecord", **{k: v for k, v in identity.items() if k != "mindrecord"}}
    extra = {"inputs": [str(h.path) for h in shards], "prepare": {"key": key, "options": options},
             "report": {"stages": {"read": {"in": total, "out": total, "removed": {}}}, "mindrecord": source},
             "packing": {"prepacked": "mindrecord"}}  # fmt: skip
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    batches = _batches(itertools.chain([first], rows), length, tok.vocab_size)
    manifest = write_dataset(output, batches, optimal_dtype(tok.vocab_size), "bestfit", length - 1,
                             opts.num_shards, tok_entry, Path(tok.path), extra)  # fmt: skip
    say(
        f"prepare: {manifest['documents']:,} MindRecord rows of {length} ids ({manifest['tokens']:,} tokens) "
        f"from {len(shards)} shard file(s) -> {output}, one sample each (seq_length {length - 1})"
    )
    return manifest

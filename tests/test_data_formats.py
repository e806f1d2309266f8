"""Input formats of ``prepare``: .jsonl / .gz / .zst / .parquet / .txt.zst, directories and globs give the same
token stream as plain jsonl; truncated, corrupt and malformed zstd and parquet inputs are clear errors (or
counted with ``on_error="skip"``); parquet is read one row group at a time; missing optional packages."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.data.indexed import IndexedDataset
from llmtrain.data.prep.prepare import prepare
from llmtrain.data.prep.readers import read_jsonl, read_parquet
from llmtrain.data.prep.tokenizer_training import train_bpe
from llmtrain.errors import DataError

# Varied lengths and non-ASCII text, so a reader that drops, reorders or mangles a document changes the tokens.
DOCS = [
    f"Document {i}: the {w} crossed the river {i % 7} times. Café №{i} — naïve façade, 東京 {w}."
    * (1 + i % 4)
    for i, w in enumerate(["whale", "boat", "stone", "tree", "bird", "cloud", "fox"] * 6)
]


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "bpe.json"
    train_bpe(iter(DOCS * 2), 400, str(path))
    return str(path)


def jsonl_bytes(texts: list[str], key: str = "text") -> bytes:
    return "".join(json.dumps({key: t}) + "\n" for t in texts).encode("utf-8")


def zst(data: bytes, frames: int = 1, streamed: bool = False) -> bytes:
    """``data`` zstd-compressed: in ``frames`` concatenated frames, or by a streaming writer (no content size)."""
    zstandard = pytest.importorskip("zstandard")
    if streamed:
        buf = io.BytesIO()
        with zstandard.ZstdCompressor().stream_writer(buf, closefd=False) as w:
            for k in range(0, len(data), 1000):
                w.write(data[k : k + 1000])
        return buf.getvalue()
    cut = [len(data) * k // frames for k in range(frames + 1)]
    return b"".join(zstandard.ZstdCompressor().compress(data[a:b]) for a, b in zip(cut, cut[1:]))


def write_parquet(path: Path, texts: list, column: str = "text", row_group_size: int = 7, **extra) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"id": list(range(len(texts))), column: texts, **extra})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def tokens(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tok_file) -> list[list[int]]:
    """The token stream of DOCS read from a plain jsonl file."""
    d = tmp_path_factory.mktemp("ref")
    (d / "docs.jsonl").write_bytes(jsonl_bytes(DOCS))
    m = prepare([str(d / "docs.jsonl")], str(d / "ref"), tokenizer=tok_file, log=None)
    assert m["documents"] == len(DOCS)
    return tokens(d / "ref")


def _same_docs(tmp_path: Path, fmt: str) -> tuple[list[str], dict]:
    """Inputs holding DOCS in format ``fmt``, and extra prepare() arguments."""
    if fmt == "jsonl.gz":
        (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(DOCS)))
        return [str(tmp_path / "d.jsonl.gz")], {}
    if fmt.startswith("jsonl.zst"):
        kind = fmt.split(":")[1]
        data = zst(jsonl_bytes(DOCS), frames=3 if kind == "3 frames" else 1, streamed=kind == "streamed")
        (tmp_path / "d.jsonl.zst").write_bytes(data)
        return [str(tmp_path / "d.jsonl.zst")], {}
    if fmt == "parquet":  # 42 rows in 6 row groups, text in 'body', extra columns before and after it
        meta = [{"lang": "en", "n": i} for i in range(len(DOCS))]
        write_parquet(tmp_path / "d.parquet", DOCS, column="body", score=[0.5] * len(DOCS), meta=meta)
        return [str(tmp_path / "d.parquet")], {"text_key": "body"}
    if fmt == "txt.zst dir":  # one document per file, found by the directory walk in sorted order
        (tmp_path / "txt").mkdir()
        for i, doc in enumerate(DOCS):
            (tmp_path / "txt" / f"doc{i:03d}.txt.zst").write_bytes(zst(doc.encode("utf-8")))
        return [str(tmp_path / "txt")], {}
    # A directory (or a glob over it) mixing formats; sorted names keep DOCS' order.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_bytes(jsonl_bytes(DOCS[:10]))
    (mixed / "b.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(DOCS[10:20])))
    write_parquet(mixed / "c.parquet", DOCS[20:30], row_group_size=4)
    (mixed / "d.txt.zst").write_bytes(zst(DOCS[30].encode("utf-8")))
    (mixed / "e.jsonl.zst").write_bytes(zst(jsonl_bytes(DOCS[31:]), frames=2))
    (mixed / "notes.md").write_text("not an input: directories take only the known extensions")
    return [str(mixed / "[a-e].*")] if fmt == "glob" else [str(mixed)], {}


FORMATS = ["jsonl.gz", "jsonl.zst:1 frame", "jsonl.zst:3 frames", "jsonl.zst:streamed", "parquet",
           "txt.zst dir", "directory", "glob"]  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
def test_formats_give_the_same_tokens(tmp_path, tok_file, reference, fmt):
    inputs, kwargs = _same_docs(tmp_path, fmt)
    m = prepare(inputs, str(tmp_path / "out"), tokenizer=tok_file, log=None, **kwargs)
    assert m["documents"] == len(DOCS)
    assert tokens(tmp_path / "out") == reference


def test_cli_reads_parquet_with_text_key(tmp_path, tok_file, reference):
    inputs, _ = _same_docs(tmp_path, "parquet")
    cmd = [sys.executable, "-m", "llmtrain", "prepare", "--input", *inputs, "--output", str(tmp_path / "cli"),
           "--tokenizer", tok_file, "--text-key", "body"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert tokens(tmp_path / "cli") == reference
    # The same command on a truncated .zst: exit code 2, the message names the file, nothing is written.
    data = zst(jsonl_bytes(DOCS))
    (tmp_path / "t.jsonl.zst").write_bytes(data[: len(data) // 2])
    cmd[cmd.index("--input") + 1] = str(tmp_path / "t.jsonl.zst")
    cmd[cmd.index("--output") + 1] = str(tmp_path / "bad" / "out")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "t.jsonl.zst' is a truncated or corrupt zstd file" in run.stderr
    assert list((tmp_path / "bad").iterdir()) == []


def _big_jsonl() -> bytes:
    """~700 KB of jsonl: several 128 KiB zstd blocks, so half the compressed bytes still hold whole lines."""
    return jsonl_bytes([f"record {i} about {DOCS[i % len(DOCS)]}" for i in range(2000)])


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], dict, str]]:
    pytest.importorskip("zstandard")
    pytest.importorskip("pyarrow")
    data = zst(_big_jsonl())
    (tmp_path / "trunc.jsonl.zst").write_bytes(data[: len(data) // 2])
    data = zst(" ".join(DOCS).encode("utf-8"))
    (tmp_path / "trunc.txt.zst").write_bytes(data[: len(data) // 2])
    (tmp_path / "utf.jsonl.zst").write_bytes(zst(b'{"text": "fine"}\n{"text": "bad \xc3\x28 here"}\n'))
    (tmp_path / "empty.jsonl.zst").write_bytes(zst(b""))
    write_parquet(tmp_path / "nocol.parquet", DOCS[:5], column="content", lang=["en"] * 5)
    write_parquet(tmp_path / "null.parquet", ["one", "two", None, "four"], row_group_size=2)
    write_parquet(tmp_path / "ints.parquet", [1, 2, 3])
    write_parquet(tmp_path / "empty.parquet", [], row_group_size=1)
    (tmp_path / "random.parquet").write_bytes(bytes(range(256)) * 8)
    return {
        "truncated jsonl.zst": (
            ["trunc.jsonl.zst"],
            {},
            r"trunc.jsonl.zst' is a truncated or corrupt zstd file",
        ),
        "truncated txt.zst": (["trunc.txt.zst"], {}, r"trunc.txt.zst' is a truncated or corrupt zstd file"),
        "invalid utf-8 in zst": (["utf.jsonl.zst"], {}, r"utf.jsonl.zst' line 2 is not valid UTF-8"),
        "empty zst": (["empty.jsonl.zst"], {}, "No documents found"),
        "missing column": (
            ["nocol.parquet"],
            {},
            r"nocol.parquet' has no column 'text' \(columns: \['id', 'content', 'lang'\]\); pass --text-key",
        ),
        "null value": (["null.parquet"], {}, r"null.parquet' row 3: column 'text' is null, not a string"),
        "int column": (
            ["ints.parquet"],
            {},
            r"ints.parquet' row 1: column 'text' is of type int, not a string",
        ),
        "empty parquet": (["empty.parquet"], {}, "No documents found"),
        "corrupt parquet": (["random.parquet"], {}, r"random.parquet' is not a readable parquet file"),
        "wrong text key": (["null.parquet"], {"text_key": "body"}, r"null.parquet' has no column 'body'"),
    }


BAD = ["truncated jsonl.zst", "truncated txt.zst", "invalid utf-8 in zst", "empty zst", "missing column",
       "null value", "int column", "empty parquet", "corrupt parquet", "wrong text key"]  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_a_clear_error_leaving_nothing(tmp_path, tok_file, case):
    names, kwargs, message = _bad_inputs(tmp_path)[case]
    out = tmp_path / "outdir"
    out.mkdir()
    with pytest.raises(DataError, match=message):
        prepare([str(tmp_path / n) for n in names], str(out / "out"), tokenizer=tok_file, log=None, **kwargs)
    assert list(out.iterdir()) == []


def test_bad_input_skip_counts(tmp_path, tok_file):
    _bad_inputs(tmp_path)
    (tmp_path / "good.jsonl").write_bytes(jsonl_bytes(DOCS[:3]))
    names = ["good.jsonl", "trunc.jsonl.zst", "trunc.txt.zst", "utf.jsonl.zst", "nocol.parquet", "null.parquet",
             "ints.parquet", "random.parquet"]  # fmt: skip
    m = prepare([str(tmp_path / n) for n in names], str(tmp_path / "out" / "o"), tokenizer=tok_file, log=None,
                options={"on_error": "skip"})  # fmt: skip
    # truncated: the two .zst files and random.parquet; missing_key: 5 rows without the column, 1 null, 3 ints.
    assert m["report"]["errors_skipped"] == {"truncated_file": 3, "invalid_utf8": 1, "missing_key": 9}
    kept_from_trunc = m["documents"] - 3 - 1 - 3  # good.jsonl, utf.jsonl.zst's good line, null.parquet's rows
    assert 0 < kept_from_trunc < 2000  # the lines before the damage, not the whole file
    read = m["report"]["stages"]["read"]
    assert read["in"] == read["out"] + 13
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "o.bin", "o.idx", "o.manifest.json", "o.report.txt", "o.tokenizer.json"]  # fmt: skip


def test_truncated_zst_keeps_the_lines_before_the_damage(tmp_path):
    """Skip mode yields exactly a prefix of the file's records, then counts one truncated_file."""
    (tmp_path / "t.jsonl.zst").write_bytes(zst(_big_jsonl())[:-1])  # only the last byte missing
    errors: dict = {}
    got = [text for text, _, _ in read_jsonl(tmp_path / "t.jsonl.zst", "text", errors)]
    want = [json.loads(line)["text"] for line in _big_jsonl().decode().splitlines()]
    assert errors == {"truncated_file": 1}
    assert 0 < len(got) < len(want) and got == want[: len(got)]


def test_parquet_damaged_row_group(tmp_path, tok_file):
    """A corrupt page in row group 2 of 5: an error naming the group; skip keeps the two groups before it."""
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"hello parquet row {i}" for i in range(50)]
    path = write_parquet(tmp_path / "dmg.parquet", texts, row_group_size=10)
    col = pq.ParquetFile(path).metadata.row_group(2).column(1)
    assert col.path_in_schema == "text"
    offset = col.dictionary_page_offset or col.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[offset : offset + 16] = b"\xff" * 16  # the page header no longer decodes
    path.write_bytes(bytes(raw))
    with pytest.raises(
        DataError, match=r"dmg.parquet' is a corrupt parquet file: row group 2 \(after row 20\)"
    ):
        prepare([str(path)], str(tmp_path / "o1"), tokenizer=tok_file, log=None)
    m = prepare([str(path)], str(tmp_path / "o2"), tokenizer=tok_file, log=None, options={"on_error": "skip"})
    assert m["report"]["errors_skipped"] == {"truncated_file": 1}
    assert m["documents"] == 20


def test_parquet_invalid_utf8_names_the_row(tmp_path, tok_file):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    # Arrow does not validate UTF-8 in a string column, so such files exist.
    values = pa.array([b"good one", b"bad \xff\xfe", None, b"good two"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": values}), tmp_path / "u.parquet")
    with pytest.raises(DataError, match=r"u.parquet' row 2: column 'text' is not valid UTF-8 \(byte 4"):
        prepare([str(tmp_path / "u.parquet")], str(tmp_path / "o1"), tokenizer=tok_file, log=None)
    m = prepare([str(tmp_path / "u.parquet")], str(tmp_path / "o2"), tokenizer=tok_file, log=None,
                options={"on_error": "skip"})  # fmt: skip
    assert m["report"]["errors_skipped"] == {"invalid_utf8": 1, "missing_key": 1}
    assert m["documents"] == 2


def test_compressed_parquet_is_refused(tmp_path, tok_file):
    path = write_parquet(tmp_path / "d.parquet", DOCS[:3])
    (tmp_path / "d.parquet.gz").write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(DataError, match=r"d.parquet.gz': a parquet file is compressed inside"):
        prepare([str(tmp_path / "d.parquet.gz")], str(tmp_path / "o"), tokenizer=tok_file, log=None)


def test_parquet_reads_one_row_group_at_a_time(tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    path = write_parquet(tmp_path / "g.parquet", DOCS, row_group_size=5)  # 9 row groups
    groups = pq.ParquetFile(path).num_row_groups
    assert groups == 9
    calls: list[int] = []
    original = pq.ParquetFile.read_row_group

    def counting(self, i, *args, **kwargs):
        calls.append(i)
        return original(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    for name in ("read", "read_row_groups", "iter_batches"):  # no whole-file read behind our back
        monkeypatch.setattr(
            pq.ParquetFile, name, lambda *a, _n=name, **k: pytest.fail(f"ParquetFile.{_n} called")
        )
    records = read_parquet(path, "text")
    first = next(records)
    assert first == (DOCS[0], path, 1)
    assert calls == [0]  # the first document came after reading only the first row group
    rest = list(records)
    assert calls == list(range(groups))
    assert [t for t, _, _ in [first, *rest]] == DOCS
    assert [row for _, _, row in [first, *rest]] == list(range(1, len(DOCS) + 1))


def test_parquet_partitions_split_rows(tmp_path, tok_file, reference):
    """--partition counts parquet rows like jsonl lines: partitions 0/2 and 1/2 hold the even and odd rows, and
    merge interleaves them back into row order (the one-process dataset)."""
    from llmtrain.data.prep.merge import merge

    inputs, kwargs = _same_docs(tmp_path, "parquet")
    for i in range(2):
        prepare(inputs, str(tmp_path / "p"), tokenizer=tok_file, log=None, partition=(i, 2), **kwargs)
    m = merge(str(tmp_path / "p"), log=None)
    assert m["documents"] == len(DOCS)
    assert tokens(tmp_path / "p") == reference


def test_parquet_without_pyarrow_is_clear(tmp_path, tok_file, monkeypatch):
    (tmp_path / "a.parquet").write_bytes(b"PAR1 not really")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(
        DataError, match=r"a.parquet' is a parquet file but 'pyarrow' is not installed; `pip "
    ):
        prepare([str(tmp_path / "a.parquet")], str(tmp_path / "o"), tokenizer=tok_file, log=None)
    assert not (tmp_path / "o.bin").exists()

"""MindRecord input: an independent writer (from shared/notes/mindrecord.md, not the reader) makes multi-shard,
multi-page fixtures; prepare must reproduce their token rows exactly, train must read each row as one sample,
and every kind of damage must be a DataError (exit 2) that leaves nothing at the output prefix."""

from __future__ import annotations

import json
import sqlite3
import struct
from pathlib import Path

import numpy as np
import pytest

from llmtrain.cli import main as cli_main
from llmtrain.data.indexed import IndexedDataset
from llmtrain.data.manifest import read_manifest
from llmtrain.data.prep import mindrecord
from llmtrain.data.prep.prepare import prepare
from llmtrain.errors import DataError

ROW = 65  # seq_length 64 + 1
SCHEMA = {
    "labels": {"type": "int64", "shape": [-1]},
    "input_ids": {"type": "int32", "shape": [-1]},
    "image": {"type": "bytes"},
    "id": {"type": "int32"},
    "source": {"type": "string"},
}
BLOB_FIELDS = ["labels", "input_ids", "image"]  # input_ids is not the first: the reader must skip "labels"


# ---- the independent writer ---------------------------------------------------------------------------------


def compress_ints(values) -> bytes:
    """MindRecord's compressed integer array, element by element in plain Python."""
    codes, body = [], b""
    for v in (int(x) for x in values):
        code = next(c for c, w in enumerate((1, 2, 4, 8)) if -(1 << (8 * w - 1)) <= v < 1 << (8 * w - 1))
        codes.append(code)
        body += v.to_bytes(1 << code, "little", signed=True)
    bitmap = bytearray((len(codes) + 3) // 4)
    for i, c in enumerate(codes):
        bitmap[i // 4] |= c << (2 * (3 - i % 4))
    return len(codes).to_bytes(4, "big") + bytes(bitmap) + body


def msgpack(obj: dict) -> bytes:
    """A msgpack map of short strings and small non-negative ints (all the raw fields here need)."""

    def one(x) -> bytes:
        if isinstance(x, int):
            return bytes([x]) if x < 128 else b"\xcd" + x.to_bytes(2, "big")
        b = x.encode()
        return bytes([0xA0 | len(b)]) + b

    return bytes([0x80 | len(obj)]) + b"".join(one(k) + one(v) for k, v in obj.items())


def encode_field(spec: dict, value) -> bytes:
    if spec["type"] in ("int32", "int64"):
        return compress_ints(value)
    return bytes(value)


def write_mindrecord(
    base: Path, rows: list[dict], shards: int = 1, page_size: int = 2048, header_size: int = 16384,
    schema: dict | None = None, blob_fields: list[str] | None = None,
) -> list[Path]:  # fmt: skip
    """Write ``rows`` (dicts of field values) as a MindRecord dataset: ``base`` or ``base0..``; returns the files."""
    schema = schema or SCHEMA
    blob_fields = BLOB_FIELDS if blob_fields is None else blob_fields
    raw_fields = [f for f in schema if f not in blob_fields]
    names = [base.name] if shards == 1 else [f"{base.name}{k}" for k in range(shards)]
    per = [len(rows) // shards + (k < len(rows) % shards) for k in range(shards)]
    paths, start = [], 0
    for k, name in enumerate(names):
        mine = rows[start : start + per[k]]
        start += per[k]
        pages: list[dict] = []  # {"type", "data", "start", "end"}
        cur = {"BLOB_DATA": None, "RAW_DATA": None}
        for r, row in enumerate(mine):
            blobs = [encode_field(schema[f], row[f]) for f in blob_fields]
            blob = blobs[0] if len(blobs) == 1 else b"".join(len(b).to_bytes(8, "big") + b for b in blobs)
            raw = msgpack({f: row[f] for f in raw_fields})
            for kind, payload in (("BLOB_DATA", blob), ("RAW_DATA", raw)):
                item = struct.pack("<Q", len(payload)) + payload
                page = cur[kind]
                if page is None or len(page["data"]) + len(item) > page_size:
                    page = {"type": kind, "data": b"", "start": r, "end": r}
                    pages.append(page)
                    cur[kind] = page
                page["data"] += item
                page["end"] = r + 1
        entries = [
            {"page_id": i, "shard_id": k, "page_type": p["type"], "page_type_id": i,
             "start_row_id": p["start"] if p["type"] == "BLOB_DATA" else 0,
             "end_row_id": p["end"] if p["type"] == "BLOB_DATA" else 0,
             "row_group_ids": [{"id": 0, "offset": 0}], "page_size": len(p["data"])}
            for i, p in enumerate(pages)
        ]  # fmt: skip
        header = {
            "header_size": header_size, "index_fields": [{"schema_id": 0, "index_field": "id"}], "page": entries,
            "page_size": page_size, "compression_size": 0,
            "schema": [{"desc": "test", "blob_fields": blob_fields, "schema": schema}],
            "shard_addresses": names, "shard_id": k, "statistics": [], "version": "3.0",
        }  # fmt: skip
        text = json.dumps(header).encode()
        assert 8 + len(text) <= header_size
        path = base.parent / name
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for i, p in enumerate(pages):  # holes between pages; the last page cut to its used length
                f.seek(header_size + i * page_size)
                f.write(p["data"])
        db = sqlite3.connect(f"{path}.db")  # the index beside it (the reader does not need it)
        db.execute("CREATE TABLE SHARD_NAME(NAME TEXT)")
        db.execute("INSERT INTO SHARD_NAME VALUES (?)", (name,))
        db.commit()
        db.close()
        paths.append(path)
    return paths


def make_rows(n: int, rng: np.random.Generator, high: int = 500, length: int = ROW) -> list[dict]:
    rows = []
    for i in range(n):
        ids = rng.integers(0, high, length)
        ids[: i % 5] = rng.integers(0, 100, i % 5)  # some int8-width values among the int16 ones
        labels = rng.integers(-(1 << 40), 1 << 40, 3).tolist() + [i, -i, 1 << 20]  # every width code
        rows.append({"input_ids": ids, "labels": labels, "image": rng.bytes(int(rng.integers(0, 40))),
                     "id": i, "source": f"s{i % 3}"})  # fmt: skip
    return rows


def wordlevel_tokenizer(path: Path, vocab_size: int) -> str:
    from tokenizers import Tokenizer, models

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tok512(tmp_path_factory) -> str:
    return wordlevel_tokenizer(tmp_path_factory.mktemp("tok") / "wl512.json", 512)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[list[Path], list[dict]]:
    """3 shards x 40 rows of 65 int32 ids (several 2 KiB pages each), with int64, bytes and raw fields."""
    rows = make_rows(120, np.random.default_rng(0))
    return write_mindrecord(tmp_path_factory.mktemp("mr") / "wiki.mindrecord", rows, shards=3), rows


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli_main(["prepare", *args])
    return code, capsys.readouterr().err


# ---- reading ------------------------------------------------------------------------------------------------


def test_fixture_layout_and_detection(dataset, tmp_path):
    paths, _ = dataset
    headers = [mindrecord.read_header(p) for p in paths]
    assert [h.rows for h in headers] == [40, 40, 40]
    assert all(len(h.pages) >= 3 for h in headers)  # several blob pages per shard
    assert all(h.header_size == 16384 and h.page_size == 2048 for h in headers)
    assert all(mindrecord.is_mindrecord(p) for p in paths)
    other = tmp_path / "a.jsonl"
    other.write_text('{"text": "header_size page_size"}\n')
    assert not mindrecord.is_mindrecord(other)
    renamed = tmp_path / "plain_name"  # detected by content, not by name
    renamed.write_bytes(paths[0].read_bytes()[:20000])
    assert mindrecord.is_mindrecord(renamed)


def test_reader_decodes_every_width_code_and_skips_other_fields(dataset):
    paths, rows = dataset
    shards = mindrecord.dataset_shards(mindrecord.read_header(paths[1]))  # any shard finds all three
    assert [h.path for h in shards] == paths
    got = list(mindrecord.iter_rows(shards, "labels"))  # int64 with values of every width
    assert len(got) == 120
    for (_, _, ids), row in zip(got, rows):
        np.testing.assert_array_equal(ids, np.asarray(row["labels"], dtype=np.int64))
    ids = [r for _, r, _ in mindrecord.iter_rows(shards, "input_ids")]
    assert ids == [*range(40)] * 3  # row numbers within each shard
    edge = [
        -1,
        0,
        127,
        -128,
        128,
        -129,
        32767,
        -32768,
        32768,
        2**31 - 1,
        -(2**31),
        2**31,
        -(2**63),
        2**63 - 1,
    ]
    np.testing.assert_array_equal(mindrecord.decode_ints(memoryview(compress_ints(edge))), np.asarray(edge))
    with pytest.raises(ValueError, match="int64 width code"):
        mindrecord.decode_ints(memoryview(compress_ints([2**40])), wide=False)


def test_reads_page_by_page(dataset, monkeypatch):
    paths, _ = dataset
    sizes: list[int] = []
    real = mindrecord._read_at
    monkeypatch.setattr(mindrecord, "_read_at", lambda f, off, n: sizes.append(n) or real(f, off, n))
    shards = mindrecord.dataset_shards(mindrecord.read_header(paths[0]))
    assert len(sizes) == 6 and max(sizes) < 16384  # each header: its 8-byte length, then its JSON
    del sizes[:]
    assert sum(1 for _ in mindrecord.iter_rows(shards, "input_ids")) == 120
    assert len(sizes) == sum(len(h.pages) for h in shards) and max(sizes) <= 2048  # one read per blob page


# ---- prepare and train --------------------------------------------------------------------------------------


def test_prepare_keeps_rows_and_train_reads_them(dataset, tok512, tmp_path, capsys):
    paths, rows = dataset
    out = tmp_path / "out" / "wiki"
    # the middle shard names the dataset; a glob would also match the .db files, which are skipped
    code, err = run_cli(["--input", str(paths[1]), "--output", str(out), "--tokenizer", tok512], capsys)
    assert code == 0, err
    expected = np.stack([r["input_ids"] for r in rows])  # [120, 65] in shard order
    ds = IndexedDataset(str(out))
    assert ds.dtype == np.uint16 and len(ds) == 120
    np.testing.assert_array_equal(ds.sizes, np.full(120, ROW))
    np.testing.assert_array_equal(np.asarray(ds.tokens).reshape(120, ROW), expected)
    m = read_manifest(str(out))
    assert m["packing"] == {"mode": "bestfit", "seq_length": 64, "prepacked": "mindrecord"}
    assert (m["documents"], m["tokens"]) == (120, 120 * ROW)
    assert m["report"]["pack"]["padding_tokens"] == 0 and m["report"]["pack"]["samples"] == 120
    assert m["report"]["mindrecord"]["rows"] == 120 and m["inputs"] == [str(p) for p in paths]
    code, _ = run_cli(["--input", f"{paths[0].parent}/wiki.mindrecord*", "--output", str(out),
                       "--tokenizer", tok512], capsys)  # fmt: skip
    assert code == 0 and read_manifest(str(out))["prepare"] == m["prepare"]  # same dataset: nothing to do

    from llmtrain.config import config_from_dict
    from llmtrain.train.trainer import Trainer

    cfg = config_from_dict({
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 64},
        "train": {"batch_size": 4, "micro_batch_size": 2, "max_steps": 2, "lr": 1e-3, "warmup_steps": 1,
                  "log_steps": 1, "eval_steps": 100, "seed": 3},
        "data": {"datasets": [{"path": str(out), "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 0, "save_at_end": False},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"eval_iters": 1},
        "run": {"device_target": "cpu", "output_dir": str(tmp_path / "run")},
    })  # fmt: skip
    t = Trainer(cfg)
    assert len(t.train_samples) + len(t.valid_samples) == 120  # one sample per row, train + valid
    seen: list[np.ndarray] = []
    next_step = t.batches.next_step

    def recording():
        micro = next_step()
        for mb in micro:
            seen.append(np.concatenate([mb["input_ids"].numpy(), mb["labels"].numpy()[:, -1:]], axis=1))
            np.testing.assert_array_equal(mb["labels"].numpy()[:, :-1], mb["input_ids"].numpy()[:, 1:])
        return micro

    t.batches.next_step = recording
    t.fit()
    batch = np.concatenate(seen)  # [2 steps * 4, 65]: each sample is exactly one fixture row
    assert batch.shape == (8, ROW)
    index = {r.tobytes(): i for i, r in enumerate(expected.astype(np.int64))}
    assert all(r.astype(np.int64).tobytes() in index for r in batch)
    np.testing.assert_array_equal(batch[0], t.train_samples.samples(np.array([0]))[1][0])


def test_int64_field_wide_ids_and_output_shards(tmp_path):
    rng = np.random.default_rng(1)
    tok = wordlevel_tokenizer(tmp_path / "wl40k.json", 40000)
    ids = [rng.integers(0, 40000, 33) for _ in range(30)]  # ids >= 32768 need the int32 width code
    ids[0][:3] = [0, 39999, 32768]
    schema = {"input_ids": {"type": "int64", "shape": [-1]}, "id": {"type": "int64"}}
    base = tmp_path / "big.mindrecord"
    write_mindrecord(base, [{"input_ids": x, "id": i} for i, x in enumerate(ids)], 1, 1024,
                     schema=schema, blob_fields=["input_ids"])  # fmt: skip
    m = prepare([str(base)], str(tmp_path / "o"), tokenizer=tok, log=None, options={"num_shards": 2})
    assert m["packing"]["seq_length"] == 32 and m["documents"] == 30
    for k in range(2):  # rows dealt round-robin to the output shards, in order
        got = np.asarray(IndexedDataset(str(tmp_path / f"o_{k:05d}")).tokens).reshape(-1, 33)
        np.testing.assert_array_equal(got, np.stack(ids[k::2]))
    m = prepare([str(base)], str(tmp_path / "p"), tokenizer=tok, log=None, max_documents=7,
                options={"seq_length": 32})  # fmt: skip
    assert m["documents"] == 7 and m["prepare"]["options"]["seq_length"] == 32
    np.testing.assert_array_equal(
        np.asarray(IndexedDataset(str(tmp_path / "p")).tokens), np.concatenate(ids[:7])
    )
    with pytest.raises(DataError, match="row 0 has 33 token ids: .* --seq-length 16 needs 17"):
        prepare([str(base)], str(tmp_path / "q"), tokenizer=tok, log=None, options={"seq_length": 16})
    assert not list(tmp_path.glob("q*")) and not list(tmp_path.glob(".q*"))


# ---- errors -------------------------------------------------------------------------------------------------


def _damage(case: str, tmp_path: Path) -> tuple[list[str], list[str], str]:
    """(input paths, extra flags, expected message part) of a damaged dataset."""
    rng = np.random.default_rng(2)
    rows = make_rows(30, rng)
    if case == "id >= vocab":
        rows[25]["input_ids"][7] = 600
    if case == "negative id":
        rows[3]["input_ids"][0] = -1
    if case == "rows of two lengths":
        rows[12]["input_ids"] = rows[12]["input_ids"][:40]
    paths = write_mindrecord(tmp_path / "d.mindrecord", rows, shards=2)
    h = mindrecord.read_header(paths[1])
    data = bytearray(paths[1].read_bytes())
    p1 = h.pages[1]  # the second blob page of shard 1
    at = h.header_size + p1.page_id * h.page_size
    n_json = struct.unpack("<Q", data[:8])[0]
    if case == "truncated file":
        data = data[: len(data) - 100]
    elif case == "truncated header":
        data = data[:500]
    elif case == "corrupt header json":
        data[8 + n_json // 2 : 8 + n_json // 2 + 4] = b"}}[\x00"
    elif case == "page past eof":
        header = json.loads(bytes(data[8 : 8 + n_json]))
        next(p for p in header["page"] if p["page_type"] == "BLOB_DATA" and p["page_id"] > 0)["page_id"] = 999
        text = json.dumps(header).encode()
        data[: 8 + len(text)] = struct.pack("<Q", len(text)) + text
    elif case == "row length past page":
        data[at : at + 8] = struct.pack("<Q", p1.used)
    elif case == "bad compressed ints":
        # the first row of the page: its blob's second field (input_ids) claims more elements than it has
        first_len = int.from_bytes(data[at + 8 : at + 16], "big")
        field_at = at + 16 + first_len + 8
        data[field_at : field_at + 4] = (200).to_bytes(4, "big")
    elif case == "missing shard":
        paths[0].unlink()
    paths[1].write_bytes(bytes(data))
    flags = {
        "missing field": ["--mindrecord-field", "tokens"],
        "non-integer field": ["--mindrecord-field", "image"],
    }
    messages = {
        "truncated file": "d.mindrecord1' is truncated or corrupt: page \\d+ ends at byte \\d+, past the end",
        "truncated header": "d.mindrecord1' is truncated or corrupt: its header length",
        "corrupt header json": "d.mindrecord1' is truncated or corrupt: its .*JSON header does not parse",
        "page past eof": "d.mindrecord1' is truncated or corrupt: page 999 ends at byte",
        "row length past page": f"d.mindrecord1' is truncated or corrupt: row {p1.start_row} .*runs past its page",
        "bad compressed ints": f"d.mindrecord1' is truncated or corrupt: row {p1.start_row} .*compressed-int",
        "id >= vocab": "d.mindrecord1' row 10 holds token id 600 .*vocabulary \\[0, 512\\)",
        "negative id": "d.mindrecord0' row 3 holds token id -1",
        "rows of two lengths": "d.mindrecord0' row 12 has 40 token ids",
        "missing field": "field 'tokens' is not in the schema. Fields present: labels .*input_ids",
        "non-integer field": "field 'image' has type 'bytes', not an integer array",
        "missing shard": "shard file\\(s\\) \\[.*d.mindrecord0'\\] do not exist",
    }
    return [str(paths[1])], flags.get(case, []), messages[case]


DAMAGE = ["truncated file", "truncated header", "corrupt header json", "page past eof", "row length past page",
          "bad compressed ints", "id >= vocab", "negative id", "rows of two lengths", "missing field",
          "non-integer field", "missing shard"]  # fmt: skip


@pytest.mark.parametrize("case", DAMAGE)
def test_damage_is_a_clean_error_leaving_nothing(case, tok512, tmp_path, capsys):
    import re

    inputs, flags, message = _damage(case, tmp_path)
    out = tmp_path / "outdir"
    out.mkdir()
    code, err = run_cli(
        ["--input", *inputs, "--output", str(out / "ds"), "--tokenizer", tok512, *flags], capsys
    )
    assert code == 2 and "Traceback" not in err
    assert re.search(message, err), err
    assert list(out.iterdir()) == []
    with pytest.raises(DataError):
        prepare(
            inputs, str(out / "ds"), tokenizer=tok512, log=None, mindrecord_field=(flags or [None, None])[1]
        )
    assert list(out.iterdir()) == []


def test_text_options_are_refused(dataset, tok512, tmp_path, capsys):
    paths, _ = dataset
    out = str(tmp_path / "x")
    code, err = run_cli(["--input", str(paths[0]), "--output", out, "--tokenizer", tok512, "--clean",
                         "--dedup", "exact"], capsys)  # fmt: skip
    assert code == 2 and "--clean, --dedup do(es) not apply to a MindRecord input" in err
    code, err = run_cli(["--input", str(paths[0]), "--output", out, "--train-tokenizer", "300"], capsys)
    assert code == 2 and "--train-tokenizer" in err
    text = tmp_path / "t.jsonl"
    text.write_text('{"text": "hello"}\n')
    code, err = run_cli(["--input", str(paths[0]), str(text), "--output", out, "--tokenizer", tok512], capsys)
    assert code == 2 and "mixes MindRecord files" in err
    code, err = run_cli(["--input", str(text), "--output", out, "--tokenizer", tok512,
                         "--mindrecord-field", "input_ids"], capsys)  # fmt: skip
    assert code == 2 and "applies to MindRecord inputs only" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]

"""MindRecord input against files MindSpore itself wrote: ``tests/fixtures/mindrecord`` holds a 2-shard dataset
written by mindspore 2.10.0's ``FileWriter`` (MindFormers' pretraining shape: int32 ``input_ids``, 65 ids per
row) and the rows its ``FileReader`` returned; ``prepare`` must reproduce them exactly, in order. The fixture's
generator is ``tests/fixtures/mindrecord/make_fixture.py``; these tests do not need mindspore."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from llmtrain.cli import main as cli_main
from llmtrain.data.indexed import IndexedDataset
from llmtrain.data.manifest import read_manifest
from llmtrain.data.prep import mindrecord

FIXTURE = Path(__file__).parent / "fixtures" / "mindrecord"
SHARDS = [FIXTURE / "pretrain.mindrecord0", FIXTURE / "pretrain.mindrecord1"]
ROWS, ROW = 480, 65


@pytest.fixture(scope="module")
def reference() -> dict:
    """The fixture's metadata and its rows as mindspore's FileReader returned them ([480, 65] int64)."""
    with gzip.open(FIXTURE / "pretrain_rows.json.gz", "rt") as f:
        ref = json.load(f)
    ref["rows"] = np.asarray(ref["rows"], dtype=np.int64)
    return ref


@pytest.fixture(scope="module")
def tok512(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 512)}}
    path = tmp_path_factory.mktemp("tok") / "wl512.json"
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(path))
    return str(path)


def test_fixture_is_mindspore_written_and_multi_page(reference):
    assert reference["mindspore"] == "2.10.0" and reference["rows"].shape == (ROWS, ROW)
    assert int(reference["rows"].min()) >= 0 and int(reference["rows"].max()) < 512
    headers = [mindrecord.read_header(p) for p in SHARDS]
    assert [h.shard_id for h in headers] == [0, 1]
    assert all(h.shard_addresses == [p.name for p in SHARDS] for h in headers)
    assert all((h.header_size, h.page_size) == (16384, 32768) for h in headers)
    assert all(h.schema == {"input_ids": {"shape": [-1], "type": "int32"}} for h in headers)
    assert [h.rows for h in headers] == [240, 240]
    # two blob pages per shard with FileWriter's raw page (page 1) between them; the last page is cut short
    assert [[(p.page_id, p.start_row, p.end_row) for p in h.pages] for h in headers] == [
        [(0, 0, 229), (2, 229, 240)],
        [(0, 0, 230), (2, 230, 240)],
    ]
    assert [h.size for h in headers] == [83481, 83354]
    assert all(h.size == h.header_size + 2 * h.page_size + h.pages[-1].used for h in headers)
    assert all(mindrecord.is_mindrecord(p) for p in SHARDS)


def test_reader_rows_equal_filereader(reference):
    for given in SHARDS:  # either shard's name finds both, in shard order
        shards = mindrecord.dataset_shards(mindrecord.read_header(given))
        assert [h.path for h in shards] == SHARDS
        got = list(mindrecord.iter_rows(shards, "input_ids"))
        assert [row for _, row, _ in got] == [*range(240)] * 2
        np.testing.assert_array_equal(np.stack([ids for _, _, ids in got]), reference["rows"])


def test_prepare_tokens_equal_filereader(reference, tok512, tmp_path, capsys):
    out = tmp_path / "out" / "pretrain"
    assert cli_main(["prepare", "--input", str(SHARDS[1]), "--output", str(out), "--tokenizer", tok512]) == 0
    ds = IndexedDataset(str(out))
    assert ds.dtype == np.uint16 and len(ds) == ROWS
    np.testing.assert_array_equal(ds.sizes, np.full(ROWS, ROW))
    np.testing.assert_array_equal(np.asarray(ds.tokens).reshape(ROWS, ROW), reference["rows"])
    m = read_manifest(str(out))
    assert m["packing"] == {"mode": "bestfit", "seq_length": 64, "prepacked": "mindrecord"}
    assert (m["documents"], m["tokens"]) == (ROWS, ROWS * ROW)
    assert m["report"]["mindrecord"]["shards"] == [p.name for p in SHARDS]
    assert m["report"]["mindrecord"]["rows"] == ROWS and m["report"]["mindrecord"]["field_type"] == ["int32"]
    # a glob matching the data files and their .db index gives the same dataset (nothing to redo)
    glob_out = tmp_path / "glob" / "pretrain"
    code = cli_main(["prepare", "--input", f"{FIXTURE}/pretrain.mindrecord*", "--output", str(glob_out),
                     "--tokenizer", tok512])  # fmt: skip
    assert code == 0
    np.testing.assert_array_equal(np.asarray(IndexedDataset(str(glob_out)).tokens), np.asarray(ds.tokens))

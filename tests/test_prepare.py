"""``prepare``: token counts per input format, workers, atomic output, the error cases, the real corpus."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from llmtrain.commands.prepare import add_arguments, main
from llmtrain.data.indexed import IndexedDataset
from llmtrain.data.manifest import read_manifest, tokenizer_path
from llmtrain.data.prep.prepare import prepare
from llmtrain.data.prep.tokenizer_training import train_bpe
from llmtrain.data.tokenizer import load_tokenizer, sha256_file
from llmtrain.errors import DataError

SHARED = Path(__file__).resolve().parents[2] / "shared"
DOCS = [
    "The first document talks about whales and the sea.",
    "第二篇文档：学而时习之，不亦说乎？",
    "def third(x):\n    return x + 1\n",
    "A fourth one, short.",
]


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "bpe.json"
    train_bpe(iter(DOCS * 3), 320, str(path))
    return str(path)


def write_jsonl(path: Path, records: list, gz: bool = False) -> Path:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(("out", ".out")))


def test_formats_and_token_counts(tmp_path, tok_file):
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    write_jsonl(src / "b.jsonl", [{"text": DOCS[0]}, {"text": ""}, {"text": DOCS[1], "source": "x"}])
    write_jsonl(src / "sub" / "a.jsonl.gz", [{"text": DOCS[2]}], gz=True)
    (src / "c.txt").write_text(DOCS[3] + "\n" + DOCS[0], encoding="utf-8")
    (src / "ignored.md").write_text("not picked up from a directory")
    script = tmp_path / "script.py"
    script.write_text("print('hello')\n")
    logs: list[str] = []
    out = tmp_path / "out" / "ds"
    manifest = prepare([str(src), str(script)], str(out), tokenizer=tok_file, log=logs.append)

    tok = load_tokenizer(tok_file)
    # directory order is sorted by relative path: b.jsonl, c.txt, sub/a.jsonl.gz; then script.py
    expected_docs = [DOCS[0], DOCS[1], DOCS[3] + "\n" + DOCS[0], DOCS[2], "print('hello')\n"]
    expected = [tok.encode(d) + [tok.eos_id] for d in expected_docs]
    ds = IndexedDataset(str(out))
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert manifest["documents"] == 5
    assert manifest["tokens"] == sum(len(tok.encode(d)) + 1 for d in expected_docs)
    assert manifest["dtype"] == "uint16" and ds.dtype == np.uint16
    assert manifest["tokenizer"]["eos_id"] == 0 and manifest["tokenizer"]["vocab_size"] == 320
    assert manifest["tokenizer"]["sha256"] == sha256_file(tok_file)
    assert manifest["files"]["bin"] == {
        "name": "ds.bin",
        "bytes": (out.parent / "ds.bin").stat().st_size,
        "sha256": sha256_file(out.parent / "ds.bin"),
    }
    assert manifest["files"]["idx"]["sha256"] == sha256_file(out.parent / "ds.idx")
    assert read_manifest(str(out)) == manifest
    assert tokenizer_path(str(out)) == out.parent / "ds.tokenizer.json"
    assert sha256_file(tokenizer_path(str(out))) == sha256_file(tok_file)
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "ds.bin", "ds.idx", "ds.manifest.json", "ds.report.txt", "ds.tokenizer.json"
    ]  # fmt: skip
    assert len(logs) == 1 and "5 documents" in logs[0] and f"{manifest['tokens']:,} tokens" in logs[0]


def test_max_documents_and_train_tokenizer(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"body": d} for d in DOCS * 5])
    m = prepare(
        [str(f)], str(tmp_path / "out"), train_tokenizer=300, text_key="body", max_documents=7, log=None
    )
    assert m["documents"] == 7
    assert m["tokenizer"]["kind"] == "hf" and m["tokenizer"]["vocab_size"] == 300
    tok = load_tokenizer(str(tmp_path / "out.tokenizer.json"))
    ds = IndexedDataset(str(tmp_path / "out"))
    assert tok.decode(ds[1][:-1].tolist()) == DOCS[1]
    assert int(ds[1][-1]) == tok.eos_id == 0
    assert m["tokens"] == sum(len(tok.encode(d)) + 1 for d in (DOCS * 5)[:7])


def test_workers_output_identical(tmp_path, tok_file):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": f"{d} #{i}"} for i, d in enumerate(DOCS * 150)])
    m1 = prepare([str(f)], str(tmp_path / "one"), tokenizer=tok_file, workers=1, log=None)
    m2 = prepare([str(f)], str(tmp_path / "two"), tokenizer=tok_file, workers=2, log=None)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"two{suffix}").read_bytes()
    assert m1["documents"] == m2["documents"] == 600
    assert m1["files"]["bin"]["sha256"] == m2["files"]["bin"]["sha256"]


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], dict, str]]:
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"text": "fine"}])
    utf = tmp_path / "utf.jsonl"
    utf.write_bytes(b'{"text": "a"}\n{"text": "\xff\xfe"}\n')
    nojson = tmp_path / "nojson.jsonl"
    nojson.write_text('{"text": "a"}\n\n{"text": broken\n')
    nokey = write_jsonl(tmp_path / "nokey.jsonl", [{"text": "a"}, {"content": "b"}])
    whole = gzip.compress("".join(json.dumps({"text": f"doc {i} " * 50}) + "\n" for i in range(200)).encode())
    trunc = tmp_path / "trunc.jsonl.gz"
    trunc.write_bytes(whole[: len(whole) // 2])
    badtxt = tmp_path / "bad.txt"
    badtxt.write_bytes(b"line one\nline two\nbad \xc3\x28 here\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    return {
        "missing input": ([str(tmp_path / "nope.jsonl")], {}, "nope.jsonl' does not exist"),
        "invalid utf-8": ([str(utf)], {}, "utf.jsonl' line 2 is not valid UTF-8"),
        "invalid utf-8 txt": ([str(badtxt)], {}, "bad.txt' line 3 is not valid UTF-8"),
        "non-json line": ([str(ok), str(nojson)], {}, "nojson.jsonl' line 3 is not valid JSON"),
        "missing key": ([str(nokey)], {}, "nokey.jsonl' line 2 has no 'text' field"),
        "truncated gz": (
            [str(trunc)],
            {},
            r"trunc.jsonl.gz' is a truncated or corrupt gzip file: .* after line \d+",
        ),
        "no documents": ([str(empty)], {}, "No documents found"),
        "tokenizer missing": ([str(ok)], {"tokenizer": str(tmp_path / "t.json")}, "t.json' does not exist"),
        "both": ([str(ok)], {"train_tokenizer": 300}, "exactly one of --tokenizer"),
        "neither": ([str(ok)], {"tokenizer": None}, "got neither"),
    }


CASES = [
    "missing input", "invalid utf-8", "invalid utf-8 txt", "non-json line", "missing key", "truncated gz",
    "no documents", "tokenizer missing", "both", "neither",
]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_errors_leave_nothing_behind(tmp_path, tok_file, case):
    inputs, kwargs, message = _bad_inputs(tmp_path)[case]
    kwargs = {"tokenizer": tok_file, **kwargs}
    out = tmp_path / "outdir"
    out.mkdir()
    with pytest.raises(DataError, match=message):
        prepare(inputs, str(out / "out"), log=None, **kwargs)
    assert list(out.iterdir()) == []


def test_failed_rerun_keeps_no_half_output(tmp_path, tok_file):
    good = write_jsonl(tmp_path / "g.jsonl", [{"text": "x"}])
    prepare([str(good)], str(tmp_path / "out"), tokenizer=tok_file, log=None)
    before = leftovers(tmp_path)
    bad = tmp_path / "b.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(DataError):
        prepare([str(bad)], str(tmp_path / "out"), tokenizer=tok_file, log=None)
    assert leftovers(tmp_path) == before  # old complete dataset untouched, no temporary files


def test_cli_flags(tmp_path, tok_file):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--input", str(f), "--output", str(tmp_path / "cli"), "--tokenizer", tok_file])
    assert args.workers == 1 and args.text_key == "text" and args.train_tokenizer is None
    assert main(args) == 0
    assert read_manifest(str(tmp_path / "cli"))["documents"] == 4


def test_real_corpus_sentencepiece(tmp_path):
    corpus = SHARED / "corpus" / "code.jsonl.gz"
    model = SHARED / "tokenizers" / "mistral_v1_sentencepiece.model"
    if not corpus.is_file() or not model.is_file():
        pytest.skip(f"shared corpus/tokenizer not present under {SHARED}")
    m = prepare([str(corpus)], str(tmp_path / "code"), tokenizer=str(model), max_documents=12, log=None)
    tok = load_tokenizer(str(model))
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(12), f)]
    assert m["documents"] == 12
    assert m["tokens"] == sum(len(tok.encode(t)) + 1 for t in texts)
    assert m["dtype"] == "uint16" and m["tokenizer"]["eos_id"] == 2 and m["tokenizer"]["bos_id"] == 1
    assert (tmp_path / "code.tokenizer.model").read_bytes() == model.read_bytes()
    ds = IndexedDataset(str(tmp_path / "code"))
    assert ds[0].tolist() == tok.encode(texts[0]) + [2]

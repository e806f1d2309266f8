"""The prepare pipeline: bad input (raise / skip), shards read back independently, resume, tokenizer mismatch,
partitions + merge with cross-partition dedup, multi-shard bestfit output."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

import llmtrain.data.prep.parts as prep
from conftest import read_megatron
from llmtrain.data.manifest import read_manifest
from llmtrain.data.prep.merge import merge
from llmtrain.data.prep.prepare import prepare
from llmtrain.data.prep.tokenizer_training import train_bpe
from llmtrain.data.tokenizer import load_tokenizer
from llmtrain.errors import DataError

TEXTS = [f"Document number {i} talks about {w} and {w}s near the river." for i, w in
         enumerate(["whales", "boats", "stones", "trees", "birds", "clouds"] * 4)]  # fmt: skip


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "bpe.json"
    train_bpe(iter(TEXTS * 2), 400, str(path))
    return str(path)


def jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def test_bad_input_skip_counts(tmp_path, tok_file):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "good one"}\n{"text": "\xff"}\n{broken\n{"other": 1}\n{"text": "good two"}\n')
    whole = gzip.compress("".join(json.dumps({"text": f"doc {i} " * 40}) + "\n" for i in range(300)).encode())
    trunc = tmp_path / "trunc.jsonl.gz"
    trunc.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match="bad.jsonl' line 2 is not valid UTF-8"):
        prepare([str(bad)], str(tmp_path / "o1"), tokenizer=tok_file, log=None)
    m = prepare([str(bad), str(trunc)], str(tmp_path / "o2"), tokenizer=tok_file, log=None,
                options={"on_error": "skip"})  # fmt: skip
    errors = m["report"]["errors_skipped"]
    assert errors == {"invalid_utf8": 1, "invalid_json": 1, "missing_key": 1, "truncated_file": 1}
    assert 2 < m["documents"] < 300  # the two good lines and the lines before the damage
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_zst_without_zstandard_is_clear(tmp_path, tok_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # `import zstandard` now raises ImportError
    z = tmp_path / "a.jsonl.zst"
    z.write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(DataError, match="zstandard"):
        prepare([str(z)], str(tmp_path / "o"), tokenizer=tok_file, log=None)


def test_shards_read_back_independently(tmp_path, tok_file):
    f = jsonl(tmp_path / "a.jsonl", TEXTS)
    m = prepare([str(f)], str(tmp_path / "ds"), tokenizer=tok_file, log=None,
                options={"num_shards": 3, "seq_length": 16})  # fmt: skip
    tok = load_tokenizer(tok_file)
    expected = [tok.encode(t) + [tok.eos_id] for t in TEXTS]
    shards = [read_megatron(str(tmp_path / s["name"])) for s in m["shards"]]
    assert [s["name"] for s in m["shards"]] == ["ds_00000", "ds_00001", "ds_00002"]
    # documents are dealt round-robin: shard i holds documents i, i+3, ...
    assert [doc for i in range(len(TEXTS)) for doc in [shards[i % 3][i // 3]]] == expected
    assert m["tokens"] == sum(map(len, expected)) and m["documents"] == len(TEXTS)


def test_bestfit_output_and_report(tmp_path, tok_file):
    f = jsonl(tmp_path / "a.jsonl", TEXTS * 3)
    kw = dict(tokenizer=tok_file, log=None)
    concat = prepare([str(f)], str(tmp_path / "c"), options={"seq_length": 24}, **kw)
    best = prepare([str(f)], str(tmp_path / "b"), options={"seq_length": 24, "pack": "bestfit"}, **kw)
    assert best["report"]["pack"]["truncated_documents"] < concat["report"]["pack"]["truncated_documents"]
    assert best["tokens"] == concat["tokens"]
    bins = read_megatron(str(tmp_path / "b"))
    assert all(len(b) <= 25 for b in bins) and sum(map(len, bins)) == best["tokens"]
    text = (tmp_path / "b.report.txt").read_text()
    assert "truncated documents" in text and "padding" in text


def test_dedup_and_rejects(tmp_path, tok_file):
    docs = [" ".join(f"w{i}x{j}" for j in range(80)) + "." for i in range(5)]
    f = jsonl(tmp_path / "a.jsonl", docs + [docs[0], docs[1] + "  ", "short one."])
    m = prepare([str(f)], str(tmp_path / "d"), tokenizer=tok_file, log=None,
                options={"clean": True, "filter": True, "dedup": "near", "rejects": str(tmp_path / "rej.jsonl")})  # fmt: skip
    assert m["documents"] == 5
    stages = m["report"]["stages"]
    assert stages["dedup"]["removed"] == {"exact_duplicate": 2}
    assert stages["filter"]["removed"] == {"too_short": 1}
    rows = [json.loads(x) for x in (tmp_path / "rej.jsonl").read_text().splitlines()]
    assert sorted(r["reason"] for r in rows) == ["exact_duplicate", "exact_duplicate", "too_short"]
    assert {r["line"] for r in rows} == {6, 7, 8}


def test_resume_skips_finished_parts(tmp_path, tok_file, monkeypatch):
    files = [jsonl(tmp_path / f"in{i}.jsonl", TEXTS[i * 6 : (i + 1) * 6]) for i in range(4)]
    inputs = [str(f) for f in files]
    reference = prepare(inputs, str(tmp_path / "ref"), tokenizer=tok_file, log=None)
    calls: list[int] = []
    real = prep._run_part

    def dying(k, *args):
        calls.append(k)
        if k == 2 and len(calls) == 3:
            raise KeyboardInterrupt  # killed while working on the third file
        return real(k, *args)

    monkeypatch.setattr(prep, "_run_part", dying)
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, str(tmp_path / "out"), tokenizer=tok_file, log=None)
    assert not (tmp_path / "out.manifest.json").exists()  # nothing looks complete
    m = prepare(inputs, str(tmp_path / "out"), tokenizer=tok_file, log=None)
    assert calls == [0, 1, 2, 2, 3]  # parts 0 and 1 were not redone
    assert m["files"]["bin"]["sha256"] == reference["files"]["bin"]["sha256"]
    assert prepare(inputs, str(tmp_path / "out"), tokenizer=tok_file, log=None) == m  # complete: no-op
    assert calls == [0, 1, 2, 2, 3]


def test_tokenizer_mismatch_with_existing_output(tmp_path, tok_file):
    f = jsonl(tmp_path / "a.jsonl", TEXTS)
    prepare([str(f)], str(tmp_path / "ds"), tokenizer=tok_file, log=None)
    other = tmp_path / "other.json"
    train_bpe(iter(TEXTS), 300, str(other))
    with pytest.raises(DataError, match="another tokenizer"):
        prepare([str(f)], str(tmp_path / "ds"), tokenizer=str(other), log=None)
    m = prepare([str(f)], str(tmp_path / "ds"), tokenizer=str(other), log=None, overwrite=True)
    assert read_manifest(str(tmp_path / "ds"))["tokenizer"]["sha256"] == m["tokenizer"]["sha256"]


@pytest.mark.parametrize("dedup", ["none", "exact"])
def test_partitions_merge_equals_one_process_bytes(tmp_path, tok_file, dedup):
    """N partitions + merge write the one-process dataset byte for byte: merge interleaves each input file's
    parts back by id (file, line). Exact duplicates within and across files and partitions, a blank line, a
    whole-file document; the manifests differ only in prepare.key (the partition is in the job's identity) and
    the report (per-partition sums, cross-partition removals)."""
    docs = [f"{t} ({i})" for i, t in enumerate(TEXTS[:11])]
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:6] + docs[1:2] + docs[6:8]) + "\n")
    (tmp_path / "b.txt").write_text(docs[3])  # one document: an exact copy of a's 4th
    c = jsonl(tmp_path / "c.jsonl", [docs[0], *docs[8:], docs[9], docs[5]])
    inputs = [str(a), str(tmp_path / "b.txt"), str(c)]
    opts = {"dedup": dedup, "num_shards": 2}
    one = prepare(inputs, str(tmp_path / "one/ds"), tokenizer=tok_file, log=None, options=opts)
    for i in range(3):
        prepare(inputs, str(tmp_path / "p/ds"), tokenizer=tok_file, log=None, options=opts, partition=(i, 3))
    merged = merge(str(tmp_path / "p/ds"), log=None)
    assert one["documents"] == merged["documents"] == (11 if dedup == "exact" else 16)
    for shard in ("ds_00000", "ds_00001"):
        for ext in (".bin", ".idx"):
            assert (tmp_path / "p" / f"{shard}{ext}").read_bytes() == (
                tmp_path / "one" / f"{shard}{ext}"
            ).read_bytes()
    one, merged = read_manifest(str(tmp_path / "one/ds")), read_manifest(str(tmp_path / "p/ds"))
    differ = {"prepare", "report", "manifest_sha256"}
    assert {k: v for k, v in one.items() if k not in differ} == {
        k: v for k, v in merged.items() if k not in differ
    }
    assert one["prepare"]["options"] == merged["prepare"]["options"]
    if dedup == "none":  # ids mean "file k, line": partitions of other --input lists do not merge
        for i, given in enumerate((inputs, inputs[:2])):
            prepare(
                given, str(tmp_path / "q/ds"), tokenizer=tok_file, log=None, options=opts, partition=(i, 2)
            )
        with pytest.raises(
            DataError, match="1-of-2' was prepared from other inputs than .*0-of-2' \\(2 vs 3 files"
        ):
            merge(str(tmp_path / "q/ds"), log=None)


def test_partitions_merge_with_cross_partition_dedup(tmp_path, tok_file):
    docs = [" ".join(f"t{i}y{j}" for j in range(60)) for i in range(10)]
    inputs = [str(jsonl(tmp_path / "a.jsonl", docs + docs[:4]))]  # 4 duplicates, in the other partitions
    opts = {"dedup": "near", "num_shards": 2}
    single = prepare(inputs, str(tmp_path / "single"), tokenizer=tok_file, log=None, options=opts)
    for i in range(3):
        prepare(inputs, str(tmp_path / "p"), tokenizer=tok_file, log=None, options=opts, partition=(i, 3))
    merged = merge(str(tmp_path / "p"), log=None)
    assert single["documents"] == merged["documents"] == 10
    assert merged["report"]["cross_partition"] == {"cross_partition_exact_duplicate": 4}
    assert not (tmp_path / "p.partitions").exists()
    with pytest.raises(DataError, match="No partitions"):
        merge(str(tmp_path / "p"), log=None)

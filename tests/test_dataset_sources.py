"""Dataset sources and verification: plain Megatron ``.bin/.idx`` (no manifest) + ``data.tokenizer``, our shards
read by Megatron, and the checks before training (sha256 of a manifest dataset, token ids within the vocabulary).

Megatron datasets are written by megatron-core's own ``IndexedDatasetBuilder`` when it is importable (on this
machine megatron-core 0.16.1: 0.19.2 needs Python >= 3.12), else by :func:`spec_write`, a writer of the
MMIDIDX layout written here from the format description, independent of ``llmtrain.data.indexed``. When both
are available they are checked byte for byte against each other. Commands run through ``llmtrain.cli.main``.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from llmtrain.cli import main as cli
from llmtrain.data.indexed import IndexedDataset, IndexedDatasetWriter
from llmtrain.data.loader import BatchIterator, build_datasets
from llmtrain.data.manifest import manifest_path, read_manifest, write_json_atomic
from llmtrain.data.tokenizer import sha256_file

SHARED_SP = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "mistral_v1_sentencepiece.model"
SEQ = 16


def megatron_indexed():
    """megatron.core.datasets.indexed_dataset, or None when megatron-core is not importable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    except Exception:  # not installed, or its imports fail on this machine
        return None
    return indexed_dataset


SPEC_CODES = {
    "uint8": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "float64": 6,
    "float32": 7,
    "uint16": 8,
}


def spec_write(prefix: str, docs: list[list[int]], lengths: list[list[int]], dtype: str) -> None:
    """MMIDIDX from the format description: header, int32 lengths, int64 byte pointers, int64 document ends."""
    flat = [n for ls in lengths for n in ls]
    size = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(flat)[:-1] * size]).astype("<i8")
    doc_index = np.concatenate([[0], np.cumsum([len(ls) for ls in lengths])]).astype("<i8")
    Path(f"{prefix}.bin").write_bytes(b"".join(np.asarray(d, dtype=dtype).tobytes() for d in docs))
    head = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, SPEC_CODES[dtype], len(flat), len(doc_index))
    body = np.asarray(flat, "<i4").tobytes() + pointers.tobytes() + doc_index.tobytes()
    Path(f"{prefix}.idx").write_bytes(head + body)


def megatron_write(prefix: str, docs: list[list[int]], lengths: list[list[int]], dtype: str) -> str:
    """The dataset written by megatron-core's builder (else :func:`spec_write`); returns which wrote it."""
    mi = megatron_indexed()
    if mi is None:
        spec_write(prefix, docs, lengths, dtype)
        return "spec"
    builder = mi.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.dtype(dtype).type)
    for doc, ls in zip(docs, lengths):
        builder.add_document(np.asarray(doc), ls)  # the builder takes anything numpy.array converts
    builder.finalize(f"{prefix}.idx")
    return "megatron-core"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE trained here (llmtrain's trainer; only its vocabulary size and EOS matter)."""
    from llmtrain.data.prep.tokenizer_training import train_bpe

    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:6]
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
    return train_bpe(texts, 300, str(tmp_path_factory.mktemp("tok") / "tok.json"))


def documents(vocab: int, eos: int, n: int = 48, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` documents ending in EOS whose first two ids are a unique pair (so a stream of them parses back),
    every third one split into 2-3 sequences (Megatron's --split-sentences), with their sequence lengths."""
    rng = np.random.default_rng(seed)
    pool = np.asarray([i for i in range(vocab) if i != eos])
    docs, lengths = [], []
    for d in range(n):
        body = rng.choice(pool, size=int(rng.integers(3, 40))).tolist()
        doc = [int(pool[d % 40]), int(pool[40 + d // 40]), *body, eos]
        cuts = sorted(
            rng.choice(np.arange(1, len(doc)), size=int(rng.integers(1, 3)), replace=False).tolist()
        )
        ls = np.diff([0, *cuts, len(doc)]).tolist() if d % 3 == 0 else [len(doc)]
        docs.append(doc)
        lengths.append(ls)
    return docs, lengths


def parse_stream(stream: list[int], docs: list[list[int]]) -> list[int]:
    """Indices of the whole documents ``stream`` is the concatenation of (the last one may be cut short)."""
    by_key = {(d[0], d[1]): i for i, d in enumerate(docs)}
    out, p = [], 0
    while p < len(stream):
        rest = stream[p:]
        i = (
            by_key.get(tuple(rest[:2]))
            if len(rest) >= 2
            else next(j for j, d in enumerate(docs) if d[0] == rest[0])
        )
        assert i is not None, f"position {p}: {rest[:2]} starts no document"
        doc = docs[i]
        assert rest[: len(doc)] == doc[: len(rest)], f"document {i} is not whole at position {p}"
        out.append(i)
        p += len(doc)
    return out


def run_config(tmp_path: Path, datasets: list[str], tokenizer: str | None, **data) -> str:
    cfg = {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": SEQ},
        "train": {"batch_size": 4, "micro_batch_size": 2, "max_steps": 2, "lr": 1e-3, "min_lr": 1e-4,
                  "warmup_steps": 1, "log_steps": 1, "eval_steps": 0, "seed": 3},
        "data": {"datasets": [{"path": p, "weight": 1.0} for p in datasets], "valid_fraction": 0.1,
                 **({"tokenizer": tokenizer} if tokenizer else {}), **data},
        "checkpoint": {"save_steps": 0, "save_at_end": False},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"eval_iters": 1},
        "run": {"device_target": "cpu", "output_dir": str(tmp_path / "run")},
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return str(path)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return code, out, err


def refused(capsys, config: str) -> str:
    """Both `check` and `train` exit 2 with the same one-paragraph error; returns it."""
    code_c, _, err_c = run_cli(capsys, "check", config)
    code_t, _, err_t = run_cli(capsys, "train", config)
    assert (code_c, code_t) == (2, 2), (err_c, err_t)
    message = err_c.split("error: ", 1)[1]
    assert err_t.split("error: ", 1)[1] == message
    return message


# ------------------------------------------------------------------------------------ Megatron, no manifest


def test_megatron_dataset_with_tokenizer_checks_and_trains(tmp_path, tokenizer, capsys):
    docs, lengths = documents(tokenizer.vocab_size, tokenizer.eos_id)
    prefix = str(tmp_path / "mega")
    megatron_write(prefix, docs, lengths, "uint16")
    ds = IndexedDataset(prefix)
    assert len(ds) == sum(map(len, lengths)) > len(docs) == ds.num_documents  # sentence-split documents
    assert ds.dtype == np.uint16 and not manifest_path(prefix).exists()
    config = run_config(tmp_path, [prefix], tokenizer.path)

    code, out, _ = run_cli(capsys, "check", config)
    assert code == 0
    assert f"vocab {tokenizer.vocab_size}," in out  # the tokenizer's vocabulary, not the flavor's 512
    stamp = json.loads(Path(f"{prefix}.verified.json").read_text())
    assert stamp["files"]["mega.bin"]["sha256"] == sha256_file(f"{prefix}.bin")
    flat = [t for d in docs for t in d]
    assert (stamp["files"]["mega.bin"]["min_id"], stamp["files"]["mega.bin"]["max_id"]) == (
        min(flat),
        max(flat),
    )

    from llmtrain.config import load_config

    cfg, _ = load_config(config)
    train, valid = build_datasets(cfg)
    source = train.sources[0]
    assert source.eos_id == tokenizer.eos_id
    n = len(source)
    windows = [source.window(i, 0).tolist() for i in range(n)]  # stream order of epoch 0
    assert all(len(w) == SEQ + 1 and w[-1] == nxt[0] for w, nxt in zip(windows, windows[1:]))
    stream = [t for w in windows for t in w[:-1]] + windows[-1][-1:]
    parsed = parse_stream(stream, docs)  # whole documents, sentences in order, each at most once
    assert len(set(parsed)) == len(parsed)
    held_out = {int(i) for i in valid.sources[0].documents}
    assert held_out and not set(parsed) & held_out
    unread = set(range(len(docs))) - held_out - set(parsed)  # only the tail that makes no whole window
    assert sum(len(docs[i]) for i in unread) < SEQ
    assert len(stream) == n * SEQ + 1
    # the first step's batch holds these windows, in the epoch's shuffled order
    batch = BatchIterator(train, 4, 2).next_step()
    rows = [r for mb in batch for r in mb["input_ids"].tolist()]
    assert rows == [w[:-1] for w in (source.sample(k).tolist() for k in range(4))]
    assert all(r in [w[:-1] for w in windows] for r in rows)

    code, out, _ = run_cli(capsys, "train", config)
    assert code == 0
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert abs(losses[0] - np.log(tokenizer.vocab_size)) < 0.5  # an untrained model over this vocabulary


def test_missing_tokenizer_is_refused_naming_the_prefix(tmp_path, tokenizer, capsys):
    docs, lengths = documents(tokenizer.vocab_size, tokenizer.eos_id, n=12)
    prefix = str(tmp_path / "nomanifest")
    megatron_write(prefix, docs, lengths, "uint16")
    message = refused(capsys, run_config(tmp_path, [prefix], None))
    assert f"data.datasets[0].path = '{prefix}'" in message and "set data.tokenizer" in message.lower()


def test_ids_above_the_vocabulary_are_refused(tmp_path, tokenizer, capsys):
    vocab = tokenizer.vocab_size
    docs, lengths = documents(vocab, tokenizer.eos_id, n=12)
    docs[5][3] = vocab + 7  # one id past the tokenizer's vocabulary
    prefix = str(tmp_path / "wide")
    megatron_write(prefix, docs, lengths, "uint16")
    message = refused(capsys, run_config(tmp_path, [prefix], tokenizer.path))
    assert (
        f"token id {vocab + 7}" in message
        and f"vocabulary of {vocab} tokens" in message
        and prefix in message
    )

    # the same for a dataset with our manifest (its recorded vocabulary bounds the ids)
    ours = str(tmp_path / "ours")
    w = IndexedDatasetWriter(ours, np.dtype("uint16"))
    for d in docs:
        w.add_document(d)
    w.finalize()
    write_manifest(ours, docs, vocab=vocab, eos=tokenizer.eos_id)
    message = refused(capsys, run_config(tmp_path, [ours], None))
    assert (
        f"token id {vocab + 7}" in message and f"vocabulary of {vocab} tokens" in message and ours in message
    )


def write_manifest(prefix: str, docs: list[list[int]], vocab: int, eos: int) -> None:
    files = {k: {"name": Path(f"{prefix}.{k}").name, "bytes": os.path.getsize(f"{prefix}.{k}"),
                 "sha256": sha256_file(f"{prefix}.{k}")} for k in ("bin", "idx")}  # fmt: skip
    write_json_atomic(
        manifest_path(prefix),
        {"format": "llmtrain.tokens", "version": 1, "dtype": "uint16", "documents": len(docs),
         "tokens": sum(map(len, docs)), "files": files, "inputs": [], "created_by": "test",
         "tokenizer": {"file": "none.json", "kind": "hf", "sha256": "f" * 64, "vocab_size": vocab,
                       "eos_id": eos, "bos_id": None}},
    )  # fmt: skip


@pytest.mark.skipif(not SHARED_SP.is_file(), reason=f"{SHARED_SP} is not on this machine")
def test_megatron_dataset_with_a_sentencepiece_model(tmp_path, capsys):
    import sentencepiece as spm

    from llmtrain.data.describe import describe_dataset

    sp = spm.SentencePieceProcessor(model_file=str(SHARED_SP))
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text(encoding="utf-8").split("\n\n")
    docs = [sp.encode(t) + [sp.eos_id()] for t in text if t.strip()][:60]
    prefix = str(tmp_path / "sp")
    megatron_write(prefix, docs, [[len(d)] for d in docs], "uint16")
    info = describe_dataset(prefix, str(SHARED_SP))
    assert (info.source, info.dtype, info.vocab_size, info.eos_id) == (
        "megatron",
        np.uint16,
        32000,
        sp.eos_id(),
    )
    assert info.tokenizer_sha256 == sha256_file(SHARED_SP)
    code, out, _ = run_cli(capsys, "check", run_config(tmp_path, [prefix], str(SHARED_SP)))
    assert code == 0 and "vocab 32000," in out


# --------------------------------------------------------------------------------- the format both ways


def test_our_shards_are_read_by_megatron(tiny_corpus):
    mi = megatron_indexed()
    if mi is None:
        pytest.skip("megatron-core is not importable here")
    theirs, ours = mi.IndexedDataset(tiny_corpus), IndexedDataset(tiny_corpus)
    assert len(theirs) == len(ours) == read_manifest(tiny_corpus)["documents"]
    assert np.array_equal(theirs.document_indices, ours.document_indices)
    assert np.array_equal(theirs.sequence_lengths, ours.sizes)
    for i in range(len(ours)):
        assert np.array_equal(theirs[i], ours[i]), i
    assert sum(int(theirs[i].size) for i in range(len(theirs))) == read_manifest(tiny_corpus)["tokens"]


def test_megatron_builder_equals_the_spec_writer(tmp_path):
    if megatron_indexed() is None:
        pytest.skip("megatron-core is not importable here")
    docs, lengths = documents(300, 0, n=20)
    for dtype in ("uint16", "int32"):
        megatron_write(str(tmp_path / f"m{dtype}"), docs, lengths, dtype)
        spec_write(str(tmp_path / f"s{dtype}"), docs, lengths, dtype)
        for suffix in (".bin", ".idx"):
            assert (
                Path(tmp_path / f"m{dtype}{suffix}").read_bytes()
                == Path(tmp_path / f"s{dtype}{suffix}").read_bytes()
            )


def test_document_view_keeps_sentence_split_documents_whole(tmp_path):
    docs, lengths = documents(300, 0, n=30)
    spec_write(str(tmp_path / "d"), docs, lengths, "int32")
    view = IndexedDataset(str(tmp_path / "d")).document_view()
    assert len(view) == view.num_documents == 30
    assert [view[i].tolist() for i in range(30)] == docs
    assert view.tokens.size == sum(map(len, docs))
    one = str(tmp_path / "one")  # one sequence per document (what `prepare` writes): the dataset itself
    spec_write(one, docs, [[len(d)] for d in docs], "int32")
    ds_one = IndexedDataset(one)
    assert ds_one.document_view() is ds_one


# ---------------------------------------------------------------------------------------- verification


@pytest.fixture
def corpus_copy(tiny_corpus, tmp_path) -> str:
    """The session's prepared corpus copied (it is shared: never damage the original)."""
    src = Path(tiny_corpus)
    for f in src.parent.glob(f"{src.name}.*"):
        if not f.name.endswith(".verified.json"):
            shutil.copy2(f, tmp_path / f.name)
    return str(tmp_path / src.name)


def flip(path: str, offset: int) -> None:
    blob = bytearray(Path(path).read_bytes())
    blob[offset] ^= 0x01
    size = len(blob)
    Path(path).write_bytes(bytes(blob))
    assert os.path.getsize(path) == size


def test_flipped_byte_in_bin_is_refused_before_and_after_a_stamp(corpus_copy, tmp_path, capsys, monkeypatch):
    from llmtrain.data import verify

    monkeypatch.setattr(verify, "_MEMO", {})
    config = run_config(tmp_path, [corpus_copy], None)
    bin_file = f"{corpus_copy}.bin"
    original = Path(bin_file).read_bytes()

    flip(bin_file, len(original) // 2)  # no stamp yet: the first use hashes the file
    message = refused(capsys, config)
    assert f"'{bin_file}' does not match its manifest" in message
    assert not Path(f"{corpus_copy}.verified.json").exists()  # a failed check stamps nothing

    Path(bin_file).write_bytes(original)
    assert run_cli(capsys, "check", config)[0] == 0
    stamp = json.loads(Path(f"{corpus_copy}.verified.json").read_text())
    manifest = read_manifest(corpus_copy)
    assert stamp["files"]["tiny.bin"]["sha256"] == manifest["files"]["bin"]["sha256"]
    assert stamp["files"]["tiny.idx"]["sha256"] == manifest["files"]["idx"]["sha256"]

    # with a stamp: an unchanged file is trusted from its size and mtime (no read) ...
    calls = []
    real = verify._full_pass
    monkeypatch.setattr(verify, "_full_pass", lambda *a: calls.append(a[0]) or real(*a))
    monkeypatch.setattr(verify, "_MEMO", {})
    assert run_cli(capsys, "check", config)[0] == 0 and calls == []
    # ... and a flipped byte (same size, a new mtime) is read again and refused, by check and by train
    stamped_ns = stamp["files"]["tiny.bin"]["mtime_ns"]
    flip(bin_file, 3)
    os.utime(bin_file, ns=(stamped_ns + 10**9, stamped_ns + 10**9))
    message = refused(capsys, config)
    assert f"'{bin_file}' does not match its manifest" in message
    assert calls == [Path(bin_file)] * 2  # read once by check, once by train; the .idx is still trusted
    assert json.loads(Path(f"{corpus_copy}.verified.json").read_text()) == stamp  # the stamp is not rewritten


def test_flipped_byte_in_idx_is_refused(corpus_copy, tmp_path, capsys):
    idx_file = f"{corpus_copy}.idx"
    n_seq = IndexedDataset(corpus_copy).sizes.size
    flip(idx_file, 34 + 4 * n_seq + 8)  # the low byte of the second sequence pointer: the header stays valid
    message = refused(capsys, run_config(tmp_path, [corpus_copy], None))
    assert f"'{idx_file}' does not match its manifest" in message


def test_foreign_stamp_is_not_overwritten(corpus_copy, tmp_path, capsys):
    foreign = Path(f"{corpus_copy}.verified.json")
    foreign.write_text('{"mine": true}\n')
    assert run_cli(capsys, "check", run_config(tmp_path, [corpus_copy], None))[0] == 0
    assert foreign.read_text() == '{"mine": true}\n'

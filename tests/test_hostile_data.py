"""Hostile data through the commands a user runs (issue 27, section 2): damaged Megatron indexes, damaged
MindRecord page tables, and ``prepare`` over bad jsonl, a damaged work folder, a ``--rejects`` naming one of
its own outputs, a full disk over an existing dataset and a work folder it did not create.

Every case asserts the exit code (2, or the documented safe result), a message naming the file, no traceback,
and that every input file (and a dataset already there) is byte-identical afterwards. Damaged Megatron files
are written here with numpy/struct from a valid one (not with llmtrain's writer).
"""

from __future__ import annotations

import errno
import glob
import hashlib
import io
import json
import os
import struct
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import yaml

from llmtrain.cli import main as cli

SEQ = 16
CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}


def digests(*paths: Path) -> dict[str, str]:
    """sha256 of every file under ``paths`` (files or folders), by path."""
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def run(args: list[str], capfd) -> tuple[int, str]:
    """``llmtrain ARGS`` in this process: (exit code, stdout + stderr)."""
    code = cli(args)
    out, err = capfd.readouterr()
    return code, out + err


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    from llmtrain.data.prep.tokenizer_training import train_bpe

    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:4]
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
    path = tmp_path_factory.mktemp("tok") / "tok.json"
    train_bpe(texts, 300, str(path))
    return str(path)


# ---------------------------------------------------------------------------------------------------------
# a. Megatron .idx files damaged but well-formed enough to be read


def megatron_parts(n_docs: int = 24, seed: int = 0) -> dict:
    """The fields of a valid MMIDIDX dataset of ``n_docs`` uint16 documents (every third split in two
    sequences, as Megatron's --split-sentences does)."""
    rng = np.random.default_rng(seed)
    lengths, doc_index, tokens = [], [0], []
    for d in range(n_docs):
        doc = rng.integers(1, 290, size=int(rng.integers(8, 40))).tolist()
        ls = [len(doc) // 2, len(doc) - len(doc) // 2] if d % 3 == 0 else [len(doc)]
        lengths += ls
        doc_index.append(len(lengths))
        tokens += doc
    sizes = np.asarray(lengths, "<i4")
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * 2)]).astype("<i8")
    return {"code": CODES["uint16"], "sizes": sizes, "pointers": pointers, "docs": np.asarray(doc_index, "<i8"),
            "bin": np.asarray(tokens, "<u2").tobytes(), "n_seq": len(sizes), "n_doc": len(doc_index),
            "tail": b""}  # fmt: skip


def write_megatron(prefix: Path, p: dict) -> None:
    """``prefix.bin/.idx`` from the fields of :func:`megatron_parts` (counts from ``n_seq``/``n_doc``)."""
    head = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, p["code"], p["n_seq"], p["n_doc"])
    body = p["sizes"].astype("<i4").tobytes() + p["pointers"].astype("<i8").tobytes() + p["docs"].tobytes()
    Path(f"{prefix}.idx").write_bytes(head + body + p["tail"])
    Path(f"{prefix}.bin").write_bytes(p["bin"])


def _damage(name: str, p: dict) -> dict:
    p = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in p.items()}
    s = p["n_seq"]
    if name == "negative length":
        p["sizes"][3] = -5
    elif name == "huge length":
        p["sizes"][3] = 2**31 - 1
    elif name == "pointer past the .bin":
        p["pointers"][-1] = len(p["bin"]) + 64
    elif name == "pointer inconsistent with the lengths":
        p["pointers"][2] += 2
    elif name == "document index unsorted":
        p["docs"][3], p["docs"][4] = p["docs"][4], p["docs"][3]
    elif name == "document index out of range":
        p["docs"][-1] = s + 7
    elif name == "float dtype code":
        p["code"] = CODES["float32"]
    elif name == "unknown dtype code":
        p["code"] = 42
    elif name == "sequence count larger than the file":
        p["n_seq"] = s + 1
    elif name == "trailing bytes in the .idx":
        p["tail"] = b"\x00" * 24
    elif name == ".bin longer than the index":
        p["bin"] = p["bin"] + b"\x01\x00" * 5
    elif name == ".bin truncated":
        p["bin"] = p["bin"][:-6]
    return p


DAMAGES = [
    "negative length", "huge length", "pointer past the .bin", "pointer inconsistent with the lengths",
    "document index unsorted", "document index out of range", "float dtype code", "unknown dtype code",
    "sequence count larger than the file", "trailing bytes in the .idx", ".bin longer than the index",
    ".bin truncated",
]  # fmt: skip


def megatron_config(tmp_path: Path, prefix: Path, tokenizer: str, steps: int = 2) -> Path:
    cfg = {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": SEQ},
        "train": {"batch_size": 2, "micro_batch_size": 2, "max_steps": steps, "lr": 1e-3, "warmup_steps": 0,
                  "log_steps": 1, "eval_steps": 0},
        "data": {"datasets": [{"path": str(prefix), "weight": 1.0}], "valid_fraction": 0.1,
                 "tokenizer": tokenizer},
        "checkpoint": {"save_steps": 0, "save_at_end": False},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": False, "eval_iters": 1},
        "run": {"device_target": "cpu", "output_dir": str(tmp_path / "run"), "threads": 1},
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_damaged_megatron_index_refused_by_check_and_train(tmp_path, tokenizer, capfd):
    good = megatron_parts()
    ok = tmp_path / "ok" / "mega"
    ok.parent.mkdir()
    write_megatron(ok, good)
    code, out = run(["check", str(megatron_config(tmp_path / "ok", ok, tokenizer))], capfd)
    assert code == 0, out
    for i, name in enumerate(DAMAGES):
        folder = tmp_path / f"d{i}"
        folder.mkdir()
        prefix = folder / "mega"
        write_megatron(prefix, _damage(name, good))
        cfg = megatron_config(folder, prefix, tokenizer)
        before = digests(folder, Path(tokenizer))
        code, out = run(["check", str(cfg)], capfd)
        assert code == 2, f"{name}: {out}"
        assert "Traceback" not in out, f"{name}: {out}"
        assert f"{prefix}.idx" in out or f"{prefix}.bin" in out, f"{name}: {out}"
        assert digests(folder, Path(tokenizer)) == before, name
        assert not Path(f"{prefix}.verified.json").exists(), name
    # train goes through the same verification: one damage, one step
    folder = tmp_path / "d0"
    before = digests(folder / "mega.bin", folder / "mega.idx")
    code, out = run(["train", str(megatron_config(folder, folder / "mega", tokenizer, 1))], capfd)
    assert code == 2 and "Traceback" not in out and f"{folder / 'mega'}.idx" in out, out
    assert "length -5" in out, out
    assert digests(folder / "mega.bin", folder / "mega.idx") == before


# ---------------------------------------------------------------------------------------------------------
# b. MindRecord page tables with empty, overlapping or duplicated pages


def _edit_pages(path: Path, edit) -> None:
    """Rewrite the JSON header of MindRecord file ``path`` with ``edit(header["page"])`` applied (same size)."""
    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(bytes(data[8 : 8 + n]))
    edit(header["page"])
    text = json.dumps(header).encode()
    data[: 8 + n] = b"\x00" * (8 + n)
    data[: 8 + len(text)] = struct.pack("<Q", len(text)) + text
    path.write_bytes(bytes(data))


def _blob(pages: list[dict]) -> list[dict]:
    return sorted((p for p in pages if p["page_type"] == "BLOB_DATA"), key=lambda p: p["page_id"])


def _drop_rows(pages):  # page 1 emptied and the rows after it renumbered: its rows silently gone
    b = _blob(pages)
    lost = b[1]["end_row_id"] - b[1]["start_row_id"]
    b[1].update(end_row_id=b[1]["start_row_id"], page_size=0)
    for p in b[2:]:
        p["start_row_id"] -= lost
        p["end_row_id"] -= lost


def _empty_tail(pages):  # one more page entry, with no rows and no bytes
    last = _blob(pages)[-1]
    pages.append({**last, "page_id": max(p["page_id"] for p in pages) + 1, "start_row_id": last["end_row_id"],
                  "page_size": 0})  # fmt: skip


def _overlap(pages):
    b = _blob(pages)
    b[2]["start_row_id"] -= 1


def _duplicate(pages):
    b = _blob(pages)
    pages.append({**b[0], "start_row_id": b[-1]["end_row_id"], "end_row_id": b[-1]["end_row_id"] + 1})


def _negative(pages):
    _blob(pages)[1]["end_row_id"] = -3


MINDRECORD_DAMAGE = {
    "empty page, rows renumbered": (_drop_rows, "blob page \\d+ is empty"),
    "empty page at the end": (_empty_tail, "blob page \\d+ is empty"),
    "overlapping rows": (_overlap, "has rows \\d+\\.\\.\\d+, not from"),
    "one page twice": (_duplicate, "two page entries have page_id"),
    "negative count": (_negative, "non-integer or negative field"),
}


def test_mindrecord_damaged_page_tables_refused(tmp_path, capfd):
    import re

    from test_mindrecord import make_rows, wordlevel_tokenizer, write_mindrecord

    tok = wordlevel_tokenizer(tmp_path / "wl.json", 512)
    for i, (name, (edit, pattern)) in enumerate(MINDRECORD_DAMAGE.items()):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        paths = write_mindrecord(folder / "d.mindrecord", make_rows(20, np.random.default_rng(i)), shards=1)
        _edit_pages(paths[0], edit)
        os.truncate(paths[0], paths[0].stat().st_size + 4 * 2048)  # a hole after the last page: still valid
        before = digests(folder, Path(tok))
        out = tmp_path / f"out{i}" / "ds"
        code, msg = run(
            ["prepare", "--input", str(paths[0]), "--output", str(out), "--tokenizer", tok], capfd
        )
        assert code == 2 and "Traceback" not in msg, f"{name}: {msg}"
        assert f"'{paths[0]}' is truncated or corrupt" in msg and re.search(pattern, msg), f"{name}: {msg}"
        assert digests(folder, Path(tok)) == before, name
        assert not out.parent.exists() or not list(out.parent.iterdir()), name


# ---------------------------------------------------------------------------------------------------------
# c. prepare: hostile jsonl, damaged work state, --rejects over its own outputs, a full disk, foreign folders

TEXTS = [
    "The first document talks about whales and the sea, at some length.",
    "A second one about ships, harbours and the weather on the coast.",
    "def third(x):\n    return x + 1\n",
    "A fourth one, short.",
]


def jsonl(path: Path, texts: list[str], repeat: int = 1) -> Path:
    path.write_text("".join(json.dumps({"text": t * repeat}) + "\n" for t in texts), encoding="utf-8")
    return path


def prep(inp: Path, out: Path, tokenizer: str, *extra: str) -> list[str]:
    return ["prepare", "--input", str(inp), "--output", str(out), "--tokenizer", tokenizer, *extra]


def test_prepare_hostile_jsonl_lines(tmp_path, tokenizer, capfd):
    bad = {
        "surrogate": '{"text": "a lone \\ud800 half of a pair"}',
        "nesting": '{"text": "deep", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "huge int": '{"text": "big", "n": ' + "9" * 5000 + "}",
    }
    for name, line in bad.items():
        inp = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        inp.write_text(jsonl(tmp_path / "good.jsonl", TEXTS).read_text() + line + "\n", encoding="utf-8")
        before = digests(inp, Path(tokenizer))
        out = tmp_path / name.replace(" ", "_") / "out"
        code, msg = run(prep(inp, out, tokenizer), capfd)
        assert code == 2 and "Traceback" not in msg and f"'{inp}' line 5" in msg, f"{name}: {msg}"
        assert not out.parent.exists() or not list(out.parent.iterdir()), name  # nothing written
        rejects = tmp_path / f"{name.replace(' ', '_')}.rejects.jsonl"
        code, msg = run(prep(inp, out, tokenizer, "--on-error", "skip", "--rejects", str(rejects)), capfd)
        assert code == 0 and "Traceback" not in msg, f"{name}: {msg}"
        report = json.loads(Path(f"{out}.manifest.json").read_text())["report"]
        reason = "invalid_unicode" if name == "surrogate" else "invalid_json"
        assert report["errors_skipped"] == {reason: 1}, (name, report["errors_skipped"])
        assert report["stages"]["tokenize"]["out"] == len(TEXTS)
        assert digests(inp, Path(tokenizer)) == before, name


def test_prepare_refuses_rejects_naming_its_own_outputs(tmp_path, tokenizer, capfd):
    inp = jsonl(tmp_path / "in.jsonl", TEXTS)
    out = tmp_path / "ds" / "out"
    out.parent.mkdir()
    before = digests(inp, Path(tokenizer))
    names = ["out.bin", "out.idx", "out.manifest.json", "out.tokenizer.json", "out.report.txt",
             "out_00001.idx", ".out.work/rejects.jsonl", "out.verified.json"]  # fmt: skip
    for name in names:
        code, msg = run(
            prep(inp, out, tokenizer, "--num-shards", "2", "--rejects", str(out.parent / name)), capfd
        )
        assert code == 2 and "Traceback" not in msg and f"--rejects {out.parent / name}" in msg, (
            f"{name}: {msg}"
        )
        assert list(out.parent.iterdir()) == [], name
    assert digests(inp, Path(tokenizer)) == before


def test_prepare_never_reuses_or_removes_a_folder_it_did_not_create(tmp_path, tokenizer, capfd):
    inp = jsonl(tmp_path / "in.jsonl", TEXTS)
    out = tmp_path / "ds" / "out"
    for folder, extra in (
        (out.parent / ".out.work", []),
        (Path(f"{out}.partitions") / "0-of-2", ["--partition", "0/2"]),
    ):
        folder.mkdir(parents=True)
        (folder / "state.json").write_text('{"key": "mine"}')
        (folder / "thesis.tex").write_text("my own work")
        before = digests(out.parent, inp)
        code, msg = run(prep(inp, out, tokenizer, *extra), capfd)
        assert code == 2 and "Traceback" not in msg and f"'{folder}'" in msg, msg
        assert digests(out.parent, inp) == before


class _DiskFull:
    """Files opened for writing under ``root`` raise ENOSPC once ``budget`` bytes were written through them."""

    def __init__(self, monkeypatch, root: Path, budget: int):
        self.root, self.budget, self.real = str(root), budget, io.open
        monkeypatch.setattr(io, "open", self.open)
        monkeypatch.setattr("builtins.open", self.open)

    def open(self, file, mode="r", *args, **kwargs):
        f = self.real(file, mode, *args, **kwargs)
        if not any(c in mode for c in "wax+") or not str(file).startswith(self.root):
            return f
        disk = self

        class Limited:
            def __getattr__(self, name):
                return getattr(f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def __iter__(self):
                return iter(f)

            def write(self, data):
                n = memoryview(data).nbytes if not isinstance(data, str) else len(data.encode())
                if n > disk.budget:
                    disk.budget = 0
                    raise OSError(errno.ENOSPC, "No space left on device")
                disk.budget -= n
                return f.write(data)

        return Limited()


def test_prepare_full_disk_keeps_the_dataset_then_damaged_state_restarts(
    tmp_path, tokenizer, capfd, monkeypatch
):
    out = tmp_path / "ds" / "out"
    first = jsonl(tmp_path / "first.jsonl", TEXTS)
    second = jsonl(tmp_path / "second.jsonl", TEXTS * 10, repeat=60)
    code, msg = run(prep(first, out, tokenizer, "--rejects", str(tmp_path / "ds" / "rejects.jsonl")), capfd)
    assert code == 0, msg
    ref = tmp_path / "ref" / "out"
    assert run(prep(second, ref, tokenizer), capfd)[0] == 0
    dataset = digests(*[p for p in out.parent.iterdir() if p.is_file()])
    inputs = digests(first, second, Path(tokenizer))
    workdir = out.parent / ".out.work"
    for budget in (0, 500, 5_000, 50_000, 120_000, 170_000):
        with monkeypatch.context() as m:
            _DiskFull(m, out.parent, budget)
            code, msg = run(prep(second, out, tokenizer), capfd)
        assert code == 2 and "Traceback" not in msg, f"{budget}: {msg}"
        assert f"--output {out}" in msg and "is unchanged" in msg, f"{budget}: {msg}"
        assert digests(*[p for p in out.parent.iterdir() if p.is_file()]) == dataset, budget
        left = {p.name for p in out.parent.iterdir()} - {".out.work"}  # the work is kept for a rerun
        assert left == {Path(k).name for k in dataset}, budget
        assert digests(first, second, Path(tokenizer)) == inputs
    # the kept work folder's state damaged in several ways: a clean restart, never a traceback
    for damage in (b"\xff\xfe\x00garbage", b"[1, 2]", b'{"key": 5}', b'{"key": "' + b"x" * 64 + b'"}'):
        (workdir / "state.json").write_bytes(damage)
        for part in workdir.glob("part-*.json"):
            part.write_bytes(b'{"read": "many"}')
        with monkeypatch.context() as m:
            _DiskFull(m, out.parent, 120_000)
            code, msg = run(prep(second, out, tokenizer), capfd)
        assert code == 2 and "Traceback" not in msg and "is unchanged" in msg, msg
    (workdir / "state.json").write_bytes(b"\x00\x01")
    code, msg = run(prep(second, out, tokenizer), capfd)
    assert code == 0 and "Traceback" not in msg, msg
    for suffix in (".bin", ".idx"):
        assert Path(f"{out}{suffix}").read_bytes() == Path(f"{ref}{suffix}").read_bytes()
    assert not workdir.exists()
    assert digests(first, second, Path(tokenizer)) == inputs


def test_merge_removes_only_the_partition_folders_prepare_made(tmp_path, tokenizer, capfd):
    inp = jsonl(tmp_path / "in.jsonl", TEXTS)
    out = tmp_path / "ds" / "out"
    code, msg = run(prep(inp, out, tokenizer, "--partition", "0/1"), capfd)
    assert code == 0, msg
    mine = Path(f"{out}.partitions") / "notes.txt"  # the user's file in the partitions folder
    mine.write_text("keep me")
    code, msg = run(["merge", "--output", str(out)], capfd)
    assert code == 0 and "Traceback" not in msg, msg
    assert Path(f"{out}.manifest.json").is_file()
    assert not (Path(f"{out}.partitions") / "0-of-1").exists() and mine.read_text() == "keep me"

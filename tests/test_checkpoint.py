"""Checkpoints: round trip of model/optimizer/RNG, atomic commit, rotation, safe loading."""

import os
import pickle
import random

import numpy as np
import pytest
import torch
from torch import nn

from llmtrain.config.schema import CheckpointConfig, FaultConfig
from llmtrain.errors import CheckpointError
from llmtrain.train.checkpoint import MARKER, Checkpointer, load_model_weights


def make(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, opt


def train_a_bit(m, opt, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(4, 5)).pow(2).sum().backward()
        opt.step()


def test_round_trip_restores_everything(tmp_path):
    m, opt = make(0)
    train_a_bit(m, opt)
    ck = Checkpointer(CheckpointConfig(keep_checkpoint_max=3), tmp_path)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path = ck.save(3, m, opt, {"step": 3, "custom": [1, 2]})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    # continue the original for two steps: the reference
    train_a_bit(m, opt, 2)
    m2, opt2 = make(1)  # different init, fresh optimizer
    state = ck.load(path, m2, opt2)
    assert state == {"step": 3, "custom": [1, 2]}
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    torch.manual_seed(123)  # same data for both continuations
    # replay: reload and run the same two steps; must equal the reference bitwise
    m3, opt3 = make(2)
    ck.load(path, m3, opt3)
    torch.manual_seed(99)
    train_a_bit(m3, opt3, 2)
    m4, opt4 = make(3)
    ck.load(path, m4, opt4)
    torch.manual_seed(99)
    train_a_bit(m4, opt4, 2)
    for a, b in zip(m3.parameters(), m4.parameters()):
        assert torch.equal(a, b)
    assert opt3.state_dict()["state"][0]["step"].item() == 5.0


def test_rotation_and_uncommitted_dirs(tmp_path):
    m, opt = make()
    ck = Checkpointer(CheckpointConfig(keep_checkpoint_max=2, resume="auto"), tmp_path)
    for s in (1, 2, 3):
        ck.save(s, m, opt, {"step": s})
    ck.wait()  # rotated-out checkpoints are uncommitted at once and deleted in the background
    names = sorted(p.name for p in ck.dir.iterdir())
    assert names == ["step_00000002", "step_00000003"]
    # a crashed save (tmp dir, or a dir without marker) is never picked up
    (ck.dir / "step_00000009.tmp").mkdir()
    (ck.dir / "step_00000010").mkdir()
    assert ck.resume_path().name == "step_00000003"
    with pytest.raises(CheckpointError, match="holds 2 committed checkpoint"):  # starting over needs the word
        Checkpointer(CheckpointConfig(resume="none"), tmp_path).resume_path()
    assert Checkpointer(CheckpointConfig(resume="none", overwrite=True), tmp_path).resume_path() is None
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        Checkpointer(CheckpointConfig(resume=str(ck.dir / "step_00000010")), tmp_path).resume_path()


def test_weights_only_load(tmp_path):
    m, opt = make(0)
    ck = Checkpointer(CheckpointConfig(), tmp_path)
    path = ck.save(1, m, opt, {"step": 1})
    m2, _ = make(4)
    load_model_weights(path, m2)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_malicious_metadata_is_refused(tmp_path):
    m, opt = make(0)
    path = Checkpointer(CheckpointConfig(), tmp_path).save(1, m, opt, {"step": 1})
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    m2, _ = make(1)
    with pytest.raises(CheckpointError, match="not allowed"):
        load_model_weights(path, m2)
    assert (path / MARKER).exists()


# ----------------------------------------------------------------------------- issue 5: checksums, fallback, async
import json  # noqa: E402
import time  # noqa: E402

from llmtrain.train.checkpoint import CHECKSUMS, verify_checkpoint  # noqa: E402
from llmtrain.train.fault import damage_file  # noqa: E402


def three_checkpoints(tmp_path, keep=3):
    m, opt = make(0)
    ck = Checkpointer(CheckpointConfig(keep_checkpoint_max=keep, resume="auto"), tmp_path)
    for s in (1, 2, 3):
        train_a_bit(m, opt, 1)
        ck.save(s, m, opt, {"step": s})
    return m, opt, ck


@pytest.mark.parametrize("mode", ["flip", "truncate"])
def test_corrupt_newest_falls_back_to_previous(tmp_path, mode):
    m, opt, ck = three_checkpoints(tmp_path)
    newest = ck.latest()
    record = json.loads((newest / CHECKSUMS).read_text())
    assert record["algorithm"] == "sha256" and ".metadata" in record["files"]
    assert all(len(v["sha256"]) == 64 for v in record["files"].values())
    damage_file(next(newest.glob("*.distcp")), mode)
    fresh = Checkpointer(ck.cfg, tmp_path)  # a new process: nothing cached
    choice = fresh.select_resume()
    assert choice.path.name == "step_00000002"
    assert len(choice.rejected) == 1 and choice.rejected[0][0] == str(newest)
    assert ("SHA-256" if mode == "flip" else "truncated") in choice.rejected[0][1]
    assert fresh.resume_notes and "step_00000003" in fresh.resume_notes[0]
    m2, opt2 = make(5)
    assert fresh.load(choice.path, m2, opt2) == {"step": 2}
    with pytest.raises(CheckpointError, match="fails verification"):
        Checkpointer(ck.cfg, tmp_path).load(newest, m2, opt2)
    explicit = Checkpointer(CheckpointConfig(resume=str(newest)), tmp_path)
    with pytest.raises(CheckpointError, match="fails verification"):
        explicit.resume_path()


def test_verify_reasons(tmp_path):
    _, _, ck = three_checkpoints(tmp_path)
    a, b, c = ck.committed()
    assert verify_checkpoint(c) is None
    (b / CHECKSUMS).unlink()
    assert "checksums.json" in verify_checkpoint(b)
    (a / "trainer_state.json").write_text('{"step": 99}')
    assert "trainer_state.json" in verify_checkpoint(a)
    (c / MARKER).unlink()
    assert "marker" in verify_checkpoint(c)
    with pytest.raises(CheckpointError, match="none of the 2 committed checkpoints"):  # c is uncommitted now
        Checkpointer(ck.cfg, tmp_path).select_resume()  # all invalid: an error, never a silent fresh start


def test_exception_during_save_keeps_previous(tmp_path):
    m, opt, ck = three_checkpoints(tmp_path)

    def boom(event, tmp_dir):
        raise RuntimeError(f"disk full at {event}")

    ck.fault_hook = boom
    with pytest.raises(RuntimeError, match="disk full"):
        ck.save(4, m, opt, {"step": 4})
    assert (ck.dir / "step_00000004.tmp").is_dir()
    assert Checkpointer(ck.cfg, tmp_path).resume_path().name == "step_00000003"
    ck.fault_hook = None
    ck.save(5, m, opt, {"step": 5})  # the next commit clears the crashed save's directory
    ck.wait()
    assert sorted(p.name for p in ck.dir.iterdir()) == ["step_00000002", "step_00000003", "step_00000005"]
    assert not list(ck.dir.glob("*.tmp")) and not list(ck.dir.glob("*.trash"))


def test_sigkill_during_async_save_keeps_previous(tmp_path):
    """A forked child (torch already imported: fast) saves step 1, then is SIGKILLed inside the async save of
    step 2 after a data file was truncated; the parent resumes from step 1."""
    from llmtrain.train.fault import FaultInjector

    m, opt = make(0)
    ck = Checkpointer(CheckpointConfig(keep_checkpoint_max=1), tmp_path)
    pid = os.fork()
    if pid == 0:  # child
        try:
            ck.save(1, m, opt, {"step": 1})
            ck.fault_hook = FaultInjector(FaultConfig(crash_in_save_at_step=[2]), tmp_path).during_save
            ck.save_async(2, m, opt, {"step": 2})
            ck.wait()
        finally:
            os._exit(3)  # not reached when the fault fires
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9, status
    assert (ck.dir / "step_00000002.tmp").is_dir()  # the half-written save, truncated, never committed
    assert [p.name for p in ck.committed()] == ["step_00000001"]
    fresh = Checkpointer(CheckpointConfig(keep_checkpoint_max=1), tmp_path)
    assert fresh.resume_path().name == "step_00000001" and fresh.resume_notes == []
    m2, opt2 = make(3)
    assert fresh.load(fresh.resume_path(), m2, opt2) == {"step": 1}
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_async_save_equals_sync_and_is_a_snapshot(tmp_path):
    m, opt = make(0)
    train_a_bit(m, opt, 2)
    expected = [p.detach().clone() for p in m.parameters()]
    sync = Checkpointer(CheckpointConfig(save_dir=str(tmp_path / "sync")), tmp_path)
    asy = Checkpointer(CheckpointConfig(save_dir=str(tmp_path / "async")), tmp_path)
    sync.save(2, m, opt, {"step": 2})
    state = {"step": 2}
    t0 = time.perf_counter()
    asy.save_async(2, m, opt, state)
    blocked = time.perf_counter() - t0
    state["step"] = 99  # the trainer mutates its state and its weights while the write runs
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    assert asy.pending
    path = asy.wait()
    assert path.name == "step_00000002" and not asy.pending and asy.wait() is None
    assert blocked < 5.0
    a = json.loads((path / CHECKSUMS).read_text())["files"]
    b = json.loads((sync.latest() / CHECKSUMS).read_text())["files"]
    data = [n for n in b if n.endswith(".distcp")]
    assert data and all(a[n] == b[n] for n in data)  # byte-identical tensor data
    assert a["trainer_state.json"] == b["trainer_state.json"]
    m2, opt2 = make(4)
    assert asy.load(path, m2, opt2) == {"step": 2}
    for got, want in zip(m2.parameters(), expected):
        assert torch.equal(got, want)


def test_poll_and_async_error(tmp_path):
    m, opt = make(0)
    ck = Checkpointer(CheckpointConfig(), tmp_path)
    ck.save_async(1, m, opt, {"step": 1})
    deadline = time.time() + 30
    got = None
    while got is None and time.time() < deadline:
        got = ck.poll()
        time.sleep(0.01)
    assert got is not None and got.name == "step_00000001" and verify_checkpoint(got) is None

    def boom(event, tmp_dir):
        raise OSError("no space left")

    ck.fault_hook = boom
    ck.save_async(2, m, opt, {"step": 2})
    with pytest.raises(CheckpointError, match="step 2 .*failed"):
        ck.wait()
    assert ck.latest().name == "step_00000001"


def test_rotation_keeps_newest_and_wall_clock_saves(tmp_path):
    m, opt = make(0)
    cfg = CheckpointConfig(keep_checkpoint_max=0, save_steps=5)
    ck = Checkpointer(cfg, tmp_path)
    for s in (1, 2):
        ck.save(s, m, opt, {"step": s})
    ck.wait()
    assert [p.name for p in ck.dir.iterdir()] == ["step_00000002"]  # keep 0 still keeps the newest
    assert ck.should_save(10) and not ck.should_save(11)
    cfg.save_minutes = 0.01  # 0.6 s; the lead adds this field to CheckpointConfig
    timed = Checkpointer(cfg, tmp_path)
    assert not timed.should_save(11)
    time.sleep(0.65)
    assert timed.should_save(11)
    timed.save(11, m, opt, {"step": 11})
    assert not timed.should_save(12)
    assert timed.latest().name == "step_00000011"


# ----------------------------------------------------------------------------- issue 5: checksums while writing
import hashlib  # noqa: E402

import llmtrain.train.checkpoint.integrity as ckpt_mod  # noqa: E402


def test_checksums_are_computed_while_writing(tmp_path, monkeypatch):
    """Data files are hashed on their way to the disk, never re-read; the digests equal SHA-256 of the files."""
    m, opt = make(0)
    train_a_bit(m, opt)
    reread = []
    real = ckpt_mod._hash_files
    monkeypatch.setattr(
        ckpt_mod, "_hash_files", lambda paths, threads: reread.extend(paths) or real(paths, threads)
    )
    path = Checkpointer(CheckpointConfig(write_threads=2), tmp_path).save(1, m, opt, {"step": 1})
    files = json.loads((path / CHECKSUMS).read_text())["files"]
    data = sorted(n for n in files if n.endswith(".distcp"))
    assert len(data) == 2  # one file per writer thread
    assert sorted(p.name for p in reread) == sorted(n for n in files if not n.endswith(".distcp"))
    for name, want in files.items():
        blob = (path / name).read_bytes()
        assert want == {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    assert sorted(files) == sorted(p.name for p in path.iterdir() if p.name not in (MARKER, CHECKSUMS))
    assert not list(path.glob("*sha256.json"))  # the per-rank sidecars were merged and removed
    m2, opt2 = make(3)
    assert Checkpointer(CheckpointConfig(), tmp_path).load(path, m2, opt2) == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_sidecar_digest_used_only_when_size_matches(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"abc")
    (tmp_path / "__1_0.distcp").write_bytes(b"abcd")  # changed after it was hashed: size differs
    (tmp_path / ".metadata").write_bytes(b"m")
    claimed = {"__0_0.distcp": {"bytes": 3, "sha256": "a" * 64}}
    (tmp_path / "__0_sha256.json").write_text(json.dumps(claimed))
    (tmp_path / "__1_sha256.json").write_text(json.dumps({"__1_0.distcp": {"bytes": 3, "sha256": "b" * 64}}))
    files = ckpt_mod.write_checksums(tmp_path)["files"]
    assert files["__0_0.distcp"] == {"bytes": 3, "sha256": "a" * 64}  # trusted: computed while writing
    assert files["__1_0.distcp"] == {"bytes": 4, "sha256": hashlib.sha256(b"abcd").hexdigest()}  # re-read
    assert files[".metadata"]["sha256"] == hashlib.sha256(b"m").hexdigest()
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not list(tmp_path.glob("*sha256.json"))


def test_hashing_stream_digest_and_seek(tmp_path):
    fs = ckpt_mod._HashingFileSystem()
    chunks = [
        b"x" * 5,
        bytearray(b"y" * (3 << 20)),
        memoryview(torch.arange(10, dtype=torch.float32).numpy()),
    ]
    with fs.create_stream(tmp_path / "__0_0.distcp", "wb") as f:
        for c in chunks:
            f.write(c)
        assert f.tell() == 5 + (3 << 20) + 40
    blob = (tmp_path / "__0_0.distcp").read_bytes()
    assert fs.digests["__0_0.distcp"] == {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    with fs.create_stream(tmp_path / "__0_1.distcp", "wb") as f:
        f.write(b"abc")
        f.seek(0)
        f.write(b"z")
    assert (tmp_path / "__0_1.distcp").read_bytes() == b"zbc" and "__0_1.distcp" not in fs.digests
    with fs.create_stream(tmp_path / ".metadata", "wb") as f:  # not a data file: a plain stream
        f.write(b"meta")
    assert ".metadata" not in fs.digests


def test_rotation_deletes_in_background_but_uncommits_at_once(tmp_path):
    m, opt = make(0)
    ck = Checkpointer(CheckpointConfig(keep_checkpoint_max=1), tmp_path)
    ck.save(1, m, opt, {"step": 1})
    ck.save(2, m, opt, {"step": 2})
    assert [p.name for p in ck.committed()] == ["step_00000002"]  # step 1 stopped being a checkpoint at once
    assert not (ck.dir / "step_00000001").exists()
    ck.wait()
    assert sorted(p.name for p in ck.dir.iterdir()) == ["step_00000002"]
    assert verify_checkpoint(ck.latest()) is None


def test_async_saves_on_two_ranks_commit_once_each(tiny_corpus, tmp_path):
    """2 ranks, an async save every step: every rank agrees when a save is done (no rank waits alone in the
    commit barrier while the other trains on), each step is committed and logged exactly once, and the newest
    checkpoint verifies."""
    import subprocess
    import sys

    import yaml

    out = tmp_path / "run"
    cfg = {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32},
        "parallel": {"zero_stage": 3},
        "train": {"batch_size": 8, "micro_batch_size": 2, "max_steps": 6, "log_steps": 1, "eval_steps": 0},
        "data": {"datasets": [{"path": tiny_corpus, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 1, "keep_checkpoint_max": 2, "async_save": True, "resume": "none"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": False, "eval_iters": 1},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1, "hang_timeout_s": 120},
    }
    path = tmp_path / "async.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "llmtrain", "launch", str(path), "--nproc-per-node", "2"]
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [1, 2, 3, 4, 5, 6]
    assert sorted(d.name for d in (out / "checkpoints").iterdir() if d.name.startswith("step_")) == [
        "step_00000005",
        "step_00000006",
    ]
    verify_checkpoint(out / "checkpoints" / "step_00000006")


def test_every_checkpoint_invalid_is_an_error_not_a_fresh_start(tmp_path):
    """resume: auto with no checkpoint that verifies: a CheckpointError naming each one and why; nothing deleted."""
    m, opt, ck = three_checkpoints(tmp_path)
    for path in ck.committed():
        damage_file(next(path.glob("*.distcp")), "flip")
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    fresh = Checkpointer(ck.cfg, tmp_path)
    with pytest.raises(CheckpointError, match="none of the 3 committed checkpoints") as e:
        fresh.select_resume()
    for step in (1, 2, 3):
        assert f"step_0000000{step}: " in str(e.value) and "SHA-256" in str(e.value)
    assert "checkpoint.resume: none" in str(e.value)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
    none = Checkpointer(CheckpointConfig(keep_checkpoint_max=3, resume="none", overwrite=True), tmp_path)
    assert none.select_resume().path is None  # the explicit way to start over

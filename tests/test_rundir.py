"""A run directory has one live owner, and a user's own config.yaml in it is never replaced (train/rundir.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from llmtrain.config import config_from_dict
from llmtrain.errors import ConfigError
from llmtrain.train.rundir import LOCK_NAME, RESOLVED_HEADER, RunLock
from llmtrain.train.trainer import Trainer


def _cfg(prefix: str, out: Path) -> dict:
    return tiny_config(prefix, out)


def _train(cfg: dict, tmp: Path) -> subprocess.CompletedProcess:
    cfg_file = tmp / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "llmtrain", "train", str(cfg_file)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_second_run_on_a_live_directory_is_refused(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    lock = RunLock(out).acquire()  # this process is the live run
    try:
        p = _train(_cfg(tiny_corpus, out), tmp_path)
        assert p.returncode == 2, p.stderr[-2000:]
        assert "in use by another run" in p.stderr and f'"pid": {os.getpid()}' in p.stderr
        assert "Traceback" not in p.stderr
        assert sorted(x.name for x in out.iterdir()) == [LOCK_NAME]  # nothing else written
    finally:
        lock.release()
    p = _train(_cfg(tiny_corpus, out), tmp_path)  # the directory is free again
    assert p.returncode == 0, p.stderr[-2000:]
    assert (out / "checkpoints" / "step_00000002" / "COMMITTED").exists()


def test_a_killed_owner_leaves_no_stale_lock(tmp_path):
    code = f"from llmtrain.train.rundir import RunLock; RunLock({str(tmp_path)!r}).acquire(); import os, signal; "
    code += "os.kill(os.getpid(), signal.SIGKILL)"
    p = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert p.returncode == -signal.SIGKILL and (tmp_path / LOCK_NAME).exists()
    RunLock(tmp_path).acquire().release()  # the OS dropped the dead process's lock


@pytest.mark.parametrize(
    "where", ["after the file is made", "after the lock is taken", "while it is dropped"]
)
def test_ctrl_c_inside_taking_or_releasing_a_prepare_lock_leaves_no_lock_file(tmp_path, monkeypatch, where):
    """A Ctrl-C delivered at the worst moment inside RunLock (a tidy prepare lock) is raised once the lock's state
    is whole again: acquire() then releases and removes the file (seen in CI when Ctrl-C met a starting
    two-worker prepare); release() still removes it."""
    from llmtrain.train import rundir

    def interrupt() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # bytecodes in which Python would run the handler

    if where == "after the file is made":
        real_flock = rundir.fcntl.flock
        monkeypatch.setattr(rundir.fcntl, "flock", lambda fd, op: (interrupt(), real_flock(fd, op))[1])
    elif where == "after the lock is taken":
        real_take = rundir._take
        monkeypatch.setattr(rundir, "_take", lambda path, claim: (real_take(path, claim), interrupt())[0])
    lock = RunLock.for_output(tmp_path / "ds")
    if where == "while it is dropped":
        lock.acquire()
        real_drop = rundir._drop
        monkeypatch.setattr(rundir, "_drop", lambda path: (interrupt(), real_drop(path))[1])
        with pytest.raises(KeyboardInterrupt):
            lock.release()
    else:
        with pytest.raises(KeyboardInterrupt):
            lock.acquire()
    assert list(tmp_path.iterdir()) == [] and lock.path not in rundir._held  # no file, nothing held
    monkeypatch.undo()
    RunLock.for_output(tmp_path / "ds").acquire().release()  # free and whole


def test_lock_is_reentrant_in_one_process_and_exclusive_across(tmp_path):
    a = RunLock(tmp_path).acquire()
    b = RunLock(tmp_path).acquire()  # same process: a second trainer over the same directory
    b.release()
    code = f"from llmtrain.train.rundir import RunLock; RunLock({str(tmp_path)!r}).acquire()"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "in use by another run" in p.stderr  # still held by `a`
    a.release()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_users_own_config_yaml_is_never_replaced(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    mine = "# my notes about this experiment\nmodel: {flavor: debug}\n"
    (out / "config.yaml").write_text(mine)
    with pytest.raises(ConfigError, match="was not written by llmtrain"):
        Trainer(config_from_dict(_cfg(tiny_corpus, out)))
    assert (out / "config.yaml").read_text() == mine
    assert not list(out.glob(".config.yaml.tmp*"))


def test_resolved_config_is_marked_and_rewritten_on_resume(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    Trainer(config_from_dict(_cfg(tiny_corpus, out))).fit()
    text = (out / "config.yaml").read_text()
    assert text.startswith(RESOLVED_HEADER)
    assert yaml.safe_load(text)["train"]["max_steps"] == 2
    cfg = _cfg(tiny_corpus, out)
    cfg["train"]["max_steps"] = 3
    Trainer(config_from_dict(cfg)).fit()  # ours: replaced by the new resolved config
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["max_steps"] == 3


@pytest.mark.parametrize(
    "model, needle",
    [
        ({"num_layers": 1}, "only in the checkpoint (layers.1."),
        ({"hidden_size": 48, "num_heads": 4}, "different shapes"),
    ],
)
def test_resume_into_another_model_shape_is_refused(tiny_corpus, tmp_path, model, needle):
    """Fewer layers used to resume silently (dropping weights); other shape changes ended in DCP tracebacks."""
    out = tmp_path / "run"
    Trainer(config_from_dict(_cfg(tiny_corpus, out))).fit()
    cfg = _cfg(tiny_corpus, out)
    cfg["model"].update(model)
    cfg["train"]["max_steps"] = 4
    with pytest.raises(ConfigError.__mro__[1], match="holds a model of another shape") as e:
        Trainer(config_from_dict(cfg))
    assert needle in str(e.value) and "config.yaml" in str(e.value)
    p = _train(cfg, tmp_path)  # the command: exit 2, one paragraph, no traceback
    assert p.returncode == 2 and "another shape" in p.stderr and "Traceback" not in p.stderr

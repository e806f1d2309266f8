"""Signals and neighbours (issue 35): no orphan workers, no hung Ctrl-C, one live owner per output.

* ``llmtrain launch`` (2 ranks): SIGTERM to the launcher, Ctrl-C to its process group (SIGINT, as a terminal
  sends it), SIGKILL to its process group and SIGKILL to the torchrun agent, one after the other on one run
  directory. Each time every process of the job is gone within the bound (the workers save the step they
  stopped at and exit 75), and the next launch of the same command resumes from that step; the last one
  finishes, and its per-step losses equal an uninterrupted one-process run's (1e-5, as tests/test_launch.py).
* ``llmtrain prepare --workers 2``: Ctrl-C to its process group (main process and workers) while the workers
  start, once the work folder is made and once a part is finished: exit 130 within the bound, no traceback, no
  process left; the same command then resumes, and the last run's output is byte-identical to a clean run's.
* Neighbours: a second ``prepare`` into a live one's output, a ``train`` with another run.output_dir but the
  live run's checkpoint directory, and one whose run.output_dir is a symbolic link to the live run's: exit 2
  naming the owner's pid, nothing written; the first (held with SIGSTOP meanwhile, so no timing decides the
  outcome) finishes with every file intact.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from llmtrain.config import config_from_dict
from llmtrain.train.checkpoint.integrity import verify_checkpoint
from llmtrain.train.rundir import LOCK_NAME
from llmtrain.train.trainer import Trainer
from test_elastic import _descendants, cfg_dict, events, launch_cmd, write_cfg  # tests/ is on sys.path

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STOP_TIMEOUT_S = 20  # llmtrain launch --stop-timeout of the launch test
LAUNCH_BOUND_S = STOP_TIMEOUT_S + 15 + 10  # launch.STOP_MARGIN_S, and slack for a loaded machine
PREPARE_BOUND_S = 20  # data.prep.parts.POOL_STOP_TIMEOUT_S (10) and slack


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _naming(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (a config or output path of one test)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace") and _alive(int(d.name)):
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def _wait_gone(pids: list[int], marker: str, bound_s: float) -> float:
    """Seconds until none of ``pids`` and no process naming ``marker`` is alive; fails after ``bound_s``."""
    start = time.monotonic()
    while any(_alive(p) for p in pids) or _naming(marker):
        left = [p for p in pids if _alive(p)] + _naming(marker)
        assert time.monotonic() - start < bound_s, f"still running after {bound_s} s: {left}"
        time.sleep(0.1)
    return time.monotonic() - start


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _rows(path: Path) -> list[dict]:
    """The complete JSON lines of a file being written (a half-written last line is skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _last_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(run_dir / "metrics.jsonl") if "loss" in r}


# ------------------------------------------------------------------------------------------------------- launch
def test_launch_signals_leave_no_process_and_the_same_command_resumes(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    base = cfg_dict(tiny_corpus, out, max_steps=400, train={"decay_steps": 400},
                    checkpoint={"save_steps": 100, "keep_checkpoint_max": 2})  # fmt: skip
    cfg_file = write_cfg(tmp_path / "run.yaml", base)
    cmd = launch_cmd(cfg_file, "--nproc-per-node", "2", "--stop-timeout", str(STOP_TIMEOUT_S))
    stops: list[int] = []
    cases = [("launcher", signal.SIGTERM, 75), ("group", signal.SIGINT, 75),
             ("group", signal.SIGKILL, -signal.SIGKILL), ("agent", signal.SIGKILL, 75)]  # fmt: skip
    for i, (target, sig, want) in enumerate(cases):
        log = tmp_path / f"launch{i}.log"
        with open(log, "w") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        procs: list[int] = []
        try:
            after = stops[-1] if stops else 0
            deadline = time.monotonic() + 240
            while max(_last_losses(out), default=0) < after + 2:  # this launch has trained two steps
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
            procs = _descendants(p.pid)  # launcher, agent, the two workers
            assert len(procs) >= 4, procs
            if target == "launcher":
                os.kill(p.pid, sig)
            elif target == "group":
                os.killpg(p.pid, sig)
            else:
                os.kill(procs[1], sig)  # the agent: the launcher's only child
            took = _wait_gone(procs, str(cfg_file), LAUNCH_BOUND_S)
            code = p.wait(timeout=LAUNCH_BOUND_S)
        finally:
            _kill_all(_descendants(p.pid) + procs)
        text = log.read_text()
        assert code == want, (target, sig, code, text[-3000:])
        stop = [e for e in events(out) if e["event"] == "preempted"][-1]["step"]
        assert stop >= after + 2, (stop, after)
        assert verify_checkpoint(out / "checkpoints" / f"step_{stop:08d}") is None
        assert not list((out / "checkpoints").glob("*.tmp"))
        stops.append(stop)
        print(f"{target} {signal.Signals(sig).name}: stopped at step {stop}, all gone in {took:.1f} s")

    final = stops[-1] + 2
    p = subprocess.run(
        [*cmd, f"train.max_steps={final}"], capture_output=True, text=True, timeout=300, env=ENV
    )
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = [e["step"] for e in events(out) if e["event"] == "resumed"]
    assert resumed == stops, (resumed, stops)  # every launch resumed where the previous one stopped

    ref_dir = tmp_path / "ref"
    Trainer(
        config_from_dict(cfg_dict(tiny_corpus, ref_dir, max_steps=final, train={"decay_steps": 400}))
    ).fit()
    want, got = _last_losses(ref_dir), _last_losses(out)
    assert sorted(got) == list(range(1, final + 1))
    for step in want:
        assert abs(got[step] - want[step]) < 1e-5, (step, got[step], want[step])


# ------------------------------------------------------------------------------------------------------ prepare
@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> dict:
    """Six jsonl inputs (stdlib sources in 2,000-character documents), a BPE tokenizer, and a clean run's
    output (``clean/ds``) to compare with."""
    from llmtrain.data.prep.tokenizer_training import train_bpe

    root = tmp_path_factory.mktemp("prep")
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:48]
    texts = [Path(f).read_text(errors="replace") for f in files]
    inputs = []
    for k in range(6):
        path = root / f"in{k}.jsonl"
        docs = [t[i : i + 2000] for t in texts[k::6] for i in range(0, len(t), 2000)]
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        inputs.append(str(path))
    tok = root / "tok.json"
    train_bpe(iter(texts[:8]), 400, str(tok))

    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "llmtrain.cli", "prepare", "--input", *inputs, "--output", str(out / "ds"),
                "--tokenizer", str(tok), "--workers", "2"]  # fmt: skip

    p = subprocess.run(command(root / "clean"), capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    return {"root": root, "command": command, "clean": _folder(root / "clean")}


def _folder(path: Path) -> dict[str, bytes]:
    """Every file of an output folder (name -> bytes, the folder's own path in the report replaced); the work
    folder or a lock file would show up here."""
    here = str(path).encode()
    return (
        {p.name: p.read_bytes().replace(here, b"OUT") for p in sorted(path.iterdir())}
        if path.is_dir()
        else {}
    )


def test_ctrl_c_ends_a_two_worker_prepare_at_any_moment_and_the_rerun_is_exact(prep):
    out = prep["root"] / "interrupted"
    cmd = prep["command"](out)
    work = out / ".ds.work"
    # the work folder and parts of the run interrupted before stay for the rerun: a moment after the first also
    # waits for this run's resource tracker, i.e. for prepare to be running (a Ctrl-C that meets a Python process
    # still starting up, before its SIGINT handler exists, kills it with -2 and no message: seen in CI)
    moments = {
        "workers starting": lambda started: len(_descendants(p.pid)) >= 3,  # main, resource tracker, a worker
        "work folder made": lambda started: len(_descendants(p.pid)) >= 2 and work.is_dir(),
        "a part finished": lambda started: (
            len(_descendants(p.pid)) >= 2 and bool(list(work.glob("part-*.json")))
        ),
    }
    p: subprocess.Popen
    for name, ready in moments.items():
        with open(out.parent / "prepare.err", "w") as err:
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=ENV, start_new_session=True)
        procs: list[int] = []
        try:
            started = time.monotonic()
            while not ready(started):
                assert p.poll() is None, f"{name}: prepare ended before the moment: {p.returncode}"
                time.sleep(0.02)
            procs = _descendants(p.pid)
            os.killpg(p.pid, signal.SIGINT)  # Ctrl-C at a terminal: the main process and its workers
            sent = time.monotonic()
            code = p.wait(timeout=PREPARE_BOUND_S)
            took = time.monotonic() - sent
            _wait_gone(procs, str(out), PREPARE_BOUND_S)
        finally:
            _kill_all(_descendants(p.pid) + procs)
        text = (out.parent / "prepare.err").read_text()
        assert code == 130, (name, code, text[-3000:])
        assert took < PREPARE_BOUND_S and "interrupted" in text, (name, took, text)
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, (name, text[-3000:])
        assert not (out / ".ds.llmtrain.lock").exists()  # the lock is released and its file removed
        print(f"Ctrl-C ({name}): exit 130 in {took:.2f} s")
    rerun = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=ENV
    )  # resumes finished parts
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _folder(out) == prep["clean"]  # same files, same bytes, no work folder or lock left


def test_second_prepare_into_a_live_output_is_refused_and_the_first_finishes_intact(prep):
    out = prep["root"] / "shared"
    lock_file = out / f".ds{LOCK_NAME}"
    with open(prep["root"] / "first.err", "w") as err:
        first = subprocess.Popen(prep["command"](out), stdout=subprocess.DEVNULL, stderr=err, env=ENV)
    try:
        while not (lock_file.is_file() and f'"pid": {first.pid}' in lock_file.read_text()):
            assert first.poll() is None, "the first prepare ended before it took its lock"
            time.sleep(0.02)
        os.kill(first.pid, signal.SIGSTOP)  # it holds the lock while the second one tries
        try:
            second = subprocess.run(
                prep["command"](out), capture_output=True, text=True, timeout=300, env=ENV
            )
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert first.wait(timeout=300) == 0, (prep["root"] / "first.err").read_text()[-3000:]
    finally:
        _kill_all(_descendants(first.pid))
    assert second.returncode == 2, second.stderr[-3000:]
    assert "in use by another `llmtrain prepare`" in second.stderr and f'"pid": {first.pid}' in second.stderr
    assert "Traceback" not in second.stderr
    assert _folder(out) == prep["clean"]


# ------------------------------------------------------------------------------------------------------- train
def test_second_run_on_a_live_runs_checkpoints_or_through_a_link_is_refused(tiny_corpus, tmp_path):
    shared = tmp_path / "shared_ckpts"
    first_cfg = tiny_config(tiny_corpus, tmp_path / "a", train={"max_steps": 6},
                            checkpoint={"save_steps": 2, "keep_checkpoint_max": 5, "save_dir": str(shared)})  # fmt: skip
    link = tmp_path / "link_to_a"
    link.symlink_to(tmp_path / "a", target_is_directory=True)
    others = {
        "same checkpoint directory": tiny_config(tiny_corpus, tmp_path / "b", train={"max_steps": 6},
                                                 checkpoint={"save_dir": str(shared)}),
        "output through a link": tiny_config(tiny_corpus, link, train={"max_steps": 6}),
    }  # fmt: skip

    def start(name: str, cfg: dict) -> subprocess.Popen:
        cfg_file = tmp_path / f"{name.replace(' ', '_')}.yaml"
        cfg_file.write_text(yaml.safe_dump(cfg))
        cmd = [sys.executable, "-m", "llmtrain.cli", "train", str(cfg_file)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)

    first = start("first", first_cfg)
    try:
        deadline = time.monotonic() + 240
        while not _last_losses(tmp_path / "a"):  # the first run holds its locks and has trained a step
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGSTOP)
        try:
            seconds = {name: start(name, cfg) for name, cfg in others.items()}  # both at once
            results = {name: (p.wait(timeout=300), p.communicate()[1]) for name, p in seconds.items()}
        finally:
            os.kill(first.pid, signal.SIGCONT)
        _, first_err = first.communicate(timeout=300)
    finally:
        _kill_all(_descendants(first.pid))
    assert first.returncode == 0, first_err[-3000:]
    for name, (code, err) in results.items():
        assert code == 2, (name, err[-3000:])
        assert f'"pid": {first.pid}' in err and "Traceback" not in err, (name, err[-3000:])
    assert "checkpoint directory" in results["same checkpoint directory"][1]
    assert "run.output_dir" in results["output through a link"][1]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [LOCK_NAME]  # nothing else written
    steps = sorted(p.name for p in shared.iterdir() if p.name.startswith("step_"))
    assert steps == ["step_00000002", "step_00000004", "step_00000006"]
    assert all(verify_checkpoint(shared / s) is None for s in steps)
    assert sorted(_last_losses(tmp_path / "a")) == [1, 2, 3, 4, 5, 6]
    assert not list((tmp_path / "a").glob("checkpoints"))  # the link's run would have made a/checkpoints

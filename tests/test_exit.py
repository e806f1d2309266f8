"""Every 2-rank run ends cleanly: finished, failed, preempted or given up, with the documented exit code.

The runs are two ``llmtrain train`` processes started with the rendezvous variables torchrun would set (no agent
in between, so each worker's own exit code is seen; SIGABRT is -6), with everything that owns threads or
outstanding work switched on: asynchronous checkpoints on their own gloo group, rotation (background deletion),
the hang watchdog, the straggler gather every step, TensorBoard and a profiler window. Busy-loop processes keep
both cores loaded, the condition under which a run used to end in ``terminate called without an active
exception`` (a gloo worker thread releasing its last work object while the interpreter shut down; see
``distributed.device.shutdown_distributed``).

``LLMTRAIN_EXIT_STRESS_RUNS`` sets how many back-to-back finished runs the stress test makes (small form by
default, so it runs in every CI; the full form, 200, is recorded in docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from ports import free_port as _free_port  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.slow

STRESS_RUNS = int(os.environ.get("LLMTRAIN_EXIT_STRESS_RUNS", "3"))
ABORT_MARKERS = ("terminate called", "SIGABRT", "Signal 6", "core dumped", "Traceback")


def _config(prefix: str, out: Path, steps: int = 6, **sections: dict) -> dict:
    cfg = {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32},
        "train": {
            "batch_size": 8, "micro_batch_size": 2, "max_steps": steps, "lr": 3e-3, "warmup_steps": 1,
            "seed": 3, "log_steps": 1, "eval_steps": 3,
        },
        "parallel": {"zero_stage": 3},
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 2, "keep_checkpoint_max": 1, "async_save": True, "resume": "auto"},
        "logging": {"progress_bar": False, "tensorboard": True, "plot": False, "profile_every": 4,
                    "profile_steps": 1},
        "eval": {"at_start": False, "eval_iters": 1},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1, "hang_timeout_s": 120,
                "dist_timeout_s": 120},
    }  # fmt: skip
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def _start(cfg: dict, tmp: Path) -> list[subprocess.Popen]:
    """Two ranks of ``llmtrain train`` with torchrun's environment (rank i's stderr in tmp/rank{i}.err)."""
    cfg_file = tmp / f"cfg_{time.monotonic_ns()}.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
        }  # fmt: skip
        err = open(tmp / f"rank{rank}.err", "w")  # closed by the child's exit
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "llmtrain.cli", "train", str(cfg_file)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )  # fmt: skip
        )
    return procs


def _finish(procs: list[subprocess.Popen], tmp: Path, timeout: float = 300) -> tuple[list[int], str]:
    codes = [p.wait(timeout=timeout) for p in procs]
    return codes, "".join((tmp / f"rank{r}.err").read_text() for r in range(2))


@contextmanager
def busy_cores(n: int = 2):
    """``n`` processes spinning at full speed beside the runs (the loaded machine of the bug reports)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def _committed(run_dir: Path) -> list[int]:
    ckpts = run_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in ckpts.glob("step_*") if (p / "COMMITTED").exists())


def test_finished_runs_exit_zero_under_load(tiny_corpus, tmp_path):
    with busy_cores():
        for i in range(STRESS_RUNS):
            run_dir = tmp_path / f"run{i}"
            codes, err = _finish(_start(_config(tiny_corpus, run_dir), tmp_path), tmp_path)
            assert codes == [0, 0], (i, codes, err[-3000:])
            assert not any(m in err for m in ABORT_MARKERS), (i, err[-3000:])
            assert _committed(run_dir) == [6]  # the last async save committed, older ones rotated away
            assert not list((run_dir / "checkpoints").glob("*.t*"))  # no .tmp / .trash left behind
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert max(r["step"] for r in rows) == 6


def test_handled_error_after_groups_are_up_exits_two(tiny_corpus, tmp_path):
    """A CheckpointError raised once the process groups exist: exit 2 on both ranks, one message, no abort."""
    run_dir = tmp_path / "run"
    cfg = _config(tiny_corpus, run_dir, checkpoint={"resume": str(tmp_path / "nowhere")})
    with busy_cores():
        codes, err = _finish(_start(cfg, tmp_path), tmp_path)
    assert codes == [2, 2], (codes, err[-3000:])
    assert "checkpoint.resume" in err and "nowhere" in err
    assert not any(m in err for m in ABORT_MARKERS), err[-3000:]


def test_give_up_exits_three(tiny_corpus, tmp_path):
    """NaN at step 2 with no checkpoint before it: the guard gives up on every rank (exit 3, the documented code)."""
    run_dir = tmp_path / "run"
    cfg = _config(
        tiny_corpus, run_dir, fault={"nan_at_step": [2], "rank": -1}, stability={"max_nonfinite_steps": 1}
    )
    with busy_cores():
        codes, err = _finish(_start(cfg, tmp_path), tmp_path)
    assert codes == [3, 3], (codes, err[-3000:])
    assert not any(m in err for m in ABORT_MARKERS), err[-3000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "rollback" for e in events)


def test_preemption_saves_and_exits_75(tiny_corpus, tmp_path):
    """SIGTERM to both ranks mid-run (as Slurm sends it): they agree to stop, save, finish the save in flight, and
    exit 75; rerunning the same config resumes from that checkpoint and finishes."""
    run_dir = tmp_path / "run"
    cfg = _config(tiny_corpus, run_dir, steps=400, checkpoint={"save_steps": 3})
    with busy_cores():
        procs = _start(cfg, tmp_path)
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count('"loss"') >= 4):
            time.sleep(0.2)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes, err = _finish(procs, tmp_path)
    assert codes == [75, 75], (codes, err[-3000:])
    assert not any(m in err for m in ABORT_MARKERS), err[-3000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    stop = next(e for e in events if e["event"] == "preempted")
    assert 4 <= stop["step"] < 400
    assert _committed(run_dir)[-1] == stop["step"]
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    cfg["train"]["max_steps"] = stop["step"] + 2
    codes, err = _finish(_start(cfg, tmp_path), tmp_path)
    assert codes == [0, 0], (codes, err[-3000:])
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "resumed" and e["step"] == stop["step"] for e in events)

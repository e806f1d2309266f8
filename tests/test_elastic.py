"""Elastic survival end to end, through ``llmtrain launch`` (torchrun's elastic agent), 2 ranks, CPU, fp32.

* Kills and a crash mid-save: rank 1 is SIGKILLed at steps 3 and 8, rank 0 is SIGKILLed while committing the
  checkpoint of step 6 (a partial ``.tmp`` directory), and rank 1 hangs at step 10. The agent restarts the job
  each time (``--max-restarts``) and the trainer resumes from the newest valid checkpoint. The final parameters
  are bitwise equal (``torch.equal``) to an uninterrupted 2-rank run's, and so are the per-step losses of
  metrics.jsonl (the last row logged for each step).
* Hang: the watchdog (``run.hang_timeout_s``) of every rank dumps its stacks to ``hang_rank{r}.txt`` and exits
  non-zero; the job restarts and completes.
* Eviction: two agents on localhost form one job with ``--nnodes 1:2`` (c10d rendezvous, one process each);
  one agent and its worker are SIGKILLed after the checkpoint of step 4; the survivor re-rendezvouses alone,
  resumes from that checkpoint on world size 1 and keeps the global batch (gradient accumulation 2 -> 4, the
  ``resharded`` event).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from llmtrain.config import config_from_dict
from llmtrain.models import build_model
from llmtrain.resolve import derive
from llmtrain.train.checkpoint import load_model_weights
from ports import free_port as _free_port  # tests/ is on sys.path under pytest

STEPS = 12
FAULTS = {"rank": 1, "kill_at_step": [3, 8], "crash_in_save_at_step": [6], "hang_at_step": [10]}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cfg_dict(prefix: str, out: Path, max_steps: int = STEPS, **sections) -> dict:
    base = {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32},
        "train": {
            "batch_size": 8,
            "micro_batch_size": 2,
            "max_steps": max_steps,
            "lr": 3e-3,
            "warmup_steps": 2,
            "seed": 5,
            "log_steps": 1,
            "eval_steps": 0,
        },
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 2, "keep_checkpoint_max": 3, "resume": "auto"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": False, "eval_iters": 1},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return base


def write_cfg(path: Path, d: dict) -> Path:
    path.write_text(yaml.safe_dump(d))
    return path


def launch_cmd(cfg_file: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "llmtrain.cli", "launch", str(cfg_file), *extra]


def step_losses(run_dir: Path) -> dict[int, float]:
    """The last logged loss of each step (rows re-logged after a resume replace the earlier ones)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def final_params(d: dict, run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model of ``run_dir``'s checkpoint of ``step``, loaded into one unsharded process."""
    model = build_model(derive(config_from_dict(d), world_size=1).model_args, device="meta")
    model.to_empty(device="cpu")
    load_model_weights(run_dir / "checkpoints" / f"step_{step:08d}", model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def chaos(tiny_corpus, tmp_path_factory):
    """An uninterrupted 2-rank run and the same run with kills, a crash mid-save and a hang (one launch each)."""
    root = tmp_path_factory.mktemp("elastic")
    ref_d = cfg_dict(tiny_corpus, root / "ref")
    run_d = cfg_dict(tiny_corpus, root / "run", run={"hang_timeout_s": 6}, fault=FAULTS)
    ref = subprocess.run(
        launch_cmd(write_cfg(root / "ref.yaml", ref_d), "--nproc-per-node", "2"),
        capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-4000:]
    run = subprocess.run(
        launch_cmd(write_cfg(root / "run.yaml", run_d), "--nproc-per-node", "2", "--max-restarts", "6"),
        capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-6000:]
    return {"ref": root / "ref", "run": root / "run", "ref_d": ref_d, "run_d": run_d, "log": run.stderr}


@pytest.mark.slow  # two 2-rank launches, five process-group starts: ~60-90 s
def test_kills_and_crash_in_save_end_bitwise_equal(chaos):
    ref_dir, run_dir = chaos["ref"], chaos["run"]
    fired = json.loads((run_dir / "faults_fired_rank1.json").read_text())
    assert sorted(fired) == ["hang@10", "kill@3", "kill@8"]
    assert json.loads((run_dir / "faults_fired_rank0.json").read_text()) == ["crash_in_save@6"]
    resumed = [e["step"] for e in events(run_dir) if e["event"] == "resumed"]
    # kill@3 -> 2, crash while saving 6 -> 4, kill@8 -> 6, hang@10 -> 8 (more if a restart itself failed)
    assert [2, 4, 6, 8] == sorted(set(resumed)), resumed
    assert not list((run_dir / "checkpoints").glob("*.tmp"))  # the crashed save's partial dir was cleared

    want, got = final_params(chaos["ref_d"], ref_dir, STEPS), final_params(chaos["run_d"], run_dir, STEPS)
    assert want.keys() == got.keys() and len(want) > 0
    for name in want:
        assert torch.equal(want[name], got[name]), name

    ref_losses, run_losses = step_losses(ref_dir), step_losses(run_dir)
    assert sorted(run_losses) == list(range(1, STEPS + 1))
    assert run_losses == ref_losses  # exact float equality, every step


@pytest.mark.slow
def test_hung_rank_dumps_stacks_and_job_restarts(chaos):
    run_dir = chaos["run"]
    dumps = {r: run_dir / f"hang_rank{r}.txt" for r in (0, 1)}
    assert all(p.exists() for p in dumps.values()), list(run_dir.iterdir())
    hung = dumps[1].read_text()
    assert "no progress for" in hung and "after step 9" in hung
    assert "before_step" in hung and "fault.py" in hung  # the injected sleep is on rank 1's main stack
    assert "all_reduce" in dumps[0].read_text() or "wait" in dumps[0].read_text()  # rank 0 waits for it
    assert "exitcode: 124" in chaos["log"]  # the watchdog's exit code reached the elastic agent
    ev = events(run_dir)
    hang_resume = [e for e in ev if e["event"] == "resumed" and e["step"] == 8]
    assert hang_resume and max(step_losses(run_dir)) == STEPS


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


@pytest.mark.slow  # two agents; last_call 20 s lets the second join under load; ~60 s
def test_evicted_node_job_resumes_on_survivor_with_same_global_batch(tiny_corpus, tmp_path):
    out = tmp_path / "ev"
    cfg_file = write_cfg(tmp_path / "ev.yaml", cfg_dict(tiny_corpus, out, max_steps=30))
    port = _free_port()
    extra = [
        "--nproc-per-node", "1", "--nnodes", "1:2", "--master-addr", "localhost", "--master-port", str(port),
        "--max-restarts", "3", "--run-id", f"ev{port}",
        "--rdzv-conf", "join_timeout=120,last_call_timeout=20,close_timeout=5,keep_alive_interval=1,"
        "keep_alive_max_attempt=2",
    ]  # fmt: skip

    def agent(tag: str) -> subprocess.Popen:
        log = open(tmp_path / f"agent_{tag}.log", "w")  # closed with the process
        return subprocess.Popen(launch_cmd(cfg_file, *extra), stdout=log, stderr=subprocess.STDOUT, env=ENV,
                                start_new_session=True)  # fmt: skip

    host = agent("host")  # hosts the rendezvous store: it must survive
    deadline = time.time() + 120
    while True:
        try:
            socket.create_connection(("localhost", port), timeout=0.2).close()
            break
        except OSError:
            assert host.poll() is None and time.time() < deadline, "rendezvous store never came up"
            time.sleep(0.1)
    evicted = agent("evicted")
    try:
        ckpt = out / "checkpoints" / "step_00000004"
        while not ckpt.exists():
            assert host.poll() is None and time.time() < deadline + 120, "no checkpoint of step 4"
            time.sleep(0.05)
        for pid in _descendants(evicted.pid):  # the node dies: its agent and its worker
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert host.wait(timeout=300) == 0, (tmp_path / "agent_host.log").read_text()[-4000:]
    finally:
        for p in (host, evicted):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    ev = events(out)
    starts = [e for e in ev if e["event"] == "run_start"]  # present when the trainer logs run starts
    resharded = [e for e in ev if e["event"] == "resharded"]
    assert len(resharded) == 1, ev
    r = resharded[0]
    assert (r["from_world"], r["to_world"]) == (2, 1)
    assert (r["from_grad_accum"], r["grad_accum"], r["global_batch"]) == (2, 4, 8)
    assert r["step"] >= 4 and r["step"] % 2 == 0
    if starts:
        assert starts[0]["world_size"] == 2 and starts[-1]["world_size"] == 1
    losses = step_losses(out)
    assert sorted(losses) == list(range(1, 31))
    state = json.loads((out / "checkpoints" / "step_00000030" / "trainer_state.json").read_text())
    assert (state["world_size"], state["grad_accum"], state["step"]) == (1, 4, 30)

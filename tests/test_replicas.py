"""Replica groups with torchft (src/llmtrain/ft/): a failed rank drops its group, the other keeps stepping.

* The pin: the installed torchft is the ft extra's build, and a replica whose peer dies in the middle of an
  all-reduce lives on (tests/distributed/ft_drill.py; torchft 0.2.0 fails this: its DDP hook asserts).
* keep, one kill: ``llmtrain launch --nproc-per-node 4 --replicas 2`` (2 groups x 2 ranks, FSDP ZeRO-3 inside),
  rank 1 of group 1 SIGKILLed at step 4. Group 0 never goes back a step and keeps stepping (metrics.jsonl is its
  log: one row per step, in order); group 1 is restarted by its torchrun, heals live from group 0 and rejoins;
  both end with the same parameters and optimizer state (``run_end``'s ``state_sha256``); every step's loss
  equals a one-process run's within 1e-5 (the survivor computed the missing slice), and every sample was
  consumed once (``consumed_tokens``).
* shrink, three kills in one run (2 groups x 1 rank: the gradients summed after the backward, no FSDP hook):
  group 1 at step 4, group 0 at step 34, group 0 again while writing the checkpoint of step 64 (it is the
  writer: the lowest live group). The survivor keeps stepping on its own slice each time, the missing slices
  are ``samples_skipped`` rows with their sample indices, ``consumed_tokens`` counts only committed samples,
  each killed group comes back and heals, the hashes agree, and ``llmtrain report`` shows the membership.
* The lighthouse (a remote one, ``--lighthouse``) killed mid-run: the launch ends with exit 76, nothing partial
  committed; the same command with a new lighthouse resumes from the newest checkpoint and finishes.
* Bad input, before anything starts (exit 2, one paragraph): replicas that do not divide the processes, an
  unreachable lighthouse, a layout replica groups cannot serve; ``check`` prints the replica layout.

Both kill drills also check the run's files while a group is down: ``metrics.jsonl`` has exactly one row per
step, written by the quorum's first group (``replicas`` the groups in that step's quorum: 1 exactly on the steps
a group was missing), every ``resumed`` row names its group, and each ``heal`` counts the bytes of the whole
group (all its ranks' shards: the one-process checkpoint's tensor bytes, plus the optimizer's step counters,
which every rank holds).

Only the degraded steps are slowed (``fault.slow_when: degraded``: rank 0 of a group sleeps
``fault.slow_seconds`` on a step whose quorum is short of groups), so the survivors wait for the restarted
group (a new torchrun attempt: 10-18 s of imports and set-up on this 2-core machine) however long it takes up to
the runway (steps left x 2 s: >= 40 s for each kill here), and the steps with every group run at full speed
(measured on this machine: 2 of 40 steps paced in keep, 14 of 84 in shrink; before, every step slept 0.6 s).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.cli import main as cli
from test_elastic import cfg_dict as elastic_cfg_dict
from test_elastic import write_cfg  # tests/ is on sys.path

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS, KILL_AT, SEQ = 40, 4, 32
DRILL = Path(__file__).parent / "distributed" / "ft_drill.py"


def cfg_dict(prefix: str, out: Path, **sections) -> dict:
    """test_elastic's run (llama3 debug, seq 32, a save every 2 steps) for STEPS steps, keeping 2 checkpoints."""
    sections["checkpoint"] = {"keep_checkpoint_max": 2, **sections.get("checkpoint", {})}
    return elastic_cfg_dict(prefix, out, max_steps=STEPS, **sections)


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def launch(cfg_file: Path, *extra: str, timeout: int = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llmtrain.cli", "launch", str(cfg_file), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_torchft_pin_and_the_survivor_lives():
    from llmtrain.ft.version import PINNED, installed

    assert installed() == PINNED, f"installed torchft {installed()}, pyproject's ft extra pins {PINNED}"
    p = subprocess.run([sys.executable, str(DRILL)], capture_output=True, text=True, timeout=180, env=ENV)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["exitcodes"] == [0, -9], p.stderr[-3000:]  # the peer was SIGKILLed; the survivor exited 0
    (survivor,) = out["results"]
    assert survivor["steps"] == 6
    assert survivor["participants"][0] == 2 and survivor["participants"][-1] == 1


# ---------------------------------------------------------------------------------------------- kills
FT = {"heartbeat_timeout_s": 1.0, "join_timeout_s": 3.0, "timeout_s": 10, "quorum_timeout_s": 60}
SLOW = {"slow_rank": 0, "slow_seconds": 2.0, "slow_when": "degraded"}  # only while a group is missing
STEPS3 = 84  # three kills: group 1 at 4, group 0 at 34, the checkpoint writer (group 0) while saving step 64
THREE = {"rank": 0, "kill_at_step": [4, 34], "kill_replicas": [1, 0], "crash_in_save_at_step": [64]}


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """One-process reference; keep with a kill in group 1 (2 x 2 ranks); shrink with three kills (2 x 1)."""
    root = tmp_path_factory.mktemp("replicas")
    ref_d = cfg_dict(tiny_corpus, root / "ref")
    ref = subprocess.run(
        [sys.executable, "-m", "llmtrain.cli", "train", str(write_cfg(root / "ref.yaml", ref_d))],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-4000:]
    keep = cfg_dict(tiny_corpus, root / "keep", parallel={"zero_stage": 3},
                    fault_tolerance={**FT, "batch_policy": "keep"},
                    fault={"replica": 1, "rank": 1, "kill_at_step": [KILL_AT], **SLOW})  # fmt: skip
    p = launch(
        write_cfg(root / "keep.yaml", keep), "--nproc-per-node", "4", "--replicas", "2", "--max-restarts", "2"
    )
    assert p.returncode == 0, ("keep", p.stdout[-3000:], p.stderr[-5000:])
    shrink = cfg_dict(tiny_corpus, root / "shrink", train={"max_steps": STEPS3},
                      fault_tolerance={**FT, "batch_policy": "shrink"}, fault={**THREE, **SLOW})  # fmt: skip
    p = launch(write_cfg(root / "shrink.yaml", shrink), "--nproc-per-node", "2", "--replicas", "2",
               "--max-restarts", "3")  # fmt: skip
    assert p.returncode == 0, ("shrink", p.stdout[-3000:], p.stderr[-5000:])
    return {"ref": root / "ref", "keep": root / "keep", "shrink": root / "shrink"}


def state_bytes(checkpoint: Path, group_world: int) -> int:
    """The bytes a group of ``group_world`` ranks holds of the state, from a one-process checkpoint's metadata:
    every tensor once, except the optimizer's step counters (a scalar per parameter), held by every rank."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    total = counters = 0
    for key, meta in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            size = math.prod(meta.size) * meta.properties.dtype.itemsize
            total += size
            counters += size if key.startswith("optim.state.") and key.endswith(".step") else 0
    assert total > counters > 0
    return total + (group_world - 1) * counters


def _common(run_dir: Path, killed: list[int], steps: int, heal_bytes: int) -> list[dict]:
    """What the kill runs show: each group lost, resumed, healed (the whole group's bytes) and rejoined in order;
    equal hashes at the end; one metrics row per step, its ``replicas`` the groups of the step's quorum."""
    ev = rows(run_dir / "events.jsonl")
    names = [e["event"] for e in ev]
    assert [e["lost"] for e in ev if e["event"] == "replica_lost"] == killed, names
    assert [e["joined"] for e in ev if e["event"] == "replica_joined"] == killed, names
    assert [e.get("replica") for e in ev if e["event"] == "resumed"] == killed, names  # each restart, tagged
    heals = [e for e in ev if e["event"] == "heal"]
    assert [e["replica"] for e in heals] == killed and {e["bytes"] for e in heals} == {heal_bytes}, heals
    metrics = [r for r in rows(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))  # every step once, in order
    quorums = [e for e in ev if e["event"] == "quorum"]  # a quorum row: the membership from step + 1 on
    for r in metrics:
        latest = [q for q in quorums if q["step"] < r["step"]][-1]
        assert r["replicas"] == latest["participants"] == len(latest["members"]), (r["step"], latest)
    assert {r["replicas"] for r in metrics} == {1, 2}
    ends = {e["replica"]: e for e in ev if e["event"] == "run_end"}  # the last per group
    assert set(ends) == {0, 1} and ends[0]["step"] == ends[1]["step"] == steps
    assert ends[0]["state_sha256"] == ends[1]["state_sha256"]  # bitwise the same params + optimizer state
    return ev


def _last_checkpoint(run_dir: Path) -> Path:
    return max(p for p in (run_dir / "checkpoints").glob("step_*") if "." not in p.name)


@pytest.mark.slow  # a one-process run and two 4-rank launches with a restart each: ~2-3 min on 2 cores
def test_keep_survivor_steps_on_restarted_group_heals_losses_equal_one_process(runs):
    run_dir = runs["keep"]
    ev = _common(run_dir, killed=[1], steps=STEPS, heal_bytes=state_bytes(_last_checkpoint(runs["ref"]), 2))
    assert json.loads((run_dir / "faults_fired_replica1_rank1.json").read_text()) == [f"kill@{KILL_AT}"]
    retried = [e for e in ev if e["event"] == "step_retried"]
    assert all(e["step"] == KILL_AT for e in retried)  # at most the step in flight was taken again
    metrics = [r for r in rows(run_dir / "metrics.jsonl") if "loss" in r]  # steps 1..STEPS once (_common)
    ref = {r["step"]: r for r in rows(runs["ref"] / "metrics.jsonl") if "loss" in r}
    for r in metrics:
        assert abs(r["loss"] - ref[r["step"]]["loss"]) < 1e-5, (r["step"], r["loss"], ref[r["step"]]["loss"])
    assert metrics[-1]["consumed_tokens"] == ref[STEPS]["consumed_tokens"]  # every sample once
    assert not [e for e in ev if e["event"] == "samples_skipped"]


@pytest.mark.slow
def test_shrink_three_kills_one_during_a_save_skipped_samples_recorded(runs):
    run_dir = runs["shrink"]
    heal_bytes = state_bytes(_last_checkpoint(runs["ref"]), 1)  # one rank per group: the checkpoint's bytes
    ev = _common(run_dir, killed=[1, 0, 0], steps=STEPS3, heal_bytes=heal_bytes)
    fired = {r: json.loads((run_dir / f"faults_fired_replica{r}_rank0.json").read_text()) for r in (0, 1)}
    assert fired == {0: [f"crash_in_save@{THREE['crash_in_save_at_step'][0]}", f"kill@{THREE['kill_at_step'][1]}"],
                     1: [f"kill@{THREE['kill_at_step'][0]}"]}  # fmt: skip
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    skipped = [e for e in ev if e["event"] == "samples_skipped"]
    assert skipped and all(e["slots"] == [1] for e in skipped)  # the survivor is the quorum's first: slot 0
    for e in skipped:  # slot 1 of step s: global samples [8(s-1) + 4, 8s)
        assert e["samples"] == [[8 * (e["step"] - 1) + 4, 8 * e["step"]]] and e["count"] == 4
    assert len({e["step"] for e in skipped}) == len(skipped)  # each step's slice skipped once, never twice
    alone = {r["step"] for r in rows(run_dir / "metrics.jsonl") if r.get("replicas") == 1}  # group 0 down too
    assert {e["step"] for e in skipped} == alone  # the rows of one group: exactly the skipped steps
    total = 8 * STEPS3 * SEQ  # every sample of the run, had none been skipped
    for e in [e for e in ev if e["event"] == "stage_end"]:  # each group's count at the end: committed only
        assert next(iter(e["tokens"].values())) == total - SEQ * 4 * len(skipped)
    from llmtrain.report import build_report

    page = build_report(run_dir, with_plan=False).read_text()  # `llmtrain report`: membership over time
    assert '<table id="membership">' in page and "group 0 lost; members [1]" in page
    assert "group 1 joined; members [0, 1]" in page and "group 0 joined; members [0, 1]" in page


@pytest.mark.slow  # one 2 x 1 launch stopped by the lighthouse's loss, one rerun: ~50 s
def test_lighthouse_loss_is_a_clean_stop_and_the_rerun_resumes(tiny_corpus, tmp_path):
    import socket
    import time

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    binary = Path(sys.executable).parent / "torchft_lighthouse"

    def lighthouse() -> subprocess.Popen:
        cmd = [str(binary), "--bind", f"[::]:{port}", "--min_replicas", "1", "--join_timeout_ms", "3000",
               "--heartbeat_timeout_ms", "1000"]  # fmt: skip
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    out = tmp_path / "lh"
    steps = 12
    d = cfg_dict(tiny_corpus, out, train={"max_steps": steps}, fault_tolerance={**FT, "quorum_timeout_s": 5},
                 fault={"slow_rank": 0, "slow_seconds": 0.3})  # fmt: skip
    cfg = write_cfg(tmp_path / "lh.yaml", d)
    extra = ["--nproc-per-node", "2", "--replicas", "2", "--lighthouse", f"localhost:{port}"]
    lh = lighthouse()
    cmd = [sys.executable, "-m", "llmtrain.cli", "launch", str(cfg), *extra]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.time() + 240
        while not (out / "checkpoints" / "step_00000004").exists():
            assert job.poll() is None and time.time() < deadline, "no checkpoint before the lighthouse's loss"
            time.sleep(0.2)
        lh.kill()
        lh.wait()
        _, err = job.communicate(timeout=240)
    finally:
        for p in (lh, job):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert job.returncode == 76, err[-3000:]  # ft/lighthouse.py: LIGHTHOUSE_LOST_EXIT_CODE
    assert "stopped answering" in err and "no quorum" in err
    saved = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*") if "." not in p.name)
    assert 4 <= saved < steps
    lh = lighthouse()
    try:
        p = launch(cfg, *extra)
    finally:
        lh.kill()
        lh.wait()
    assert p.returncode == 0, p.stderr[-3000:]
    ev = rows(out / "events.jsonl")
    assert any(e["event"] == "resumed" and e["step"] == saved for e in ev)
    ends = {e["replica"]: e for e in ev if e["event"] == "run_end"}
    assert ends[0]["step"] == ends[1]["step"] == steps and ends[0]["state_sha256"] == ends[1]["state_sha256"]


@pytest.mark.slow  # one 2-rank group alone under torchrun: ~20 s
def test_a_group_alone_at_the_start_leaves_its_wait_as_one(tiny_corpus, tmp_path):
    """A fresh job waits up to ``quorum_timeout_s`` for all its groups at the first quorum. Group 1 (2 ranks,
    ZeRO-3) starts alone, its rank 1 reaching that wait 3 s after rank 0 (tests/distributed/late_rank.py): the
    ranks' clocks say different things, but torchft's quorum needs every rank of the group. Before the ranks agreed
    (ft/replicas.py ``_group_all``), rank 0 left the wait while rank 1 took one more quorum, which waited for
    rank 0 until the timeout: exit 76 ("no quorum") on one rank, a closed connection on the other (CI, session
    12). Now the group leaves together, trains alone (its peers' slices ``samples_skipped``) and exits 0."""
    import socket

    from llmtrain.ft.lighthouse import reachable
    from ports import free_port

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    cmd = [str(binary), "--bind", f"[::]:{port}", "--min_replicas", "1", "--join_timeout_ms", "1000",
           "--heartbeat_timeout_ms", "1000"]  # fmt: skip
    lh = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out, steps = tmp_path / "alone", 3
    d = cfg_dict(tiny_corpus, out, train={"max_steps": steps}, parallel={"zero_stage": 3},
                 checkpoint={"save_steps": 0, "save_at_end": False},
                 fault_tolerance={**FT, "replicas": 2, "quorum_timeout_s": 4, "enabled": True})  # fmt: skip
    cfg = write_cfg(tmp_path / "alone.yaml", d)
    env = {**ENV, "LLMTRAIN_REPLICA_ID": "1", "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}",
           "LATE_RANK_SECONDS": "3"}  # fmt: skip
    late = Path(__file__).parent / "distributed" / "late_rank.py"
    try:
        assert reachable(f"localhost:{port}", 30.0), "the lighthouse did not start"
        p = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
             str(free_port()), str(late), "train", str(cfg)],
            capture_output=True, text=True, timeout=240, env=env,
        )  # fmt: skip
    finally:
        lh.kill()
        lh.wait()
    assert p.returncode == 0, p.stderr[-4000:]
    ev = rows(out / "events.jsonl")
    (quorum,) = [e for e in ev if e["event"] == "quorum"]
    assert quorum["members"] == [1] and quorum["participants"] == 1 and quorum["step"] == 0
    assert [e["step"] for e in ev if e["event"] == "samples_skipped"] == list(range(1, steps + 1))
    (end,) = [e for e in ev if e["event"] == "run_end"]
    assert end["step"] == steps


# --------------------------------------------------------------------------- the run's files, the pacing
def test_metrics_writers_share_the_log_and_a_rejoining_group_cuts_nothing(tmp_path):
    """Two groups' loggers on one run directory (train/metrics.py): each row by the writer of its step, one
    O_APPEND write each; a group that rejoins a live run (start without repair) leaves the rows the other wrote
    after its checkpoint; the group that starts the run's writing (repair) drops a crashed run's rows after the
    resume point; rows logged before the first quorum are written once the files are ready."""
    from llmtrain.config.schema import LoggingConfig
    from llmtrain.train.metrics import MetricsLogger

    cfg = LoggingConfig(progress_bar=False, tensorboard=False, wandb=False)
    turn = {"g0": True}
    g0 = MetricsLogger(tmp_path, cfg, 10, 0, writer=lambda: turn["g0"])
    g1 = MetricsLogger(tmp_path, cfg, 10, 0, writer=lambda: not turn["g0"], primary=False)
    g0.log({"step": 0, "val_loss": 5.0})  # before the first quorum: held
    assert not (tmp_path / "metrics.jsonl").exists()
    assert g0.start(0, repair=True) == [] and g1.start(0, repair=False) == []
    for step in (1, 2):
        for g in (g0, g1):
            g.log({"step": step, "loss": 1.0 / step})
    turn["g0"] = False  # group 0 is down: group 1 is the quorum's first group
    for step in (3, 4, 5):
        for g in (g0, g1):
            g.log({"step": step, "loss": 1.0 / step})
    back = MetricsLogger(
        tmp_path, cfg, 10, 2, writer=lambda: turn["g0"]
    )  # restarted from the step-2 checkpoint
    assert back.start(2, repair=False) == []  # it healed: a rejoin cuts nothing
    turn["g0"] = True
    for g in (back, g1):
        g.log({"step": 6, "loss": 1.0 / 6})
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5, 6]
    for g in (g0, g1, back):
        g.close()
    fresh = MetricsLogger(tmp_path, cfg, 10, 4, writer=lambda: True)  # a full stop, resumed at step 4
    assert fresh.start(4, repair=True) == []
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    fresh.close()


def test_slow_when_degraded_paces_only_the_steps_short_of_groups(tmp_path, monkeypatch):
    from llmtrain.config.schema import FaultConfig
    from llmtrain.train import fault

    slept: list[float] = []
    monkeypatch.setattr(fault.time, "sleep", slept.append)
    paced = fault.FaultInjector(FaultConfig(slow_rank=0, slow_seconds=2.0, slow_when="degraded"), tmp_path)
    paced.before_step(1, [])  # a full quorum
    paced.degraded = True  # set by ReplicaSet.start_step: fewer groups than fault_tolerance.replicas
    paced.before_step(2, [])
    always = fault.FaultInjector(FaultConfig(slow_rank=0, slow_seconds=0.5), tmp_path)  # the straggler drill
    always.before_step(1, [])
    assert slept == [2.0, 0.5]


# ------------------------------------------------------------------------------------------ bad input
def _refused(capsys, *argv: str) -> str:
    code = cli(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err


def test_bad_input_refused_before_anything_starts(tiny_corpus, tmp_path, capsys):
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny_corpus, tmp_path / "r"))
    err = _refused(capsys, "launch", str(cfg), "--nproc-per-node", "3", "--replicas", "2")
    assert "fault_tolerance.replicas = 2 does not divide the world size 3" in err
    err = _refused(capsys, "launch", str(cfg), "--nproc-per-node", "2", "--replicas", "2", "--lighthouse",
                   "127.0.0.1:1", "--connect-timeout", "0.5")  # fmt: skip
    assert "lighthouse 127.0.0.1:1 did not answer" in err
    err = _refused(capsys, "launch", str(cfg), "--nproc-per-node", "4", "--replicas", "2",
                   "parallel.pipeline_parallel=2", "train.micro_batch_size=4")  # fmt: skip
    assert "runs the schedule on its group's slot of 4 sequences" in err  # 1 pipeline micro-batch < 2 stages
    err = _refused(
        capsys, "launch", str(cfg), "--nproc-per-node", "4", "--replicas", "2", "train.batch_size=4"
    )
    assert "not divisible" in err and "fault_tolerance.replicas 2" in err
    assert not (tmp_path / "r").exists()  # nothing started, nothing written
    assert cli(["check", str(cfg), "fault_tolerance.enabled=true", "fault_tolerance.replicas=2",
                "--world-size", "4"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "replica groups:    2 x 2 ranks" in out and "4 samples of the global batch 8" in out

"""One fault, two ways to survive it: torchrun's elastic restart vs replica groups (torchft), side by side.

The same run (debug Llama, 2 ranks, CPU, fp32, a checkpoint every ``--save-steps``) four times through
``llmtrain launch``:

    elastic     --nproc-per-node 2 --max-restarts 1                 (one job, FSDP over 2 ranks)
    replicas    --nproc-per-node 2 --replicas 2 --max-restarts 1    (2 groups x 1 rank, fault_tolerance)

each once without a fault and once with rank 1 (elastic) / group 1 (replicas) SIGKILLed at the start of
``--kill-at``. Printed per mode: the wall time of the training (first ``run_start`` to the ``stage_end`` of the
job, or of group 0, the survivor), the seconds the fault cost (faulty minus clean), the completed steps computed
again (elastic: those since the newest checkpoint; replicas: none, only the step in flight is retried) and, for
replica groups, the survivor's stall (from the failed step to its next committed step) and the restarted
group's heal. ``--slow`` sleeps that long on rank 0 before each step (a step time closer to a real one).

    OMP_NUM_THREADS=1 .venv/bin/python bench/ft_fault.py --steps 40 --save-steps 10 --kill-at 19 --slow 0.2
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import yaml


def config(prefix: str, out: Path, steps: int, save_steps: int, slow: float, fault: dict) -> dict:
    return {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32},
        "train": {"batch_size": 8, "micro_batch_size": 2, "max_steps": steps, "lr": 3e-3, "warmup_steps": 2,
                  "seed": 5, "log_steps": 1, "eval_steps": 0},
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": save_steps, "keep_checkpoint_max": 2, "resume": "auto"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": False, "eval_iters": 1},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1},
        "fault": {"slow_rank": 0, "slow_seconds": slow, **fault},
        "fault_tolerance": {"heartbeat_timeout_s": 1.0, "join_timeout_s": 3.0, "timeout_s": 10,
                            "batch_policy": "keep"},
    }  # fmt: skip


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def measure(root: Path, prefix: str, mode: str, faulty: bool, a: argparse.Namespace) -> dict:
    name = f"{mode}_{'fault' if faulty else 'clean'}"
    out = root / name
    fault = {}
    if faulty:
        fault = {"rank": 1, "kill_at_step": [a.kill_at]} if mode == "elastic" else {
            "replica": 1, "rank": 0, "kill_at_step": [a.kill_at]}  # fmt: skip
    cfg = root / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(config(prefix, out, a.steps, a.save_steps, a.slow, fault)))
    extra = ["--replicas", "2"] if mode == "replicas" else []
    cmd = [sys.executable, "-m", "llmtrain.cli", "launch", str(cfg), "--nproc-per-node", "2",
           "--max-restarts", "1", *extra]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        sys.exit(f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}")
    ev = events(out)
    start = min(e["time"] for e in ev if e["event"] == "run_start")
    ends = [e for e in ev if e["event"] == "stage_end" and e.get("replica", 0) == 0]
    row = {"wall_s": ends[-1]["time"] - start, "recomputed": 0, "stall_s": None, "heal": None}
    resumed = [e["step"] for e in ev if e["event"] == "resumed"]
    if mode == "elastic" and faulty and resumed:
        row["recomputed"] = a.kill_at - 1 - resumed[0]
    if mode == "replicas" and faulty:
        retried = [e for e in ev if e["event"] == "step_retried"]
        lost = [e for e in ev if e["event"] == "replica_lost"]
        if retried and lost:
            row["stall_s"] = lost[0]["time"] - retried[0]["time"]
        heals = [e for e in ev if e["event"] == "heal"]
        if heals:
            row["heal"] = (
                f"step {heals[0]['step']}, {heals[0]['seconds']} s, {heals[0]['bytes'] / 1e6:.1f} MB"
            )
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-steps", type=int, default=10)
    ap.add_argument("--kill-at", type=int, default=19)
    ap.add_argument("--slow", type=float, default=0.2)
    a = ap.parse_args()
    from llmtrain.data.prep.prepare import prepare

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:12]
        prefix = str(root / "corpus" / "tiny")
        (root / "corpus").mkdir()
        prepare(files, prefix, train_tokenizer=512, log=None)
        res = {(m, f): measure(root, prefix, m, f, a) for m in ("elastic", "replicas") for f in (False, True)}
    print(f"one SIGKILL at step {a.kill_at} of {a.steps}, checkpoint every {a.save_steps} steps, "
          f"{a.slow} s extra per step")  # fmt: skip
    print(f"{'':34}{'elastic restart':>20}{'replica groups':>28}")
    e0, e1, r0, r1 = (
        res["elastic", False],
        res["elastic", True],
        res["replicas", False],
        res["replicas", True],
    )
    table = [
        ("wall time without the fault (s)", f"{e0['wall_s']:.1f}", f"{r0['wall_s']:.1f}"),
        ("wall time with the fault (s)", f"{e1['wall_s']:.1f}", f"{r1['wall_s']:.1f}"),
        (
            "seconds lost to the fault",
            f"{e1['wall_s'] - e0['wall_s']:.1f}",
            f"{r1['wall_s'] - r0['wall_s']:.1f}",
        ),
        ("completed steps computed again", str(e1["recomputed"]), str(r1["recomputed"])),
        ("survivor stall (s)", "all ranks restart", f"{r1['stall_s']:.1f}" if r1["stall_s"] else "-"),
        ("restarted group's heal", "-", r1["heal"] or "after the run"),
    ]
    for label, x, y in table:
        print(f"{label:34}{x:>20}{y:>28}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

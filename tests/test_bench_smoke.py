"""Smoke run of the benchmark that reaches into the trainer's context-parallel path (bench/long_context.py's cp2
column: two gloo ranks through ``parallelize`` and ``TrainStep.forward_loss``), so a refactor of that path
that breaks the benchmark fails here rather than at the next measurement. Figures are not asserted beyond
being numbers: the measurements themselves live in docs/performance.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_long_context_cp2_column_runs() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        str(ROOT / "bench/long_context.py"),
        "--seqs",
        "256",
        "--kinds",
        "cp2",
        "--no-loss",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| 256 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert re.fullmatch(r"\d+\.\d", cells[6]) and re.fullmatch(r"\d+\.\d{3}", cells[7]), row  # cp2 MiB, s


def test_stability_bench_runs_its_three_ways() -> None:
    """bench/stability.py at toy size (2 layers, 3 steps, one seed) on stdlib text: one row per way, numbers."""
    import glob
    import sysconfig

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:6]
    cmd = [sys.executable, str(ROOT / "bench/stability.py"), "--corpus", *files, "--depths", "2", "--hidden",
           "32", "--heads", "2", "--steps", "3", "--seeds", "1", "--vocab", "300", "--eval-iters", "1",
           "--threads", "1"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 2 | ")]
    assert [r.split("|")[2].strip() for r in rows[:3]] == ["pre", "dssn", "zloss_qk"]
    for row in rows[:3]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3].isdigit() and re.fullmatch(r"\d+\.\d{4}", cells[7]), row  # spikes, final val loss

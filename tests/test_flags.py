"""Bad numbers and paths in command flags are refused before anything runs: exit 2, the flag and what is valid,
no traceback, nothing written (issue 14's flag cases)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["plan", "CFG", "--search", "--top", "0"], "--top: expected an integer >= 1, got 0"),
        (["plan", "CFG", "--search", "--top", "-1"], "--top: expected an integer >= 1, got -1"),
        (
            ["merge", "--output", "OUT/x", "--num-shards", "0"],
            "--num-shards: expected an integer >= 1, got 0",
        ),
        (
            ["prepare", "--input", "IN", "--output", "", "--train-tokenizer", "300"],
            "--output: expected a path prefix",
        ),
        (
            ["prepare", "--input", "IN", "--output", "OUT/", "--train-tokenizer", "300"],
            "--output: expected a path prefix",
        ),
        (
            ["generate", "RUN", "--prompt", "x", "--temperature", "nan"],
            "--temperature: expected a finite number >= 0",
        ),
        (["generate", "RUN", "--prompt", "x", "--top-p", "0"], "--top-p: expected a finite number (0, 1]"),
        (
            ["generate", "RUN", "--prompt", "x", "--max-new-tokens", "0"],
            "--max-new-tokens: expected an integer >= 1",
        ),
        # launch: out of range before torchrun (its own assertion was a traceback for -1), a port past 65535
        (
            ["launch", "CFG", "--nproc-per-node", "1", "--max-restarts", "-1"],
            "--max-restarts: expected an integer >= 0",
        ),
        (
            ["launch", "CFG", "--nproc-per-node", "1", "--master-port", "99999"],
            "--master-port: expected an integer in",
        ),
        (
            ["launch", "CFG", "--nproc-per-node", "0"],
            "--nproc-per-node: expected an integer in [1, 65536], got 0",
        ),
        (
            ["launch", "CFG", "--nproc-per-node", "1", "--node-rank", "-1"],
            "--node-rank: expected an integer >= 0",
        ),
    ],
)
def test_bad_flags_exit_two_before_running(argv, needle, tmp_path):
    (tmp_path / "IN").write_text("hello\n")
    (tmp_path / "CFG").write_text("model: {flavor: debug}\n")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    p = subprocess.run([sys.executable, "-m", "llmtrain", *argv], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert sorted(x.name for x in tmp_path.rglob("*")) == before  # nothing written, not even hidden files

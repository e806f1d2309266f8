"""Exit stress: how often a finished 2-rank run still dies at exit (SIGABRT), with both cores kept busy.

Two parts, each printed as counts per outcome:

1. ``raw gloo``: the mechanism alone, no llmtrain. Two processes join a gloo group, start four 4 MiB
   all-reduces without waiting for them and leave, (a) as a script that simply ends and (b) after
   ``destroy_process_group()``. In (a) gloo's worker thread frees the finished work objects (and their tensors)
   while the interpreter is shutting down; its GIL acquire then ends the thread inside a C++ destructor and the
   process aborts with ``terminate called without an active exception``.
2. ``llmtrain``: back-to-back tiny 2-rank ``llmtrain train`` runs with asynchronous checkpoints, rotation, the
   hang watchdog, the straggler gather, TensorBoard and a profiler window (the runs of tests/test_exit.py).
   ``--src DIR`` runs another source tree (e.g. a checkout of the commit before the fix:
   ``git worktree add /tmp/before <commit>`` then ``--src /tmp/before/src``).

    OMP_NUM_THREADS=1 .venv/bin/python bench/exit_stress.py --runs 200 --raw 20
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_exit import _config, _finish, _start, busy_cores  # the test's own runs

RAW_WORKER = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1000))
works = [dist.all_reduce(torch.ones(1 << 20), async_op=True) for _ in range(4)]
del works
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
"""


def _outcome(codes: list[int]) -> str:
    if all(c == 0 for c in codes):
        return "exit 0"
    if -6 in codes or 134 in codes:
        return "SIGABRT"
    return f"exit {codes}"


def raw_gloo(mode: str, runs: int) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for _ in range(runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RAW_WORKER, mode],
                env={
                    **os.environ,
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "WORLD_SIZE": "2",
                    "RANK": str(r),
                },
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            for r in range(2)
        ]
        counts[_outcome([p.wait(timeout=120) for p in procs])] += 1
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20, help="llmtrain runs")
    ap.add_argument("--raw", type=int, default=10, help="raw gloo runs per mode")
    ap.add_argument("--src", help="source tree to run llmtrain from (PYTHONPATH), default: the installed one")
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the runs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name, busy_cores(args.busy):
        tmp = Path(tmp_name)
        if args.raw:
            for mode in ("end", "destroy"):
                t0 = time.time()
                counts = raw_gloo(mode, args.raw)
                print(f"raw gloo, {mode:8s}: {dict(counts)}  ({time.time() - t0:.0f} s)", flush=True)
        if not args.runs:
            return 0
        files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:12]
        prefix = str(tmp / "tiny")  # prepared by this tree's command (the same files either way)
        subprocess.run(
            [sys.executable, "-m", "llmtrain.cli", "prepare", "--input", *files, "--output", prefix,
             "--train-tokenizer", "512"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        if args.src:
            os.environ["PYTHONPATH"] = os.pathsep.join([args.src, os.environ.get("PYTHONPATH", "")])
        counts: collections.Counter = collections.Counter()
        t0 = time.time()
        for i in range(args.runs):
            codes, err = _finish(_start(_config(prefix, tmp / f"run{i}"), tmp), tmp)
            outcome = _outcome(codes)
            counts[outcome] += 1
            if outcome != "exit 0":
                tail = [line for line in err.splitlines() if line.strip()][-3:]
                print(f"  run {i}: {outcome}: {' | '.join(tail)[:300]}", flush=True)
            if (i + 1) % 20 == 0:
                print(f"  {i + 1} runs: {dict(counts)}", flush=True)
        print(
            f"llmtrain ({args.src or 'installed'}): {args.runs} runs: {dict(counts)}  ({time.time() - t0:.0f} s)"
        )
        return 0 if counts["exit 0"] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())

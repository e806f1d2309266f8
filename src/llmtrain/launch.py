"""``llmtrain launch CONFIG --nproc-per-node N [...] [overrides]``: torchrun's elastic agent around ``train``.

Single node: ``--standalone`` (a free local port). Several nodes: a c10d rendezvous at
``--master-addr:--master-port`` with ``--nnodes MIN:MAX`` (elastic: the job continues on at least MIN nodes
after losing one, restarted up to ``--max-restarts`` times; training resumes from the newest checkpoint).
``llmtrain train`` also runs directly under a torchrun the user starts; this command only builds the torchrun
line (printed first) and forwards its exit code. Templates for Slurm and mpirun are in ``scripts/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from llmtrain.errors import PREEMPTED_EXIT_CODE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, passed on to `llmtrain train`")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="processes (devices) per node")
    parser.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX for an elastic job (default 1)")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's rank (static multi-node)")
    parser.add_argument("--master-addr", default=None, help="rendezvous host (multi-node)")
    parser.add_argument("--master-port", type=int, default=29500, help="rendezvous port (default 29500)")
    parser.add_argument("--max-restarts", type=int, default=0, help="elastic restarts before giving up")
    parser.add_argument(
        "--run-id", default=None, help="rendezvous id (default: derived from the config path)"
    )
    parser.add_argument(
        "--rdzv-conf",
        default=None,
        help="torchrun rendezvous settings for elastic jobs, e.g. join_timeout=60,last_call_timeout=5",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command, do not run it")


def torchrun_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}"]
    if args.nnodes in ("1", "1:1") and args.master_addr is None:
        cmd.append("--standalone")
    else:
        if args.master_addr is None:
            from llmtrain.errors import ConfigError

            raise ConfigError(
                "--nnodes other than 1 needs --master-addr (the rendezvous host) and --master-port."
            )
        run_id = args.run_id or hashlib.sha1(os.path.abspath(args.config).encode()).hexdigest()[:12]
        cmd += [
            f"--nnodes={args.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.master_addr}:{args.master_port}",
            f"--rdzv-id={run_id}",
        ]
        if getattr(args, "rdzv_conf", None):
            cmd.append(f"--rdzv-conf={args.rdzv_conf}")
        if args.node_rank is not None:
            cmd.append(f"--node-rank={args.node_rank}")
    cmd += [
        f"--max-restarts={args.max_restarts}",
        "-m",
        "llmtrain.cli",
        "train",
        args.config,
        *args.overrides,
    ]
    return cmd


def main(args: argparse.Namespace) -> int:
    from llmtrain.config import load_config, validate

    nnodes_min = int(str(args.nnodes).split(":")[0])
    cfg, _ = load_config(args.config, args.overrides)
    validate(cfg, world_size=args.nproc_per_node * nnodes_min, require_data=True)  # fail before spawning
    cmd = torchrun_command(args)
    print("launch: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if args.dry_run:
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // args.nproc_per_node, 1)))
    # Workers must not share the rendezvous TCPStore: after an elastic restart they would read the previous
    # attempt's gloo/NCCL addresses from it ("Connection refused", pytorch/pytorch#135712).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    code = subprocess.call(cmd, env=env)
    if code != 0 and _preempted(Path(cfg.run.output_dir)):
        return PREEMPTED_EXIT_CODE  # torchrun reports a worker's 75 as a failure (1): say what happened
    return code


def _preempted(run_dir: Path) -> bool:
    """True when the newest attempt recorded in ``events.jsonl`` ended with a ``preempted`` event."""
    path = run_dir / "events.jsonl"
    if not path.is_file():
        return False
    last = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line).get("event")
        except (ValueError, AttributeError):
            continue
        if event in ("run_start", "preempted"):
            last = event
    return last == "preempted"

"""``llmtrain launch CONFIG --nproc-per-node N --replicas R``: the lighthouse and R replica groups.

One host: the N processes are R groups of N / R, each its own ``torchrun --standalone`` (its own rendezvous,
its own ``--max-restarts``: when a rank of a group dies, torchrun restarts that group alone; its new ranks
resume from the newest checkpoint, then heal live from a peer at their first quorum). Each group's ranks get
``LLMTRAIN_REPLICA_ID`` and ``TORCHFT_LIGHTHOUSE``; the config gets ``fault_tolerance.enabled=true`` and
``fault_tolerance.replicas=R``. The lighthouse is embedded (this process; it lives as long as the launch) or,
with ``--lighthouse HOST:PORT``, one running elsewhere, checked before anything starts and watched while the
groups run (ft/lighthouse.py: its loss stops the groups, exit code 76; a rerun resumes).

Exit code: 0 when every group finished; the first failing group's code otherwise (a group that exhausted its
restarts while the others finished still fails the launch: its failure is not hidden).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llmtrain.errors import ConfigError
from llmtrain.ft.layout import LIGHTHOUSE_ENV, REPLICA_ENV, group_world
from llmtrain.ft.lighthouse import LIGHTHOUSE_LOST_EXIT_CODE, reachable, require_reachable, start


def ft_overrides(replicas: int) -> list[str]:
    return ["fault_tolerance.enabled=true", f"fault_tolerance.replicas={replicas}"]


def launch_replicas(spec: Any, dry_run: bool = False) -> int:
    """Validate, start the lighthouse and the groups of ``spec`` (a ``llmtrain.launch.LaunchSpec``), wait."""
    from llmtrain.config import load_config
    from llmtrain.launch import check_devices, torchrun_command
    from llmtrain.resolve import validate

    if str(spec.nnodes) not in ("1", "1:1") or spec.master_addr is not None:
        raise ConfigError(
            "--replicas runs the replica groups of one host (each group one torchrun); for several nodes start "
            "one `llmtrain train` group per node set with LLMTRAIN_REPLICA_ID and TORCHFT_LIGHTHOUSE (see "
            "scripts/slurm_train.sbatch and docs/launch.md)."
        )
    overrides = [*spec.overrides, *ft_overrides(spec.replicas)]
    cfg, _ = load_config(spec.config, overrides)
    group = group_world(cfg, spec.nproc_per_node)
    validate(cfg, world_size=group, require_data=True)  # one group's layout, before anything starts
    check_devices(spec.nproc_per_node, cfg.run.device_target)
    ft = cfg.fault_tolerance
    remote = spec.lighthouse or ft.lighthouse
    if remote is not None and not dry_run:
        require_reachable(remote, spec.connect_timeout_s)
    group_spec = dataclasses.replace(spec, nproc_per_node=group, overrides=overrides, replicas=1)
    cmd = torchrun_command(group_spec)
    for r in range(spec.replicas):
        print(f"launch: group {r}: {REPLICA_ENV}={r} " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if dry_run:
        return 0
    server = None
    if remote is not None:
        address = remote
    else:
        server = start(ft.min_replicas, ft.join_timeout_s, ft.heartbeat_timeout_s)
        address = str(server.address())
    print(f"launch: lighthouse {address} ({'remote' if remote else 'embedded'})", flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // spec.nproc_per_node, 1)))
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env[LIGHTHOUSE_ENV] = address
    procs = [_start_group(cmd, {**env, REPLICA_ENV: str(r)}) for r in range(spec.replicas)]
    stopped: list[int] = []

    def forward(signum: int, frame: object) -> None:  # SIGTERM / SIGINT / SIGHUP: every group stops (75)
        if stopped:  # a second signal: kill everything now
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return
        stopped.append(signum)
        print(
            f"launch: {signal.Signals(signum).name}: stopping every replica group",
            file=sys.stderr,
            flush=True,
        )
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        code = _wait(procs, remote)
        if stopped and code != 0:
            from llmtrain.errors import PREEMPTED_EXIT_CODE
            from llmtrain.launch import _preempted

            return PREEMPTED_EXIT_CODE if _preempted(Path(cfg.run.output_dir)) else 128 + stopped[0]
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if server is not None:
            server.shutdown()


def _start_group(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """One group's torchrun agent, in a session of its own (a Ctrl-C reaches the launcher only, which passes
    it on once), killed when the launcher dies (parent-death signal; distributed/orphan.py)."""
    from llmtrain.distributed.orphan import set_parent_death_signal

    return subprocess.Popen(
        cmd, env=env, start_new_session=True, preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL)
    )  # noqa: PLW1509


def _wait(procs: list[subprocess.Popen], remote: str | None) -> int:
    """Wait for every group; a remote lighthouse that stops answering stops them all (SIGTERM, exit 76)."""
    last_check = time.monotonic()
    while any(p.poll() is None for p in procs):
        time.sleep(0.2)
        if remote is not None and time.monotonic() - last_check > 2.0:
            last_check = time.monotonic()
            if not reachable(remote, 2.0):
                print(
                    f"launch: the lighthouse {remote} stopped answering: stopping every group",
                    file=sys.stderr,
                )
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                for p in procs:
                    try:
                        p.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
                return LIGHTHOUSE_LOST_EXIT_CODE
    codes = [p.returncode for p in procs]
    return next((c for c in codes if c != 0), 0)

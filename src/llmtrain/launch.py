"""``llmtrain launch CONFIG --nproc-per-node N [...] [overrides]``: torchrun's elastic agent around ``train``.

Single node: ``--standalone`` (a free local port). Several nodes: a c10d rendezvous at
``--master-addr:--master-port`` with ``--nnodes MIN:MAX`` (elastic: the job continues on at least MIN nodes
after losing one, restarted up to ``--max-restarts`` times; training resumes from the newest checkpoint).
``llmtrain train`` also runs directly under a torchrun the user starts; this command only builds the torchrun
line (printed first) and forwards its exit code. Before spawning it checks the layout, the devices
(:func:`check_devices`) and, for a rendezvous on another host, that the host answers within ``--connect-timeout``
(:func:`wait_for_rendezvous_host`). mpirun and Slurm start ``llmtrain train`` directly (it reads their rank
variables: :mod:`llmtrain.distributed.env`); scripts for them are in ``scripts/``, the table of every launcher in
docs/launch.md.

This module is the launcher (:class:`LaunchSpec`, :func:`launch`); the command's flags are in
:mod:`llmtrain.commands.launch`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from llmtrain.errors import PREEMPTED_EXIT_CODE


@dataclass(frozen=True)
class LaunchSpec:
    """What to run and how torchrun lays it out (the flags of ``llmtrain launch``, same names and defaults)."""

    config: str
    overrides: list[str]
    nproc_per_node: int
    nnodes: str = "1"  # N, or MIN:MAX for an elastic job
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int = 29500
    max_restarts: int = 0
    run_id: str | None = None  # None: derived from the config path
    rdzv_conf: str | None = None
    connect_timeout_s: float = (
        60.0  # how long to wait for a remote rendezvous host to answer (--connect-timeout)
    )


def torchrun_command(spec: LaunchSpec) -> list[str]:
    """The torchrun command line that runs ``llmtrain train`` as ``spec`` describes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={spec.nproc_per_node}"]
    if spec.nnodes in ("1", "1:1") and spec.master_addr is None:
        cmd.append("--standalone")
    else:
        if spec.master_addr is None:
            from llmtrain.errors import ConfigError

            raise ConfigError(
                "--nnodes other than 1 needs --master-addr (the rendezvous host) and --master-port."
            )
        run_id = spec.run_id or hashlib.sha1(os.path.abspath(spec.config).encode()).hexdigest()[:12]
        cmd += [
            f"--nnodes={spec.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.master_addr}:{spec.master_port}",
            f"--rdzv-id={run_id}",
        ]
        if spec.rdzv_conf:
            cmd.append(f"--rdzv-conf={spec.rdzv_conf}")
        if spec.node_rank is not None:
            cmd.append(f"--node-rank={spec.node_rank}")
    cmd += [
        f"--max-restarts={spec.max_restarts}",
        "-m",
        "llmtrain.cli",
        "train",
        spec.config,
        *spec.overrides,
    ]
    return cmd


def launch(spec: LaunchSpec, dry_run: bool = False) -> int:
    """Validate the config for the whole job, print the torchrun line and (unless ``dry_run``) run it; returns
    torchrun's exit code, or PREEMPTED_EXIT_CODE when the newest attempt was preempted."""
    from llmtrain.config import load_config
    from llmtrain.resolve import validate

    nnodes_min = int(str(spec.nnodes).split(":")[0])
    cfg, _ = load_config(spec.config, spec.overrides)
    validate(cfg, world_size=spec.nproc_per_node * nnodes_min, require_data=True)  # fail before spawning
    check_devices(spec.nproc_per_node, cfg.run.device_target)
    cmd = torchrun_command(spec)
    if spec.master_addr is not None and not dry_run:
        wait_for_rendezvous_host(spec.master_addr, spec.master_port, spec.connect_timeout_s)
    print("launch: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if dry_run:
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // spec.nproc_per_node, 1)))
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


def check_devices(nproc_per_node: int, device_target: str) -> None:
    """More processes than this node's accelerators: ConfigError (two ranks on one GPU fail in NCCL, late). More
    processes than CPU cores on a CPU run: a warning only (it runs, slowly; torchrun allows it too)."""
    import torch

    from llmtrain.distributed.device import normalize_device_target
    from llmtrain.errors import ConfigError

    kind = normalize_device_target(device_target)
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and torch.cuda.is_available() and nproc_per_node > torch.cuda.device_count():
        raise ConfigError(
            f"--nproc-per-node {nproc_per_node} is more than the {torch.cuda.device_count()} CUDA devices of this "
            "node (one process per device); lower it, or add devices (CUDA_VISIBLE_DEVICES)."
        )
    cores = os.cpu_count() or 1
    if kind == "cpu" and nproc_per_node > cores:
        print(
            f"launch: warning: --nproc-per-node {nproc_per_node} is more than this machine's {cores} CPU cores: "
            "the processes share cores (it runs, slowly; each gets OMP_NUM_THREADS=1).",
            file=sys.stderr,
            flush=True,
        )


def _is_this_host(host: str) -> bool:
    """True when ``host`` names this machine (a loopback address, or one of this host name's addresses): the
    agent here then hosts the rendezvous store itself instead of connecting to it."""
    import socket

    from llmtrain.errors import ConfigError

    try:
        addrs = {str(a[4][0]) for a in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise ConfigError(
            f"--master-addr {host!r} does not resolve ({e.strerror}); give the rendezvous host's name or IP address."
        ) from None
    if any(a.startswith("127.") or a == "::1" for a in addrs) or host in (
        socket.gethostname(),
        socket.getfqdn(),
    ):
        return True
    try:
        mine = {str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None)}
    except socket.gaierror:
        mine = set()
    return bool(addrs & mine)


def wait_for_rendezvous_host(host: str, port: int, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` (``--connect-timeout``) for a remote rendezvous host to accept a TCP connection on
    ``port``; ConfigError (exit 2) naming the host, the port and the timeout when it never does. Nothing to wait
    for when the host is this machine (the agent here starts the store)."""
    import socket
    import time

    from llmtrain.errors import ConfigError

    if _is_this_host(host):
        return
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            socket.create_connection((host, port), timeout=min(left, 5.0)).close()
            return
        except OSError as e:
            last = e.strerror or type(e).__name__
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0)))
    raise ConfigError(
        f"the rendezvous host {host}:{port} did not answer within --connect-timeout {timeout_s:g} s (last: {last}). "
        "Start `llmtrain launch` on that node first (its agent hosts the rendezvous store), check --master-addr "
        "and --master-port and that the port is reachable from here, or raise --connect-timeout."
    )

"""``llmtrain launch CONFIG --nproc-per-node N [...] [overrides]``: torchrun's elastic agent around ``train``.

Single node: ``--standalone`` (a free local port). Several nodes: a c10d rendezvous at
``--master-addr:--master-port`` with ``--nnodes MIN:MAX`` (elastic: the job continues on at least MIN nodes
after losing one, restarted up to ``--max-restarts`` times; training resumes from the newest checkpoint).
``llmtrain train`` also runs directly under a torchrun the user starts; this command builds the torchrun line
(printed first), runs it (through :func:`_agent_main`: torchrun's main, which ends on a stop signal with one line
instead of a traceback) and forwards its exit code. It owns the job's end (:func:`run_agent`): SIGTERM, SIGINT
and SIGHUP are passed on once (the workers save and exit 75), the wait is bounded (``--stop-timeout``), and no
worker outlives the launcher or its agent. Before spawning it checks the layout, the devices
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
import signal
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
    stop_timeout_s: float = 60.0  # --stop-timeout: how long a stopping worker may take to save (then SIGKILL)
    replicas: int = 1  # --replicas: replica groups with torchft (ft/launch.py); 1 = one torchrun, as before
    lighthouse: str | None = None  # --lighthouse HOST:PORT (None with replicas: an embedded lighthouse)


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
    # the time a stopping worker has to save (torchrun's --shutdown-timeout; also the orphan guard's grace)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(max(int(spec.stop_timeout_s), 1)))
    code, stopped_by = run_agent(cmd, env, spec.stop_timeout_s)
    if code != 0 and _preempted(Path(cfg.run.output_dir)):
        return PREEMPTED_EXIT_CODE  # torchrun reports a worker's 75 as a failure (1): say what happened
    if stopped_by is not None:
        return 128 + stopped_by  # stopped by the user before any step was saved: 130 (Ctrl-C), 143 (SIGTERM)
    return code if code >= 0 else 1  # the agent itself was killed (-9): a failure


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what the launcher passes on to the job


class _Stop:
    """The launcher's signal handler: the first SIGTERM / SIGINT / SIGHUP is passed on to the agent as SIGTERM
    and starts the clock; a second one, or the end of the clock, kills the job (SIGKILL)."""

    def __init__(self, agent: subprocess.Popen, timeout_s: float):
        self.agent, self.timeout_s = agent, timeout_s
        self.signum: int | None = None
        self.kill_at: float | None = None  # time.monotonic() after which everything left is killed

    def __call__(self, signum: int, frame: object) -> None:
        import time

        if self.signum is not None:
            print("launch: a second signal: killing the job now", file=sys.stderr, flush=True)
            self.kill_at = time.monotonic()
            return
        self.signum = signum
        self.kill_at = time.monotonic() + self.timeout_s + STOP_MARGIN_S
        print(
            f"launch: {signal.Signals(signum).name}: stopping the job (SIGTERM to the torchrun agent, which passes "
            "it to every worker: they stop after the same step, save it and exit 75; rerun the same command to "
            f"resume). Waiting up to {self.timeout_s + STOP_MARGIN_S:g} s; signal again to kill it at once.",
            file=sys.stderr,
            flush=True,
        )
        _signal_quietly(self.agent.pid, signal.SIGTERM)


STOP_MARGIN_S = 15.0  # beyond --stop-timeout: the agent's own SIGKILL of its workers and its exit


def run_agent(cmd: list[str], env: dict[str, str], stop_timeout_s: float) -> tuple[int, int | None]:
    """Run the torchrun agent ``cmd`` to its end, and leave no process of the job behind; returns (the agent's
    exit code, the signal that stopped the launcher or None).

    * The agent runs in a session of its own, so a Ctrl-C at the terminal or a signal to the launcher's process
      group reaches the launcher only. The launcher passes SIGTERM / SIGINT / SIGHUP on to the agent as one
      SIGTERM (:class:`_Stop`); the agent sends it once to every worker (a second one would make a worker skip
      its save) and waits ``stop_timeout_s`` for them (torchrun's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) before it
      kills them. The launcher waits that long plus :data:`STOP_MARGIN_S`, then kills whatever is left.
    * The agent is killed when the launcher dies (a parent-death signal, SIGKILL: the launcher has threads, and
      a dying multi-threaded parent sends it once per thread, which a SIGTERM handler would take for a second
      signal); its workers then stop by themselves, as below.
    * The launcher is a subreaper (``distributed/orphan.py``): when the agent dies (SIGKILL, OOM), its workers,
      which stop by themselves (``orphan.stop_with_parent``), become the launcher's children; it waits for them
      (the same bound) and kills any that outlive it.
    """
    import time

    from llmtrain.distributed.orphan import become_subreaper, set_parent_death_signal

    become_subreaper()
    launcher = os.getpid()

    def agent_setup() -> None:  # in the agent, between fork and exec
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != launcher:  # the launcher died before that: nothing would stop this agent
            os.kill(os.getpid(), signal.SIGKILL)

    agent = subprocess.Popen(_quiet_agent(cmd), env=env, start_new_session=True, preexec_fn=agent_setup)  # noqa: PLW1509
    stop = _Stop(agent, stop_timeout_s)
    previous = {sig: signal.signal(sig, stop) for sig in FORWARDED}
    try:
        code = _wait_or_kill(agent, stop)
        deadline = stop.kill_at or time.monotonic() + stop_timeout_s + STOP_MARGIN_S
        _reap_adopted(stop, deadline)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code, stop.signum


def _quiet_agent(cmd: list[str]) -> list[str]:
    """``cmd`` with torchrun's module replaced by this one's :func:`_agent_main` (the same agent), when it is the
    ``python -m torch.distributed.run`` line of :func:`torchrun_command`."""
    if cmd[1:3] == ["-m", "torch.distributed.run"]:
        return [cmd[0], "-m", "llmtrain.launch", *cmd[3:]]
    return cmd


def _agent_main() -> int:
    """torchrun's own main (``python -m llmtrain.launch TORCHRUN-ARGS``), which ends on a stop signal with one
    line instead of torchrun's traceback; its other ends are torchrun's."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    try:
        main()
    except SignalException as e:
        print(
            f"launch: the torchrun agent stopped its workers on {e.sigval.name}", file=sys.stderr, flush=True
        )
        return 128 + int(e.sigval)
    return 0


def _wait_or_kill(agent: subprocess.Popen, stop: _Stop) -> int:
    """The agent's exit code; the agent and its descendants are killed once ``stop.kill_at`` has passed."""
    import time

    while True:
        try:
            return agent.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if stop.kill_at is not None and time.monotonic() >= stop.kill_at:
                for pid in reversed(_descendants(agent.pid)):  # the workers, then the agent
                    _signal_quietly(pid, signal.SIGKILL)


def _reap_adopted(stop: _Stop, deadline: float) -> None:
    """Wait for the processes this launcher adopted (workers whose agent died) until ``deadline`` (or
    ``stop.kill_at``, which a second signal moves to now), then kill those left and reap them."""
    import time

    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no children left
        if pid:
            continue
        if time.monotonic() >= min(deadline, stop.kill_at or deadline):
            for child in _children(os.getpid()):
                _signal_quietly(child, signal.SIGKILL)
            deadline = stop.kill_at = float("inf")  # killed: now only reap them
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry))
    return found


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, parents before children."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo += _children(p)
    return found


def _signal_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


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


if __name__ == "__main__":  # the torchrun agent of run_agent (_quiet_agent)
    sys.exit(_agent_main())

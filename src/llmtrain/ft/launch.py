"""``llmtrain launch CONFIG --nproc-per-node N --replicas R``: the lighthouse and R replica groups.

One host: the N processes are R groups of N / R, each its own ``torchrun --standalone`` (its own rendezvous,
its own ``--max-restarts``: when a rank of a group dies, torchrun restarts that group alone; its new ranks
resume from the newest checkpoint, then heal live from a peer at their first quorum). Each group's ranks get
``LLMTRAIN_REPLICA_ID`` and ``TORCHFT_LIGHTHOUSE``; the config gets ``fault_tolerance.enabled=true`` and
``fault_tolerance.replicas=R``. The lighthouse is embedded (this process; it lives as long as the launch) or,
with ``--lighthouse HOST:PORT``, one running elsewhere, checked before anything starts and watched while the
groups run (ft/lighthouse.py: its loss stops the groups, exit code 76; a rerun resumes).

Several nodes (``--nnodes M --node-rank K --master-addr H``, the same command on every node; :func:`node_share`):
when M divides R each node runs R / M whole groups (replica ids K x R / M ..), each ``--standalone`` as on one
host; when R divides M each group spans M / R nodes (nodes r x M / R .. of group r), one torchrun per node
joining the group's c10d rendezvous at ``H:--master-port`` (run id ``<run id>-g<r>``). Node 0's launcher hosts
that rendezvous store (the other agents connect to it, ``is_host=false``) and, without ``--lighthouse``, the
lighthouse at ``H:--master-port + 1`` (:data:`LIGHTHOUSE_PORT_OFFSET`); the other nodes wait up to
``--connect-timeout`` for both to answer, then watch the lighthouse like a remote one. Node 0 keeps both up
until every node's launcher has reported its end through the store (or stopped sending heartbeats,
:data:`NODE_STALE_S`). Node 0 is therefore the job's single point of failure: its loss stops every group (76).

Exit code: 0 when every group of this node finished; the first failing group's code otherwise (a group that
exhausted its restarts while the others finished still fails the launch: its failure is not hidden).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmtrain.errors import ConfigError
from llmtrain.ft.layout import LIGHTHOUSE_ENV, REPLICA_ENV, group_world
from llmtrain.ft.lighthouse import LIGHTHOUSE_LOST_EXIT_CODE, reachable, require_reachable, start

LIGHTHOUSE_PORT_OFFSET = 1
"""Several nodes without ``--lighthouse``: node 0 runs the lighthouse at ``--master-addr:--master-port + 1``."""
NODE_STALE_S = 30.0
"""Node 0 stops waiting for a node whose launcher sent no heartbeat through the store for this long."""
STORE_PREFIX = "llmtrain/replicas/"


def ft_overrides(replicas: int) -> list[str]:
    return ["fault_tolerance.enabled=true", f"fault_tolerance.replicas={replicas}"]


@dataclasses.dataclass(frozen=True)
class NodeShare:
    """This node's part of R replica groups over M nodes of N processes each."""

    replica_ids: list[int]
    """The groups with ranks on this node."""
    group_nodes: int
    """Nodes per group: 1 when whole groups run on this node (``--standalone``), M / R otherwise."""
    node_in_group: int
    """This node's rank inside its group (0 when ``group_nodes`` is 1)."""
    procs_per_group: int
    """Each group's processes on this node."""


def valid_replicas(nnodes: int, nproc_per_node: int) -> list[int]:
    """The ``--replicas`` values above 1 that M nodes of N processes can run: divisors of M (groups of whole
    nodes) and M x d for each divisor d of N (whole groups on each node)."""
    div = lambda n: [d for d in range(1, n + 1) if n % d == 0]  # noqa: E731
    return sorted({r for r in [*div(nnodes), *(nnodes * d for d in div(nproc_per_node))] if r > 1})


def node_share(replicas: int, nnodes: int, node_rank: int, nproc_per_node: int) -> NodeShare:
    """Where node ``node_rank`` of ``nnodes`` sits among ``replicas`` groups; ConfigError (naming --nnodes and
    --replicas and the valid choices) when the groups cannot be laid on the nodes."""
    if replicas % nnodes == 0 and nproc_per_node % (replicas // nnodes) == 0:
        k = replicas // nnodes
        return NodeShare(list(range(node_rank * k, node_rank * k + k)), 1, 0, nproc_per_node // k)
    if nnodes % replicas == 0:
        s = nnodes // replicas
        return NodeShare([node_rank // s], s, node_rank % s, nproc_per_node)
    raise ConfigError(
        f"launch --replicas {replicas} with --nnodes {nnodes} (x --nproc-per-node {nproc_per_node}): replica groups "
        "must be whole nodes or lie whole on a node: --replicas must divide --nnodes (each group spans --nnodes / "
        "--replicas nodes) or be --nnodes times a divisor of --nproc-per-node (each node runs whole groups). "
        f"Valid here: {', '.join(map(str, valid_replicas(nnodes, nproc_per_node))) or 'none'}."
    )


def _multinode_share(spec: Any) -> NodeShare:
    """The checks of a several-node ``--replicas`` launch (static, node rank and rendezvous host given)."""
    nnodes = str(spec.nnodes)
    low, _, high = nnodes.partition(":")
    if high and high != low:
        raise ConfigError(
            f"launch --replicas with --nnodes {nnodes}: replica groups need a fixed number of nodes (a lost node's "
            f"groups are restarted, the others keep training); use --nnodes {high} with --node-rank."
        )
    if spec.master_addr is None or spec.node_rank is None:
        raise ConfigError(
            f"launch --replicas {spec.replicas} --nnodes {low} needs --master-addr (node 0's address: it runs the "
            "rendezvous store and the lighthouse) and --node-rank (0 .. nnodes - 1) on every node."
        )
    return node_share(spec.replicas, int(low), spec.node_rank, spec.nproc_per_node)


def _group_spec(spec: Any, share: NodeShare, r: int, overrides: list[str]) -> Any:
    """The LaunchSpec of group ``r``'s torchrun on this node."""
    if share.group_nodes == 1:  # whole groups here: each its own --standalone rendezvous
        return dataclasses.replace(
            spec, nproc_per_node=share.procs_per_group, overrides=overrides, replicas=1, nnodes="1",
            node_rank=None, master_addr=None, run_id=None, rdzv_conf=None,
        )  # fmt: skip
    base = spec.run_id or hashlib.sha1(os.path.abspath(spec.config).encode()).hexdigest()[:12]
    conf = ",".join(c for c in (spec.rdzv_conf, "is_host=false") if c)  # node 0's launcher hosts the store
    return dataclasses.replace(
        spec, nproc_per_node=share.procs_per_group, overrides=overrides, replicas=1,
        nnodes=str(share.group_nodes), node_rank=share.node_in_group, run_id=f"{base}-g{r}", rdzv_conf=conf,
    )  # fmt: skip


def launch_replicas(spec: Any, dry_run: bool = False) -> int:
    """Validate, start the lighthouse and the groups of ``spec`` (a ``llmtrain.launch.LaunchSpec``), wait."""
    from llmtrain.config import load_config
    from llmtrain.launch import _quiet_agent, check_devices, torchrun_command

    multi = str(spec.nnodes) not in ("1", "1:1") or spec.master_addr is not None
    if multi:
        share = _multinode_share(spec)
        nnodes, node_rank = int(str(spec.nnodes).split(":")[0]), spec.node_rank
    else:
        nnodes, node_rank = 1, 0
    overrides = [*spec.overrides, *ft_overrides(spec.replicas)]
    cfg, _ = load_config(spec.config, overrides)
    group = group_world(cfg, spec.nproc_per_node * nnodes)
    if not multi:
        share = NodeShare(list(range(spec.replicas)), 1, 0, group)
    from llmtrain.resolve import validate

    validate(cfg, world_size=group, require_data=True)  # one group's layout, before anything starts
    check_devices(spec.nproc_per_node, cfg.run.device_target)
    ft = cfg.fault_tolerance
    remote = spec.lighthouse or ft.lighthouse
    embed_port = 0  # an embedded lighthouse: a free port on one host, a fixed one on node 0 of several
    if multi and remote is None:
        embed_port = spec.master_port + LIGHTHOUSE_PORT_OFFSET
        if node_rank > 0:
            remote = f"{spec.master_addr}:{embed_port}"  # node 0's, watched like any remote lighthouse
    cmds = {r: torchrun_command(_group_spec(spec, share, r, overrides)) for r in share.replica_ids}
    if multi:
        print(
            f"launch: node {node_rank} of {nnodes}: replica groups {share.replica_ids} of {spec.replicas} "
            f"({share.group_nodes} node(s) per group, {share.procs_per_group} process(es) per group here)",
            flush=True,
        )
    for r, cmd in cmds.items():
        print(f"launch: group {r}: {REPLICA_ENV}={r} " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if dry_run:
        return 0
    store = None
    if multi:  # node 0 hosts the store (group rendezvous, node ends); the others wait for it
        store = _store(spec.master_addr, spec.master_port, node_rank == 0, spec.connect_timeout_s)
    if remote is not None:
        require_reachable(remote, spec.connect_timeout_s)
    server = None
    if remote is not None:
        address = remote if "://" in remote else f"http://{remote}"
    else:
        server = start(ft.min_replicas, ft.join_timeout_s, ft.heartbeat_timeout_s, port=embed_port)
        address = f"http://{spec.master_addr}:{embed_port}" if multi else str(server.address())
    print(f"launch: lighthouse {address} ({'remote' if remote else 'embedded'})", flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // spec.nproc_per_node, 1)))
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env[LIGHTHOUSE_ENV] = address
    procs = [_start_group(_quiet_agent(cmd), {**env, REPLICA_ENV: str(r)}) for r, cmd in cmds.items()]
    stopped: list[int] = []

    def forward(signum: int, frame: object) -> None:  # SIGTERM / SIGINT / SIGHUP: every group stops (75)
        stopped.append(signum)
        if len(stopped) > 1:  # a second signal: kill everything now
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return
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
        tick = None if store is None or node_rank == 0 else _heartbeat(store, node_rank)
        code = _wait(procs, remote, tick)
        if store is not None and code != LIGHTHOUSE_LOST_EXIT_CODE:  # 76: node 0 (or the lighthouse) is gone
            _node_end(store, node_rank, nnodes, code, lambda: len(stopped) > 1)
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


def _store(host: str, port: int, is_master: bool, timeout_s: float) -> Any:
    """Node 0: the store at ``port`` on every interface (multi-tenant: the groups' c10d rendezvous use it too);
    the other nodes: a client of node 0's, once it answers (``--connect-timeout``). ConfigError otherwise."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    if not is_master and not reachable(f"{host}:{port}", timeout_s):
        raise ConfigError(
            f"launch --replicas on several nodes: node 0's store at {host}:{port} (--master-addr, --master-port) "
            f"did not answer within --connect-timeout {timeout_s:g} s. Start node 0's `llmtrain launch` (it hosts "
            "the store and the lighthouse), give every node the same --master-addr and --master-port, or raise "
            "--connect-timeout."
        )
    try:
        return TCPStore(
            host, port, is_master=is_master, multi_tenant=True, wait_for_workers=False,
            timeout=timedelta(seconds=max(timeout_s, 30.0)),
        )  # fmt: skip
    except (RuntimeError, ValueError, TimeoutError) as e:
        raise ConfigError(
            f"launch --replicas on several nodes: {'node 0 could not listen' if is_master else 'no store'} at "
            f"{host}:{port} (--master-addr, --master-port): {str(e).splitlines()[0] if str(e) else type(e).__name__}. "
            "Use a free port, the same on every node."
        ) from None


def _heartbeat(store: Any, node_rank: int) -> Callable[[], None]:
    """A node's sign of life for node 0 (:func:`_node_end`), sent from :func:`_wait`'s loop."""

    def tick() -> None:
        try:
            store.add(f"{STORE_PREFIX}alive/{node_rank}", 1)
        except Exception:  # node 0 gone: the lighthouse watch says so  # noqa: BLE001
            pass

    return tick


def _node_end(store: Any, node_rank: int, nnodes: int, code: int, abort: Callable[[], bool]) -> None:
    """A node other than 0 reports its end; node 0 waits for every other node's report before it takes the store
    and the lighthouse down (a node whose heartbeat stopped for :data:`NODE_STALE_S` is not waited for)."""
    if node_rank > 0:
        try:
            store.set(f"{STORE_PREFIX}done/{node_rank}", str(code))
        except Exception:  # noqa: BLE001
            pass
        return
    left = {k: (-1, time.monotonic()) for k in range(1, nnodes)}  # node -> (last heartbeat, seen at)
    announced = False
    while left and not abort():
        for k in list(left):
            if store.check([f"{STORE_PREFIX}done/{k}"]):
                del left[k]
                continue
            beat = store.add(f"{STORE_PREFIX}alive/{k}", 0)
            if beat != left[k][0]:
                left[k] = (beat, time.monotonic())
            elif time.monotonic() - left[k][1] > NODE_STALE_S:
                print(f"launch: node {k} sent no heartbeat for {NODE_STALE_S:g} s: not waiting for it",
                      file=sys.stderr, flush=True)  # fmt: skip
                del left[k]
        if left and not announced:
            print(f"launch: node 0 keeps the lighthouse up until nodes {sorted(left)} end", flush=True)
            announced = True
        time.sleep(0.5)


def _start_group(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """One group's torchrun agent, in a session of its own (a Ctrl-C reaches the launcher only, which passes
    it on once), killed when the launcher dies (parent-death signal; distributed/orphan.py)."""
    from llmtrain.distributed.orphan import set_parent_death_signal

    return subprocess.Popen(
        cmd, env=env, start_new_session=True, preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL)
    )  # noqa: PLW1509


def _wait(procs: list[subprocess.Popen], remote: str | None, tick: Callable[[], None] | None = None) -> int:
    """Wait for every group; a remote lighthouse that stops answering stops them all (SIGTERM, exit 76)."""
    last_check = time.monotonic()
    while any(p.poll() is None for p in procs):
        time.sleep(0.2)
        if time.monotonic() - last_check > 2.0:
            last_check = time.monotonic()
            if remote is not None and not reachable(remote, 2.0):
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
            if tick is not None:
                tick()
    codes = [p.returncode for p in procs]
    return next((c for c in codes if c != 0), 0)

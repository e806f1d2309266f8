"""``llmtrain launch CONFIG --nproc-per-node N [...] [overrides]``: torchrun's elastic agent around ``train``.

Single node: ``--standalone``; several nodes: a c10d rendezvous at ``--master-addr:--master-port`` with
``--nnodes MIN:MAX`` (elastic). The flags become a :class:`llmtrain.launch.LaunchSpec`;
:func:`llmtrain.launch.launch` prints the torchrun line, runs it and forwards its exit code (see that module).
"""

from __future__ import annotations

import argparse

from llmtrain.commands.flags import (
    check_launch_flags,
    float_in,
    int_at_least,
    name_token,
    node_range,
    rdzv_conf,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, passed on to `llmtrain train`")
    parser.add_argument(
        "--nproc-per-node", type=int_at_least(1, 1 << 16), required=True, help="processes (devices) per node"
    )
    parser.add_argument(
        "--nnodes", default="1", type=node_range, help="nodes, or MIN:MAX for an elastic job (default 1)"
    )
    parser.add_argument(
        "--node-rank", type=int_at_least(0), default=None, help="this node's rank (static multi-node)"
    )
    parser.add_argument("--master-addr", type=name_token, default=None, help="rendezvous host (multi-node)")
    parser.add_argument(
        "--master-port",
        type=int_at_least(1, 65535),
        default=None,
        help="rendezvous port (multi-node; default 29500)",
    )
    parser.add_argument(
        "--max-restarts", type=int_at_least(0), default=0, help="elastic restarts before giving up"
    )
    parser.add_argument(
        "--run-id",
        type=name_token,
        default=None,
        help="rendezvous id (default: derived from the config path)",
    )
    parser.add_argument(
        "--rdzv-conf",
        type=rdzv_conf,
        default=None,
        help="torchrun rendezvous settings for elastic jobs, e.g. join_timeout=60,last_call_timeout=5",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float_in(0, 86400, low_open=True),
        default=None,
        help="seconds to wait for a remote --master-addr or --lighthouse to answer before giving up with exit 2 "
        "(default 60)",
    )
    parser.add_argument(
        "--replicas", type=int_at_least(1, 1 << 16), default=1,
        help="replica groups (torchft): a failed rank drops its group, the others keep training; the group is "
        "restarted (--max-restarts) and heals live from a peer (default 1: one torchrun job). Several nodes "
        "(--nnodes M --node-rank K --master-addr H): R a multiple of M (whole groups per node) or a divisor of M "
        "(groups of M / R nodes); node 0 runs the lighthouse at H:--master-port + 1",
    )  # fmt: skip
    parser.add_argument(
        "--lighthouse", default=None, metavar="HOST:PORT",
        help="with --replicas: a torchft lighthouse running elsewhere (default: one inside this launcher; on "
        "several nodes, inside node 0's)",
    )  # fmt: skip
    parser.add_argument(
        "--stop-timeout",
        type=float_in(0, 86400, low_open=True),
        default=60.0,
        help="on SIGTERM/Ctrl-C: seconds the workers get to save and exit (75) before they are killed; a second "
        "signal kills them at once (default 60)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command, do not run it")


def main(args: argparse.Namespace) -> int:
    from llmtrain.launch import LaunchSpec, launch

    check_launch_flags(args)  # flags that only mean something together, before torchrun sees them
    spec = LaunchSpec(
        config=args.config,
        overrides=list(args.overrides),
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=29500 if args.master_port is None else args.master_port,
        max_restarts=args.max_restarts,
        run_id=args.run_id,
        rdzv_conf=args.rdzv_conf,
        connect_timeout_s=60.0 if args.connect_timeout is None else args.connect_timeout,
        stop_timeout_s=args.stop_timeout,
        replicas=args.replicas,
        lighthouse=args.lighthouse,
    )
    if spec.replicas > 1:  # replica groups: the lighthouse and one torchrun per group (ft/launch.py)
        from llmtrain.ft.launch import launch_replicas

        return launch_replicas(spec, dry_run=args.dry_run)
    return launch(spec, dry_run=args.dry_run)

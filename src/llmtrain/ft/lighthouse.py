"""The lighthouse: torchft's quorum service, embedded in ``llmtrain launch`` or running elsewhere.

``--replicas R`` without ``--lighthouse`` starts one inside the launching process (:func:`start`); with
``--lighthouse HOST:PORT`` the launcher first checks that it answers (:func:`reachable`, ConfigError otherwise,
before anything is spawned) and then watches it (:func:`reachable` every few seconds). The lighthouse is a
single point of failure of the replica groups: without it no new quorum forms. Each group's next quorum then
fails after ``fault_tolerance.quorum_timeout_s`` (ft/replicas.py ``LighthouseLost``, exit code
:data:`LIGHTHOUSE_LOST_EXIT_CODE`), and the launcher, watching a remote lighthouse, sends every group SIGTERM and
exits with the same code. Nothing partial is committed; the same command resumes from the newest checkpoint once
a lighthouse runs again.

Several nodes (ft/launch.py): node 0's launcher embeds it at ``--master-port + 1`` (:func:`start` with that
port); the other nodes' launchers wait for it like a remote one (:func:`require_reachable`) and watch it. Losing
node 0 is therefore losing the lighthouse: every other node's groups stop with the same exit code.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from llmtrain.errors import ConfigError

LIGHTHOUSE_LOST_EXIT_CODE = 76
"""``llmtrain launch --replicas``: the lighthouse stopped answering; the groups were stopped cleanly."""


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (an ``http://`` prefix allowed) -> (host, port); ConfigError when it is not one."""
    bare = address.split("://", 1)[-1].rstrip("/")
    host, _, port = bare.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--lighthouse {address!r}: expected HOST:PORT (e.g. node0:29510).")
    return host.strip("[]"), int(port)


def reachable(address: str, timeout_s: float) -> bool:
    """True when the lighthouse at ``address`` accepts a TCP connection within ``timeout_s``."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(
                (host, port), timeout=max(min(deadline - time.monotonic(), 2.0), 0.1)
            ).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def require_reachable(address: str, timeout_s: float) -> None:
    if not reachable(address, timeout_s):
        raise ConfigError(
            f"the lighthouse {address} did not answer within --connect-timeout {timeout_s:g} s. Start it first "
            "(torchft_lighthouse --bind [::]:PORT --min_replicas 1), check the host and port, or leave out "
            "--lighthouse to run one inside `llmtrain launch`."
        )


def start(min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float, port: int = 0) -> Any:
    """An embedded lighthouse on ``port`` of this host, every interface (0: a free one; ``.address()``: its
    http:// address). ConfigError when the port is taken."""
    from torchft.coordination import LighthouseServer

    try:
        return LighthouseServer(
            bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=int(join_timeout_s * 1000),
            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
        )  # fmt: skip
    except (RuntimeError, OSError) as e:
        raise ConfigError(
            f"the embedded lighthouse could not listen on port {port} ({str(e).splitlines()[0] if str(e) else e!r}): "
            "several nodes use --master-port + 1 on node 0; choose another --master-port, or run a lighthouse "
            "elsewhere and pass --lighthouse HOST:PORT."
        ) from None

"""One free TCP port for a test's rendezvous, below the kernel's ephemeral range.

A port found with ``bind(0)`` and closed again comes from the ephemeral range, where the kernel also hands out
the source ports of outgoing connections and every other ``bind(0)``: on a loaded machine (two test workers,
gloo opening many connections) another process can take it before the test's rank 0 listens on it, and the run
fails with EADDRINUSE (seen in CI: tests/test_exit.py). :func:`free_port` draws from below that range instead,
where only explicit choices land, and checks that the port and the next one (``llmtrain launch`` puts the
lighthouse at ``--master-port + 1``) can be bound.
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 15000, 32000  # below Linux's default ip_local_port_range (32768-60999)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port that ``port`` and ``port + 1`` of 127.0.0.1 can be bound on now, drawn outside the ephemeral range
    (falling back to one the kernel picks when none of 200 draws is free)."""
    for _ in range(200):
        port = random.randrange(LOW, HIGH - 1)
        if _bindable(port) and _bindable(port + 1):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""A process whose parent died stops by itself (Linux): no orphan worker keeps training.

Under torchrun (``llmtrain launch``, or a torchrun the user starts) a worker's parent is the elastic agent, and
torchrun starts each worker in a session of its own, so a SIGKILL to the agent, to the launcher's process group
or to the launcher and agent together never reaches the workers: they trained on, holding their port, the run
lock, a GPU and the checkpoint directory. :func:`stop_with_parent`, called once at worker start-up
(``commands/train.py``, before torch is imported), arranges two things:

* the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG)``), as :data:`PARENT_DIED`, a real-time signal
  of its own: its handler checks that the parent process is gone (``os.getppid()`` changed) and then sends this
  process one SIGTERM, which the trainer treats as a preemption (every rank stops after the same step, saves
  it and exits 75; the same command resumes); before the trainer's handler is installed, SIGTERM ends the
  process. Pitfalls, and why not SIGTERM itself: the kernel sends it when the *thread* that forked the worker
  exits, not the process; when a multi-threaded parent dies, the worker is handed from one dying thread to the
  next and gets the signal once per hand-over (measured: two SIGTERMs, and a second SIGTERM tells the trainer
  to stop without saving), the first while ``os.getppid()`` still names the dying parent. It survives ``exec``
  and is cleared in a forked child.
* a watchdog thread that reads ``os.getppid()`` every :data:`POLL_S` seconds. A different parent means the
  worker was reparented: its parent process is dead. It sends the same single SIGTERM (whichever of the two
  comes first sends it), then gives the worker ``grace_s`` seconds (the time torchrun gives a stopping worker,
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, default 30) to save and exit, and kills it (SIGKILL) if it is still there,
  saying so on stderr.

It applies under torchrun only (``TORCHELASTIC_RUN_ID`` set): under mpirun, srun or as a plain process the
parent is the launcher's business, and their spawning threads may come and go (a spurious parent-death signal
would stop a healthy run). :func:`set_parent_death_signal` is also what ``llmtrain launch`` uses for the agent it
starts (``launch.py``), and :func:`become_subreaper` lets the launcher adopt and reap workers whose agent died.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import time
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.5  # how often the watchdog reads the parent's pid
DEFAULT_GRACE_S = 30.0  # torchrun's default shutdown timeout
# the parent-death signal (Linux only: real-time signals and prctl)
PARENT_DIED: int | None = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else None

_state: dict[str, int | bool] = {}  # "parent": its pid at start-up; "stopped": the SIGTERM was sent
_lock = threading.Lock()


@functools.cache
def _prctl_function() -> Any:
    """libc's ``prctl`` (None where there is none: not Linux); looked up once, so that a forked child calls it
    without loading anything."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)``; False where it is not available or refused."""
    fn = _prctl_function()
    return fn is not None and fn(option, ctypes.c_ulong(value), 0, 0, 0) == 0


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (the thread that forked it) dies. Safe
    between fork and exec (``preexec_fn``). Returns whether it is set."""
    return _prctl(PR_SET_PDEATHSIG, int(sig))


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants: a child's children that outlive it are
    reparented here (and must be waited for here) instead of to init. Returns whether it is set."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def grace_seconds() -> float:
    """The time a worker whose parent died has to stop by itself: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30."""
    try:
        value = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_GRACE_S))
    except ValueError:
        return DEFAULT_GRACE_S
    return value if value > 0 else DEFAULT_GRACE_S


def stop_with_parent(grace_s: float | None = None) -> bool:
    """Under torchrun: stop this process when its parent dies (see the module docstring); a no-op elsewhere
    and on a second call. Returns whether the guard is on. Call it from the main thread."""
    if _state or "TORCHELASTIC_RUN_ID" not in os.environ or PARENT_DIED is None:
        return bool(_state)
    parent = os.getppid()
    _state["parent"] = parent
    signal.signal(PARENT_DIED, _on_parent_death_signal)
    set_parent_death_signal(PARENT_DIED)  # without prctl the watchdog alone notices
    if parent == 1:  # the parent died before the signal was set: nothing would send it
        _stop()
    threading.Thread(
        target=_watch, args=(parent, grace_seconds() if grace_s is None else grace_s),
        name="llmtrain-orphan-watchdog", daemon=True,
    ).start()  # fmt: skip
    return True


def _on_parent_death_signal(signum: int, frame: object) -> None:
    if os.getppid() != _state["parent"]:  # else a thread of a living or dying parent: the watchdog decides
        _stop()


def _stop() -> None:
    """Send this process its one SIGTERM (the first caller does; later ones do nothing)."""
    with _lock:
        if _state.get("stopped"):
            return
        _state["stopped"] = True
    os.kill(os.getpid(), signal.SIGTERM)


def _watch(parent: int, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    _stop()
    time.sleep(grace_s)
    sys.stderr.write(
        f"llmtrain: this worker's parent (pid {parent}, the torchrun agent) died {grace_s:g} s ago and the worker "
        "has not stopped; killing it (SIGKILL).\n"
    )
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)

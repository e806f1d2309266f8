"""One task of any stage of the staged dedup: skip it if finished, else run, time and measure it, mark it done.

:func:`execute` is what every engine runs (in this process, a pool worker, or a Ray worker). A finished task
(its marker ``stats/S-KKKKK.json`` exists) is not redone: its figures come back with ``resumed: true``. Else it
runs, and its figures get the wall and CPU seconds and the peak resident memory *of that task*: the kernel's
high-water mark (``VmHWM``) is reset before the task (``/proc/self/clear_refs``, Linux) and read after, so a
long-lived worker reports each task's own peak, not its lifetime's (elsewhere: ``ru_maxrss``, the process
peak). The marker is written last. A user error (``LLMTrainError``, e.g. a malformed input line) or an
``OSError`` comes back as ``{"error": exception}`` for the driver to raise with its own message (Ray would
wrap it in its own error type and traceback).
"""

from __future__ import annotations

import os
import resource
import socket
import time
from collections.abc import Callable

from llmtrain.data.prep.stages.components import components_task
from llmtrain.data.prep.stages.layout import StageContext
from llmtrain.data.prep.stages.pairs import pairs_task
from llmtrain.data.prep.stages.screen import screen_task
from llmtrain.data.prep.stages.tokenize import tokenize_task
from llmtrain.errors import LLMTrainError

RUNNERS: dict[int, Callable[[StageContext, int], dict]] = {
    1: screen_task,
    2: pairs_task,
    3: components_task,
    4: tokenize_task,
}


def reset_peak_memory() -> bool:
    """Reset this process's resident-memory high-water mark (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory() -> int:
    """Bytes: the resident-memory high-water mark since the last reset (else the process's peak)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def execute(ctx: StageContext, stage: int, task: int) -> dict:
    """Run task ``task`` of ``stage`` unless it is finished; returns its figures (see the module docstring)."""
    done = ctx.done(stage, task)
    if done is not None:
        return {**done, "resumed": True}
    if os.getpid() != ctx.driver_pid:  # a worker: one tokenizer thread, the driver's relative paths
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ["RAYON_NUM_THREADS"] = "1"
        if os.getcwd() != ctx.cwd:
            os.chdir(ctx.cwd)
    for folder in (ctx.s2(), ctx.s3(), ctx.s4()):
        folder.mkdir(parents=True, exist_ok=True)
    reset_peak_memory()
    start, cpu = time.perf_counter(), _cpu()
    try:
        stats = RUNNERS[stage](ctx, task)
    except (LLMTrainError, OSError) as e:
        return {"error": e}
    stats.update(
        stage=stage,
        task=task,
        seconds=round(time.perf_counter() - start, 4),
        cpu_seconds=round(_cpu() - cpu, 4),
        peak_rss=peak_memory(),
        host=socket.gethostname(),
        pid=os.getpid(),
    )
    ctx.finish(stage, task, stats)
    return stats

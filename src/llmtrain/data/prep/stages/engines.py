"""Where the staged dedup's tasks run: this process, a pool of local worker processes, or Ray tasks.

Every engine runs :func:`~llmtrain.data.prep.stages.tasks.execute` on ``(context, stage, task)`` and yields
the tasks' figures as they finish (in any order: each task writes its own files, so the result does not depend
on the order). The engines differ only in where the processes are:

* :class:`InProcess`: one task after the other in this process (``--workers 1``, and a single ``--task`` run
  by a scheduler, which is then the engine);
* :class:`LocalPool`: ``--workers N`` spawned processes on this machine (``parts.start_pool``: one tokenizer
  thread each, the tokenizer loaded while the first tasks are queued);
* :class:`RayEngine`: one Ray task per stage task (``num_cpus=1``). With ``--ray-address ADDR`` it joins that
  cluster (``ray start --head`` on a node that sees the same filesystem: the stage files are the only data
  passed between tasks, so every node must see the work folder and the inputs under the same paths, and have
  llmtrain installed); without, it starts a local Ray with ``--workers`` CPUs, or uses the Ray this process
  already initialized. Ray is imported only here, only for ``--engine ray`` (``pip install llmtrain[ray]``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from multiprocessing.pool import Pool
from typing import Any, Protocol

from llmtrain.data.prep.job import PrepareJob
from llmtrain.data.prep.parts import start_pool, stop_pool
from llmtrain.data.prep.stages.layout import StageContext, StageSettings
from llmtrain.data.prep.stages.tasks import execute
from llmtrain.errors import ConfigError


class Engine(Protocol):
    """Runs tasks of one stage; yields each task's figures as it finishes."""

    name: str

    def run(self, ctx: StageContext, stage: int, tasks: list[int]) -> Iterator[dict]: ...

    def close(self) -> None: ...


class InProcess:
    """Every task in this process, in order."""

    name = "in-process"

    def run(self, ctx: StageContext, stage: int, tasks: list[int]) -> Iterator[dict]:
        for t in tasks:
            yield execute(ctx, stage, t)

    def close(self) -> None:
        pass


class LocalPool:
    """``workers`` spawned processes on this machine."""

    def __init__(self, job: PrepareJob):
        self.name = f"local x{job.workers}"
        self.pool: Pool | None = start_pool(job)

    def run(self, ctx: StageContext, stage: int, tasks: list[int]) -> Iterator[dict]:
        assert self.pool is not None
        yield from self.pool.imap_unordered(functools.partial(execute, ctx, stage), tasks)

    def close(self) -> None:
        if self.pool is not None:
            stop_pool(self.pool)  # bounded, also after a Ctrl-C (parts.start_pool: the workers ignore SIGINT)
            self.pool = None


def import_ray() -> Any:
    """The ``ray`` module; ConfigError saying how to install it when it is missing."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--engine ray needs the 'ray' package, which is not installed: `pip install llmtrain[ray]` (or "
            "`pip install 'ray>=2.9'`), or use --engine local."
        ) from None
    return ray


class RayEngine:
    """One Ray task per stage task (see the module docstring)."""

    def __init__(self, address: str | None, workers: int):
        ray = self.ray = import_ray()
        self.owned = not ray.is_initialized()
        if self.owned:
            kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
            if address is None:
                kwargs["num_cpus"] = workers
            ray.init(address=address, **kwargs)
        self.limit = workers if address is None or workers > 1 else None  # tasks in flight
        cpus = int(ray.cluster_resources().get("CPU", 0))
        self.name = f"ray ({address or 'local'}, {cpus} CPUs)"
        self.remote = ray.remote(num_cpus=1)(execute)

    def run(self, ctx: StageContext, stage: int, tasks: list[int]) -> Iterator[dict]:
        ray = self.ray
        shared = ray.put(ctx)
        queue = list(tasks)
        pending: list = []
        try:
            while queue or pending:
                while queue and (self.limit is None or len(pending) < self.limit):
                    pending.append(self.remote.remote(shared, stage, queue.pop(0)))
                done, pending = ray.wait(pending, num_returns=1)
                yield ray.get(done[0])
        except BaseException:  # a task failed (or the caller stopped): no task may write after we return
            self._stop(pending)
            raise

    def _stop(self, pending: list) -> None:
        """Cancel the tasks still in flight and wait until they have ended, so that the caller's clean-up of the
        work folder is not followed by a late write (a worker that is killed writes nothing more)."""
        for ref in pending:
            self.ray.cancel(ref, force=True)
        if pending:
            self.ray.wait(pending, num_returns=len(pending), timeout=60)

    def close(self) -> None:
        if self.owned:
            self.ray.shutdown()


def make_engine(settings: StageSettings, job: PrepareJob) -> Engine:
    """The engine of a run: in-process for one local worker or a single ``--task``, else a pool or Ray."""
    if settings.task is not None or (settings.engine == "local" and job.workers == 1):
        return InProcess()
    if settings.engine == "ray":
        return RayEngine(settings.ray_address, job.workers)
    return LocalPool(job)

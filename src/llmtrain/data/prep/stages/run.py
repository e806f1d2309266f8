"""The staged dedup's driver: the plan, the stages in order on an engine, progress, the per-stage report.

:func:`run_stages` is called by ``prepare`` (``prepare._prepare``) after the work folder and the tokenizer are
settled, in one of two modes:

* a whole run (no ``--stage``): stages 1-4, each task skipped if its marker exists (a killed run rerun with the
  same arguments continues where it stopped, on any engine), then the result for stage 5, which ``prepare``
  writes with ``shards.write_dataset`` (atomic, manifest last) from :func:`~.tokenize.staged_batches`;
* a scheduled run (``--stage S [--task K]``, one array task of Slurm, say): that stage (or task) only, after
  checking that the stage before it is finished; ``--stage 5`` returns the result for the dataset.

The report (the manifest's ``report``) keeps the one-process layout (``stage_report`` of the parts' counters:
documents in and out of read, clean, filter, dedup, tokenize) and adds ``staged``: the plan and, per stage,
tasks, documents (or rows, pairs) in and out, pairs, components, bytes written, task seconds and CPU seconds,
and the peak resident memory of each task; a whole run adds, per stage, the tasks found finished when it started
(``resumed``) and the driver's wall seconds of the tasks it ran (``wall_seconds``), and the seconds the engine
took to start (``engine_seconds``). Timings are never compared: the byte identity across engines is of the
shards and of the document counts (``report.stages``), not of ``report.staged``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmtrain.data.manifest import write_json_atomic
from llmtrain.data.prep.job import PartCounters, PrepareJob, stage_report
from llmtrain.data.prep.shards import part_done, part_prefix
from llmtrain.data.prep.stages.engines import Engine, make_engine
from llmtrain.data.prep.stages.layout import (
    STAGES,
    Plan,
    StageContext,
    StageSettings,
    default_partitions,
    make_plan,
)
from llmtrain.data.prep.stages.tokenize import staged_batches
from llmtrain.data.tokenizer import Tokenizer
from llmtrain.errors import ConfigError, DataError

SUMMED = ("docs_in", "docs_out", "chars_in", "rows_in", "candidates", "pairs", "pairs_in", "nodes",
          "components", "dropped", "exact_duplicate", "near_duplicate", "tokens", "bytes", "seconds",
          "cpu_seconds")  # fmt: skip


@dataclass
class StagedResult:
    """What :func:`run_stages` hands back: the dataset's report and document stream (stages 1-4 finished), or
    the summary of the one stage or task that was asked for."""

    summary: dict | None = None
    report: dict | None = None
    batches: Iterator[tuple[np.ndarray, np.ndarray]] | None = None
    parts_dir: Path | None = None
    parts: int = 0


def plan_for(job: PrepareJob, files: list[Path], settings: StageSettings) -> Plan:
    """The plan of this run: ``--partitions`` (default from files and workers; 1 with ``--max-documents``,
    whose limit is over the inputs in order) and ``--buckets`` (default: as many as partitions)."""
    if job.max_documents is not None:
        if (settings.partitions or 1) > 1:
            raise ConfigError(
                f"--max-documents {job.max_documents} reads the inputs in order in one partition; drop "
                f"--partitions {settings.partitions}, or drop --max-documents."
            )
        partitions = 1
    else:
        partitions = settings.partitions or default_partitions(len(files), job.workers)
    return make_plan(files, partitions, settings.buckets or partitions)


def _check_layout(root: Path, plan: Plan, scheduled: bool) -> None:
    """Start over (or, for a scheduled task, refuse) when the work folder holds stages of another plan."""
    path = root / "layout.json"
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):  # damaged: another plan for all we know
            old = None
        if old == plan.to_json():
            return
        if scheduled:
            known = isinstance(old, dict) and isinstance(old.get("partitions"), list)
            what = (
                f"{len(old['partitions'])} partitions x {old.get('buckets')} buckets" if known else "damaged"
            )
            raise ConfigError(
                f"{root} holds the stages of another plan ({what}; this run asks {len(plan.partitions)} x "
                f"{plan.buckets}). Give every task the same --partitions and --buckets, or remove {root} to "
                f"start over."
            )
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, plan.to_json())


def run_stages(
    job: PrepareJob, files: list[Path], tok: Tokenizer, settings: StageSettings, workdir: Path
) -> StagedResult:
    """Run the stages of ``job`` (see the module docstring)."""
    scheduled = settings.stage is not None
    if scheduled and job.train_tokenizer is not None:
        raise ConfigError(
            "--stage needs --tokenizer: the tasks of a scheduled run must share one tokenizer file; train it "
            "first (`llmtrain prepare ... --train-tokenizer V` without --stage, or bench/ tools)."
        )
    plan = plan_for(job, files, settings)
    root = workdir / "staged"
    _check_layout(root, plan, scheduled)
    ctx = StageContext(str(root.resolve()), plan, job.options, tok.path, job.eos_token, job.max_documents,
                       os.getcwd(), os.getpid())  # fmt: skip
    wanted = [settings.stage] if settings.stage is not None else [1, 2, 3, 4]
    engine: Engine | None = None
    timing: dict[int, dict] = {}  # stage -> resumed tasks and wall seconds of this run
    engine_seconds = None
    try:
        for stage in wanted:
            if stage == 5:
                break
            tasks = list(range(ctx.tasks(stage)))
            if settings.task is not None:
                if settings.task >= len(tasks):
                    raise ConfigError(
                        f"--task {settings.task}: stage {stage} ({STAGES[stage]}) has {len(tasks)} tasks "
                        f"(0..{len(tasks) - 1}) with {len(plan.partitions)} partitions x {plan.buckets} buckets."
                    )
                tasks = [settings.task]
            _prerequisites(ctx, stage)
            todo = [t for t in tasks if ctx.done(stage, t) is None]
            if todo and engine is None:
                started = time.perf_counter()
                engine = make_engine(settings, job)
                engine_seconds = round(time.perf_counter() - started, 3)
            wall = _run_stage(job, ctx, stage, tasks, todo, engine)
            timing[stage] = {"resumed": len(tasks) - len(todo)}
            if wall is not None:
                timing[stage]["wall_seconds"] = wall
    finally:
        if engine is not None:
            engine.close()
    if settings.stage is not None and settings.stage != 5:
        summary = {
            "stage": settings.stage,
            "task": settings.task,
            "report": {**stage_summary(ctx, settings.stage), **timing.get(settings.stage, {})},
        }
        return StagedResult(summary=summary)
    _prerequisites(ctx, 5)
    counters = []
    for k in range(len(plan.partitions)):
        part = part_done(ctx.s4(), k)
        if part is None:  # stage 4 is finished (checked just above), so its counters file is damaged
            raise DataError(
                f"The work file '{part_prefix(ctx.s4(), k)}.json' is damaged; the work folder is removed, so "
                f"running the same command again redoes the work."
            )
        counters.append(PartCounters.from_json(part))
    report = stage_report(counters, job.options)
    report["staged"] = {
        "partitions": len(plan.partitions),
        "buckets": plan.buckets,
        "engine": settings.engine,
        "workers": job.workers,
        "stages": {
            STAGES[s]: {**stage_summary(ctx, s), **timing.get(s, {})} for s in (1, 2, 3, 4) if ctx.tasks(s)
        },
    }
    if engine_seconds is not None:
        report["staged"]["engine_seconds"] = engine_seconds
    return StagedResult(
        report=report, batches=staged_batches(ctx), parts_dir=ctx.s4(), parts=len(plan.partitions)
    )


def _prerequisites(ctx: StageContext, stage: int) -> None:
    """DataError unless the stages ``stage`` reads are finished."""
    needs = {1: [], 2: [1], 3: [2], 4: [1, 3], 5: [4]}[stage]
    for s in needs:
        if ctx.tasks(s):
            ctx.require(s)


def _run_stage(
    job: PrepareJob, ctx: StageContext, stage: int, tasks: list[int], todo: list[int], engine: Engine | None
) -> float | None:
    """Run the unfinished ``todo`` of ``tasks`` on ``engine``, with progress lines; the wall seconds they took
    (None when there was nothing to do)."""
    name = f"stage {stage} {STAGES[stage]}"
    if not todo:
        if tasks:
            job.say(f"prepare: {name}: {len(tasks)} task(s) already finished")
        return None
    assert engine is not None
    job.say(
        f"prepare: {name}: {len(todo)} task(s) on {engine.name} ({len(tasks) - len(todo)} already finished)"
    )
    start = time.perf_counter()
    step = max(1, len(todo) // 10)
    for n, stats in enumerate(engine.run(ctx, stage, todo), start=1):
        if "error" in stats:
            raise stats["error"]
        if n % step == 0 or n == len(todo):
            job.say(f"prepare: {name}: {n}/{len(todo)} done, {time.perf_counter() - start:.1f}s")
    wall = round(time.perf_counter() - start, 3)
    s = stage_summary(ctx, stage, tasks)
    figures = ", ".join(f"{k.replace('_', ' ')} {s[k]:,}" for k in ("docs_in", "docs_out", "rows_in", "pairs",
                        "components", "dropped", "tokens") if k in s)  # fmt: skip
    job.say(
        f"prepare: {name}: {figures}; {s['bytes'] / 1e6:.1f} MB written, {s['cpu_seconds']:.1f} CPU s, "
        f"peak RSS per task {s['peak_rss_mb_max']:.0f} MB"
    )
    return wall


def stage_summary(ctx: StageContext, stage: int, tasks: list[int] | None = None) -> dict:
    """The figures of ``stage`` summed over its finished tasks (all, or ``tasks``), with each task's peak
    resident memory (MB)."""
    marks = [m for m in (ctx.done(stage, t) for t in (tasks if tasks is not None else range(ctx.tasks(stage))))
             if m is not None]  # fmt: skip
    out: dict = {"tasks": len(marks)}
    for key in SUMMED:
        if any(key in m for m in marks):
            total = sum(m.get(key, 0) for m in marks)
            out[key] = round(total, 3) if isinstance(total, float) else total
    rss = [round(m["peak_rss"] / 2**20, 1) for m in marks]
    out["peak_rss_mb_max"] = max(rss, default=0.0)
    out["peak_rss_mb"] = rss
    return out

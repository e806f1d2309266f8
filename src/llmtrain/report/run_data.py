"""Reading a run directory for the report, tolerant of runs that are still going or that crashed.

``load_run(run_dir)`` reads ``metrics.jsonl`` (a line cut mid-write, garbage or of the wrong types is skipped
and counted, by the trainer's rule),
``events.jsonl`` (optional), ``config.yaml`` (optional, ``yaml.safe_load``) and returns a :class:`RunData` with
the train rows and validation rows in file order. A rollback makes the step counter go back and the steps after
the restored one are logged again; :meth:`RunData.latest` keeps the last row per step (the timeline that
stands) and :meth:`RunData.abandoned` the rows that were overwritten (drawn faint on the loss plot).
``plan_estimate`` asks the planner (``llmtrain.plan``) for the run's config and returns ``None`` with a reason
when it cannot (no config, a config the planner does not know, a device not in the catalog).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmtrain.errors import DataError


def read_jsonl(path: Path, kind: str = "metrics") -> tuple[list[dict], int]:
    """Rows of ``metrics.jsonl`` (``kind="metrics"``) or ``events.jsonl`` (``"events"``) and the number of lines
    that are not rows (a torn last write, garbage bytes, wrong types): the trainer's rule
    (``llmtrain.train.metrics.parse_row``), so the report shows exactly the rows a resumed run keeps."""
    from llmtrain.train.metrics import parse_row

    if not path.is_file():
        return [], 0
    rows, bad = [], 0
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        row = parse_row(line, kind)
        if row is None:
            bad += 1
        else:
            rows.append(row)
    return rows, bad


@dataclass
class RunData:
    run_dir: Path
    train: list[dict] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    downstream: list[dict] = field(default_factory=list)  # rows of in-loop downstream evaluations (eval/...)
    events: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    bad_lines: int = 0
    metrics_mtime: float | None = None

    def latest(self) -> list[dict]:
        """Train rows, the last one per step, sorted by step."""
        by_step: dict[int, dict] = {}
        for row in self.train:
            by_step[int(row["step"])] = row
        return [by_step[s] for s in sorted(by_step)]

    def abandoned(self) -> list[list[dict]]:
        """Runs of train rows that a later rollback overwrote (each a list in step order)."""
        segments: list[list[dict]] = [[]]
        for row in self.train:
            if segments[-1] and int(row["step"]) <= int(segments[-1][-1]["step"]):
                segments.append([])
            segments[-1].append(row)
        out = []
        for i, seg in enumerate(segments[:-1]):
            restart = int(segments[i + 1][0]["step"])
            dropped = [r for r in seg if int(r["step"]) >= restart]
            if dropped:
                out.append(dropped)
        return out

    def events_of(self, *kinds: str) -> list[dict]:
        return [e for e in self.events if e.get("event") in kinds]

    def stage_starts(self) -> list[tuple[int, str]]:
        """(step, stage name) where a stage begins: stage_start events, else changes of the rows' stage."""
        found = [(int(e.get("step", 0)), str(e.get("stage", ""))) for e in self.events_of("stage_start")]
        if found:
            return found
        out, current = [], None
        for row in self.latest():
            if "stage" in row and row["stage"] != current:
                current = row["stage"]
                out.append((int(row["step"]), str(current)))
        return out

    def max_steps(self) -> int | None:
        starts = self.events_of("run_start")
        if starts:
            return int(starts[-1].get("max_steps", 0)) or None
        value = self.config.get("train", {}).get("max_steps")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def status(self) -> str:
        rows = self.latest()
        last = int(rows[-1]["step"]) if rows else 0
        total = self.max_steps()
        if self.events_of("preempted"):
            return f"preempted at step {last}"
        if total and last >= total:
            return f"finished ({last} steps)"
        age = time.time() - self.metrics_mtime if self.metrics_mtime else None
        ago = f", last write {age / 60:.1f} min ago" if age is not None else ""
        return f"incomplete: step {last} of {total or '?'} (still running, or stopped/crashed{ago})"


_EVENT_INTS = ("step", "detected_step", "max_steps", "world_size", "num_params")
_EVENT_NUMBERS = ("time", "step_time")


def event_fields_ok(event: dict) -> bool:
    """Whether the fields of an event the report reads have their types: integers >= 0 (:data:`_EVENT_INTS`),
    finite numbers (:data:`_EVENT_NUMBERS`), ``hosts`` a list of names, ``layout`` a mapping."""
    for key in _EVENT_INTS:
        v = event.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            return False
    for key in _EVENT_NUMBERS:
        v = event.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)):
            return False
    hosts, layout = event.get("hosts"), event.get("layout")
    if hosts is not None and not (isinstance(hosts, list) and all(isinstance(h, str) for h in hosts)):
        return False
    return layout is None or isinstance(layout, dict)


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not run_dir.is_dir() or not (metrics.exists() or (run_dir / "events.jsonl").exists()):
        raise DataError(
            f"{run_dir}: not a run directory (no metrics.jsonl or events.jsonl); give the run.output_dir of a "
            f"training run."
        )
    rows, bad = read_jsonl(metrics)
    events, bad_events = read_jsonl(run_dir / "events.jsonl", "events")
    kept = [e for e in events if event_fields_ok(e)]  # an event whose fields the page reads have wrong types
    events, bad_events = kept, bad_events + len(events) - len(kept)
    config: dict = {}
    if (run_dir / "config.yaml").exists():
        try:
            loaded = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        except (yaml.YAMLError, OSError, UnicodeDecodeError, RecursionError):
            config = {}
        config = {k: v for k, v in config.items() if isinstance(v, dict)}  # sections only (page reads .get)
    rows = [r for r in rows if isinstance(r.get("step"), (int, float))]
    return RunData(
        run_dir=run_dir,
        train=[r for r in rows if r.get("loss") is not None],
        val=[r for r in rows if r.get("val_loss") is not None],
        downstream=[r for r in rows if any(str(k).startswith("eval/") for k in r)],
        events=events,
        config=config,
        bad_lines=bad + bad_events,
        metrics_mtime=metrics.stat().st_mtime if metrics.exists() else None,
    )


def plan_estimate(run: RunData) -> tuple[dict | None, str]:
    """The planner's figures for the run's config on its device and world size, or (None, why not)."""
    cfg_path = run.run_dir / "config.yaml"
    if not cfg_path.exists():
        return None, "no config.yaml in the run directory"
    try:
        from llmtrain.config.loader import load_config
        from llmtrain.plan.catalog import load_catalog, parse_cluster
        from llmtrain.plan.search import evaluate, layout_from_config

        cfg, _ = load_config(str(cfg_path), [])
        start = (run.events_of("run_start") or [{}])[-1]
        world = int(start.get("world_size") or len((run.latest() or [{}])[-1].get("rank_step_time_s") or [1]))
        catalog = load_catalog(None)  # the device by the name the run recorded (older runs: by its type)
        found = catalog.match(str(start.get("device_name") or "")) or catalog.match(
            str(start.get("device") or cfg.run.device_target)
        )
        cluster = parse_cluster(f"{world}x{found.name if found else 'h100'}", catalog)
        layout, margs, tokens_per_step = layout_from_config(cfg, world, cfg.recompute.mode, False)
        result = evaluate(margs, layout, cluster, tokens_per_step, bool(cfg.train.compile))
        return {
            "device": cluster.device.name,
            "layout": layout.describe(),
            "num_params": margs.num_params(),
            "step_time_s": result.step_time_s,
            "tokens_per_s": result.tokens_per_s_per_device * world,
            "mfu": result.mfu,
            "memory_bytes": result.memory.total,
        }, ""
    except Exception as e:  # the report must render without a plan
        return None, f"planner unavailable for this config: {type(e).__name__}: {e}"


def summary_value(rows: list[dict], key: str, last: int = 10) -> Any:
    """Median of ``key`` over the last ``last`` rows that have it (None when none has)."""
    values = sorted(float(r[key]) for r in rows[-last:] if isinstance(r.get(key), (int, float)))
    return values[len(values) // 2] if values else None

"""Metrics sinks: ``metrics.jsonl``, TensorBoard, the console (a live progress bar with ETA), the loss plot.

One JSON object per log step (and per validation, and per downstream evaluation) goes to ``<run_dir>/metrics.jsonl``, appended so that a resumed
run continues the same file; rows of steps after the resume point left by a crashed run are dropped on resume so
the file reads as one run. A ``metrics.jsonl`` or ``events.jsonl`` with damaged lines (garbage bytes, wrong
types) never fails the run: the file is set aside under a new name and the readable rows continue
(:func:`salvage`; :func:`parse_row` is the rule the report reads by too). The console shows a rich progress bar when stdout is a terminal and plain lines
otherwise (CI, log files). Only rank 0 writes.

Each row is one ``write`` to a file opened with ``O_APPEND`` for it, so several writers may append to the same
``metrics.jsonl`` (replica groups, ft/: the quorum's first group writes each step's row, and that group changes
while group 0 is down). There, ``writer`` says per row whether this process writes it, and the repair of the
files (damaged lines, rows after the resume point) waits for :meth:`MetricsLogger.start`, which the replica set
calls at its first quorum: only the group that starts the job's writing repairs; a group that rejoins a live run
(it healed) never cuts or moves the rows the others are appending.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmtrain.config.schema import LoggingConfig
from llmtrain.errors import ConfigError

NUMERIC_KEYS = ("loss", "val_loss", "val_ppl", "lr", "grad_norm", "loss_scale", "tokens_per_s", "mfu")
"""Keys of a metrics row that are a number (or null) when present: what the console, the plot and the report
read as numbers."""


def parse_row(line: bytes | str, kind: str = "metrics") -> dict | None:
    """One line of ``metrics.jsonl`` (``kind="metrics"``) or ``events.jsonl`` (``"events"``) as a row, or None
    when it is not one: not UTF-8, not a JSON object, or of the wrong types (a metrics row needs an integer
    ``step`` >= 0 and numbers for :data:`NUMERIC_KEYS`; an event a string ``event``). The one rule for the
    trainer's resume and the report."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError:
            return None
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(row, dict):
        return None
    if kind == "events":
        return row if isinstance(row.get("event"), str) else None
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    for key in NUMERIC_KEYS:
        value = row.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return None
    return row


def salvage(path: Path, kind: str, after_step: int | None = None) -> str | None:
    """Make ``path`` (metrics.jsonl or events.jsonl of a run being resumed or restarted) hold only readable rows,
    never losing one: when a line is damaged (garbage bytes, not JSON, wrong types, a torn last write), the file
    is moved aside to ``NAME.damaged-N`` (never deleted, never overwritten) and a new ``NAME`` holds the rows that
    parse, in order. ``after_step``: metrics rows of later steps (left by a crashed run after its last
    checkpoint) are dropped as well, so the file reads as one run. The file is replaced by a rename, never
    rewritten in place (a symbolic link is replaced by a file; what it pointed at is untouched). Returns a
    sentence saying what was set aside, or None when the file was intact."""
    if not path.is_file():
        return None
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    keep, bad = [], 0
    for line in lines:
        if not line.strip():
            continue
        row = parse_row(line, kind)
        if row is None:
            bad += 1
        elif after_step is None or kind != "metrics" or row["step"] <= after_step:
            keep.append(line + b"\n")
    body = b"".join(keep)
    if not bad and (body == data or after_step is None):
        return None
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(body)
    if not bad:  # only the rows after the resume point dropped: nothing to keep aside
        os.replace(tmp, path)
        return None
    aside = _free_name(path)
    os.rename(path, aside)
    os.replace(tmp, path)
    return (
        f"{path} had {bad} damaged line(s) (not UTF-8, not JSON, or of the wrong types); the file was moved "
        f"aside to {aside.name} and {path.name} continues with its {len(keep)} readable row(s)"
    )


def _free_name(path: Path) -> Path:
    n = 1
    while (aside := path.with_name(f"{path.name}.damaged-{n}")).exists() or aside.is_symlink():
        n += 1
    return aside


def truncate_after(path: Path, step: int) -> None:
    """Drop rows with ``step`` greater than ``step`` (left by a run that crashed after its last checkpoint);
    damaged lines are set aside as :func:`salvage` says."""
    salvage(path, "metrics", step)


class MetricsLogger:
    """Writes metrics rows to every enabled sink."""

    def __init__(
        self,
        run_dir: str | Path,
        cfg: LoggingConfig,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        run_config: dict | None = None,
        writer: Callable[[], bool] | None = None,
        primary: bool = True,
    ):
        """``writer``: replica groups (see the module docstring): whether this process writes the row now; the
        files are then repaired by :meth:`start`, not here. ``primary``: this process owns the run's one-of-a-kind
        sinks, the wandb run (``logging.wandb``) and the console's progress bar (replica groups: group 0's)."""
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.cfg = cfg
        self.total_steps = total_steps
        self.writer = writer
        self.tb: Any = None
        self.progress = None
        self.wandb = None
        self.salvaged: list[str] = []
        self._started = False  # the files repaired (or left alone) and TensorBoard's purge step decided
        self._purge_step: int | None = None
        self._closed = False
        self._held: list[dict[str, Any]] = []  # rows logged before start() (a validation at the start)
        if not enabled:
            return
        if getattr(cfg, "wandb", False) and primary:
            self.wandb = start_wandb(cfg, self.run_dir, run_config)
        if writer is None:
            self.salvaged = self.start(start_step, repair=True)
        if cfg.progress_bar and primary and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
            self.progress.start()
        self._t0 = time.time()
        self._start_step = start_step

    def start(self, step: int, repair: bool) -> list[str]:
        """Make the files ready for this process's rows: with ``repair`` (a run starting or resuming at ``step``,
        no other writer live), damaged lines of an earlier attempt set aside (the file kept under another name,
        never fatal) and metrics rows after ``step`` dropped, and TensorBoard purges its points after ``step``;
        without it the files are left exactly as they are. Returns the sentences on what was set aside; once."""
        if not self.enabled or self._started:
            return []
        self._started = True
        notes = []
        if repair:
            self._purge_step = step + 1
            notes = [
                note
                for note in (salvage(self.path, "metrics", step), salvage(self.run_dir / "events.jsonl", "events"))
                if note is not None
            ]  # fmt: skip
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.close(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))  # there from the start
        if self.cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=self._purge_step)
        held, self._held = self._held, []
        for row in held:
            self._write(row)
        return notes

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled or self._closed or (self.writer is not None and not self.writer()):
            return
        if not self._started:  # replica groups, before the first quorum: written once the files are ready
            self._held.append(row)
            return
        self._write(row)

    def _write(self, row: dict[str, Any]) -> None:
        data = (json.dumps(row) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:  # one write of the whole row: rows of concurrent writers never interleave
            os.write(fd, data)
        finally:
            os.close(fd)
        step = int(row["step"])
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    tag = k if k.startswith("eval/") else f"val/{k}" if k.startswith("val") else f"train/{k}"
                    self.tb.add_scalar(tag, v, step)
        if self.wandb is not None:
            scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
            self.wandb.log(scalars, step=step)
        line = self._format(row)
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=line)
        else:
            print(line, flush=True)

    def _format(self, row: dict[str, Any]) -> str:
        parts = [f"step {row['step']}/{self.total_steps}"]
        for key, fmt in (
            ("loss", ".4f"),
            ("val_loss", ".4f"),
            ("val_ppl", ".2f"),
            ("lr", ".3e"),
            ("grad_norm", ".3f"),
            ("loss_scale", ".0f"),
            ("tokens_per_s", ",.0f"),
            ("mfu", ".2%"),
        ):
            if key in row and row[key] is not None:
                parts.append(f"{key} {row[key]:{fmt}}")
        for key, value in row.items():  # downstream scores: eval/<task>/<metric> (stderr and timing left out)
            if key.count("/") == 2 and key.startswith("eval/") and not key.endswith("_stderr"):
                parts.append(f"{key[5:]} {value:.4g}")
        if "step" in row and "tokens_per_s" in row:
            done = int(row["step"]) - self._start_step
            if done > 0:
                eta = (time.time() - self._t0) / done * (self.total_steps - int(row["step"]))
                parts.append(f"eta {eta / 60:.1f} min")
        return " | ".join(parts)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Stop the progress bar, flush and close TensorBoard / wandb / metrics.jsonl (once; later calls no-op)."""
        if not self.enabled or self._closed:
            return
        if not self._started:  # replica groups, no step taken (resumed at the end): write what was held
            self.start(self._start_step, repair=False)
        self._closed = True
        if self.progress is not None:
            self.progress.stop()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def start_wandb(cfg: LoggingConfig, run_dir: Path, run_config: dict | None) -> Any:
    """``wandb.init`` for logging.wandb (imported only then); a ConfigError names the fix when it is missing."""
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(
            "logging.wandb is true but the wandb package is not installed: run `pip install wandb` (or "
            "`pip install llmtrain[wandb]`), or set logging.wandb: false."
        ) from e
    return wandb.init(
        project=cfg.wandb_project,
        mode=cfg.wandb_mode,
        dir=str(run_dir),
        name=run_dir.name,
        config=run_config or {},
    )


def plot_losses(metrics_path: str | Path, out_png: str | Path) -> Path | None:
    """Training and validation loss against step, from metrics.jsonl, as a PNG."""
    rows = [r for x in Path(metrics_path).read_bytes().splitlines() if (r := parse_row(x)) is not None]
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if not train and not val:
        return None
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5, ms=4)
    stages = [(r["step"], r["stage"]) for r in rows if r.get("stage") is not None and "loss" in r]
    for (_, before), (step, name) in zip(stages, stages[1:]):  # boundaries of a multi-stage run
        if name != before:
            ax.axvline(step - 0.5, color="grey", ls="--", lw=1)
            ax.annotate(name, (step, 1.0), xycoords=("data", "axes fraction"), va="top", fontsize=8)
    if stages and len({name for _, name in stages}) > 1:
        ax.annotate(
            stages[0][1], (stages[0][0], 1.0), xycoords=("data", "axes fraction"), va="top", fontsize=8
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return Path(out_png)

"""Metrics sinks: ``metrics.jsonl``, TensorBoard, the console (a live progress bar with ETA), the loss plot.

One JSON object per log step (and per validation, and per downstream evaluation) goes to ``<run_dir>/metrics.jsonl``, appended so that a resumed
run continues the same file; rows of steps after the resume point left by a crashed run are dropped on resume so
the file reads as one run. The console shows a rich progress bar when stdout is a terminal and plain lines
otherwise (CI, log files). Only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from llmtrain.config.schema import LoggingConfig
from llmtrain.errors import ConfigError


def truncate_after(path: Path, step: int) -> None:
    """Drop rows with ``step`` greater than ``step`` (left by a run that crashed after its last checkpoint)."""
    if not path.exists():
        return
    keep = [
        line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step
    ]
    path.write_text("".join(line + "\n" for line in keep))


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
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.cfg = cfg
        self.total_steps = total_steps
        self.tb = None
        self.progress = None
        self.wandb = None
        if not enabled:
            return
        if getattr(cfg, "wandb", False):
            self.wandb = start_wandb(cfg, self.run_dir, run_config)
        truncate_after(self.path, start_step)
        self._file = open(self.path, "a")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        if cfg.progress_bar and sys.stdout.isatty():
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

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
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
        if not self.enabled or self._file.closed:
            return
        if self.progress is not None:
            self.progress.stop()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self._file.close()


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
    rows = [json.loads(x) for x in Path(metrics_path).read_text().splitlines() if x.strip()]
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

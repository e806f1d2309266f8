"""``llmtrain report RUN_DIR [--out report.html]``: one self-contained HTML report of a run.

The page needs no network to open: the plots are matplotlib figures inlined as SVG, the CSS and the one small
check script are inline. It shows loss and validation loss, LR, grad norm, loss scale, tokens/s, MFU, memory,
the compute / communication / data split, per-rank busy times, stage boundaries and the events timeline
(checkpoints, rollbacks with the skipped data windows, restarts, NaN skips, stragglers), under a header with
the config summary, parameter count, layout, tokens seen, elapsed time and the planner's estimate beside the
measured figures. It reads only files, so it works on a run that is still going and on one that crashed
(``run_data`` skips a torn last line). The file is written atomically (temporary file, then rename).

Modules: ``run_data`` (reading the run, the plan), ``plots`` (SVG figures), ``page`` (HTML); this one writes
the file (:func:`build_report`). The command's flags are in :mod:`llmtrain.commands.report`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from llmtrain.errors import FileSystemError
from llmtrain.report.page import render_page
from llmtrain.report.plots import render_all
from llmtrain.report.run_data import load_run, plan_estimate


def build_report(run_dir: str | Path, out: str | Path | None = None, with_plan: bool = True) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``<run_dir>/report.html``); return its path."""
    run = load_run(run_dir)
    plan, note = plan_estimate(run) if with_plan else (None, "not requested (--no-plan)")
    page = render_page(run, render_all(run), plan, note)
    out_path = Path(out) if out else run.run_dir / "report.html"
    _check_replaceable(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html", dir=out_path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out_path


def _check_replaceable(path: Path) -> None:
    """FileSystemError unless ``path`` is free or an earlier report of ours (its title says so): a user's own
    file is never replaced, a directory is not a file."""
    if path.is_dir():
        raise FileSystemError(
            f"--out {path} is a directory; name the HTML file to write, e.g. {path / 'report.html'}."
        )
    if path.exists():
        with open(path, "rb") as f:
            head = f.read(512)
        if b"<title>llmtrain report: " not in head:
            raise FileSystemError(
                f"--out {path} already exists and is not a report written by llmtrain; it is left untouched. "
                "Name a new file."
            )

"""The report in a real browser: headless Chromium opens it from disk (no network), the page's check script
finds an SVG with a non-empty box in every plot figure (read back from the dumped DOM), no script error or
console error is logged, and a screenshot is saved (tmp_path, and $LLMTRAIN_TEST_ARTIFACTS when set).

Needs Debian's ``chromium`` package (``apt-get install -y chromium``); skipped with the reason when absent."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from llmtrain.config import config_from_dict
from llmtrain.report import build_report
from llmtrain.report.plots import PLOTS, plot_titles
from llmtrain.report.run_data import load_run
from llmtrain.train.trainer import Trainer

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(
    BROWSER is None,
    reason="headless Chromium not found (install Debian's package: apt-get install -y chromium)",
)


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    cmd = [BROWSER, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--hide-scrollbars",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def test_report_renders_in_chromium(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    cfg = {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32},
        "train": {"batch_size": 8, "micro_batch_size": 8, "max_steps": 6, "log_steps": 1, "eval_steps": 3},
        "data": {"datasets": [{"path": tiny_corpus, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 3},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": True, "eval_iters": 1},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1},
    }
    downstream = importlib.util.find_spec("lm_eval") is not None  # the eval extra: one plot per task metric
    if downstream:
        cfg["eval"].update({"tasks": ["stdlib_mc"], "downstream_steps": 3, "limit": 4})
    Trainer(config_from_dict(cfg)).fit()
    plots = list(plot_titles(load_run(out)))
    assert plots[: len(PLOTS)] == list(PLOTS)
    if downstream:  # acc and acc_norm of stdlib_mc, after the fixed plots
        assert plots[len(PLOTS) :] == ["eval-stdlib_mc-acc", "eval-stdlib_mc-acc_norm"]
    report = build_report(out, tmp_path / "report.html", with_plan=False)
    url = report.resolve().as_uri()

    p = chromium(["--virtual-time-budget=5000", "--dump-dom", url], tmp_path / "profile-dom")
    assert p.returncode == 0, p.stderr[-3000:]
    body = re.search(r"<body([^>]*)>", p.stdout)
    assert body, p.stdout[:2000]
    attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', body.group(1)))
    assert attrs.get("plots") == str(len(plots)) and attrs.get("rendered") == str(len(plots)), attrs
    assert attrs.get("ok") == "1", attrs
    assert "data-errors" not in re.search(r"<html[^>]*>", p.stdout).group(0)  # no uncaught script error
    for pid in plots:  # every figure is in the DOM, marked rendered by the page's check
        assert re.search(rf'<figure id="plot-{pid}" data-plot="{pid}" data-rendered="1">', p.stdout), pid
    for pid in plots[len(PLOTS) :]:  # the downstream plots hold the scores, not the "no data yet" note
        figure = re.search(rf'<figure id="plot-{pid}".*?</figure>', p.stdout, re.S)
        assert figure and "no data yet" not in figure.group(0) and "<path" in figure.group(0), pid
    if downstream:  # the evaluation's time is a band of the time split; its events are on the timeline
        assert any((r.get("time_eval_frac") or 0) > 0 for r in load_run(out).latest())
        split = re.search(r'<figure id="plot-time_split".*?</figure>', p.stdout, re.S)
        assert split and "downstream eval" in split.group(0)
        timeline = re.search(r'<figure id="plot-events".*?</figure>', p.stdout, re.S)
        assert timeline and "downstream_eval" in timeline.group(0)
    console = [line for line in p.stderr.splitlines() if "CONSOLE" in line]
    assert not [line for line in console if re.search(r"error|uncaught", line, re.I)], console

    shot = tmp_path / "report.png"
    p = chromium([f"--screenshot={shot}", "--window-size=1400,2600", url], tmp_path / "profile-shot")
    assert p.returncode == 0 and shot.exists() and shot.stat().st_size > 20_000, p.stderr[-3000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    artifacts = os.environ.get("LLMTRAIN_TEST_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / "report_screenshot.png")
        shutil.copy(report, Path(artifacts) / "report.html")

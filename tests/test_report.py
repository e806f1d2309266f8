"""`llmtrain report`: a self-contained HTML page with every plot, for a finished run, a crashed run (a real
SIGKILL from fault injection in a forked trainer, plus a torn last line in metrics.jsonl), a run with a rollback (skipped data
window drawn), and a directory with no metrics yet; a non-run directory is a DataError."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from llmtrain.config import config_from_dict
from llmtrain.errors import DataError
from llmtrain.report import build_report
from llmtrain.report.plots import PLOTS
from llmtrain.train.trainer import Trainer


def run_cfg(prefix: str, out: Path, **sections) -> dict:
    base = {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32},
        "train": {
            "batch_size": 8,
            "micro_batch_size": 8,
            "max_steps": 12,
            "lr": 3e-3,
            "log_steps": 1,
            "eval_steps": 4,
            "warmup_steps": 2,
            "seed": 3,
        },  # fmt: skip
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 4, "keep_checkpoint_max": 3},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": True, "eval_iters": 1},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return base


def figures(page: str) -> dict[str, str]:
    """plot id -> the figure's HTML."""
    return dict(re.findall(r'<figure id="plot-(\w+)" data-plot="\w+">(.*?)</figure>', page, re.S))


def assert_complete(page: str) -> None:
    figs = figures(page)
    assert list(figs) == list(PLOTS)
    assert all("<svg" in f and "</svg>" in f for f in figs.values())
    # self-contained: nothing fetched (only the SVG namespace URIs mention http)
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(https?:", page)


@pytest.fixture(scope="module")
def finished(tiny_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    Trainer(config_from_dict(run_cfg(tiny_corpus, out))).fit()
    return out


def test_finished_run(finished, tmp_path):
    path = build_report(finished, tmp_path / "r.html")
    page = path.read_text()
    assert_complete(page)
    assert "finished (12 steps)" in page
    figs = figures(page)
    assert "validation loss" in figs["loss"] and "no data yet" not in figs["loss"]
    for pid in ("lr", "grad_norm", "tokens_per_s", "mfu", "memory", "time_split", "rank_step_time", "events"):
        assert "no data yet" not in figs[pid], pid
    assert page.count('class="ev-checkpoint"') == 3  # steps 4, 8, 12
    assert "planned (cpu" in page  # the planner's estimate beside the measured figures
    assert 'id="planned-vs-measured"' in page and "188,736" in page  # debug model parameters
    assert path.stat().st_mode & 0o044  # readable by others (written via a temp file + rename)


def test_crashed_run_with_torn_line(tiny_corpus, tmp_path):
    out = tmp_path / "crash"
    cfg = config_from_dict(run_cfg(tiny_corpus, out, fault={"kill_at_step": [7]}))
    pid = os.fork()  # the trainer in a child (torch already imported), killed by the injected fault
    if pid == 0:
        try:
            Trainer(cfg).fit()
        finally:
            os._exit(0)
    status = os.waitpid(pid, 0)[1]
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL  # at the start of step 7
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 5.1, "lr"')  # a write cut short
    page = build_report(out, with_plan=False).read_text()  # default --out: RUN_DIR/report.html
    assert (out / "report.html").exists()
    assert_complete(page)
    assert "incomplete: step 6 of 12" in page and "1 unreadable line(s) skipped" in page
    # without events.jsonl too
    (out / "events.jsonl").unlink()
    assert_complete(build_report(out, tmp_path / "noevents.html", with_plan=False).read_text())


def test_rollback_run(tiny_corpus, tmp_path):
    out = tmp_path / "spike"
    cfg = run_cfg(
        tiny_corpus,
        out,
        train={"max_steps": 24, "eval_steps": 0, "batch_size": 8, "micro_batch_size": 8},
        checkpoint={"save_steps": 5},
        eval={"at_start": False},
        model={"seq_length": 64},
        stability={"rule": "ratio", "ratio": 1.1, "consecutive": 2, "min_history": 8, "window": 20},
        fault={"spike_at_step": [17], "spike_steps": 3},
    )
    Trainer(config_from_dict(cfg)).fit()
    kinds = [json.loads(x)["event"] for x in (out / "events.jsonl").read_text().splitlines()]
    assert "rollback" in kinds and "rollback_done" in kinds, kinds
    page = build_report(out, tmp_path / "r.html", with_plan=False).read_text()
    assert_complete(page)
    loss = figures(page)["loss"]
    assert "rolled back" in loss and "skipped data" in loss  # abandoned rows and the shaded window
    assert 'class="ev-rollback_done"' in page and "skipped_samples=" in page


def test_empty_and_invalid_dirs(tmp_path):
    run = tmp_path / "fresh"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    page = build_report(run, with_plan=False).read_text()
    assert_complete(page)
    assert page.count("no data yet") == len(PLOTS)
    with pytest.raises(DataError, match="not a run directory"):
        build_report(tmp_path / "nothing")


def test_cli(finished, tmp_path):
    from llmtrain.cli import main

    assert main(["report", str(finished), "--out", str(tmp_path / "x.html"), "--no-plan"]) == 0
    assert_complete((tmp_path / "x.html").read_text())

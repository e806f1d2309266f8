"""Monitoring: the step-time split adds up to the measured step time (within 5%) on a CPU run and puts an
injected data-loading delay in the data phase; memory fields are consistent; the phase timer and the straggler
rule match closed forms; a rank slowed on purpose (sleep on rank 1 of 2, torchrun) is named as a straggler
with its host; W&B logging (a fake module) gets init/log/finish, and a missing package is a ConfigError."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

from llmtrain.config import config_from_dict
from llmtrain.config.schema import LoggingConfig
from llmtrain.errors import ConfigError
from llmtrain.train import timing
from llmtrain.train.metrics import MetricsLogger
from llmtrain.train.straggler import StragglerMonitor
from llmtrain.train.timing import PHASES, StepTimer, split_fractions
from llmtrain.train.trainer import Trainer


def run_cfg(prefix: str, out: Path, **sections) -> dict:
    base = {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32},
        "train": {"batch_size": 8, "micro_batch_size": 4, "max_steps": 8, "lr": 3e-3, "log_steps": 1},
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 0, "save_at_end": False, "resume": "none"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": False, "eval_iters": 1},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return base


def train_rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def events(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]


def test_split_sums_to_step_time_and_memory(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    cfg = run_cfg(
        tiny_corpus,
        out,
        fault={"slow_rank": 0, "slow_seconds": 0.03},  # runs inside the data phase
        logging={"profile_every": 4, "profile_steps": 2},
    )
    Trainer(config_from_dict(cfg)).fit()
    rows = train_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for r in rows:
        phases = r["time_phase_s"]
        assert set(phases) == set(PHASES)
        assert abs(sum(phases.values()) - r["step_time_s"]) <= 0.05 * r["step_time_s"], r
        fracs = [r[f"time_{k}_frac"] for k in ("data", "compute", "comm", "other")]
        assert abs(sum(fracs) - 1.0) < 1e-9 and min(fracs) >= 0
        assert phases["data"] >= 0.03  # the injected delay is charged to data loading
        assert phases["compute"] > 0 and phases["comm_dp"] == 0 and phases["comm_norm"] == 0  # one process
        # memory: current <= peak <= capacity (RAM), frac = peak / capacity
        assert 0 < r["memory_current_bytes"] <= r["memory_peak_bytes"] <= r["memory_capacity_bytes"]
        assert r["memory_frac"] == pytest.approx(r["memory_peak_bytes"] / r["memory_capacity_bytes"])
        assert r["rank_memory_peak_bytes"] == [r["memory_peak_bytes"]]
        busy = sum(v for k, v in phases.items() if not k.startswith("comm"))
        assert r["rank_step_time_s"] == [pytest.approx(busy)]
    # one profiler window (steps 4-5): trace + collective summary, and a profile event
    summaries = list((out / "profile").glob("*.summary.json"))
    assert len(summaries) == 1 and list((out / "profile").glob("*.trace.json"))
    s = json.loads(summaries[0].read_text())
    assert (s["first_step"], s["last_step"]) == (4, 5) and s["collectives"] == {}
    assert [e["step"] for e in events(out) if e["event"] == "profile"] == [5]


def test_timer_charges_nested_phases_exclusively():
    clock = iter([0.0, 1.0, 3.0, 3.5, 6.0, 7.0, 8.0, 10.0])  # the switch instants below, in order
    t = StepTimer("cpu", clock=lambda: next(clock))  # t=0: other
    with t.phase("data"):  # 1
        pass  # 3: back to other
    with t.phase("compute"):  # 3.5
        with t.phase("comm_norm"):  # 6
            pass  # 7: compute resumes
    t.step_done()  # (compute ends at 8)
    got = t.collect()  # 10
    assert got["data"] == 2.0 and got["compute"] == 2.5 + 1.0 and got["comm_norm"] == 1.0
    assert got["other"] == 1.0 + 0.5 + 2.0 and got["steps"] == 1
    assert sum(got[p] for p in PHASES) == 10.0
    f = split_fractions(got)
    assert f["time_compute_frac"] == 0.35 and f["time_comm_frac"] == 0.1 and f["time_other_frac"] == 0.35
    assert timing.busy_seconds(got) == 9.0


def test_straggler_rule_closed_form():
    m = StragglerMonitor(world_size=1, margin=0.2, patience=2)
    m.world_size, m.hosts, m.streak = 3, ["a", "b", "c"], [0, 0, 0]
    assert m.observe(1, [1.0, 1.0, 1.3]) == []  # rank 2 slow once (median 1.0, 1.3 > 1.2)
    found = m.observe(2, [1.0, 1.1, 1.4])  # twice in a row -> reported
    assert [(f["rank"], f["host"], f["median"]) for f in found] == [(2, "c", 1.1)]
    assert m.observe(3, [1.0, 1.0, 1.5]) == []  # same streak: reported once
    assert m.observe(4, [1.0, 1.0, 1.19]) == []  # within the margin: streak reset
    assert m.observe(5, [1.0, 1.0, 2.0]) == [] and m.streak == [0, 0, 1]


WORKER = """
import json, sys
import torch.distributed as dist
from llmtrain.config import config_from_dict
from llmtrain.train.trainer import Trainer
Trainer(config_from_dict(json.load(open(sys.argv[1])))).fit()
dist.destroy_process_group()
"""


def test_slowed_rank_is_reported_as_straggler(tiny_corpus, tmp_path):
    out = tmp_path / "dp2"
    cfg = run_cfg(
        tiny_corpus,
        out,
        train={"max_steps": 6},
        parallel={"zero_stage": 0},
        fault={"slow_rank": 1, "slow_seconds": 0.3},
        logging={"straggler_margin": 0.2, "straggler_patience": 2},
    )
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    (tmp_path / "worker.py").write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(tmp_path / "worker.py"), str(tmp_path / "cfg.json")]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    stragglers = [e for e in events(out) if e["event"] == "straggler"]
    # once per streak, for rank 1 only, after `patience` (2) slow log steps (step 1 can be slow on every rank)
    assert [(e["rank"], e["host"]) for e in stragglers] == [(1, socket.gethostname())]
    assert 2 <= stragglers[0]["step"] <= 6
    assert stragglers[0]["step_time"] >= 0.3 and stragglers[0]["step_time"] > 1.2 * stragglers[0]["median"]
    assert "[straggler]" in p.stdout  # console line
    rows = train_rows(out)
    for r in rows:
        assert len(r["rank_step_time_s"]) == 2 and r["rank_step_time_s"][1] >= 0.3
        assert len(r["rank_memory_peak_bytes"]) == 2 and min(r["rank_memory_peak_bytes"]) > 0
    # rank 0 spends the sleep waiting in the data-parallel all-reduce: exposed communication
    waits = sorted(r["time_phase_s"]["comm_dp"] for r in rows)
    assert waits[len(waits) // 2] >= 0.15, waits

    from llmtrain.report import build_report

    page = build_report(out, with_plan=False).read_text()
    assert 'class="ev-straggler"' in page and "rank 1" in page


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.calls: list[tuple] = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, data, step=None):
        self.calls.append(("log", data, step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_logging_with_fake_module(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = LoggingConfig(
        progress_bar=False, tensorboard=False, wandb=True, wandb_project="p", wandb_mode="offline"
    )
    logger = MetricsLogger(tmp_path, cfg, total_steps=2, run_config={"train": {"lr": 1.0}})
    logger.log({"step": 1, "loss": 2.5, "rank_step_time_s": [0.1, 0.2], "time_phase_s": {"data": 0.1}})
    logger.close()
    init, log, finish = fake.calls
    assert init[0] == "init" and init[1]["project"] == "p" and init[1]["mode"] == "offline"
    assert init[1]["config"] == {"train": {"lr": 1.0}} and init[1]["dir"] == str(tmp_path)
    assert log == ("log", {"loss": 2.5}, 1)  # lists and dicts are not W&B scalars
    assert finish == ("finish",)


def test_wandb_missing_package_is_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match="pip install wandb"):
        MetricsLogger(tmp_path, LoggingConfig(progress_bar=False, tensorboard=False, wandb=True), 2)

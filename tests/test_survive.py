"""The trainer survives: an injected loss spike is detected, rolled back and its data window skipped, and the
run ends within 2% of an uninjected run; an injected NaN step is skipped; a corrupted newest checkpoint makes
resume fall back to the previous one (events.jsonl says why); SIGTERM saves and stops."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from llmtrain.config import config_from_dict
from llmtrain.train.fault import damage_file
from llmtrain.train.trainer import Trainer


def cfg(prefix: str, out: Path, **sections) -> dict:
    base = {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 64},
        "train": {
            "batch_size": 8,
            "micro_batch_size": 8,
            "max_steps": 40,
            "lr": 3e-3,
            "min_lr": 3e-4,
            "warmup_steps": 3,
            "log_steps": 1,
            "eval_steps": 0,
            "seed": 3,
        },
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 5, "keep_checkpoint_max": 3},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"eval_iters": 2, "at_start": False},
        "stability": {"rule": "ratio", "ratio": 1.1, "consecutive": 2, "min_history": 8, "window": 20},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return base


def events(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]


def test_spike_rolled_back_and_run_completes(tiny_corpus, tmp_path):
    clean = Trainer(config_from_dict(cfg(tiny_corpus, tmp_path / "clean"))).fit()
    spiky = Trainer(
        config_from_dict(
            cfg(tiny_corpus, tmp_path / "spike", fault={"spike_at_step": [23], "spike_steps": 3})
        )
    )
    result = spiky.fit()
    ev = events(tmp_path / "spike")
    kinds = [e["event"] for e in ev]
    assert "rollback" in kinds and "rollback_done" in kinds, kinds
    rb = next(e for e in ev if e["event"] == "rollback")
    assert 23 <= rb["step"] <= 25  # detected within the configured window (2 consecutive steps)
    done = next(e for e in ev if e["event"] == "rollback_done")
    assert done["step"] == 20 and done["skipped_samples"] > 0
    assert result["step"] == 40
    assert abs(result["val_loss"] - clean["val_loss"]) / clean["val_loss"] < 0.02


def test_nan_step_is_skipped(tiny_corpus, tmp_path):
    t = Trainer(
        config_from_dict(
            cfg(tiny_corpus, tmp_path / "nan", fault={"nan_at_step": [6]}, train={"max_steps": 10})
        )
    )
    t.fit()
    ev = events(tmp_path / "nan")
    assert [e["step"] for e in ev if e["event"] == "skip"] == [6]
    assert t.scaler.skipped_steps == 1 and t.step == 10


def test_corrupt_newest_checkpoint_falls_back(tiny_corpus, tmp_path):
    out = tmp_path / "corrupt"
    Trainer(config_from_dict(cfg(tiny_corpus, out, train={"max_steps": 10}))).fit()
    newest = out / "checkpoints" / "step_00000010"
    damage_file(sorted(newest.glob("*.distcp"))[0], "flip")
    t = Trainer(config_from_dict(cfg(tiny_corpus, out, train={"max_steps": 12})))
    assert t.step == 5
    assert any(e["event"] == "checkpoint_fallback" and "step_00000010" in e["reason"] for e in events(out))


def test_sigterm_saves_and_stops(tiny_corpus, tmp_path, monkeypatch):
    out = tmp_path / "term"
    t = Trainer(
        config_from_dict(cfg(tiny_corpus, out, train={"max_steps": 30}, checkpoint={"save_steps": 0}))
    )
    original = Trainer.train_step

    def step_then_signal(self):
        r = original(self)
        if self.step == 7:
            os.kill(os.getpid(), signal.SIGTERM)
        return r

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    result = t.fit()
    assert result == {"step": 7, "preempted": True}
    assert (out / "checkpoints" / "step_00000007" / "COMMITTED").exists()

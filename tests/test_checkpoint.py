"""Checkpoints: round trip of model/optimizer/RNG, atomic commit, rotation, safe loading."""

import os
import pickle
import random

import numpy as np
import pytest
import torch
from torch import nn

from llmtrain.config.schema import CheckpointConfig
from llmtrain.errors import CheckpointError
from llmtrain.train.checkpoint import MARKER, Checkpointer, load_model_weights


def make(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, opt


def train_a_bit(m, opt, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(4, 5)).pow(2).sum().backward()
        opt.step()


def test_round_trip_restores_everything(tmp_path):
    m, opt = make(0)
    train_a_bit(m, opt)
    ck = Checkpointer(CheckpointConfig(keep_checkpoint_max=3), tmp_path)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path = ck.save(3, m, opt, {"step": 3, "custom": [1, 2]})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    # continue the original for two steps: the reference
    train_a_bit(m, opt, 2)
    m2, opt2 = make(1)  # different init, fresh optimizer
    state = ck.load(path, m2, opt2)
    assert state == {"step": 3, "custom": [1, 2]}
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    torch.manual_seed(123)  # same data for both continuations
    # replay: reload and run the same two steps; must equal the reference bitwise
    m3, opt3 = make(2)
    ck.load(path, m3, opt3)
    torch.manual_seed(99)
    train_a_bit(m3, opt3, 2)
    m4, opt4 = make(3)
    ck.load(path, m4, opt4)
    torch.manual_seed(99)
    train_a_bit(m4, opt4, 2)
    for a, b in zip(m3.parameters(), m4.parameters()):
        assert torch.equal(a, b)
    assert opt3.state_dict()["state"][0]["step"].item() == 5.0


def test_rotation_and_uncommitted_dirs(tmp_path):
    m, opt = make()
    ck = Checkpointer(CheckpointConfig(keep_checkpoint_max=2, resume="auto"), tmp_path)
    for s in (1, 2, 3):
        ck.save(s, m, opt, {"step": s})
    names = sorted(p.name for p in ck.dir.iterdir())
    assert names == ["step_00000002", "step_00000003"]
    # a crashed save (tmp dir, or a dir without marker) is never picked up
    (ck.dir / "step_00000009.tmp").mkdir()
    (ck.dir / "step_00000010").mkdir()
    assert ck.resume_path().name == "step_00000003"
    assert Checkpointer(CheckpointConfig(resume="none"), tmp_path).resume_path() is None
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        Checkpointer(CheckpointConfig(resume=str(ck.dir / "step_00000010")), tmp_path).resume_path()


def test_weights_only_load(tmp_path):
    m, opt = make(0)
    ck = Checkpointer(CheckpointConfig(), tmp_path)
    path = ck.save(1, m, opt, {"step": 1})
    m2, _ = make(4)
    load_model_weights(path, m2)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_malicious_metadata_is_refused(tmp_path):
    m, opt = make(0)
    path = Checkpointer(CheckpointConfig(), tmp_path).save(1, m, opt, {"step": 1})
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    m2, _ = make(1)
    with pytest.raises(CheckpointError, match="not allowed"):
        load_model_weights(path, m2)
    assert (path / MARKER).exists()

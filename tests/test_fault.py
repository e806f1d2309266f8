"""Fault injection hooks (in process, or in a forked child when the fault kills), the hang watchdog (a forked
child that must exit non-zero with its stacks on disk) and the preemption signal handler."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torch import nn

from llmtrain.config.schema import CheckpointConfig, FaultConfig
from llmtrain.train.checkpoint import Checkpointer, verify_checkpoint
from llmtrain.train.fault import HANG_EXIT_CODE, FaultInjector, HangWatchdog, PreemptionHandler


def batch(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        ids = torch.randint(0, 50, (2, 9), generator=gen)
        labels = ids[:, 1:].clone()
        labels[0, :3] = -100
        out.append({"input_ids": ids[:, :-1], "labels": labels})
    return out


def fork(fn) -> int:
    """Run ``fn`` in a forked child; return its wait status."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
            os._exit(0)
        except BaseException:
            os._exit(5)
    return os.waitpid(pid, 0)[1]


def test_kill_fires_once_across_restarts(tmp_path):
    def job():
        inj = FaultInjector(FaultConfig(kill_at_step=[3]), tmp_path)
        for step in range(1, 6):
            inj.before_step(step, batch())

    first = fork(job)
    assert os.WIFSIGNALED(first) and os.WTERMSIG(first) == signal.SIGKILL
    assert (tmp_path / "faults_fired_rank0.json").read_text() == '["kill@3"]'
    second = fork(job)  # the "restarted" job passes step 3
    assert os.WIFEXITED(second) and os.WEXITSTATUS(second) == 0


def test_kill_targets_only_its_rank(tmp_path):
    inj = FaultInjector(FaultConfig(kill_at_step=[1], rank=1), tmp_path, rank=0)
    assert inj.before_step(1, batch()) is not None  # rank 0 survives
    assert not (tmp_path / "faults_fired_rank0.json").exists()


def test_hang_sleeps(tmp_path):
    inj = FaultInjector(FaultConfig(hang_at_step=[2], hang_seconds=0.3), tmp_path)
    t0 = time.perf_counter()
    inj.before_step(1, batch())
    assert time.perf_counter() - t0 < 0.2
    inj.before_step(2, batch())
    assert time.perf_counter() - t0 >= 0.3


def test_spike_corrupts_tokens_deterministically(tmp_path):
    cfg = FaultConfig(spike_at_step=[4], spike_steps=2, seed=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = FaultInjector(cfg, tmp_path / "a", vocab_size=50)
    b = FaultInjector(cfg, tmp_path / "b", vocab_size=50)
    clean = batch()
    assert a.before_step(3, clean) is clean
    got, again = a.before_step(4, batch()), b.before_step(4, batch())
    for mb, orig, twin in zip(got, clean, again):
        assert torch.equal(mb["labels"], twin["labels"]) and torch.equal(mb["input_ids"], twin["input_ids"])
        assert torch.equal(mb["labels"] == -100, orig["labels"] == -100)  # padding kept
        changed = (mb["labels"] != orig["labels"]).float().mean().item()
        assert changed > 0.8 and int(mb["labels"].max()) < 50
    assert a.before_step(5, batch()) is not a.before_step(5, batch())  # second spike step fires once
    assert a.before_step(6, clean) is clean
    assert a.before_step(4, clean) is clean  # fired already


def test_nan_in_loss_and_grad(tmp_path):
    inj = FaultInjector(FaultConfig(nan_at_step=[2, 3]), tmp_path)
    loss = torch.tensor(2.5)
    assert inj.poison_loss(1, loss).item() == 2.5
    assert torch.isnan(inj.poison_loss(2, loss))
    assert inj.poison_loss(2, loss).item() == 2.5  # once
    m = nn.Linear(3, 2)
    m(torch.randn(4, 3)).sum().backward()
    inj.after_backward(3, m)  # target is the loss: gradients untouched
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    (tmp_path / "g").mkdir()
    g = FaultInjector(FaultConfig(nan_at_step=[3], nan_target="grad"), tmp_path / "g")
    assert torch.isfinite(g.poison_loss(3, loss))
    g.after_backward(3, m)
    norm = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])
    assert torch.isnan(norm)


@pytest.mark.parametrize("mode", ["flip", "truncate"])
def test_corrupt_checkpoint_after_save(tmp_path, mode):
    m = nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters())
    ck = Checkpointer(CheckpointConfig(), tmp_path)
    inj = FaultInjector(FaultConfig(corrupt_checkpoint_at_step=[2], corrupt_mode=mode), tmp_path)
    for step in (1, 2):
        path = ck.save(step, m, opt, {"step": step})
        inj.after_save(step, path)
    assert verify_checkpoint(ck.dir / "step_00000001") is None
    reason = verify_checkpoint(path)
    assert reason is not None and ("SHA-256" in reason if mode == "flip" else "truncated" in reason)
    assert Checkpointer(CheckpointConfig(), tmp_path).resume_path().name == "step_00000001"


def test_watchdog_dumps_stacks_and_exits(tmp_path):
    def stuck_in_a_collective():
        time.sleep(30)

    def job():
        dog = HangWatchdog(tmp_path, rank=1, timeout_s=0.5).start()
        for step in range(1, 4):
            dog.beat(step)
            time.sleep(0.05)
        stuck_in_a_collective()

    t0 = time.time()
    status = fork(job)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == HANG_EXIT_CODE
    assert time.time() - t0 < 10
    text = (tmp_path / "hang_rank1.txt").read_text()
    assert "rank 1: no progress" in text and "after step 3" in text
    assert "stuck_in_a_collective" in text and "hang-watchdog" not in text.split("\n")[0]


def test_watchdog_quiet_while_beating(tmp_path):
    def job():
        dog = HangWatchdog(tmp_path, rank=0, timeout_s=0.4).start()
        for step in range(12):
            dog.beat(step)
            time.sleep(0.1)
        dog.stop()

    status = fork(job)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert not (tmp_path / "hang_rank0.txt").exists()


def test_preemption_flag():
    before = signal.getsignal(signal.SIGTERM)
    handler = PreemptionHandler().install()
    try:
        assert not handler.requested and not handler.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert handler.requested and handler.received == signal.SIGTERM and handler.should_stop()
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before

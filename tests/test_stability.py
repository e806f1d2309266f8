"""Stability guard on synthetic loss series: spikes caught in the window, no false alarms, NaN skips, give-up,
rollback plans, state that survives resume, the host-memory snapshot and the event log."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from torch import nn

from llmtrain.train.stability import (
    GIVE_UP,
    OK,
    ROLLBACK,
    SKIP,
    EventLog,
    HostSnapshot,
    StabilityConfig,
    StabilityGuard,
    plan_rollback,
)


def noisy_decay(n: int, seed: int = 0) -> list[float]:
    """A realistic curve: 7 -> ~2.5 exponential decay with 3% multiplicative noise."""
    rng = random.Random(seed)
    return [(2.5 + 4.5 * math.exp(-t / 150)) * (1 + 0.03 * rng.gauss(0, 1)) for t in range(n)]


def run(guard: StabilityGuard, losses: list[float], start: int = 1) -> list:
    return [guard.observe(start + i, loss, 1.0) for i, loss in enumerate(losses)]


@pytest.mark.parametrize("rule", ["mad", "sigma", "ratio"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_false_positives_on_noisy_decaying_curve(rule, seed):
    cfg = StabilityConfig(rule=rule, consecutive=3, ratio=1.5)
    decisions = run(StabilityGuard(cfg), noisy_decay(600, seed))
    assert [d.action for d in decisions].count(OK) == 600


@pytest.mark.parametrize(("rule", "consecutive"), [("mad", 3), ("sigma", 3), ("ratio", 10)])
def test_spike_detected_within_window(rule, consecutive):
    losses = noisy_decay(400)
    for t in range(300, 330):
        losses[t] *= 2.5  # a spike of 30 steps starting at step 301 (1-based)
    guard = StabilityGuard(StabilityConfig(rule=rule, consecutive=consecutive, ratio=2.0))
    decisions = run(guard, losses[: 300 + consecutive])
    assert [d.action for d in decisions[:-1]].count(OK) == 300 + consecutive - 1
    first = decisions[-1]
    assert first.action == ROLLBACK  # exactly `consecutive` anomalous steps in a row
    assert (first.step, first.first_bad_step) == (300 + consecutive, 301)
    assert "spike" in first.reason
    # the anomalous steps never entered the window: the level is still the pre-spike one
    assert guard.level("loss") == pytest.approx(2.5 + 4.5 * math.exp(-275 / 150), rel=0.05)
    # it keeps firing while the spike lasts (the trainer would have rolled back), up to max_rollbacks
    rest = run(guard, losses[300 + consecutive :], 301 + consecutive)
    assert (
        [d.action for d in decisions + rest].count(ROLLBACK) == min(30 // consecutive, 5) == guard.rollbacks
    )


def test_short_blip_is_not_a_spike():
    losses = noisy_decay(200)
    losses[150] *= 3.0
    losses[151] *= 3.0  # two steps only, consecutive = 3
    decisions = run(StabilityGuard(StabilityConfig(consecutive=3)), losses)
    assert all(d.action == OK for d in decisions)
    assert "anomalous" in decisions[150].reason


def test_grad_norm_watch():
    guard = StabilityGuard(StabilityConfig(watch=("loss", "grad_norm"), consecutive=2, min_history=10))
    for step in range(1, 31):
        assert guard.observe(step, 3.0 + 0.01 * (step % 3), 1.0 + 0.05 * (step % 4)).ok
    assert guard.observe(31, 3.0, 50.0).action == OK
    d = guard.observe(32, 3.0, 60.0)
    assert d.action == ROLLBACK and "grad_norm" in d.reason and d.first_bad_step == 31


def test_nan_skipped_then_rollback_then_give_up():
    cfg = StabilityConfig(max_nonfinite_steps=3, max_rollbacks=2)
    guard = StabilityGuard(cfg)
    assert guard.observe(1, float("nan"), 1.0).action == SKIP
    assert guard.observe(2, 3.0, float("inf")).action == SKIP
    assert guard.observe(3, 3.0, 1.0).action == OK  # the run of bad steps is broken
    assert guard.skipped_steps == 2
    actions = [guard.observe(s, float("nan"), None).action for s in range(4, 13)]
    assert actions == [SKIP, SKIP, ROLLBACK, SKIP, SKIP, ROLLBACK, SKIP, SKIP, GIVE_UP]
    assert guard.rollbacks == 2 and guard.skipped_steps == 11
    last = guard.observe(13, float("nan"), None)
    assert last.action == SKIP
    final = [guard.observe(s, float("nan"), None) for s in (14, 15)][-1]
    assert (
        final.action == GIVE_UP
        and "max_rollbacks" in final.reason
        and "14 non-finite" in final.reason
        and final.step == 15
    )


def test_rollback_plan():
    cfg = StabilityConfig(lr_factor=0.5, lr_factor_steps=20)
    plan = plan_rollback(cfg, first_bad_step=301, detected_step=303, available_steps=[100, 200, 300, 400])
    assert (plan.restore_step, plan.skip_batches) == (300, 3)  # state after 300 is pre-spike; skip 301-303
    assert plan.lr_scale(300) == 1.0 and plan.lr_scale(301) == 0.5 and plan.lr_scale(320) == 0.5
    assert plan.lr_scale(321) == 1.0
    cfg = StabilityConfig(skip_batches=200, margin_steps=100)
    plan = plan_rollback(cfg, 301, 303, [100, 200, 300])
    assert (plan.restore_step, plan.skip_batches, plan.lr_scale(250)) == (200, 200, 1.0)
    assert plan_rollback(cfg, 150, 153, [100, 200]) is None  # nothing old enough


def test_state_dict_survives_resume():
    losses = noisy_decay(120)
    a = StabilityGuard()
    run(a, losses[:100])
    a.observe(101, float("nan"), None)
    b = StabilityGuard()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    rest_a = [d.action for d in run(a, losses[100:], 102)]
    rest_b = [d.action for d in run(b, losses[100:], 102)]
    assert rest_a == rest_b and b.skipped_steps == 1


def test_guard_plans_and_lowers_lr():
    guard = StabilityGuard(StabilityConfig(consecutive=2, lr_factor=0.1, lr_factor_steps=5))
    losses = noisy_decay(60)
    losses[50] = losses[51] = 40.0
    decision = next(d for d in run(guard, losses) if d.action == ROLLBACK)
    plan = guard.plan(decision, available_steps=[20, 40, 60])
    assert plan.restore_step == 40 and plan.skip_batches == 12
    assert guard.lr_scale(41) == 0.1 and guard.lr_scale(45) == 0.1 and guard.lr_scale(46) == 1.0
    assert StabilityGuard(None).lr_scale(45) == 1.0


def test_config_from_object_and_disabled():
    guard = StabilityGuard(StabilityConfig(rule="ratio", ratio=3.0, watch=["loss"]))
    assert guard.cfg.ratio == 3.0 and guard.cfg.watch == ["loss"]
    off = StabilityGuard(StabilityConfig(enabled=False))
    assert off.observe(1, float("nan"), None).action == OK
    with pytest.raises(ValueError, match="rule"):
        StabilityGuard(StabilityConfig(rule="zscore"))


def test_host_snapshot_restores_model_optimizer_rng():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

    def step():
        opt.zero_grad()
        m(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()

    step()
    snap = HostSnapshot(max_bytes=1 << 20)
    assert snap.capture(1, m, opt, {"step": 1, "data": {"consumed_samples": 8}})
    ref_next = torch.rand(1).item()
    torch.manual_seed(1)
    step()
    ref = [p.detach().clone() for p in m.parameters()]
    for _ in range(3):
        step()  # diverge
    torch.manual_seed(5)
    assert snap.restore(m, opt) == {"step": 1, "data": {"consumed_samples": 8}}
    assert torch.rand(1).item() == ref_next  # RNG restored too
    torch.manual_seed(1)
    step()
    for a, b in zip(m.parameters(), ref):
        assert torch.equal(a, b)  # same optimizer moments -> the same update, bitwise
    assert not HostSnapshot(max_bytes=100).capture(1, m, opt, {})


def test_event_log(tmp_path):
    lines: list[str] = []
    log = EventLog(tmp_path, echo=lines.append)
    log.write("rollback", step=303, restore_step=300, skip_batches=3)
    log.write("skip", step=5, reason="nan")
    rows = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [r["event"] for r in rows] == ["rollback", "skip"] and rows[0]["restore_step"] == 300
    assert lines[0] == "[rollback] step=303 restore_step=300 skip_batches=3"
    EventLog(tmp_path, enabled=False).write("x")
    assert len((tmp_path / "events.jsonl").read_text().splitlines()) == 2

"""LR schedules against their closed forms."""

import math

import pytest

from llmtrain.config.schema import TrainConfig
from llmtrain.train.schedule import build_lr_schedule

LR, MIN, WARM, STEPS = 1e-3, 1e-5, 10, 110


def sched(style, **kw):
    return build_lr_schedule(
        TrainConfig(lr=LR, min_lr=MIN, warmup_steps=WARM, max_steps=STEPS, decay_style=style, **kw)
    )


def test_warmup_is_linear_from_zero():
    f = sched("cosine")
    for s in range(1, WARM + 1):
        assert f(s) == pytest.approx(LR * s / WARM, rel=1e-12)


@pytest.mark.parametrize("step", [11, 35, 60, 87, 110])
def test_cosine_closed_form(step):
    p = (step - WARM) / (STEPS - WARM)
    assert sched("cosine")(step) == pytest.approx(
        MIN + (LR - MIN) * 0.5 * (1 + math.cos(math.pi * p)), rel=1e-12
    )


@pytest.mark.parametrize("step", [11, 35, 60, 110])
def test_linear_closed_form(step):
    p = (step - WARM) / (STEPS - WARM)
    assert sched("linear")(step) == pytest.approx(LR - (LR - MIN) * p, rel=1e-12)


def test_constant_and_end_values():
    assert sched("constant")(STEPS) == pytest.approx(LR)
    for style in ("cosine", "linear", "wsd"):
        assert abs(sched(style)(STEPS) - MIN) < 1e-15, style
        assert abs(sched(style)(STEPS + 50) - MIN) < 1e-15, style  # holds min_lr after the decay


def test_wsd_stable_then_linear_decay():
    f = sched("wsd", wsd_decay_fraction=0.2)
    # decay_steps = 100: stable through progress 0.8 (step 90), then linear to MIN at step 110
    assert f(50) == LR and f(90) == LR
    assert f(100) == pytest.approx(LR - (LR - MIN) * 0.5, rel=1e-12)


def test_explicit_decay_steps():
    f = build_lr_schedule(
        TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=1000, decay_steps=100, decay_style="linear")
    )
    assert f(50) == pytest.approx(0.5) and f(100) == 0.0 and f(500) == 0.0

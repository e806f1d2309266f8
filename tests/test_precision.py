"""Dynamic loss scaling: overflow skips the step, backs off, counts; growth after the window; clipping."""

import math

import torch

from llmtrain.config.schema import TrainConfig
from llmtrain.train.precision import LossScaler, grad_norm_


def test_fp16_overflow_path_skips_and_backs_off():
    s = LossScaler.from_config(TrainConfig(precision="fp16", initial_loss_scale=1024.0, loss_scale_window=3))
    assert s.enabled and s.dynamic and s.scale == 1024.0
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.tensor([1.0, float("inf"), 2.0, 3.0]) * s.scale
    s.unscale_([p])
    norm = grad_norm_([p], max_norm=1.0)
    assert math.isinf(norm)
    assert s.update(norm) is True
    assert s.scale == 512.0 and s.skipped_steps == 1 and s.good_steps == 0
    # three finite steps double it again
    for _ in range(3):
        assert s.update(1.0) is False
    assert s.scale == 1024.0 and s.skipped_steps == 1


def test_unscale_and_clip_compute_true_norm():
    s = LossScaler(enabled=True, dynamic=True, init_scale=8.0)
    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.tensor([3.0, 0.0]) * 8.0
    q.grad = torch.tensor([4.0]) * 8.0
    s.unscale_([p, q])
    norm = grad_norm_([p, q], max_norm=1.0)
    assert norm == 5.0  # pre-clip norm is logged
    clipped = torch.cat([p.grad, q.grad]).norm().item()
    assert abs(clipped - 1.0) < 1e-5


def test_fixed_scale_and_disabled():
    s = LossScaler.from_config(TrainConfig(precision="fp16", loss_scale=128))
    assert s.scale == 128.0 and not s.dynamic
    assert s.update(float("nan")) is True and s.scale == 128.0
    off = LossScaler.from_config(TrainConfig(precision="bf16"))
    assert not off.enabled and off.scale == 1.0
    assert (
        off.update(float("nan")) is True and off.skipped_steps == 1
    )  # NaN steps are skipped in any precision


def test_state_dict_round_trip():
    s = LossScaler(enabled=True, init_scale=64.0)
    s.update(float("inf"))
    t = LossScaler(enabled=True)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() == {"scale": 32.0, "good_steps": 0, "skipped_steps": 1}


def test_fsdp_policy_per_precision():
    """bf16/fp16 runs gather the blocks in their dtype, reduce in fp32 and keep the fp32 residual stream (no
    input cast); fp32 runs get no policy (tests/test_bf16_memory.py checks the numerics and the bytes)."""
    from llmtrain.distributed.parallelize import mixed_precision

    assert mixed_precision("fp32") is None
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        policy = mixed_precision(name)
        assert policy is not None and policy.param_dtype == dtype and policy.reduce_dtype == torch.float32
        assert policy.cast_forward_inputs is False and policy.output_dtype is None

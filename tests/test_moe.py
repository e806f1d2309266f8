"""Mixture of experts: the MoE block against a naive per-token loop, the aux loss against its closed form,
capacity drops, the aux-free bias, parameter counts; and expert parallel (ep2, all-to-all) plus dp2 (ZeRO 3)
against a single-process run of qwen3 debug_moe: losses within 1e-5, grad norms within 1e-3 (relative) over 3
steps with clipping active, one torchrun launch; an ep2 checkpoint loaded by one process gives the same weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from llmtrain.config import config_from_dict
from llmtrain.errors import ConfigError
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.moe import MoE, update_expert_bias
from llmtrain.models.common.router import load_balance_loss
from llmtrain.models.qwen import QWEN3
from llmtrain.resolve import derive
from llmtrain.train.trainer import Trainer
from test_parallel import base as parallel_base  # tests/ is on sys.path under pytest
from test_parallel import close, launch, per_step

STEPS = 3


def make_moe(
    score: str = "softmax", shared: int = 1, coef: float = 0.0, capacity: float | None = None
) -> MoE:
    args = TransformerArgs(
        hidden_size=16, num_experts=4, top_k=2, moe_hidden_size=8, shared_experts=shared, router_score=score,
        aux_loss_coef=coef, capacity_factor=capacity,
    )  # fmt: skip
    moe = MoE(args)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return moe


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_moe_matches_naive_per_token_loop(score):
    moe = make_moe(score)
    moe.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))  # changes the choice, not the weights
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    out = moe(x)
    ex, sh = moe.experts, moe.shared_experts
    ref = torch.zeros(10, 16)
    for t, xt in enumerate(x.reshape(10, 16)):
        logits = moe.router.gate.weight @ xt
        s = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
        chosen = torch.topk(s + moe.router.expert_bias, 2).indices
        w = s[chosen] / s[chosen].sum()
        for e, we in zip(chosen.tolist(), w):
            ref[t] += we * swiglu(xt, ex.w1[e], ex.w2[e], ex.w3[e])
        ref[t] += sh(xt)
    torch.testing.assert_close(out.reshape(10, 16), ref, atol=1e-6, rtol=1e-6)
    assert moe.last_counts.sum().item() == 20 and moe.last_counts.shape == (4,)


def test_moe_under_bf16_autocast_sums_in_the_input_dtype():
    """Under autocast the experts return bf16 rows while the residual stream is fp32: the combine sums them
    in fp32 (it once failed: index_add_ of a bf16 source into an fp32 destination), and the result stays within
    bf16 rounding of the fp32 forward; backward reaches every expert weight."""
    moe = make_moe(coef=0.01)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    ref = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    assert out.dtype == torch.float32
    err = (out - ref).abs().max().item()
    assert 0 < err <= 2**-6 * ref.abs().max().item(), err
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in moe.experts.parameters())


def test_aux_loss_closed_form_and_gradient():
    # 2 experts, 2 tokens, top 1: both pick expert 0 -> f = [1, 0], P = [0.75, 0.25] -> 2 * 0.75 = 1.5.
    scores = torch.tensor([[0.75, 0.25], [0.75, 0.25]])
    assert load_balance_loss(scores, torch.tensor([[0], [0]]), 2).item() == pytest.approx(1.5, abs=1e-7)
    uniform = torch.full((2, 2), 0.5)
    assert load_balance_loss(uniform, torch.tensor([[0], [1]]), 2).item() == pytest.approx(1.0, abs=1e-7)
    # Through the block: the attached aux gradient equals coef x scale x d(aux), on top of the output's.
    x = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(2))
    moe = make_moe(coef=0.1)
    moe.aux_grad_scale = 2.0
    moe(x).sum().backward()
    with_aux = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    moe.aux_grad_scale = 0.0
    moe(x).sum().backward()
    plain = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    scores, chosen, _ = moe.router(x.reshape(-1, 16))
    load_balance_loss(scores, chosen, 4).backward()
    torch.testing.assert_close(
        with_aux, plain + 0.1 * 2.0 * moe.router.gate.weight.grad, atol=1e-6, rtol=1e-5
    )
    assert moe.last_aux.item() == pytest.approx(load_balance_loss(scores, chosen, 4).item(), abs=1e-7)


def test_capacity_drops_exactly_the_tokens_over_capacity():
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(3))
    free, capped = make_moe(shared=0), make_moe(shared=0, capacity=1.0)
    for m in (free, capped):  # every token picks experts 0 and 1: capacity ceil(1.0 * 8 * 2 / 4) = 4 each
        m.router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    a, b = free(x)[0], capped(x)[0]
    torch.testing.assert_close(b[:4], a[:4], atol=0, rtol=0)  # first 4 tokens fit in both experts
    assert torch.count_nonzero(b[4:]) == 0 and torch.count_nonzero(a[4:]) > 0  # the rest are dropped
    assert capped.last_counts.tolist() == [8, 8, 0, 0]  # counts are before drops


def test_aux_free_bias_moves_toward_balance():
    moe = make_moe(shared=0)
    counts = torch.tensor([[6.0, 2.0, 0.0, 0.0]])
    update_expert_bias(moe, counts, 0.1)
    torch.testing.assert_close(moe.router.expert_bias, torch.tensor([-0.1, 0.0, 0.1, 0.1]))
    moe.router.expert_bias.zero_()
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.2  # skew the router toward expert 0
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(4)).abs()
    imbalance = []
    for _ in range(200):
        moe(x)
        c = moe.last_counts.float()
        imbalance.append((c.max() / c.mean()).item())
        update_expert_bias(moe, c[None], 0.003)
    assert imbalance[0] > 1.4 and max(imbalance[-20:]) < 1.1, imbalance  # 1.44 -> ~1.05


def test_parameter_counts_and_config():
    args = QWEN3.flavor_args("30b_a3b")  # published: 30.5B total, 3.3B activated
    assert args.num_params() == 30_532_122_624
    assert args.num_params(active=True) == 3_353_032_704
    small = QWEN3.flavor_args("debug_moe")
    from llmtrain.models import build_model

    model = build_model(small, device="cpu")
    assert sum(p.numel() for p in model.parameters()) == small.num_params()
    assert all(isinstance(b.feed_forward, MoE) for b in model.layers.values())
    cfg = {"model": {"model_type": "qwen3", "flavor": "debug", "vocab_size": 512,
                     "moe": {"num_experts": 8, "top_k": 2, "moe_hidden_size": 32, "every": 2}}}  # fmt: skip
    d = derive(config_from_dict(cfg))
    assert d.model_args.num_experts == 8 and d.model_args.num_moe_layers == 1  # blocks 1 of 0..1
    assert d.active_params == d.num_params - 6 * 3 * 64 * 32  # 6 of the 8 experts are inactive
    dense = derive(config_from_dict({"model": {"model_type": "qwen3", "flavor": "debug", "vocab_size": 512}}))
    # FLOPs count active parameters: the MoE block has router 64x8 + 2 experts x 3x64x32 instead of 3x64x256.
    assert d.flops_per_token == dense.flops_per_token - 6 * (3 * 64 * 256 - (64 * 8 + 2 * 3 * 64 * 32))
    bad = copy.deepcopy(cfg)
    bad["model"]["moe"]["top_k"] = 9
    with pytest.raises(ConfigError, match="model.moe.top_k"):
        derive(config_from_dict(bad))


# ---------------------------------------------------------------- distributed parity (one launch, world 2)
def base(prefix: str) -> dict:
    """The dense parity base of test_parallel with the MoE flavor (capacity 1.25, so tokens get dropped)."""
    cfg = parallel_base(prefix, "qwen3")
    cfg["model"].update({"flavor": "debug_moe", "moe": {"capacity_factor": 1.25}})
    return cfg


def test_expert_parallel_matches_single_process(tiny_corpus, tmp_path):
    cfg = base(tiny_corpus)
    cfg["run"]["output_dir"] = str(tmp_path / "ref")
    ref_trainer = Trainer(config_from_dict(cfg))
    ref = [ref_trainer.train_step() for _ in range(STEPS)]
    ref_trainer.metrics.close()
    assert all(r["grad_norm"] > 0.05 for r in ref)  # clipping really acts
    assert all(r["moe_load_max_over_mean"] > 1.0 and r["moe_aux_loss"] > 1.0 for r in ref)
    assert ref_trainer.model.layers["0"].feed_forward.router.expert_bias.abs().sum() > 0  # bias moved

    dump, ckpt = tmp_path / "ep2_state.pt", tmp_path / "ep2_ckpt"
    variants = {
        "zero3_dp2": {"parallel": {"zero_stage": 3}},
        "ep2_zero3": {
            "parallel": {"zero_stage": 3, "expert_parallel": 2, "enable_alltoall": True},
            "checkpoint": {"save_dir": str(ckpt)},
            "save_after_steps": True,
            "dump_state": str(dump),
        },
        "ep2_zero2_recompute": {
            "parallel": {"zero_stage": 2, "expert_parallel": 2},
            "recompute": {"mode": "full"},
        },
        "ep2_zero0": {"parallel": {"zero_stage": 0, "expert_parallel": 2}},
    }
    results = launch(2, {"base": base(tiny_corpus), "steps": STEPS, "variants": variants}, tmp_path)
    assert set(results) == set(variants)
    for name, r in results.items():
        close(name, r, per_step(ref))

    # The ep2 checkpoint (expert shards as DTensors) loads into one process: bitwise the gathered weights.
    gathered = torch.load(dump, weights_only=True)
    cfg = base(tiny_corpus)
    cfg["run"]["output_dir"] = str(tmp_path / "load")
    cfg["checkpoint"]["resume"] = str(ckpt / f"step_{STEPS:08d}")
    loaded = Trainer(config_from_dict(cfg))
    assert loaded.step == STEPS
    state = loaded.model.state_dict()
    assert set(gathered) == set(state)
    for key, value in gathered.items():
        assert torch.equal(state[key], value), key
    # ... and within float noise of the single-process run's weights (experts included).
    for key, value in ref_trainer.model.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=1e-4, rtol=0, msg=key)
    loaded.metrics.close()

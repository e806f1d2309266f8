"""Stability by construction (issue 32): model.init (TinyInit), model.norm_scheme (sandwich / DSSN), train.z_loss,
model.qk_norm on every family, the sandwich export to Glm4ForCausalLM, and the per-layer health metrics.

Every number is checked against a formula or a direct computation: each init's measured per-layer std against
its formula (tolerance: 6 standard errors of a sample std, ``6 / sqrt(2 n)`` relative); a sandwich and a
pre-norm block against a hand-written reference; z-loss value and gradient against ``logsumexp`` computed
directly, for the plain and the chunked loss; the exported sandwich / DSSN model's logits in transformers
against ours at fp32; the health monitor's per-layer norms against ``torch.linalg.vector_norm``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmtrain.config import config_from_dict
from llmtrain.config.schema import ModelConfig, StabilityConfig
from llmtrain.errors import ConfigError
from llmtrain.models import build_model, resolve_model_args
from llmtrain.models.common.init import DSSN_C_ATTN, DSSN_C_MLP, TINYINIT_EMBED_STD, tinyinit_std
from llmtrain.models.common.transformer import TransformerBlock
from llmtrain.train.health import HealthMonitor
from llmtrain.train.loss import LogitStats, chunked_head_loss, token_cross_entropy
from llmtrain.train.stability import StabilityGuard

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_config  # noqa: E402


def model_args(family: str = "llama3", flavor: str = "debug", **fields):
    return resolve_model_args(ModelConfig(model_type=family, flavor=flavor, seq_length=32, **fields), None)


def std_ok(t: torch.Tensor, want: float) -> bool:
    """Sample std within 6 standard errors (a normal sample's std has relative sd ~ 1 / sqrt(2 n))."""
    return abs(t.float().std().item() / want - 1.0) < 6.0 / math.sqrt(2 * t.numel())


# ---- init


@pytest.mark.parametrize("init", ["default", "tinyinit"])
def test_each_init_matches_its_formula_per_layer(init: str) -> None:
    args = model_args(
        num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=384, init=init
    )
    model = build_model(args, "cpu")
    model.init_weights(seed=3)
    d, n_layers = args.hidden_size, args.num_layers
    for i in range(n_layers):
        block = model.layers[str(i)]
        for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                     "feed_forward.w2", "feed_forward.w3"):  # fmt: skip
            weight = block.get_submodule(name).weight
            if init == "tinyinit":
                want = math.sqrt(1.0 / (2 * d * n_layers))  # Pangu Ultra: N(0, 1 / (2 d L))
            elif name.endswith(("wo", "w2")):
                want = args.init_std / math.sqrt(2 * n_layers)  # GPT-2's residual scaling
            else:
                want = args.init_std
            assert std_ok(weight, want), (i, name, weight.std().item(), want)
    embed_want = TINYINIT_EMBED_STD if init == "tinyinit" else args.init_std
    assert std_ok(model.tok_embeddings.weight, embed_want)
    assert std_ok(model.output.weight, tinyinit_std(args) if init == "tinyinit" else args.init_std)
    assert tinyinit_std(args) == pytest.approx(1 / 32)  # sqrt(1 / (2 * 128 * 4))


@pytest.mark.parametrize("scheme", ["sandwich", "dssn"])
def test_post_norm_gains_start_depth_scaled_with_dssn(scheme: str) -> None:
    args = model_args(num_layers=9, norm_scheme=scheme)
    assert args.post_norms and args.norm_scheme == scheme
    model = build_model(args, "cpu")
    model.init_weights(seed=0)
    attn, mlp = (DSSN_C_ATTN / 3, DSSN_C_MLP / 3) if scheme == "dssn" else (1.0, 1.0)  # c / sqrt(9)
    for block in model.layers.values():
        assert torch.equal(block.attention_post_norm.weight, torch.full((args.hidden_size,), attn))
        assert torch.equal(block.ffn_post_norm.weight, torch.full((args.hidden_size,), mlp))
        assert torch.equal(block.attention_norm.weight, torch.ones(args.hidden_size))  # pre norms stay 1


def test_default_init_is_unchanged_bitwise() -> None:
    """model.init default draws exactly what the init drew before the option existed (seeded per name)."""
    args = model_args()
    model = build_model(args, "cpu")
    model.init_weights(seed=1)
    gen = torch.Generator().manual_seed(
        (1 * 1_000_003 + __import__("zlib").crc32(b"layers.0.attention.wo.weight")) % 2**63
    )
    want = torch.empty_like(model.layers["0"].attention.wo.weight).normal_(
        0, 0.02 / math.sqrt(4), generator=gen
    )
    assert torch.equal(model.layers["0"].attention.wo.weight, want)


def test_norm_scheme_resolution_and_conflicts() -> None:
    assert model_args("glm4", "debug_0414").norm_scheme == "sandwich"  # the published checkpoint's
    assert model_args("glm4", "debug_0414", norm_scheme="pre").post_norms is False
    assert model_args("llama3").norm_scheme == "pre"
    with pytest.raises(
        ConfigError, match="model.norm_scheme pre has no post norms but model.post_norms is true"
    ):
        model_args(norm_scheme="pre", post_norms=True)
    cfg = config_from_dict({"model": {"model_type": "llama3", "flavor": "debug", "norm_scheme": "dssn"}})
    assert cfg.model.norm_scheme == "dssn"
    with pytest.raises(ConfigError, match="norm_scheme"):
        config_from_dict({"model": {"model_type": "llama3", "norm_scheme": "post"}})


# ---- sandwich vs pre-norm forward, by hand


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_block(block: TransformerBlock, x: torch.Tensor, eps: float, sandwich: bool) -> torch.Tensor:
    """The block written out by hand: causal softmax attention (no RoPE: positions all 0), SwiGLU."""
    att = block.attention
    hd = att.head_dim
    a_in = _rms(x, block.attention_norm.weight, eps)
    q = (a_in @ att.wq.weight.T).view(1, -1, att.wq.weight.shape[0] // hd, hd).transpose(1, 2)
    k = (a_in @ att.wk.weight.T).view(1, -1, att.wk.weight.shape[0] // hd, hd).transpose(1, 2)
    v = (a_in @ att.wv.weight.T).view(1, -1, att.wv.weight.shape[0] // hd, hd).transpose(1, 2)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    t = x.shape[1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd) + torch.full((t, t), float("-inf")).triu(1)
    a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, t, -1) @ att.wo.weight.T
    if sandwich:
        a = _rms(a, block.attention_post_norm.weight, eps)
    h = x + a
    f_in = _rms(h, block.ffn_norm.weight, eps)
    ff = block.feed_forward
    f = (F.silu(f_in @ ff.w1.weight.T) * (f_in @ ff.w3.weight.T)) @ ff.w2.weight.T
    if sandwich:
        f = _rms(f, block.ffn_post_norm.weight, eps)
    return h + f


@pytest.mark.parametrize("scheme", ["pre", "sandwich", "dssn"])
def test_block_forward_matches_hand_computation(scheme: str) -> None:
    args = model_args(hidden_size=8, num_heads=2, num_kv_heads=1, intermediate_size=16, norm_scheme=scheme)
    model = build_model(args, "cpu")
    model.init_weights(seed=4)
    block = model.layers["0"]
    with torch.no_grad():  # non-trivial gains so every norm weight matters
        for name, p in block.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(torch.linspace(0.5, 1.5, p.numel()))
    x = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(0))
    from llmtrain.models.common.attention import build_masks

    mask = build_masks(5, 0, None, False, x.device)
    with torch.no_grad():
        got = block(x, None, mask)
        want = _reference_block(block, x, args.rms_norm_eps, scheme != "pre")
    assert (got - want).abs().max().item() < 1e-5  # (RoPE off: the block gets rope=None)


# ---- z-loss


def test_z_loss_value_and_gradient_match_direct_computation() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50, generator=gen)).requires_grad_()
    labels = torch.randint(0, 50, (3, 7), generator=gen)
    labels[0, :2] = -100
    coef = 1e-2
    got = token_cross_entropy(logits, labels, 0.0, coef)
    (g_got,) = torch.autograd.grad(got, logits)
    keep = labels != -100
    lse = torch.logsumexp(logits.double(), -1)
    ce = -(logits.double().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0])
    want = (ce[keep]).sum() + coef * (lse[keep] ** 2).sum()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    # d/dlogits: softmax - onehot + 2 coef lse softmax, on kept tokens only
    p = logits.double().softmax(-1)
    onehot = F.one_hot(labels.clamp(min=0), 50).double()
    g_want = (p - onehot + 2 * coef * lse[..., None] * p) * keep[..., None]
    assert (g_got.double() - g_want).abs().max().item() < 1e-6
    # coef 0 is the plain cross-entropy, bitwise
    plain = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)
    assert torch.equal(token_cross_entropy(logits, labels), plain)


def test_chunked_z_loss_matches_full_logits_and_collects_rms() -> None:
    gen = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(16, 40, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(40, 16, generator=gen))
    h = torch.randn(2, 9, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 40, (2, 9), generator=gen)
    labels[1, -3:] = -100
    stats = LogitStats()
    got = chunked_head_loss(h, head, labels, 4, z_loss=1e-3, stats=stats)
    g_h, g_w = torch.autograd.grad(got, (h, head.weight))
    logits = head(h)
    want = token_cross_entropy(logits, labels, 0.0, 1e-3)
    w_h, w_w = torch.autograd.grad(want, (h, head.weight))
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert torch.allclose(g_h, w_h, rtol=1e-4, atol=1e-6) and torch.allclose(g_w, w_w, rtol=1e-4, atol=1e-6)
    sumsq, count = stats.take()
    assert count == 2 * 9 * 40
    assert math.sqrt(sumsq / count) == pytest.approx(logits.pow(2).mean().sqrt().item(), rel=1e-5)


# ---- QK-norm on every family


@pytest.mark.parametrize(
    "family,flavor",
    [("llama3", "debug"), ("qwen2", "debug"), ("glm4", "debug"), ("baichuan2", "debug"), ("mistral", "debug"),
     ("mixtral", "debug")],
)  # fmt: skip
def test_qk_norm_on_every_gqa_family_bounds_the_logits(family: str, flavor: str) -> None:
    """With QK-norm (gains 1 at init) every query and key has norm ``sqrt(head_dim * ms / (ms + eps))`` (ms its
    mean square, ~0.03 at init), so the bound the health metric reports is sqrt(head_dim), less eps / ms."""
    args = model_args(family, flavor, qk_norm=True)
    model = build_model(args, "cpu")
    model.init_weights(seed=0)
    health = HealthMonitor(model, args.num_layers, world_size=1)
    health.record(True)
    with torch.no_grad():
        model(torch.randint(0, args.vocab_size, (1, 12)))
    row = health.reduce(rank=0)
    assert math.sqrt(args.head_dim) * (1 - 2e-3) < row["attn_logit_bound"] <= math.sqrt(args.head_dim)


def test_qk_norm_with_mla_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="QK-norm"):
        model_args("deepseek_v3", "debug", qk_norm=True)


# ---- export of a sandwich model


def test_dssn_glm4_exports_to_glm4_with_logits_parity(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from llmtrain.models.hf_io import load_hf_pretrained, save_hf

    args = dataclasses.replace(
        model_args("glm4", "debug_0414", norm_scheme="dssn", init="tinyinit"), seq_length=64
    )
    ours = build_model(args, "cpu").eval()
    ours.init_weights(seed=9)
    with torch.no_grad():  # trained-looking gains, so the post norms' mapping matters
        for name, p in ours.named_parameters():
            if "post_norm" in name:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    save_hf(ours.state_dict(), args, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Glm4ForCausalLM"] and config["model_type"] == "glm4"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (ours(ids) - hf(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-5  # fp32: the same ops, possibly in another order
    back, back_args = load_hf_pretrained(tmp_path, "cpu")  # and import gives back the same function
    back.eval()
    assert back_args.post_norms and back.args.norm_scheme == "sandwich"  # (dssn is an init, not stored)
    with torch.no_grad():
        assert torch.equal(back(ids), ours(ids))


def test_sandwich_export_of_another_family_is_refused(tmp_path: Path) -> None:
    from llmtrain.models.hf_io import save_hf

    args = model_args(norm_scheme="sandwich")
    model = build_model(args, "cpu")
    model.init_weights(seed=0)
    with pytest.raises(ConfigError, match="Glm4ForCausalLM"):
        save_hf(model.state_dict(), args, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written


# ---- health metrics


def test_health_norms_match_direct_computation() -> None:
    args = model_args(num_layers=3)
    model = build_model(args, "cpu")
    model.init_weights(seed=2)
    ids = torch.randint(0, args.vocab_size, (2, 16))
    health = HealthMonitor(model, args.num_layers, world_size=1)
    health.record(True)
    loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    health.step_values(params)
    health.take_norms()
    row = health.reduce(rank=0)
    for i in range(3):
        block = model.layers[str(i)]
        g = torch.linalg.vector_norm(
            torch.cat([p.grad.flatten() for p in block.parameters()]).double()
        ).item()
        w = torch.linalg.vector_norm(
            torch.cat([p.detach().flatten() for p in block.parameters()]).double()
        ).item()
        assert row[f"grad_norm/layer_{i:02d}"] == pytest.approx(g, rel=1e-6)
        assert row[f"param_norm/layer_{i:02d}"] == pytest.approx(w, rel=1e-6)
    assert row["max_layer_grad_norm"] == max(row[f"grad_norm/layer_{i:02d}"] for i in range(3))
    assert row["nonfinite_frac"] == 0.0
    params[0].grad[0, 0] = float("nan")  # a step the scaler would skip: one non-finite value counted
    health.step_values(params)
    health.count_nonfinite(params)
    assert health.reduce(rank=0)["nonfinite_frac"] == pytest.approx(1 / sum(p.numel() for p in params))


def test_guard_watches_a_health_metric_and_refuses_unknown_names() -> None:
    guard = StabilityGuard(
        StabilityConfig(watch=["loss", "grad_norm/layer_01"], min_history=3, consecutive=2)
    )
    for step in range(1, 11):  # the metric every other step (log steps), steady
        metrics = {"grad_norm/layer_01": 1.0 + 0.01 * (step % 3)} if step % 2 == 0 else None
        assert guard.observe(step, 2.0, 1.0, metrics).ok
    assert guard.observe(11, 2.0, 1.0, None).ok
    assert guard.observe(12, 2.0, 1.0, {"grad_norm/layer_01": 50.0}).ok  # first anomalous log step
    assert guard.observe(13, 2.0, 1.0, None).ok  # a step without the metric does not break the streak
    assert guard.observe(14, 2.0, 1.0, {"grad_norm/layer_01": 60.0}).action == "rollback"
    with pytest.raises(ConfigError, match="stability.watch\\[0\\]: .grad_norms/layer_01. is not one of"):
        StabilityGuard(StabilityConfig(watch=["grad_norms/layer_01"]))


def test_training_writes_health_rows(tiny_corpus: str, tmp_path: Path) -> None:
    """A 2-step run with DSSN + TinyInit + QK-norm + z-loss logs the per-layer keys every log step."""
    from llmtrain.train.trainer import Trainer

    out = tmp_path / "run"
    cfg = tiny_config(
        tiny_corpus, out, model={"norm_scheme": "dssn", "init": "tinyinit", "qk_norm": True},
        train={"z_loss": 1e-4}, checkpoint={"save_at_end": False},
        stability={"watch": ["loss", "max_layer_grad_norm"]},
    )  # fmt: skip
    Trainer(config_from_dict(cfg)).fit()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert len(train) == 2
    for r in train:
        layer_keys = [k for k in r if "layer" in k and "grad" in k and k != "max_layer_grad_norm"]
        assert layer_keys == ["grad_norm/layer_00", "grad_norm/layer_01"]
        assert r["max_layer_grad_norm"] == max(r[k] for k in layer_keys)
        assert r["logit_rms"] > 0 and r["attn_logit_bound"] == pytest.approx(4.0, rel=1e-3)  # sqrt(16)
        assert r["nonfinite_frac"] == 0.0
    val = [r for r in rows if "val_loss" in r]
    assert val and math.isfinite(val[-1]["val_loss"])
    from llmtrain.report.plots import render_all
    from llmtrain.report.run_data import load_run

    svgs = render_all(load_run(out))  # the report's heat-map of per-layer gradient norms has the data
    assert "no data yet" not in svgs["layer_grad_norm"] and "no data yet" not in svgs["health"]

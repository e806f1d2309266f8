"""The MoE router options of every family (models/common/moe.py) against hand computations in plain torch.

Shown: the top-k weights with routed_scaling_factor, route_norm and pre- / post-softmax top-k (post-softmax equals
pre-softmax with renormalisation, which is how export writes it); the fp32 router under bf16 autocast; the aux
loss per micro-batch and over the global batch (running counts over the step's micro-batches, reset each step,
unchanged by activation recompute, summed over two gloo ranks through FSDP's mesh); the tokens each drop policy
keeps at capacity; the defaults; and the refusals by key name (config validation, Hugging Face export).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from llmtrain.cli import main
from llmtrain.errors import ConfigError
from llmtrain.models import FAMILIES, build_model
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.moe import (
    MoE,
    Router,
    kept_assignments,
    reset_balance,
    resolve_balance_groups,
)
from llmtrain.models.hf_io import save_hf

N, D = 6, 64  # tokens, hidden (qwen3 debug_moe_hf: 4 experts of width 64, top 2)


def moe_args(**changes) -> TransformerArgs:
    return dataclasses.replace(FAMILIES["qwen3"].flavor_args("debug_moe_hf"), **changes)


def tokens(seed: int, n: int = N) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def seeded(module: torch.nn.Module) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    if hasattr(module, "expert_bias"):
        module.expert_bias.zero_()
    for m in module.modules():
        if isinstance(m, Router):
            m.expert_bias.zero_()
    return module


def hand_routing(x, w, k, pre, norm, scale, sigmoid=False):
    """(chosen [N][k] expert ids, weights [N][k]) computed one token at a time in float64."""
    chosen, weights = [], []
    for row in (x.double() @ w.double().T).tolist():
        ids = sorted(range(len(row)), key=lambda e: -row[e])[:k]  # top-k of the logits = of their softmax
        if sigmoid:
            ws = [1 / (1 + math.exp(-row[e])) for e in ids]
            ws = [v / sum(ws) for v in ws] if norm else ws
        elif pre:
            z = sum(math.exp(v) for v in row)
            ws = [math.exp(row[e]) / z for e in ids]
            ws = [v / sum(ws) for v in ws] if norm else ws
        else:  # softmax over the chosen logits only
            z = sum(math.exp(row[e]) for e in ids)
            ws = [math.exp(row[e]) / z for e in ids]
        chosen.append(ids)
        weights.append([v * scale for v in ws])
    return chosen, torch.tensor(weights)


# fp32 softmax / division of values <= 1 against float64: a few ulps (6e-8) each, times the scale <= 2.5
TOL = 1e-6


@pytest.mark.parametrize(
    ("pre", "norm", "scale"),
    [(True, False, 1.0), (True, False, 1.5), (True, True, 1.5), (False, False, 1.5), (False, True, 1.0)],
)
def test_router_weights_by_hand(pre, norm, scale):
    router = seeded(Router(moe_args(pre_softmax=pre, route_norm=norm, routed_scaling_factor=scale)))
    x = tokens(1)
    scores, chosen, weights = router(x)
    ids, expected = hand_routing(x, router.gate.weight, 2, pre, norm, scale)
    assert chosen.tolist() == ids
    assert (weights - expected).abs().max() < TOL
    full = torch.softmax((x.double() @ router.gate.weight.double().T), -1)  # the aux loss's P: all experts
    assert (scores - full).abs().max() < TOL
    if not pre:  # post-softmax top-k = renormalised pre-softmax top-k (what export writes: norm_topk_prob)
        _, renorm = hand_routing(x, router.gate.weight, 2, True, True, scale)
        assert (weights - renorm).abs().max() < TOL


def test_sigmoid_router_scales_in_any_family():
    router = seeded(Router(moe_args(router_score="sigmoid", route_norm=True, routed_scaling_factor=2.5)))
    x = tokens(2)
    _, chosen, weights = router(x)
    ids, expected = hand_routing(x, router.gate.weight, 2, True, True, 2.5, sigmoid=True)
    assert chosen.tolist() == ids and (weights - expected).abs().max() < TOL
    assert torch.allclose(weights.sum(-1), torch.full((N,), 2.5))


def test_router_fp32_under_bf16_autocast():
    """router_fp32: the logits are the fp32 matmul, bit for bit, under autocast; without it the gate runs in
    bf16 (what autocast does to a Linear), which rounds the logits."""
    x = tokens(3)
    for fp32 in (True, False):
        router = seeded(Router(moe_args(router_fp32=fp32)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores, _, _ = router(x)
        exact = torch.softmax(x @ router.gate.weight.T, -1)
        diff = (scores - exact).abs().max().item()
        assert (diff == 0.0) if fp32 else (diff > 1e-4), (fp32, diff)


def hand_aux(xs_counted, x_now, w, k, e):
    """E * sum_i f_i P_i: f from the assignments of every token batch in ``xs_counted``, P from ``x_now``."""
    counts = torch.zeros(e, dtype=torch.float64)
    for x in xs_counted:
        for ids in hand_routing(x, w, k, True, True, 1.0)[0]:
            for i in ids:
                counts[i] += 1
    p = torch.softmax(x_now.double() @ w.double().T, -1).mean(0)
    return float(e * (counts / counts.sum() * p.detach()).sum())


def test_aux_loss_per_micro_batch_and_over_the_global_batch():
    """micro_batch: f counts the micro-batch itself; global_batch: the step's micro-batches so far (MindFormers'
    gbs_aux_loss accumulates them the same way), reset when the step ends."""
    x1, x2, x3 = tokens(4), tokens(5), tokens(6)
    for scope in ("micro_batch", "global_batch"):
        moe = seeded(MoE(moe_args(aux_loss_coef=0.01, aux_loss_scope=scope))).train()
        w = moe.router.gate.weight
        resolve_balance_groups(moe)  # one process, plain weight: nothing to sum over
        assert moe.balance_groups == ([] if scope == "global_batch" else None)
        auxes = []
        for x in (x1, x2):
            moe(x[None])
            auxes.append(float(moe.last_aux))
        reset_balance(moe)  # the step ends
        moe(x3[None])
        auxes.append(float(moe.last_aux))
        if scope == "micro_batch":
            expected = [hand_aux([x], x, w, 2, 4) for x in (x1, x2, x3)]
        else:
            expected = [
                hand_aux([x1], x1, w, 2, 4),
                hand_aux([x1, x2], x2, w, 2, 4),
                hand_aux([x3], x3, w, 2, 4),
            ]
        assert auxes == pytest.approx(expected, abs=1e-6), scope
    assert expected[1] != pytest.approx(hand_aux([x2], x2, w, 2, 4), abs=1e-4)  # the scopes differ here


def _router_grads(recompute: bool, scope: str) -> torch.Tensor:
    moe = seeded(MoE(moe_args(aux_loss_coef=0.5, aux_loss_scope=scope))).train()
    moe.aux_grad_scale = 1.0
    for seed in (4, 5):
        x = tokens(seed)[None].requires_grad_()
        out = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False) if recompute else moe(x)
        out.pow(2).mean().backward()
    reset_balance(moe)
    return moe.router.gate.weight.grad.clone()


def test_global_aux_loss_is_unchanged_by_activation_recompute():
    """The re-run of a checkpointed forward inside backward takes the fractions its first run used (the running
    counts have moved on by then), so the gradients equal the run without recompute."""
    plain, recomputed = _router_grads(False, "global_batch"), _router_grads(True, "global_batch")
    assert torch.equal(plain, recomputed)
    assert (plain - _router_grads(False, "micro_batch")).abs().max() > 1e-6  # the aux loss's gradient shows


def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        moe = seeded(MoE(moe_args(aux_loss_coef=0.01, aux_loss_scope="global_batch"))).train()
        fully_shard(moe, mesh=init_device_mesh("cpu", (2,)))
        resolve_balance_groups(moe)
        groups = len(moe.balance_groups)
        auxes = []
        for seed in (10 + rank, 20 + rank):  # two micro-batches per rank
            moe(tokens(seed)[None])
            auxes.append(float(moe.last_aux))
        torch.save({"groups": groups, "aux": auxes}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_global_aux_loss_sums_the_counts_over_data_parallel_ranks(tmp_path):
    """Two gloo ranks under FSDP: the counts are summed over the router weight's mesh, so each rank's f is the
    fraction over both ranks' tokens and the micro-batches so far; P stays the rank's own."""
    import torch.multiprocessing as mp

    fd, init_file = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    os.remove(init_file)
    mp.spawn(_two_rank_worker, args=(init_file, str(tmp_path)), nprocs=2, join=True)
    w = seeded(MoE(moe_args())).router.gate.weight
    xs = {seed: tokens(seed) for seed in (10, 11, 20, 21)}
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["groups"] == 1
        first = hand_aux([xs[10], xs[11]], xs[10 + rank], w, 2, 4)
        second = hand_aux([xs[10], xs[11], xs[20], xs[21]], xs[20 + rank], w, 2, 4)
        assert got["aux"] == pytest.approx([first, second], abs=1e-6), rank


def test_drop_policies_keep_by_position_or_by_weight():
    # 5 assignments to expert 0 (tokens 0..4, weights below) and 1 to expert 1; capacity 2
    flat_expert = torch.tensor([0, 0, 0, 1, 0, 0])
    weights = torch.tensor([0.1, 0.9, 0.3, 0.5, 0.9, 0.2])
    counts = torch.bincount(flat_expert, minlength=2)
    assert kept_assignments(flat_expert, weights, counts, 2, "position").tolist() == [0, 1, 3]
    assert kept_assignments(flat_expert, weights, counts, 2, "probs").tolist() == [1, 4, 3]  # ties: earlier


def hand_moe(moe: MoE, x: torch.Tensor, keep) -> torch.Tensor:
    """The MoE output with only the assignments ``keep(token, slot, expert, weight)`` accepts, token by token."""
    _, chosen, weights = moe.router(x)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(chosen.shape[1]):
            e = int(chosen[t, s])
            if keep(t, s, e, float(weights[t, s])):
                h = F.silu(x[t] @ w1[e].T) * (x[t] @ w3[e].T)
                out[t] += weights[t, s] * (h @ w2[e].T)
    return out


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_dropped_tokens_by_policy(policy):
    """capacity_factor 0.5: ceil(0.5 x 12 tokens x 2 / 4) = 3 slots per expert; the MoE output is the hand sum
    over the assignments the policy keeps (position: each expert's first 3 tokens; probs: its 3 heaviest)."""
    moe = seeded(MoE(moe_args(capacity_factor=0.5, drop_policy=policy)))
    x = tokens(8, 12)
    with torch.no_grad():
        _, chosen, weights = moe.router(x)
    per_expert: dict[int, list[tuple[float, int, int]]] = {}
    for t in range(12):
        for s in range(2):
            per_expert.setdefault(int(chosen[t, s]), []).append((-float(weights[t, s]), t, s))
    kept = set()
    for items in per_expert.values():
        ranked = sorted(items, key=lambda i: (i[1], i[2])) if policy == "position" else sorted(items)
        kept |= {(t, s) for _, t, s in ranked[:3]}
    assert len(kept) < 24  # something is dropped
    with torch.no_grad():
        got = moe(x[None])[0]
        expected = hand_moe(moe, x, lambda t, s, e, w: (t, s) in kept)
    # fp32 sums of 64-term products against the same in another order: a few ulps of the largest output
    assert (got - expected).abs().max() < 16 * torch.finfo(torch.float32).eps * expected.abs().max()


def test_defaults_are_unchanged():
    a = TransformerArgs()
    assert (a.pre_softmax, a.router_fp32, a.aux_loss_scope, a.drop_policy) == (
        True,
        False,
        "micro_batch",
        "position",
    )
    assert a.routed_scaling_factor == 1.0 and a.capacity_factor is None


@pytest.mark.parametrize(
    ("moe", "match"),
    [
        ({"router_score": "sigmoid", "pre_softmax": False}, r"model\.moe\.pre_softmax false .* needs model\.moe\.router_score softmax"),
        ({"aux_loss_scope": "gbs_aux_loss"}, r"model\.moe\.aux_loss_scope.*micro_batch.*global_batch"),
        ({"drop_policy": "random"}, r"model\.moe\.drop_policy.*position.*probs"),
        ({"routed_scaling_factor": 0}, r"model\.moe\.routed_scaling_factor\b.*(> 0|positive)"),
    ],
)  # fmt: skip
def test_bad_router_options_are_named(tmp_path, capsys, moe, match):
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump({"model": {"model_type": "qwen3", "flavor": "debug_moe_hf", "moe": moe}}))
    before = path.read_bytes()
    assert main(["check", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "Traceback" not in out.err
    assert re_search(match, out.err), out.err
    assert path.read_bytes() == before


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


@pytest.mark.parametrize(
    ("family", "flavor", "changes", "key"),
    [
        ("qwen3", "debug_moe_hf", {"routed_scaling_factor": 1.5}, "model.moe.routed_scaling_factor 1.5"),
        ("qwen3", "debug_moe_hf", {"capacity_factor": 1.25}, "model.moe.capacity_factor 1.25"),
        ("mixtral", "debug", {"n_group": 2, "topk_group": 1}, "model.moe.n_group 2 / topk_group 1"),
        ("mixtral", "debug", {"routed_scaling_factor": 2.0}, "model.moe.routed_scaling_factor 2.0"),
    ],
)
def test_export_refuses_what_transformers_cannot_express(tmp_path, family, flavor, changes, key):
    args = dataclasses.replace(FAMILIES[family].flavor_args(flavor), **changes)
    model = build_model(args, "cpu")
    with pytest.raises(ConfigError, match=rf"cannot express {key}"):
        save_hf(model.state_dict(), args, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_post_softmax_exports_as_renormalised_top_k(tmp_path):
    args = moe_args(pre_softmax=False, route_norm=False)
    save_hf(build_model(args, "cpu").state_dict(), args, tmp_path / "out")
    config = yaml.safe_load((tmp_path / "out" / "config.json").read_text())
    assert config["norm_topk_prob"] is True

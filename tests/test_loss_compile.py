"""The compiled cross-entropy of ``train.compile`` (train/loss.py) against the eager one, and who gets it.

Numbers: a 3-step run of the trainer with ``train.compile: true`` (compiled blocks and loss) logs the same losses,
validation loss included, as the eager run; the summed loss and the gradients of the logits (plain loss) or of the hidden states and the head
weight (chunked loss) agree with the eager path to float rounding, with label smoothing, ignored targets and
bf16 logits. Wiring: the trainer's loss is compiled exactly when its blocks are (``compiles``: train.compile
without tensor parallel).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_config
from llmtrain.config import config_from_dict
from llmtrain.config.schema import Config
from llmtrain.distributed.parallel_dims import ParallelDims
from llmtrain.distributed.parallelize import compiles
from llmtrain.train.loss import chunked_head_loss, cross_entropy_fn, token_cross_entropy
from llmtrain.train.step import TokenLoss
from llmtrain.train.trainer import Trainer


def _targets(n: int, vocab: int) -> torch.Tensor:
    labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1))
    labels[::7] = -100  # ignored positions (document ends, padding)
    return labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_compiled_cross_entropy_matches_eager(dtype, smoothing) -> None:
    gen = torch.Generator().manual_seed(0)
    base = (3 * torch.randn(4, 48, 301, generator=gen)).to(dtype)
    labels = _targets(4 * 48, 301).view(4, 48)
    results = []
    for compiled in (False, True):
        logits = base.clone().requires_grad_()
        loss = TokenLoss(smoothing, compiled=compiled)(logits, labels)
        loss.backward()
        assert loss.dtype == torch.float32 and logits.grad is not None and logits.grad.dtype == dtype
        results.append((loss.detach(), logits.grad.float()))
    (eager, g_eager), (comp, g_comp) = results
    compiled = cross_entropy_fn(True)
    assert compiled is not token_cross_entropy and compiled is cross_entropy_fn(True)  # one shared instance
    assert abs(comp.item() - eager.item()) <= 1e-5 * abs(eager.item())
    grad_tol = 1e-5 if dtype == torch.float32 else 1e-2  # fp32: summation order; bf16: one more rounding
    assert (g_comp - g_eager).abs().max().item() <= grad_tol * g_eager.abs().max().item()
    assert g_eager[labels == -100].abs().max().item() == 0.0  # ignored targets get no gradient either way
    assert g_comp[labels == -100].abs().max().item() == 0.0


def test_compiled_chunked_loss_matches_eager() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 257, bias=False)
    h0 = torch.randn(2, 40, 32)
    labels = _targets(80, 257).view(2, 40)
    results = []
    for compiled in (False, True):
        head.zero_grad()
        h = h0.clone().requires_grad_()
        loss = chunked_head_loss(h, head, labels, chunk_tokens=24, label_smoothing=0.05, compiled=compiled)
        loss.backward()
        assert h.grad is not None and head.weight.grad is not None
        results.append((loss.item(), h.grad.clone(), head.weight.grad.clone()))
    (l0, gh0, gw0), (l1, gh1, gw1) = results
    assert abs(l1 - l0) <= 1e-5 * abs(l0)
    assert torch.allclose(gh1, gh0, rtol=1e-5, atol=1e-7) and torch.allclose(gw1, gw0, rtol=1e-5, atol=1e-7)
    whole = TokenLoss(0.05)(head(h0), labels).item()  # the chunks sum to the plain loss
    assert abs(l1 - whole) <= 1e-5 * abs(whole)


def test_the_loss_is_compiled_exactly_when_the_blocks_are() -> None:
    cfg = Config()
    assert not compiles(cfg, ParallelDims.from_config(cfg.parallel, 1))
    cfg.train.compile = True
    assert compiles(cfg, ParallelDims.from_config(cfg.parallel, 1))
    cfg.parallel.tensor_parallel = 2  # TP runs eagerly (feasibility warning tp_compile), the loss too
    assert not compiles(cfg, ParallelDims.from_config(cfg.parallel, 2))


def test_trainer_compiled_matches_eager(tiny_corpus, tmp_path) -> None:
    logged = {}
    for compiled in (False, True):
        out = tmp_path / f"compile_{compiled}"
        raw = tiny_config(tiny_corpus, out, train={"max_steps": 3, "compile": compiled, "eval_steps": 3})
        trainer = Trainer(config_from_dict(raw))
        assert trainer.step_fn.loss_fn.compiled is compiled
        trainer.fit()
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        logged[compiled] = [
            (r["step"], r.get("loss"), r.get("val_loss")) for r in rows if "loss" in r or "val_loss" in r
        ]
    eager, comp = logged[False], logged[True]
    assert [s for s, _, _ in eager] == [s for s, _, _ in comp] and len(eager) >= 4  # 3 steps + a validation
    for (_, l0, v0), (_, l1, v1) in zip(eager, comp, strict=True):
        for a, b in ((l0, l1), (v0, v1)):
            assert (a is None) == (b is None) and (a is None or abs(a - b) <= 1e-5 * abs(a)), (eager, comp)

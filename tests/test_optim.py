"""The optimizer: grouping (no decay on norms/biases) and the update against torch.optim.AdamW."""

import pytest
import torch
from torch import nn

from llmtrain.config.schema import TrainConfig
from llmtrain.train.optim import build_optimizer, param_groups


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lin = nn.Linear(6, 5, bias=True)
        self.norm = nn.LayerNorm(5)

    def forward(self, x):
        return self.norm(self.lin(self.emb(x))).pow(2).sum()


def test_groups_exclude_norms_and_biases():
    m = Tiny()
    g = param_groups(m, 0.1)
    decayed = {id(p) for p in g[0]["params"]}
    assert decayed == {id(m.emb.weight), id(m.lin.weight)}
    assert g[0]["weight_decay"] == 0.1 and g[1]["weight_decay"] == 0.0
    assert {id(p) for p in g[1]["params"]} == {id(m.lin.bias), id(m.norm.weight), id(m.norm.bias)}


@pytest.mark.parametrize("impl", ["fused", "foreach", "single"])
def test_update_matches_reference_adamw(impl):
    torch.manual_seed(0)
    a = Tiny()
    b = Tiny()
    b.load_state_dict(a.state_dict())
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-7, optimizer_impl=impl)
    ours = build_optimizer(a, cfg)
    ref = torch.optim.AdamW(
        [
            {"params": [b.emb.weight, b.lin.weight], "weight_decay": 0.1},
            {"params": [b.lin.bias, b.norm.weight, b.norm.bias], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.8, 0.9),
        eps=1e-7,
        foreach=False,
    )
    x = torch.randint(0, 11, (4, 3))
    for _ in range(3):
        for m, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            m(x).backward()
            opt.step()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa - pb).abs().max().item() < 1e-6, (n, (pa - pb).abs().max().item())
    # and weight decay really acted on the matrices only: a norm weight has no decay term
    assert not torch.equal(a.emb.weight, Tiny().emb.weight)

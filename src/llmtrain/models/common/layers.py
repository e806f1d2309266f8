"""Small building blocks shared by every family: RMSNorm, the gated feed-forward and Baichuan's NormHead.

Parameter names follow torchtitan (``w1``/``w2``/``w3``, ``weight``) so tensor-parallel plans written as
"module path -> style" apply unchanged to every family; the Hugging Face names are mapped in each family's
``hf.py``. Fused layouts of some checkpoints (GLM-4's ``gate_up_proj``, Baichuan's ``W_pack``) are split in
those adapters rather than kept fused here, because a column-wise TP shard of a fused weight would cut across
the boundary of its parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32 then cast back (as HF does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
"""Gate activations: ``silu`` (SwiGLU), ``gelu`` (exact, erf) and ``gelu_tanh`` (the tanh approximation that
Hugging Face calls gelu_new / gelu_pytorch_tanh / gelu_fast)."""


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """``name`` (one of :data:`ACTIVATIONS`) applied to ``x``."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}; valid: {', '.join(ACTIVATIONS)}")


class FeedForward(nn.Module):
    """Gated MLP ``w2(act(w1 x) * w3 x)`` (SwiGLU with silu); w1 is the gate, w3 the up projection, w2 the down
    projection; ``bias`` puts a bias on all three (Llama's ``mlp_bias``)."""

    def __init__(self, dim: int, hidden_dim: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.act = act
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(activation(self.act, self.w1(x)) * self.w3(x))  # [B, T, dim]


class NormHead(nn.Linear):
    """Output projection whose rows are L2-normalised at every forward (Baichuan 2's NormHead).

    The stored weight stays unnormalised (so the optimizer sees the raw parameter, as in Baichuan's training
    code); a vocabulary-sharded (column-wise) TP shard normalises its own rows, which is exact.
    """

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, F.normalize(self.weight, dim=-1))  # [B, T, vocab]

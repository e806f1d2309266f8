"""The MoE router and the Switch/GShard balance loss (the routing steps of ``models/common/moe.py``'s docstring).

:class:`Router` scores the tokens over the experts and picks each token's top-k (softmax or sigmoid scores,
pre- or post-softmax top-k, DeepSeek-V3's group-limited choice and aux-loss-free selection bias, the routed
scaling factor, fp32 logits); :func:`load_balance_loss` is ``E * sum_i f_i * P_i``. Single-device code: the
MoE block (moe.py) decides the fractions' scope (micro-batch, global batch, context-parallel ranks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.models.common.args import TransformerArgs


class Router(nn.Module):
    """Linear scores over experts and the top-k choice (with the aux-loss-free selection bias)."""

    expert_bias: torch.Tensor  # [E] buffer, registered in __init__

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.score, self.route_norm = args.router_score, args.route_norm
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.routed_scaling_factor = args.routed_scaling_factor
        self.pre_softmax, self.fp32 = args.pre_softmax, args.router_fp32
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)

    def _choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores + expert_bias`` [N, E]; with groups, -inf outside each token's ``topk_group`` best groups
        (a group scores by the sum of its two best biased scores, as DeepSeek-V3's noaux_tc routing)."""
        biased = scores + self.expert_bias
        if self.n_group == 1:
            return biased
        grouped = biased.view(biased.shape[0], self.n_group, -1)  # [N, G, E / G]
        best = torch.topk(grouped.topk(2, dim=-1).values.sum(-1), self.topk_group, dim=-1).indices  # [N, g]
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)  # [N, G]
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(biased)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores [N, E] fp32, chosen experts [N, k], their weights [N, k] fp32) for tokens x [N, D]."""
        if self.fp32:  # fp32 input and weight: no 16-bit rounding of the logits
            with torch.autocast(x.device.type, enabled=False):
                logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        if self.score == "softmax" and not self.pre_softmax:  # top-k of the logits, softmax over the chosen
            chosen = torch.topk(self._choice_scores(logits), self.top_k, dim=-1).indices  # [N, k]
            weights = logits.gather(1, chosen).softmax(-1)
        else:
            chosen = torch.topk(self._choice_scores(scores), self.top_k, dim=-1).indices  # [N, k]
            weights = scores.gather(1, chosen)
            if self.route_norm:
                weights = weights / weights.sum(-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return scores, chosen, weights

    def init_buffers(self) -> None:
        self.expert_bias.zero_()


def load_balance_loss(
    scores: torch.Tensor,
    chosen: torch.Tensor,
    num_experts: int,
    fraction: torch.Tensor | None = None,
    context_parallel: Any = None,
) -> torch.Tensor:
    """Switch/GShard auxiliary loss ``E * sum_i f_i * P_i`` (1.0 when perfectly balanced).

    ``f_i``: fraction of the N*k assignments in ``chosen`` [N, k] that went to expert i (no gradient), or the
    given ``fraction`` [E] (the global-batch scope, and under context parallel); ``P_i``: mean over tokens of
    expert i's score, normalised per token to sum to 1 (``scores`` [N, E]). ``context_parallel``: the tokens
    are this rank's part of the micro-batch; ``P_i`` sums every CP rank's scores (the gradient reaching this
    rank's tokens only, ``ContextParallel.sum_keep_grad``) and divides by the whole micro-batch's tokens.
    """
    if fraction is None:
        counts = torch.bincount(chosen.flatten(), minlength=num_experts).to(scores.dtype)
        f = counts / chosen.numel()
    else:
        f = fraction.to(scores.dtype)
    normalised = scores / scores.sum(-1, keepdim=True)
    if context_parallel is None:
        p = normalised.mean(0)
    else:
        p = context_parallel.sum_keep_grad(normalised.sum(0)) / (scores.shape[0] * context_parallel.size)
    return num_experts * (f * p).sum()

"""Mixture-of-experts feed-forward: top-k router, grouped SwiGLU experts, shared experts, load balancing.

Single-device code, exact and simple; expert parallelism is applied from outside
(``distributed/expert_parallel.py`` hooks the ``experts`` module). One forward over ``N = B * T`` tokens::

    scores  = softmax | sigmoid(router.gate(x))                        [N, E] fp32
    chosen  = top_k(scores + expert_bias)                              [N, k]  (bias: selection only)
              with n_group > 1 among the experts of each token's topk_group best groups (DeepSeek-V3)
    weights = scores[chosen] (/ their sum when route_norm) x routed_scaling_factor      [N, k]
    sort the N*k (token, expert) assignments by expert (stable: token order within an expert), drop those
    past the expert's capacity, run each expert on its contiguous slice (GroupedExperts), scale by the
    weights and index_add back into [N, D]; add the shared experts' SwiGLU of every token (scaled per token by
    sigmoid(shared_gate(x)) with ``shared_expert_gate``, Qwen2-MoE's gated shared expert).

Load balancing, both optional:

* Auxiliary loss (Switch / GShard): ``aux = E * sum_i f_i * P_i`` with ``f_i`` the fraction of the N*k
  assignments that chose expert i (before capacity drops) and ``P_i`` the mean normalised score of expert i.
  It is computed per micro-batch, so data parallelism (which hands out whole micro-batches) is exact. Its
  gradient is attached to the block output by :class:`_AttachAux` (forward: identity; backward: adds
  ``aux_grad_scale * d aux``), so it flows through FSDP's per-block backward like the main loss; the trainer
  sets ``aux_grad_scale`` (``set_aux_grad_scale``) to ``coef x the micro-batch's share of the global batch``
  times its own loss multipliers. The value of the last forward is kept in ``last_aux`` for logging.
* Auxiliary-loss-free bias (DeepSeek-V3): ``router.expert_bias`` [E] is added to the scores for the top-k
  choice only; after each optimizer step ``update_expert_bias`` moves it by
  ``bias_update_rate * sign(mean_load - load)`` (loads summed over the step and, by the trainer, over the
  data-parallel ranks), outside autograd.

Tokens per expert of the last forward (``last_counts`` [E], before drops) are kept for logging and the bias.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.layers import FeedForward


def _local(w: torch.Tensor) -> torch.Tensor:
    """The local shard of an expert-parallel / tensor-parallel DTensor weight (autograd-aware); plain tensors
    unchanged."""
    return w.to_local() if hasattr(w, "to_local") else w


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs stored as stacked weights ``w1, w3 [E, H, D]`` and ``w2 [E, D, H]``.

    ``forward(x [M, D], counts [E])`` takes tokens already sorted by expert, ``counts[e]`` rows for expert e,
    and returns ``[M, D]`` in the same order. Under expert parallel the weights are DTensors sharded on dim 0
    and the hooks hand this module only the tokens of its local experts (``counts`` of length E / ep).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)  # [E_local, H, D], [E_local, D, H]
        outs = []
        for e, xe in enumerate(torch.split(x, counts.tolist())):  # xe [count_e, D]
            outs.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])  # [M, D]


class Router(nn.Module):
    """Linear scores over experts and the top-k choice (with the aux-loss-free selection bias)."""

    expert_bias: torch.Tensor  # [E] buffer, registered in __init__

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.score, self.route_norm = args.router_score, args.route_norm
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.routed_scaling_factor = args.routed_scaling_factor
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
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        chosen = torch.topk(self._choice_scores(scores), self.top_k, dim=-1).indices  # [N, k]
        weights = scores.gather(1, chosen)
        if self.route_norm:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return scores, chosen, weights

    def init_buffers(self) -> None:
        self.expert_bias.zero_()


def load_balance_loss(scores: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss ``E * sum_i f_i * P_i`` (1.0 when perfectly balanced).

    ``f_i``: fraction of the N*k assignments in ``chosen`` [N, k] that went to expert i (no gradient);
    ``P_i``: mean over tokens of expert i's score, normalised per token to sum to 1 (``scores`` [N, E]).
    """
    counts = torch.bincount(chosen.flatten(), minlength=num_experts).to(scores.dtype)
    f = counts / chosen.numel()
    p = (scores / scores.sum(-1, keepdim=True)).mean(0)
    return num_experts * (f * p).sum()


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float | None) -> int | None:
    """Slots per expert: ``ceil(factor * tokens * top_k / num_experts)``; None (no limit) without a factor."""
    return None if factor is None else math.ceil(factor * num_tokens * top_k / num_experts)


class _AttachAux(torch.autograd.Function):
    """Identity on ``y``; in backward also feeds ``scale`` as the gradient of the scalar ``aux``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class MoE(nn.Module):
    """The MoE feed-forward of one block (see the module docstring). Input/output ``[B, T, dim]``."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.aux_loss_coef, self.capacity_factor = args.aux_loss_coef, args.capacity_factor
        self.router = Router(args)
        self.experts = GroupedExperts(args.num_experts, args.hidden_size, args.moe_hidden_size)
        self.shared_experts: FeedForward | None = None
        if args.shared_experts > 0:
            self.shared_experts = FeedForward(args.hidden_size, args.shared_experts * args.moe_hidden_size)
        self.shared_gate: nn.Linear | None = None
        if args.shared_experts > 0 and args.shared_expert_gate:
            self.shared_gate = nn.Linear(args.hidden_size, 1, bias=False)
        self.aux_grad_scale = 0.0  # set by the trainer before each training forward
        self.last_aux: torch.Tensor | None = None  # detached aux loss of the last forward
        self.last_counts: torch.Tensor | None = None  # [E] assignments per expert of the last forward
        self.step_stats: tuple[torch.Tensor, torch.Tensor] | None = None  # pipeline: PipelineMoEStats sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_flat = x.reshape(-1, shape[-1])  # [N, D]
        n = x_flat.shape[0]
        scores, chosen, weights = self.router(x_flat)  # [N, E], [N, k], [N, k]
        flat_expert = chosen.flatten()  # [N*k], assignment a = token * k + slot
        counts = torch.bincount(flat_expert, minlength=self.num_experts)  # [E]
        order = torch.argsort(flat_expert, stable=True)  # assignments grouped by expert, token order inside
        capacity = expert_capacity(n, self.top_k, self.num_experts, self.capacity_factor)
        kept = counts
        if capacity is not None:
            starts = torch.cumsum(counts, 0) - counts  # [E] first sorted position of each expert
            position = torch.arange(order.numel(), device=x.device) - starts[flat_expert[order]]
            order = order[position < capacity]  # drop each expert's assignments past its capacity
            kept = counts.clamp(max=capacity)
        token = order // self.top_k  # [M]
        y = self.experts(x_flat[token], kept)  # [M, D]
        y = y * weights.flatten()[order, None].to(y.dtype)
        # summed in the input's dtype (fp32 residual stream under autocast, where y is bf16 / fp16)
        out = torch.zeros_like(x_flat).index_add_(0, token, y.to(x_flat.dtype))  # [N, D]
        if self.shared_experts is not None:
            shared = self.shared_experts(x_flat)  # [N, D]
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x_flat)) * shared  # [N, 1] gate per token
            out = out + shared
        self.last_counts = counts.detach()
        if self.aux_loss_coef > 0:
            aux = load_balance_loss(scores, chosen, self.num_experts)
            self.last_aux = aux.detach()
            if torch.is_grad_enabled() and self.aux_grad_scale:
                out = _AttachAux.apply(out, aux, self.aux_loss_coef * self.aux_grad_scale)
        return out.reshape(shape)


# ---------------------------------------------------------------- model-level helpers (used by the trainer)
def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE modules of ``model`` in block order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_grad_scale(model: nn.Module, scale: float) -> None:
    """d(loss being backpropagated) / d(aux loss) for the next forward, before ``aux_loss_coef``."""
    for m in moe_layers(model):
        m.aux_grad_scale = scale


def last_moe_stats(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over blocks of the last forward's aux loss, coef not applied; counts [num_moe_layers, E])."""
    layers = moe_layers(model)
    last_counts = []
    for m in layers:
        assert m.last_counts is not None, "last_moe_stats() is read after a forward"
        last_counts.append(m.last_counts)
    counts = torch.stack(last_counts).float()
    aux = sum((m.last_aux for m in layers if m.last_aux is not None), counts.new_zeros(()))
    return aux.float(), counts


@torch.no_grad()
def update_expert_bias(model: nn.Module, counts: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing: ``bias += rate * sign(mean_load - load)`` per block; counts [layers, E]."""
    for m, load in zip(moe_layers(model), counts):
        bias = m.router.expert_bias
        bias += rate * torch.sign(load.mean() - load).to(bias.device, bias.dtype)


class MoEStepStats:
    """The trainer's MoE bookkeeping over one optimizer step: aux-loss gradient scale, logged figures, bias.

    ``start(model, mb, loss_multiplier)`` before each micro-batch's forward (``loss_multiplier``: what the
    trainer multiplies the micro-batch's summed token loss by before backward, e.g. dp / global tokens x the
    fp16 loss scale); ``end(model)`` after it; ``finish(model, dp_sum, n_tokens)`` after the optimizer step
    returns ``moe_aux_loss`` (per block summed, token-weighted mean over the global batch's micro-batches) and
    ``moe_load_max_over_mean`` (worst block's max / mean tokens per expert), and applies the bias update.
    """

    def __init__(self, bias_update_rate: float) -> None:
        self.rate = bias_update_rate
        self.aux_sum: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.tokens = 0

    def start(self, model: nn.Module, mb: dict[str, torch.Tensor], loss_multiplier: float) -> None:
        self.tokens = int((mb["labels"] != -100).sum())
        set_aux_grad_scale(model, self.tokens * loss_multiplier)

    def end(self, model: nn.Module) -> None:
        aux, counts = last_moe_stats(model)
        aux = aux * self.tokens
        self.aux_sum = aux if self.aux_sum is None else self.aux_sum + aux
        self.counts = counts if self.counts is None else self.counts + counts

    def finish(self, model: nn.Module, dp_sum, n_tokens: int, update_bias: bool = True) -> dict:
        if self.counts is None:  # a pipeline step: the schedule ran the micro-batches (PipelineMoEStats)
            self.aux_sum, self.counts = PipelineMoEStats.take(model)
        if self.counts is None:
            return {}
        assert self.aux_sum is not None  # end() sets both
        aux = float(dp_sum(self.aux_sum.reshape(1).clone()).item()) / max(n_tokens, 1)
        counts = dp_sum(self.counts.clone())  # [layers, E], the same on every data-parallel rank
        if update_bias and self.rate > 0:
            update_expert_bias(model, counts, self.rate)
        balance = (counts.max(1).values / counts.mean(1).clamp(min=1e-9)).max().item()
        self.aux_sum, self.counts = None, None
        return {"moe_aux_loss": aux, "moe_load_max_over_mean": balance}


class PipelineMoEStats:
    """MoE bookkeeping of a pipeline rank, where torch's schedule runs the micro-batches (distributed/pipeline.py).

    A forward hook on each stage module records, after every training forward of a pipeline micro-batch, the
    aux loss and expert counts of its MoE blocks (a stage module's forward runs once per micro-batch; activation
    recompute re-runs blocks, not stage modules, so nothing is counted twice). ``before_step`` sets the aux-loss
    gradient scale (one value for every micro-batch of the step: the runner passes the mean tokens per pipeline
    micro-batch, exact when no label is ignored) and ``after_step`` keeps the step's last ``n_mb`` forwards
    (torch's metadata inference adds one forward on the first step) and leaves their sums on each MoE block for
    :meth:`MoEStepStats.finish`, which then logs and updates the bias as without a pipeline. Under PP the logged
    ``moe_*`` figures cover the logging rank's stage only.
    """

    def __init__(self, stage_modules: Sequence[nn.Module]) -> None:
        self._forwards: dict[int, list[tuple[torch.Tensor | None, torch.Tensor]]] = {}
        for stage in stage_modules:
            if moe_layers(stage):
                stage.register_forward_hook(self._record)

    def _record(self, stage: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not torch.is_grad_enabled():
            return
        for m in moe_layers(stage):
            if m.training and m.last_counts is not None:
                self._forwards.setdefault(id(m), []).append((m.last_aux, m.last_counts))

    def before_step(self, model: nn.Module, aux_grad_scale: float) -> None:
        """Before the schedule's step: ``aux_grad_scale`` is tokens per micro-batch x the loss multiplier."""
        self._forwards.clear()
        set_aux_grad_scale(model, aux_grad_scale)

    def after_step(self, model: nn.Module, n_mb: int, tokens_per_mb: float) -> None:
        """After the schedule's step: each MoE block of ``model`` gets (token-weighted aux sum, counts [E])."""
        for m in moe_layers(model):
            recorded = self._forwards.get(id(m), [])[-n_mb:]
            if recorded:
                aux = sum((a.float() for a, _ in recorded if a is not None), torch.zeros(()))
                counts = torch.stack([c for _, c in recorded]).sum(0).float()
                m.step_stats = (aux.to(counts.device) * tokens_per_mb, counts)
        self._forwards.clear()

    @staticmethod
    def take(model: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(aux sum, counts [blocks, E])`` that ``after_step`` left on ``model``'s MoE blocks (cleared), or
        ``(None, None)`` when there are none (no pipeline, or no MoE block on this stage)."""
        layers = moe_layers(model)
        stats = [m.step_stats for m in layers]
        for m in layers:
            m.step_stats = None
        if not layers or any(s is None for s in stats):
            return None, None
        kept = [s for s in stats if s is not None]
        return torch.stack([a for a, _ in kept]).sum(), torch.stack([c for _, c in kept])

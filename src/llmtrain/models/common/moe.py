"""Mixture-of-experts feed-forward: top-k router, grouped SwiGLU experts, shared experts, load balancing.

Single-device code, exact and simple; expert parallelism is applied from outside
(``distributed/expert_parallel.py`` hooks the ``experts`` module). One forward over ``N = B * T`` tokens::

    logits  = router.gate(x)        (router_fp32: fp32 input and weight, outside autocast)  [N, E] fp32
    scores  = softmax | sigmoid(logits)                                 [N, E] fp32
    chosen  = top_k(scores + expert_bias)                              [N, k]  (bias: selection only)
              with n_group > 1 among the experts of each token's topk_group best groups (DeepSeek-V3)
    weights = scores[chosen] (/ their sum when route_norm) x routed_scaling_factor      [N, k]
              pre_softmax false (softmax only): chosen = top_k(logits + bias), weights = softmax(logits[chosen])
              x routed_scaling_factor (Megatron's post-softmax top-k; they sum to 1 before the scaling)
    sort the N*k (token, expert) assignments by expert (stable: token order within an expert), drop those
    past the expert's capacity (drop_policy position: the last tokens; probs: the lowest weights), run each
    expert on its contiguous slice (GroupedExperts), scale by the weights and index_add back into [N, D]; add
    the shared experts' SwiGLU of every token (scaled per token by sigmoid(shared_gate(x)) with
    ``shared_expert_gate``, Qwen2-MoE's gated shared expert).

Load balancing, both optional:

* Auxiliary loss (Switch / GShard): ``aux = E * sum_i f_i * P_i`` with ``f_i`` the fraction of the N*k
  assignments that chose expert i (before capacity drops) and ``P_i`` the mean normalised score of expert i.
  With ``aux_loss_scope: micro_batch`` it is computed per micro-batch, so data parallelism (which hands out
  whole micro-batches) is exact. With ``global_batch`` (MindFormers' gbs_aux_loss) ``f_i`` counts the
  assignments of every data-parallel rank and of the step's micro-batches up to this one: each forward
  all-reduces its counts [E] over the ranks the router's weight is data-parallel over (its DTensor mesh,
  :func:`resolve_balance_groups`; tensor-parallel ranks see the same tokens, which leaves the fractions
  unchanged) and adds them to a running sum that :class:`MoEStepStats` / :class:`PipelineMoEStats` reset
  each step; ``P_i`` stays the micro-batch's own. An activation-recompute re-run of the forward (inside
  backward) takes the fractions its first run used, in order, without communicating. Its gradient is
  attached to the block output by :class:`_AttachAux` (forward: identity; backward: adds
  ``aux_grad_scale * d aux``), so it flows through FSDP's per-block backward like the main loss; the trainer
  sets ``aux_grad_scale`` (``set_aux_grad_scale``) to ``coef x the micro-batch's share of the global batch``
  times its own loss multipliers. The value of the last forward is kept in ``last_aux`` for logging.
* Auxiliary-loss-free bias (DeepSeek-V3): ``router.expert_bias`` [E] is added to the scores for the top-k
  choice only; after each optimizer step ``update_expert_bias`` moves it by
  ``bias_update_rate * sign(mean_load - load)`` (loads summed over the step and, by the trainer, over the
  data-parallel ranks), outside autograd.

Tokens per expert of the last forward (``last_counts`` [E], before drops) are kept for logging and the bias.

Context parallel (``context_parallel``, set by distributed/context_parallel.py): the block sees this rank's
sequence chunks of the micro-batch. Routing is per token, so the routed output needs nothing; what is defined
over the micro-batch is made whole-micro-batch: the counts [E] are all-reduced over CP (``last_counts``, hence
the logged load figure and the aux-free bias loads, are the micro-batch's); the aux loss takes ``f_i`` from
those counts and ``P_i`` from the CP-summed score sums over the whole micro-batch's tokens, the sum's backward
passing the gradient to this rank's scores unchanged (the aux value is the same on every CP rank, each rank's
backward gives its tokens' share of the gradient, and the trainer's ``aux_grad_scale`` carries the x cp that
FSDP's average over ``dp x cp`` removes, as for the token loss); a capacity counts the whole micro-batch's
tokens and the drops are decided on every CP rank's choices gathered in sequence order, as one process
decides them (``_cp_kept``). With ``global_batch`` the balance groups already include the CP ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.layers import FeedForward
from llmtrain.models.common.router import Router, load_balance_loss


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


def _in_backward() -> bool:
    """True while the autograd engine runs (an activation-recompute re-run of a forward)."""
    return torch._C._current_graph_task_id() != -1


def kept_assignments(
    flat_expert: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, capacity: int, policy: str
) -> torch.Tensor:
    """Indices of the kept assignments [M], grouped by expert in token order, at most ``capacity`` per expert.

    ``flat_expert`` [N*k] (assignment a = token * k + slot), ``weights`` [N*k], ``counts`` [E]. ``position``
    keeps each expert's first ``capacity`` assignments in token order; ``probs`` its ``capacity`` highest
    weights (ties: the earlier token)."""
    order = torch.argsort(flat_expert, stable=True)  # by expert, token order inside
    starts = torch.cumsum(counts, 0) - counts  # [E] first sorted position of each expert
    if policy == "position":
        position = torch.arange(order.numel(), device=order.device) - starts[flat_expert[order]]
        return order[position < capacity]
    by_weight = torch.argsort(-weights.detach(), stable=True)  # highest weight first, earlier token on ties
    ranked = by_weight[torch.argsort(flat_expert[by_weight], stable=True)]  # by expert, weight order inside
    rank = torch.arange(ranked.numel(), device=ranked.device) - starts[flat_expert[ranked]]
    keep = torch.zeros_like(flat_expert, dtype=torch.bool)
    keep[ranked[rank < capacity]] = True
    return order[keep[order]]


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
        self.aux_loss_scope, self.drop_policy = args.aux_loss_scope, args.drop_policy
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
        # global-batch aux loss: the groups to sum counts over (None: not resolved yet), the step's running
        # sum of counts [E] and the fractions each first forward used, for recompute re-runs (in order)
        self.balance_groups: list | None = None
        self.balance_sum: torch.Tensor | None = None
        self.balance_used: list[tuple[torch.Tensor, torch.Tensor]] = []  # (local counts [E], fraction [E])
        # context parallel (distributed/context_parallel.py sets it): x holds this rank's sequence chunks
        self.context_parallel: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_flat = x.reshape(-1, shape[-1])  # [N, D]
        n = x_flat.shape[0]
        scores, chosen, weights = self.router(x_flat)  # [N, E], [N, k], [N, k]
        flat_expert = chosen.flatten()  # [N*k], assignment a = token * k + slot
        counts = torch.bincount(flat_expert, minlength=self.num_experts)  # [E]
        cp = self.context_parallel
        mb_counts = counts if cp is None else self._cp_counts(counts)  # [E] of the whole micro-batch
        order = torch.argsort(flat_expert, stable=True)  # assignments grouped by expert, token order inside
        mb_tokens = n if cp is None else n * cp.size
        capacity = expert_capacity(mb_tokens, self.top_k, self.num_experts, self.capacity_factor)
        kept = counts
        if capacity is not None and cp is not None:  # drops decided on the whole micro-batch (CP ranks)
            order = self._cp_kept(flat_expert, weights, mb_counts, capacity, shape)
            kept = torch.bincount(flat_expert[order], minlength=self.num_experts)
        elif capacity is not None:  # drop each expert's assignments past its capacity (drop_policy)
            order = kept_assignments(flat_expert, weights.flatten(), counts, capacity, self.drop_policy)
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
        self.last_counts = mb_counts.detach()
        if self.aux_loss_coef > 0:
            fraction = None
            if self.aux_loss_scope == "global_batch" and self.training and torch.is_grad_enabled():
                fraction = self._global_fraction(counts)
            elif cp is not None:  # f over the whole micro-batch
                fraction = mb_counts.float() / mb_counts.sum().clamp(min=1).float()
            aux = load_balance_loss(scores, chosen, self.num_experts, fraction, cp)
            self.last_aux = aux.detach()
            if torch.is_grad_enabled() and self.aux_grad_scale:
                out = _AttachAux.apply(out, aux, self.aux_loss_coef * self.aux_grad_scale)
        return out.reshape(shape)

    @torch.compiler.disable
    def _cp_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Context parallel: the micro-batch's assignments per expert [E], this rank's summed over CP."""
        return self.context_parallel.sum_(counts.clone())

    @torch.compiler.disable
    def _cp_kept(
        self, flat_expert: torch.Tensor, weights: torch.Tensor, mb_counts: torch.Tensor, capacity: int,
        shape: torch.Size,
    ) -> torch.Tensor:  # fmt: skip
        """Context parallel with a capacity: this rank's kept assignments (grouped by expert, token order
        inside), the drops decided as one process decides them: every CP rank's choices (and weights, for
        ``drop_policy: probs``) all-gathered in sequence order, :func:`kept_assignments` on the whole
        micro-batch, this rank's positions kept."""
        cp, k = self.context_parallel, self.top_k
        bsz, t = shape[0], shape[1]
        experts = cp.sequence(flat_expert.view(bsz, t, k))  # [B, T, k]
        mb_weights = cp.sequence(weights.view(bsz, t, k))
        kept = kept_assignments(
            experts.flatten(), mb_weights.flatten(), mb_counts, capacity, self.drop_policy
        )
        keep = torch.zeros(experts.numel(), dtype=torch.bool, device=flat_expert.device)
        keep[kept] = True
        local = cp.local_part(keep.view(experts.shape)).flatten()  # [N * k] this rank's assignments
        order = torch.argsort(flat_expert, stable=True)
        return order[local[order]]

    @torch.compiler.disable
    def _global_fraction(self, counts: torch.Tensor) -> torch.Tensor:
        """f [E] of the global-batch scope (module docstring): this forward's counts summed over the balance
        groups, added to the step's running sum, normalised; a recompute re-run returns its first run's (the
        oldest kept one with the same local counts: a re-run that stopped early, before this point, leaves its
        entry behind, which the next re-run passes over)."""
        if _in_backward():
            while self.balance_used:
                local, fraction = self.balance_used.pop(0)
                if torch.equal(local, counts):
                    return fraction
            local = counts.detach().float()  # nothing kept (not expected): no communication inside backward
            return local / local.sum().clamp(min=1.0)
        summed = counts.detach().float()
        for group in self.balance_groups or []:
            dist.all_reduce(summed, group=group)
        self.balance_sum = summed if self.balance_sum is None else self.balance_sum + summed
        fraction = self.balance_sum / self.balance_sum.sum().clamp(min=1.0)
        self.balance_used.append((counts.detach().clone(), fraction))
        return fraction

    def reset_balance(self) -> None:
        """Start a new step of the global-batch scope (no running sum, no kept fractions)."""
        self.balance_sum, self.balance_used = None, []


# ---------------------------------------------------------------- model-level helpers (used by the trainer)
def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE modules of ``model`` in block order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def resolve_balance_groups(model: nn.Module) -> None:
    """For the global-batch aux loss: the process groups over which each MoE block's counts are summed, once.

    They are the mesh dimensions of the router weight's DTensor (FSDP's data-parallel mesh: dp_replicate x
    dp_shard, or dp_shard x cp; with TP also the tp dimension, whose ranks route the same tokens, which scales
    every count alike and leaves the fractions unchanged). Called between steps, while FSDP holds the sharded
    DTensor; a plain weight (one data-parallel rank) sums nothing."""
    for m in moe_layers(model):
        if m.aux_loss_scope != "global_batch" or m.balance_groups is not None:
            continue
        weight = m.router.gate.weight
        mesh = getattr(weight, "device_mesh", None)
        m.balance_groups = (
            [mesh.get_group(i) for i in range(mesh.ndim) if mesh.size(i) > 1] if mesh is not None else []
        )


def reset_balance(model: nn.Module) -> None:
    """End of a step: the global-batch aux loss starts its running counts again."""
    for m in moe_layers(model):
        m.reset_balance()


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
        resolve_balance_groups(model)

    def end(self, model: nn.Module) -> None:
        aux, counts = last_moe_stats(model)
        aux = aux * self.tokens
        self.aux_sum = aux if self.aux_sum is None else self.aux_sum + aux
        self.counts = counts if self.counts is None else self.counts + counts

    def finish(self, model: nn.Module, dp_sum, n_tokens: int, update_bias: bool = True) -> dict:
        reset_balance(model)
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


def _cp_total(model: nn.Module, value: float) -> float:
    """``value`` summed over the CP group of ``model``'s MoE blocks (unchanged without context parallel): a
    pipeline rank under CP counts the tokens of its own sequence chunks, the aux loss weighs whole
    micro-batches'."""
    layers = moe_layers(model)
    cp = layers[0].context_parallel if layers else None
    if cp is None:
        return value
    total = torch.tensor([value], dtype=torch.float64, device=layers[0].router.expert_bias.device)
    return float(cp.sum_(total).item())


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
        """Before the schedule's step: ``aux_grad_scale`` is tokens per micro-batch x the loss multiplier (under
        context parallel the runner counts this rank's chunks: summed over CP here, :func:`_cp_total`)."""
        self._forwards.clear()
        set_aux_grad_scale(model, _cp_total(model, aux_grad_scale))
        resolve_balance_groups(model)
        reset_balance(model)

    def after_step(self, model: nn.Module, n_mb: int, tokens_per_mb: float) -> None:
        """After the schedule's step: each MoE block of ``model`` gets (token-weighted aux sum, counts [E]); a
        second schedule run before :meth:`take` (replica groups' ``keep``: one run per slot) adds to them."""
        tokens_per_mb = _cp_total(model, tokens_per_mb)
        for m in moe_layers(model):
            recorded = self._forwards.get(id(m), [])[-n_mb:]
            if recorded:
                aux = sum((a.float() for a, _ in recorded if a is not None), torch.zeros(()))
                counts = torch.stack([c for _, c in recorded]).sum(0).float()
                stats = (aux.to(counts.device) * tokens_per_mb, counts)
                prev = m.step_stats
                m.step_stats = stats if prev is None else (prev[0] + stats[0], prev[1] + stats[1])
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

"""Context parallel (CP): the sequence split over the ``cp`` mesh dim, keys/values all-gathered in attention.

The Llama 3 approach (docs/parallelism.md, "Context parallel", compares it with a ring): every rank keeps the
queries of its own part of each sequence and all-gathers the keys and values of the whole sequence inside
each attention layer, so any mask works (causal, packed-document, sliding window, ALiBi), built once per batch
from *global* positions and document ids.

* **Load-balanced split**: each sequence of length ``T`` is cut into ``2 x cp`` chunks; CP rank ``r`` holds
  chunks ``r`` and ``2 cp - 1 - r``, so under a causal mask every rank does the same attention work
  (:func:`local_index`). The all-gather concatenates the ranks' parts in rank order, so the gathered keys are
  *not* in sequence order: the mask is built from the gathered order's global positions
  (:func:`key_index`), and since softmax does not care about the order of the keys the output is exactly the
  one-process output.
* **Autograd**: :class:`_GatherSeq` all-gathers in forward and reduce-scatters the key/value gradients in
  backward (every rank's queries contributed to every key's gradient).
* **RoPE / positions**: the model gets this rank's slice of the global ``position_ids`` (the packed batch's
  per-document ones, or ``arange(T)``); ``Attention.context_parallel`` (models/common/attention.py) swaps in the
  gathered keys/values, and ``Transformer.forward`` hands every layer :meth:`ContextParallel.masks` in place
  of its own.
* **One additive mask per micro-batch**: SDPA would convert the boolean mask into an additive one in every
  layer and autograd would save each copy (``Tq x Tk`` elements a layer: 256 MiB in bf16 at seq 16k, cp 2).
  :meth:`ContextParallel.masks` converts it once, in the queries' dtype, and all layers pass that tensor, so
  autograd saves it once. ``shard`` runs outside autocast (train/step.py), where that dtype is not known yet,
  so it keeps only the boolean masks; ``Transformer.forward``, which knows the dtype (autocast's or the hidden
  states'), calls ``masks(dtype)`` once before the layers. That builds a fresh tensor and mutates nothing, so
  no state changes inside the blocks (compiled or not), and activation recompute replays the same tensor (a
  block's argument).
* **Loss**: each rank sums the token losses of its own tokens; the step divides by the global token count
  (counted on the unsplit batch, summed over data parallel) and sums the reported loss over CP too
  (train/step.py).
* **Gradients**: parameters are replicated over CP; FSDP2 shards them over the flattened ``dp_shard x cp``
  mesh (torchtitan's choice: CP ranks become extra shard ranks, so no separate all-reduce and ZeRO memory
  shrinks with cp; HSDP and ZeRO 0 use ``(dp_replicate, dp_shard x cp)``: distributed/parallelize.py), and
  FSDP's gradient average over ``dp x cp`` ranks is undone by ``grad_scale x cp``.

* **Pipeline parallel**: the runner (distributed/pipeline.py) feeds the stages this rank's chunks
  (:meth:`ContextParallel.local`), and :meth:`ContextParallel.stage_pre_hook`, a forward pre-hook of each stage
  module, builds the masks of the pipeline micro-batch about to run from its keyword arguments (local
  ``position_ids``, global ``document_ids``): the schedule runs micro-batches in its own order, so the masks
  cannot be built once per batch as ``shard`` does.

The object is attached to the model by :func:`apply_cp` (``model.context_parallel``) and found by the train
step with :func:`find`. It holds the current micro-batch's boolean masks from ``shard`` on; the additive mask
lives in that micro-batch's autograd graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.models.common.attention import Attention, AttentionMask, with_additive


class _GatherSeq(torch.autograd.Function):
    """All-gather along ``dim`` over ``group`` (rank order); backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        n = dist.get_world_size(group)
        xs = x.movedim(dim, 0).contiguous()
        out = torch.empty((n * xs.shape[0], *xs.shape[1:]), dtype=xs.dtype, device=xs.device)
        dist.all_gather_into_tensor(out, xs, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        n = dist.get_world_size(ctx.group)
        g = grad.movedim(ctx.dim, 0).contiguous()
        out = torch.empty((g.shape[0] // n, *g.shape[1:]), dtype=g.dtype, device=g.device)
        dist.reduce_scatter_tensor(out, g, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


class _SumKeepGrad(torch.autograd.Function):
    """All-reduce (sum) over ``group`` in forward; backward passes the gradient through unchanged (each rank's
    summand gets the gradient of the replicated result it helped form: the per-rank gradients are summed later,
    by FSDP over the CP ranks, so an all-reduce here would count them ``cp`` times)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def gather_seq(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along ``dim`` (autograd-correct)."""
    return _GatherSeq.apply(x, group, dim)


def local_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by CP rank ``rank``: chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``."""
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def key_index(seq_len: int, cp: int) -> torch.Tensor:
    """Global positions of the all-gathered keys: every rank's :func:`local_index`, in rank order."""
    return torch.cat([local_index(seq_len, cp, r) for r in range(cp)])


class ContextParallel:
    """One model's CP state: its group, the split, and the current batch's masks."""

    def __init__(self, group: Any, size: int, rank: int, alibi: bool, window: int) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.alibi, self.window = alibi, window
        self._mask: AttentionMask | None = None

    def shard(self, mb: dict[str, torch.Tensor], document_mask: bool) -> dict[str, torch.Tensor]:
        """This rank's part of a micro-batch ``{input_ids, labels, position_ids[, document_ids]}`` [B, T]:
        ``input_ids``, ``labels`` and global ``position_ids`` of the local chunks; builds the masks of the local
        queries against all keys (document ids only with ``document_mask``)."""
        ids = mb["input_ids"]
        self.set_masks(ids.shape[1], mb["document_ids"] if document_mask else None, ids.device)
        return self.local(mb, document_mask)

    def local(self, mb: dict[str, torch.Tensor], document_mask: bool) -> dict[str, torch.Tensor]:
        """``input_ids``, ``labels`` and global ``position_ids`` of this rank's chunks of ``mb`` [B, T] (the
        packed batch's per-document positions with ``document_mask``, else ``arange(T)``); no masks."""
        ids = mb["input_ids"]
        bsz, seq = ids.shape
        q_idx = local_index(seq, self.size, self.rank).to(ids.device)
        if document_mask:
            positions = mb["position_ids"]
        else:
            positions = torch.arange(seq, device=ids.device)[None].expand(bsz, seq)
        return {
            "input_ids": ids[:, q_idx],
            "labels": mb["labels"][:, q_idx],
            "position_ids": positions[:, q_idx],
        }

    def set_masks(self, seq: int, document_ids: torch.Tensor | None, device: torch.device) -> None:
        """Build the boolean masks of this rank's queries against all keys of sequences of length ``seq``
        (``document_ids`` [B, T], global: also across packed documents); what :meth:`masks` hands out next."""
        q_idx = local_index(seq, self.size, self.rank).to(device)
        k_idx = key_index(seq, self.size).to(device)
        causal = k_idx[None, :] <= q_idx[:, None]  # [Tq, Tk]
        allowed = causal[None, None]  # [1, 1, Tq, Tk]
        if document_ids is not None:
            doc = document_ids
            same = doc[:, q_idx][:, :, None] == doc[:, k_idx][:, None, :]  # [B, Tq, Tk]
            allowed = (same & causal[None])[:, None]  # [B, 1, Tq, Tk]
        rel = (k_idx[None, :] - q_idx[:, None]).float() if self.alibi else None
        self._mask = AttentionMask(is_causal=False, allowed=allowed, rel_pos=rel)
        if 0 < self.window < seq:
            band = (k_idx[None, :] > q_idx[:, None] - self.window)[None, None]
            self._mask.sliding = AttentionMask(is_causal=False, allowed=allowed & band, rel_pos=rel)

    def stage_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of a pipeline stage module (distributed/pipeline.py): the masks of the pipeline
        micro-batch about to run, from its keyword arguments as the schedule split them: ``position_ids``
        [b, T / cp] (this rank's, so ``T`` is their length x cp) and, with document masks, the global
        ``document_ids`` [b, T]. Each stage forward of each micro-batch gets its own; backward needs none (the
        additive mask lives in the micro-batch's autograd graph)."""
        positions = kwargs["position_ids"]
        self.set_masks(positions.shape[-1] * self.size, kwargs.get("document_ids"), positions.device)

    def release(self) -> None:
        """Forget the current micro-batch's masks (the next ``shard`` builds new ones)."""
        self._mask = None

    def mask(self, sliding: bool) -> AttentionMask:
        """The current batch's boolean mask of local queries vs gathered keys (the windowed one for sliding
        layers)."""
        assert self._mask is not None, "ContextParallel.shard builds the masks first"
        return self._mask.sliding if sliding and self._mask.sliding is not None else self._mask

    def masks(self, dtype: torch.dtype | None) -> AttentionMask:
        """What every layer of the current micro-batch's forward gets: the boolean masks (sliding twin under
        ``.sliding``) with their additive mask in ``dtype``, the queries' (none with ALiBi; see the module
        docstring). A new object each call; the stored boolean masks are not touched."""
        full, sliding = self.mask(False), self.mask(True)
        mask = AttentionMask(is_causal=False, allowed=full.allowed, rel_pos=full.rel_pos)
        if sliding is not full:
            mask.sliding = AttentionMask(is_causal=False, allowed=sliding.allowed, rel_pos=sliding.rel_pos)
        return with_additive(mask, dtype)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, heads, T / cp, hd]`` of every CP rank: ``[B, heads, T, hd]`` (gathered order)."""
        return gather_seq(k, self.group, 2), gather_seq(v, self.group, 2)

    def gather_latent(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's compressed keys/values of every CP rank (models/common/mla.py): ``latent`` [B, T / cp, r] and
        the rotary key ``k_rope`` [B, T / cp, 1, rope] (already rotated at this rank's global positions) ->
        [B, T, r], [B, T, 1, rope] in the gathered order; one all-gather when both have one dtype."""
        bsz, t, r = latent.shape
        if latent.dtype != k_rope.dtype:
            return gather_seq(latent, self.group, 1), gather_seq(k_rope, self.group, 1)
        both = gather_seq(torch.cat((latent, k_rope.reshape(bsz, t, -1)), dim=-1), self.group, 1)
        latent_all, rope_all = both.split([r, both.shape[-1] - r], dim=-1)
        return latent_all, rope_all.reshape(bsz, both.shape[1], 1, -1)

    def sum_keep_grad(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the CP group (a new tensor), the gradient passed through to this rank's ``t``
        (:class:`_SumKeepGrad`): a micro-batch statistic built from every rank's tokens, e.g. the MoE aux
        loss's mean scores (models/common/moe.py)."""
        return _SumKeepGrad.apply(t, self.group)

    def sequence(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``x`` [B, T / cp, ...] of every CP rank, in sequence order: [B, T, ...] (no autograd)."""
        bsz, t = x.shape[:2]
        xs = x.detach().transpose(0, 1).contiguous()  # [T / cp, B, ...]: rank-major along dim 0
        out = xs.new_empty((self.size * t, *xs.shape[1:]))
        dist.all_gather_into_tensor(out, xs, group=self.group)
        order = torch.argsort(key_index(self.size * t, self.size)).to(x.device)  # sequence pos -> gathered
        return out[order].transpose(0, 1)

    def local_part(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's positions of ``x`` [B, T, ...] (sequence order): [B, T / cp, ...]."""
        return x[:, local_index(x.shape[1], self.size, self.rank).to(x.device)]

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) ``t`` in place over the CP group; returns it."""
        dist.all_reduce(t, group=self.group)
        return t


def apply_cp(model: nn.Module, cp_mesh: Any) -> ContextParallel:
    """Attach a :class:`ContextParallel` over ``cp_mesh`` to the model, every attention layer (standard and
    multi-head latent) and every MoE block (its micro-batch statistics span the CP ranks)."""
    from llmtrain.models.common.mla import MultiHeadLatentAttention
    from llmtrain.models.common.moe import MoE

    args: Any = getattr(model, "args")  # noqa: B009  (a Transformer's TransformerArgs)
    cp = ContextParallel(
        cp_mesh.get_group(),
        cp_mesh.size(),
        cp_mesh.get_local_rank(),
        alibi=args.position_embedding == "alibi",
        window=args.sliding_window or 0,
    )
    for module in model.modules():
        if isinstance(module, (Attention, MultiHeadLatentAttention, MoE)):
            module.context_parallel = cp
    model.context_parallel = cp  # type: ignore[assignment]
    return cp


def find(model: nn.Module) -> ContextParallel | None:
    """The model's :class:`ContextParallel` (None without context parallel)."""
    cp = getattr(model, "context_parallel", None)
    return cp if isinstance(cp, ContextParallel) else None

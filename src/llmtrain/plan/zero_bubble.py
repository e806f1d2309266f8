"""What torch's interleaved zero-bubble schedule (``schedule: zero_bubble``) keeps per pipeline rank, played op by
op in torch's own order.

The schedule splits each chunk's backward into an input-gradient step (I) and a later weight-gradient step
(W). ``stage_backward_input`` runs I with ``retain_graph=True`` and keeps, until W, the micro-batch's whole graph
(its saved activations) and the gradient flowing into every node where a weight's path leaves the input's: each
linear layer's and each norm's output gradient; on the head chunk that is the logits' gradient, beside the
logits torch pipelining keeps and the loss's saved fp32 log-softmax. W is delayed by the rank's index, so the
last rank holds up to ``min(pp, M)`` head micro-batches at once. Measured on CPU (``tests/test_plan_measured.py``,
pipeline 2 x 2 chunks, 2 micro-batches): against interleaved 1F1B on the same run, pipeline rank 0 +1.2 MB and
rank 1 (the head) +7.8 MB.

:func:`order` asks torch for the per-rank order (``ScheduleInterleavedZeroBubble``'s own generator, run on the
four numbers it reads); :func:`retained` plays it: the bytes held just before the worst input step (where the
loss's peak and the block's backward temporaries add on top) and the most held at any other moment.
"""

from __future__ import annotations

from functools import lru_cache

from llmtrain.models import TransformerArgs
from llmtrain.plan.activations import proj_widths
from llmtrain.plan.layout import Layout, RankShape
from llmtrain.plan.long_context import head_vocab

Action = tuple[str, int, int]  # (F | I | W | B: a whole backward, global stage index, micro-batch)


@lru_cache(maxsize=64)  # every pipeline rank of a plan asks for the same order
def order(pp: int, v: int, m: int) -> dict[int, list[Action]] | None:
    """Each rank's (kind, stage, micro-batch) actions as torch orders them; None when this torch's generator is
    not the one read here (a private method: the memory then falls back to interleaved 1F1B's count)."""
    try:
        from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

        sched = object.__new__(ScheduleInterleavedZeroBubble)
        sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, v, m
        sched.number_of_rounds = max(1, m // pp)
        sched.microbatches_per_round = m // sched.number_of_rounds
        kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
        out: dict[int, list[Action]] = {}
        for rank in range(pp):
            acts = [a for a in sched._calculate_single_rank_operations(rank) if a is not None]
            out[rank] = [
                (kinds[a.computation_type.name], a.stage_index, int(a.microbatch_index or 0)) for a in acts
            ]
        return out
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def intermediate_bytes(args: TransformerArgs, lay: Layout, moe: bool) -> float:
    """Bytes per token of one block's output gradients kept from I to W: q, k, v, the attention output projection,
    the MLP's (dense: w1, w3, w2; MoE: router scores, the routed rows' w1, w3, w2, the shared experts) and the two
    norms, at the activation dtype, per TP shard."""
    h, a = args.hidden_size, lay.act_bytes
    qkv, _ = proj_widths(args)
    if moe:
        k, hm, s = args.top_k, args.moe_hidden_size, args.shared_experts
        mlp = args.num_experts + k * (2 * hm + h) * lay.expert_rows_share + (2 * s * hm + h if s else 0.0)
    else:
        mlp = 2 * args.intermediate_size + h
    return a * (qkv + h + mlp + 2 * h) / lay.tp


def retained(
    args: TransformerArgs, lay: Layout, shape: RankShape, per_layer: float, boundary: float
) -> tuple[float, float] | None:
    """(held just before the worst I step, most held at any other moment) on ``shape``'s rank: every chunk
    micro-batch forwarded and not yet through W keeps its layers' saved bytes (``per_layer`` each) and its stage
    output (``boundary``); from I to W also its output gradients, and on the head chunk the logits, the loss's
    saved log-softmax and the logits' gradient (the micro-batch in its own I is the loss's peak, counted apart).
    None without torch's order."""
    plan = order(lay.pp, lay.chunks_per_rank, lay.grad_accum)
    if plan is None:
        return None
    tokens = lay.micro_batch_size * lay.seq_length / lay.cp
    moe_frac = shape.moe_layers / max(shape.layers, 1)
    inter = tokens * (
        (1 - moe_frac) * intermediate_bytes(args, lay, False) + moe_frac * intermediate_bytes(args, lay, True)
    )
    head_stage = lay.pp * lay.chunks_per_rank - 1
    head = tokens * (head_vocab(args, lay) * (2 * lay.act_bytes + 4) + lay.act_bytes * args.hidden_size)
    size = {shape.rank + i * lay.pp: n for i, n in enumerate(shape.chunk_sizes)}
    held: dict[tuple[int, int], float] = {}
    before_input, other = 0.0, 0.0
    for kind, stage, mb in plan[shape.rank]:
        now = sum(held.values())
        if kind in ("I", "B"):
            before_input = max(before_input, now)
            if kind == "B":
                held.pop((stage, mb))
            else:
                held[(stage, mb)] += size[stage] * inter + (head if stage == head_stage else 0.0)
        else:
            other = max(other, now)
            if kind == "F":
                held[(stage, mb)] = size[stage] * per_layer + boundary
            else:
                held.pop((stage, mb))
    return before_input, other


__all__ = ["intermediate_bytes", "order", "retained"]

"""Activation bytes of the memory model: per token of one block, the blocks in flight per pipeline schedule, and
the backward's temporaries (plan/memory.py itemises them; docs/planner.md "Memory model" gives the formulas).

Bytes per token of one block without recompute (``layer_activation_bytes``), with selective activation
checkpointing (``sac_op_bytes``), the block input a recomputed block keeps (``block_input_bytes``), the layer
total with recompute (``layer_bytes``), the micro-batches a pipeline rank holds (``in_flight``, and per layer
over unequal chunks ``in_flight_layers``), and the gradients a block's backward holds beside its saved tensors
(``backward_temporary_bytes``).
"""

from __future__ import annotations

from llmtrain.feasibility import V_SCHEDULES
from llmtrain.models import TransformerArgs
from llmtrain.plan.layout import MASTER_BYTES, Layout
from llmtrain.plan.long_context import cp_layer_bytes


def proj_widths(args: TransformerArgs) -> tuple[float, float]:
    """(q + 2 kv, o): output widths of the attention projections whose results are saved."""
    heads = args.num_heads
    if getattr(args, "kv_lora_rank", 0):  # MLA: keys/values expanded per head, widths as in the FLOP count
        width = args._attention_width()
        return 3 * heads * width, heads * args.v_head_dim
    return (heads + 2 * args.num_kv_heads) * args.head_dim, heads * args.head_dim


def _mla_attention_bytes(args: TransformerArgs, lay: Layout) -> float:
    """This trainer's MLA attention per token (models/common/mla.py), counted with saved-tensor hooks on CPU:
    SDPA keeps q, k, v and its output at one head width ``W = max(nope + rope, v)`` (the narrower side is
    zero-padded so the fused kernel serves it) and the logsumexp; ``wo`` keeps the output cut back to ``v``
    (a copy when ``v < W``); each latent norm (query ``q_lora_rank`` when set, key/value ``kv_lora_rank``) its
    fp32 input and rstd, and its output twice at the activation dtype (the norm's and its projection's
    input); the latents are whole on every TP rank."""
    a, t, heads = lay.act_bytes, lay.tp, args.num_heads
    qk, v = args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    width = max(qk, v)
    sdpa = (a * heads * (4 * width + (v if v < qk else 0)) + 4 * heads) / t
    latents = [r for r in (args.q_lora_rank, args.kv_lora_rank) if r]
    return sdpa + sum(4 * r + 4 + 2 * a * r for r in latents)


def layer_activation_bytes(args: TransformerArgs, lay: Layout, moe: bool = False) -> float:
    """Bytes autograd saves per token in one block without recompute (see the module docstring)."""
    h, t, a = args.hidden_size, lay.tp, lay.act_bytes
    qkv, o = proj_widths(args)
    n_norms = 4 if getattr(args, "post_norms", False) else 2
    attention = (a * (qkv + o) + 4 * args.num_heads) / t
    k, hm, s, e = args.top_k, args.moe_hidden_size, args.shared_experts, args.num_experts
    if lay.torchtitan:  # norm inputs sharded + rstd, each norm output gathered once (saved whole)
        norms = n_norms * ((a * h + 4) / t + a * h)
        if not moe:
            return norms + attention + 4 * a * args.intermediate_size / t
        share = lay.dispatch_share
        experts = 2 * a * k * h * share + 4 * a * k * hm * lay.expert_rows_share / lay.etp + a * k * h * share
        ffn = 4 * e + 12 * k + experts + (4 * a * s * hm / t if s else 0.0)
        return norms + attention + ffn
    mla = getattr(args, "kv_lora_rank", 0) > 0
    if lay.bf16_weights:
        return _megatron_layer_bytes(args, lay, moe)
    norms = n_norms * (8 * h + 4) / t
    if mla:
        attention = _mla_attention_bytes(args, lay)
    elif getattr(args, "qk_norm", False):  # per-head RMSNorm of q and of k: fp32 input, rstd, output
        attention += sum((4 + a) * n * args.head_dim + 4 * n for n in (args.num_heads, args.num_kv_heads)) / t
    # The gathered norm output, cast once in the block under autocast (models/common/transformer.py): one copy
    # for wq/wk/wv (or MLA's projections), one for the MLP's w1/w3; the MoE casts its fp32 input per consumer.
    casts = 2 if lay.precision != "fp32" else 1  # copies of the MoE's input for the shared experts' w1, w3
    gathered_attn = a * h
    if lay.precision != "fp32":  # RoPE casts cos / sin to bf16 for q and for k in every block
        gathered_attn += 2 * args.rotary_dim * a
    if not moe:
        return norms + gathered_attn + a * h + attention + 4 * a * args.intermediate_size / t
    router = a * h + 4 * e + 12 * k  # the gate's input cast, fp32 scores, top-k indices and weights
    # the dispatched copies and the experts' output: the rows this rank dispatches (Layout.dispatch_share);
    # the experts' hidden states: the rows its experts receive, at width H / etp (= 4 a k H / t either way)
    share = lay.dispatch_share
    experts = 2 * a * k * h * share + 4 * a * k * hm * lay.expert_rows_share / lay.etp + a * k * h * share
    shared = (casts * a * h + 4 * a * s * hm / t) if s else 0.0
    return norms + gathered_attn + attention + router + experts + shared


def _megatron_layer_bytes(args: TransformerArgs, lay: Layout, moe: bool) -> float:
    """:func:`layer_activation_bytes` in the Megatron-style engines. Each norm keeps its input and its output
    (the next linear layer's input); attention its projections' outputs, the output projection's input and
    the logsumexp; an MLP its up projection's output (the activation's input) and the down projection's input;
    a MoE block its router state and, per routed row, the dispatched input, its MLP's two tensors and the
    row's routing weight (Megatron-Core from v0.13 scales the activation by it, so the expert's output is not
    kept for the combine). A linear layer's input is kept as its FP8 copy under ``train.fp8`` (Transformer
    Engine saves the quantized input for the backward GEMMs; DeepSeek-V3 caches the same in FP8), and the
    activation's input too with ``act_fp8_input_store`` (Megatron's ``--activation-func-fp8-input-store``;
    DeepSeek-V3's SwiGLU inputs). ``recompute_modules``: ``layernorm`` drops the norm outputs, ``moe_act`` the
    experts' activation output, ``mla_up_proj`` the up-projections' and RoPE's outputs (core attention's q, k,
    v are recomputed from the latents, kept whole on every TP rank: the normed q and kv latents and the rotary
    key)."""
    h, t, a = args.hidden_size, lay.tp, lay.act_bytes
    lin = 1 if lay.fp8 != "none" else a  # bytes of a saved linear-layer input
    act_in = 1 if lay.act_fp8_input_store else a  # bytes of the saved activation (SwiGLU) input
    mods = lay.recompute_modules
    qkv, o = proj_widths(args)
    n_norms = 4 if getattr(args, "post_norms", False) else 2
    norms = n_norms * (a * h + (0 if "layernorm" in mods else lin * h) + 4) / t
    attention = (a * qkv + lin * o + 4 * args.num_heads) / t
    if "mla_up_proj" in mods and args.kv_lora_rank > 0:
        latents = lin * (args.q_lora_rank + args.kv_lora_rank) + a * args.qk_rope_head_dim
        attention = (lin * o + 4 * args.num_heads) / t + latents
    if not moe:
        return norms + attention + (2 * act_in + lin) * args.intermediate_size / t
    k, hm, s, e = args.top_k, args.moe_hidden_size, args.shared_experts, args.num_experts
    act_out = 0 if "moe_act" in mods else lin
    rows = k * (lin * h + (2 * act_in + act_out) * hm + 4)
    ffn = (4 * e + 12 * k + rows + (2 * act_in + lin) * s * hm) / t
    return norms + attention + ffn


def sac_op_bytes(args: TransformerArgs, lay: Layout, moe: bool = False) -> float:
    """Bytes per token torchtitan's per-op selective recompute keeps of one block (``selective_ac_option: op``):
    the block's input, the outputs of every second matmul (wq, wv, w1, w2 of a dense block: 1st, 3rd, 5th,
    7th; w2's is the whole partial sum before its reduce-scatter under TP), attention's output and logsumexp,
    and under TP the two reduce-scatter outputs. An MoE block keeps its routed rows' expert inputs instead
    of w1 / w2 (the dispatch is recomputed)."""
    h, t, a = args.hidden_size, lay.tp, lay.act_bytes
    qkv, o = proj_widths(args)
    if getattr(args, "kv_lora_rank", 0):  # MLA: the query and value widths of its FLOP count
        saved_proj = 2 * qkv / 3
    else:  # wq and wv
        saved_proj = (args.num_heads + args.num_kv_heads) * args.head_dim
    out = a * h / t + a * saved_proj / t + a * o / t + 4 * args.num_heads / t
    out += 2 * a * h / t if t > 1 else 0.0
    if moe:
        return out + a * args.top_k * h * lay.dispatch_share + a * h
    return out + a * args.intermediate_size / t + a * h


def block_input_bytes(lay: Layout, hidden: int) -> float:
    """Bytes per token of a block's input (the residual stream, sequence-sharded): what full recompute keeps."""
    return (lay.act_bytes if lay.bf16_weights else MASTER_BYTES) * hidden / lay.tp


def layer_bytes(args: TransformerArgs, lay: Layout, moe: bool = False) -> float:
    """Bytes one block saves for one micro-batch: the per-token count x its ``micro-batch x seq / cp`` tokens,
    plus context parallel's gathered K/V (and ALiBi bias: :func:`~llmtrain.plan.long_context.cp_layer_bytes`);
    the additive mask all layers share is a per-micro-batch term (``cp_additive_mask`` of :func:`~llmtrain.plan.memory.estimate_memory`)."""
    tokens = lay.micro_batch_size * lay.seq_length / lay.cp
    return tokens * layer_activation_bytes(args, lay, moe) + sum(cp_layer_bytes(args, lay).values())


def in_flight(lay: Layout, rank: int) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak (whole-rank units)."""
    m, p = lay.grad_accum, lay.pp
    if p == 1:
        return 1.0
    if lay.schedule == "gpipe":
        return float(m)
    if lay.schedule == "1f1b":
        return float(max(1, min(p - rank, m)))
    if lay.schedule == "zbv":
        return float(min(p, m))
    if lay.schedule == "dualpipev":  # 2 pp + 1 chunks in flight, DeepSeek's "PP + 1" (its PP counts chunks)
        return min(p + 0.5, m)
    v = lay.chunks_per_rank
    return min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1) / v


def in_flight_layers(lay: Layout, rank: int, chunk_sizes: tuple[int, ...]) -> float:
    """Layer x micro-batch activation sets pipeline rank ``rank`` holds at its peak, its chunks sized
    ``chunk_sizes`` (layers, in the rank's order). The multi-chunk schedules interleaved 1F1B and zero-bubble
    are played op by op as Megatron (and torch's interleaved schedule) order them: a warm-up of ``2 (pp - r - 1)
    + (v - 1) N`` forwards, then one forward and one backward at a time; forwards take the rank's chunks in
    groups of ``N = pp`` contiguous micro-batches (the chunk of forward ``k`` is ``(k // N) mod v``), backwards
    the same groups from the last chunk down. With equal chunks the peak is :func:`in_flight` x the rank's
    layers; with unequal ones (a chunk holding only the embedding or only the head, as the Llama 3 paper splits
    405B) the peak is where the held chunks are largest, not the count times an average."""
    whole = in_flight(lay, rank) * sum(chunk_sizes)
    m, p, v = lay.grad_accum, lay.pp, lay.chunks_per_rank
    if v == 1 or lay.schedule in V_SCHEDULES or len(set(chunk_sizes)) <= 1 or m % p:
        return whole
    total, group = m * v, p
    warm = min(total, 2 * (p - rank - 1) + (v - 1) * group)

    def fwd(k: int) -> int:
        return chunk_sizes[(k // group) % v]

    def bwd(k: int) -> int:
        return chunk_sizes[v - 1 - (k // group) % v]

    live = sum(fwd(k) for k in range(warm))
    peak = live
    for k in range(warm, total):  # steady state: forward k, then the oldest backward still owed
        live += fwd(k)
        peak = max(peak, live)
        live -= bwd(k - warm)
    return float(peak)


def backward_temporary_bytes(args: TransformerArgs, lay: Layout, moe: bool = False) -> float:
    """Bytes per token of the gradients a block's backward holds at once beside its saved tensors: at the MLP,
    the gradient of the down projection's input, then of the activation's output and of the up projection's
    output while the first is still live (3 x the MLP width, at the activation dtype; an MoE block: the rows its
    experts receive, as :func:`layer_activation_bytes` counts their hidden states). Found on CPU with a
    dispatch-level tally of the live storages at the step's peak (fp32, full recompute: the recomputed MLP's
    four intermediates plus these three)."""
    if moe:
        return 3 * lay.act_bytes * args.top_k * args.moe_hidden_size * lay.expert_rows_share / lay.etp
    return 3 * lay.act_bytes * args.intermediate_size / lay.tp


__all__ = [
    "layer_activation_bytes",
    "sac_op_bytes",
    "block_input_bytes",
    "layer_bytes",
    "in_flight",
    "in_flight_layers",
    "backward_temporary_bytes",
]

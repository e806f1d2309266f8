"""Memory per device, itemised: parameters, gradients, optimizer states, activations and the rest.

The worst pipeline rank is reported (:mod:`~llmtrain.plan.layout` says what each rank holds). Parameters are
split into *dense* ones (FSDP/ZeRO shards them over ``D = dp_shard x cp``) and routed *experts* (split over
``ep`` and the expert-TP degree ``etp``; under EP, ZeRO >= 1 shards them over their ``edp`` replicas, their own
FSDP: ``D_e = edp``, ZeRO-0 keeps them whole; :class:`~llmtrain.plan.layout.Layout`).

Engine ``llmtrain`` (this trainer: fp32 parameters under ``torch.autocast``; under FSDP2 the blocks carry a
16-bit ``MixedPrecisionPolicy``, distributed/parallelize.py; bytes per parameter of the slice a rank owns)::

    parameters        4 / D      fp32 (the model's parameters are the master weights)
    gradients         4          whole while micro-batches accumulate (gradient sync once per step: FSDP2
                                 keeps the unsharded sum, distributed/grad_sync.py), 4 / D without accumulation
                                 or with reduce_grads per_microbatch; ZeRO-3 under auto: 4 / D, with per_step
                                 4 / D + 4; ZeRO-0: 4
    optimizer_states  8 / D      AdamW exp_avg + exp_avg_sq in fp32
    other             4          ZeRO 1-2 (and ZeRO-3 under PP, run as 2): the all-gathered parameters,
                                 held from forward to backward; ZeRO-3: two blocks + the root. bf16/fp16:
                                 blocks gathered in 2 (also ZeRO-0's copy), the root in 4
                      2          bf16/fp16 copies autocast makes of matmul weights (not the embedding table),
                                 saved for backward: without FSDP every one; under FSDP the head and the
                                 expert-parallel experts only (measured on gloo, tests/test_plan.py)

TP without FSDP adds the embedding's gradient, which comes back replicated (the whole vocab x h table).

Engine ``torchtitan`` (FSDP2 with a bf16 ``MixedPrecisionPolicy``, the root too): parameters 4 / D, gradients
4 / D (under PP the fp32 unsharded sum across micro-batches: FSDP2 upcasts the accumulated gradient to its fp32
``reduce_dtype``), optimizer states 8 / D, the gathered blocks and root in bf16, no autocast copies.

Engine ``megatron`` (distributed optimizer): parameters 2 (bf16 weights; / D under ZeRO-3) + 4 / D (fp32
master; engine ``nemo``: 2 / D, the 16-bit remainders NeMo's distributed Adam stores), gradients g whole
(ZeRO 0-1: the gradient buffer) or g / D (ZeRO 2-3: Megatron-FSDP's ``optim_grads``, the Llama 3 paper's FSDP,
plus one block's unsharded gradient before its reduce-scatter), optimizer states 8 / D, no cast copies. g is
:attr:`Layout.grad_bytes`: 2 by default (Megatron-Core's ``grad_reduce_in_fp32 = False``, NeMo's
``grad_sync_dtype: bf16``, Megatron-Bridge's performance recipes; 4 under ZeRO-0, fp32 main grads), 4 with
``grad_dtype: fp32`` (Megatron-LM's ``--bf16`` default, megatron/training/arguments.py
``accumulate_allreduce_grads_in_fp32``; DeepSpeed's bf16 optimizer). ``offload`` (FSDP2 CPUOffloadPolicy) moves the persistent
parameters, gradients and optimizer states to host memory (``host_bytes``).

Activations, bytes per token of one block without recompute (T = micro-batch x seq / cp tokens; a = 2 under
bf16/fp16, 4 under fp32; h hidden, I the MLP width, q/kv/o the projection widths)::

    llmtrain  norms      2 x (8 h + 4) / t   fp32 norm input (the residual stream is fp32) + fp32 output + rstd
              gathered   2 a h, whole even under sequence parallel: each norm output is cast to bf16 once
                         in the block (then all-gathered in bf16) and saved once for wq, wk, wv, once for w1, w3
              attention  a (q + 2 kv + o) / t + 4 heads / t   (q, k, v after RoPE, the output, the logsumexp)
                         + 2 a rotary (bf16 cos / sin, cast for q and for k in each block)
              mlp        4 a I / t                            (w1 out, activation out, w3 out, product)
    megatron  (2 x 2 a h + 8 + a (q + 2 kv + o) + 4 heads + 3 a I) / t: norm inputs and outputs saved
              sharded (gathered again in backward), fused gate-up output + activation output
    torchtitan 2 x ((a h + 4) / t + a h) + a (q + 2 kv + o) / t + 4 heads / t + 4 a I / t: bf16 norm inputs
              and rstd, each gathered norm output saved once (whole); ``selective`` is its per-op policy
              (:func:`sac_op_bytes`)

Megatron's ``mla_up_proj`` module recompute (``Layout.recompute_modules``, the Megatron-style engines, MLA):
core attention's q, k, v are not kept (``a (q + 2 kv) / t`` above), the q and kv latents and the rotary key are
(``a (q_lora_rank + kv_lora_rank + qk_rope_head_dim)``, whole on every TP rank).

(the llmtrain figures were counted tensor by tensor on gloo with saved-tensor hooks and match to the byte:
``tests/test_plan.py::test_activation_bytes_match_saved_tensors``). An MoE block replaces the MLP term by
the router (4 E fp32 scores, 12 k index/weight bytes), its input cast (a h, llmtrain), the dispatched token
copies (2 a k h llmtrain / a k h megatron), the experts' hidden states (4 a k H / 3 a k H, H =
moe_hidden_size), the experts' output (a k h) and the shared experts' MLP; one layer's all-to-all send and
receive buffers (2 k h tokens, fp32 in llmtrain, whose dispatch moves the fp32 residual) are transient. The
dispatched copies, the experts' output and the buffers count the rows one rank dispatches
(``Layout.dispatch_share``: 1 / t with expert-TP 1, where each TP rank keeps its own rows, and in the
megatron engines).

``full`` recompute keeps each block's input (fp32 / a bytes x h / t) plus one block while it is recomputed;
``selective`` recomputes one block in ``recompute_every``. In flight on pipeline rank r (M micro-batches):
gpipe M, 1f1b min(pp - r, M), interleaved ``min(M v, 2 (pp - r - 1) + (v - 1) pp + 1) / v`` (Megatron's
warm-up, = Korthikanti et al. 2022's pp (1 + (pp - 1) / (pp v)) on rank 0; zero-bubble too when torch's order
is not at hand, otherwise this trainer's and torchtitan's is played in it: :mod:`~llmtrain.plan.zero_bubble`),
zbv min(pp, M), dualpipev min(pp + 1/2, M) (torch's DualPipeV order holds 2 pp + 1 chunks: DeepSeek's
"PP + 1" over its 2 pp stages); with
chunks of unequal size on a rank (an end chunk holding only the embedding or the head) the interleaved
schedule is played op by op over the chunk sizes (:func:`in_flight_layers`). The residual stream at a stage
boundary is held once per micro-batch in flight by this trainer and torchtitan (torch pipelining keeps a
stage's output until its backward); the Megatron-style engines free it once sent (only the head rank's
final-norm input stays). During the backward, the block in hand also holds its own gradient temporaries
(:func:`backward_temporary_bytes`: 3 x the MLP width at the activation dtype).
The head rank adds the logits of one micro-batch (llmtrain: the full vocabulary, gathered; megatron and
torchtitan: the vocabulary-parallel shard) at the loss's peak bytes per element (llmtrain 12, torchtitan 12 /
14 under ``loss_parallel``, megatron 10: :func:`~llmtrain.plan.long_context.logits_bytes`); under the chunked
loss (``train.loss_chunk_tokens``, the trainer's own rule) ``min(chunk, tokens)`` tokens' worth.

The items are each one's own peak; the total is the step's: :func:`concurrency_overlap` removes what the
logits, a recomputed block and gradients freed every step count in phases that never meet
(``MemoryEstimate.not_concurrent``; checked against torch's MemTracker on CPU within 10%), and
:attr:`MemoryEstimate.reserved` adds the caching allocator's reserve (:data:`ALLOCATOR_RESERVE`).

Context parallel as the trainer runs it adds each layer's gathered K/V (:func:`layer_bytes`; ALiBi: its bias
too), per micro-batch in flight the additive mask all layers share and, once, the boolean mask (``details``), and
``recompute: offload`` moves the saved activations to ``host_bytes``, one block's worth staying on the device:
:mod:`~llmtrain.plan.long_context`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmtrain.models import TransformerArgs
from llmtrain.plan import zero_bubble
from llmtrain.plan.activations import (
    backward_temporary_bytes,
    block_input_bytes,
    in_flight,
    in_flight_layers,
    layer_activation_bytes,
    layer_bytes,
    sac_op_bytes,
)
from llmtrain.plan.layout import (
    ADAM_BYTES,
    GRAD_BYTES,
    MASTER_BYTES,
    PRECISION_BYTES,
    RECOMPUTE_MODES,
    SCHEDULES,
    Layout,
    ParamShape,
    RankShape,
    rank_params,
    rank_shapes,
)
from llmtrain.plan.long_context import (
    cp_additive_mask_bytes,
    cp_bool_mask_bytes,
    cp_layer_bytes,
    head_vocab,
    logits_bytes,
    loss_chunk,
)
from llmtrain.plan.replicas import replica_memory_bytes

ALLOCATOR_RESERVE = 0.125
"""What a device's caching allocator reserves beyond the allocated peak, as a fraction of it (block rounding,
cached segments a larger request cannot reuse): :attr:`MemoryEstimate.reserved`. One global value, the
0.025-grid optimum of the planned / measured error on the fit half of the measured-memory runs (torchtitan's 1-D FSDP
tables, Memory(GiB) = max reserved; tests/test_plan_published.py); the other measured runs are held out."""


@dataclass
class MemoryEstimate:
    """Bytes per device on the worst pipeline stage; ``details`` breaks ``other`` (and more) down."""

    parameters: float
    gradients: float
    optimizer_states: float
    activations: float
    other: float
    capacity: float
    stage: int
    details: dict[str, float] = field(default_factory=dict)
    host_bytes: float = 0.0
    not_concurrent: float = 0.0
    """Bytes two items count that are never live at once (:func:`concurrency_overlap`): the items are each
    one's own peak, the total is the step's peak."""

    @property
    def total(self) -> float:
        items = self.parameters + self.gradients + self.optimizer_states + self.activations + self.other
        return items - self.not_concurrent

    @property
    def reserved(self) -> float:
        """The caching allocator's reserved peak: :attr:`total` plus :data:`ALLOCATOR_RESERVE` of it (what
        ``max_memory_reserved`` reports; the allocator frees cached blocks and retries before it runs out, so
        :attr:`fits` compares the allocated peak)."""
        return self.total * (1 + ALLOCATOR_RESERVE)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict[str, float]:
        """The items, ``not_concurrent`` (subtracted) and ``total`` = items - not_concurrent."""
        keys = ("parameters", "gradients", "optimizer_states", "activations", "other", "not_concurrent")
        return {**{k: float(getattr(self, k)) for k in keys}, "total": float(self.total)}


def concurrency_overlap(
    lay: Layout,
    saved: float,
    transient: float,
    logits: float,
    grads: float,
    block_grad: float = 0.0,
    bwd_temp: float = 0.0,
    grads_pending: float = 0.0,
    after_backward: float = 0.0,
    saved_at_recompute: float | None = None,
    retained: float = 0.0,
) -> float:
    """Bytes the itemised sum counts twice for phases that never meet: the loss's logits peak at the end of
    the forward and the start of the backward; a recomputed block's activations, one block's unsharded
    gradient before its reduce-scatter (``block_grad``) and the block's own gradient temporaries
    (``bwd_temp``, :func:`backward_temporary_bytes`) exist during the backward only; and gradients that are
    freed every step (``zero_grad(set_to_none=True)``: every engine but the Megatron-style ones, whose gradient
    buffer is persistent, and every layout without accumulation) grow during the backward while the saved
    activations are released. With ``b = recomputed + block_grad + bwd_temp``, the peak of these is
    ``max(saved + logits, saved + b, b + gradients - grads_pending)`` (at layer ``i`` of the backward: the
    saved activations below ``i``, the gradients above it and the block in hand, whose own gradients and the
    embedding's, ``grads_pending``, come later), and after the backward ``gradients + after_backward`` (replica
    groups' flat all-reduce buffer, which meets the gradients but no activation). ``saved_at_recompute``: what
    is still saved when the highest recomputed block runs again (selective recompute: the blocks above it have
    released theirs; the top block's backward meets all of ``saved`` but no recomputed block); default
    ``saved``. ``retained``: what is held beyond ``saved`` at a moment no loss peak and no backward meets (the
    zero-bubble schedule between an input step and its weight step, plan/zero_bubble.py). Measured on CPU with
    torch's MemTracker, one process, two gloo ranks and every layout the parity tests run
    (``tests/test_plan.py``, ``tests/test_plan_measured.py``)."""
    live_grads = 0.0 if (lay.megatron_engine or lay.grad_accum > 1) else grads
    backward = transient + block_grad + bwd_temp
    summed = saved + backward + logits + live_grads + after_backward + retained
    pending = min(grads_pending, live_grads)
    at_recompute = saved if saved_at_recompute is None else saved_at_recompute
    phases = (saved + logits, saved + block_grad + bwd_temp, at_recompute + backward,
              backward + live_grads - pending, live_grads + after_backward, saved + retained)  # fmt: skip
    return summed - max(phases)


def estimate_memory(args: TransformerArgs, layout: Layout, capacity: float = math.inf) -> MemoryEstimate:
    """Itemised bytes per device of ``layout``; the worst pipeline rank is reported."""
    worst: MemoryEstimate | None = None
    for shape in rank_shapes(args, layout):
        est = _rank_memory(args, layout, shape, capacity)
        if worst is None or est.total > worst.total:
            worst = est
    assert worst is not None
    return worst


def _state_bytes(
    lay: Layout, dense: float, expert: float, block: float, root: float, uncast: float
) -> dict[str, float]:
    """Parameters, gradients, optimizer states and gathered copies of one rank (see the module docstring);
    ``uncast``: parameters autocast never casts (the embedding table, a lookup)."""
    d, de, a = lay.shard_degree, lay.expert_shard_degree, lay.act_bytes
    sharded = dense / d + expert / de
    whole = dense + expert
    accumulating = lay.grad_accum > 1 and lay.grad_sync == "per_step"
    out = {"optimizer_states": ADAM_BYTES * sharded, "gathered_parameters": 0.0, "autocast_weight_copies": 0.0,
           "unsharded_gradients": 0.0}  # fmt: skip
    if lay.megatron_engine:
        weights = (whole / d if lay.zero_stage == 3 else whole) * a
        master = 2 if lay.engine == "nemo" and lay.zero_stage > 0 else MASTER_BYTES  # NeMo: 16-bit remainders
        out["parameters"] = weights + master * sharded
        g = lay.grad_bytes  # the gradient buffer's dtype (Layout.grad_dtype)
        # ZeRO 0-1: the whole buffer (the distributed optimizer reduce-scatters it once per step); ZeRO 2-3:
        # sharded (Megatron-FSDP optim_grads / optim_grads_params, the Llama 3 paper's FSDP: each micro-batch's
        # block gradient reduce-scattered into the shard, whole only for the block in hand)
        out["gradients"] = g * (sharded if lay.zero_stage >= 2 else whole)
        if lay.zero_stage >= 2 and d > 1:
            out["unsharded_gradients"] = g * block
        if lay.zero_stage == 3:
            out["gathered_parameters"] = a * (2 * block + root)
        return out
    out["parameters"] = MASTER_BYTES * sharded
    # experts under EP: their own FSDP over the edp replicas with ZeRO >= 1, else outside FSDP (whole, / ep etp)
    fsdp = dense + (expert if lay.ep == 1 or lay.expert_fsdp else 0.0)
    # bf16/fp16 under FSDP: the blocks are gathered in 16 bits (MixedPrecisionPolicy), the root in fp32
    policy = lay.precision != "fp32" and (lay.dp > 1 or lay.cp > 1 or lay.torchtitan)
    gathered = a if policy else MASTER_BYTES  # bytes of a gathered block parameter
    root_bytes = a if lay.torchtitan else MASTER_BYTES  # torchtitan: the root under the policy too
    unsharded = a * (fsdp - root) if policy else 0.0  # a shard group of 1 gathers nothing, but casts
    if d > 1:
        unsharded = gathered * (fsdp - root) + root_bytes * root
    if lay.zero_stage == 0:
        grads = GRAD_BYTES * whole
        out["gathered_parameters"] = unsharded
    elif lay.zero_stage in (1, 2) or not lay.reshards_after_forward:
        grads = GRAD_BYTES * (whole if accumulating else sharded)
        out["gathered_parameters"] = unsharded
    else:  # ZeRO-3: sharded gradients, + the unsharded accumulator under per_step, + a sharded partial sum
        grads = GRAD_BYTES * sharded + (GRAD_BYTES * whole if accumulating else 0.0)
        if lay.grad_sync == "replicate_per_step":
            grads += GRAD_BYTES * sharded
        out["gathered_parameters"] = gathered * 2 * block + root_bytes * root
    if not accumulating and lay.zero_stage > 0 and d > 1:
        out["unsharded_gradients"] = GRAD_BYTES * block  # one block's gradient before its reduce-scatter
    out["gradients"] = grads
    if lay.torchtitan:  # no autocast: the policy casts every parameter, experts outside FSDP are bf16 already
        return out
    if policy:  # what autocast still casts: the head (root, fp32) and experts outside FSDP (EP)
        outside = expert if lay.ep > 1 and not lay.expert_fsdp else 0.0
        out["autocast_weight_copies"] = a * (root - uncast + outside)
    elif lay.precision != "fp32":
        out["autocast_weight_copies"] = a * (whole - uncast)  # cached by autocast, saved for backward
    return out


def _rank_memory(args: TransformerArgs, lay: Layout, shape: RankShape, capacity: float) -> MemoryEstimate:
    ps = ParamShape(args)
    dense, expert = rank_params(args, lay, shape)
    block = ps.dense_block(lay.tp, shape.moe_layers > 0)
    if shape.moe_layers:
        block += ps.expert_block(lay.etp, lay.ep)
    embed = ps.embedding(lay.tp) if shape.embedding else 0.0
    root = embed + (ps.head(lay.tp, lay.pp) if shape.head else 0.0)
    tied_cast = ps.embedding(lay.tp) if (shape.head and args.tie_word_embeddings and lay.pp == 1) else 0.0
    st = _state_bytes(lay, dense, expert, block, root, uncast=embed - tied_cast)
    params, grads, states = st["parameters"], st["gradients"], st["optimizer_states"]
    if lay.tp > 1 and lay.zero_stage == 0 and shape.embedding and not lay.bf16_weights:
        # The embedding's gradient under TP (RowwiseParallel over the vocabulary) comes back Replicate: the
        # whole vocab x h table on every TP rank; without FSDP nothing reshards it (measured on gloo).
        grads += GRAD_BYTES * args.vocab_size * args.hidden_size * (1 - 1 / lay.tp)
    # replica groups: the flat fp32 buffer of the cross-group all-reduce after the backward (device), and the
    # live heal's host copy of the rank's parameters and optimizer state (plan/replicas.py)
    replica = replica_memory_bytes(lay, dense, expert, state_bytes=params + states)
    host = replica["host"]
    if lay.offload:
        host, params, grads, states = host + params + grads + states, 0.0, 0.0, 0.0

    tokens = lay.micro_batch_size * lay.seq_length / lay.cp
    dense_layer, moe_layer = layer_bytes(args, lay, moe=False), layer_bytes(args, lay, moe=True)
    boundary = tokens * block_input_bytes(lay, args.hidden_size)
    full_set = shape.dense_layers * dense_layer + shape.moe_layers * moe_layer
    biggest = moe_layer if shape.moe_layers else dense_layer
    n_flight = in_flight(lay, shape.rank)
    if shape.layers:  # the schedule played with this rank's chunk sizes (an empty chunk holds nothing)
        n_flight = in_flight_layers(lay, shape.rank, shape.chunk_sizes) / shape.layers
    offloaded = 0.0
    stored_at_recompute: float | None = None  # this trainer's selective recompute: see below
    if lay.recompute == "offload":  # saved tensors on the host; one block's worth on the device at a time
        stored, transient, offloaded = 0.0, biggest, full_set * n_flight
    elif lay.recompute == "full":
        stored, transient = shape.layers * boundary, biggest
    elif lay.recompute == "selective" and lay.torchtitan:
        # torchtitan's per-op policy: the saved op outputs of every block, one block recomputed at a time
        per_token = shape.dense_layers * sac_op_bytes(args, lay) + shape.moe_layers * sac_op_bytes(
            args, lay, True
        )
        stored, transient = tokens * per_token, biggest
    elif lay.recompute == "selective":
        frac = 1.0 / max(lay.recompute_every, 1)
        stored, transient = frac * shape.layers * boundary + (1 - frac) * full_set, biggest
        if not lay.bf16_weights:
            # this trainer recomputes blocks 0, every, 2 every, ...; the highest of them, j, runs again after the
            # blocks above it have released what they saved: below it j / every inputs, the other blocks whole,
            # and its own input
            every = max(lay.recompute_every, 1)
            j = every * ((shape.layers - 1) // every) if shape.layers else 0
            per_block = full_set / max(shape.layers, 1)
            stored_at_recompute = (j // every + 1) * boundary + (j - j // every) * per_block
    else:
        stored, transient = full_set, 0.0
    # the residual stream at each stage boundary: this trainer's torch pipelining keeps a stage's output until
    # its backward (one per micro-batch in flight; without PP the final norm's input); Megatron-style stacks
    # free it once sent (Megatron's deallocate_pipeline_outputs; Meta's "proactively deallocate ... the input
    # and output tensors of each pipeline stage", Llama 3 paper sec. 3.3.2), the stage input being the first
    # layer's saved norm input, counted in its layer: only the head rank's final-norm input stays, for one.
    held = n_flight
    if lay.megatron_engine and lay.pp > 1:
        held = 1.0 if shape.head else 0.0
    saved = stored * n_flight + boundary * held
    retained = 0.0
    if lay.schedule == "zero_bubble" and lay.pp > 1 and shape.layers and not lay.megatron_engine:
        played = zero_bubble.retained(args, lay, shape, stored / shape.layers, boundary)
        if played is not None:  # torch's order played: before the worst input step, and at any other moment
            saved, retained = played[0], max(0.0, played[1] - played[0])
    saved_at_recompute = None  # the micro-batch in its backward holds less when that block runs again
    if stored_at_recompute is not None:
        saved_at_recompute = stored * (n_flight - 1) + stored_at_recompute + boundary * held
    activations = saved + transient

    dispatch = 0.0
    if shape.moe_layers and lay.ep > 1:  # one layer's all-to-all send + receive buffers
        rows = tokens * lay.dispatch_share * args.top_k * args.hidden_size
        dispatch = 2 * rows * (lay.act_bytes if lay.bf16_weights else 4)
    logits = logits_bytes(args, lay, tokens) if shape.head else 0.0
    if shape.head and lay.pp > 1 and not lay.megatron_engine and not loss_chunk(args, lay):
        # (the chunked loss runs in the last stage's forward, whose output is then the loss: nothing held)
        # torch pipelining computes the loss right after the last stage's forward and keeps that output, the
        # logits, until the micro-batch's backward (without PP this trainer frees them before the backward): per
        # head micro-batch in flight one copy at the activation dtype, and for every one but the micro-batch
        # whose backward peaks the loss's saved fp32 log-softmax output. GPipe holds all of them; the 1F1B
        # family runs the head chunk's backward right after its forward (one)
        head_flight = lay.grad_accum if lay.schedule == "gpipe" else 1
        per_element = head_flight * lay.act_bytes + (head_flight - 1) * 4
        logits += tokens * head_vocab(args, lay) * per_element
    if shape.head and lay.torchtitan:
        # the final norm's input (sharded) and rstd, and its gathered output (saved whole by the head)
        logits += tokens * (lay.act_bytes * args.hidden_size * (1 + 1 / lay.tp) + 4 / lay.tp)
    details = {
        "gathered_parameters": st["gathered_parameters"],
        "autocast_weight_copies": st["autocast_weight_copies"],
        "unsharded_gradients": st["unsharded_gradients"],
        "moe_dispatch_buffers": dispatch,
        "logits_and_loss": logits,
        "cp_mask": cp_bool_mask_bytes(args, lay),
        "cp_additive_mask": cp_additive_mask_bytes(args, lay) * n_flight,  # one per micro-batch in flight
    }
    bwd_temp = 0.0
    if shape.layers:
        temps = [backward_temporary_bytes(args, lay, moe) for moe, n in
                 ((False, shape.dense_layers), (True, shape.moe_layers)) if n]  # fmt: skip
        bwd_temp = tokens * max(temps)
    details["backward_temporaries"] = bwd_temp
    details["replica_all_reduce_buffer"] = replica["device"]
    details["zero_bubble_weight_pending"] = retained
    cp_terms = cp_layer_bytes(args, lay)
    # gradients not yet produced while the first block's backward peaks: its own and the embedding's
    pending = grads * min(1.0, (block + embed) / (dense + expert)) if shape.layers and dense + expert else 0.0
    overlap = concurrency_overlap(lay, saved, transient, logits, grads, st["unsharded_gradients"], bwd_temp,
                                  pending, replica["device"], saved_at_recompute, retained)  # fmt: skip
    return MemoryEstimate(
        parameters=params,
        gradients=grads,
        optimizer_states=states,
        activations=activations,
        other=sum(details.values()),
        capacity=capacity,
        stage=shape.rank,
        details={**details, "parameters_per_device": dense / lay.shard_degree + expert / lay.expert_shard_degree,
                 "expert_parameters_per_device": expert / lay.expert_shard_degree,
                 "activations_per_layer": dense_layer, "activations_per_moe_layer": moe_layer if args.num_experts else 0.0,
                 "cp_gathered_kv_per_layer": cp_terms["gathered_kv"], "cp_alibi_bias_per_layer": cp_terms["mask"],
                 "activations_offloaded": offloaded},
        host_bytes=host + offloaded,
        not_concurrent=overlap,
    )  # fmt: skip


def min_state_bytes_per_device(args: TransformerArgs, world_size: int) -> float:
    """The floor no layout can beat without offload: 16 B per parameter spread evenly over every device."""
    return (MASTER_BYTES + GRAD_BYTES + ADAM_BYTES) * args.num_params() / world_size


__all__ = [
    "ALLOCATOR_RESERVE", "PRECISION_BYTES", "RECOMPUTE_MODES", "SCHEDULES", "Layout", "MemoryEstimate",
    "backward_temporary_bytes", "concurrency_overlap", "estimate_memory", "in_flight", "in_flight_layers",
    "layer_activation_bytes", "layer_bytes", "min_state_bytes_per_device", "sac_op_bytes",
]  # fmt: skip

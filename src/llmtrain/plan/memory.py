"""Memory per device, itemised: parameters, gradients, optimizer states, activations and the rest.

Byte accounting (per parameter of the slice a device owns after tensor and pipeline parallel)::

    parameters        4 B   fp32 master weights (they are the model's parameters; autocast / FSDP2's
                            MixedPrecisionPolicy make bf16/fp16 working copies, counted under "other")
    gradients         4 B   fp32, as FSDP2 reduces with reduce_dtype fp32; TP without FSDP adds the
                            embedding's whole vocab x h gradient (it comes back replicated, see below)
    optimizer_states  8 B   AdamW exp_avg + exp_avg_sq in fp32 (+ 4 B per tensor for ``step``, negligible)

That is the 16 B/parameter of mixed-precision Adam (DeepSpeed's 2 + 2 + 12 count the same total). The ZeRO
stages follow this project's FSDP2 realisation (``distributed/parallelize.py``), sharding over
``dp_shard x cp`` (FSDP shards over the flattened ``dp_shard_cp`` mesh):

=====  ===========================================  ===============================================
stage  persistent state per device                  gathered working copies ("other")
=====  ===========================================  ===============================================
0      everything whole                             bf16 copy of all weights under mixed precision
1, 2   params, grads, states / D (stage 1 is run    all unsharded weights, held from forward to
       as stage 2: same communication, less memory)  backward (reshard_after_forward=False)
3      params, grads, states / D                    two blocks' weights (current + prefetch) and one
                                                    block's unsharded gradients
=====  ===========================================  ===============================================

``offload`` (FSDP2 CPUOffloadPolicy) moves the persistent parameters, gradients and optimizer states to host
memory (reported as ``host_bytes``); the gathered copies stay on the device.

Activations are counted tensor by tensor from what autograd saves in one block of this project's model (torch
TP with sequence parallel, SDPA flash attention, SwiGLU), per token, in elements::

    attention: h/t (norm input) + h (gathered norm output, saved by wq/wk/wv) + (nh + 2 nkv) hd / t (q, k, v)
               + 2 nh hd / t (attention output as SDPA saves it, and its contiguous copy saved by wo)
    mlp:       h/t (norm input) + h (gathered norm output) + 4 I / t (w1 out, silu out, w3 out, product)

times the activation bytes (2 under bf16/fp16, 4 under fp32), micro-batch x seq / cp tokens. ``full``
recompute keeps only each block's input (h/t per token) plus one block's full set while it is recomputed;
``selective`` recomputes one block in ``recompute_every`` (as ``apply_recompute`` does). Pipeline schedules
hold this many micro-batches in flight on their first stage (the worst one): gpipe all M, 1f1b / zero_bubble
/ zbv min(pp, M), interleaved_1f1b min(pp, M) x (1 + (pp - 1) / (pp v)) (Korthikanti et al. 2022, sec. 4.2.3).
Temporary buffers ("other") add the logits of one micro-batch (full vocabulary, as the TP plan gathers them:
bf16 logits + fp32 copy + fp32 gradient) on the last stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmtrain.errors import ConfigError
from llmtrain.models import TransformerArgs

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
RECOMPUTE_MODES = ("none", "selective", "full")
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MASTER_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8


@dataclass(frozen=True)
class Layout:
    """One parallel layout of one run: degrees, ZeRO stage, batch split, schedule, recompute, precision."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    grad_accum: int = 1
    """Micro-batches per optimizer step on each data-parallel rank (= pipeline micro-batches M)."""
    seq_length: int = 2048
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    recompute_every: int = 2
    offload: bool = False
    precision: str = "bf16"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"parallel.schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}.")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"--recompute {self.recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}.")
        if self.precision not in PRECISION_BYTES:
            raise ConfigError(f"train.precision {self.precision!r} is not one of fp32, bf16, fp16.")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero_stage {self.zero_stage} is not one of 0, 1, 2, 3.")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def shard_degree(self) -> int:
        """Devices one FSDP shard group spans (dp_shard x cp); 1 under ZeRO-0."""
        return 1 if self.zero_stage == 0 else self.dp_shard * self.cp

    @property
    def act_bytes(self) -> int:
        return PRECISION_BYTES[self.precision]

    def describe(self) -> str:
        dp = f"dp{self.dp}" if self.dp_replicate in (1, self.dp) else f"dp{self.dp_replicate}x{self.dp_shard}"
        parts = [f"tp{self.tp}", f"pp{self.pp}", dp]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        parts += [f"zero{self.zero_stage}", f"mbs{self.micro_batch_size}", f"rc-{self.recompute}"]
        if self.pp > 1:
            parts.append(self.schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        return " ".join(parts) + (" offload" if self.offload else "")


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

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.other

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict[str, float]:
        keys = ("parameters", "gradients", "optimizer_states", "activations", "other")
        return {**{k: float(getattr(self, k)) for k in keys}, "total": float(self.total)}


def layer_params_local(args: TransformerArgs, tp: int) -> int:
    """Parameters of one block on one tensor-parallel rank (norm weights are replicated, the rest split)."""
    norms = 2 * args.hidden_size + (2 * args.head_dim if args.qk_norm else 0)
    return (args._layer_params() - norms) // tp + norms


def stage_layers(args: TransformerArgs, pp: int) -> list[int]:
    """Blocks per pipeline stage (the first stages take the remainder)."""
    base, extra = divmod(args.num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def stage_params(args: TransformerArgs, tp: int, pp: int, stage: int) -> int:
    """Parameters held by one (tp, pp) rank of ``stage`` before data-parallel sharding."""
    n = stage_layers(args, pp)[stage] * layer_params_local(args, tp)
    vocab = args.vocab_size * args.hidden_size
    if stage == 0:
        n += vocab // tp
    if stage == pp - 1:
        n += args.hidden_size + (0 if args.tie_word_embeddings and pp == 1 else vocab // tp)
    return n


def activation_elems_per_token(args: TransformerArgs, tp: int) -> float:
    """Elements autograd saves per token in one block without recompute (see the module docstring)."""
    h, hd, t = args.hidden_size, args.head_dim, tp
    attn = h / t + h + (args.num_heads + 2 * args.num_kv_heads) * hd / t + 2 * args.num_heads * hd / t
    mlp = h / t + h + 4 * args.intermediate_size / t
    return attn + mlp


def in_flight_microbatches(layout: Layout) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak."""
    m, p, v = layout.grad_accum, layout.pp, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved_1f1b":
        return min(p, m) * (1 + (p - 1) / (p * max(v, 1)))
    return float(min(p, m))


def estimate_memory(args: TransformerArgs, layout: Layout, capacity: float = math.inf) -> MemoryEstimate:
    """Itemised bytes per device of ``layout``; the worst pipeline stage is reported."""
    worst: MemoryEstimate | None = None
    for stage in range(layout.pp):
        est = _stage_memory(args, layout, stage, capacity)
        if worst is None or est.total > worst.total:
            worst = est
    assert worst is not None
    return worst


def _stage_memory(args: TransformerArgs, lay: Layout, stage: int, capacity: float) -> MemoryEstimate:
    p_local = stage_params(args, lay.tp, lay.pp, stage)
    shard = lay.shard_degree
    params = MASTER_BYTES * p_local / shard
    grads = GRAD_BYTES * p_local / shard
    states = ADAM_BYTES * p_local / shard
    if lay.tp > 1 and lay.zero_stage == 0 and stage == 0:
        # The embedding's gradient under TP (RowwiseParallel over the vocabulary) comes back Replicate: the
        # whole vocab x h table on every TP rank; without FSDP nothing reshards it (measured on gloo).
        grads += GRAD_BYTES * args.vocab_size * args.hidden_size * (1 - 1 / lay.tp)
    host = 0.0
    if lay.offload:
        host, params, grads, states = params + grads + states, 0.0, 0.0, 0.0

    work = lay.act_bytes  # bytes of a gathered working copy (param_dtype)
    block = layer_params_local(args, lay.tp)
    if lay.zero_stage == 0:
        gathered = 0.0 if work == MASTER_BYTES else work * p_local
        gathered_grads = 0.0
    elif lay.zero_stage in (1, 2):
        gathered = 0.0 if (work == MASTER_BYTES and shard == 1) else work * p_local
        gathered_grads = GRAD_BYTES * block
    else:
        root = p_local - stage_layers(args, lay.pp)[stage] * block
        gathered = work * (2 * block + root)
        gathered_grads = GRAD_BYTES * block

    tokens = lay.micro_batch_size * lay.seq_length / lay.cp
    per_layer = lay.act_bytes * tokens * activation_elems_per_token(args, lay.tp)
    boundary = lay.act_bytes * tokens * args.hidden_size / lay.tp  # a block's input, sequence-sharded
    n_layers = stage_layers(args, lay.pp)[stage]
    if lay.recompute == "full":
        stored_layer, transient = boundary, per_layer
    elif lay.recompute == "selective":
        frac = 1.0 / max(lay.recompute_every, 1)
        stored_layer, transient = frac * boundary + (1 - frac) * per_layer, per_layer * frac
    else:
        stored_layer, transient = per_layer, 0.0
    in_flight = in_flight_microbatches(lay) if stage == 0 else max(1.0, in_flight_microbatches(lay) - stage)
    activations = n_layers * stored_layer * in_flight + transient + boundary * in_flight

    logits = 0.0
    if stage == lay.pp - 1:
        logits = tokens * args.vocab_size * (lay.act_bytes + 4 + 4)
    details = {
        "gathered_parameters": gathered,
        "unsharded_gradients": gathered_grads,
        "logits_and_loss": logits,
    }
    return MemoryEstimate(
        parameters=params,
        gradients=grads,
        optimizer_states=states,
        activations=activations,
        other=sum(details.values()),
        capacity=capacity,
        stage=stage,
        details={**details, "parameters_per_device": p_local / shard, "activations_per_layer": per_layer},
        host_bytes=host,
    )


def min_state_bytes_per_device(args: TransformerArgs, world_size: int) -> float:
    """The floor no layout can beat without offload: 16 B per parameter spread evenly over every device."""
    return (MASTER_BYTES + GRAD_BYTES + ADAM_BYTES) * args.num_params() / world_size

"""What long sequences add to a plan: context parallel as the trainer runs it, the chunked loss, activation offload.

**Context parallel** (``distributed/context_parallel.py``, engine ``llmtrain``): each rank holds ``seq / cp``
tokens of every sequence (two load-balanced chunks) and, in every attention layer, all-gathers the keys and
values of the whole sequence, then runs ``scaled_dot_product_attention`` of its queries against all keys with a
dense boolean mask built once per micro-batch from global positions. Counted per layer, per rank
(``b`` micro-batch, ``s`` seq, ``t`` tp, ``kv`` = kv_heads x head_dim, ``a`` the activation bytes):

* communication: forward an all-gather of K and of V, each ``b s kv / t`` elements of ``a`` bytes, of which a
  rank receives ``(cp - 1) / cp``; backward a reduce-scatter of their gradients, the same volume (again
  forward under full recompute). The trainer runs them in line, so all of it is exposed
  (:func:`cp_comm_bytes`).
* memory, what autograd saves (counted with saved-tensor hooks, ``tests/test_plan_long.py``). Per layer
  (:func:`cp_layer_bytes`): SDPA keeps the *gathered* K and V, ``(cp - 1) / cp`` more than the local ones the
  block count already has, ``2 a b s kv (cp - 1) / (cp t)``; with ALiBi also its bias, built per layer with a
  head dimension: ``a x b_m x heads / t x (s / cp) x s`` (``b_m`` = ``b`` with ``model.document_mask``, else
  1). Per micro-batch (:func:`cp_additive_mask_bytes`): the additive mask (0 / -inf in the query dtype) that
  the model builds once from the boolean one and every layer's SDPA saves, one tensor shared by all layers,
  ``a x b_m x (s / cp) x s`` (twice with a sliding window shorter than the sequence: the windowed twin; none
  with ALiBi), held by every micro-batch in flight; and the boolean masks themselves (1 byte per element,
  :func:`cp_bool_mask_bytes`), which the trainer holds for the current micro-batch.
* attention FLOPs: a dense mask makes the kernel compute every query-key block (no causal block skipping), so
  a rank runs ``(s / cp) x s`` scores per head, twice the causal half that load balancing would give a
  causal kernel (:func:`cp_dense_keys`); the mask's traffic is added (:func:`cp_mask_traffic`): each layer
  reads its mask forward and backward (ALiBi: also writes its bias from the boolean mask), and the shared
  additive mask is written once per micro-batch.

Engines ``megatron`` / ``nemo`` keep the ring model (Transformer Engine's P2P ring: (cp - 1) K/V exchanges per
layer forward and twice backward, hidden behind the attention of the same step, causal work only).

**Chunked loss** (``train/loss.py``): :func:`loss_chunk` asks the trainer's own rule
(``resolve_loss_chunk``: ``train.loss_chunk_tokens``, automatic at vocab >= 64k, under every layout), and the head
rank's logits term (bf16 logits + fp32 log-softmax + fp32 gradient per element) covers ``min(chunk, tokens)``
tokens instead of the micro-batch's (:func:`logits_bytes`); the chunks' logits are recomputed in backward, one
more forward of the output projection (:func:`loss_recompute_fraction`).

**Activation offload** (``recompute.mode: offload``, ``distributed/offload.py``): the tensors each block saves
go to host memory during forward and come back in backward; parameters (and views of them) stay. On the
device: the residual stream in flight and one block's saved tensors (the block running forward before its
copies land, or backward after they came back); ``host_bytes`` gets the rest. The copies cross the host link
twice per micro-batch (out in forward, back in backward) at ``host_link_gbps``; they are issued on the compute
stream (``copy_(non_blocking)`` / ``.to(non_blocking)``), so the planner counts them as exposed
(:func:`offload_seconds`).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.models import TransformerArgs
from llmtrain.plan.catalog import Device
from llmtrain.plan.layout import Layout
from llmtrain.train.loss import resolve_loss_chunk

LOGIT_BYTES_EXTRA = 4 + 4
"""Per logit element beyond the activation dtype, the Megatron-style engines (vocabulary-parallel fused
cross-entropy): the fp32 log-softmax and the fp32 gradient."""


LLMTRAIN_LOGIT_BYTES = 12
"""Bytes per logit element at this trainer's loss peak (train/step.py: the logits are a local of the forward,
freed before ``backward``): the log-softmax backward holds its saved fp32 output, the fp32 gradient it
receives and the fp32 gradient it returns; the forward's bf16 logits + fp32 copy + fp32 output are 10 (fp32
runs: 8). Per chunk under the chunked loss. Measured with the step's peak on CPU (tests/test_plan.py)."""

VOCAB_PARALLEL_LOGIT_BYTES = 4
"""Bytes per local logit element beyond the activation dtype at this trainer's loss-parallel peak
(train/vocab_parallel.py): forward holds the head's logits and their shifted fp32 copy, which becomes the
softmax kept for backward; backward turns it into the fp32 gradient in place and casts it to the logits' dtype
(bf16: 4 + 2; fp32: no cast, the forward's 4 + 4 is the peak)."""

TORCHTITAN_COMPILED_LOGIT_BYTES = 4
"""Bytes per logit element at torchtitan's loss peak when the loss is compiled (``Layout.loss_compiled``): the
upcast, log-softmax and gradient fuse into kernels that keep only the bf16 logits (saved for backward, with a
per-token fp32 log-sum-exp) and write the bf16 gradient (a count, with or without TP)."""

TORCHTITAN_LOGIT_BYTES = {False: 12, True: 14}
"""Bytes per logit element at torchtitan's loss peak (``cross_entropy(pred.float(), labels)``, the bf16 logits
deleted before backward), without / with TP: log-softmax's backward holds its saved fp32 output, the fp32
gradient it receives and the fp32 gradient it returns (12); under ``loss_parallel`` the forward is DTensor's
decomposed log-softmax, which holds the bf16 logits, their fp32 copy, the shifted copy and its exp at once (14)."""


def trainer_cp(lay: Layout) -> bool:
    """Context parallel as this trainer runs it (all-gathered K/V, dense mask), not a ring."""
    return lay.cp > 1 and not lay.bf16_weights


def _kv_width(args: TransformerArgs) -> int:
    return args.num_kv_heads * args.head_dim


def _alibi(args: TransformerArgs) -> bool:
    return args.position_embedding == "alibi"


def _mask_elements(lay: Layout) -> float:
    """Elements of one CP mask, local queries x all keys: ``b_m x (s / cp) x s`` (a batch dim with document
    masks only)."""
    rows = lay.micro_batch_size if lay.document_mask else 1
    return rows * (lay.seq_length / lay.cp) * lay.seq_length


def _mask_count(args: TransformerArgs, lay: Layout) -> int:
    """The full mask and, with a sliding window shorter than the sequence, its windowed twin."""
    return 2 if 0 < (getattr(args, "sliding_window", 0) or 0) < lay.seq_length else 1


def cp_layer_bytes(args: TransformerArgs, lay: Layout) -> dict[str, float]:
    """Bytes one attention layer saves under the trainer's CP beyond the block's per-token count
    (``gathered_kv``; ``mask``: ALiBi's per-layer bias, 0 otherwise, the additive mask being shared:
    :func:`cp_additive_mask_bytes`; see the module docstring); zeros without it."""
    if not trainer_cp(lay):
        return {"gathered_kv": 0.0, "mask": 0.0}
    a, b, s, cp, t = lay.act_bytes, lay.micro_batch_size, lay.seq_length, lay.cp, lay.tp
    gathered = 2 * a * b * s * _kv_width(args) * (cp - 1) / (cp * t)
    bias = a * args.num_heads / t * _mask_elements(lay) if _alibi(args) else 0.0
    return {"gathered_kv": gathered, "mask": bias}


def cp_additive_mask_bytes(args: TransformerArgs, lay: Layout) -> float:
    """The additive mask(s) one micro-batch's forward builds once and all its layers' SDPA save (none with
    ALiBi, whose bias is per layer)."""
    if not trainer_cp(lay) or _alibi(args):
        return 0.0
    return lay.act_bytes * _mask_count(args, lay) * _mask_elements(lay)


def cp_bool_mask_bytes(args: TransformerArgs, lay: Layout) -> float:
    """The boolean mask (and its sliding-window twin) the trainer holds for the current micro-batch."""
    if not trainer_cp(lay):
        return 0.0
    return _mask_count(args, lay) * _mask_elements(lay)


def cp_mask_traffic(args: TransformerArgs, lay: Layout) -> tuple[float, float]:
    """(per layer, per micro-batch) bytes of mask memory traffic under the trainer's CP: a layer reads its
    mask forward and backward (ALiBi: writes its bias from the boolean mask first); the shared additive mask
    is written once per micro-batch from the boolean one."""
    if not trainer_cp(lay):
        return 0.0, 0.0
    bias = cp_layer_bytes(args, lay)["mask"]
    if bias:
        return bias / lay.act_bytes + 3 * bias, 0.0
    shared = cp_additive_mask_bytes(args, lay)
    return 2 * shared / _mask_count(args, lay), cp_bool_mask_bytes(args, lay) + shared


def cp_comm_bytes(args: TransformerArgs, lay: Layout) -> tuple[float, float]:
    """(forward, backward) bytes one rank receives per attention layer under the trainer's CP: the all-gather
    of K and V, the reduce-scatter of their gradients, each ``(cp - 1) / cp`` of ``2 b s kv / t x a``."""
    if not trainer_cp(lay):
        return 0.0, 0.0
    full = 2 * lay.micro_batch_size * lay.seq_length * _kv_width(args) / lay.tp * lay.act_bytes
    moved = (lay.cp - 1) / lay.cp * full
    return moved, moved


def cp_dense_keys(lay: Layout) -> float:
    """Keys per local query the trainer's dense-mask kernel computes under CP: the whole sequence."""
    return float(lay.seq_length)


@dataclass(frozen=True)
class RingAttention:
    """What torch's ``context_parallel`` (the ring torchtitan runs) adds to one attention layer on one rank,
    beyond the causal attention FLOPs (which load balancing spreads evenly: ``s^2 / 2cp`` scores per head).

    ``merge_fwd`` / ``merge_bwd``: bytes of the eager fp32 merge and accumulation traffic (memory bound);
    ``kv_gather``: bytes a rank receives in the K/V all-gather (once forward, once again backward);
    ``dkv_send``: bytes of one fp32 dK/dV rotation (``cp`` of them backward, each waited one step later);
    ``steps``: the ring steps (``cp``), each one SDPA call on a chunk pair."""

    merge_fwd: float
    merge_bwd: float
    kv_gather: float
    dkv_send: float
    steps: int


def ring_kv_width(args: TransformerArgs) -> int:
    """Width of the K and V torchtitan's Llama passes to ``scaled_dot_product_attention``: all the query
    heads x head_dim. Its attention repeats the K/V heads before SDPA (``keys = repeat_kv(xk, self.n_rep)``, in
    ``torchtitan/models/llama/model.py`` at 9dec370, the commit its December 2024 benchmark names), and
    ``context_parallel`` wraps SDPA, so the ring gathers, accumulates and rotates K/V (and dK/dV) ``num_heads /
    num_kv_heads`` times wider than the model's GQA width: 4x for Llama 3 8B, 16x for 405B."""
    return args.num_heads * args.head_dim


RING_MERGE_BYTES = {"fwd_step": 32.5, "fwd_once": 12.0, "bwd_q_step": 14.5, "bwd_q_once": 20.0,
                    "bwd_kv_step": 28.0, "bwd_kv_once": 20.0}  # fmt: skip
"""Bytes per element of the rank's attention output (``q``) or K/V (``kv``) the ring's eager ops move, counted
from ``torch.distributed.tensor.experimental._context_parallel._attention`` (``convert_to_f32`` and load
balancing on, its defaults). Forward, per step after the first: the block output cast to fp32 (6), ``out -
block_out`` (12), the scale by ``sigmoid(block_lse - lse)`` (8), the update (12) = 38 on a whole step, 19 on
the half of a partial step (``i > rank``: the second query chunk) plus the ``torch.cat`` that rebuilds the
output (8) and the query chunk's copy (2): 32.5 averaged over the two kinds; once: the first block's fp32
cast (6) and the final bf16 cast (6). Backward, per step: ``grad_query += grad_query_`` in fp32 (10; partial:
half of it and the ``cat`` 8, and the copies of the chunked q / out / grad_out: 6), averaged 14.5; the dK / dV
accumulation, its ``cat`` into the send buffer and the K/V ``cat`` (28); once: the fp32 zero buffers (4), the
first accumulation (10) and the final casts (6)."""


def ring_attention(args: TransformerArgs, lay: Layout) -> RingAttention | None:
    """The ring's costs for ``lay`` (engine ``torchtitan`` with ``cp > 1``; None otherwise)."""
    if not (lay.torchtitan and lay.cp > 1):
        return None
    b, cp, t = lay.micro_batch_size, lay.cp, lay.tp
    local = b * lay.seq_length / cp  # tokens of the rank (two load-balanced chunks)
    q_el = local * args.num_heads * args.head_dim / t
    kv_el = 2 * local * ring_kv_width(args) / t
    m = RING_MERGE_BYTES
    return RingAttention(
        merge_fwd=q_el * (m["fwd_once"] + (cp - 1) * m["fwd_step"]),
        merge_bwd=q_el * (m["bwd_q_once"] + (cp - 1) * m["bwd_q_step"])
        + kv_el * (m["bwd_kv_once"] + (cp - 1) * m["bwd_kv_step"]),
        kv_gather=(cp - 1) * kv_el * lay.act_bytes,
        dkv_send=kv_el * 4,
        steps=cp,
    )


def loss_chunk(args: TransformerArgs, lay: Layout) -> int:
    """Tokens per loss chunk the trainer uses for this layout (0: the plain loss); engines other than
    ``llmtrain`` keep their own (vocabulary-parallel) loss."""
    if lay.bf16_weights:
        return 0
    return resolve_loss_chunk(lay.loss_chunk_tokens, args.vocab_size)


def head_vocab(args: TransformerArgs, lay: Layout) -> float:
    """Logit columns one head rank holds: the vocabulary-parallel shard ``V / tp`` (this trainer's loss
    parallel, the other engines' vocabulary-parallel loss); the whole vocabulary in this trainer with
    ``parallel.loss_parallel: false`` (gathered)."""
    return args.vocab_size / (lay.tp if (lay.bf16_weights or lay.loss_parallel) else 1)


def vocab_parallel(lay: Layout) -> bool:
    """Whether this trainer's loss runs on vocabulary-sharded logits (TP with ``parallel.loss_parallel``)."""
    return not lay.bf16_weights and lay.tp > 1 and lay.loss_parallel


def logits_bytes(args: TransformerArgs, lay: Layout, tokens: float) -> float:
    """The head rank's logits term for one micro-batch of ``tokens`` tokens (see the module docstring)."""
    vocab = head_vocab(args, lay)
    chunk = loss_chunk(args, lay)
    live = min(float(chunk), tokens) if chunk else tokens
    if lay.torchtitan:  # the fp32 loss: its peak element bytes (TORCHTITAN_LOGIT_BYTES), or compiled
        per = TORCHTITAN_COMPILED_LOGIT_BYTES if lay.loss_compiled else TORCHTITAN_LOGIT_BYTES[lay.tp > 1]
        return live * vocab * per
    # the chunked loss: each chunk's head weight gradient [vocab, h] in fp32 before it is added into the
    # gradient the earlier chunks left (autograd's accumulation of a weight used once per chunk)
    head_grad = vocab * args.hidden_size * 4 if chunk and tokens > chunk else 0.0
    if vocab_parallel(lay):  # this trainer's loss parallel: the logits + one fp32 tensor (VOCAB_PARALLEL_...)
        return live * vocab * (lay.act_bytes + VOCAB_PARALLEL_LOGIT_BYTES) + head_grad
    if not lay.bf16_weights:  # this trainer: the log-softmax backward's peak (LLMTRAIN_LOGIT_BYTES)
        return live * vocab * LLMTRAIN_LOGIT_BYTES + head_grad
    return live * vocab * (lay.act_bytes + LOGIT_BYTES_EXTRA)


def loss_recompute_fraction(args: TransformerArgs, lay: Layout) -> float:
    """Extra output-projection work of the chunked loss, as a fraction of its forward + backward (1/3)."""
    return 1.0 / 3 if loss_chunk(args, lay) else 0.0


def offload_seconds(dev: Device, saved_bytes: float) -> float:
    """Seconds of one micro-batch's offload copies: ``saved_bytes`` out in forward and back in backward."""
    return 2 * saved_bytes / (dev.host_link_gbps * 1e9)


__all__ = [
    "cp_additive_mask_bytes", "cp_bool_mask_bytes", "cp_comm_bytes", "cp_dense_keys", "cp_layer_bytes",
    "cp_mask_traffic", "head_vocab", "vocab_parallel", "logits_bytes", "loss_chunk", "loss_recompute_fraction", "offload_seconds", "ring_attention",
    "RingAttention", "RING_MERGE_BYTES", "ring_kv_width", "trainer_cp",
]  # fmt: skip

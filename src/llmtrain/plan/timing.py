"""Time per step: the GEMMs at their shape's efficiency, attention, element-wise traffic and communication.

One global cost model (calibration in ``docs/planner.md``); nothing is fitted per published run. Per
micro-batch on each pipeline rank (``T`` = micro-batch x seq / cp tokens, its layers from
:func:`~llmtrain.plan.layout.rank_shapes`):

* **GEMMs** at the shape-dependent efficiency of :mod:`~llmtrain.plan.gemm` (dense blocks, MoE blocks with
  their experts at the *active* count ``top_k``, the output projection on the head rank). **Attention**:
  causal FLOPs as executed (7 passes of ``2 T keys width`` per head: flash attention's backward recomputes
  ``Q K^T``), keys = seq / 2 on average (a sliding window: its mean), /tp /cp, at ``e x attention_ratio``.
  **Element-wise** kernels (norms, RoPE, activations, residuals, casts, MoE permutes) as memory traffic
  ``a (c_h h + c_i I) / t`` per token per layer, eager or fused constants. Fused = ``train.compile`` (graph
  mode); engine ``llmtrain`` runs eager under TP (the trainer skips compile with TP, feasibility warning
  ``tp_compile``). Engine ``llmtrain`` also casts every matmul weight to bf16 once per micro-batch (autocast
  over fp32 parameters; under PP once per step): 6 bytes per weight. Recompute adds one forward of the
  recomputed blocks.
* **TP** (sequence parallel): per block 4 all-gathers + 4 reduce-scatters of ``T x h`` (+4 with full
  recompute); engine ``llmtrain`` gathers the fp32 norm outputs (and reduce-scatters their fp32 gradients),
  ``megatron`` moves bf16 and gathers the two saved inputs again in backward (+2), ``torchtitan`` moves bf16
  and saves the gathered inputs (no +2). ``llmtrain`` and ``torchtitan`` run them in line (exposed, unless
  ``tp_overlap``: async TP); ``megatron`` hides the backward ones behind ``tp_overlap_fraction`` of the backward GEMMs
  (its linear layers overlap them with the dgrad / wgrad GEMMs); ``tp_overlap`` hides the forward ones behind
  the forward GEMMs as well. ``llmtrain`` also all-gathers the logits over the vocabulary.
* **EP** all-to-all: per MoE block 2 exchanges forward (dispatch, combine) and 2 backward (+2 with full
  recompute) of the rows the rank dispatches, ``T x top_k x h x Layout.dispatch_share`` (``T / t`` with
  expert-TP 1 and in the megatron engines, all ``T`` in this trainer with expert-TP ``t``; fp32 dispatch in
  ``llmtrain``, whose router input is the fp32 residual stream), over the ``ep`` group of the expert mesh
  (peers ``etp`` ranks apart), ``(ep - 1) / ep`` of it leaving the rank, at the intra-node bandwidth for the
  peers in the node and the inter-node one for the rest (in parallel). Exposed (neither engine overlaps it).
  Expert replicas (``edp > 1``): with ZeRO >= 1 their own FSDP gathers them and reduce-scatters their
  gradients over ``edp``; ZeRO-0 all-reduces their gradients.
* **CP**, engine ``llmtrain`` (the trainer, :mod:`~llmtrain.plan.long_context`): per layer forward an
  all-gather of K and of V (``(cp - 1) / cp`` of ``b s kv / t`` elements each), backward a reduce-scatter of
  their gradients (the same volume; the forward again under full recompute), exposed (run in line); the dense
  mask's kernel computes all ``seq`` keys of each local query (no causal block skipping) and the mask's
  traffic (each layer reads the shared additive mask forward and backward, built once per micro-batch) is
  element-wise work. Engines ``megatron`` / ``nemo``: ring attention, (cp - 1) K/V exchanges
  per layer forward, twice backward, hidden behind the attention compute of the same ring step.
* **FP8** (``train.fp8``): the blocks' linear GEMMs at the device's FP8 peak (:mod:`~llmtrain.plan.gemm`).
* **Chunked loss**: one more forward of the output projection (the chunks' logits are recomputed in backward).
* **Activation offload** (``recompute: offload``): every saved activation crosses the host link out and back
  per micro-batch at ``host_link_gbps``, on the compute stream: exposed (``StepTime.offload``).
* **PP**: each rank's micro-batch time ``t_r`` (compute + exposed TP / EP / CP); the slowest rank sets the
  pace: step = M max_r t_r + bubble, bubble = f x the sum over the other ranks of their chunk time
  ``t_r / v`` (= (pp - 1) / v slots of an even split), f = 1 for gpipe / 1f1b / interleaved and 1/3 for the
  zero-bubble schedules; an uneven ``pipeline_layers`` split shows up in ``max_r t_r``. Point-to-point
  sends on the fill and drain path.
* **DP / ZeRO**: the traffic of :func:`_dp_traffic` (gradient reduction once per optimizer step in
  ``per_step`` mode, this trainer's default since the gradient-sync switch, ``distributed/grad_sync.py``;
  per micro-batch for ZeRO-3's reduce-scatter under ``auto``, or with ``reduce_grads: per_microbatch``),
  hidden behind ``dp_overlap`` of the compute it overlaps with: a once-per-step gather behind the first
  forward, a once-per-step reduction behind the last backward, per-micro-batch traffic behind its own
  micro-batch; the last block's reduction is exposed. Engine ``llmtrain`` gathers fp32 parameters and
  reduces fp32 gradients (FSDP2 without a mixed-precision policy), ``megatron`` bf16 ones (ZeRO-0: fp32).
* **Optimizer**: memory bound, read p, g, m, v and write p, m, v of the rank's shard.

A collective over ``g`` ranks moves ``(g - 1) / g`` of the buffer per rank (ring), twice for an all-reduce, at
``link_efficiency`` of :func:`group_bandwidth`: the intra-node link when the group fits in a node (mesh order
pp, dp_replicate, dp_shard, cp, tp with tp innermost), else ``k`` NICs' worth for a group with ``k`` members
per node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.models import TransformerArgs
from llmtrain.plan.catalog import Cluster
from llmtrain.plan.gemm import GemmModel, block_gemm_time, head_gemm_time
from llmtrain.plan.layout import Layout, RankShape, rank_params, rank_shapes
from llmtrain.plan.long_context import (
    cp_comm_bytes,
    cp_dense_keys,
    cp_mask_traffic,
    loss_recompute_fraction,
    offload_seconds,
    trainer_cp,
)
from llmtrain.plan.memory import MASTER_BYTES, layer_bytes


@dataclass(frozen=True)
class Efficiency:
    """The global calibration of the cost model (one set for every device and every run)."""

    attention_ratio: float = 0.5
    """Flash attention (forward + backward) runs at this fraction of the GEMM ceiling."""
    link_efficiency: float = 0.8
    """Collectives reach this fraction of the nominal link bandwidth (NCCL/HCCL bus bandwidth)."""
    dp_overlap: float = 0.9
    """Fraction of the overlappable compute window that hides data-parallel traffic."""
    tp_overlap_fraction: float = 0.8
    """With ``tp_overlap``: the fraction of a block's GEMM time that hides its TP collectives."""
    eager_elementwise: tuple[float, float] = (90.0, 13.0)
    """(c_h, c_i): element-wise traffic per token per layer, forward + backward, unfused eager kernels."""
    fused_elementwise: tuple[float, float] = (14.0, 5.0)
    """(c_h, c_i) with fused kernels (torch.compile, Transformer Engine, MindSpore graph mode)."""
    moe_permute: float = 6.0
    """Element-wise passes over the ``top_k x h`` routed copies of a token (gather, scale, scatter-add)."""
    latency_s: float = 20e-6
    """Fixed cost of one collective or send."""
    gemm: GemmModel = field(default_factory=GemmModel)


@dataclass
class StepTime:
    """Seconds per optimizer step and its parts (all per device, on the critical path)."""

    compute: float
    tp_comm: float
    pp_bubble: float
    pp_p2p: float
    dp_exposed: float
    cp_exposed: float
    optimizer: float
    dp_total: float
    model_flops: float
    """Model FLOPs per device per step (6N + attention, no recompute): the MFU numerator."""
    ep_comm: float = 0.0
    offload: float = 0.0
    """Activation offload's host <-> device copies (``recompute: offload``), exposed."""
    parts: dict[str, float] = field(default_factory=dict)
    stage_microbatch_s: list[float] = field(default_factory=list)
    """Micro-batch time of each pipeline rank (the slowest sets the pace)."""

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.ep_comm + self.pp_bubble + self.pp_p2p + self.dp_exposed
                + self.cp_exposed + self.optimizer + self.offload)  # fmt: skip


def group_bandwidth(cluster: Cluster, size: int, stride: int, eff: Efficiency) -> float:
    """Bytes/s per rank of a ring collective over ``size`` ranks spaced ``stride`` apart in rank order.

    Inside one node: the intra-node link. Across nodes, a ring with ``k`` members in each node crosses each node
    boundary once per channel, and NCCL spreads its channels over the NICs; the other groups of the same
    layout run concurrently on the node's other NICs, so each group gets ``k`` NICs: ``min(intra, k x inter)``
    (a pure data-parallel ring with all 8 GPUs of a node: 8 NICs; one GPU per node, e.g. DP under TP8: 1).
    """
    dev = cluster.device
    if size * stride <= cluster.devices_per_node:
        return dev.intra_node_bw_gbs * 1e9 * eff.link_efficiency
    per_node = max(1, min(size, cluster.devices_per_node // max(stride, 1)))
    return min(dev.intra_node_bw_gbs, per_node * dev.inter_node_bw_gbs) * 1e9 * eff.link_efficiency


def _collective(nbytes: float, size: int, bw: float, eff: Efficiency, kind: str = "ag") -> float:
    """Ring time of an all-gather / reduce-scatter ("ag"/"rs") or all-reduce ("ar") of ``nbytes``."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if kind == "ar" else 1.0
    return factor * (size - 1) / size * nbytes / bw + eff.latency_s


def _all_to_all(nbytes: float, size: int, stride: int, cluster: Cluster, eff: Efficiency) -> float:
    """One all-to-all of ``nbytes`` per rank over ``size`` ranks ``stride`` apart (intra / inter in parallel)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    dev = cluster.device
    inside = min(size, max(1, cluster.devices_per_node // stride))
    intra = (inside - 1) / size * nbytes / (dev.intra_node_bw_gbs * 1e9 * eff.link_efficiency)
    inter = (size - inside) / size * nbytes / (dev.inter_node_bw_gbs * 1e9 * eff.link_efficiency)
    return max(intra, inter) + eff.latency_s


@dataclass
class _RankTime:
    """One pipeline rank's micro-batch: compute, exposed TP / EP / CP and its GEMM time."""

    compute: float
    tp: float
    ep: float
    cp: float
    chunks: int
    offload: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.ep + self.cp + self.offload


def _mean_keys(args: TransformerArgs, seq: int) -> float:
    """Keys per query averaged over the blocks (causal seq / 2; a sliding window its mean)."""
    keys = [
        args.sliding_window - args.sliding_window**2 / (2 * seq)
        if getattr(args, "sliding_window", 0) and args.is_sliding_layer(i) and args.sliding_window < seq
        else seq / 2
        for i in range(args.num_layers)
    ]
    return sum(keys) / max(len(keys), 1)


def _rank_time(
    args: TransformerArgs, lay: Layout, cluster: Cluster, shape: RankShape, fused: bool, eff: Efficiency
) -> _RankTime:
    dev, t, cp, a = cluster.device, lay.tp, lay.cp, lay.act_bytes
    h, v = args.hidden_size, args.vocab_size
    tokens = lay.micro_batch_size * lay.seq_length / cp
    ceiling = dev.peak_flops * dev.matmul_efficiency
    rc = {"selective": 1.0 / max(lay.recompute_every, 1), "full": 1.0}.get(lay.recompute, 0.0)
    mega = lay.bf16_weights

    dense_s, _ = block_gemm_time(args, lay, dev, tokens, False, eff.gemm)
    moe_s, _ = block_gemm_time(args, lay, dev, tokens, True, eff.gemm) if shape.moe_layers else (0.0, 0.0)
    gemm_layers = shape.dense_layers * dense_s + shape.moe_layers * moe_s
    width = args._attention_width() if hasattr(args, "_attention_width") else args.head_dim
    keys = cp_dense_keys(lay) if trainer_cp(lay) else _mean_keys(args, lay.seq_length)
    attn_flops = 14 * keys * tokens * args.num_heads * width / t
    attn_layer = attn_flops / (ceiling * eff.attention_ratio)
    mask_layer, mask_once = cp_mask_traffic(args, lay)  # read by each layer; built once per micro-batch
    attn_layer += mask_layer / (dev.memory_bw_gbs * 1e9)
    c_h, c_i = eff.fused_elementwise if fused else eff.eager_elementwise
    dense_bytes = a * (c_h * h + c_i * args.intermediate_size) / t * tokens
    k, hm = args.top_k, args.moe_hidden_size
    moe_bytes = a * (c_h * h + c_i * (k + args.shared_experts) * hm + eff.moe_permute * k * h) / t * tokens
    elem = (shape.dense_layers * dense_bytes + shape.moe_layers * moe_bytes) / (dev.memory_bw_gbs * 1e9)
    compute = (gemm_layers + shape.layers * attn_layer + elem) * (1 + rc / 3)
    compute += mask_once / (dev.memory_bw_gbs * 1e9)
    if shape.head:
        compute += (1 + loss_recompute_fraction(args, lay)) * head_gemm_time(args, lay, dev, tokens, eff.gemm)
        compute += (
            tokens * v / (1 if mega else t) * (a + 12) / (dev.memory_bw_gbs * 1e9)
        )  # logits, softmax, grad
    if not mega and lay.precision != "fp32" and lay.pp == 1:  # autocast's weight casts, every micro-batch
        dense, expert = rank_params(args, lay, shape)
        compute += (1 + rc) * 6 * (dense + expert) / (dev.memory_bw_gbs * 1e9)

    # tensor parallel (sequence parallel): per block, forward and backward collectives and what hides them
    tp = 0.0
    if t > 1:
        bw = group_bandwidth(cluster, t, 1, eff)
        msg = tokens * h
        if lay.megatron_engine:  # bf16; backward gathers the two saved inputs again
            one = _collective(msg * a, t, bw, eff)
            fwd, bwd = (4 + 4 * rc) * one, 6 * one
        elif mega:  # torchtitan: bf16, the gathered inputs are saved (nothing gathered again in backward)
            one = _collective(msg * a, t, bw, eff)
            fwd, bwd = (4 + 4 * rc) * one, 4 * one
        else:  # the norm outputs are gathered in fp32 (and their gradients reduce-scattered in fp32)
            gathered = MASTER_BYTES if lay.precision != "fp32" else a
            pair = _collective(msg * gathered, t, bw, eff) + _collective(msg * a, t, bw, eff)
            fwd, bwd = (2 + 2 * rc) * pair, 2 * pair
        f = eff.tp_overlap_fraction
        for n_layers, gemm_s in ((shape.dense_layers, dense_s), (shape.moe_layers, moe_s)):
            fwd_exposed = max(0.0, fwd - f * (1 + rc) * gemm_s / 3) if lay.tp_overlap else fwd
            # Megatron's linear layers overlap the backward gathers / reduce-scatters with the dgrad / wgrad
            # GEMMs even without --tp-comm-overlap; torch TP runs them in line
            bwd_exposed = (
                max(0.0, bwd - f * 2 * gemm_s / 3) if (lay.tp_overlap or lay.megatron_engine) else bwd
            )
            tp += n_layers * (fwd_exposed + bwd_exposed)
        if shape.head and not mega:
            tp += _collective(tokens * v * a, t, bw, eff)  # the logits gathered over the vocabulary

    # expert parallel all-to-all, exposed
    ep = 0.0
    if shape.moe_layers and lay.ep > 1:
        rows = tokens * lay.dispatch_share * k * h  # the rows this rank dispatches (plan/layout.py)
        dispatch = rows * (MASTER_BYTES if not mega and lay.precision != "fp32" else a)
        # the ep group of the expert mesh (pp, edp, ep, etp) over the stage's ranks: peers etp apart
        one_way = _all_to_all(dispatch, lay.ep, lay.etp, cluster, eff) + _all_to_all(
            rows * a, lay.ep, lay.etp, cluster, eff
        )
        ep = shape.moe_layers * one_way * (2 + rc)

    # context parallel: the trainer all-gathers K/V (exposed); a ring hides its exchange behind attention
    cp_t = 0.0
    if trainer_cp(lay):
        cp_bw = group_bandwidth(cluster, cp, t, eff)
        fwd_b, bwd_b = cp_comm_bytes(args, lay)  # bytes received, K and V together: two collectives each way
        one_way = 2 * eff.latency_s
        cp_t = shape.layers * ((1 + rc) * (fwd_b / cp_bw + one_way) + bwd_b / cp_bw + one_way)
    elif cp > 1:
        cp_bw = group_bandwidth(cluster, cp, t, eff)
        kv_msg = tokens * 2 * args.num_kv_heads * args.head_dim / t * a
        ring = 3 * (cp - 1) * (kv_msg / cp_bw + eff.latency_s)  # forward once, backward twice (kv + dkv)
        cp_t = shape.layers * max(0.0, ring - attn_layer)
    offload = 0.0
    if lay.recompute == "offload":
        dense_b, moe_b = layer_bytes(args, lay, False), layer_bytes(args, lay, True)
        offload = offload_seconds(dev, shape.dense_layers * dense_b + shape.moe_layers * moe_b)
    return _RankTime(compute, tp, ep, cp_t, len(shape.chunks), offload)


def _dp_traffic(
    lay: Layout, cluster: Cluster, dense: float, expert: float, eff: Efficiency
) -> tuple[float, float, float]:
    """(gather once per step, reduce once per step, traffic per micro-batch) in seconds, one rank."""
    t, cp = lay.tp, lay.cp
    mega = lay.bf16_weights
    fsdp = dense + (expert if lay.ep == 1 else 0.0)  # under EP the experts have their own group, below
    pbytes = lay.act_bytes if mega else MASTER_BYTES  # gathered parameter dtype
    gbytes = lay.act_bytes if (lay.megatron_engine and lay.zero_stage > 0) else 4  # reduced gradient dtype
    shard = lay.dp_shard * cp if lay.zero_stage > 0 else 1
    rep = lay.dp_replicate if lay.zero_stage > 0 else lay.dp * cp
    shard_bw = group_bandwidth(cluster, shard, t, eff)
    rep_bw = group_bandwidth(cluster, rep, t * shard, eff)
    if lay.zero_stage == 0:
        reduce = _collective(gbytes * fsdp, rep, rep_bw, eff, "ar")
        gather = 0.0
    else:
        gather = _collective(pbytes * fsdp, shard, shard_bw, eff)
        reduce = _collective(gbytes * fsdp, shard, shard_bw, eff, "rs")
        reduce += _collective(gbytes * fsdp / shard, rep, rep_bw, eff, "ar")
    edp = lay.edp if lay.ep > 1 else 1  # experts under EP: their replicas, ranks ep x etp apart
    replica_mb = 0.0
    if edp > 1:
        edp_bw = group_bandwidth(cluster, edp, lay.ep * lay.etp, eff)
        if lay.expert_fsdp:  # their own FSDP over the replicas: gathered, gradients reduce-scattered
            gather += _collective(pbytes * expert, edp, edp_bw, eff)
            reduce += _collective(gbytes * expert, edp, edp_bw, eff, "rs")
        else:  # ZeRO-0: every replica keeps them whole; this trainer sums each micro-batch's expert gradient
            summed = _collective(gbytes * expert, edp, edp_bw, eff, "ar")  # over the replicas (a hook)
            if mega:
                reduce += summed
            else:
                replica_mb = summed
    mode = lay.grad_sync
    if lay.zero_stage == 3 and lay.reshards_after_forward:  # gathered for forward and again for backward
        per_mb = 2 * gather
        if mode == "per_microbatch":
            return 0.0, 0.0, per_mb + reduce
        if mode == "replicate_per_step":
            rs = _collective(gbytes * fsdp, shard, shard_bw, eff, "rs")
            return 0.0, reduce - rs, per_mb + rs
        return 0.0, reduce, per_mb
    if mode == "per_microbatch":
        return 0.0, 0.0, gather + reduce + replica_mb
    return gather, reduce, replica_mb


def estimate_step_time(
    args: TransformerArgs, layout: Layout, cluster: Cluster, fused: bool, eff: Efficiency | None = None
) -> StepTime:
    """Step time of ``layout`` on ``cluster``; ``fused``: the run compiles (``train.compile`` / graph mode)."""
    eff = eff or Efficiency()
    lay, dev = layout, cluster.device
    m = lay.grad_accum
    fused = fused and (lay.tp == 1 or lay.bf16_weights)
    shapes = rank_shapes(args, lay)
    times = [_rank_time(args, lay, cluster, s, fused, eff) for s in shapes]
    slow = max(range(len(times)), key=lambda r: times[r].total)
    t_mb = times[slow].total

    # pipeline: the slowest rank sets the pace; the others' chunk times fill and drain the pipeline
    bubble = 0.0
    if lay.pp > 1:
        factor = 1.0 / 3 if lay.schedule in ("zero_bubble", "zbv") else 1.0
        bubble = factor * sum(tr.total / tr.chunks for r, tr in enumerate(times) if r != slow)
    p2p = 0.0
    if lay.pp > 1:
        tokens = lay.micro_batch_size * lay.seq_length / lay.cp
        pp_bw = group_bandwidth(cluster, 2, lay.tp * lay.cp * lay.dp, eff)
        msg = tokens * args.hidden_size / lay.tp * (lay.act_bytes if lay.bf16_weights else MASTER_BYTES)
        p2p = 2 * (lay.pp - 1) * lay.chunks_per_rank * (msg / pp_bw + eff.latency_s)

    # data parallel: the worst rank's exposed traffic
    dp_exposed, dp_total, n_opt_max = 0.0, 0.0, 0.0
    for shape, tr in zip(shapes, times):
        dense, expert = rank_params(args, lay, shape)
        gather, reduce, per_mb = _dp_traffic(lay, cluster, dense, expert, eff)
        window = tr.compute  # the gather hides behind a first forward, the reduction behind a last backward
        exposed = max(0.0, gather - eff.dp_overlap * window / 3)
        exposed += max(0.0, reduce - eff.dp_overlap * 2 * window / 3)
        exposed += m * max(0.0, per_mb - eff.dp_overlap * window)
        exposed += (reduce + per_mb) / max(shape.layers, 1)  # the last block's reduction
        dp_exposed = max(dp_exposed, exposed)
        dp_total = max(dp_total, gather + reduce + m * per_mb)
        n_opt_max = max(n_opt_max, dense / lay.shard_degree + expert / lay.expert_shard_degree)

    if lay.offload:
        work = MASTER_BYTES
        link = dev.host_link_gbps * 1e9  # host Adam + the parameters / gradients over the host link
        t_opt = n_opt_max * 32 / 50e9 + n_opt_max * (work + 4) / link
    else:
        t_opt = n_opt_max * (7 * MASTER_BYTES + 4) / (dev.memory_bw_gbs * 1e9)
    if not lay.bf16_weights and lay.precision != "fp32" and lay.pp > 1:  # autocast casts, once per step
        dense, expert = rank_params(args, lay, shapes[slow])
        t_opt += 6 * (dense + expert) / (dev.memory_bw_gbs * 1e9)

    tokens_mb = lay.micro_batch_size * lay.seq_length
    model_flops = args.flops_per_token(lay.seq_length) * tokens_mb * m * lay.dp / lay.world_size
    st = times[slow]
    return StepTime(
        compute=m * st.compute,
        tp_comm=m * st.tp,
        pp_bubble=bubble,
        pp_p2p=p2p,
        dp_exposed=dp_exposed,
        cp_exposed=m * st.cp,
        optimizer=t_opt,
        dp_total=dp_total,
        model_flops=model_flops,
        ep_comm=m * st.ep,
        offload=m * st.offload,
        parts={"t_microbatch": t_mb, "slowest_stage": float(slow), "bubble_slots": bubble / t_mb if t_mb else 0.0},
        stage_microbatch_s=[tr.total for tr in times],
    )  # fmt: skip


__all__ = ["Efficiency", "StepTime", "estimate_step_time", "group_bandwidth"]

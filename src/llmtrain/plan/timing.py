"""Time per step: compute from FLOPs at a device efficiency, plus the communication each parallel dim adds.

One global cost model (calibration in ``docs/planner.md``); nothing is fitted per published run:

* **Compute** of one micro-batch on the busiest pipeline stage: matmul FLOPs (6 x weights per token, /tp) at
  ``peak x matmul_efficiency``; causal attention FLOPs as executed (7 L s nh hd per token, /tp /cp: flash
  attention's backward recomputes Q K^T, one pass more than the model count's 6) at that rate times
  :attr:`Efficiency.attention_ratio`; element-wise kernels (norms, RoPE, SwiGLU, residuals, casts) as memory
  traffic ``act_bytes x (c_h h + c_i I) / tp`` per token per layer at the device's memory bandwidth, with
  eager (unfused) or fused constants (``train.compile`` / graph mode). Recompute adds one forward of the
  recomputed blocks (full: x 4/3 of block FLOPs).
* **TP** (sequence parallel): 4 all-gathers + 4 reduce-scatters of the block's activations per layer per
  micro-batch (+4 with full recompute), on the critical path (eager TP does not overlap them), plus the
  vocabulary gather of the logits.
* **PP**: step = (M + bubble) x t_micro-batch, bubble = (pp - 1) / v for gpipe / 1f1b / interleaved,
  (pp - 1) / 3 for zero_bubble, (pp - 1) / 6 for zbv; point-to-point sends on the fill and drain path.
* **DP / ZeRO** (FSDP2): stage 0 all-reduces fp32 gradients; stages 1-2 all-gather working weights once and
  reduce-scatter fp32 gradients; stage 3 all-gathers twice (forward and backward). Without PP this happens
  per micro-batch (FSDP2 reduces on every backward), with PP once per step (the pipeline stage syncs on the
  last micro-batch only). Traffic hides behind compute up to :attr:`Efficiency.dp_overlap` of it.
* **CP** ring attention: (cp - 1) K/V exchanges per layer forward, twice that backward, hidden behind the
  attention compute of the same ring step. **EP**: the models here are dense, so no all-to-all.

A collective over ``g`` ranks moves ``(g - 1) / g`` of the buffer per rank (ring), twice for an all-reduce, at
``link_efficiency`` of the group's slowest link: the intra-node link when the group fits in a node (mesh order
pp, dp_replicate, dp_shard, cp, tp with tp innermost), else the inter-node one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.models import TransformerArgs
from llmtrain.plan.catalog import Cluster
from llmtrain.plan.memory import MASTER_BYTES, Layout, stage_layers, stage_params


@dataclass(frozen=True)
class Efficiency:
    """The global calibration of the cost model (one set for every device and every run)."""

    attention_ratio: float = 0.6
    """Flash attention (forward + backward) reaches this fraction of the GEMM rate."""
    link_efficiency: float = 0.8
    """Collectives reach this fraction of the nominal link bandwidth (NCCL/HCCL bus bandwidth)."""
    dp_overlap: float = 0.9
    """Fraction of the overlappable compute window that hides data-parallel traffic."""
    eager_elementwise: tuple[float, float] = (90.0, 13.0)
    """(c_h, c_i): element-wise traffic per token per layer, forward + backward, unfused eager kernels."""
    fused_elementwise: tuple[float, float] = (14.0, 5.0)
    """(c_h, c_i) with fused kernels (torch.compile, Transformer Engine, MindSpore graph mode)."""
    latency_s: float = 20e-6
    """Fixed cost of one collective or send."""


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
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.pp_bubble + self.pp_p2p + self.dp_exposed + self.cp_exposed
                + self.optimizer)  # fmt: skip


def group_bandwidth(cluster: Cluster, size: int, stride: int, eff: Efficiency) -> float:
    """Bytes/s per rank of a collective over ``size`` ranks spaced ``stride`` apart in rank order."""
    dev = cluster.device
    intra = size * stride <= cluster.devices_per_node
    return (dev.intra_node_bw_gbs if intra else dev.inter_node_bw_gbs) * 1e9 * eff.link_efficiency


def _collective(nbytes: float, size: int, bw: float, eff: Efficiency, kind: str = "ag") -> float:
    """Ring time of an all-gather / reduce-scatter ("ag"/"rs") or all-reduce ("ar") of ``nbytes``."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if kind == "ar" else 1.0
    return factor * (size - 1) / size * nbytes / bw + eff.latency_s


def estimate_step_time(
    args: TransformerArgs, layout: Layout, cluster: Cluster, fused: bool, eff: Efficiency | None = None
) -> StepTime:
    """Step time of ``layout`` on ``cluster``; ``fused``: element-wise kernels fused (compile / graph mode)."""
    eff = eff or Efficiency()
    dev, lay = cluster.device, layout
    t, cp, pp, m = lay.tp, lay.cp, lay.pp, lay.grad_accum
    a = lay.act_bytes
    rate = dev.peak_flops * dev.matmul_efficiency
    tokens_mb = lay.micro_batch_size * lay.seq_length  # tokens of one micro-batch (whole sequence)
    local_tokens = tokens_mb / cp
    h, inter, v = args.hidden_size, args.intermediate_size, args.vocab_size

    # --- compute of one micro-batch on the busiest stage -----------------------------------------------------
    layers = max(stage_layers(args, pp))
    block_w = args._layer_params() - 2 * h  # matmul weights of one block (norms are element-wise)
    rc_fwd = {"none": 0.0, "selective": 1.0 / max(lay.recompute_every, 1), "full": 1.0}[lay.recompute]
    mm_flops = 6 * block_w / t * local_tokens * layers * (1 + rc_fwd / 3)
    # Flash attention's backward recomputes Q K^T: 7 causal matmul passes executed where the model FLOP
    # count (6 L s nh hd) has 6 (forward 2, backward 4).
    attn_flops = (
        7 * args.num_heads * args.head_dim * lay.seq_length / t * local_tokens * layers * (1 + rc_fwd / 3)
    )
    out_flops = 6 * v * h / t * local_tokens  # output projection, on the last stage
    c_h, c_i = eff.fused_elementwise if fused else eff.eager_elementwise
    elem_bytes = a * (c_h * h + c_i * inter) / t * local_tokens * layers * (1 + rc_fwd / 3)
    loss_bytes = local_tokens * v * (a + 12)  # logits: cast to fp32, softmax, gradient
    t_compute_mb = (
        (mm_flops + out_flops / pp) / rate
        + attn_flops / (rate * eff.attention_ratio)
        + (elem_bytes + loss_bytes / pp) / (dev.memory_bw_gbs * 1e9)
    )

    # --- tensor parallel (sequence parallel): on the critical path -------------------------------------------
    tp_bw = group_bandwidth(cluster, t, 1, eff)
    act_msg = local_tokens * h * a  # one block activation, whole sequence slice of this CP rank
    n_coll = 8 + 4 * rc_fwd
    t_tp_mb = layers * n_coll * _collective(act_msg, t, tp_bw, eff)
    t_tp_mb += _collective(local_tokens * v * a, t, tp_bw, eff) / pp  # logits gathered over the vocabulary

    # --- context parallel: ring K/V exchange per layer, hidden behind the attention of the same step --------
    t_cp_mb = 0.0
    if cp > 1:
        cp_bw = group_bandwidth(cluster, cp, t, eff)
        kv_msg = local_tokens * 2 * args.num_kv_heads * args.head_dim / t * a
        ring = 3 * (cp - 1) * (kv_msg / cp_bw + eff.latency_s)  # forward once, backward twice (kv + dkv)
        t_cp_mb = layers * max(0.0, ring - attn_flops / layers / (rate * eff.attention_ratio))

    t_mb = t_compute_mb + t_tp_mb + t_cp_mb
    # --- pipeline -------------------------------------------------------------------------------------------
    vs = lay.virtual_stages if lay.schedule == "interleaved_1f1b" else 1
    bubble_slots = 0.0
    if pp > 1:
        bubble_slots = {"zero_bubble": (pp - 1) / 3, "zbv": (pp - 1) / 6}.get(lay.schedule, (pp - 1) / vs)
    pp_stride = t * cp * lay.dp
    p2p = 0.0
    if pp > 1:
        pp_bw = group_bandwidth(cluster, 2, pp_stride, eff)
        p2p = 2 * (pp - 1) * vs * (local_tokens * h * a / t / pp_bw + eff.latency_s)

    # --- data parallel / ZeRO (FSDP2) ------------------------------------------------------------------------
    p_local = max(_stage_params_all(args, lay))
    work = a  # working-copy bytes (param dtype)
    shard_size = lay.dp_shard * cp if lay.zero_stage > 0 else 1
    rep_size = lay.dp_replicate if lay.zero_stage > 0 else lay.dp * cp
    shard_bw = group_bandwidth(cluster, shard_size, t, eff)
    rep_bw = group_bandwidth(cluster, rep_size, t * shard_size, eff)
    grad_bytes = 4.0 * p_local
    if lay.zero_stage == 0:
        t_dp_once = _collective(grad_bytes, rep_size, rep_bw, eff, "ar")
        ag_fwd = 0.0
    else:
        gathers = 2 if lay.zero_stage == 3 else 1
        ag_fwd = _collective(work * p_local, shard_size, shard_bw, eff)
        t_dp_once = gathers * ag_fwd + _collective(grad_bytes, shard_size, shard_bw, eff, "rs")
        t_dp_once += _collective(grad_bytes / shard_size, rep_size, rep_bw, eff, "ar")
    if pp == 1:  # every micro-batch reduces; hidden behind that micro-batch's compute
        dp_total = m * t_dp_once
        tail = t_dp_once / max(layers, 1)  # the last block's reduction and the first block's gather
        dp_exposed = m * (max(0.0, t_dp_once - eff.dp_overlap * t_compute_mb) + tail)
    else:  # once per step: the gather hides behind the first forward, the reduction behind the last backward
        dp_total = t_dp_once
        rs = t_dp_once - (2 if lay.zero_stage == 3 else 1) * ag_fwd
        dp_exposed = max(0.0, ag_fwd - eff.dp_overlap * t_compute_mb / 3)
        dp_exposed += max(0.0, rs - eff.dp_overlap * 2 * t_compute_mb / 3)
        if lay.zero_stage == 3:
            dp_exposed += max(0.0, ag_fwd - eff.dp_overlap * 2 * t_compute_mb / 3)

    # --- optimizer step: memory bound (read p, g, m, v; write p, m, v; + the norm for clipping) -----------
    n_opt = p_local / (shard_size if lay.zero_stage > 0 else 1)
    if lay.offload:
        t_opt = n_opt * 32 / 50e9 + n_opt * (work + 4) / 25e9  # host Adam + PCIe transfers (~25 GB/s)
    else:
        t_opt = n_opt * (7 * MASTER_BYTES + 4) / (dev.memory_bw_gbs * 1e9)

    model_flops = args.flops_per_token(lay.seq_length) * tokens_mb * m * lay.dp / lay.world_size
    return StepTime(
        compute=m * t_compute_mb,
        tp_comm=m * t_tp_mb,
        pp_bubble=bubble_slots * t_mb,
        pp_p2p=p2p,
        dp_exposed=dp_exposed,
        cp_exposed=m * t_cp_mb,
        optimizer=t_opt,
        dp_total=dp_total,
        model_flops=model_flops,
        parts={"t_microbatch": t_mb, "bubble_slots": bubble_slots},
    )


def _stage_params_all(args: TransformerArgs, lay: Layout) -> list[int]:
    return [stage_params(args, lay.tp, lay.pp, s) for s in range(lay.pp)]


__all__ = ["Efficiency", "StepTime", "estimate_step_time", "group_bandwidth"]

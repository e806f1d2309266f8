"""Time per step: the GEMMs at their shape's efficiency, attention, element-wise traffic and communication.

One global cost model (calibration in ``docs/planner.md``); nothing is fitted per published run. Per
micro-batch on each pipeline rank (``T`` = micro-batch x seq / cp tokens, its layers from
:func:`~llmtrain.plan.layout.rank_shapes`):

* **GEMMs** at the shape-dependent efficiency of :mod:`~llmtrain.plan.gemm` (dense blocks, MoE blocks with
  their experts at the *active* count ``top_k``, the output projection on the head rank). **Attention**:
  causal FLOPs as executed (7 passes of ``2 T keys width`` per head: flash attention's backward recomputes
  ``Q K^T``), keys = seq / 2 on average (a sliding window: its mean), /tp /cp, at the device's published
  flash-attention rate (``Device.attention_tflops``, FlashAttention-2's), else (no published rate, or the unfused
  attention of ``Layout.attention`` ``unfused``) at ``e x attention_ratio`` (:func:`_attention_time`).
  **Element-wise** kernels (norms, RoPE, activations, residuals, casts, MoE permutes) as memory traffic
  ``a (c_h h + c_i I) / t`` per token per layer, eager or fused constants. Fused = ``train.compile`` (graph
  mode); engine ``llmtrain`` runs eager under TP (the trainer skips compile with TP, feasibility warning
  ``tp_compile``). Engine ``llmtrain`` also casts every matmul weight to bf16 once per micro-batch (autocast
  over fp32 parameters; under PP once per step): 6 bytes per weight. Recompute adds one forward of the
  recomputed blocks.
* **TP** (sequence parallel): per block 4 all-gathers + 4 reduce-scatters of ``T x h`` (+4 with full
  recompute); engine ``llmtrain`` gathers the fp32 norm outputs (and reduce-scatters their fp32 gradients),
  ``megatron`` moves bf16 and gathers the two saved inputs again in backward (+2), ``torchtitan`` moves bf16
  and saves the gathered inputs (no +2). ``llmtrain`` and ``torchtitan`` run them in line (exposed); their
  ``tp_overlap`` (torch's async TP) hides the forward ones (the recomputed forward's too) behind the forward
  GEMMs, not the backward ones (torch's async-TP announcement: "up to ~20% forward pass speedup and ~8% E2E
  speedup in Llama3 70B"); ``megatron`` hides the backward ones behind ``tp_overlap_fraction`` of the backward
  GEMMs (its linear layers overlap them with the dgrad / wgrad GEMMs), and with ``tp_overlap`` (Transformer
  Engine's userbuffers) the forward ones as well. ``llmtrain`` with ``parallel.loss_parallel: false`` also
  all-gathers the logits over the vocabulary (loss parallel, the default, keeps them sharded: two all-reduces
  of a few floats per token).
* **EP** all-to-all: per MoE block 2 exchanges forward (dispatch, combine) and 2 backward (+2 with full
  recompute) of the rows the rank dispatches, ``T x top_k x h x Layout.dispatch_share`` (``T / t`` with
  expert-TP 1 and in the megatron engines, all ``T`` in this trainer with expert-TP ``t``; fp32 dispatch in
  ``llmtrain``, whose router input is the fp32 residual stream), over the ``ep`` group of the expert mesh
  (peers ``etp`` ranks apart), ``(ep - 1) / ep`` of it leaving the rank, at the intra-node bandwidth for the
  peers in the node and the inter-node one for the rest (in parallel). Exposed, except with ``ep_overlap``
  (DualPipe, Megatron's ``--overlap-moe-expert-parallel-comm``): it runs beside another micro-batch's compute,
  which then runs on the SMs it leaves (``/ (1 - Efficiency.ep_overlap_sms)``), and only what outlasts that
  compute is exposed.
  Expert replicas (``edp > 1``): with ZeRO >= 1 their own FSDP gathers them and reduce-scatters their
  gradients over ``edp``; ZeRO-0 all-reduces their gradients.
* **CP**, engine ``llmtrain`` (the trainer, :mod:`~llmtrain.plan.long_context`): per layer forward an
  all-gather of K and of V (``(cp - 1) / cp`` of ``b s kv / t`` elements each), backward a reduce-scatter of
  their gradients (the same volume; the forward again under full recompute), exposed (run in line); the dense
  mask's kernel computes all ``seq`` keys of each local query (no causal block skipping) and the mask's
  traffic (each layer reads the shared additive mask forward and backward, built once per micro-batch) is
  element-wise work. Engines ``megatron`` / ``nemo``: ring attention, (cp - 1) K/V exchanges
  per layer forward, twice backward, hidden behind the attention compute of the same ring step. Engine
  ``torchtitan``: torch's ``context_parallel`` (:func:`~llmtrain.plan.long_context.ring_attention`): the eager
  fp32 merges and accumulations as memory traffic, the K/V all-gather hidden behind step 0's SDPA, the dK / dV
  rotations each behind one step's backward, the last one exposed.
* **Module recompute** (``Layout.recompute_modules``, Megatron's ``recompute_modules``): the forward of each
  named module again (:func:`_module_recompute`). **MTP** (``Layout.mtp_layers``): the last stage's extra blocks
  (in its block counts), their ``2h -> h`` projections and one more output head + loss each.
* **Replica groups** (``Layout.replicas``, :mod:`~llmtrain.plan.replicas`): the cross-group all-reduce of the
  gradient shards; the FSDP-hooked part joins the data-parallel reduction (same overlap rule), the explicit
  part after the backward is exposed.
* **FP8** (``train.fp8``): the blocks' linear GEMMs at the device's FP8 peak, and the casts of dynamic scaling
  as element-wise traffic (:func:`~llmtrain.plan.gemm.fp8_cast_bytes`).
* **Chunked loss**: one more forward of the output projection (the chunks' logits are recomputed in backward).
* **Activation offload** (``recompute: offload``): every saved activation crosses the host link out and back
  per micro-batch at ``host_link_gbps``, on the compute stream: exposed (``StepTime.offload``).
* **PP**: each rank's micro-batch time ``t_r`` (compute + exposed TP / EP / CP); the slowest rank sets the
  pace: step = M max_r t_r + bubble, bubble = f x the sum over the other ranks of their chunk time
  ``t_r / v`` (= (pp - 1) / v slots of an even split), f = 1 for gpipe / 1f1b / interleaved and 1/3 for the
  zero-bubble schedules; an uneven ``pipeline_layers`` split shows up in ``max_r t_r``. Point-to-point
  sends on the fill and drain path, and with the non-interleaved ``1f1b`` schedule two exposed exchanges per
  micro-batch in the steady state (Megatron's ``send_forward_recv_backward`` / ``send_backward_recv_forward``
  are waited before the next compute, as torch pipelining's 1F1B waits on each receive); the interleaved
  schedules overlap them with the other chunks' compute (Megatron's ``overlap_p2p_comm``).
* **DP / ZeRO**: the traffic of :func:`~llmtrain.plan.comm.dp_traffic` (gradient reduction once per optimizer step in
  ``per_step`` mode, this trainer's default since the gradient-sync switch, ``distributed/grad_sync.py``;
  per micro-batch for ZeRO-3's reduce-scatter under ``auto``, or with ``reduce_grads: per_microbatch``),
  hidden behind ``dp_overlap`` of the compute it overlaps with: a once-per-step gather behind the first
  forward, a once-per-step reduction behind the last backward, per-micro-batch traffic behind its own
  micro-batch; the last block's reduction is exposed. Engine ``llmtrain`` gathers fp32 parameters and
  reduces fp32 gradients (FSDP2 without a mixed-precision policy), ``megatron`` bf16 parameters and gradients
  in its buffer's dtype (``Layout.grad_bytes``: 16-bit, fp32 under ZeRO-0 or with ``grad_dtype: fp32``, as
  Megatron-LM's ``grad_reduce_in_fp32``); its ZeRO 2-3 reduce-scatter every micro-batch (``Layout.grad_sync``:
  the sharded buffer, Megatron-FSDP's ``optim_grads``), ZeRO 2 gathering its whole weights once per step.
* **Optimizer**: memory bound, read p, g, m, v and write p, m, v of the rank's shard.

A collective over ``g`` ranks moves ``(g - 1) / g`` of the buffer per rank (ring), twice for an all-reduce, at
``link_efficiency`` of :func:`group_bandwidth`: the intra-node link when the group fits in a node (mesh order
pp, dp_replicate, dp_shard, cp, tp with tp innermost), else ``k`` NICs' worth for a group with ``k`` members
per node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.feasibility import ZERO_BUBBLE_SCHEDULES
from llmtrain.models import TransformerArgs
from llmtrain.plan.activations import layer_bytes
from llmtrain.plan.calibration import Efficiency
from llmtrain.plan.catalog import Cluster, Device
from llmtrain.plan.comm import all_to_all, collective, dp_traffic, group_bandwidth, replica_traffic
from llmtrain.plan.gemm import (
    block_gemm_time,
    fp8_cast_bytes,
    gemm_time,
    head_gemm_time,
    module_forward_gemm_time,
)
from llmtrain.plan.layout import MASTER_BYTES, Layout, RankShape, rank_params, rank_shapes
from llmtrain.plan.long_context import (
    cp_comm_bytes,
    cp_dense_keys,
    cp_mask_traffic,
    head_vocab,
    loss_recompute_fraction,
    offload_seconds,
    ring_attention,
    trainer_cp,
    vocab_parallel,
)


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


def _attention_time(
    args: TransformerArgs, lay: Layout, dev: Device, tokens: float, keys: float, width: float, eff: Efficiency
) -> float:
    """Seconds of one layer's attention core (forward + backward) on one rank for ``tokens`` queries: the causal
    FLOPs as executed (7 passes of ``2 T keys width`` per head, /tp) at the device's published flash-attention
    rate (``Device.attention_tflops``, FlashAttention-2's forward + backward figure) when the run uses flash
    attention and the catalog has one; else (a device without a published rate, or ``Layout.attention``
    ``unfused``: Megatron-LM before flash attention) at ``attention_ratio`` of the GEMM ceiling."""
    flops = 14 * keys * tokens * args.num_heads * width / lay.tp
    rate = dev.attention_flops if lay.attention == "flash" else 0.0
    return flops / (rate or dev.peak_flops * dev.matmul_efficiency * eff.attention_ratio)


def _rank_time(
    args: TransformerArgs, lay: Layout, cluster: Cluster, shape: RankShape, fused: bool, eff: Efficiency
) -> _RankTime:
    dev, t, cp, a = cluster.device, lay.tp, lay.cp, lay.act_bytes
    h, v = args.hidden_size, args.vocab_size
    tokens = lay.micro_batch_size * lay.seq_length / cp
    rc = {"selective": 1.0 / max(lay.recompute_every, 1), "full": 1.0}.get(lay.recompute, 0.0)
    mega = lay.bf16_weights

    dense_s, _ = block_gemm_time(args, lay, dev, tokens, False, eff.gemm)
    moe_s, _ = block_gemm_time(args, lay, dev, tokens, True, eff.gemm) if shape.moe_layers else (0.0, 0.0)
    gemm_layers = shape.dense_layers * dense_s + shape.moe_layers * moe_s
    width = args._attention_width() if hasattr(args, "_attention_width") else args.head_dim
    keys = cp_dense_keys(lay) if trainer_cp(lay) else _mean_keys(args, lay.seq_length)
    attn_layer = _attention_time(args, lay, dev, tokens, keys, width, eff)
    mask_layer, mask_once = cp_mask_traffic(args, lay)  # read by each layer; built once per micro-batch
    attn_layer += mask_layer / (dev.memory_bw_gbs * 1e9)
    c_h, c_i = eff.fused_elementwise if fused else eff.eager_elementwise
    dense_bytes = a * (c_h * h + c_i * args.intermediate_size) / t * tokens
    k, hm = args.top_k, args.moe_hidden_size
    moe_bytes = a * (c_h * h + c_i * (k + args.shared_experts) * hm + eff.moe_permute * k * h) / t * tokens
    dense_bytes += fp8_cast_bytes(args, lay, tokens, False)
    moe_bytes += fp8_cast_bytes(args, lay, tokens, True) if shape.moe_layers else 0.0
    elem = (shape.dense_layers * dense_bytes + shape.moe_layers * moe_bytes) / (dev.memory_bw_gbs * 1e9)
    compute = (gemm_layers + shape.layers * attn_layer + elem) * (1 + rc / 3)
    compute += mask_once / (dev.memory_bw_gbs * 1e9)
    compute += _module_recompute(args, lay, cluster, shape, tokens, attn_layer, eff)
    if shape.head:
        heads = 1 + shape.mtp  # each MTP layer has its own output projection and loss
        compute += (
            heads
            * (1 + loss_recompute_fraction(args, lay))
            * head_gemm_time(args, lay, dev, tokens, eff.gemm)
        )
        per = 3 * a if lay.loss_compiled else a + 12  # fused: read forward, read + write backward
        compute += heads * (
            tokens * (v if mega else head_vocab(args, lay)) * per / (dev.memory_bw_gbs * 1e9)
        )  # logits, softmax, grad (the megatron engines' term as fitted: tests/test_plan_published.py)
        # MTP's 2h -> h projection of [norm(h_i); norm(emb(t_i+k))] (three GEMMs)
        compute += shape.mtp * 3 * gemm_time(dev, tokens, h / t, 2 * h, a, eff.gemm)
    if not mega and lay.precision != "fp32" and lay.pp == 1:  # autocast's weight casts, every micro-batch
        dense, expert = rank_params(args, lay, shape)
        compute += (1 + rc) * 6 * (dense + expert) / (dev.memory_bw_gbs * 1e9)

    # tensor parallel (sequence parallel): per block, forward and backward collectives and what hides them
    tp = 0.0
    if t > 1:
        bw = group_bandwidth(cluster, t, 1, eff)
        msg = tokens * h
        if lay.megatron_engine:  # bf16; backward gathers the two saved inputs again
            one = collective(msg * a, t, bw, eff)
            fwd, bwd = (4 + 4 * rc) * one, 6 * one
        elif mega:  # torchtitan: bf16, the gathered inputs are saved (nothing gathered again in backward)
            one = collective(msg * a, t, bw, eff)
            fwd, bwd = (4 + 4 * rc) * one, 4 * one
        else:  # the norm outputs are gathered in fp32 (and their gradients reduce-scattered in fp32)
            gathered = MASTER_BYTES if lay.precision != "fp32" else a
            pair = collective(msg * gathered, t, bw, eff) + collective(msg * a, t, bw, eff)
            fwd, bwd = (2 + 2 * rc) * pair, 2 * pair
        f = eff.tp_overlap_fraction
        for n_layers, gemm_s in ((shape.dense_layers, dense_s), (shape.moe_layers, moe_s)):
            fwd_exposed = max(0.0, fwd - f * (1 + rc) * gemm_s / 3) if lay.tp_overlap else fwd
            # Megatron's linear layers overlap the backward gathers / reduce-scatters with the dgrad / wgrad
            # GEMMs even without --tp-comm-overlap; torch TP runs them in line, async TP included (its
            # pattern pass fuses a gather into GEMMs that all take it as their left operand, and a GEMM into
            # the reduce-scatter of its own output: the forward's shapes; in backward the gathered output
            # gradient also feeds the weight-gradient GEMM transposed, and the input gradient that is
            # reduce-scattered is a sum of GEMMs)
            bwd_exposed = max(0.0, bwd - f * 2 * gemm_s / 3) if lay.megatron_engine else bwd
            tp += n_layers * (fwd_exposed + bwd_exposed)
        if shape.head and not mega and not vocab_parallel(lay):
            tp += collective(
                tokens * v * a, t, bw, eff
            )  # the logits gathered (parallel.loss_parallel: false)

    # expert parallel all-to-all, exposed
    ep = 0.0
    if shape.moe_layers and lay.ep > 1:
        rows = tokens * lay.dispatch_share * k * h  # the rows this rank dispatches (plan/layout.py)
        dispatch = rows * (MASTER_BYTES if not mega and lay.precision != "fp32" else a)
        # the ep group of the expert mesh (pp, edp, ep, etp) over the stage's ranks: peers etp apart
        one_way = all_to_all(dispatch, lay.ep, lay.etp, cluster, eff) + all_to_all(
            rows * a, lay.ep, lay.etp, cluster, eff
        )
        again = 1 if "moe" in lay.recompute_modules else 0  # the recomputed MoE layer dispatches again
        ep = shape.moe_layers * one_way * (2 + max(rc, again))
        if lay.ep_overlap:
            # beside another micro-batch's compute, which runs on the SMs the all-to-all leaves
            compute /= 1 - eff.ep_overlap_sms
            ep = max(0.0, ep - compute)

    # context parallel: the trainer all-gathers K/V (exposed); a ring hides its exchange behind attention
    cp_t = 0.0
    if trainer_cp(lay):
        cp_bw = group_bandwidth(cluster, cp, t, eff)
        fwd_b, bwd_b = cp_comm_bytes(args, lay)  # bytes received, K and V together: two collectives each way
        one_way = 2 * eff.latency_s
        cp_t = shape.layers * ((1 + rc) * (fwd_b / cp_bw + one_way) + bwd_b / cp_bw + one_way)
    elif (ring := ring_attention(args, lay)) is not None:  # torch's context_parallel (torchtitan)
        cp_bw = group_bandwidth(cluster, cp, t, eff)
        fwd_attn, bwd_attn = 2 / 7 * attn_layer, 5 / 7 * attn_layer  # the 7 passes: 2 forward, 5 backward
        gather = ring.kv_gather / cp_bw + eff.latency_s  # waited at step 1: hidden behind step 0's SDPA
        send = ring.dkv_send / cp_bw + eff.latency_s  # each waited one step later; the last one exposed
        fwd_exposed = max(0.0, gather - fwd_attn / cp)
        bwd_exposed = max(0.0, gather - bwd_attn / cp) + (cp - 1) * max(0.0, send - bwd_attn / cp) + send
        cp_t = shape.layers * ((1 + rc) * fwd_exposed + bwd_exposed)
        merge = ((1 + rc) * ring.merge_fwd + ring.merge_bwd) / (dev.memory_bw_gbs * 1e9)
        compute += shape.layers * merge
    elif cp > 1:
        cp_bw = group_bandwidth(cluster, cp, t, eff)
        kv_msg = tokens * 2 * args.num_kv_heads * args.head_dim / t * a
        exchanges = 3 * (cp - 1) * (kv_msg / cp_bw + eff.latency_s)  # forward once, backward twice (kv, dkv)
        cp_t = shape.layers * max(0.0, exchanges - attn_layer)
    offload = 0.0
    if lay.recompute == "offload":
        dense_b, moe_b = layer_bytes(args, lay, False), layer_bytes(args, lay, True)
        offload = offload_seconds(dev, shape.dense_layers * dense_b + shape.moe_layers * moe_b)
    return _RankTime(compute, tp, ep, cp_t, len(shape.chunks), offload)


def _module_recompute(
    args: TransformerArgs,
    lay: Layout,
    cluster: Cluster,
    shape: RankShape,
    tokens: float,
    attn_layer: float,
    eff: Efficiency,
) -> float:
    """Seconds per micro-batch of Megatron's module recompute (``Layout.recompute_modules``) on one rank: the
    forward of each named module again in backward. ``core_attn``: the attention kernel's forward (2 of its 7
    passes); ``mla_up_proj``: the MLA up-projections (and RoPE's traffic on their rotary part); ``mlp``: a
    dense block's MLP GEMMs and activation; ``moe``: a MoE block's router, experts and shared experts (its
    all-to-alls are counted with the EP traffic); ``moe_act``: the experts' SwiGLU; ``layernorm``: the two
    norms. Nothing when the whole block is recomputed anyway (``recompute`` full)."""
    mods = lay.recompute_modules
    if not mods or lay.recompute == "full":
        return 0.0
    dev, t, a, h = cluster.device, lay.tp, lay.act_bytes, args.hidden_size
    bw = dev.memory_bw_gbs * 1e9
    dense_n, moe_n = shape.dense_layers, shape.moe_layers
    out = 0.0
    if "core_attn" in mods:
        out += shape.layers * 2 / 7 * attn_layer
    if "mla_up_proj" in mods and args.kv_lora_rank:
        up = module_forward_gemm_time(args, lay, dev, tokens, "mla_up_proj", eff.gemm)
        rope = 3 * a * tokens * args.num_heads * args.qk_rope_head_dim / t / bw  # read q, k; write
        out += shape.layers * (up + rope)
    if "mlp" in mods and dense_n:
        act = 3 * a * tokens * args.intermediate_size / t / bw  # SwiGLU: read gate, up; write
        out += dense_n * (module_forward_gemm_time(args, lay, dev, tokens, "mlp", eff.gemm) + act)
    if "moe" in mods and moe_n:
        act = 3 * a * tokens * args.top_k * args.moe_hidden_size / t / bw
        out += moe_n * (module_forward_gemm_time(args, lay, dev, tokens, "moe", eff.gemm) + act)
    elif "moe_act" in mods and moe_n:
        out += moe_n * 3 * a * tokens * args.top_k * args.moe_hidden_size / t / bw
    if "layernorm" in mods:
        out += shape.layers * 2 * 2 * a * tokens * h / t / bw  # two RMSNorms: read, write
    return out


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
        factor = 1.0 / 3 if lay.schedule in ZERO_BUBBLE_SCHEDULES else 1.0
        bubble = factor * sum(tr.total / tr.chunks for r, tr in enumerate(times) if r != slow)
    p2p = 0.0
    if lay.pp > 1:
        tokens = lay.micro_batch_size * lay.seq_length / lay.cp
        pp_bw = group_bandwidth(cluster, 2, lay.tp * lay.cp * lay.dp, eff)
        msg = tokens * args.hidden_size / lay.tp * (lay.act_bytes if lay.bf16_weights else MASTER_BYTES)
        one = msg / pp_bw + eff.latency_s
        p2p = 2 * (lay.pp - 1) * lay.chunks_per_rank * one  # the fill and drain path
        if lay.schedule == "1f1b":  # steady state: each step's send / receive pair is waited before the next
            p2p += 2 * m * one  # compute (forward out + gradient in, then gradient out + next input in)

    # data parallel: the worst rank's exposed traffic
    dp_exposed, dp_total, n_opt_max, replica_total = 0.0, 0.0, 0.0, 0.0
    for shape, tr in zip(shapes, times):
        dense, expert = rank_params(args, lay, shape)
        gather, reduce, per_mb = dp_traffic(lay, cluster, dense, expert, eff)
        hooked, explicit = replica_traffic(lay, cluster, dense, expert, eff)
        if reduce == 0.0 and per_mb > 0.0:  # reduce-scattered per micro-batch: the hook runs each time
            per_mb += hooked
        else:
            reduce += hooked
        window = tr.compute  # the gather hides behind a first forward, the reduction behind a last backward
        exposed = explicit  # summed after the backward (plan/replicas.py)
        exposed += max(0.0, gather - eff.dp_overlap * window / 3)
        exposed += max(0.0, reduce - eff.dp_overlap * 2 * window / 3)
        exposed += m * max(0.0, per_mb - eff.dp_overlap * window)
        exposed += (reduce + per_mb) / max(shape.layers, 1)  # the last block's reduction
        dp_exposed = max(dp_exposed, exposed)
        dp_total = max(dp_total, gather + reduce + m * per_mb + explicit)
        replica_total = max(
            replica_total, (m * hooked if reduce == 0.0 and per_mb > 0.0 else hooked) + explicit
        )
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
    model_flops = args.flops_per_token(lay.seq_length) * tokens_mb * m * lay.dp / lay.group_world
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
        parts={"t_microbatch": t_mb, "slowest_stage": float(slow), "bubble_slots": bubble / t_mb if t_mb else 0.0,
               "replica_all_reduce": replica_total},
        stage_microbatch_s=[tr.total for tr in times],
    )  # fmt: skip


__all__ = ["Efficiency", "StepTime", "estimate_step_time", "group_bandwidth"]

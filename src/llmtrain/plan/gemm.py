"""GEMM time as a function of the matrix shape, and the GEMMs one transformer block runs on one rank.

**The curve** (a soft roofline; two global constants). A GEMM ``(m x k) @ (k x n)`` with ``b``-byte operands
costs its FLOPs at the ceiling ``e`` of the device's peak plus the traffic of its three operands at a fraction
``beta`` of the memory bandwidth, plus a fixed kernel cost ``tau``::

    t(m, n, k) = 2 m n k / (e * peak) + b (m k + k n + m n) / (beta * bw) + tau

so, without ``tau``, the fraction of peak it reaches is::

    eff(m, n, k) = e / (1 + (e / beta) * (peak / bw) * (b / 2) / I),      I = 1 / (1/m + 1/n + 1/k)

``I`` is the GEMM's arithmetic intensity in FLOP per operand byte (bf16) and ``peak / bw`` the device's ridge
point (295 FLOP/B on an H100, 153 on an A100 80 GB, 196 on an Ascend 910B). Large GEMMs saturate at ``e``
(the device's ``matmul_efficiency``, :data:`llmtrain.plan.catalog.DEFAULT_MATMUL_EFFICIENCY` unless the
catalog sets one); the efficiency falls with the smallest dimension: on an H100 (with the default constants)
the training GEMMs of a Llama 8B (4096 x 4096 weights, 16k tokens) reach 0.82 e, its grouped-query K/V
projections 0.66 e, a 1024-wide MoE expert fed 512 tokens ~0.3 e; 4096^3 0.77 e, 8192^3 0.88 e. In training every weight matrix runs three GEMMs of the same
three sizes (forward ``T x K @ K x N``, input gradient, weight gradient), so one shape gives all three.

**The GEMMs of a block** on one tensor-parallel rank, ``T`` tokens (micro-batch x seq / cp; under sequence
parallel the projections see the gathered sequence), engine ``llmtrain`` (this trainer's separate
projections; also ``torchtitan``) or ``megatron`` / ``nemo`` (fused QKV and gate-up GEMMs)::

    attention   wq (h -> q/t), wk, wv (h -> kv/t), wo (q/t -> h)        | qkv (h -> (q + 2 kv)/t), proj
    mlp         w1, w3 (h -> I/t), w2 (I/t -> h)                          | fc1 (h -> 2 I/t), fc2
    moe         router (h -> E); per local expert (E / ep of them) the same three GEMMs at width H / etp on
                ``T (etp / t) k ep / E`` tokens (the tokens every EP peer routes to it, balanced; expert-TP
                ``etp`` = ``moe_rules.expert_tp``: t, or 1 with each TP rank's own T / t); shared experts as an MLP
    head        output (h -> V/t) on the last stage

With ``train.fp8`` (``Layout.fp8``) the block's linear layers (attention projections, the dense MLP, shared
experts: what ``distributed/float8.py`` converts) run at the device's dense FP8 peak (``peak_fp8_tflops``, a
ConfigError naming the device when it has none); the router, the routed experts, the output head and attention
itself stay at the bf16 peak, their two inputs are read as 1-byte elements, and the casts of dynamic tensorwise
scaling (torchao's ``Float8Linear``) are memory traffic of their own (:func:`fp8_cast_bytes`).

Multi-head latent attention (``kv_lora_rank`` > 0) is costed as one ``h -> A / (h t)`` projection of the same
parameter count ``A``. Flash attention is not a GEMM here: its FLOPs run at the device's published
flash-attention rate (``plan/timing.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.models import TransformerArgs
from llmtrain.plan.catalog import Device, fp8_peak_flops
from llmtrain.plan.layout import Layout, ParamShape


@dataclass(frozen=True)
class GemmModel:
    """The global constants of the GEMM curve (the ceiling ``e`` is the device's ``matmul_efficiency``)."""

    bandwidth_fraction: float = 0.9
    """``beta``: the fraction of memory bandwidth that a GEMM's operand traffic moves at (fitted jointly with
    the ceiling ``e`` and ``dp_overlap`` on the fit half of the published runs, tests/test_plan_published.py)."""
    kernel_s: float = 4e-6
    """``tau``: fixed cost of one GEMM kernel (launch, tail wave; a kernel launch's few microseconds, not fitted:
    the fit half's MAE is flat in it)."""


def gemm_time(
    dev: Device, m: float, n: float, k: float, operand_bytes: int, model: GemmModel, peak: float | None = None
) -> float:
    """Seconds of one ``(m x k) @ (k x n)`` GEMM on ``dev`` (the module docstring's curve); ``peak``: FLOP/s
    instead of the device's bf16 peak (the FP8 peak for ``train.fp8``'s linear layers, whose two inputs are read
    as 1-byte elements; the output stays ``operand_bytes``)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k / (dev.matmul_efficiency * (peak or dev.peak_flops))
    inputs = (1 if peak else operand_bytes) * (m * k + k * n)
    traffic = (inputs + operand_bytes * m * n) / (model.bandwidth_fraction * dev.memory_bw_gbs * 1e9)
    return flops + traffic + model.kernel_s


def efficiency(
    dev: Device, m: float, n: float, k: float, operand_bytes: int = 2, model: GemmModel | None = None
) -> float:
    """Fraction of ``dev``'s peak that one ``(m x k) @ (k x n)`` GEMM reaches (kernel cost included)."""
    t = gemm_time(dev, m, n, k, operand_bytes, model or GemmModel())
    return 2.0 * m * n * k / (t * dev.peak_flops) if t > 0 else 0.0


def _attention_gemms(args: TransformerArgs, lay: Layout, ps: ParamShape) -> list[tuple[float, float, int]]:
    """(K, N, count) of one block's attention projections on one TP rank."""
    h, t = args.hidden_size, lay.tp
    if getattr(args, "kv_lora_rank", 0):
        return [(h, ps.attention / (h * t), 1)]
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    if lay.megatron_engine:
        return [(h, (q + 2 * kv) / t, 1), (q / t, h, 1)]
    return [(h, q / t, 1), (h, kv / t, 2), (q / t, h, 1)]


def _mlp_gemms(h: int, width: float, lay: Layout, tp: int | None = None) -> list[tuple[float, float, int]]:
    """(K, N, count) of a gated MLP of ``width`` hidden units split over ``tp`` ranks (default ``lay.tp``)."""
    w = width / (lay.tp if tp is None else tp)
    if lay.megatron_engine:
        return [(h, 2 * w, 1), (w, h, 1)]
    return [(h, w, 2), (w, h, 1)]


def block_gemm_time(
    args: TransformerArgs, lay: Layout, dev: Device, tokens: float, moe: bool, model: GemmModel
) -> tuple[float, float]:
    """(seconds, FLOPs) of forward + backward of one block's GEMMs on one rank for ``tokens`` tokens."""
    ps = ParamShape(args)
    b = lay.act_bytes
    h = args.hidden_size
    shapes = [(tokens, k, n, c) for k, n, c in _attention_gemms(args, lay, ps)]
    other: list[tuple[float, float, float, int]] = []  # never fp8: the router, the routed experts
    if moe:
        other.append((tokens, h, args.num_experts, 1))  # router (replicated over TP)
        local = max(args.num_experts // max(lay.ep, 1), 1)
        # the rows each local expert receives from its ep peers, at width H / etp (plan/layout.py)
        per_expert = tokens * lay.expert_rows_share * args.top_k * lay.ep / args.num_experts
        experts = _mlp_gemms(h, args.moe_hidden_size, lay, tp=lay.etp)
        other += [(per_expert, k, n, c * local) for k, n, c in experts]
        if args.shared_experts:
            shapes += [
                (tokens, k, n, c)
                for k, n, c in _mlp_gemms(h, args.shared_experts * args.moe_hidden_size, lay)
            ]
    else:
        shapes += [(tokens, k, n, c) for k, n, c in _mlp_gemms(h, args.intermediate_size, lay)]
    peak = fp8_peak_flops(dev, lay.fp8) if lay.fp8 != "none" else None
    seconds = sum(3 * c * gemm_time(dev, m, n, k, b, model, peak) for m, k, n, c in shapes)
    seconds += sum(3 * c * gemm_time(dev, m, n, k, b, model) for m, k, n, c in other)
    flops = sum(6.0 * c * m * n * k for m, k, n, c in shapes + other)
    return seconds, flops


FP8_CAST_BYTES = (6.0, 4.0)
"""Bytes the casts of dynamic tensorwise FP8 scaling move per element (a count, not fitted): per linear-layer input
element 3 forward (read bf16, write fp8; its amax fused into the kernel that made it) and 3 backward (its
transposed fp8 copy for the weight-gradient GEMM); per output-gradient element 4 (read bf16, write fp8 and the
transposed copy). An input shared by several GEMMs (q, k, v; gate and up) is cast once; the weights' casts
(once per micro-batch, on the FSDP shard) are left out (about 1% of a step in the published runs)."""


def fp8_cast_bytes(args: TransformerArgs, lay: Layout, tokens: float, moe: bool) -> float:
    """Bytes of the FP8 casts of one block's converted linear layers (attention projections, a dense MLP or the
    shared experts) on one TP rank for ``tokens`` tokens (:data:`FP8_CAST_BYTES`); 0 without ``train.fp8``."""
    if lay.fp8 == "none":
        return 0.0
    h, t = args.hidden_size, lay.tp
    modules = [_attention_gemms(args, lay, ParamShape(args))]
    width = args.shared_experts * args.moe_hidden_size if moe else args.intermediate_size
    if width:
        modules.append(_mlp_gemms(h, width, lay))
    inputs = outputs = 0.0
    # each module's column-parallel GEMMs read the (sharded) block input; its last GEMM is row-parallel
    for gemms in modules:
        if len(gemms) == 1:  # MLA costed as one projection of the block input
            inputs, outputs = inputs + h / t, outputs + gemms[0][1]
            continue
        inputs += h / t + gemms[-1][0]
        outputs += sum(n * c for _, n, c in gemms[:-1]) + h / t
    cast_in, cast_out = FP8_CAST_BYTES
    return tokens * (cast_in * inputs + cast_out * outputs)


def module_forward_gemm_time(
    args: TransformerArgs, lay: Layout, dev: Device, tokens: float, module: str, model: GemmModel
) -> float:
    """Seconds of the forward GEMMs of one block's Megatron recompute ``module`` on one rank (what recomputing
    it runs again): ``mla_up_proj`` the MLA up-projections (``q_lora_rank -> heads x (nope + rope)`` and
    ``kv_lora_rank -> heads x (nope + v)``, split over TP); ``mlp`` a dense block's MLP; ``moe`` a MoE block's
    router, routed experts (as in :func:`block_gemm_time`) and shared experts; 0 for the other modules."""
    h = args.hidden_size
    peak = fp8_peak_flops(dev, lay.fp8) if lay.fp8 != "none" else None
    b = lay.act_bytes
    if module == "mla_up_proj":
        if not args.kv_lora_rank:
            return 0.0
        heads = args.num_heads / lay.tp
        out = gemm_time(dev, tokens, heads * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank,
                        b, model, peak)  # fmt: skip
        if args.q_lora_rank:
            q = heads * (args.qk_nope_head_dim + args.qk_rope_head_dim)
            out += gemm_time(dev, tokens, q, args.q_lora_rank, b, model, peak)
        return out
    if module == "mlp":
        return sum(c * gemm_time(dev, tokens, n, k, b, model, peak)
                   for k, n, c in _mlp_gemms(h, args.intermediate_size, lay))  # fmt: skip
    if module == "moe":
        local = max(args.num_experts // max(lay.ep, 1), 1)
        per_expert = tokens * lay.expert_rows_share * args.top_k * lay.ep / args.num_experts
        out = gemm_time(dev, tokens, args.num_experts, h, b, model)
        out += sum(c * local * gemm_time(dev, per_expert, n, k, b, model)
                   for k, n, c in _mlp_gemms(h, args.moe_hidden_size, lay, tp=lay.etp))  # fmt: skip
        if args.shared_experts:
            out += sum(c * gemm_time(dev, tokens, n, k, b, model, peak)
                       for k, n, c in _mlp_gemms(h, args.shared_experts * args.moe_hidden_size, lay))  # fmt: skip
        return out
    return 0.0


def head_gemm_time(args: TransformerArgs, lay: Layout, dev: Device, tokens: float, model: GemmModel) -> float:
    """Seconds of the output projection's three GEMMs (forward + backward) on one TP rank."""
    return 3 * gemm_time(dev, tokens, args.vocab_size / lay.tp, args.hidden_size, lay.act_bytes, model)


__all__ = [
    "GemmModel", "block_gemm_time", "efficiency", "gemm_time", "head_gemm_time", "module_forward_gemm_time",
]  # fmt: skip

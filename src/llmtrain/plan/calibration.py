"""The global calibration of the planner's time model: one set of constants for every device and every run
(docs/planner.md says where each comes from: a measurement, a count, or the fit half of the published runs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.plan.gemm import GemmModel


@dataclass(frozen=True)
class Efficiency:
    """The global calibration of the cost model (one set for every device and every run)."""

    attention_ratio: float = 0.5
    """Attention (forward + backward) runs at this fraction of the GEMM ceiling (0.3 of peak with the default
    ceiling) where no published kernel rate applies: a device whose catalog entry gives no ``attention_tflops``,
    and the unfused attention of Megatron-LM before flash attention (``Layout.attention`` ``unfused``: the fit
    half's Narayanan et al. runs, docs/planner.md). Devices with FlashAttention-2's published rate use it."""
    link_efficiency: float = 0.8
    """Collectives reach this fraction of the nominal link bandwidth (NCCL/HCCL bus bandwidth, as nccl-tests
    measure it on NVLink / InfiniBand; not fitted)."""
    dp_overlap: float = 1.0
    """Fraction of the overlappable compute window that hides data-parallel traffic (fitted on the fit half of
    the published runs with the GEMM ceiling and ``GemmModel.bandwidth_fraction``; 1.0 is also its bound)."""
    tp_overlap_fraction: float = 0.8
    """With ``tp_overlap``: the fraction of a block's GEMM time that hides its TP collectives."""
    eager_elementwise: tuple[float, float] = (90.0, 13.0)
    """(c_h, c_i): element-wise traffic per token per layer, forward + backward, unfused eager kernels."""
    fused_elementwise: tuple[float, float] = (14.0, 5.0)
    """(c_h, c_i) with fused kernels (torch.compile, Transformer Engine, MindSpore graph mode)."""
    moe_permute: float = 6.0
    """Element-wise passes over the ``top_k x h`` routed copies of a token (gather, scale, scatter-add)."""
    ep_overlap_sms: float = 20 / 132
    """With ``ep_overlap``: the share of the GPU's SMs the all-to-all kernels hold while the compute runs beside
    them: 20 of the H800's 132 (DeepSeek-V3 technical report, sec. 3.2.2, "only 20 SMs are sufficient to fully
    utilize the bandwidths of IB and NVLink"; DeepEP's default ``Buffer.num_sms`` is 20). Published, not fitted."""
    latency_s: float = 20e-6
    """Fixed cost of one collective or send."""
    gemm: GemmModel = field(default_factory=GemmModel)

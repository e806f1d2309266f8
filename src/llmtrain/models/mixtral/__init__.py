"""Mixtral (``model_type: mixtral``): Mistral's attention with a sparse mixture of experts in every block.

Each block's feed-forward is ``models/common/moe.py``'s MoE: a softmax router, the top 2 of 8 SwiGLU experts
renormalised (``route_norm``), each expert ``intermediate_size`` wide, no shared expert. ``8x7b`` is
Mixtral-8x7B-v0.1: hidden 4,096, 32 layers, 32 heads of 128, 8 KV heads, ffn 14,336, vocab 32,000,
rope_theta 1,000,000, rms_norm_eps 1e-5, no sliding window, router aux coefficient 0.02 (its config.json's
``router_aux_loss_coef``): 46,702,792,704 parameters, 12,879,925,248 active per token (published: 46.7B /
12.9B). ``debug``: 4 experts of width 128, top 2, a 16-token window. Parallelism: expert parallel (any ``ep``
dividing dp x cp x tp, with expert-TP as ``distributed/expert_parallel.py`` lays it out) and ZeRO as for
every MoE model; the common TP plan (attention by heads, experts by hidden units: ``models/common/moe_tp.py``),
and pipeline parallel.
"""

from __future__ import annotations

from llmtrain.models.common.family import COMMON_TP_PLAN, FamilySpec
from llmtrain.models.mixtral import hf

MIXTRAL = FamilySpec(
    name="mixtral",
    description="Mixtral: Mistral attention, top-2 of 8 experts in every block",
    defaults={"rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "top_k": 2, "route_norm": True},
    flavors={
        "debug": {
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 512,
            "num_experts": 4,
            "sliding_window": 16,
            "aux_loss_coef": 0.02,
        },
        "8x7b": {
            "hidden_size": 4096,
            "num_layers": 32,
            "num_heads": 32,
            "num_kv_heads": 8,
            "head_dim": 128,
            "intermediate_size": 14336,
            "vocab_size": 32000,
            "num_experts": 8,
            "aux_loss_coef": 0.02,
        },
    },
    hf=hf,
    tp_plan=COMMON_TP_PLAN,
)

"""Qwen2 (QKV bias) and Qwen3 (QK-norm, explicit head_dim) families, with their MoE variants.

Both are Llama-shaped (RMSNorm eps 1e-6, RoPE theta 1,000,000, GQA, SwiGLU). Qwen2 adds a bias to the q/k/v
projections; Qwen3 drops it and instead RMS-normalises each head's queries and keys before RoPE, with a
head_dim (128) independent of hidden_size / num_heads. Small flavors tie the input and output embeddings, as
the published checkpoints do. Published sizes (parameters, tied counted once):

qwen2: 0.5b 494,032,768; 1.5b 1,543,714,304; 7b 7,615,616,512; 72b 72,706,203,648.
qwen3: 0.6b 596,049,920; 1.7b 1,720,574,976; 4b 4,022,468,096; 8b 8,190,735,360;
14b 14,768,307,200; 32b 32,762,123,264; 30b_a3b (MoE) 30,532,122,624 total, 3,353,032,704 active
(published: 30.5B total, 3.3B activated).

Qwen2-MoE (Hugging Face ``qwen2_moe``; ``models/common/moe.py`` with a sigmoid-gated shared expert, top-k
weights not renormalised): ``14b_a2.7b`` is Qwen1.5-MoE-A2.7B (60 experts of 1,408, top 4, shared 5,632 = 4
experts' width), 14,315,784,192 total, 2,689,173,504 active (published 14.3B / 2.7B); ``57b_a14b`` is
Qwen2-57B-A14B (64 experts of 2,560, top 8, shared 20,480), 57,408,658,944 total, 14,249,270,784 active
(published 57.4B / 14B). ``debug_moe`` of qwen2 has the same switches at test size. Qwen3-MoE is ``qwen3`` with
experts (``30b_a3b``; its ``debug_moe`` uses an ungated shared expert and the aux-loss-free bias, which
Qwen3MoeForCausalLM lacks: export refuses it by name; ``debug_moe_hf`` is the exportable one). MoE blocks run
with expert parallel, ZeRO, pipeline parallel and the common TP plan (``models/common/moe_tp.py``: experts split
by hidden units, the shared expert gate replicated); expert parallel together with TP is refused.
"""

from __future__ import annotations

from llmtrain.models.common.family import COMMON_TP_PLAN, FamilySpec
from llmtrain.models.qwen import hf

_QWEN_COMMON = {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
_DEBUG = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 512,
}
_DEMO = {
    "hidden_size": 384,
    "num_layers": 6,
    "num_heads": 6,
    "num_kv_heads": 2,
    "intermediate_size": 1024,
    "vocab_size": 8192,
}

# Tiny MoE: 4 experts, top 2, one shared expert, both balancing methods on (so tests exercise them).
_DEBUG_MOE = {
    "num_experts": 4,
    "top_k": 2,
    "moe_hidden_size": 64,
    "shared_experts": 1,
    "aux_loss_coef": 0.01,
    "bias_update_rate": 0.001,
}
# Qwen3-30B-A3B (config.json): 128 experts of width 768, top 8, renormalised, every block, router aux 0.001.
_QWEN3_30B_A3B_MOE = {"num_experts": 128, "top_k": 8, "moe_hidden_size": 768, "aux_loss_coef": 0.001}
# Qwen2-MoE: the shared expert's gate, top-k weights as the softmax gives them (norm_topk_prob false).
_QWEN2_MOE = {"shared_expert_gate": True, "route_norm": False, "aux_loss_coef": 0.001}


def _shape(hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, tied: bool) -> dict:
    return {
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": kv,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
    }


QWEN2 = FamilySpec(
    name="qwen2",
    description="Qwen2: Llama-shaped with q/k/v bias",
    defaults={**_QWEN_COMMON, "qkv_bias": True},
    flavors={
        "debug": dict(_DEBUG),
        "demo": dict(_DEMO),
        "0.5b": _shape(896, 24, 14, 2, 4864, 151936, tied=True),
        "1.5b": _shape(1536, 28, 12, 2, 8960, 151936, tied=True),
        "7b": _shape(3584, 28, 28, 4, 18944, 152064, tied=False),
        "72b": _shape(8192, 80, 64, 8, 29568, 152064, tied=False),
        "debug_moe": {
            **_DEBUG,
            "num_experts": 4,
            "top_k": 2,
            "moe_hidden_size": 64,
            "shared_experts": 2,
            **_QWEN2_MOE,
        },
        "14b_a2.7b": {
            **_shape(2048, 24, 16, 16, 5632, 151936, tied=False),
            "num_experts": 60,
            "top_k": 4,
            "moe_hidden_size": 1408,
            "shared_experts": 4,
            **_QWEN2_MOE,
        },
        "57b_a14b": {
            **_shape(3584, 28, 28, 4, 18944, 151936, tied=False),
            "num_experts": 64,
            "top_k": 8,
            "moe_hidden_size": 2560,
            "shared_experts": 8,
            **_QWEN2_MOE,
        },
    },
    hf=hf,
    tp_plan=COMMON_TP_PLAN,
)

QWEN3 = FamilySpec(
    name="qwen3",
    description="Qwen3: Llama-shaped with per-head QK RMSNorm and explicit head_dim",
    defaults={**_QWEN_COMMON, "qk_norm": True},
    flavors={
        "debug": {**_DEBUG, "head_dim": 32},
        "demo": {**_DEMO, "head_dim": 64},
        "0.6b": {**_shape(1024, 28, 16, 8, 3072, 151936, tied=True), "head_dim": 128},
        "1.7b": {**_shape(2048, 28, 16, 8, 6144, 151936, tied=True), "head_dim": 128},
        "4b": {**_shape(2560, 36, 32, 8, 9728, 151936, tied=True), "head_dim": 128},
        "8b": {**_shape(4096, 36, 32, 8, 12288, 151936, tied=False), "head_dim": 128},
        "14b": {**_shape(5120, 40, 40, 8, 17408, 151936, tied=False), "head_dim": 128},
        "32b": {**_shape(5120, 64, 64, 8, 25600, 151936, tied=False), "head_dim": 128},
        # Mixture of experts (models/common/moe.py): a tiny one for tests, and Qwen3-30B-A3B.
        "debug_moe": {**_DEBUG, "head_dim": 32, **_DEBUG_MOE},
        "debug_moe_hf": {
            **_DEBUG,
            "head_dim": 32,
            "num_experts": 4,
            "top_k": 2,
            "moe_hidden_size": 64,
            "aux_loss_coef": 0.001,
        },
        "30b_a3b": {
            **_shape(2048, 48, 32, 4, 6144, 151936, tied=False),
            "head_dim": 128,
            **_QWEN3_30B_A3B_MOE,
        },
    },
    hf=hf,
    tp_plan=COMMON_TP_PLAN,
)

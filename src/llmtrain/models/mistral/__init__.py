"""Mistral (``model_type: mistral``): Llama-shaped blocks (GQA, SwiGLU, RMSNorm, no biases) with sliding-window
attention, every layer attending to at most ``sliding_window`` positions (itself included).

``7b`` is Mistral-7B-v0.3 (vocab 32,768, rope_theta 1,000,000, rms_norm_eps 1e-5, no window: its config.json
sets ``sliding_window: null``), 7,248,023,552 parameters; ``7b_v0.1`` the first release (vocab 32,000,
rope_theta 10,000, a 4,096 window), 7,241,732,096. Both: hidden 4,096, 32 layers, 32 heads of 128, 8 KV heads,
ffn 14,336, untied. ``debug`` has a 16-token window, so tests' 32+ token sequences cross it. The window is a
banded causal mask (``models/common/attention.py``); the KV cache of ``generate`` keeps every position and the
band hides those out of the window. TP: the common plan (the window needs no communication: each rank's
heads see the same band).
"""

from __future__ import annotations

from llmtrain.models.common.family import COMMON_TP_PLAN, FamilySpec
from llmtrain.models.mistral import hf

_7B = {
    "hidden_size": 4096,
    "num_layers": 32,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
}

MISTRAL = FamilySpec(
    name="mistral",
    description="Mistral: Llama-shaped with sliding-window attention",
    defaults={"rms_norm_eps": 1e-5, "rope_theta": 1000000.0},
    flavors={
        "debug": {
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 256,
            "vocab_size": 512,
            "sliding_window": 16,
        },
        "7b": {**_7B, "vocab_size": 32768},
        "7b_v0.1": {**_7B, "vocab_size": 32000, "rope_theta": 10000.0, "sliding_window": 4096},
    },
    hf=hf,
    tp_plan=COMMON_TP_PLAN,
)

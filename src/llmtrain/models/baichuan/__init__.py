"""Baichuan 2: Llama-like blocks with a NormHead (output-embedding rows L2-normalised at every forward).

``7b`` uses RoPE (theta 10,000): hidden 4,096, 32 layers, 32 heads, ffn 11,008, vocab 125,696,
7,505,973,248 parameters. ``13b`` replaces RoPE with ALiBi: hidden 5,120, 40 layers, 40 heads, ffn 13,696,
13,896,668,160 parameters. Neither uses GQA; rms_norm_eps is 1e-6 and embeddings are untied. The checkpoint's
packed ``W_pack`` (q, k, v stacked) is split by ``baichuan.hf``. ``debug``/``demo`` are the 7B shape;
``debug_alibi``/``demo_alibi`` the 13B one (ALiBi), for tests and CPU runs.
"""

from __future__ import annotations

from llmtrain.models.baichuan import hf
from llmtrain.models.common.family import COMMON_TP_PLAN, FamilySpec

_DEBUG = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 256, "vocab_size": 512}
_DEMO = {"hidden_size": 384, "num_layers": 6, "num_heads": 6, "intermediate_size": 1024, "vocab_size": 8192}
_ALIBI = {"position_embedding": "alibi"}

BAICHUAN2 = FamilySpec(
    name="baichuan2",
    description="Baichuan 2: NormHead; 7B RoPE, 13B ALiBi",
    defaults={"norm_head": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "position_embedding": "rope"},
    flavors={
        "debug": dict(_DEBUG),
        "debug_alibi": {**_DEBUG, **_ALIBI},
        "demo": dict(_DEMO),
        "demo_alibi": {**_DEMO, **_ALIBI},
        "7b": {
            "hidden_size": 4096,
            "num_layers": 32,
            "num_heads": 32,
            "intermediate_size": 11008,
            "vocab_size": 125696,
        },
        "13b": {
            **_ALIBI,
            "hidden_size": 5120,
            "num_layers": 40,
            "num_heads": 40,
            "intermediate_size": 13696,
            "vocab_size": 125696,
        },
    },
    hf=hf,
    tp_plan=COMMON_TP_PLAN,
)

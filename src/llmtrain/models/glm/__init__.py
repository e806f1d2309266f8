"""GLM-4 (the Hugging Face ``GlmForCausalLM`` architecture of THUDM/glm-4-9b-hf).

Llama-shaped blocks with q/k/v bias, 2 key/value heads, and RoPE on only the first half of each head
(``partial_rotary_factor`` 0.5) in the interleaved pair layout (dims 2i and 2i+1 rotate together). The
checkpoint fuses the MLP's gate and up projections (``gate_up_proj``); ``glm.hf`` splits it into ``w1``/``w3``.
``9b``: hidden 4,096, 40 layers, 32 heads of 128, 2 KV heads, ffn 13,696, vocab 151,552, rope_theta 10,000,
rms_norm_eps 1.5625e-7, untied: 9,399,951,360 parameters.

GLM-4-0414 (Hugging Face ``model_type: glm4``) adds an RMSNorm on the attention output and one on the MLP output,
each before its residual add (``post_norms``). ``9b_0414`` is GLM-4-9B-0414 (the 9B shape, rms_norm_eps 1e-5,
max_position_embeddings 32,768): 9,400,279,040 parameters; ``debug_0414`` its test size. TP plan: the common
one, which runs the two post norms of any sandwich model (``norm_scheme`` sandwich / dssn) as sequence-parallel
norms (their input is the row-parallel projections' sequence-sharded output, and their weight gradients are
reduced over the TP ranks like the other norms').
"""

from __future__ import annotations

from llmtrain.models.common.family import COMMON_TP_PLAN, FamilySpec
from llmtrain.models.glm import hf

GLM_TP_PLAN = COMMON_TP_PLAN
"""The common plan (``models/common/parallelize.py``), which shards the post norms of any sandwich model."""
_DEBUG = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 256, "vocab_size": 512}
_9B = {
    "hidden_size": 4096,
    "num_layers": 40,
    "num_heads": 32,
    "head_dim": 128,
    "intermediate_size": 13696,
    "vocab_size": 151552,
}

GLM4 = FamilySpec(
    name="glm4",
    description="GLM-4: q/k/v bias, partial (0.5) interleaved RoPE, 2 KV heads",
    defaults={
        "qkv_bias": True,
        "partial_rotary_factor": 0.5,
        "rope_interleaved": True,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1.5625e-07,
        "num_kv_heads": 2,
    },
    flavors={
        "debug": {
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "intermediate_size": 256,
            "vocab_size": 512,
        },
        "demo": {
            "hidden_size": 384,
            "num_layers": 6,
            "num_heads": 6,
            "intermediate_size": 1024,
            "vocab_size": 8192,
        },
        "9b": dict(_9B),
        "debug_0414": {**_DEBUG, "post_norms": True},
        "9b_0414": {**_9B, "post_norms": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768},
    },
    hf=hf,
    tp_plan=GLM_TP_PLAN,
)

"""Llama 3 / 3.1 (``model_type: llama3``, alias ``llama``): RMSNorm, RoPE with Llama 3 scaling, GQA, SwiGLU.

Real flavors carry Meta's published hyperparameters (vocab 128,256, rope_theta 500,000, Llama 3.1 RoPE scaling
factor 8 / low 1 / high 4 / original context 8,192, rms_norm_eps 1e-5, untied embeddings):

=======  ======  ======  =====  ===  ======  ==============
flavor   hidden  layers  heads  kv   ffn     parameters
=======  ======  ======  =====  ===  ======  ==============
8b        4,096      32     32    8  14,336   8,030,261,248
70b       8,192      80     64    8  28,672  70,553,706,496
405b     16,384     126    128    8  53,248  405,853,388,800
100b     10,240      80     80    8  32,256  100,355,614,720
=======  ======  ======  =====  ===  ======  ==============

``100b`` is our own shape for the seed documents' "100B" model: Llama 3 proportions (head_dim 128, 8 KV
heads, ffn about 3.15x hidden) with 80 heads and 80 layers, so tensor parallel 8 and pipeline 2/4/8/16 divide
it evenly, and ffn 32,256 = 126 * 256 (divisible by 8) lands the total at 100.36B parameters.
``debug`` (tiny, for tests) and ``demo`` (15.7M parameters at vocab 8,192; trains on a 2-core CPU) keep the
family's switches.
"""

from __future__ import annotations

from llmtrain.models.common.family import COMMON_TP_PLAN, FamilySpec
from llmtrain.models.llama import hf

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_REAL = {"vocab_size": 128256, "num_kv_heads": 8}

LLAMA3 = FamilySpec(
    name="llama3",
    description="Llama 3 / 3.1: RMSNorm, RoPE (Llama 3 scaling), GQA, SwiGLU",
    defaults={"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE_SCALING},
    flavors={
        "debug": {
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 256,
            "vocab_size": 512,
        },
        "demo": {
            "hidden_size": 384,
            "num_layers": 6,
            "num_heads": 6,
            "num_kv_heads": 2,
            "intermediate_size": 1024,
            "vocab_size": 8192,
        },
        "8b": {**_REAL, "hidden_size": 4096, "num_layers": 32, "num_heads": 32, "intermediate_size": 14336},
        "70b": {**_REAL, "hidden_size": 8192, "num_layers": 80, "num_heads": 64, "intermediate_size": 28672},
        "100b": {
            **_REAL,
            "hidden_size": 10240,
            "num_layers": 80,
            "num_heads": 80,
            "intermediate_size": 32256,
        },
        "405b": {
            **_REAL,
            "hidden_size": 16384,
            "num_layers": 126,
            "num_heads": 128,
            "intermediate_size": 53248,
        },
    },
    hf=hf,
    tp_plan=COMMON_TP_PLAN,
    aliases=("llama",),
)

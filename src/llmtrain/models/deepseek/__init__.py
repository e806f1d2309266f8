"""DeepSeek-V3 (``model_type: deepseek_v3``): multi-head latent attention + DeepSeekMoE.

Every block's attention is MLA (``models/common/mla.py``): queries through a low-rank ``wq_a -> q_norm ->
wq_b``, keys and values from a compressed latent (``kv_lora_rank``) plus one rotary key shared by the heads,
RoPE on ``qk_rope_head_dim`` dims in adjacent pairs; the KV cache holds only the latent and the rotary key.
The first ``first_dense_layers`` blocks have a dense SwiGLU (``intermediate_size``), every later one
DeepSeekMoE (``models/common/moe.py``): sigmoid router scores, the top ``top_k`` of ``num_experts`` experts
chosen inside the ``topk_group`` best of ``n_group`` expert groups, the chosen weights renormalised and scaled
by ``routed_scaling_factor``, plus ``shared_experts`` always-on experts; balance by the aux-loss-free selection
bias (``bias_update_rate``, DeepSeek's gamma 0.001) and a small auxiliary loss (0.0001; llmtrain's is the
per-micro-batch Switch form, DeepSeek's the per-sequence one). Multi-token prediction is not part of the
model (transformers does not run it either).

Flavors (parameters as ``llmtrain check`` counts them; "active": what one token passes through):

=======  ======  ======  =====  =========  ========================  =================  ================
flavor   hidden  layers  heads  q/kv rank  experts (top, shared)     total              active
=======  ======  ======  =====  =========  ========================  =================  ================
debug        64       2      4    32 / 32  8 (2, 1), 2 groups (1)        178,112            141,248
demo        256       4      4     0 / 64  16 (4, 1), 4 groups (2)     10,287,616           6,748,672
671b      7,168      61    128  1536/512   256 (8, 1), 8 groups (4)   671,026,404,352     37,552,282,624
=======  ======  ======  =====  =========  ========================  =================  ================

``671b`` is the published DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3: 3 dense blocks of ffn 18,432,
58 MoE blocks of 256 experts of width 2,048, vocab 129,280, rms_norm_eps 1e-6, yarn RoPE factor 40 over 4,096
with mscale 1 / mscale_all_dim 1, max_position_embeddings 163,840): 671B total, 37.6B activated (published:
671B / 37B). ``debug`` (tiny, for tests: one dense block then one MoE block, both balancing methods on, aux 0.01) and
``demo`` (no query compression, as DeepSeek-V2-Lite; trains on a CPU) keep the family's switches.
The tensor-parallel plan (``models/deepseek/tp.py``) splits MLA by heads and the MoE experts by hidden units
(``models/common/moe_tp.py``); MoE blocks also take expert parallel (not together with TP).
"""

from __future__ import annotations

from typing import Any

from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.family import FamilySpec, TPPlan
from llmtrain.models.deepseek import hf


def _block_plan(args: TransformerArgs) -> dict[str, Any]:
    from llmtrain.models.deepseek.tp import block_plan  # lazy: imports torch.distributed.tensor

    return block_plan(args)


def _top_plan(args: TransformerArgs, loss_parallel: bool = True) -> dict[str, Any]:
    from llmtrain.models.deepseek.tp import top_plan

    return top_plan(args, loss_parallel)


DEEPSEEK_TP_PLAN = TPPlan(block=_block_plan, top=_top_plan)

_ROUTING = {"router_score": "sigmoid", "route_norm": True, "routed_scaling_factor": 2.5}
_BALANCE = {"bias_update_rate": 0.001, "aux_loss_coef": 0.0001}
YARN_671B = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

DEEPSEEK_V3 = FamilySpec(
    name="deepseek_v3",
    description="DeepSeek-V3: multi-head latent attention, DeepSeekMoE (shared experts, aux-loss-free bias)",
    defaults={"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_interleaved": True, **_ROUTING},
    flavors={
        "debug": {
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "intermediate_size": 128,
            "vocab_size": 512,
            "num_experts": 8,
            "top_k": 2,
            "moe_hidden_size": 32,
            "shared_experts": 1,
            "first_dense_layers": 1,
            "n_group": 2,
            "topk_group": 1,
            "bias_update_rate": 0.001,
            "aux_loss_coef": 0.01,
        },
        "demo": {
            "hidden_size": 256,
            "num_layers": 4,
            "num_heads": 4,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "intermediate_size": 768,
            "vocab_size": 8192,
            "num_experts": 16,
            "top_k": 4,
            "moe_hidden_size": 128,
            "shared_experts": 1,
            "first_dense_layers": 1,
            "n_group": 4,
            "topk_group": 2,
            **_BALANCE,
        },
        "671b": {
            "hidden_size": 7168,
            "num_layers": 61,
            "num_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "intermediate_size": 18432,
            "vocab_size": 129280,
            "num_experts": 256,
            "top_k": 8,
            "moe_hidden_size": 2048,
            "shared_experts": 1,
            "first_dense_layers": 3,
            "n_group": 8,
            "topk_group": 4,
            "rope_scaling": YARN_671B,
            "max_position_embeddings": 163840,
            **_BALANCE,
        },
    },
    hf=hf,
    tp_plan=DEEPSEEK_TP_PLAN,
)

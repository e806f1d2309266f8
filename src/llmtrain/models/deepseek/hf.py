"""Hugging Face adapter for DeepSeek-V3 (``DeepseekV3ForCausalLM``, ``model_type: deepseek_v3``).

Tensors, per block ``model.layers.{i}.`` (ours in ``models/common/mla.py`` and ``moe.py``):

==========================================  =======================================================
Hugging Face                                ours (``layers.{i}.``)
==========================================  =======================================================
``self_attn.q_proj`` (q_lora_rank null)     ``attention.wq``
``self_attn.q_a_proj / q_a_layernorm``      ``attention.wq_a / q_norm``
``self_attn.q_b_proj``                      ``attention.wq_b``
``self_attn.kv_a_proj_with_mqa``            ``attention.wkv_a`` (first kv_lora_rank rows) + ``wk_rope``
``self_attn.kv_a_layernorm / kv_b_proj``    ``attention.kv_norm / wkv_b``
``self_attn.o_proj``                        ``attention.wo``
``mlp.{gate,up,down}_proj`` (dense blocks)  ``feed_forward.w1 / w3 / w2``
``mlp.gate.weight``                         ``feed_forward.router.gate.weight``
``mlp.gate.e_score_correction_bias``        ``feed_forward.router.expert_bias`` (aux-loss-free bias)
``mlp.experts.{e}.{gate,up,down}_proj``     ``feed_forward.experts.w1 / w3 / w2`` [e] (``hf_moe.py``)
``mlp.shared_experts.{gate,up,down}_proj``  ``feed_forward.shared_experts.w1 / w3 / w2``
==========================================  =======================================================

A published checkpoint also holds the multi-token-prediction module(s) as extra layers ``model.layers.{L}...``
(``num_nextn_predict_layers``; their marker is ``eh_proj``); transformers skips them on load and so does the
import here (llmtrain trains the main model; export writes it without MTP weights). Published DeepSeek-V3
weights are FP8 block-quantized (``quantization_config``): refused by name, import the bf16 conversion.

config.json: MLA sizes (``q_lora_rank`` null = no query compression), ``rope_interleave`` (default true,
adjacent rotary pairs), yarn ``rope_scaling`` with ``mscale`` / ``mscale_all_dim`` (the softmax scale),
``n_routed_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``n_shared_experts``,
``routed_scaling_factor``, ``n_group`` / ``topk_group``, ``norm_topk_prob``, ``first_k_dense_replace``.
transformers always routes with sigmoid scores plus the correction bias (``scoring_func`` / ``topk_method``
are not read) and ignores the training-only ``aux_loss_alpha`` / ``seq_aux``; so does this import. Refused:
``attention_bias`` true, ``num_key_value_heads`` other than ``num_attention_heads`` (the class builds every
head's keys from the latent). Absent keys take ``DeepseekV3Config``'s defaults (the 671B sizes).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.hf_adapter import LLAMA_LAYER, rename_from_hf, rename_to_hf, row_blocks
from llmtrain.models.common.hf_config import ConfigReader, HFDefaults, common_args_from_hf, common_hf_config
from llmtrain.models.common.hf_moe import MoENames, adding, check_routing, moe_from_hf, moe_to_hf

ARCHITECTURE = "DeepseekV3ForCausalLM"
KEEP_FP32 = ("mlp.gate.e_score_correction_bias",)
"""Exported in fp32 whatever ``--dtype`` (hf_io.save_hf): DeepSeek's checkpoints keep the router's correction
bias in fp32, and a bias moved in steps of ``bias_update_rate`` (0.001) would not survive bf16's 8 bits."""
NAMES = MoENames(ARCHITECTURE, shared="shared_experts", expert_bias="gate.e_score_correction_bias")
_FUSED = "attention.wkv_a_rope.weight"  # transient: wkv_a and wk_rope stacked as HF stores them
LAYER: dict[str, str] = {
    **{k: v for k, v in LLAMA_LAYER.items() if not k.startswith("attention.")},
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    _FUSED: "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
# DeepseekV3Config's values for absent keys (the published 671B model).
MOE_DEFAULTS = {
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
}
MLA_DEFAULTS = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64}
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
_fuse, _split = row_blocks(  # [kv_lora_rank + rope, hidden]
    _FUSED,
    ("attention.wkv_a.weight", "attention.wk_rope.weight"),
    lambda a: [a.kv_lora_rank, a.qk_rope_head_dim],
)


def _without_mtp(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """``sd`` without the multi-token-prediction layers (index >= num_layers, marked by ``eh_proj``)."""
    mtp = set()
    for key in sd:
        m = _HF_LAYER_KEY.match(key)
        if m and int(m.group(1)) >= args.num_layers and key.endswith(".eh_proj.weight"):
            mtp.add(m.group(0))
    return {k: v for k, v in sd.items() if not k.startswith(tuple(mtp))} if mtp else sd


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """HF ``DeepseekV3ForCausalLM`` state dict (per-expert or transformers 5's fused experts) -> ours."""
    ours, rest = moe_from_hf(_without_mtp(sd, args), args, NAMES)
    return rename_from_hf(rest, LAYER, adding(ours, _split), args)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF ``DeepseekV3ForCausalLM`` names (one tensor per expert, as the Hub stores them)."""
    moe, rest = moe_to_hf(sd, args, NAMES)
    return {**rename_to_hf(rest, LAYER, _fuse, args), **moe}


def to_hf_config(args: TransformerArgs) -> dict[str, Any]:
    """config.json content that ``transformers.DeepseekV3Config`` loads (a dense model: every block dense)."""
    if args.num_experts:
        check_routing(args, ARCHITECTURE, scaled_groups=True)
    wrong = []
    if not args.kv_lora_rank or args.position_embedding != "rope" or args.norm_head or args.mlp_bias:
        wrong.append("multi-head latent attention (kv_lora_rank > 0) with RoPE, no norm_head / mlp_bias")
    if args.num_experts and (
        args.moe_every != 1 or args.router_score != "sigmoid" or not args.shared_experts
    ):
        wrong.append("MoE in every block past first_dense_layers, a sigmoid router and shared experts")
    if args.capacity_factor is not None or args.sliding_window or args.tie_word_embeddings:
        wrong.append("no capacity factor (token drops), sliding window or tied embeddings")
    if wrong:
        raise ConfigError(f"{ARCHITECTURE} needs {'; '.join(wrong)}; this model differs.")
    d = common_hf_config(args, ARCHITECTURE, "deepseek_v3")
    dense = args.num_experts == 0
    d.update(
        q_lora_rank=args.q_lora_rank or None,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        rope_interleave=args.rope_interleaved,
        attention_bias=False,
        first_k_dense_replace=args.num_layers if dense else args.first_dense_layers,
        n_routed_experts=1 if dense else args.num_experts,
        num_experts_per_tok=1 if dense else args.top_k,
        moe_intermediate_size=args.moe_hidden_size or args.intermediate_size,
        n_shared_experts=args.shared_experts or 1,
        routed_scaling_factor=args.routed_scaling_factor,
        n_group=args.n_group,
        topk_group=args.topk_group,
        norm_topk_prob=args.route_norm,
        num_nextn_predict_layers=0,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )
    return d


def args_from_hf_config(d: dict[str, Any], source: str = "config.json") -> TransformerArgs:
    """TransformerArgs of a HF ``deepseek_v3`` config.json (see the module docstring)."""
    r = ConfigReader(d, source)
    if d.get("model_type", "deepseek_v3") != "deepseek_v3":
        raise CheckpointError(f"{source}: model_type {d.get('model_type')!r} is not deepseek_v3.")
    if r.bool("attention_bias", False):
        raise ConfigError(
            f"{source}: attention_bias is true (biases on q_a_proj, kv_a_proj_with_mqa and o_proj); llmtrain's "
            "multi-head latent attention has no biases, so this model is refused."
        )
    heads, layers = r.int("num_attention_heads"), r.int("num_hidden_layers")
    kv = r.int("num_key_value_heads", 128) if d.get("num_key_value_heads") is not None else heads
    if kv != heads:
        raise ConfigError(
            f"{source}: num_key_value_heads {kv} differs from num_attention_heads {heads}; DeepseekV3Attention "
            "builds keys for every head from the latent, so the two must be equal."
        )
    no_q_lora = "q_lora_rank" in d and d["q_lora_rank"] is None  # null: one query projection (q_proj)
    mla = {
        k: 0 if k == "q_lora_rank" and no_q_lora else r.int(k, v, minimum=0 if k == "qk_nope_head_dim" else 1)
        for k, v in MLA_DEFAULTS.items()
    }
    mla["v_head_dim"] = r.int("v_head_dim", 128)
    moe = {k: r.int(k, v, minimum=0 if k == "first_k_dense_replace" else 1) for k, v in MOE_DEFAULTS.items()}
    experts, groups = moe["n_routed_experts"], moe["n_group"]
    if moe["first_k_dense_replace"] >= layers:  # no MoE block: a dense model
        routing: dict[str, Any] = {"num_experts": 0}
    else:
        if experts % groups or experts // groups < 2 or moe["topk_group"] > groups:
            raise CheckpointError(
                f"{source}: n_routed_experts {experts}, n_group {groups}, topk_group {moe['topk_group']}: the "
                "groups must split the experts evenly into groups of at least 2, with topk_group <= n_group."
            )
        routing = {
            "num_experts": experts,
            "top_k": moe["num_experts_per_tok"],
            "moe_hidden_size": moe["moe_intermediate_size"],
            "shared_experts": moe["n_shared_experts"],
            "first_dense_layers": moe["first_k_dense_replace"],
            "n_group": groups,
            "topk_group": moe["topk_group"],
            "routed_scaling_factor": r.number("routed_scaling_factor", 2.5),
            "route_norm": r.bool("norm_topk_prob", True),
        }
    defaults = HFDefaults(
        rms_norm_eps=1e-6,
        head_dim=mla["qk_rope_head_dim"],
        num_key_value_heads=heads,
        max_position_embeddings=4096,
    )
    # transformers sets head_dim = qk_rope_head_dim whatever the file says (the rotary width)
    values = {**d, "head_dim": mla["qk_rope_head_dim"], "num_key_value_heads": heads}
    fixed: dict[str, Any] = {
        "rope_interleaved": r.bool("rope_interleave", True),
        "router_score": "sigmoid",
        **mla,
        **routing,
    }
    return common_args_from_hf(values, "deepseek_v3", defaults, source, **fixed)

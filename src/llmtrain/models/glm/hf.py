"""Hugging Face adapter for GLM-4 (``GlmForCausalLM``, ``model_type: glm``, as in THUDM/glm-4-9b-hf) and
GLM-4-0414 (``Glm4ForCausalLM``, ``model_type: glm4``, THUDM/GLM-4-9B-0414), which is the same model with two
more RMSNorms per block (``post_self_attn_layernorm``, ``post_mlp_layernorm`` -> our ``attention_post_norm``,
``ffn_post_norm``; ``post_norms`` true) and ``Glm4Config``'s defaults (the same as ``GlmConfig``'s).

The checkpoint stores the MLP's gate and up projections as one ``mlp.gate_up_proj`` ``[2 * ffn, hidden]``
(gate rows first); we keep them apart as ``w1`` (gate) and ``w3`` (up) so a column-wise TP plan can shard
them. Everything else is a rename; the interleaved partial RoPE is the same arithmetic on both sides.
``attention_bias`` (default true) is the q/k/v bias (GLM's o_proj has none). Absent keys take ``GlmConfig``'s
defaults: head_dim 128, 2 key/value heads, partial_rotary_factor 0.5, rms_norm_eps 1.5625e-7,
max_position_embeddings 131,072, rope_theta 10,000.
"""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.errors import ConfigError
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.hf_adapter import LLAMA_LAYER, rename_from_hf, rename_to_hf, row_blocks
from llmtrain.models.common.hf_config import ConfigReader, HFDefaults, common_args_from_hf, common_hf_config

DEFAULTS = HFDefaults(
    rms_norm_eps=1.5625e-07,
    head_dim=128,
    num_key_value_heads=2,
    max_position_embeddings=131072,
    partial_rotary_factor=0.5,
)

_FUSED = "feed_forward.w13.weight"
GLM_LAYER = {
    k: v for k, v in LLAMA_LAYER.items() if k not in ("feed_forward.w1.weight", "feed_forward.w3.weight")
}
GLM_LAYER[_FUSED] = "mlp.gate_up_proj.weight"
GLM_LAYER["attention_post_norm.weight"] = "post_self_attn_layernorm.weight"
GLM_LAYER["ffn_post_norm.weight"] = "post_mlp_layernorm.weight"
_fuse, _split = row_blocks(_FUSED, ("feed_forward.w1.weight", "feed_forward.w3.weight"))  # [ffn, hidden] each


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """HF ``GlmForCausalLM`` state dict -> ours (``gate_up_proj`` split into w1, w3)."""
    return rename_from_hf(sd, GLM_LAYER, _split, args)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF ``GlmForCausalLM`` names (w1, w3 concatenated into ``gate_up_proj``)."""
    return rename_to_hf(sd, GLM_LAYER, _fuse, args)


def to_hf_config(args: TransformerArgs) -> dict[str, Any]:
    """config.json content that ``transformers.GlmConfig`` (or, with ``post_norms``, ``Glm4Config``) loads."""
    if args.qk_norm or args.norm_head or args.position_embedding != "rope" or not args.rope_interleaved:
        raise ConfigError("GlmForCausalLM needs interleaved RoPE and no qk_norm / norm_head / alibi.")
    if args.attention_out_bias or args.mlp_bias:
        raise ConfigError("GlmForCausalLM has no o_proj or MLP bias (attention_out_bias / mlp_bias).")
    if args.num_experts or args.sliding_window:
        raise ConfigError("GlmForCausalLM / Glm4ForCausalLM are dense, without a sliding window.")
    arch, model_type = ("Glm4ForCausalLM", "glm4") if args.post_norms else ("GlmForCausalLM", "glm")
    d = common_hf_config(args, arch, model_type)
    d.update(attention_bias=args.qkv_bias, partial_rotary_factor=args.partial_rotary_factor)
    return d


def args_from_hf_config(d: dict[str, Any], source: str = "config.json") -> TransformerArgs:
    """TransformerArgs of a HF ``glm`` or ``glm4`` (GLM-4-0414: post norms) config.json."""
    bias = ConfigReader(d, source).bool("attention_bias", True)
    post = d.get("model_type") == "glm4"
    return common_args_from_hf(
        d, "glm4", DEFAULTS, source, whole_heads=False, qkv_bias=bias, rope_interleaved=True, post_norms=post
    )

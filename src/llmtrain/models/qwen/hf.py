"""Hugging Face adapter for Qwen2 (``Qwen2ForCausalLM``) and Qwen3 (``Qwen3ForCausalLM``).

The tensor names are Llama's plus ``self_attn.{q,k}_norm`` for Qwen3; ``args.family`` picks the config class.
Qwen2's q/k/v biases are fixed in its architecture (transformers ignores ``attention_bias`` for it); Qwen3's
``attention_bias`` puts biases on q, k, v and o_proj (our ``qkv_bias`` + ``attention_out_bias``). Both refuse
an active sliding window (``use_sliding_window``). Absent keys take ``Qwen2Config`` / ``Qwen3Config``'s
defaults: 32 key/value heads, max_position_embeddings 32,768, rope_theta 10,000, and for Qwen3 head_dim 128.
"""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.hf_adapter import LLAMA_LAYER, rename_from_hf, rename_to_hf
from llmtrain.models.common.hf_config import ConfigReader, HFDefaults, common_args_from_hf, common_hf_config

QWEN2_DEFAULTS = HFDefaults(num_key_value_heads=32, max_position_embeddings=32768)
QWEN3_DEFAULTS = HFDefaults(num_key_value_heads=32, max_position_embeddings=32768, head_dim=128)


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """HF Qwen2/Qwen3 state dict -> ours."""
    return rename_from_hf(sd, LLAMA_LAYER, None, args)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF Qwen2/Qwen3 names (same tensors)."""
    return rename_to_hf(sd, LLAMA_LAYER, None, args)


def to_hf_config(args: TransformerArgs) -> dict[str, Any]:
    """config.json content for ``transformers.Qwen2Config`` or ``Qwen3Config`` (by ``args.family``)."""
    unsupported = args.norm_head or args.position_embedding != "rope" or args.rope_interleaved
    unsupported = unsupported or args.partial_rotary_factor != 1.0 or args.mlp_bias
    if args.family == "qwen2":
        if unsupported or not args.qkv_bias or args.qk_norm or args.attention_out_bias:
            raise ConfigError(
                "Qwen2ForCausalLM needs qkv_bias true, qk_norm / attention_out_bias / mlp_bias false and "
                "whole-head half-rotation RoPE."
            )
        d = common_hf_config(args, "Qwen2ForCausalLM", "qwen2")
        d.update(use_sliding_window=False, max_window_layers=args.num_layers)
        return d
    if unsupported or not args.qk_norm or args.qkv_bias != args.attention_out_bias:
        raise ConfigError(
            "Qwen3ForCausalLM needs qk_norm true, qkv_bias equal to attention_out_bias (its attention_bias), "
            "no mlp_bias and whole-head half-rotation RoPE."
        )
    d = common_hf_config(args, "Qwen3ForCausalLM", "qwen3")
    d.update(attention_bias=args.qkv_bias, use_sliding_window=False, max_window_layers=args.num_layers)
    return d


def args_from_hf_config(d: dict[str, Any], source: str = "config.json") -> TransformerArgs:
    """TransformerArgs of a HF Qwen2 or Qwen3 config.json (``model_type`` decides which)."""
    model_type = d.get("model_type", "qwen2")
    if model_type == "qwen3":
        bias = ConfigReader(d, source).bool("attention_bias", False)
        return common_args_from_hf(
            d,
            "qwen3",
            QWEN3_DEFAULTS,
            source,
            sliding=True,
            qk_norm=True,
            qkv_bias=bias,
            attention_out_bias=bias,
        )
    if model_type != "qwen2":
        raise CheckpointError(f"{source}: model_type {model_type!r} is neither qwen2 nor qwen3.")
    return common_args_from_hf(d, "qwen2", QWEN2_DEFAULTS, source, sliding=True, qkv_bias=True)

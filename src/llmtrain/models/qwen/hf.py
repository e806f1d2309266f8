"""Hugging Face adapter for Qwen2 (``Qwen2ForCausalLM``) and Qwen3 (``Qwen3ForCausalLM``).

The tensor names are Llama's plus ``self_attn.{q,k}_norm`` for Qwen3; ``args.family`` picks the config class.
Qwen2's q/k/v biases are fixed in its architecture; Qwen3's ``attention_bias`` would also add an ``o_proj``
bias, which we do not have, so only ``attention_bias: false`` converts.
"""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.errors import ConfigError
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.hf_adapter import (
    LLAMA_LAYER,
    common_args_from_hf,
    common_hf_config,
    rename_from_hf,
    rename_to_hf,
)


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """HF Qwen2/Qwen3 state dict -> ours."""
    return rename_from_hf(sd, LLAMA_LAYER, None, args)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF Qwen2/Qwen3 names (same tensors)."""
    return rename_to_hf(sd, LLAMA_LAYER, None, args)


def to_hf_config(args: TransformerArgs) -> dict[str, Any]:
    """config.json content for ``transformers.Qwen2Config`` or ``Qwen3Config`` (by ``args.family``)."""
    unsupported = args.norm_head or args.position_embedding != "rope" or args.rope_interleaved
    unsupported = unsupported or args.partial_rotary_factor != 1.0
    if args.family == "qwen2":
        if unsupported or not args.qkv_bias or args.qk_norm:
            raise ConfigError(
                "Qwen2ForCausalLM needs qkv_bias true, qk_norm false, whole-head half-rotation RoPE."
            )
        d = common_hf_config(args, "Qwen2ForCausalLM", "qwen2")
        d.update(use_sliding_window=False, max_window_layers=args.num_layers)
        return d
    if unsupported or args.qkv_bias or not args.qk_norm:
        raise ConfigError(
            "Qwen3ForCausalLM needs qk_norm true, qkv_bias false, whole-head half-rotation RoPE."
        )
    d = common_hf_config(args, "Qwen3ForCausalLM", "qwen3")
    d.update(attention_bias=False, use_sliding_window=False, max_window_layers=args.num_layers)
    return d


def args_from_hf_config(d: dict[str, Any]) -> TransformerArgs:
    """TransformerArgs of a HF Qwen2 or Qwen3 config.json (``model_type`` decides which)."""
    model_type = d.get("model_type", "qwen2")
    if d.get("use_sliding_window"):
        raise ConfigError(
            "config.json enables use_sliding_window, which llmtrain's attention does not implement."
        )
    if model_type == "qwen3":
        if d.get("attention_bias"):
            raise ConfigError(
                "config.json sets attention_bias (with an o_proj bias), which Qwen3 here lacks."
            )
        return common_args_from_hf(d, "qwen3", 1000000.0, qk_norm=True)
    if model_type != "qwen2":
        raise ConfigError(f"config.json model_type {model_type!r} is neither qwen2 nor qwen3.")
    return common_args_from_hf(d, "qwen2", 1000000.0, qkv_bias=True)

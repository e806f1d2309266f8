"""Hugging Face adapter for Mistral (``MistralForCausalLM``, ``model_type: mistral``).

Llama's tensor names and arithmetic (no biases, whole-head half-rotation RoPE) plus ``sliding_window``, which
transformers applies to every layer when it is not null (``MistralConfig`` defaults it to 4,096 when the key
is absent; Mistral-7B-v0.1 sets 4,096, v0.3 null). Absent keys take ``MistralConfig``'s defaults:
rms_norm_eps 1e-6, 8 key/value heads, max_position_embeddings 131,072, rope_theta 10,000; ``head_dim`` is
honoured when given.
"""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.errors import ConfigError
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.hf_adapter import LLAMA_LAYER, rename_from_hf, rename_to_hf
from llmtrain.models.common.hf_config import HFDefaults, common_args_from_hf, common_hf_config

DEFAULTS = HFDefaults(rms_norm_eps=1e-6, num_key_value_heads=8, max_position_embeddings=131072)


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """HF ``MistralForCausalLM`` state dict -> ours."""
    return rename_from_hf(sd, LLAMA_LAYER, None, args)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF ``MistralForCausalLM`` names (same tensors)."""
    return rename_to_hf(sd, LLAMA_LAYER, None, args)


def check_exportable(args: TransformerArgs, architecture: str) -> None:
    """ConfigError unless ``args`` is a plain Llama-shaped model with at most a window on every layer (what
    Mistral / Mixtral express)."""
    odd = [
        name
        for name, value in (
            ("qkv_bias", args.qkv_bias),
            ("attention_out_bias", args.attention_out_bias),
            ("mlp_bias", args.mlp_bias),
            ("qk_norm", args.qk_norm),
            ("norm_head", args.norm_head),
            ("post_norms", args.post_norms),
            ("rope_interleaved", args.rope_interleaved),
            ("position_embedding alibi", args.position_embedding != "rope"),
            ("partial_rotary_factor", args.partial_rotary_factor != 1.0),
            ("sliding_window_layers", args.sliding_window_layers is not None),
        )
        if value
    ]
    if odd:
        raise ConfigError(
            f"{architecture} has no biases, QK-norm, NormHead, post-norms, ALiBi or partial/interleaved RoPE and "
            f"applies sliding_window to every layer; this model sets {', '.join(odd)}. Export it with the family "
            "that has them."
        )


def to_hf_config(args: TransformerArgs) -> dict[str, Any]:
    """config.json content that ``transformers.MistralConfig`` loads."""
    check_exportable(args, "MistralForCausalLM")
    if args.num_experts:
        raise ConfigError("MistralForCausalLM is dense; an MoE model of this shape is model_type: mixtral.")
    d = common_hf_config(args, "MistralForCausalLM", "mistral")
    d["sliding_window"] = args.sliding_window or None
    return d


def args_from_hf_config(d: dict[str, Any], source: str = "config.json") -> TransformerArgs:
    """TransformerArgs of a HF Mistral config.json."""
    return common_args_from_hf(d, "mistral", DEFAULTS, source, sliding="all")

"""Hugging Face adapter for Llama 3 (``LlamaForCausalLM``, also SmolLM2 and other ``model_type: llama``):
state-dict renames and config.json.

Our attention keeps the Hugging Face RoPE layout (rotate halves), so the q/k weights need no permutation:
the conversion is a rename table and the round trip returns the very same tensors. ``attention_bias`` puts
biases on q, k, v and o_proj (our ``qkv_bias`` + ``attention_out_bias``), ``mlp_bias`` on the three MLP
projections; both are imported and exported. Defaults of absent keys are ``LlamaConfig``'s (rms_norm_eps
1e-6, max_position_embeddings 2048, rope_theta 10,000); ``models/common/hf_config.py`` has the whole list.
"""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.errors import ConfigError
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.hf_adapter import LLAMA_LAYER, rename_from_hf, rename_to_hf
from llmtrain.models.common.hf_config import ConfigReader, HFDefaults, common_args_from_hf, common_hf_config

DEFAULTS = HFDefaults(rms_norm_eps=1e-6, max_position_embeddings=2048)


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """HF ``LlamaForCausalLM`` state dict -> ours."""
    return rename_from_hf(sd, LLAMA_LAYER, None, args)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF ``LlamaForCausalLM`` names (same tensors)."""
    return rename_to_hf(sd, LLAMA_LAYER, None, args)


def to_hf_config(args: TransformerArgs) -> dict[str, Any]:
    """config.json content that ``transformers.LlamaConfig`` loads."""
    if args.qk_norm or args.norm_head or args.position_embedding != "rope" or args.rope_interleaved:
        raise ConfigError(
            "this model uses qk_norm, norm_head, alibi or interleaved RoPE, which LlamaForCausalLM cannot "
            "express; export it with its own family."
        )
    if args.qkv_bias != args.attention_out_bias:
        raise ConfigError(
            "LlamaForCausalLM's attention_bias puts biases on q, k, v and o_proj together; this model has "
            f"qkv_bias {args.qkv_bias} and attention_out_bias {args.attention_out_bias}."
        )
    if args.partial_rotary_factor != 1.0:
        raise ConfigError("LlamaForCausalLM rotates whole heads; model.partial_rotary_factor must be 1.")
    d = common_hf_config(args, "LlamaForCausalLM", "llama")
    d.update(attention_bias=args.qkv_bias, mlp_bias=args.mlp_bias)
    return d


def args_from_hf_config(d: dict[str, Any], source: str = "config.json") -> TransformerArgs:
    """TransformerArgs of a HF Llama config.json (``attention_bias``: q/k/v/o biases; ``mlp_bias``)."""
    r = ConfigReader(d, source)
    bias = r.bool("attention_bias", False)
    return common_args_from_hf(
        d,
        "llama3",
        DEFAULTS,
        source,
        qkv_bias=bias,
        attention_out_bias=bias,
        mlp_bias=r.bool("mlp_bias", False),
    )

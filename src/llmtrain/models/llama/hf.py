"""Hugging Face adapter for Llama 3 (``LlamaForCausalLM``): state-dict renames and config.json.

Our attention keeps the Hugging Face RoPE layout (rotate halves), so the q/k weights need no permutation:
the conversion is a rename table and the round trip returns the very same tensors.
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
    """HF ``LlamaForCausalLM`` state dict -> ours."""
    return rename_from_hf(sd, LLAMA_LAYER, None, args)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF ``LlamaForCausalLM`` names (same tensors)."""
    return rename_to_hf(sd, LLAMA_LAYER, None, args)


def to_hf_config(args: TransformerArgs) -> dict[str, Any]:
    """config.json content that ``transformers.LlamaConfig`` loads."""
    if (
        args.qkv_bias
        or args.qk_norm
        or args.norm_head
        or args.position_embedding != "rope"
        or args.rope_interleaved
    ):
        raise ConfigError(
            "this model uses qkv_bias, qk_norm, norm_head, alibi or interleaved RoPE, which LlamaForCausalLM "
            "cannot express (its attention_bias also adds an o_proj bias); export it with its own family."
        )
    if args.partial_rotary_factor != 1.0:
        raise ConfigError("LlamaForCausalLM rotates whole heads; model.partial_rotary_factor must be 1.")
    d = common_hf_config(args, "LlamaForCausalLM", "llama")
    d.update(attention_bias=False, mlp_bias=False)
    return d


def args_from_hf_config(d: dict[str, Any]) -> TransformerArgs:
    """TransformerArgs of a HF Llama config.json (attention_bias / mlp_bias are not supported)."""
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ConfigError(
            "config.json sets attention_bias or mlp_bias, which our Llama does not have (it has no o_proj or "
            "MLP biases); such checkpoints cannot be imported as llama3."
        )
    return common_args_from_hf(d, "llama3", 10000.0)

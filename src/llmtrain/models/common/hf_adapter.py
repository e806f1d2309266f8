"""Shared machinery of the Hugging Face state-dict and config adapters (``models/<family>/hf.py``).

All supported families store a checkpoint as ``model.embed_tokens``, ``model.layers.{i}.self_attn.*``,
``model.layers.{i}.mlp.*``, two layer norms, ``model.norm`` and ``lm_head``; they differ in a few fused
tensors. A family adapter therefore gives only a rename table for the per-layer tensors plus optional
``fuse``/``split`` hooks (GLM-4's ``gate_up_proj``, Baichuan's ``W_pack``), and this module does the rest:
renaming, tied-embedding handling, and a completeness check that names what is missing or unexpected.

Conversions are pure renames, concatenations and splits (no arithmetic), so a round trip returns the very
same tensors. Config helpers read RoPE settings in both the transformers 4.x spelling (``rope_theta`` +
``rope_scaling``) and the 5.x spelling (``rope_parameters``); exported configs use the 4.x spelling, which
both versions load.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from llmtrain.errors import CheckpointError
from llmtrain.models.common.args import TransformerArgs

TOP_LEVEL: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

LLAMA_LAYER: dict[str, str] = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}

_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_IGNORED = ("rotary_emb.inv_freq",)

StateDict = dict[str, torch.Tensor]
FuseHook = Callable[[StateDict, TransformerArgs], StateDict]


def expected_keys(args: TransformerArgs) -> set[str]:
    """Our state-dict keys for ``args`` (from a meta-device build, so nothing is allocated)."""
    from llmtrain.models.common.transformer import Transformer

    with torch.device("meta"):
        return set(Transformer(args).state_dict().keys())


def rename_to_hf(
    sd: StateDict, layer_map: dict[str, str], fuse: FuseHook | None, args: TransformerArgs
) -> StateDict:
    """Our names -> HF names; ``fuse`` first merges tensors that HF stores fused (it edits a copy)."""
    sd = fuse(dict(sd), args) if fuse is not None else dict(sd)
    out: StateDict = {}
    for key, tensor in sd.items():
        match = _OURS_LAYER.match(key)
        if match and match.group(2) in layer_map:
            out[f"model.layers.{match.group(1)}.{layer_map[match.group(2)]}"] = tensor
        elif key in TOP_LEVEL:
            out[TOP_LEVEL[key]] = tensor
        else:
            raise CheckpointError(
                f"state dict key {key!r} has no Hugging Face name for family {args.family!r}."
            )
    return out


def rename_from_hf(
    sd: StateDict, layer_map: dict[str, str], split: FuseHook | None, args: TransformerArgs
) -> StateDict:
    """HF names -> our names; ``split`` then unfuses tensors; checks the result against ``args``."""
    inverse_layer = {hf: ours for ours, hf in layer_map.items()}
    inverse_top = {hf: ours for ours, hf in TOP_LEVEL.items()}
    out: StateDict = {}
    unexpected: list[str] = []
    for key, tensor in sd.items():
        match = _HF_LAYER.match(key)
        if key.endswith(_HF_IGNORED):
            continue
        if match and match.group(2) in inverse_layer:
            out[f"layers.{match.group(1)}.{inverse_layer[match.group(2)]}"] = tensor
        elif key in inverse_top:
            out[inverse_top[key]] = tensor
        else:
            unexpected.append(key)
    if split is not None:
        out = split(out, args)
    if args.tie_word_embeddings and "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    missing = sorted(expected_keys(args) - out.keys())
    if unexpected or missing:
        raise CheckpointError(
            f"the Hugging Face state dict does not match a {args.family} model with these arguments: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}. Check that config.json belongs to the "
            "weights and that the family is right."
        )
    return out


def rope_from_hf_config(
    d: dict[str, Any], default_theta: float
) -> tuple[float, dict[str, Any] | None, float]:
    """``(rope_theta, rope_scaling or None, partial_rotary_factor)`` from a 4.x or 5.x config dict."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", default_theta)))
    partial = float(params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default" or not params:
        return theta, None, partial
    params["rope_type"] = kind
    params.pop("type", None)
    return theta, params, partial


def common_hf_config(args: TransformerArgs, architecture: str, model_type: str) -> dict[str, Any]:
    """The config.json keys every supported family shares (4.x spelling of RoPE)."""
    d: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.seq_length,
        "rms_norm_eps": args.rms_norm_eps,
        "initializer_range": args.init_std,
        "tie_word_embeddings": args.tie_word_embeddings,
        "rope_theta": args.rope_theta,
        "pad_token_id": None,  # token ids belong to the tokenizer; the exporter may fill them in
    }
    if args.rope_scaling:
        d["rope_scaling"] = dict(args.rope_scaling)
        original = args.rope_scaling.get("original_max_position_embeddings")
        if original:  # the scaled context is what HF calls max_position_embeddings (Llama 3.1: 8192 * 16)
            d["max_position_embeddings"] = max(args.seq_length, int(original * args.rope_scaling["factor"]))
    return d


def common_args_from_hf(
    d: dict[str, Any], family: str, default_theta: float, **fixed: Any
) -> TransformerArgs:
    """TransformerArgs from the shared config.json keys; ``fixed`` sets the family's own switches."""
    try:
        heads = int(d["num_attention_heads"])
        theta, scaling, partial = rope_from_hf_config(d, default_theta)
        values: dict[str, Any] = {
            "family": family,
            "flavor": None,
            "hidden_size": int(d["hidden_size"]),
            "num_layers": int(d["num_hidden_layers"]),
            "num_heads": heads,
            "num_kv_heads": int(d.get("num_key_value_heads") or heads),
            "head_dim": int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            "intermediate_size": int(d["intermediate_size"]),
            "vocab_size": int(d["vocab_size"]),
            "seq_length": int(d.get("max_position_embeddings") or d.get("model_max_length") or 2048),
            "rms_norm_eps": float(d.get("rms_norm_eps", 1e-6)),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "partial_rotary_factor": partial,
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
            "init_std": float(d.get("initializer_range", 0.02)),
        }
    except KeyError as exc:
        raise CheckpointError(
            f"Hugging Face config.json lacks the key {exc.args[0]!r} needed for {family}."
        ) from None
    values.update(fixed)
    return TransformerArgs(**values)

"""Shared machinery of the Hugging Face state-dict and config adapters (``models/<family>/hf.py``).

All supported families store a checkpoint as ``model.embed_tokens``, ``model.layers.{i}.self_attn.*``,
``model.layers.{i}.mlp.*``, two layer norms, ``model.norm`` and ``lm_head``; they differ in a few fused
tensors. A family adapter therefore gives only a rename table for the per-layer tensors plus optional
``fuse``/``split`` hooks (GLM-4's ``gate_up_proj``, Baichuan's ``W_pack``), and this module does the rest:
renaming, tied-embedding handling, and a completeness check that names what is missing or unexpected. A fused
tensor that is row blocks of ours stacked along dim 0 (GLM-4's ``gate_up_proj`` = w1, w3; DeepSeek-V3's
``kv_a_proj_with_mqa`` = wkv_a, wk_rope) gets its pair of hooks from :func:`row_blocks`.

Conversions are pure renames, concatenations and splits (no arithmetic), so a round trip returns the very
same tensors. config.json is read and written by ``models/common/hf_config.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

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
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w1.bias": "mlp.gate_proj.bias",
    "feed_forward.w2.bias": "mlp.down_proj.bias",
    "feed_forward.w3.bias": "mlp.up_proj.bias",
}

_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_IGNORED = ("rotary_emb.inv_freq",)

StateDict = dict[str, torch.Tensor]
FuseHook = Callable[[StateDict, TransformerArgs], StateDict]


def row_blocks(
    fused: str, parts: tuple[str, ...], rows: Callable[[TransformerArgs], list[int]] | None = None
) -> tuple[FuseHook, FuseHook]:
    """``(fuse, split)`` hooks for a tensor that HF stores as the row blocks of several of ours stacked along
    dim 0. ``fused`` and ``parts`` are names inside a block (``layers.{i}.`` omitted), ``parts`` in HF's row
    order; ``rows(args)`` gives each part's row count (None: equal parts). ``fuse`` concatenates the parts of
    every block that has the first one; ``split`` cuts every fused tensor back (views, no copy)."""

    def fuse(sd: StateDict, args: TransformerArgs) -> StateDict:
        for key in [k for k in sd if (m := _OURS_LAYER.match(k)) and m.group(2) == parts[0]]:
            prefix = key[: -len(parts[0])]
            sd[prefix + fused] = torch.cat([sd.pop(prefix + p) for p in parts], dim=0)
        return sd

    def split(sd: StateDict, args: TransformerArgs) -> StateDict:
        for key in [k for k in sd if (m := _OURS_LAYER.match(k)) and m.group(2) == fused]:
            prefix, tensor = key[: -len(fused)], sd.pop(key)
            blocks = tensor.chunk(len(parts), dim=0) if rows is None else tensor.split(rows(args), dim=0)
            sd.update({prefix + p: b for p, b in zip(parts, blocks, strict=True)})
        return sd

    return fuse, split


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
    if args.tie_word_embeddings and "tok_embeddings.weight" in out:
        # tied: the output matrix is the embedding (hf_io refuses a stored lm_head.weight that differs)
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

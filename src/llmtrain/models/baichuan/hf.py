"""Hugging Face adapter for Baichuan 2 (``BaichuanForCausalLM``, remote code of baichuan-inc/Baichuan2-*).

The checkpoint packs q, k and v into ``self_attn.W_pack`` ``[3 * hidden, hidden]`` (q rows, then k, then
v); we keep ``wq/wk/wv`` apart for tensor parallelism. ``lm_head.weight`` is the raw NormHead weight (its rows
are normalised in the forward on both sides). The 7B and 13B modeling files differ (RoPE vs ALiBi) but their
configs do not say so: we write ``position_embedding`` into config.json ourselves and, reading a config
without it, take ALiBi when it lacks ``max_position_embeddings`` (as the 13B config does).
There is no transformers class to test parity against (the model is remote code), so only the renames and
the round trip are tested.
"""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.hf_adapter import LLAMA_LAYER, rename_from_hf, rename_to_hf, row_blocks
from llmtrain.models.common.hf_config import ConfigReader, HFDefaults, common_args_from_hf

_PACKED = "attention.wqkv.weight"
BAICHUAN_LAYER = {
    k: v for k, v in LLAMA_LAYER.items() if not k.startswith("attention.w") or k.startswith("attention.wo")
}
BAICHUAN_LAYER[_PACKED] = "self_attn.W_pack.weight"


def _qkv_rows(args: TransformerArgs) -> list[int]:
    q_rows, kv_rows = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    return [q_rows, kv_rows, kv_rows]


_fuse, _split = row_blocks(
    _PACKED, ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"), _qkv_rows
)


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """HF ``BaichuanForCausalLM`` state dict -> ours (``W_pack`` split into wq, wk, wv)."""
    return rename_from_hf(sd, BAICHUAN_LAYER, _split, args)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF ``BaichuanForCausalLM`` names (wq, wk, wv stacked into ``W_pack``)."""
    return rename_to_hf(sd, BAICHUAN_LAYER, _fuse, args)


def to_hf_config(args: TransformerArgs) -> dict[str, Any]:
    """config.json content in the layout of Baichuan 2's own configs (``model_type: baichuan``)."""
    if args.qkv_bias or args.qk_norm or not args.norm_head or args.num_kv_heads != args.num_heads:
        raise ConfigError("BaichuanForCausalLM has no qkv bias, qk_norm or GQA and always uses a NormHead.")
    if args.position_embedding == "rope" and (args.rope_scaling or args.partial_rotary_factor != 1.0):
        raise ConfigError("BaichuanForCausalLM rotates whole heads without RoPE scaling.")
    d: dict[str, Any] = {
        "architectures": ["BaichuanForCausalLM"],
        "model_type": "baichuan",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "hidden_act": "silu",
        "model_max_length": args.seq_length,
        "rms_norm_eps": args.rms_norm_eps,
        "initializer_range": args.init_std,
        "tie_word_embeddings": args.tie_word_embeddings,
        "position_embedding": args.position_embedding,
    }
    if args.position_embedding == "rope":
        d["max_position_embeddings"] = args.seq_length
        d["rope_theta"] = args.rope_theta
    return d


def args_from_hf_config(d: dict[str, Any], source: str = "config.json") -> TransformerArgs:
    """TransformerArgs of a Baichuan 2 config.json (7B: RoPE; 13B: ALiBi; see the module docstring)."""
    r = ConfigReader(d, source)
    pe = d.get("position_embedding") or ("rope" if "max_position_embeddings" in d else "alibi")
    if pe not in ("rope", "alibi"):
        raise CheckpointError(f"{source}: position_embedding must be rope or alibi, got {pe!r}.")
    defaults = HFDefaults(max_position_embeddings=r.int("model_max_length", 2048))
    return common_args_from_hf(
        d,
        "baichuan2",
        defaults,
        source,
        norm_head=True,
        position_embedding=pe,
        num_kv_heads=r.int("num_attention_heads"),
    )

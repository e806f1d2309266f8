"""Hugging Face adapter for Qwen2 / Qwen3 (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``) and their MoE variants
Qwen2-MoE (``Qwen2MoeForCausalLM``: Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE (``Qwen3MoeForCausalLM``).

The tensor names are Llama's plus ``self_attn.{q,k}_norm`` for Qwen3; ``args.family`` picks the config class
and ``args.num_experts`` > 0 the MoE one. Qwen2's q/k/v biases are fixed in its architecture (transformers
ignores ``attention_bias`` for it; Qwen2-MoE reads ``qkv_bias``, default true); Qwen3's ``attention_bias`` puts
biases on q, k, v and o_proj (our ``qkv_bias`` + ``attention_out_bias``). Sliding windows are honoured by each
class's rule (``models/common/hf_config.hf_sliding_window``) and written back so that it reads the same.

MoE (``models/common/hf_moe.py`` for the expert tensors, per-expert or transformers 5's fused form): softmax
router, ``num_experts_per_tok`` of ``num_experts`` (Qwen3-MoE in transformers 5 writes ``num_local_experts``;
both read), ``norm_topk_prob`` -> ``route_norm``, ``moe_intermediate_size`` -> expert width, the dense
``intermediate_size`` for the blocks ``decoder_sparse_step`` / ``mlp_only_layers`` leave dense (only "the
first N" and "one in every N" are expressible: other patterns are refused), ``router_aux_loss_coef`` ->
``model.moe.aux_loss_coef``. Qwen2-MoE's shared expert (``shared_expert_intermediate_size``, a multiple of the
expert width: ``shared_experts`` = the ratio) is gated by ``sigmoid(shared_expert_gate(x))``; Qwen3-MoE has
none. Absent keys take the config classes' defaults (``Qwen2Config`` / ``Qwen3Config``: 32 key/value heads,
max_position_embeddings 32,768, rope_theta 10,000, Qwen3 head_dim 128; ``Qwen2MoeConfig``: 16 KV heads, 60
experts, top 4, width 1,408, shared 5,632; ``Qwen3MoeConfig``: 4 KV heads, head_dim hidden / heads, 128
experts, top 8, width 768).
"""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.hf_adapter import LLAMA_LAYER, rename_from_hf, rename_to_hf
from llmtrain.models.common.hf_config import ConfigReader, HFDefaults, common_args_from_hf, common_hf_config
from llmtrain.models.common.hf_moe import MoENames, adding, check_routing, moe_from_hf, moe_to_hf
from llmtrain.models.mixtral.hf import experts_key

QWEN2_DEFAULTS = HFDefaults(num_key_value_heads=32, max_position_embeddings=32768)
QWEN3_DEFAULTS = HFDefaults(num_key_value_heads=32, max_position_embeddings=32768, head_dim=128)
QWEN2_MOE_DEFAULTS = HFDefaults(num_key_value_heads=16, max_position_embeddings=32768)
QWEN3_MOE_DEFAULTS = HFDefaults(num_key_value_heads=4, max_position_embeddings=32768)
QWEN2_MOE = MoENames("Qwen2MoeForCausalLM", shared="shared_expert", shared_gate="shared_expert_gate")
QWEN3_MOE = MoENames("Qwen3MoeForCausalLM")


def _names(args: TransformerArgs) -> MoENames:
    return QWEN2_MOE if args.family == "qwen2" else QWEN3_MOE


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """HF Qwen2/Qwen3 (MoE) state dict -> ours."""
    if not args.num_experts:
        return rename_from_hf(sd, LLAMA_LAYER, None, args)
    ours, rest = moe_from_hf(sd, args, _names(args))
    return rename_from_hf(rest, LLAMA_LAYER, adding(ours), args)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF Qwen2/Qwen3 (MoE) names (same tensors; experts one tensor each)."""
    if not args.num_experts:
        return rename_to_hf(sd, LLAMA_LAYER, None, args)
    moe, rest = moe_to_hf(sd, args, _names(args))
    return {**rename_to_hf(rest, LLAMA_LAYER, None, args), **moe}


def _sliding_keys(args: TransformerArgs, rule: str) -> dict[str, Any]:
    """use_sliding_window / sliding_window / max_window_layers / layer_types that read back to our window."""
    n, layers = args.num_layers, args.sliding_window_layers
    if not args.sliding_window:
        return {"use_sliding_window": False, "max_window_layers": n}
    d: dict[str, Any] = {"use_sliding_window": True, "sliding_window": args.sliding_window}
    if rule == "qwen3_moe":
        if layers is not None:
            raise ConfigError(
                "Qwen3MoeForCausalLM applies sliding_window to every layer; model.sliding_window_layers must be null."
            )
        return d
    sliding = set(range(n) if layers is None else layers)
    start = min(sliding)
    if rule == "qwen" and sliding == set(range(start, n)):
        return {**d, "max_window_layers": start}
    kinds = ["sliding_attention" if i in sliding else "full_attention" for i in range(n)]
    return {**d, "max_window_layers": n, "layer_types": kinds}


def _check_moe(args: TransformerArgs, architecture: str) -> None:
    check_routing(args, architecture)
    problems = []
    if args.router_score != "softmax":
        problems.append("a softmax router (model.moe.router_score)")
    if args.family == "qwen3" and args.shared_experts:
        problems.append("no shared experts (model.moe.shared_experts 0)")
    if args.family == "qwen2" and not (args.shared_experts and args.shared_expert_gate):
        problems.append("a gated shared expert (model.moe.shared_experts > 0, shared_expert_gate true)")
    if problems:
        raise ConfigError(f"{architecture} needs {' and '.join(problems)}; this model differs.")


def _moe_keys(args: TransformerArgs) -> dict[str, Any]:
    d: dict[str, Any] = {
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_hidden_size,
        "norm_topk_prob": args.route_norm or not args.pre_softmax,  # post-softmax top-k sums to 1
        "decoder_sparse_step": args.moe_every,
        "mlp_only_layers": list(range(args.first_dense_layers)),
        "router_aux_loss_coef": args.aux_loss_coef,
        "output_router_logits": False,
    }
    if args.family == "qwen2":
        d["shared_expert_intermediate_size"] = args.shared_experts * args.moe_hidden_size
    return d


def to_hf_config(args: TransformerArgs) -> dict[str, Any]:
    """config.json content for ``transformers.Qwen2Config`` / ``Qwen3Config`` or, with experts,
    ``Qwen2MoeConfig`` / ``Qwen3MoeConfig`` (by ``args.family``)."""
    unsupported = args.norm_head or args.position_embedding != "rope" or args.rope_interleaved
    unsupported = unsupported or args.partial_rotary_factor != 1.0 or args.mlp_bias or args.post_norms
    moe = bool(args.num_experts)
    if args.family == "qwen2":
        arch, model_type = ("Qwen2MoeForCausalLM", "qwen2_moe") if moe else ("Qwen2ForCausalLM", "qwen2")
        if unsupported or args.qk_norm or args.attention_out_bias or not (args.qkv_bias or moe):
            raise ConfigError(
                f"{arch} needs qkv_bias true (Qwen2-MoE: its qkv_bias), qk_norm / attention_out_bias / mlp_bias / "
                "post_norms false and whole-head half-rotation RoPE."
            )
        d = common_hf_config(args, arch, model_type)
        if moe:
            _check_moe(args, arch)
            d.update(qkv_bias=args.qkv_bias, **_moe_keys(args))
        d.update(_sliding_keys(args, "qwen2_moe" if moe else "qwen"))
        return d
    arch, model_type = ("Qwen3MoeForCausalLM", "qwen3_moe") if moe else ("Qwen3ForCausalLM", "qwen3")
    if unsupported or not args.qk_norm or args.qkv_bias != args.attention_out_bias:
        raise ConfigError(
            f"{arch} needs qk_norm true, qkv_bias equal to attention_out_bias (its attention_bias), no mlp_bias "
            "or post_norms and whole-head half-rotation RoPE."
        )
    d = common_hf_config(args, arch, model_type)
    d["attention_bias"] = args.qkv_bias
    if moe:
        _check_moe(args, arch)
        d.update(_moe_keys(args))
    d.update(_sliding_keys(args, "qwen3_moe" if moe else "qwen"))
    return d


def _first_dense(r: ConfigReader, num_layers: int) -> tuple[int, int]:
    """``(moe_every, first_dense_layers)`` giving transformers' MoE blocks (``decoder_sparse_step`` and
    ``mlp_only_layers``); ConfigError when no such pair exists."""
    step = r.int("decoder_sparse_step", 1)
    dense = r.d.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise r._fail("mlp_only_layers", dense, "a list of layer indices")
    theirs = {i for i in range(num_layers) if i not in dense and (i + 1) % step == 0}
    for first in range(num_layers + 1):
        if theirs == {i for i in range(first, num_layers) if (i + 1) % step == 0}:
            return step, first
    raise ConfigError(
        f"{r.source}: mlp_only_layers {dense} with decoder_sparse_step {step} makes blocks {sorted(theirs)} MoE; "
        "llmtrain expresses dense blocks only as the first N (model.moe.first_dense_layers) and one MoE block in "
        "every N (model.moe.every), so this model is refused."
    )


def _moe_args(r: ConfigReader, num_layers: int, qwen2: bool) -> dict[str, Any]:
    """The model.moe fields of a Qwen2-MoE / Qwen3-MoE config.json."""
    experts = r.int("num_experts", 60) if qwen2 else experts_key(r, 128)
    width = r.int("moe_intermediate_size", 1408 if qwen2 else 768)
    every, first = _first_dense(r, num_layers)
    values: dict[str, Any] = {
        "num_experts": experts,
        "top_k": r.int("num_experts_per_tok", 4 if qwen2 else 8),
        "moe_hidden_size": width,
        "route_norm": r.bool("norm_topk_prob", False),
        "moe_every": every,
        "first_dense_layers": first,
        "aux_loss_coef": r.number("router_aux_loss_coef", 0.001, positive=False),
    }
    if qwen2:
        shared = r.int("shared_expert_intermediate_size", 5632)
        if shared % width:
            raise ConfigError(
                f"{r.source}: shared_expert_intermediate_size {shared} is not a multiple of moe_intermediate_size "
                f"{width}; llmtrain's shared expert is model.moe.shared_experts x the expert width."
            )
        values.update(shared_experts=shared // width, shared_expert_gate=True)
    return values


def args_from_hf_config(d: dict[str, Any], source: str = "config.json") -> TransformerArgs:
    """TransformerArgs of a HF Qwen2, Qwen3, Qwen2-MoE or Qwen3-MoE config.json (``model_type`` decides)."""
    model_type = d.get("model_type", "qwen2")
    r = ConfigReader(d, source)
    layers = r.int("num_hidden_layers")
    if model_type in ("qwen3", "qwen3_moe"):
        moe = model_type == "qwen3_moe"
        bias = r.bool("attention_bias", False)
        return common_args_from_hf(
            d,
            "qwen3",
            QWEN3_MOE_DEFAULTS if moe else QWEN3_DEFAULTS,
            source,
            sliding="qwen3_moe" if moe else "qwen",
            qk_norm=True,
            qkv_bias=bias,
            attention_out_bias=bias,
            **(_moe_args(r, layers, qwen2=False) if moe else {}),
        )
    if model_type == "qwen2_moe":
        return common_args_from_hf(
            d,
            "qwen2",
            QWEN2_MOE_DEFAULTS,
            source,
            sliding="qwen2_moe",
            qkv_bias=r.bool("qkv_bias", True),
            **_moe_args(r, layers, qwen2=True),
        )
    if model_type != "qwen2":
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not qwen2, qwen3, qwen2_moe or qwen3_moe."
        )
    return common_args_from_hf(d, "qwen2", QWEN2_DEFAULTS, source, sliding="qwen", qkv_bias=True)

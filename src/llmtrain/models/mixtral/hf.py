"""Hugging Face adapter for Mixtral (``MixtralForCausalLM``, ``model_type: mixtral``).

Mistral's attention (``sliding_window`` on every layer when not null; ``MixtralConfig`` defaults it to null)
and in every block a sparse MoE: a softmax router over ``num_local_experts`` experts (``num_experts`` is
transformers 5's alias), the top ``num_experts_per_tok`` renormalised, each expert a SwiGLU of width
``intermediate_size``. Expert tensors: ``models/common/hf_moe.py`` (files: ``block_sparse_moe.experts.{e}.w1 /
w3 / w2`` and ``block_sparse_moe.gate``; transformers 5 in memory: fused ``mlp.experts.gate_up_proj /
down_proj``). ``router_aux_loss_coef`` is read as ``model.moe.aux_loss_coef`` (llmtrain's per-block Switch loss
with that coefficient) and written back from it; ``router_jitter_noise`` > 0 (noise on the router input in
training) is refused. Absent keys take ``MixtralConfig``'s defaults: rms_norm_eps 1e-5, 8 key/value heads,
max_position_embeddings 131,072, rope_theta 1,000,000, 8 experts, top 2, aux coefficient 0.001.
"""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.hf_adapter import LLAMA_LAYER, rename_from_hf, rename_to_hf
from llmtrain.models.common.hf_config import ConfigReader, HFDefaults, common_args_from_hf, common_hf_config
from llmtrain.models.common.hf_moe import MoENames, adding, check_routing, moe_from_hf, moe_to_hf
from llmtrain.models.mistral.hf import check_exportable

DEFAULTS = HFDefaults(
    rms_norm_eps=1e-5,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=1000000.0,
    sliding_window=None,
)
NAMES = MoENames("MixtralForCausalLM", block="block_sparse_moe", gate="w1", up="w3", down="w2")


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """HF ``MixtralForCausalLM`` state dict (per-expert or fused) -> ours."""
    ours, rest = moe_from_hf(sd, args, NAMES)
    return rename_from_hf(rest, LLAMA_LAYER, adding(ours), args)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF ``MixtralForCausalLM`` names (one tensor per expert, as the Hub stores them)."""
    moe, rest = moe_to_hf(sd, args, NAMES)
    return {**rename_to_hf(rest, LLAMA_LAYER, None, args), **moe}


def experts_key(r: ConfigReader, default: int) -> int:
    """``num_local_experts``, or transformers 5's alias ``num_experts``; both present must agree."""
    local, alias = r.d.get("num_local_experts"), r.d.get("num_experts")
    if local is not None and alias is not None and local != alias:
        raise CheckpointError(
            f"{r.source}: num_local_experts {local!r} and num_experts {alias!r} disagree (transformers treats "
            "them as one setting); keep one."
        )
    return r.int("num_local_experts" if local is not None else "num_experts", default)


def to_hf_config(args: TransformerArgs) -> dict[str, Any]:
    """config.json content that ``transformers.MixtralConfig`` loads."""
    check_exportable(args, "MixtralForCausalLM")
    if args.num_experts:
        check_routing(args, "MixtralForCausalLM")
    wrong = []
    if not args.num_experts or args.num_moe_layers != args.num_layers:
        wrong.append("an MoE feed-forward in every block (model.moe.every 1, first_dense_layers 0)")
    if args.moe_hidden_size != args.intermediate_size:
        wrong.append("experts as wide as model.intermediate_size (model.moe.moe_hidden_size)")
    if args.shared_experts or args.router_score != "softmax" or not (args.route_norm or not args.pre_softmax):
        wrong.append("no shared experts, a softmax router and renormalised top-k weights (route_norm)")
    if wrong:
        raise ConfigError(f"MixtralForCausalLM needs {'; '.join(wrong)}; this model differs.")
    d = common_hf_config(args, "MixtralForCausalLM", "mixtral")
    d.update(
        sliding_window=args.sliding_window or None,
        num_local_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        router_aux_loss_coef=args.aux_loss_coef,
        output_router_logits=False,
        router_jitter_noise=0.0,
    )
    return d


def args_from_hf_config(d: dict[str, Any], source: str = "config.json") -> TransformerArgs:
    """TransformerArgs of a HF Mixtral config.json."""
    r = ConfigReader(d, source)
    jitter = r.number("router_jitter_noise", 0.0, positive=False)
    if jitter:
        raise ConfigError(
            f"{source}: router_jitter_noise {jitter} multiplies the router input by uniform noise in training, "
            "which llmtrain's router does not do; set it to 0.0 to import the model."
        )
    width = r.int("intermediate_size")
    return common_args_from_hf(
        d,
        "mixtral",
        DEFAULTS,
        source,
        sliding="all",
        num_experts=experts_key(r, 8),
        top_k=r.int("num_experts_per_tok", 2),
        moe_hidden_size=width,
        aux_loss_coef=r.number("router_aux_loss_coef", 0.001, positive=False),
    )

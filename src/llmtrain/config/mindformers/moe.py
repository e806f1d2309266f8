"""MindFormers mixture-of-experts keys -> ``model.moe.*``: the 2.x keys inside ``model_config`` (Hugging Face
and mcore spellings: ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``,
``moe_aux_loss_coeff``...) and the 1.x ``moe_config`` section (``expert_num``, ``num_experts_chosen``,
``aux_loss_factor``, ``balance_via_topk_bias``...) reach one set of canonical names.

:func:`finish_moe` writes every ``model.moe`` field explicitly, MindFormers' defaults where the file is silent
(1.x ``MoEConfig``: top-1, capacity 1.1, aux 0.05, renormalised top-k; 2.x mcore: no capacity (no drops), no
aux loss, softmax scores; plus the model type's own defaults, e.g. Qwen3-MoE's ``norm_topk_prob: false``).
The balance loss is llmtrain's per-micro-batch one whatever ``moe_router_load_balancing_type`` says (the note
says so); a router z-loss, dense layers listed one by one, gated shared experts are refused.
"""

from __future__ import annotations

from typing import Any

from llmtrain.config.mindformers import tables as T
from llmtrain.config.mindformers.common import (
    Ctx,
    Ignore,
    Only,
    Spec,
    collect,
    ignore_all,
    lookup,
    pending,
    walk,
)

MOE = {  # MindFormers spelling -> canonical name
    "num_experts": "num_experts", "n_routed_experts": "num_experts", "expert_num": "num_experts",
    "num_moe_experts": "num_experts", "num_experts_per_tok": "top_k", "num_experts_chosen": "top_k",
    "moe_router_topk": "top_k", "moe_intermediate_size": "moe_hidden_size",
    "moe_ffn_hidden_size": "moe_hidden_size", "n_shared_experts": "shared_experts",
    "shared_expert_num": "shared_experts", "moe_shared_expert_intermediate_size": "shared_hidden",
    "norm_topk_prob": "route_norm", "use_gating_sigmoid": "gating_sigmoid", "scoring_func": "router_score",
    "moe_router_score_function": "router_score", "balance_via_topk_bias": "expert_bias",
    "moe_router_enable_expert_bias": "expert_bias", "topk_bias_update_rate": "bias_rate",
    "moe_router_bias_update_rate": "bias_rate", "moe_aux_loss_coeff": "aux_coef", "aux_loss_factor": "aux_coef",
    "aux_loss_types": "aux_types", "aux_loss_factors": "aux_factors",
    "moe_router_load_balancing_type": "balancing", "first_k_dense_replace": "first_dense_layers",
    "decoder_sparse_step": "every", "moe_layer_freq": "every", "mlp_only_layers": "mlp_only_layers",
    "capacity_factor": "capacity_factor", "moe_expert_capacity_factor": "capacity_factor",
    "moe_z_loss_coeff": "z_loss", "z_loss_factor": "z_loss", "routed_scaling_factor": "scaling",
    "moe_router_topk_scaling_factor": "scaling", "n_group": "n_group", "moe_router_num_groups": "n_group",
    "topk_group": "topk_group", "moe_router_group_topk": "topk_group", "moe_router_pre_softmax": "pre_softmax",
    "router_dense_type": "router_dtype", "moe_router_dtype": "router_dtype", "moe_token_drop_policy": "drop_policy",
}  # fmt: skip
TYPES: dict[str, str] = {  # canonical name -> the type its value must have (common.typed)
    "num_experts": "int0", "top_k": "int1", "moe_hidden_size": "int1", "shared_experts": "int0",
    "shared_hidden": "int0", "route_norm": "bool", "gating_sigmoid": "bool", "expert_bias": "bool",
    "bias_rate": "num0", "aux_coef": "num0", "first_dense_layers": "int0", "capacity_factor": "num",
    "z_loss": "num0", "scaling": "num+", "n_group": "int0", "topk_group": "int0", "pre_softmax": "bool",
    "router_dtype": "str", "balancing": "str", "router_score": "str",
}  # fmt: skip
_OFF = "llmtrain's MoE does not implement it"
_DROPS = "which tokens an expert over capacity drops: llmtrain drops the last routed ones"
MOE_SPEC: Spec = {  # the MoE keys, valid in a 2.x model_config and in a 1.x moe_config
    **{k: collect("moe", c, TYPES.get(c)) for k, c in MOE.items()},
    "moe_router_force_expert_balance": Only((False,), "off: routing follows the scores", _OFF),
    "use_shared_expert_gating": Only((False,), "off: shared experts are not gated", _OFF),
    "expert_model_parallel": Only((None, 1), "1: experts are not tensor-parallel", _OFF),
    "enable_cold_hot_expert": Only((False,), "off", _OFF),
    "router_aux_loss_coef": Ignore(T.R_AUX_IGNORED),
    "enable_sdrop": Ignore(_DROPS),
    **ignore_all("used only with enable_cold_hot_expert", "update_step hot_expert_num cold_token_percent"),
    **ignore_all(
        T.R_MOE_KERNEL,
        "use_fused_ops_topkrouter use_fused_ops_permute moe_grouped_gemm use_gmm moe_token_dispatcher_type "
        "moe_permute_fusion enable_gmm_safe_tokens use_pad_tokens callback_moe_droprate routing_policy "
        "expert_group_size group_wise_a2a comp_comm_parallel comp_comm_parallel_degree max_router_load "
        "enable_deredundency npu_nums_per_device moe_shared_expert_overlap use_allgather_dispatcher "
        "moe_init_method_std save_token_distribution cur_layer moe_module_name moe_per_layer_logging",
    ),
}
# MoE keys whose default a model type sets (tables.MODEL_DEFAULTS: Qwen3-MoE's, DeepSeek-V3's)
_FAMILY_MOE_DEFAULTS = (
    "num_experts", "top_k", "moe_hidden_size", "route_norm", "every", "router_score", "shared_experts",
    "first_dense_layers", "scaling", "n_group", "topk_group",
)  # fmt: skip
MOE_CONFIG_SPEC: Spec = {  # the 1.x top-level moe_config; DeepSeek's topk_method waits for its family
    **MOE_SPEC,
    "topk_method": pending,
}


def map_moe_config(ctx: Ctx, name: str, value: Any) -> None:
    """The 1.x top-level ``moe_config:``."""
    walk(ctx, name, value, MOE_CONFIG_SPEC)


def finish_moe(ctx: Ctx, defaults: dict[str, Any], layout2: bool) -> None:
    """Write ``model.moe.*`` from the collected MoE keys (nothing for a dense model: 1.x ``expert_num: 1``)."""
    got: dict[str, tuple[str, Any]] = ctx.facts.get("moe", {})
    base = dict(T.MOE_DEFAULTS_2X if layout2 else T.MOE_DEFAULTS_1X)
    base.update({k: v for k, v in defaults.items() if k in _FAMILY_MOE_DEFAULTS})

    def val(c: str) -> Any:
        return got[c][1] if c in got else base.get(c)

    def where(c: str) -> str:
        return got[c][0]

    n = val("num_experts") or 0
    if n <= 1:  # a dense model (1.x MoEConfig's expert_num 1): the MoE keys have nothing to act on
        for name, _ in got.values():
            ctx.notes.ignore(name, f"the model is dense (num_experts {n})")
        return
    out: dict[str, Any] = {"num_experts": n, "top_k": val("top_k"), "moe_hidden_size": val("moe_hidden_size")}
    out["shared_experts"] = val("shared_experts") or 0
    if "shared_hidden" in got:  # mcore: the shared experts' total width
        width, each = got["shared_hidden"][1], out["moe_hidden_size"]
        if not out["shared_experts"] and each and width % each == 0:
            out["shared_experts"] = width // each
        if width != out["shared_experts"] * (each or 0):
            raise ctx.error(where("shared_hidden"), f"{width}: must be shared experts x expert width {each}.")
    score = (
        ("sigmoid" if val("gating_sigmoid") else "softmax")
        if "gating_sigmoid" in got
        else val("router_score")
    )
    if str(score).lower() not in ("softmax", "sigmoid"):
        raise ctx.error(where("router_score"), f"{score!r}: router scores are softmax or sigmoid.")
    out["router_score"] = str(score).lower()
    out["route_norm"] = bool(val("route_norm"))
    out["aux_loss_coef"] = float(_aux(ctx, got, val("aux_coef")) or 0.0)
    _balancing(ctx, got, val("balancing"), out)
    out["bias_update_rate"] = float(val("bias_rate") or 0.0) if val("expert_bias") else 0.0
    if "bias_rate" in got and not val("expert_bias"):
        ctx.notes.ignore(
            where("bias_rate"), "the expert bias is off (balance_via_topk_bias / enable_expert_bias)"
        )
    out["capacity_factor"] = val("capacity_factor")
    _routing(ctx, got, val, out)
    first = val("first_dense_layers") or 0
    out["first_dense_layers"] = int(first)
    every = val("every") or 1
    if isinstance(every, bool) or not isinstance(every, int):
        raise ctx.error(where("every"), f"{every!r}: only a whole-number MoE layer frequency is supported.")
    out["every"] = every
    if val("mlp_only_layers"):
        raise ctx.error(
            where("mlp_only_layers"),
            "dense layers come from first_k_dense_replace / decoder_sparse_step only.",
        )
    if val("z_loss"):
        raise ctx.error(where("z_loss"), "the router z-loss is not implemented; set it to 0.")
    for c in ("z_loss", "mlp_only_layers"):
        if c in got:
            ctx.notes.ignore(where(c), "off")
    for k, v in out.items():
        ctx.put(f"model.moe.{k}", v)
    given = ", ".join(f"{k} {v!r}" for k, v in out.items())
    written = ", ".join(f"{name.rsplit('.', 1)[-1]} {v!r}" for name, v in got.values())
    ctx.notes.add(
        f"MoE ({written}) -> model.moe: {given} (MindFormers' defaults for the keys the file leaves out)."
    )


def _balancing(ctx: Ctx, got: dict[str, tuple[str, Any]], kind: Any, out: dict[str, Any]) -> None:
    """moe_router_load_balancing_type -> model.moe.aux_loss_scope (tables.BALANCING; none: no aux loss)."""
    out["aux_loss_scope"] = "micro_batch"
    if kind is None:
        return
    origin = (
        got["balancing"][0] if "balancing" in got else "moe_router_load_balancing_type (MindFormers' default)"
    )
    if str(kind).lower() == "none":
        out["aux_loss_coef"] = 0.0
        ctx.notes.add(f"{origin}: 'none' -> model.moe.aux_loss_coef 0.0 (no balance loss).")
        return
    out["aux_loss_scope"] = lookup(T.BALANCING, kind, origin, ctx.source)
    if out["aux_loss_scope"] == "global_batch":
        ctx.notes.add(
            f"{origin}: {kind!r} -> model.moe.aux_loss_scope global_batch: the expert fractions count the "
            "assignments of every data-parallel rank and of the step's micro-batches so far, as MindFormers' "
            f"router does (coefficient {out['aux_loss_coef']})."
        )
    elif str(kind).lower().replace("_", "") == "seqauxloss":
        ctx.notes.add(
            f"{origin}: {kind!r} -> model.moe.aux_loss_scope micro_batch: llmtrain has no per-sequence balance "
            "loss, so the fractions count each micro-batch."
        )
    else:
        ctx.notes.add(
            f"{origin}: {kind!r} -> model.moe.aux_loss_scope micro_batch (each rank's micro-batch, as MindFormers' "
            "per data-parallel slice)."
        )


def _routing(ctx: Ctx, got: dict[str, tuple[str, Any]], val: Any, out: dict[str, Any]) -> None:
    """Routed scaling, groups, pre-softmax, router dtype and drop policy, the same for every family."""
    out["routed_scaling_factor"] = float(val("scaling"))
    out["n_group"] = val("n_group") or 1  # null / 0: no groups
    out["topk_group"] = val("topk_group") or 1
    out["pre_softmax"] = True
    if "pre_softmax" in got and got["pre_softmax"][1] is False:
        ctx.notes.add(
            f"{got['pre_softmax'][0]}: False -> model.moe.pre_softmax true: MindFormers' training router "
            "(parallel_core/training_graph/transformer/moe/router.py; 1.x modules/transformer/moe.py) takes the "
            "softmax over all experts before the top-k whatever this key says, and llmtrain does the same."
        )
    dtype = str(val("router_dtype")).lower()
    if dtype not in T.R_DTYPE_NAMES:
        raise ctx.error(
            where_of(got, "router_dtype"),
            f"{val('router_dtype')!r} is not one of {', '.join(T.R_DTYPE_NAMES)}.",
        )
    out["router_fp32"] = dtype == "float32"
    policy = val("drop_policy")
    if policy is not None and str(policy).lower() not in ("probs", "position"):
        raise ctx.error(where_of(got, "drop_policy"), f"{policy!r}: the drop policy is probs or position.")
    out["drop_policy"] = str(policy).lower() if policy is not None else "position"
    if out["capacity_factor"] is None and "drop_policy" in got:
        ctx.notes.ignore(got["drop_policy"][0], T.R_DROP + " (the policy applies only with a capacity)")


def where_of(got: dict[str, tuple[str, Any]], canonical: str) -> str:
    """The key as the file wrote it, or the canonical name when the value is MindFormers' default."""
    return got[canonical][0] if canonical in got else f"{canonical} (MindFormers' default)"


def _aux(ctx: Ctx, got: dict[str, tuple[str, Any]], coef: Any) -> Any:
    """The balance-loss coefficient: aux_loss_types / aux_loss_factors (their 'expert' entry) win."""
    if "aux_types" not in got and "aux_factors" not in got:
        return coef
    kinds, factors = (
        list(got.get("aux_types", ("", []))[1] or []),
        list(got.get("aux_factors", ("", []))[1] or []),
    )
    table = dict(zip(kinds, factors))
    others = [k for k in table if k != "expert" and table[k]]
    if others:
        name = got.get("aux_types", got.get("aux_factors", ("aux_loss_types", None)))[0]
        raise ctx.error(
            name, f"{table}: only the expert-level balance loss exists (not {', '.join(others)})."
        )
    if "aux_coef" in got:
        ctx.notes.ignore(got["aux_coef"][0], "aux_loss_types / aux_loss_factors set the coefficient instead")
    return table.get("expert", 0.0)

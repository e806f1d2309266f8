"""DeepSeek-V3's own MindFormers keys (1.x ``DeepseekV3Config`` + ``moe_config``, 2.x ``model_type: deepseek_v3``)
-> the ``deepseek_v3`` family's ``model.*`` / ``model.moe.*``.

The walk collects these keys as *pending* (``tables.MLA_KEYS``) whatever the model type; for another family
``model._pending_check`` requires them off, for DeepSeek-V3 :func:`finish_deepseek` maps them:

* Multi-head Latent Attention: ``q_lora_rank`` (null / 0: no query compression), ``kv_lora_rank``,
  ``qk_rope_head_dim`` (mcore: ``qk_pos_emb_head_dim``), ``qk_nope_head_dim`` (mcore: ``qk_head_dim``),
  ``v_head_dim``; a key the file leaves out takes DeepseekV3Config's default (512 / 1536 / 64 / 128 / 128).
  ``multi_latent_attention`` must be true; ``mla_qkv_concat`` is a weight layout.
* routing: ``routed_scaling_factor`` and ``n_group`` / ``topk_group`` are options of every MoE router
  (``moe.py``; absent, they take 1.x ``MoEConfig``'s 1.0 / no groups, or 2.x ``DeepseekV3Config``'s 2.5 / 8 /
  4 from ``tables.MODEL_DEFAULTS``). ``topk_method`` is checked to be a DeepSeek method and otherwise ignored.
* YaRN: ``mscale``, ``mscale_all_dim``, ``beta_fast``, ``beta_slow`` at the top level join the YaRN
  ``scaling_factor`` (``extend_method: YARN``); without YaRN they change nothing and are ignored.
* multi-token prediction (``mtp_depth`` / ``num_nextn_predict_layers`` / ``mtp_num_layers``, with
  ``mtp_loss_factor``): not implemented. The run trains the main model with the next-token loss only (the MTP
  module's extra loss, ``mtp_loss_factor`` x its CE, is dropped), and :func:`mtp_layers` lets the pipeline split
  leave the MTP layer out of the last stage, where MindFormers puts it. The note says so.
"""

from __future__ import annotations

from typing import Any

from llmtrain.config.mindformers.common import Ctx

# DeepseekV3Config's values for MLA keys a file leaves out (MindFormers research/deepseek3, Hugging Face alike)
MLA_DEFAULTS = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}
_MLA = {  # MindFormers / mcore spelling -> model.* key
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "qk_pos_emb_head_dim": "qk_rope_head_dim",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_head_dim": "qk_nope_head_dim",
    "v_head_dim": "v_head_dim",
}
YARN_KEYS = ("mscale", "mscale_all_dim", "beta_fast", "beta_slow")
MTP_KEYS = ("mtp_depth", "num_nextn_predict_layers", "mtp_num_layers")
_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _pending(ctx: Ctx) -> dict[str, tuple[str, Any]]:
    """Short key -> (dotted name, value) of the collected DeepSeek keys."""
    return {name.rsplit(".", 1)[-1]: (name, value) for name, value in ctx.facts.get("pending", [])}


def mtp_layers(ctx: Ctx) -> int:
    """Multi-token-prediction layers the file asks for (MindFormers counts them in the pipeline split)."""
    got = _pending(ctx)
    for key in MTP_KEYS:
        if key in got and got[key][1]:
            return int(got[key][1])
    return 0


def yarn_extras(ctx: Ctx) -> dict[str, Any]:
    """The top-level YaRN keys of the file (they join ``scaling_factor`` under ``extend_method: YARN``)."""
    got = _pending(ctx)
    return {k: got[k][1] for k in YARN_KEYS if k in got and got[k][1] is not None}


def finish_deepseek(ctx: Ctx, yarn: bool, layout2: bool) -> None:
    """Map the collected DeepSeek keys (see the module docstring); ``yarn``: the RoPE is YaRN-scaled;
    ``layout2``: a 2.x (``model_type``) file."""
    got = _pending(ctx)
    mla: dict[str, Any] = {}
    for key, target in _MLA.items():
        if key in got:
            name, value = got[key]
            mla[target] = 0 if value is None and target == "q_lora_rank" else value
            ctx.notes.renamed(name, f"model.{target}")
    defaulted = {k: v for k, v in MLA_DEFAULTS.items() if k not in mla}
    for target, value in {**defaulted, **mla}.items():
        ctx.put(f"model.{target}", value)
    if defaulted:
        ctx.notes.add(
            "MindFormers' DeepseekV3Config defaults for MLA keys the file leaves out: "
            + ", ".join(f"model.{k} {v!r}" for k, v in defaulted.items())
            + "."
        )
    if "multi_latent_attention" in got:
        name, value = got["multi_latent_attention"]
        if value is not True:
            raise ctx.error(name, f"{value!r}: DeepSeek-V3 is Multi-head Latent Attention; set it to true.")
        ctx.notes.ignore(name, "the deepseek_v3 family is MLA")
    if "mla_qkv_concat" in got:
        ctx.notes.ignore(got["mla_qkv_concat"][0], "a weight layout (fused MLA projections): same math")
    if "topk_method" in got:
        name, method = got["topk_method"]
        if method not in (*_TOPK_METHODS, None):
            raise ctx.error(name, f"{method!r} is not one of {', '.join(_TOPK_METHODS)}.")
        ctx.notes.ignore(name, "the routing follows from n_group / topk_group and the expert bias")
    if not yarn:
        for key in YARN_KEYS:
            if key in got:
                ctx.notes.ignore(got[key][0], "a YaRN parameter, and the RoPE is not YaRN-scaled")
    depth = mtp_layers(ctx)
    for key in (*MTP_KEYS, "mtp_loss_factor", "mtp_loss_scaling_factor"):
        if key in got:
            ctx.notes.ignore(got[key][0], "multi-token prediction is not implemented (see the note)")
    if depth:
        ctx.notes.add(
            f"multi-token prediction (mtp_depth {depth}) is not implemented: llmtrain trains the "
            f"{ctx.out.get('model', {}).get('num_layers', '?')}-layer main model with the next-token loss only "
            "(no MTP module, no mtp_loss_factor term), and the pipeline split leaves the MTP layer out."
        )

"""The ``model:`` section of a MindFormers 1.x / 2.x file (and the 1.x ``moe_config:``) -> ``model.*``.

``model: {model_config: {...}, arch: {type: ...}}``. A 1.x ``model_config`` names its config class
(``type: LlamaConfig``) and uses MindFormers' own spellings (``num_layers``, ``num_heads``, ``n_kv_heads``,
``theta``, ``multiple_of``, ``qkv_has_bias``...); a 2.x one names a Hugging Face ``model_type`` (``qwen3``,
``qwen3_moe``, ``deepseek_v3``) and uses Hugging Face spellings (``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rope_theta``, ``num_experts``...). Both reach
one set of canonical names (the 1.x spelling) first, so a key is mapped the same way in either layout.

What is filled in (:func:`finish_model`, after the whole file is read):

* the family: ``tables.MODEL_TYPES`` (``qwen3`` and ``qwen3_moe`` are our ``qwen3`` family, so QK-norm comes
  with it; a type without a family is refused by the caller, naming what is missing, after everything else
  has been mapped);
* every architecture key the file leaves out takes **MindFormers'** default (``tables.MODEL_DEFAULTS``:
  LlamaConfig's ``theta`` 10000, not our llama3 family's 500000), each reported;
* the FFN width of a 1.x file without ``intermediate_size`` by MindFormers' own rule:
  ``h = 4 x hidden; h = int((ffn_dim_multiplier + 0.01) x h) if set; h = int(2h / 3)``, rounded up to a
  multiple of ``multiple_of``;
* RoPE scaling: none (``model.rope_scaling: 1.0``, the identity, so no family default applies), linear for
  ``extend_method: PI``, yarn for ``extend_method: YARN`` (its ``scaling_factor`` mapping, DeepSeek-V3), a 2.x
  ``rope_scaling`` mapping as written;
* DeepSeek-V3's MLA / routing / MTP keys: ``config/mindformers/deepseek.py``;
* ``compute_dtype`` -> ``train.precision``; the MoE keys -> ``model.moe.*``, every field explicit (MindFormers'
  defaults where the file is silent: 1.x top-1, aux 0.05, capacity 1.1; 2.x no aux loss, no capacity);
* ``offset`` -> ``parallel.pipeline_layers`` (:func:`finish_pipeline`): MindFormers gives stage ``s`` of
  interleave round ``i`` ``num_layers // (pp x rounds) + offset[i][s]`` layers.
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
    pending,
    same,
    walk,
)
from llmtrain.config.mindformers.deepseek import finish_deepseek, mtp_layers, yarn_extras
from llmtrain.config.mindformers.moe import MOE_SPEC, finish_moe
from llmtrain.errors import ConfigError

# canonical name -> native key (None: read by a computation in finish_model / finish_pipeline)
ARCH: dict[str, str | None] = {
    "hidden_size": "model.hidden_size", "num_layers": "model.num_layers", "num_heads": "model.num_heads",
    "n_kv_heads": "model.num_kv_heads", "intermediate_size": "model.intermediate_size",
    "vocab_size": "model.vocab_size", "head_dim": "model.head_dim", "rms_norm_eps": "model.rms_norm_eps",
    "theta": "model.rope_theta", "seq_length": "model.seq_length", "qkv_has_bias": "model.qkv_bias",
    "qk_layernorm": "model.qk_norm", "tie_word_embeddings": "model.tie_word_embeddings",
    "use_flash_attention": "model.use_flash_attention", "initializer_range": "model.init_std",
    "partial_rotary_factor": "model.partial_rotary_factor",
    "multiple_of": None, "ffn_dim_multiplier": None, "extend_method": None, "scaling_factor": None,
    "rope_scaling": None, "compute_dtype": None, "offset": None, "pp_interleave_num": None, "untie": None,
    "type": None, "model_type": None, "checkpoint_name_or_path": None,
}  # fmt: skip
# canonical name -> the type its value must have (common.typed); the others are checked where they are read
TYPES: dict[str, str] = {
    **dict.fromkeys(
        ("hidden_size", "num_layers", "num_heads", "n_kv_heads", "intermediate_size", "vocab_size", "head_dim",
         "seq_length", "multiple_of", "pp_interleave_num"),
        "int1",
    ),
    **dict.fromkeys(("rms_norm_eps", "theta", "initializer_range", "partial_rotary_factor"), "num+"),
    "ffn_dim_multiplier": "num+",
    **dict.fromkeys(("qkv_has_bias", "qk_layernorm", "tie_word_embeddings", "use_flash_attention", "untie"), "bool"),
    "checkpoint_name_or_path": "str",
}  # fmt: skip
ALIASES = {  # Hugging Face / mcore spelling -> canonical name
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads", "num_key_value_heads": "n_kv_heads",
    "num_query_groups": "n_kv_heads", "multi_query_group_num": "n_kv_heads", "ffn_hidden_size": "intermediate_size",
    "kv_channels": "head_dim", "layernorm_epsilon": "rms_norm_eps", "rope_theta": "theta", "rotary_base": "theta",
    "rotary_emb_base": "theta", "attention_bias": "qkv_has_bias", "add_qkv_bias": "qkv_has_bias",
    "init_method_std": "initializer_range", "rotary_percent": "partial_rotary_factor",
    "untie_embeddings_and_output_weights": "untie",
}  # fmt: skip
# Value(s) at which a DeepSeek-only key changes nothing in another family (None: any value, meaningless once
# the keys it qualifies are off).
NEUTRAL: dict[str, tuple[Any, ...] | None] = {
    "mtp_depth": (0, None), "num_nextn_predict_layers": (0, None), "mtp_num_layers": (0, None),
    "topk_method": ("greedy", None), "multi_latent_attention": (False, None), "mtp_loss_factor": None,
    "mtp_loss_scaling_factor": None,
}  # fmt: skip
_OFF = "llmtrain's families do not implement it"
_NO_DROPOUT = Only((0, 0.0), "0: llmtrain's models have no dropout", "llmtrain's models have no dropout")
MODEL_CONFIG_SPEC: Spec = {
    **{k: collect("model", k, TYPES.get(k)) for k in ARCH},
    **{k: collect("model", c, TYPES.get(c)) for k, c in ALIASES.items()},
    **MOE_SPEC,
    **{k: pending for k in T.MLA_KEYS},
    "hidden_act": Only(
        ("silu", "swiglu", "swish", "fusedswiglu"),
        "the SwiGLU MLP llmtrain builds",
        "llmtrain's MLPs are SwiGLU",
    ),
    "gated_linear_unit": Only(
        (True,), "the SwiGLU MLP llmtrain builds", "llmtrain's MLPs are gated (SwiGLU)"
    ),
    "add_bias_linear": Only(
        (False,),
        "off: no bias on the other linear layers, as llmtrain builds them",
        "biases exist only on q/k/v (qkv_has_bias)",
    ),
    "position_embedding_type": Only(
        ("rope",), "RoPE, as llmtrain builds it", "only rotary position embeddings are mapped"
    ),
    "normalization": Only(("RMSNorm",), "RMSNorm, as llmtrain builds it", "llmtrain's families use RMSNorm"),
    "use_past": Only((False,), T.R_INFER, "a KV cache is for inference"),
    "use_ring_attention": Only(
        (False,), "off", "ring attention is context parallelism (parallel_config.context_parallel)"
    ),
    "rope_interleave": Only((False, None), "off: RoPE rotates the two halves, as llmtrain's", _OFF),
    "rotary_interleaved": Only((False, None), "off: RoPE rotates the two halves, as llmtrain's", _OFF),
    "softmax_scale": Only((None,), "unset: the attention scale is 1/sqrt(head_dim), as llmtrain's", _OFF),
    "apply_residual_connection_post_layernorm": Only((False,), "off: pre-norm blocks, as llmtrain's", _OFF),
    "layernorm_zero_centered_gamma": Only((False,), "off: plain RMSNorm weights, as llmtrain's", _OFF),
    "apply_query_key_layer_scaling": Only((False,), "off: plain attention scale, as llmtrain's", _OFF),
    **{
        k: _NO_DROPOUT
        for k in (
            "hidden_dropout",
            "attention_dropout",
            "hidden_dropout_rate",
            "attention_dropout_rate",
            "emb_dropout_prob",
        )
    },
    "calculate_per_token_loss": Ignore("llmtrain's loss is the mean over every token of the global batch"),
    "ignore_token_id": Ignore("padding labels are excluded from the loss"),
    "architectures": Ignore(T.R_ARCH),
    "auto_register": Ignore(T.R_REGISTER),
    **ignore_all(
        T.R_INFER,
        "batch_size use_past_shard is_dynamic block_size num_blocks repetition_penalty max_decode_length top_k "
        "top_p do_sample temperature use_cache use_incre_flash_attention use_prompt_flash_attention "
        "parallel_decoding_params llm_backend",
    ),
    **ignore_all(T.R_TOKENS, "bos_token_id eos_token_id pad_token_id"),
    **ignore_all(
        T.R_DTYPE,
        "layernorm_compute_type layernorm_compute_dtype softmax_compute_type softmax_compute_dtype rotary_dtype "
        "fp32_residual_connection residual_dtype attention_softmax_in_fp32",
    ),
    **ignore_all(T.R_PARAMS, "param_init_type params_dtype embedding_init_type"),
    **ignore_all(T.R_POSITIONS, "max_position_embedding max_position_embeddings"),
    **ignore_all(
        T.R_LAYOUT,
        "qkv_concat mlp_concat use_contiguous_weight_layout_attention use_contiguous_weight_layout "
        "input_sliced_sig fine_grain_interleave use_fused_rope use_fused_swiglu apply_rope_fusion "
        "bias_swiglu_fusion use_attn_mask_compression use_eod_attn_mask_compression compute_in_2d use_rope_slice "
        "lm_head_dp fused_rms_norm masked_softmax_fusion bias_dropout_fusion return_extra_loss input_layout "
        "sparse_mode use_attention_mask seq_split_num",
    ),
}
_SECTION_SPEC: Spec = {
    "model_config": lambda ctx, name, value: walk(ctx, name, value, MODEL_CONFIG_SPEC),
    "arch": lambda ctx, name, value: walk(
        ctx, name, value, {"type": Ignore(T.R_ARCH), "auto_register": Ignore(T.R_REGISTER)}
    ),
}


def map_model(ctx: Ctx, name: str, value: Any) -> None:
    """The ``model:`` section: ``model_config`` (the architecture) and ``arch`` (the model class)."""
    walk(ctx, name, value, _SECTION_SPEC)


def finish_model(ctx: Ctx) -> str | None:
    """Write ``model.*`` (and ``train.precision``) from the collected keys; return the missing family's label
    (``deepseek_v3 (MLA + DeepSeekMoE)``) when the model type has no llmtrain family yet, else None."""
    m: dict[str, tuple[str, Any]] = ctx.facts.get("model", {})
    if "model_type" not in m and "type" not in m:
        raise ctx.error(
            "model.model_config", "names no model: give type (1.x, e.g. LlamaConfig) or model_type (2.x)."
        )
    where, kind = m.get("model_type") or m["type"]
    key = str(kind).lower()
    if key not in T.MODEL_TYPES:
        raise ctx.error(
            where,
            f"{kind!r} has no llmtrain family; supported (case-insensitive): {', '.join(T.MODEL_TYPES)}.",
        )
    family, is_moe = T.MODEL_TYPES[key]
    defaults, layout2 = T.MODEL_DEFAULTS.get(key, {}), "model_type" in m
    missing = [c for c in T.REQUIRED_2X if c not in m] if layout2 else []
    if missing:
        raise ctx.error("model.model_config", f"a 2.x (model_type) file must give {', '.join(missing)}.")
    native_type = family or T.MISSING_FAMILIES[key][0]
    ctx.put("model.model_type", native_type)
    ctx.notes.add(f"{where}: {kind!r} -> model.model_type {native_type!r}.")
    if "type" in m and layout2:
        ctx.notes.ignore(m["type"][0], "model_type names the model")
    value = {c: (m[c][1] if c in m else defaults.get(c)) for c in ARCH}
    used_defaults = []
    for c, fixed in T.MODEL_FIXED.get(key, {}).items():
        if c in m and m[c][1] != fixed:
            ctx.notes.add(f"{m[c][0]}: {m[c][1]!r} ignored: MindFormers' {kind} model always uses {fixed!r}.")
            del m[c]
        if c not in m:
            value[c] = fixed
            used_defaults.append(f"{ARCH[c]} {fixed!r} (fixed in MindFormers' {kind} model)")
    for c, target in ARCH.items():
        if target is not None and value[c] is not None:
            ctx.put(target, value[c])
            if c in m:
                ctx.notes.renamed(m[c][0], target)
            elif c not in T.MODEL_FIXED.get(key, {}):
                used_defaults.append(f"{target} {value[c]!r}")
    if "untie" in m:
        tie = not m["untie"][1]
        if "tie_word_embeddings" in m and m["tie_word_embeddings"][1] != tie:
            raise ctx.error(m["untie"][0], "contradicts tie_word_embeddings.")
        ctx.put("model.tie_word_embeddings", tie)
        ctx.notes.add(f"{m['untie'][0]}: {m['untie'][1]!r} -> model.tie_word_embeddings {tie!r}.")
    _ffn(ctx, m, value)
    _rope(ctx, m, value)
    _precision(ctx, m, value["compute_dtype"])
    if used_defaults:
        ctx.notes.add(
            f"MindFormers defaults of {kind} for keys the file leaves out: {', '.join(used_defaults)}."
        )
    if value["checkpoint_name_or_path"] not in (None, ""):
        # run_mindformer.py: run_mode train -> Trainer.train(), which sets checkpoint_name_or_path to None; weights
        # come only from load_checkpoint, refused when set (sections.TOP_IGNORED), as run_mode other than train is
        ctx.notes.add(
            f"{m['checkpoint_name_or_path'][0]}: {value['checkpoint_name_or_path']!r} dropped, as MindFormers drops "
            "it: with run_mode train and an empty load_checkpoint its Trainer.train() sets checkpoint_name_or_path "
            "to None and loads no weights, so pretraining starts from initialised weights (to start from existing "
            "weights, convert them to a Hugging Face directory and set model.init_from: hf:DIR)."
        )
    elif "checkpoint_name_or_path" in m:
        ctx.notes.ignore(m["checkpoint_name_or_path"][0], "empty: the run starts from initialised weights")
    if is_moe or ctx.facts.get("moe"):
        finish_moe(ctx, defaults, layout2)
    return _pending_check(ctx, key, family)


def _ffn(ctx: Ctx, m: dict[str, tuple[str, Any]], value: dict[str, Any]) -> None:
    """MindFormers' LLaMA FFN width when intermediate_size is not given (llama_layer.LlamaFeedForward)."""
    given = [m[c][0] for c in ("multiple_of", "ffn_dim_multiplier") if c in m]
    if value["intermediate_size"] is not None or value["multiple_of"] is None:
        for name in given:
            ctx.notes.ignore(name, "intermediate_size is given")
        return
    hidden, multiple, multiplier = (
        int(value["hidden_size"]),
        int(value["multiple_of"]),
        value["ffn_dim_multiplier"],
    )
    width = 4 * hidden
    if multiplier is not None:
        width = int((float(multiplier) + 0.01) * width)
    width = int(2 * width / 3)
    ffn = multiple * ((width + multiple - 1) // multiple)
    ctx.put("model.intermediate_size", ffn)
    ctx.notes.add(
        f"no intermediate_size -> model.intermediate_size {ffn} by MindFormers' LLaMA rule (4 x hidden {hidden}"
        f"{f', x (ffn_dim_multiplier {multiplier} + 0.01)' if multiplier is not None else ''}, x 2/3, rounded up to "
        f"a multiple of multiple_of {multiple}{'' if 'multiple_of' in m else ', its default'})."
    )


def _rope(ctx: Ctx, m: dict[str, tuple[str, Any]], value: dict[str, Any]) -> None:
    method, factor, scaling = value["extend_method"], value["scaling_factor"], value["rope_scaling"]
    named = ", ".join(
        f"{m[c][0]} {m[c][1]!r}" for c in ("extend_method", "scaling_factor", "rope_scaling") if c in m
    )
    if scaling is not None:
        ctx.put("model.rope_scaling", scaling)
        ctx.notes.add(f"{named} -> model.rope_scaling {scaling!r}.")
    elif method is None or str(method).lower() == "none":
        ctx.put("model.rope_scaling", 1.0)  # the identity: no family default (Llama 3.1 scaling) applies
        ctx.notes.add(
            f"RoPE: {named or 'no scaling'} -> model.rope_scaling 1.0 (linear factor 1: no scaling)."
        )
    elif str(method).upper() == "YARN":
        if not isinstance(factor, dict):
            raise ctx.error(
                m["extend_method"][0] if "extend_method" in m else "model.model_config.extend_method",
                f"{method!r} needs scaling_factor as a mapping (factor, original_max_position_embeddings, beta_fast, "
                f"beta_slow, mscale, mscale_all_dim), got {factor!r}.",
            )
        yarn = {"rope_type": "yarn", **yarn_extras(ctx), **factor}
        ctx.put("model.rope_scaling", yarn)
        ctx.notes.add(f"{named} -> model.rope_scaling {yarn!r} (YaRN).")
    elif str(method).upper() == "PI":
        ctx.put("model.rope_scaling", {"rope_type": "linear", "factor": float(factor or 1.0)})
        ctx.notes.add(
            f"{named} -> model.rope_scaling linear factor {float(factor or 1.0)} (position interpolation)."
        )
    else:
        raise ctx.error(
            m["extend_method"][0], f"{method!r} is not supported: RoPE extension None or PI (linear) only."
        )


def _precision(ctx: Ctx, m: dict[str, tuple[str, Any]], dtype: Any) -> None:
    if dtype is None:
        return
    if str(dtype) not in T.R_DTYPE_NAMES:
        raise ctx.error(
            "model.model_config.compute_dtype", f"{dtype!r} is not one of {', '.join(T.R_DTYPE_NAMES)}."
        )
    precision = T.R_DTYPE_NAMES[str(dtype)]
    ctx.put("train.precision", precision)
    origin = m["compute_dtype"][0] if "compute_dtype" in m else "compute_dtype (MindFormers default)"
    ctx.notes.add(f"{origin}: {dtype!r} -> train.precision {precision} (autocast over fp32 parameters).")


def _pending_check(ctx: Ctx, key: str, family: str | None) -> str | None:
    """The missing family's label, or None after mapping (DeepSeek-V3) or checking off the DeepSeek-only keys."""
    if family == "deepseek_v3":
        scaling = ctx.out.get("model", {}).get("rope_scaling")
        yarn = isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "yarn"
        finish_deepseek(ctx, yarn, "model_type" in ctx.facts.get("model", {}))
        return None
    if family is None:
        waiting = ", ".join(f"{name} {value!r}" for name, value in ctx.facts.get("pending", []))
        ctx.notes.add(
            f"for the {T.MISSING_FAMILIES[key][1]} family, not in llmtrain yet: {waiting or 'its model type'}."
        )
        return T.MISSING_FAMILIES[key][1]
    for name, value in ctx.facts.get("pending", []):
        neutral = NEUTRAL.get(name.rsplit(".", 1)[-1], (None,))
        if neutral is None or any(same(value, v) for v in neutral):
            ctx.notes.ignore(name, "off in this file (an MLA / MTP / DeepSeek top-k method setting)")
            continue
        raise ConfigError(
            f"{ctx.source}: {name}: {value!r} is not supported: it is a DeepSeek-V3 setting (Multi-head Latent "
            f"Attention, multi-token prediction or DeepSeek's top-k method) and model type {key!r} "
            f"(llmtrain family {family}) has no such part; remove it or set it off."
        )
    return None


def finish_pipeline(ctx: Ctx, pp: int) -> None:
    """``offset`` / ``pp_interleave_num`` -> ``parallel.pipeline_layers`` / ``virtual_stages``."""
    m: dict[str, tuple[str, Any]] = ctx.facts.get("model", {})
    rounds = m["pp_interleave_num"][1] if "pp_interleave_num" in m else 1
    if "pp_interleave_num" in m and (pp == 1 or rounds == 1):
        ctx.notes.ignore(m["pp_interleave_num"][0], "no interleaved pipeline (pipeline_stage 1 or 1 round)")
    if pp > 1 and rounds > 1:
        ctx.put("parallel.virtual_stages", rounds)
        ctx.put("parallel.schedule", "interleaved_1f1b")
        ctx.notes.add(
            f"{m['pp_interleave_num'][0]}: {rounds} -> parallel.virtual_stages {rounds}, schedule interleaved_1f1b."
        )
    if "offset" not in m:
        return
    name, offset = m["offset"]
    if pp == 1:
        ctx.notes.ignore(name, "no pipeline parallel")
        return
    if offset in (0, None):
        ctx.notes.add(f"{name}: 0 -> parallel.pipeline_layers null (an even split).")
        return
    mtp = _mtp_layers(ctx)
    layers = int(ctx.out["model"]["num_layers"]) + mtp
    avg = layers // (pp * rounds)
    rows = (
        offset if isinstance(offset, list) and offset and isinstance(offset[0], list) else [offset] * rounds
    )
    split: list[int] = []
    for row in rows:
        row = row if isinstance(row, list) else [row] * pp
        if len(row) != pp or not all(isinstance(o, int) and not isinstance(o, bool) for o in row):
            raise ctx.error(name, f"{offset!r}: expected an integer or {pp} integers per interleave round.")
        split += [avg + o for o in row]
    if len(split) != pp * rounds:
        raise ctx.error(
            name, f"{offset!r}: expected {rounds} rows of {pp} offsets (pp_interleave_num rounds)."
        )
    without = ""
    if mtp and ctx.out["model"].get("model_type") == "deepseek_v3":  # MTP is not built: off the last stage
        split[-1] -= mtp
        without = f", less the {mtp} multi-token-prediction layer(s) MindFormers places on the last stage"
        if split[-1] < 1:
            raise ctx.error(
                name, f"{offset!r}: the last stage would hold only multi-token-prediction layers."
            )
    ctx.put("parallel.pipeline_layers", split)
    ctx.notes.add(
        f"{name}: {offset!r} -> parallel.pipeline_layers {split} ({layers} // {pp * rounds} + offset per stage"
        f"{without})."
    )


def _mtp_layers(ctx: Ctx) -> int:
    """MindFormers counts multi-token-prediction layers in the pipeline split (DeepSeek-V3's mtp_depth)."""
    return mtp_layers(ctx)

"""``model.init_from: hf:DIR``: the architecture comes from ``DIR/config.json``, not from the YAML.

:func:`init_from_args` is what ``resolve.derive`` calls for such a config, so ``check``, ``plan`` and ``train``
all see the real model. The YAML's model section may stay empty (only ``seq_length``, the training length, is
its own); every architecture key it does set is compared with config.json, and each disagreement is named
with both values in one ConfigError (``model.flavor`` counts as setting all of that flavor's fields). The
tokenizer's vocabulary must fit the embedding (``<= vocab_size``); a smaller one leaves rows unused, as
published checkpoints do. ``model.model_type`` has a default (llama3), so only a non-default value is
compared. When ``DIR/config.json`` is not on this machine (a cluster path checked on a laptop) and the YAML
names an architecture, that architecture is used as before; the trainer's load then says what is missing.

:func:`model_config_of` writes the resolved architecture back into the model section (the run's
``config.yaml`` is then self-describing: a run can be generated from or exported after DIR is gone, and
re-resolving it with DIR present agrees key by key). RoPE scaling that is off is written as ``none``, since
``rope_scaling: null`` in YAML means "the flavor's".
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from llmtrain.config.schema import ModelConfig
from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.models import TransformerArgs, get_family, resolve_model_args
from llmtrain.models.common.family import OVERRIDABLE
from llmtrain.models.common.rope import normalize_rope_scaling

# ModelConfig fields that name an architecture setting (same name on TransformerArgs).
# The shape fields first (``_FROM_FLAVOR`` takes them), then every other architecture field; vocab_size is part
# of a checkpoint's shape, max_position_embeddings is metadata (kept, not compared).
COMPARED = (
    *OVERRIDABLE[:6],
    "vocab_size",
    *(k for k in OVERRIDABLE[6:] if k != "max_position_embeddings"),
)
_FROM_FLAVOR = (
    *COMPARED[:7],
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "partial_rotary_factor",
    "qkv_bias",
    "sliding_window",
    "post_norms",
    "num_experts",
    "top_k",
    "moe_hidden_size",
    "shared_experts",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
# model.moe fields that name an architecture setting -> the TransformerArgs field.
MOE_COMPARED = {
    "num_experts": "num_experts",
    "top_k": "top_k",
    "moe_hidden_size": "moe_hidden_size",
    "shared_experts": "shared_experts",
    "shared_expert_gate": "shared_expert_gate",
    "router_score": "router_score",
    "route_norm": "route_norm",
    "every": "moe_every",
    "first_dense_layers": "first_dense_layers",
    "n_group": "n_group",
    "topk_group": "topk_group",
    "routed_scaling_factor": "routed_scaling_factor",
    "pre_softmax": "pre_softmax",
}
# model.moe training options the YAML may set for an imported model (config.json gives only the aux coefficient).
MOE_TRAINING = (
    "aux_loss_coef", "bias_update_rate", "capacity_factor", "aux_loss_scope", "drop_policy", "router_fp32",
)  # fmt: skip


def hf_init_dir(cfg: ModelConfig) -> Path | None:
    """``DIR`` of ``model.init_from: hf:DIR``, else None."""
    source = cfg.init_from
    return Path(source[3:]) if isinstance(source, str) and source.startswith("hf:") else None


def _names_architecture(cfg: ModelConfig) -> bool:
    return cfg.flavor is not None or cfg.hidden_size is not None


def init_from_args(cfg: ModelConfig, vocab_size: int | None) -> TransformerArgs:
    """The TransformerArgs of a run whose model section has ``init_from: hf:DIR`` (see the module docstring)."""
    from llmtrain.models.hf_io import read_hf_config

    path = hf_init_dir(cfg)
    assert path is not None
    if not (path / "config.json").is_file() and _names_architecture(cfg):
        return resolve_model_args(cfg, vocab_size)  # DIR not on this machine: the YAML's own architecture
    d, hf_args = read_hf_config(path)
    source = path / "config.json"
    problems = _disagreements(cfg, d, hf_args, vocab_size)
    if problems:
        raise ConfigError(
            f"model.init_from: hf:{path} takes the architecture from {source}, and the config's model section "
            f"disagrees with it: {'; '.join(problems)}. Remove these keys from the model section (config.json "
            "decides) or point model.init_from at the model they describe."
        )
    if vocab_size is not None and vocab_size > hf_args.vocab_size:
        raise ConfigError(
            f"the tokenizer has {vocab_size} tokens but {source} has vocab_size {hf_args.vocab_size}: token ids >= "
            f"{hf_args.vocab_size} would index past the embedding of model.init_from. Use the model's own "
            "tokenizer (or one no larger)."
        )
    training = {k: getattr(cfg.moe, k) for k in MOE_TRAINING if getattr(cfg.moe, k) is not None}
    return dataclasses.replace(
        hf_args, seq_length=cfg.seq_length, **(training if hf_args.num_experts else {})
    )


def _disagreements(
    cfg: ModelConfig, d: dict[str, Any], hf: TransformerArgs, vocab_size: int | None
) -> list[str]:
    """``model.KEY is A but config.json says B`` for every explicitly set key that differs."""
    out: list[str] = []

    def differ(key: str, ours: Any, theirs: Any) -> None:
        if ours != theirs:
            out.append(f"model.{key} is {ours!r}, config.json gives {theirs!r}")

    if cfg.model_type != ModelConfig.model_type:
        differ("model_type", get_family(cfg.model_type).name, hf.family)
    if cfg.flavor is not None:
        spec = get_family(cfg.model_type)
        if cfg.flavor not in spec.flavors:
            raise ConfigError(f"model.flavor {cfg.flavor!r} is not a flavor of {spec.name}.")
        flavor = spec.flavor_args(cfg.flavor)
        for key in _FROM_FLAVOR:
            if getattr(flavor, key) != getattr(hf, key):
                out.append(
                    f"model.flavor {cfg.flavor} has {key} {getattr(flavor, key)!r}, config.json gives "
                    f"{getattr(hf, key)!r}"
                )
    for key in COMPARED:
        value = getattr(cfg, key)
        if value is None:
            continue
        if key == "rope_scaling":
            value = normalize_rope_scaling(value, d.get("max_position_embeddings"), hf.rotary_dim)
        differ(key, value, getattr(hf, key))
    if cfg.max_position_embeddings is not None:
        differ("max_position_embeddings", cfg.max_position_embeddings, d.get("max_position_embeddings"))
    if not cfg.use_rope:
        differ("use_rope", False, hf.position_embedding == "rope")
    scheme = getattr(cfg, "norm_scheme", None)
    if scheme is not None and (scheme != "pre") != hf.post_norms:  # dssn vs sandwich: only the init differs
        differ("norm_scheme", scheme, "sandwich" if hf.post_norms else "pre")
    for key, arg in MOE_COMPARED.items():
        value = getattr(cfg.moe, key)
        if value is not None and (hf.num_experts or key == "num_experts"):
            differ(f"moe.{key}", value, getattr(hf, arg))
    return out


def model_config_of(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its architecture keys filled from ``DIR/config.json`` (unchanged without init_from hf:,
    or when config.json is not on this machine)."""
    path = hf_init_dir(cfg)
    if path is None or not (path / "config.json").is_file():
        return cfg
    from llmtrain.models.hf_io import read_hf_config

    try:
        d, args = read_hf_config(path)
    except CheckpointError:
        return cfg  # derive has raised it already for the run; nothing to fill
    values: dict[str, Any] = {k: getattr(args, k) for k in COMPARED}
    values["rope_scaling"] = dict(args.rope_scaling) if args.rope_scaling else "none"
    values.update(
        model_type=args.family, flavor=None, max_position_embeddings=d.get("max_position_embeddings")
    )
    if args.num_experts:  # the experts too; training options the YAML set stay (init_from_args applied them)
        moe = {key: getattr(args, arg) for key, arg in MOE_COMPARED.items()}
        moe.update({k: getattr(args, k) for k in MOE_TRAINING if getattr(cfg.moe, k) is None})
        values["moe"] = dataclasses.replace(cfg.moe, **moe)
    return dataclasses.replace(cfg, **values)

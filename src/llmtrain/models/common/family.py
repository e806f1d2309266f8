"""Model families, their named flavors, and the resolution of a ``ModelConfig`` into ``TransformerArgs``.

A :class:`FamilySpec` is plain data: the family's fixed switches and defaults, a table of flavors (each a
partial ``TransformerArgs`` as a dict), the module of its Hugging Face adapter, and its tensor-parallel plan
(:class:`TPPlan`: two builders, TransformerArgs -> {module path: ParallelStyle}; every family uses
:data:`COMMON_TP_PLAN`, the Megatron-style plan of ``models/common/parallelize.py``, imported on first use
because it pulls in ``torch.distributed.tensor``). Resolution layers three
sources, later ones winning: family defaults <- the named flavor <- every explicit (non-None) field of the
config. Without a flavor the config must give at least ``hidden_size``, ``num_layers`` and ``num_heads``; the
rest is derived (``num_kv_heads = num_heads``, ``head_dim = hidden_size / num_heads``, ``intermediate_size =
ceil(8/3 * hidden_size)`` rounded up to a multiple of 256). The vocabulary comes from the config, else from the
tokenizer, else from the flavor. Every inconsistency is a ``ConfigError`` naming the ``model.*`` key.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any

from llmtrain.config.schema import ModelConfig
from llmtrain.errors import ConfigError
from llmtrain.models.common.args import TransformerArgs, check_moe_args
from llmtrain.models.common.layers import ACTIVATIONS
from llmtrain.models.common.mla import check_mla_args
from llmtrain.models.common.rope import normalize_rope_scaling as rope_normalize

# ModelConfig fields copied onto TransformerArgs when set (same names on both sides): the architecture a YAML
# may state (``models.hf_resolve`` compares the same fields with a Hugging Face config.json).
OVERRIDABLE = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "position_embedding",
    "partial_rotary_factor",
    "qkv_bias",
    "qk_norm",
    "norm_head",
    "tie_word_embeddings",
    "hidden_act",
    "mlp_bias",
    "attention_out_bias",
    "max_position_embeddings",
    "sliding_window",
    "sliding_window_layers",
    "post_norms",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
_ARG_FIELDS = {f.name for f in fields(TransformerArgs)}


@dataclass(frozen=True)
class TPPlan:
    """How tensor parallel splits a family's model: ``block(args)`` plans one TransformerBlock (paths relative
    to the block), ``top(args, loss_parallel)`` the modules around the blocks (the head's logits sharded over
    the vocabulary or gathered); both return {module path: ParallelStyle}."""

    block: Callable[[TransformerArgs], dict[str, Any]]
    top: Callable[[TransformerArgs, bool], dict[str, Any]]


def _common_block_plan(args: TransformerArgs) -> dict[str, Any]:
    from llmtrain.models.common.parallelize import block_plan  # lazy: imports torch.distributed.tensor

    return block_plan(args)


def _common_top_plan(args: TransformerArgs, loss_parallel: bool = True) -> dict[str, Any]:
    from llmtrain.models.common.parallelize import top_plan  # lazy: imports torch.distributed.tensor

    return top_plan(args, loss_parallel)


COMMON_TP_PLAN = TPPlan(block=_common_block_plan, top=_common_top_plan)
"""The Megatron-style plan with sequence parallel shared by every family (``models/common/parallelize.py``)."""


@dataclass(frozen=True)
class FamilySpec:
    """One model family: defaults shared by its flavors, the flavors, its HF adapter module and TP plan."""

    name: str
    defaults: dict[str, Any]
    flavors: dict[str, dict[str, Any]]
    hf: ModuleType | None = None
    description: str = ""
    aliases: tuple[str, ...] = field(default_factory=tuple)
    tp_plan: TPPlan = COMMON_TP_PLAN
    """The tensor-parallel plan (``distributed/parallelize.apply_tp`` applies it)."""

    def flavor_args(self, flavor: str) -> TransformerArgs:
        """The flavor's TransformerArgs without any config overrides (e.g. for parameter counts)."""
        values = {"seq_length": 2048, **self.defaults, **self.flavors[flavor]}
        return _finish({**values, "family": self.name, "flavor": flavor})


def default_intermediate_size(hidden_size: int) -> int:
    """ceil(8/3 * hidden_size) rounded up to a multiple of 256 (the SwiGLU width with ~4x MLP parameters)."""
    return 256 * math.ceil(math.ceil(8 * hidden_size / 3) / 256)


def normalize_rope_scaling(value: Any, max_positions: int | None = None) -> dict[str, Any] | None:
    """None, a number (linear factor), an off spelling (``none``) or a mapping -> the dict form
    ``TransformerArgs.rope_scaling`` holds (``models/common/rope.normalize_rope_scaling``)."""
    return rope_normalize(value, max_positions)


def resolve(spec: FamilySpec, cfg: ModelConfig, vocab_size: int | None) -> TransformerArgs:
    """Family defaults <- flavor <- explicit config fields, validated (see the module docstring)."""
    values: dict[str, Any] = dict(spec.defaults)
    if cfg.flavor is not None:
        if cfg.flavor not in spec.flavors:
            raise ConfigError(
                f"model.flavor {cfg.flavor!r} is not a flavor of {spec.name}; valid flavors: "
                f"{', '.join(spec.flavors)}."
            )
        values.update(spec.flavors[cfg.flavor])
    else:
        missing = [
            f"model.{k}" for k in ("hidden_size", "num_layers", "num_heads") if getattr(cfg, k) is None
        ]
        if missing:
            raise ConfigError(
                f"model.flavor is not set and {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                f"missing: either name a flavor of {spec.name} ({', '.join(spec.flavors)}) or give "
                "model.hidden_size, model.num_layers and model.num_heads."
            )
    for key in OVERRIDABLE:
        value = getattr(cfg, key)
        if value is not None:
            values[key] = value
    _resolve_norm_scheme(cfg, values)
    for key, value in vars(getattr(cfg, "moe", None) or {}).items():  # model.moe.* (every -> moe_every)
        if value is not None:
            values["moe_every" if key == "every" else key] = value
    if not cfg.use_rope:
        if cfg.position_embedding not in (None, "alibi"):
            raise ConfigError(
                f"model.use_rope is false but model.position_embedding is {cfg.position_embedding!r}; "
                "set model.position_embedding: alibi (the only position embedding besides rope)."
            )
        values["position_embedding"] = "alibi"
    if values.get("position_embedding") == "alibi":
        for key in ("rope_scaling", "partial_rotary_factor"):
            if getattr(cfg, key) is not None and not (
                key == "rope_scaling" and rope_normalize(cfg.rope_scaling) is None
            ):
                raise ConfigError(
                    f"model.{key} is set but model.position_embedding is alibi, which has no rotary "
                    f"embedding; remove model.{key} or use position_embedding: rope."
                )
        values["rope_scaling"] = None
    vocab = cfg.vocab_size if cfg.vocab_size is not None else vocab_size
    if vocab is not None:
        values["vocab_size"] = vocab
    elif "vocab_size" not in values:
        raise ConfigError(
            "model.vocab_size is not set and no tokenizer vocabulary is known: set model.vocab_size or "
            "data.tokenizer (or a dataset whose manifest names its tokenizer)."
        )
    values.update(
        family=spec.name, flavor=cfg.flavor, seq_length=cfg.seq_length, init_std=cfg.init_std, init=cfg.init
    )
    return _finish(values)


def _resolve_norm_scheme(cfg: ModelConfig, values: dict[str, Any]) -> None:
    """``model.norm_scheme`` sets ``post_norms`` (sandwich and dssn have the post norms, pre has none); an
    explicit ``model.post_norms`` that says otherwise is a ConfigError naming both keys."""
    scheme = getattr(cfg, "norm_scheme", None)
    if scheme is None:
        return
    post = scheme != "pre"
    if cfg.post_norms is not None and cfg.post_norms != post:
        raise ConfigError(
            f"model.norm_scheme {scheme} {'has' if post else 'has no'} post norms but model.post_norms is "
            f"{str(cfg.post_norms).lower()}; remove model.post_norms (norm_scheme sets it)."
        )
    values.update(norm_scheme=scheme, post_norms=post)


NORM_SCHEMES = ("pre", "sandwich", "dssn")
INITS = ("default", "tinyinit")


def _check_norm_scheme(values: dict[str, Any]) -> None:
    """``norm_scheme`` one of :data:`NORM_SCHEMES` and consistent with ``post_norms`` (unset: derived from it);
    ``init`` one of :data:`INITS`."""
    post = values.get("post_norms", False)
    scheme = values.setdefault("norm_scheme", "sandwich" if post else "pre")
    if scheme not in NORM_SCHEMES:
        raise ConfigError(f"model.norm_scheme must be one of {', '.join(NORM_SCHEMES)}, got {scheme!r}.")
    if (scheme != "pre") != bool(post):
        raise ConfigError(
            f"model.norm_scheme {scheme} and model.post_norms {post!r} disagree: sandwich and dssn have the "
            "post norms, pre has none."
        )
    init = values.setdefault("init", "default")
    if init not in INITS:
        raise ConfigError(f"model.init must be one of {', '.join(INITS)}, got {init!r}.")


def _finish(values: dict[str, Any]) -> TransformerArgs:
    """Fill derived fields, check every constraint, build the dataclass."""
    for key in ("hidden_size", "num_layers", "num_heads", "vocab_size", "seq_length"):
        _positive_int(values, key)
    check_mla_args(values)  # MLA (kv_lora_rank > 0) fixes head_dim and num_kv_heads
    values.setdefault("num_kv_heads", values["num_heads"])
    _positive_int(values, "num_kv_heads")
    if values.get("head_dim") is None:
        if values["hidden_size"] % values["num_heads"]:
            raise ConfigError(
                f"model.num_heads ({values['num_heads']}) must divide model.hidden_size "
                f"({values['hidden_size']}) when model.head_dim is not set."
            )
        values["head_dim"] = values["hidden_size"] // values["num_heads"]
    _positive_int(values, "head_dim")
    if values.get("intermediate_size") is None:
        values["intermediate_size"] = default_intermediate_size(values["hidden_size"])
    _positive_int(values, "intermediate_size")
    if values["num_heads"] % values["num_kv_heads"]:
        raise ConfigError(
            f"model.num_kv_heads ({values['num_kv_heads']}) must divide model.num_heads ({values['num_heads']})."
        )
    pe = values.get("position_embedding", "rope")
    if pe not in ("rope", "alibi"):
        raise ConfigError(f"model.position_embedding must be rope or alibi, got {pe!r}.")
    partial = _positive_float(values, "partial_rotary_factor") if "partial_rotary_factor" in values else 1.0
    rotary_dim = int(values["head_dim"] * partial)
    if pe == "rope" and not (0 < partial <= 1 and rotary_dim >= 2 and rotary_dim % 2 == 0):
        raise ConfigError(
            f"model.partial_rotary_factor {partial} must be in (0, 1] and give an even number of rotated "
            f"dimensions of model.head_dim {values['head_dim']} (got {rotary_dim})."
        )
    max_pos = values.get("max_position_embeddings")
    if max_pos is not None:
        _positive_int(values, "max_position_embeddings")
    # a copy, never shared; types that need the original context take max_position_embeddings when unset
    values["rope_scaling"] = rope_normalize(values.get("rope_scaling"), max_pos, rotary_dim)
    act = values.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"model.hidden_act {act!r} is not supported; valid: {', '.join(ACTIVATIONS)}.")
    if values.get("num_experts") and (act != "silu" or values.get("mlp_bias")):
        raise ConfigError(
            "model.moe experts are SwiGLU without biases: model.hidden_act must be silu and model.mlp_bias "
            f"false with model.moe.num_experts > 0 (got hidden_act {act!r}, mlp_bias {values.get('mlp_bias')!r})."
        )
    for key in ("rms_norm_eps", "rope_theta", "init_std", "partial_rotary_factor"):
        if key in values:
            values[key] = _positive_float(values, key)
    _check_sliding(values)
    _check_norm_scheme(values)
    unknown = set(values) - _ARG_FIELDS
    if unknown:
        raise ConfigError(f"unknown model argument(s) {', '.join(sorted(unknown))}.")
    check_moe_args(values)
    return TransformerArgs(**values)


def _check_sliding(values: dict[str, Any]) -> None:
    """``sliding_window`` an integer >= 0; ``sliding_window_layers`` None or distinct block indices (sorted)."""
    window = values.get("sliding_window", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ConfigError(
            f"model.sliding_window must be an integer >= 0 (0 = full attention), got {window!r}."
        )
    layers, n = values.get("sliding_window_layers"), values["num_layers"]
    if layers is not None:
        ok = isinstance(layers, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in layers
        )
        if not ok or len(set(layers)) != len(layers):
            raise ConfigError(
                f"model.sliding_window_layers must be null (every block) or a list of distinct block indices in "
                f"[0, {n}), got {layers!r}."
            )
        values["sliding_window_layers"] = sorted(layers)
    if not isinstance(values.get("post_norms", False), bool):
        raise ConfigError(f"model.post_norms must be true or false, got {values['post_norms']!r}.")


def _positive_int(values: dict[str, Any], key: str) -> None:
    value = values.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"model.{key} must be a positive integer, got {value!r}.")


def _positive_float(values: dict[str, Any], key: str) -> float:
    value = values.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"model.{key} must be a positive number, got {value!r}.")
    return float(value)

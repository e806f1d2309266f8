"""Hugging Face ``config.json`` <-> ``TransformerArgs`` for the families that transformers implements.

The rule: our model computes what transformers' class for that ``model_type`` computes from the same file.
So a key transformers reads is honoured or refused with a ConfigError naming it, and a key it ignores is
ignored here too; an absent key takes the value the transformers config class defaults to
(:class:`HFDefaults`: Qwen3 and GLM default ``head_dim`` to 128, Qwen2/3 ``num_key_value_heads`` to 32, every
family ``rope_theta`` to 10,000, ...). The architecture sizes themselves (hidden, layers, heads,
intermediate, vocabulary) must be present.

Honoured: sizes, ``head_dim``, ``num_key_value_heads``, ``rms_norm_eps``, ``rope_theta`` and ``rope_scaling``
of every type (4.x spelling ``rope_theta`` + ``rope_scaling``, 5.x spelling ``rope_parameters``; when both
are present ``rope_scaling`` wins, as in transformers 5; a top-level ``original_max_position_embeddings``
overrides the one inside), ``partial_rotary_factor`` (GLM; Llama and Qwen rotate whole heads, so another value
is refused), ``hidden_act`` (silu/swish, gelu/gelu_python, gelu_new/gelu_pytorch_tanh/gelu_fast/
gelu_accurate/gelu_python_tanh as the tanh approximation), ``attention_bias`` (Llama, Qwen3: q/k/v and
o_proj biases; GLM: q/k/v), ``mlp_bias`` (Llama), ``tie_word_embeddings``, ``max_position_embeddings``
(dynamic / longrope scaling read it), ``initializer_range`` (init_std).
Sliding windows (:func:`hf_sliding_window`) are honoured where transformers applies them, by the rule of the
family's class: Mistral / Mixtral ``sliding_window`` on every layer; Qwen2 / Qwen3 only with
``use_sliding_window``, on the ``layer_types`` sliding layers or those >= ``max_window_layers``; Qwen2-MoE
with ``use_sliding_window``, on ``layer_types`` or the even layers below ``max_window_layers``; Qwen3-MoE with
``use_sliding_window`` on every layer. A family that passes ``sliding=True`` (a window it does not implement)
still refuses an active one.
Refused: ``attention_dropout`` > 0 (we have no dropout), a ``quantization_config``, per-layer-type
``rope_parameters``, an unknown ``hidden_act``.

Values are checked by :class:`ConfigReader` (a size that is not a positive integer, a flag that is not a
boolean: CheckpointError naming the file, key and value). :func:`common_hf_config` writes the keys every
family shares (4.x RoPE spelling, which transformers 4 and 5 both read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.rope import normalize_rope_scaling

_MISSING: Any = object()

# Hugging Face hidden_act -> ours (transformers.activations.ACT2CLS: the tanh spellings are one function).
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_accurate": "gelu_tanh",
}
OUR_ACTIVATION_TO_HF = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
_READS_MAX_POS = (
    "dynamic",
    "yarn",
    "longrope",
)  # rope types whose frequencies depend on max_position_embeddings


@dataclass(frozen=True)
class HFDefaults:
    """What a transformers config class assumes for an absent key (``configuration_<family>.py``)."""

    rms_norm_eps: float = 1e-6
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    num_key_value_heads: int | None = None  # None: num_attention_heads
    max_position_embeddings: int = 2048
    partial_rotary_factor: float = 1.0
    rope_theta: float = 10000.0
    sliding_window: int | None = 4096


class ConfigReader:
    """Typed access to a config.json dict; every bad value is a CheckpointError naming ``source`` and the key."""

    def __init__(self, d: dict[str, Any], source: str = "config.json") -> None:
        self.d, self.source = d, source

    def _fail(self, key: str, value: Any, what: str) -> CheckpointError:
        return CheckpointError(
            f"{self.source}: {key} must be {what}, got {value!r}. Fix config.json or re-save the model with "
            "transformers."
        )

    def has(self, key: str) -> bool:
        return key in self.d

    def int(self, key: str, default: Any = _MISSING, minimum: int = 1) -> int:
        value = self.d.get(key, default)
        if value is _MISSING:
            raise CheckpointError(f"{self.source} lacks the key {key!r}, which the architecture needs.")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._fail(key, value, f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: Any = _MISSING, positive: bool = True) -> float:
        value = self.d.get(key, default)
        if value is _MISSING:
            raise CheckpointError(f"{self.source} lacks the key {key!r}, which the architecture needs.")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and not value > 0):
            raise self._fail(key, value, "a positive number" if positive else "a number")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.d.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(key, value, "true or false")
        return value


def hf_rope(
    r: ConfigReader, defaults: HFDefaults, head_dim: int, max_positions: int
) -> tuple[float, dict[str, Any] | None, float]:
    """``(rope_theta, rope_scaling or None, partial_rotary_factor)`` from either RoPE spelling of config.json."""
    legacy, params = r.d.get("rope_scaling"), r.d.get("rope_parameters")
    for key, value in (("rope_scaling", legacy), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise r._fail(key, value, "null or a mapping")
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(
            f"{r.source}: rope_parameters is given per layer type ({', '.join(params)}); llmtrain has one RoPE "
            "for all layers, so this model is refused."
        )
    scaling = dict(legacy or params or {})  # transformers 5: rope_scaling wins over rope_parameters
    theta = scaling.pop("rope_theta", r.number("rope_theta", defaults.rope_theta))
    partial = scaling.pop(
        "partial_rotary_factor", r.d.get("partial_rotary_factor", defaults.partial_rotary_factor)
    )
    theta = ConfigReader({"rope_theta": theta}, r.source).number("rope_theta")
    partial = ConfigReader({"partial_rotary_factor": partial}, r.source).number("partial_rotary_factor")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("llama3", "yarn", "longrope") and r.has("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = r.int("original_max_position_embeddings")
    if kind == "default":  # transformers computes plain RoPE whatever else the mapping holds
        scaling = {}
    rotary_dim = int(head_dim * partial)
    where = f"{r.source} rope_scaling"
    return theta, normalize_rope_scaling(scaling or None, max_positions, rotary_dim, where), partial


def refuse_unsupported(r: ConfigReader, num_layers: int, sliding: bool) -> None:
    """ConfigError for a setting transformers would apply and llmtrain cannot (see the module docstring)."""
    dropout = r.d.get("attention_dropout", 0.0)
    if dropout not in (None, 0, 0.0):
        raise ConfigError(
            f"{r.source}: attention_dropout {dropout!r} would drop attention weights in training, and llmtrain's "
            "attention has no dropout; set it to 0.0 to import the model."
        )
    if r.d.get("quantization_config"):
        raise ConfigError(
            f"{r.source}: quantization_config is set: the weights are quantized, which llmtrain cannot train or "
            "load; import the unquantized model."
        )
    if not sliding:
        return
    window, use = r.d.get("sliding_window", 4096), r.bool("use_sliding_window", False)
    if not use or window is None:
        return
    layer_types = r.d.get("layer_types")
    if layer_types is None:
        start = r.int("max_window_layers", 28, minimum=0)
        layer_types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    if "sliding_attention" in list(layer_types):
        raise ConfigError(
            f"{r.source}: use_sliding_window is true with sliding_window {window} and sliding layers (from "
            f"{'layer_types' if r.has('layer_types') else 'max_window_layers'}); llmtrain's attention has no "
            "sliding window, so these layers would see more context than the model was trained with. Set "
            "use_sliding_window to false only if the model never relied on it."
        )


SLIDING_RULES = ("all", "qwen", "qwen2_moe", "qwen3_moe")
"""How a transformers class picks its sliding layers (see the module docstring)."""


def hf_sliding_window(
    r: ConfigReader, num_layers: int, rule: str, default: int | None
) -> tuple[int, list[int] | None]:
    """``(window, sliding block indices or None for every block)`` as transformers' ``rule`` computes them from
    config.json; ``(0, None)`` when no layer slides. ``default``: the config class's ``sliding_window``."""
    assert rule in SLIDING_RULES, rule
    if rule != "all" and not r.bool("use_sliding_window", False):
        return 0, None
    window = r.d.get("sliding_window", default)
    if window is None:
        return 0, None
    window = r.int("sliding_window", window)
    layers: list[int] | None = None
    if rule in ("qwen", "qwen2_moe"):
        types = r.d.get("layer_types")
        if types is not None:
            kinds = ("full_attention", "sliding_attention")
            if not isinstance(types, list) or len(types) != num_layers or any(t not in kinds for t in types):
                raise r._fail("layer_types", types, f"a list of {num_layers} of {' / '.join(kinds)}")
            layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
        else:
            start = r.int("max_window_layers", 28, minimum=0)
            layers = [
                i for i in range(num_layers) if (i >= start if rule == "qwen" else i % 2 == 0 and i < start)
            ]
        if not layers:
            return 0, None
        if len(layers) == num_layers:
            layers = None
    return window, layers


def hidden_act(r: ConfigReader) -> str:
    act = r.d.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise ConfigError(
            f"{r.source}: hidden_act {act!r} is not supported; supported: {', '.join(HF_ACTIVATIONS)}."
        )
    return HF_ACTIVATIONS[act]


def common_args_from_hf(
    d: dict[str, Any],
    family: str,
    defaults: HFDefaults,
    source: str = "config.json",
    whole_heads: bool = True,
    sliding: bool | str = False,
    **fixed: Any,
) -> TransformerArgs:
    """TransformerArgs from the shared config.json keys; ``fixed`` sets the family's own switches.

    ``whole_heads``: the family's transformers class rotates every head dimension (Llama, Qwen), so a
    ``partial_rotary_factor`` other than 1 is refused. ``sliding``: a rule of :data:`SLIDING_RULES` (the
    window is honoured that way), or True (the family knows a window llmtrain does not implement: refused)."""
    r = ConfigReader(d, source)
    heads = r.int("num_attention_heads")
    hidden = r.int("hidden_size")
    layers = r.int("num_hidden_layers")
    kv = d.get("num_key_value_heads", defaults.num_key_value_heads)
    kv = heads if kv is None else r.int("num_key_value_heads", kv)
    head_dim = d.get("head_dim", defaults.head_dim)
    head_dim = hidden // heads if head_dim is None else r.int("head_dim", head_dim)
    max_pos = r.int("max_position_embeddings", defaults.max_position_embeddings)
    theta, scaling, partial = hf_rope(r, defaults, head_dim, max_pos)
    if whole_heads and partial != 1.0:
        raise ConfigError(
            f"{source}: partial_rotary_factor {partial} is set, but transformers' {family} model rotates whole "
            "heads (it ignores the factor or fails with scaling); remove it to import the model."
        )
    if heads % kv:
        raise CheckpointError(
            f"{source}: num_key_value_heads {kv} does not divide num_attention_heads {heads}."
        )
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise CheckpointError(
            f"{source}: head_dim {head_dim} x partial_rotary_factor {partial} = {rotary_dim} rotated dimensions; "
            "it must be even and at least 2."
        )
    window, window_layers = 0, None
    if isinstance(sliding, str):
        window, window_layers = hf_sliding_window(r, layers, sliding, defaults.sliding_window)
    refuse_unsupported(r, layers, sliding is True)
    values: dict[str, Any] = {
        "family": family,
        "flavor": None,
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": r.int("intermediate_size"),
        "vocab_size": r.int("vocab_size"),
        "seq_length": max_pos,
        # kept where the RoPE arithmetic reads it (the exporter writes config.json's own value back)
        "max_position_embeddings": max_pos if scaling and scaling["rope_type"] in _READS_MAX_POS else None,
        "rms_norm_eps": r.number("rms_norm_eps", defaults.rms_norm_eps),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "partial_rotary_factor": partial,
        "tie_word_embeddings": r.bool("tie_word_embeddings", False),
        "init_std": r.number("initializer_range", 0.02),
        "hidden_act": hidden_act(r),
        "sliding_window": window,
        "sliding_window_layers": window_layers,
    }
    values.update(fixed)
    values["norm_scheme"] = "sandwich" if values.get("post_norms") else "pre"  # GLM-4-0414's post norms
    return TransformerArgs(**values)


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
        "hidden_act": OUR_ACTIVATION_TO_HF[args.hidden_act],
        "max_position_embeddings": args.max_position_embeddings or args.seq_length,
        "rms_norm_eps": args.rms_norm_eps,
        "initializer_range": args.init_std,
        "tie_word_embeddings": args.tie_word_embeddings,
        "rope_theta": args.rope_theta,
        "attention_dropout": 0.0,
        "pad_token_id": None,  # token ids belong to the tokenizer; the exporter may fill them in
    }
    if args.rope_scaling:
        d["rope_scaling"] = dict(args.rope_scaling)
        original = args.rope_scaling.get("original_max_position_embeddings")
        factor = args.rope_scaling.get("factor")
        if original and factor and args.max_position_embeddings is None:
            # the scaled context is what HF calls max_position_embeddings (Llama 3.1: 8192 * 16)
            d["max_position_embeddings"] = max(args.seq_length, int(original * factor))
    return d

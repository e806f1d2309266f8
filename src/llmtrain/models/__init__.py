"""Model families and their named flavors; the entry points the trainer, planner and exporter use.

``FAMILIES`` maps a ``model.model_type`` (``llama3`` and its alias ``llama``, ``qwen2``, ``qwen3``, ``glm4``,
``baichuan2``, ``mistral``, ``mixtral``, ``deepseek_v3``) to a :class:`FamilySpec`: defaults, flavors and the Hugging Face adapter module (``spec.hf``
with ``from_hf_state_dict``, ``to_hf_state_dict``, ``to_hf_config``, ``args_from_hf_config``). All families
share one single-device :class:`Transformer`; parallelism is applied to it from outside.

Typical use::

    args = resolve_model_args(cfg.model, vocab_size=tokenizer_vocab)
    model = build_model(args)                 # meta device: no memory
    ...                                       # TP / FSDP / pipeline split
    model.to_empty(device="cuda"); model.init_weights(seed=cfg.train.seed)
"""

from __future__ import annotations

import torch

from llmtrain.config.schema import ModelConfig
from llmtrain.errors import ConfigError
from llmtrain.models.baichuan import BAICHUAN2
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.family import FamilySpec, resolve
from llmtrain.models.common.kv_cache import KVCache
from llmtrain.models.common.transformer import Transformer
from llmtrain.models.deepseek import DEEPSEEK_V3
from llmtrain.models.glm import GLM4
from llmtrain.models.llama import LLAMA3
from llmtrain.models.mistral import MISTRAL
from llmtrain.models.mixtral import MIXTRAL
from llmtrain.models.qwen import QWEN2, QWEN3

FAMILIES: dict[str, FamilySpec] = {
    "llama3": LLAMA3,
    "llama": LLAMA3,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "glm4": GLM4,
    "baichuan2": BAICHUAN2,
    "mistral": MISTRAL,
    "mixtral": MIXTRAL,
    "deepseek_v3": DEEPSEEK_V3,
}


def get_family(family: str) -> FamilySpec:
    """The FamilySpec of ``family`` (aliases accepted); ConfigError naming model.model_type otherwise."""
    spec = FAMILIES.get(family.lower()) if isinstance(family, str) else None
    if spec is None:
        raise ConfigError(
            f"model.model_type {family!r} is not a known model family; valid: {', '.join(FAMILIES)}."
        )
    return spec


def list_flavors(family: str) -> list[str]:
    """Flavor names of ``family``, in definition order (debug and demo first)."""
    return list(get_family(family).flavors)


def resolve_model_args(cfg: ModelConfig, vocab_size: int | None = None) -> TransformerArgs:
    """Family defaults <- ``cfg.flavor`` <- explicit ``cfg`` fields; ``vocab_size`` (the tokenizer's) fills
    ``cfg.vocab_size`` when that is None. Raises ConfigError naming the offending ``model.*`` key."""
    return resolve(get_family(cfg.model_type), cfg, vocab_size)


def build_model(args: TransformerArgs, device: str | torch.device = "meta") -> Transformer:
    """The model for ``args``. On the meta device (default) nothing is allocated: shard it, then call
    ``to_empty`` and ``init_weights``. Any other device returns it materialised there and initialised with
    ``init_weights(seed=0)``."""
    with torch.device("meta"):
        model = Transformer(args)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights(seed=0)
    return model


__all__ = [
    "FAMILIES",
    "FamilySpec",
    "KVCache",
    "Transformer",
    "TransformerArgs",
    "build_model",
    "get_family",
    "list_flavors",
    "resolve_model_args",
]

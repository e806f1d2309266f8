"""Adapter for MindSpore / MindFormers config files, run before the strict native parse.

Three inputs reach it; :func:`adapt` picks the mapping by the file's top-level keys:

* a **MindFormers run file** (1.x: ``model.model_config.type: LlamaConfig``; 2.x: Hugging Face-style
  ``model.model_config.model_type: qwen3``), recognised by ``model.model_config``, ``runner_config`` or
  ``context`` at the top level: ``structured.py`` (sections in ``sections.py``, the model in ``model.py``,
  MindFormers' facts and defaults in ``tables.py``, its fault-tolerance switch ``$MS_ENABLE_TFT`` in
  ``fault.py``);
* the **flat layout of the seed documents** (``run_mode``, ``model_size``, ``model_config{}``,
  ``parallel_config{}``, ``train_config{}``...): ``flat.py``;
* our **native layout**, possibly with MindSpore-only keys (``run.mode``, ``run.device_target: Ascend``):
  passed through ``flat.normalize_mindspore_keys``.

Every MindFormers key maps onto a native key, is ignored with its reason, or is refused with what to change;
an unknown key is an error naming it. The notes ``load_config`` returns (and ``llmtrain check`` prints) say
which. :func:`finish` runs after the command-line overrides: the run length and the warmup / decay steps of a
MindFormers file may depend on an overridden ``train.max_steps``. docs/interop.md has the key tables.
"""

from __future__ import annotations

import copy

from llmtrain.config.mindformers.flat import from_mindformers, is_flat_layout, normalize_mindspore_keys
from llmtrain.config.mindformers.structured import finish, from_structured, is_structured_layout, translate

__all__ = [
    "adapt",
    "finish",
    "from_mindformers",
    "from_structured",
    "is_flat_layout",
    "is_mindformers_layout",
    "is_structured_layout",
    "normalize_mindspore_keys",
    "translate",
]


def is_mindformers_layout(raw: dict) -> bool:
    """True for either MindFormers layout (a run file or the seed's flat layout)."""
    return is_structured_layout(raw) or is_flat_layout(raw)


def adapt(raw: dict, source: str) -> tuple[dict, list[str]]:
    """Native dict and notes for a raw YAML mapping of any layout (before the command-line overrides)."""
    if is_structured_layout(raw):
        native, notes = from_structured(raw, source)
    elif is_flat_layout(raw):
        native, notes = from_mindformers(raw, source)
    else:
        native, notes = copy.deepcopy(raw), []
    notes += normalize_mindspore_keys(native, source)
    return native, notes

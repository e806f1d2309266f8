"""Run configuration, at the bottom of the package: typed dataclasses (``schema``), YAML load/save and dotted
overrides (``loader``) and the MindSpore/MindFormers key adapter (``mindformers``). It imports nothing from
llmtrain but ``errors``; what a config *means* (derived figures, stages, cross-field validation) is
``llmtrain.resolve``.

Typical use::

    cfg, notes = load_config("run.yaml", ["train.lr=1e-3"])
    warnings = llmtrain.resolve.validate(cfg, world_size=8)
"""

from llmtrain.config.loader import apply_overrides, config_from_dict, config_to_dict, load_config, save_config
from llmtrain.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DatasetSpec,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DatasetSpec",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "save_config",
]

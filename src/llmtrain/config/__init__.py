"""Run configuration: typed dataclasses (``schema``), YAML load/save and dotted overrides (``loader``), the
MindSpore/MindFormers key adapter (``mindformers``), cross-field validation (``validate``) and derived figures
(``derived``).

Typical use::

    cfg, notes = load_config("run.yaml", ["train.lr=1e-3"])
    warnings = validate(cfg, world_size=8)
    figures = derive(cfg, world_size=8)
"""

from llmtrain.config.derived import Derived, derive
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
from llmtrain.config.validate import validate

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DatasetSpec",
    "Derived",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "derive",
    "load_config",
    "save_config",
    "validate",
]

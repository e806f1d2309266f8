"""Which downstream tasks can run, strictly offline: names and YAML paths -> lm-eval task configs.

A task spec (one entry of ``eval.tasks`` or ``llmtrain eval --tasks``) is either

* the name of a task llmtrain ships (:data:`SHIPPED`, the YAMLs of ``configs/eval/``, built by
  :mod:`llmtrain.eval.stdlib_tasks`), or
* the path of an lm-eval task YAML file (lm-eval's own format: ``include:`` and ``!function`` work as they do
  in lm-eval, read by lm-eval's loader; llmtrain's own YAMLs are read with ``yaml.safe_load``).

Nothing is ever downloaded: a task's data must be local, ``dataset_path`` one of the ``datasets`` library's
file builders (:data:`LOCAL_BUILDERS`: ``json``, ``csv``, ``parquet``, ``text``, ``arrow``) with
``dataset_kwargs.data_files`` naming files that exist, or a local directory. Relative paths are resolved
against the YAML's directory (lm-eval would resolve them against the working directory). A task that would
read from the Hugging Face Hub, which is every task registered in lm-eval itself (``hellaswag``, ``arc_easy``
...), is refused with a :class:`~llmtrain.errors.ConfigError` naming the task and how to point it at local
files. Groups and Python task classes are refused too: list the member task YAMLs instead.

:func:`check_specs` needs no lm-eval (``resolve.validate`` calls it for ``eval.tasks``);
:func:`task_configs` reads the YAMLs into the dicts :func:`llmtrain.eval.run.evaluate` hands to lm-eval.
"""

from __future__ import annotations

import copy
import glob
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from llmtrain.errors import ConfigError

SHIPPED = ("stdlib_mc", "stdlib_ppl")
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
_HOW = (
    "set `dataset_path: json` (or csv, parquet, text, arrow) and `dataset_kwargs: {data_files: {test: FILE}}` "
    "with local files (paths relative to the YAML are fine), or set dataset_path to a local directory"
)


def shipped_dir() -> Path:
    """The folder of llmtrain's own task YAMLs and their data (``llmtrain/configs/eval``)."""
    return Path(__file__).resolve().parents[1] / "configs" / "eval"


def spec_path(spec: str) -> Path | None:
    """The YAML file of ``spec`` (a shipped name or a path), or None when it is neither."""
    if spec in SHIPPED:
        return shipped_dir() / f"{spec}.yaml"
    p = Path(spec).expanduser()
    return p if p.suffix in (".yaml", ".yml") and p.is_file() else None


def check_specs(specs: Sequence[Any], key: str = "eval.tasks") -> None:
    """Every spec is a shipped task name or an existing task YAML file (no lm-eval needed)."""
    if isinstance(specs, str) or not isinstance(specs, Sequence):
        raise ConfigError(f"{key} must be a list of task names or task YAML paths, got {specs!r}.")
    for i, spec in enumerate(specs):
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"{key}[{i}] must be a task name or a task YAML path, got {spec!r}.")
        if spec_path(spec) is not None:
            continue
        if Path(spec).suffix in (".yaml", ".yml") or "/" in spec:
            raise ConfigError(f"{key}[{i}]: task file '{spec}' does not exist (or is not a .yaml file).")
        raise ConfigError(
            f"{key}[{i}]: '{spec}' is neither one of llmtrain's tasks ({', '.join(SHIPPED)}) nor a task YAML "
            f"file. The tasks registered in lm-eval itself read their data from the Hugging Face Hub, which "
            f"llmtrain never downloads: copy the task's YAML (lm_eval/tasks/...), {_HOW}, and list the YAML's "
            "path instead of the name."
        )


def _read_yaml(path: Path, shipped: bool) -> dict[str, Any]:
    if shipped:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    else:
        try:  # lm-eval >= 0.4.10
            from lm_eval.tasks._yaml_loader import load_yaml

            cfg = load_yaml(path, resolve_func=True)
        except ImportError:  # older 0.4 releases
            from lm_eval.utils import load_yaml_config

            cfg = load_yaml_config(str(path), mode="full")
    if not isinstance(cfg, dict):
        raise ConfigError(f"task file {path} holds {type(cfg).__name__}, not an lm-eval task mapping.")
    return cfg


def _local_files(value: Any, base: Path, name: str, path: Path) -> Any:
    """``data_files`` (a path, a list of them, or split -> either) with every path absolute and present."""
    if isinstance(value, dict):
        return {split: _local_files(v, base, name, path) for split, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_local_files(v, base, name, path) for v in value]
    if not isinstance(value, str) or "://" in value or value.startswith(("hf:", "hf://")):
        raise ConfigError(
            f"task '{name}' ({path}): data_files entry {value!r} is not a local file path; {_HOW}."
        )
    p = Path(value).expanduser()
    p = p if p.is_absolute() else base / p
    if not (glob.glob(str(p)) if glob.has_magic(str(p)) else p.is_file()):
        raise ConfigError(f"task '{name}' ({path}): data file {p} does not exist; {_HOW}.")
    return str(p)


def localize(cfg: dict[str, Any], path: Path, key: str = "eval.tasks") -> dict[str, Any]:
    """``cfg`` (a task YAML's mapping) with its data paths absolute; ConfigError when it would download."""
    name = str(cfg.get("group") or cfg.get("task") or path.stem)
    if "group" in cfg or isinstance(cfg.get("task"), list):
        raise ConfigError(
            f"{key}: '{path}' is a task group ({name}); llmtrain evaluates single tasks: list the YAML of "
            "each member task instead."
        )
    if "class" in cfg:
        raise ConfigError(
            f"{key}: task '{name}' ({path}) is a Python task class, whose data source llmtrain cannot check; "
            f"write it as a YAML task whose data is local: {_HOW}."
        )
    out = copy.copy(cfg)
    base = path.resolve().parent
    if out.get("custom_dataset") is not None:  # the user's own function builds the dataset
        return out
    dataset = out.get("dataset_path")
    kwargs = dict(out.get("dataset_kwargs") or {})
    if isinstance(dataset, str) and dataset in LOCAL_BUILDERS:
        if kwargs.get("data_files") is None and kwargs.get("data_dir") is None:
            raise ConfigError(
                f"task '{name}' ({path}): dataset_path {dataset} needs dataset_kwargs.data_files naming the "
                "local files to read."
            )
        if kwargs.get("data_files") is not None:
            kwargs["data_files"] = _local_files(kwargs["data_files"], base, name, path)
        if kwargs.get("data_dir") is not None:
            d = Path(str(kwargs["data_dir"])).expanduser()
            kwargs["data_dir"] = str(d if d.is_absolute() else base / d)
        out["dataset_kwargs"] = kwargs
        return out
    if isinstance(dataset, str) and dataset:
        d = Path(dataset).expanduser()
        d = d if d.is_absolute() else base / d
        if d.is_dir():
            out["dataset_path"] = str(d)
            return out
    raise ConfigError(
        f"task '{name}' ({path}) reads dataset_path {dataset!r} from the Hugging Face Hub, which llmtrain "
        f"never downloads (evaluation is offline by construction): {_HOW}."
    )


def task_configs(specs: Sequence[str], key: str = "eval.tasks") -> list[dict[str, Any]]:
    """The lm-eval task config (a mapping) of each spec, checked offline (lm-eval must be importable)."""
    check_specs(specs, key)
    configs, names = [], set()
    for spec in specs:
        path = spec_path(spec)
        assert path is not None  # check_specs passed
        cfg = localize(_read_yaml(path, shipped=spec in SHIPPED), path, key)
        if "task" not in cfg:
            raise ConfigError(f"{key}: task file {path} has no `task:` name.")
        if cfg["task"] in names:
            raise ConfigError(f"{key}: task '{cfg['task']}' is listed twice ({path}).")
        names.add(cfg["task"])
        configs.append(cfg)
    return configs

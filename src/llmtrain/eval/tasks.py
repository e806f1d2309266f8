"""Which downstream tasks can run, strictly offline: names and YAML paths -> lm-eval task configs.

A task spec (one entry of ``eval.tasks`` or ``llmtrain eval --tasks``) is either

* the name of a task llmtrain ships (:data:`SHIPPED`, the YAMLs of ``configs/eval/``, built by
  :mod:`llmtrain.eval.stdlib_tasks`), or
* the path of an lm-eval task YAML file (lm-eval's own format: ``include:`` and ``!function`` work as they do
  in lm-eval). Every task file is first read by llmtrain's bounded safe loader (:func:`read_task_file`:
  ``config.yaml_text``, includes followed with cycles refused, ``!function`` modules looked up but not
  imported, the keys llmtrain and lm-eval read checked for shape), and only then by lm-eval's loader (which
  imports the ``!function`` modules); any refusal is one ConfigError naming the file.

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
import dataclasses
import glob
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    """Every spec is a shipped task name or an existing task YAML file that :func:`read_task_file` accepts
    (no lm-eval needed)."""
    if isinstance(specs, str) or not isinstance(specs, Sequence):
        raise ConfigError(f"{key} must be a list of task names or task YAML paths, got {specs!r}.")
    for i, spec in enumerate(specs):
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"{key}[{i}] must be a task name or a task YAML path, got {spec!r}.")
        path = spec_path(spec)
        if path is not None:
            if (
                spec not in SHIPPED
            ):  # read and shape-checked now (`check`, train start), not at the first eval
                read_task_file(path, f"{key}[{i}]")
            continue
        if Path(spec).suffix in (".yaml", ".yml") or "/" in spec:
            raise ConfigError(f"{key}[{i}]: task file '{spec}' does not exist (or is not a .yaml file).")
        raise ConfigError(
            f"{key}[{i}]: '{spec}' is neither one of llmtrain's tasks ({', '.join(SHIPPED)}) nor a task YAML "
            f"file. The tasks registered in lm-eval itself read their data from the Hugging Face Hub, which "
            f"llmtrain never downloads: copy the task's YAML (lm_eval/tasks/...), {_HOW}, and list the YAML's "
            "path instead of the name."
        )


@dataclasses.dataclass(frozen=True)
class FunctionRef:
    """A ``!function module.name`` of a task file, read but not imported (``base``: the file's folder)."""

    spec: str
    base: Path


MAX_INCLUDES = 32  # task files one task reads through `include:` (lm-eval's own tasks use one or two)
OUTPUT_TYPES = ("loglikelihood", "multiple_choice", "loglikelihood_rolling", "generate_until")
_NAME_KEYS = ("task", "dataset_path", "dataset_name", "test_split", "validation_split", "training_split",
              "fewshot_split", "target_delimiter", "fewshot_delimiter", "description")  # fmt: skip
_FIELD_KEYS = ("doc_to_text", "doc_to_target", "doc_to_choice", "doc_to_decontamination_query")


def _read_one(path: Path, what: str) -> dict[str, Any]:
    """One task file's own mapping (no includes resolved): bounded, safe, UTF-8, ``!function`` kept unread."""
    from llmtrain.config.yaml_text import MAX_CONFIG_CHARS, parse_yaml

    try:
        with open(path, "rb") as f:
            raw = f.read(4 * MAX_CONFIG_CHARS + 1)  # UTF-8: at most 4 bytes a character
        if len(raw) > 4 * MAX_CONFIG_CHARS:
            raise ConfigError(
                f"{what} is larger than {4 * MAX_CONFIG_CHARS:,} bytes; is this the right file?"
            )
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); a task file is YAML "
            "text: is this the right file?"
        ) from None
    except OSError as e:
        from llmtrain.errors import os_error_text

        raise ConfigError(f"{what} cannot be read: {os_error_text(e)}") from None
    cfg = parse_yaml(text, what, tags={"!function": lambda spec: FunctionRef(spec, path.resolve().parent)})
    if not isinstance(cfg, dict):
        shown = "is empty" if cfg is None else f"holds a {type(cfg).__name__}"
        raise ConfigError(
            f"{what} {shown}, not an lm-eval task mapping (task: NAME, dataset_path: ..., doc_to_text: ...)."
        )
    return cfg


def read_task_file(path: Path, key: str = "eval.tasks") -> dict[str, Any]:
    """The task file's mapping with its ``include:`` files merged as lm-eval merges them (included first, the
    file's own keys win), read with llmtrain's bounded safe loader; ConfigError naming the file for invalid
    YAML, a Python tag, a non-mapping, deep nesting, an include that is missing or cyclic, or keys of the
    wrong shape (:func:`check_task_shape`). ``!function`` values stay :class:`FunctionRef` (not imported)."""
    top = path
    seen: set[Path] = set()

    def load(p: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
        real = p.expanduser().resolve()
        what = f"task file {p}" + (f" (included from {top})" if chain else "")
        if real in chain:
            raise ConfigError(
                f"{key}: task file {top}: the include chain {' -> '.join(str(c) for c in (*chain, real))} is a "
                "cycle; an included file must not include the file that includes it."
            )
        if real in seen:  # lm-eval refuses a file read twice in one task (a diamond) as a cycle too
            raise ConfigError(
                f"{key}: task file {top} includes {p} twice (directly or through another file); lm-eval "
                "reads each file once per task: include it in one place."
            )
        if len(seen) >= MAX_INCLUDES:
            raise ConfigError(f"{key}: task file {top} includes more than {MAX_INCLUDES} files.")
        seen.add(real)
        if not real.is_file():
            raise ConfigError(f"{key}: {what}: the included file does not exist (or is not a file).")
        cfg = _read_one(real, what)
        includes = cfg.pop("include", None)
        if includes is None:
            return cfg
        names = includes if isinstance(includes, list) else [includes]
        if not names or not all(isinstance(n, str) and n.strip() for n in names):
            raise ConfigError(
                f"{key}: {what}: include must be a file name or a list of them (relative to the file), got "
                f"{includes!r}."
            )
        merged: dict[str, Any] = {}
        for name in names:
            inc = Path(name).expanduser()
            inner = load(inc if inc.is_absolute() else real.parent / inc, (*chain, real))
            inner.pop("task_list", None)
            merged.update(inner)
        merged.update(cfg)
        return merged

    cfg = load(path, ())
    check_task_shape(cfg, path, key)
    return cfg


def _kind(value: Any) -> str:
    return "a function" if isinstance(value, FunctionRef) else f"{type(value).__name__} {value!r}"[:120]


def check_task_shape(cfg: dict[str, Any], path: Path, key: str = "eval.tasks") -> None:
    """ConfigError naming the file and key when a key llmtrain or lm-eval reads has the wrong type or value:
    names and splits are strings, ``task`` a non-empty one, ``dataset_kwargs`` a mapping whose ``data_files`` is
    a path, a list of paths or split -> either, ``output_type`` one of :data:`OUTPUT_TYPES`, ``num_fewshot`` an
    integer >= 0, ``metric_list`` a list of mappings with a ``metric``, ``!function`` modules findable."""

    def bad(name: str, want: str, value: Any) -> ConfigError:
        return ConfigError(f"{key}: task file {path}: {name} must be {want}, got {_kind(value)}.")

    if "group" in cfg or "class" in cfg or isinstance(cfg.get("task"), list):
        return  # refused by localize with its own message (groups and Python task classes)
    for name in _NAME_KEYS:
        value = cfg.get(name)
        if value is not None and not isinstance(value, str):
            raise bad(name, "a string", value)
    task = cfg.get("task")
    if task is None or not str(task).strip():
        raise bad("task", "a non-empty task name", task)
    if (kw := cfg.get("dataset_kwargs")) is not None:
        if not isinstance(kw, dict):
            raise bad("dataset_kwargs", "a mapping (data_files: ..., data_dir: ...)", kw)
        files = kw.get("data_files")
        if files is not None:
            values = list(files.values()) if isinstance(files, dict) else [files]
            for v in values:
                items = v if isinstance(v, list) else [v]
                if not items or not all(isinstance(i, str) and i for i in items):
                    raise bad(
                        "dataset_kwargs.data_files", "a file path, a list of them, or split: path(s)", v
                    )
        if kw.get("data_dir") is not None and not isinstance(kw["data_dir"], str):
            raise bad("dataset_kwargs.data_dir", "a folder path", kw["data_dir"])
    if (out := cfg.get("output_type")) is not None and out not in OUTPUT_TYPES:
        raise bad("output_type", f"one of {', '.join(OUTPUT_TYPES)}", out)
    shots = cfg.get("num_fewshot")
    if shots is not None and (isinstance(shots, bool) or not isinstance(shots, int) or shots < 0):
        raise bad("num_fewshot", "an integer >= 0", shots)
    for name in ("repeats",):
        if (v := cfg.get(name)) is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise bad(name, "an integer >= 1", v)
    for name in ("generation_kwargs", "metadata", "fewshot_config", "filter_list"):
        want = list if name == "filter_list" else dict
        if (v := cfg.get(name)) is not None and not isinstance(v, want):
            raise bad(name, f"a {'list' if want is list else 'mapping'}", v)
    _check_generation(cfg.get("generation_kwargs") or {}, bad)
    if (metrics := cfg.get("metric_list")) is not None:
        if not isinstance(metrics, list) or not all(
            isinstance(m, dict) and isinstance(m.get("metric"), str | FunctionRef) and m["metric"]
            for m in metrics
        ):
            raise bad("metric_list", "a list of mappings each with a `metric:` name", metrics)
    for name in _FIELD_KEYS:
        v = cfg.get(name)
        if v is not None and not isinstance(v, str | int | list | dict | FunctionRef) or isinstance(v, bool):
            raise bad(name, "a template string, a field index or list, or !function", v)
    _check_functions(cfg, path, key)


def _check_generation(kw: dict[str, Any], bad: Any) -> None:
    """The ``generation_kwargs`` llmtrain's LM reads (``eval.lm.LLMTrainLM.generate_until``), each of its type."""
    import math

    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    until = kw.get("until")
    if until is not None and not isinstance(until, str):
        if not isinstance(until, list) or not all(isinstance(u, str) and u for u in until):
            raise bad("generation_kwargs.until", "a stop string or a list of them", until)
    checks = (
        (
            "max_gen_toks",
            "an integer >= 1",
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        ),
        ("do_sample", "true or false", lambda v: isinstance(v, bool)),
        ("temperature", "a finite number >= 0", lambda v: number(v) and v >= 0),
        ("top_k", "an integer >= 1", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
        ("top_p", "a number in (0, 1]", lambda v: number(v) and 0 < v <= 1),
    )
    for name, want, ok in checks:
        if kw.get(name) is not None and not ok(kw[name]):
            raise bad(f"generation_kwargs.{name}", want, kw[name])


def _check_functions(value: Any, path: Path, key: str, where: str = "") -> None:
    """ConfigError naming the key when a ``!function module.name`` names a module found neither next to the
    task file (``module.py``) nor on the Python path (nothing is imported here)."""
    import importlib.util

    if isinstance(value, dict):
        for k, v in value.items():
            _check_functions(v, path, key, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_functions(v, path, key, f"{where}[{i}]")
    elif isinstance(value, FunctionRef):
        module, _, name = value.spec.rpartition(".")
        found = bool(module and name) and (value.base / f"{module.replace('.', '/')}.py").is_file()
        if module and name and not found:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
        if not found:
            raise ConfigError(
                f"{key}: task file {path}: {where} = !function {value.spec} names "
                + (f"module '{module}', which is neither {value.base / (module.replace('.', '/') + '.py')} "
                   "nor an importable module" if module and name else "no module (write module.function)")
                + "; put the module next to the task file or fix the name."
            )  # fmt: skip


def _read_yaml(path: Path, shipped: bool, key: str = "eval.tasks") -> dict[str, Any]:
    """The task mapping lm-eval will build: checked by :func:`read_task_file` first, then (for a user's file)
    read by lm-eval's own loader, which imports the ``!function`` modules; its errors name the file."""
    cfg = read_task_file(path, key)
    if shipped or "group" in cfg or "class" in cfg or isinstance(cfg.get("task"), list):
        return cfg  # shipped: no !function; a group or class: localize refuses it before anything is imported
    try:  # lm-eval >= 0.4.10
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:  # older 0.4 releases
        from lm_eval.utils import load_yaml_config

        def load_yaml(p: Path, resolve_func: bool = True) -> dict[str, Any]:
            return dict(load_yaml_config(str(p), mode="full"))

    try:
        loaded = load_yaml(path, resolve_func=True)
    except (
        Exception
    ) as e:  # a user's module that fails to import, or lacks the function: the file is at fault
        raise ConfigError(
            f"{key}: lm-eval could not read task file {path}: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"{key}: task file {path} holds {type(loaded).__name__}, not an lm-eval task mapping."
        )
    return loaded


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
        cfg = localize(_read_yaml(path, spec in SHIPPED, key), path, key)
        if "task" not in cfg:
            raise ConfigError(f"{key}: task file {path} has no `task:` name.")
        if cfg["task"] in names:
            raise ConfigError(f"{key}: task '{cfg['task']}' is listed twice ({path}).")
        names.add(cfg["task"])
        configs.append(cfg)
    return configs

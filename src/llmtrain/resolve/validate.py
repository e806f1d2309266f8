"""Cross-field validation of a Config: one ConfigError/DataError for a fatal problem, warnings for the rest.

Order of the checks (the first failure is the one reported):

1. choices (``_CHOICES`` and the schema's ``Literal`` types) and ranges (``config.ranges.RANGES``, the table
   the loader applies too): tables of dotted key -> allowed values / range, so adding a rule is one line and
   the message always names the key and the valid range;
2. data: dataset prefixes and the tokenizer. A dataset missing on this machine is an error only with
   ``require_data`` (``train``); ``check`` passes False and gets a warning, since seed paths are cluster paths.
   Each present dataset is described by ``llmtrain.data.describe`` (its manifest, or a plain Megatron
   ``.bin/.idx`` read with ``data.tokenizer``; without either it is refused). All datasets must share one
   tokenizer (sha256), equal to ``data.tokenizer`` when that is set, and ``model.vocab_size`` must not be
   smaller than the tokenizer's vocabulary;
3. arithmetic: ``resolve.derived.derive`` (parallel degrees vs world size, the batch identity, the model's own
   checks in ``resolve_model_args``);
4. the parallel layout: :func:`llmtrain.feasibility.layout_problems` with the resolved model, the one place
   that holds every layout rule (the planner's search and the builders in ``distributed/`` call it too), so
   ``check``, ``train`` and ``plan --search`` agree. Its first fatal problem is raised with the same message;
   its warnings are returned. With ``stages``, every stage's config is checked the same way (message prefixed
   with the stage);
5. the data's bytes, last (it may read the files once): every present dataset (of ``data.datasets`` and of
   the stages) is verified by ``llmtrain.data.verify`` (sha256 against the manifest, token ids against the
   vocabulary), the same check the loader makes, so ``check`` refuses what ``train`` refuses;
6. advice: settings outside the layout that are legal but have no effect or look unintended become warnings.

``eval.tasks`` is checked with the fields when ``eval.downstream_steps`` is on (and a stage's override of
them): every task a shipped name or a task YAML file (:func:`llmtrain.eval.tasks.check_specs`, no lm-eval
needed), lm-eval installed, and no context parallel (FSDP / ZeRO, TP, EP and PP are supported: every rank
runs the same requests, llmtrain/eval/forward.py; a context-parallel run's checkpoints are scored with
``llmtrain eval``).

``train.fp8`` is checked with the fields (before any data is read): :func:`_check_fp8` asks
``llmtrain.distributed.float8`` (the one place of the fp8 rules) about the config alone (CPU / NPU targets,
tensor parallel: no torch), then about this machine's CUDA device when there is one, and whether torchao is
installed. A machine without a CUDA device cannot tell whether the cluster's GPUs have fp8: ``check`` warns,
``train`` (``require_data``) refuses when ``run.device_target: auto`` would train on this machine's CPU.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtrain.config.loader import choice_error, literal_values
from llmtrain.config.ranges import check_config_ranges
from llmtrain.config.schema import Config
from llmtrain.config.survival import check_watch
from llmtrain.errors import ConfigError, DataError
from llmtrain.feasibility import layout_problems, raise_fatal
from llmtrain.resolve.derived import Derived, derive

if TYPE_CHECKING:
    from llmtrain.data.describe import DatasetInfo

# Allowed values are the schema's ``Literal`` field types (one source for the loader, this check and the docs);
# run.device_target stays a string because the seed's spellings (Ascend, GPU, CPU) are mapped onto these.
_CHOICES: dict[str, tuple[Any, ...]] = {"run.device_target": ("auto", "cpu", "cuda", "npu")}
_HINTS = {"run.device_target": " (in a config file Ascend, GPU and CPU are also accepted and mapped)"}


def validate(cfg: Config, world_size: int = 1, require_data: bool = True) -> list[str]:
    """Check cfg for world_size processes; raise ConfigError/DataError on the first problem, return warnings."""
    return check_config(cfg, world_size, require_data)[1]


def check_config(cfg: Config, world_size: int = 1, require_data: bool = True) -> tuple[Derived, list[str]]:
    """:func:`validate` that also returns the Derived figures it computed (used by ``llmtrain check``)."""
    from llmtrain.data.loader import parse_mixture
    from llmtrain.ft.layout import check_group as check_replica_group

    _check_fields(cfg)
    check_replica_group(cfg, world_size)  # fault_tolerance: world_size is one replica group's (ft/layout.py)
    warnings: list[str] = []
    _check_downstream(cfg)
    _check_fp8(cfg, require_data, warnings)
    _check_long_context(cfg)
    vocab, found = _check_data(cfg, require_data, warnings)
    parse_mixture(cfg.data.mixture, len(cfg.data.datasets))  # what the loader will refuse
    derived = derive(cfg, world_size, vocab_size=vocab)
    warnings += raise_fatal(layout_problems(cfg, world_size, derived.model_args))
    if cfg.stages:
        found += _check_stages(cfg, world_size, vocab, require_data)
    _verify_data(cfg, found)
    warnings += _advice(cfg)
    return derived, warnings


def _verify_data(cfg: Config, found: list[tuple[str, DatasetInfo]]) -> None:
    """The loader's verification of every described dataset, once per prefix (``llmtrain.data.verify``)."""
    from llmtrain.data.verify import verify_dataset

    seen: set[str] = set()
    for key, info in found:
        if info.prefix not in seen:
            seen.add(info.prefix)
            verify_dataset(info, key if key.endswith(".path") else f"{key}.path", cfg.model.vocab_size)


def _check_stages(
    cfg: Config, world_size: int, vocab: int | None, require_data: bool
) -> list[tuple[str, DatasetInfo]]:
    """Every stage resolves (lengths, overrides, LR, mixture), its batch arithmetic and its layout rules pass;
    returns the stages' datasets present on this machine, described."""
    from llmtrain.data.describe import describe_dataset, missing_files
    from llmtrain.resolve.stages import resolve_stages

    found: list[tuple[str, DatasetInfo]] = []

    for plan in resolve_stages(cfg)[1]:
        where = f"stages[{plan.index}] ({plan.name}): "
        try:
            d = derive(plan.cfg, world_size, vocab_size=vocab)
        except ConfigError as e:
            raise ConfigError(f"{where}{e}") from None
        raise_fatal(layout_problems(plan.cfg, world_size, d.model_args), prefix=where)
        if (plan.cfg.recompute.mode == "offload") != (cfg.recompute.mode == "offload"):
            raise ConfigError(
                f"{where}recompute.mode {plan.cfg.recompute.mode!r} while the run uses {cfg.recompute.mode!r}: "
                f"activation offload (recompute.mode: offload) cannot be switched per stage; use it in every "
                f"stage or in none."
            )
        _check_long_context(plan.cfg, where)
        check_watch(plan.cfg.stability.watch, where)
        for j, spec in enumerate(cfg.stages[plan.index].datasets):
            key = f"stages[{plan.index}].datasets[{j}].path"
            absent = missing_files(spec.path)
            if absent and require_data:
                raise ConfigError(
                    f"{key} = '{spec.path}': no dataset at this prefix ({', '.join(absent)} missing). Create "
                    f"it with `llmtrain prepare --output {spec.path} ...` or fix the path."
                )
            if not absent and _readable(cfg, spec.path):
                found.append((key, describe_dataset(spec.path, cfg.data.tokenizer, key)))
    return found


def _check_long_context(cfg: Config, where: str = "") -> None:
    """FlexAttention trains only on CUDA (no CPU backward in torch 2.13)."""
    if cfg.model.attention == "flex" and cfg.run.device_target == "cpu":
        raise ConfigError(
            f"{where}model.attention = 'flex' with run.device_target = 'cpu': FlexAttention has no CPU backward "
            f"in torch 2.13, so it cannot train here. Use model.attention: sdpa (dense masks) or auto."
        )


def _readable(cfg: Config, prefix: str) -> bool:
    """Whether a present dataset can be described here: it has a manifest, or data.tokenizer is unset (then
    ``describe_dataset`` refuses it, as train would) or on this machine (if not, its own check reports that)."""
    from llmtrain.data.manifest import manifest_path

    tok = cfg.data.tokenizer
    return manifest_path(prefix).is_file() or not tok or Path(tok).is_file()


def _get(cfg: Config, dotted: str) -> Any:
    return operator.attrgetter(dotted)(cfg)


def _literal_fields(cls: Any, prefix: str = "") -> list[tuple[str, tuple[Any, ...], bool]]:
    """(dotted key, allowed values, is a list) of every ``Literal`` field below the dataclass ``cls``."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        key = f"{prefix}{name}"
        inner = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
        allowed = literal_values(inner)
        if allowed is not None:
            out.append((key, allowed, inner is not tp))
        elif isinstance(inner, type) and dataclasses.is_dataclass(inner) and inner is not tp:
            continue  # lists of sections (stages, datasets) are checked by their own rules
        elif isinstance(inner, type) and dataclasses.is_dataclass(inner):
            out += _literal_fields(inner, f"{key}.")
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            sections = [a for a in typing.get_args(tp) if isinstance(a, type) and dataclasses.is_dataclass(a)]
            for section in sections:
                out += _literal_fields(section, f"{key}.")
    return out


def _check_fields(cfg: Config) -> None:
    choices = [(k, v, False) for k, v in _CHOICES.items()] + _literal_fields(Config)
    for key, allowed, is_list in choices:
        try:
            value = _get(cfg, key)
        except AttributeError:  # an optional section that is not set
            continue
        for item in value if is_list else [value]:
            if item not in allowed:
                raise ConfigError(choice_error(key, item, allowed, _HINTS.get(key, "")))
    check_config_ranges(cfg)  # every number against its range (config/ranges.py, the loader's table too)
    check_watch(cfg.stability.watch)  # loss, grad_norm or a health figure's name (config/survival.py)
    train = cfg.train
    if train.min_lr > train.lr:
        raise ConfigError(
            f"train.min_lr {train.min_lr} is larger than train.lr {train.lr}; it must be <= lr."
        )
    scale = train.loss_scale
    if scale != "dynamic" and (isinstance(scale, bool) or not isinstance(scale, int | float) or scale <= 0):
        raise ConfigError(
            f"train.loss_scale: expected 'dynamic' or a number > 0, got {scale!r} (write a fixed scale with a "
            f"dot, e.g. 1.0e4: YAML reads 1e4 as a string)."
        )
    for i, spec in enumerate(cfg.data.datasets):
        if not spec.path:
            raise ConfigError(
                f"data.datasets[{i}].path is empty: give the prefix written by `llmtrain prepare`."
            )


def _check_downstream(cfg: Config) -> None:
    """``eval.tasks`` (and a stage's ``eval.tasks`` override) when downstream evaluation is on: every task a
    shipped name or a task YAML (``llmtrain.eval.tasks``), lm-eval installed, no context parallel (any other
    layout, any world size: llmtrain/eval/forward.py)."""
    import importlib.util

    from llmtrain.eval.tasks import check_specs

    lists = [("eval.tasks", cfg.eval.tasks, cfg.eval.downstream_steps)]
    for i, stage in enumerate(cfg.stages):
        if "eval.tasks" in stage.overrides or "eval.downstream_steps" in stage.overrides:
            steps = stage.overrides.get("eval.downstream_steps", cfg.eval.downstream_steps)
            tasks = stage.overrides.get("eval.tasks", cfg.eval.tasks)
            lists.append((f"stages[{i}].overrides['eval.tasks']", tasks, steps))
    active = [(key, tasks) for key, tasks, steps in lists if tasks and steps]
    for key, tasks in active:
        check_specs(tasks, key)
    if active and importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            f"{active[0][0]} with eval.downstream_steps > 0 needs lm-evaluation-harness, which is not installed: "
            "run `pip install 'llmtrain[eval]'` (or `pip install lm-eval`), or set eval.downstream_steps: 0."
        )
    if active and cfg.parallel.context_parallel > 1:
        raise ConfigError(
            f"{active[0][0]} with eval.downstream_steps > 0 and parallel.context_parallel = "
            f"{cfg.parallel.context_parallel}: in-loop downstream evaluation does not run under context parallel "
            "(lm-eval's requests have arbitrary lengths, the context-parallel model takes load-balanced chunks of "
            "fixed-length batches); it does run under data, tensor, expert and pipeline parallelism. Set "
            "eval.downstream_steps: 0 and score the checkpoints with `llmtrain eval RUN_DIR --tasks ...`."
        )


def _check_fp8(cfg: Config, require_data: bool, warnings: list[str]) -> None:
    """``train.fp8`` rules (module docstring): a ConfigError, a warning, or nothing."""
    from llmtrain.distributed import float8

    recipe = cfg.train.fp8
    if recipe == "none":
        return
    problem = float8.config_problem(cfg)  # torch-free: cpu / npu targets, tensor parallel
    if problem:
        raise ConfigError(problem)
    import torch

    if torch.cuda.is_available():
        problem = float8.device_problem(
            recipe, torch.cuda.get_device_capability(), torch.cuda.get_device_name()
        )
    elif cfg.run.device_target == "auto" and require_data:
        problem = (
            f"train.fp8 {recipe} with run.device_target auto: this machine has no CUDA device, so the run would "
            f"train on the CPU, which has no fp8 training GEMMs; run it on a GPU with compute capability >= "
            f"{'.'.join(map(str, float8.MIN_CAPABILITY[recipe]))} or set train.fp8: none."
        )
    else:
        warnings.append(
            f"train.fp8 {recipe}: no CUDA device here to check; the GPUs that train it need compute "
            f"capability >= {'.'.join(map(str, float8.MIN_CAPABILITY[recipe]))} (H100, H200, B200, L40S)."
        )
    problem = problem or float8.torchao_problem(recipe)
    if problem and (require_data or torch.cuda.is_available()):
        raise ConfigError(problem)
    if problem:
        warnings.append(problem)


def _check_data(
    cfg: Config, require_data: bool, warnings: list[str]
) -> tuple[int | None, list[tuple[str, DatasetInfo]]]:
    """Check datasets and tokenizer; return the tokenizer's vocabulary size when known, and the present
    datasets (config key, description)."""
    from llmtrain.data.describe import describe_dataset, missing_files, tokenizer_facts

    def missing(message: str) -> None:
        if require_data:
            raise DataError(message)
        warnings.append(message + " `llmtrain train` will need it.")

    if not cfg.data.datasets:
        if require_data:
            raise ConfigError("data.datasets is empty: give at least one {path: PREFIX, weight: W} entry.")
        warnings.append("data.datasets is empty: `llmtrain train` needs at least one dataset.")
    found: list[tuple[str, DatasetInfo]] = []  # (dataset key, description) of every present dataset
    for i, spec in enumerate(cfg.data.datasets):
        key = f"data.datasets[{i}]"
        absent = missing_files(spec.path)
        if absent:
            missing(
                f"{key}: dataset prefix {spec.path!r} is not on this machine (missing {', '.join(absent)})."
            )
        elif _readable(cfg, spec.path):
            found.append((key, describe_dataset(spec.path, cfg.data.tokenizer, f"{key}.path")))
    where = {key: f"{key} ({info.prefix})" for key, info in found}
    for key, info in found[1:]:
        first_key, first = found[0]
        if info.tokenizer_sha256 != first.tokenizer_sha256:
            raise ConfigError(
                f"{key} was tokenized with a different tokenizer (sha256 {str(info.tokenizer_sha256)[:12]}...) "
                f"than {where[first_key]} (sha256 {str(first.tokenizer_sha256)[:12]}...); every dataset of a run "
                f"must share one tokenizer. Re-prepare one of them with the other's tokenizer."
            )
    vocab, vocab_from = (found[0][1].vocab_size, where[found[0][0]]) if found else (None, "")
    if cfg.data.tokenizer:
        if not Path(cfg.data.tokenizer).is_file():
            missing(f"data.tokenizer {cfg.data.tokenizer!r} does not exist on this machine.")
        else:
            tokenizer = tokenizer_facts(cfg.data.tokenizer)
            if found and tokenizer.sha256 != found[0][1].tokenizer_sha256:
                raise ConfigError(
                    f"data.tokenizer {cfg.data.tokenizer!r} (sha256 {tokenizer.sha256[:12]}...) is not the "
                    f"tokenizer {where[found[0][0]]} was prepared with (sha256 "
                    f"{str(found[0][1].tokenizer_sha256)[:12]}...): its token ids would be misread. Remove "
                    f"data.tokenizer to use the dataset's own, or re-prepare."
                )
            vocab, vocab_from = tokenizer.vocab_size, f"data.tokenizer {cfg.data.tokenizer!r}"
    if vocab is not None and cfg.model.vocab_size is not None and cfg.model.vocab_size < vocab:
        raise ConfigError(
            f"model.vocab_size {cfg.model.vocab_size} is smaller than the tokenizer's vocabulary {vocab} (from "
            f"{vocab_from}): token ids >= {cfg.model.vocab_size} would index past the embedding. Set "
            f"model.vocab_size >= {vocab} or remove it to take the tokenizer's."
        )
    return vocab, found


def _advice(cfg: Config) -> list[str]:
    """Legal settings outside the layout that have no effect or look unintended (the layout's own are
    ``llmtrain.feasibility`` warnings)."""
    t = cfg.train
    out: list[str] = []
    if t.warmup_steps >= t.max_steps:
        out.append(
            f"train.warmup_steps {t.warmup_steps} >= train.max_steps {t.max_steps}: the learning rate never "
            f"reaches train.lr {t.lr}."
        )
    elif t.decay_steps is not None and t.warmup_steps + t.decay_steps > t.max_steps:
        out.append(
            f"train.warmup_steps + train.decay_steps = {t.warmup_steps + t.decay_steps} > train.max_steps "
            f"{t.max_steps}: training stops before the learning rate reaches train.min_lr."
        )
    if t.fp8 != "none" and not t.compile:
        out.append(
            f"train.fp8 {t.fp8} without train.compile: the fp8 casts run as separate kernels and the step is "
            f"usually slower than bf16; set train.compile: true."
        )
    if t.loss_scale != "dynamic" and t.precision != "fp16":
        out.append(f"train.loss_scale {t.loss_scale!r} is used only with train.precision fp16.")
    return out

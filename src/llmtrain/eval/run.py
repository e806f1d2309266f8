"""Score a model on downstream tasks with lm-evaluation-harness, offline: :func:`evaluate` and its outputs.

:func:`evaluate` is the one entry point, shared by ``llmtrain eval`` (a checkpoint) and the in-loop callback
(the run's current weights): the task specs become lm-eval task configs (:mod:`llmtrain.eval.tasks`: local
data only), lm-eval builds them, and ``lm_eval.simple_evaluate`` scores them with :class:`llmtrain.eval.lm.
LLMTrainLM`. lm-eval is imported here, lazily; before that the Hugging Face libraries are switched offline
(``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE``), so even a dataset builder that tried the network would fail
instead of downloading. lm-eval's global seeding is turned off (the training loop's RNG state is left alone);
its few-shot sampler keeps its own fixed seed, so the same weights give the same scores. Standard errors are
lm-eval's (closed form for means such as ``acc``; ``bootstrap_iters`` draws for the bootstrapped metrics).

The outputs: :func:`metric_fields` flattens the results into ``eval/<task>/<metric>`` (and ``..._stderr``)
scalars for metrics.jsonl; :func:`format_table` is the console table; :func:`write_results` writes lm-eval's
results JSON atomically, marked with a top-level ``"llmtrain"`` key, and replaces only a file so marked.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from llmtrain.errors import ConfigError, FileSystemError

MARKER = "llmtrain"


def import_lm_eval() -> Any:
    """``lm_eval``, with the Hugging Face libraries offline first; ConfigError naming the extra when absent."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    for module, attr in (
        ("datasets.config", "HF_DATASETS_OFFLINE"),
        ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
    ):
        if module in sys.modules:  # imported before us: its flag was read at import time
            setattr(sys.modules[module], attr, True)
    try:
        import lm_eval
        import lm_eval.evaluator
    except ImportError as e:
        raise ConfigError(
            f"downstream evaluation needs lm-evaluation-harness, which is not installed ({e}): run "
            "`pip install 'llmtrain[eval]'` (or `pip install lm-eval`), or leave eval.tasks empty."
        ) from None
    return lm_eval


def run_tokenizer(cfg: Any) -> Any:
    """The tokenizer of a run's config: its first dataset's (as ``llmtrain.train.sample`` loads it)."""
    from llmtrain.data.describe import describe_dataset
    from llmtrain.data.tokenizer import load_tokenizer

    specs = cfg.data.datasets or [d for stage in cfg.stages for d in stage.datasets]
    data = describe_dataset(specs[0].path, cfg.data.tokenizer, "data.datasets[0].path")
    return load_tokenizer(str(data.tokenizer_path()))


def build_tasks(specs: Sequence[str], key: str = "eval.tasks") -> tuple[Any, list[Any]]:
    """(lm-eval TaskManager, Task objects) for ``specs`` (checked offline first); a task lm-eval cannot build
    is named. The manager indexes no directory: scanning lm-eval's own ~14k Hub-backed tasks takes ~10 s."""
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    from llmtrain.eval.tasks import spec_path, task_configs

    manager = TaskManager(include_defaults=False)  # no scan of lm-eval's own (Hub-backed) tasks
    built = []
    for spec, cfg in zip(specs, task_configs(specs, key)):
        try:
            loaded = manager.load([cfg])
        except ConfigError:
            raise
        except Exception as e:  # lm-eval's and datasets' many error types: the task's file is at fault
            raise ConfigError(
                f"{key}: lm-eval could not build task '{cfg['task']}' from {spec_path(spec)}: "
                f"{type(e).__name__}: {e}"
            ) from None
        built += list(loaded["tasks"].values())
    return manager, built


def evaluate(
    model: torch.nn.Module,
    tokenizer: Any,
    tasks: Sequence[str],
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    *,
    max_length: int | None = None,
    autocast_dtype: torch.dtype | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 1000,
    env_info: bool = True,
    progress: bool = True,
    forward: Any = None,
    key: str = "eval.tasks",
) -> dict[str, Any]:
    """lm-eval's results dict (``results``, ``configs``, ``versions``, ``n-shot``, ``n-samples`` ...; with
    ``samples`` when ``log_samples``) for ``model`` on ``tasks`` (shipped names or task YAML paths).
    ``env_info`` False skips lm-eval's environment survey (torch's collect_env: ~2 s of subprocesses) and its
    ``git describe``, ``progress`` False its progress bars, as the in-loop evaluation does. ``forward`` (an
    :mod:`llmtrain.eval.forward` object) is how the model is called: None for one process, a
    ``LayoutForward`` on every rank of a parallel run (all ranks then call this with the same arguments).
    ``key`` names where the task specs came from in messages (``eval.tasks``, ``--tasks``)."""
    lm_eval = import_lm_eval()
    from llmtrain.eval.lm import LLMTrainLM

    if limit is not None and limit <= 0:
        raise ConfigError(f"the evaluation limit must be positive (items per task), got {limit}.")
    if num_fewshot is not None and num_fewshot < 0:
        raise ConfigError(f"num_fewshot must be 0 or more, got {num_fewshot}.")
    with _datasets_quiet(progress):
        manager, built = build_tasks(tasks, key)
    files = _task_files(tasks)
    check_fewshot(built, num_fewshot, files)
    lm = LLMTrainLM(
        model, tokenizer, batch_size, max_length=max_length, autocast_dtype=autocast_dtype, progress=progress,
        forward=forward,
    )  # fmt: skip
    was_training = model.training
    model.eval()
    try:
        with _patched(lm_eval, env_info, progress), _datasets_quiet(progress):
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=built,
                task_manager=manager,
                num_fewshot=num_fewshot,
                batch_size=batch_size,
                limit=limit,
                bootstrap_iters=bootstrap_iters,
                log_samples=log_samples,
                random_seed=None,
                numpy_random_seed=None,
                torch_random_seed=None,
            )
    except Exception as e:
        if not _raised_outside_llmtrain(e):
            raise
        # lm-eval (or jinja2 / datasets under it) failed on what a task file asked for: name the files
        raise ConfigError(
            f"lm-eval could not evaluate the task(s) of {files}: {type(e).__name__}: {e}. Check those task "
            "files (templates, splits, fields, few-shot settings)."
        ) from None
    finally:
        model.train(was_training)
    return dict(results or {})


def _task_files(specs: Sequence[str]) -> str:
    from llmtrain.eval.tasks import spec_path

    return ", ".join(str(spec_path(s) or s) for s in specs)


def _raised_outside_llmtrain(e: BaseException) -> bool:
    """Whether ``e`` came from lm-eval (or jinja2 / datasets under it) without passing through llmtrain's code
    below this module (our LM wrapper, the model): an error of ours keeps its traceback."""
    tb = e.__traceback__
    ours = str(Path(__file__).resolve().parents[1])
    if tb is None:
        return False
    tb = tb.tb_next  # this module's own frame
    while tb is not None:
        if str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(ours):
            return False
        tb = tb.tb_next
    return True


def check_fewshot(built: Sequence[Any], num_fewshot: int | None, files: str) -> None:
    """ConfigError when a task asks for more few-shot examples than its few-shot split holds (lm-eval would
    fail deep inside its sampler); ``num_fewshot`` (the flag) overrides each task's own ``num_fewshot``."""
    for task in built:
        config = getattr(task, "config", None)
        shots = num_fewshot if num_fewshot is not None else getattr(config, "num_fewshot", None)
        if not isinstance(shots, int) or shots <= 0:
            continue
        name = getattr(config, "task", "?")
        try:
            docs = task.fewshot_docs()
            available = len(docs) if docs is not None else 0
        except Exception:  # a version without the API: lm-eval's own error is wrapped later
            continue
        split = getattr(getattr(task, "fewshot_cfg", None), "split", None)
        same = split is not None and split == getattr(config, "test_split", None)
        available -= 1 if same else 0  # the scored document itself is left out of its own examples
        if shots > available:
            raise ConfigError(
                f"task '{name}' ({files}): {shots} few-shot examples asked for (--num-fewshot or the task's "
                f"num_fewshot) but its few-shot split holds only {max(available, 0)} other documents; lower "
                "--num-fewshot or add data to the split."
            )


@contextlib.contextmanager
def _patched(lm_eval: Any, env_info: bool, progress: bool) -> Iterator[None]:
    """lm-eval without its environment survey and/or its progress bars, for the duration of the block."""
    import lm_eval.api.task as task_module

    saved = []
    if not env_info and hasattr(lm_eval.evaluator, "add_env_info"):
        saved.append((lm_eval.evaluator, "add_env_info", lm_eval.evaluator.add_env_info))
        lm_eval.evaluator.add_env_info = lambda results: None
    if not env_info and hasattr(lm_eval.evaluator, "get_git_commit_hash"):  # a `git describe` subprocess,
        saved.append((lm_eval.evaluator, "get_git_commit_hash", lm_eval.evaluator.get_git_commit_hash))
        lm_eval.evaluator.get_git_commit_hash = lambda: None  # "fatal: not a git repository" outside one
    if not progress and hasattr(task_module, "tqdm"):
        saved.append((task_module, "tqdm", task_module.tqdm))
        task_module.tqdm = functools.partial(task_module.tqdm, disable=True)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextlib.contextmanager
def _datasets_quiet(progress: bool) -> Iterator[None]:
    """Without datasets' "Generating test split" bar (a task's local file read the first time) unless
    ``progress``."""
    from datasets.utils import logging as ds_logging  # type: ignore[import-untyped]

    bars = not progress and ds_logging.is_progress_bar_enabled()
    if bars:
        ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            ds_logging.enable_progress_bar()


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def metric_fields(results: dict[str, Any], prefix: str = "eval") -> dict[str, float]:
    """``{"eval/<task>/<metric>": value, "eval/<task>/<metric>_stderr": stderr}`` for every numeric metric
    (lm-eval's ``acc,none`` keys lose their filter suffix when it is ``none``)."""
    out: dict[str, float] = {}
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if name in ("alias", "sample_len") or _number(value) is None:
                continue
            name = name if filt in ("", "none") else f"{name}_{filt}"
            stderr = name.endswith("_stderr")
            base = name[: -len("_stderr")] if stderr else name
            out[f"{prefix}/{task}/{base}" + ("_stderr" if stderr else "")] = float(value)
    return out


def format_table(results: dict[str, Any]) -> str:
    """A plain-text table: task, metric, value, stderr, items (n-samples)."""
    rows = [("task", "metric", "value", "stderr", "n")]
    counts = results.get("n-samples") or {}
    for task, metrics in sorted((results.get("results") or {}).items()):
        for key, value in metrics.items():
            name = key.partition(",")[0]
            if name in ("alias", "sample_len") or name.endswith("_stderr") or _number(value) is None:
                continue
            stderr = _number(metrics.get(key.replace(name, f"{name}_stderr", 1)))
            n = (counts.get(task) or {}).get("effective", "")
            rows.append((task, name, f"{value:.4f}", "" if stderr is None else f"{stderr:.4f}", str(n)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def check_output(path: str | Path) -> Path:
    """``path`` may be written: it is new, or an earlier llmtrain results file (checked before evaluating)."""
    out = Path(path)
    if out.exists() or out.is_symlink():
        ours = False
        if out.is_file() and not out.is_symlink():
            try:
                ours = isinstance(old := json.loads(out.read_text(encoding="utf-8")), dict) and MARKER in old
            except (OSError, UnicodeDecodeError, ValueError):
                ours = False
        if not ours:
            raise FileSystemError(
                f"{out} exists and is not a results file written by `llmtrain eval` (no top-level "
                f'"{MARKER}" key): llmtrain replaces only its own results; choose another --output or remove it.'
            )
    if not out.parent.is_dir():
        raise FileSystemError(
            f"{out}: the folder {out.parent} does not exist; create it or choose another --output."
        )
    return out


def write_results(results: dict[str, Any], path: str | Path, meta: dict[str, Any]) -> Path:
    """Write ``results`` + ``{"llmtrain": meta}`` as JSON to ``path`` (temp file + rename); an existing file
    is replaced only when it is an earlier llmtrain results file."""
    from lm_eval.utils import handle_non_serializable

    out = check_output(path)
    body = {MARKER: meta, **{k: v for k, v in results.items() if k != MARKER}}
    text = json.dumps(body, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out

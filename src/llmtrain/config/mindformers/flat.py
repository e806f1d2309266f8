"""The MindFormers *flat* layout of the seed documents, and MindSpore-only keys in the native layout.

Two kinds of input reach this module (see the seed documents):

* the **MindFormers flat layout** (``run_mode``, ``model_size``, ``model_config{}``, ``parallel_config{}``,
  ``optimizer{lr_scheduler{}}``, ``train_config{}``, ``train_dataset_dir``...). :func:`is_flat_layout`
  detects it and :func:`from_mindformers` maps every key onto our native sections through the tables below:
  plain renames are data (``_RENAMES``), keys whose meaning changes have a small handler each. A key with no
  entry is an error naming it (with the closest known key), never silently dropped.
* our **native layout with MindSpore-only keys** (``run.mode``, ``run.device_target: Ascend``,
  ``run.enable_graph_kernel``, ``run.graph_kernel_flags``, ``parallel.micro_batch_interleave``), handled by
  :func:`normalize_mindspore_keys` for every layout.

The real MindFormers 1.x / 2.x layout (``model.model_config``, ``runner_config``, ``context``...) is
``structured.py``'s. Every key that is renamed, reinterpreted or ignored produces one human-readable note.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any

from llmtrain.config.mindformers.common import (
    DEVICE_TARGETS,
    Ctx,
    compile_from_mode,
    expect_of,
    lookup,
    put,
    typed,
)
from llmtrain.errors import ConfigError

# Top-level keys that only the MindFormers layout has; any one of them selects the adapter.
_MARKERS = {
    "run_mode", "model_size", "model_config", "parallel_config", "train_config", "max_train_steps",
    "num_train_epochs", "train_dataset_dir", "lr_scheduler", "lr_schedule",
}  # fmt: skip
# Native sections that may appear next to the flat keys and pass through unchanged.
_PASSTHROUGH = ("data", "checkpoint", "logging", "eval", "run", "recompute", "stability", "fault")

# (section, MindFormers key) -> native dotted key. Same meaning, new name: one summary note lists them.
_RENAMES: dict[tuple[str, str], str] = {
    ("", "model_type"): "model.model_type",
    ("", "seq_length"): "model.seq_length",
    ("", "micro_batch_size"): "train.micro_batch_size",
    ("", "max_train_steps"): "train.max_steps",
    ("", "seed"): "train.seed",
    ("", "output_dir"): "run.output_dir",
    ("model_config", "hidden_size"): "model.hidden_size",
    ("model_config", "num_layers"): "model.num_layers",
    ("model_config", "num_hidden_layers"): "model.num_layers",
    ("model_config", "num_heads"): "model.num_heads",
    ("model_config", "num_attention_heads"): "model.num_heads",
    ("model_config", "n_kv_heads"): "model.num_kv_heads",
    ("model_config", "num_kv_heads"): "model.num_kv_heads",
    ("model_config", "num_key_value_heads"): "model.num_kv_heads",
    ("model_config", "intermediate_size"): "model.intermediate_size",
    ("model_config", "ffn_hidden_size"): "model.intermediate_size",
    ("model_config", "vocab_size"): "model.vocab_size",
    ("model_config", "head_dim"): "model.head_dim",
    ("model_config", "rms_norm_eps"): "model.rms_norm_eps",
    ("model_config", "rope_theta"): "model.rope_theta",
    ("model_config", "theta"): "model.rope_theta",
    ("model_config", "use_rope"): "model.use_rope",
    ("model_config", "qkv_bias"): "model.qkv_bias",
    ("model_config", "tie_word_embeddings"): "model.tie_word_embeddings",
    ("model_config", "use_flash_attention"): "model.use_flash_attention",
    ("model_config", "seq_length"): "model.seq_length",
    ("parallel_config", "data_parallel"): "parallel.data_parallel",
    ("parallel_config", "tensor_parallel"): "parallel.tensor_parallel",
    ("parallel_config", "model_parallel"): "parallel.tensor_parallel",
    ("parallel_config", "pipeline_parallel"): "parallel.pipeline_parallel",
    ("parallel_config", "pipeline_stage"): "parallel.pipeline_parallel",
    ("parallel_config", "context_parallel"): "parallel.context_parallel",
    ("parallel_config", "expert_parallel"): "parallel.expert_parallel",
    ("parallel_config", "micro_batch_num"): "parallel.micro_batch_num",
    ("parallel_config", "enable_alltoall"): "parallel.enable_alltoall",
    ("parallel_config", "zero_stage"): "parallel.zero_stage",
    ("parallel_config", "use_zero"): "parallel.use_zero",
    ("parallel_config", "zero_level"): "parallel.zero_level",
    ("optimizer", "learning_rate"): "train.lr",
    ("optimizer", "weight_decay"): "train.weight_decay",
    ("optimizer", "beta1"): "train.beta1",
    ("optimizer", "beta2"): "train.beta2",
    ("optimizer", "eps"): "train.eps",
    ("optimizer", "epsilon"): "train.eps",
    ("lr_scheduler", "learning_rate"): "train.lr",
    ("lr_scheduler", "T_max"): "train.decay_steps",
    ("lr_scheduler", "total_steps"): "train.decay_steps",
    ("lr_scheduler", "eta_min"): "train.min_lr",
    ("lr_scheduler", "lr_end"): "train.min_lr",
    ("lr_scheduler", "warmup_steps"): "train.warmup_steps",
    ("train_config", "save_steps"): "checkpoint.save_steps",
    ("train_config", "keep_checkpoint_max"): "checkpoint.keep_checkpoint_max",
    ("train_config", "log_steps"): "train.log_steps",
    ("train_config", "eval_steps"): "train.eval_steps",
    ("train_config", "gradient_accumulation_steps"): "train.gradient_accumulation_steps",
    ("train_config", "clip_grad_norm"): "train.grad_clip_norm",
}

# (section, key) -> why it is ignored. Accepted so that real MindFormers files load, each reported by name.
_IGNORED: dict[tuple[str, str], str] = {
    ("parallel_config", "use_seq_parallel"): "sequence parallelism is always on with tensor_parallel > 1",
    ("parallel_config", "vocab_emb_dp"): "the embedding is sharded by the tensor-parallel plan",
    ("parallel_config", "gradient_aggregation_group"): "gradient buckets are chosen by FSDP2",
    ("model_config", "max_position_embeddings"): "positions are bounded by model.seq_length",
    ("model_config", "compute_dtype"): "compute precision is train.precision",
    ("model_config", "param_init_type"): "parameters are kept in fp32 (train.precision sets autocast)",
}

_LR_SCHEDULERS = {
    "cosineannealinglr": "cosine", "cosinewithwarmuplr": "cosine", "cosine": "cosine",
    "linearwithwarmuplr": "linear", "linear": "linear",
    "constantwarmuplr": "constant", "constant": "constant", "wsd": "wsd", "warmupstabledecaylr": "wsd",
}  # fmt: skip
_OPTIMIZERS = {"adamw": "adamw", "fusedadamweightdecay": "adamw", "fp32adamw": "adamw"}
_SECTIONS = ("model_config", "parallel_config", "optimizer", "train_config")


def is_flat_layout(raw: dict) -> bool:
    """True for the MindFormers flat layout (run_mode, model_config{}, parallel_config{}, ...)."""
    return bool(_MARKERS & set(raw)) or isinstance(raw.get("optimizer"), dict)


def from_mindformers(raw: dict, source: str) -> tuple[dict, list[str]]:
    """Map a MindFormers flat config onto native sections; ConfigError for keys it cannot place."""
    for native_section in ("model", "parallel", "train"):
        if native_section in raw:
            raise ConfigError(
                f"{source}: mixes the MindFormers flat layout (e.g. model_config, parallel_config) with the "
                f"native section {native_section!r}; write the file in one layout."
            )
    out: dict[str, Any] = {name: copy.deepcopy(raw[name]) for name in _PASSTHROUGH if name in raw}
    notes: list[str] = []
    renamed: list[str] = []
    for key, value in raw.items():
        if key in _PASSTHROUGH:
            continue
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {key}: expected a mapping of keys, got {value!r}.")
            for sub_key, sub_value in value.items():
                _map_key(key, str(sub_key), sub_value, out, notes, renamed, source)
        else:
            _map_key("", str(key), value, out, notes, renamed, source)
    if renamed:
        notes.insert(0, "MindFormers keys renamed: " + ", ".join(renamed) + ".")
    return out, notes


def _map_key(
    section: str, key: str, value: Any, out: dict, notes: list[str], renamed: list[str], source: str
) -> None:
    name = f"{section}.{key}" if section else key
    if (section, key) in _RENAMES:
        target = _RENAMES[(section, key)]
        put(out, target, typed(Ctx(source), name, value, expect_of(target)))
        renamed.append(f"{name} -> {target}")
    elif (section, key) in _IGNORED:
        notes.append(f"{name}: {value!r} ignored: {_IGNORED[(section, key)]}.")
    elif section == "" and key in _HANDLERS:
        _HANDLERS[key](value, out, notes, source)
    elif section == "optimizer" and key == "type":
        put(out, "train.optimizer", lookup(_OPTIMIZERS, value, "optimizer.type", source))
        notes.append(f"optimizer.type: {value!r} -> train.optimizer {out['train']['optimizer']!r}.")
    elif section in ("", "optimizer") and key in ("lr_scheduler", "lr_schedule"):
        _map_lr_scheduler(name, value, out, notes, renamed, source)
    elif section == "model_config" and key == "rope_scaling":
        _map_rope_scaling(value, out, notes)
    elif section == "train_config" and key == "dynamic_loss_scale":
        scale = "dynamic" if value is True else 1.0
        put(out, "train.loss_scale", scale)
        notes.append(
            f"train_config.dynamic_loss_scale: {value!r} -> train.loss_scale {scale!r} (used only with "
            "train.precision fp16)."
        )
    else:
        known = sorted({k for s, k in (*_RENAMES, *_IGNORED) if s == section} | _extra_keys(section))
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f" (did you mean {(section + '.' if section else '') + close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{source}: unknown MindFormers key {name!r}{hint}. Known keys"
            f"{' in ' + section if section else ' at the top level'}: {', '.join(known)}."
        )


def _extra_keys(section: str) -> set[str]:
    """Keys handled by code rather than by the tables, for the suggestion list."""
    return {
        "": set(_HANDLERS) | set(_SECTIONS) | set(_PASSTHROUGH) | {"lr_scheduler", "lr_schedule"},
        "optimizer": {"type", "lr_scheduler", "lr_schedule"},
        "model_config": {"rope_scaling"},
        "train_config": {"dynamic_loss_scale"},
    }.get(section, set())


def _map_lr_scheduler(name: str, value: Any, out: dict, notes: list[str], renamed: list[str], source: str):
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {name}: expected a mapping like {{type: CosineAnnealingLR, T_max: N}}.")
    for key, sub_value in value.items():
        if key == "type":
            style = lookup(_LR_SCHEDULERS, sub_value, f"{name}.type", source)
            put(out, "train.decay_style", style)
            notes.append(f"{name}.type: {sub_value!r} -> train.decay_style {style!r}.")
        elif ("lr_scheduler", key) in _RENAMES:
            target = _RENAMES[("lr_scheduler", key)]
            put(out, target, sub_value)
            renamed.append(f"{name}.{key} -> {target}")
        else:
            known = sorted({k for s, k in _RENAMES if s == "lr_scheduler"} | {"type"})
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f" (did you mean {name + '.' + close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{source}: unknown MindFormers key {name + '.' + str(key)!r}{hint}. Known keys in {name}: "
                f"{', '.join(known)}."
            )


def _map_rope_scaling(value: Any, out: dict, notes: list[str]) -> None:
    # model.rope_scaling None would mean "the flavor's default" (Llama 3.1 scaling for llama3 flavors), so
    # "no scaling" is written explicitly as the identity: a linear factor of 1.
    put(out, "model.rope_scaling", 1.0 if value is None else value)
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool) and value == 1):
        notes.append(
            f"model_config.rope_scaling: {value!r} -> model.rope_scaling 1.0: no RoPE scaling (linear factor 1, "
            "the identity; replaces the flavor's default scaling)."
        )
    else:
        notes.append(
            f"model_config.rope_scaling: {value!r} -> model.rope_scaling (a number is a linear factor)."
        )


def _run_mode(value: Any, out: dict, notes: list[str], source: str) -> None:
    if str(value).lower() != "train":
        raise ConfigError(
            f"{source}: run_mode {value!r} is not supported: llmtrain pretrains only (run_mode: train); "
            f"use `llmtrain generate` for inference."
        )
    notes.append("run_mode: 'train' ignored: `llmtrain train` is the only run mode.")


def _model_size(value: Any, out: dict, notes: list[str], source: str) -> None:
    flavor = str(value).lower()
    put(out, "model.flavor", flavor)
    notes.append(f"model_size: {value!r} -> model.flavor {flavor!r} (the family's named size).")


def _batch_size(value: Any, out: dict, notes: list[str], source: str) -> None:
    put(out, "train.batch_size", value)
    notes.append(
        f"batch_size: {value!r} -> train.batch_size, read as the global batch in sequences "
        "(= micro_batch_size x data-parallel size x gradient accumulation)."
    )


def _epochs(value: Any, out: dict, notes: list[str], source: str) -> None:
    put(out, "train.epochs", value)
    notes.append(
        f"num_train_epochs: {value!r} -> train.epochs (caps training; train.max_steps still applies)."
    )


def _dataset_dir(value: Any, out: dict, notes: list[str], source: str) -> None:
    put(out, "data.datasets", [{"path": value, "weight": 1.0}])
    notes.append(
        f"train_dataset_dir: {value!r} -> data.datasets [{{path: {value}, weight: 1}}], read as a token "
        "dataset prefix (PREFIX.bin/.idx/.manifest.json written by `llmtrain prepare`), not MindRecord files."
    )


_HANDLERS = {
    "run_mode": _run_mode,
    "model_size": _model_size,
    "batch_size": _batch_size,
    "num_train_epochs": _epochs,
    "train_dataset_dir": _dataset_dir,
}


def normalize_mindspore_keys(d: dict, source: str) -> list[str]:
    """Rewrite MindSpore-only keys of a native dict in place (run.mode, device_target...); return notes."""
    notes: list[str] = []
    run, train, parallel = d.get("run"), d.get("train"), d.get("parallel")
    if isinstance(run, dict):
        if "mode" in run:
            mode = run.pop("mode")
            compile_ = compile_from_mode(mode)
            if compile_ is None:
                raise ConfigError(
                    f"{source}: run.mode: expected 0 (GRAPH_MODE, -> train.compile: true) or 1 (PYNATIVE_MODE, "
                    f"-> train.compile: false), got {mode!r}."
                )
            train = d.setdefault("train", {}) if train is None else train
            if isinstance(train, dict) and "compile" in train:
                notes.append(f"run.mode: {mode!r} ignored: train.compile is given explicitly.")
            elif isinstance(train, dict):
                train["compile"] = compile_
                notes.append(f"run.mode: {mode!r} -> train.compile: {str(compile_).lower()} (torch.compile).")
        for key in ("enable_graph_kernel", "graph_kernel_flags"):
            if key in run:
                notes.append(
                    f"run.{key}: {run.pop(key)!r} ignored: MindSpore graph-kernel fusion has no PyTorch "
                    "equivalent; kernel fusion comes from torch.compile (train.compile)."
                )
        target = run.get("device_target")
        if isinstance(target, str) and DEVICE_TARGETS.get(target.lower(), target) != target:
            run["device_target"] = DEVICE_TARGETS[target.lower()]
            notes.append(f"run.device_target: {target!r} -> {run['device_target']!r}.")
    if isinstance(parallel, dict) and parallel.get("micro_batch_interleave") is True:
        pp = parallel.get("pipeline_parallel", 1)
        if isinstance(pp, int) and pp > 1 and "schedule" not in parallel:
            parallel["schedule"] = "interleaved_1f1b"
            parallel.setdefault("virtual_stages", 2)
            notes.append(
                "parallel.micro_batch_interleave: true -> parallel.schedule interleaved_1f1b with "
                f"virtual_stages {parallel['virtual_stages']} (pipeline_parallel {pp})."
            )
    return notes

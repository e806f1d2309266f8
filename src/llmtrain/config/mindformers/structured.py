"""The real MindFormers layout (1.x and 2.x pretraining files) -> native sections.

A MindFormers run file has ``model: {model_config, arch}`` (``model.py``), ``runner_config``,
``parallel_config`` (the degrees), ``parallel`` (MindSpore's *parallel context*: parallel_mode,
enable_parallel_optimizer, full_batch... — not our ``parallel:`` section), ``recompute_config``, ``context``
(MindSpore's device context), ``optimizer``, ``lr_schedule``, ``train_dataset`` / ``train_dataset_task``,
``callbacks``, ``runner_wrapper`` and many MindSpore-only keys. Each section is a spec (``common.py``): every
key maps, is ignored with its reason, or is refused; an unknown key is an error naming it.

Figures that need several keys are computed after the walk (:func:`translate`), as MindFormers computes them
(``trainer/base_trainer.py`` ``_check_global_batch_size_for_auto_parallel``, ``_check_grad_accumulation_steps``;
``trainer/utils.py`` ``check_runner_config``; ``create_lr_scheduler``):

* **global batch** (semi-auto / auto parallel): ``batch_size x data_parallel x micro_batch_num x
  micro_batch_interleave_num`` when ``pipeline_stage > 1`` (MindFormers resets gradient_accumulation_steps to 1
  under pipeline parallel), else ``batch_size x data_parallel x micro_batch_interleave_num x
  gradient_accumulation_steps``; data-parallel mode (``parallel_mode: 0``): ``batch_size x devices x
  gradient_accumulation_steps``. It becomes ``train.batch_size``; ``train.micro_batch_size`` is ``batch_size x
  micro_batch_interleave_num``, ``parallel.micro_batch_num`` the pipeline micro-batches.
* **run length**: ``lr_schedule.total_steps: -1`` (or absent) means ``epochs x`` the dataset's steps. When the
  data loader states its sample count (``BlendedMegatronDatasetDataLoader`` ``sizes[0]``) that is
  ``epochs x (sizes[0] // global batch)`` -> ``train.max_steps``; otherwise (a MindRecord ``MindDataset``) the
  size is unknown and :func:`finish` (after the command-line overrides) asks for ``train.max_steps``.
  ``train.epochs`` keeps the epoch count as a cap on llmtrain's own data.
* **warmup_ratio** -> ``train.warmup_steps = int(ratio x total)``, total = ``total_steps`` or the run length,
  computed in :func:`finish` so that an overridden ``train.max_steps`` counts. A given ``total_steps`` N sets
  ``train.decay_steps = N - warmup``.
* ``enable_parallel_optimizer`` -> ZeRO 3 (MindSpore's optimizer parallel stores parameters sliced over the
  data-parallel ranks and gathers them for use, as FSDP does); ``optimizer_weight_shard_size`` -> HSDP.
* ``recompute: true`` -> ``recompute.mode full``; per-stage layer counts -> ``selective`` with the nearest
  ``every``; MindSpore's op- and communication-level recompute has no counterpart (listed as ignored).
"""

from __future__ import annotations

import copy
import os
from typing import Any

from llmtrain.config.mindformers import tables as T
from llmtrain.config.mindformers.common import (
    DEVICE_TARGETS,
    Ctx,
    Fact,
    Ignore,
    Only,
    Spec,
    To,
    compile_from_mode,
    fact_int,
    lookup,
    walk,
)
from llmtrain.config.mindformers.fault import map_tft
from llmtrain.config.mindformers.model import finish_model, finish_pipeline, map_model
from llmtrain.config.mindformers.moe import map_moe_config
from llmtrain.config.mindformers.schedule import PENDING, finish, run_length
from llmtrain.config.mindformers.sections import (
    CONTEXT_SPEC,
    DATASET_SPEC,
    EVAL_SPEC,
    LR_SPEC,
    OPTIMIZER_SPEC,
    PARALLEL_SPEC,
    RECOMPUTE_SPEC,
    RUNNER_WRAPPER_SPEC,
    TOP_IGNORED,
    finish_data,
    finish_recompute,
    map_callbacks,
)
from llmtrain.errors import ConfigError

__all__ = ["PENDING", "finish", "from_structured", "is_structured_layout", "translate"]

NATIVE_SECTIONS = (
    "train",
    "data",
    "checkpoint",
    "logging",
    "eval",
    "run",
    "recompute",
    "stability",
    "fault",
    "fault_tolerance",
    "stages",
)


def is_structured_layout(raw: dict) -> bool:
    """True for a MindFormers 1.x / 2.x run file: ``model.model_config``, ``runner_config`` or ``context``."""
    model = raw.get("model")
    return (isinstance(model, dict) and "model_config" in model) or "runner_config" in raw or "context" in raw


def translate(raw: dict, source: str) -> tuple[dict, list[str], str | None]:
    """(native dict, notes, missing family) of a MindFormers run file; ConfigError for what cannot be mapped.

    The missing family is the label of a model type llmtrain has no family for yet (None otherwise); every
    other key is mapped before it is reported, so that the family is then the only thing missing."""
    ctx, raw = Ctx(source), copy.deepcopy(raw)
    native: dict[str, Any] = {}
    for key, value in raw.items():
        if key in NATIVE_SECTIONS:
            native[str(key)] = value
    walk(ctx, "", {k: v for k, v in raw.items() if k not in NATIVE_SECTIONS}, _TOP_SPEC)
    missing = finish_model(ctx)
    _parallel_and_batch(ctx)
    map_tft(ctx, os.environ)  # MindFormers' fault-tolerance switch is an environment variable (fault.py)
    finish_recompute(ctx)
    finish_data(ctx)
    run_length(ctx)
    out = ctx.out
    for section, values in native.items():
        if not isinstance(values, dict) or not isinstance(out.get(section, {}), dict):
            out[section] = values
            continue
        clash = sorted(set(values) & set(out.get(section, {})))
        if clash:
            ctx.notes.add(
                f"native section {section}: {', '.join(clash)} written there win over the MindFormers keys."
            )
        out.setdefault(section, {}).update(values)
    return out, ctx.notes.render(), missing


def from_structured(raw: dict, source: str) -> tuple[dict, list[str]]:
    """Native dict and notes; ConfigError when the model type has no llmtrain family yet."""
    out, notes, missing = translate(raw, source)
    if missing is not None:
        raise ConfigError(
            f"{source}: model_type {missing} is not available yet: llmtrain has no family with Multi-head Latent "
            f"Attention, DeepSeek's MoE routing and multi-token prediction, which this file asks for "
            f"(model.model_config / moe_config: {_pending_names(raw)}). Every other key of the file maps onto "
            "llmtrain (docs/interop.md); only the family is missing. Train a Llama or Qwen family config meanwhile."
        )
    return out, notes


def _pending_names(raw: dict) -> str:
    found = []
    for section in ((raw.get("model") or {}).get("model_config") or {}, raw.get("moe_config") or {}):
        found += [f"{k} {section[k]!r}" for k in T.MLA_KEYS if k in section]
    return ", ".join(found) or "its model type"


# ------------------------------------------------------------------------------------------------- top level
def _run_mode(ctx: Ctx, name: str, value: Any) -> None:
    if str(value).lower() != "train":
        raise ctx.error(
            name,
            f"{value!r} is not supported: llmtrain pretrains (run_mode: train); use `llmtrain generate`.",
        )
    ctx.notes.ignore(name, "`llmtrain train` is the only run mode")


def _resume(ctx: Ctx, name: str, value: Any) -> None:
    ctx.notes.add(
        f"{name}: {value!r} -> checkpoint.resume auto: llmtrain resumes only from checkpoints of its own run "
        "directory (run.output_dir); a new directory starts from scratch."
    )


def _context_mode(ctx: Ctx, name: str, value: Any) -> None:
    compile_ = compile_from_mode(value)
    if compile_ is None:
        raise ctx.error(name, f"expected 0 (GRAPH_MODE) or 1 (PYNATIVE_MODE), got {value!r}.")
    ctx.put("train.compile", compile_)
    ctx.notes.add(
        f"{name}: {value!r} -> train.compile {str(compile_).lower()} (torch.compile for graph mode)."
    )


def _device_target(ctx: Ctx, name: str, value: Any) -> None:
    target = lookup(DEVICE_TARGETS, value, name, ctx.source)
    ctx.put("run.device_target", target)
    ctx.notes.add(f"{name}: {value!r} -> run.device_target {target}.")


def _scale_sense(ctx: Ctx, name: str, value: Any) -> None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        ctx.put("train.loss_scale", float(value))
        ctx.notes.add(
            f"{name}: {value!r} -> train.loss_scale {float(value)} (a fixed scale; applied with fp16 only)."
        )
        return
    sub: dict[str, Any] = {}
    walk(
        ctx,
        name,
        value,
        {
            "type": Fact("scale_type"),
            "loss_scale_value": Fact("scale_value", "num+"),
            "scale_window": Fact("scale_window", "int1"),
            "scale_factor": Only(
                (2, 2.0),
                "2: llmtrain's dynamic loss scale also halves on overflow and doubles",
                "llmtrain's dynamic loss scale moves by 2x",
            ),
        },
    )
    kind = str(ctx.facts.get("scale_type", "")).lower()
    if kind == "dynamiclossscaleupdatecell":
        sub = {"loss_scale": "dynamic"}
        if "scale_value" in ctx.facts:
            sub["initial_loss_scale"] = float(ctx.facts["scale_value"])
        if "scale_window" in ctx.facts:
            sub["loss_scale_window"] = int(ctx.facts["scale_window"])
    elif kind == "fixedlossscaleupdatecell":
        sub = {"loss_scale": float(ctx.facts.get("scale_value", 1.0))}
    else:
        raise ctx.error(
            f"{name}.type",
            f"{kind or None!r}: expected DynamicLossScaleUpdateCell or FixedLossScaleUpdateCell.",
        )
    for key, v in sub.items():
        ctx.put(f"train.{key}", v)
    ctx.notes.add(
        f"{name} ({ctx.written('scale_type', 'scale_value', 'scale_window')}) -> "
        + ", ".join(f"train.{k} {v!r}" for k, v in sub.items())
        + " (used with fp16)."
    )


def _walker(spec: Spec):
    return lambda ctx, name, value: walk(ctx, name, value, spec)


def _dataset_config(ctx: Ctx, name: str, value: Any) -> None:
    if "loader_type" in ctx.facts:  # train_dataset was read: the usual YAML anchor, the same mapping
        ctx.notes.ignore(name, "the same mapping as train_dataset, read there")
    else:
        walk(ctx, name, value, DATASET_SPEC)


_RUNNER_SPEC: Spec = {
    "epochs": Fact("epochs", "int1"),
    "batch_size": Fact("batch_size", "int1"),
    "gradient_accumulation_steps": Fact("gas", "int1"),
    "sink_mode": Ignore(T.R_SINK),
    "sink_size": Ignore(T.R_SINK),
    "initial_epoch": Only(
        (0, None), "0: starts at the beginning", "resume with llmtrain's checkpoints instead"
    ),
    "initial_step": Only(
        (0, None), "0: starts at the beginning", "resume with llmtrain's checkpoints instead"
    ),
}
_PARALLEL_CONFIG_SPEC: Spec = {
    "data_parallel": Fact("dp", "int1"),
    "model_parallel": Fact("mp", "int1"),
    "pipeline_stage": Fact("pp", "int1"),
    "micro_batch_num": Fact("mbn", "int1"),
    "expert_parallel": Fact("ep", "int1"),
    "context_parallel": Fact("cp", "int1"),
    "use_seq_parallel": Ignore(T.R_SEQPAR),
    "vocab_emb_dp": Ignore(T.R_EMBED),
    "gradient_aggregation_group": Ignore(T.R_COMM),
    "mem_coeff": Ignore(T.R_AUTO),
    "optimizer_shard": Fact("optimizer_shard"),
    "seq_split_num": Only(
        (1, None), "1: no sequence pipelining", "sequence pipelining (seqpipe) is not implemented"
    ),
    "expert_model_parallel": Only(
        (None, 1), "experts are not tensor-parallel", "expert tensor parallelism is not implemented"
    ),
}
_TOP_SPEC: Spec = {
    "seed": To("train.seed", expect="int0"),
    "output_dir": To("run.output_dir"),
    "run_mode": _run_mode,
    "use_parallel": Fact("use_parallel", "bool"),
    "resume_training": _resume,
    "micro_batch_interleave_num": Fact("interleave", "int1"),
    "trainer": _walker(
        {
            "type": Only(
                ("CausalLanguageModelingTrainer",), T.R_TRAINER, "llmtrain pretrains causal language models"
            ),
            "model_name": Ignore(T.R_TRAINER),
        }
    ),
    "runner_config": _walker(_RUNNER_SPEC),
    "parallel_config": _walker(_PARALLEL_CONFIG_SPEC),
    "parallel": _walker(PARALLEL_SPEC),
    "recompute_config": _walker(RECOMPUTE_SPEC),
    "context": _walker({**CONTEXT_SPEC, "mode": _context_mode, "device_target": _device_target}),
    "optimizer": _walker(OPTIMIZER_SPEC),
    "lr_schedule": _walker(LR_SPEC),
    "runner_wrapper": _walker({**RUNNER_WRAPPER_SPEC, "scale_sense": _scale_sense}),
    "train_dataset": _walker(DATASET_SPEC),
    "train_dataset_task": _walker(
        {
            "type": Only(
                ("CausalLanguageModelDataset",),
                "the causal-LM dataset, the one llmtrain trains on",
                "llmtrain pretrains causal LMs",
            ),
            "dataset_config": _dataset_config,
        }
    ),
    "callbacks": map_callbacks,
    "model": map_model,
    "moe_config": map_moe_config,
    **EVAL_SPEC,
    **TOP_IGNORED,
}


# ------------------------------------------------------------------------------------ figures from several keys
_MODES = {"0": "data_parallel", "1": "semi_auto_parallel", "2": "auto_parallel", "3": "hybrid_parallel"}


def _parallel_mode(ctx: Ctx) -> str:
    mode = str(ctx.facts.get("parallel_mode", 1)).lower()
    mode = _MODES.get(mode, mode)
    if mode not in ("data_parallel", "semi_auto_parallel", "auto_parallel", "stand_alone"):
        raise ctx.error(
            "parallel.parallel_mode",
            f"{ctx.facts.get('parallel_mode')!r} is not supported: 0 (data parallel), 1 (semi-auto) or 2 (auto "
            "parallel); hybrid parallel (3) is sharding written in MindSpore code.",
        )
    return mode


def _parallel_and_batch(ctx: Ctx) -> None:
    """The degrees and the global batch (module docstring), then ZeRO, the schedule and the pipeline split."""
    f = ctx.facts
    dp, mp, pp = fact_int(ctx, "dp", 1), fact_int(ctx, "mp", 1), fact_int(ctx, "pp", 1)
    cp, ep, mbn = fact_int(ctx, "cp", 1), fact_int(ctx, "ep", 1), fact_int(ctx, "mbn", 1)
    bs, gas, inter = fact_int(ctx, "batch_size", 1), fact_int(ctx, "gas", 1), fact_int(ctx, "interleave", 1)
    mode = _parallel_mode(ctx)
    if f.get("use_parallel") is False or mode in ("data_parallel", "stand_alone"):
        devices = 1 if f.get("use_parallel") is False else dp * mp * pp * cp
        gbs, mbs, accum = bs * devices * gas, bs, gas
        dp, mp, pp, cp, ep, mbn = devices, 1, 1, 1, 1, 1
        why = "use_parallel: false, one device" if f.get("use_parallel") is False else "data-parallel mode"
        formula = f"batch_size {bs} x devices {devices} x gradient_accumulation_steps {gas} ({why})"
    elif pp > 1:
        gbs, mbs, accum = bs * dp * mbn * inter, bs * inter, None
        formula = (
            f"batch_size {bs} x data_parallel {dp} x micro_batch_num {mbn} x micro_batch_interleave_num "
            f"{inter} (pipeline_stage {pp} > 1)"
        )
        if "gas" in f:
            ctx.notes.add(
                f"runner_config.gradient_accumulation_steps {gas} ignored: MindFormers resets it to 1 under "
                "pipeline parallel (the pipeline micro-batches accumulate instead)."
            )
    else:
        gbs, mbs, accum = bs * dp * inter * gas, bs * inter, gas
        formula = (
            f"batch_size {bs} x data_parallel {dp} x micro_batch_interleave_num {inter} x "
            f"gradient_accumulation_steps {gas}"
        )
        if mbn > 1:
            ctx.notes.ignore(f"parallel_config.micro_batch_num {mbn}", T.R_NOEFFECT_PP1)
    degrees = {"data_parallel": dp, "tensor_parallel": mp, "pipeline_parallel": pp, "context_parallel": cp}
    degrees["expert_parallel"] = ep
    for key, v in degrees.items():
        ctx.put(f"parallel.{key}", v)
    if pp > 1:
        ctx.put("parallel.micro_batch_num", mbn)
    shown = ", ".join(f"{k} {v}" for k, v in degrees.items()) + (f", micro_batch_num {mbn}" if pp > 1 else "")
    ctx.notes.add(
        f"parallel_config ({ctx.written('parallel_mode', 'dp', 'mp', 'pp', 'cp', 'ep', 'mbn')}) -> parallel: {shown}."
    )
    ctx.put("train.batch_size", gbs)
    ctx.put("train.micro_batch_size", mbs)
    if accum is not None:
        ctx.put("train.gradient_accumulation_steps", accum)
    f["global_batch"] = gbs
    ctx.notes.add(
        f"global batch {gbs} = {formula}, as MindFormers computes it -> train.batch_size {gbs}, "
        f"train.micro_batch_size {mbs}" + (f", train.gradient_accumulation_steps {accum}." if accum else ".")
    )
    if inter > 1:
        ctx.notes.add(
            f"micro_batch_interleave_num {inter}: each micro-batch is {inter} MindSpore slices run together "
            f"(a communication-overlap trick) -> one micro-batch of {mbs} sequences."
        )
    if f.get("use_parallel") is True:
        ctx.notes.ignore(
            "use_parallel", "the process count comes from the launcher (torchrun / llmtrain launch)"
        )
    _sharding(ctx, dp)
    _schedule(ctx, pp)
    finish_pipeline(ctx, pp)


def _sharding(ctx: Ctx, dp: int) -> None:
    f = ctx.facts
    zero = 3 if f.get("parallel_optimizer", f.get("optimizer_shard", False)) else 0
    ctx.put("parallel.zero_stage", zero)
    ctx.notes.add(
        f"parallel.enable_parallel_optimizer {bool(zero)} -> parallel.zero_stage {zero}"
        + (" (parameters, gradients and optimizer states sharded over data parallel: FSDP)." if zero else ".")
    )
    size = f.get("shard_size")
    if zero and isinstance(size, int) and 1 < size < dp and dp % size == 0:
        ctx.put("parallel.data_parallel_replicate", dp // size)
        ctx.notes.add(
            f"optimizer_weight_shard_size {size} -> parallel.data_parallel_replicate {dp // size} (HSDP)."
        )
    elif "shard_size" in f:
        name = "parallel.parallel_optimizer_config.optimizer_weight_shard_size"
        ctx.notes.ignore(name, "the optimizer shards over the whole data-parallel group")


def _schedule(ctx: Ctx, pp: int) -> None:
    schedule, name = ctx.facts.get("pipeline_scheduler"), "parallel.pipeline_config.pipeline_scheduler"
    if schedule is None:
        return
    if pp == 1:
        ctx.notes.ignore(name, "no pipeline parallel")
        return
    ctx.put(
        "parallel.schedule",
        lookup({"1f1b": "1f1b", "gpipe": "gpipe", "zerobubblev": "zbv"}, schedule, name, ctx.source),
    )
    ctx.notes.renamed(name, "parallel.schedule")

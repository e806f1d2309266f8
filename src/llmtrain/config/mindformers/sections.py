"""Specs of the MindFormers 1.x / 2.x sections that are mostly data: which key maps where, which is ignored and
why, which is refused. The computations that need several keys are in ``structured.py``."""

from __future__ import annotations

from typing import Any

from llmtrain.config.mindformers import tables as T
from llmtrain.config.mindformers.common import Ctx, Fact, Ignore, Only, Spec, To, walk
from llmtrain.config.mindformers.fault import CALLBACK_KEY_NOTE, CALLBACK_NOTE


def _all(reason: str, *keys: str) -> Spec:
    return {k: Ignore(reason) for k in keys}


PARALLEL_SPEC: Spec = {  # MindSpore's parallel context (`parallel:`), not our parallel section
    "parallel_mode": Fact("parallel_mode"),
    "enable_parallel_optimizer": Fact("parallel_optimizer", "bool"),
    "enable_alltoall": To("parallel.enable_alltoall", expect="bool"),
    "gradients_mean": Ignore(
        "the loss is the mean over the global batch's tokens; its gradients need no extra mean"
    ),
    "full_batch": Ignore("each data-parallel rank reads only its own share of every global batch"),
    "loss_repeated_mean": Ignore("the loss is the mean over the global batch's tokens"),
    "parallel_optimizer_config": lambda ctx, name, value: walk(
        ctx,
        name,
        value,
        {
            "gradient_accumulation_shard": Ignore("FSDP2 keeps sharded gradients across accumulation"),
            "parallel_optimizer_threshold": Ignore("FSDP2 shards every parameter, however small"),
            "optimizer_weight_shard_size": Fact("shard_size", "int"),
        },
    ),
    "pipeline_config": lambda ctx, name, value: walk(
        ctx,
        name,
        value,
        {
            "pipeline_interleave": Ignore("interleaving follows model_config.pp_interleave_num"),
            "pipeline_scheduler": Fact("pipeline_scheduler"),
        },
    ),
    **_all(T.R_AUTO, "search_mode", "dataset_strategy", "auto_pipeline", "sharding_propagation"),
    **_all(T.R_CKPT, "strategy_ckpt_save_file", "strategy_ckpt_load_file", "strategy_ckpt_config"),
    "device_num": Ignore(T.R_DEVICE),
}
RECOMPUTE_SPEC: Spec = {
    "recompute": Fact("recompute"),
    "select_recompute": Fact("select_recompute"),
    **_all(
        T.R_COMM,
        "select_comm_recompute",
        "mp_comm_recompute",
        "parallel_optimizer_comm_recompute",
        "recompute_slice_activation",
        "select_recompute_exclude",
        "select_comm_recompute_exclude",
    ),
}
CONTEXT_SPEC: Spec = {  # mode and device_target have handlers in structured.py
    "device_id": Ignore(T.R_DEVICE),
    "affinity_cpu_list": Ignore(T.R_DEVICE),
    "max_device_memory": Ignore(T.R_MEMORY),
    **_all(
        T.R_GRAPH,
        "mempool_block_size",
        "max_call_depth",
        "save_graphs",
        "save_graphs_path",
        "jit_config",
        "memory_optimize_level",
        "enable_graph_kernel",
        "graph_kernel_flags",
        "ascend_config",
        "runtime_num_threads",
        "jit_level",
        "pynative_synchronize",
    ),
}
OPTIMIZER_SPEC: Spec = {
    "type": Fact("opt_type"),
    "betas": Fact("betas"),
    "beta1": Fact("beta1", "num0"),
    "beta2": Fact("beta2", "num0"),
    "eps": Fact("eps", "num+"),
    "epsilon": Fact("eps", "num+"),
    "weight_decay": Fact("weight_decay", "num0"),
    "learning_rate": Fact("opt_lr", "num0"),
    "use_fused": Ignore(T.R_LAYOUT),
    "amsgrad": Only((False,), "off: plain AdamW", "AMSGrad is not implemented"),
    "maximize": Only((False,), "off: the loss is minimised", "llmtrain minimises the loss"),
    "swap": Only(
        (False,),
        "off: optimizer states stay on the device",
        "set parallel.cpu_offload to keep them on the host",
    ),
}
_WARMUP_INIT = Only((0, 0.0), "warmup starts at 0", "llmtrain's warmup rises linearly from 0")
LR_SPEC: Spec = {
    "type": Fact("lr_type"),
    "learning_rate": Fact("lr", "num0"),
    "base_lr": Fact("lr", "num0"),
    "lr_end": Fact("lr_end", "num0"),
    "eta_min": Fact("lr_end", "num0"),
    "warmup_steps": Fact("warmup_steps", "int0"),
    "warmup_ratio": Fact("warmup_ratio", "num0"),
    "total_steps": Fact("total_steps", "int"),
    "t_max": Fact("t_max", "int"),
    "decay_steps": Fact("decay_steps", "int"),
    "decay_ratio": Fact("decay_ratio", "num0"),
    "decay_start_steps": Fact("decay_start_steps", "int"),
    "decay_start_ratio": Fact("decay_start_ratio", "num0"),
    "warmup_lr_init": _WARMUP_INIT,
    "num_cycles": Only(
        (0.5,),
        "0.5: one half-period cosine decay, as llmtrain's",
        "llmtrain's cosine decays over half a period",
    ),
    "power": Only((1, 1.0), "1: a linear decay", "only power 1 (linear) is supported"),
    "auto_register": Ignore(T.R_REGISTER),
}
RUNNER_WRAPPER_SPEC: Spec = {  # scale_sense has a handler in structured.py
    "type": Only(
        (
            "MFTrainOneStepCell",
            "MFPipelineWithLossScaleCell",
            "TrainOneStepWithLossScaleCell",
            "TrainOneStepCell",
        ),
        "a plain training step: one optimizer update per global batch",
        "only plain training steps",
    ),  # fmt: skip
    "use_clip_grad": Fact("use_clip_grad", "bool"),
    "max_grad_norm": Fact("max_grad_norm", "num+"),
    "enable_check_overflow": Ignore("fp16 steps with non-finite gradients are always skipped"),
}
_MASK = "the causal (and document) mask is built inside attention"
MEGATRON_SPEC: Spec = {
    "seq_length": Fact("data_seq", "int1"),
    "eod_mask_loss": To("data.eod_mask_loss"),
    "reset_position_ids": Fact("reset_pos"),
    "reset_attention_mask": Fact("reset_mask"),
    "data_path": Fact("data_path"),
    "split": Ignore(T.R_EVAL),
    **_all("the data order follows train.seed", "seed", "random_seed"),
    **_all(_MASK, "create_attention_mask", "create_compressed_eod_mask", "eod_pad_length"),
    **_all(T.R_TOKENS, "eod", "pad"),
    **_all(T.R_DATA, "num_dataset_builder_threads", "mmap_bin_files", "path_to_cache"),
}
DATA_LOADER_SPEC: Spec = {
    "type": Fact("loader_type"),
    "dataset_dir": Fact("dataset_dir"),
    "sizes": Fact("sizes"),
    "shuffle": Ignore("training samples are always shuffled, seeded by train.seed"),
    "datasets_type": Only(
        ("GPTDataset",), "GPT samples: packed token sequences, as llmtrain reads", "only GPTDataset"
    ),
    "config": lambda ctx, name, value: walk(ctx, name, value, MEGATRON_SPEC),
}


DATASET_SPEC: Spec = {
    "data_loader": lambda ctx, name, value: walk(ctx, name, value, DATA_LOADER_SPEC),
    "drop_remainder": Ignore("every step takes a whole global batch"),
    "batch_size": Ignore("MindFormers replaces it by runner_config.batch_size"),
    "repeat": Only((1, None), "1: each epoch is one pass", "epochs are runner_config.epochs"),
    **_all("the data order follows train.seed", "seed"),
    **_all(
        T.R_DATA,
        "input_columns",
        "construct_args_key",
        "output_columns",
        "num_parallel_workers",
        "python_multiprocessing",
        "numa_enable",
        "prefetch_size",
    ),
}
EVAL_SPEC: Spec = {
    "do_eval": Fact("do_eval"),
    "eval_step_interval": Fact("eval_steps", "int"),
    **_all(T.R_EVAL, "eval_epoch_interval", "eval_dataset", "eval_dataset_task", "eval_callbacks", "metric"),
}
TOP_IGNORED: Spec = {
    "load_checkpoint": Only(
        ("", None),
        "empty: the run starts from initialised weights",
        "MindSpore checkpoints cannot be loaded: convert "
        "them to a Hugging Face directory and set model.init_from: hf:DIR",
    ),
    "only_save_strategy": Only((False,), T.R_CKPT, "llmtrain has no strategy-only run"),
    **_all(
        T.R_CKPT,
        "load_ckpt_format",
        "src_strategy_path_or_dir",
        "auto_trans_ckpt",
        "transform_process_num",
        "remove_redundancy",
        "load_ckpt_async",
    ),
    "processor": Ignore("tokenization is offline (`llmtrain prepare`); the dataset's tokenizer is used"),
    "auto_tune": Only((False,), "off", "MindSpore auto-tune has no counterpart"),
    **_all("used only with auto_tune", "filepath_prefix", "autotune_per_step"),
    "layer_scale": Only((False,), "off: one LR for every layer", "layer-wise LR decay is not implemented"),
    "layer_decay": Ignore("used only with layer_scale"),
    "lr_scale": Only(
        (False,),
        "off: the LR as written",
        "LR scaling by batch size is not implemented; scale lr_schedule.learning_rate",
    ),
    "lr_scale_factor": Ignore("used only with lr_scale"),
    "grouped_lr_schedule": Only((None,), "empty", "per-parameter-group LR schedules are not implemented"),
    "remote_save_url": Ignore(T.R_PLATFORM),
    "pretrained_model_dir": Ignore(
        "MindFormers reads a Hugging Face config / tokenizer there; llmtrain takes the "
        "architecture from model_config and the tokenizer from the dataset"
    ),
    "use_legacy": Ignore(T.R_LEGACY),
    "print_separate_loss": Ignore("llmtrain logs the MoE balance loss in its own metrics column"),
    "train_precision_sync": Ignore(T.R_GRAPH),
    "monitor_config": Ignore(T.R_PROFILE),
    "profile": Only(
        (False,), T.R_PROFILE, "use logging.profile_every / logging.profile_steps (torch.profiler)"
    ),
    **_all(
        T.R_PROFILE,
        "profile_start_step",
        "profile_stop_step",
        "init_start_profile",
        "profile_communication",
        "profile_memory",
        "profiler_level",
        "profile_rank_ids",
        "profile_pipeline",
        "profile_output",
    ),
}
_CKPT_MONITOR: Spec = {
    "save_checkpoint_steps": To("checkpoint.save_steps", expect="int"),
    "keep_checkpoint_max": To("checkpoint.keep_checkpoint_max", expect="int"),
    "async_save": To("checkpoint.async_save"),
    "directory": To("checkpoint.save_dir"),
    "save_checkpoint_seconds": To("checkpoint.save_minutes", lambda s: float(s) / 60, "num+"),
    **_all(
        T.R_CKPT,
        "prefix",
        "integrated_save",
        "checkpoint_format",
        "save_network_params",
        "save_trainable_params",
        "remove_redundancy",
        "keep_checkpoint_per_n_minutes",
        "embedding_local_norm_threshold",
    ),
}
_LOSS_MONITOR: Spec = {
    "per_print_times": To("train.log_steps", expect="int1"),
    "check_for_nan_in_loss_and_grad": Ignore(
        "non-finite steps are handled by the stability guard (stability.*)"
    ),
    **_all(
        "taken from the run itself",
        "learning_rate",
        "micro_batch_num",
        "micro_batch_interleave_num",
        "origin_epochs",
        "dataset_size",
        "initial_epoch",
        "initial_step",
        "global_batch_size",
        "gradient_accumulation_steps",
        "calculate_per_token_loss",
    ),
}
_BIAS = "the trainer moves the expert bias itself (model.moe.bias_update_rate, from moe_config)"
CALLBACKS: dict[str, tuple[Spec, str]] = {  # lower-case type -> (spec of its keys, what the callback becomes)
    "mflossmonitor": (_LOSS_MONITOR, "metrics.jsonl / console lines every train.log_steps"),
    "checkpointmonitor": (_CKPT_MONITOR, "checkpoint.* (torch DCP checkpoints)"),
    "obsmonitor": ({}, "ignored: " + T.R_PLATFORM),
    "summarymonitor": (
        {"summary_dir": Ignore("TensorBoard files go to <run.output_dir>/tensorboard")},
        "logging.tensorboard",
    ),
    "profilemonitor": (
        _all(T.R_PROFILE, "start_step", "stop_step", "output_path", "profile_memory"),
        "ignored: " + T.R_PROFILE,
    ),
    "trainingstatemonitor": (
        {},
        "ignored: llmtrain's metrics.jsonl records loss, grad norm, LR and throughput",
    ),
    "trainfaulttolerance": (  # MindSpore's MindIO TFT callback; the switch is $MS_ENABLE_TFT (fault.py)
        {"ckpt_save_path": Ignore(CALLBACK_KEY_NOTE)},
        CALLBACK_NOTE,
    ),
    "topkbiasbalancecallback": (
        _all(
            _BIAS,
            "balance_via_topk_bias",
            "topk_bias_update_rate",
            "num_layers",
            "mtp_depth",
            "expert_num",
            "micro_batch_num",
        ),
        "ignored: " + _BIAS,
    ),  # fmt: skip
}


def map_callbacks(ctx: Ctx, name: str, value: Any) -> None:
    """``callbacks: [{type: MFLossMonitor, ...}, ...]``: each callback's keys by its own spec."""
    if not isinstance(value, list):
        raise ctx.error(name, f"expected a list of {{type: ...}} mappings, got {value!r}.")
    for i, item in enumerate(value):
        kind = item.get("type") if isinstance(item, dict) else None
        entry = CALLBACKS.get(str(kind).lower())
        if entry is None:
            raise ctx.error(
                f"{name}[{i}].type",
                f"{kind!r} is not a known callback; known: "
                f"{', '.join(sorted(CALLBACKS))} (case-insensitive).",
            )
        spec, becomes = entry
        walk(ctx, f"{name}[{i}]", {k: v for k, v in item.items() if k != "type"}, spec)
        ctx.notes.add(f"{name}[{i}] {kind} -> {becomes}.")
        if str(kind).lower() == "summarymonitor":
            ctx.put("logging.tensorboard", True)


def finish_recompute(ctx: Ctx) -> None:
    """recompute_config -> recompute.mode / every (needs the layer count and the pipeline degree)."""
    value, select = ctx.facts.get("recompute", False), ctx.facts.get("select_recompute", False)
    layers, pp = int(ctx.out["model"].get("num_layers", 1)), int(ctx.out["parallel"]["pipeline_parallel"])
    if isinstance(value, bool):
        done, total = (layers if value else 0), layers
    elif isinstance(value, int):
        done, total = min(value, layers // pp) * pp, layers
    elif isinstance(value, list):
        flat = [x for row in value for x in (row if isinstance(row, list) else [row])]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in flat):
            raise ctx.error(
                "recompute_config.recompute", f"{value!r}: expected true/false, a count or per-stage counts."
            )
        done, total = sum(flat), layers
    else:
        raise ctx.error(
            "recompute_config.recompute", f"{value!r}: expected true/false, a count or per-stage counts."
        )
    if done >= total:
        mode, every = "full", 2
    elif done <= 0:
        mode, every = "none", 2
    else:
        mode, every = "selective", max(round(total / done), 2)
        mode = "full" if total / done < 1.5 else mode
    ctx.put("recompute.mode", mode)
    if mode == "selective":
        ctx.put("recompute.every", every)
    ctx.notes.add(
        f"recompute_config.recompute {value!r} ({done} of {total} layers) -> recompute.mode {mode}"
        + (f", every {every} (the nearest whole-block ratio)." if mode == "selective" else ".")
    )
    if select not in (False, None, [], {}):
        ctx.notes.add(
            f"recompute_config.select_recompute {select!r} not mapped: llmtrain recomputes whole blocks "
            f"(recompute.mode {mode}); MindSpore's per-operator recompute has no counterpart."
        )
    elif "select_recompute" in ctx.facts:
        ctx.notes.ignore("recompute_config.select_recompute", "off")


def finish_data(ctx: Ctx) -> None:
    """The dataset, grad clipping and validation keys, which need several keys at once."""
    f = ctx.facts
    if "use_clip_grad" in f or "max_grad_norm" in f:
        norm = float(f.get("max_grad_norm", 1.0)) if f.get("use_clip_grad", True) else None
        ctx.put("train.grad_clip_norm", norm)
        ctx.notes.add(
            f"runner_wrapper.use_clip_grad {f.get('use_clip_grad')!r} -> train.grad_clip_norm {norm} "
            "(max_grad_norm, MindFormers' default 1.0)."
        )
    if f.get("eval_steps") is not None:
        if f.get("do_eval"):
            ctx.put("train.eval_steps", f["eval_steps"])
            ctx.notes.renamed("eval_step_interval", "train.eval_steps")
        else:
            ctx.notes.ignore("eval_step_interval", "do_eval is false")
    if "do_eval" in f and not f["do_eval"]:
        ctx.notes.ignore("do_eval", T.R_EVAL)
    kind = f.get("loader_type")
    if kind is not None:
        if str(kind) not in ("MindDataset", "BlendedMegatronDatasetDataLoader"):
            raise ctx.error(
                "train_dataset.data_loader.type",
                f"{kind!r} is not supported: pretraining data is "
                "MindDataset (MindRecord, converted by `llmtrain prepare`) or BlendedMegatronDatasetDataLoader.",
            )
        ctx.notes.ignore(
            "train_dataset.data_loader.type", "the data is read as token files named in data.datasets"
        )
    if "dataset_dir" in f:
        if f["dataset_dir"]:
            ctx.put("data.datasets", [{"path": f["dataset_dir"], "weight": 1.0}])
            ctx.notes.add(
                f"train_dataset.data_loader.dataset_dir {f['dataset_dir']!r} -> data.datasets, read as a token "
                "dataset prefix: convert MindRecord files once with `llmtrain prepare --input FILE "
                "--output PREFIX` and point data.datasets at PREFIX."
            )
        else:
            ctx.notes.add("train_dataset.data_loader.dataset_dir is empty: set data.datasets.")
    if "data_path" in f:
        items = f["data_path"]
        if isinstance(items, list) and len(items) == 1:  # one prefix, no weight (Megatron's shorthand)
            items = [1.0, items[0]]
        if not isinstance(items, list) or len(items) % 2:
            raise ctx.error(f["data_path@"], f"{items!r}: expected [weight, prefix, weight, prefix, ...].")
        specs = [{"path": str(items[i + 1]), "weight": float(items[i])} for i in range(0, len(items), 2)]
        ctx.put("data.datasets", specs)
        ctx.notes.add(
            f"{f['data_path@']} -> data.datasets {specs} (Megatron .bin/.idx prefixes; without an llmtrain "
            "manifest set data.tokenizer)."
        )
    if "reset_mask" in f or "reset_pos" in f:
        mask, pos = bool(f.get("reset_mask", False)), bool(f.get("reset_pos", False))
        if mask != pos:
            raise ctx.error(
                "train_dataset.data_loader.config",
                f"reset_attention_mask {mask} with reset_position_ids "
                f"{pos}: llmtrain resets both at document ends or neither (model.document_mask).",
            )
        ctx.put("model.document_mask", mask)
        ctx.notes.add(
            f"reset_attention_mask / reset_position_ids {mask} -> model.document_mask {str(mask).lower()}."
        )
    seq = f.get("data_seq")
    if seq is not None and seq != ctx.out["model"].get("seq_length"):
        raise ctx.error(
            f["data_seq@"],
            f"{seq} differs from model_config.seq_length {ctx.out['model'].get('seq_length')}.",
        )

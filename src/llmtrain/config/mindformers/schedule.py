"""Optimizer, LR schedule and run length of a MindFormers run file, as MindFormers computes them.

* ``optimizer.type`` (AdamW, FP32StateAdamWeightDecay, AdamWeightDecay, FusedAdamWeightDecay...) ->
  ``train.optimizer: adamw``; betas, eps and weight decay as written, else the type's MindFormers defaults
  (``tables.OPTIMIZERS``).
* ``lr_schedule.type`` -> ``train.decay_style`` (``tables.LR_SCHEDULES``), ``learning_rate`` -> ``train.lr``,
  ``lr_end`` -> ``train.min_lr`` (the type's default when absent).
* The run length: MindFormers trains ``epochs x`` the dataset's steps (``trainer/utils.check_runner_config``)
  and ``lr_schedule.total_steps: -1`` (or absent) makes the schedule span exactly that
  (``base_trainer.create_lr_scheduler``). When the data loader states its sample count
  (``BlendedMegatronDatasetDataLoader`` ``sizes[0]``) the steps are ``epochs x (sizes[0] // global batch)`` ->
  ``train.max_steps``. A ``MindDataset`` (MindRecord) has no size in the file: :func:`finish` then asks for
  ``train.max_steps`` (a ConfigError naming it), after the command-line overrides so that
  ``train.max_steps=N`` on the command line answers it. ``train.epochs`` keeps the epoch count as a cap on
  llmtrain's own data.
* ``warmup_ratio`` (which MindFormers prefers over ``warmup_steps``) -> ``train.warmup_steps = int(total x
  ratio)``; a given ``total_steps`` N -> ``train.decay_steps = N - warmup``; ``WarmUpStableDecayLR``'s
  ``decay_start_steps`` / ``decay_start_ratio`` -> ``train.wsd_decay_fraction``. These are computed in
  :func:`finish`, after the overrides, from the run's final ``train.max_steps``.
"""

from __future__ import annotations

from llmtrain.config.mindformers import tables as T
from llmtrain.config.mindformers.common import Ctx, fact_int, int_value, lookup
from llmtrain.errors import ConfigError

PENDING = "_mindformers_pending"  # key of the native dict that carries work for finish()


def finish(native: dict, source: str) -> list[str]:
    """After the command-line overrides: the run length and the warmup / decay steps that depend on it."""
    pending = native.pop(PENDING, None)
    if pending is None:
        return []
    train = native.setdefault("train", {})
    notes = []
    if "max_steps" not in train:
        raise ConfigError(
            f"{source}: {pending['why']} The run length is therefore not known from the config: give it as "
            "train.max_steps (e.g. the override train.max_steps=10000); warmup_ratio and the schedule then "
            "apply to it."
        )
    total = pending["total"] if pending["total"] is not None else train["max_steps"]
    ratio = pending["warmup_ratio"]
    if ratio is not None and "warmup_steps" not in train:
        if isinstance(total, str) or not isinstance(total, int):
            raise ConfigError(
                f"{source}: train.max_steps {total!r} must be an integer for lr_schedule.warmup_ratio."
            )
        train["warmup_steps"] = int(total * ratio)
        notes.append(
            f"lr_schedule.warmup_ratio {ratio} x {total} steps -> train.warmup_steps {train['warmup_steps']}."
        )
    if pending["total"] is not None and "decay_steps" not in train:
        train["decay_steps"] = max(pending["total"] - int(train.get("warmup_steps", 0)), 1)
        notes.append(
            f"lr_schedule.total_steps {pending['total']} -> train.decay_steps {train['decay_steps']} (total - warmup)."
        )
    start = pending.get("wsd_start_steps")
    if pending.get("wsd_start_ratio") is not None:
        start = int(total * pending["wsd_start_ratio"])
    if start is not None and "wsd_decay_fraction" not in train:
        warm = int(train.get("warmup_steps", 0))
        train["wsd_decay_fraction"] = max(total - start, 1) / max(total - warm, 1)
        notes.append(
            f"WarmUpStableDecayLR decays from step {start} -> train.wsd_decay_fraction "
            f"{train['wsd_decay_fraction']:.4g}."
        )
    return notes


def run_length(ctx: Ctx) -> None:
    """Optimizer, LR schedule and the run length (what finish() needs is left under PENDING)."""
    _optimizer(ctx)
    f = ctx.facts
    kind = str(f.get("lr_type", "ConstantWarmUpLR"))
    style, default_end = T.LR_SCHEDULES[
        lookup({k: k for k in T.LR_SCHEDULES}, kind, "lr_schedule.type", ctx.source)
    ]
    lr = f.get("lr", f.get("opt_lr"))
    if lr is not None:
        ctx.put("train.lr", lr)
    if "lr" in f and "opt_lr" in f:
        ctx.notes.ignore(
            "optimizer.learning_rate", "the lr_schedule's learning_rate is the one MindFormers uses"
        )
    end = f.get("lr_end", default_end)
    ctx.put("train.decay_style", style)
    ctx.put("train.min_lr", float(end) if end is not None else 0.0)
    ctx.notes.add(
        f"lr_schedule ({ctx.written('lr_type', 'lr', 'lr_end', 'warmup_steps', 'warmup_ratio', 'total_steps', 't_max')})"
        f" -> train.decay_style {style}, train.lr {lr}, train.min_lr {end or 0.0}; the warmup and run length below."
    )
    for key in ("decay_steps", "decay_ratio"):
        if f.get(key) is not None:
            raise ctx.error(
                f"lr_schedule.{key}", "holding lr_end from a step before total_steps is not supported."
            )
    total = f.get("total_steps", f.get("t_max"))
    total = None if total in (None, -1) else int_value(ctx, "lr_schedule.total_steps", total, 1)
    ratio = f.get("warmup_ratio")
    if ratio is None:
        ctx.put("train.warmup_steps", fact_int(ctx, "warmup_steps", 0, 0))
    elif "warmup_steps" in f:
        ctx.notes.ignore("lr_schedule.warmup_steps", "warmup_ratio takes precedence in MindFormers")
    epochs = fact_int(ctx, "epochs", 1)
    ctx.put("train.epochs", epochs)
    ctx.notes.add(
        f"runner_config.epochs {epochs} -> train.epochs {epochs} (also caps the run at {epochs} passes "
        "over llmtrain's own data)."
    )
    sizes: list = f["sizes"] if isinstance(f.get("sizes"), list) else []
    samples = int(sizes[0]) if sizes else 0
    if len(sizes) > 1:
        ctx.notes.ignore("train_dataset.data_loader.sizes[1:]", T.R_EVAL)
    why = ""
    if samples > 0:
        steps = max(epochs * (samples // f["global_batch"]), 1)
        ctx.put("train.max_steps", steps)
        ctx.notes.add(
            f"run length: runner_config.epochs {epochs} x (sizes[0] {samples} samples // global batch "
            f"{f['global_batch']}) -> train.max_steps {steps}"
            + (" (lr_schedule.total_steps -1: the schedule spans it)." if total is None else ".")
        )
    else:
        why = (
            f"lr_schedule.total_steps {f.get('total_steps', 'absent')} and runner_config.epochs {epochs} make "
            "MindFormers train for epochs x the dataset's steps, but the dataset's size is not in the file "
            "(a MindDataset reads it from the MindRecord files)."
        )
    ctx.out[PENDING] = {
        "why": why, "total": total, "warmup_ratio": ratio,
        "wsd_start_steps": f.get("decay_start_steps"), "wsd_start_ratio": f.get("decay_start_ratio"),
    }  # fmt: skip


def _optimizer(ctx: Ctx) -> None:
    f = ctx.facts
    kind = str(f.get("opt_type", "AdamW"))
    defaults = T.OPTIMIZERS[lookup({k: k for k in T.OPTIMIZERS}, kind, "optimizer.type", ctx.source)]
    ctx.put("train.optimizer", "adamw")
    betas = f.get("betas")
    if betas is not None:
        if not (isinstance(betas, list) and len(betas) == 2):
            raise ctx.error("optimizer.betas", f"{betas!r}: expected [beta1, beta2].")
        for name, value in zip(("beta1", "beta2"), betas):
            if name in f and f[name] != value:
                raise ctx.error(f"optimizer.{name}", f"{f[name]!r} contradicts optimizer.betas {betas!r}.")
            f[name] = value
    chosen = {k: f.get(k, d) for k, d in defaults.items()}
    for k, v in chosen.items():
        ctx.put(f"train.{k}", v)
    shown = ", ".join(f"{k} {v}{'' if k in f else ' (MindFormers default)'}" for k, v in chosen.items())
    written = ctx.written("opt_type", "betas", "beta1", "beta2", "eps", "weight_decay")
    ctx.notes.add(f"optimizer ({written}) -> train.optimizer adamw (fp32 states), {shown}.")

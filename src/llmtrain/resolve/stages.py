"""Multi-stage runs: the ``stages:`` list resolved into a plan of step ranges, LR targets, mixtures and configs.

A stage is a phase of one run (the seed's general -> reasoning -> annealing). :func:`resolve_stages` turns the
config into :class:`StagePlan` records, one per stage, before anything is built, so ``llmtrain check`` prints the
same table the trainer follows and every mistake is a ConfigError at load time, not at a boundary::

    stage k covers optimizer steps (start_step, end_step]      (1-based steps, end inclusive)
    its config      = the base config + stage k's overrides (only keys in MUTABLE may change mid-run)
    its mixture     = weights over the union of all stages' dataset paths (0 = not read in this stage)
    its LR          = from the previous stage's end LR (stage 0: the peak train.lr after warmup) to
                      lr_end x peak at end_step, with the stage's shape (constant, linear, cosine, wsd)

Lengths: ``steps``; ``tokens`` -> ceil(tokens / tokens per step of this stage); ``fraction`` -> that share of
the run's token budget (``train.max_steps`` x the base config's tokens per step), rounded to whole steps. The
run's ``train.max_steps`` becomes the sum of the stage lengths. Without ``stages`` the run is one stage named
``main`` over ``data.datasets`` with the ``train`` LR schedule (:func:`single_stage_name`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from llmtrain.config.schema import Config
from llmtrain.errors import ConfigError

SHAPES = ("constant", "linear", "cosine", "wsd")

# Settings that may differ between stages: they change what is read or how a step is taken, not the model's
# parameters, their sharding or the optimizer's state layout. Anything else is refused at config load.
MUTABLE = (
    "model.seq_length",
    "train.batch_size",
    "train.micro_batch_size",
    "train.gradient_accumulation_steps",
    "train.grad_clip_norm",
    "train.label_smoothing",
    "train.log_steps",
    "train.eval_steps",
    "data.eod_mask_loss",
    "recompute.mode",
    "recompute.every",
    "eval.eval_iters",
    "eval.tasks",
    "eval.downstream_steps",
    "eval.limit",
    "eval.num_fewshot",
    "eval.batch_size",
    "stability.*",
)

SINGLE_STAGE = "main"


@dataclass
class StagePlan:
    """One resolved stage."""

    index: int
    name: str
    cfg: Config
    """The base config with this stage's overrides (and data.datasets = the stage's mixture)."""
    start_step: int
    end_step: int
    lr_start: float
    lr_end: float
    shape: str
    weights: list[float]
    """Mixture weights over the run's dataset paths (see :func:`resolve_stages`), normalised."""
    tokens_per_step: int

    @property
    def steps(self) -> int:
        return self.end_step - self.start_step

    @property
    def global_batch(self) -> int:
        return self.cfg.train.batch_size


def is_mutable(key: str) -> bool:
    return key in MUTABLE or any(m.endswith(".*") and key.startswith(m[:-1]) for m in MUTABLE)


def stage_config(base: Config, overrides: dict, where: str) -> Config:
    """``base`` with ``overrides`` ({dotted.key: value}) applied; ConfigError for keys that cannot change."""
    from llmtrain.config.loader import apply_overrides, config_from_dict, config_to_dict

    if not isinstance(overrides, dict):
        raise ConfigError(f"{where}: expected a mapping of dotted keys to values, got {overrides!r}.")
    for key in overrides:
        if not is_mutable(str(key)):
            raise ConfigError(
                f"{where}: '{key}' cannot change between stages (it changes the model, its parallel layout, "
                f"precision or the optimizer; stop the run and start a new one with init_from for that). "
                f"Settings a stage may override: {', '.join(MUTABLE)}."
            )
    raw = config_to_dict(base)
    raw.pop("stages", None)
    items = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    return config_from_dict(apply_overrides(raw, items), source=where)


def dataset_paths(cfg: Config) -> list[str]:
    """The run's dataset paths: data.datasets first, then those only some stages name, in order of mention."""
    paths = [d.path for d in cfg.data.datasets]
    for stage in cfg.stages:
        for d in stage.datasets:
            if d.path not in paths:
                paths.append(d.path)
    return paths


def resolve_stages(cfg: Config) -> tuple[list[str], list[StagePlan]]:
    """(dataset paths, stage plans) of ``cfg``; ConfigError naming the stage and key for every mistake."""
    if not cfg.stages:
        raise ConfigError("resolve_stages needs a config with stages: (single-stage runs have no plan).")
    if not cfg.data.datasets:  # validation and the tokenizer then come from the first stage's mixture
        cfg.data.datasets = list(cfg.stages[0].datasets)
    paths = dataset_paths(cfg)
    peak, warmup = cfg.train.lr, cfg.train.warmup_steps
    base_tokens = cfg.train.batch_size * cfg.model.seq_length
    budget = cfg.train.max_steps * base_tokens
    names: set[str] = set()
    plans: list[StagePlan] = []
    step, lr = 0, peak
    for i, st in enumerate(cfg.stages):
        where = f"stages[{i}]"
        if not st.name or st.name in names:
            raise ConfigError(f"{where}.name = {st.name!r}: every stage needs a unique, non-empty name.")
        names.add(st.name)
        scfg = stage_config(cfg, st.overrides, f"{where}.overrides")
        if st.datasets:
            scfg.data.datasets = list(st.datasets)
        weights = [0.0] * len(paths)
        for j, d in enumerate(scfg.data.datasets):
            if not d.weight >= 0:
                raise ConfigError(f"{where}.datasets[{j}].weight = {d.weight}: weights must be >= 0.")
            weights[paths.index(d.path)] += float(d.weight)
        if not sum(weights) > 0:
            raise ConfigError(f"{where}.datasets: the weights must have a positive sum.")
        weights = [w / sum(weights) for w in weights]
        tps = scfg.train.batch_size * scfg.model.seq_length
        given = [k for k in ("steps", "tokens", "fraction") if getattr(st, k) is not None]
        if len(given) != 1:
            raise ConfigError(
                f"{where} ({st.name}): give exactly one length, steps, tokens or fraction (got "
                f"{', '.join(given) or 'none'})."
            )
        if st.steps is not None:
            steps = st.steps
        elif st.tokens is not None:
            steps = math.ceil(st.tokens / tps)
        else:
            assert st.fraction is not None  # exactly one of the three is given (checked above)
            if not 0 < st.fraction <= 1:
                raise ConfigError(f"{where}.fraction = {st.fraction}: expected a share in (0, 1].")
            steps = round(st.fraction * budget / tps)
        if steps < 1:
            raise ConfigError(f"{where} ({st.name}): the stage is {steps} steps long; it needs at least 1.")
        last = i == len(cfg.stages) - 1
        shape = st.lr_schedule or cfg.train.decay_style
        if shape not in SHAPES:
            raise ConfigError(f"{where}.lr_schedule = {shape!r}: valid shapes are {', '.join(SHAPES)}.")
        if st.lr_end is not None:
            if not st.lr_end >= 0:
                raise ConfigError(f"{where}.lr_end = {st.lr_end}: a fraction of the peak LR, >= 0.")
            lr_end = st.lr_end * peak
        else:
            lr_end = cfg.train.min_lr if last and shape != "constant" else lr
        if i == 0 and warmup >= steps:
            raise ConfigError(
                f"train.warmup_steps {warmup} does not fit in the first stage ({st.name}, {steps} steps)."
            )
        plans.append(StagePlan(i, st.name, scfg, step, step + steps, lr, lr_end, shape, weights, tps))
        step, lr = step + steps, lr_end
    for p in plans:
        p.cfg.train.max_steps = step
    return paths, plans


class StagedLR:
    """The LR of 1-based step ``s`` in a staged run: warmup, then each stage's shape from its start to its end."""

    def __init__(self, plans: list[StagePlan], warmup_steps: int, peak: float, wsd_fraction: float):
        self.plans, self.warmup, self.peak, self.wsd_fraction = plans, warmup_steps, peak, wsd_fraction

    def __call__(self, step: int) -> float:
        from llmtrain.train.schedule import decay_factor

        if self.warmup > 0 and step <= self.warmup:
            return self.peak * step / self.warmup
        plan = stage_at(self.plans, step)
        if plan.shape == "constant":
            return plan.lr_end
        begin = max(plan.start_step, self.warmup) if plan.index == 0 else plan.start_step
        p = min(max((step - begin) / max(plan.end_step - begin, 1), 0.0), 1.0)
        return plan.lr_end + (plan.lr_start - plan.lr_end) * decay_factor(plan.shape, p, self.wsd_fraction)


def stage_at(plans: list[StagePlan], step: int) -> StagePlan:
    """The stage that optimizer step ``step`` (1-based) belongs to; steps past the end belong to the last."""
    for plan in plans:
        if step <= plan.end_step:
            return plan
    return plans[-1]


def stage_table(paths: list[str], plans: list[StagePlan]) -> list[list[str]]:
    """Rows for ``llmtrain check`` from :func:`resolve_stages`: stage, steps, tokens, LR range, mixture."""
    rows = []
    for p in plans:
        mix = ", ".join(f"{paths[j]} {w:.0%}" for j, w in enumerate(p.weights) if w > 0)
        rows.append(
            [
                p.name,
                f"{p.start_step + 1}-{p.end_step} ({p.steps})",
                f"{p.steps * p.tokens_per_step:,}",
                f"{p.lr_start:.3g} -> {p.lr_end:.3g} {p.shape}",
                mix,
            ]
        )
    return rows

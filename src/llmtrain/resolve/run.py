"""The resolve step: a config as written -> what it means on a world of processes, as one frozen record.

:func:`resolve_run` computes the derived figures (batch arithmetic, model size, FLOPs: ``resolve.derived``), the
stage plan (``resolve.stages``) and the run's real length: the stages' total, or ``train.epochs`` as a cap on
``train.max_steps`` (which needs the number of training samples, so the data is read first). The config as
written is not changed: :class:`ResolvedRun` holds a copy whose ``train.max_steps`` is that length (and whose
model section, with ``model.init_from: hf:DIR``, spells out config.json's architecture). That copy is what the
trainer reads and what goes to ``<run_dir>/config.yaml``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmtrain.config.schema import Config
from llmtrain.resolve.derived import Derived, derive
from llmtrain.resolve.stages import StagePlan, resolve_stages


@dataclass(frozen=True)
class ResolvedRun:
    """What the config means on this world: the config to train with (a copy; ``train.max_steps`` is the run's
    real length), its derived figures, the stage plan (None: one stage) and the notes of what was resolved."""

    cfg: Config
    derived: Derived
    stages: tuple[list[str], list[StagePlan]] | None
    notes: tuple[str, ...]

    @property
    def max_steps(self) -> int:
        return self.cfg.train.max_steps


def resolve_run(cfg: Config, world_size: int, vocab_size: int, train_samples: int) -> ResolvedRun:
    """The run's length from its stages (their total) or ``train.epochs`` (a cap on ``train.max_steps``); the
    stage plan is resolved from the config as written (a fraction is of its ``train.max_steps``)."""
    stages = resolve_stages(cfg) if cfg.stages else None
    derived = derive(cfg, world_size=world_size, vocab_size=vocab_size)
    notes, max_steps = [], cfg.train.max_steps
    if stages is not None:  # the stage plan fixes the run's length
        max_steps = stages[1][-1].end_step
        if max_steps != cfg.train.max_steps:
            notes.append(f"stages: {max_steps} steps in all (train.max_steps was {cfg.train.max_steps}).")
    elif cfg.train.epochs:  # the seed's epoch count caps the run (max_steps still applies)
        epoch_steps = max(cfg.train.epochs * train_samples // derived.global_batch, 1)
        if epoch_steps < cfg.train.max_steps:
            notes.append(
                f"train.epochs {cfg.train.epochs} caps the run at {epoch_steps} steps "
                f"(train.max_steps was {cfg.train.max_steps})."
            )
            max_steps = epoch_steps
    from llmtrain.models.hf_resolve import model_config_of  # lazy: the model package imports torch

    # model.init_from: hf:DIR -> the model section written out with config.json's architecture
    resolved = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, max_steps=max_steps), model=model_config_of(cfg.model)
    )
    return ResolvedRun(resolved, derived, stages, tuple(notes))

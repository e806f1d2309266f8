"""The trainer's side of a multi-stage run: the active stage, its batches, and tokens per dataset.

:func:`llmtrain.resolve.stages.resolve_stages` fixed every stage's step range, config and mixture before the
run. Here each stage reads from its own :class:`~llmtrain.data.samples.BlendedSamples` over the run's dataset
paths (weights 0 for the datasets it does not read), built for the stage's ``model.seq_length``. A source's
sample stream continues across stages: a stage's blend starts each source at the samples the earlier stages
drew from it (``offsets``), so no sample is repeated or skipped at a boundary. When a stage changes the
sequence length, the windows are new; each source then continues at the same share of its pass (tokens
drawn / new window length, rounded up), not at the same documents.

Everything is a function of the stage plan, so the state is small: the active stage's index, its iterator's
state (samples consumed within the stage) and the tokens drawn from each dataset by the completed stages.
Resuming rebuilds the earlier stages' blends to recompute the offsets (deterministic, no data is read).
"""

from __future__ import annotations

import copy
import math
from typing import cast

from torch import nn

from llmtrain.config.schema import Config
from llmtrain.data.loader import BatchIterator, open_source
from llmtrain.data.samples import BlendedSamples, TokenWindows
from llmtrain.resolve.stages import StagePlan


class Curriculum:
    """Stages of ``cfg.stages`` (``stages``: what :func:`resolve_stages` returned for it) for the data-parallel
    rank ``dp_rank`` of ``dp_size``."""

    def __init__(
        self, cfg: Config, stages: tuple[list[str], list[StagePlan]], dp_rank: int = 0, dp_size: int = 1
    ):
        self.paths, self.plans = stages
        self.seed, self.valid_fraction = int(cfg.train.seed), float(cfg.data.valid_fraction)
        self.tokenizer, self.vocab_size = cfg.data.tokenizer, cfg.model.vocab_size  # for Megatron datasets
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._sources: dict[int, list[TokenWindows]] = {}  # seq_length -> one source per path
        self._blends: dict[int, BlendedSamples] = {}
        self.before: dict[str, int] = dict.fromkeys(self.paths, 0)  # tokens drawn by completed stages
        self.index = 0
        self.batches = self._iterator(0)

    @property
    def plan(self) -> StagePlan:
        return self.plans[self.index]

    def sources(self, seq_length: int) -> list[TokenWindows]:
        if seq_length not in self._sources:
            self._sources[seq_length] = [
                open_source(
                    p,
                    f"dataset '{p}' of stages",
                    seq_length,
                    self.seed,
                    self.valid_fraction,
                    self.tokenizer,
                    self.vocab_size,
                )[0]
                for p in self.paths
            ]
        return self._sources[seq_length]

    def blend(self, k: int) -> BlendedSamples:
        """Stage k's sample order, continuing each source where stages < k left it."""
        if k not in self._blends:
            plan = self.plans[k]
            seq = plan.cfg.model.seq_length
            offsets = [0] * len(self.paths)
            if k > 0:
                prev = self.plans[k - 1]
                counts = self.blend(k - 1).source_counts(prev.steps * prev.global_batch)
                ratio = prev.cfg.model.seq_length / seq
                offsets = [c if ratio == 1 else math.ceil(c * ratio) for c in counts]
            meta = {
                "valid_fraction": self.valid_fraction,
                "seq_length": seq,
                "split": "train",
                "stage": plan.name,
            }
            blend = BlendedSamples(self.sources(seq), plan.weights, self.seed, meta, offsets=offsets)
            blend.eod_mask_loss = bool(plan.cfg.data.eod_mask_loss)
            self._blends[k] = blend
        return self._blends[k]

    def _iterator(self, k: int) -> BatchIterator:
        plan = self.plans[k]
        return BatchIterator(
            self.blend(k), plan.global_batch, plan.cfg.train.micro_batch_size, self.dp_rank, self.dp_size
        )

    def advance(self) -> StagePlan:
        """Close the active stage and start the next one (its iterator at its first sample)."""
        for path, n in self.batches.consumed_tokens.items():
            self.before[path] += n
        self.index += 1
        self.batches = self._iterator(self.index)
        return self.plan

    def consumed_tokens(self) -> dict[str, int]:
        """Tokens drawn from each dataset path by all ranks since the run began."""
        return {p: self.before[p] + self.batches.consumed_tokens.get(p, 0) for p in self.paths}

    def stage_tokens(self) -> dict[str, int]:
        """Tokens drawn from each dataset path in the active stage so far."""
        return dict(self.batches.consumed_tokens)

    def state_dict(self) -> dict:
        return {"stage": self.index, "iterator": self.batches.state_dict(), "before": dict(self.before)}

    def load_state_dict(self, sd: dict) -> None:
        self.index = int(sd["stage"])
        self.batches = self._iterator(self.index)
        self.batches.load_state_dict(sd["iterator"])
        self.before = {p: int(sd["before"].get(p, 0)) for p in self.paths}


def _plain(module: nn.Module, *args, **kwargs):
    return module(*args, **kwargs)


def recompute_superset(cfg: Config, stages: tuple[list[str], list[StagePlan]] | None) -> Config:
    """The config to parallelize with: when some stage recomputes, every block gets a checkpoint wrapper once
    (``recompute.mode: full``) and :func:`set_recompute` switches each wrapper on or off per stage."""
    if stages is None:
        return cfg
    settings = {(p.cfg.recompute.mode, p.cfg.recompute.every) for p in stages[1]}
    out = copy.deepcopy(cfg)
    if len(settings) == 1:
        out.recompute.mode, out.recompute.every = settings.pop()
    else:
        out.recompute.mode = "full"
    return out


def set_recompute(model: nn.Module, mode: str, every: int) -> None:
    """Turn the checkpoint wrapper of each block on (per ``mode``: none, selective 1-in-``every``, full) or off."""
    for i, block in enumerate(cast(nn.ModuleDict, model.layers).values()):
        block = getattr(block, "_orig_mod", block)  # under torch.compile
        if not hasattr(block, "checkpoint_fn"):
            continue
        if not hasattr(block, "_llmtrain_checkpoint_fn"):
            block._llmtrain_checkpoint_fn = block.checkpoint_fn
        on = mode == "full" or (mode == "selective" and i % max(every, 1) == 0)
        block.checkpoint_fn = block._llmtrain_checkpoint_fn if on else _plain

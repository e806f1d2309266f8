"""Figures derived from a config: batch arithmetic, model size, FLOPs and token budget.

One function, :func:`derive`, turns ``(Config, world_size)`` into a :class:`Derived` record. It is the single
place where the batch identity is resolved::

    global_batch = micro_batch_size x data_parallel x grad_accum         (sequences per optimizer step)
    tokens_per_step = global_batch x seq_length
    total_tokens    = max_steps x tokens_per_step

``train.batch_size`` is the global batch; ``train.gradient_accumulation_steps`` is derived from it when unset
and must make the identity exact when set. The model is resolved by ``llmtrain.models.resolve_model_args``
(which raises ConfigError for inconsistent architectures), or, with ``model.init_from: hf:DIR``, read from
``DIR/config.json`` (``models.hf_resolve``), so the parameter count and FLOPs are exact for what ``train`` will
build. The vocabulary comes from ``model.vocab_size``, else the tokenizer's (see
:func:`tokenizer_vocab`), else the flavor's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.config.schema import Config, TrainConfig
from llmtrain.distributed.parallel_dims import ParallelDims
from llmtrain.errors import ConfigError

if TYPE_CHECKING:
    from llmtrain.models import TransformerArgs


@dataclass
class Derived:
    """Resolved figures of a run (all batch sizes in sequences)."""

    world_size: int
    data_parallel: int
    grad_accum: int
    global_batch: int
    micro_batch_size: int
    tokens_per_step: int
    num_params: int
    flops_per_token: float
    total_tokens: int
    model_args: TransformerArgs
    dims: ParallelDims | None = None
    """The validated parallel degrees (the mesh is built from these)."""
    active_params: int = 0
    """Parameters a token passes through (MoE: top_k routed experts; equals num_params for dense models).
    flops_per_token is computed from these."""


def derive(cfg: Config, world_size: int = 1, vocab_size: int | None = None) -> Derived:
    """Derived figures of cfg on world_size processes; ConfigError when the numbers do not fit together.

    vocab_size: the tokenizer's vocabulary if already known; None looks it up (data.tokenizer or the first
    dataset's manifest, when present on this machine). model.vocab_size, when set, wins either way.
    """
    from llmtrain.models import resolve_model_args  # lazy: the model package imports torch
    from llmtrain.models.hf_resolve import hf_init_dir, init_from_args

    dims = ParallelDims.from_config(cfg.parallel, world_size)
    grad_accum = resolve_grad_accum(cfg.train, dims.dp)
    if vocab_size is None and cfg.model.vocab_size is None:
        vocab_size, _ = tokenizer_vocab(cfg)
    if hf_init_dir(cfg.model) is not None:  # model.init_from: hf:DIR -> DIR/config.json is the architecture
        args = init_from_args(cfg.model, vocab_size)
    else:
        args = resolve_model_args(cfg.model, vocab_size)
    seq = cfg.model.seq_length
    global_batch = cfg.train.micro_batch_size * dims.dp * grad_accum
    tokens_per_step = global_batch * seq
    return Derived(
        world_size=world_size,
        data_parallel=dims.dp,
        grad_accum=grad_accum,
        global_batch=global_batch,
        micro_batch_size=cfg.train.micro_batch_size,
        tokens_per_step=tokens_per_step,
        num_params=args.num_params(),
        flops_per_token=float(args.flops_per_token(seq)),
        total_tokens=cfg.train.max_steps * tokens_per_step,
        model_args=args,
        dims=dims,
        active_params=args.num_params(active=True),
    )


def resolve_grad_accum(train: TrainConfig, data_parallel: int) -> int:
    """Gradient-accumulation steps that make batch_size = micro_batch_size x data_parallel x steps exact."""
    batch, micro = train.batch_size, train.micro_batch_size
    if batch < 1 or micro < 1:
        key, value = ("train.batch_size", batch) if batch < 1 else ("train.micro_batch_size", micro)
        raise ConfigError(f"{key}: expected an integer >= 1, got {value}.")
    per_pass = micro * data_parallel
    if batch % per_pass:
        lower = max(per_pass, batch // per_pass * per_pass)  # the multiples around batch, two different ones
        upper = lower + per_pass
        raise ConfigError(
            f"train.batch_size {batch} (the global batch) is not divisible by train.micro_batch_size {micro} x "
            f"data-parallel size {data_parallel} = {per_pass}; use a multiple of {per_pass} (e.g. {lower} or "
            f"{upper}), or change micro_batch_size or the parallel degrees."
        )
    accum = train.gradient_accumulation_steps
    if accum is None:
        return batch // per_pass
    if accum < 1:
        raise ConfigError(
            f"train.gradient_accumulation_steps: expected an integer >= 1 or null, got {accum}."
        )
    if per_pass * accum != batch:
        raise ConfigError(
            f"train.batch_size {batch} must equal train.micro_batch_size {micro} x data-parallel size "
            f"{data_parallel} x train.gradient_accumulation_steps {accum} = {per_pass * accum}; set "
            f"gradient_accumulation_steps to {batch // per_pass} or null (derived), or batch_size to "
            f"{per_pass * accum}."
        )
    return accum


def tokenizer_vocab(cfg: Config) -> tuple[int | None, str]:
    """(vocabulary size, where it came from) of the run's tokenizer, or (None, reason) when none is readable.

    Looks at data.tokenizer if the file exists, else the first dataset described on this machine
    (``llmtrain.data.describe``: its manifest).
    """
    from llmtrain.data.describe import tokenizer_facts, try_describe

    if cfg.data.tokenizer and Path(cfg.data.tokenizer).is_file():
        return tokenizer_facts(cfg.data.tokenizer).vocab_size, f"data.tokenizer {cfg.data.tokenizer}"
    for i, spec in enumerate(cfg.data.datasets):
        info = try_describe(spec.path, cfg.data.tokenizer) if spec.path else None
        if info is not None and isinstance(info.vocab_size, int):
            return info.vocab_size, f"the manifest of data.datasets[{i}] {spec.path}"
    return None, "no tokenizer or dataset manifest found on this machine"

"""The valid range of every number in a run config: one table, checked uniformly.

``RANGES`` maps a dotted key (``model.num_layers``; a list's items as ``[]``: ``stages[].steps``,
``parallel.pipeline_layers[]``) to a :class:`Range`. The loader checks each int/float field against it the
moment the value is read (``config.loader._coerce``), so no size reaches an allocation or a loop unbounded, and
``resolve.validate`` checks a whole Config again with :func:`check_config_ranges` (configs built in code, the
configs of stages). ``data.prepare.*`` keys bound `llmtrain prepare --config` (``config.loader.check_section``).
A number field missing from the table gets :data:`DEFAULT_INT` / :data:`DEFAULT_FLOAT`, and
tests/test_hostile_config.py fails naming it: a new number field comes with its range here.

Rules every number follows, whatever its range:

- NaN and infinity are refused for every float (no field documents them as meaning anything), and inside
  free-form values too (``model.rope_scaling``, ``data.prepare``, ``stages[].overrides``...);
- sizes (widths, layers, heads, vocabulary, sequence length, batch, parallel degrees) have an upper bound far
  above any real model but low enough that a typo (``1e30``, ``2**63``) is refused before anything is built;
- a 0 that means nothing (a timeout, an interval, a count of threads or iterations) is refused unless the
  field's docstring says what 0 means ("0: off"); the message then says it too.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from typing import Any

from llmtrain.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """Allowed numbers ``lo <= v <= hi`` (``<`` where open; None: unbounded on that side), plus ``extra``
    special values outside it (``-1``: derived). ``note`` says what a special value means."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    extra: tuple[float, ...] = ()
    note: str = ""
    text: str = ""
    """The whole description, when the generated one would read badly (``0, 1, 2 or 3``)."""

    def allows(self, value: float) -> bool:
        if value in self.extra:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def describe(self, integer: bool, optional: bool = False) -> str:
        """``an integer >= 1 and <= 10,000`` / ``a number in (0, 1]`` / ``-1 or an integer >= 1 ... (-1: ...)``;
        optional adds ``or null``."""
        null = " or null" if optional else ""
        if self.text:
            return self.text + null
        kind = "an integer" if integer else "a number"
        lo, hi = _fmt(self.lo), _fmt(self.hi)
        if not integer and self.lo is not None and self.hi is not None and self.hi <= 1:
            span = f"{kind} in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        else:
            parts = []
            if self.lo is not None:
                parts.append(f"{'>' if self.lo_open else '>='} {lo}")
            if self.hi is not None:
                parts.append(f"{'<' if self.hi_open else '<='} {hi}")
            span = f"{kind} {' and '.join(parts)}" if parts else f"a finite {kind[2:].strip()}"
        extra = "".join(f"{_fmt(x)} or " for x in self.extra)
        return f"{extra}{span}{null}{f' ({self.note})' if self.note else ''}"


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    if float(x).is_integer() and abs(x) >= 10_000:
        return f"{int(x):,}"
    return f"{int(x)}" if float(x).is_integer() else f"{x:g}"


# Upper bounds of sizes: far above any model trained today, low enough to refuse a typo before it allocates.
MAX_WIDTH = 2**20  # hidden, expert and head widths (a 1M-wide residual stream)
MAX_LAYERS = 10_000
MAX_HEADS = 2**16
MAX_SEQ = 2**24  # tokens in one sequence (16.7M)
MAX_VOCAB = 2**24
MAX_DEGREE = 2**20  # devices along one parallel dimension
MAX_BATCH = 2**24  # sequences in one global batch
MAX_STEPS = 10**9  # steps, intervals in steps, iterations
MAX_EXPERTS = 2**16
MAX_THREADS = 4096
MAX_SECONDS = 10**7  # timeouts and sleeps (115 days)
MAX_SEED = 2**32 - 1

# Fallbacks for a number field not listed below.
DEFAULT_INT = Range(0, 2**53)
DEFAULT_FLOAT = Range(0)

_SIZE = Range(1, MAX_WIDTH)
_COUNT = Range(1, MAX_STEPS)
_DEGREE = Range(1, MAX_DEGREE)
_POSITIVE = Range(0, lo_open=True)
_NONNEG = Range(0)
_SHARE = Range(0, 1, hi_open=True)  # [0, 1)
_FRACTION = Range(0, 1, lo_open=True)  # (0, 1]
_STEP_LIST = Range(0, MAX_STEPS)


def _off(hi: float | None = None, note: str = "0: off") -> Range:
    """0 (documented as off) or more, up to hi."""
    return Range(0, hi, note=note)


RANGES: dict[str, Range] = {
    # model
    "model.hidden_size": _SIZE,
    "model.num_layers": Range(1, MAX_LAYERS),
    "model.num_heads": Range(1, MAX_HEADS),
    "model.num_kv_heads": Range(1, MAX_HEADS),
    "model.intermediate_size": _SIZE,
    "model.seq_length": Range(1, MAX_SEQ),
    "model.vocab_size": Range(1, MAX_VOCAB),
    "model.head_dim": Range(1, MAX_HEADS),
    "model.rms_norm_eps": Range(0, 1, lo_open=True),
    "model.rope_theta": _POSITIVE,
    "model.max_position_embeddings": Range(1, 2**31 - 1),
    "model.partial_rotary_factor": _FRACTION,
    "model.sliding_window": _off(2**31 - 1),
    "model.sliding_window_layers[]": Range(0, MAX_LAYERS - 1),
    "model.kv_lora_rank": _off(MAX_WIDTH, "0: grouped-query attention"),
    "model.q_lora_rank": _off(MAX_WIDTH, "0: queries from one projection"),
    "model.qk_nope_head_dim": Range(0, MAX_HEADS),
    "model.qk_rope_head_dim": Range(0, MAX_HEADS),
    "model.v_head_dim": _off(MAX_HEADS, "0: not multi-head latent attention"),
    "model.init_std": _POSITIVE,
    "model.moe.num_experts": _off(MAX_EXPERTS, "0: dense"),
    "model.moe.top_k": Range(1, MAX_EXPERTS),
    "model.moe.moe_hidden_size": _SIZE,
    "model.moe.shared_experts": _off(MAX_EXPERTS, "0: none"),
    "model.moe.aux_loss_coef": _off(),
    "model.moe.bias_update_rate": _off(),
    "model.moe.capacity_factor": _POSITIVE,
    "model.moe.every": Range(1, MAX_LAYERS),
    "model.moe.first_dense_layers": Range(0, MAX_LAYERS),
    "model.moe.n_group": Range(1, MAX_EXPERTS),
    "model.moe.topk_group": Range(1, MAX_EXPERTS),
    "model.moe.routed_scaling_factor": _POSITIVE,
    # parallel
    "parallel.data_parallel": Range(1, MAX_DEGREE, extra=(-1,), note="-1: derived from the world size"),
    "parallel.tensor_parallel": _DEGREE,
    "parallel.pipeline_parallel": _DEGREE,
    "parallel.context_parallel": _DEGREE,
    "parallel.expert_parallel": _DEGREE,
    "parallel.data_parallel_replicate": _DEGREE,
    "parallel.zero_level": Range(1, 3, text="1, 2, 3"),
    "parallel.zero_stage": Range(0, 3, text="0, 1, 2, 3"),
    "parallel.micro_batch_num": Range(1, MAX_BATCH),
    "parallel.virtual_stages": Range(1, MAX_LAYERS),
    "parallel.pipeline_layers[]": Range(0, MAX_LAYERS),
    # train
    "train.batch_size": Range(1, MAX_BATCH),
    "train.micro_batch_size": Range(1, MAX_BATCH),
    "train.gradient_accumulation_steps": Range(1, MAX_BATCH),
    "train.max_steps": _COUNT,
    "train.epochs": Range(1, 10**6),
    "train.lr": _POSITIVE,
    "train.min_lr": _NONNEG,
    "train.weight_decay": _NONNEG,
    "train.beta1": _SHARE,
    "train.beta2": _SHARE,
    "train.eps": _POSITIVE,
    "train.warmup_steps": Range(0, MAX_STEPS),
    "train.decay_steps": _COUNT,
    "train.wsd_decay_fraction": _FRACTION,
    "train.grad_clip_norm": _off(),
    "train.initial_loss_scale": _POSITIVE,
    "train.loss_scale_window": _COUNT,
    "train.label_smoothing": _SHARE,
    "train.z_loss": Range(0, 1),  # PaLM: 1e-4; 0: off
    "train.loss_chunk_tokens": _off(MAX_SEQ),
    "train.seed": Range(0, MAX_SEED),
    "train.log_steps": _COUNT,
    "train.eval_steps": _off(MAX_STEPS, "0: only at the end"),
    # data
    "data.datasets[].weight": _POSITIVE,
    "data.valid_fraction": _SHARE,
    "data.num_workers": Range(0, MAX_THREADS),
    # checkpoint
    "checkpoint.save_steps": _off(MAX_STEPS, "0: only at the end"),
    "checkpoint.keep_checkpoint_max": Range(1, 10**6),
    "checkpoint.save_minutes": _off(10**5),
    "checkpoint.write_threads": Range(1, MAX_THREADS),
    # logging
    "logging.peak_tflops": _POSITIVE,
    "logging.profile_every": _off(MAX_STEPS),
    "logging.profile_steps": _off(MAX_STEPS),
    "logging.straggler_margin": Range(0, lo_open=True, note="0.2 = 20% slower than the median"),
    "logging.straggler_patience": _COUNT,
    # eval
    "eval.eval_iters": Range(1, 10**6),
    "eval.downstream_steps": _off(MAX_STEPS),
    "eval.limit": Range(1, MAX_STEPS),
    "eval.num_fewshot": Range(0, 1000),
    "eval.batch_size": Range(1, MAX_BATCH),
    # run
    "run.threads": Range(1, MAX_THREADS),
    "run.dist_timeout_s": Range(1, MAX_SECONDS),
    "run.hang_timeout_s": _off(MAX_SECONDS),
    # recompute
    "recompute.every": Range(1, MAX_LAYERS),
    # stages
    "stages[].steps": _COUNT,
    "stages[].tokens": Range(1, 2**62),
    "stages[].fraction": _FRACTION,
    "stages[].lr_end": _NONNEG,
    "stages[].datasets[].weight": _POSITIVE,
    # stability
    "stability.window": Range(1, 10**6),
    "stability.min_history": Range(0, 10**6),
    "stability.k": _POSITIVE,
    "stability.ratio": _POSITIVE,
    "stability.min_rel_increase": _NONNEG,
    "stability.consecutive": Range(1, 10**6),
    "stability.max_nonfinite_steps": Range(1, 10**6),
    "stability.max_rollbacks": Range(0, 10**6),
    "stability.skip_batches": Range(0, MAX_STEPS),
    "stability.margin_steps": Range(0, MAX_STEPS),
    "stability.lr_factor": _POSITIVE,
    "stability.lr_factor_steps": Range(0, MAX_STEPS),
    "stability.snapshot_max_gb": _off(2**20, "0: never"),
    # fault
    "fault.kill_at_step[]": _STEP_LIST,
    "fault.hang_at_step[]": _STEP_LIST,
    "fault.hang_seconds": Range(0, MAX_SECONDS),
    "fault.nan_at_step[]": _STEP_LIST,
    "fault.spike_at_step[]": _STEP_LIST,
    "fault.spike_steps": Range(1, MAX_STEPS),
    "fault.crash_in_save_at_step[]": _STEP_LIST,
    "fault.corrupt_checkpoint_at_step[]": _STEP_LIST,
    "fault.rank": Range(0, MAX_DEGREE, extra=(-1,), note="-1: every rank"),
    "fault.slow_rank": Range(0, MAX_DEGREE, extra=(-1,), note="-1: none"),
    "fault.slow_seconds": Range(0, MAX_SECONDS),
    "fault.seed": Range(0, MAX_SEED),
    "fault.replica": Range(0, MAX_DEGREE, extra=(-1,), note="-1: every replica group"),
    "fault.kill_replicas[]": Range(0, MAX_DEGREE),
    # fault_tolerance (ft/)
    "fault_tolerance.replicas": Range(1, MAX_DEGREE),
    "fault_tolerance.min_replicas": Range(1, MAX_DEGREE),
    "fault_tolerance.heartbeat_timeout_s": Range(0, MAX_SECONDS, lo_open=True),
    "fault_tolerance.join_timeout_s": Range(0, MAX_SECONDS),
    "fault_tolerance.quorum_timeout_s": Range(0, MAX_SECONDS, lo_open=True),
    "fault_tolerance.timeout_s": Range(0, MAX_SECONDS, lo_open=True),
    # data.prepare (`llmtrain prepare`'s options, data/prep/pipeline.py PrepareOptions; config.loader.check_section)
    "data.prepare.seq_length": Range(1, MAX_SEQ),
    "data.prepare.num_shards": Range(1, 100_000),
    "data.prepare.minhash.ngram": Range(1, 1000),
    "data.prepare.minhash.bands": Range(1, 10_000),
    "data.prepare.minhash.rows": Range(1, 1000),
    "data.prepare.minhash.threshold": _FRACTION,
    "data.prepare.minhash.seed": Range(0, MAX_SEED),
}

_INDEX = re.compile(r"\[\d+\]")


def range_of(key: str, integer: bool) -> Range:
    """The Range of the dotted key (list indices ignored: ``stages[2].steps`` -> ``stages[].steps``)."""
    return RANGES.get(_INDEX.sub("[]", key), DEFAULT_INT if integer else DEFAULT_FLOAT)


def show(value: Any, limit: int = 200) -> str:
    """repr(value) cut to about ``limit`` characters (a 5,000-digit number is not quoted whole)."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's 4300-digit repr limit
        return f"<an integer of about {int(value.bit_length() * 0.30103):,} digits>"
    return text if len(text) <= limit else f"{text[: limit - 40]}...{text[-12:]} ({len(text):,} characters)"


def range_problem(
    key: str, value: Any, integer: bool, optional: bool = False, written: Any = None
) -> str | None:
    """``key: expected <range>, got <value>.`` when value is outside key's range; None when inside (or None).
    optional: the field may also be null (said in the message); written: the value as the user wrote it."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    rng = range_of(key, integer)
    if rng.allows(value):
        return None
    shown = show(value if written is None else written)
    return f"{key}: expected {rng.describe(integer, optional)}, got {shown}."


def check_config_ranges(cfg: Any, prefix: str = "") -> None:
    """ConfigError for the first number field of the dataclass tree ``cfg`` outside its range (lists of
    sections and of numbers included), in field order."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        key, value = f"{prefix}{f.name}", getattr(cfg, f.name)
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            where = key if i is None else f"{key}[{i}]"
            if dataclasses.is_dataclass(item) and not isinstance(item, type):
                check_config_ranges(item, f"{where}.")
            elif isinstance(item, int | float) and not isinstance(item, bool):
                leaves = _leaf_types(hints.get(f.name, type(item)))
                problem = range_problem(where, item, int in leaves, i is None and type(None) in leaves)
                if problem:
                    raise ConfigError(problem)


def _leaf_types(tp: Any) -> set[Any]:
    args = typing.get_args(tp)
    if not args:
        return {tp}
    return set().union(*(_leaf_types(a) for a in args))


def nonfinite_path(value: Any, key: str) -> tuple[str, float] | None:
    """(dotted path, value) of the first NaN or infinite float inside a free-form value (dicts, lists), or None."""
    stack: list[tuple[Any, str]] = [(value, key)]
    seen: set[int] = set()  # an alias repeats one object: look at it once
    while stack:
        v, where = stack.pop()
        if isinstance(v, dict | list):
            if id(v) in seen:
                continue
            seen.add(id(v))
        if isinstance(v, float) and not math.isfinite(v):
            return where, v
        if isinstance(v, dict):
            stack.extend((item, f"{where}.{k}") for k, item in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((item, f"{where}[{i}]") for i, item in reversed(list(enumerate(v))))
    return None

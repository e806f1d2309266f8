"""Which parallel layouts can run: every layout rule once, as data, torch-free.

:func:`layout_problems` looks at a config, a world size and (optionally) the resolved model shape and returns
one :class:`Problem` per rule that applies, in a fixed order. A fatal problem is a layout ``train`` refuses; a
warning is a legal layout that wastes something or does not do what it seems to say. Every consumer calls this
one function and reports the first fatal problem's message verbatim:

* ``resolve.validate`` (``llmtrain check`` and ``llmtrain train`` before anything is built): ConfigError for the
  first fatal problem, the warnings returned with the others;
* ``plan.search``: candidates with a fatal problem are dropped (the planner never proposes a layout training
  refuses); ``layout_from_config`` refuses only the ``split`` rules, so the planner can cost what-if layouts;
* ``distributed.parallelize`` / ``distributed.pipeline``: one assertion (:func:`require_feasible`) before
  building; ``ParallelDims.from_config`` raises :func:`degree_problems`.

Nothing here imports torch: the model shape is any object with the attributes in :class:`ModelShape` (callers
pass the resolved ``TransformerArgs``; without it, only the rules that need no architecture run).

Rules: ``RULES`` lists every rule once, in report order, with its verdict (fatal or a warning), its kind and
the config key its message names first. Kinds: ``degrees`` (the numbers do not make a mesh), ``split`` (the
model does not divide over the degrees), ``schedule`` (pipeline batch / schedule arithmetic), ``unsupported``
(a combination this version refuses), ``advice`` (warnings). The first fatal problem is the one reported.
Where the old copies of these rules disagreed, the verdict follows training (docs/parallelism.md). Two groups
of rules live in their own torch-free modules and are reported from here: context parallel
(``context_rules.py``) and MoE / expert parallel (``moe_rules.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from llmtrain.context_rules import cp_problems
from llmtrain.errors import ConfigError
from llmtrain.moe_rules import moe_problems

if TYPE_CHECKING:
    from llmtrain.config.schema import Config, ParallelConfig


@dataclass(frozen=True)
class Rule:
    """One layout rule: its verdict, kind and the config key its message names first."""

    fatal: bool
    kind: str
    key: str


_F, _W = True, False
_P = "parallel."
# fmt: off
RULES: dict[str, Rule] = {
    "world_size": Rule(_F, "degrees", "world size"),                       # world size < 1
    "degree_min": Rule(_F, "degrees", _P + "tensor_parallel"),             # a degree < 1 (key: that degree)
    "dp_derive": Rule(_F, "degrees", _P + "data_parallel"),                # dp -1 and world % (tp x pp x cp)
    "dp_value": Rule(_F, "degrees", _P + "data_parallel"),                 # dp not -1 and < 1
    "world_product": Rule(_F, "degrees", _P + "data_parallel"),            # dp x tp x pp x cp != world
    "hsdp_replicate": Rule(_F, "degrees", _P + "data_parallel_replicate"), # replicate does not divide dp
    "ep_divides": Rule(_F, "degrees", _P + "expert_parallel"),             # ep does not divide dp x cp x tp
    "cp_seq": Rule(_F, "split", "model.seq_length"),                       # seq % 2cp, (seq / cp) % tp
    "tp_heads": Rule(_F, "split", _P + "tensor_parallel"),                 # num_heads % tp
    "tp_kv_heads": Rule(_F, "split", _P + "tensor_parallel"),              # num_kv_heads % tp
    "tp_ffn": Rule(_F, "split", _P + "tensor_parallel"),                   # intermediate_size % tp
    "tp_seq": Rule(_F, "split", "model.seq_length"),                       # seq_length % tp (sequence parallel)
    "tp_vocab": Rule(_W, "advice", "model.vocab_size"),                    # vocab % tp: uneven shards
    "tp_compile": Rule(_W, "advice", "train.compile"),                     # compile with tp > 1: runs eager
    "tp_moe_ffn": Rule(_F, "split", _P + "tensor_parallel"),               # moe_hidden_size % tp (moe_rules)
    "ep_without_moe": Rule(_F, "unsupported", _P + "expert_parallel"),     # ep > 1, no MoE blocks
    "ep_experts": Rule(_F, "split", _P + "expert_parallel"),               # num_experts % ep
    "alltoall_without_ep": Rule(_W, "advice", _P + "enable_alltoall"),     # enable_alltoall with ep 1
    "pipeline_layers_without_pp": Rule(_F, "schedule", _P + "pipeline_layers"),  # pipeline_layers, pp 1
    "virtual_stages_without_pp": Rule(_W, "advice", _P + "virtual_stages"),      # virtual_stages > 1, pp 1
    "interleave_without_pp": Rule(_W, "advice", _P + "micro_batch_interleave"),  # interleave, pp 1
    "pp_layers_min": Rule(_F, "split", "model.num_layers"),                # num_layers < pp x virtual_stages
    "pp_single_stage": Rule(_F, "schedule", _P + "virtual_stages"),        # gpipe / 1f1b with v != 1
    "pp_zbv_stages": Rule(_F, "schedule", _P + "virtual_stages"),          # zbv / dualpipev with v != 2
    "pp_dualpipev_microbatches": Rule(_F, "schedule", _P + "micro_batch_num"),  # dualpipev, mb < 2 pp
    "pp_1f1b_microbatches": Rule(_F, "schedule", _P + "micro_batch_num"),  # 1f1b, pipeline micro-batches < pp
    "pp_rounds": Rule(_F, "schedule", _P + "micro_batch_num"),             # interleaved: not whole rounds
    "pp_batch_split": Rule(_F, "schedule", "train.batch_size"),            # batch % (dp x micro-batches)
    "pp_compile_zero_bubble": Rule(_W, "advice", "train.compile"),         # compile with zero_bubble: eager
    "pp_even_split": Rule(_F, "schedule", _P + "pipeline_layers"),         # num_layers % (pp x v), no list
    "pipeline_layers_shape": Rule(_F, "schedule", _P + "pipeline_layers"), # wrong count or sum
    "pipeline_layers_entries": Rule(_F, "schedule", _P + "pipeline_layers"),  # negative / empty middle
    "pp_bubble": Rule(_W, "advice", _P + "micro_batch_num"),               # micro-batches < pp (not 1f1b)
    "pp_microbatch_size": Rule(_W, "advice", "train.micro_batch_size"),    # pipeline micro-batch != it
    "pp_zero3": Rule(_W, "advice", _P + "zero_stage"),                     # ZeRO 3 under pp runs as 2
    "zero_without_dp": Rule(_W, "advice", _P + "zero_stage"),              # ZeRO > 0 with dp 1
    "zero1_as_zero2": Rule(_W, "advice", _P + "zero_stage"),               # ZeRO 1 runs as 2 on FSDP2
}
# fmt: on
FATAL_RULES = tuple(k for k, r in RULES.items() if r.fatal)

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # one stage chunk per rank; the others are multi-stage
ZERO_BUBBLE_SCHEDULES = ("zero_bubble", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two stage chunks per rank in a V shape: rank r holds r and 2 pp - 1 - r


@dataclass(frozen=True)
class Problem:
    """One rule that applies: the config key to change, the message (one paragraph), fatal or a warning."""

    key: str
    message: str
    fatal: bool
    rule: str


class ModelShape(Protocol):
    """The attributes of ``TransformerArgs`` the rules read (any object with them will do)."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    tie_word_embeddings: bool
    num_experts: int
    moe_hidden_size: int

    @property
    def num_moe_layers(self) -> int: ...  # read-only: a property of TransformerArgs


class _Found(list):
    """The problems found so far; ``add`` takes the verdict and key from ``RULES``."""

    def add(self, rule: str, message: str, key: str | None = None) -> None:
        self.append(Problem(key or RULES[rule].key, message, RULES[rule].fatal, rule))


def schedule_name(p: ParallelConfig) -> str:
    """The schedule to run: ``parallel.schedule``; the seed key micro_batch_interleave turns 1f1b interleaved."""
    return "interleaved_1f1b" if p.micro_batch_interleave and p.schedule == "1f1b" else p.schedule


def pipeline_microbatches(cfg: Config, dp: int) -> int:
    """Pipeline micro-batches per step: ``parallel.micro_batch_num``, or when it is 1 (the default) the
    gradient-accumulation steps ``batch_size / (micro_batch_size x dp)`` (the planner's convention)."""
    n_mb = cfg.parallel.micro_batch_num
    return n_mb if n_mb > 1 else max(cfg.train.batch_size // max(cfg.train.micro_batch_size * dp, 1), 1)


def data_parallel_size(p: ParallelConfig, world_size: int) -> int:
    """The data-parallel size of a layout without degree problems (``data_parallel: -1`` derived)."""
    if p.data_parallel == -1:
        return world_size // (p.tensor_parallel * p.pipeline_parallel * p.context_parallel)
    return p.data_parallel


@dataclass(frozen=True)
class Degrees:
    """The parallel degrees of a layout without degree problems (``distributed.ParallelDims`` builds its mesh
    from these): data parallel splits into replicate x shard (ZeRO 0 shards nothing)."""

    tp: int
    cp: int
    pp: int
    ep: int
    dp_replicate: int
    dp_shard: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def degrees(p: ParallelConfig, world_size: int) -> Degrees:
    dp, replicate = data_parallel_size(p, world_size), p.data_parallel_replicate
    if p.effective_zero_stage() == 0:  # plain data parallelism: full replicas, nothing sharded
        replicate, shard = dp, 1
    else:
        shard = dp // replicate
    return Degrees(
        p.tensor_parallel, p.context_parallel, p.pipeline_parallel, p.expert_parallel, replicate, shard
    )


def _int(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


def degree_problems(p: ParallelConfig, world_size: int) -> list[Problem]:
    """The ``degrees`` rules: the parallel section and the world size make a mesh (empty list when they do)."""
    out = _Found()
    if not _int(world_size, 1):
        out.add(
            "world_size",
            f"the world size (the number of processes: --world-size, $WORLD_SIZE or torchrun's) must be an "
            f"integer >= 1, got {world_size!r}.",
        )
        return out
    degrees = ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel")
    for key in (*degrees, "data_parallel_replicate"):
        if not _int(getattr(p, key), 1):
            value = getattr(p, key)
            out.add("degree_min", f"parallel.{key}: expected an integer >= 1, got {value!r}.", _P + key)
            return out
    tp, pp, cp, dp = p.tensor_parallel, p.pipeline_parallel, p.context_parallel, p.data_parallel
    ranks = tp * pp * cp
    if dp == -1 and world_size % ranks:
        out.add(
            "dp_derive",
            f"the world size {world_size} is not divisible by tensor_parallel {tp} x pipeline_parallel {pp} x "
            f"context_parallel {cp} = {ranks}, so parallel.data_parallel: -1 cannot be derived. Run on a "
            f"multiple of {ranks} processes or change the degrees.",
        )
    elif dp != -1 and not _int(dp, 1):
        out.add(
            "dp_value",
            f"parallel.data_parallel: expected -1 (derive from the world size) or an integer >= 1, got {dp!r}.",
        )
    elif dp != -1 and dp * ranks != world_size:
        out.add(
            "world_product",
            f"the parallel degrees do not multiply to the world size: data_parallel {dp} x tensor_parallel {tp} "
            f"x pipeline_parallel {pp} x context_parallel {cp} = {dp * ranks}, but the world size is "
            f"{world_size}. Set parallel.data_parallel: -1 to derive it, or launch {dp * ranks} processes.",
        )
    if out:
        return out
    dp, rep, ep = data_parallel_size(p, world_size), p.data_parallel_replicate, p.expert_parallel
    if dp % rep:
        out.add(
            "hsdp_replicate",
            f"parallel.data_parallel_replicate {rep} does not divide the data-parallel size {dp} (HSDP needs "
            f"data_parallel = replicate x shard); use one of {_divisors(dp)}.",
        )
    elif (dp * cp * tp) % ep:
        out.add(
            "ep_divides",
            f"parallel.expert_parallel {ep} must divide data-parallel x context-parallel x tensor-parallel "
            f"({dp} x {cp} x {tp} = {dp * cp * tp}): expert-parallel ranks are taken from those (the ranks of "
            f"one pipeline stage); use one of {_divisors(dp * cp * tp)}.",
        )
    return out


def pipeline_split_problems(num_layers: int, p: ParallelConfig) -> list[Problem]:
    """The rules on how the layers split into ``pp x virtual_stages`` stage chunks (even, or pipeline_layers)."""
    out = _Found()
    pp, v = p.pipeline_parallel, p.virtual_stages
    n_chunks = pp * v
    if p.pipeline_layers is None:
        if num_layers % n_chunks:
            out.add(
                "pp_even_split",
                f"model.num_layers {num_layers} is not divisible by pipeline_parallel {pp} x virtual_stages {v} "
                f"= {n_chunks} stage chunks. Give an explicit uneven split with parallel.pipeline_layers (a list "
                f"of {n_chunks} layer counts summing to {num_layers}), or change the degrees.",
            )
        return out
    counts = list(p.pipeline_layers)
    ints = all(isinstance(c, int) and not isinstance(c, bool) for c in counts)
    total = sum(counts) if ints else "a non-integer"
    if len(counts) != n_chunks or total != num_layers:
        out.add(
            "pipeline_layers_shape",
            f"parallel.pipeline_layers {counts} must list {n_chunks} layer counts (pipeline_parallel {pp} x "
            f"virtual_stages {v}) that sum to model.num_layers {num_layers}; it has {len(counts)} entries "
            f"summing to {total}.",
        )
    elif any(c < 0 for c in counts) or any(c < 1 for c in counts[1:-1]):
        out.add(
            "pipeline_layers_entries",
            f"parallel.pipeline_layers {counts}: every entry must be an integer >= 1 (only the first and the "
            f"last stage, which also hold the embedding and the output head, may have 0 layers).",
        )
    return out


def layout_problems(cfg: Config, world_size: int, model: ModelShape | None = None) -> list[Problem]:
    """Every layout rule that applies to ``cfg`` on ``world_size`` processes, fatal ones and warnings, in
    ``RULES`` order. ``model``: the resolved ``TransformerArgs`` (without it the rules on the architecture are
    skipped). Degree problems end the list (nothing else can be computed without a mesh)."""
    p = cfg.parallel
    out = _Found(degree_problems(p, world_size))
    if out:
        return out
    dims = degrees(p, world_size)
    tp, dp = dims.tp, dims.dp
    for rule, message in cp_problems(cfg, model, dims):  # context parallel: llmtrain/context_rules.py
        out.add(rule, message)
    if model is not None and tp > 1:
        _tp_split(out, model, tp, cfg.model.seq_length)
    if cfg.train.compile and tp > 1:
        out.add(
            "tp_compile",
            f"train.compile is ignored with parallel.tensor_parallel {tp}: on this torch, TP + per-block "
            "compile fails in backward and FSDP + TP + whole-model compile gives wrong losses "
            "(docs/parallelism.md), so the blocks run eagerly (correct, without kernel fusion). Set "
            "train.compile: false to say so, or tensor_parallel: 1 to compile.",
        )
    if model is not None:
        for rule, message in moe_problems(model, dims):  # MoE / expert parallel: llmtrain/moe_rules.py
            out.add(rule, message)
    if p.enable_alltoall and dims.ep == 1:
        msg = "parallel.enable_alltoall has no effect with expert_parallel 1 (it is for MoE dispatch)."
        out.add("alltoall_without_ep", msg)
    _pipeline(out, cfg, model, dims.pp, dp)
    zero = p.effective_zero_stage()
    if zero > 0 and dp == 1:
        out.add("zero_without_dp", f"ZeRO stage {zero} has no effect with a data-parallel size of 1.")
    elif zero == 1:
        out.add(
            "zero1_as_zero2",
            "ZeRO stage 1 runs as stage 2 on FSDP2: gradients are reduce-scattered, so sharding them with the "
            "optimizer states costs no extra communication (zero_stage: 2 says so).",
        )
    return out


def _tp_split(out: _Found, m: ModelShape, tp: int, seq: int) -> None:
    sizes = (m.num_heads, m.num_kv_heads, m.intermediate_size, seq)
    valid = ", ".join(str(k) for k in range(1, min(sizes) + 1) if all(s % k == 0 for s in sizes))
    hint = f" Tensor-parallel degrees that divide every split size of this model: {valid}."
    for rule, key, value in (
        ("tp_heads", "num_heads", m.num_heads),
        ("tp_kv_heads", "num_kv_heads", m.num_kv_heads),
    ):
        if value % tp:
            msg = f"model.{key} {value} is not divisible by parallel.tensor_parallel {tp}: each tensor-parallel "
            out.add(rule, msg + f"rank must hold whole heads.{hint}")
            return
    if m.intermediate_size % tp:
        out.add(
            "tp_ffn",
            f"model.intermediate_size {m.intermediate_size} is not divisible by parallel.tensor_parallel {tp} "
            f"(the MLP is split by columns across tensor-parallel ranks).{hint}",
        )
    elif seq % tp:
        out.add(
            "tp_seq",
            f"model.seq_length {seq} is not divisible by parallel.tensor_parallel {tp}: sequence parallel splits "
            f"every sequence into {tp} equal slices between the blocks. Use a multiple of {tp} (e.g. "
            f"{max(seq // tp, 1) * tp} or {(max(seq // tp, 1) + 1) * tp}), or another tensor_parallel.{hint}",
        )
    if m.vocab_size % tp:
        out.add(
            "tp_vocab",
            f"vocabulary {m.vocab_size} is not divisible by tensor_parallel {tp}: the embedding and output "
            "shards are uneven (slower); pad model.vocab_size to a multiple.",
        )


def _pipeline(out: _Found, cfg: Config, m: ModelShape | None, pp: int, dp: int) -> None:
    p, batch, mbs = cfg.parallel, cfg.train.batch_size, cfg.train.micro_batch_size
    if pp == 1:
        if p.pipeline_layers is not None:
            msg = "parallel.pipeline_layers is only used with pipeline_parallel > 1; remove it."
            out.add("pipeline_layers_without_pp", msg)
        if p.virtual_stages > 1:
            msg = f"parallel.virtual_stages {p.virtual_stages} has no effect without pipeline parallelism."
            out.add("virtual_stages_without_pp", msg)
        if p.micro_batch_interleave:
            msg = "parallel.micro_batch_interleave has no effect without pipeline parallelism."
            out.add("interleave_without_pp", msg)
        return
    name, v, n_mb = schedule_name(p), p.virtual_stages, pipeline_microbatches(cfg, dp)
    # an explicit pipeline_layers may leave the first and the last chunk empty (pipeline_layers_entries)
    min_layers = pp * v - (2 if p.pipeline_layers is not None and pp * v > 2 else 0)
    if m is not None and m.num_layers < min_layers:
        out.add(
            "pp_layers_min",
            f"model.num_layers {m.num_layers} is fewer than the pipeline stages: pipeline_parallel {pp} x "
            f"virtual_stages {v} = {pp * v}; every stage needs at least one layer (with parallel.pipeline_layers "
            "the first and the last may have none).",
        )
    if name in SINGLE_STAGE_SCHEDULES and v != 1:
        out.add(
            "pp_single_stage",
            f"parallel.schedule {name} runs one stage per rank, but parallel.virtual_stages is {v}; use "
            "virtual_stages: 1, or schedule interleaved_1f1b / zero_bubble for virtual stages.",
        )
    if name in V_SCHEDULES and v != 2:
        out.add(
            "pp_zbv_stages",
            f"parallel.schedule {name} places exactly 2 stage chunks per rank in a V shape; set "
            f"parallel.virtual_stages: 2 (got {v}).",
        )
    if name == "dualpipev" and n_mb < 2 * pp:
        out.add(
            "pp_dualpipev_microbatches",
            f"parallel.schedule dualpipev needs {n_mb} pipeline micro-batches (parallel.micro_batch_num, or the "
            f"gradient-accumulation steps when it is 1) >= its {2 * pp} stages (2 x pipeline_parallel {pp}): "
            f"torch's DualPipeV feeds one per stage before the first backward. Set micro_batch_num >= {2 * pp}.",
        )
    if name == "1f1b" and n_mb < pp:
        out.add(
            "pp_1f1b_microbatches",
            f"parallel.schedule 1f1b needs {n_mb} pipeline micro-batches (parallel.micro_batch_num, or the "
            f"gradient-accumulation steps when it is 1) >= pipeline_parallel {pp}: one in flight per stage. "
            f"Set micro_batch_num >= {pp} (e.g. {2 * pp}), or use schedule gpipe.",
        )
    rounds = max(1, n_mb // pp)
    if name in ("interleaved_1f1b", "zero_bubble") and n_mb % rounds:
        out.add(
            "pp_rounds",
            f"parallel.schedule {name} runs micro-batches in rounds of pipeline_parallel {pp}: {n_mb} pipeline "
            f"micro-batches (parallel.micro_batch_num) must be a multiple of its {rounds} rounds (e.g. "
            f"{rounds * pp} or {(rounds + 1) * pp}).",
        )
    if batch % (dp * n_mb):
        out.add(
            "pp_batch_split",
            f"train.batch_size {batch} (the global batch) is not divisible by data-parallel size {dp} x {n_mb} "
            f"pipeline micro-batches (parallel.micro_batch_num) = {dp * n_mb}: each data-parallel rank splits "
            "its share of the batch into that many equal pipeline micro-batches.",
        )
    if cfg.train.compile and name in ZERO_BUBBLE_SCHEDULES:
        out.add(
            "pp_compile_zero_bubble",
            f"train.compile is ignored with parallel.schedule {name}: the zero-bubble schedules split each "
            "stage's backward into an input-gradient pass that keeps the graph and a later weight-gradient "
            "pass, and a compiled block's backward is one fused node that cannot be split (torch refuses "
            "compiled stage modules for these schedules; measured on torch 2.13, docs/parallelism.md), so the "
            "blocks and the loss run eagerly (correct, without kernel fusion). Set train.compile: false to "
            f"say so, or parallel.schedule: interleaved_1f1b (same pipeline_parallel {pp} and virtual_stages) "
            "to compile.",
        )
    if m is not None and m.num_layers >= min_layers:  # (too few layers: pp_layers_min has said it)
        out.extend(pipeline_split_problems(m.num_layers, p))
    if n_mb < pp and name != "1f1b":
        out.add(
            "pp_bubble",
            f"{n_mb} pipeline micro-batches per step < pipeline_parallel {pp}: fewer micro-batches than stages "
            "leave most stages idle (a large pipeline bubble); raise parallel.micro_batch_num.",
        )
    if batch // (dp * n_mb) != mbs:
        out.add(
            "pp_microbatch_size",
            f"under pipeline parallel each data-parallel rank's {batch // dp} sequences per step run as "
            f"parallel.micro_batch_num {n_mb} pipeline micro-batches of {batch // (dp * n_mb)} sequences; "
            f"train.micro_batch_size {mbs} only sets data loading.",
        )
    if p.effective_zero_stage() == 3 and dp > 1:
        out.add(
            "pp_zero3",
            f"ZeRO stage 3 under pipeline_parallel {pp} runs as stage 2: stage modules keep their parameters "
            "gathered from forward to backward (resharding after forward gives wrong gradients with torch's "
            "zero-bubble schedules on this torch).",
        )


def raise_fatal(problems: Iterable[Problem], prefix: str = "") -> list[str]:
    """ConfigError with the first fatal problem's message (after ``prefix``); else the warnings' messages."""
    problems = list(problems)
    for problem in problems:
        if problem.fatal:
            raise ConfigError(prefix + problem.message)
    return [problem.message for problem in problems]


def require_feasible(cfg: Config, world_size: int, model: ModelShape | None = None) -> None:
    """The builders' assertion: ConfigError (the validation message) if ``cfg`` is a layout training refuses."""
    raise_fatal(layout_problems(cfg, world_size, model))

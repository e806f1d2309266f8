"""Evaluate one layout (memory + time -> a :class:`PlanResult`) and search the valid layouts of a cluster.

:func:`layout_from_config` turns the run config into the :class:`~llmtrain.plan.memory.Layout` it describes
(degrees via ``ParallelDims.from_config``, the batch split via ``config.derive``), :func:`evaluate` costs it,
and :func:`search` enumerates the alternatives a user could configure on the same cluster with the same global
batch and sequence length:

* ``tp`` a divisor of the devices per node (TP stays inside a node); ``pp`` a divisor of the layer count
  (up to 64); ``cp`` 1, 2, 4, 8, ... dividing the devices left by tp x pp, with ``seq % (2 cp) == 0``, with
  any pp; ``dp`` the rest of the devices, which must divide the global batch with the micro-batch size; for
  an MoE model ``ep`` every divisor of ``num_experts`` that divides the stage's ``dp x cp x tp`` ranks (the
  expert mesh, :class:`~llmtrain.plan.layout.Layout`; expert-TP by ``moe_rules.expert_tp``), else 1;
* ZeRO 0, 2, 3 (1 is run as 2); recompute none / selective / full (and offload when the config uses it);
  micro-batch 1, 2, 4, 8;
* with ``pp > 1``: 1f1b and interleaved_1f1b (2 virtual stages when the layers allow), and at least ``pp``
  micro-batches per step (fewer is mostly bubble).

Which of those training would run is not decided here: each candidate is written as the run config a user
would give it (:func:`layout_config`) and dropped when :func:`llmtrain.feasibility.layout_problems` reports a
fatal problem (heads / FFN / sequence / experts not divisible by the degrees, tied embeddings with pp, the
context-parallel rules of ``llmtrain/context_rules.py``, ...), so ``--search`` never proposes a layout
``llmtrain train`` refuses; :func:`layout_overrides` writes a candidate as the overrides ``llmtrain check``
takes. :func:`search` costs memory first and times only the layouts that fit. The configured layout itself
(:func:`layout_from_config`) is refused only for the ``split`` rules, where the cost model could not split the
model; the other refusals are this version's limits, and the planner also costs what-if layouts.

Layouts that fit in memory are ranked by tokens/s per device (then by lower memory); the reasons shown are the
step-time breakdown and the memory headroom. Every candidate keeps the configured engine and TP-overlap choice
(:class:`~llmtrain.plan.layout.Layout`), ``parallel.reduce_grads`` and precision; ``pipeline_layers`` is
dropped (it only fits the configured degrees), so candidates use an even split. ``train.fp8``,
``train.loss_chunk_tokens`` and ``model.document_mask`` are kept too (the trainer's fp8 rule,
``distributed.float8.config_problem``, also filters what fp8 cannot run).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, cast

from llmtrain.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from llmtrain.errors import ConfigError
from llmtrain.feasibility import RULES, layout_problems, raise_fatal
from llmtrain.models import TransformerArgs
from llmtrain.plan.catalog import Cluster
from llmtrain.plan.layout import Layout
from llmtrain.plan.memory import MemoryEstimate, estimate_memory
from llmtrain.plan.timing import Efficiency, StepTime, estimate_step_time
from llmtrain.resolve.derived import derive


@dataclass
class PlanResult:
    """Memory and time of one layout on one cluster."""

    layout: Layout
    memory: MemoryEstimate
    time: StepTime
    tokens_per_step: int
    peak_flops: float

    @property
    def step_time_s(self) -> float:
        return self.time.total

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_step / self.step_time_s / self.layout.world_size

    @property
    def mfu(self) -> float:
        return self.time.model_flops / (self.step_time_s * self.peak_flops)

    def why(self) -> str:
        """One line: where the step time goes and how much memory is left."""
        t, total = self.time, self.step_time_s
        parts = {"compute": t.compute, "TP comm": t.tp_comm, "EP all-to-all": t.ep_comm,
                 "PP bubble": t.pp_bubble + t.pp_p2p, "DP exposed": t.dp_exposed, "CP exposed": t.cp_exposed,
                 "optimizer": t.optimizer, "offload copies": t.offload}  # fmt: skip
        shown = ", ".join(f"{k} {v / total:.0%}" for k, v in parts.items() if v / total >= 0.005)
        free = self.memory.capacity - self.memory.total
        return f"{shown}; memory {self.memory.total / 2**30:.1f} GiB ({free / 2**30:+.1f} GiB free)"


def layout_from_config(
    cfg: Config,
    world_size: int,
    recompute: str = "none",
    offload: bool = False,
    vocab_size: int | None = None,
    engine: str = "llmtrain",
    tp_overlap: bool = False,
    ep_overlap: bool = False,
    act_fp8_input_store: bool = False,
    recompute_modules: tuple[str, ...] = (),
    mtp_layers: int = 0,
    attention: str = "flash",
    grad_dtype: str = "auto",
    loss_compiled: bool = False,
) -> tuple[Layout, TransformerArgs, int]:
    """(layout, model args, tokens per step) of the run config on ``world_size`` devices; ConfigError for a
    feasibility ``split`` rule (the model does not divide over the degrees, see the module docstring).
    ``engine`` / ``tp_overlap`` / ``ep_overlap`` / ``act_fp8_input_store`` / ``recompute_modules`` /
    ``mtp_layers`` / ``attention`` / ``grad_dtype`` / ``loss_compiled``: how the layout is executed and what else
    the publishing engine trains (:class:`~llmtrain.plan.layout.Layout`)."""
    replicas = cfg.fault_tolerance.replicas if cfg.fault_tolerance.enabled else 1
    if replicas > 1:  # one group's layout on world / R ranks, its slice batch / R of the global batch
        from llmtrain.ft.layout import group_world

        world_size = group_world(cfg, world_size)
        cfg = replace(cfg, train=replace(cfg.train, batch_size=cfg.train.batch_size // replicas))
    d = derive(cfg, world_size, vocab_size=vocab_size)
    dims, p = d.dims, cfg.parallel
    assert dims is not None
    zero = p.effective_zero_stage()
    layout = Layout(
        tp=dims.tp, pp=dims.pp, cp=dims.cp, ep=dims.ep, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard,
        zero_stage=zero, micro_batch_size=d.micro_batch_size, grad_accum=d.grad_accum,
        seq_length=cfg.model.seq_length, schedule=p.schedule, virtual_stages=max(p.virtual_stages, 1),
        pipeline_layers=tuple(p.pipeline_layers) if p.pipeline_layers is not None else None,
        recompute=recompute, recompute_every=max(cfg.recompute.every, 1), offload=offload,
        precision=cfg.train.precision, reduce_grads=p.reduce_grads, engine=engine, tp_overlap=tp_overlap,
        ep_overlap=ep_overlap, act_fp8_input_store=act_fp8_input_store,
        fp8=cfg.train.fp8, loss_chunk_tokens=cfg.train.loss_chunk_tokens, document_mask=cfg.model.document_mask,
        loss_parallel=p.loss_parallel, recompute_modules=tuple(recompute_modules), mtp_layers=mtp_layers, replicas=replicas, attention=attention,
        grad_dtype=grad_dtype, replica_policy=cfg.fault_tolerance.batch_policy, loss_compiled=loss_compiled,
    )  # fmt: skip
    split = [pr for pr in layout_problems(cfg, world_size, d.model_args) if RULES[pr.rule].kind == "split"]
    raise_fatal(split)
    return layout, d.model_args, d.tokens_per_step * replicas


def layout_config(lay: Layout, global_batch: int, compile: bool = False) -> Config:
    """The run config a user would write for ``lay`` (the sections the feasibility rules read). Pipeline
    micro-batches are the gradient-accumulation steps (``parallel.micro_batch_num`` left at its default 1)."""
    # lay.schedule is a str that Layout checked is one of plan.memory.SCHEDULES (ParallelConfig's Literal)
    parallel = ParallelConfig(
        data_parallel=lay.dp, tensor_parallel=lay.tp, pipeline_parallel=lay.pp, context_parallel=lay.cp,
        expert_parallel=lay.ep, data_parallel_replicate=lay.dp_replicate if lay.zero_stage else 1,
        zero_stage=lay.zero_stage, schedule=cast(Any, lay.schedule), virtual_stages=lay.virtual_stages,
        pipeline_layers=list(lay.pipeline_layers) if lay.pipeline_layers is not None else None,
        cpu_offload=lay.offload, reduce_grads=cast(Any, lay.reduce_grads), loss_parallel=lay.loss_parallel,
    )  # fmt: skip
    train = TrainConfig(batch_size=global_batch, micro_batch_size=lay.micro_batch_size, compile=compile,
                        fp8=cast(Any, lay.fp8))  # fmt: skip
    model = ModelConfig(seq_length=lay.seq_length, document_mask=lay.document_mask)
    return Config(model=model, parallel=parallel, train=train)


def layout_overrides(lay: Layout) -> list[str]:
    """The ``section.key=value`` overrides that turn a run config into ``lay`` (what ``llmtrain check`` /
    ``train`` take; ``--search --json`` lists them per ranked layout). The degrees, ZeRO stage, schedule,
    micro-batch and recompute; ``pipeline_layers`` reset to an even split, as the search costs it."""
    out = [f"parallel.data_parallel={lay.dp}", f"parallel.tensor_parallel={lay.tp}",
           f"parallel.pipeline_parallel={lay.pp}", f"parallel.context_parallel={lay.cp}",
           f"parallel.expert_parallel={lay.ep}", f"parallel.zero_stage={lay.zero_stage}",
           f"parallel.data_parallel_replicate={lay.dp_replicate if lay.zero_stage else 1}",
           f"parallel.schedule={lay.schedule}", f"parallel.virtual_stages={lay.virtual_stages}",
           "parallel.pipeline_layers=" + (f"[{','.join(map(str, lay.pipeline_layers))}]"
                                          if lay.pipeline_layers is not None else "null"),
           f"parallel.cpu_offload={str(lay.offload).lower()}", f"train.micro_batch_size={lay.micro_batch_size}",
           f"recompute.mode={lay.recompute}"]  # fmt: skip
    return out


def refused(lay: Layout, global_batch: int, world_size: int, args: TransformerArgs, compile: bool) -> bool:
    """Whether training would refuse ``lay``: a fatal feasibility problem (context-parallel rules included) or
    the trainer's fp8 rule; the same functions ``llmtrain train`` asks."""
    from llmtrain.distributed.float8 import config_problem

    cfg = layout_config(lay, global_batch, compile)
    if any(pr.fatal for pr in layout_problems(cfg, world_size, args)):
        return True
    return lay.fp8 != "none" and config_problem(cfg) is not None


def evaluate(
    args: TransformerArgs, layout: Layout, cluster: Cluster, tokens_per_step: int, fused: bool,
    eff: Efficiency | None = None,
) -> PlanResult:  # fmt: skip
    """Memory and step time of ``layout``."""
    if layout.world_size != cluster.num_devices:
        raise ConfigError(
            f"the layout uses {layout.world_size} devices (tp {layout.tp} x pp {layout.pp} x cp {layout.cp} x dp "
            f"{layout.dp}) but the cluster has {cluster.num_devices}; set parallel.data_parallel: -1 or change "
            f"--cluster."
        )
    memory = estimate_memory(args, layout, capacity=cluster.device.usable_bytes)
    time = estimate_step_time(args, layout, cluster, fused=fused, eff=eff)
    return PlanResult(layout, memory, time, tokens_per_step, cluster.device.peak_flops)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(
    args: TransformerArgs, base: Layout, cluster: Cluster, global_batch: int, compile: bool = False
) -> list[Layout]:
    """Every layout the search considers that training would run (see the module docstring); ``compile``:
    the run's ``train.compile`` (a rule input: compile with zero-bubble schedules is refused)."""
    n = cluster.num_devices // base.replicas  # one replica group's ranks (the degrees are a group's)
    tps = [t for t in _divisors(cluster.devices_per_node) if t <= n]
    pps = [p for p in _divisors(args.num_layers) if p <= 64]
    cps = [2**i for i in range(n.bit_length()) if n % 2**i == 0 and base.seq_length % 2 ** (i + 1) == 0]
    out: list[Layout] = []
    for tp, pp, cp in itertools.product(tps, pps, cps):
        if n % (tp * pp * cp):
            continue
        dp = n // (tp * pp * cp)
        # EP regroups a stage's dp x cp x tp ranks (plan/layout.py): every divisor of the expert count that
        # divides them; whether training runs it (and with which expert-TP) is the feasibility rules' call
        eps = [e for e in _divisors(args.num_experts) if (dp * cp * tp) % e == 0] if args.num_experts else [1]
        for ep in eps:
            probe = replace(base, tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=1, dp_shard=dp, virtual_stages=1,
                            pipeline_layers=None)  # fmt: skip
            out += _batch_variants(args, base, probe, global_batch, n, compile)
    return out


def _batch_variants(
    args: TransformerArgs, base: Layout, probe: Layout, global_batch: int, n: int, compile: bool
) -> list[Layout]:
    """The ZeRO / recompute / micro-batch / schedule variants of the degrees ``probe`` that training runs."""
    out: list[Layout] = []
    dp, pp = probe.dp, probe.pp
    modes = ("none", "selective", "full") + (("offload",) if base.recompute == "offload" else ())
    for mbs, zero, rc in itertools.product((1, 2, 4, 8), (0, 2, 3), modes):
        if global_batch % (mbs * dp):
            continue
        accum = global_batch // (mbs * dp)
        if pp > 1 and accum < pp:
            continue  # fewer micro-batches than stages: mostly bubble
        scheds = [("1f1b", 1)]
        if pp > 1 and args.num_layers % (2 * pp) == 0 and accum % pp == 0:
            scheds.append(("interleaved_1f1b", 2))
        for sched, vs in scheds:
            lay = replace(
                probe, zero_stage=zero, micro_batch_size=mbs, grad_accum=accum, recompute=rc,
                schedule=sched if pp > 1 else base.schedule, virtual_stages=vs,
            )  # fmt: skip
            if not refused(lay, global_batch, n, args, compile):
                out.append(lay)
    return out


def search(
    args: TransformerArgs, base: Layout, cluster: Cluster, tokens_per_step: int, fused: bool, top: int = 5,
    eff: Efficiency | None = None,
) -> tuple[list[PlanResult], int, int]:  # fmt: skip
    """(best ``top`` fitting layouts by tokens/s per device, candidates tried, candidates that fit).
    ``fused``: the run compiles (``train.compile``; fused kernels in the time model)."""
    global_batch = tokens_per_step // base.seq_length // base.replicas  # one group's slice
    candidates = candidate_layouts(args, base, cluster, global_batch, compile=fused)
    capacity = cluster.device.usable_bytes
    # memory first, the cheap half: only the layouts that fit are timed (the ranking is over those alone)
    fits = [lay for lay in candidates if estimate_memory(args, lay, capacity=capacity).fits]
    fitting = [evaluate(args, lay, cluster, tokens_per_step, fused, eff) for lay in fits]
    fitting.sort(key=lambda r: (-r.tokens_per_s_per_device, r.memory.total))
    return fitting[:top], len(candidates), len(fitting)

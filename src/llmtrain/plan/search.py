"""Evaluate one layout (memory + time -> a :class:`PlanResult`) and search the valid layouts of a cluster.

:func:`layout_from_config` turns the run config into the :class:`~llmtrain.plan.memory.Layout` it describes
(degrees via ``ParallelDims.from_config``, the batch split via ``config.derive``), :func:`evaluate` costs it,
and :func:`search` enumerates the alternatives a user could configure on the same cluster with the same global
batch and sequence length:

* ``tp`` a divisor of the devices per node (TP stays inside a node) that divides the heads, KV heads, FFN
  width and vocabulary; ``pp`` a divisor of the layer count; ``cp`` 1 (2 and 4 from 32k tokens on);
  ``dp`` the rest of the devices, which must divide the global batch with the micro-batch size;
* ZeRO 0, 2, 3 (1 is run as 2); recompute none / selective / full; micro-batch 1, 2, 4, 8;
* with ``pp > 1``: 1f1b and interleaved_1f1b (2 virtual stages when the layers allow).

Layouts that fit in memory are ranked by tokens/s per device (then by lower memory); the reasons shown are the
step-time breakdown and the memory headroom.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from llmtrain.config.derived import derive
from llmtrain.config.schema import Config
from llmtrain.errors import ConfigError
from llmtrain.models import TransformerArgs
from llmtrain.plan.catalog import Cluster
from llmtrain.plan.memory import Layout, MemoryEstimate, estimate_memory
from llmtrain.plan.timing import Efficiency, StepTime, estimate_step_time


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
        parts = {"compute": t.compute, "TP comm": t.tp_comm, "PP bubble": t.pp_bubble + t.pp_p2p,
                 "DP exposed": t.dp_exposed, "CP exposed": t.cp_exposed, "optimizer": t.optimizer}  # fmt: skip
        shown = ", ".join(f"{k} {v / total:.0%}" for k, v in parts.items() if v / total >= 0.005)
        free = self.memory.capacity - self.memory.total
        return f"{shown}; memory {self.memory.total / 2**30:.1f} GiB ({free / 2**30:+.1f} GiB free)"


def layout_from_config(
    cfg: Config,
    world_size: int,
    recompute: str = "none",
    offload: bool = False,
    vocab_size: int | None = None,
) -> tuple[Layout, TransformerArgs, int]:
    """(layout, model args, tokens per step) of the run config on ``world_size`` devices."""
    d = derive(cfg, world_size, vocab_size=vocab_size)
    dims, p = d.dims, cfg.parallel
    assert dims is not None
    zero = p.effective_zero_stage()
    layout = Layout(
        tp=dims.tp, pp=dims.pp, cp=dims.cp, ep=dims.ep, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard,
        zero_stage=zero, micro_batch_size=d.micro_batch_size, grad_accum=d.grad_accum,
        seq_length=cfg.model.seq_length, schedule=p.schedule, virtual_stages=max(p.virtual_stages, 1),
        recompute=recompute, offload=offload, precision=cfg.train.precision,
    )  # fmt: skip
    check_divisibility(d.model_args, layout)
    return layout, d.model_args, d.tokens_per_step


def check_divisibility(args: TransformerArgs, lay: Layout) -> None:
    """ConfigError when the model cannot be split as the layout says."""
    checks = [
        ("model.num_heads", args.num_heads, lay.tp, "parallel.tensor_parallel"),
        ("model.num_kv_heads", args.num_kv_heads, lay.tp, "parallel.tensor_parallel"),
        ("model.intermediate_size", args.intermediate_size, lay.tp, "parallel.tensor_parallel"),
        ("the vocabulary", args.vocab_size, lay.tp, "parallel.tensor_parallel"),
        ("model.seq_length", lay.seq_length, lay.cp * lay.tp, "context_parallel x tensor_parallel"),
    ]
    for what, value, by, key in checks:
        if value % by:
            raise ConfigError(
                f"{what} {value} is not divisible by {key} {by}; choose a degree that divides it."
            )
    if args.num_layers < lay.pp * lay.virtual_stages:
        raise ConfigError(
            f"model.num_layers {args.num_layers} is fewer than pipeline_parallel {lay.pp} x virtual_stages "
            f"{lay.virtual_stages}: every pipeline chunk needs at least one block."
        )


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
    args: TransformerArgs, base: Layout, cluster: Cluster, global_batch: int
) -> list[Layout]:
    """Every layout the search considers (see the module docstring)."""
    n = cluster.num_devices
    tps = [t for t in _divisors(cluster.devices_per_node) if t <= n]
    pps = [p for p in _divisors(args.num_layers) if p <= 64]
    cps = [1, 2, 4] if base.seq_length >= 32768 else [1]
    out: list[Layout] = []
    for tp, pp, cp in itertools.product(tps, pps, cps):
        if n % (tp * pp * cp):
            continue
        dp = n // (tp * pp * cp)
        probe = replace(base, tp=tp, pp=pp, cp=cp, dp_replicate=1, dp_shard=dp, virtual_stages=1)
        try:
            check_divisibility(args, probe)
        except ConfigError:
            continue
        for mbs, zero, rc in itertools.product((1, 2, 4, 8), (0, 2, 3), ("none", "selective", "full")):
            if global_batch % (mbs * dp):
                continue
            accum = global_batch // (mbs * dp)
            if pp > 1 and accum < pp:
                continue  # fewer micro-batches than stages: mostly bubble
            scheds = [("1f1b", 1)]
            if pp > 1 and args.num_layers % (2 * pp) == 0 and accum % pp == 0:
                scheds.append(("interleaved_1f1b", 2))
            for sched, vs in scheds:
                out.append(
                    replace(
                        probe,
                        zero_stage=zero,
                        micro_batch_size=mbs,
                        grad_accum=accum,
                        recompute=rc,
                        schedule=sched if pp > 1 else base.schedule,
                        virtual_stages=vs,
                    )  # fmt: skip
                )
    return out


def search(
    args: TransformerArgs, base: Layout, cluster: Cluster, tokens_per_step: int, fused: bool, top: int = 5,
    eff: Efficiency | None = None,
) -> tuple[list[PlanResult], int, int]:  # fmt: skip
    """(best ``top`` fitting layouts by tokens/s per device, candidates tried, candidates that fit)."""
    global_batch = tokens_per_step // base.seq_length
    results = [evaluate(args, lay, cluster, tokens_per_step, fused, eff)
               for lay in candidate_layouts(args, base, cluster, global_batch)]  # fmt: skip
    fitting = [r for r in results if r.memory.fits]
    fitting.sort(key=lambda r: (-r.tokens_per_s_per_device, r.memory.total))
    return fitting[:top], len(results), len(fitting)

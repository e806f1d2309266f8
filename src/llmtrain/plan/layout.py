"""A parallel layout and what each pipeline rank of it holds: chunks, layers, parameters (dense and expert).

:class:`Layout` is one run's degrees, ZeRO stage, batch split, schedule, recompute, precision and the two
choices of *how* the layout is executed that the planner cannot read from a config:

* ``engine`` ``llmtrain`` (default): what this project's trainer does, as measured on gloo
  (``tests/test_plan.py``): fp32 parameters under ``torch.autocast``, torch tensor parallel with sequence
  parallel, FSDP2 without a mixed-precision policy, eager kernels under TP (compile is skipped with TP);
  ``megatron``: how Megatron-style implementations (Megatron-LM / Megatron-Core, NeMo with Transformer Engine,
  Megatron-DeepSpeed, MindFormers in graph mode) run the same layout: bf16 weights and residual stream, fused
  kernels also under TP, sequence-parallel inputs saved sharded and gathered again in backward, the
  distributed optimizer's gradient buffer (16-bit, or fp32: ``grad_dtype``), fused QKV / gate-up GEMMs; ``nemo``: the same as NeMo runs it
  with its distributed Adam (Apex), which keeps only the 16-bit remainders of the fp32 master weights
  (``store_param_remainders``, NeMo's default for bf16 models); ``torchtitan``: PyTorch's torchtitan, the same
  stack as this trainer (FSDP2, DTensor TP, torch pipelining) but run as torchtitan runs it: FSDP2 with a bf16
  ``MixedPrecisionPolicy`` over fp32 master weights (fp32 gradients reduced and sharded, no autocast copies),
  a bf16 residual stream, the gathered sequence-parallel inputs saved once each, the loss vocabulary-parallel
  (``loss_parallel``), separate projection GEMMs, ring context parallel, TP collectives in line unless async TP
  (``tp_overlap``), and ``selective`` recompute as its per-op policy (``selective_ac_option: op``: every
  second matmul output, attention and reduce-scatter outputs saved, the rest recomputed). The differences are
  in :mod:`~llmtrain.plan.memory` and :mod:`~llmtrain.plan.timing`.
* ``tp_overlap``: tensor-parallel collectives overlap with the GEMMs that use them (Megatron
  ``--tp-comm-overlap`` / Transformer Engine userbuffers; torch async TP, the forward's only: plan/timing.py);
  off by default, as in this trainer.

Read from the config as well: ``fp8`` (``train.fp8``), ``loss_chunk_tokens`` (``train.loss_chunk_tokens``),
``document_mask`` (``model.document_mask``), ``recompute`` ``offload`` (``recompute.mode: offload``, the
saved activations to host memory; ``offload`` the field is FSDP2's CPU offload of the training state) and
``replicas`` (``fault_tolerance.replicas`` when enabled: the degrees are one replica group's). Two more describe
what a published Megatron-style recipe runs: ``recompute_modules`` (Megatron's module recompute) and
``mtp_layers`` (multi-token-prediction layers on the last stage).

Pipeline placement follows ``distributed/pipeline.py``: the layers split into ``pp x v`` stage chunks
(``parallel.pipeline_layers``, or an even split; the planner gives a remainder to the first chunks so it can
also cost splits the trainer refuses), chunk ``c`` on rank ``c mod pp`` (loop order), or, for ``zbv``, ranks
``r`` and ``2 pp - 1 - r`` (the V shape: rank 0 holds the first and the last chunk). A rank holds the embedding
with chunk 0 and the final norm + output projection with the last chunk.

Parameters of a rank are split in two: *dense* (attention, norms, dense MLPs, routers, shared experts,
embeddings; FSDP/ZeRO shards them over ``dp_shard x cp``) and *expert* (routed experts). Expert parallel is a
second mesh ``(edp, ep, etp)`` over a stage's ``dp x cp x tp`` ranks (distributed/expert_parallel.py): the
experts split over ``ep`` and over the expert-TP degree ``etp`` (:attr:`Layout.etp`, training's own
``moe_rules.expert_tp``: ``tp`` when ``ep`` divides ``dp x cp``, else 1, whole experts with EP drawn from the
TP ranks too), replicated over ``edp = dp x cp x tp / (ep x etp)`` and, with ZeRO >= 1, FSDP-sharded over
those replicas (:attr:`Layout.expert_shard_degree`). Without EP the experts are split over ``tp`` and
sharded with the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

from llmtrain.config.schema import ParallelConfig
from llmtrain.distributed.grad_sync import sync_mode
from llmtrain.errors import ConfigError
from llmtrain.feasibility import SINGLE_STAGE_SCHEDULES, V_SCHEDULES
from llmtrain.models import TransformerArgs
from llmtrain.moe_rules import expert_tp

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
MULTI_CHUNK_SCHEDULES = tuple(s for s in SCHEDULES if s not in SINGLE_STAGE_SCHEDULES)
RECOMPUTE_MODES = ("none", "selective", "full", "offload")
FP8_RECIPES = ("none", "tensorwise", "rowwise")
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MASTER_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
"""Bytes per parameter of this trainer's fp32 master weights and gradients, and of AdamW's two fp32 moments."""
ENGINES = ("llmtrain", "megatron", "nemo", "torchtitan")
REDUCE_GRADS = ("auto", "per_step", "per_microbatch")
GRAD_DTYPES = ("auto", "fp32", "bf16")
"""The Megatron-style engines' gradient buffer dtype (``Layout.grad_dtype``)."""
ATTENTION_KERNELS = ("flash", "unfused")
"""How the attention core runs (``Layout.attention``)."""
RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "mlp", "moe", "moe_act", "layernorm")
"""Megatron-Core's selective recompute modules the planner costs (``Layout.recompute_modules``)."""


@dataclass(frozen=True)
class Layout:
    """One parallel layout of one run: degrees, ZeRO stage, batch split, schedule, recompute, precision."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    grad_accum: int = 1
    """Micro-batches per optimizer step on each data-parallel rank (= pipeline micro-batches M)."""
    seq_length: int = 2048
    schedule: str = "1f1b"
    virtual_stages: int = 1
    pipeline_layers: tuple[int, ...] | None = None
    """Layers per stage chunk (``parallel.pipeline_layers``, pp x v entries); None: an even split."""
    recompute: str = "none"
    recompute_every: int = 2
    offload: bool = False
    precision: str = "bf16"
    reduce_grads: str = "auto"
    """``parallel.reduce_grads``: when data-parallel gradients are reduced (distributed/grad_sync.py)."""
    engine: str = "llmtrain"
    tp_overlap: bool = False
    ep_overlap: bool = False
    act_fp8_input_store: bool = False
    """The Megatron-style engines under ``train.fp8``: the MLP activation's (SwiGLU's) input kept in FP8 for its
    backward (``--act-fp8-input-store``; Megatron's ``--activation-func-fp8-input-store``, DeepSeek-V3's
    "inputs of the SwiGLU operator in MoE ... stored in FP8"). Memory only."""
    """The Megatron-style engines: each micro-batch's expert-parallel all-to-all runs while another micro-batch
    computes (``--ep-overlap``: DeepSeek's DualPipe, Megatron-LM's ``--overlap-moe-expert-parallel-comm``), on
    the SMs the communication kernels take (``Efficiency.ep_overlap_sms``): plan/timing.py. Time only."""
    fp8: str = "none"
    """``train.fp8``: the linear layers' GEMMs at the device's FP8 peak (distributed/float8.py)."""
    loss_chunk_tokens: int | None = None
    """``train.loss_chunk_tokens`` (None: the trainer's automatic rule, train/loss.py)."""
    loss_parallel: bool = True
    """``parallel.loss_parallel``: under TP this trainer's logits stay sharded over the vocabulary
    (train/vocab_parallel.py); False: gathered whole on every TP rank."""
    document_mask: bool = False
    """``model.document_mask``: under context parallel the dense mask has a batch dimension."""
    recompute_modules: tuple[str, ...] = ()
    """Megatron-style module recompute (``--recompute-modules``; Megatron's ``recompute_modules`` under
    ``recompute_granularity: selective``): the forward of each named part of every block runs again in
    backward, one of :data:`RECOMPUTE_MODULES`. Time (``plan/timing.py``); memory for ``mla_up_proj``,
    ``layernorm`` and ``moe_act`` in the Megatron-style engines (what they recompute is not saved:
    ``plan/activations.py``), the others' savings not modelled; this trainer recomputes whole blocks
    (``recompute``)."""
    replicas: int = 1
    """``fault_tolerance.replicas`` (torchft replica groups, with ``fault_tolerance.enabled``): the job is
    ``replicas`` groups of :attr:`group_world` ranks; every degree above is one group's, and the gradient shards
    are also all-reduced across the groups (:mod:`~llmtrain.plan.replicas`)."""
    replica_policy: str = "shrink"
    """``fault_tolerance.batch_policy`` (``shrink`` | ``keep``): with ``keep`` over three or more groups the
    cross-group sum runs after the backward, not in FSDP's hook (``ft.layout.fsdp_hook_sums``)."""
    mtp_layers: int = 0
    """Multi-token-prediction layers trained on the last stage (``--mtp-layers``; Megatron's ``mtp_num_layers``):
    each one more block of the last layer's kind, an ``2h -> h`` projection and one more output projection +
    loss on the head rank."""
    attention: str = "flash"
    """The attention kernel: ``flash`` (a fused flash-attention kernel: causal block skipping, nothing of size
    ``s x s`` in memory; every engine today) or ``unfused`` (Megatron-LM before flash attention, as Narayanan et
    al. 2021 ran: batched ``Q K^T`` and ``P V`` GEMMs over all ``s x s`` scores, a fused scale-mask-softmax
    kernel and attention dropout on the materialized scores; no published rate: costed at
    ``Efficiency.attention_ratio`` of the GEMM ceiling). Time only (``plan/timing.py``); ``--attention``."""
    loss_compiled: bool = False
    """Engine ``torchtitan``: its cross-entropy runs as one compiled function (``--compiled-loss``; torchtitan
    compiles it under ``training.compile`` from 2025, ``components/loss.py``; its December 2024 benchmarks ran
    it eager): the loss holds the bf16 logits and the bf16 gradient, not the fp32 copies
    (``long_context.TORCHTITAN_COMPILED_LOGIT_BYTES``), and moves fewer bytes (``plan/timing.py``)."""
    grad_dtype: str = "auto"
    """The Megatron-style engines' gradient buffer (main grads): ``auto`` (Megatron-Core's
    ``DistributedDataParallelConfig.grad_reduce_in_fp32 = False``: 16 bits, fp32 under ZeRO-0), ``fp32``
    (Megatron-LM's ``--bf16`` default, megatron/training/arguments.py: ``accumulate_allreduce_grads_in_fp32``
    unless ``--grad-reduce-in-bf16``; DeepSpeed's bf16 optimizer; the Llama 3 paper's FP32 accumulation) or
    ``bf16``. The other engines keep fp32 gradients (:attr:`grad_bytes`). Memory (``plan/memory.py``) and the
    bytes the data-parallel reduction moves (``plan/timing.py``); ``--grad-dtype``."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"parallel.schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}.")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"--recompute {self.recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}.")
        if self.precision not in PRECISION_BYTES:
            raise ConfigError(f"train.precision {self.precision!r} is not one of fp32, bf16, fp16.")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero_stage {self.zero_stage} is not one of 0, 1, 2, 3.")
        if self.fp8 not in FP8_RECIPES:
            raise ConfigError(f"train.fp8 {self.fp8!r} is not one of {', '.join(FP8_RECIPES)}.")
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine {self.engine!r} is not one of {', '.join(ENGINES)}.")
        if self.grad_dtype not in GRAD_DTYPES:
            raise ConfigError(f"--grad-dtype {self.grad_dtype!r} is not one of {', '.join(GRAD_DTYPES)}.")
        if self.loss_compiled and self.engine != "torchtitan":
            raise ConfigError(
                f"--compiled-loss models torchtitan's compiled cross-entropy and the engine is {self.engine}: this "
                "trainer compiles its loss under train.compile on its own and the Megatron-style engines fuse "
                "theirs. Drop --compiled-loss, or plan with --engine torchtitan."
            )
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError(f"--attention {self.attention!r} is not one of {', '.join(ATTENTION_KERNELS)}.")
        if bad := [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]:
            raise ConfigError(
                f"--recompute-modules {','.join(bad)}: each must be one of {', '.join(RECOMPUTE_MODULES)}."
            )
        if self.ep_overlap and not (
            self.megatron_engine and self.ep > 1 and self.pp > 1 and self.schedule != "gpipe"
        ):
            raise ConfigError(
                "--ep-overlap hides each micro-batch's expert-parallel all-to-all behind another micro-batch's "
                "forward or backward, as DualPipe and Megatron-LM's --overlap-moe-expert-parallel-comm do: it "
                f"needs --engine megatron or nemo (got {self.engine}), expert_parallel > 1 (got {self.ep}) and a "
                f"pipeline schedule that pairs forwards with backwards (pipeline_parallel {self.pp}, schedule "
                f"{self.schedule}; any but gpipe). This trainer runs the all-to-all in line: drop --ep-overlap."
            )
        if self.act_fp8_input_store and not (self.megatron_engine and self.fp8 != "none"):
            raise ConfigError(
                "--act-fp8-input-store keeps the MLP activation's input in FP8 (Megatron's "
                f"--activation-func-fp8-input-store): it needs --engine megatron or nemo (got {self.engine}) and "
                f"train.fp8 (got {self.fp8}). Drop it, or plan with both."
            )
        if self.replicas < 1:
            raise ConfigError(f"fault_tolerance.replicas {self.replicas} must be 1 or more.")
        if self.mtp_layers < 0:
            raise ConfigError(f"--mtp-layers {self.mtp_layers} must be 0 or more.")
        if self.reduce_grads not in REDUCE_GRADS:
            raise ConfigError(
                f"parallel.reduce_grads {self.reduce_grads!r} is not one of {', '.join(REDUCE_GRADS)}."
            )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def group_world(self) -> int:
        """Ranks of one replica group (the whole job without replica groups)."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def world_size(self) -> int:
        return self.group_world * self.replicas

    @property
    def shard_degree(self) -> int:
        """Devices one FSDP shard group spans (dp_shard x cp); 1 under ZeRO-0."""
        return 1 if self.zero_stage == 0 else self.dp_shard * self.cp

    @property
    def etp(self) -> int:
        """Expert tensor-parallel degree: ``moe_rules.expert_tp`` (training's rule), ``tp`` without EP."""
        return expert_tp(self)

    @property
    def edp(self) -> int:
        """Expert replicas: the ``dp x cp x tp`` ranks of a stage over ``ep x etp`` (the expert mesh's ``edp``)."""
        return self.dp * self.cp * self.tp // (self.ep * self.etp)

    @property
    def expert_fsdp(self) -> bool:
        """Routed experts in their own FSDP over ``edp`` (``distributed.expert_parallel.fsdp_over_edp``)."""
        return self.ep > 1 and self.zero_stage >= 1 and self.edp > 1

    @property
    def expert_shard_degree(self) -> int:
        """Devices the ZeRO stage shards an expert's state over: the blocks' shard group without EP; under EP
        the ``edp`` replicas with ZeRO >= 1, else 1 (every replica keeps its experts whole)."""
        if self.ep == 1:
            return self.shard_degree
        return self.edp if self.expert_fsdp else 1

    @property
    def dispatch_share(self) -> float:
        """Fraction of a micro-batch's ``T`` tokens whose routed copies one rank dispatches and combines: the
        sequence-parallel share ``1 / tp`` with expert-TP 1 (each TP rank keeps its rows) and in the Megatron
        engines (all-to-all before the expert-TP all-gather); 1 in this trainer with expert-TP ``tp`` (every TP
        rank routes the same all-gathered tokens, distributed/expert_parallel.py)."""
        return 1.0 / self.tp if (self.bf16_weights or self.etp == 1) else 1.0

    @property
    def expert_rows_share(self) -> float:
        """Fraction of ``T`` whose routed rows reach one rank's experts, summed over its ``ep`` peers and
        divided by ``ep / E`` (balanced routing): ``etp / tp`` (whole experts: its own ``T / tp``; expert-TP:
        all ``T`` at width ``H / tp``)."""
        return self.etp / self.tp

    @property
    def bf16_weights(self) -> bool:
        """Engines other than this trainer: bf16 compute weights and residual stream, no autocast copies."""
        return self.engine != "llmtrain"

    @property
    def megatron_engine(self) -> bool:
        """Megatron-style engines (megatron, nemo): persistent bf16 weights and gradient buffer, fused QKV and
        gate-up GEMMs, sequence-parallel inputs saved sharded, backward TP communication overlapped."""
        return self.engine in ("megatron", "nemo")

    @property
    def torchtitan(self) -> bool:
        """torchtitan's FSDP2 + bf16 mixed-precision policy (fp32 master sharded, fp32 gradients)."""
        return self.engine == "torchtitan"

    @property
    def act_bytes(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element as the engine keeps and reduces them: 4 in this trainer and torchtitan
        (fp32 ``reduce_dtype``); in the Megatron-style engines the :attr:`grad_dtype` buffer (``auto``: the
        16-bit buffer with the distributed optimizer, fp32 main grads under ZeRO-0)."""
        if not self.megatron_engine or self.grad_dtype == "fp32":
            return 4
        if self.grad_dtype == "bf16":
            return 2
        return 4 if self.zero_stage == 0 else self.act_bytes

    @property
    def chunks_per_rank(self) -> int:
        """Stage chunks one pipeline rank runs (virtual stages of the multi-chunk schedules; zbv, dualpipev: 2)."""
        if self.pp == 1 or self.schedule not in MULTI_CHUNK_SCHEDULES:
            return 1
        return 2 if self.schedule in V_SCHEDULES else max(self.virtual_stages, 1)

    @property
    def reshards_after_forward(self) -> bool:
        """ZeRO-3's per-block resharding; under PP the trainer runs stage 3 as 2 (feasibility rule pp_zero3)."""
        return self.zero_stage == 3 and self.pp == 1

    @property
    def grad_sync(self) -> str:
        """per_step / replicate_per_step / per_microbatch: ``distributed.grad_sync.sync_mode`` of this layout
        (without accumulation, or under PP, where the schedule reduces on its last micro-batch: per_step). The
        Megatron-style engines: ZeRO 0-1 reduce once per step (DDP's and the distributed optimizer's gradient
        buffer is whole, reduced after the last micro-batch), ZeRO 2-3 every micro-batch (the buffer is sharded:
        Megatron-FSDP's ``optim_grads``, the Llama 3 paper's FSDP reduce-scatter each micro-batch's block
        gradient into the shard; plan/memory.py holds it so)."""
        if self.grad_accum == 1:
            return "per_step"
        if self.megatron_engine:
            return "per_microbatch" if self.zero_stage >= 2 else "per_step"
        if self.pp > 1:
            return "per_step"
        mode = cast(Any, self.reduce_grads)  # one of REDUCE_GRADS (checked in __post_init__)
        return sync_mode(ParallelConfig(zero_stage=self.zero_stage, data_parallel_replicate=self.dp_replicate,
                                        reduce_grads=mode))  # fmt: skip

    def describe(self) -> str:
        dp = f"dp{self.dp}" if self.dp_replicate in (1, self.dp) else f"dp{self.dp_replicate}x{self.dp_shard}"
        parts = [f"tp{self.tp}", f"pp{self.pp}", dp]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + (f"/etp{self.etp}" if self.etp != self.tp else ""))
        parts += [f"zero{self.zero_stage}", f"mbs{self.micro_batch_size}", f"rc-{self.recompute}"]
        if self.pp > 1:
            parts.append(self.schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
            if self.pipeline_layers is not None:
                parts.append("layers" + "-".join(str(n) for n in self.pipeline_layers))
        if self.engine != "llmtrain":
            parts.append(f"engine-{self.engine}")
        if self.grad_dtype != "auto":
            parts.append(f"grad-{self.grad_dtype}")
        if self.tp_overlap and self.tp > 1:
            parts.append("tp-overlap")
        if self.ep_overlap:
            parts.append("ep-overlap")
        if self.act_fp8_input_store:
            parts.append("act-fp8-store")
        if self.loss_compiled:
            parts.append("compiled-loss")
        if self.fp8 != "none":
            parts.append(f"fp8-{self.fp8}")
        if self.recompute_modules:
            parts.append("rc-modules-" + "+".join(self.recompute_modules))
        if self.mtp_layers:
            parts.append(f"mtp{self.mtp_layers}")
        if self.attention != "flash":
            parts.append(f"attn-{self.attention}")
        text = " ".join(parts) + (" offload" if self.offload else "")
        return f"{self.replicas} replica groups x [{text}]" if self.replicas > 1 else text


def chunk_layers(args: TransformerArgs, lay: Layout) -> list[int]:
    """Layers of each of the ``pp x chunks_per_rank`` stage chunks, in model order."""
    n_chunks = lay.pp * lay.chunks_per_rank
    if lay.pipeline_layers is not None and len(lay.pipeline_layers) == n_chunks:
        return list(lay.pipeline_layers)
    base, extra = divmod(args.num_layers, n_chunks)
    return [base + (1 if c < extra else 0) for c in range(n_chunks)]


def rank_chunks(lay: Layout, rank: int) -> list[int]:
    """The stage chunks pipeline rank ``rank`` runs (distributed/pipeline.stage_ids)."""
    if lay.chunks_per_rank == 1:
        return [rank]
    if lay.schedule in V_SCHEDULES:
        return [rank, 2 * lay.pp - 1 - rank]
    return [rank + i * lay.pp for i in range(lay.chunks_per_rank)]


@dataclass(frozen=True)
class RankShape:
    """What one pipeline rank holds: its blocks (dense and MoE), the embedding, the output head."""

    rank: int
    chunks: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    dense_layers: int
    moe_layers: int
    embedding: bool
    head: bool
    mtp: int = 0
    """Multi-token-prediction layers on this rank (the head rank: ``Layout.mtp_layers``), counted in the
    block counts above; each adds one more output projection + loss."""

    @property
    def layers(self) -> int:
        return self.dense_layers + self.moe_layers


def rank_shapes(args: TransformerArgs, lay: Layout) -> list[RankShape]:
    """One :class:`RankShape` per pipeline rank."""
    sizes = chunk_layers(args, lay)
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    out = []
    for r in range(lay.pp):
        chunks = rank_chunks(lay, r)
        ids = [i for c in chunks for i in range(starts[c], starts[c] + sizes[c])]
        head = len(sizes) - 1 in chunks
        mtp = lay.mtp_layers if head else 0  # blocks of the last layer's kind
        ids += [args.num_layers - 1] * mtp
        moe = sum(args.is_moe_layer(i) for i in ids)
        out.append(RankShape(r, tuple(chunks), tuple(sizes[c] for c in chunks), len(ids) - moe, moe,
                             0 in chunks, head, mtp))  # fmt: skip
    return out


class ParamShape:
    """Parameter counts of one block and of the model's ends, split as tensor/expert parallel splits them."""

    def __init__(self, args: TransformerArgs) -> None:
        self.args = args

    @cached_property
    def norms(self) -> int:
        """Norm weights of one block (replicated over TP)."""
        a = self.args
        n = (4 if getattr(a, "post_norms", False) else 2) * a.hidden_size
        return n + (2 * a.head_dim if a.qk_norm else 0)

    @cached_property
    def attention(self) -> int:
        """Attention weights of one block (split over TP)."""
        a = self.args
        return a._layer_params() - a._dense_ffn_params() - self.norms

    @cached_property
    def dense_ffn(self) -> int:
        return self.args._dense_ffn_params()

    @cached_property
    def router(self) -> int:
        return self.args.hidden_size * self.args.num_experts

    @cached_property
    def shared(self) -> int:
        """Shared experts of one MoE block (split over TP like a dense MLP)."""
        a = self.args
        return a.shared_experts * 3 * a.hidden_size * a.moe_hidden_size

    @cached_property
    def routed(self) -> int:
        """All routed experts of one MoE block."""
        a = self.args
        return a.num_experts * 3 * a.hidden_size * a.moe_hidden_size

    def dense_block(self, tp: int, moe: bool) -> float:
        """Dense (FSDP-sharded) parameters of one block on one TP rank."""
        if moe:
            return (self.attention + self.shared) / tp + self.norms + self.router
        return (self.attention + self.dense_ffn) / tp + self.norms

    def expert_block(self, etp: int, ep: int) -> float:
        """Routed-expert parameters of one MoE block on one rank of the expert mesh: split over ``ep`` and the
        expert tensor-parallel degree ``etp`` (:attr:`Layout.etp`, 1 when EP is drawn from TP ranks)."""
        return self.routed / (etp * ep)

    def embedding(self, tp: int) -> float:
        return self.args.vocab_size * self.args.hidden_size / tp

    def head(self, tp: int, pp: int) -> float:
        """Final norm + output projection (tied to the embedding only without PP)."""
        a = self.args
        return a.hidden_size + (0 if a.tie_word_embeddings and pp == 1 else a.vocab_size * a.hidden_size / tp)


def rank_params(args: TransformerArgs, lay: Layout, shape: RankShape) -> tuple[float, float]:
    """(dense, expert) parameters of one (TP, EP) rank of pipeline rank ``shape.rank``, before ZeRO sharding."""
    ps = ParamShape(args)
    dense = shape.dense_layers * ps.dense_block(lay.tp, False) + shape.moe_layers * ps.dense_block(
        lay.tp, True
    )
    if shape.embedding:
        dense += ps.embedding(lay.tp)
    if shape.head:
        dense += ps.head(lay.tp, lay.pp)
    dense += shape.mtp * 2 * args.hidden_size * args.hidden_size / lay.tp  # MTP's 2h -> h projection
    return dense, shape.moe_layers * ps.expert_block(lay.etp, lay.ep)


__all__ = [
    "ENGINES", "GRAD_DTYPES", "Layout", "PRECISION_BYTES", "ParamShape", "RECOMPUTE_MODES", "RECOMPUTE_MODULES",
    "RankShape", "SCHEDULES", "chunk_layers", "rank_chunks", "rank_params", "rank_shapes",
]  # fmt: skip

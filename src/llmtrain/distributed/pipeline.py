"""Pipeline parallelism from the YAML: stage split, placement, schedule and the per-step runner.

The approach is torchtitan's ``pipeline_module_split``, adapted so that the rest of the trainer (optimizer,
checkpoints, host snapshots, fault drills) keeps seeing *one* module per rank:

1. The full model is built on the meta device. Layers are assigned to ``pp x virtual_stages`` stage chunks
   (``parallel.pipeline_layers``, or an even split); chunk ``s`` holds a contiguous run of layers.
2. Chunks are placed on pipeline ranks: loop style (rank ``r`` holds ``r, r + pp, r + 2pp, ...``) for every
   schedule but ``zbv``, which needs the V shape (rank ``r`` holds ``r`` and ``2pp - 1 - r``).
3. The *rank model* is the meta model pruned in place to this rank's layers (``tok_embeddings`` kept only if
   the rank holds chunk 0, ``norm`` / ``output`` only if it holds the last chunk). The ``layers`` ModuleDict
   keeps the original indices as keys, so parameter names are the full model's FQNs and a DCP checkpoint
   written under one layout loads under any other (PP2 -> single process included).
4. Each chunk is a *stage module*: a shell Transformer that shares the rank model's submodules (no copy of
   any parameter). TP -> recompute -> compile -> FSDP are applied per stage module by ``parallelize``
   (FSDP with ``reshard_after_forward=False`` under PP, see the CPU notes), so the shared parameters become
   the sharded DTensors the rank model, the optimizer and the checkpointer see.
5. :class:`PipelineRunner` feeds this rank's micro-batches (concatenated to the local batch ``[B, T]``) to
   torch's schedule, which splits them into ``parallel.micro_batch_num`` pipeline micro-batches (the default
   1 means "one per gradient-accumulation step", i.e. micro-batches of ``train.micro_batch_size``). The loss
   function given to the schedule is the trainer's (summed token CE) times the trainer's normalisation
   (``dp / tokens in the global batch`` when FSDP averages), with ``scale_grads=False``, so the gradients are
   exactly the single-process ones. The summed CE of the last stage is all-reduced over the pp group, so every
   rank returns the same loss; the grad norm is reduced over the pp group by ``precision.grad_norm_``.
   With replica groups (``fault_tolerance``, ft/) one schedule run takes one group's slot of the global batch
   (the micro-batches are counted over data parallel x replicas); under ``keep`` a survivor runs the schedule
   once per slot it computes, the gradients accumulating (train/step.py; the cross-group sum: ft/grads.py).

Which pipeline layouts are legal (schedule vs virtual stages, micro-batch counts, the layer split, compile
with zero-bubble schedules) is decided by :mod:`llmtrain.feasibility` only; the runner
asserts it with the same function before building.

Context parallel (``parallel.context_parallel > 1``, distributed/context_parallel.py) composes: the runner feeds
this rank's load-balanced chunks of every sequence (``[B, T / cp]`` ids, labels and global positions), so the
stages pass the hidden states of the local chunks. The attention masks (local queries vs all keys) differ per
pipeline micro-batch with document masks: each stage module has a forward pre-hook
(``ContextParallel.stage_pre_hook``) that builds them from the keyword arguments the schedule split for that
micro-batch (the local ``position_ids`` and the global ``document_ids [b, T]``), right before the stage's
forward; backward needs none (the additive mask is in the micro-batch's autograd graph). The rank model
carries the CP object too, for the train step's loss sum and gradient scale.

Tied input / output embeddings (``model.tie_word_embeddings``): the last stage's head holds a copy of the
first stage's embedding, gradients summed and the two kept equal (:class:`TiedEmbedding`).

MoE blocks (expert counts for the aux-loss-free bias, the aux-loss gradient scale) are accounted per pipeline
micro-batch by ``models/common/moe.PipelineMoEStats``, hooked on the stage modules.

Every stage gets ``position_ids [B, T]`` as a keyword argument: under sequence parallel a middle stage
receives only its sequence slice ``[B, T / tp, dim]`` and could not infer the full length from its input.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.config.schema import Config, ParallelConfig
from llmtrain.distributed import context_parallel
from llmtrain.distributed.parallel_dims import ParallelDims
from llmtrain.distributed.parallelize import parallelize
from llmtrain.feasibility import (
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    pipeline_microbatches,
    pipeline_split_problems,
    raise_fatal,
    require_feasible,
    schedule_name,
)
from llmtrain.models import Transformer
from llmtrain.models.common.moe import PipelineMoEStats, moe_layers

# config name -> torch.distributed.pipelining class name (explicit registry; imported lazily)
SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SINGLE_STAGE = SINGLE_STAGE_SCHEDULES  # one chunk per rank; the others are multi-stage schedules
# schedule_name and pipeline_microbatches (pure arithmetic the rules share) live in llmtrain.feasibility and are
# importable from here as before.


def layers_per_stage(num_layers: int, p: ParallelConfig) -> list[int]:
    """Layers of each stage chunk (in model order), from ``parallel.pipeline_layers`` or an even split
    (ConfigError, the feasibility message, for a split that does not fit)."""
    raise_fatal(pipeline_split_problems(num_layers, p))
    if p.pipeline_layers is None:
        n_chunks = p.pipeline_parallel * p.virtual_stages
        return [num_layers // n_chunks] * n_chunks
    return list(p.pipeline_layers)


def stage_ids(pp_rank: int, p: ParallelConfig) -> list[int]:
    """The stage chunks pipeline rank ``pp_rank`` holds, in execution order of its schedule."""
    pp, v = p.pipeline_parallel, p.virtual_stages
    if schedule_name(p) in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(v)]


def split_model(
    model: Transformer, stages: list[int], counts: list[int]
) -> tuple[Transformer, list[Transformer]]:
    """Prune ``model`` (meta) in place to the layers of ``stages``; return it and one shell module per stage.

    The shells share every submodule with the pruned model (``deepcopy`` with all submodules memoised), so
    parameters exist once and keep their full-model names in the pruned model.
    """
    n_chunks = len(counts)
    starts = [sum(counts[:s]) for s in range(n_chunks)]
    keys_of = {s: [str(i) for i in range(starts[s], starts[s] + counts[s])] for s in stages}
    kept = {k for s in stages for k in keys_of[s]}
    for key in [k for k in model.layers if k not in kept]:
        del model.layers[key]
    if model.args.tie_word_embeddings and n_chunks - 1 in stages:  # the head's own copy (TiedEmbedding)
        assert model.output is not None
        model.pipeline_untied = True
        model.output.weight = nn.Parameter(torch.empty_like(model.output.weight))
    if 0 not in stages:
        model.tok_embeddings = None
    if n_chunks - 1 not in stages:
        model.norm = None
        model.output = None
    parts = []
    for s in stages:
        memo = {id(m): m for m in model.modules() if m is not model}
        shell = copy.deepcopy(model, memo)
        shell.layers = nn.ModuleDict({k: model.layers[k] for k in keys_of[s]})
        if s != 0:
            shell.tok_embeddings = None
        if s != n_chunks - 1:
            shell.norm = None
            shell.output = None
        parts.append(shell)
    return model, parts


@dataclass
class _StepState:
    """What the schedule's loss function needs during one ``step`` (set by the runner, read by the loss)."""

    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    scale: float = 1.0
    recorded: list[torch.Tensor] | None = None
    chunked: bool = False  # the last stage returned its summed loss (the chunked loss, train/loss.py)


class PipelineRunner:
    """Runs one pipeline step (train or eval) over this rank's micro-batches; see the module docstring."""

    def __init__(
        self,
        cfg: Config,
        dims: ParallelDims,
        meshes: dict,
        model: Transformer,
        device: torch.device,
        ce_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        from torch.distributed import pipelining

        p = cfg.parallel
        args = model.args
        require_feasible(cfg, dims.world_size, args)  # validation already refused the others
        self.cfg, self.device, self.ce_loss = cfg, device, ce_loss
        pp_mesh = meshes["pp"]
        self.pp_group = pp_mesh.get_group()
        counts = layers_per_stage(args.num_layers, p)
        self.stage_ids = stage_ids(pp_mesh.get_local_rank(), p)
        pruned, self.parts = split_model(model, self.stage_ids, counts)
        self.model: nn.Module = pruned  # this rank's Transformer, pruned to its stages' layers
        self.fsdp = False
        for part in self.parts:
            self.fsdp = parallelize(part, cfg, dims, meshes["world"], device.type)
        n_chunks = len(counts)
        self.stages = [
            pipelining.PipelineStage(part, s, n_chunks, device, group=self.pp_group)
            for part, s in zip(self.parts, self.stage_ids)
        ]
        self.has_first = 0 in self.stage_ids
        self.has_last = n_chunks - 1 in self.stage_ids
        self.n_chunks, self.pp_rank = n_chunks, pp_mesh.get_local_rank()
        self.owner = {s: r for r in range(p.pipeline_parallel) for s in stage_ids(r, p)}  # stage -> pp rank
        self._state = _StepState()
        ft = cfg.fault_tolerance  # replica groups: a schedule run takes one group's slot (ft/data.py)
        self.n_mb = pipeline_microbatches(cfg, dims.dp * (ft.replicas if ft.enabled else 1))
        name = schedule_name(p)
        schedule_cls = getattr(pipelining, SCHEDULES[name])
        stages = self.stages[0] if name in SINGLE_STAGE else self.stages
        self.schedule = schedule_cls(stages, n_microbatches=self.n_mb, loss_fn=self._loss, scale_grads=False)
        self.moe = PipelineMoEStats(self.parts) if moe_layers(self.model) else None
        self.tied = TiedEmbedding(self.model, meshes["world"], self.owner[0], self.owner[n_chunks - 1])
        self.cp = context_parallel.find(self.parts[0])  # context parallel: one per stage module
        if self.cp is not None:
            setattr(self.model, "context_parallel", self.cp)  # noqa: B010  (the step's loss sum, grad scale)
            for part in self.parts:  # each stage forward builds the masks of its pipeline micro-batch
                cp = context_parallel.find(part)
                assert cp is not None
                part.register_forward_pre_hook(cp.stage_pre_hook, with_kwargs=True)

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one pipeline micro-batch: logits [b, T, vocab], labels [b, T]."""
        st = self._state
        loss = output if st.chunked else self.ce_loss(output, labels)
        if st.transform is not None:
            loss = st.transform(loss)
        if st.recorded is not None:
            st.recorded.append(loss.detach())
        return loss * st.scale

    def _inputs(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[tuple, dict, torch.Tensor]:
        """Positional args (input ids on the first stage's rank only), keyword args and labels [B, T]."""
        batch = {k: torch.cat([mb[k] for mb in micro_batches]).to(self.device) for k in micro_batches[0]}
        ids = batch["input_ids"]  # [B, T]
        kwargs: dict[str, torch.Tensor] = {}
        if self.cp is not None:  # this rank's sequence chunks [B, T / cp]; masks per micro-batch (pre-hook)
            local = self.cp.local(batch, self.cfg.model.document_mask)
            kwargs["position_ids"] = local["position_ids"]
            if self.cfg.model.document_mask:
                kwargs["document_ids"] = batch["document_ids"]  # global [B, T]: only the stage hook reads it
            args = (local["input_ids"],) if self.has_first else ()
            return args, kwargs, local["labels"]
        if self.cfg.model.document_mask:
            kwargs["position_ids"] = batch["position_ids"]
            kwargs["document_ids"] = batch["document_ids"]
        else:
            kwargs["position_ids"] = (
                torch.arange(ids.shape[1], device=self.device).expand_as(ids).contiguous()
            )
        args = (ids,) if self.has_first else ()
        return args, kwargs, batch["labels"]

    def _reduce(self, recorded: list[torch.Tensor]) -> torch.Tensor:
        """Sum of the recorded losses on the last stage, shared with every rank of the pp group.

        On the first step torch's stage-metadata inference also calls the loss (on uninitialised tensors)
        before the real micro-batches: only the last ``n_mb`` calls are the step's losses."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.has_last:
            n_mb = self.n_mb
            assert len(recorded) >= n_mb, (len(recorded), n_mb)
            for loss in recorded[-n_mb:]:
                total += loss.float()
        dist.all_reduce(total, group=self.pp_group)
        return total

    def train_step(
        self,
        micro_batches: list[dict[str, torch.Tensor]],
        scale: float,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward + backward of this rank's micro-batches; returns their summed (transformed) token CE.

        The loss backpropagated per pipeline micro-batch is ``transform(CE sum) * scale``.
        """
        from llmtrain.train.precision import autocast

        args, kwargs, labels = self._inputs(micro_batches)
        recorded: list[torch.Tensor] = []
        head_loss = self._head_loss()
        if head_loss is not None:  # the last stage runs the chunked loss in its forward on its labels
            kwargs = {**kwargs, "labels": labels}
        self._set_head_loss(head_loss)
        self._state = _StepState(transform, scale, recorded, chunked=head_loss is not None)
        tokens_per_mb = 0.0
        if self.moe is not None:  # the aux loss of each pipeline micro-batch weighs its (mean) tokens
            tokens_per_mb = int((labels != -100).sum()) / self.n_mb
            self.moe.before_step(self.model, tokens_per_mb * scale)
        with autocast(self.cfg.train.precision, self.device.type):
            self.schedule.step(*args, target=labels, return_outputs=False, **kwargs)
        self._set_head_loss(None)
        self.tied.after_backward()
        if self.moe is not None:  # several runs in one step (replica groups' keep): their figures add up
            self.moe.after_step(self.model, self.n_mb, tokens_per_mb)
        self._state = _StepState()
        return self._reduce(recorded)

    def _head_loss(self) -> Any:
        """The chunked loss of this step (``train.loss_chunk_tokens`` by the trainer's rule, train/loss.py) with
        the trainer loss's current settings, or None for the plain loss on the last stage's logits."""
        from llmtrain.train.loss import HeadLoss, resolve_loss_chunk

        vocab = int(getattr(getattr(self.model, "args", None), "vocab_size", 0))
        chunk = resolve_loss_chunk(self.cfg.train.loss_chunk_tokens, vocab)
        if not chunk:
            return None
        ce = cast(Any, self.ce_loss)  # the trainer's TokenLoss (train/step.py)
        return HeadLoss(chunk, ce.label_smoothing, ce.compiled, ce.z_loss, ce.stats)

    def _set_head_loss(self, head_loss: Any) -> None:
        """Give the last stage's module its chunked loss (None: back to logits, as eval and lm-eval need)."""
        if self.has_last:
            mine = dict(zip(self.stage_ids, self.parts))
            cast(Any, mine[self.n_chunks - 1]).head_loss = head_loss

    def before_optimizer_step(self) -> None:
        """Called by train/step.py after clipping, right before the optimizer step: the tied head's copy of the
        embedding gets the embedding's final gradient (:class:`TiedEmbedding`; nothing when untied)."""
        if self.tied.tied and (self.tied.emb is not None or self.tied.copy is not None):
            self.tied.before_step()

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Summed token CE of the micro-batches, forward only, same on every pp rank.

        Runs the stages one after another per pipeline micro-batch with plain send / recv rather than
        ``schedule.eval``: torch's ZBV runtime still executes its backward actions in eval mode and fails.
        """
        from llmtrain.train.precision import autocast

        args, kwargs, labels = self._inputs(micro_batches)
        n_mb = self.n_mb
        ids = torch.tensor_split(labels if not args else args[0], n_mb)  # (unused without the first stage)
        kw = [
            dict(zip(kwargs, vals)) for vals in zip(*(torch.tensor_split(v, n_mb) for v in kwargs.values()))
        ]
        targets = torch.tensor_split(labels, n_mb)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        with autocast(self.cfg.train.precision, self.device.type):
            for m in range(n_mb):
                logits = self._forward_stages(ids[m], **kw[m])
                if logits is not None:
                    total += self.ce_loss(logits, targets[m]).float()
        dist.all_reduce(total, group=self.pp_group)
        return total

    @torch.no_grad()
    def forward_logits(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[B, T, vocab]`` of token ids ``[B, T]`` (the same on every pp rank), forward only, on the
        rank that holds the last stage; None on the others. The stages run one after another with plain send /
        recv, as in :meth:`eval_loss`; any ``[B, T]`` (T a multiple of the TP degree under sequence parallel).
        The caller chooses the autocast (downstream evaluation: llmtrain/eval/forward.py)."""
        ids = ids.to(self.device)
        position_ids = torch.arange(ids.shape[1], device=self.device).expand_as(ids).contiguous()
        return self._forward_stages(ids, position_ids=position_ids)

    def _forward_stages(self, ids: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | None:
        """This rank's stages of one forward-only pass, in stage order, activations sent / received between
        ranks; the last stage's output (logits) on its rank, None on the others."""
        mine = dict(zip(self.stage_ids, self.parts))
        h: torch.Tensor | None = None
        for s in range(self.n_chunks):
            if s not in mine:
                continue
            if s > 0 and self.owner[s - 1] != self.pp_rank:
                h = self._recv(self.owner[s - 1])
            h = mine[s](ids if s == 0 else h, **kwargs)  # [b, T(/tp), dim] or logits
            if s == self.n_chunks - 1:
                return h
            if self.owner[s + 1] != self.pp_rank:
                self._send(h, self.owner[s + 1])
        return None

    def _send(self, t: torch.Tensor, pp_peer: int) -> None:
        """Send an activation (shape and dtype first) to pipeline rank ``pp_peer``."""
        peer = dist.get_global_rank(self.pp_group, pp_peer)
        header = torch.zeros(8, dtype=torch.int64)
        header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
        header[2 : 2 + t.dim()] = torch.tensor(t.shape)
        dist.send(header.to(self.device), peer, group=self.pp_group)
        dist.send(t.contiguous(), peer, group=self.pp_group)

    def _recv(self, pp_peer: int) -> torch.Tensor:
        peer = dist.get_global_rank(self.pp_group, pp_peer)
        header = torch.zeros(8, dtype=torch.int64, device=self.device)
        dist.recv(header, peer, group=self.pp_group)
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        out = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=self.device)
        dist.recv(out, peer, group=self.pp_group)
        return out


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP / TP), the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class TiedEmbedding:
    """Tied input / output embeddings under pipeline parallel, as Megatron shares the word embedding.

    The first stage owns ``tok_embeddings.weight``; the last stage's head ``output.weight`` is a copy of it
    (:func:`split_model` gives it its own parameter; ``init_weights`` draws it from the embedding's generator,
    so both start equal). Both are sharded alike by FSDP / TP (the TP plans shard both over the vocabulary),
    so their local shards match element for element across the pipeline ranks that hold them:

    * after the backward (:meth:`after_backward`) the copy's gradient is summed into the embedding's (a reduce
      over the two ranks, a local add when one rank holds both, as ZBV's rank 0 does) and the copy's is
      dropped: the grad norm and clipping then see the tied weight once, as on one process;
    * right before each optimizer step (:meth:`before_step`, called by ``PipelineRunner.before_optimizer_step``
      from train/step.py after clipping) the copy gets the embedding's final (unscaled, clipped) gradient, so the two identical optimizer updates keep the
      weights equal; the checkpoint holds both (equal) and loads on one process, where they are one tensor.
    """

    def __init__(self, model: Transformer, world: object, first: int, last: int) -> None:
        self.model = model
        self.tied = model.args.tie_word_embeddings
        self.group: dist.ProcessGroup | None = None
        self.src = -1
        if not self.tied:
            return
        if first != last:  # one group per pipeline (every rank creates all of them, in the same order)
            mesh = cast(Any, world)
            dim = mesh.mesh_dim_names.index("pp")
            ranks = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.shape[dim])
            me = dist.get_rank()
            for row in ranks.tolist():
                group = dist.new_group([row[first], row[last]])
                if me in (row[first], row[last]):
                    self.group, self.src = group, row[first]

    @property
    def emb(self) -> nn.Parameter | None:
        """The embedding on this rank (looked up each time: ``to_empty`` replaces the meta parameters)."""
        emb = self.model.tok_embeddings
        return cast(nn.Parameter, emb.weight) if self.tied and emb is not None else None

    @property
    def copy(self) -> nn.Parameter | None:
        """The head's copy of the embedding on this rank."""
        out = self.model.output
        return cast(nn.Parameter, out.weight) if self.tied and out is not None else None

    @torch.no_grad()
    def after_backward(self) -> None:
        """Sum the copy's gradient into the embedding's; drop the copy's."""
        if self.emb is None and self.copy is None:
            return
        if self.emb is not None and self.copy is not None:  # one rank holds both stages
            if self.copy.grad is not None:
                self.emb.grad = self.copy.grad if self.emb.grad is None else self.emb.grad + self.copy.grad
            self.copy.grad = None
            return
        param = cast(nn.Parameter, self.emb if self.emb is not None else self.copy)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.reduce(_local(param.grad), self.src, group=self.group)
        if self.copy is not None:
            self.copy.grad = None

    @torch.no_grad()
    def before_step(self) -> None:
        """The embedding's gradient, as the optimizer will use it, handed to the copy."""
        if self.emb is not None and self.emb.grad is None:
            self.emb.grad = torch.zeros_like(self.emb)
        if self.emb is not None and self.copy is not None:
            self.copy.grad = cast(torch.Tensor, self.emb.grad).clone()
            return
        if self.copy is not None:
            self.copy.grad = torch.zeros_like(self.copy)
        param = cast(nn.Parameter, self.emb if self.emb is not None else self.copy)
        dist.broadcast(_local(cast(torch.Tensor, param.grad)), self.src, group=self.group)

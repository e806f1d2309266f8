"""The peers of bench/train_throughput.py: torchtitan, OLMo-core and litgpt at llmtrain's shape, and the GEMM limit.

Each peer's own Llama model class is built from its own config API at exactly llmtrain's shape (hidden, layers,
heads, KV heads, FFN width, vocabulary, sequence length, RoPE theta, RMSNorm eps, untied output) and driven by
the same plain loop as the ``bare`` way (forward, ``F.cross_entropy``, backward, clip 1.0, fused AdamW) on the
same token windows; in the compiled rounds the loop's cross-entropy is compiled too (as torchtitan's trainer
and llmtrain's ``train.compile`` do), so the ways differ in their models only. The script asserts that every peer has llmtrain's parameter count. Choices per peer:

- torchtitan 0.3: ``Llama3Model`` with its fused-QKV GQA attention. Its language-model attention backends are
  flex and varlen (positions-aware, for packed documents); the bench's windows are plain causal, so the inner
  attention is torchtitan's own ``ScaledDotProductAttention`` (causal SDPA), the kernel llmtrain and hf use.
  Llama 3 RoPE scaling as llmtrain's (factor 8, low 1, high 4, original 8192). Compile: its ``apply_compile``
  (per block, fullgraph). It imports ``triton`` at import time (its CUDA expert-parallel kernels, never run
  here), which the CPU build of torch does not bring: the ``bench`` extra names it.
- OLMo-core 3.0: ``TransformerConfig.llama_like`` (torch SDPA backend) with the FFN width given directly. Its
  RoPE scaling is parametrised by spectrum proportions, not Llama 3's factors, so it runs unscaled (the same
  cost: the table is computed once). Two ways: its model in the plain loop, and its ``TransformerTrainModule``
  (``train_batch`` + ``optim_step``: its loss, backward, grad clipping and optimizer step, the part of its
  ``Trainer`` runs per batch; the Trainer proper owns the loop, ``fit`` over its own data loader to its
  max duration, so it cannot take turns step by step; its metric bookkeeping is stood in for, see below).
  Compile: ``Transformer.apply_compile`` (per block + LM head); the train module's ``compile_model=True``
  does the same, but on CUDA only (on a CPU it logs a warning and stays eager; the bench says so).
- litgpt 0.5: ``litgpt.GPT`` from a ``Config`` written like its Llama 3.2 entries. Compile: ``torch.compile``
  of the whole model, as litgpt's pretrain script does.

The GEMM limit times the model's own linear layers at ``tokens`` rows: for each (in, out) the forward
``F.linear``, the input-gradient and the weight-gradient matmuls, weighted by how many such layers there are,
and reports FLOPs / seconds of the whole mix: what a step would cost if it were nothing but its GEMMs.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shape:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    theta: float
    eps: float
    scaling: dict[str, Any] | None


def shape_of(margs: Any, seq: int) -> Shape:
    return Shape(
        margs.hidden_size,
        margs.num_layers,
        margs.num_heads,
        margs.num_kv_heads,
        margs.intermediate_size,
        margs.vocab_size,
        seq,
        float(margs.rope_theta),
        float(margs.rms_norm_eps),
        dict(margs.rope_scaling) if margs.rope_scaling else None,
    )


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------- torchtitan
def torchtitan_model(s: Shape, device: torch.device) -> nn.Module:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    lin = {"weight": lambda t: nn.init.trunc_normal_(t, std=0.02), "bias": nn.init.zeros_}
    norm_init = {"weight": nn.init.ones_}
    sc = s.scaling or {}
    rope = ComplexRoPE.Config(
        dim=s.dim // s.heads,
        max_seq_len=s.seq,
        theta=s.theta,
        scaling="llama" if sc.get("rope_type") == "llama3" else "none",
        scaling_factor=float(sc.get("factor", 8.0)),
        low_freq_factor=float(sc.get("low_freq_factor", 1.0)),
        high_freq_factor=float(sc.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(sc.get("original_max_position_embeddings", 8192)),
    )

    def norm() -> Any:
        return RMSNorm.Config(normalized_shape=s.dim, eps=s.eps, param_init=norm_init)

    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=norm(),
            ffn_norm=norm(),
            attention=make_gqa_config(
                dim=s.dim,
                n_heads=s.heads,
                n_kv_heads=s.kv_heads,
                wqkv_param_init=lin,
                wo_param_init=lin,
                inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=True,
                rope=rope,
            ),
            feed_forward=make_ffn_config(dim=s.dim, hidden_dim=s.ffn, w1_param_init=lin, w2w3_param_init=lin),
        )
        for _ in range(s.layers)
    ]
    cfg = Llama3Model.Config(
        dim=s.dim,
        vocab_size=s.vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=s.vocab, embedding_dim=s.dim, param_init={"weight": nn.init.normal_}
        ),
        norm=norm(),
        lm_head=Linear.Config(in_features=s.dim, out_features=s.vocab, param_init=lin),
        layers=layers,
    )
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=device)
    return model


def torchtitan_compile(model: nn.Module) -> nn.Module:
    from torchtitan.config.configs import CompileConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.parallel_dims import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    apply_compile(model, compile_config=CompileConfig(enable=True), parallel_dims=dims)
    return model


# ---------------------------------------------------------------------------------------------- OLMo-core
def olmo_config(s: Shape) -> Any:
    from olmo_core.nn.attention.backend import AttentionBackendName
    from olmo_core.nn.feed_forward import FeedForwardConfig
    from olmo_core.nn.transformer import TransformerConfig

    return TransformerConfig.llama_like(
        d_model=s.dim,
        vocab_size=s.vocab,
        n_layers=s.layers,
        n_heads=s.heads,
        n_kv_heads=s.kv_heads,
        layer_norm_eps=s.eps,
        rope_theta=int(s.theta),
        attn_backend=AttentionBackendName.torch,
        feed_forward=FeedForwardConfig(hidden_size=s.ffn, bias=False),
    )


def olmo_model(s: Shape, device: torch.device) -> nn.Module:
    model = olmo_config(s).build(init_device="meta")
    model.init_weights(max_seq_len=s.seq, device=device)
    return model


def olmo_compile(model: nn.Module) -> nn.Module:
    model.apply_compile()  # type: ignore[operator]
    return model


def olmo_train_module(model: nn.Module, s: Shape, batch_tokens: int, compile_: bool) -> Any:
    """OLMo-core's ``TransformerTrainModule`` over ``model``: its loss, backward, clip 1.0 and AdamW."""
    from olmo_core.optim import AdamWConfig
    from olmo_core.train.train_module import TransformerTrainModule

    return TransformerTrainModule(
        model=model,  # type: ignore[arg-type]
        optim=AdamWConfig(lr=1e-3, fused=True),
        rank_microbatch_size=batch_tokens,
        max_sequence_length=s.seq,
        max_grad_norm=1.0,
        compile_model=compile_,
        autocast_precision=torch.bfloat16 if next(model.parameters()).device.type == "cuda" else None,
    )


class _NullTrainer:
    """What ``TransformerTrainModule`` reads from its ``Trainer`` per batch: the device, and metric recording.

    Like the Trainer, it keeps the step's metrics (detached tensors, no host sync); it never reduces or logs
    them, which the Trainer does once per ``metrics_collect_interval`` steps.
    """

    def __init__(self, device: torch.device, global_batch_size: int) -> None:
        self.device = device
        self.global_batch_size = global_batch_size
        self.dp_process_group = None
        self.metrics: dict[str, Any] = {}

    def record_metric(
        self, name: str, value: Any, *args: Any, namespace: str | None = None, **kw: Any
    ) -> None:
        self.metrics[f"{namespace}/{name}" if namespace else name] = (
            value.detach() if isinstance(value, torch.Tensor) else value
        )

    def record_ce_loss(self, value: Any, reduce_type: Any = None) -> None:
        self.record_metric("train/CE loss", value)


# ------------------------------------------------------------------------------------------------- litgpt
def litgpt_model(s: Shape, device: torch.device) -> nn.Module:
    from litgpt import GPT, Config

    sc = s.scaling or {}
    adjust = (
        {
            "factor": float(sc["factor"]),
            "low_freq_factor": float(sc["low_freq_factor"]),
            "high_freq_factor": float(sc["high_freq_factor"]),
            "original_max_seq_len": int(sc["original_max_position_embeddings"]),
        }
        if sc.get("rope_type") == "llama3"
        else None
    )
    cfg = Config(
        name="llmtrain-bench",
        block_size=s.seq,
        vocab_size=s.vocab,
        padded_vocab_size=s.vocab,
        n_layer=s.layers,
        n_embd=s.dim,
        n_head=s.heads,
        n_query_groups=s.kv_heads,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=s.eps,
        mlp_class_name="LLaMAMLP",
        intermediate_size=s.ffn,
        rope_base=int(s.theta),
        rope_adjustments=adjust,
    )
    with torch.device(device):
        return GPT(cfg)


# ------------------------------------------------------------------------------------------ the ways
def build(name: str, s: Shape, device: torch.device) -> nn.Module:
    return {"torchtitan": torchtitan_model, "olmo": olmo_model, "litgpt": litgpt_model}[name](s, device)


def compile_model(name: str, model: nn.Module) -> nn.Module:
    if name == "torchtitan":
        return torchtitan_compile(model)
    if name == "olmo":
        return olmo_compile(model)
    return cast(nn.Module, torch.compile(model))  # litgpt, hf: the whole module


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def plain_step(
    model: nn.Module, params: nn.Module, batches: list[dict], device: torch.device, amp: Any, hf: bool = False,
    compile_loss: bool = False,
) -> Callable[[], None]:  # fmt: skip
    """One training step of the plain loop over ``batches`` (cycled), the loop every reference way shares;
    ``compile_loss``: the cross-entropy under torch.compile too (compiled rounds: torchtitan's trainer compiles
    its loss by default, ``compile.components = ["model", "loss"]``, and so does llmtrain's ``train.compile``)."""
    opt = torch.optim.AdamW(params.parameters(), lr=1e-3, fused=True)
    loss_fn = cast(Callable[..., torch.Tensor], torch.compile(_token_loss)) if compile_loss else _token_loss
    i = [0]

    def step() -> None:
        mb = batches[i[0] % len(batches)]
        i[0] += 1
        x, y = mb["input_ids"].to(device), mb["labels"].to(device)
        with amp:
            logits = model(input_ids=x).logits if hf else model(x)
        loss_fn(logits, y).backward()
        torch.nn.utils.clip_grad_norm_(params.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def olmo_trainer_step(
    model: nn.Module, s: Shape, batches: list[dict], device: torch.device, compile_: bool
) -> Callable[[], None]:
    tokens = batches[0]["input_ids"].numel()
    tm = olmo_train_module(model, s, tokens, compile_)
    tm._attach_trainer(_NullTrainer(device, tokens))
    i = [0]

    def step() -> None:
        mb = batches[i[0] % len(batches)]
        i[0] += 1
        tm.zero_grads()
        tm.train_batch({"input_ids": mb["input_ids"].to(device), "labels": mb["labels"].to(device)})
        tm.optim_step()

    return step


# ------------------------------------------------------------------------------------------ GEMM limit
def linear_shapes(model: nn.Module) -> Counter[tuple[int, int]]:
    """(in_features, out_features) of every ``nn.Linear`` in ``model``, with how many there are."""
    return Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear))


def _three(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> None:
    """The three GEMMs of one linear layer in a training step, in nn.Linear's layouts."""
    F.linear(x, w)  # forward          [T x k] @ [k x n]
    dy @ w  # input gradient   [T x n] @ [n x k]
    dy.t() @ x  # weight gradient  [n x T] @ [T x k]


def gemm_limit(shapes: Counter[tuple[int, int]], tokens: int, device: torch.device, reps: int = 2) -> float:
    """FLOP/s of the model's GEMM mix at ``tokens`` rows: forward, input-grad and weight-grad of each layer.

    Each distinct shape is timed ``reps`` times after one warm-up (the best time counts: the limit is what
    the machine can do, not what it did while disturbed) and weighted by its count; fp32 on the CPU, bf16 on
    a GPU, as the bench runs.
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    flops = seconds = 0.0
    for (k, n), count in shapes.items():
        x = torch.randn(tokens, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        dy = torch.randn(tokens, n, device=device, dtype=dtype)

        _three(x, w, dy)
        best = float("inf")
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            _three(x, w, dy)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        flops += count * 3 * 2 * tokens * k * n
        seconds += count * best
    return flops / seconds

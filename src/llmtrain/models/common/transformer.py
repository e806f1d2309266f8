"""The decoder-only transformer shared by every family (single-device code; no ``torch.distributed``).

Layout (torchtitan's names, which tensor-parallel plans and FSDP wrapping address from outside)::

    tok_embeddings   nn.Embedding [vocab, dim]              (None on a pipeline stage without it)
    rope             RotaryEmbedding (no parameters; None with ALiBi)
    layers           nn.ModuleDict {"0": TransformerBlock, ..., "L-1": ...}
        attention_norm, attention.{wq, wk, wv, wo[, q_norm, k_norm]}, ffn_norm, feed_forward.{w1, w2, w3}
        (biases: wq/wk/wv with qkv_bias, wo with attention_out_bias, w1/w2/w3 with mlp_bias;
        attention_post_norm, ffn_post_norm with post_norms, GLM-4-0414; with kv_lora_rank > 0 the attention is
        MLA, attention.{wq | wq_a, q_norm, wq_b; wkv_a, wk_rope, kv_norm, wkv_b, wo}, models/common/mla.py)
    norm             RMSNorm                                 (None on a non-last pipeline stage)
    output           nn.Linear / NormHead [vocab, dim]       (None on a non-last pipeline stage)

Life cycle: build on the meta device (``models.build_model``), let the parallel plans shard it, then
``to_empty(device=...)`` and :meth:`Transformer.init_weights`. Initialisation is seeded per parameter from
its name, so the same seed gives bitwise the same tensors whatever subset of layers a pipeline stage kept.

``forward`` returns logits ``[B, T, vocab]`` (or hidden states when ``output`` is None); the loss lives in the
trainer. With ``document_ids`` it masks attention across packed documents; with a :class:`KVCache` it
processes only the new tokens and appends their keys/values. The masks are built here, once per forward and
before the blocks (which ``torch.compile`` may wrap), dense ones with the additive mask every layer's SDPA
shares (models/common/attention.py); under context parallel they come from ``context_parallel.masks``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.attention import Attention, AttentionMask, build_masks, query_dtype
from llmtrain.models.common.init import norm_gain, weight_std
from llmtrain.models.common.kv_cache import KVCache
from llmtrain.models.common.layers import FeedForward, NormHead, RMSNorm
from llmtrain.models.common.mla import MultiHeadLatentAttention
from llmtrain.models.common.moe import MoE
from llmtrain.models.common.rope import RotaryEmbedding


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h))``; with
    ``post_norms`` (``norm_scheme`` sandwich or dssn) each sub-layer's output is RMS-normalised before its
    residual add (GLM-4-0414; DSSN starts those gains at c / sqrt(num_layers), models/common/init.py). Under
    autocast the norm outputs are cast once before the projections (:func:`_autocast_input`)."""

    def __init__(self, args: TransformerArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_key = str(layer_id)
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attention: Attention | MultiHeadLatentAttention = (
            MultiHeadLatentAttention(args)  # DeepSeek-V3 (kv_lora_rank > 0)
            if args.kv_lora_rank
            else Attention(args, sliding=args.is_sliding_layer(layer_id))
        )
        self.attention_post_norm: RMSNorm | None = None
        self.ffn_post_norm: RMSNorm | None = None
        if args.post_norms:
            self.attention_post_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.ffn_post_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feed_forward: FeedForward | MoE = (
            MoE(args)
            if args.is_moe_layer(layer_id)
            else FeedForward(args.hidden_size, args.intermediate_size, args.hidden_act, args.mlp_bias)
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: AttentionMask,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        a = self.attention(_autocast_input(self.attention_norm(x)), rope, mask, cache, self.layer_key)
        if self.attention_post_norm is not None:
            a = self.attention_post_norm(a)
        h = x + a  # [B, T, dim], fp32 under autocast (the residual stream)
        normed = self.ffn_norm(h)
        f = self.feed_forward(normed if isinstance(self.feed_forward, MoE) else _autocast_input(normed))
        if self.ffn_post_norm is not None:
            f = self.ffn_post_norm(f)
        return h + f


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype when autocast is on for its device, else ``x``: a norm output cast once for all
    the projections that read it (attention's wq/wk/wv or MLA's, the MLP's w1/w3), the cast each of them would
    make (bit-identical), so one 16-bit copy is saved instead of one per projection, and under sequence parallel
    the all-gather that follows moves 16 bits. Not for the MoE, whose combine accumulates in its input dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(device))
    return x


class Transformer(nn.Module):
    """Decoder-only LM of any supported family; see the module docstring for the layout."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.hidden_size)
        self.rope: RotaryEmbedding | None = None
        if args.position_embedding == "rope":
            self.rope = RotaryEmbedding(
                args.rotary_dim,
                args.rope_theta,
                args.rope_scaling,
                args.max_position_embeddings or args.seq_length,
            )
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.num_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.output: nn.Linear | None = (
            NormHead(args.hidden_size, args.vocab_size)
            if args.norm_head
            else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        )
        self.pipeline_untied = False  # distributed/pipeline.py: the head holds its own copy of the embedding
        # distributed/pipeline.py: a last stage's chunked loss, used when the forward gets labels but no head_loss
        self.head_loss: Callable[[torch.Tensor, nn.Module, torch.Tensor], torch.Tensor] | None = None
        self.tie_weights()
        self.attention_impl = "sdpa"  # model.attention (auto, sdpa, flex), set by distributed/parallelize.py
        self.context_parallel: Any = None  # distributed/context_parallel.py sets it: the micro-batch's masks

    def tie_weights(self) -> None:
        """Share ``tok_embeddings.weight`` with ``output`` when the args tie them (and both exist here)."""
        if self.pipeline_untied:  # under PP the head is a copy kept equal by the pipeline runner
            return
        if self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Transformer:
        """``nn.Module.to_empty`` that keeps tied embeddings tied (the base method allocates each separately)."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        labels: torch.Tensor | None = None,
        head_loss: Callable[[torch.Tensor, nn.Module, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` for token ids ``[B, T]`` (hidden states ``[B, T, dim]`` on a stage
        without ``tok_embeddings`` come in as ``input_ids`` and go out when ``output`` is None).
        With ``labels`` and ``head_loss`` the result is ``head_loss(h, output, labels)`` instead of logits
        (the chunked loss of train/loss.py, which never holds all logits).

        ``position_ids`` [B, T] or [T] default to ``past + arange(T)``; reset them per document together with
        ``document_ids`` [B, T] to make each packed document see exactly what it would see alone.
        """
        # Full sequence length from the input: under sequence parallel the embedding output holds only this
        # rank's slice of the sequence, while attention (after its all-gather) sees all of it.
        bsz, seqlen = input_ids.shape[:2]
        if position_ids is not None and self.tok_embeddings is None:  # a pipeline stage fed a sequence slice
            seqlen = position_ids.shape[-1]
        h = self.tok_embeddings(input_ids) if self.tok_embeddings is not None else input_ids  # [B, T, dim]
        past = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + seqlen, device=h.device)
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(bsz, seqlen)  # [B, T]
        rope = self.rope(position_ids) if self.rope is not None else None
        alibi, window = self.args.position_embedding == "alibi", self.args.sliding_window
        impl = "sdpa" if self.args.kv_lora_rank else self.attention_impl  # MLA attends through SDPA only
        dtype = query_dtype(h)
        if self.context_parallel is not None:  # local queries vs all keys, from ContextParallel.shard
            mask = self.context_parallel.masks(dtype)
        else:
            mask = build_masks(seqlen, past, document_ids, alibi, h.device, window, impl, dtype=dtype)
        for layer in self.layers.values():
            h = layer(h, rope, mask, cache)
        if cache is not None:
            cache.advance(seqlen)
        if self.norm is not None:
            h = self.norm(h)
        head_loss = head_loss if head_loss is not None else self.head_loss
        if head_loss is not None and labels is not None and self.output is not None:
            return head_loss(h, self.output, labels)  # summed loss, a scalar
        return self.output(h) if self.output is not None else h  # [B, T, vocab]

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        """Deterministic init, after ``to_empty``: the same seed gives bitwise the same weights.

        Norm weights take ``norm_gain`` (1, or DSSN's depth-scaled post-norm gains), biases zeros, every other
        matrix ``normal(0, weight_std)`` (models/common/init.py: ``model.init`` default is GPT-2's depth scaling
        of ``attention.wo`` / ``feed_forward.w2``, ``init_std / sqrt(2 * num_layers)``; tinyinit is Pangu
        Ultra's). Each parameter draws from its own generator seeded by ``(seed, parameter name)``, names
        taken without activation-checkpoint / compile wrapper prefixes. Parameters already sharded as DTensors
        (FSDP2, TP) are drawn in full and then distributed, so every parallel layout starts from the same
        weights as one device. The non-persistent buffers (RoPE inverse frequencies, ALiBi slopes) are
        recomputed on ``buffer_device`` (default: where the parameters live).
        """
        self.tie_weights()
        device = buffer_device
        for raw_name, param in self.named_parameters():
            device = device or param.device
            if param.device.type == "meta":
                continue
            name = raw_name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            if name == "output.weight" and self.args.tie_word_embeddings:  # a pipeline stage's copy of the
                name = "tok_embeddings.weight"  # tied embedding starts equal to it
            if name.endswith("norm.weight"):
                param.fill_(norm_gain(name, self.args))
            elif name.endswith(".bias"):
                param.zero_()
            else:
                gen = torch.Generator(device=param.device)
                gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
                _normal_(param, weight_std(name, self.args), gen)
        if self.rope is not None:
            self.rope.reset_buffers(device)
        for layer in self.layers.values():  # a wrapped block (compile, checkpoint) forwards .attention
            cast(Attention, layer.attention).reset_buffers(device)
        for module in self.modules():  # MoE routers' aux-loss-free bias starts at zero
            if isinstance(module, MoE):
                module.router.init_buffers()


def _normal_(param: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Fill ``param`` from ``normal(0, std)``; a DTensor gets the slice of the full unsharded draw."""
    if hasattr(param, "device_mesh") and hasattr(param, "placements"):
        # Lazy import: reached only once a parallel plan has turned parameters into DTensors.
        from torch.distributed.tensor import distribute_tensor

        full = torch.empty(param.shape, dtype=param.dtype, device=param.device).normal_(
            0.0, std, generator=gen
        )
        param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
    else:
        param.normal_(0.0, std, generator=gen)

"""The model calls of downstream evaluation, on one process or under the run's parallel layout.

:class:`~llmtrain.eval.lm.LLMTrainLM` never calls the model itself: it asks a forward object for the two things
lm-eval's requests need, each a few numbers per token rather than logits:

* :meth:`ModelForward.token_logprobs`: for inputs ``[B, T]`` and their next tokens ``[B, T]``, the fp32
  log-probability of each next token and whether it is the argmax (``[B, T]`` each);
* :meth:`ModelForward.next_logits`: the fp32 logits ``[V]`` of the last position of one sequence (generation).

:class:`ModelForward` is one process: the model called directly, generation KV-cached
(:class:`~llmtrain.models.common.kv_cache.KVCache`).

:class:`LayoutForward` is one rank of a parallel run (FSDP / ZeRO 0-3, TP, EP, PP). Every rank runs the same
lm-eval requests in the same order (each presents itself to lm-eval as rank 0 of 1), so every rank calls the
model with the *same* inputs and the collectives inside it match:

* FSDP / ZeRO and EP: the rank model is called as is (parameters are gathered, tokens routed to their experts);
* TP: sequence parallel shards the sequence between blocks, so ``T`` is right-padded to a multiple of the TP
  degree (the model is causal: a padded position never changes an earlier one, and padded positions are
  dropped); the output projection gathers full logits, replicated on every TP rank;
* PP: :meth:`llmtrain.distributed.pipeline.PipelineRunner.forward_logits` runs the stage modules forward only
  (send / recv of arbitrary shapes); the rank holding the last stage turns its logits into the per-token
  numbers above and broadcasts them (``[2, B, T]``, or ``[V]`` when generating) over the pipeline group.

Generation under a layout recomputes the whole sequence for every new token (no KV cache: the caches of TP and
pipeline-stage modules are not wired up), and the chosen token is broadcast from global rank 0 so that every
rank stops at the same token. Context parallel is refused before the run starts (resolve/validate.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.models.common.kv_cache import KVCache


class ModelForward:
    """One process: ``model(tokens)``; generation with a KV cache."""

    def __init__(self, model: torch.nn.Module, autocast_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.autocast_dtype = autocast_dtype

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def new_cache(self, max_seq_len: int) -> KVCache | None:
        """A KV cache for one sequence of up to ``max_seq_len`` tokens (None: feed the whole sequence)."""
        return KVCache(max_seq_len=max_seq_len, batch_size=1)

    def logits(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor | None:
        """fp32 logits ``[B, T, V]`` of ``tokens`` ``[B, T]`` (None on a rank that holds no logits)."""
        with torch.no_grad(), self.autocast():
            out = self.model(tokens, cache=cache) if cache is not None else self.model(tokens)
        if hasattr(out, "full_tensor"):  # a tensor-parallel DTensor
            out = out.full_tensor()
        return out.float()

    def token_logprobs(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p(target), target == argmax), each ``[B, T]``, for ``inputs`` / ``targets`` ``[B, T]``."""
        logits = self.logits(inputs)
        packed = None if logits is None else _pack(logits, targets)
        packed = self.share(packed, (2, *inputs.shape))
        return packed[0], packed[1] > 0.5

    def next_logits(self, tokens: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """fp32 logits ``[V]`` of the position after ``tokens`` ``[1, T]`` (the new tokens when cached)."""
        logits = self.logits(tokens, cache)
        last = None if logits is None else logits[0, -1].contiguous()
        return self.share(last, None)

    def share(self, t: torch.Tensor | None, shape: tuple[int, ...] | None) -> torch.Tensor:
        """``t`` as every rank needs it (one process: ``t`` itself)."""
        assert t is not None
        return t

    def agree(self, token: int) -> int:
        """The generated token every rank continues with (one process: ``token``)."""
        return token


def _pack(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[2, B, T]``: log-softmax of ``logits`` ``[B, T, V]`` at ``targets`` ``[B, T]``, and 1.0 where the
    target is the argmax (one sequence at a time: one ``[T, V]`` temporary, not a second ``[B, T, V]``)."""
    out = torch.empty((2, *targets.shape), dtype=torch.float32, device=logits.device)
    for b in range(targets.shape[0]):
        logp = torch.log_softmax(logits[b], dim=-1)  # [T, V]
        out[0, b] = logp.gather(-1, targets[b, :, None])[:, 0]
        out[1, b] = (logp.argmax(dim=-1) == targets[b]).float()
    return out


class LayoutForward(ModelForward):
    """One rank of a parallel run (see the module docstring): the same inputs on every rank."""

    def __init__(
        self,
        model: torch.nn.Module,
        autocast_dtype: torch.dtype | None = None,
        *,
        tensor_parallel: int = 1,
        pipeline: Any = None,
    ) -> None:
        super().__init__(model, autocast_dtype)
        self.multiple = max(int(tensor_parallel), 1)
        self.pipeline = pipeline
        args = getattr(model, "args", None)
        self.vocab = int(args.vocab_size) if args is not None else 0  # the logits' width (under PP)
        if pipeline is not None:
            last = pipeline.owner[pipeline.n_chunks - 1]
            self.src = dist.get_global_rank(pipeline.pp_group, last)

    def new_cache(self, max_seq_len: int) -> KVCache | None:
        return None

    def logits(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor | None:
        assert cache is None
        length = tokens.shape[1]
        pad = -length % self.multiple
        if pad:  # sequence parallel: T a multiple of the TP degree (causal: earlier positions unchanged)
            tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], pad)], dim=1)
        if self.pipeline is None:
            out = super().logits(tokens)
        else:
            with torch.no_grad(), self.autocast():
                out = self.pipeline.forward_logits(tokens)
            out = None if out is None else out.float()
        return None if out is None else out[:, :length]

    def share(self, t: torch.Tensor | None, shape: tuple[int, ...] | None) -> torch.Tensor:
        """Under PP: broadcast from the rank of the last stage over the pipeline group; else ``t``."""
        if self.pipeline is None:
            assert t is not None
            return t
        if t is None:
            t = torch.empty(shape or (self.vocab,), dtype=torch.float32, device=self.device)
        t = t.contiguous()
        dist.broadcast(t, src=self.src, group=self.pipeline.pp_group)
        return t

    def agree(self, token: int) -> int:
        """Global rank 0's token, on every rank (one int per generated token)."""
        t = torch.tensor([token], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return int(t.item())

"""An lm-eval ``LM`` backed by llmtrain's own model and tokenizer (this module imports lm-eval: load it lazily).

:class:`LLMTrainLM` subclasses lm-eval's ``TemplateLM``, so the text -> token bookkeeping is lm-eval's own
(trailing spaces of a context move to the continuation, an empty context becomes the prefix token, the
context/continuation split is taken from the encoding of the whole string) and the numbers are comparable with
lm-eval's ``hf`` model on an ``llmtrain export`` of the same weights:

* ``loglikelihood`` / ``_loglikelihood_tokens``: each request's tokens ``(context + continuation)`` cut to the
  last ``max_length + 1`` and fed without the last one, as lm-eval's ``hf`` model does; the continuation's
  log-probabilities are summed in fp32, ``is_greedy`` is whether every continuation token is the argmax.
  Requests run in batches of ``batch_size`` sorted longest first (right-padded: the model is causal, so a
  padded position never changes an earlier one) and come back in the caller's order.
* ``loglikelihood_rolling``: lm-eval's rolling windows (``get_rolling_token_windows`` with context 1 and
  ``make_disjoint_window``) over the whole text, each token predicted once, summed per document.
* ``generate_until``: KV-cached decoding on one process (:class:`~llmtrain.models.common.kv_cache.KVCache`),
  greedy unless the task asks for ``do_sample`` (then :func:`llmtrain.generate.sample_next` with a seeded
  generator); it stops at ``max_gen_toks``, the EOS token, or the first of the ``until`` strings, which is
  cut off.

The model calls go through a forward object (:mod:`llmtrain.eval.forward`): :class:`~llmtrain.eval.forward.
ModelForward` on one process (the default), :class:`~llmtrain.eval.forward.LayoutForward` on each rank of a
parallel run (every rank runs the same requests; generation there recomputes the sequence instead of caching).

``max_length`` defaults to the model's ``seq_length``, the context the run trained on (lm-eval's ``hf`` model
reads ``max_position_embeddings`` from config.json instead, which a flavor may set far longer: pass it
``max_length=SEQ_LENGTH`` to score the same windows). The prefix token is the tokenizer's BOS, else its EOS
(lm-eval's rule). The LM presents itself to lm-eval as one process (rank 0 of 1); the caller decides which
process records the results. The model's train/eval mode is the caller's business.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from llmtrain.data.tokenizer import Tokenizer
from llmtrain.eval.forward import ModelForward
from llmtrain.generate import sample_next


class LLMTrainLM(TemplateLM):
    """lm-eval's view of an llmtrain :class:`~llmtrain.models.common.transformer.Transformer`."""

    backend = "causal"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        batch_size: int = 8,
        max_length: int | None = None,
        autocast_dtype: torch.dtype | None = None,
        max_gen_toks: int = 256,
        seed: int = 1234,
        progress: bool = True,
        forward: ModelForward | None = None,
    ) -> None:
        super().__init__()
        self.model, self.tok = model, tokenizer
        self._batch_size = max(int(batch_size), 1)
        args = getattr(model, "args", None)
        self._max_length = int(max_length or (args.seq_length if args is not None else 2048))
        self.forward = forward if forward is not None else ModelForward(model, autocast_dtype)
        self._device = self.forward.device
        self._max_gen_toks = max_gen_toks
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._progress = progress

    # ------------------------------------------------------------------ what lm-eval asks of a TemplateLM
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return f"llmtrain-{self.tok.sha256[:16]}"

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's own request tokenization (``TemplateLM.loglikelihood``), its progress bar optional."""
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self._progress)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """llmtrain's encoding: never a BOS/EOS (the training data has none inside a document)."""
        return self.tok.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens)

    # ------------------------------------------------------------------ model calls (llmtrain/eval/forward.py)
    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), greedy?) for each ``(key, context ids, continuation ids)``."""
        full = [(ctx + cont)[-(self.max_length + 1) :] for _, ctx, cont in requests]
        order = sorted(range(len(requests)), key=lambda i: (-len(full[i]), tuple(full[i])))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = [i for i in order[start : start + self.batch_size] if requests[i][2]]
            if not chunk:
                continue
            inputs = [full[i][:-1] for i in chunk]
            width = max(len(x) for x in inputs)
            batch = torch.tensor([x + [0] * (width - len(x)) for x in inputs], device=self._device)
            nxt = torch.tensor(
                [full[i][1:] + [0] * (width - len(full[i]) + 1) for i in chunk], device=self._device
            )
            logp, argmax = self.forward.token_logprobs(batch, nxt)  # [B, T] each
            for row, i in enumerate(chunk):
                n = min(len(requests[i][2]), len(inputs[row]))
                end = len(inputs[row])
                score = float(logp[row, end - n : end].sum())
                greedy = bool(argmax[row, end - n : end].all())
                results[i] = (score, greedy)
                key = requests[i][0]
                if key is not None and key[0] is not None:
                    self.cache_hook.add_partial("loglikelihood", key, results[i])
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text, in windows of ``max_length`` (see the module docstring)."""
        windows: list[tuple[Any, list[int], list[int]]] = []
        counts = []
        for req in requests:
            (text,) = req.args
            pairs = [
                lm_utils.make_disjoint_window(w)
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows += [(None, ctx, cont) for ctx, cont in pairs]
            counts.append(len(pairs))
        scores = self._loglikelihood_tokens(windows)
        out, at = [], 0
        for req, count in zip(requests, counts):
            total = sum(s for s, _ in scores[at : at + count])
            at += count
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """The continuation of each context, up to the first ``until`` string (see the module docstring)."""
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None)
            stops = [until] if isinstance(until, str) else list(until or [])
            eos_text = self.tok_decode([self.eot_token_id])
            if eos_text not in stops:
                stops.append(eos_text)
            max_new = min(int(kw.pop("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
            temperature = float(kw.pop("temperature", 0.0)) if kw.pop("do_sample", False) else 0.0
            top_k, top_p = kw.pop("top_k", None), kw.pop("top_p", None)
            ids = self.tok_encode(context)[-(self.max_length - max_new) :] or [self.prefix_token_id]
            text = self._generate(ids, max_new, stops, temperature, top_k, top_p)
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out

    def _generate(
        self,
        ids: list[int],
        max_new: int,
        stops: list[str],
        temperature: float,
        top_k: int | None,
        top_p: float | None,
    ) -> str:
        cache = self.forward.new_cache(len(ids) + max_new)  # None under a parallel layout: recompute
        tokens = torch.tensor([ids], device=self._device)  # [1, T]
        new: list[int] = []
        text = ""
        for _ in range(max_new):
            logits = self.forward.next_logits(tokens, cache)  # [V]
            token = self.forward.agree(sample_next(logits, temperature, top_k, top_p, self._generator))
            new.append(token)
            text = self.tok_decode(new)
            if token == self.eot_token_id or any(s and s in text for s in stops):
                break
            step = [[token]] if cache is not None else [ids + new]
            tokens = torch.tensor(step, device=self._device)  # [1, 1], or [1, T] without a cache
        for s in stops:
            if s:
                text = text.split(s)[0]
        return text

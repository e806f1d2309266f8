"""Autoregressive sampling with a KV cache: greedy, temperature, top-k and top-p (nucleus).

:func:`generate` runs the prompt once through the model (prefill), then feeds one token at a time, each step
reusing the keys and values cached by the earlier ones (a preallocated :class:`KVCache` sized prompt + new
tokens). Sampling happens in fp32 on the last position's logits: temperature 0 means greedy (argmax, no
randomness); otherwise logits are divided by the temperature, filtered by top-k and then top-p, and one token
is drawn with ``torch.multinomial`` from ``generator`` (so a seeded generator makes the output reproducible).
The filters are exposed (:func:`filter_top_k`, :func:`filter_top_p`, :func:`sample_next`) so that they can be
tested and reused.
"""

from __future__ import annotations

import torch

from llmtrain.errors import ConfigError
from llmtrain.models.common.kv_cache import KVCache
from llmtrain.models.common.transformer import Transformer


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of ``[..., V]`` (ties with the k-th kept), set the rest to -inf."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to at least ``p``; -inf the rest."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # [..., V]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly more likely tokens
    drop_sorted = mass_before >= p  # the top token always has mass_before 0 and stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """One token id from the logits ``[V]`` of the last position."""
    logits = logits.float()
    if temperature == 0:
        return int(logits.argmax(dim=-1))
    logits = logits / temperature
    if top_k is not None:
        logits = filter_top_k(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = filter_top_p(logits, top_p)
    probs = logits.softmax(dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def _check(
    prompt_ids: list[int], max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    if not prompt_ids:
        raise ConfigError("generate needs a non-empty prompt (at least one token id).")
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be 0 or more, got {max_new_tokens}.")
    if temperature < 0:
        raise ConfigError(f"temperature must be 0 (greedy) or positive, got {temperature}.")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k must be a positive integer or unset, got {top_k}.")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1] or unset, got {top_p}.")


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """New tokens (without the prompt) sampled after ``prompt_ids``; stops after ``eos_id`` (included) or
    ``max_new_tokens``. ``temperature`` 0 is greedy decoding. The model's train/eval mode is left as it is."""
    _check(prompt_ids, max_new_tokens, temperature, top_k, top_p)
    if max_new_tokens == 0:
        return []
    vocab = model.args.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"prompt token ids {bad[:5]} are outside the model's vocabulary of {vocab}.")
    device = next(model.parameters()).device
    cache = KVCache(max_seq_len=len(prompt_ids) + max_new_tokens, batch_size=1)
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, T_prompt]
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(tokens, cache=cache)[0, -1]  # [V]
        token = sample_next(logits, temperature, top_k, top_p, generator)
        new.append(token)
        if eos_id is not None and token == eos_id:
            break
        tokens = torch.tensor([[token]], dtype=torch.long, device=device)  # [1, 1]
    return new

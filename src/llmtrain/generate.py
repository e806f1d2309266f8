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

import os

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
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False  # the top token always stays (a p that underflows float32 to 0 included)
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
    scaled = logits / temperature
    if not bool(torch.isfinite(scaled[torch.isfinite(logits)]).all()):
        # a temperature so small that logits / T overflows (1e-300; 5e-324 is 0 in fp32): the same limit,
        # computed without overflow: the largest logits keep 0, the others go to -inf (greedy among ties)
        shifted = (logits - logits.max()).double() / temperature
        scaled = shifted.nan_to_num(nan=float("-inf")).float()
    logits = scaled
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


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device``: the GPU's free memory, or the host's available memory
    (``MemAvailable``), or None where neither can be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


@torch.no_grad()
def cache_bytes_per_token(model: Transformer, device: torch.device) -> int:
    """Bytes of key/value cache one position takes (measured: one token through a 1-position cache)."""
    probe = KVCache(max_seq_len=1, batch_size=1)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # dropout draws none
        model(torch.zeros((1, 1), dtype=torch.long, device=device), cache=probe)
    return sum(t.numel() * t.element_size() for d in (probe._k, probe._v) for t in d.values())


def check_cache_memory(model: Transformer, prompt: int, max_new_tokens: int, device: torch.device) -> None:
    """ConfigError naming max_new_tokens when the preallocated key/value cache of ``prompt`` +
    ``max_new_tokens`` positions would take more than half of the memory available on ``device``."""
    free = available_memory(device)
    if free is None:
        return
    per_token = max(cache_bytes_per_token(model, device), 1)
    budget = free // 2
    if (prompt + max_new_tokens) * per_token <= budget:
        return
    fits = max(budget // per_token - prompt, 0)
    raise ConfigError(
        f"max_new_tokens {max_new_tokens} (after a prompt of {prompt} tokens) needs a key/value cache of "
        f"{(prompt + max_new_tokens) * per_token / 2**30:.1f} GiB ({per_token:,} bytes per position), more than "
        f"half of the {free / 2**30:.1f} GiB available on {device.type}; at most {fits:,} new tokens fit (the "
        f"model was trained on {model.args.seq_length} tokens of context)."
    )


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
    check_cache_memory(model, len(prompt_ids), max_new_tokens, device)
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

"""Preallocated key/value cache for incremental decoding.

One :class:`KVCache` serves one model and one batch. Each attention layer owns a pair of buffers
``[B, KV_local, max_seq_len, head_dim]`` keyed by the layer's name in ``model.layers`` (so a pipeline stage
that deleted other layers still finds its own). The buffers are allocated on the layer's first call, with the
dtype, device and local (tensor-parallel) head count of the keys it produced, so the cache needs no knowledge
of the model's sharding; :meth:`allocate` does the same ahead of time for callers who want the memory reserved
up front.

The cache tracks one ``length`` for the whole model: during a forward every layer writes its new keys at
``[length, length + T)`` and reads ``[0, length + T)``; the model then calls :meth:`advance` once. Writing past
``max_seq_len`` raises instead of silently reallocating.

Keys and values may differ in width: multi-head latent attention (``models/common/mla.py``) stores its
compressed latent ``[B, 1, S, kv_lora_rank]`` as the "keys" and its shared rotary key ``[B, 1, S, rope]`` as the
"values" of a layer, which is all it needs to rebuild every head's keys and values.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer for positions ``[0, length)`` of a batch of sequences."""

    def __init__(self, max_seq_len: int, batch_size: int = 1) -> None:
        if max_seq_len <= 0 or batch_size <= 0:
            raise ValueError(
                f"KVCache needs positive max_seq_len and batch_size, got {max_seq_len}, {batch_size}"
            )
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.length = 0
        self._k: dict[str, torch.Tensor] = {}
        self._v: dict[str, torch.Tensor] = {}

    def allocate(
        self,
        layer_key: str,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        v_head_dim: int | None = None,
    ) -> None:
        """Reserve the buffers of one layer now instead of at its first update (``v_head_dim``: the width of
        the values when it differs from the keys')."""
        shape = (self.batch_size, num_kv_heads, self.max_seq_len, head_dim)
        self._k[layer_key] = torch.zeros(shape, dtype=dtype, device=device)
        v_shape = shape if v_head_dim is None else (*shape[:3], v_head_dim)
        self._v[layer_key] = torch.zeros(v_shape, dtype=dtype, device=device)

    def update(self, layer_key: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` [B, KV, T, hd] at the current length; return all keys/values ``[B, KV, length + T, hd]``."""
        bsz, kv_heads, seqlen, head_dim = k.shape
        end = self.length + seqlen
        if end > self.max_seq_len:
            raise ValueError(
                f"KVCache is full: {self.length} cached + {seqlen} new tokens exceed max_seq_len {self.max_seq_len}"
            )
        if bsz != self.batch_size:
            raise ValueError(f"KVCache was made for batch size {self.batch_size}, got a batch of {bsz}")
        if layer_key not in self._k:
            self.allocate(layer_key, kv_heads, head_dim, k.dtype, k.device, v_head_dim=v.shape[-1])
        k_buf, v_buf = self._k[layer_key], self._v[layer_key]
        k_buf[:, :, self.length : end] = k
        v_buf[:, :, self.length : end] = v
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def advance(self, num_tokens: int) -> None:
        """Mark ``num_tokens`` more positions as cached (the model calls this after all its layers ran)."""
        self.length += num_tokens

    def reset(self) -> None:
        """Forget every cached position (buffers are kept for reuse)."""
        self.length = 0

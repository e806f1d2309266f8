"""CPU staging for asynchronous saves without a process group: a reusable CPU copy of a state dict.

Part of the save mechanism (``store``): ``save_async`` copies the state here, returns to training, and a thread
writes the copy. The buffers are cached by their place in the state dict and reused while shapes and dtypes
stay the same, because fresh allocations cost page faults, often more than the copy itself.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


def _staging_buffers(
    obj: Any,
    cache: dict[str, torch.Tensor],
    copies: list[tuple[torch.Tensor, torch.Tensor]],
    prefix: str = "",
) -> Any:
    """``obj`` with every tensor replaced by its (reused) CPU buffer; the copies to make go into ``copies``."""
    if isinstance(obj, torch.Tensor):
        buf = cache.get(prefix)
        if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
            buf = cache[prefix] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
        copies.append((buf, obj.detach()))
        return buf
    if isinstance(obj, dict):
        return {k: _staging_buffers(v, cache, copies, f"{prefix}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_staging_buffers(v, cache, copies, f"{prefix}/{i}") for i, v in enumerate(obj))
    return obj


def stage_to_cpu(obj: Any, cache: dict[str, torch.Tensor], threads: int = 1) -> Any:
    """A CPU copy of a (nested) state dict, so training can overwrite the originals during the write. Buffers
    are kept in ``cache`` and reused by the next save (fresh allocations cost page faults, often more than the
    copy itself); the caller makes sure the previous write finished first. ``copy_`` releases the GIL, so
    ``threads`` threads copy different tensors at once (the training loop is blocked for this copy)."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    staged = _staging_buffers(obj, cache, copies)
    if threads <= 1 or len(copies) <= 1:
        for dst, src in copies:
            dst.copy_(src)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda pair: pair[0].copy_(pair[1]), copies))
    return staged

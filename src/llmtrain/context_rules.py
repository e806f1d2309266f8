"""The context-parallel layout rules, torch-free; :func:`llmtrain.feasibility.layout_problems` reports them.

Context parallel (distributed/context_parallel.py: load-balanced sequence chunks, keys/values all-gathered in
attention) is loss-parity tested with FSDP (ZeRO 0-3 and HSDP, sharding over the flattened ``dp_shard x cp``
mesh), with tensor parallel, with pipeline parallel (every schedule kind; the stages pass the hidden states of
the local chunks and each stage forward builds its pipeline micro-batch's masks), with ``train.compile``,
``train.fp8`` (the activation and gradient scales reduced over CP), ``parallel.cpu_offload``, MoE models and
expert parallel (the blocks' micro-batch statistics: counts, aux loss, capacity, summed over CP;
models/common/moe.py) and multi-head latent attention (its latent and rotary key all-gathered over CP;
models/common/mla.py) (docs/parallelism.md, "Which axes compose"). The one rule left is the sequence split,
``cp_seq`` (kind ``split``): a degree that does not divide.
"""

from __future__ import annotations

import math
from typing import Any


def cp_problems(cfg: Any, model: Any, dims: Any) -> list[tuple[str, str]]:
    """``(rule, message)`` for each CP rule that applies to ``cfg`` with degrees ``dims`` (``model``: the
    resolved model shape or None); empty without context parallel."""
    cp, tp, seq = dims.cp, dims.tp, cfg.model.seq_length
    if cp == 1:
        return []
    out: list[tuple[str, str]] = []
    if seq % (2 * cp) or (seq // cp) % tp:
        unit = cp * 2 * tp // math.gcd(2, tp)  # the least common multiple of 2 cp and cp tp
        out.append((
            "cp_seq",
            f"model.seq_length {seq} must be divisible by 2 x parallel.context_parallel {cp} = {2 * cp} (each "
            f"rank holds two of {2 * cp} equal chunks, load-balanced for the causal mask) and seq_length / cp by "
            f"tensor_parallel {tp} (sequence parallel splits each rank's part); use a multiple of "
            f"{unit} such as {max(seq // unit, 1) * unit}.",
        ))  # fmt: skip
    return out

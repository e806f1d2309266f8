"""The context-parallel layout rules, torch-free; :func:`llmtrain.feasibility.layout_problems` reports them.

Context parallel (distributed/context_parallel.py: load-balanced sequence chunks, keys/values all-gathered in
attention) is loss-parity tested with FSDP (ZeRO 0-3 and HSDP, sharding over the flattened ``dp_shard x cp``
mesh) and with tensor parallel (docs/parallelism.md, "Context parallel"). What it does not compose with is
refused here, under the rule ``context_parallel`` (kind ``unsupported``); the sequence split under ``cp_seq``
(kind ``split``).
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
    p, out = cfg.parallel, []
    refused: list[tuple[object, str, str]] = [
        (
            dims.pp > 1,
            f"pipeline_parallel {dims.pp}",
            "set pipeline_parallel: 1 (use tensor_parallel or FSDP)",
        ),
        (
            dims.ep > 1 or (model is not None and model.num_experts),
            "an MoE model or expert_parallel",
            "experts are dispatched per rank's tokens and their load statistics are not CP-aware yet",
        ),
        (
            model is not None and getattr(model, "kv_lora_rank", 0),
            "multi-head latent attention (model kv_lora_rank > 0)",
            "its compressed keys/values are not gathered over CP yet",
        ),
        (bool(cfg.train.compile), "train.compile", "set train.compile: false"),
        (cfg.train.fp8 != "none", f"train.fp8 {cfg.train.fp8}", "set train.fp8: none"),
        (bool(p.cpu_offload), "parallel.cpu_offload", "set parallel.cpu_offload: false"),
    ]
    for bad, what, fix in refused:
        if bad:
            out.append((
                "context_parallel",
                f"parallel.context_parallel {cp} with {what} is not supported in this version (context parallel "
                f"is tested with FSDP / HSDP and tensor_parallel only): {fix}, or set "
                "parallel.context_parallel: 1.",
            ))  # fmt: skip
            return out
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

"""The MoE and expert-parallel layout rules, torch-free; :func:`llmtrain.feasibility.layout_problems` reports them.

Tensor parallel splits every expert by hidden units (``models/common/moe_tp.py``), so ``moe_hidden_size`` must
divide by ``tensor_parallel`` (rule ``tp_moe_ffn``, kind ``split``). Expert parallel (distributed/expert_parallel.py)
borrows the data-parallel ranks: ``ep == dp``, no HSDP, ``num_experts % ep == 0``, a model with MoE blocks; and
it is not combined with tensor parallel in this version (rule ``ep_with_tp``: the experts would need a 2-D
``[dp, tp]`` layout and the dispatch an order with the TP hooks, neither of which is built or tested). The
rule names and verdicts are listed in ``feasibility.RULES``.
"""

from __future__ import annotations

from typing import Any


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


def moe_problems(model: Any, dims: Any) -> list[tuple[str, str]]:
    """``(rule, message)`` for each MoE / EP rule that applies to the resolved model shape ``model`` with the
    degrees ``dims`` (``feasibility.Degrees``); at most one, the first that applies."""
    n, ep, dp, tp = model.num_experts, dims.ep, dims.dp, dims.tp
    width = getattr(model, "moe_hidden_size", 0)
    if n and tp > 1 and width % tp:
        return [(
            "tp_moe_ffn",
            f"model.moe.moe_hidden_size {width} is not divisible by parallel.tensor_parallel {tp} (tensor "
            f"parallel splits every expert's hidden units across the tensor-parallel ranks); use a "
            f"tensor_parallel that divides it ({_divisors(width)}) and the attention heads.",
        )]  # fmt: skip
    if ep > 1 and tp > 1 and n and model.num_moe_layers:
        return [(
            "ep_with_tp",
            f"parallel.expert_parallel {ep} together with parallel.tensor_parallel {tp} is not supported in this "
            "version: an MoE model trains with tensor parallel (experts split by hidden units) when "
            "expert_parallel is 1, or with expert parallel (experts sharded over the data-parallel ranks) when "
            "tensor_parallel is 1; set one of them to 1.",
        )]  # fmt: skip
    if ep > 1 and not (n and model.num_moe_layers):
        return [(
            "ep_without_moe",
            f"parallel.expert_parallel {ep} but the model has no MoE blocks: set model.moe.num_experts > 0 (or "
            "a MoE flavor such as qwen3 debug_moe), or expert_parallel: 1.",
        )]  # fmt: skip
    if ep > 1 and ep != dp:
        return [(
            "ep_equals_dp",
            f"parallel.expert_parallel {ep} must equal the data-parallel size {dp} in this version (experts "
            f"are sharded over all data-parallel ranks); set expert_parallel to {dp} or 1.",
        )]  # fmt: skip
    if ep > 1 and dims.dp_replicate > 1 and dims.dp_shard > 1:
        return [(
            "ep_hsdp",
            f"parallel.expert_parallel {ep} with HSDP (parallel.data_parallel_replicate {dims.dp_replicate} x "
            f"shard {dims.dp_shard}, ZeRO > 0) is not supported yet; set data_parallel_replicate: 1.",
        )]  # fmt: skip
    if ep > 1 and n % ep:
        return [(
            "ep_experts",
            f"model.moe.num_experts {n} is not divisible by parallel.expert_parallel {ep} (each expert-parallel "
            f"rank holds the same number of experts); use an expert_parallel that divides it ({_divisors(n)}).",
        )]  # fmt: skip
    return []

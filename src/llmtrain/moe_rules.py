"""The MoE and expert-parallel layout rules, torch-free; :func:`llmtrain.feasibility.layout_problems` reports them.

Expert parallel (distributed/expert_parallel.py) regroups the ``dp x cp x tp`` ranks of a pipeline stage as an
expert mesh ``edp x ep x etp`` (:func:`expert_tp` picks ``etp``): EP inside the data-parallel ranks with the
experts' replicas reduced over ``edp`` (ep < dp, HSDP included), EP together with tensor parallel either as
expert-TP (``etp = tp``: experts split over EP and their hidden units over TP) or, when ``ep`` does not divide
``dp x cp``, with EP drawn from the ``dp x cp x tp`` ranks and whole experts (``etp = 1``). What cannot divide is
refused: ``ep`` must divide ``dp x cp x tp`` (``feasibility.degree_problems``, rule ``ep_divides``) and
``num_experts`` (``ep_experts``); split hidden units need ``moe_hidden_size % tp`` (``tp_moe_ffn``); and EP needs
MoE blocks (``ep_without_moe``). Context parallel composes with MoE and EP (``distributed/context_parallel.py``
spans the router's statistics over the CP ranks). The rule names and verdicts are listed in ``feasibility.RULES``.
"""

from __future__ import annotations

from typing import Any


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


def expert_tp(dims: Any) -> int:
    """The expert tensor-parallel degree of the degrees ``dims``: ``tp`` when ``ep`` divides ``dp x cp`` (EP
    drawn from the data-parallel ranks, expert hidden units split over TP, Megatron's default expert-TP; also
    every layout without EP), else 1 (EP drawn from the ``dp x cp x tp`` ranks, whole experts)."""
    return dims.tp if (dims.dp * dims.cp) % dims.ep == 0 else 1


def moe_problems(model: Any, dims: Any) -> list[tuple[str, str]]:
    """``(rule, message)`` for each MoE / EP rule that applies to the resolved model shape ``model`` with the
    degrees ``dims`` (``feasibility.Degrees``); at most one, the first that applies."""
    n, ep, tp = model.num_experts, dims.ep, dims.tp
    width = getattr(model, "moe_hidden_size", 0)
    splits = expert_tp(dims) > 1 or getattr(model, "shared_experts", 0) > 0  # what TP splits by hidden units
    if n and tp > 1 and width % tp and splits:
        return [(
            "tp_moe_ffn",
            f"model.moe.moe_hidden_size {width} is not divisible by parallel.tensor_parallel {tp} (tensor "
            f"parallel splits the hidden units of every routed expert, and of the shared experts, across the "
            f"tensor-parallel ranks); use a tensor_parallel that divides it ({_divisors(width)}) and the "
            f"attention heads.",
        )]  # fmt: skip
    if ep > 1 and not (n and model.num_moe_layers):
        return [(
            "ep_without_moe",
            f"parallel.expert_parallel {ep} but the model has no MoE blocks: set model.moe.num_experts > 0 (or "
            "a MoE flavor such as qwen3 debug_moe), or expert_parallel: 1.",
        )]  # fmt: skip
    if ep > 1 and n % ep:
        return [(
            "ep_experts",
            f"model.moe.num_experts {n} is not divisible by parallel.expert_parallel {ep} (each expert-parallel "
            f"rank holds the same number of experts); use an expert_parallel that divides it ({_divisors(n)}).",
        )]  # fmt: skip
    return []

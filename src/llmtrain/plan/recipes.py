"""Which engine models a run: the published recipes ``llmtrain plan`` recognises, and its one-line hints.

``llmtrain plan`` models this trainer (``--engine llmtrain``) unless told otherwise. When the config is another
framework's run file (a MindFormers run file) or its model and degrees are those of a published recipe (the
table below: family, parameter count within 2%, TP / PP / CP / EP degrees), the plan prints one line saying
which engine models the run as it was published; the figures of the default engine are what *this* trainer
would do with the same layout. The recipes are the published runs of ``tests/test_plan_published.py`` whose
model this checkout builds by name; sources in docs/planner.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.models import TransformerArgs
from llmtrain.plan.layout import Layout

ENGINE_SUMMARY = {
    "llmtrain": "this trainer as it runs: fp32 weights under autocast, FSDP2, torch TP / pipelining",
    "megatron": "Megatron-style: bf16 weights, a 16-bit gradient buffer (--grad-dtype fp32 for Megatron-LM --bf16), "
    "fused kernels, SP inputs saved sharded",
    "nemo": "NeMo: the megatron engine with NeMo's distributed Adam (16-bit master remainders)",
    "torchtitan": "torchtitan: FSDP2 with a bf16 mixed-precision policy, loss parallel, per-op selective recompute",
}
"""One line per engine, printed under the layout (docs/planner.md has the full list of differences)."""


@dataclass(frozen=True)
class Recipe:
    """A published run's model and degrees, and the framework (engine) that ran it."""

    name: str
    source: str
    engine: str
    family: str
    params_b: float
    """Parameters in billions (the planner's count of the model the recipe trains)."""
    tp: int
    pp: int
    ep: int = 1
    cp: int = 1

    def matches(self, args: TransformerArgs, lay: Layout) -> bool:
        return (
            args.family == self.family
            and abs(args.num_params() / 1e9 / self.params_b - 1) <= 0.02
            and (lay.tp, lay.pp, lay.ep, lay.cp) == (self.tp, self.pp, self.ep, self.cp)
        )


RECIPES = (
    Recipe("DGXC DeepSeek-V3 on 1,024 H100", "NVIDIA dgxc-benchmarking deepseek_v3/pretraining (NeMo 25.04.01)",
           "megatron", "deepseek_v3", 671.03, tp=2, pp=16, ep=64),
    Recipe("DGXC DeepSeek-V3 on 512 H100", "NVIDIA dgxc-benchmarking deepseek_v3/pretraining (NeMo 25.04.01)",
           "megatron", "deepseek_v3", 671.03, tp=2, pp=8, ep=64),
    Recipe("DeepSeek-V3 on 2,048 H800", "DeepSeek-V3 technical report; its DualPipe, FP8 and recompute as "
           "docs/planner.md plans them: schedule dualpipev, --ep-overlap, train.fp8, --act-fp8-input-store, "
           "--recompute-modules layernorm,mla_up_proj,moe_act, --mtp-layers 1", "megatron", "deepseek_v3",
           671.03, tp=1, pp=16, ep=64),
    Recipe("MindFormers DeepSeek-V3", "mindformers research/deepseek3 pretrain_deepseek3_671b.yaml", "megatron",
           "deepseek_v3", 671.03, tp=4, pp=16, ep=8),
    Recipe("DGXC Qwen3-235B on 256 H100", "NVIDIA dgxc-benchmarking qwen3/pretrain (Megatron-Bridge)",
           "megatron", "qwen3", 235.09, tp=2, pp=8, ep=32),
    Recipe("DGXC Llama 3.1 8B", "NVIDIA dgxc-benchmarking v24.11 (NeMo)", "nemo", "llama3", 8.03, tp=1, pp=1, cp=2),
    Recipe("DGXC Llama 3.1 70B", "NVIDIA dgxc-benchmarking v24.11 (NeMo)", "nemo", "llama3", 70.55, tp=4, pp=4,
           cp=2),
    Recipe("DGXC Llama 3.1 405B", "NVIDIA dgxc-benchmarking v24.11 (NeMo)", "nemo", "llama3", 405.85, tp=8, pp=9,
           cp=2),
    Recipe("torchtitan Llama 3.1 70B 2-D", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md", "torchtitan",
           "llama3", 70.55, tp=8, pp=1),
    Recipe("torchtitan Llama 3.1 405B 3-D", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md", "torchtitan",
           "llama3", 405.85, tp=8, pp=8),
    Recipe("Llama 3 405B pretraining", "Llama 3 paper, Table 4 (Meta's Megatron-style stack)", "megatron",
           "llama3", 405.85, tp=8, pp=16),
)  # fmt: skip


def engine_hint(args: TransformerArgs, lay: Layout, mindformers_run_file: bool) -> tuple[str, str] | None:
    """``(engine, one-line hint)`` when another engine models this run as published (a recipe of
    :data:`RECIPES`, or MindFormers for a MindFormers run file); None when ``lay.engine`` already does."""
    for recipe in RECIPES:
        if recipe.matches(args, lay):
            if recipe.engine == lay.engine:
                return None
            return recipe.engine, (
                f"this is the layout of {recipe.name} ({recipe.source}): --engine {recipe.engine} models that "
                f"run as published; this plan is engine {lay.engine} running the same layout"
            )
    if mindformers_run_file and lay.engine == "llmtrain":
        return "megatron", (
            "this is a MindFormers run file: --engine megatron models MindFormers running it (graph mode, bf16 "
            "weights, fused kernels); this plan is engine llmtrain running the same layout"
        )
    return None


__all__ = ["ENGINE_SUMMARY", "RECIPES", "Recipe", "engine_hint"]

"""Tensor-parallel plan of the llama family: the common Megatron-style plan with sequence parallel (see
``models/common/parallelize.py``); the family's specifics (qkv biases, QK-norm, NormHead) are covered there."""

from llmtrain.models.common.parallelize import block_plan, top_plan

__all__ = ["block_plan", "top_plan"]

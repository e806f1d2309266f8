"""Code shared by every model family: arguments, attention, RoPE/ALiBi, norms, MLP, the transformer, KV cache."""

from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.kv_cache import KVCache
from llmtrain.models.common.transformer import Transformer, TransformerBlock

__all__ = ["KVCache", "Transformer", "TransformerArgs", "TransformerBlock"]

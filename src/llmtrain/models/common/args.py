"""Fully resolved architecture of one decoder-only transformer.

:class:`TransformerArgs` is what the model code reads; it is produced by ``models.resolve_model_args`` from a
``ModelConfig`` (family defaults <- named flavor <- explicit fields) or by a family's ``hf.args_from_hf_config``.
Every family (Llama 3, Qwen2/3, GLM-4, Baichuan 2) is the same pre-norm block with a few switches:

* ``qkv_bias``              bias on the q/k/v projections (Qwen2, GLM-4).
* ``qk_norm``               RMSNorm over each head's queries and keys, before RoPE (Qwen3).
* ``partial_rotary_factor`` fraction of each head that is rotated (GLM-4: 0.5, the rest passes through).
* ``rope_interleaved``      rotate adjacent pairs (2i, 2i+1) (GLM-4) instead of the two halves (Llama/HF).
* ``position_embedding``    ``rope`` or ``alibi`` (Baichuan 2 13B).
* ``norm_head``             L2-normalised rows of the output embedding (Baichuan 2).

Parameter counts and FLOPs are computed here analytically, so the real-size flavors (8B ... 405B) can be
costed without building anything; ``num_params`` equals the built model's ``sum(p.numel())`` exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TransformerArgs:
    """Every architecture field of a model, with no unset values (see ``ModelConfig`` for the meaning)."""

    family: str = "llama3"
    flavor: str | None = None
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 256
    vocab_size: int = 512
    seq_length: int = 2048
    """Training sequence length (RoPE is computed from positions on the fly, so longer inputs still work)."""
    rms_norm_eps: float = 1e-5
    position_embedding: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """None, {"rope_type": "linear", "factor": f} or Llama 3's {"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}."""
    partial_rotary_factor: float = 1.0
    rope_interleaved: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_head: bool = False
    tie_word_embeddings: bool = False
    init_std: float = 0.02

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (even; 0 with ALiBi)."""
        if self.position_embedding != "rope":
            return 0
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data copy (for logging, checkpoints' metadata and YAML)."""
        return asdict(self)

    def _layer_params(self) -> int:
        """Parameters of one transformer block."""
        d, hd = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_heads * hd, self.num_kv_heads * hd
        attn = d * q_out + 2 * d * kv_out + q_out * d  # wq, wk, wv, wo
        if self.qkv_bias:
            attn += q_out + 2 * kv_out
        if self.qk_norm:
            attn += 2 * hd
        ffn = 3 * d * self.intermediate_size  # w1, w2, w3
        return attn + ffn + 2 * d  # + attention_norm, ffn_norm

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Exact parameter count of the built model (tied embeddings counted once).

        ``exclude_embedding`` leaves out the input embedding table (``tok_embeddings``) only; with tied
        embeddings that is also the output matrix, since they are one tensor.
        """
        embed = self.vocab_size * self.hidden_size
        output = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        total = self.num_layers * self._layer_params() + self.hidden_size + output  # + final norm
        return total if exclude_embedding else total + embed

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token (forward + backward) at ``seq_length``.

        ``6 * N`` for every matmul weight the token passes through (N = parameters without the input
        embedding, which is a lookup, but with the output projection even when it is tied), plus attention
        scores and values: ``6 * num_layers * seq_length * num_heads * head_dim``. That attention term is the
        causal count, half of the ``12 * L * T * d`` of full attention, since the masked half is not computed
        by flash kernels (the PaLM / nanoGPT MFU convention uses the full 12; ours is the lower, causal one).
        """
        dense = self.num_params(exclude_embedding=True)
        if self.tie_word_embeddings:
            dense += self.vocab_size * self.hidden_size
        attention = 6 * self.num_layers * seq_length * self.num_heads * self.head_dim
        return float(6 * dense + attention)

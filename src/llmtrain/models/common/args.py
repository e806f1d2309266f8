"""Fully resolved architecture of one decoder-only transformer.

:class:`TransformerArgs` is what the model code reads; it is produced by ``models.resolve_model_args`` from a
``ModelConfig`` (family defaults <- named flavor <- explicit fields) or by a family's ``hf.args_from_hf_config``.
Every family (Llama 3, Qwen2/3, GLM-4, Baichuan 2) is the same pre-norm block with a few switches:

* ``qkv_bias``              bias on the q/k/v projections (Qwen2, GLM-4).
* ``attention_out_bias``    bias on the attention output projection (HF Llama / Qwen3 ``attention_bias``).
* ``mlp_bias``              biases on the three MLP projections (HF Llama ``mlp_bias``).
* ``hidden_act``            the MLP gate's activation: silu (SwiGLU), gelu, gelu_tanh.
* ``qk_norm``               RMSNorm over each head's queries and keys, before RoPE (Qwen3).
* ``partial_rotary_factor`` fraction of each head that is rotated (GLM-4: 0.5, the rest passes through).
* ``rope_interleaved``      rotate adjacent pairs (2i, 2i+1) (GLM-4) instead of the two halves (Llama/HF).
* ``position_embedding``    ``rope`` or ``alibi`` (Baichuan 2 13B).
* ``norm_head``             L2-normalised rows of the output embedding (Baichuan 2).
* ``num_experts`` > 0       Mixture-of-experts feed-forward (``models/common/moe.py``) in the blocks that
                            ``is_moe_layer`` selects; FLOPs count only the active (top_k) experts.
* ``sliding_window`` > 0    Sliding-window attention (Mistral, Qwen) in the blocks ``is_sliding_layer``
                            selects (``sliding_window_layers``; None: all of them).
* ``post_norms``            RMSNorm of the attention and MLP outputs before each residual add (GLM-4-0414).
* ``norm_scheme``           pre, sandwich (= ``post_norms``) or dssn (sandwich with depth-scaled post-norm gains
                            at init, Pangu Ultra); ``init`` default or tinyinit (``Transformer.init_weights``).
* ``kv_lora_rank`` > 0      Multi-head latent attention (DeepSeek-V3, ``models/common/mla.py``) instead of
                            GQA: ``head_dim`` is then the rotary width ``qk_rope_head_dim``.

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
    """None or a dict with ``rope_type`` linear, dynamic, yarn, llama3 or longrope and that type's parameters
    (``models/common/rope.py``), e.g. Llama 3's {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}."""
    max_position_embeddings: int | None = None
    """The context length the model declares (HF ``max_position_embeddings``); dynamic RoPE scales beyond it.
    None: ``seq_length``."""
    partial_rotary_factor: float = 1.0
    rope_interleaved: bool = False
    qkv_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    qk_norm: bool = False
    norm_head: bool = False
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    sliding_window: int = 0
    """Each query of a sliding block attends to itself and the ``sliding_window - 1`` keys before it (Hugging
    Face's ``kv_idx > q_idx - sliding_window``); 0: full causal attention."""
    sliding_window_layers: list[int] | None = None
    """Block indices that use the window (Qwen's ``layer_types`` / ``max_window_layers``); None: every block."""
    post_norms: bool = False
    """GLM-4-0414: ``post_self_attn_layernorm`` / ``post_mlp_layernorm`` on each sub-layer's output."""
    norm_scheme: str = "pre"
    """pre, sandwich or dssn; sandwich and dssn have ``post_norms`` (the same modules: dssn differs only in the
    post norms' initial gains, ``models/common/init.py``)."""
    init: str = "default"
    """Weight init: default or tinyinit (``models/common/init.py``)."""
    # Mixture of experts (models/common/moe.py); num_experts 0 = dense. See ModelConfig.moe / MoEConfig.
    num_experts: int = 0
    top_k: int = 2
    moe_hidden_size: int = 0
    shared_experts: int = 0
    router_score: str = "softmax"
    route_norm: bool = True
    aux_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: float | None = None
    moe_every: int = 1
    first_dense_layers: int = 0
    shared_expert_gate: bool = False
    """Qwen2-MoE: the shared experts' output is scaled per token by ``sigmoid(x @ gate)`` (gate ``[1, dim]``)."""
    n_group: int = 1
    """Group-limited routing (DeepSeek-V3): experts in ``n_group`` groups, a token picks its top_k among the
    ``topk_group`` groups whose two best scores sum highest; 1 = no groups."""
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights (after route_norm), any family; DeepSeek-V3: 2.5."""
    pre_softmax: bool = True
    """Softmax router: softmax over all experts then top-k (True), or top-k of the logits then softmax over them."""
    router_fp32: bool = False
    """Router logits from fp32 input and weight, outside autocast (MindFormers' router_dense_type float32)."""
    aux_loss_scope: str = "micro_batch"
    """micro_batch or global_batch: the tokens the aux loss's expert fractions count (models/common/moe.py)."""
    drop_policy: str = "position"
    """position or probs: which assignments past an expert's capacity are dropped."""
    # Multi-head latent attention (models/common/mla.py); kv_lora_rank 0 = the GQA attention.
    q_lora_rank: int = 0
    """Rank of the query compression (wq_a -> q_norm -> wq_b); 0: one projection wq."""
    kv_lora_rank: int = 0
    """Width of the compressed key/value latent (what the KV cache holds, with the rotary key)."""
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` has an MoE feed-forward: past ``first_dense_layers``, and one block in
        ``moe_every`` counted as Qwen's ``decoder_sparse_step`` does (``(layer_id + 1) % moe_every == 0``)."""
        return (
            self.num_experts > 0
            and layer_id >= self.first_dense_layers
            and (layer_id + 1) % self.moe_every == 0
        )

    def is_sliding_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` attends through the sliding window."""
        layers = self.sliding_window_layers
        return self.sliding_window > 0 and (layers is None or layer_id in layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

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
        if self.kv_lora_rank:
            attn = self._mla_params()
        if self.qkv_bias:
            attn += q_out + 2 * kv_out
        if self.attention_out_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * hd
        norms = 4 * d if self.post_norms else 2 * d  # attention_norm, ffn_norm (+ the two post norms)
        return attn + self._dense_ffn_params() + norms

    def _mla_params(self) -> int:
        """Parameters of one multi-head latent attention (models/common/mla.py; no biases)."""
        d, h, rope = self.hidden_size, self.num_heads, self.qk_rope_head_dim
        qk, r = self.qk_nope_head_dim + rope, self.kv_lora_rank
        q = d * h * qk  # wq
        if self.q_lora_rank:  # wq_a, q_norm, wq_b
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk
        # wkv_a, wk_rope, kv_norm, wkv_b
        kv = d * (r + rope) + r + r * h * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d  # + wo

    def _attention_width(self) -> float:
        """Mean of the score (q.k) and value widths per head: head_dim, or (qk_nope + qk_rope + v) / 2 with MLA."""
        if self.kv_lora_rank:
            return (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim) / 2
        return self.head_dim

    def _dense_ffn_params(self) -> int:
        """Parameters of one dense feed-forward (w1, w2, w3 and their biases)."""
        ffn = 3 * self.hidden_size * self.intermediate_size
        if self.mlp_bias:
            ffn += 2 * self.intermediate_size + self.hidden_size
        return ffn

    def _moe_delta(self, active: bool) -> int:
        """Parameters of one MoE block minus those of a dense block (all experts, or the top_k active ones)."""
        d, h = self.hidden_size, self.moe_hidden_size
        routed = (self.top_k if active else self.num_experts) * 3 * d * h
        moe = d * self.num_experts + routed + self.shared_experts * 3 * d * h  # router + experts + shared
        if self.shared_experts and self.shared_expert_gate:
            moe += d
        return moe - self._dense_ffn_params()

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Exact parameter count of the built model (tied embeddings counted once).

        ``exclude_embedding`` leaves out the input embedding table (``tok_embeddings``) only; with tied
        embeddings that is also the output matrix, since they are one tensor. ``active`` counts, in MoE
        blocks, only the ``top_k`` routed experts a token passes through (plus router and shared experts).
        """
        embed = self.vocab_size * self.hidden_size
        output = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        total = self.num_layers * self._layer_params() + self.hidden_size + output  # + final norm
        total += self.num_moe_layers * self._moe_delta(active)
        return total if exclude_embedding else total + embed

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token (forward + backward) at ``seq_length``.

        ``6 * N`` for every matmul weight the token passes through (N = parameters without the input
        embedding, which is a lookup, but with the output projection even when it is tied), plus attention
        scores and values: ``6 * num_layers * seq_length * num_heads * head_dim``. That attention term is the
        causal count, half of the ``12 * L * T * d`` of full attention, since the masked half is not computed
        by flash kernels (the PaLM / nanoGPT MFU convention uses the full 12; ours is the lower, causal one).
        A sliding block counts its mean window, ``w - w^2 / 2T`` keys per query instead of ``T / 2``.
        """
        dense = self.num_params(exclude_embedding=True, active=True)  # MoE: the experts a token visits
        if self.tie_word_embeddings:
            dense += self.vocab_size * self.hidden_size
        # keys per query: T/2 causal (the convention above); a window w < T: w - w^2 / (2T) by that count
        keys = sum(
            self.sliding_window - self.sliding_window**2 / (2 * seq_length)
            if self.is_sliding_layer(i) and self.sliding_window < seq_length
            else seq_length / 2
            for i in range(self.num_layers)
        )
        attention = 12 * keys * self.num_heads * self._attention_width()  # MLA: q.k and v widths differ
        return float(6 * dense + attention)


def check_moe_args(values: dict[str, Any]) -> None:
    """Validate the MoE fields of a resolved argument dict (ConfigError naming the ``model.moe.*`` key)."""
    from llmtrain.errors import ConfigError  # local: keeps this module import-light

    n = values.get("num_experts", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"model.moe.num_experts must be an integer >= 0 (0 = dense), got {n!r}.")
    if n == 0:
        return
    k = values.get("top_k", 2)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ConfigError(f"model.moe.top_k must be an integer in [1, num_experts={n}], got {k!r}.")
    if not values.get("moe_hidden_size"):  # unset: each expert as wide as the dense MLP
        values["moe_hidden_size"] = values["intermediate_size"]
    for key in ("moe_hidden_size", "moe_every"):
        v = values.get(key, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            name = "every" if key == "moe_every" else key
            raise ConfigError(f"model.moe.{name} must be a positive integer, got {v!r}.")
    for key in ("shared_experts", "first_dense_layers"):
        v = values.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"model.moe.{key} must be an integer >= 0, got {v!r}.")
    gate = values.get("shared_expert_gate", False)
    if not isinstance(gate, bool) or (gate and not values.get("shared_experts")):
        raise ConfigError(
            f"model.moe.shared_expert_gate must be true or false, and true only with model.moe.shared_experts > 0 "
            f"(got {gate!r} with shared_experts {values.get('shared_experts', 0)!r})."
        )
    score = values.get("router_score", "softmax")
    if score not in ("softmax", "sigmoid"):
        raise ConfigError(f"model.moe.router_score must be softmax or sigmoid, got {score!r}.")
    _check_router_options(values, score)
    for key in ("aux_loss_coef", "bias_update_rate"):
        v = values.get(key, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"model.moe.{key} must be a number >= 0 (0 = off), got {v!r}.")
    cap = values.get("capacity_factor")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
        raise ConfigError(
            f"model.moe.capacity_factor must be a positive number or null (no drop), got {cap!r}."
        )
    _check_group_routing(values, n, k)


def _check_router_options(values: dict[str, Any], score: str) -> None:
    """pre_softmax / router_fp32 (booleans), aux_loss_scope and drop_policy (their named values)."""
    from llmtrain.errors import ConfigError

    for key in ("pre_softmax", "router_fp32"):
        v = values.get(key, key == "pre_softmax")
        if not isinstance(v, bool):
            raise ConfigError(f"model.moe.{key} must be true or false, got {v!r}.")
    if score == "sigmoid" and values.get("pre_softmax", True) is False:
        raise ConfigError(
            "model.moe.pre_softmax false (top-k of the logits, then a softmax over the chosen) needs "
            "model.moe.router_score softmax; a sigmoid router scores each expert on its own."
        )
    for key, allowed in (
        ("aux_loss_scope", ("micro_batch", "global_batch")),
        ("drop_policy", ("position", "probs")),
    ):
        v = values.get(key, allowed[0])
        if v not in allowed:
            raise ConfigError(f"model.moe.{key} must be {' or '.join(allowed)}, got {v!r}.")


def _check_group_routing(values: dict[str, Any], n: int, k: int) -> None:
    """n_group / topk_group / routed_scaling_factor (DeepSeek-V3's group-limited routing)."""
    from llmtrain.errors import ConfigError

    groups, top = values.get("n_group", 1), values.get("topk_group", 1)
    for key, v in (("n_group", groups), ("topk_group", top)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"model.moe.{key} must be a positive integer (1 = no groups), got {v!r}.")
    if n % groups or (groups > 1 and n // groups < 2) or top > groups or k > top * (n // groups):
        raise ConfigError(
            f"model.moe.n_group {groups} must divide num_experts {n} into groups of at least 2 experts (a group "
            f"scores by its two best), topk_group {top} must be <= n_group, and top_k {k} <= topk_group x "
            f"experts per group."
        )
    scale = values.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ConfigError(f"model.moe.routed_scaling_factor must be a positive number, got {scale!r}.")
    values["routed_scaling_factor"] = float(scale)

"""Initial values of every parameter: ``model.init`` (default | tinyinit) and ``model.norm_scheme: dssn`` gains.

:meth:`Transformer.init_weights <llmtrain.models.common.transformer.Transformer.init_weights>` draws each
weight matrix from ``normal(0, weight_std(name, args))`` and fills each norm weight with
``norm_gain(name, args)``; biases are zero. ``L`` is ``num_layers`` (the whole model's, on every pipeline
stage), ``d`` is ``hidden_size``.

``default`` (GPT-2 / Megatron): ``init_std`` for every matrix, ``init_std / sqrt(2L)`` for the two that write
into the residual stream (``attention.wo``, ``feed_forward.w2`` and the experts' ``w2``).

``tinyinit`` (Pangu Ultra, arXiv 2504.07866, section 2.1 "TinyInit"): every matrix, projections, experts,
router and output head alike, from ``N(0, 1 / (2 d L))``, i.e. ``std = sqrt(1 / (2 d L))``, scaling the std with
both width and depth instead of the usual ``N(0, 2 / (5 d))`` (small init) or its ``1 / sqrt(2L)`` residual
variant; the input embedding gets std 0.5 (:data:`TINYINIT_EMBED_STD`). With tied embeddings the one matrix is
also the output head and takes the matrix std (0.5 would give logits of std ``0.5 sqrt(d)``).

``norm_scheme: dssn`` (Pangu Ultra, section 2.1 "Depth-scaled sandwich-norm", its equations (1)-(2))::

    h <- h + Norm(gamma_attn, ATTN(Norm(h))),   gamma_attn = c_attn / sqrt(L)
    h <- h + Norm(gamma_mlp,  FFN(Norm(h))),    gamma_mlp  = c_mlp  / sqrt(L)

the post norms' gains start at ``c / sqrt(L)`` with ``c_attn = 0.283`` and ``c_mlp = 0.432``
(:data:`DSSN_C_ATTN`, :data:`DSSN_C_MLP`, the values the paper uses, the initial output scales of its attention
and FFN). ``sandwich`` is the same structure with gains 1 (GLM-4-0414's post norms); every other norm weight is 1.

Source note: the paper's own text is not in the reference store this was written from; the formulas above are
taken from a summary of its section 2 (an AI-made study note of arXiv 2504.07866v2 in a public notes repository,
which quotes both equations and the constants) and agree with the public descriptions of DSSN reused by Arcee
Trinity (post-norm gain ``1 / sqrt(L)`` at init).
"""

from __future__ import annotations

import math

from llmtrain.models.common.args import TransformerArgs

DSSN_C_ATTN = 0.283
"""Pangu Ultra's c_attn: the attention post norm's gain starts at c_attn / sqrt(num_layers)."""
DSSN_C_MLP = 0.432
"""Pangu Ultra's c_mlp: the MLP post norm's gain starts at c_mlp / sqrt(num_layers)."""
TINYINIT_EMBED_STD = 0.5
"""Pangu Ultra's TinyInit standard deviation of the (untied) input embedding."""

RESIDUAL_OUTPUTS = ("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "shared_experts.w2.weight")
"""Matrices that write into the residual stream (the default init scales them by 1 / sqrt(2L))."""


def tinyinit_std(args: TransformerArgs) -> float:
    """TinyInit's ``sqrt(1 / (2 d L))``."""
    return math.sqrt(1.0 / (2 * args.hidden_size * args.num_layers))


def weight_std(name: str, args: TransformerArgs) -> float:
    """Standard deviation of the normal draw of weight matrix ``name`` (a model-level parameter name, wrapper
    prefixes removed) under ``args.init``."""
    if args.init == "tinyinit":
        if name == "tok_embeddings.weight" and not args.tie_word_embeddings:
            return TINYINIT_EMBED_STD
        return tinyinit_std(args)
    if name.endswith(RESIDUAL_OUTPUTS):
        return args.init_std / math.sqrt(2 * args.num_layers)
    return args.init_std


def norm_gain(name: str, args: TransformerArgs) -> float:
    """Initial value of norm weight ``name``: DSSN's depth-scaled post-norm gains, else 1."""
    if args.norm_scheme == "dssn":
        if name.endswith("attention_post_norm.weight"):
            return DSSN_C_ATTN / math.sqrt(args.num_layers)
        if name.endswith("ffn_post_norm.weight"):
            return DSSN_C_MLP / math.sqrt(args.num_layers)
    return 1.0

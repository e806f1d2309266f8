"""Facts about MindFormers, as data: why keys are ignored, the optimizer and LR-schedule types, the model types
and MindFormers' own defaults for keys a file leaves out.

Everything here describes MindFormers (read from mindspore-lab/mindformers: ``trainer/base_trainer.py``,
``core/lr/lr_schedule.py``, ``core/optim``, ``models/llama/llama_config.py``,
``parallel_core/transformer_config_utils.py``, ``modules/transformer/moe.py``) or names one of our native keys;
nothing here is a fact about llmtrain's model families (those live in ``llmtrain.models``).
"""

from __future__ import annotations

from typing import Any

# ---------------------------------------------------------------------------------------------- why ignored
R_GRAPH = (
    "MindSpore graph-compiler, memory-pool or kernel setting; PyTorch has no such switch "
    "(train.compile is torch.compile)"
)
R_CKPT = (
    "MindSpore checkpoint / parallel-strategy file handling; llmtrain writes torch DCP checkpoints that "
    "reshard on load"
)
R_INFER = "inference / generation setting; `llmtrain generate` takes these as flags"
R_TOKENS = "special-token ids come from the tokenizer recorded with the dataset"
R_DTYPE = (
    "per-op precision is autocast's (train.precision); norms, softmax, RoPE and the MoE router run in fp32"
)
R_PARAMS = "parameters and optimizer states are kept in fp32 under every train.precision"
R_LAYOUT = "MindSpore weight-layout, operator-fusion or slicing switch: same math, no PyTorch counterpart"
R_DATA = "MindSpore dataset-pipeline setting; llmtrain reads memory-mapped token files (data.num_workers)"
R_PROFILE = "MindSpore profiler/monitor setting; use logging.profile_every / logging.profile_steps"
R_PLATFORM = "Huawei Cloud ModelArts / OBS / AICC platform setting"
R_AUTO = (
    "MindSpore auto-parallel strategy search or dataset sharding strategy; llmtrain's layout is the "
    "explicit degrees"
)
R_COMM = "MindSpore communication fusion / recompute scheduling; FSDP2 and torch choose buckets and overlap"
R_SEQPAR = "sequence parallelism is always on with tensor_parallel > 1"
R_EMBED = "the embedding is sharded by the tensor-parallel plan"
R_TRAINER = "llmtrain has one causal-LM pretraining trainer and one model class per family"
R_EVAL = "validation runs on the held-out split of the training data (data.valid_fraction, train.eval_steps)"
R_DEVICE = "the device and rank come from the launcher (torchrun / llmtrain launch: LOCAL_RANK)"
R_MEMORY = "PyTorch uses the whole device; cap it with PYTORCH_CUDA_ALLOC_CONF if needed"
R_SINK = "data sinking only groups steps into MindSpore epochs; the run length is the same"
R_MOE_KERNEL = "MoE kernel / dispatch implementation switch: same routing and math"
R_ROUTER_FP32 = "the MoE router runs in fp32"
R_POSITIONS = "positions are bounded by model.seq_length (RoPE is computed from positions on the fly)"
R_DROP = "no expert capacity is set, so no token is dropped"
R_AUX_IGNORED = (
    "MindFormers itself ignores it (NotSupportedInfo.useless); moe_aux_loss_coeff is the coefficient used"
)
R_ARCH = "the model class follows from the config type / model_type"
R_REGISTER = "MindFormers' class registration for its module loader"
R_LEGACY = "selects MindFormers' legacy or mcore model code; the architecture keys are read either way"
R_NOEFFECT_PP1 = "without pipeline parallel MindFormers resets it to 1"
R_DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

# ------------------------------------------------------------------------------------- optimizers, LR schedules
# type (lower-case, no '_' / '-') -> MindFormers' defaults for betas, eps and weight decay when the file omits
# them (core/optim: AdamW (0.9, 0.999) eps 1e-8; the AdamWeightDecay family 0.9 / 0.999 eps 1e-6; decay 0).
OPTIMIZERS: dict[str, dict[str, float]] = {
    "adamw": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
    "fusedadamw": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
    "adamweightdecay": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.0},
    "fp32stateadamweightdecay": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.0},
    "fusedadamweightdecay": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.0},
    "fusedcastadamweightdecay": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.0},
}
# type -> (train.decay_style, MindFormers' default lr_end for it; None: the schedule has no end LR)
LR_SCHEDULES: dict[str, tuple[str, float | None]] = {
    "cosinewithwarmuplr": ("cosine", 0.0),
    "linearwithwarmuplr": ("linear", None),  # decays to 0
    "constantwarmuplr": ("constant", None),
    "warmupstabledecaylr": ("wsd", 1e-7),
    "cosineannealinglr": ("cosine", 0.0),  # eta_min
    "polynomialwithwarmuplr": ("linear", 1e-7),  # power 1 only
}

# ------------------------------------------------------------------------------------------------ model types
# MindFormers model (1.x config class or 2.x model_type, lower-case) -> (our model.model_type, is MoE). None as
# our type: no llmtrain family yet; the message says what is missing.
MODEL_TYPES: dict[str, tuple[str | None, bool]] = {
    "llamaconfig": ("llama3", False),
    "llama": ("llama3", False),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "qwen3_moe": ("qwen3", True),
    "deepseekv3config": ("deepseek_v3", True),
    "deepseek_v3": ("deepseek_v3", True),
}
# -> (the model.model_type it will have, the label the refusal names); empty since deepseek_v3 has its family
MISSING_FAMILIES: dict[str, tuple[str, str]] = {}
# What MindFormers uses when a file leaves an architecture key out (LlamaConfig's __init__ for 1.x; the
# Hugging Face config classes MindFormers 2.x mirrors), under the adapter's canonical names (model.py).
_MF2 = {"seq_length": 4096, "compute_dtype": "bfloat16", "use_flash_attention": True}  # MFModelConfig (r1.8)
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "llamaconfig": {
        "seq_length": 2048, "hidden_size": 4096, "num_layers": 32, "num_heads": 32, "vocab_size": 32000,
        "multiple_of": 256, "rms_norm_eps": 1e-5, "theta": 10000.0, "compute_dtype": "float16",
        "qkv_has_bias": False, "tie_word_embeddings": False, "use_flash_attention": False,
    },
    "llama": {**_MF2, "rms_norm_eps": 1e-6, "theta": 10000.0, "tie_word_embeddings": False, "qkv_has_bias": False},
    "qwen2": {**_MF2, "rms_norm_eps": 1e-6, "theta": 10000.0, "tie_word_embeddings": False, "qkv_has_bias": True},
    "qwen3": {
        **_MF2,
        "rms_norm_eps": 1e-6, "theta": 10000.0, "tie_word_embeddings": False, "qkv_has_bias": False,
        "head_dim": 128,
    },
    "qwen3_moe": {
        **_MF2,
        "rms_norm_eps": 1e-6, "theta": 10000.0, "tie_word_embeddings": False, "qkv_has_bias": False,
        "head_dim": 128, "num_experts": 128, "top_k": 8, "moe_hidden_size": 768, "route_norm": False,
        "every": 1,
    },
    "deepseekv3config": {  # research/deepseek3/deepseek3_config.py
        "seq_length": 2048, "hidden_size": 4096, "num_layers": 32, "num_heads": 32, "intermediate_size": 18432,
        "vocab_size": 129280, "rms_norm_eps": 1e-6, "theta": 10000.0, "tie_word_embeddings": False,
        "initializer_range": 0.006, "compute_dtype": "bfloat16", "use_flash_attention": False,
    },
    "deepseek_v3": {  # DeepseekV3Config (Hugging Face): the 671B routing
        **_MF2, "rms_norm_eps": 1e-6, "theta": 10000.0, "tie_word_embeddings": False, "num_experts": 256,
        "top_k": 8, "moe_hidden_size": 2048, "shared_experts": 1, "router_score": "sigmoid", "route_norm": True,
        "first_dense_layers": 3, "every": 1, "scaling": 2.5, "n_group": 8, "topk_group": 4,
    },
}  # fmt: skip
# What a model type's MindFormers code hard-wires whatever the file says (models/qwen3*/modeling_*_train.py
# build their layer spec with qk_layernorm=True).
MODEL_FIXED: dict[str, dict[str, Any]] = {
    "qwen3": {"qk_layernorm": True},
    "qwen3_moe": {"qk_layernorm": True},
}
# 2.x files give the shape explicitly (MindFormers 2.x takes the rest from the Hugging Face defaults above).
REQUIRED_2X = ("hidden_size", "num_layers", "num_heads", "vocab_size")
# 1.x moe_config defaults (modules/transformer/moe.py MoEConfig); 2.x MoE defaults are mcore's (no aux loss,
# no capacity, softmax router) plus the model type's MODEL_DEFAULTS.
# Both routers (1.x moe.py, 2.x parallel_core/training_graph/transformer/moe/router.py) take the softmax over all
# experts before the top-k, multiply the chosen weights by routed_scaling_factor (1.x MoEConfig 1.0; mcore
# moe_router_topk_scaling_factor) and compute the router in router_dense_type / moe_router_dtype (float32).
MOE_DEFAULTS_1X: dict[str, Any] = {
    "top_k": 1, "capacity_factor": 1.1, "aux_loss_coef": 0.05, "route_norm": True, "shared_experts": 0,
    "router_score": "softmax", "bias_update_rate": 0.0, "scaling": 1.0, "n_group": None, "topk_group": None,
    "router_dtype": "float32", "balancing": None, "drop_policy": None,
}  # fmt: skip
MOE_DEFAULTS_2X: dict[str, Any] = {
    "capacity_factor": None, "aux_loss_coef": 0.0, "shared_experts": 0, "router_score": "softmax",
    "bias_update_rate": 0.0, "scaling": 1.0, "n_group": None, "topk_group": None, "router_dtype": "float32",
    "balancing": "sub_seq_aux_loss", "drop_policy": "probs",
}  # fmt: skip
# moe_router_load_balancing_type -> model.moe.aux_loss_scope (router.py: sub_seq_aux_loss counts each data-parallel
# slice of the micro-batch, seq_aux_loss each sequence, gbs_aux_loss the data-parallel ranks and the step's
# micro-batches so far)
BALANCING: dict[str, str] = {
    "subseqauxloss": "micro_batch", "auxloss": "micro_batch", "gbsauxloss": "global_batch",
    "seqauxloss": "micro_batch",
}  # fmt: skip
# Keys only a family with Multi-head Latent Attention or multi-token prediction reads (DeepSeek-V3): collected,
# mapped for deepseek_v3 (config/mindformers/deepseek.py), required off for others. Routed scaling and group-limited
# routing are options of every MoE router (config/mindformers/moe.py).
MLA_KEYS = (
    "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "qk_head_dim", "qk_pos_emb_head_dim",
    "v_head_dim", "multi_latent_attention", "mla_qkv_concat", "mscale", "mscale_all_dim", "beta_fast",
    "beta_slow", "mtp_depth", "num_nextn_predict_layers", "mtp_num_layers", "mtp_loss_factor",
    "mtp_loss_scaling_factor", "topk_method",
)  # fmt: skip

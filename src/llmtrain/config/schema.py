"""Typed run configuration: one dataclass per component, composed by :class:`Config`.

The YAML file is these dataclasses serialized (``config.loader`` reads and writes it). Field names follow the
seed documents' own words where they name a setting (``model.num_heads``, ``parallel.tensor_parallel``,
``train.batch_size``, ``checkpoint.keep_checkpoint_max``...). Every field has a docstring (the string below
it); ``llmtrain check --explain`` could print them. Each number field's valid range is in ``config.ranges``
(one table, applied by the loader and by ``resolve.validate``). Cross-field rules live in ``resolve.validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from llmtrain.config.survival import FaultConfig, FaultToleranceConfig, StabilityConfig


@dataclass
class MoEConfig:
    """Mixture-of-experts feed-forward (models/common/moe.py). Unset (None) fields take the flavor's value."""

    num_experts: int | None = None
    """Routed experts per MoE block; 0 = dense model (no MoE)."""
    top_k: int | None = None
    """Experts each token is sent to."""
    moe_hidden_size: int | None = None
    """Hidden width of each expert's SwiGLU (and of each shared expert)."""
    shared_experts: int | None = None
    """Always-on shared experts (one SwiGLU of width shared_experts x moe_hidden_size); 0 = none."""
    router_score: Literal["softmax", "sigmoid"] | None = None
    """softmax (Qwen, Mixtral) or sigmoid (DeepSeek-V3) router scores."""
    route_norm: bool | None = None
    """Renormalise the top_k weights of each token to sum to 1."""
    aux_loss_coef: float | None = None
    """Coefficient of the load-balancing auxiliary loss (Switch: num_experts x sum_i f_i P_i); 0 = off."""
    bias_update_rate: float | None = None
    """Auxiliary-loss-free balancing (DeepSeek-V3): per-expert selection bias moved by this much per step
    toward balance; 0 = off."""
    capacity_factor: float | None = None
    """Expert capacity = ceil(factor x tokens x top_k / num_experts) per micro-batch; tokens over it are
    dropped by that expert. None = no dropping."""
    every: int | None = None
    """MoE in one block of every N (block i is MoE when (i + 1) % N == 0, Qwen's decoder_sparse_step)."""
    first_dense_layers: int | None = None
    """The first N blocks stay dense (DeepSeek's first_k_dense_replace)."""
    shared_expert_gate: bool | None = None
    """Scale the shared experts' output per token by sigmoid(x . gate) (Qwen2-MoE's shared_expert_gate)."""
    n_group: int | None = None
    """Group-limited routing (DeepSeek-V3: 8): the experts form n_group groups and each token picks its top_k
    experts inside its topk_group best groups (a group scores by the sum of its two best scores); 1 = off."""
    topk_group: int | None = None
    """Groups each token may route to (DeepSeek-V3: 4)."""
    routed_scaling_factor: float | None = None
    """Multiplies the routed experts' weights after route_norm, in every family (DeepSeek-V3: 2.5; MindFormers'
    Qwen3-30B-A3B file: 1.5); 1 = off."""
    pre_softmax: bool | None = None
    """Softmax routers: true (default) takes the softmax over all experts, then the top_k of those scores (Qwen,
    Mixtral, DeepSeek, transformers); false takes the top_k of the logits, then a softmax over the k chosen ones
    (Megatron's default), so the weights sum to 1 whatever route_norm says. Must stay true with sigmoid scores."""
    router_fp32: bool | None = None
    """Compute the router's logits in fp32 (its input and weight cast to fp32, outside autocast), as MindFormers'
    router_dense_type float32; false (default): the gate matmul runs under autocast and its logits are cast to
    fp32. Scores, top-k and weights are fp32 either way. Under FSDP with bf16 / fp16 the weight is the 16-bit
    copy FSDP gathers, cast up."""
    aux_loss_scope: Literal["micro_batch", "global_batch"] | None = None
    """Which tokens the aux loss's expert fractions f_i count. micro_batch (default): this micro-batch's own.
    global_batch (MindFormers' gbs_aux_loss): the assignments summed over the data-parallel ranks and over the
    step's micro-batches up to this one (a running sum, reset each step). P_i is this micro-batch's own either
    way, so the gradient reaches only its tokens."""
    drop_policy: Literal["position", "probs"] | None = None
    """With capacity_factor: which of an expert's assignments past its capacity are dropped. position (default):
    the last tokens of the micro-batch; probs: those with the lowest routing weights (Megatron / MindFormers)."""


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer. Unset (None) fields take the flavor's value."""

    model_type: str = "llama3"
    """Model family: llama3 (alias llama), qwen2, qwen3, glm4, baichuan2, mistral, mixtral, deepseek_v3."""
    flavor: str | None = None
    """Named size within the family (debug, demo, 8b, 70b, ...); explicit fields below override it."""
    hidden_size: int | None = None
    """Width of the residual stream."""
    num_layers: int | None = None
    """Number of transformer blocks."""
    num_heads: int | None = None
    """Attention query heads."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means equal to num_heads."""
    intermediate_size: int | None = None
    """Hidden width of the SwiGLU MLP; None derives ceil(8/3 * hidden_size) rounded up to a multiple of 256."""
    seq_length: int = 2048
    """Training sequence length in tokens."""
    vocab_size: int | None = None
    """Embedding rows; None takes the tokenizer's vocabulary (from the first dataset's manifest)."""
    head_dim: int | None = None
    """Per-head width; None means hidden_size // num_heads."""
    rms_norm_eps: float | None = None
    """Epsilon of RMSNorm."""
    rope_theta: float | None = None
    """RoPE base frequency."""
    rope_scaling: Any = None
    """RoPE scaling: None (the flavor's), none (off; 1.0, a linear factor of 1, too), a number (linear factor) or
    a mapping with rope_type linear, dynamic, yarn, llama3 or longrope and its parameters, like Llama 3's
    {rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}."""
    max_position_embeddings: int | None = None
    """Context length the model declares (Hugging Face max_position_embeddings; dynamic RoPE scales past it);
    None means seq_length. With init_from: hf:PATH it comes from config.json."""
    use_rope: bool = True
    """Rotary position embeddings (False only with position_embedding: alibi)."""
    position_embedding: Literal["rope", "alibi"] | None = None
    """rope or alibi (Baichuan 2 13B)."""
    partial_rotary_factor: float | None = None
    """Fraction of each head's dims that are rotated (GLM-4: 0.5)."""
    qkv_bias: bool | None = None
    """Bias on the q/k/v projections (Qwen2, GLM-4)."""
    qk_norm: bool | None = None
    """RMSNorm on each head's queries and keys (Qwen3)."""
    norm_head: bool | None = None
    """Normalise the output-embedding rows (Baichuan 2 NormHead)."""
    tie_word_embeddings: bool | None = None
    """Share the input embedding and the output projection."""
    hidden_act: Literal["silu", "gelu", "gelu_tanh"] | None = None
    """Activation of the MLP gate: silu (SwiGLU), gelu (exact) or gelu_tanh (tanh approximation); None: silu."""
    mlp_bias: bool | None = None
    """Biases on the three MLP projections (Hugging Face Llama's mlp_bias)."""
    attention_out_bias: bool | None = None
    """Bias on the attention output projection (with qkv_bias, Hugging Face Llama / Qwen3 attention_bias)."""
    sliding_window: int | None = None
    """Sliding-window attention (Mistral, Qwen): a token sees itself and sliding_window - 1 before it; 0 = off."""
    sliding_window_layers: list[int] | None = None
    """Blocks (0-based) that use the sliding window; None: every block (Qwen's layer_types pick some)."""
    post_norms: bool | None = None
    """Extra RMSNorms on the attention and MLP outputs before each residual add (GLM-4-0414); the structural
    switch behind norm_scheme sandwich / dssn."""
    norm_scheme: Literal["pre", "sandwich", "dssn"] | None = None
    """Where the blocks normalise: pre (pre-norm), sandwich (pre-norm plus an RMSNorm on each sub-layer's output
    before its residual add, GLM-4-0414's post norms) or dssn (Pangu Ultra's depth-scaled sandwich norm: sandwich
    with the post norms' gains initialised to c / sqrt(num_layers)). None: the flavor's (sandwich for GLM-4-0414,
    pre for every other published checkpoint)."""
    init: Literal["default", "tinyinit"] = "default"
    """Weight init: default (normal(0, init_std), residual projections init_std / sqrt(2 * num_layers)) or
    tinyinit (Pangu Ultra: every matrix normal(0, sqrt(1 / (2 * hidden_size * num_layers))), embedding std 0.5)."""
    kv_lora_rank: int | None = None
    """Multi-head latent attention (DeepSeek-V3: 512) when > 0: keys and values come from a compressed latent
    of this width (what the KV cache holds); 0: grouped-query attention."""
    q_lora_rank: int | None = None
    """MLA query compression rank (DeepSeek-V3: 1536); 0: queries from one projection."""
    qk_nope_head_dim: int | None = None
    """MLA per-head query/key width without RoPE (DeepSeek-V3: 128)."""
    qk_rope_head_dim: int | None = None
    """MLA per-head rotary query/key width, shared key across heads (DeepSeek-V3: 64); head_dim is this."""
    v_head_dim: int | None = None
    """MLA per-head value width (DeepSeek-V3: 128)."""
    use_flash_attention: bool = True
    """Use torch's scaled_dot_product_attention (flash / memory-efficient kernels where the device has them)."""
    document_mask: bool = False
    """Mask attention across document boundaries inside packed sequences (needs EOS-separated samples)."""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """sdpa (dense masks), flex (block-sparse FlexAttention) or auto: flex for document masks on CUDA."""
    init_std: float = 0.02
    """Standard deviation of the normal init of weight matrices."""
    init_from: str | None = None
    """Start from existing weights: hf:PATH (a Hugging Face directory: its config.json is the architecture,
    model keys set here must agree with it) or a checkpoint path."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture of experts: model.moe.num_experts > 0 makes the selected blocks' feed-forward an MoE."""


@dataclass
class ParallelConfig:
    """Parallel layout. Degrees multiply to the world size; data_parallel -1 derives it."""

    data_parallel: int = -1
    """Data-parallel degree; -1 derives it as world_size / (tensor_parallel * pipeline_parallel * ...)."""
    tensor_parallel: int = 1
    """Tensor-parallel degree (with sequence parallel)."""
    pipeline_parallel: int = 1
    """Pipeline stages."""
    context_parallel: int = 1
    """Context-parallel degree for long sequences."""
    expert_parallel: int = 1
    """Expert-parallel degree (MoE)."""
    data_parallel_replicate: int = 1
    """HSDP replicate degree (data_parallel = replicate * shard)."""
    use_zero: bool = False
    """Seed spelling: enable ZeRO sharding (stage given by zero_level)."""
    zero_level: int | None = None
    """Seed spelling of the ZeRO stage (1-3); used when use_zero is true."""
    zero_stage: int | None = None
    """ZeRO stage 0-3 (0 = plain data parallel). Takes precedence over use_zero/zero_level."""
    micro_batch_num: int = 1
    """Pipeline micro-batches per step."""
    micro_batch_interleave: bool = False
    """Seed key; accepted and mapped to the interleaved pipeline schedule when pipeline_parallel > 1."""
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"] = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv, dualpipev (DeepSeek's DualPipeV:
    the V shape of zbv, each micro-batch pair's forward and backward interleaved)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedules)."""
    pipeline_layers: list[int] | None = None
    """Layers per pipeline stage chunk, in model order (pipeline_parallel x virtual_stages entries summing to
    model.num_layers), e.g. [1, 3, 3, 1] for fewer layers on the first and last stage; null = even split."""
    enable_alltoall: bool = False
    """Seed key: all-to-all dispatch for expert parallel."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer states in host memory (FSDP2 CPUOffloadPolicy; the
    seed's heterogeneous memory). Applies to the FSDP-wrapped (data-parallel) layouts."""
    reduce_grads: Literal["auto", "per_step", "per_microbatch"] = "auto"
    """DP gradient reduction under accumulation: auto, per_step or per_microbatch (docs/parallelism.md)."""
    loss_parallel: bool = True
    """Under tensor parallel, keep the logits sharded over the vocabulary and run the cross-entropy on the
    shards (train/vocab_parallel.py; torchtitan's loss parallel): each TP rank holds V / tp of them. false
    gathers whole logits on every TP rank (the trainer before loss parallel; more memory, same result)."""

    def effective_zero_stage(self) -> int:
        """The ZeRO stage after resolving the seed's use_zero/zero_level spelling."""
        if self.zero_stage is not None:
            return self.zero_stage
        if self.use_zero:
            return self.zero_level if self.zero_level is not None else 3
        return 0


@dataclass
class TrainConfig:
    """Optimisation and the training loop."""

    batch_size: int = 8
    """Global batch in sequences: micro_batch_size x data_parallel x gradient accumulation."""
    micro_batch_size: int = 1
    """Sequences per forward/backward on one data-parallel rank."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches per step on each rank; None derives it from batch_size."""
    max_steps: int = 100
    """Optimizer steps to train."""
    epochs: int | None = None
    """Seed key; when set, caps training at this many passes over the data (max_steps still applies)."""
    optimizer: Literal["adamw"] = "adamw"
    """Optimizer: adamw."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norms, biases and embeddings' norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    optimizer_impl: Literal["auto", "fused", "foreach", "single"] = "auto"
    """AdamW kernel: auto, fused, foreach or single."""
    warmup_steps: int = 0
    """Linear warmup steps from 0 to lr."""
    decay_style: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """Schedule after warmup: cosine, linear, constant or wsd (warmup-stable-decay)."""
    decay_steps: int | None = None
    """Steps over which to decay after warmup; None means max_steps - warmup_steps."""
    wsd_decay_fraction: float = 0.2
    """With decay_style wsd: the final fraction of decay_steps spent decaying (linearly) to min_lr."""
    grad_clip_norm: float | None = 1.0
    """Clip the global gradient norm to this value; None or 0 disables clipping (the norm is still logged)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32, bf16 (autocast) or fp16 (autocast with dynamic loss scaling)."""
    loss_scale: Any = "dynamic"
    """fp16 loss scaling: dynamic or a fixed number. Ignored for fp32/bf16."""
    initial_loss_scale: float = 65536.0
    """First loss scale of dynamic scaling."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic loss scale doubles."""
    label_smoothing: float = 0.0
    """Label smoothing of the cross-entropy loss."""
    loss_chunk_tokens: int | None = None
    """Loss in token chunks of this size (0: off; None: auto, 2048 at vocab >= 64K without TP/PP)."""
    seed: int = 1234
    """Seed of the model init, data order and dropout."""
    log_steps: int = 10
    """Log metrics every this many steps."""
    eval_steps: int = 0
    """Validate every this many steps (0: only at the end)."""
    compile: bool = False
    """torch.compile each block and the cross-entropy (not with tensor parallel: warning ``tp_compile``)."""
    z_loss: float = 0.0
    """PaLM's auxiliary z-loss: adds z_loss * log(Z)^2 per target token (Z the softmax normaliser of its
    logits) to the training loss, pulling the log-partition towards 0 (PaLM: 1e-4; 0: off). Not in val_loss."""
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    """FP8 GEMMs of the blocks' linears (torchao; CUDA >= 8.9): none, tensorwise or rowwise (docs/precision.md)."""


@dataclass
class DatasetSpec:
    """One entry of data.datasets."""

    path: str = ""
    """Dataset prefix as written by `llmtrain prepare --output` (PREFIX.bin, PREFIX.idx, PREFIX.manifest.json),
    or a plain Megatron-LM / MindFormers PREFIX.bin + PREFIX.idx without a manifest (then set data.tokenizer)."""
    weight: float = 1.0
    """Relative sampling weight in the blend."""


@dataclass
class DataConfig:
    """Where tokens come from."""

    datasets: list[DatasetSpec] = field(default_factory=list)
    """Token datasets to blend: a list of {path: PREFIX, weight: W}."""
    tokenizer: str | None = None
    """Tokenizer file (tokenizer.json or .model); None takes the one recorded in the first dataset's manifest.
    Required for datasets without a manifest (Megatron's preprocess_data.py output): their vocabulary size and
    EOS come from this file, the token dtype from the .idx header."""
    valid_fraction: float = 0.01
    """Fraction of documents held out for validation (whole documents, never shared with training)."""
    num_workers: int = 0
    """Background workers of the torch DataLoader."""
    eod_mask_loss: bool = False
    """Ignore the loss of the token after each EOS (predicting a new document from no context)."""
    mixture: list[dict] = field(default_factory=list)
    """Mixture changes: [{start_sample: N, weights: [one per data.datasets entry]}]; from global sample N the
    blend uses these weights (zero allowed)."""
    prepare: dict | None = None
    """Settings of `llmtrain prepare --config` (see llmtrain.data.prep.pipeline.PrepareOptions)."""


@dataclass
class CheckpointConfig:
    """Distributed checkpoints."""

    save_steps: int = 0
    """Save every this many steps (0: only at the end)."""
    keep_checkpoint_max: int = 3
    """Keep the newest this many checkpoints."""
    resume: str = "auto"
    """auto (newest checkpoint under checkpoint dir, if any), none, or a checkpoint PATH."""
    overwrite: bool = False
    """With resume: none, start over in a folder that holds committed checkpoints: they are replaced by this run's
    first checkpoint (without it, such a start is refused). `llmtrain train --overwrite` sets it."""
    save_dir: str | None = None
    """Where checkpoints go; None means <run.output_dir>/checkpoints."""
    save_at_end: bool = True
    """Save a checkpoint after the last step."""
    save_minutes: float = 0
    """Also save when this many minutes have passed since the last save (0: off)."""
    async_save: bool = False
    """Write in the background; training is blocked only while the state is staged."""
    write_threads: int = 2
    """DCP writer threads and SHA-256 threads per rank."""


@dataclass
class LoggingConfig:
    """Console, JSONL, TensorBoard and plots."""

    progress_bar: bool = True
    """Live progress bar with ETA (falls back to plain lines when the output is not a terminal)."""
    tensorboard: bool = True
    """Write TensorBoard event files under <run.output_dir>/tensorboard."""
    plot: bool = True
    """Write <run.output_dir>/loss.png at the end of the run."""
    peak_tflops: float | None = None
    """Peak dense FLOP/s of one device in TFLOP/s for MFU; None uses a built-in figure for the device."""
    profile_every: int = 0
    """Open a torch.profiler window every this many steps (chrome trace in <run.output_dir>/profile/; 0: off)."""
    profile_steps: int = 0
    """Steps in each profiler window (0: off)."""
    straggler_margin: float = 0.2
    """A rank is slow when its busy time per step exceeds the median of all ranks by this fraction."""
    straggler_patience: int = 3
    """Log steps in a row a rank must be slow before a straggler event is written."""
    wandb: bool = False
    """Also log metrics to Weights & Biases (needs `pip install wandb`)."""
    wandb_project: str = "llmtrain"
    """W&B project name."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """W&B mode: online, offline (no network; `wandb sync` later) or disabled."""


@dataclass
class EvalConfig:
    """Validation on the held-out split, and downstream tasks scored with lm-evaluation-harness (llmtrain/eval/)."""

    eval_iters: int = 10
    """Micro-batches per validation."""
    at_start: bool = True
    """Also validate (and score eval.tasks) before the first step (step 0)."""
    tasks: list[str] = field(default_factory=list)
    """Downstream tasks: shipped names (stdlib_mc, stdlib_ppl) or lm-eval task YAML paths with local data only
    (dataset_path: json + data_files); empty = none. Needs the eval extra (pip install llmtrain[eval])."""
    downstream_steps: int = 0
    """Score eval.tasks every N steps (and at the end) with the current weights; 0 = off."""
    limit: int | None = None
    """Items per task (the first N); None = all."""
    num_fewshot: int | None = None
    """Few-shot examples per item; None = each task's own default."""
    batch_size: int = 8
    """Sequences per forward pass of the downstream evaluation."""


@dataclass
class RunConfig:
    """Where and how the job runs."""

    device_target: str = "auto"
    """auto, cpu, cuda or npu (the seed's Ascend and GPU are accepted)."""
    output_dir: str = "runs/default"
    """Run directory: resolved config, metrics.jsonl, tensorboard/, checkpoints/, loss.png."""
    name: str | None = None
    """Run name for logs; None uses the output directory's name."""
    threads: int | None = None
    """torch CPU threads per process (None: torch's default)."""
    dist_timeout_s: int = 600
    """Timeout of collectives (the seed's HCCL_CONNECT_TIMEOUT)."""
    hang_timeout_s: float = 0
    """Hang watchdog: a step taking longer than this dumps every rank's stacks and exits non-zero (0: off)."""


@dataclass
class RecomputeConfig:
    """Activation recomputation (checkpointing), applied per transformer block from outside the model."""

    mode: Literal["none", "selective", "full", "offload"] = "none"
    """none, selective (every `every`-th block), full (every block), offload (every block's saved tensors to host)."""
    every: int = 2
    """With mode selective: recompute one block in this many."""


@dataclass
class StageConfig:
    """One entry of ``stages:``, a phase of a multi-stage run (general -> reasoning -> annealing).

    Give exactly one length: ``steps``, ``tokens`` (rounded up to whole steps of this stage's batch) or
    ``fraction`` of the run's token budget (``train.max_steps`` x the base config's tokens per step)."""

    name: str = ""
    """Stage name (unique); metrics rows and events carry it."""
    steps: int | None = None
    """Length in optimizer steps."""
    tokens: int | None = None
    """Length in tokens (steps = ceil(tokens / this stage's tokens per step))."""
    fraction: float | None = None
    """Length as a fraction of the run's token budget."""
    lr_end: float | None = None
    """LR at the stage's last step as a fraction of the peak train.lr (default: the LR the stage starts with;
    for the last stage train.min_lr / train.lr)."""
    lr_schedule: Literal["constant", "linear", "cosine", "wsd"] | None = None
    """Shape from the stage's start LR to lr_end: constant (lr_end throughout), linear, cosine or wsd (constant,
    then linear over the last train.wsd_decay_fraction of the stage). Default: train.decay_style."""
    datasets: list[DatasetSpec] = field(default_factory=list)
    """The stage's mixture ({path, weight}); empty = data.datasets. A dataset left out is not read."""
    overrides: dict = field(default_factory=dict)
    """Settings changed for this stage, as {dotted.key: value}; only keys that may change mid-run."""


@dataclass
class Config:
    """A whole run: the seed's sections (model, parallel, train, run) plus data, checkpoint, logging, eval."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    stages: list[StageConfig] = field(default_factory=list)
    """Multi-stage curriculum (see StageConfig); empty = one stage over data.datasets."""

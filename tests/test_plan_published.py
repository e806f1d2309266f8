"""The planner against published training runs (sources, quoted figures and assumptions: docs/planner.md).

Every run is planned as its source describes it: model shape, degrees, batch, sequence, recompute, and the
engine that ran it (``megatron`` for Megatron-LM / Megatron-Core / Megatron-Bridge / Megatron-DeepSpeed /
MindFormers / Meta's Llama 3 stack, ``nemo`` for NeMo's DGXC recipes, ``torchtitan`` for torchtitan's
benchmarks), whether tensor-parallel communication was overlapped and, in the Megatron-style engines, the
gradient buffer's dtype the run's stack keeps (:data:`FP32_GRADS`), all given as ``llmtrain plan`` flags and
read by the command's own parser (:func:`user_layout`). Each case carries its source
(:data:`SOURCES`) and the figure as published; the tests print source, quoted figure, planner figure and error.

Asserted (bounds measured at this commit; the goal of issue 30 is 10% on both, 15% for MoE):

* tokens/s per GPU: the mean absolute error over all runs, over the fit half (:data:`FIT_SOURCES`: the two
  sources the time constants were first chosen on; the GEMM ceiling ``DEFAULT_MATMUL_EFFICIENCY``, the GEMM
  curve's bandwidth fraction and ``dp_overlap`` are its joint grid optimum, asserted) and over the held-out
  half (every other source, never used to choose a constant), each within :data:`TIME_MAE_BOUND`; every run within +-25% except :data:`KNOWN_TIME_MISSES`
  (each with its reason and its own bound);
* memory: every run that trained fits (except :data:`KNOWN_MEMORY_MISSES`, asserted to stay a miss); where the
  source published a measured peak per GPU (:data:`MEASURED_MEMORY`: torchtitan's tables, ``Memory(GiB)``,
  the caching allocator's max reserved bytes) the planner's reserved peak is within :data:`MEMORY_BOUND` of it
  and the MAE within :data:`MEMORY_MAE_BOUND`, over all runs, the fit half (Tables 1 and 3, which choose
  ``ALLOCATOR_RESERVE``, asserted) and the held-out half; the run torchtitan reports as out of memory is
  planned as not fitting (:data:`MEASURED_OOM`);
* MoE runs (DeepSeek-V3 on 2,048 H800 as its technical report ran it, DGXC DeepSeek-V3 on 1,024 and on 512
  H100 and Qwen3-235B on 256 H100, EP drawn from DP x TP with expert-TP 1) plan, fit an 80 GB card, and are
  within the bounds of :data:`MOE_BOUND`.
"""

from __future__ import annotations

import json
import os

import pytest

from llmtrain.config.loader import load_config
from llmtrain.errors import ConfigError
from llmtrain.plan.catalog import load_catalog, parse_cluster
from llmtrain.plan.search import evaluate, layout_from_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "configs/seed/100b_32card.yaml")  # llama3 family, bf16, compile; overridden below


def gpt(
    h: int, layers: int, heads: int, vocab: int, ffn: int | None = None, kv: int | None = None
) -> list[str]:
    """Overrides for a GPT-style model: a non-gated MLP of ``ffn`` (default 4h) becomes the SwiGLU of the same
    parameter count (I = 2 ffn / 3, rounded to 64)."""
    width = round(2 * (ffn or 4 * h) / 3 / 64) * 64
    return [f"model.hidden_size={h}", f"model.num_layers={layers}", f"model.num_heads={heads}",
            f"model.num_kv_heads={kv or heads}", f"model.intermediate_size={width}", f"model.vocab_size={vocab}"]  # fmt: skip


def layout(
    tp: int, pp: int, batch: int, mbs: int = 1, v: int = 1, cp: int = 1, zero: int = 1, ep: int = 1
) -> list[str]:
    out = [f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}", f"parallel.context_parallel={cp}",
           f"parallel.expert_parallel={ep}", f"parallel.zero_stage={zero}", f"train.batch_size={batch}",
           f"train.micro_batch_size={mbs}", "parallel.data_parallel=-1"]  # fmt: skip
    if pp > 1:
        out += [
            "parallel.schedule=" + ("interleaved_1f1b" if v > 1 else "1f1b"),
            f"parallel.virtual_stages={v}",
        ]
    return out


def megatron_h100(tflops: float, h: int, layers: int, seq: int = 4096, vocab: int = 131072) -> float:
    """Tokens/s of a Megatron-LM README row: its FLOP count 72 l h^2 + 12 l s h + 6 V h per token."""
    return tflops * 1e12 / (72 * layers * h * h + 12 * layers * seq * h + 6 * vocab * h)


def narayanan(tflops: float, h: int, layers: int, seq: int = 2048, vocab: int = 51200) -> float:
    """Tokens/s of a Narayanan et al. (2021) Table 1 row: 96 l h^2 (1 + s / 6h + V / 16 l h) per token
    (their count includes the recomputed forward)."""
    return tflops * 1e12 / (96 * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h)))


LLAMA2_13B = ["model.hidden_size=5120", "model.num_layers=40", "model.num_heads=40", "model.num_kv_heads=40",
              "model.intermediate_size=13824", "model.vocab_size=32000", "model.seq_length=4096"]  # fmt: skip
LLAMA2_70B = ["model.hidden_size=8192", "model.num_layers=80", "model.num_heads=64", "model.num_kv_heads=8",
              "model.intermediate_size=28672", "model.vocab_size=32000", "model.seq_length=4096"]  # fmt: skip
QWEN3_235B = ["model.model_type=qwen3", "model.flavor=30b_a3b", "model.hidden_size=4096", "model.num_layers=94",
              "model.num_heads=64", "model.num_kv_heads=4", "model.moe.num_experts=128", "model.moe.top_k=8",
              "model.moe.moe_hidden_size=1536", "model.seq_length=4096"]  # fmt: skip
"""Qwen3-235B-A22B (its Hugging Face config.json): hidden 4096, 94 layers, 64 heads, 4 KV heads, 128 experts,
top-8, expert width 1536, vocab 151,936 (the 30b_a3b flavor's, with its head_dim 128 and norms)."""
MEG = ["--engine", "megatron"]
OVERLAP = ["--engine", "megatron", "--tp-overlap"]
MEG_FULL = ["--engine", "megatron", "--recompute", "full"]
MEG_2021 = MEG_FULL + ["--attention", "unfused"]
"""Narayanan et al. 2021 and BLOOM (2022, Megatron-DeepSpeed): Megatron before flash attention (the s x s scores,
the fused scale-mask-softmax and attention dropout; plan/layout.py ``Layout.attention``)."""
NEMO, NEMO_OVERLAP = ["--engine", "nemo"], ["--engine", "nemo", "--tp-overlap"]
FP32_GRADS = ["--grad-dtype", "fp32"]
"""An fp32 gradient buffer (``Layout.grad_dtype``) where the run's stack keeps one: Megatron-LM with ``--bf16``
(megatron/training/arguments.py sets ``accumulate_allreduce_grads_in_fp32`` unless ``--grad-reduce-in-bf16``),
DeepSpeed's bf16 optimizer (BLOOM: ``fp32_groups_gradients_flat``), the Llama 3 paper ("FP32 gradient
accumulation ... reduce-scatter gradients in FP32") and the DeepSeek-V3 report (gradients "retained in FP32").
The NeMo recipes (``optim.grad_sync_dtype: bf16``) and Megatron-Bridge's performance recipes
(``grad_reduce_in_fp32 = False``) keep the engines' 16-bit default. The buffer's dtype is also the dtype the
data-parallel reduction moves (plan/timing.py)."""
MLM_OVERLAP = OVERLAP + FP32_GRADS
S4K = ["model.seq_length=4096"]
# name -> (published tokens/s per GPU, overrides, cluster, flags)
RUNS: dict[str, tuple[float, list[str], str, list[str]]] = {
    # Megatron-LM README, "Training Speed and Scalability": H100, seq 4096, vocab 131,072, tp-comm-overlap,
    # overlapped DP, data-parallel size 48; micro-batch 1 and the interleaving depth are our assumptions.
    "megatron-1.7b": (megatron_h100(408.8, 2048, 24), gpt(2048, 24, 16, 131072) + S4K + layout(1, 1, 192), "48xh100", MLM_OVERLAP),
    "megatron-7.1b": (megatron_h100(465.9, 4096, 30), gpt(4096, 30, 32, 131072) + S4K + layout(2, 1, 192), "96xh100", MLM_OVERLAP),
    "megatron-16b": (megatron_h100(489.1, 6144, 32), gpt(6144, 32, 48, 131072) + S4K + layout(4, 1, 192), "192xh100", MLM_OVERLAP),
    "megatron-32b": (megatron_h100(459.6, 7168, 48), gpt(7168, 48, 56, 131072) + S4K + layout(8, 1, 192), "384xh100", MLM_OVERLAP),
    "megatron-70b": (megatron_h100(419.7, 8192, 84), gpt(8192, 84, 64, 131072) + S4K + layout(8, 2, 384, v=3), "768xh100", MLM_OVERLAP),
    "megatron-119b": (megatron_h100(420.5, 10240, 92), gpt(10240, 92, 80, 131072) + S4K + layout(8, 4, 768), "1536xh100", MLM_OVERLAP),
    "megatron-177b": (megatron_h100(432.8, 12288, 96), gpt(12288, 96, 96, 131072) + S4K + layout(8, 6, 1152, v=2), "2304xh100", MLM_OVERLAP),
    "megatron-314b": (megatron_h100(474.4, 16384, 96), gpt(16384, 96, 128, 131072) + S4K + layout(8, 8, 1536, v=3), "3072xh100", MLM_OVERLAP),
    "megatron-462b": (megatron_h100(459.9, 18432, 112), gpt(18432, 112, 144, 131072) + S4K + layout(8, 16, 3072, v=7), "6144xh100", MLM_OVERLAP),
    # Narayanan et al. 2021, Table 1 (A100 80 GB, seq 2048, vocab 51,200, full recompute); micro-batches and
    # interleaving from Megatron-LM's examples/sc21/run_table_1.sh; no sequence parallel or TP overlap then.
    "narayanan-1.7b": (narayanan(137, 2304, 24), gpt(2304, 24, 24, 51200) + layout(1, 1, 512, mbs=16, zero=0), "32xa100-80gb", MEG_2021),
    "narayanan-3.6b": (narayanan(138, 3072, 30), gpt(3072, 30, 32, 51200) + layout(2, 1, 512, mbs=16, zero=0), "64xa100-80gb", MEG_2021),
    "narayanan-7.5b": (narayanan(142, 4096, 36), gpt(4096, 36, 32, 51200) + layout(4, 1, 512, mbs=16, zero=0), "128xa100-80gb", MEG_2021),
    "narayanan-18b": (narayanan(135, 6144, 40), gpt(6144, 40, 48, 51200) + layout(8, 1, 1024, mbs=8, zero=0), "256xa100-80gb", MEG_2021),
    "narayanan-39b": (narayanan(138, 8192, 48), gpt(8192, 48, 64, 51200) + layout(8, 2, 1536, mbs=4, zero=0), "512xa100-80gb", MEG_2021),
    "narayanan-76b": (narayanan(140, 10240, 60), gpt(10240, 60, 80, 51200) + layout(8, 4, 1792, mbs=2, v=3, zero=0), "1024xa100-80gb", MEG_2021),
    "narayanan-145b": (narayanan(148, 12288, 80), gpt(12288, 80, 96, 51200) + layout(8, 8, 2304, mbs=2, v=2, zero=0), "1536xa100-80gb", MEG_2021),
    "narayanan-310b": (narayanan(155, 16384, 96), gpt(16384, 96, 128, 51200) + layout(8, 16, 2160, v=2, zero=0), "1920xa100-80gb", MEG_2021),
    "narayanan-530b": (narayanan(163, 20480, 105), gpt(20480, 105, 128, 51200) + layout(8, 35, 2520, v=3, zero=0), "2520xa100-80gb", MEG_2021),
    "narayanan-1t": (narayanan(163, 25600, 128), gpt(25600, 128, 160, 51200) + layout(8, 64, 3072, zero=0), "3072xa100-80gb", MEG_2021),
    # NVIDIA DGX Cloud benchmarking recipes (github.com/NVIDIA/dgxc-benchmarking, v24.11: NeMo 24.09, BF16,
    # distributed optimizer, the README tables and their YAML): tokens per second / GPUs.
    "dgxc-llama3.1-8b": (81222 / 8, ["model.flavor=8b", "model.seq_length=8192"] + layout(1, 1, 128, cp=2), "8xh100", NEMO),
    "dgxc-llama3.1-70b": (71235 / 64, ["model.flavor=70b", "model.seq_length=8192"] + layout(4, 4, 128, v=5, cp=2), "64xh100", NEMO_OVERLAP),
    "dgxc-llama3.1-405b": (120022 / 576, ["model.flavor=405b", "model.seq_length=8192"] + layout(8, 9, 252, v=7, cp=2), "576xh100", NEMO_OVERLAP),
    "dgxc-nemotron4-340b": (28432 / 128, gpt(18432, 96, 96, 256000, ffn=73728, kv=8) + S4K + layout(8, 8, 32, v=12), "128xh100", NEMO_OVERLAP),
    "dgxc-nemotron4-15b": (92630 / 16, gpt(6144, 32, 48, 256000, ffn=24576, kv=8) + S4K + layout(4, 1, 64, mbs=4), "16xh100", NEMO_OVERLAP),
    "dgxc-grok1-314b": (402718 / 512, gpt(6144, 64, 48, 131072, kv=8) + ["model.seq_length=8192", "model.moe.num_experts=8",
                        "model.moe.top_k=2", "model.moe.moe_hidden_size=32768"] + layout(4, 8, 1024, v=8, cp=2, ep=8), "512xh100", NEMO),
    # BLOOM-176B (bigscience tr11-176B-ml: Megatron-DeepSpeed, 384 A100 80 GB, TP4 PP12 DP8, ZeRO-1, micro-batch 2,
    # global batch 2048, seq 2048, full recompute; chronicles: 19.46 samples/s at full batch)
    "bloom-176b": (19.46 * 2048 / 384, gpt(14336, 70, 112, 250880) + layout(4, 12, 2048, mbs=2), "384xa100-80gb", MEG_2021 + FP32_GRADS),
    # Llama 3 405B (Llama 3 paper, Table 4: 8,192 H100, TP8 PP16 DP64, seq 8192, 16M tokens per batch, 430
    # TFLOP/s per GPU, at our FLOP count); sec. 3.3.2: "one Transformer layer" less on the first and the last stage,
    # so that "the first model chunk on the first stage has only the embedding" and the last only the output and
    # loss: one layer per chunk, 126 = 16 x 8 - 2, i.e. 8 virtual stages, the end chunks empty. Sec. 3.3.2 on
    # its FSDP: "shards optimizer states and gradients, but for model shards we do not reshard after forward
    # computation", with "FP32 gradient accumulation ... and also reduce-scatter gradients in FP32": ZeRO-2 with
    # an fp32 gradient shard (the megatron engine at zero_stage 2: bf16 weights whole, gradients sharded).
    "llama3-405b": (430e12 / 2.52398e12, ["model.flavor=405b", "model.seq_length=8192"] + layout(8, 16, 2048, v=8, zero=2)
                    + ["parallel.pipeline_layers=[0," + "1," * 126 + "0]"], "8192xh100", MEG + FP32_GRADS),
    # DeepSeek-V3 technical report (arXiv 2412.19437): 2,048 H800, PP16 with DualPipe, EP64 over 8 nodes, ZeRO-1
    # DP, no TP, seq 4096, batch 15,360; 180K H800 GPU hours per trillion tokens. Sec. 3.2.1: DualPipe overlaps
    # each chunk's all-to-all with another micro-batch's compute (dualpipev, torch's DualPipeV: the same pairs and
    # "PP + 1" activations, one copy of the weights), --ep-overlap (sec. 3.2.2: the all-to-all on 20 of 132 SMs);
    # sec. 3.3: FP8 GEMMs (tensorwise stands in for its 1x128 / 128x128 blocks), the linear layers' inputs cached
    # in FP8 and "the inputs of the SwiGLU operator in MoE" too (--act-fp8-input-store); sec. 3.2.3: RMSNorm and
    # the MLA up-projections recomputed, the SwiGLU output too (sec. 3.3.4): layernorm, mla_up_proj, moe_act; fp32
    # gradients (sec. 3.3.4); one MTP module on the rank of the embedding and the output head (sec. 2.2, 3.2.3):
    # the two end chunks of the V hold only those, the 61 layers fill the other 30 (3, then 2 each).
    "deepseek-v3": (1e12 / 180e3 / 3600, ["model.model_type=deepseek_v3", "model.flavor=671b", "model.seq_length=4096",
                    "train.fp8=tensorwise"] + layout(1, 16, 15360, ep=64)
                    + ["parallel.schedule=dualpipev", "parallel.virtual_stages=2",
                       "parallel.pipeline_layers=[0,3," + "2," * 29 + "0]"], "2048xh800",
                    MEG + ["--recompute-modules", "layernorm,mla_up_proj,moe_act", "--mtp-layers", "1", "--ep-overlap",
                           "--act-fp8-input-store"] + FP32_GRADS),
    # NVIDIA dgxc-benchmarking deepseek_v3/pretraining/README.md (NeMo 25.04.01 image, BF16): 1,024 H100, TP2 PP16
    # EP64 ETP1 DP32, MBS1, GBS 8192, seq 4096; its launch.sh: --recompute_modules mla_up_proj; "training step time
    # = 52.04 s" -> 4096 x 8192 / 52.04 / 1024 tokens/s per GPU. EP 64 over DP 32 x TP 2 (expert-TP 1). The script
    # it runs, NeMo's scripts/performance/llm/pretrain_deepseek_v3.py, sets num_layers_in_first_pipeline_stage =
    # 64 / pp - 1 = 3 and num_layers_in_last_pipeline_stage = 64 / pp - 2 = 2 (4 in each middle stage), and NeMo's
    # recipes/deepseek_v3.py pretrain_recipe trains one MTP layer (use_mtp=True: mtp_num_layers 1):
    # pipeline_layers [3, 14 x 4, 2], --mtp-layers 1.
    "dgxc-deepseek-v3-1024": (4096 * 8192 / 52.04 / 1024, ["model.model_type=deepseek_v3", "model.flavor=671b",
                              "model.seq_length=4096"] + layout(2, 16, 8192, ep=64)
                              + ["parallel.pipeline_layers=[3," + "4," * 14 + "2]"], "1024xh100",
                              MEG + ["--recompute-modules", "mla_up_proj", "--mtp-layers", "1"]),
    # The same README at v25.05.04 (its launch.sh: GSW_VERSION 25.05.04, NeMo 25.04.01, BF16) adds a 512-H100 row:
    # TP2 PP8 CP1 EP64 ETP1 DP32 VP1 MBS1 GBS 4096 (GA 128), seq 4096, --recompute_modules mla_up_proj,
    # --activation_offload_layers 0, no FP8 ("FP8 recipe is not currently supported"); "Training step time
    # (seconds per step) | 48.948". The same NeMo script: first stage 64 / 8 - 1 = 7 layers, last 64 / 8 - 2 = 6,
    # 8 in each of the six middle stages, one MTP layer.
    "dgxc-deepseek-v3-512": (4096 * 4096 / 48.948 / 512, ["model.model_type=deepseek_v3", "model.flavor=671b",
                             "model.seq_length=4096"] + layout(2, 8, 4096, ep=64)
                             + ["parallel.pipeline_layers=[7," + "8," * 6 + "6]"], "512xh100",
                             MEG + ["--recompute-modules", "mla_up_proj", "--mtp-layers", "1"]),
    # NVIDIA dgxc-benchmarking qwen3/pretrain/README.md (Megatron-Bridge, BF16): Qwen3-235B-A22B on 256 H100,
    # TP2 PP8 EP32 DP16 VP4 MBS1, seq 4096; its example output "pretrain_qwen3_235b_a22b_bf16_gpus256_tp2_pp8_
    # cp1_vp4_ep32_mbs1_gbs2048 ... 25532.270 ms" -> 4096 x 2048 / 25.532 / 256 tokens/s per GPU.
    "dgxc-qwen3-235b-256": (4096 * 2048 / 25.53227 / 256, QWEN3_235B + layout(2, 8, 2048, ep=32, v=4), "256xh100", MEG),
}  # fmt: skip

TT = ["--engine", "torchtitan"]
TT_SEL, TT_FULL = TT + ["--recompute", "selective"], TT + ["--recompute", "full"]
TT_ASYNC = TT_FULL + ["--tp-overlap"]
TT_2025 = TT_SEL + ["--compiled-loss"]
"""torchtitan from 2025: the loss compiled under ``training.compile`` (its December 2024 benchmarks ran it eager)."""
NOC, COMP, FP8 = (
    ["train.compile=false"],
    ["train.compile=true"],
    ["train.compile=true", "train.fp8=tensorwise"],
)
L3_8B, L3_70B, L3_405B = (["model.flavor=8b"], ["model.flavor=70b"], ["model.flavor=405b"])
S8K = ["model.seq_length=8192"]
# torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton, H100 96 GB at 500 W): TPS/GPU and
# Memory(GiB) (the max over GPUs of the caching allocator's reserved peak). Local batch = micro-batch x
# pipeline micro-batches; the 405B runs' 32 (Table 5) and 8 (Table 6) local samples are taken as 8 pipeline
# micro-batches (torchtitan's default: the pipeline degree). "selective" = torchtitan's op-level SAC.
RUNS.update({  # fmt: skip
    # Table 1: Llama 3.1 8B, FSDP 8, local batch 2, selective AC
    "torchtitan-h100-8b-fsdp8": (5762.0, L3_8B + S8K + NOC + layout(1, 1, 16, mbs=2, zero=3), "8xh100-96gb", TT_SEL),
    "torchtitan-h100-8b-fsdp8-compile": (6667.0, L3_8B + S8K + COMP + layout(1, 1, 16, mbs=2, zero=3), "8xh100-96gb", TT_SEL),
    "torchtitan-h100-8b-fsdp8-fp8": (8532.0, L3_8B + S8K + FP8 + layout(1, 1, 16, mbs=2, zero=3), "8xh100-96gb", TT_SEL),
    # Table 3: the same on 128 GPUs
    "torchtitan-h100-8b-fsdp128": (5605.0, L3_8B + S8K + NOC + layout(1, 1, 256, mbs=2, zero=3), "128xh100-96gb", TT_SEL),
    "torchtitan-h100-8b-fsdp128-compile": (6514.0, L3_8B + S8K + COMP + layout(1, 1, 256, mbs=2, zero=3), "128xh100-96gb", TT_SEL),
    "torchtitan-h100-8b-fsdp128-fp8": (8380.0, L3_8B + S8K + FP8 + layout(1, 1, 256, mbs=2, zero=3), "128xh100-96gb", TT_SEL),
    # Table 2: 8B, FSDP x CP on 8 GPUs, compile + Float8, local batch 1, full AC (sequence 32k x CP)
    **{f"torchtitan-h100-8b-cp{cp}": (tps, L3_8B + FP8 + [f"model.seq_length={32768 * cp}"] + layout(1, 1, 8 // cp, cp=cp, zero=3),
                                       "8xh100-96gb", TT_FULL)
       for cp, tps in ((1, 3890.0), (2, 2540.0), (4, 1071.0), (8, 548.0))},
    # Table 4: Llama 3.1 70B, FSDP 32 x TP 8 on 256 GPUs, compile + Float8, local batch 16, full AC
    "torchtitan-h100-70b-2d": (829.0, L3_70B + S8K + FP8 + layout(8, 1, 512, mbs=16, zero=3), "256xh100-96gb", TT_FULL),
    "torchtitan-h100-70b-2d-asynctp": (876.0, L3_70B + S8K + FP8 + layout(8, 1, 512, mbs=16, zero=3), "256xh100-96gb", TT_ASYNC),
    # Table 5: Llama 3.1 405B, FSDP 8 x TP 8 x PP 8 on 512 GPUs, compile + Float8 + AsyncTP, local batch 32, full AC
    "torchtitan-h100-405b-1f1b": (100.0, L3_405B + S8K + FP8 + layout(8, 8, 256, mbs=4, zero=3), "512xh100-96gb", TT_ASYNC),
    "torchtitan-h100-405b-interleaved": (128.0, L3_405B + S8K + FP8 + layout(8, 8, 256, mbs=4, v=2, zero=3), "512xh100-96gb", TT_ASYNC),
    # Table 6: 405B, TP 8 x PP 8 x FSDP x CP, 1F1B, local batch 8, full AC (sequence 32k x CP)
    **{f"torchtitan-h100-405b-cp{cp}": (tps, L3_405B + FP8 + [f"model.seq_length={32768 * cp}"] + layout(8, 8, 64 // cp, cp=cp, zero=3),
                                         "512xh100-96gb", TT_ASYNC)
       for cp, tps in ((1, 76.0), (2, 47.0), (4, 31.0), (8, 16.0))},
    # torchtitan docs/performance.md: FSDP2 on 64 A100 80 GB, WPS per GPU (no compile, no Float8)
    "torchtitan-a100-llama3-8b": (2973.0, L3_8B + S8K + NOC + layout(1, 1, 64, zero=3), "64xa100-80gb", TT_SEL),
    "torchtitan-a100-llama3-70b": (331.0, L3_70B + S8K + NOC + layout(1, 1, 64, zero=3), "64xa100-80gb", TT_FULL),
    "torchtitan-a100-llama2-13b": (2162.0, LLAMA2_13B + NOC + layout(1, 1, 128, mbs=2, zero=3), "64xa100-80gb", TT),
    "torchtitan-a100-llama2-13b-op": (1904.0, LLAMA2_13B + NOC + layout(1, 1, 128, mbs=2, zero=3), "64xa100-80gb", TT_SEL),
    "torchtitan-a100-llama2-70b-op": (355.0, LLAMA2_70B + NOC + layout(1, 1, 64, zero=3), "64xa100-80gb", TT_SEL),
    "torchtitan-a100-llama2-70b-full": (353.0, LLAMA2_70B + NOC + layout(1, 1, 128, mbs=2, zero=3), "64xa100-80gb", TT_FULL),
    # torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md (Trainy, June 2025; torchtitan e7c0cae):
    # llama3_8b.toml (seq 8192, op-level selective AC) with local batch 2, training.compile (the loss compiled
    # too in that version: components/loss.py) and float8 (FSDP float8 all-gather), 4 and 8 nodes of 8 H200
    **{f"torchtitan-h200-8b-fsdp{n}-fp8": (tps, L3_8B + S8K + FP8 + layout(1, 1, 2 * n, mbs=2, zero=3), f"{n}xh200", TT_2025)
       for n, tps in ((32, 10938.0), (64, 10753.0))},
})  # fmt: skip


KNOWN_MEMORY_MISSES: dict[str, str] = {}
"""Runs that trained but are planned as not fitting (name -> reason), asserted to stay misses. Empty: DGXC
DeepSeek-V3 on 512 H100 (84.7 GiB while mla_up_proj was costed for time only) plans at 72.5 GiB with Megatron's
drop of core attention's q, k, v; Llama 3
405B, the last one (82.8 of 78.5 GiB with Megatron's whole bf16 gradient buffer), is planned as the paper's FSDP
runs it (ZeRO-2, fp32 gradient shards: the case's comment) at 78.49 of 78.5 GiB on pipeline rank 1, a margin of
about 10 MiB: 70.0 GiB of activations (141 one-layer chunks in flight, N = pp = 16 contiguous micro-batches),
5.9 GiB of bf16 weights kept gathered, 0.75 GiB of fp32 gradient, master and Adam shards, 1.5 GiB for one
block's unsharded fp32 gradient before its reduce-scatter and 0.3 GiB of backward temporaries."""

SOURCES = {  # name prefix -> where the figures are published
    "megatron-": "Megatron-LM README, 'Training Speed and Scalability' (H100, model FLOP/s per GPU)",
    "narayanan-": "Narayanan et al. 2021, Table 1 (A100; examples/sc21/run_table_1.sh for micro-batches)",
    "dgxc-llama": "NVIDIA dgxc-benchmarking v24.11 llama3.1/README_*.md (NeMo 24.09, tokens/s)",
    "dgxc-nemotron": "NVIDIA dgxc-benchmarking v24.11 nemotron/README_*.md (NeMo 24.09, tokens/s)",
    "dgxc-grok": "NVIDIA dgxc-benchmarking v24.11 grok1/README_314b.md (NeMo 24.09, tokens/s)",
    "dgxc-deepseek": "NVIDIA dgxc-benchmarking deepseek_v3/pretraining/README.md (NeMo 25.04.01, step time)",
    "dgxc-qwen3": "NVIDIA dgxc-benchmarking qwen3/pretrain/README.md (Megatron-Bridge, example step time)",
    "bloom-": "bigscience tr11-176B-ml chronicles (Megatron-DeepSpeed, samples/s)",
    "llama3-": "Llama 3 paper (Dubey et al. 2024), Table 4 (TFLOP/s per GPU)",
    "deepseek-": "DeepSeek-V3 technical report (GPU hours per trillion tokens)",
    "mindformers-": "MindFormers docs/model_cards/llama2.md (tokens/s/p)",
    "torchtitan-h100-": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (TPS/GPU, Memory(GiB))",
    "torchtitan-a100-": "torchtitan docs/performance.md (WPS per GPU, 64 A100)",
    "torchtitan-h200-": "torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md (Trainy; TPS/GPU, Memory(GiB))",
}
FIT_SOURCES = ("megatron-", "narayanan-")
"""The fit half, by source: the two sources the global time constants were first chosen on. The constants it
pins, the GEMM ceiling ``DEFAULT_MATMUL_EFFICIENCY``, the GEMM curve's ``bandwidth_fraction`` and
``dp_overlap``, are its joint grid optimum (asserted below); the others come from measurements or counts
(docs/planner.md, "Time model"). Every other source is the held-out half and is never used to choose one."""

MEASURED_MEMORY = {  # name -> Memory(GiB) as published (torchtitan: max reserved over all GPUs)
    "torchtitan-h100-8b-fsdp8": 82.4, "torchtitan-h100-8b-fsdp8-compile": 77.0, "torchtitan-h100-8b-fsdp8-fp8": 76.8,
    "torchtitan-h100-8b-fsdp128": 67.0, "torchtitan-h100-8b-fsdp128-compile": 62.0,
    "torchtitan-h100-8b-fsdp128-fp8": 61.8,
    "torchtitan-h100-8b-cp1": 83.9, "torchtitan-h100-8b-cp2": 84.2, "torchtitan-h100-8b-cp4": 84.0,
    "torchtitan-h100-8b-cp8": 84.5,
    "torchtitan-h100-70b-2d": 71.9, "torchtitan-h100-70b-2d-asynctp": 67.6,
    "torchtitan-h100-405b-1f1b": 82.5, "torchtitan-h100-405b-interleaved": 72.7,
    "torchtitan-h100-405b-cp1": 75.3, "torchtitan-h100-405b-cp2": 75.9, "torchtitan-h100-405b-cp4": 77.1,
    "torchtitan-h100-405b-cp8": 84.9,
    "torchtitan-h200-8b-fsdp32-fp8": 47.96, "torchtitan-h200-8b-fsdp64-fp8": 46.97,
}  # fmt: skip
MEASURED_OOM = {
    # torchtitan docs/performance.md, footnote 1: "the 70B training with local batch size 2 will cause an OOM
    # error when selective activation checkpointing is used" (Llama 2 70B, 64 A100 80 GB, FSDP)
    "torchtitan-a100-llama2-70b-op-b2": (0.0, LLAMA2_70B + NOC + layout(1, 1, 128, mbs=2, zero=3), "64xa100-80gb", TT_SEL),
}  # fmt: skip
MEMORY_BOUND = (-0.16, 0.065)
"""Planned reserved / measured - 1 for every MEASURED_MEMORY case, as measured at this commit: the planner's
reserved peak (its allocated peak, checked on CPU within 10%, plus ALLOCATOR_RESERVE) is at most 6.4% above
torchtitan's and at most 15.7% under it (the 70B 2-D run at 131k tokens per micro-batch: docs/planner.md)."""
MEMORY_MAE_BOUND = {"all": 0.056, "fit": 0.037, "held-out": 0.064}
"""Goal 10%; measured: all 20 runs 5.5%, fit half (6) 3.6%, held-out half (14) 6.4% (the two H200 runs of
June 2025, +5.2% / +4.0% with torchtitan's compiled loss, would be +42% with the December 2024 eager one)."""
TIME_MAE_BOUND = {"all": 0.089, "fit": 0.075, "held-out": 0.097}
"""Tokens/s MAE as measured at this commit (goal 10% on each): all 57 runs 8.9%, fit half (19) 7.4%, held-out half
(38) 9.6%, DeepSeek-V3's own run among them since it is planned as its report ran it (9.0 / 7.4 / 9.8% over 56
runs without it; 9.5 / 7.4 / 10.6% before torchtitan's ring carried its K/V at the query heads' width, as its Llama
repeats them before SDPA; 10.2 / 7.4 / 11.8% over 54 runs before torch's async TP hid only the forward's TP
collectives and FP8's casts were costed as traffic; 9.2 / 5.4 / 11.4% before the data-parallel reduction moved
the gradient buffer's dtype, the Megatron-style ZeRO-2 reduce-scatter was charged per micro-batch and the fit
half's optimum was re-fitted). The largest held-out misses: torchtitan's ring attention at >= 128k tokens on 8B
(KNOWN_TIME_MISSES)."""
RING = (
    "torchtitan's ring attention (torch context_parallel, load-balanced, all-gather rotation) is costed from its "
    "mechanism (long_context.ring_attention: per-step fp32 merge and accumulation traffic, the K/V all-gather "
    "and the dK/dV rotations at the query heads' width, each hidden behind one step's SDPA, the last one "
    "exposed), which adds 4-5% on 8B (the ring stays inside one node; 7-14% on 405B); at a constant 32k local tokens the "
    "published time per token grows 2.4x from CP 2 to CP 4 and 1.95x from CP 4 to CP 8, where the attention "
    "work per rank doubles and nothing else the mechanism does grows faster"
)
FP32_REDUCE = (
    "the fp32 gradient reduction of FP32_GRADS (Megatron-LM's --bf16 default, grad_reduce_in_fp32) over a "
    "data-parallel group of one GPU per node (TP 8 fills the node), on the per-GPU NIC: the once-per-step "
    "reduce-scatter of a rank's 4B parameters hides only behind the last micro-batch's backward (-11% with a "
    "16-bit reduction); whether the README's run passed --grad-reduce-in-bf16 its table does not say"
)
KNOWN_TIME_MISSES = {  # name -> (bound on |planned / published - 1|, reason); asserted to stay beyond 25%
    "torchtitan-h100-8b-cp4": (0.33, RING),
    "torchtitan-h100-8b-cp8": (0.38, RING),
    "megatron-32b": (0.27, FP32_REDUCE),
}
MOE_BOUND = 0.14
"""Goal 15%, met: DeepSeek-V3 on 2,048 H800 is planned 2.1% slow as its report runs it (DualPipe's all-to-all
overlap on 20 of 132 SMs, FP8 GEMMs and activation caching, its module recompute and MTP layer; 63% slow while
zbv, BF16 and full recompute stood in for them), DGXC DeepSeek-V3 is planned 13.7% fast on 1,024 H100 and 10.4% fast on 512 H100 with the
pipeline layouts NeMo's performance script gives them (64 / pp - 1 layers on the first stage, 64 / pp - 2 + the
MTP layer on the last), their mla_up_proj recompute (time, and core attention's q, k, v not kept) and MTP layer
modelled (the EP all-to-all is a third of the planned step), Qwen3-235B 8.5% slow."""


def source(name: str) -> str:
    return next(text for prefix, text in SOURCES.items() if name.startswith(prefix))


def held_out(name: str) -> bool:
    return not name.startswith(FIT_SOURCES)


def user_layout(overrides: list[str], cluster_spec: str, flags: list[str], catalog=None):
    """(config, cluster, layout, model args, tokens per step) as ``llmtrain plan BASE OVERRIDES --cluster SPEC
    FLAGS`` builds them: the command's own argument parser and its flag -> layout mapping
    (``commands.plan.layout_options``); ``catalog`` replaces the device catalog (the constant fits)."""
    import argparse

    from llmtrain.commands.plan import add_arguments, layout_options

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args([BASE, *overrides, "--cluster", cluster_spec, *flags])
    cfg, _ = load_config(ns.config, ns.overrides)
    cluster = parse_cluster(ns.cluster, catalog or load_catalog())
    lay, margs, tokens = layout_from_config(
        cfg, cluster.num_devices, ns.recompute or cfg.recompute.mode, ns.offload, **layout_options(ns)
    )
    return cfg, cluster, lay, margs, tokens


def plan(name: str, catalog=None, runs=None) -> dict[str, float]:
    published, overrides, cluster_spec, flags = (runs or RUNS)[name]
    cfg, cluster, lay, margs, tokens = user_layout(overrides, cluster_spec, flags, catalog)
    res = evaluate(margs, lay, cluster, tokens, bool(cfg.train.compile))
    return {"published": published, "predicted": res.tokens_per_s_per_device, "fits": float(res.memory.fits),
            "memory_gib": res.memory.total / 2**30,
            "reserved_gib": res.memory.reserved / 2**30, "capacity_gib": res.memory.capacity / 2**30, "mfu": res.mfu}  # fmt: skip


def _mae(errors: list[float]) -> float:
    return sum(abs(e) for e in errors) / len(errors)


@pytest.fixture(scope="module")
def planned() -> dict[str, dict[str, float]]:
    return {name: plan(name) for name in RUNS}


def test_mean_absolute_error(planned, capsys):
    errors = {n: r["predicted"] / r["published"] - 1 for n, r in planned.items()}
    fit = [e for n, e in errors.items() if not held_out(n)]
    held = [e for n, e in errors.items() if held_out(n)]
    with capsys.disabled():
        print()
        for half, names in (("fit half", [n for n in errors if not held_out(n)]),
                            ("held-out half", [n for n in errors if held_out(n)])):  # fmt: skip
            print(f"  {half}:")
            for n in names:
                r = planned[n]
                print(f"    {n:<36} published {r['published']:9.1f}  planned {r['predicted']:9.1f}  {errors[n]:+6.1%}"
                      f"  memory {r['memory_gib']:6.1f} / {r['capacity_gib']:.1f} GiB  [{source(n)}]")  # fmt: skip
        print(f"  tokens/s per GPU, mean absolute error: all {len(errors)} runs {_mae(list(errors.values())):.1%}, "
              f"fit half ({len(fit)}) {_mae(fit):.1%}, held-out half ({len(held)}) {_mae(held):.1%}")  # fmt: skip
    assert len(errors) >= 50 and len(fit) == 19
    assert _mae(list(errors.values())) <= TIME_MAE_BOUND["all"]
    assert _mae(fit) <= TIME_MAE_BOUND["fit"]
    assert _mae(held) <= TIME_MAE_BOUND["held-out"]


@pytest.mark.parametrize("name", list(RUNS))
def test_each_run_within_25_percent_and_fits(planned, name):
    r = planned[name]
    bound = KNOWN_TIME_MISSES.get(name, (0.25, ""))[0]
    assert abs(r["predicted"] / r["published"] - 1) <= bound, name
    if name in KNOWN_TIME_MISSES:
        assert abs(r["predicted"] / r["published"] - 1) > 0.25, f"{name} is now within 25%: remove it"
    if name in KNOWN_MEMORY_MISSES:
        assert not r["fits"], f"{name} now fits: remove it from KNOWN_MEMORY_MISSES"
        return
    assert r["fits"], (
        f"{name} really trained but is planned at {r['memory_gib']:.1f} of {r['capacity_gib']:.1f} GiB"
    )


def memory_fit_half(name: str) -> bool:
    """The fit half of the measured-memory runs, by table: torchtitan's 1-D FSDP runs of its December 2024 H100
    benchmark (Tables 1 and 3)."""
    return name.startswith("torchtitan-h100-8b-fsdp")


def test_measured_memory(planned, capsys):
    """The planned reserved peak (allocated peak + ALLOCATOR_RESERVE) against torchtitan's Memory(GiB)."""
    errors = {n: planned[n]["reserved_gib"] / gib - 1 for n, gib in MEASURED_MEMORY.items()}
    fit = [e for n, e in errors.items() if memory_fit_half(n)]
    held = [e for n, e in errors.items() if not memory_fit_half(n)]
    with capsys.disabled():
        print()
        for n, gib in MEASURED_MEMORY.items():
            half = "fit" if memory_fit_half(n) else "held-out"
            print(f"  {n:<36} {half:<8} measured {gib:5.1f} GiB  planned {planned[n]['reserved_gib']:5.1f} GiB "
                  f"(allocated {planned[n]['memory_gib']:5.1f})  {errors[n]:+6.1%}  [{source(n)}]")  # fmt: skip
        print(f"  memory per GPU, mean absolute error: all {len(errors)} measured runs {_mae(list(errors.values())):.1%}, "
              f"fit half ({len(fit)}) {_mae(fit):.1%}, held-out half ({len(held)}) {_mae(held):.1%}")  # fmt: skip
    for n, e in errors.items():
        assert MEMORY_BOUND[0] <= e <= MEMORY_BOUND[1], f"{n}: planned / measured - 1 = {e:+.1%}"
    assert len(fit) == 6 and len(held) == 14
    assert _mae(list(errors.values())) <= MEMORY_MAE_BOUND["all"]
    assert _mae(fit) <= MEMORY_MAE_BOUND["fit"] and _mae(held) <= MEMORY_MAE_BOUND["held-out"]


def test_allocator_reserve_is_the_fit_half_optimum(planned):
    """ALLOCATOR_RESERVE is the best of a 0.025 grid on the fit half of the measured-memory runs only."""
    from llmtrain.plan.memory import ALLOCATOR_RESERVE

    fit = {n: gib for n, gib in MEASURED_MEMORY.items() if memory_fit_half(n)}

    def mae(r: float) -> float:
        return _mae([planned[n]["memory_gib"] * (1 + r) / gib - 1 for n, gib in fit.items()])

    assert mae(ALLOCATOR_RESERVE) <= min(mae(ALLOCATOR_RESERVE - 0.025), mae(ALLOCATOR_RESERVE + 0.025))


@pytest.mark.parametrize("name", list(MEASURED_OOM))
def test_measured_out_of_memory_does_not_fit(name):
    r = plan(name, runs=MEASURED_OOM)
    assert not r["fits"], f"{name} ran out of memory but is planned at {r['memory_gib']:.1f} GiB"


@pytest.mark.parametrize(
    "name", ["deepseek-v3", "dgxc-deepseek-v3-1024", "dgxc-deepseek-v3-512", "dgxc-qwen3-235b-256"]
)
def test_moe_recipes_fit_an_80_gb_card(planned, name):
    r = planned[name]
    assert r["fits"] and r["memory_gib"] <= 80 * 0.98
    assert abs(r["predicted"] / r["published"] - 1) <= MOE_BOUND


def test_time_constants_are_the_fit_half_optimum():
    """The constants the fit half pins, the GEMM ceiling ``e`` with the GEMM curve's ``bandwidth_fraction`` and
    ``dp_overlap``, are the joint optimum of the fit half's MAE on their grids (0.025, 0.1, 0.05; dp_overlap at
    its bound 1.0), and only of it: no held-out run enters."""
    from dataclasses import replace

    from llmtrain.plan.catalog import DEFAULT_MATMUL_EFFICIENCY, Catalog
    from llmtrain.plan.search import evaluate
    from llmtrain.plan.timing import Efficiency

    base = load_catalog()
    fit = [n for n in RUNS if not held_out(n)]
    eff0 = Efficiency()
    prepared = {}
    for n in fit:
        published, overrides, cluster_spec, flags = RUNS[n]
        cfg, _, lay, margs, tokens = user_layout(overrides, cluster_spec, flags, base)
        prepared[n] = (published, cluster_spec, lay, margs, tokens, bool(cfg.train.compile))

    def mae(e: float, beta: float, dp_overlap: float) -> float:
        cat = Catalog({k: replace(d, matmul_efficiency=e) for k, d in base.devices.items()}, base.aliases)
        eff = replace(eff0, dp_overlap=dp_overlap, gemm=replace(eff0.gemm, bandwidth_fraction=beta))
        errs = []
        for published, spec, lay, margs, tokens, comp in prepared.values():
            r = evaluate(margs, lay, parse_cluster(spec, cat), tokens, comp, eff=eff)
            errs.append(r.tokens_per_s_per_device / published - 1)
        return _mae(errs)

    e, beta, dpo = DEFAULT_MATMUL_EFFICIENCY, eff0.gemm.bandwidth_fraction, eff0.dp_overlap
    here = mae(e, beta, dpo)
    for step in ((0.025, 0, 0), (-0.025, 0, 0), (0, 0.1, 0), (0, -0.1, 0), (0, 0, -0.05)):
        assert here <= mae(e + step[0], beta + step[1], dpo + step[2]), step
    assert dpo == 1.0  # at its bound


DGXC_DSV3 = ["model.model_type=deepseek_v3", "model.flavor=671b", "model.seq_length=4096"] + layout(
    2, 16, 8192, ep=64
)


def _plan_cli(capsys, *argv: str) -> tuple[dict, str]:
    from llmtrain.cli import main as cli_main

    assert cli_main(["plan", *argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert cli_main(["plan", *argv]) == 0
    return got, capsys.readouterr().out


def test_plan_names_its_engine_and_the_publishing_one(capsys):
    """The DGXC DeepSeek-V3 layout (EP 64 over DP 32 x TP 2, expert-TP 1) and the MindFormers DeepSeek-V3 run
    file plan on 80 GB H100s; the output names the engine it modelled, and the one-line hint names the engine
    that models the published run with that engine's figures (which fit an 80 GB card)."""
    pytest.importorskip("llmtrain.models.deepseek")
    mf = os.path.join(ROOT, "tests/fixtures/mindformers/deepseek3_671b.yaml")
    for argv, name in (([BASE, *DGXC_DSV3, "--cluster", "1024xh100"], "DGXC DeepSeek-V3"),
                       ([mf, "--cluster", "1024xh100"], "MindFormers DeepSeek-V3")):  # fmt: skip
        got, text = _plan_cli(capsys, *argv)
        assert got["engine"] == "llmtrain" and "engine: llmtrain (this trainer" in text
        [hint] = got["hints"]
        assert name in hint and "--engine megatron" in hint and ", fits," in hint
        assert text.count("\nhint: ") == 1
        published, _ = _plan_cli(capsys, *argv, "--engine", "megatron")
        assert published["engine"] == "megatron" and published["hints"] == []
        assert published["fits"] and published["memory_per_device_bytes"]["total"] <= 80 * 2**30
        assert f"{published['memory_per_device_bytes']['total'] / 2**30:.1f} GiB per device" in hint
    # the MindFormers file plans within an 80 GB card under this trainer too
    assert got["fits"] and got["memory_per_device_bytes"]["total"] <= 80 * 2**30
    # a layout that is no published recipe gets no hint; a run file of this trainer names no other engine
    plain, _ = _plan_cli(capsys, BASE, "--cluster", "32x910b@4")
    assert plain["engine"] == "llmtrain" and plain["hints"] == []


def test_module_recompute_and_mtp_by_hand(capsys):
    """DGXC DeepSeek-V3's ``--recompute-modules mla_up_proj`` adds, per layer and micro-batch on the slowest rank,
    the forward of the two MLA up-projections (q_lora_rank 1536 -> 64 heads x 192, kv_lora_rank 512 -> 64 x 256
    on a TP-2 rank) and RoPE's traffic; ``--mtp-layers 1`` puts one more MoE block and one more output head on
    the last stage. Both print in the layout; an unknown module is refused with the valid ones named."""
    pytest.importorskip("llmtrain.models.deepseek")
    from dataclasses import replace

    from llmtrain.plan.gemm import GemmModel, gemm_time
    from llmtrain.plan.layout import rank_shapes
    from llmtrain.plan.timing import estimate_step_time

    cfg, _ = load_config(BASE, DGXC_DSV3)
    cluster = parse_cluster("1024xh100", load_catalog())
    lay, margs, _ = layout_from_config(cfg, 1024, engine="megatron")
    plain = estimate_step_time(margs, lay, cluster, fused=True)
    up = estimate_step_time(margs, replace(lay, recompute_modules=("mla_up_proj",)), cluster, fused=True)
    dev, tokens = cluster.device, 4096.0
    gemms = gemm_time(dev, tokens, 64 * 256, 512, 2, GemmModel()) + gemm_time(
        dev, tokens, 64 * 192, 1536, 2, GemmModel()
    )
    rope = 3 * 2 * tokens * 128 * 64 / 2 / (dev.memory_bw_gbs * 1e9)
    slow = int(plain.parts["slowest_stage"])
    layers = rank_shapes(margs, lay)[slow].layers
    per_mb = up.stage_microbatch_s[slow] - plain.stage_microbatch_s[slow]
    assert per_mb == pytest.approx(layers * (gemms + rope), rel=1e-9)
    # memory: mla_up_proj drops core attention's q, k, v (as the planner counts them: 3 x 128 heads x 160, the
    # FLOP count's width, (192 + 128) / 2, over TP 2) and keeps the q and kv latents and the rotary key (1536 +
    # 512 + 64, whole), 2 bytes each, per token
    from llmtrain.plan.memory import layer_activation_bytes

    up_lay = replace(lay, recompute_modules=("mla_up_proj",))
    for moe in (False, True):
        saved = layer_activation_bytes(margs, lay, moe) - layer_activation_bytes(margs, up_lay, moe)
        assert saved == 2 * (3 * 128 * 160 / 2 - (1536 + 512 + 64))
    assert layer_activation_bytes(margs, replace(up_lay, engine="llmtrain"), True) == layer_activation_bytes(
        margs, replace(lay, engine="llmtrain"), True
    )  # this trainer has no module recompute
    mtp = replace(lay, mtp_layers=1)
    last = rank_shapes(margs, mtp)[-1]
    assert (last.mtp, last.moe_layers) == (1, rank_shapes(margs, lay)[-1].moe_layers + 1)
    assert (
        estimate_step_time(margs, mtp, cluster, fused=True).stage_microbatch_s[-1]
        > plain.stage_microbatch_s[-1]
    )
    from llmtrain.cli import main as cli_main

    argv = ["plan", BASE, *DGXC_DSV3, "--cluster", "1024xh100", "--engine", "megatron"]
    assert cli_main([*argv, "--recompute-modules", "mla_up_proj", "--mtp-layers", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"].endswith("rc-modules-mla_up_proj mtp1")
    assert cli_main([*argv, "--recompute-modules", "mla_up"]) == 2
    err = capsys.readouterr().err
    assert "--recompute-modules mla_up" in err and "mla_up_proj" in err and "Traceback" not in err


def test_ring_attention_costs_by_hand(monkeypatch):
    """torchtitan's ring (torch context_parallel) for torchtitan's 8B at CP 8, 262,144 tokens: per layer and rank
    the eager fp32 merge / accumulation bytes of long_context.RING_MERGE_BYTES over the rank's 32,768 queries x
    4,096 output width and its 2 x 32,768 x 4,096 K/V elements (torchtitan's Llama repeats its 8 K/V heads to the 32
    query heads before SDPA, so the ring carries them 4x wider); the K/V all-gather hides behind step 0's SDPA and
    each dK / dV rotation behind one step's backward, so only the last rotation is exposed."""
    from dataclasses import replace

    from llmtrain.plan.long_context import RING_MERGE_BYTES as M
    from llmtrain.plan.long_context import ring_attention
    from llmtrain.plan.timing import Efficiency, estimate_step_time, group_bandwidth

    published, overrides, spec, flags = RUNS["torchtitan-h100-8b-cp8"]
    cfg, _ = load_config(BASE, overrides)
    cluster = parse_cluster(spec, load_catalog())
    lay, margs, _ = layout_from_config(cfg, 8, "full", engine="torchtitan")
    ring = ring_attention(margs, lay)
    q, kv = 32768 * 4096, 2 * 32768 * 4096
    assert ring is not None and ring.steps == 8
    assert ring.merge_fwd == q * (M["fwd_once"] + 7 * M["fwd_step"])
    assert ring.merge_bwd == q * (M["bwd_q_once"] + 7 * M["bwd_q_step"]) + kv * (
        M["bwd_kv_once"] + 7 * M["bwd_kv_step"]
    )
    assert ring.kv_gather == 7 * kv * 2 and ring.dkv_send == 4 * kv
    assert ring_attention(margs, replace(lay, engine="megatron")) is None
    eff = Efficiency()
    send = ring.dkv_send / group_bandwidth(cluster, 8, 1, eff) + eff.latency_s
    st = estimate_step_time(margs, lay, cluster, fused=True)
    assert st.cp_exposed == pytest.approx(lay.grad_accum * margs.num_layers * send, rel=1e-9)
    # the merges' traffic at the HBM bandwidth, the forward's twice under full recompute
    import llmtrain.plan.timing as timing

    monkeypatch.setattr(
        timing, "ring_attention", lambda args, layout: replace(ring, merge_fwd=0.0, merge_bwd=0.0)
    )
    without = estimate_step_time(margs, lay, cluster, fused=True)
    merges = (2 * ring.merge_fwd + ring.merge_bwd) / (cluster.device.memory_bw_gbs * 1e9)
    assert st.compute - without.compute == pytest.approx(lay.grad_accum * margs.num_layers * merges, rel=1e-9)


def test_attention_rate_by_device_and_kernel():
    """Flash attention runs at the device's published FlashAttention-2 rate (A100 189, H100 312 TFLOP/s forward +
    backward, devices.yaml); the unfused attention of Megatron before flash attention (Narayanan et al., BLOOM),
    and a device without a published rate, at ``attention_ratio`` of the GEMM ceiling."""
    from dataclasses import replace

    from llmtrain.plan.timing import Efficiency, _attention_time

    cat = load_catalog()
    cfg, _ = load_config(BASE, ["model.flavor=8b", "model.seq_length=8192"] + layout(1, 1, 8, zero=3))
    lay, margs, _ = layout_from_config(cfg, 8, engine="torchtitan")
    eff, tokens, keys = Efficiency(), 8192.0, 4096.0
    flops = 14 * keys * tokens * margs.num_heads * margs.head_dim
    for name, tflops in (("a100-80gb", 189), ("h100", 312), ("h800", 312)):
        dev = cat.get(name)
        assert dev.attention_tflops == tflops
        got = _attention_time(margs, lay, dev, tokens, keys, margs.head_dim, eff)
        assert got == pytest.approx(flops / (tflops * 1e12), rel=1e-12)
        stand_in = flops / (dev.peak_flops * dev.matmul_efficiency * eff.attention_ratio)
        unfused = _attention_time(
            margs, replace(lay, attention="unfused"), dev, tokens, keys, margs.head_dim, eff
        )
        assert unfused == pytest.approx(stand_in, rel=1e-12)
    b200 = cat.get("b200")  # no published rate in the catalog
    assert _attention_time(margs, lay, b200, tokens, keys, margs.head_dim, eff) == pytest.approx(
        flops / (b200.peak_flops * b200.matmul_efficiency * eff.attention_ratio), rel=1e-12
    )
    with pytest.raises(ConfigError, match="--attention"):
        replace(lay, attention="sdpa")


def test_pipeline_p2p_by_hand():
    """Point-to-point sends: 2 (pp - 1) v exchanges on the fill and drain path, plus two per micro-batch in the
    non-interleaved 1F1B steady state (each send / receive pair waited before the next compute); the interleaved
    schedule overlaps its steady-state exchanges with the other chunks' compute."""
    from dataclasses import replace

    from llmtrain.plan.timing import Efficiency, estimate_step_time, group_bandwidth

    cfg, _ = load_config(BASE, ["model.flavor=70b", "model.seq_length=4096"] + layout(8, 4, 64, v=1))
    cluster = parse_cluster("64xh100", load_catalog())
    lay, margs, _ = layout_from_config(cfg, 64, engine="megatron")
    eff = Efficiency()
    msg = 4096 * margs.hidden_size / 8 * 2  # sequence-parallel bf16 activations of one micro-batch
    one = msg / group_bandwidth(cluster, 2, 8 * lay.dp, eff) + eff.latency_s
    m = lay.grad_accum
    st = estimate_step_time(margs, lay, cluster, fused=True)
    assert st.pp_p2p == pytest.approx((2 * 3 + 2 * m) * one, rel=1e-12)
    inter = replace(lay, schedule="interleaved_1f1b", virtual_stages=2)
    assert estimate_step_time(margs, inter, cluster, fused=True).pp_p2p == pytest.approx(
        2 * 3 * 2 * one, rel=1e-12
    )

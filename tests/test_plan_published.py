"""The planner against published training runs (sources, quoted figures and assumptions: docs/planner.md).

Every run is planned as its source describes it: model shape, degrees, batch, sequence, recompute, and the
engine that ran it (``megatron`` for Megatron-LM / Megatron-Core / Megatron-Bridge / Megatron-DeepSpeed /
MindFormers / Meta's Llama 3 stack, ``nemo`` for NeMo's DGXC recipes, ``torchtitan`` for torchtitan's
benchmarks) and whether tensor-parallel communication was overlapped. Each case carries its source
(:data:`SOURCES`) and the figure as published; the tests print source, quoted figure, planner figure and error.

Asserted (bounds measured at this commit; the goal of issue 30 is 10% on both, 15% for MoE):

* tokens/s per GPU: the mean absolute error over all runs, over the fit half (:data:`FIT_SOURCES`: the two
  sources the time constants were first chosen on; the one global GEMM ceiling ``DEFAULT_MATMUL_EFFICIENCY``
  is the grid optimum on it, asserted) and over the held-out half (every other source, never used to choose a
  constant), each within :data:`TIME_MAE_BOUND`; every run within +-25% except :data:`KNOWN_TIME_MISSES`
  (each with its reason and its own bound);
* memory: every run that trained fits (except :data:`KNOWN_MEMORY_MISSES`, asserted to stay a miss); where the
  source published a measured peak per GPU (:data:`MEASURED_MEMORY`: torchtitan's tables, ``Memory(GiB)``,
  the caching allocator's max reserved bytes) the planner's reserved peak is within :data:`MEMORY_BOUND` of it
  and the MAE within :data:`MEMORY_MAE_BOUND`, over all runs, the fit half (Tables 1 and 3, which choose
  ``ALLOCATOR_RESERVE``, asserted) and the held-out half; the run torchtitan reports as out of memory is
  planned as not fitting (:data:`MEASURED_OOM`);
* MoE runs (DGXC DeepSeek-V3 on 1,024 H100 and Qwen3-235B on 256 H100, EP drawn from DP x TP with expert-TP 1)
  plan, fit an 80 GB card, and are within the bounds of :data:`MOE_BOUND`.

DeepSeek-V3 on 2,048 H800 (the technical report) is checked for memory only (:data:`MEMORY_ONLY`).
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
NEMO, NEMO_OVERLAP = ["--engine", "nemo"], ["--engine", "nemo", "--tp-overlap"]
S4K = ["model.seq_length=4096"]
# name -> (published tokens/s per GPU, overrides, cluster, flags)
RUNS: dict[str, tuple[float, list[str], str, list[str]]] = {
    # Megatron-LM README, "Training Speed and Scalability": H100, seq 4096, vocab 131,072, tp-comm-overlap,
    # overlapped DP, data-parallel size 48; micro-batch 1 and the interleaving depth are our assumptions.
    "megatron-1.7b": (megatron_h100(408.8, 2048, 24), gpt(2048, 24, 16, 131072) + S4K + layout(1, 1, 192), "48xh100", OVERLAP),
    "megatron-7.1b": (megatron_h100(465.9, 4096, 30), gpt(4096, 30, 32, 131072) + S4K + layout(2, 1, 192), "96xh100", OVERLAP),
    "megatron-16b": (megatron_h100(489.1, 6144, 32), gpt(6144, 32, 48, 131072) + S4K + layout(4, 1, 192), "192xh100", OVERLAP),
    "megatron-32b": (megatron_h100(459.6, 7168, 48), gpt(7168, 48, 56, 131072) + S4K + layout(8, 1, 192), "384xh100", OVERLAP),
    "megatron-70b": (megatron_h100(419.7, 8192, 84), gpt(8192, 84, 64, 131072) + S4K + layout(8, 2, 384, v=3), "768xh100", OVERLAP),
    "megatron-119b": (megatron_h100(420.5, 10240, 92), gpt(10240, 92, 80, 131072) + S4K + layout(8, 4, 768), "1536xh100", OVERLAP),
    "megatron-177b": (megatron_h100(432.8, 12288, 96), gpt(12288, 96, 96, 131072) + S4K + layout(8, 6, 1152, v=2), "2304xh100", OVERLAP),
    "megatron-314b": (megatron_h100(474.4, 16384, 96), gpt(16384, 96, 128, 131072) + S4K + layout(8, 8, 1536, v=3), "3072xh100", OVERLAP),
    "megatron-462b": (megatron_h100(459.9, 18432, 112), gpt(18432, 112, 144, 131072) + S4K + layout(8, 16, 3072, v=7), "6144xh100", OVERLAP),
    # Narayanan et al. 2021, Table 1 (A100 80 GB, seq 2048, vocab 51,200, full recompute); micro-batches and
    # interleaving from Megatron-LM's examples/sc21/run_table_1.sh; no sequence parallel or TP overlap then.
    "narayanan-1.7b": (narayanan(137, 2304, 24), gpt(2304, 24, 24, 51200) + layout(1, 1, 512, mbs=16, zero=0), "32xa100-80gb", MEG_FULL),
    "narayanan-3.6b": (narayanan(138, 3072, 30), gpt(3072, 30, 32, 51200) + layout(2, 1, 512, mbs=16, zero=0), "64xa100-80gb", MEG_FULL),
    "narayanan-7.5b": (narayanan(142, 4096, 36), gpt(4096, 36, 32, 51200) + layout(4, 1, 512, mbs=16, zero=0), "128xa100-80gb", MEG_FULL),
    "narayanan-18b": (narayanan(135, 6144, 40), gpt(6144, 40, 48, 51200) + layout(8, 1, 1024, mbs=8, zero=0), "256xa100-80gb", MEG_FULL),
    "narayanan-39b": (narayanan(138, 8192, 48), gpt(8192, 48, 64, 51200) + layout(8, 2, 1536, mbs=4, zero=0), "512xa100-80gb", MEG_FULL),
    "narayanan-76b": (narayanan(140, 10240, 60), gpt(10240, 60, 80, 51200) + layout(8, 4, 1792, mbs=2, v=3, zero=0), "1024xa100-80gb", MEG_FULL),
    "narayanan-145b": (narayanan(148, 12288, 80), gpt(12288, 80, 96, 51200) + layout(8, 8, 2304, mbs=2, v=2, zero=0), "1536xa100-80gb", MEG_FULL),
    "narayanan-310b": (narayanan(155, 16384, 96), gpt(16384, 96, 128, 51200) + layout(8, 16, 2160, v=2, zero=0), "1920xa100-80gb", MEG_FULL),
    "narayanan-530b": (narayanan(163, 20480, 105), gpt(20480, 105, 128, 51200) + layout(8, 35, 2520, v=3, zero=0), "2520xa100-80gb", MEG_FULL),
    "narayanan-1t": (narayanan(163, 25600, 128), gpt(25600, 128, 160, 51200) + layout(8, 64, 3072, zero=0), "3072xa100-80gb", MEG_FULL),
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
    "bloom-176b": (19.46 * 2048 / 384, gpt(14336, 70, 112, 250880) + layout(4, 12, 2048, mbs=2), "384xa100-80gb", MEG + ["--recompute", "full"]),
    # Llama 3 405B (Llama 3 paper, Table 4: 8,192 H100, TP8 PP16 DP64, seq 8192, 16M tokens per batch, 430
    # TFLOP/s per GPU, at our FLOP count); first and last stage one layer less (sec. 3.3.2), 2 virtual stages.
    "llama3-405b": (430e12 / 2.52398e12, ["model.flavor=405b", "model.seq_length=8192"] + layout(8, 16, 2048, v=2)
                    + ["parallel.pipeline_layers=[3," + "4," * 30 + "3]"], "8192xh100", MEG),
    # DeepSeek-V3 technical report: 2,048 H800, PP16 (DualPipe), EP64 over 8 nodes, ZeRO-1 DP, no TP, seq 4096,
    # batch 15,360; 180K GPU hours per trillion tokens. FP8 GEMMs and the all-to-all hidden by DualPipe are not
    # modelled (zbv stands in for DualPipe; full recompute for its FP8 activation caching and recomputed norms,
    # MLA up-projections and SwiGLU): memory only, its throughput is printed but not in the MAE.
    "deepseek-v3": (1e12 / 180e3 / 3600, ["model.model_type=deepseek_v3", "model.flavor=671b", "model.seq_length=4096"]
                    + layout(1, 16, 15360, ep=64) + ["parallel.schedule=zbv", "parallel.virtual_stages=2"], "2048xh800",
                    MEG + ["--recompute", "full"]),
    # NVIDIA dgxc-benchmarking deepseek_v3/pretrain/README.md (Megatron-Bridge, BF16): 1,024 H100, TP2 PP16 EP64
    # ETP1 DP32, MBS1, GBS 8192, seq 4096, RecomputeModule mla_up_proj; "training step time = 52.04 s" ->
    # 4096 x 8192 / 52.04 / 1024 tokens/s per GPU. EP 64 over DP 32 x TP 2 (expert-TP 1); the module recompute
    # is not modelled (planned without recompute: its time is not charged, its memory saving not taken).
    "dgxc-deepseek-v3-1024": (4096 * 8192 / 52.04 / 1024, ["model.model_type=deepseek_v3", "model.flavor=671b",
                              "model.seq_length=4096"] + layout(2, 16, 8192, ep=64), "1024xh100", MEG),
    # NVIDIA dgxc-benchmarking qwen3/pretrain/README.md (Megatron-Bridge, BF16): Qwen3-235B-A22B on 256 H100,
    # TP2 PP8 EP32 DP16 VP4 MBS1, seq 4096; its example output "pretrain_qwen3_235b_a22b_bf16_gpus256_tp2_pp8_
    # cp1_vp4_ep32_mbs1_gbs2048 ... 25532.270 ms" -> 4096 x 2048 / 25.532 / 256 tokens/s per GPU.
    "dgxc-qwen3-235b-256": (4096 * 2048 / 25.53227 / 256, QWEN3_235B + layout(2, 8, 2048, ep=32, v=4), "256xh100", MEG),
}  # fmt: skip

TT = ["--engine", "torchtitan"]
TT_SEL, TT_FULL = TT + ["--recompute", "selective"], TT + ["--recompute", "full"]
TT_ASYNC = TT_FULL + ["--tp-overlap"]
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
})  # fmt: skip


MEMORY_ONLY = {
    "deepseek-v3": "FP8 GEMMs and DualPipe's hidden all-to-all are not modelled (printed, not in the MAE)"
}
KNOWN_MEMORY_MISSES = {
    "llama3-405b": "Meta's own pipeline (custom schedule, stage buffers freed early; Llama 3 paper sec. 3.3.2) keeps "
    "less than the interleaved-1F1B count: planned at ~102 GiB, no activation recompute",
}

SOURCES = {  # name prefix -> where the figures are published
    "megatron-": "Megatron-LM README, 'Training Speed and Scalability' (H100, model FLOP/s per GPU)",
    "narayanan-": "Narayanan et al. 2021, Table 1 (A100; examples/sc21/run_table_1.sh for micro-batches)",
    "dgxc-llama": "NVIDIA dgxc-benchmarking v24.11 llama3.1/README_*.md (NeMo 24.09, tokens/s)",
    "dgxc-nemotron": "NVIDIA dgxc-benchmarking v24.11 nemotron/README_*.md (NeMo 24.09, tokens/s)",
    "dgxc-grok": "NVIDIA dgxc-benchmarking v24.11 grok1/README_314b.md (NeMo 24.09, tokens/s)",
    "dgxc-deepseek": "NVIDIA dgxc-benchmarking deepseek_v3/pretrain/README.md (Megatron-Bridge, step time)",
    "dgxc-qwen3": "NVIDIA dgxc-benchmarking qwen3/pretrain/README.md (Megatron-Bridge, example step time)",
    "bloom-": "bigscience tr11-176B-ml chronicles (Megatron-DeepSpeed, samples/s)",
    "llama3-": "Llama 3 paper (Dubey et al. 2024), Table 4 (TFLOP/s per GPU)",
    "deepseek-": "DeepSeek-V3 technical report (GPU hours per trillion tokens)",
    "mindformers-": "MindFormers docs/model_cards/llama2.md (tokens/s/p)",
    "torchtitan-h100-": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (TPS/GPU, Memory(GiB))",
    "torchtitan-a100-": "torchtitan docs/performance.md (WPS per GPU, 64 A100)",
}
FIT_SOURCES = ("megatron-", "narayanan-")
"""The fit half, by source: the two sources the global time constants were first chosen on. The GEMM ceiling
``DEFAULT_MATMUL_EFFICIENCY`` is the optimum of the fit half's MAE on a 0.025 grid (asserted below); every other
source is the held-out half and is never used to choose a constant."""

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
}  # fmt: skip
MEASURED_OOM = {
    # torchtitan docs/performance.md, footnote 1: "the 70B training with local batch size 2 will cause an OOM
    # error when selective activation checkpointing is used" (Llama 2 70B, 64 A100 80 GB, FSDP)
    "torchtitan-a100-llama2-70b-op-b2": (0.0, LLAMA2_70B + NOC + layout(1, 1, 128, mbs=2, zero=3), "64xa100-80gb", TT_SEL),
}  # fmt: skip
MEMORY_BOUND = (-0.16, 0.065)
"""Planned reserved / measured - 1 for every MEASURED_MEMORY case, as measured at this commit: the planner's
reserved peak (its allocated peak, checked on CPU within 10%, plus ALLOCATOR_RESERVE) is at most 6.3% above
torchtitan's and at most 15.7% under it (the 70B 2-D run at 131k tokens per micro-batch: docs/planner.md)."""
MEMORY_MAE_BOUND = {"all": 0.057, "fit": 0.037, "held-out": 0.067}
"""Goal 10%; measured: all 18 runs 5.6%, fit half (6) 3.6%, held-out half (12) 6.6%."""
TIME_MAE_BOUND = {"all": 0.101, "fit": 0.06, "held-out": 0.125}
"""Tokens/s MAE as measured at this commit (goal 10% on each): all 10.0%, fit half 5.8%, held-out half 12.3%.
The held-out half misses the goal: torchtitan's ring attention at >= 128k tokens (KNOWN_TIME_MISSES) and its
eager FSDP runs on A100 (planned 6-17% slow) carry most of it."""
RING = (
    "torchtitan's context parallel is a ring of per-step SDPA calls merged in eager ops; at >= 128k tokens its "
    "attention runs well below the flash-attention efficiency the planner charges (attention_ratio of the GEMM "
    "ceiling), and no measured ring figure exists to cost it by"
)
KNOWN_TIME_MISSES = {  # name -> (bound on |planned / published - 1|, reason); asserted to stay beyond 25%
    "torchtitan-h100-8b-cp4": (0.40, RING),
    "torchtitan-h100-8b-cp8": (0.45, RING),
    "torchtitan-h100-405b-cp8": (0.45, RING),
}
MOE_BOUND = 0.20
"""Goal 15%; DGXC DeepSeek-V3 is planned 19% fast (its mla_up_proj recompute and any MTP layer are not
modelled), Qwen3-235B 11% slow."""


def source(name: str) -> str:
    return next(text for prefix, text in SOURCES.items() if name.startswith(prefix))


def held_out(name: str) -> bool:
    return not name.startswith(FIT_SOURCES)


def plan(name: str, catalog=None, runs=None) -> dict[str, float]:
    published, overrides, cluster_spec, flags = (runs or RUNS)[name]
    valued = [f for f in flags if f != "--tp-overlap"]
    opts = dict(zip(valued[::2], valued[1::2]))  # --engine X, --recompute Y
    cfg, _ = load_config(BASE, overrides)
    cluster = parse_cluster(cluster_spec, catalog or load_catalog())
    lay, margs, tokens = layout_from_config(
        cfg, cluster.num_devices, opts.get("--recompute", "none"), engine=opts.get("--engine", "llmtrain"),
        tp_overlap="--tp-overlap" in flags,
    )  # fmt: skip
    res = evaluate(margs, lay, cluster, tokens, bool(cfg.train.compile))
    return {"published": published, "predicted": res.tokens_per_s_per_device, "fits": float(res.memory.fits),
            "memory_gib": res.memory.total / 2**30,
            "reserved_gib": res.memory.reserved / 2**30, "capacity_gib": res.memory.capacity / 2**30, "mfu": res.mfu}  # fmt: skip


def _plan_or_skip(name: str) -> dict[str, float]:
    try:
        return plan(name)
    except ConfigError as e:  # a model family this checkout does not have yet (DeepSeek-V3 lands separately)
        if "model_type" in str(e) or "flavor" in str(e):
            pytest.skip(f"{name}: {e}")
        raise


def _mae(errors: list[float]) -> float:
    return sum(abs(e) for e in errors) / len(errors)


@pytest.fixture(scope="module")
def planned() -> dict[str, dict[str, float]]:
    return {name: plan(name) for name in RUNS if name not in MEMORY_ONLY}


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


@pytest.mark.parametrize("name", [n for n in RUNS if n not in MEMORY_ONLY])
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
    """The fit half of the measured-memory runs, by table: torchtitan's 1-D FSDP runs (Tables 1 and 3)."""
    return "-fsdp" in name


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
    assert len(fit) == 6 and len(held) == 12
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


@pytest.mark.parametrize("name", ["dgxc-deepseek-v3-1024", "dgxc-qwen3-235b-256"])
def test_moe_recipes_fit_an_80_gb_card(planned, name):
    r = planned[name]
    assert r["fits"] and r["memory_gib"] <= 80 * 0.98
    assert abs(r["predicted"] / r["published"] - 1) <= MOE_BOUND


def test_gemm_ceiling_is_the_fit_half_optimum():
    """The one global GEMM ceiling is the best of a 0.025 grid on the fit half (and only on it)."""
    from dataclasses import replace

    from llmtrain.plan.catalog import DEFAULT_MATMUL_EFFICIENCY, Catalog

    base = load_catalog()
    fit = [n for n in RUNS if not held_out(n)]

    def mae(e: float) -> float:
        cat = Catalog({k: replace(d, matmul_efficiency=e) for k, d in base.devices.items()}, base.aliases)
        return _mae([(r := plan(n, cat))["predicted"] / r["published"] - 1 for n in fit])

    here = mae(DEFAULT_MATMUL_EFFICIENCY)
    assert here <= mae(DEFAULT_MATMUL_EFFICIENCY - 0.025) and here <= mae(DEFAULT_MATMUL_EFFICIENCY + 0.025)


@pytest.mark.parametrize("name", list(MEMORY_ONLY))
def test_memory_only_runs_fit(name, capsys):
    r = _plan_or_skip(name)
    with capsys.disabled():
        print(f"\n  {name}: planned {r['predicted']:.0f} tokens/s per GPU (published {r['published']:.0f}; "
              f"{MEMORY_ONLY[name]}), memory {r['memory_gib']:.1f} / {r['capacity_gib']:.1f} GiB")  # fmt: skip
    assert r["fits"], f"{name} really trained but is planned at {r['memory_gib']:.1f} GiB"


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

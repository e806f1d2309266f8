"""The planner against published training runs it was never fitted to (sources and assumptions: docs/planner.md).

Every run is planned as its source describes it: model shape, degrees, batch, sequence, recompute, the engine
that ran it (``megatron`` for Megatron-LM / NeMo / Megatron-DeepSpeed / MindFormers / Meta's and torchtitan's
bf16-weight stacks) and whether tensor-parallel communication was overlapped. Asserted: the mean absolute
error of tokens/s per GPU over all runs (computed, printed, must stay <= 10%), every run within +-25%, and
every run (they all really trained) fits in memory, except the one listed in KNOWN_MEMORY_MISSES with its
reason (asserted to stay a miss, so a model change that fixes it shows up). DeepSeek-V3 is checked for memory
only (MEMORY_ONLY).
"""

from __future__ import annotations

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
    # MindFormers Llama 2 70B pretrain on Atlas 800T A2 (docs/model_cards/llama2.md): 407 tokens/s/p
    "mindformers-llama2-70b": (407.0, ["model.hidden_size=8192", "model.num_layers=80", "model.num_heads=64",
                               "model.num_kv_heads=8", "model.intermediate_size=28672", "model.vocab_size=32000"]
                               + layout(4, 8, 256), "64x910b@8", MEG),
    # torchtitan benchmarks/llama3_h100_202412_torchtitan.md Table 1: Llama 3.1 8B, FSDP on 8 H100 (96 GB,
    # 500 W), local batch 2, seq 8192, selective AC, no compile: 5,762 TPS/GPU
    "torchtitan-llama3-8b": (5762.0, ["model.flavor=8b", "model.seq_length=8192", "train.compile=false"]
                             + layout(1, 1, 16, mbs=2, zero=3), "8xh100-96gb", MEG + ["--recompute", "selective"]),
}  # fmt: skip


MEMORY_ONLY = {
    "deepseek-v3": "FP8 GEMMs and DualPipe's hidden all-to-all are not modelled (printed, not in the MAE)"
}
KNOWN_MEMORY_MISSES = {
    "llama3-405b": "Meta's own pipeline (custom schedule, stage buffers freed early; Llama 3 paper sec. 3.3.2) keeps "
    "less than the interleaved-1F1B count: planned at ~102 GiB, no activation recompute",
}


def plan(name: str) -> dict[str, float]:
    published, overrides, cluster_spec, flags = RUNS[name]
    valued = [f for f in flags if f != "--tp-overlap"]
    opts = dict(zip(valued[::2], valued[1::2]))  # --engine X, --recompute Y
    cfg, _ = load_config(BASE, overrides)
    cluster = parse_cluster(cluster_spec, load_catalog())
    lay, margs, tokens = layout_from_config(
        cfg, cluster.num_devices, opts.get("--recompute", "none"), engine=opts.get("--engine", "llmtrain"),
        tp_overlap="--tp-overlap" in flags,
    )  # fmt: skip
    res = evaluate(margs, lay, cluster, tokens, bool(cfg.train.compile))
    return {"published": published, "predicted": res.tokens_per_s_per_device, "fits": float(res.memory.fits),
            "memory_gib": res.memory.total / 2**30, "capacity_gib": res.memory.capacity / 2**30, "mfu": res.mfu}  # fmt: skip


def _plan_or_skip(name: str) -> dict[str, float]:
    try:
        return plan(name)
    except ConfigError as e:  # a model family this checkout does not have yet (DeepSeek-V3 lands separately)
        if "model_type" in str(e) or "flavor" in str(e):
            pytest.skip(f"{name}: {e}")
        raise


@pytest.fixture(scope="module")
def planned() -> dict[str, dict[str, float]]:
    return {name: plan(name) for name in RUNS if name not in MEMORY_ONLY}


def test_mean_absolute_error_within_10_percent(planned, capsys):
    errors = {n: r["predicted"] / r["published"] - 1 for n, r in planned.items()}
    mae = sum(abs(e) for e in errors.values()) / len(errors)
    with capsys.disabled():
        print()
        for n, r in planned.items():
            print(f"  {n:<24} published {r['published']:9.1f}  planned {r['predicted']:9.1f}  {errors[n]:+6.1%}"
                  f"  memory {r['memory_gib']:6.1f} / {r['capacity_gib']:.1f} GiB")  # fmt: skip
        print(f"  mean absolute error of tokens/s per GPU over {len(errors)} published runs: {mae:.1%}")
    assert len(errors) >= 29
    assert mae <= 0.10, f"MAE {mae:.1%} over {len(errors)} published runs"


@pytest.mark.parametrize("name", [n for n in RUNS if n not in MEMORY_ONLY])
def test_each_run_within_25_percent_and_fits(planned, name):
    r = planned[name]
    assert r["predicted"] == pytest.approx(r["published"], rel=0.25), name
    if name in KNOWN_MEMORY_MISSES:
        assert not r["fits"], f"{name} now fits: remove it from KNOWN_MEMORY_MISSES"
        return
    assert r["fits"], (
        f"{name} really trained but is planned at {r['memory_gib']:.1f} of {r['capacity_gib']:.1f} GiB"
    )


@pytest.mark.parametrize("name", list(MEMORY_ONLY))
def test_memory_only_runs_fit(name, capsys):
    r = _plan_or_skip(name)
    with capsys.disabled():
        print(f"\n  {name}: planned {r['predicted']:.0f} tokens/s per GPU (published {r['published']:.0f}; "
              f"{MEMORY_ONLY[name]}), memory {r['memory_gib']:.1f} / {r['capacity_gib']:.1f} GiB")  # fmt: skip
    assert r["fits"], f"{name} really trained but is planned at {r['memory_gib']:.1f} GiB"

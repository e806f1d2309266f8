"""Real MindFormers run files (1.x ``LlamaConfig`` layout, 2.x Hugging Face-style layout) through `llmtrain check`
and a tiny `llmtrain train`.

The fixtures in tests/fixtures/mindformers/ are our own files with the key structure of public MindFormers
pretraining configs (llama2 7B r1.3, qwen3 32B, qwen3_moe 30B-A3B, deepseek3 671B r1.5). The references are
independent of the adapter: the published parameter counts (and the exact Hugging Face counts), the global
batch computed here from the YAML by MindFormers' own rule (trainer/base_trainer.py), a DeepSeek-V3 parameter
count written out by hand from its MLA / MoE shapes, and LR values from the closed-form schedule. Values of the
wrong type (a string, a float or a list where MindFormers reads a count, a number or a flag) are refused through
`llmtrain check` naming the file and the key, the file unchanged.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from llmtrain.cli import main
from llmtrain.config import load_config
from llmtrain.config.mindformers import is_mindformers_layout, translate
from llmtrain.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "mindformers"
LLAMA2, QWEN3, QWEN3_MOE, DEEPSEEK3 = (
    FIXTURES / f"{n}.yaml" for n in ("llama2_7b_1x", "qwen3_32b_2x", "qwen3_moe_30b_2x", "deepseek3_671b")
)


def raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def mindformers_global_batch(cfg: dict) -> int:
    """MindFormers' global batch in semi-auto parallel (base_trainer._check_global_batch_size_for_auto_parallel):
    batch_size x data_parallel x micro_batch_num x micro_batch_interleave_num under pipeline parallel (where
    _check_grad_accumulation_steps resets gradient_accumulation_steps to 1), else batch_size x data_parallel x
    micro_batch_interleave_num x gradient_accumulation_steps."""
    run, par = cfg["runner_config"], cfg["parallel_config"]
    bs, dp, inter = run["batch_size"], par["data_parallel"], cfg.get("micro_batch_interleave_num", 1)
    if par.get("pipeline_stage", 1) > 1:
        return bs * dp * par["micro_batch_num"] * inter
    return bs * dp * inter * (run.get("gradient_accumulation_steps") or 1)


def run_check(capsys, path: Path, world: int, *overrides: str) -> tuple[int, str, str]:
    code = main(["check", str(path), *overrides, "--world-size", str(world)])
    out = capsys.readouterr()
    return code, out.out, out.err


def section(out: str, title: str) -> str:
    """The block of `check`'s output under ``# title`` (up to the next ``# `` heading)."""
    match = re.search(rf"^# {title}\n(.*?)(?=^# |\Z)", out, re.S | re.M)
    assert match, title
    return match.group(1)


def resolved(out: str) -> dict:
    return yaml.safe_load(section(out, "resolved config"))


def derived(out: str, label: str) -> str:
    match = re.search(rf"^{label}:\s+(.*)$", section(out, "derived"), re.M)
    assert match, label
    return match.group(1)


def parameters(out: str) -> int:
    return int(re.search(r"\(([\d,]+)\)", derived(out, "parameters")).group(1).replace(",", ""))


# fixture, world size, overrides, family, published parameters, exact Hugging Face count
CASES = [
    (LLAMA2, 8, ["train.max_steps=1000"], "llama3", 6.74e9, 6_738_415_616),
    (QWEN3, 32, [], "qwen3", 32.8e9, 32_762_123_264),
    (QWEN3_MOE, 8, [], "qwen3", 30.5e9, 30_532_122_624),
    (DEEPSEEK3, 1024, [], "deepseek_v3", 671e9, 671_026_404_352),  # EP 8 x TP 4
]


@pytest.mark.parametrize(("path", "world", "overrides", "family", "published", "exact"), CASES, ids=lambda c: getattr(c, "stem", None))  # fmt: skip
def test_check_maps_the_model_and_the_batch(capsys, path, world, overrides, family, published, exact):
    code, out, err = run_check(capsys, path, world, *overrides)
    assert code == 0, err
    assert derived(out, "model").startswith(f"{family}:")
    n = parameters(out)
    assert abs(n - published) / published < 0.01 and n == exact
    gbs = mindformers_global_batch(raw(path))
    assert derived(out, "global batch").startswith(f"{gbs} sequences")
    cfg = resolved(out)
    assert cfg["train"]["batch_size"] == gbs
    assert cfg["parallel"]["data_parallel"] * cfg["parallel"]["tensor_parallel"] * cfg["parallel"]["pipeline_parallel"] == world  # fmt: skip


# the published files' own layouts where our fixtures use another (mindformers r1.8 configs/qwen3/
# pretrain_qwen3_32b_4k.yaml and configs/qwen3_moe/pretrain_qwen3_30b_a3b_4k.yaml: dp 1 x mp 4 x pp 4, the MoE's
# 128 experts over expert parallel 4, carved from the tensor-parallel ranks); llama2 r1.3 and deepseek3 r1.5 are
# CASES as they are
PUBLISHED_LAYOUTS = [
    (
        QWEN3,
        {"data_parallel": 1, "model_parallel": 4, "pipeline_stage": 4, "micro_batch_num": 4},
        "qwen3",
        32_762_123_264,
    ),  # fmt: skip
    (
        QWEN3_MOE,
        {
            "data_parallel": 1,
            "model_parallel": 4,
            "pipeline_stage": 4,
            "micro_batch_num": 16,
            "expert_parallel": 4,
        },
        "qwen3",
        30_532_122_624,
    ),  # fmt: skip
]


@pytest.mark.parametrize(("path", "layout", "family", "exact"), PUBLISHED_LAYOUTS, ids=lambda v: getattr(v, "stem", None))  # fmt: skip
def test_check_on_the_published_layouts(capsys, tmp_path, path, layout, family, exact):
    def publish(cfg):
        cfg["parallel_config"].update(layout)
        cfg["runner_config"]["gradient_accumulation_steps"] = 1

    variant, before = _variant(tmp_path, path, "published.yaml", publish)
    code, out, err = run_check(capsys, variant, 16)
    assert code == 0, err
    assert derived(out, "model").startswith(f"{family}:") and parameters(out) == exact
    gbs = mindformers_global_batch(raw(variant))  # 1 x dp 1 x micro_batch_num x 1
    assert gbs == layout["micro_batch_num"] and derived(out, "global batch").startswith(f"{gbs} sequences")
    assert variant.read_bytes() == before


def test_llama2_1x_keys(capsys):
    code, out, _ = run_check(capsys, LLAMA2, 8, "train.max_steps=1000")
    assert code == 0
    cfg, notes = resolved(out), section(out, "notes")
    m, t, p = cfg["model"], cfg["train"], cfg["parallel"]
    # LlamaConfig's own defaults, not the llama3 family's (rope_theta 500000, Llama 3.1 scaling)
    assert (m["rope_theta"], m["rope_scaling"], m["intermediate_size"], m["num_kv_heads"]) == (10000.0, 1.0, 11008, None)  # fmt: skip
    # 1 x 8 x 8
    assert (t["batch_size"], t["micro_batch_size"], t["gradient_accumulation_steps"]) == (64, 1, 8)  # fmt: skip
    assert (t["precision"], t["loss_scale"], t["initial_loss_scale"], t["loss_scale_window"]) == ("fp16", "dynamic", 65536.0, 1000)  # fmt: skip
    # decay: FP32StateAdamWeightDecay's default
    assert (t["beta1"], t["beta2"], t["eps"], t["weight_decay"]) == (0.9, 0.95, 1e-8, 0.0)  # fmt: skip
    assert (t["decay_style"], t["lr"], t["min_lr"], t["warmup_steps"], t["decay_steps"]) == ("cosine", 5e-5, 0.0, 30, None)  # fmt: skip
    assert (t["epochs"], t["compile"], t["seed"], t["grad_clip_norm"]) == (2, True, 42, 1.0)
    assert (p["zero_stage"], cfg["recompute"]["mode"], cfg["checkpoint"]["save_steps"]) == (3, "none", 500)
    assert cfg["run"]["device_target"] == "npu"
    assert cfg["data"]["datasets"] == [{"path": "/data/wikitext-2/llama2_4096.mindrecord", "weight": 1.0}]
    for mapped in ("model.model_config.num_layers -> model.num_layers", "FP32StateAdamWeightDecay",
                   "CosineWithWarmUpLR", "warmup_ratio 0.03 x 1000 steps -> train.warmup_steps 30",
                   "MindFormers' LLaMA rule", "model.rope_theta 10000.0", "global batch 64 ="):  # fmt: skip
        assert mapped in notes, mapped
    ignored = "\n".join(line for line in notes.splitlines() if line.startswith("- ignored ("))
    for name in ("runner_config.sink_mode", "context.max_device_memory", "parallel_config.vocab_emb_dp",
                 "parallel.full_batch", "model.model_config.param_init_type", "model.model_config.use_past",
                 "recompute_config.mp_comm_recompute", "processor", "remote_save_url", "eval_dataset"):  # fmt: skip
        assert name in ignored, name


def test_llama2_run_length_needs_max_steps(capsys):
    """total_steps -1 with a MindRecord dataset: MindFormers takes the length from the data, which the file does
    not state; the refusal names the key that answers it (and the override does)."""
    code, out, err = run_check(capsys, LLAMA2, 8)
    assert code == 2 and "Traceback" not in err and out == ""
    assert "lr_schedule.total_steps -1" in err and "train.max_steps" in err and str(LLAMA2) in err


def test_qwen3_2x_keys(capsys):
    code, out, _ = run_check(capsys, QWEN3, 32)
    assert code == 0
    cfg, notes = resolved(out), section(out, "notes")
    m, t, p = cfg["model"], cfg["train"], cfg["parallel"]
    assert (m["model_type"], m["qk_norm"], m["head_dim"], m["num_kv_heads"], m["rope_theta"]) == ("qwen3", True, 128, 8, 1e6)  # fmt: skip
    assert (p["tensor_parallel"], p["pipeline_parallel"], p["micro_batch_num"]) == (4, 4, 16)
    # offset [-1, -1, 1, 1]
    assert p["pipeline_layers"] == [64 // 4 - 1, 64 // 4 - 1, 64 // 4 + 1, 64 // 4 + 1]  # fmt: skip
    steps = 1 * (64000 // 32)  # epochs x (sizes[0] // global batch)
    assert (t["max_steps"], t["warmup_steps"], t["decay_steps"]) == (steps, int(steps * 0.01), None)
    assert (t["precision"], t["lr"], t["min_lr"], t["weight_decay"], t["beta2"]) == ("bf16", 3e-4, 3e-5, 0.1, 0.95)  # fmt: skip
    assert (cfg["recompute"]["mode"], p["zero_stage"], t["log_steps"], cfg["checkpoint"]["async_save"]) == ("full", 3, 5, True)  # fmt: skip
    assert cfg["data"]["datasets"] == [
        {"path": "/data/megatron/web_text_document", "weight": 0.7},
        {"path": "/data/megatron/code_text_document", "weight": 0.3},
    ]
    for mapped in ("model.model_config.num_hidden_layers -> model.num_layers",
                   "model.model_config.num_key_value_heads -> model.num_kv_heads",
                   "model.model_config.qk_layernorm -> model.qk_norm", "model_type: 'qwen3' -> model.model_type 'qwen3'",
                   "parallel.pipeline_layers [15, 15, 17, 17]", "micro_batch_num 16 x micro_batch_interleave_num 1"):  # fmt: skip
        assert mapped in notes, mapped
    for name in ("context.jit_config", "context.ascend_config", "model.model_config.qkv_concat",
                 "parallel.dataset_strategy", "model.model_config.architectures", "use_legacy"):  # fmt: skip
        assert name in notes, name


def test_qwen3_moe_2x_keys(capsys):
    code, out, _ = run_check(capsys, QWEN3_MOE, 8)
    assert code == 0
    cfg, notes = resolved(out), section(out, "notes")
    moe = cfg["model"]["moe"]
    assert (cfg["model"]["model_type"], cfg["model"]["qk_norm"]) == ("qwen3", True)
    # norm_topk_prob False, routed_scaling_factor 1.5: the real file's routing, read as MindFormers' router does
    assert (moe["num_experts"], moe["top_k"], moe["moe_hidden_size"], moe["route_norm"]) == (128, 8, 768, False)  # fmt: skip
    assert (moe["routed_scaling_factor"], moe["pre_softmax"], moe["router_fp32"], moe["n_group"]) == (1.5, True, True, 1)  # fmt: skip
    # moe_aux_loss_coeff 0.001 over the global batch (gbs_aux_loss); no capacity, so the drop policy has no effect
    assert (moe["aux_loss_coef"], moe["aux_loss_scope"], moe["capacity_factor"], moe["drop_policy"]) == (0.001, "global_batch", None, "probs")  # fmt: skip
    assert (moe["shared_experts"], moe["router_score"]) == (0, "softmax")
    assert cfg["parallel"]["expert_parallel"] == 8 and cfg["train"]["max_steps"] == 16000 // 16
    assert "active per token 3.35B" in derived(out, "parameters")
    assert "gbs_aux_loss' -> model.moe.aux_loss_scope global_batch" in notes
    assert "router_aux_loss_coef" in notes and "moe_grouped_gemm" in notes


def test_pipeline_ignores_gradient_accumulation(tmp_path):
    """MindFormers resets gradient_accumulation_steps to 1 under pipeline parallel: the global batch is
    batch_size x dp x micro_batch_num x micro_batch_interleave_num, whatever the accumulation says."""
    cfg = raw(QWEN3)
    cfg["runner_config"]["gradient_accumulation_steps"] = 4
    cfg["runner_config"]["batch_size"] = 2
    path = tmp_path / "gas.yaml"
    path.write_text(yaml.safe_dump(cfg))
    loaded, notes = load_config(path)
    assert loaded.train.batch_size == mindformers_global_batch(cfg) == 2 * 2 * 16
    assert (loaded.train.micro_batch_size, loaded.train.gradient_accumulation_steps) == (2, None)
    assert any("gradient_accumulation_steps 4 ignored" in n for n in notes)


def test_deepseek3_maps_onto_the_deepseek_v3_family(capsys):
    """The deepseek3 671B file maps onto model_type deepseek_v3 (MLA + DeepSeekMoE): its own layout (EP 8 with
    TP 4 on 1024 ranks) passes (CASES), so does TP 4 without EP, and without TP, on the 256 ranks left (pp 16 x
    dp 16, the experts sharded over the 16 data-parallel ranks), it passes with the 671B model. The MTP layer is
    left out."""
    code, out, err = run_check(capsys, DEEPSEEK3, 1024, "parallel.expert_parallel=1")
    assert code == 0, err
    code, out, err = run_check(
        capsys, DEEPSEEK3, 256, "parallel.tensor_parallel=1", "parallel.expert_parallel=16"
    )
    assert code == 0, err
    assert derived(out, "model").startswith("deepseek_v3:")
    n = parameters(out)
    assert n == 671_026_404_352 and abs(n - 671e9) / 671e9 < 0.01
    assert "active per token 37.6B (37,552,282,624)" in derived(out, "parameters")  # published: 37B activated
    m, notes = resolved(out)["model"], section(out, "notes")
    assert (m["q_lora_rank"], m["kv_lora_rank"], m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]) == (1536, 512, 128, 64, 128)  # fmt: skip
    assert "multi-token prediction (mtp_depth 1) is not implemented" in notes
    cfg = raw(DEEPSEEK3)
    native, notes, missing = translate(cfg, str(DEEPSEEK3))
    assert missing is None and native["model"]["model_type"] == "deepseek_v3"
    assert native["train"]["batch_size"] == mindformers_global_batch(cfg) == 1 * 16 * 32
    assert native["train"]["max_steps"] == 512000 // 512
    layers = native["parallel"]["pipeline_layers"]  # (61 layers + 1 MTP) // 16 + offset, less the MTP layer
    assert layers == [4] * 15 + [1] and sum(layers) == 61
    assert native["model"]["moe"] == {
        "num_experts": 256, "top_k": 8, "moe_hidden_size": 2048, "shared_experts": 1, "router_score": "sigmoid",
        "route_norm": True, "aux_loss_coef": 0.0001, "bias_update_rate": 0.001, "capacity_factor": 1.5,
        "first_dense_layers": 3, "every": 1, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
        "aux_loss_scope": "micro_batch", "pre_softmax": True, "router_fp32": True, "drop_policy": "position",
    }  # fmt: skip
    assert (native["parallel"]["expert_parallel"], native["recompute"]["mode"]) == (8, "full")
    # the fixture is DeepSeek-V3-sized: its MLA + MoE parameters, written out by hand, are the published 671B
    mc, moe = cfg["model"]["model_config"], cfg["moe_config"]
    d, heads, vocab = mc["hidden_size"], mc["num_heads"], mc["vocab_size"]
    qk = mc["qk_nope_head_dim"] + mc["qk_rope_head_dim"]
    attn = (d * mc["q_lora_rank"] + mc["q_lora_rank"] + mc["q_lora_rank"] * heads * qk  # q down, norm, up
            + d * (mc["kv_lora_rank"] + mc["qk_rope_head_dim"]) + mc["kv_lora_rank"]  # kv down (+ rope k), norm
            + mc["kv_lora_rank"] * heads * (mc["qk_nope_head_dim"] + mc["v_head_dim"])  # kv up
            + heads * mc["v_head_dim"] * d)  # output  # fmt: skip
    expert = 3 * d * moe["moe_intermediate_size"]
    dense_ffn, moe_ffn = 3 * d * mc["intermediate_size"], (moe["expert_num"] + moe["shared_expert_num"]) * expert + d * moe["expert_num"]  # fmt: skip
    dense = moe["first_k_dense_replace"]
    total = mc["num_layers"] * (attn + 2 * d) + dense * dense_ffn + (mc["num_layers"] - dense) * moe_ffn + 2 * vocab * d + d  # fmt: skip
    assert abs(total - 671e9) / 671e9 < 0.01 and total == n  # and it is what llmtrain check counts


def test_unknown_and_refused_keys(tmp_path):
    def load(cfg: dict, name: str):
        path = tmp_path / name
        path.write_text(yaml.safe_dump(cfg))
        return load_config(path, ["train.max_steps=10"])

    cfg = raw(LLAMA2)
    cfg["parallel_config"]["data_paralel"] = 2
    with pytest.raises(
        ConfigError,
        match=r"unknown MindFormers key 'parallel_config\.data_paralel' \(did you mean 'parallel_config\.data_parallel'\?\)",
    ):
        load(cfg, "typo.yaml")
    cfg = raw(QWEN3_MOE)
    cfg["model"]["model_config"]["mtp_depth"] = 1
    with pytest.raises(
        ConfigError, match=r"model\.model_config\.mtp_depth: 1 is not supported: it is a DeepSeek-V3"
    ):
        load(cfg, "mtp.yaml")
    cfg = raw(QWEN3)
    cfg["model"]["model_config"]["hidden_dropout"] = 0.1
    with pytest.raises(
        ConfigError, match=r"hidden_dropout: 0\.1 is not supported: llmtrain's models have no dropout"
    ):
        load(cfg, "dropout.yaml")
    cfg = raw(QWEN3)
    cfg["model"]["model_config"]["model_type"] = "glm4_moe"
    with pytest.raises(ConfigError, match=r"'glm4_moe' has no llmtrain family"):
        load(cfg, "family.yaml")
    cfg = raw(LLAMA2)
    cfg["lr_schedule"]["type"] = "CosineWithRestartsAndWarmUpLR"
    with pytest.raises(
        ConfigError, match=r"lr_schedule\.type: 'CosineWithRestartsAndWarmUpLR' is not supported"
    ):
        load(cfg, "lr.yaml")


def test_layout_detection():
    assert is_mindformers_layout(raw(LLAMA2)) and is_mindformers_layout(raw(QWEN3))
    assert is_mindformers_layout({"context": {"mode": 0}}) and is_mindformers_layout({"runner_config": {}})
    assert is_mindformers_layout({"parallel_config": {"data_parallel": 2}})  # the seeds' flat layout
    assert not is_mindformers_layout({"model": {"model_type": "qwen3"}, "parallel": {"tensor_parallel": 2}})


TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
    "model.intermediate_size=128", "model.vocab_size=512", "model.seq_length=64", "parallel.data_parallel=1",
    "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1", "parallel.expert_parallel=1",
    "parallel.micro_batch_num=1", "parallel.pipeline_layers=null", "train.batch_size=2",
    "train.micro_batch_size=1", "train.gradient_accumulation_steps=null", "train.max_steps=2", "train.log_steps=1",
    "train.compile=false", "train.precision=fp32", "run.device_target=cpu", "logging.progress_bar=false",
    "logging.tensorboard=false", "logging.plot=false", "checkpoint.save_at_end=false", "eval.eval_iters=1",
]  # fmt: skip


def cosine(step: int, lr: float, min_lr: float, decay_steps: int) -> float:
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * min(step / decay_steps, 1.0)))


@pytest.mark.parametrize(
    ("path", "extra", "lrs"),
    [
        # CosineWithWarmUpLR 5e-5 -> 0, warmup_ratio 0.03 of 2 steps = 0: cosine over the 2 steps
        (LLAMA2, [], [cosine(1, 5e-5, 0.0, 2), cosine(2, 5e-5, 0.0, 2)]),
        # CosineWithWarmUpLR 3e-4 -> 3e-5, warmup_ratio 0.01 of 2 steps = 0
        (QWEN3, ["model.head_dim=16"], [cosine(1, 3e-4, 3e-5, 2), cosine(2, 3e-4, 3e-5, 2)]),
        # ConstantWarmUpLR 1e-5 with warmup_steps 50: steps 1 and 2 of the linear warmup
        (
            QWEN3_MOE,
            [
                "model.head_dim=16",
                "model.moe.num_experts=4",
                "model.moe.top_k=2",
                "model.moe.moe_hidden_size=32",
            ],
            [1e-5 * 1 / 50, 1e-5 * 2 / 50],
        ),
    ],
    ids=["1x-llama2", "2x-qwen3", "2x-qwen3-moe"],
)
def test_tiny_train_of_each_layout(tiny_corpus, tmp_path, capsys, path, extra, lrs):
    out = tmp_path / "run"
    argv = ["train", str(path), *TINY, *extra, f"data.datasets=[{{path: {tiny_corpus}}}]", f"run.output_dir={out}"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["lr"] for r in steps] == pytest.approx(lrs, rel=1e-9)
    assert abs(steps[0]["loss"] - math.log(512)) < 0.5  # an untrained 512-token model: ~ln(512)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    if path == LLAMA2:
        assert (saved["model"]["model_type"], saved["model"]["rope_theta"]) == ("llama3", 10000.0)
    else:
        assert (saved["model"]["model_type"], saved["model"]["qk_norm"]) == ("qwen3", True)


def test_plan_reads_the_2x_layout(capsys):
    assert main(["plan", str(QWEN3), "--cluster", "32x910b@4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"] == "tp4 pp4 dp2 zero3 mbs1 rc-full 1f1b layers15-15-17-17"
    assert plan["tokens_per_step"] == mindformers_global_batch(raw(QWEN3)) * 4096


def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        name = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            yield from _leaves(v, name)
        else:
            yield name


@pytest.mark.parametrize("path", [LLAMA2, QWEN3, QWEN3_MOE, DEEPSEEK3], ids=lambda p: p.stem)
def test_no_key_is_dropped_silently(path):
    """Every key of the file is named in the notes: mapped, reinterpreted, or ignored with a reason (a section
    ignored as a whole names the section)."""
    cfg = raw(path)
    _, notes, _ = translate(cfg, str(path))
    text = "\n".join(notes)
    words = {w.rstrip(".,:;)") for w in re.findall(r"[\w.\[\]]+", text)}
    unnamed = [
        leaf for leaf in _leaves(cfg)
        if not re.search(rf"\b{re.escape(leaf.split('.')[-1])}\b", text)
        and not any(".".join(leaf.split(".")[:i]) in words for i in range(1, leaf.count(".") + 1))
    ]  # fmt: skip
    assert unnamed == []


def _variant(tmp_path: Path, path: Path, name: str, edit) -> tuple[Path, bytes]:
    """A copy of the fixture ``path`` with ``edit(cfg)`` applied, written as YAML; (its path, its bytes)."""
    cfg = raw(path)
    edit(cfg)
    out = tmp_path / name
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out, out.read_bytes()


def test_llama2_checkpoint_name_is_dropped_as_mindformers_drops_it(capsys, tmp_path):
    """checkpoint_name_or_path "llama2_7b" with run_mode train and an empty load_checkpoint: MindFormers' Trainer.train()
    sets it to None and loads nothing, so check passes and says so; a load_checkpoint that MindFormers would load
    is refused by name, the file untouched."""
    assert raw(LLAMA2)["model"]["model_config"]["checkpoint_name_or_path"] == "llama2_7b"
    code, out, err = run_check(capsys, LLAMA2, 8, "train.max_steps=1000")
    assert code == 0, err
    notes = section(out, "notes")
    assert "checkpoint_name_or_path: 'llama2_7b' dropped, as MindFormers drops it" in notes
    assert resolved(out)["model"]["init_from"] is None

    def load_weights(cfg):
        cfg["load_checkpoint"] = "/ckpt/llama2_7b.ckpt"

    path, before = _variant(tmp_path, LLAMA2, "load.yaml", load_weights)
    code, out, err = run_check(capsys, path, 8, "train.max_steps=1000")
    assert code == 2 and out == "" and "Traceback" not in err
    assert (
        f"{path}: load_checkpoint: '/ckpt/llama2_7b.ckpt' is not supported" in err
        and "model.init_from" in err
    )
    assert path.read_bytes() == before


def _set(dotted: str, value):
    def edit(cfg):
        *parents, key = dotted.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[key] = value

    return edit


@pytest.mark.parametrize(
    ("path", "key", "value", "expected"),
    [
        (LLAMA2, "model.model_config.num_layers", "32", "an integer >= 1"),
        (LLAMA2, "model.model_config.num_layers", 32.0, "an integer >= 1"),
        (LLAMA2, "model.model_config.num_layers", [32], "an integer >= 1"),
        (QWEN3, "model.model_config.num_hidden_layers", "64", "an integer >= 1"),
        (QWEN3, "model.model_config.rms_norm_eps", "1.0e-6", "a number > 0"),
        (QWEN3_MOE, "model.model_config.num_experts_per_tok", 8.0, "an integer >= 1"),
        (QWEN3_MOE, "model.model_config.routed_scaling_factor", "1.5", "a number > 0"),
        (QWEN3_MOE, "model.model_config.norm_topk_prob", "False", "true or false"),
        (DEEPSEEK3, "moe_config.expert_num", [256], "an integer >= 0"),
        (LLAMA2, "parallel_config.data_parallel", "8", "an integer >= 1"),
        (LLAMA2, "runner_config.batch_size", 1.5, "an integer >= 1"),
        (QWEN3, "optimizer.weight_decay", "0.1", "a number >= 0"),
        (QWEN3, "lr_schedule.warmup_ratio", [0.01], "a number >= 0"),
    ],
    ids=lambda v: v.stem if isinstance(v, Path) else None,
)
def test_values_of_the_wrong_type_are_named(capsys, tmp_path, path, key, value, expected):
    """A MindFormers key holding a string, a float or a list where MindFormers reads a number or a flag: one
    ConfigError naming the file and the key, exit 2, no traceback, nothing on stdout, the file unchanged."""
    bad, before = _variant(tmp_path, path, "bad.yaml", _set(key, value))
    world = {LLAMA2: 8, QWEN3: 32, QWEN3_MOE: 8, DEEPSEEK3: 1024}[path]
    code, out, err = run_check(capsys, bad, world, "train.max_steps=10")
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"{bad}: {key}: expected {expected}, got {value!r}" in err, err
    assert bad.read_bytes() == before


SEED_FLAT = Path(__file__).parent.parent / "configs" / "seed" / "pretrain_llama3_70b_64card.yaml"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("model_config.num_layers", "80", "an integer"),
        ("model_config.num_layers", 80.0, "an integer"),
        ("parallel_config.data_parallel", [8], "an integer"),
        ("model_config.rms_norm_eps", "1.0e-5", "a number"),
    ],
)
def test_flat_layout_values_of_the_wrong_type_are_named(capsys, tmp_path, key, value, expected):
    """The seeds' flat layout reads through the same typed helper: the native key's type, the MindFormers key named
    (its own ``rms_norm_eps: 1e-5``, a string to YAML 1.1, still reads as the number)."""
    assert load_config(SEED_FLAT)[0].model.rms_norm_eps == 1e-5
    bad, before = _variant(tmp_path, SEED_FLAT, "flat.yaml", _set(key, value))
    code = main(["check", str(bad)])
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and "Traceback" not in out.err
    assert f"{bad}: {key}: expected {expected}, got {value!r}" in out.err, out.err
    assert bad.read_bytes() == before


def _with_mindio(cfg: dict, shard_size: int | None = 4) -> None:
    """MindFormers' high-availability example (docs feature/high_availability.md, r1.7.0): data parallel 8, the
    optimizer sharded in 4 (two copies of the state: MindIO's replica relation), sink_size 1, and the
    TrainFaultTolerance entry some run files list (MindFormers' trainer skips it)."""
    if shard_size is not None:
        cfg["parallel"]["parallel_optimizer_config"]["optimizer_weight_shard_size"] = shard_size
    cfg["runner_config"]["sink_size"] = 1
    cfg["callbacks"].append({"type": "TrainFaultTolerance", "ckpt_save_path": "./ttp_ckpt"})


def test_mindio_tft_switch_maps_to_replica_groups(capsys, tmp_path, monkeypatch):
    """MindFormers switches MindIO TFT with $MS_ENABLE_TFT (version_control.check_tft_valid), not a YAML key.
    ARF (a failed node repaired from a replica) -> replica groups, one per copy of the state (8 / 4 = 2), each
    group FSDP over the shard size; TRE -> the stability guard; TTP, UCE, TSP and MindIO's controller address
    have no counterpart and the notes say so; with too few copies the switch is refused by name."""
    path, before = _variant(tmp_path, LLAMA2, "ha.yaml", _with_mindio)
    monkeypatch.delenv("MS_ENABLE_TFT", raising=False)
    code, out, err = run_check(capsys, path, 8, "train.max_steps=1000")  # without the switch
    assert code == 0, err
    assert resolved(out)["fault_tolerance"]["enabled"] is False
    assert resolved(out)["parallel"]["data_parallel_replicate"] == 2  # HSDP, as without MindIO
    assert "callbacks[3] TrainFaultTolerance -> ignored, as MindFormers' trainer skips this entry" in out

    monkeypatch.setenv("MS_ENABLE_TFT", "{TTP:1,UCE:1,ARF:1,TRE:1,TSP:1}")
    monkeypatch.setenv("MS_TFT_IP", "127.0.0.1")
    monkeypatch.setenv("MS_TFT_PORT", "30051")
    code, out, err = run_check(capsys, path, 8, "train.max_steps=1000")
    assert code == 0, err
    cfg, notes = resolved(out), section(out, "notes")
    assert (cfg["fault_tolerance"]["enabled"], cfg["fault_tolerance"]["replicas"]) == (True, 2)
    p = cfg["parallel"]
    assert (p["data_parallel"], p["zero_stage"], p["data_parallel_replicate"]) == (4, 3, 1)  # FSDP in 4
    assert cfg["stability"]["enabled"] is True
    assert "replica groups:    2 x 4 ranks" in out  # MindFormers' 1 x 8 x 8 = 64, each group 1 x 4 x 8 = 32
    assert "32 samples of the global batch 64 per step (micro 1 x DP 4 x accumulation 8;" in out
    copies = "MindIO's copies of the state: data_parallel 8 / optimizer_weight_shard_size 4"
    assert f"fault_tolerance.replicas 2 ({copies})" in notes
    assert "--replicas 2" in notes and "r1.7.0 mindformers/version_control.py" in notes
    for flag in ("TTP", "UCE", "TSP"):
        assert f"$MS_ENABLE_TFT {flag}:1 not mapped: no counterpart" in notes, flag
    assert "$MS_TFT_IP, $MS_TFT_PORT not mapped: MindIO's controller" in notes
    assert "$MS_ENABLE_TFT TRE:1" in notes and "redundant optimizer copies" in notes

    monkeypatch.setenv("MS_ENABLE_TFT", "{UCE:0 TTP:1}")  # the dying checkpoint alone: noted, nothing enabled
    code, out, err = run_check(capsys, path, 8, "train.max_steps=1000")
    assert code == 0 and resolved(out)["fault_tolerance"]["enabled"] is False, err
    assert "$MS_ENABLE_TFT TTP:1 not mapped" in out and "UCE:1" not in out

    one_copy, before = _variant(tmp_path, LLAMA2, "one_copy.yaml", lambda c: _with_mindio(c, None))
    monkeypatch.setenv("MS_ENABLE_TFT", "{ARF:1}")
    code, out, err = run_check(capsys, one_copy, 8, "train.max_steps=1000")
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"{one_copy}: $MS_ENABLE_TFT: ARF:1" in err and "1 copy of the weights and optimizer state" in err
    assert "optimizer_weight_shard_size" in err and one_copy.read_bytes() == before

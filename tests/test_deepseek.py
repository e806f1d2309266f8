"""DeepSeek-V3 (``model_type: deepseek_v3``): multi-head latent attention + DeepSeekMoE against transformers.

The reference is transformers' own ``DeepseekV3ForCausalLM``, built from a 2-layer version of the published
config.json of deepseek-ai/DeepSeek-V3 (first_k_dense_replace 1: one dense and one MoE block; hidden 64, 16
experts in the published 8 groups, yarn RoPE factor 40 with mscale as published) with seeded random weights,
norm weights, biases and the router's correction bias perturbed too. Shown here: the 671b flavor's counts
(transformers' own count of the published model on the meta device; 671B / 37B published), logits parity to
1e-5 in fp32 (also far positions, where yarn matters), group-limited routing against a per-token loop, HF import
-> first-step loss equal to transformers' -> export round-trips weights and config.json exactly, the MLA KV
cache (latent + rotary key only) in greedy generation (= transformers' and = our own no-cache forward, also
through ``llmtrain generate``'s code on a trained run), bad configs refused by name, a MindFormers 2.x
deepseek_v3 file, and gloo launches (2 ranks: ZeRO-3, expert parallel 2, pipeline parallel 2 and, for the dense
variant, tensor parallel 2; 4 ranks: pp2 x dp2 x ep2), each within 1e-5 (loss) / 1e-3 relative (grad norm) of
one process over 2 steps with the aux loss and the aux-loss-free bias both acting.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from llmtrain.cli import main as cli_main
from llmtrain.config import config_from_dict
from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.generate import generate
from llmtrain.models import FAMILIES, KVCache, build_model
from llmtrain.models.common.args import TransformerArgs
from llmtrain.models.common.router import Router
from llmtrain.models.hf_io import load_hf_pretrained, read_hf_state_dict, save_hf
from llmtrain.resolve import derive
from test_parallel import base as parallel_base  # tests/ is on sys.path under pytest
from test_parallel import close, launch, per_step

transformers = pytest.importorskip("transformers")

SPEC = FAMILIES["deepseek_v3"]
VOCAB = 512
# deepseek-ai/DeepSeek-V3 config.json as published, less quantization_config (its weights are FP8 blocks;
# the random ones here are not quantized) and auto_map (remote code, unused by transformers' own class).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def tiny(**changes: Any) -> dict[str, Any]:
    """The published config at 2 layers (1 dense + 1 MoE), hidden 64, 4 heads, 16 experts in 8 groups."""
    d = copy.deepcopy(DEEPSEEK_V3)
    d.update(
        num_hidden_layers=2, first_k_dense_replace=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, vocab_size=VOCAB,
    )  # fmt: skip
    d.update(copy.deepcopy(changes))
    return d


def hf_model(config: dict[str, Any], seed: int = 0):
    """transformers' DeepseekV3ForCausalLM of ``config``, seeded random weights and correction bias, fp32."""
    hf_config = transformers.DeepseekV3Config.from_dict(copy.deepcopy(config))
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(hf_config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


def make_hf_dir(path: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """``hf_model`` saved by transformers in the config's dtype, with the published-spelling config.json."""
    dtype = {"bfloat16": torch.bfloat16}.get(config.get("torch_dtype"), torch.float32)
    model = hf_model(config, seed).to(dtype)
    for name, b in model.named_buffers():  # fp32 in the published checkpoint, as DeepSeek's own code keeps it
        if name.endswith("e_score_correction_bias"):
            b.data = b.data.float()
    model.save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def ours_of(hf) -> torch.nn.Module:
    args = SPEC.hf.args_from_hf_config(hf.config.to_dict())
    model = build_model(args, "cpu").eval()
    model.load_state_dict(SPEC.hf.from_hf_state_dict(hf.state_dict(), args), strict=True)
    return model


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------- sizes
def test_671b_counts_are_the_published_model():
    args = SPEC.flavor_args("671b")
    hf_config = transformers.DeepseekV3Config.from_dict(
        {k: v for k, v in DEEPSEEK_V3.items() if k != "torch_dtype"}
    )
    with torch.device("meta"):
        published = transformers.DeepseekV3ForCausalLM(hf_config)
    total = sum(p.numel() for p in published.parameters())  # transformers' own model (no MTP layer)
    moe_blocks, expert = 61 - 3, 3 * 7168 * 2048
    assert args.num_params() == total == 671_026_404_352 and abs(total - 671e9) / 671e9 < 0.01
    active = total - moe_blocks * (256 - 8) * expert  # 8 of the 256 routed experts per token
    assert args.num_params(active=True) == active == 37_552_282_624 and abs(active - 37e9) / 37e9 < 0.02
    assert (args.head_dim, args.num_kv_heads, args.rotary_dim) == (64, 128, 64)
    d = derive(
        config_from_dict({"model": {"model_type": "deepseek_v3", "flavor": "671b", "seq_length": 4096}})
    )
    assert (d.num_params, d.active_params) == (total, active)
    # FLOPs: 6 x active non-embedding weights + attention with q.k over 192 dims and values over 128
    attention = 6 * 61 * 4096 * 128 * (192 + 128) / 2
    assert d.flops_per_token == pytest.approx(6 * (active - 129280 * 7168) + attention, rel=1e-12)


@pytest.mark.parametrize(
    ("flavor", "total", "active"), [("debug", 178_112, 141_248), ("demo", 10_287_616, 6_748_672)]
)
def test_small_flavors_count_what_is_built(flavor, total, active):
    args = SPEC.flavor_args(flavor)
    model = build_model(args, "meta")
    assert sum(p.numel() for p in model.parameters()) == args.num_params() == total
    assert args.num_params(active=True) == active
    assert [args.is_moe_layer(i) for i in range(args.num_layers)] == [False] + [True] * (args.num_layers - 1)


# ----------------------------------------------------------------------------- parity with transformers
def test_logits_match_transformers():
    hf = hf_model(tiny())
    ours = ours_of(hf)
    assert ours.layers["1"].feed_forward.router.expert_bias.abs().sum() > 0  # the correction bias came along
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(7))
    far = torch.arange(5000, 5012)[None]  # past the original 4096: yarn's interpolated frequencies
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        assert max_diff(ours(ids), expected) < 1e-5 and expected.abs().max().item() > 0.1
        assert (
            max_diff(
                ours(ids[:1, :12], position_ids=far), hf(input_ids=ids[:1, :12], position_ids=far).logits
            )
            < 1e-5
        )
    # the yarn softmax scale is in play: (16 + 8) ** -0.5 x (0.1 ln 40 + 1) ** 2
    assert ours.layers["0"].attention.softmax_scale == pytest.approx(
        24**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12
    )


def test_variants_match_transformers():
    """No query compression (q_lora_rank null), plain half-rotation RoPE, no groups, unnormalised weights."""
    config = tiny(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False)
    config["rope_scaling"] = None
    hf = hf_model(config, seed=3)
    ours = ours_of(hf)
    assert ours.layers["0"].attention.wq is not None and ours.args.n_group == 1
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert max_diff(ours(ids), hf(input_ids=ids).logits) < 1e-5


def test_group_limited_routing_equals_a_per_token_loop():
    args = TransformerArgs(hidden_size=16, num_experts=12, top_k=3, moe_hidden_size=8, router_score="sigmoid",
                           n_group=4, topk_group=2, routed_scaling_factor=2.5)  # fmt: skip
    router = Router(args)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.gate.weight.copy_(torch.randn(12, 16, generator=gen))
        router.expert_bias.copy_(0.3 * torch.randn(12, generator=gen))
    x = torch.randn(40, 16, generator=gen)
    _, chosen, weights = router(x)
    for t in range(40):
        s = torch.sigmoid(router.gate.weight @ x[t])
        b = s + router.expert_bias
        group_score = [sorted(b[g * 3 : g * 3 + 3].tolist())[-2:] for g in range(4)]
        groups = sorted(range(4), key=lambda g: -sum(group_score[g]))[:2]
        allowed = [e for g in groups for e in range(g * 3, g * 3 + 3)]
        best = sorted(allowed, key=lambda e: -b[e].item())[:3]
        assert sorted(chosen[t].tolist()) == sorted(best)
        w = s[best] / s[best].sum() * 2.5
        got = dict(zip(chosen[t].tolist(), weights[t].tolist()))
        assert [got[e] for e in best] == pytest.approx(w.tolist(), abs=1e-6)


def test_state_dict_round_trip_and_mtp_layers():
    config = tiny()
    hf = hf_model(config)
    args = SPEC.hf.args_from_hf_config(config)
    per_expert = {}
    for k, v in hf.state_dict().items():  # the Hub's layout: one tensor per expert
        if k.endswith("experts.gate_up_proj"):
            for e, t in enumerate(v):
                gate, up = t.chunk(2)
                per_expert[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                per_expert[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif k.endswith("experts.down_proj"):
            per_expert.update({k.replace("down_proj", f"{e}.down_proj.weight"): t for e, t in enumerate(v)})
        else:
            per_expert[k] = v
    ours = SPEC.hf.from_hf_state_dict(per_expert, args)
    back = SPEC.hf.to_hf_state_dict(ours, args)
    assert back.keys() == per_expert.keys() and all(torch.equal(back[k], per_expert[k]) for k in back)
    fused = per_expert["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]  # [32 latent + 8 rope, 64]
    assert torch.equal(ours["layers.0.attention.wkv_a.weight"], fused[:32])
    assert torch.equal(ours["layers.0.attention.wk_rope.weight"], fused[32:])
    # a published checkpoint's MTP module (layer num_layers, marked by eh_proj) is skipped, as transformers does
    mtp = {
        "model.layers.2.eh_proj.weight": torch.zeros(64, 128),
        "model.layers.2.enorm.weight": torch.ones(64),
    }
    assert SPEC.hf.from_hf_state_dict({**per_expert, **mtp}, args).keys() == ours.keys()
    with pytest.raises(CheckpointError, match="unexpected.*layers.2.enorm"):
        SPEC.hf.from_hf_state_dict({**per_expert, "model.layers.2.enorm.weight": torch.ones(64)}, args)


def test_import_first_loss_and_export_round_trip(tiny_corpus, tmp_path):
    """model.init_from: hf:DIR starts at transformers' loss; export (llmtrain export) of the trained run loads in
    transformers with our logits; import + export without training gives back the same bytes of every tensor
    and the same config.json."""
    from llmtrain.train.trainer import Trainer

    config = tiny()
    hf_dir = make_hf_dir(tmp_path / "hf", config)
    run = {
        "model": {"seq_length": 32, "init_from": f"hf:{hf_dir}"},
        "train": {"batch_size": 2, "micro_batch_size": 2, "max_steps": 1, "lr": 1e-3, "warmup_steps": 0,
                  "decay_style": "constant", "log_steps": 1, "eval_steps": 0, "seed": 5},
        "data": {"datasets": [{"path": tiny_corpus, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 0, "resume": "auto"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"eval_iters": 1, "at_start": False},
        "run": {"device_target": "cpu", "output_dir": str(tmp_path / "run"), "threads": 1},
    }  # fmt: skip
    trainer = Trainer(config_from_dict(run))
    assert trainer.model.args.family == "deepseek_v3" and trainer.model.args.kv_lora_rank == 32
    mb = trainer.batches.next_step()[0]
    ours = trainer.forward_loss(mb).item() / int((mb["labels"] != -100).sum())
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(input_ids=mb["input_ids"]).logits
    theirs = F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100).item()
    assert theirs > 5.0 and ours == pytest.approx(theirs, rel=1e-5)
    trainer.fit()
    out = tmp_path / "export"
    assert cli_main(["export", str(tmp_path / "run"), "--to", "hf", str(out), "--dtype", "fp32"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    from llmtrain.train.sample import load_for_generation

    trained, tok, _ = load_for_generation(tmp_path / "run")
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert max_diff(trained(ids), exported(input_ids=ids).logits) < 1e-5
        assert max_diff(reference(input_ids=ids).logits, exported(input_ids=ids).logits) > 1e-4  # it trained
    # `llmtrain generate` (greedy, MLA cache) continues a prompt as transformers does from the export
    from llmtrain.train.sample import sample_from_run

    prompt = "def main(argv):\n    return"
    text = sample_from_run(tmp_path / "run", prompt, 8, temperature=0.0, top_k=None, top_p=None, seed=0)
    prompt_ids = tok.encode(prompt)
    hf_ids = exported.generate(
        torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_id
    )[0, len(prompt_ids) :]
    assert text == prompt + tok.decode(hf_ids.tolist()) and len(hf_ids) == 8
    # the run's config.yaml spells the architecture out: without DIR it resolves to the same model
    import yaml

    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text().split("\n", 1)[1])
    model_yaml = written["model"]
    assert (model_yaml["kv_lora_rank"], model_yaml["moe"]["n_group"], model_yaml["moe"]["topk_group"]) == (
        32,
        8,
        4,
    )
    written["model"]["init_from"] = f"hf:{tmp_path / 'gone'}"
    assert derive(config_from_dict(written)).model_args == trainer.model.args
    config_out = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in config_out.items() if k != "torch_dtype"} == {
        k: v for k, v in config.items() if k != "torch_dtype"
    }
    # import -> export, no training: every tensor and config.json come back as they were
    model, args = load_hf_pretrained(hf_dir)
    again = tmp_path / "again"
    save_hf(model.state_dict(), args, again, dtype=torch.bfloat16, base_config=config)
    before, after = read_hf_state_dict(hf_dir), read_hf_state_dict(again)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert {k: v.dtype for k, v in after.items()} == {k: v.dtype for k, v in before.items()}
    assert after["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32  # the rest: bf16
    assert json.loads((again / "config.json").read_text()) == config


def test_exported_config_reads_back_and_loads_in_transformers(tmp_path):
    """A model of the debug flavor (trained here: a moved expert bias) exports a directory transformers loads
    with our logits, and its config.json reads back to the same arguments."""
    args = dataclasses.replace(SPEC.flavor_args("debug"), seq_length=64)
    ours = build_model(args, "cpu").eval()
    ours.init_weights(seed=11)
    with torch.no_grad():
        ours.layers["1"].feed_forward.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    save_hf(ours.state_dict(), args, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert torch.equal(hf.model.layers[1].mlp.gate.e_score_correction_bias, torch.linspace(-0.2, 0.2, 8))
    ids = torch.randint(0, args.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert max_diff(ours(ids), hf(input_ids=ids).logits) < 1e-5
    keep = ("aux_loss_coef", "bias_update_rate")  # training settings, not in config.json
    parsed = dataclasses.replace(SPEC.hf.args_from_hf_config(config), flavor="debug", seq_length=64,
                                 **{k: getattr(args, k) for k in keep})  # fmt: skip
    assert parsed == args


# ----------------------------------------------------------------------------- generation with the MLA cache
def test_mla_cache_generation_equals_transformers_and_full_forward():
    hf = hf_model(tiny(), seed=4)
    ours = ours_of(hf)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    cache = KVCache(max_seq_len=24, batch_size=2)
    with torch.no_grad():
        full = ours(ids)
        chunks = [ours(ids[:, :8], cache=cache), ours(ids[:, 8:13], cache=cache)]
        chunks += [ours(ids[:, t : t + 1], cache=cache) for t in range(13, 20)]
    assert max_diff(torch.cat(chunks, dim=1), full) < 1e-5 and cache.length == 20
    # the cache holds the compressed latent (32) and the shared rotary key (8) per position, not 2 x 4 heads x 24
    assert {tuple(t.shape) for t in cache._k.values()} == {(2, 1, 24, 32)}
    assert {tuple(t.shape) for t in cache._v.values()} == {(2, 1, 24, 8)}
    prompt = [5, 17, 42, 7, 100, 3]
    got = generate(ours, prompt, max_new_tokens=8, temperature=0.0)
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
    assert got == expected.tolist()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(ours(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt) :]


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("model", "match"),
    [
        (
            {"flavor": "debug", "head_dim": 16},
            r"model\.head_dim 16 conflicts with multi-head latent attention",
        ),
        ({"flavor": "debug", "qk_norm": True}, r"does not combine with model\.qk_norm True"),
        (
            {"flavor": "debug", "kv_lora_rank": 0},
            r"model\.q_lora_rank, model\.qk_nope_head_dim.*kv_lora_rank is 0",
        ),
        ({"flavor": "debug", "qk_rope_head_dim": 7}, r"even model\.qk_rope_head_dim"),
        ({"flavor": "debug", "moe": {"n_group": 3}}, r"model\.moe\.n_group 3 must divide num_experts 8"),
        ({"flavor": "debug", "moe": {"topk_group": 3}}, r"topk_group 3 must be <= n_group"),
    ],
)
def test_bad_mla_and_routing_settings_are_config_errors(model, match):
    with pytest.raises(ConfigError, match=match):
        derive(config_from_dict({"model": {"model_type": "deepseek_v3", **model}}))


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"attention_bias": True}, ConfigError, "attention_bias is true"),
        ({"num_key_value_heads": 2}, ConfigError, "num_key_value_heads 2 differs"),
        ({"quantization_config": {"quant_method": "fp8"}}, ConfigError, "quantization_config is set"),
        ({"n_group": 3}, CheckpointError, "n_routed_experts 16, n_group 3"),
        ({"kv_lora_rank": "512"}, CheckpointError, "kv_lora_rank must be an integer"),
    ],
)
def test_bad_config_json_is_refused_by_name(changes, error, match):
    with pytest.raises(error, match=match):
        SPEC.hf.args_from_hf_config(tiny(**changes))


# ----------------------------------------------------------------------------- parallel parity
STEPS = 2
GROUPS = {  # model group -> overrides of the debug flavor; one single-process reference each
    "moe": {},
    "moe_4_layers": {"num_layers": 4},  # pipeline stages of 2 blocks: dense + MoE | MoE + MoE
    "dense": {"moe": {"num_experts": 0}},  # MLA + dense blocks: the tensor-parallel plan
}
VARIANTS = {  # world size -> {group:layout -> parallel overrides}
    2: {
        "moe:zero3_dp2": {"parallel": {"zero_stage": 3}},
        "moe:ep2_zero3": {"parallel": {"zero_stage": 3, "expert_parallel": 2, "enable_alltoall": True}},
        "moe_4_layers:pp2_1f1b": {"parallel": {"pipeline_parallel": 2, "micro_batch_num": 4}},
        "dense:tp2": {"parallel": {"tensor_parallel": 2}},
    },
    4: {  # experts sharded over each stage's data-parallel ranks
        "moe_4_layers:pp2_dp2_ep2": {
            "parallel": {"pipeline_parallel": 2, "micro_batch_num": 2, "zero_stage": 3, "expert_parallel": 2}
        },
    },
}


def group_config(prefix: str, group: str) -> dict:
    cfg = parallel_base(prefix, "deepseek_v3")
    cfg["model"].update(copy.deepcopy(GROUPS[group]))
    return cfg


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory) -> dict[str, list[dict]]:
    """Single-process steps of every model group (the aux loss and the expert bias both act)."""
    from llmtrain.train.trainer import Trainer

    out = {}
    for group in GROUPS:
        cfg = group_config(tiny_corpus, group)
        cfg["run"]["output_dir"] = str(tmp_path_factory.mktemp(f"ref-{group}"))
        t = Trainer(config_from_dict(cfg))
        out[group] = [t.train_step() for _ in range(STEPS)]
        t.metrics.close()
        assert all(s["grad_norm"] > 0.05 for s in out[group])  # clipping (0.05) really acts
        if group != "dense":
            assert all(s["moe_aux_loss"] > 0.5 for s in out[group])
            assert t.model.layers["1"].feed_forward.router.expert_bias.abs().sum() > 0
    return out


@pytest.mark.slow  # one gloo launch each: ~15 s (2 ranks), ~20 s (4 ranks)
@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layouts_match_single_process(world, tiny_corpus, reference, tmp_path):
    """One launch per world size; the second step's loss sees the first step's aux-loss gradient and bias move
    (turning either off changes it by more than 3e-5 on this model), so both are checked under every layout."""
    variants = {n: {**v, "model": copy.deepcopy(GROUPS[n.split(":")[0]])} for n, v in VARIANTS[world].items()}
    spec = {"base": group_config(tiny_corpus, "moe"), "steps": STEPS, "variants": variants}
    results = launch(world, spec, tmp_path)
    assert set(results) == set(variants)
    for name, r in results.items():
        ref = reference[name.split(":")[0]]
        close(name, r, per_step(ref))


# ----------------------------------------------------------------------------- MindFormers 2.x layout
def test_mindformers_2x_deepseek_v3_takes_the_config_class_defaults(tmp_path, capsys):
    """A 2.x (``model_type: deepseek_v3``) run file that gives only the sizes gets DeepseekV3Config's routing:
    sigmoid, 8 groups with 4 chosen, scale 2.5, 3 dense blocks, one shared expert (the 1.x file is
    tests/test_mindformers_configs.py's)."""
    import yaml

    fixture = Path(__file__).parent / "fixtures" / "mindformers" / "qwen3_moe_30b_2x.yaml"
    raw = yaml.safe_load(fixture.read_text())
    sizes = {k: v for k, v in DEEPSEEK_V3.items() if isinstance(v, int) and not isinstance(v, bool)}
    raw["model"]["model_config"] = {
        "model_type": "deepseek_v3",
        "compute_dtype": "bfloat16",
        **{k: sizes[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")},
        **{k: sizes[k] for k in ("num_attention_heads", "num_key_value_heads", "moe_intermediate_size")},
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
    }
    path = tmp_path / "deepseek_v3_2x.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli_main(["check", str(path), "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "671B (671,026,404,352); active per token 37.6B (37,552,282,624)" in out
    moe = yaml.safe_load(out.split("# resolved config\n", 1)[1].split("\n# derived", 1)[0])["model"]["moe"]
    assert (moe["router_score"], moe["n_group"], moe["topk_group"], moe["routed_scaling_factor"]) == ("sigmoid", 8, 4, 2.5)  # fmt: skip
    assert (moe["first_dense_layers"], moe["shared_experts"]) == (3, 1)

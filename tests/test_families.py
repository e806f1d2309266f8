"""The families of issue 16 against transformers, the reference: Mistral (sliding window), Mixtral, Qwen2-MoE
(Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B: gated shared expert), Qwen3-MoE (Qwen3-30B-A3B) and GLM-4-0414 (post norms).

Each starts from the published config.json (the Hub's keys and values) cut to 2 layers, hidden 64, 4 heads of 16,
2 KV heads, vocab 512 and a few narrow experts (``test_hf_interop.tiny``); transformers builds it with seeded
random weights (norm weights perturbed) and ``save_pretrained`` writes it (experts one tensor each, as on the Hub).
Shown: fp32 logits within 1e-5 of transformers' (also with sliding windows that 48 tokens cross, and a decoded
continuation through the KV cache), import -> export returns every tensor and config.json exactly, transformers
5's fused expert tensors import to the same model, a run initialised from the folder starts at transformers'
loss and its export (after one optimizer step) is what transformers computes, llmtrain-only MoE options are
refused by name on export, Gemma by model type on import; and gloo parity of TP2 / ZeRO-3 / EP2 against one
process for the new flavors (losses within 1e-5, grad norms within 1e-3 relative).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from llmtrain.cli import main as cli_main
from llmtrain.config import config_from_dict
from llmtrain.errors import ConfigError
from llmtrain.models import FAMILIES, KVCache, build_model
from llmtrain.models.hf_io import load_hf_pretrained, read_hf_config, read_hf_state_dict, save_hf
from test_hf_interop import QWEN25_05B, VOCAB, hf_reference, make_hf_dir, max_diff, run_config, tiny
from test_parallel import base as parallel_base
from test_parallel import close, launch, per_step

transformers = pytest.importorskip("transformers")

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
    "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.39.0.dev0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}  # fmt: skip
QWEN2_57B_A14B = {
    **QWEN15_MOE_A27B, "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 131072,
    "max_window_layers": 28, "moe_intermediate_size": 2560, "num_attention_heads": 28, "num_experts": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "shared_expert_intermediate_size": 20480, "sliding_window": 65536, "transformers_version": "4.40.1",
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000,
}  # fmt: skip
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0",
    "use_cache": True, "vocab_size": 32768,
}  # fmt: skip
GLM4_9B_0414 = {
    "architectures": ["Glm4ForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 13696, "max_position_embeddings": 32768, "model_type": "glm4",
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "pad_token_id": 151329,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.52.0.dev0", "use_cache": True, "vocab_size": 151552,
}  # fmt: skip
_EXPERTS = {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}  # shared = 2 experts' width
# name -> (2-layer config, our family): the published ones, then sliding windows that 48 tokens cross.
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "qwen3_30b_a3b": (tiny(QWEN3_30B_A3B, num_experts=16, **_EXPERTS), "qwen3"),
    "qwen1.5_moe_a2.7b": (tiny(QWEN15_MOE_A27B, num_experts=8, **_EXPERTS), "qwen2"),
    "qwen2_57b_a14b": (tiny(QWEN2_57B_A14B, num_experts=16, **_EXPERTS), "qwen2"),
    "mixtral_8x7b": (tiny(MIXTRAL_8X7B), "mixtral"),
    "mistral_7b_v0.3": (tiny(MISTRAL_7B_V03, sliding_window=8), "mistral"),
    "glm4_9b_0414": (tiny(GLM4_9B_0414), "glm4"),
}
SLIDING: dict[str, tuple[dict[str, Any], str]] = {
    "mixtral_window": (tiny(MIXTRAL_8X7B, sliding_window=8), "mixtral"),
    "qwen2_moe_window": (  # transformers 5's Qwen2-MoE rule: the even layers below max_window_layers
        tiny(QWEN15_MOE_A27B, num_experts=8, use_sliding_window=True, sliding_window=8, max_window_layers=2,
             **_EXPERTS), "qwen2"),
    "qwen3_moe_window": (
        tiny(QWEN3_30B_A3B, num_experts=16, use_sliding_window=True, sliding_window=8, **_EXPERTS), "qwen3"),
    "qwen2_dense_window": (  # layers >= max_window_layers
        tiny(QWEN25_05B, use_sliding_window=True, sliding_window=8, max_window_layers=1), "qwen2"),
    "qwen3_dense_layer_types": (
        {**tiny(QWEN3_30B_A3B), "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
         "use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
        "qwen3"),
}  # fmt: skip


def fp32(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """name -> a saved transformers model of every case (fp32 weights, config.json as published)."""
    root = tmp_path_factory.mktemp("families")
    return {
        name: make_hf_dir(root / name.replace(".", "_"), fp32(config), seed=i)
        for i, (name, (config, _)) in enumerate({**CASES, **SLIDING}.items())
    }


IDS = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", [*CASES, *SLIDING])
def test_logits_match_transformers(name: str, hf_dirs) -> None:
    _, family = {**CASES, **SLIDING}[name]
    ours, args = load_hf_pretrained(hf_dirs[name])
    assert args.family == family
    with torch.no_grad():
        expected = hf_reference(hf_dirs[name])(input_ids=IDS).logits
        got = ours.eval()(IDS)
    assert expected.abs().max().item() > 0.1
    assert max_diff(got, expected) < 1e-5, name
    if args.sliding_window:  # the window is real: without it the same weights give other logits
        assert args.sliding_window == 8 and IDS.shape[1] > 8
        full = build_model(dataclasses.replace(args, sliding_window=0), "cpu").eval()
        full.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert max_diff(full(IDS), expected) > 1e-3


def test_what_each_config_means(hf_dirs) -> None:
    """The published switches arrive as the model's arguments (counts checked against transformers' model)."""
    args = {name: read_hf_config(hf_dirs[name])[1] for name in hf_dirs}
    q3 = args["qwen3_30b_a3b"]
    assert (q3.num_experts, q3.top_k, q3.moe_hidden_size, q3.shared_experts) == (
        16,
        8,
        32,
        0,
    ) and q3.route_norm
    q15 = args["qwen1.5_moe_a2.7b"]
    assert (q15.top_k, q15.route_norm, q15.shared_experts, q15.shared_expert_gate) == (4, False, 2, True)
    assert q15.qkv_bias and not q15.attention_out_bias and q15.aux_loss_coef == 0.001
    mix = args["mixtral_8x7b"]
    assert (mix.num_experts, mix.top_k, mix.moe_hidden_size, mix.aux_loss_coef) == (8, 2, 128, 0.02)
    assert mix.sliding_window == 0 and args["mistral_7b_v0.3"].sliding_window == 8
    assert args["glm4_9b_0414"].post_norms and args["glm4_9b_0414"].rope_interleaved
    assert args["qwen2_moe_window"].sliding_window_layers == [0]
    assert args["qwen2_dense_window"].sliding_window_layers == [1]
    assert args["qwen3_dense_layer_types"].sliding_window_layers == [0]
    assert (
        args["qwen3_moe_window"].sliding_window_layers is None
        and args["qwen3_moe_window"].sliding_window == 8
    )
    for name, a in args.items():
        hf_params = sum(p.numel() for p in hf_reference(hf_dirs[name]).parameters())
        assert a.num_params() == hf_params, name


@pytest.mark.parametrize("name", [*CASES, "qwen2_moe_window"])
def test_import_export_round_trips_exactly(name: str, hf_dirs, tmp_path) -> None:
    """Every tensor (experts one by one, names as transformers writes them) and every config.json key."""
    src = hf_dirs[name]
    config, args = read_hf_config(src)
    model, _ = load_hf_pretrained(src)
    save_hf(model.state_dict(), args, tmp_path / "out", base_config=config)
    theirs, ours = read_hf_state_dict(src), read_hf_state_dict(tmp_path / "out")
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in theirs)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == config
    # Without the imported config.json, to_hf_config describes the same model to transformers.
    adapter = FAMILIES[args.family].hf
    hf_config = transformers.AutoConfig.for_model(**adapter.to_hf_config(args))
    back = adapter.args_from_hf_config(hf_config.to_dict())  # transformers 5's own spelling
    assert dataclasses.replace(back, seq_length=args.seq_length) == args


@pytest.mark.parametrize(
    "family, flavor",
    [("mistral", "debug"), ("mixtral", "debug"), ("qwen2", "debug_moe"), ("qwen3", "debug_moe_hf"),
     ("glm4", "debug_0414")],
)  # fmt: skip
def test_flavors_export_to_what_transformers_computes(family: str, flavor: str, tmp_path) -> None:
    """A run built from a flavor (no import): config.json from to_hf_config, weights strict, same logits."""
    args = dataclasses.replace(FAMILIES[family].flavor_args(flavor), seq_length=64)
    model = build_model(args, "cpu").eval()
    model.init_weights(seed=4)
    save_hf(model.state_dict(), args, tmp_path)
    assert read_hf_config(tmp_path)[1] == dataclasses.replace(args, flavor=None)
    with torch.no_grad():
        expected = hf_reference(tmp_path)(input_ids=IDS).logits
        assert max_diff(model(IDS), expected) < 1e-5 and expected.abs().max().item() > 0.01


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "qwen1.5_moe_a2.7b", "mixtral_8x7b"])
def test_transformers5_fused_experts_import_the_same(name: str, hf_dirs) -> None:
    """transformers 5 holds experts as fused 3-D tensors (``experts.gate_up_proj`` / ``down_proj``)."""
    hf = hf_reference(hf_dirs[name])
    fused = hf.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in fused)
    _, args = read_hf_config(hf_dirs[name])
    adapter = FAMILIES[args.family].hf
    from_fused = adapter.from_hf_state_dict(fused, args)
    from_files = adapter.from_hf_state_dict(read_hf_state_dict(hf_dirs[name]), args)
    assert from_fused.keys() == from_files.keys()
    assert all(torch.equal(from_fused[k], from_files[k]) for k in from_files)
    gate_up = fused["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2H, D]: gate rows first
    assert torch.equal(from_fused["layers.1.feed_forward.experts.w1"], gate_up[:, : args.moe_hidden_size])
    assert from_files["layers.1.feed_forward.router.expert_bias"].abs().sum() == 0


def test_decoding_through_the_kv_cache_crosses_the_window(hf_dirs) -> None:
    """Token by token past the 8-token window: the cached logits equal a full forward's (and transformers')."""
    model, args = load_hf_pretrained(hf_dirs["mistral_7b_v0.3"])
    model.eval()
    ids = IDS[:1, :20]
    cache = KVCache(max_seq_len=32)
    with torch.no_grad():
        steps = [model(ids[:, :5], cache=cache)[:, -1]]
        steps += [model(ids[:, t : t + 1], cache=cache)[:, -1] for t in range(5, 20)]
        full = model(ids)[0]
        expected = hf_reference(hf_dirs["mistral_7b_v0.3"])(input_ids=ids).logits[0]
    assert cache.length == 20
    assert max_diff(torch.cat(steps), full[4:]) < 1e-5 and max_diff(full, expected) < 1e-5


def test_window_mask_with_packed_documents_and_yaml_keys() -> None:
    """The band combines with document masks exactly; model.sliding_window(_layers) resolve and are checked."""
    from llmtrain.config.schema import ModelConfig
    from llmtrain.models import resolve_model_args
    from llmtrain.models.common.attention import build_attention_mask

    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    got = build_attention_mask(12, 0, docs, False, torch.device("cpu"), window=3).allowed
    want = torch.tensor(
        [[docs[0, q] == docs[0, k] and q - 3 < k <= q for k in range(12)] for q in range(12)]
    )  # fmt: skip
    assert got is not None and torch.equal(got[0, 0], want)
    decode = build_attention_mask(1, 9, None, False, torch.device("cpu"), window=4).allowed  # 10th token
    assert decode is not None and decode[0, 0, 0].tolist() == [False] * 6 + [True] * 4
    args = resolve_model_args(ModelConfig(flavor="debug", sliding_window=4, sliding_window_layers=[1]))
    assert [args.is_sliding_layer(i) for i in range(2)] == [False, True]
    model = build_model(args, "cpu")
    assert not model.layers["0"].attention.sliding and model.layers["1"].attention.sliding
    off = resolve_model_args(ModelConfig(model_type="mistral", flavor="debug", sliding_window=0))
    windowed = FAMILIES["mistral"].flavor_args("debug")
    assert off.sliding_window == 0 and windowed.sliding_window == 16
    # FLOPs: 16 - 16^2 / 64 = 12 keys per query at 32 tokens instead of 16, in each of 2 layers x 4 heads of 16
    assert off.flops_per_token(32) - windowed.flops_per_token(32) == 12 * (16 - 12) * 2 * 4 * 16
    with pytest.raises(ConfigError, match=r"model.sliding_window_layers .* in \[0, 2\), got \[5\]"):
        resolve_model_args(ModelConfig(flavor="debug", sliding_window=4, sliding_window_layers=[5]))


@pytest.fixture(scope="module", params=list(CASES))
def trained(request, hf_dirs, tiny_corpus, tmp_path_factory):
    """(name, first-step losses ours / transformers', run dir, export dir) of a 1-step run from the folder."""
    from llmtrain.train.trainer import Trainer

    name = request.param
    root = tmp_path_factory.mktemp(name.replace(".", "_"))
    trainer = Trainer(
        config_from_dict(run_config(tiny_corpus, root / "run", {"init_from": f"hf:{hf_dirs[name]}"}))
    )
    mb = trainer.batches.next_step()[0]
    ours = trainer.forward_loss(mb).item() / int((mb["labels"] != -100).sum())
    with torch.no_grad():
        logits = hf_reference(hf_dirs[name])(input_ids=mb["input_ids"]).logits
    theirs = F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100).item()
    trainer.fit()
    assert cli_main(["export", str(root / "run"), "--to", "hf", str(root / "export")]) == 0
    return name, (ours, theirs), root / "run", root / "export"


def test_run_starts_at_transformers_loss_and_exports_what_it_trained(trained, hf_dirs):
    from llmtrain.train.sample import load_for_generation

    name, (ours, theirs), run, out = trained
    assert theirs > 5.0 and ours == pytest.approx(theirs, rel=1e-5), name
    model, _, _ = load_for_generation(run)
    with torch.no_grad():
        exported = hf_reference(out)(input_ids=IDS).logits
        assert max_diff(model(IDS), exported) < 1e-5, name
        assert max_diff(hf_reference(hf_dirs[name])(input_ids=IDS).logits, exported) > 1e-4  # it did train
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (hf_dirs[name] / "config.json").read_text()
    )


# ----------------------------------------------------------------------------- refused, by name
def test_llmtrain_only_moe_options_are_refused_on_export(tmp_path) -> None:
    """qwen3 debug_moe (ungated shared expert) and an aux-loss-free bias have no place in Qwen3MoeForCausalLM."""
    args = FAMILIES["qwen3"].flavor_args("debug_moe")
    model = build_model(args, "cpu")
    with pytest.raises(ConfigError, match=r"Qwen3MoeForCausalLM.*shared expert.*MoE export with that option"):
        save_hf(model.state_dict(), args, tmp_path / "a")
    args = dataclasses.replace(FAMILIES["qwen3"].flavor_args("debug_moe_hf"), bias_update_rate=0.001)
    model = build_model(args, "cpu")
    save_hf(model.state_dict(), args, tmp_path / "zero")  # the bias is still all zeros: exact, exported
    with torch.no_grad():
        model.layers["1"].feed_forward.router.expert_bias[2] = 0.01
    with pytest.raises(ConfigError, match=r"block 1.*expert_bias.*bias_update_rate 0\.001.*unsupported"):
        save_hf(model.state_dict(), args, tmp_path / "b")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text"])
def test_gemma_is_refused_by_model_type(model_type: str, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**tiny(MISTRAL_7B_V03), "model_type": model_type}))
    with pytest.raises(ConfigError, match=rf"model_type '{model_type}' is refused: Gemma's RMSNorm.*GeGLU"):
        load_hf_pretrained(tmp_path)


def test_bad_moe_configs_are_named(tmp_path) -> None:
    cases = [
        ({**CASES["mixtral_8x7b"][0], "router_jitter_noise": 0.1}, "router_jitter_noise 0.1"),
        ({**CASES["qwen1.5_moe_a2.7b"][0], "shared_expert_intermediate_size": 40}, "not a multiple"),
        ({**CASES["qwen3_30b_a3b"][0], "mlp_only_layers": [1]}, r"mlp_only_layers \[1\]"),
        ({**CASES["qwen3_30b_a3b"][0], "num_local_experts": 4}, "num_local_experts 4 and num_experts 16"),
    ]
    for config, match in cases:
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(Exception, match=match):
            read_hf_config(tmp_path)
    dense_first = {**CASES["qwen3_30b_a3b"][0], "mlp_only_layers": [0]}  # expressible: first_dense_layers 1
    (tmp_path / "config.json").write_text(json.dumps(dense_first))
    assert read_hf_config(tmp_path)[1].first_dense_layers == 1


# ----------------------------------------------------------------------------- gloo parity, one launch
STEPS = 3
GROUPS = {  # group -> model section over test_parallel's base
    "mistral": {"model_type": "mistral", "flavor": "debug"},
    "glm4_0414": {"model_type": "glm4", "flavor": "debug_0414"},
    "mixtral": {"model_type": "mixtral", "flavor": "debug"},
    "qwen2_moe": {"model_type": "qwen2", "flavor": "debug_moe"},
}
VARIANTS = {  # TP2: the window and the post norms; EP2 over ZeRO-3: the new experts
    "mistral:tp2": {"parallel": {"tensor_parallel": 2}},
    "glm4_0414:tp2": {"parallel": {"tensor_parallel": 2}},
    "mixtral:ep2_zero3": {"parallel": {"zero_stage": 3, "expert_parallel": 2}},
    "qwen2_moe:ep2_zero3": {"parallel": {"zero_stage": 3, "expert_parallel": 2}},
}


def test_parallel_layouts_match_single_process(tiny_corpus, tmp_path):
    from llmtrain.train.trainer import Trainer

    base = parallel_base(tiny_corpus, "llama3")
    reference = {}
    for group, model in GROUPS.items():
        cfg = json.loads(json.dumps(base))
        cfg["model"].update(model)
        cfg["run"]["output_dir"] = str(tmp_path / f"ref-{group}")
        t = Trainer(config_from_dict(cfg))
        reference[group] = [t.train_step() for _ in range(STEPS)]
        t.metrics.close()
        assert all(s["grad_norm"] > 0.05 for s in reference[group])  # clipping acts
    assert len({round(r[0]["loss"], 6) for r in reference.values()}) == len(GROUPS)  # four different models
    variants = {name: {**over, "model": GROUPS[name.split(":")[0]]} for name, over in VARIANTS.items()}
    results = launch(2, {"base": base, "steps": STEPS, "variants": variants}, tmp_path, tag="_families")
    assert set(results) == set(VARIANTS)
    for name, r in results.items():
        ref = reference[name.split(":")[0]]
        close(name, r, per_step(ref))

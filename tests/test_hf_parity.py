"""Logits parity with Hugging Face transformers (the reference implementation) and the state-dict adapters.

Tiny HF models are built from the HF config classes with seeded random weights (norm weights and biases
perturbed too, so every tensor's mapping matters), converted with ``models/<family>/hf.py`` and compared in fp32.
transformers is a test-only dependency; the library never imports it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmtrain.errors import CheckpointError
from llmtrain.models import FAMILIES, TransformerArgs, build_model

transformers = pytest.importorskip("transformers")

HF_CLASSES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "glm4": ("GlmConfig", "GlmForCausalLM"),
}
PARITY_FAMILIES = list(HF_CLASSES)


def debug_args(family: str) -> TransformerArgs:
    args = FAMILIES[family].flavor_args("debug")
    return dataclasses.replace(args, seq_length=256)


def hf_model(family: str, args: TransformerArgs, seed: int = 0):
    config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[family])
    config = config_cls.from_dict(FAMILIES[family].hf.to_hf_config(args))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return model


def ours_from_hf(family: str, args: TransformerArgs, hf) -> torch.nn.Module:
    model = build_model(args, "cpu").eval()
    model.load_state_dict(FAMILIES[family].hf.from_hf_state_dict(hf.state_dict(), args), strict=True)
    return model


def test_llama3_debug_uses_llama3_rope_scaling() -> None:
    args = debug_args("llama3")
    assert args.rope_scaling is not None and args.rope_scaling["rope_type"] == "llama3"
    assert (
        args.rope_scaling["factor"] == 8.0 and args.rope_scaling["original_max_position_embeddings"] == 8192
    )
    from llmtrain.models.common.rope import rope_inv_freq

    plain = rope_inv_freq(args.rotary_dim, args.rope_theta, None)
    scaled = rope_inv_freq(args.rotary_dim, args.rope_theta, args.rope_scaling)
    assert not torch.equal(plain, scaled)  # the scaling really changes some frequencies at this head size
    assert torch.equal(plain[0], scaled[0])  # ... but not the highest one


@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_logits_match_transformers(family: str) -> None:
    args = debug_args(family)
    hf = hf_model(family, args)
    ours = ours_from_hf(family, args, hf)
    ids = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids)
    assert got.shape == expected.shape == (2, 48, args.vocab_size)
    assert (got - expected).abs().max().item() < 1e-5
    assert expected.abs().max().item() > 0.1  # the comparison is not between two near-zero tensors


@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_logits_match_with_explicit_positions(family: str) -> None:
    """Position ids far from 0 exercise the (scaled) low frequencies of RoPE."""
    args = debug_args(family)
    hf = hf_model(family, args, seed=3)
    ours = ours_from_hf(family, args, hf)
    ids = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(5000, 5012)[None]
    with torch.no_grad():
        diff = (ours(ids, position_ids=pos) - hf(input_ids=ids, position_ids=pos).logits).abs().max().item()
    assert diff < 1e-5


@pytest.mark.parametrize("family", [*PARITY_FAMILIES, "baichuan2"])
def test_state_dict_round_trip_is_exact(family: str) -> None:
    adapter = FAMILIES[family].hf
    args = debug_args(family)
    ours = build_model(args, "cpu")
    ours.init_weights(seed=5)
    sd = ours.state_dict()
    back = adapter.from_hf_state_dict(adapter.to_hf_state_dict(sd, args), args)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    if family in HF_CLASSES:
        hf_sd = hf_model(family, args).state_dict()
        again = adapter.to_hf_state_dict(adapter.from_hf_state_dict(hf_sd, args), args)
        assert again.keys() == hf_sd.keys()
        assert all(torch.equal(again[k], hf_sd[k]) for k in hf_sd)


@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_exported_config_and_weights_load_strictly(family: str) -> None:
    """to_hf_config loads into the transformers config class, and the HF model takes our weights strictly."""
    adapter = FAMILIES[family].hf
    args = debug_args(family)
    ours = build_model(args, "cpu").eval()
    ours.init_weights(seed=11)
    config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[family])
    config = config_cls.from_dict(adapter.to_hf_config(args))
    assert config.num_key_value_heads == args.num_kv_heads and config.vocab_size == args.vocab_size
    config._attn_implementation = "eager"
    hf = model_cls(config).eval()
    hf.load_state_dict(adapter.to_hf_state_dict(ours.state_dict(), args), strict=True)
    ids = torch.randint(0, args.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max().item() < 1e-5
    # The config transformers itself writes (5.x spelling: rope_parameters) reads back to the same arguments.
    parsed = adapter.args_from_hf_config(config.to_dict())
    assert dataclasses.replace(parsed, flavor="debug", seq_length=args.seq_length) == args


def test_tied_embeddings_parity_and_missing_lm_head() -> None:
    args = dataclasses.replace(debug_args("qwen2"), tie_word_embeddings=True)
    hf = hf_model("qwen2", args)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    hf_sd = {
        k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"
    }  # as safetensors files store it
    ours = build_model(args, "cpu").eval()
    ours.load_state_dict(FAMILIES["qwen2"].hf.from_hf_state_dict(hf_sd, args), strict=True)
    ids = torch.randint(0, args.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max().item() < 1e-5


def test_from_hf_names_missing_and_unexpected_keys() -> None:
    args = debug_args("llama3")
    hf_sd = hf_model("llama3", args).state_dict()
    hf_sd.pop("model.layers.1.mlp.up_proj.weight")
    hf_sd["model.layers.0.self_attn.bogus.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"layers\.1\.feed_forward\.w3\.weight.*bogus"):
        FAMILIES["llama3"].hf.from_hf_state_dict(hf_sd, args)


def test_glm_gate_up_is_split_gate_first() -> None:
    args = debug_args("glm4")
    hf = hf_model("glm4", args)
    sd = FAMILIES["glm4"].hf.from_hf_state_dict(hf.state_dict(), args)
    fused = hf.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(sd["layers.0.feed_forward.w1.weight"], fused[: args.intermediate_size])
    assert torch.equal(sd["layers.0.feed_forward.w3.weight"], fused[args.intermediate_size :])


def test_baichuan_w_pack_and_config() -> None:
    adapter = FAMILIES["baichuan2"].hf
    for flavor, pe in (("debug", "rope"), ("debug_alibi", "alibi")):
        args = FAMILIES["baichuan2"].flavor_args(flavor)
        ours = build_model(args, "cpu")
        hf_sd = adapter.to_hf_state_dict(ours.state_dict(), args)
        w_pack = hf_sd["model.layers.0.self_attn.W_pack.weight"]
        assert w_pack.shape == (3 * args.hidden_size, args.hidden_size)
        assert torch.equal(
            w_pack[args.hidden_size : 2 * args.hidden_size], ours.layers["0"].attention.wk.weight
        )
        config = adapter.to_hf_config(args)
        assert config["position_embedding"] == pe
        assert dataclasses.replace(adapter.args_from_hf_config(config), flavor=flavor) == args
    # A published 13B config (no max_position_embeddings, no position_embedding key) reads as ALiBi.
    published_13b = {
        "hidden_size": 5120,
        "intermediate_size": 13696,
        "num_attention_heads": 40,
        "num_hidden_layers": 40,
        "vocab_size": 125696,
        "model_max_length": 4096,
        "rms_norm_eps": 1e-6,
    }
    args13 = adapter.args_from_hf_config(published_13b)
    assert args13.position_embedding == "alibi" and args13.num_params() == 13_896_668_160

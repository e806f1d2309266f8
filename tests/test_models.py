"""Model families: build/materialise/forward, exact and published parameter counts, deterministic init,
document masking of packed sequences (RoPE and ALiBi), head-sharded attention, and config resolution errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from llmtrain.config.schema import ModelConfig
from llmtrain.errors import ConfigError
from llmtrain.models import FAMILIES, build_model, list_flavors, resolve_model_args
from llmtrain.models.common.rope import alibi_slopes

DEBUG_CASES = [
    ("llama3", "debug"),
    ("qwen2", "debug"),
    ("qwen3", "debug"),
    ("glm4", "debug"),
    ("baichuan2", "debug"),
    ("baichuan2", "debug_alibi"),
]


def materialised(family: str, flavor: str = "debug", seed: int = 0, **overrides):
    args = dataclasses.replace(FAMILIES[family].flavor_args(flavor), **overrides)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.eval()


@pytest.mark.parametrize(("family", "flavor"), DEBUG_CASES)
def test_debug_flavor_builds_on_meta_materialises_and_runs(family: str, flavor: str) -> None:
    args = resolve_model_args(ModelConfig(model_type=family, flavor=flavor))
    model = build_model(args)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    assert list(model.layers.keys()) == [str(i) for i in range(args.num_layers)]
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    ids = torch.randint(0, args.vocab_size, (2, 9))
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (2, 9, args.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0
    embed = args.vocab_size * args.hidden_size
    assert args.num_params(exclude_embedding=True) == args.num_params() - embed


PUBLISHED = [
    ("llama3", "8b", 8.03e9),
    ("llama3", "70b", 70.6e9),
    ("llama3", "405b", 405.9e9),
    ("llama3", "100b", 100e9),
    ("qwen2", "0.5b", 0.49e9),
    ("qwen2", "7b", 7.6e9),
    ("qwen2", "72b", 72.7e9),
    ("qwen3", "0.6b", 0.6e9),
    ("qwen3", "8b", 8.2e9),
    ("qwen3", "32b", 32.8e9),
    ("glm4", "9b", 9.4e9),
    ("baichuan2", "7b", 7.5e9),
    ("baichuan2", "13b", 13.9e9),
]


@pytest.mark.parametrize(("family", "flavor", "published"), PUBLISHED)
def test_real_flavors_match_published_parameter_counts(family: str, flavor: str, published: float) -> None:
    args = FAMILIES[family].flavor_args(flavor)
    assert abs(args.num_params() - published) / published < 0.01


def test_exact_counts_and_flops_of_llama3_8b() -> None:
    args = FAMILIES["llama3"].flavor_args("8b")
    assert args.num_params() == 8_030_261_248
    assert args.rope_theta == 500000.0 and args.rope_scaling["factor"] == 8.0
    non_embed = 8_030_261_248 - 128256 * 4096
    assert args.flops_per_token(8192) == 6 * non_embed + 6 * 32 * 8192 * 32 * 128
    tied = FAMILIES["qwen3"].flavor_args("0.6b")  # tied: the output matmul still costs FLOPs
    assert tied.flops_per_token(1) == 6 * tied.num_params() + 6 * 28 * 1 * 16 * 128


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "glm4", "baichuan2"])
def test_demo_flavors_are_small_enough_for_a_cpu(family: str) -> None:
    args = FAMILIES[family].flavor_args("demo")
    assert args.vocab_size == 8192 and args.hidden_size == 384 and args.num_layers == 6
    assert 10e6 <= args.num_params() <= 30e6


def test_init_is_deterministic_and_name_seeded() -> None:
    a, b = materialised("qwen3", seed=4), materialised("qwen3", seed=4)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c = materialised("qwen3", seed=5)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], c.state_dict()["layers.0.attention.wq.weight"])
    assert torch.equal(sa["layers.1.attention.q_norm.weight"], torch.ones(32))
    # A pipeline stage that keeps only layer 1 gets the very same tensors for it.
    stage = build_model(a.args)
    del stage.layers["0"]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    stage.init_weights(seed=4)
    assert torch.equal(stage.layers["1"].feed_forward.w2.weight, a.layers["1"].feed_forward.w2.weight)
    # Residual-writing matrices are depth-scaled: std / sqrt(2 * num_layers).
    wo_std = a.layers["0"].attention.wo.weight.std().item()
    assert abs(wo_std - 0.02 / 2) < 0.002


def test_pipeline_stages_chain_to_the_full_model() -> None:
    full = materialised("llama3")
    first, last = copy.deepcopy(full), copy.deepcopy(full)
    del first.layers["1"]
    first.norm, first.output = None, None
    del last.layers["0"]
    last.tok_embeddings = None
    ids = torch.randint(0, 512, (2, 7))
    with torch.no_grad():
        hidden = first(ids)
        assert hidden.shape == (2, 7, 64)
        assert torch.allclose(last(hidden), full(ids), atol=1e-6)


def pack(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.cat(docs)[None]  # [1, T]
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    return ids, doc_ids, pos


@pytest.mark.parametrize(
    ("family", "flavor"), [("llama3", "debug"), ("baichuan2", "debug_alibi"), ("glm4", "debug")]
)
def test_document_mask_makes_packed_equal_to_alone(family: str, flavor: str) -> None:
    model = materialised(family, flavor, seed=3)
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 512, (n,), generator=gen) for n in (5, 9, 4)]
    ids, doc_ids, pos = pack(docs)
    with torch.no_grad():
        packed = model(ids, position_ids=pos, document_ids=doc_ids)[0]  # [T, V]
        unmasked = model(ids, position_ids=pos)[0]
        start = 0
        for doc in docs:
            alone = model(doc[None])[0]
            assert (packed[start : start + len(doc)] - alone).abs().max().item() < 1e-5
            start += len(doc)
    assert (unmasked[5:] - packed[5:]).abs().max().item() > 1e-3  # without the mask documents leak


def test_alibi_slopes_follow_press_et_al() -> None:
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    s40 = alibi_slopes(40)
    assert torch.allclose(s40[:32], alibi_slopes(32))
    assert torch.allclose(s40[32:], alibi_slopes(64)[0::2][:8])


def test_attention_derives_local_heads_from_weight_shapes() -> None:
    """Two half-width attention shards (as column/row-wise TP makes them) sum to the full attention."""
    model = materialised("llama3", seed=6)
    attn = model.layers["0"].attention
    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(6)[None].expand(2, 6)
    rope = model.rope(pos)
    from llmtrain.models.common.attention import build_attention_mask

    mask = build_attention_mask(6, 0, None, False, x.device)
    with torch.no_grad():
        full = attn(x, rope, mask)
        total = torch.zeros_like(full)
        for rank in range(2):
            shard = copy.deepcopy(attn)
            q_rows, kv_rows = slice(32 * rank, 32 * (rank + 1)), slice(16 * rank, 16 * (rank + 1))
            shard.wq.weight = torch.nn.Parameter(attn.wq.weight[q_rows])
            shard.wk.weight = torch.nn.Parameter(attn.wk.weight[kv_rows])
            shard.wv.weight = torch.nn.Parameter(attn.wv.weight[kv_rows])
            shard.wo.weight = torch.nn.Parameter(attn.wo.weight[:, q_rows])
            total += shard(x, rope, mask)
    assert (total - full).abs().max().item() < 1e-5


def test_resolution_layers_defaults_flavor_and_overrides() -> None:
    args = resolve_model_args(ModelConfig(model_type="llama", flavor="demo", num_layers=3), vocab_size=1000)
    assert (
        args.family == "llama3"
        and args.num_layers == 3
        and args.hidden_size == 384
        and args.vocab_size == 1000
    )
    assert resolve_model_args(ModelConfig(model_type="qwen2", flavor="7b")).vocab_size == 152064
    free = resolve_model_args(ModelConfig(model_type="glm4", hidden_size=100, num_layers=2, num_heads=4), 300)
    assert free.intermediate_size == 512 and free.head_dim == 25 and free.num_kv_heads == 2 and free.qkv_bias
    assert resolve_model_args(ModelConfig(flavor="debug", rope_scaling=4)).rope_scaling == {
        "rope_type": "linear",
        "factor": 4.0,
    }
    alibi = resolve_model_args(ModelConfig(model_type="baichuan2", flavor="debug", use_rope=False))
    assert alibi.position_embedding == "alibi" and alibi.rotary_dim == 0
    assert list_flavors("llama")[:2] == ["debug", "demo"] and "100b" in list_flavors("llama3")
    assert set(FAMILIES) == {
        "llama3", "llama", "qwen2", "qwen3", "glm4", "baichuan2", "mistral", "mixtral", "deepseek_v3"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"model_type": "gpt2"}, "model.model_type"),
        ({"flavor": "huge"}, "model.flavor"),
        ({"flavor": None, "hidden_size": 64}, "model.num_layers"),
        ({"num_kv_heads": 3}, "model.num_kv_heads"),
        ({"num_heads": 5, "num_kv_heads": 5}, "model.num_heads"),
        ({"hidden_size": 0}, "model.hidden_size"),
        ({"num_layers": -1}, "model.num_layers"),
        ({"model_type": "baichuan2", "flavor": "debug_alibi", "rope_scaling": 2.0}, "model.rope_scaling"),
        ({"use_rope": False, "position_embedding": "rope"}, "model.use_rope"),
        ({"position_embedding": "learned"}, "model.position_embedding"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2}}, "model.rope_scaling"),
        ({"partial_rotary_factor": 0.1}, "model.partial_rotary_factor"),
        ({"rope_theta": "big"}, "model.rope_theta"),
    ],
)
def test_resolution_errors_name_the_key(fields: dict, key: str) -> None:
    cfg = ModelConfig(**{"flavor": "debug", **fields})
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve_model_args(cfg)


def test_missing_vocabulary_is_a_config_error() -> None:
    cfg = ModelConfig(hidden_size=64, num_layers=1, num_heads=4)
    with pytest.raises(ConfigError, match=r"model\.vocab_size"):
        resolve_model_args(cfg)
    assert resolve_model_args(cfg, vocab_size=777).vocab_size == 777

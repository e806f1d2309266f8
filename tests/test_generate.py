"""KV-cache decoding equals full forwards; greedy generation; top-k / top-p filters."""

from __future__ import annotations

import pytest
import torch

from llmtrain.errors import ConfigError
from llmtrain.generate import filter_top_k, filter_top_p, generate, sample_next
from llmtrain.models import FAMILIES, KVCache, build_model


def debug_model(family: str, flavor: str = "debug", seed: int = 0):
    model = build_model(FAMILIES[family].flavor_args(flavor), "cpu").eval()
    model.init_weights(seed=seed)
    return model


CASES = [
    ("llama3", "debug"),
    ("qwen2", "debug"),
    ("qwen3", "debug"),
    ("glm4", "debug"),
    ("baichuan2", "debug_alibi"),
]


@pytest.mark.parametrize(("family", "flavor"), CASES)
def test_incremental_logits_equal_full_forward(family: str, flavor: str) -> None:
    model = debug_model(family, flavor, seed=1)
    ids = torch.randint(0, model.args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)  # [2, 20, V]
        cache = KVCache(max_seq_len=24, batch_size=2)
        chunks = [model(ids[:, :8], cache=cache), model(ids[:, 8:13], cache=cache)]  # prefill, then a chunk
        chunks += [model(ids[:, t : t + 1], cache=cache) for t in range(13, 20)]  # one token at a time
    assert cache.length == 20
    incremental = torch.cat(chunks, dim=1)
    assert (incremental - full).abs().max().item() < 1e-5
    assert full.std().item() > 0.01


def test_greedy_generate_equals_argmax_loop_without_cache() -> None:
    model = debug_model("llama3", seed=2)
    prompt = [5, 17, 42, 7]
    got = generate(model, prompt, max_new_tokens=12, temperature=0.0)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt) :]
    assert len(got) == 12


def test_generate_stops_at_eos_and_is_reproducible() -> None:
    model = debug_model("qwen3", seed=3)
    greedy = generate(model, [1, 2, 3], max_new_tokens=10, temperature=0)
    eos = greedy[3]
    stopped = generate(model, [1, 2, 3], max_new_tokens=10, temperature=0, eos_id=eos)
    assert stopped == greedy[: greedy.index(eos) + 1]
    a = generate(model, [1, 2, 3], 15, temperature=1.0, top_k=50, generator=torch.Generator().manual_seed(9))
    b = generate(model, [1, 2, 3], 15, temperature=1.0, top_k=50, generator=torch.Generator().manual_seed(9))
    assert a == b and len(a) == 15
    assert generate(model, [1, 2, 3], 8, top_k=1, generator=torch.Generator().manual_seed(0)) == greedy[:8]


def test_top_k_filter_and_samples() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 3.0, 0.0])
    kept = filter_top_k(logits, 3)
    assert torch.isfinite(kept).nonzero().flatten().tolist() == [1, 3, 4]
    assert torch.equal(kept[[1, 3, 4]], logits[[1, 3, 4]])
    gen = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, temperature=5.0, top_k=2, generator=gen) for _ in range(300)}
    assert draws == {1, 4}  # high temperature flattens, but only the top 2 (3.0, 2.0) can come out


def test_top_p_filter_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    keep = lambda p: torch.isfinite(filter_top_p(logits, p)).nonzero().flatten().tolist()  # noqa: E731
    assert keep(0.4) == [1]
    assert keep(0.8) == [1, 3]  # 0.5 + 0.3 reaches 0.8 exactly
    assert keep(0.81) == [1, 2, 3]
    assert keep(1.0) == [0, 1, 2, 3]
    gen = torch.Generator().manual_seed(1)
    draws = [sample_next(logits, temperature=1.0, top_p=0.8, generator=gen) for _ in range(400)]
    assert set(draws) == {1, 3}
    share = draws.count(1) / len(draws)
    assert abs(share - 0.5 / 0.8) < 0.08  # renormalised over the nucleus


def test_generate_rejects_bad_arguments() -> None:
    model = debug_model("llama3")
    with pytest.raises(ConfigError, match="top_p"):
        generate(model, [1], 3, top_p=1.5)
    with pytest.raises(ConfigError, match="temperature"):
        generate(model, [1], 3, temperature=-1)
    with pytest.raises(ConfigError, match="vocabulary"):
        generate(model, [100000], 3)
    with pytest.raises(ConfigError, match="prompt"):
        generate(model, [], 3)


def test_kv_cache_refuses_to_overflow() -> None:
    model = debug_model("llama3")
    cache = KVCache(max_seq_len=4)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        with pytest.raises(ValueError, match="full"):
            model(torch.tensor([[4, 5]]), cache=cache)

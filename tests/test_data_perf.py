"""The loader's batched path (one gather per step) equals the per-sample path exactly: order, tokens, source,
token accounting and batch tensors, on blended multi-shard concat and bestfit datasets across epochs, a mixture
change and stage offsets; and make_batch against a per-row reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llmtrain.config.schema import Config, DatasetSpec
from llmtrain.data.loader import BatchIterator, build_datasets, make_batch
from llmtrain.data.prep.prepare import prepare
from llmtrain.data.prep.tokenizer_training import train_bpe
from llmtrain.data.samples import BlendedSamples

TEXTS = [f"Doc {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][i % 4] for _ in range(3 + (i * 7) % 40))
         for i in range(90)]  # fmt: skip
SEQ = 16


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> BlendedSamples:
    root = tmp_path_factory.mktemp("perf")
    tok = root / "bpe.json"
    train_bpe(iter(TEXTS), 300, str(tok))
    src = root / "a.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    opts = {"concat": {"num_shards": 3}, "best": {"pack": "bestfit", "seq_length": SEQ, "num_shards": 2}}
    for name, o in opts.items():
        prepare([str(src)], str(root / name), tokenizer=str(tok), log=None, options=o)
    cfg = Config()
    cfg.model.seq_length, cfg.train.seed, cfg.data.valid_fraction = SEQ, 11, 0.1
    cfg.data.datasets = [DatasetSpec(str(root / "concat"), 0.6), DatasetSpec(str(root / "best"), 0.4)]
    cfg.data.mixture = [{"start_sample": 700, "weights": [0.2, 0.8]}]
    train, _ = build_datasets(cfg)
    return train


def reference_batch(tokens: np.ndarray, eos: np.ndarray, eod_mask_loss: bool) -> dict[str, np.ndarray]:
    """Per-row, per-token reference of make_batch (the documented semantics, written as loops)."""
    rows = {k: [] for k in ("input_ids", "labels", "position_ids", "document_ids")}
    for window, e in zip(tokens.tolist(), eos.tolist()):
        filled = [e if x < 0 else x for x in window]
        inputs, labels = filled[:-1], filled[1:]
        labels = [-100 if window[i + 1] < 0 or (eod_mask_loss and inputs[i] == e) else y
                  for i, y in enumerate(labels)]  # fmt: skip
        pos, doc, p, d = [], [], 0, 0
        for x in inputs:
            pos.append(p)
            doc.append(d)
            p, d = (0, d + 1) if x == e else (p + 1, d)
        for k, v in zip(rows, (inputs, labels, pos, doc)):
            rows[k].append(v)
    return {k: np.asarray(v, dtype=np.int64) for k, v in rows.items()}


def test_batched_samples_equal_per_sample(blend):
    assert [len(s) for s in blend.sources] == [len(blend.sources[0]), len(blend.sources[1])]
    n = 3 * sum(len(s) for s in blend.sources) + 50  # several epochs of each source, past the mixture change
    gs = np.arange(n)
    source, tokens = blend.samples(gs)
    src_ref, k_ref = zip(*(blend.locate(int(g)) for g in gs))
    assert source.tolist() == list(src_ref)
    assert blend.locate_many(gs)[1].tolist() == list(k_ref)
    for g in range(n):
        assert np.array_equal(tokens[g], blend.sample(g)[1]), g
    assert (tokens == -1).any() and (tokens[source == 0] >= 0).all()  # bestfit padding only in source 1
    for d, s in enumerate(blend.sources):  # shuffled, non-contiguous indices spanning epochs
        ks = np.random.default_rng(d).integers(0, 4 * len(s), size=200)
        assert np.array_equal(s.samples(ks), np.stack([s.sample(int(k)) for k in ks]))
        assert s.samples_tokens(ks).tolist() == [s.sample_tokens(int(k)) for k in ks]


def test_offsets_and_single_source(blend):
    staged = BlendedSamples(blend.sources, [0.5, 0.5], seed=5, offsets=[17, 3])
    gs = np.arange(0, 300, 7)
    source, tokens = staged.samples(gs)
    for i, g in enumerate(gs):
        d, window = staged.sample(int(g))
        assert source[i] == d and np.array_equal(tokens[i], window)
    single = BlendedSamples(blend.sources[:1], [1.0], seed=5, offsets=[9])
    assert np.array_equal(single.samples(gs)[1], np.stack([single.sample(int(g))[1] for g in gs]))


@pytest.mark.parametrize("eod_mask_loss,batch_tokens", [(False, 1 << 15), (True, 1)])
def test_iterator_equals_per_sample_reference(blend, eod_mask_loss, batch_tokens, monkeypatch):
    monkeypatch.setattr("llmtrain.data.loader.BATCH_TOKENS", batch_tokens)  # 1: make_batch per micro-batch
    blend.eod_mask_loss = eod_mask_loss
    eos = np.asarray([s.eos_id for s in blend.sources], dtype=np.int64)
    it = BatchIterator(blend, 24, 4, dp_rank=1, dp_size=2, consumed_samples=680)  # crosses the mixture change
    expected_tokens = dict.fromkeys(blend.names(), 0)
    for g in range(680):
        d, k = blend.locate(g)
        expected_tokens[blend.names()[d]] += blend.sources[d].sample_tokens(k)
    it.consumed_tokens = dict(expected_tokens)
    for _ in range(5):
        start = it.consumed_samples
        mine = range(start + 12, start + 24)
        batches = it.next_step()
        assert len(batches) == 3
        picked = [blend.sample(g) for g in mine]
        ref = reference_batch(np.stack([w for _, w in picked]), eos[[d for d, _ in picked]], eod_mask_loss)
        for m, batch in enumerate(batches):
            for key, value in batch.items():
                assert value.dtype == torch.int64 and value.shape == (4, SEQ)
                assert value.is_contiguous()
                assert np.array_equal(value.numpy(), ref[key][4 * m : 4 * m + 4]), key
        for g in range(start, start + 24):
            d, k = blend.locate(g)
            expected_tokens[blend.names()[d]] += blend.sources[d].sample_tokens(k)
        assert it.consumed_tokens == expected_tokens
    blend.eod_mask_loss = False


def test_make_batch_closed_form():
    tokens = np.array([[5, 9, 2, 7, 2, 4, -1, -1], [2, 3, 3, 3, 3, 3, 3, 2]])  # eos 2 / 3
    batch = make_batch(tokens, np.array([2, 3]), eod_mask_loss=True)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 1, 0, 0, 0, 0, 0]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2], [0, 0, 1, 2, 3, 4, 5]]
    assert batch["labels"].tolist() == [
        [9, 2, -100, 2, -100, -100, -100],
        [3, -100, -100, -100, -100, -100, -100],
    ]
    assert batch["input_ids"].tolist() == [[5, 9, 2, 7, 2, 4, 2], [2, 3, 3, 3, 3, 3, 3]]
    ref = reference_batch(tokens, np.array([2, 3]), True)
    assert all(np.array_equal(batch[k].numpy(), ref[k]) for k in ref)


def reference_repetition(units: list[str], cfg) -> str | None:
    """The Gopher n-gram rules by counting n-gram tuples (ties of the top n-gram: the longest)."""
    from collections import Counter

    total = sum(map(len, units))
    for n, limit in sorted(cfg.max_top_ngram_chars.items()):
        grams = Counter(tuple(units[i : i + n]) for i in range(len(units) - n + 1))
        most = max(grams.values(), default=0)
        if most > 1 and max(sum(map(len, g)) for g, c in grams.items() if c == most) * most / total > limit:
            return f"top_ngram_{n}"
    for n, limit in sorted(cfg.max_dup_ngram_chars.items()):
        grams = Counter(tuple(units[i : i + n]) for i in range(len(units) - n + 1))
        covered = set()
        for i in range(len(units) - n + 1):
            if grams[tuple(units[i : i + n])] > 1:
                covered.update(range(i, i + n))
        if sum(len(units[j]) for j in covered) / total > limit:
            return f"dup_ngram_{n}"
    return None


def test_repetition_rules_equal_reference():
    import random

    from llmtrain.data.prep.filters import FilterConfig, repetition_reason

    rng, cfg = random.Random(0), FilterConfig()
    vocab = ["the", "a", "of", "cat", "elephant", "ran", "over", "hill", "to", "and", "is", "x"]
    seen = set()
    for _ in range(300):
        base = [rng.choice(vocab) for _ in range(rng.choice([2, 3, 5, 8, 20, 60]))]
        units = base * rng.randint(1, 8) + [rng.choice(vocab) for _ in range(rng.randint(0, 200))]
        if rng.random() < 0.3:
            rng.shuffle(units)
        got = repetition_reason(units, cfg)
        assert got == reference_repetition(units, cfg), units
        seen.add(got)
    assert {None, "top_ngram_2", "dup_ngram_5"} <= seen  # the cases exercise kept and rejected documents
    # a tie between a short and a long 2-gram (3 times each): the longer one decides, whatever the hash order
    units = ["a", "b"] * 3 + ["elephant", "giraffes"] * 3 + [f"w{i}" for i in range(40)]
    assert repetition_reason(units, FilterConfig(max_top_ngram_chars={2: 0.25}, max_dup_ngram_chars={})) == (
        "top_ngram_2"  # 3 * 16 / 164 = 0.29 > 0.25, while "a b" covers 0.04
    )


def test_batched_minhash_equals_per_document():
    from llmtrain.data.prep.dedup import DedupConfig, MinHasher

    mh = MinHasher(DedupConfig())
    texts = TEXTS + ["", "x", "重复的文字" * 50, " ".join(TEXTS) * 3]
    bands, sigs = mh.signatures(texts)
    assert bands.shape == (len(texts), 20) and sigs.shape == (len(texts), 120)
    for i, t in enumerate(texts):
        b, s = mh.signature(t)
        assert np.array_equal(bands[i], b) and np.array_equal(sigs[i], s)

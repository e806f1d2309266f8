"""Loader: blended proportions, per-source token accounting, exact resume with a smaller DP size, mixture
change at a step, multi-shard and bestfit datasets, EOS loss mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtrain.config.schema import Config, DatasetSpec
from llmtrain.data.loader import BatchIterator, build_datasets
from llmtrain.data.prep.prepare import prepare
from llmtrain.data.prep.tokenizer_training import train_bpe
from llmtrain.errors import DataError

TEXTS = [f"Record {i}: the {w} went over the {w} hill and came back {i % 7} times." for i, w in
         enumerate(["fox", "cat", "owl", "elk", "bee"] * 12)]  # fmt: skip


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ds")
    tok = root / "bpe.json"
    train_bpe(iter(TEXTS), 300, str(tok))
    src = root / "a.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    out = {}
    for name, opts in {"a": {}, "b": {"num_shards": 3}, "c": {"num_shards": 2},
                       "best": {"pack": "bestfit", "seq_length": 16}}.items():  # fmt: skip
        prepare([str(src)], str(root / name), tokenizer=str(tok), log=None, options=opts)
        out[name] = str(root / name)
    return out


def config(paths, weights=None, seq=16, **data):
    cfg = Config()
    cfg.model.seq_length, cfg.train.seed, cfg.data.valid_fraction = seq, 3, 0.05
    cfg.data.datasets = [DatasetSpec(p, w) for p, w in zip(paths, weights or [1.0] * len(paths))]
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_blend_proportions_and_accounting(datasets):
    train, _ = build_datasets(config([datasets["a"], datasets["b"], datasets["c"]], [0.5, 0.3, 0.2]))
    it = BatchIterator(train, 10, 10)
    for _ in range(100):  # 1,000 samples
        it.next_step()
    tokens = it.consumed_tokens
    total = sum(tokens.values())
    assert total == 1000 * 16
    for path, w in zip((datasets["a"], datasets["b"], datasets["c"]), (0.5, 0.3, 0.2)):
        assert abs(tokens[path] / total - w) <= 0.01
    assert it.state_dict()["consumed_tokens"] == tokens


def rows(it: BatchIterator, steps: int) -> list:
    out = []
    for _ in range(steps):
        out.append([tuple(r) for mb in it.next_step() for r in mb["input_ids"].tolist()])
    return out


def test_exact_resume_with_smaller_dp(datasets):
    cfg = config([datasets["a"], datasets["b"]], [2, 1])
    train, _ = build_datasets(cfg)
    ranks4 = [BatchIterator(train, 8, 1, r, 4) for r in range(4)]
    uninterrupted = [sum(step, []) for step in zip(*(rows(it, 6) for it in ranks4))]
    first = [BatchIterator(build_datasets(cfg)[0], 8, 1, r, 4) for r in range(4)]
    for it in first:
        rows(it, 3)
    state = first[0].state_dict()
    for dp in (4, 2):  # same and smaller data-parallel size, global batch kept
        resumed = [BatchIterator(build_datasets(cfg)[0], 8, 2, r, dp) for r in range(dp)]
        for it in resumed:
            it.load_state_dict(state)
        after = [sum(step, []) for step in zip(*(rows(it, 3) for it in resumed))]
        assert after == uninterrupted[3:]
        assert resumed[0].consumed_tokens == ranks4[0].consumed_tokens


def test_mixture_change_is_resumable(datasets):
    cfg = config(
        [datasets["a"], datasets["c"]], [1, 1], mixture=[{"start_sample": 400, "weights": [0.9, 0.1]}]
    )
    train, _ = build_datasets(cfg)
    sources = [train.locate(g)[0] for g in range(1400)]
    assert sum(sources[:400]) == 200 and abs(sources[400:].count(1) / 1000 - 0.1) <= 0.01
    assert train.with_weights(400, [0.9, 0.1]).mixture() == train.mixture()
    # no source sample is repeated across the change
    seen = [train.locate(g) for g in range(1400)]
    assert len(set(seen)) == len(seen)
    it = BatchIterator(train, 100, 100)
    for _ in range(5):
        it.next_step()
    state = it.state_dict()
    other = BatchIterator(build_datasets(config([datasets["a"], datasets["c"]], [1, 1]))[0], 100, 100)
    with pytest.raises(DataError, match="fingerprint"):  # the mixture before sample 500 differs
        other.load_state_dict(state)
    other.load_state_dict(state, allow_data_change=True)
    assert other.consumed_samples == 500


def test_bestfit_samples_pad_and_mask(datasets):
    train, _ = build_datasets(config([datasets["best"]]))
    mb = BatchIterator(train, 32, 32).next_step()[0]
    labels = mb["labels"]
    assert (labels == -100).any()  # padding of bins is ignored by the loss
    assert (mb["input_ids"] >= 0).all()
    with pytest.raises(DataError, match="packed"):
        build_datasets(config([datasets["best"]], seq=32))


def test_eod_mask_loss(datasets):
    plain = BatchIterator(build_datasets(config([datasets["a"]]))[0], 16, 16).next_step()[0]
    masked = BatchIterator(
        build_datasets(config([datasets["a"]], eod_mask_loss=True))[0], 16, 16
    ).next_step()[0]
    assert plain["input_ids"].equal(masked["input_ids"])
    eos = masked["input_ids"] == int(
        json.loads(Path(datasets["a"] + ".manifest.json").read_text())["tokenizer"]["eos_id"]
    )
    assert eos.any() and (masked["labels"][eos] == -100).all() and (plain["labels"][eos] != -100).all()

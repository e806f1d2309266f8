"""Loader: windows, shuffles, splits, the blend, resume, DP-independent order, batch tensors, fingerprints."""

from __future__ import annotations

import numpy as np
import pytest

from llmtrain.config.schema import Config, DatasetSpec
from llmtrain.data.indexed import IndexedDataset, IndexedDatasetWriter
from llmtrain.data.loader import (
    BatchIterator,
    BlendedSamples,
    TokenWindows,
    build_datasets,
    make_batch,
    split_documents,
)
from llmtrain.data.manifest import manifest_path, write_json_atomic
from llmtrain.data.samples import BLEND_BLOCK
from llmtrain.data.tokenizer import sha256_file
from llmtrain.errors import DataError

EOS = 0


def make_dataset(
    prefix: str, n_docs: int, base: int, rng_seed: int = 0, tokenizer_sha: str = "t" * 64
) -> list:
    """A dataset of n_docs documents with unique token ids (base + running counter), each ending in EOS."""
    rng = np.random.default_rng(rng_seed)
    docs, next_id = [], base
    for _ in range(n_docs):
        n = int(rng.integers(1, 12))
        docs.append(list(range(next_id, next_id + n)) + [EOS])
        next_id += n
    w = IndexedDatasetWriter(prefix, np.dtype("int32"))
    for d in docs:
        w.add_document(d)
    w.finalize()
    files = {
        k: {
            "name": f"x.{k}",
            "bytes": len(open(f"{prefix}.{k}", "rb").read()),
            "sha256": sha256_file(f"{prefix}.{k}"),
        }
        for k in ("bin", "idx")
    }
    write_json_atomic(
        manifest_path(prefix),
        {"format": "llmtrain.tokens", "version": 1, "dtype": "int32", "documents": n_docs,
         "tokens": sum(map(len, docs)), "files": files, "inputs": [], "created_by": "test",
         "tokenizer": {"file": "x.tokenizer.json", "kind": "hf", "sha256": tokenizer_sha, "vocab_size": 10**6,
                       "eos_id": EOS, "bos_id": None}},
    )  # fmt: skip
    return docs


def config(
    prefixes: list[str], weights: list[float] | None = None, seq: int = 8, seed: int = 1, vf: float = 0.1
):
    cfg = Config()
    cfg.model.seq_length, cfg.train.seed, cfg.data.valid_fraction = seq, seed, vf
    cfg.data.datasets = [DatasetSpec(p, w) for p, w in zip(prefixes, weights or [1.0] * len(prefixes))]
    return cfg


@pytest.fixture
def two(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    make_dataset(a, 120, base=1000)
    make_dataset(b, 80, base=100000, rng_seed=1)
    return a, b


def test_windows_cover_the_stream(tmp_path):
    prefix = str(tmp_path / "a")
    docs = make_dataset(prefix, 50, base=1)
    ds = IndexedDataset(prefix)
    total = sum(map(len, docs))
    tw = TokenWindows(ds, np.arange(len(ds)), seq_length=7, seed=3)
    assert len(tw) == (total - 1) // 7
    for epoch in (0, 1):
        wins = [tw.window(i, epoch) for i in range(len(tw))]
        assert all(w.shape == (8,) and w.dtype == np.int64 for w in wins)
        assert all(wins[i][-1] == wins[i + 1][0] for i in range(len(wins) - 1))
        stream = np.concatenate([wins[0]] + [w[1:] for w in wins[1:]])
        assert len(stream) == len(tw) * 7 + 1
        # documents appear whole and in one piece: every non-EOS id is followed by its successor or an EOS
        body = stream[:-1]
        nxt = stream[1:]
        ok = (body == EOS) | (nxt == body + 1) | (nxt == EOS)
        assert ok.all()
        assert len(set(stream[stream != EOS].tolist())) == int((stream != EOS).sum())  # no token twice
        assert total - len(stream) < 7
    # epochs reshuffle the document order, so the streams differ
    assert any(not np.array_equal(tw.window(i, 0), tw.window(i, 1)) for i in range(len(tw)))


def test_shuffle_deterministic_by_seed(tmp_path):
    prefix = str(tmp_path / "a")
    make_dataset(prefix, 60, base=1)
    ds = IndexedDataset(prefix)
    docs = np.arange(len(ds))

    def order(seed: int) -> list[tuple]:
        tw = TokenWindows(ds, docs, 5, seed)
        return [tuple(tw.sample(k)) for k in range(2 * len(tw))]

    a, b, c = order(7), order(7), order(8)
    assert a == b
    assert a != c
    n = len(TokenWindows(ds, docs, 5, 7))
    epoch0 = TokenWindows(ds, docs, 5, 7)
    assert set(a[:n]) == {tuple(epoch0.window(i, 0)) for i in range(n)}  # epoch 0 is a permutation of windows
    assert a[:n] != [tuple(epoch0.window(i, 0)) for i in range(n)]  # ... a shuffled one
    assert set(a[n:]) == {tuple(epoch0.window(i, 1)) for i in range(n)}  # then epoch 1


def test_split_disjoint_whole_documents(two):
    a, _ = two
    ds = IndexedDataset(a)
    train, valid = split_documents(ds, 0.1, seq_length=8)
    assert len(valid) == 12 and len(train) == 108
    assert set(train.tolist()).isdisjoint(valid.tolist())
    assert sorted(train.tolist() + valid.tolist()) == list(range(120))
    train_1 = build_datasets(config([a], seed=1))[0].sources[0].documents
    train_s, valid_s = build_datasets(config([a], seed=99))
    assert np.array_equal(train_1, train_s.sources[0].documents)  # split does not depend on train.seed
    assert set(train_s.sources[0].documents.tolist()).isdisjoint(valid_s.sources[0].documents.tolist())
    # a tiny fraction still yields enough validation documents for one window
    _, v = split_documents(ds, 0.001, seq_length=40)
    assert int(ds.sizes[v].sum()) >= 41
    assert split_documents(ds, 0.0, 8)[1].size == 0


def test_blend_tracks_weights(two, tmp_path):
    c = str(tmp_path / "c")
    make_dataset(c, 60, base=500000, rng_seed=2)
    train, _ = build_datasets(config([*two, c], weights=[5, 3, 2]))
    counts = np.zeros(3)
    worst = 0.0
    for g in range(1000):
        source, window = train.sample(g)
        assert window.shape == (9,)
        counts[source] += 1
        worst = max(worst, float(np.abs(counts - np.array([0.5, 0.3, 0.2]) * (g + 1)).max()))
    assert np.allclose(counts / 1000, [0.5, 0.3, 0.2], atol=0.01)
    assert worst < 2.0  # tracks the weights at every step, not just on average
    # the same rule as Megatron's build_blending_indices, written out independently
    w, cur = [0.5, 0.3, 0.2], [0, 0, 0]
    for g in range(300):
        errs = [w[d] * max(g, 1) - cur[d] for d in range(3)]
        d = int(np.argmax(errs))
        assert train.locate(g) == (d, cur[d])
        cur[d] += 1
    # lazily computed blocks agree with a fresh instance jumping straight past a block boundary
    fresh, _ = build_datasets(config([*two, c], weights=[5, 3, 2]))
    g = BLEND_BLOCK + 17
    assert fresh.locate(g) == train.locate(g)
    # the blend never ends: sources wrap into new epochs
    s, win = train.sample(10 * len(train))
    assert win.shape == (9,)


def test_resume_matches_uninterrupted(two):
    train, _ = build_datasets(config(list(two), weights=[2, 1]))
    full = BatchIterator(train, global_batch_size=8, micro_batch_size=2)
    steps = [full.next_step() for _ in range(5)]
    part = BatchIterator(train, global_batch_size=8, micro_batch_size=2)
    for _ in range(3):
        part.next_step()
    state = part.state_dict()
    assert state["consumed_samples"] == 24
    fresh_train, _ = build_datasets(config(list(two), weights=[2, 1]))
    resumed = BatchIterator(fresh_train, global_batch_size=8, micro_batch_size=2)
    resumed.load_state_dict(state)
    for want in steps[3:]:
        got = resumed.next_step()
        assert len(got) == len(want) == 4
        for g, w in zip(got, want):
            for key in ("input_ids", "labels", "position_ids", "document_ids"):
                assert g[key].equal(w[key])


def test_dp_sizes_share_the_global_order(two):
    train, _ = build_datasets(config(list(two)))

    def step_rows(dp_size: int, steps: int = 3) -> list[list[tuple]]:
        its = [BatchIterator(train, 8, 1, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
        out = []
        for _ in range(steps):
            rows = []
            for it in its:  # rank order = contiguous slices of the global batch
                for mb in it.next_step():
                    rows += [tuple(r) for r in mb["input_ids"].tolist()]
            out.append(rows)
        return out

    one, two_, four = step_rows(1), step_rows(2), step_rows(4)
    assert one == two_ == four
    assert all(len(set(r)) == 8 for r in one)
    it = BatchIterator(train, 8, 2, dp_rank=1, dp_size=2, consumed_samples=16)
    assert list(it.rank_indices()) == [20, 21, 22, 23]
    assert [b["input_ids"].shape for b in it.next_step()] == [(2, 8), (2, 8)]


def test_batch_positions_and_documents():
    tokens = np.array([[5, 6, EOS, 7, 8, EOS, 9, 4, 3], [EOS, 1, 2, 3, 4, 5, 6, 7, EOS]])
    b = make_batch(tokens, np.array([EOS, EOS]))
    assert b["input_ids"].tolist() == [[5, 6, 0, 7, 8, 0, 9, 4], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert b["labels"].tolist() == [[6, 0, 7, 8, 0, 9, 4, 3], [1, 2, 3, 4, 5, 6, 7, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert b["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert all(t.dtype.is_floating_point is False and t.dtype.itemsize == 8 for t in b.values())
    no_eos = make_batch(tokens, np.array([-1, -1]))
    assert no_eos["position_ids"][0].tolist() == list(range(8))


def test_fingerprint_mismatch_raises(two):
    a, b = two
    base = BatchIterator(build_datasets(config([a, b], weights=[1, 1]))[0], 4, 1)
    base.next_step()
    state = base.state_dict()
    for other in (config([a, b], weights=[1, 2]), config([a, b], seed=2), config([a, b], seq=16),
                  config([a, b], vf=0.2), config([a])):  # fmt: skip
        it = BatchIterator(build_datasets(other)[0], 4, 1)
        with pytest.raises(DataError, match="fingerprint"):
            it.load_state_dict(state)
    same = BatchIterator(build_datasets(config([a, b], weights=[2, 2]))[0], 4, 1)  # same normalised weights
    same.load_state_dict(state)
    assert same.consumed_samples == 4


def test_build_errors(tmp_path, two):
    a, _ = two
    with pytest.raises(DataError, match=r"data.datasets\[1\].path = '.*nowhere'"):
        build_datasets(config([a, str(tmp_path / "nowhere")]))
    d = str(tmp_path / "d")
    make_dataset(d, 10, base=1, tokenizer_sha="u" * 64)
    with pytest.raises(DataError, match="another tokenizer"):
        build_datasets(config([a, d]))
    with pytest.raises(DataError, match="fewer than model.seq_length"):
        build_datasets(config([d], seq=1000))
    with open(f"{d}.bin", "ab") as f:
        f.write(b"\x00\x00\x00\x00")
    with pytest.raises(DataError, match="do not match the manifest"):
        build_datasets(config([d]))
    assert isinstance(build_datasets(config([a]))[1], BlendedSamples)

"""From ``cfg.data`` to this rank's micro-batches: dataset splits, the blend, and the stateful batch iterator.

:func:`build_datasets` opens every ``data.datasets`` prefix (memory-mapped ``.bin/.idx``, described by its
manifest or, for a plain Megatron dataset, by its ``.idx`` header and ``data.tokenizer``: ``describe``),
verifies the files (sha256 against the manifest, token ids against the vocabulary: ``verify``), checks that all
datasets share one tokenizer, splits each dataset's
*documents* into train and validation (a fixed pseudo-random choice that does not depend on ``train.seed``, so
validation losses stay comparable across seeds; no document is in both), and returns two
:class:`~llmtrain.data.samples.BlendedSamples`.

:class:`BatchIterator` turns the global sample order into batches. The order never depends on the data-parallel
layout: step ``s`` covers global samples ``[s*GB, (s+1)*GB)``; rank ``r`` of ``D`` takes the contiguous slice
``[r*GB/D, (r+1)*GB/D)`` of them, cut into micro-batches. Its whole state is ``consumed_samples`` plus a
fingerprint of the data (manifests, seq_length, seed, weights, valid_fraction), so a run resumes exactly, even
with another DP size, and refuses to resume on different data.

A batch is a dict of int64 tensors, each ``[B, T]``: ``input_ids``, ``labels`` (inputs shifted by one),
``position_ids`` (restart at 0 after each EOS) and ``document_ids`` (increment after each EOS), the last two
for document-masked attention. Padding of ``bestfit`` bins has label ``-100`` (ignored by the loss); with
``data.eod_mask_loss`` the label after each EOS (predicting a new document from nothing) is ``-100`` too.

Datasets may be multi-shard (``PREFIX.manifest.json`` listing ``PREFIX_00000.bin`` ...) and ``bestfit``-packed
(the manifest's ``packing``; its ``seq_length`` must equal ``model.seq_length``). Concat datasets are windowed
over whole documents: a Megatron document split into several sequences (``--split-sentences``) is one unit
(``IndexedDataset.document_view``), its sentences in order (Megatron's own GPTDataset shuffles sequences). ``data.mixture`` (a list of
``{start_sample, weights}``) changes the blend at given samples (see ``samples``). The iterator also counts, per
dataset path, the input tokens consumed by all ranks (``consumed_tokens``); that count is in its state.

Speed: ``next_step`` does no per-sample Python: one blend lookup and one gather for the rank's samples of the
step, ``make_batch`` over groups of ~``BATCH_TOKENS`` tokens (position and document ids by a running max and a
cumulative sum over the group), and one vectorised token count per source for the accounting.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from llmtrain.config.schema import Config
from llmtrain.data.describe import DatasetInfo, describe_dataset
from llmtrain.data.indexed import IndexedDataset, bin_path
from llmtrain.data.samples import BinSamples, BlendedSamples, TokenWindows
from llmtrain.data.verify import verify_dataset
from llmtrain.errors import ConfigError, DataError

__all__ = [
    "BatchIterator",
    "BinSamples",
    "BlendedSamples",
    "TokenWindows",
    "build_datasets",
    "make_batch",
    "split_documents",
]

SPLIT_SEED = 0x5EED  # the train/valid split is fixed per dataset, independent of train.seed
BATCH_TOKENS = 1 << 15  # tokens per make_batch call (cache-sized; micro-batches are cut from it)


def split_documents(
    dataset: IndexedDataset, valid_fraction: float, seq_length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted sequence ids of the (train, valid) documents.

    ``ceil(valid_fraction * documents)`` documents go to validation, chosen by a fixed permutation; when those
    hold fewer than ``seq_length + 1`` tokens, more are added (if training keeps enough) so validation has at
    least one window. A multi-sequence Megatron document contributes all its sequences to the same side.
    """
    doc_index = dataset.document_indices  # [C] = 0, end of doc 0, end of doc 1, ...
    n_docs = dataset.num_documents
    cum = np.concatenate([[0], np.cumsum(dataset.sizes, dtype=np.int64)])
    doc_tokens = cum[doc_index[1:]] - cum[doc_index[:-1]]  # [n_docs]
    perm = np.random.default_rng(SPLIT_SEED).permutation(n_docs)
    n_valid = min(math.ceil(valid_fraction * n_docs), n_docs - 1) if valid_fraction > 0 else 0
    if n_valid > 0:
        cum_valid = np.cumsum(doc_tokens[perm])
        need = int(np.searchsorted(cum_valid, seq_length + 1, side="left")) + 1
        if need < n_docs and cum_valid[-1] - cum_valid[need - 1] >= seq_length + 1:
            n_valid = max(n_valid, need)
    is_valid = np.zeros(n_docs, dtype=bool)
    is_valid[perm[:n_valid]] = True
    return _sequences(doc_index, ~is_valid), _sequences(doc_index, is_valid)


def _sequences(doc_index: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """Sequence ids of the chosen documents, in order."""
    starts, ends = doc_index[:-1][chosen], doc_index[1:][chosen]
    if np.all(ends - starts == 1):
        return starts.astype(np.int64)
    return np.concatenate(
        [np.arange(s, e, dtype=np.int64) for s, e in zip(starts, ends)] or [np.zeros(0, np.int64)]
    )


def split_shards(
    shards: list[IndexedDataset], valid_fraction: float, seq_length: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(shard, sequence)`` pairs [D, 2] of the (train, valid) documents of a multi-shard dataset.

    The split is per shard (each shard's documents split as by :func:`split_documents`), so it is fixed by the
    data alone and a document is never on both sides."""
    train, valid = [], []
    for i, ds in enumerate(shards):
        t, v = split_documents(ds, valid_fraction, seq_length)
        train.append(np.stack([np.full_like(t, i), t], axis=1))
        valid.append(np.stack([np.full_like(v, i), v], axis=1))
    return np.concatenate(train), np.concatenate(valid)


def _open(
    prefix: str, where: str, tokenizer: str | None = None, vocab_size: int | None = None
) -> tuple[list[IndexedDataset], DatasetInfo, dict[str, str]]:
    """Shards, description and verified checksums of ``prefix`` (named ``where`` in the config; ``tokenizer``:
    ``data.tokenizer``, ``vocab_size``: ``model.vocab_size``), the files checked against the manifest."""
    info = describe_dataset(prefix, tokenizer, where)
    manifest = info.manifest
    shards = []
    for shard_prefix, entry in info.shards:
        dataset = IndexedDataset(shard_prefix)
        if manifest is not None and entry is not None:
            expected = entry["files"]["bin"]["bytes"]
            actual = bin_path(shard_prefix).stat().st_size
            if actual != expected or dataset.dtype.name != manifest["dtype"]:
                raise DataError(
                    f"{where} = '{prefix}': the files of shard '{shard_prefix}' do not match the manifest ({actual} "
                    f"bytes of {dataset.dtype.name} tokens on disk, the manifest says {expected} bytes of "
                    f"{manifest['dtype']}). The files were changed or copied incompletely; run prepare again."
                )
        shards.append(dataset)
    on_disk = sum(d.num_tokens for d in shards)
    if manifest is not None and on_disk != manifest["tokens"]:
        raise DataError(
            f"{where} = '{prefix}': the .bin/.idx files do not match the manifest ({on_disk} tokens on disk, the "
            f"manifest says {manifest['tokens']}). The files were changed or copied incompletely; run prepare again."
        )
    checksums = verify_dataset(info, where, vocab_size)
    return shards, info, checksums


def build_datasets(cfg: Config) -> tuple[BlendedSamples, BlendedSamples]:
    """(train, valid) blends from ``cfg.data.datasets``, ``cfg.model.seq_length``, ``cfg.train.seed`` and
    ``cfg.data.valid_fraction``. Valid sources too small for one window are left out of the valid blend."""
    specs = cfg.data.datasets
    if not specs:
        raise ConfigError(
            "data.datasets is empty: list at least one {path: PREFIX, weight: W} made by prepare."
        )
    seq_length, seed = int(cfg.model.seq_length), int(cfg.train.seed)
    valid_fraction = float(cfg.data.valid_fraction)
    if not 0.0 <= valid_fraction < 1.0:
        raise ConfigError(f"data.valid_fraction = {valid_fraction}: it must be in [0, 1).")
    train, valid, weights, valid_weights = [], [], [], []
    tokenizer_sha: str | None = None
    for i, spec in enumerate(specs):
        prefix = spec["path"] if isinstance(spec, dict) else spec.path
        weight = float(spec.get("weight", 1.0) if isinstance(spec, dict) else spec.weight)
        where = f"data.datasets[{i}].path"
        if not weight > 0:
            raise ConfigError(f"data.datasets[{i}].weight = {weight}: blend weights must be positive.")
        source, held_out, sha = open_source(
            str(prefix), where, seq_length, seed, valid_fraction, cfg.data.tokenizer, cfg.model.vocab_size
        )
        if tokenizer_sha is not None and sha != tokenizer_sha:
            raise DataError(
                f"{where} = '{prefix}' was tokenized with another tokenizer than data.datasets[0] (sha256 "
                f"{str(sha)[:12]} vs {str(tokenizer_sha)[:12]}); blended datasets must share one tokenizer."
            )
        tokenizer_sha = sha
        train.append(source)
        weights.append(weight)
        if len(held_out) > 0:
            valid.append(held_out)
            valid_weights.append(weight)
    meta = {"valid_fraction": valid_fraction, "seq_length": seq_length}
    schedule = parse_mixture(getattr(cfg.data, "mixture", None), len(train))
    train_blend = BlendedSamples(train, weights, seed, meta={**meta, "split": "train"}, schedule=schedule)
    valid_blend = BlendedSamples(valid, valid_weights, seed, meta={**meta, "split": "valid"})
    for blend in (train_blend, valid_blend):
        blend.eod_mask_loss = bool(getattr(cfg.data, "eod_mask_loss", False))
    return train_blend, valid_blend


def open_source(
    prefix: str,
    where: str,
    seq_length: int,
    seed: int,
    valid_fraction: float,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
) -> tuple[TokenWindows, TokenWindows, str | None]:
    """(train samples, held-out samples, tokenizer sha256) of the dataset at ``prefix`` (``where`` names it in
    the config; ``tokenizer``: ``data.tokenizer``, needed by a dataset without a manifest; ``vocab_size``:
    ``model.vocab_size``); DataError when it has not one training sample of ``seq_length``."""
    shards, info, checksums = _open(prefix, where, tokenizer, vocab_size)
    packing = info.packing
    kind = TokenWindows
    if packing["mode"] == "bestfit":
        kind = BinSamples
        if int(packing["seq_length"]) != seq_length:
            raise DataError(
                f"{where} = '{prefix}' was packed (bestfit) for seq_length {packing['seq_length']}, but "
                f"model.seq_length is {seq_length}; run prepare again with --seq-length {seq_length}."
            )
    else:  # windows over whole documents (a sentence-split Megatron document is one unit)
        shards = [ds.document_view() for ds in shards]
    eos_id = info.eos_id
    train_ids, valid_ids = split_shards(shards, valid_fraction, seq_length)
    identity = info.identity(checksums)
    source = kind(shards, train_ids, seq_length, seed, eos_id=eos_id, identity=identity, name=prefix)
    if len(source) == 0:
        raise DataError(
            f"{where} = '{prefix}' has {source.num_tokens} training tokens, fewer than model.seq_length + 1 "
            f"= {seq_length + 1}: not one sample. Add data or lower model.seq_length."
        )
    held_out = kind(shards, valid_ids, seq_length, seed, eos_id=eos_id, identity=identity, name=prefix)
    return source, held_out, info.tokenizer_sha256


def parse_mixture(entries: Any, n: int) -> list[tuple[int, list[float]]]:
    """``data.mixture`` -> [(start_sample, weights)]; ConfigError naming the bad entry (``check`` calls it too)."""
    schedule = []
    for i, e in enumerate(entries or []):
        get = e.get if isinstance(e, dict) else lambda k, d=None, e=e: getattr(e, k, d)
        start, w = get("start_sample"), get("weights")
        if not isinstance(start, int) or start < 1 or not isinstance(w, list | tuple) or len(w) != n:
            raise ConfigError(
                f"data.mixture[{i}] = {e!r}: expected {{start_sample: N >= 1, weights: [{n} non-negative "
                f"numbers, one per data.datasets entry]}}."
            )
        numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in w)
        if not numbers or any(not float(x) >= 0 for x in w) or not sum(map(float, w)) > 0:
            raise ConfigError(f"data.mixture[{i}].weights = {list(w)}: non-negative with a positive sum.")
        schedule.append((start, [float(x) for x in w]))
    return schedule


def make_batch(
    tokens: np.ndarray, eos_ids: np.ndarray, eod_mask_loss: bool = False
) -> dict[str, torch.Tensor]:
    """Batch tensors from windows ``tokens`` [B, T+1] (-1: padding) and each row's EOS id ``eos_ids`` [B]
    (-1: none). Padding and, with ``eod_mask_loss``, the targets right after an EOS get label -100."""
    pad = tokens < 0  # [B, T+1]
    if pad.any():
        tokens = np.where(pad, np.maximum(eos_ids, 0)[:, None], tokens)
    inputs, labels = np.ascontiguousarray(tokens[:, :-1]), tokens[:, 1:].copy()  # [B, T]
    labels[pad[:, 1:]] = -100
    is_eos = inputs == eos_ids[:, None]  # [B, T]
    if eod_mask_loss:
        labels[is_eos] = -100
    b, t = is_eos.shape
    document_ids = np.cumsum(is_eos, axis=1, dtype=np.int64)  # [B, T]
    document_ids -= is_eos  # EOS belongs to the document it ends
    # position = index - index of the document's first token: one running max over the flattened batch of
    # the document starts (every row start is one), in place
    flat = np.arange(b * t, dtype=np.int64).reshape(b, t)  # [B, T]
    first = np.empty((b, t), dtype=np.int64)
    first[:, 0] = flat[:, 0]
    np.multiply(flat[:, 1:], is_eos[:, :-1], out=first[:, 1:])
    np.maximum.accumulate(first.reshape(-1), out=first.reshape(-1))
    position_ids = np.subtract(flat, first, out=first)
    return {
        "input_ids": torch.from_numpy(inputs),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "document_ids": torch.from_numpy(document_ids),
    }


class BatchIterator:
    """This rank's micro-batches, step by step, from a global sample order shared by all ranks."""

    def __init__(
        self,
        samples: BlendedSamples,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
    ):
        if global_batch_size % dp_size:
            raise ConfigError(
                f"train.batch_size = {global_batch_size} is not divisible by the data-parallel size "
                f"{dp_size}; use a multiple of it."
            )
        per_rank = global_batch_size // dp_size
        if micro_batch_size < 1 or per_rank % micro_batch_size:
            raise ConfigError(
                f"train.micro_batch_size = {micro_batch_size} does not divide the {per_rank} samples "
                f"per rank and step (train.batch_size {global_batch_size} / data parallel {dp_size})."
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        self.samples = samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = int(consumed_samples)
        self.consumed_tokens: dict[str, int] = dict.fromkeys(samples.names(), 0)
        self._eod_mask_loss = bool(getattr(samples, "eod_mask_loss", False))
        self._eos = np.asarray(
            [-1 if s.eos_id is None else s.eos_id for s in samples.sources], dtype=np.int64
        )

    def rank_indices(self) -> range:
        """Global sample indices this rank reads at the next step."""
        per_rank = self.global_batch_size // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        return range(start, start + per_rank)

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next global step; advances ``consumed_samples`` by the global batch."""
        indices = self.rank_indices()
        source, tokens = self.samples.samples(np.arange(indices.start, indices.stop))  # [N], [N, T+1]
        eos, mb = self._eos[source], self.micro_batch_size  # [N]
        # make_batch over groups of micro-batches of ~BATCH_TOKENS tokens: few numpy calls, arrays in cache
        group = mb * max(1, BATCH_TOKENS // (mb * tokens.shape[1]))
        batches = []
        for g in range(0, len(indices), group):
            made = make_batch(tokens[g : g + group], eos[g : g + group], self._eod_mask_loss)
            for m in range(0, len(made["input_ids"]), mb):  # contiguous row slices
                batches.append({k: v[m : m + mb] for k, v in made.items()})
        self._account(range(self.consumed_samples, self.consumed_samples + self.global_batch_size))
        self.consumed_samples += self.global_batch_size
        return batches

    def _account(self, indices: range, chunk: int = 1 << 20) -> None:
        """Add the input tokens of global samples ``indices`` (all ranks) to ``consumed_tokens``."""
        names, sources = self.samples.names(), self.samples.sources
        for lo in range(indices.start, indices.stop, chunk):
            source, k = self.samples.locate_many(np.arange(lo, min(lo + chunk, indices.stop)))
            for d in np.unique(source):
                self.consumed_tokens[names[d]] += int(sources[d].samples_tokens(k[source == d]).sum())

    def state_dict(self) -> dict:
        return {
            "consumed_samples": self.consumed_samples,
            "fingerprint": self.samples.fingerprint,
            "mixture": self.samples.mixture(self.consumed_samples),
            "consumed_tokens": dict(self.consumed_tokens),
        }

    def load_state_dict(self, sd: dict, allow_data_change: bool = False) -> None:
        """Resume from ``sd``; DataError if it was saved for other data, or another mixture before its position
        (``allow_data_change`` skips both checks: the run continues at the same sample count on new data)."""
        consumed = int(sd["consumed_samples"])
        mixture = sd.get("mixture")
        same_mixture = mixture is None or mixture == self.samples.mixture(consumed)
        if not allow_data_change and (sd.get("fingerprint") != self.samples.fingerprint or not same_mixture):
            raise DataError(
                f"The checkpoint's data state was saved for other data (fingerprint {sd.get('fingerprint')!r}, "
                f"mixture {mixture}; this run's are {self.samples.fingerprint!r}, "
                f"{self.samples.mixture(consumed)}): the datasets, their weights or mixture before sample "
                f"{consumed}, model.seq_length, train.seed or data.valid_fraction changed. Restore them, or start "
                f"without resuming the data state."
            )
        self.consumed_samples = consumed
        saved = sd.get("consumed_tokens")
        if saved is not None and set(saved) == set(self.consumed_tokens):
            self.consumed_tokens = {k: int(v) for k, v in saved.items()}
        else:  # an older state, or data changed on purpose: recount from the sample positions
            self.consumed_tokens = dict.fromkeys(self.samples.names(), 0)
            self._account(range(consumed))

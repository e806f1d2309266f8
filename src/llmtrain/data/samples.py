"""The sample index: token windows over one dataset split, and a weighted blend of several.

:class:`TokenWindows` follows Megatron's ``GPTDataset``: the chosen documents are concatenated (in an order
shuffled per epoch) into one token stream, cut into windows of ``seq_length + 1`` tokens that start every
``seq_length`` tokens, so consecutive windows share one token and every token is predicted exactly once per
epoch (``labels`` are the window shifted by one). The window order is shuffled again per epoch. Everything is a
pure function of ``(seed, epoch, index)``: there is no iterator state to save, only a sample count.

:class:`BlendedSamples` interleaves sources with Megatron's largest-error rule (``build_blending_indices`` in
megatron/core/datasets/helpers.cpp): global sample ``g`` goes to the source whose count lags its weight the most,
``argmax_d(w_d * max(g, 1) - count_d)``, so the consumed proportions track the weights at every step. The blend is
infinite; a source that runs out of windows continues in its next epoch (new document and window order). The
blend is computed lazily in blocks and cached on the instance, so random access to sample ``g`` costs the blocks
up to ``g`` once (about a microsecond per sample and source).

Window reads are vectorised over the memory map: a window inside one document is a slice; a window spanning
documents is one fancy-index gather built with ``np.repeat``, no per-token Python.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from llmtrain.data.indexed import IndexedDataset
from llmtrain.data.manifest import fingerprint_fields, manifest_path, read_manifest
from llmtrain.errors import DataError

BLEND_BLOCK = 1 << 14  # samples per lazily computed block of the blend


def digest(obj: object) -> str:
    """Short stable hash of a JSON-serialisable object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class _EpochLayout:
    """One epoch of a TokenWindows: the document order and the window order."""

    bin_start: np.ndarray  # [D] token offset in .bin of the epoch's j-th document
    stream_start: np.ndarray  # [D] its first token's position in the epoch's stream
    stream_end: np.ndarray  # [D] one past its last token in the stream
    window_order: np.ndarray  # [W] shuffled window indices


class TokenWindows:
    """``seq_length + 1``-token windows over the documents (sequence ids) of one dataset split."""

    def __init__(
        self,
        dataset: IndexedDataset,
        documents: np.ndarray,
        seq_length: int,
        seed: int,
        eos_id: int | None = None,
    ):
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.dataset = dataset
        self.documents = np.asarray(documents, dtype=np.int64)  # [D] sequence ids
        self.seq_length = int(seq_length)
        self.seed = int(seed) % 2**63  # SeedSequence takes non-negative entropy
        self._lengths = dataset.sizes[self.documents].astype(np.int64)  # [D]
        self._bin_start = dataset.pointers[self.documents] // dataset.dtype.itemsize  # [D] token offsets
        self.num_tokens = int(self._lengths.sum())
        self._num_windows = max((self.num_tokens - 1) // self.seq_length, 0)
        identity = {"sequences": len(dataset), "tokens": dataset.num_tokens}
        self.eos_id = eos_id
        if manifest_path(dataset.prefix).is_file():
            manifest = read_manifest(dataset.prefix)
            identity = fingerprint_fields(manifest)
            if self.eos_id is None:
                self.eos_id = manifest["tokenizer"].get("eos_id")
        self.fingerprint = digest(
            {
                "dataset": identity,
                "split_documents": len(self.documents),
                "split_tokens": self.num_tokens,
                "seq_length": self.seq_length,
                "seed": self.seed,
            }
        )
        self._cache: tuple[int, _EpochLayout] | None = None

    def __len__(self) -> int:
        return self._num_windows

    def _layout(self, epoch: int) -> _EpochLayout:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        doc_rng = np.random.default_rng([self.seed, epoch, 0])
        win_rng = np.random.default_rng([self.seed, epoch, 1])
        order = doc_rng.permutation(len(self.documents))  # [D]
        lengths = self._lengths[order]
        stream_end = np.cumsum(lengths)
        index_dtype = np.int32 if self._num_windows < 2**31 else np.int64
        layout = _EpochLayout(
            bin_start=self._bin_start[order],
            stream_start=stream_end - lengths,
            stream_end=stream_end,
            window_order=win_rng.permutation(self._num_windows).astype(index_dtype),
        )
        self._cache = (epoch, layout)
        return layout

    def window(self, i: int, epoch: int = 0) -> np.ndarray:
        """Window ``i`` in stream order of ``epoch``: int64 tokens ``[i*T, i*T + T]`` of the stream, [T+1]."""
        if not 0 <= i < self._num_windows:
            raise IndexError(f"window {i} out of range [0, {self._num_windows})")
        lay = self._layout(epoch)
        first = i * self.seq_length
        last = first + self.seq_length  # inclusive
        j0 = int(np.searchsorted(lay.stream_end, first, side="right"))
        j1 = int(np.searchsorted(lay.stream_end, last, side="right"))
        tokens = self.dataset.tokens
        if j0 == j1:  # inside one document: a slice of the memory map
            start = int(lay.bin_start[j0] + first - lay.stream_start[j0])
            return tokens[start : start + self.seq_length + 1].astype(np.int64)
        docs = slice(j0, j1 + 1)
        piece_len = np.minimum(lay.stream_end[docs], last + 1) - np.maximum(lay.stream_start[docs], first)
        shift = np.repeat(lay.bin_start[docs] - lay.stream_start[docs], piece_len)  # [T+1]
        return tokens[np.arange(first, last + 1) + shift].astype(np.int64)

    def sample(self, k: int) -> np.ndarray:
        """The ``k``-th sample of the infinite shuffled sequence (epoch ``k // len``), [T+1] int64."""
        if self._num_windows == 0:
            raise DataError(
                f"Dataset '{self.dataset.prefix}' has fewer than seq_length + 1 = "
                f"{self.seq_length + 1} tokens in this split; it cannot make a single sample."
            )
        epoch, j = divmod(int(k), self._num_windows)
        return self.window(int(self._layout(epoch).window_order[j]), epoch)


class BlendedSamples:
    """Infinite weighted blend of :class:`TokenWindows`; ``sample(g) -> (source index, tokens [T+1])``."""

    def __init__(
        self, sources: list[TokenWindows], weights: list[float], seed: int, meta: dict | None = None
    ):
        if len(sources) != len(weights):
            raise ValueError(f"{len(sources)} sources but {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise ValueError(f"blend weights must be positive, got {weights}")
        total = float(sum(weights))
        self.sources = list(sources)
        self.weights = [float(w) / total for w in weights]
        self.seed = int(seed)
        self.fingerprint = digest(
            {
                "sources": [s.fingerprint for s in self.sources],
                "weights": self.weights,
                "seed": self.seed,
                "meta": meta or {},
            }
        )
        self._blocks: list[tuple[np.ndarray, np.ndarray]] = []  # per block: source [B], source sample [B]
        self._counts = [0] * len(self.sources)  # samples given to each source before the next block

    def __len__(self) -> int:
        """Samples in one nominal pass (every source's windows once); ``sample`` goes on past it."""
        return sum(len(s) for s in self.sources)

    def locate(self, g: int) -> tuple[int, int]:
        """(source index, index into that source's infinite sample sequence) of global sample ``g``."""
        if not self.sources:
            raise DataError("This blend has no data (for example valid_fraction 0 or too few documents).")
        if g < 0:
            raise IndexError(f"sample index must be non-negative, got {g}")
        if len(self.sources) == 1:
            return 0, int(g)
        block, offset = divmod(int(g), BLEND_BLOCK)
        while len(self._blocks) <= block:
            self._blocks.append(self._next_block())
        source, index = self._blocks[block]
        return int(source[offset]), int(index[offset])

    def _next_block(self) -> tuple[np.ndarray, np.ndarray]:
        """The next BLEND_BLOCK decisions of the largest-error rule, continuing the running counts."""
        weights, counts, n = self.weights, self._counts, len(self.weights)
        first = len(self._blocks) * BLEND_BLOCK
        chosen, taken = [0] * BLEND_BLOCK, [0] * BLEND_BLOCK
        for t in range(BLEND_BLOCK):
            x = float(max(first + t, 1))
            best, best_err = 0, weights[0] * x - counts[0]
            for d in range(1, n):
                err = weights[d] * x - counts[d]
                if err > best_err:
                    best, best_err = d, err
            chosen[t], taken[t] = best, counts[best]
            counts[best] += 1
        return np.asarray(chosen, dtype=np.int32), np.asarray(taken, dtype=np.int64)

    def sample(self, g: int) -> tuple[int, np.ndarray]:
        """Global sample ``g``: (source index, int64 tokens [T+1])."""
        source, k = self.locate(g)
        return source, self.sources[source].sample(k)

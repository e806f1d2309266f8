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

A dataset may be several shards (``PREFIX_00000.bin`` ...): a TokenWindows then takes a list of memory maps
and its documents are ``(shard, sequence)`` pairs; a window that crosses shards is gathered piece by piece.
:class:`BinSamples` serves ``bestfit``-packed datasets: a sample is one stored bin, padded to ``seq_length + 1``
with ``-1`` (the loader turns that into ignored labels), shuffled per epoch like the windows.

The mixture can change at given samples: ``BlendedSamples(..., schedule=[(start, weights), ...])`` or
``blend.with_weights(start, weights)``. Each segment runs the largest-error rule on its own counts (so its
proportions track its weights from its first sample), while each source's sample index continues where it
stopped, so no sample is repeated or skipped across a change. The schedule is data: a run that resumes with the
same schedule reproduces the same order; ``mixture(upto)`` is what a checkpoint records and checks.

Window reads are vectorised over the memory map: a window inside one document is a slice; a window spanning
documents is one fancy-index gather built with ``np.repeat``, no per-token Python. The loader's batched path
reads a whole step at once: ``BlendedSamples.samples(gs)`` locates all global indices with one lookup in the
blend blocks, and ``TokenWindows.samples(ks)`` cuts every window of the step into its document pieces and
gathers all of them with one fancy index per shard (row ``n`` equals ``sample(ks[n])``, which stays the
per-sample reference).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass

import numpy as np

from llmtrain.data.describe import try_describe
from llmtrain.data.indexed import IndexedDataset
from llmtrain.errors import DataError

BLEND_BLOCK = 1 << 14  # samples per lazily computed block of the blend


def digest(obj: object) -> str:
    """Short stable hash of a JSON-serialisable object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class _EpochLayout:
    """One epoch of a TokenWindows: the document order and the window order."""

    shard: np.ndarray  # [D] shard of the epoch's j-th document
    bin_start: np.ndarray  # [D] token offset in its shard's .bin
    stream_start: np.ndarray  # [D] its first token's position in the epoch's stream
    stream_end: np.ndarray  # [D] one past its last token in the stream
    window_order: np.ndarray  # [W] shuffled window indices


class TokenWindows:
    """``seq_length + 1``-token windows over the documents (sequence ids) of one dataset split."""

    def __init__(
        self,
        dataset: IndexedDataset | list[IndexedDataset],
        documents: np.ndarray,
        seq_length: int,
        seed: int,
        eos_id: int | None = None,
        identity: dict | None = None,
        name: str | None = None,
    ):
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.shards = list(dataset) if isinstance(dataset, list | tuple) else [dataset]
        self.dataset = self.shards[0]
        self.name = name or self.dataset.prefix
        docs = np.asarray(documents, dtype=np.int64)
        if docs.ndim == 1:  # sequence ids of a single shard
            docs = np.stack([np.zeros_like(docs), docs], axis=1)
        self.documents = docs[:, 1] if len(self.shards) == 1 else docs  # [D] or [D, 2] (shard, sequence)
        self.seq_length = int(seq_length)
        self.seed = int(seed) % 2**63  # SeedSequence takes non-negative entropy
        self._shard, seq = docs[:, 0], docs[:, 1]  # [D], [D]
        self._lengths = np.zeros(len(docs), dtype=np.int64)  # [D]
        self._bin_start = np.zeros(len(docs), dtype=np.int64)  # [D] token offsets in their shard
        for i, ds in enumerate(self.shards):
            m = self._shard == i
            self._lengths[m] = ds.sizes[seq[m]]
            self._bin_start[m] = ds.pointers[seq[m]] // ds.dtype.itemsize
        self.num_tokens = int(self._lengths.sum())
        self._num_windows = self._count()
        self.eos_id = eos_id
        if identity is None:
            identity = {"sequences": len(self.dataset), "tokens": self.dataset.num_tokens}
            info = try_describe(self.dataset.prefix)  # the manifest's identity and EOS, when there is one
            if info is not None:
                identity = info.identity()
                if self.eos_id is None:
                    self.eos_id = info.eos_id
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

    def _count(self) -> int:
        return max((self.num_tokens - 1) // self.seq_length, 0)

    def __len__(self) -> int:
        return self._num_windows

    def sample_tokens(self, k: int) -> int:
        """Input tokens (not padding) of sample ``k``: always ``seq_length`` for windows."""
        return self.seq_length

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
            shard=self._shard[order],
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
        if j0 == j1:  # inside one document: a slice of the memory map
            start = int(lay.bin_start[j0] + first - lay.stream_start[j0])
            return (
                self.shards[int(lay.shard[j0])].tokens[start : start + self.seq_length + 1].astype(np.int64)
            )
        docs = slice(j0, j1 + 1)
        lo = np.maximum(lay.stream_start[docs], first)  # [n] first stream position of each piece
        piece_len = np.minimum(lay.stream_end[docs], last + 1) - lo
        if len(self.shards) > 1 and np.any(
            lay.shard[docs] != lay.shard[j0]
        ):  # crosses shards: piece by piece
            starts = lay.bin_start[docs] + lo - lay.stream_start[docs]
            return np.concatenate(
                [self.shards[int(s)].tokens[b : b + n] for s, b, n in zip(lay.shard[docs], starts, piece_len)]
            ).astype(np.int64)
        shift = np.repeat(lay.bin_start[docs] - lay.stream_start[docs], piece_len)  # [T+1]
        return self.shards[int(lay.shard[j0])].tokens[np.arange(first, last + 1) + shift].astype(np.int64)

    def sample(self, k: int) -> np.ndarray:
        """The ``k``-th sample of the infinite shuffled sequence (epoch ``k // len``), [T+1] int64."""
        if self._num_windows == 0:
            raise DataError(
                f"Dataset '{self.dataset.prefix}' has fewer than seq_length + 1 = "
                f"{self.seq_length + 1} tokens in this split; it cannot make a single sample."
            )
        epoch, j = divmod(int(k), self._num_windows)
        return self.window(int(self._layout(epoch).window_order[j]), epoch)

    def samples(self, ks: np.ndarray) -> np.ndarray:
        """Samples ``ks`` [N] at once: int64 [N, T+1], row ``n`` equal to ``sample(ks[n])``."""
        ks = np.asarray(ks, dtype=np.int64)
        if self._num_windows == 0:
            self.sample(0)  # raises the DataError that explains it
        epochs, js = np.divmod(ks, self._num_windows)
        if len(ks) and epochs.min() == epochs.max():  # one epoch (the usual case): no extra copy
            return self._rows(js, int(epochs[0]))
        out = np.empty((len(ks), self.seq_length + 1), dtype=np.int64)
        for epoch in np.unique(epochs):
            rows = np.flatnonzero(epochs == epoch)
            out[rows] = self._rows(js[rows], int(epoch))
        return out

    def samples_tokens(self, ks: np.ndarray) -> np.ndarray:
        """Input tokens (not padding) of samples ``ks`` [N]: int64 [N], like ``sample_tokens``."""
        return np.full(len(ks), self.seq_length, dtype=np.int64)

    def _rows(self, js: np.ndarray, epoch: int) -> np.ndarray:
        """Windows at positions ``js`` [N] of ``epoch``'s window order, [N, T+1], in one gather.

        Each window is cut into its document pieces (``j0..j1`` per row, all rows' pieces in one flat array
        [P]); every token's offset from stream to ``.bin`` position is its piece's, spread with ``np.repeat``."""
        lay = self._layout(epoch)
        T1 = self.seq_length + 1
        first = lay.window_order[js].astype(np.int64) * self.seq_length  # [N] first stream position
        j0 = np.searchsorted(lay.stream_end, first, side="right")  # [N] document of the first token
        j1 = np.searchsorted(lay.stream_end, first + self.seq_length, side="right")  # [N] ... of the last
        n_pieces = j1 - j0 + 1  # [N]
        row = np.repeat(np.arange(len(js)), n_pieces)  # [P]
        doc = np.arange(len(row)) - np.repeat(np.cumsum(n_pieces) - n_pieces - j0, n_pieces)  # [P]
        lo = np.maximum(lay.stream_start[doc], first[row])  # [P]
        piece_len = np.minimum(lay.stream_end[doc], first[row] + T1) - lo  # [P], sums to T+1 per row
        pos = np.repeat(lay.bin_start[doc] - lay.stream_start[doc], piece_len)  # [N*(T+1)] stream -> .bin
        grid = pos.reshape(len(js), T1)  # a view: add the stream positions in place
        grid += first[:, None]
        grid += np.arange(T1)
        if len(self.shards) == 1:
            return self.shards[0].tokens[pos].astype(np.int64).reshape(len(js), T1)
        shard = np.repeat(lay.shard[doc], piece_len)  # [N*(T+1)]
        out = np.empty(len(pos), dtype=np.int64)
        for s in np.unique(shard):
            m = shard == s
            out[m] = self.shards[int(s)].tokens[pos[m]]
        return out.reshape(len(js), T1)


class BinSamples(TokenWindows):
    """Samples of a ``bestfit`` dataset: each stored sequence is one bin, padded with -1 to ``seq_length + 1``."""

    PAD = -1
    _order_cache: tuple[int, np.ndarray] | None = None  # (epoch, its bin order); bins need no _EpochLayout

    def _count(self) -> int:
        return len(self._lengths)

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = np.random.default_rng([self.seed, epoch, 2]).permutation(len(self._lengths))
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def window(self, i: int, epoch: int = 0) -> np.ndarray:
        """Bin ``i`` padded to [T+1] int64 (-1 marks padding)."""
        n = min(int(self._lengths[i]), self.seq_length + 1)
        start = int(self._bin_start[i])
        out = np.full(self.seq_length + 1, self.PAD, dtype=np.int64)
        out[:n] = self.shards[int(self._shard[i])].tokens[start : start + n]
        return out

    def sample(self, k: int) -> np.ndarray:
        if self._num_windows == 0:
            raise DataError(f"Dataset '{self.dataset.prefix}' has no packed bins in this split.")
        epoch, j = divmod(int(k), self._num_windows)
        return self.window(int(self._order(epoch)[j]), epoch)

    def sample_tokens(self, k: int) -> int:
        epoch, j = divmod(int(k), self._num_windows)
        return min(int(self._lengths[int(self._order(epoch)[j])]), self.seq_length)

    def samples_tokens(self, ks: np.ndarray) -> np.ndarray:
        ks = np.asarray(ks, dtype=np.int64)
        out = np.empty(len(ks), dtype=np.int64)
        epochs, js = np.divmod(ks, max(self._num_windows, 1))
        for epoch in np.unique(epochs):
            rows = np.flatnonzero(epochs == epoch)
            out[rows] = np.minimum(self._lengths[self._order(int(epoch))[js[rows]]], self.seq_length)
        return out

    def _rows(self, js: np.ndarray, epoch: int) -> np.ndarray:
        """Bins at positions ``js`` [N] of ``epoch``'s order, padded with -1: [N, T+1]."""
        ids = self._order(epoch)[js]  # [N]
        steps = np.arange(self.seq_length + 1)  # [T+1]
        keep = steps < np.minimum(self._lengths[ids], self.seq_length + 1)[:, None]  # [N, T+1]
        pos = self._bin_start[ids][:, None] + steps  # [N, T+1]
        out = np.full(keep.shape, self.PAD, dtype=np.int64)
        shard = self._shard[ids]  # [N]
        for s in np.unique(shard):
            m = keep & (shard == s)[:, None]
            out[m] = self.shards[int(s)].tokens[pos[m]]
        return out


def _normalise(weights: list[float], where: str) -> list[float]:
    if not weights:  # an empty blend (for example no validation data); locate() explains
        return []
    if any(not w >= 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"{where}: blend weights must be non-negative with a positive sum, got {weights}")
    total = float(sum(weights))
    return [float(w) / total for w in weights]


class BlendedSamples:
    """Infinite weighted blend of :class:`TokenWindows`; ``sample(g) -> (source index, tokens [T+1])``."""

    eod_mask_loss: bool = False  # set by the loader from data.eod_mask_loss; read by BatchIterator

    def __init__(
        self,
        sources: list[TokenWindows],
        weights: list[float],
        seed: int,
        meta: dict | None = None,
        schedule: list[tuple[int, list[float]]] | None = None,
        offsets: list[int] | None = None,
    ):
        segments = [(0, list(weights)), *sorted((int(s), list(w)) for s, w in (schedule or []))]
        for start, w in segments:
            if len(w) != len(sources):
                raise ValueError(f"{len(sources)} sources but {len(w)} weights (segment at sample {start})")
        starts = [s for s, _ in segments]
        if starts[1:] and (starts[1] <= 0 or len(set(starts)) != len(starts)):
            raise ValueError(f"mixture schedule starts must be distinct and positive, got {starts[1:]}")
        self.sources = list(sources)
        self.segments = [(s, _normalise(w, f"segment at sample {s}")) for s, w in segments]
        self.weights = self.segments[0][1]
        self.seed = int(seed)
        self.meta = meta or {}
        # offsets: samples of each source already read before this blend (an earlier stage of the run)
        self.offsets = [int(x) for x in offsets] if offsets else [0] * len(self.sources)
        ident = {"sources": [s.fingerprint for s in self.sources], "seed": self.seed, "meta": self.meta}
        if offsets:
            ident["offsets"] = self.offsets
        self.fingerprint = digest(ident)
        self._blocks: list[tuple[np.ndarray, np.ndarray]] = []  # per block: source [B], source sample [B]
        self._counts = list(self.offsets)  # samples given to each source before the next block
        self._seg_counts = [0] * len(self.sources)  # ... within the current mixture segment

    def with_weights(self, start_sample: int, weights: list[float]) -> BlendedSamples:
        """A blend identical to this one before global sample ``start_sample`` and mixed by ``weights`` after it."""
        kept = [(s, w) for s, w in self.segments[1:] if s < start_sample]
        return BlendedSamples(
            self.sources,
            self.segments[0][1],
            self.seed,
            self.meta,
            [*kept, (start_sample, weights)],
            self.offsets if any(self.offsets) else None,
        )

    def mixture(self, upto: int | None = None) -> list[list]:
        """``[[start, weights], ...]`` of the segments that begin before sample ``upto`` (all when None)."""
        return [[s, [round(x, 12) for x in w]] for s, w in self.segments if upto is None or s < max(upto, 1)]

    def names(self) -> list[str]:
        """Dataset path of each source (the keys of per-source token accounting)."""
        return [getattr(s, "name", str(i)) for i, s in enumerate(self.sources)]

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
            return 0, int(g) + self.offsets[0]
        block, offset = divmod(int(g), BLEND_BLOCK)
        while len(self._blocks) <= block:
            self._blocks.append(self._next_block())
        source, index = self._blocks[block]
        return int(source[offset]), int(index[offset])

    def locate_many(self, gs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`locate` of global samples ``gs`` [N] at once: (source [N], source sample index [N])."""
        gs = np.asarray(gs, dtype=np.int64)
        if len(gs) == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        self.locate(int(gs.max()))  # checks, and materialises the blocks up to the last sample
        if int(gs.min()) < 0:
            raise IndexError(f"sample index must be non-negative, got {int(gs.min())}")
        if len(self.sources) == 1:
            return np.zeros(len(gs), np.int64), gs + self.offsets[0]
        blocks, offset = np.divmod(gs, BLEND_BLOCK)
        source, index = np.empty(len(gs), np.int64), np.empty(len(gs), np.int64)
        for b in np.unique(blocks):
            m = blocks == b
            source[m] = self._blocks[int(b)][0][offset[m]]
            index[m] = self._blocks[int(b)][1][offset[m]]
        return source, index

    def samples(self, gs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global samples ``gs`` [N] at once: (source [N], int64 tokens [N, T+1]), row by row as :meth:`sample`."""
        source, index = self.locate_many(gs)
        if len(self.sources) == 1:
            return source, self.sources[0].samples(index)
        tokens = np.empty((len(source), self.sources[0].seq_length + 1), dtype=np.int64)
        for d in np.unique(source):
            rows = np.flatnonzero(source == d)
            tokens[rows] = self.sources[int(d)].samples(index[rows])
        return source, tokens

    def source_counts(self, upto: int) -> list[int]:
        """Samples drawn from each source by global samples ``[0, upto)``, offsets included."""
        if len(self.sources) == 1:
            return [self.offsets[0] + int(upto)]
        counts = list(self.offsets)
        if upto > 0:
            self.locate(upto - 1)  # materialise the blocks up to upto
            full, rest = divmod(int(upto), BLEND_BLOCK)
            chosen = [src for src, _ in self._blocks[:full]]
            if rest:
                chosen.append(self._blocks[full][0][:rest])
            for d, n in enumerate(np.bincount(np.concatenate(chosen), minlength=len(self.sources))):
                counts[d] += int(n)
        return counts

    def _next_block(self) -> tuple[np.ndarray, np.ndarray]:
        """The next BLEND_BLOCK decisions of the largest-error rule, continuing the running counts."""
        counts, seg_counts, n = self._counts, self._seg_counts, len(self.sources)
        first = len(self._blocks) * BLEND_BLOCK
        starts = [s for s, _ in self.segments]
        chosen, taken = [0] * BLEND_BLOCK, [0] * BLEND_BLOCK
        for t in range(BLEND_BLOCK):
            g = first + t
            seg = bisect.bisect_right(starts, g) - 1
            start, weights = self.segments[seg]
            if g == start and g > 0:
                seg_counts[:] = [0] * n  # a new mixture segment: its own largest-error counts
            x = float(max(g - start, 1))
            best, best_err = -1, 0.0
            for d in range(n):  # a source of weight 0 is never read (ties would otherwise pick it)
                err = weights[d] * x - seg_counts[d]
                if weights[d] > 0 and (best < 0 or err > best_err):
                    best, best_err = d, err
            chosen[t], taken[t] = best, counts[best]
            counts[best] += 1
            seg_counts[best] += 1
        return np.asarray(chosen, dtype=np.int32), np.asarray(taken, dtype=np.int64)

    def sample(self, g: int) -> tuple[int, np.ndarray]:
        """Global sample ``g``: (source index, int64 tokens [T+1])."""
        source, k = self.locate(g)
        return source, self.sources[source].sample(k)

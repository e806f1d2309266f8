"""Packing tokenized documents into training samples: ``concat`` (Megatron) and ``bestfit`` (Ding et al. 2024).

A sample is ``seq_length + 1`` tokens (inputs and the labels shifted by one), so the bin capacity is
``C = seq_length + 1``.

* ``concat``: documents are written one sequence each; the loader concatenates them and cuts windows every
  ``seq_length`` tokens. Nothing is padded, but every document that crosses a window boundary is cut in two
  (its continuation loses its context). The report counts those *truncated documents* for the written order.
* ``bestfit``: best-fit decreasing over a buffer of documents ("Fewer Truncations Improve Language Modeling",
  Ding et al. 2024). A document longer than ``C`` is cut into full bins of ``C`` tokens plus a remainder (the
  only truncation); the remainders and all shorter documents are sorted by length, longest first, and each goes
  into the open bin with the *least* room that still fits it (a sorted list of remaining capacities and
  ``bisect``), or a new bin. Unused room is padding (the loader pads with ``-1`` and masks it from the loss).

On disk a ``bestfit`` sequence is one bin (unpadded) and a Megatron document is a *group*: the full bins of
every long document whose remainder went into a bin, followed by that bin. A group never shares a source
document with another group, so the loader's document-level train/valid split cannot leak. Packing works on
buffers of ``buffer_tokens`` tokens, so memory is bounded; the padding lost at buffer ends is negligible for
buffers much larger than ``C``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

PACK_MODES = ("concat", "bestfit")
Group = list[np.ndarray]  # sequences of one Megatron document


@dataclass
class PackStats:
    """Counts of a packing run (all in tokens or documents)."""

    documents: int = 0
    tokens: int = 0
    truncated_documents: int = 0
    samples: int = 0
    padding_tokens: int = 0

    def as_dict(self, capacity: int) -> dict:
        slots = self.samples * capacity
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "samples": self.samples,
            "truncated_documents": self.truncated_documents,
            "truncation_rate": self.truncated_documents / max(self.documents, 1),
            "padding_tokens": self.padding_tokens,
            "padding_rate": self.padding_tokens / max(slots, 1),
        }


class ConcatPacker:
    """One group of one sequence per document; counts documents cut by the loader's windows."""

    def __init__(self, seq_length: int):
        self.seq_length = seq_length
        self.capacity = seq_length + 1
        self.stats = PackStats()
        self._pos = 0  # position of the next document in the concatenated stream

    def add(self, doc: np.ndarray) -> Iterator[Group]:
        n = len(doc)
        start, end = self._pos, self._pos + n
        # windows start every T tokens and hold T + 1: a document is cut if a window boundary falls inside it
        first_window, last_window = start // self.seq_length, max(end - 2, start) // self.seq_length
        self.stats.truncated_documents += int(first_window != last_window)
        self.stats.documents += 1
        self.stats.tokens += n
        self._pos = end
        yield [doc]

    def add_lengths(self, lengths: np.ndarray) -> None:
        """The accounting of :meth:`add` for many documents at once (the caller writes them as they are)."""
        ends = self._pos + np.cumsum(lengths, dtype=np.int64)  # [D]
        starts = ends - lengths
        first, last = starts // self.seq_length, np.maximum(ends - 2, starts) // self.seq_length
        self.stats.truncated_documents += int(np.count_nonzero(first != last))
        self.stats.documents += len(lengths)
        self.stats.tokens += int(ends[-1] - self._pos) if len(lengths) else 0
        self._pos = int(ends[-1]) if len(lengths) else self._pos

    def flush(self) -> Iterator[Group]:
        self.stats.samples = max((self._pos - 1) // self.seq_length, 0)
        return iter(())


class BestFitPacker:
    """Best-fit-decreasing packing into bins of ``seq_length + 1`` tokens, over buffers of documents."""

    def __init__(self, seq_length: int, buffer_tokens: int = 1 << 22):
        self.capacity = seq_length + 1
        self.buffer_tokens = max(buffer_tokens, self.capacity)
        self.stats = PackStats()
        self._buffer: list[np.ndarray] = []
        self._buffered = 0

    def add(self, doc: np.ndarray) -> Iterator[Group]:
        self._buffer.append(doc)
        self._buffered += len(doc)
        if self._buffered >= self.buffer_tokens:
            yield from self.flush()

    def flush(self) -> Iterator[Group]:
        docs, self._buffer, self._buffered = self._buffer, [], 0
        if docs:
            yield from self._pack(docs)

    def _pack(self, docs: list[np.ndarray]) -> Iterator[Group]:
        C = self.capacity
        pieces: list[tuple[int, np.ndarray]] = []  # (document index, remainder or whole document)
        chunks: dict[int, list[np.ndarray]] = {}  # document index -> its full bins
        for i, doc in enumerate(docs):
            self.stats.documents += 1
            self.stats.tokens += len(doc)
            if len(doc) > C:
                self.stats.truncated_documents += 1
                n_full = len(doc) // C
                chunks[i] = [doc[k * C : (k + 1) * C] for k in range(n_full)]
                if len(doc) % C:
                    pieces.append((i, doc[n_full * C :]))
            else:
                pieces.append((i, doc))
        pieces.sort(key=lambda p: -len(p[1]))  # stable: equal lengths keep input order
        bins: list[list[tuple[int, np.ndarray]]] = []
        room: list[tuple[int, int]] = []  # sorted (remaining capacity, bin id) of open bins
        for piece in pieces:
            n = len(piece[1])
            k = bisect.bisect_left(room, (n, -1))
            if k < len(room):
                left, b = room.pop(k)
            else:
                left, b = C, len(bins)
                bins.append([])
            bins[b].append(piece)
            if left - n > 0:
                bisect.insort(room, (left - n, b))
        for contents in bins:
            used = sum(len(p) for _, p in contents)
            self.stats.padding_tokens += C - used
            group = [chunk for i, _ in contents for chunk in chunks.pop(i, [])]
            group.append(np.concatenate([p for _, p in contents]))
            self.stats.samples += len(group)
            yield group
        for full in chunks.values():  # long documents that were an exact multiple of C
            self.stats.samples += len(full)
            yield full


def make_packer(mode: str, seq_length: int, buffer_tokens: int = 1 << 22) -> ConcatPacker | BestFitPacker:
    """The packer named ``mode`` (one of PACK_MODES)."""
    if mode == "concat":
        return ConcatPacker(seq_length)
    if mode == "bestfit":
        return BestFitPacker(seq_length, buffer_tokens)
    raise ValueError(f"unknown packing {mode!r}; expected one of {PACK_MODES}")


def pack_all(mode: str, docs: Iterable[np.ndarray], seq_length: int) -> tuple[list[Group], PackStats]:
    """Pack a finite list of documents (tests and benchmarks); returns the groups and the stats."""
    packer = make_packer(mode, seq_length)
    groups = [g for d in docs for g in packer.add(d)]
    groups.extend(packer.flush())
    return groups, packer.stats

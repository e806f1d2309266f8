"""Megatron-LM compatible token shards: ``PREFIX.bin`` (raw token ids) and ``PREFIX.idx`` (the index).

The byte layout is Megatron's ``MMIDIDX`` format (megatron/core/datasets/indexed_dataset.py), so shards written
here are read by Megatron-LM and MindFormers, and theirs by us. All integers are little-endian:

    .idx   9 bytes   magic b"MMIDIDX\\x00\\x00"
           <Q        version, always 1
           <B        dtype code of the .bin tokens (Megatron's codes, see DTYPE_CODES)
           <Q        S = number of sequences
           <Q        C = number of entries of document_indices (= documents + 1, it starts with a 0)
           int32[S]  sequence lengths in tokens
           int64[S]  sequence pointers: byte offset of each sequence in .bin
           int64[C]  document_indices: 0, then the sequence count after each document
    .bin   the sequences' tokens back to back in the dtype, no header.

``prepare`` with ``concat`` packing writes one sequence per document, so ``document_indices`` is ``0, 1, ..., n``;
with ``bestfit`` packing a sequence is one packed bin and a Megatron "document" is a group of bins that share a
source document (see ``pack``). The reader accepts both, and Megatron's sentence-split multi-sequence documents
(``preprocess_data.py --split-sentences``: one sequence per sentence, the EOD appended to the last one).
:meth:`IndexedDataset.document_view` merges each such document into one sequence (its sequences are adjacent in
``.bin`` in every writer), so the loader can shuffle whole documents. Reading is a memory map: a sequence is a
zero-copy numpy view of the ``.bin`` file. :func:`read_header` reads only the 34-byte header (dtype and counts),
for describing a dataset without mapping it.
"""

from __future__ import annotations

import copy
import struct
from pathlib import Path

import numpy as np

from llmtrain.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # = 34

# Megatron's DType enum: numpy dtype -> code stored in the header.
DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}
CODE_DTYPES: dict[int, np.dtype] = {code: dt for dt, code in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when ``vocab_size < 65500``, else int32."""
    return np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else np.dtype(np.int32)


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


class IndexedDatasetWriter:
    """Stream documents into ``PREFIX.bin``; ``finalize()`` writes ``PREFIX.idx``.

    Equivalent, byte for byte, to Megatron's ``IndexedDatasetBuilder`` fed ``add_document(tokens, [len])`` per
    document followed by ``finalize``.
    """

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype} has no Megatron code; use one of {list(DTYPE_CODES)}")
        self._limit = np.iinfo(self.dtype).max if self.dtype.kind in "iu" else None
        self._bin = open(bin_path(self.prefix), "wb")  # closed in finalize()
        self._lengths: list[int] = []  # [S] sequence lengths
        self._doc_ends: list[int] = []  # [D] sequence count after each document
        self.num_tokens = 0

    def add_document(self, tokens, lengths: list[int] | None = None) -> None:
        """Append one document: ``tokens`` as one sequence, or as several of ``lengths`` (summing to its size)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size and self._limit is not None and (int(arr.max()) > self._limit or int(arr.min()) < 0):
            raise DataError(
                f"Token id {int(arr.max())} does not fit the shard dtype {self.dtype} of '{self.prefix}.bin'; "
                f"the tokenizer's vocabulary is larger than the dtype chosen for it."
            )
        if lengths is not None and sum(lengths) != arr.size:
            raise ValueError(f"sequence lengths {lengths} do not add up to the document's {arr.size} tokens")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.extend([int(arr.size)] if lengths is None else [int(n) for n in lengths])
        self._doc_ends.append(len(self._lengths))
        self.num_tokens += int(arr.size)

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many documents at once, one sequence each: ``tokens`` [sum(lengths)] back to back, already
        in the shard dtype (the bulk path of ``prepare``; same bytes as ``add_document`` per document)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if tokens.dtype != self.dtype or tokens.ndim != 1 or int(lengths.sum()) != tokens.size:
            raise ValueError(
                f"add_documents needs 1-D {self.dtype} tokens whose size ({tokens.size}) is the sum of "
                f"lengths ({int(lengths.sum())}); got dtype {tokens.dtype}"
            )
        self._bin.write(np.ascontiguousarray(tokens).data.cast("B"))  # .data: the array's memoryview
        first = len(self._lengths)
        self._lengths.extend(lengths.tolist())
        self._doc_ends.extend(range(first + 1, first + len(lengths) + 1))
        self.num_tokens += int(tokens.size)

    @property
    def num_documents(self) -> int:
        return len(self._doc_ends)

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    def close(self) -> None:
        """Close ``.bin`` without writing the index (used when a prepare fails half way)."""
        self._bin.close()

    def finalize(self) -> None:
        """Close ``.bin`` and write ``.idx``."""
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_indices = np.asarray([0, *self._doc_ends], dtype=np.int64)
        with open(idx_path(self.prefix), "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(doc_indices)))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_indices.tobytes(order="C"))


def read_header(prefix: str | Path) -> tuple[np.dtype, int, int]:
    """(token dtype, sequences S, document_indices entries C) from the header of ``PREFIX.idx``; DataError
    naming the file when it is missing or not an MMIDIDX index."""
    ipath = idx_path(prefix)
    try:
        with open(ipath, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise DataError(f"Cannot read the index '{ipath}' of dataset prefix '{prefix}' ({e}).") from None
    if len(head) < HEADER_BYTES or head[: len(MAGIC)] != MAGIC:
        raise DataError(f"'{ipath}' is not a Megatron MMIDIDX index (bad magic or truncated header).")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(MAGIC) :])
    if version != VERSION or code not in CODE_DTYPES:
        raise DataError(
            f"'{ipath}' has index version {version} / dtype code {code}; expected version 1 "
            f"and one of Megatron's dtype codes {sorted(CODE_DTYPES)}."
        )
    if CODE_DTYPES[code].kind == "f":
        raise DataError(
            f"'{ipath}' declares its tokens as {CODE_DTYPES[code].name} (dtype code {code}): token ids are "
            f"integers, so this is not a token dataset (or its header is damaged). Token datasets use one of the "
            f"integer codes {sorted(c for c, dt in CODE_DTYPES.items() if dt.kind in 'iu')}."
        )
    return CODE_DTYPES[code], int(n_seq), int(n_doc)


CHECK_BLOCK = 1 << 22  # sequences per vectorised step of check_index: ~50 MB of temporaries at most


def check_index(prefix: str | Path) -> None:
    """The internal consistency of ``PREFIX.idx`` against itself and ``PREFIX.bin``, as every MMIDIDX writer
    (Megatron's ``IndexedDatasetBuilder``, ours) makes it; DataError naming the file and the first fault.

    Checked: an integer dtype and a known code (:func:`read_header`); the ``.idx`` size is exactly what its
    header's counts describe; every sequence length is >= 0; every pointer is the byte offset right after
    the previous sequence (so within ``.bin``, aligned, no overlap, no gap); the ``.bin`` holds exactly the
    tokens the index describes; ``document_indices`` starts at 0, never decreases and ends at the sequence
    count. Vectorised in blocks of :data:`CHECK_BLOCK` sequences: one read of the index, memory bounded."""
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    dtype, n_seq, n_doc = read_header(prefix)
    size = ipath.stat().st_size
    expected = HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
    if size == expected + n_seq and n_seq:
        raise DataError(
            f"'{ipath}' ends with one mode byte per sequence: a Megatron multimodal index (text and image "
            f"sequences), which llmtrain does not train on; use a text-only dataset."
        )
    if size != expected:
        raise DataError(
            f"'{ipath}' is damaged: its header counts {n_seq} sequences and {n_doc} document_indices entries, "
            f"which take {expected} bytes, but the file has {size} bytes "
            f"({'truncated' if size < expected else 'trailing bytes, or wrong counts'}). Regenerate the index "
            f"with the tool that wrote the dataset."
        )
    if n_doc < 1:
        raise DataError(
            f"'{ipath}' is damaged: it has no document_indices (Megatron's index always starts them with 0). "
            f"Regenerate the index with the tool that wrote the dataset."
        )
    n_bytes = bpath.stat().st_size
    raw = np.memmap(ipath, dtype=np.uint8, mode="r")
    sizes = np.frombuffer(raw, dtype=np.int32, count=n_seq, offset=HEADER_BYTES)
    pointers = np.frombuffer(raw, dtype=np.int64, count=n_seq, offset=HEADER_BYTES + 4 * n_seq)
    docs = np.frombuffer(raw, dtype=np.int64, count=n_doc, offset=HEADER_BYTES + 12 * n_seq)
    item = dtype.itemsize
    offset = 0  # bytes of .bin before the current block
    for lo in range(0, n_seq, CHECK_BLOCK):
        block = sizes[lo : lo + CHECK_BLOCK].astype(np.int64)  # [B]
        if (bad := np.flatnonzero(block < 0)).size:
            i = lo + int(bad[0])
            raise DataError(
                f"'{ipath}' is damaged: sequence {i} has length {int(sizes[i])} (a length is a token count, "
                f"never negative). Regenerate the index with the tool that wrote the dataset."
            )
        if (bad := np.flatnonzero(block * item > n_bytes)).size:
            i = lo + int(bad[0])
            raise DataError(
                f"'{ipath}' is damaged: sequence {i} has length {int(sizes[i])} tokens ({int(sizes[i]) * item} "
                f"bytes of {dtype.name}), more than the whole '{bpath}' ({n_bytes} bytes). Regenerate the index "
                f"with the tool that wrote the dataset."
            )
        ends = offset + np.cumsum(block * item)  # [B] byte end of each sequence
        starts = ends - block * item  # [B] where each must start: right after the previous one
        if (bad := np.flatnonzero(pointers[lo : lo + CHECK_BLOCK] != starts)).size:
            i, at = lo + int(bad[0]), int(pointers[lo + int(bad[0])])
            where = (
                f"past the end of '{bpath}' ({n_bytes} bytes)" if not 0 <= at < n_bytes else f"of '{bpath}'"
            )
            raise DataError(
                f"'{ipath}' is damaged: sequence {i} points at byte {at} {where}, but the lengths before it put "
                f"it at byte {int(starts[bad[0]])} (every MMIDIDX writer stores the sequences back to back, each "
                f"pointer the sum of the lengths before it x {item} bytes). Regenerate the index with the tool "
                f"that wrote the dataset."
            )
        offset = int(ends[-1])
    if offset != n_bytes:
        what = "the .bin is truncated" if n_bytes < offset else "the .bin is longer than its index says"
        raise DataError(
            f"'{bpath}' has {n_bytes} bytes, but its index '{ipath}' describes {offset} bytes ({n_seq} "
            f"sequences of {dtype.name} tokens): {what}, or the two files are not of one dataset. Regenerate "
            f"them together."
        )
    if docs[0] != 0 or docs[-1] != n_seq:
        raise DataError(
            f"'{ipath}' is damaged: its document_indices run from {int(docs[0])} to {int(docs[-1])}; they must "
            f"run from 0 to its {n_seq} sequences. Regenerate the index with the tool that wrote the dataset."
        )
    for lo in range(0, n_doc - 1, CHECK_BLOCK):
        step = np.diff(docs[lo : lo + CHECK_BLOCK + 1])  # [B]
        if (bad := np.flatnonzero(step < 0)).size:
            i = lo + int(bad[0])
            raise DataError(
                f"'{ipath}' is damaged: its document_indices decrease at entry {i + 1} ({int(docs[i])} then "
                f"{int(docs[i + 1])}); they are the sequence counts after each document, never decreasing. "
                f"Regenerate the index with the tool that wrote the dataset."
            )


class IndexedDataset:
    """Memory-mapped reader of ``PREFIX.bin`` / ``PREFIX.idx``; ``ds[i]`` is sequence ``i`` as a numpy view."""

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for p in (ipath, bpath):
            if not p.is_file():
                raise DataError(
                    f"Dataset prefix '{prefix}' has no '{p}'. A dataset is PREFIX.bin + PREFIX.idx as written by "
                    f"`llmtrain prepare --output PREFIX` (or Megatron-LM's preprocess_data.py)."
                )
        self.dtype: np.dtype
        self.dtype, n_seq, n_doc = read_header(prefix)
        raw = np.memmap(ipath, dtype=np.uint8, mode="r")
        expected = HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
        if raw.size < expected:
            raise DataError(f"'{ipath}' is truncated: {raw.size} bytes, its header needs {expected}.")
        off = HEADER_BYTES
        self.sizes: np.ndarray = np.frombuffer(raw, dtype=np.int32, count=n_seq, offset=off)  # [S]
        off += 4 * n_seq
        self.pointers: np.ndarray = np.frombuffer(raw, dtype=np.int64, count=n_seq, offset=off)  # [S]
        off += 8 * n_seq
        self.document_indices: np.ndarray = np.frombuffer(raw, dtype=np.int64, count=n_doc, offset=off)  # [C]
        self._idx_map = raw
        if n_doc and (self.document_indices[0] != 0 or self.document_indices[-1] != n_seq):
            raise DataError(
                f"'{ipath}' is inconsistent: its document_indices run from {int(self.document_indices[0])} to "
                f"{int(self.document_indices[-1])}, they must run from 0 to its {n_seq} sequences."
            )
        n_bytes = bpath.stat().st_size
        need = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n_seq else 0
        if n_bytes < need:
            raise DataError(f"'{bpath}' is truncated: {n_bytes} bytes, its index needs {need}.")
        # [N] all tokens, a plain ndarray view of the memory map (indexing a np.memmap subclass is slower);
        # np.memmap refuses empty files, so an empty dataset gets an empty array.
        self.tokens: np.ndarray = (
            np.memmap(bpath, dtype=self.dtype, mode="r", shape=(n_bytes // self.dtype.itemsize,)).view(
                np.ndarray
            )
            if n_bytes
            else np.zeros(0, dtype=self.dtype)
        )

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sizes[i])]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``i`` (to its end when ``length`` is None)."""
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]

    def document_view(self) -> IndexedDataset:
        """This dataset with one sequence per document: a multi-sequence document's sequences (adjacent in
        ``.bin``) become one sequence of their total length, ``document_indices`` becomes ``0, 1, ..., D``.
        ``self`` when every document already is one sequence, or when some document's sequences are not
        adjacent in ``.bin`` (no writer makes that; its sequences then stay separate units)."""
        doc = self.document_indices  # [C]
        n_docs = self.num_documents
        if len(self) == 0 or (n_docs == len(self) and np.array_equal(doc, np.arange(n_docs + 1))):
            return self
        size = self.dtype.itemsize
        starts, ends = doc[:-1], doc[1:]  # [D] first sequence, one past the last
        adjacent = self.pointers[1:] == self.pointers[:-1] + self.sizes[:-1].astype(np.int64) * size  # [S-1]
        inner = np.ones(len(self), dtype=bool)  # [S] sequence continues its document's previous one
        inner[starts[ends > starts]] = False
        if not np.all(adjacent[inner[1:]]):
            return self
        cum = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])  # [S+1]
        view = copy.copy(self)
        view.sizes = cum[ends] - cum[starts]  # [D] int64
        view.pointers = np.where(ends > starts, self.pointers[np.minimum(starts, len(self) - 1)], 0)
        view.document_indices = np.arange(n_docs + 1, dtype=np.int64)
        return view

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, sequences={len(self)}, dtype={self.dtype})"

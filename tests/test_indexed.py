"""Megatron .bin/.idx: exact bytes against an expected layout built independently from the format spec."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from llmtrain.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from llmtrain.errors import DataError

DOCS = [[1, 2, 3], [7], [], [65000, 4, 5, 6], [9, 9]]


def expected_bytes(docs: list[list[int]], np_dtype: str, code: int, itemsize: int) -> tuple[bytes, bytes]:
    """(.bin, .idx) as Megatron's IndexedDatasetBuilder writes them for one sequence per document."""
    binary = b"".join(struct.pack(f"<{len(d)}{'H' if itemsize == 2 else 'i'}", *d) for d in docs)
    lengths = [len(d) for d in docs]
    pointers, pos = [], 0
    for n in lengths:
        pointers.append(pos)
        pos += n * itemsize
    doc_indices = list(range(len(docs) + 1))  # starts with 0, then the sequence count after each document
    idx = b"MMIDIDX\x00\x00"
    idx += struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(docs)) + struct.pack("<Q", len(doc_indices))
    idx += struct.pack(f"<{len(lengths)}i", *lengths)
    idx += struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(doc_indices)}q", *doc_indices)
    return binary, idx


@pytest.mark.parametrize("dtype,code,itemsize", [("uint16", 8, 2), ("int32", 4, 4)])
def test_bytes_match_megatron_layout(tmp_path, dtype, code, itemsize):
    prefix = str(tmp_path / "ds")
    w = IndexedDatasetWriter(prefix, np.dtype(dtype))
    for d in DOCS:
        w.add_document(d)
    w.finalize()
    want_bin, want_idx = expected_bytes(DOCS, dtype, code, itemsize)
    assert (tmp_path / "ds.bin").read_bytes() == want_bin
    assert (tmp_path / "ds.idx").read_bytes() == want_idx
    # header 34 bytes + 5 * (4 + 8) + 6 * 8
    assert len(want_idx) == 34 + 60 + 48
    assert len(want_bin) == 10 * itemsize


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_reader_round_trip(tmp_path, dtype):
    prefix = str(tmp_path / "ds")
    w = IndexedDatasetWriter(prefix, np.dtype(dtype))
    for d in DOCS:
        w.add_document(np.asarray(d))
    w.finalize()
    ds = IndexedDataset(prefix)
    assert len(ds) == 5 and ds.num_documents == 5 and ds.num_tokens == 10
    assert ds.dtype == np.dtype(dtype)
    assert ds.sizes.tolist() == [3, 1, 0, 4, 2]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4, 5]
    assert [ds[i].tolist() for i in range(5)] == DOCS
    assert ds.get(3, offset=1, length=2).tolist() == [4, 5]
    assert ds.get(3, offset=2).tolist() == [5, 6]
    assert ds.get(0).tolist() == [1, 2, 3]


def test_optimal_dtype_thresholds():
    assert optimal_dtype(32000) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(129280) == np.int32


def test_token_too_large_for_uint16(tmp_path):
    w = IndexedDatasetWriter(str(tmp_path / "ds"), np.dtype("uint16"))
    with pytest.raises(DataError, match="does not fit"):
        w.add_document([1, 70000])
    w.close()


def test_reader_rejects_bad_files(tmp_path):
    with pytest.raises(DataError, match="has no"):
        IndexedDataset(str(tmp_path / "missing"))
    prefix = str(tmp_path / "ds")
    w = IndexedDatasetWriter(prefix, np.dtype("int32"))
    w.add_document([1, 2, 3])
    w.finalize()
    idx = (tmp_path / "ds.idx").read_bytes()
    (tmp_path / "ds.idx").write_bytes(idx[:-4])
    with pytest.raises(DataError, match="truncated"):
        IndexedDataset(prefix)
    (tmp_path / "ds.idx").write_bytes(b"NOTMAGIC!" + idx[9:])
    with pytest.raises(DataError, match="magic"):
        IndexedDataset(prefix)
    (tmp_path / "ds.idx").write_bytes(idx)
    (tmp_path / "ds.bin").write_bytes(b"\x00" * 8)  # needs 12 bytes
    with pytest.raises(DataError, match="truncated"):
        IndexedDataset(prefix)


def test_check_index_accepts_every_writer_output(tmp_path):
    """``check_index`` passes what the writer makes: one- and multi-sequence documents, an empty document, an
    empty dataset (the damaged cases are in tests/test_hostile_data.py)."""
    from llmtrain.data.indexed import check_index

    w = IndexedDatasetWriter(str(tmp_path / "a"), np.uint16)
    w.add_document([1, 2, 3])
    w.add_document([4, 5, 6, 7], [1, 3])
    w.add_document([])
    w.add_documents(np.asarray([8, 9, 10], np.uint16), np.asarray([2, 1]))
    w.finalize()
    check_index(tmp_path / "a")
    empty = IndexedDatasetWriter(str(tmp_path / "e"), np.int32)
    empty.finalize()
    check_index(tmp_path / "e")

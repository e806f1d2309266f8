"""Deduplication: exact (hash of the cleaned text) and near-duplicate (MinHash + LSH, verified).

Two documents are *exact* duplicates when their cleaned texts are equal (an 8-byte BLAKE2b digest of the text).
They are *near* duplicates when the Jaccard similarity of their shingle sets is at least ``threshold``:

* shingles: word ``ngram``-grams of the lower-cased text (default 5), or character ``ngram``-grams (whitespace
  removed) for CJK/Thai text, which has no spaces; each shingle is a 32-bit hash (CRC32 of each word, code
  points for characters, combined by a polynomial hash), so signatures are identical in every process;
* MinHash: ``num_perm = bands * rows`` hash functions ``h_i(x) = (a_i x + b_i mod 2^64) >> 32`` (multiply-shift,
  fixed seed), applied to all shingles at once with numpy; the signature is the per-function minimum;
* LSH: the signature is cut into ``bands`` bands of ``rows`` values; documents sharing any band are candidates,
  with probability ``1 - (1 - s^rows)^bands`` at similarity ``s``. Defaults 20 x 6: 0.998 at s = 0.8,
  0.27 at 0.5, 0.015 at 0.3;
* verification: a candidate is a duplicate only if the fraction of equal signature values (the unbiased
  Jaccard estimate) is at least ``threshold`` (0.7; standard error 0.04 at 120 functions). So recall at
  J >= 0.8 is about 0.99 and false positives below J = 0.5 are about 1e-5.

:class:`DedupIndex` keeps, per kept document, its exact digest, one dict entry per band and a 16-bit copy of its
signature for verification (about 1.5 KB per document in all): memory grows with the documents *kept*, which is
why a corpus too large for one process is split with ``prepare --partition i/N`` and the partitions'
signatures are joined by ``merge`` (phase 2 of the two-phase scheme in docs/data.md). The signature
computation (:class:`MinHasher`) is pure and runs in the tokenizer workers, batched over a chunk of documents
(``signatures``: one flat shingle array, ``np.minimum.reduceat`` per document); only the index lookups run in
the main process, in input order, so decisions do not depend on the worker count.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass

import numpy as np

from llmtrain.data.filters import _SPACE, _ngram_hashes, is_cjk

_MASK32 = np.uint64(0xFFFFFFFF)
_BLOCK = 4096  # shingles per block of the [S, P] hash matrix


@dataclass(frozen=True)
class DedupConfig:
    """Deduplication settings; see the module docstring for what they mean."""

    exact: bool = True
    near: bool = True
    ngram: int = 5
    bands: int = 20
    rows: int = 6
    threshold: float = 0.7
    seed: int = 1


def exact_digest(text: str) -> int:
    """64-bit digest of a (cleaned) text; equal texts, equal digests."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


class MinHasher:
    """Shingles, MinHash signatures and LSH band keys of documents; pure and picklable."""

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg
        self.num_perm = cfg.bands * cfg.rows
        rng = np.random.default_rng([cfg.seed, 0x5157])
        self._a = rng.integers(1, 2**63, size=self.num_perm, dtype=np.uint64) | np.uint64(1)  # [P] odd
        self._b = rng.integers(0, 2**63, size=self.num_perm, dtype=np.uint64)  # [P]

    def shingles(self, text: str) -> np.ndarray:
        """Unique 32-bit shingle hashes of ``text`` [S] (uint64 holding 32-bit values)."""
        if is_cjk(text):
            units = np.frombuffer(_SPACE.sub("", text).encode("utf-32-le"), dtype=np.uint32)
            units = units.astype(np.uint64)
        else:
            words = text.lower().split()
            units = np.fromiter((zlib.crc32(w.encode()) for w in words), dtype=np.uint64, count=len(words))
        if len(units) == 0:
            return np.zeros(1, dtype=np.uint64)
        h = _ngram_hashes(units, min(self.cfg.ngram, len(units)))
        return np.unique((h ^ (h >> np.uint64(32))) & _MASK32)

    def signature_of(self, shingles: np.ndarray) -> np.ndarray:
        """MinHash signature [P] uint32 of a shingle set [S]."""
        sig = np.full(self.num_perm, np.iinfo(np.uint64).max, dtype=np.uint64)
        for i in range(0, len(shingles), _BLOCK):
            x = shingles[i : i + _BLOCK, None]  # [S', 1]
            h = (x * self._a[None, :] + self._b[None, :]) >> np.uint64(32)  # [S', P], wraps mod 2^64
            np.minimum(sig, h.min(axis=0), out=sig)
        return sig.astype(np.uint32)

    def band_keys(self, sig: np.ndarray) -> np.ndarray:
        """One uint64 key per band [B] of a signature [P]."""
        rows = sig.astype(np.uint64).reshape(self.cfg.bands, self.cfg.rows)  # [B, R]
        key = np.full(self.cfg.bands, 0xCBF29CE484222325, dtype=np.uint64)
        for r in range(self.cfg.rows):
            key = (key ^ rows[:, r]) * np.uint64(0x100000001B3)
        return key ^ np.arange(self.cfg.bands, dtype=np.uint64)  # different bands never collide

    def signature(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(band keys [B] uint64, 16-bit signature [P] uint16) of a document, as the index consumes them."""
        sig = self.signature_of(self.shingles(text))
        return self.band_keys(sig), (sig & 0xFFFF).astype(np.uint16)

    def signatures(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`signature` of many documents at once: (band keys [N, B] uint64, signatures [N, P] uint16).

        The shingles of all documents are hashed in [S', P] blocks of one flat array and reduced per document
        with ``np.minimum.reduceat``, so small documents cost no per-document numpy calls beyond shingling."""
        shingles = [self.shingles(t) for t in texts]  # each non-empty
        if not shingles:
            return np.zeros((0, self.cfg.bands), np.uint64), np.zeros((0, self.num_perm), np.uint16)
        flat = np.concatenate(shingles)  # [S]
        offsets = np.cumsum([0] + [len(x) for x in shingles[:-1]])  # [N] first shingle of each document
        sig = np.full((len(texts), self.num_perm), np.iinfo(np.uint64).max, dtype=np.uint64)  # [N, P]
        for i in range(0, len(flat), _BLOCK):
            j = min(i + _BLOCK, len(flat))
            h = (flat[i:j, None] * self._a[None, :] + self._b[None, :]) >> np.uint64(32)  # [S', P]
            d0 = int(np.searchsorted(offsets, i, side="right")) - 1  # documents with shingles in [i, j)
            d1 = int(np.searchsorted(offsets, j - 1, side="right"))
            local = np.maximum(offsets[d0:d1], i) - i  # [d] strictly increasing segment starts
            np.minimum(sig[d0:d1], np.minimum.reduceat(h, local, axis=0), out=sig[d0:d1])
        sig = sig.astype(np.uint32)
        rows = sig.astype(np.uint64).reshape(len(texts), self.cfg.bands, self.cfg.rows)  # [N, B, R]
        key = np.full((len(texts), self.cfg.bands), 0xCBF29CE484222325, dtype=np.uint64)
        for r in range(self.cfg.rows):
            key = (key ^ rows[:, :, r]) * np.uint64(0x100000001B3)
        return key ^ np.arange(self.cfg.bands, dtype=np.uint64), (sig & 0xFFFF).astype(np.uint16)


class DedupIndex:
    """The documents kept so far; :meth:`check` answers and records one document at a time."""

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg
        self.num_perm = cfg.bands * cfg.rows
        self._exact: set[int] = set()
        self._bands: dict[int, int] = {}  # band key -> first kept document holding it
        self._sigs = np.zeros((1024, self.num_perm), dtype=np.uint16)  # [N, P] kept signatures
        self.size = 0

    def check(self, digest: int | None, bands: np.ndarray | None, sig: np.ndarray | None) -> str | None:
        """``"exact_duplicate"`` / ``"near_duplicate"`` if the document repeats a kept one; else record it."""
        if digest is not None and self.cfg.exact:
            if digest in self._exact:
                return "exact_duplicate"
        if bands is not None and self.cfg.near:
            keys = bands.tolist()
            candidates = {c for k in keys if (c := self._bands.get(k)) is not None}
            for c in sorted(candidates):
                if float(np.mean(self._sigs[c] == sig)) >= self.cfg.threshold:
                    return "near_duplicate"
        self.add(digest, bands, sig)
        return None

    def add(self, digest: int | None, bands: np.ndarray | None, sig: np.ndarray | None) -> None:
        """Record a kept document without checking it."""
        if digest is not None and self.cfg.exact:
            self._exact.add(int(digest))
        if bands is not None and self.cfg.near:
            if self.size == len(self._sigs):
                self._sigs = np.concatenate([self._sigs, np.zeros_like(self._sigs)])
            self._sigs[self.size] = sig
            for k in bands.tolist():
                self._bands.setdefault(k, self.size)
            self.size += 1


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two shingle sets."""
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / max(len(a) + len(b) - inter, 1)

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
(``signatures``: the shingles of all documents hashed in a few numpy rounds, the CRC32 of the words included,
one flat shingle array, one hash function at a time, ``np.minimum.reduceat`` per document; bitwise equal to
the per-document ``signature``); only the index lookups run in the main process, in input order, so decisions
do not depend on the worker count.

The staged deduplication (``stages/``: bounded memory per task, local processes or Ray) uses the same
:class:`MinHasher` signatures and band keys and the same verification (:func:`estimated_jaccard` >=
``threshold``), but groups equal band keys in hash buckets on disk instead of this index.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from typing import cast

import numpy as np

from llmtrain.data.prep.filters import is_cjk
from llmtrain.data.prep.filters_batch import cjk_flags
from llmtrain.data.prep.textarrays import POLY, SPACE, SPACE_F, encode, ngram_hashes, parts, prefix, words

_MASK32 = np.uint64(0xFFFFFFFF)
_BLOCK = 4096  # shingles per block of the [S, P] hash matrix
_BATCH_BLOCK = 32768  # shingles per block in signatures(): a 256 KB buffer, in L2 cache


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


def _crc_table() -> np.ndarray:
    """[256] uint32: the table of the byte-at-a-time CRC-32 (the zlib / IEEE 802.3 reflected polynomial)."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0xEDB88320), table >> 1)
    return table


_CRC_TABLE = _crc_table()
_CRC_MAX = 64  # longer words are rare: zlib.crc32 one by one rather than one numpy round per byte


def _crc32_many(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """[W] uint64 ``zlib.crc32(data[starts[i]:ends[i]])`` of many non-empty byte strings of ``data`` [uint8]:
    the byte-at-a-time CRC advanced for all strings at once, one numpy round per byte position."""
    size = ends - starts
    out = np.empty(len(starts), dtype=np.uint64)
    long = size > _CRC_MAX
    for i in np.flatnonzero(long).tolist():
        out[i] = zlib.crc32(data[starts[i] : ends[i]].tobytes())
    short = np.flatnonzero(~long)
    # longest first, so round k updates a prefix (a stable sort of uint8 keys is a radix sort)
    order = short[np.argsort((_CRC_MAX - size[short]).astype(np.uint8), kind="stable")]
    begin, neg = starts[order], -size[order]
    crc = np.full(len(order), 0xFFFFFFFF, dtype=np.uint32)
    for k in range(int(-neg[0]) if len(order) else 0):
        m = int(np.searchsorted(neg, -k, side="left"))  # strings longer than k bytes
        c = crc[:m]
        crc[:m] = _CRC_TABLE[(c ^ data[begin[:m] + k]) & 0xFF] ^ (c >> 8)
    out[order] = crc ^ np.uint32(0xFFFFFFFF)
    return out


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
            units = np.frombuffer(SPACE.sub("", text).encode("utf-32-le"), dtype=np.uint32)
            units = units.astype(np.uint64)
        else:
            split = text.lower().split()
            units = np.fromiter((zlib.crc32(w.encode()) for w in split), dtype=np.uint64, count=len(split))
        if len(units) == 0:
            return np.zeros(1, dtype=np.uint64)
        h = ngram_hashes(units, min(self.cfg.ngram, len(units)))
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

    def signatures(self, texts: list[str], cjk: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`signature` of many documents at once: (band keys [N, B] uint64, signatures [N, P] uint16),
        bitwise equal to the per-document results.

        ``cjk``: :func:`~llmtrain.data.prep.filters_batch.cjk_flags` of these very texts, if the caller has
        them (after C4 line filtering, of the shortened texts). Shingling is batched (:meth:`_flat_shingles`);
        the MinHash runs one hash function at a time over blocks of the flat shingle array (1-D passes that stay
        in cache, 3x faster than [S', P] blocks), reduced per document with ``np.minimum.reduceat``.
        A signature value is ``(a x + b mod 2^64) >> 32`` minimised over the shingles x; the shift is monotone,
        so it is applied once to the minimum, and a document's repeated shingles do not change a minimum, so
        the per-document ``np.unique`` is not needed."""
        texts = list(texts)
        n = len(texts)
        if n == 0:
            return np.zeros((0, self.cfg.bands), np.uint64), np.zeros((0, self.num_perm), np.uint16)
        cjk = cjk_flags(texts) if cjk is None else np.asarray(cjk, dtype=bool)
        if cjk.shape != (n,):
            raise ValueError(f"cjk has shape {cjk.shape}; expected ({n},)")
        bands = np.zeros((n, self.cfg.bands), dtype=np.uint64)
        sigs = np.zeros((n, self.num_perm), dtype=np.uint16)
        for a, b in parts(texts):  # parts of a few MB of arrays (see textarrays.parts)
            bands[a:b], sigs[a:b] = self._signatures(texts[a:b], cjk[a:b])
        return bands, sigs

    def _signatures(self, texts: list[str], cjk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`signatures` of one part."""
        n = len(texts)
        flat, offsets = self._flat_shingles(texts, cjk)  # [S], [N] (every document has a shingle)
        sig = np.full((self.num_perm, n), np.iinfo(np.uint64).max, dtype=np.uint64)  # [P, N]
        buf = np.empty(min(_BATCH_BLOCK, len(flat)), dtype=np.uint64)
        for i in range(0, len(flat), _BATCH_BLOCK):  # blocks of shingles; a document may span blocks
            j = min(i + _BATCH_BLOCK, len(flat))
            x, h = flat[i:j], buf[: j - i]
            d0 = int(np.searchsorted(offsets, i, side="right")) - 1  # documents with shingles in [i, j)
            d1 = int(np.searchsorted(offsets, j - 1, side="right"))
            local = np.maximum(offsets[d0:d1], i) - i  # [d] strictly increasing segment starts
            for p in range(self.num_perm):  # one function at a time: contiguous 1-D passes, in cache
                np.multiply(x, self._a[p], out=h)  # wraps mod 2^64
                np.add(h, self._b[p], out=h)
                np.minimum(sig[p, d0:d1], np.minimum.reduceat(h, local), out=sig[p, d0:d1])
        sig = (sig.T >> np.uint64(32)).astype(np.uint32, order="C")  # [N, P]
        rows = sig.astype(np.uint64).reshape(n, self.cfg.bands, self.cfg.rows)  # [N, B, R]
        key = np.full((n, self.cfg.bands), 0xCBF29CE484222325, dtype=np.uint64)
        for r in range(self.cfg.rows):
            key = (key ^ rows[:, :, r]) * np.uint64(0x100000001B3)
        return key ^ np.arange(self.cfg.bands, dtype=np.uint64), (sig & 0xFFFF).astype(np.uint16)

    def _flat_shingles(self, texts: list[str], cjk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shingle hashes [S] of all documents, back to back, with repeats; first shingle of each [N]): the
        values of :meth:`shingles`. Units: the code points of the non-space characters of CJK documents (one
        encoding of all of them) and the CRC32 of the lower-cased words of the others; n-grams are hashed
        for all documents in ``ngram`` numpy rounds, windows never crossing a document."""
        n, ngram = len(texts), self.cfg.ngram
        counts = np.zeros(n, dtype=np.int64)  # [N] units per document
        idx = np.flatnonzero(cjk)
        # strict: a lone surrogate raises UnicodeEncodeError, as the per-document encode does
        cps, flags, offsets = encode([texts[i] for i in idx.tolist()], "strict")
        nonspace = (flags & SPACE_F) == 0
        pre = prefix(nonspace)
        counts[idx] = pre[offsets[1:]] - pre[offsets[:-1]]
        char_units = cps[nonspace]
        idx = np.flatnonzero(~cjk)
        lowered = [texts[i].lower() for i in idx.tolist()]
        data = np.frombuffer("".join(lowered).encode("utf-8"), dtype=np.uint8)  # strict, as w.encode()
        cps, flags, offsets = encode(lowered)
        wstart, wend, wdoc = words((flags & SPACE_F) != 0, offsets)
        counts[idx] = np.bincount(wdoc, minlength=len(idx))
        utf8 = prefix(1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000))  # bytes before
        units = np.empty(int(counts.sum()), dtype=np.uint64)  # [U] in document order
        in_cjk = np.repeat(cjk, counts)
        units[in_cjk] = char_units
        units[~in_cjk] = _crc32_many(data, utf8[wstart], utf8[wend])
        ustart = prefix(counts)[:-1]  # [N]
        grams = np.maximum(counts - ngram + 1, 1)  # [N] shingles: one for a document shorter than ngram
        first = prefix(grams)[:-1]  # [N]
        pos = np.repeat(ustart - first, grams) + np.arange(int(grams.sum()))  # [S] first unit of each shingle
        if len(units) == 0:  # only empty documents
            return np.zeros(n, dtype=np.uint64), first
        width = np.repeat(np.minimum(counts, ngram), grams)  # [S] units in each shingle
        short = bool((width < ngram).any())
        h = units[np.minimum(pos, len(units) - 1)]
        for k in range(1, ngram):
            if short:  # a short document's shingle is its n-gram of all its units
                m = width > k
                h[m] = h[m] * POLY + units[pos[m] + k]
            else:
                h = h * POLY + units[pos + k]
        h = (h ^ (h >> np.uint64(32))) & _MASK32
        h[np.repeat(counts == 0, grams)] = 0  # an empty document's single shingle is 0
        return h, first


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
        out = self.check_many(
            None if digest is None else np.asarray([digest], dtype=np.uint64),
            None if bands is None else np.asarray(bands)[None],
            None if sig is None else np.asarray(sig)[None],
        )
        return out[0] if out else None  # nothing to check or record

    def check_many(
        self, digests: np.ndarray | None, bands: np.ndarray | None, sigs: np.ndarray | None, rows=None
    ) -> list[str | None]:
        """:meth:`check` of the documents ``rows`` (default: all) of a chunk's arrays ([N], [N, B], [N, P]), in
        order: the same decisions, with the arrays turned into Python lists once and one C-level ``map`` of
        the band lookups per document (the main process's share of ``prepare`` with dedup)."""
        n = len(digests) if digests is not None else 0 if bands is None else len(bands)
        dig = digests.tolist() if digests is not None and self.cfg.exact else None
        keys_all = bands.tolist() if bands is not None and self.cfg.near else None
        get, setdefault = self._bands.get, self._bands.setdefault
        out: list[str | None] = []
        for j in range(n) if rows is None else rows:
            if dig is not None and dig[j] in self._exact:
                out.append("exact_duplicate")
                continue
            if keys_all is not None:
                assert sigs is not None  # near dedup passes the signatures with the bands
                keys = keys_all[j]
                got = list(map(get, keys))
                candidates = set(got)
                candidates.discard(None)
                if any(
                    float(estimated_jaccard(self._sigs[c], sigs[j])) >= self.cfg.threshold
                    for c in sorted(cast("set[int]", candidates))  # None is discarded just above
                ):
                    out.append("near_duplicate")
                    continue
            out.append(None)
            if dig is not None:
                self._exact.add(dig[j])
            if keys_all is not None:
                assert sigs is not None
                if self.size == len(self._sigs):
                    self._sigs = np.concatenate([self._sigs, np.zeros_like(self._sigs)])
                self._sigs[self.size] = sigs[j]
                for k, g in zip(keys, got):
                    if g is None:
                        setdefault(k, self.size)
                self.size += 1
        return out

    def add(self, digest: int | None, bands: np.ndarray | None, sig: np.ndarray | None) -> None:
        """Record a kept document without checking it."""
        if digest is not None and self.cfg.exact:
            self._exact.add(int(digest))
        if bands is not None and self.cfg.near:
            assert sig is not None  # the signature always comes with its bands
            if self.size == len(self._sigs):
                self._sigs = np.concatenate([self._sigs, np.zeros_like(self._sigs)])
            self._sigs[self.size] = sig
            for k in bands.tolist():
                self._bands.setdefault(k, self.size)
            self.size += 1


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The MinHash estimate of the Jaccard similarity: the fraction of equal values of two signatures [P] (a
    scalar), or of each row pair of two stacks [M, P] (-> [M]). A candidate is a near duplicate when it is at
    least ``DedupConfig.threshold`` (:class:`DedupIndex` and the staged dedup's ``stages/pairs.py``)."""
    return np.mean(np.asarray(a) == np.asarray(b), axis=-1)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two shingle sets."""
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / max(len(a) + len(b) - inter, 1)

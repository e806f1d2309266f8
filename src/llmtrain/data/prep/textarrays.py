"""Character classes and text-as-array primitives shared by the filters (``filters``, ``filters_batch``) and
MinHash (``dedup``).

One definition of each rule's character class, so the per-document rules, the batched rules and the
shingling cannot drift apart:

* the classes: CJK/Thai characters (:data:`CJK`, with :data:`CJK_THRESHOLD`, the share of them that makes a
  document CJK), whitespace runs (:data:`SPACE`: exactly ``str.isspace``), paragraph breaks, list bullets;
* :data:`POLY` and :func:`ngram_hashes`: the rolling polynomial hash of n-grams of unit hashes (uint64, wraps);
* the batched view of a list of texts: :func:`encode` joins them into one UTF-32 code point array with its
  per-code-point flags (:data:`SPACE_F`, :data:`ALPHA_F`, :data:`WORD_F`, :data:`CJK_F`, :data:`BULLET_F`)
  from :func:`table`, a lazily filled table computed with the very predicates the per-document rules use;
  :func:`prefix` sums, :func:`words` (``str.split()`` boundaries) and :func:`parts` (cache-sized ranges of a
  batch) turn counts and ratios into a few numpy passes.
"""

from __future__ import annotations

import re

import numpy as np

CJK = re.compile(r"[\u0e00-\u0e7f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
SPACE = re.compile(r"\s+")
PARAGRAPHS = re.compile(r"\n\s*\n")
BULLETS = ("•", "●", "○", "■", "□", "▪", "‣", "-", "*", "·", "–")
POLY = np.uint64(0x100000001B3)
CJK_THRESHOLD = 0.3  # share of CJK/Thai characters among the non-space ones that makes a document CJK

SPACE_F, ALPHA_F, WORD_F, CJK_F, BULLET_F, KNOWN_F = 1, 2, 4, 8, 16, 128  # per-code-point flags
BATCH_CHARS = 1 << 18  # characters per part of a batch (see parts)
_WORD_CHAR = re.compile(r"[^\W\d_]")  # the letter class of filters' alphabetic-word rule


def ngram_hashes(ids: np.ndarray, n: int) -> np.ndarray:
    """[W - n + 1] uint64 rolling hashes of the n-grams of unit hashes ``ids`` [W]."""
    m = len(ids) - n + 1
    h = ids[:m].copy()
    for k in range(1, n):
        h = h * POLY + ids[k : k + m]
    return h


class CharTable:
    """Per code point: rule flags and ``hash(chr(cp))``, computed on first sight with the very predicates of
    the per-document rules (``str.isspace``, ``str.isalpha``, the regexes), so the batched rules cannot drift
    from them. A corpus uses a few thousand distinct code points: filling costs milliseconds once per
    process; the arrays (10 MB of address space) are zero pages until touched."""

    def __init__(self) -> None:
        self.flags = np.zeros(0x110000, dtype=np.uint8)  # KNOWN_F once filled
        self.hashes = np.zeros(0x110000, dtype=np.int64)

    def lookup(self, cps: np.ndarray) -> np.ndarray:
        """Flags [L] uint8 of the code points ``cps`` [L]."""
        flags = self.flags[cps]
        missing = (flags & KNOWN_F) == 0
        if missing.any():
            new = np.unique(cps[missing])
            chars = "".join(map(chr, new.tolist()))
            self.flags[new] = (
                KNOWN_F
                | SPACE_F * np.fromiter(map(str.isspace, chars), dtype=np.uint8, count=len(chars))
                | ALPHA_F * np.fromiter(map(str.isalpha, chars), dtype=np.uint8, count=len(chars))
                | WORD_F * _matches(_WORD_CHAR, chars)
                | CJK_F * _matches(CJK, chars)
                | BULLET_F * np.isin(new, [ord(b) for b in BULLETS])  # every bullet is one character
            )
            # hash() of the 1-character strings: the unit hashes of CJK text in the per-document path
            self.hashes[new] = np.fromiter(map(hash, chars), dtype=np.int64, count=len(chars))
            flags = self.flags[cps]
        return flags


def utf32(text: str, errors: str = "surrogatepass") -> np.ndarray:
    """[L] uint32 code points of ``text``."""
    # surrogatepass: a lone surrogate (legal in a str) stays the one code point it is in the str
    return np.frombuffer(text.encode("utf-32-le", errors), dtype=np.uint32)


def _matches(pattern: re.Pattern, chars: str) -> np.ndarray:
    """[K] uint8: 1 where the one-character class ``pattern`` matches the character of ``chars``."""
    marked = pattern.sub("\x00", chars)  # NUL is in none of the classes: a character that changed matched
    return (utf32(marked) != utf32(chars)).astype(np.uint8)


_TABLE: CharTable | None = None


def table() -> CharTable:
    """The process's :class:`CharTable` (created on first use)."""
    global _TABLE
    if _TABLE is None:
        _TABLE = CharTable()
    return _TABLE


def encode(texts: list[str], errors: str = "surrogatepass") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(code points [L] uint32, their flags [L] uint8, document offsets [N + 1] int64) of the texts, joined.
    ``errors="strict"``: a lone surrogate raises UnicodeEncodeError."""
    cps = utf32("".join(texts), errors)
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)), out=offsets[1:])
    return cps, table().lookup(cps), offsets


def prefix(values: np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """[L + 1] exclusive prefix sums of ``values`` [L] (uint64 sums wrap, which hashing wants)."""
    out: np.ndarray = np.zeros(len(values) + 1, dtype=dtype)
    np.cumsum(values, dtype=dtype, out=out[1:])  # dtype too: without it the cast is a slow buffered loop
    return out


def parts(texts: list[str], limit: int | None = None) -> list[tuple[int, int]]:
    """Consecutive ranges [a, b) of ``texts`` holding at most ``limit`` characters (or one longer text).

    The batched code builds several arrays the size of the batch's characters; a few MB each stay in cache
    and are reused by the allocator, while arrays over 32 MB are fresh mmaps whose page faults (2 ms per 8 MB)
    cost more than the work: 256 long documents are split, 256 short ones are one part."""
    limit = BATCH_CHARS if limit is None else limit
    ranges, start, size = [], 0, 0
    for i, t in enumerate(texts):
        if i > start and size + len(t) > limit:
            ranges.append((start, i))
            start, size = i, 0
        size += len(t)
    if texts:
        ranges.append((start, len(texts)))
    return ranges


def words(space: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start [W], end [W], document [W]) of the words, as ``str.split()`` cuts them: maximal runs of
    non-space characters (``space`` [L]: ``str.isspace``), never across the document ``offsets`` [N + 1]."""
    edge = np.zeros(len(space) + 1, dtype=bool)
    edge[offsets] = True
    before = np.ones(len(space), dtype=bool)  # the previous character is a space or in another document
    before[1:] = space[:-1]
    before |= edge[:-1]
    after = np.ones(len(space), dtype=bool)
    after[:-1] = space[1:]
    after |= edge[1:]
    inside = ~space
    wstart = np.flatnonzero(inside & before)
    wend = np.flatnonzero(inside & after) + 1
    return wstart, wend, np.searchsorted(offsets, wstart, side="right") - 1

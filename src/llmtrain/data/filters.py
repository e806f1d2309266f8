"""Document quality filters: Gopher-style document rules, Gopher repetition rules, optional C4 line rules.

:func:`quality_check` returns ``(text, None)`` for a kept document or ``(text, reason)`` for a rejected one; the
reason (``"too_short"``, ``"dup_ngram_5"``...) is what ``prepare`` counts in its report and writes to the
rejects side file. The defaults, in :class:`FilterConfig`, are those of Rae et al. 2021 ("Scaling Language
Models: Methods, Analysis & Insights from Training Gopher", appendix A) and Raffel et al. 2020 (C4):

* length: 50 to 100,000 words; mean word length 3 to 10 characters;
* symbols: at most 0.1 ``#`` or ``...``/``…`` per word; at most 90% of lines starting with a bullet and 30%
  ending in an ellipsis; at least 80% of words containing an alphabetic character;
* repetition: duplicate lines <= 30% (by count) and <= 20% (by characters); the same for paragraphs; the most
  frequent 2/3/4-gram covers <= 20/18/16% of the characters; characters inside repeated 5..10-grams
  <= 15/14/13/12/11/10%;
* C4 line rules (off by default: they delete code and verse): keep only lines ending in terminal punctuation
  with at least 3 words, drop lines mentioning javascript or cookie/privacy/terms boilerplate, reject pages
  with "lorem ipsum" and pages left with fewer than 3 lines.

Language awareness: a document whose letters are mostly CJK (Han, kana, Hangul) or Thai has no spaces between
words, so its units are *characters* (whitespace removed) instead of words: the length rule counts characters
(default 50 to 200,000), the mean-word-length rule does not apply, the alphabetic rule asks 60% of characters to
be letters, and the repetition n-grams are character n-grams. Repetition statistics are computed with numpy on
hashed units (a rolling polynomial hash per n), so a 100,000-word document costs milliseconds. One pass serves
all n: the n-grams are hashed only at positions whose shorter prefix repeats (an n-gram that occurs twice has
a repeated prefix), so after n = 2 or 3 little is left to sort. The most frequent n-gram, when several are
equally frequent, is the one covering the most characters (deterministic and the strictest reading).

Batched path (what ``prepare`` runs on a chunk of documents): :func:`cjk_flags` and :func:`quality_check_many`
give exactly the results of :func:`is_cjk` and :func:`quality_check` per document, with a few numpy passes over
the whole chunk instead of regex and numpy rounds per document. The chunk is one UTF-32 code point array; a
per-code-point table (filled lazily with the very predicates the per-document rules use: ``str.isspace``,
``str.isalpha``, the regexes) gives whitespace, letters, CJK and bullets, so word and line boundaries, counts
and ratios are prefix sums read at document, word and line offsets. The repetition rules run once for the
chunk on one flat array of unit hashes (Python's ``hash`` of the same strings as the per-document path, so the
n-gram groups are the same); the document index is mixed into the first unit of every n-gram hash, so equal
n-grams of different documents never share a group (different n-grams collide with probability 2^-64, as
within one document), and per-document maxima and sums come from
``np.maximum.at`` / prefix sums. Duplicate lines and paragraphs are found by a cheap key per line (its length
and 9 sampled characters; never different for equal strings) and only documents where two keys match are
checked exactly, with the per-document code. Large batches are cut into parts of 256K characters (the arrays
stay in cache). Measured on 15,309 documents (4.6M characters, en/zh/code): 1.45 s -> 0.35 s of CPU.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

_CJK = re.compile(r"[\u0e00-\u0e7f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_SPACE = re.compile(r"\s+")
_ALPHA_WORD = re.compile(r"\S*[^\W\d_]\S*")  # a whitespace-delimited word holding a letter
_PARAGRAPHS = re.compile(r"\n\s*\n")
_BULLETS = ("•", "●", "○", "■", "□", "▪", "‣", "-", "*", "·", "–")
_TERMINAL = (".", "!", "?", '"', "'", "”", "’", "。", "！", "？", "…")
_C4_BAD_LINE = re.compile(r"javascript|cookie policy|uses cookies|privacy policy|terms of use", re.IGNORECASE)
_POLY = np.uint64(0x100000001B3)
_CJK_THRESHOLD = 0.3  # share of CJK/Thai characters among the non-space ones that makes a document CJK


@dataclass
class FilterConfig:
    """Thresholds of the quality filters (defaults: Gopher and C4, see the module docstring)."""

    min_words: int = 50
    max_words: int = 100_000
    min_chars_cjk: int = 50
    max_chars_cjk: int = 200_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1
    max_bullet_lines: float = 0.9
    max_ellipsis_lines: float = 0.3
    min_alpha_words: float = 0.8
    min_alpha_chars_cjk: float = 0.6
    max_dup_lines: float = 0.3
    max_dup_line_chars: float = 0.2
    max_dup_paragraphs: float = 0.3
    max_dup_paragraph_chars: float = 0.2
    max_top_ngram_chars: dict[int, float] = field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    max_dup_ngram_chars: dict[int, float] = field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}
    )
    c4_lines: bool = False
    c4_min_line_words: int = 3
    c4_min_lines: int = 3


def is_cjk(text: str, threshold: float = _CJK_THRESHOLD) -> bool:
    """True when at least ``threshold`` of the non-space characters are CJK or Thai (no spaces between words)."""
    sample = text[:20_000]
    nonspace = len(sample) - sum(map(len, _SPACE.findall(sample)))
    return nonspace > 0 and len(_CJK.findall(sample)) >= threshold * nonspace


def _dup_fraction(parts: list[str]) -> tuple[float, float]:
    """(fraction of parts, fraction of characters) that repeat an earlier part."""
    if not parts:
        return 0.0, 0.0
    seen: set[str] = set()
    dup_n = dup_chars = total_chars = 0
    for p in parts:
        total_chars += len(p)
        if p in seen:
            dup_n += 1
            dup_chars += len(p)
        else:
            seen.add(p)
    return dup_n / len(parts), dup_chars / max(total_chars, 1)


def _ngram_hashes(ids: np.ndarray, n: int) -> np.ndarray:
    """[W - n + 1] uint64 rolling hashes of the n-grams of unit hashes ``ids`` [W]."""
    m = len(ids) - n + 1
    h = ids[:m].copy()
    for k in range(1, n):
        h = h * _POLY + ids[k : k + m]
    return h


def _ngram_stats(ids: np.ndarray, cfg: FilterConfig) -> dict[int, tuple[np.ndarray, ...]]:
    """Per rule n: (positions [K], count of the n-gram at each [K], and per distinct n-gram in hash order: its
    count [U] and first position [U]).

    Only n-grams that can repeat are hashed: an n-gram that occurs twice has its m-gram prefix (m < n) occurring
    twice too, so each n is evaluated at the positions whose previous-n prefix repeated (all positions for the
    smallest n). Counts > 1 are exact (every occurrence of a repeated n-gram is among the positions); the n-grams
    left out all occur once, which no rule counts."""
    stats = {}
    empty = np.zeros(0, dtype=np.int64)
    positions, h, done = np.arange(len(ids)), ids, 1  # [K] candidates, [K] hash of their done-gram
    for n in sorted({*cfg.max_top_ngram_chars, *cfg.max_dup_ngram_chars}):
        keep = positions <= len(ids) - n
        positions, h = positions[keep], h[keep]
        if len(positions) == 0:  # nothing repeats at a shorter n: nothing repeats from here on
            stats[n] = (empty, empty, empty, empty)
            continue
        for k in range(done, n):  # extend the rolling hash to n-grams
            h = h * _POLY + ids[positions + k]
        done = n
        order = np.argsort(h)  # [K] equal hashes adjacent, groups in hash order
        sorted_h = h[order]
        new = np.empty(len(h), dtype=bool)
        new[0] = True
        np.not_equal(sorted_h[1:], sorted_h[:-1], out=new[1:])
        starts = new.nonzero()[0]  # [U] group starts
        counts = np.empty(len(starts), dtype=np.int64)  # [U]
        counts[:-1] = starts[1:] - starts[:-1]
        counts[-1] = len(h) - starts[-1]
        first = np.minimum.reduceat(positions[order], starts)  # [U]
        count = np.empty(len(h), dtype=np.int64)
        count[order] = np.repeat(counts, counts)  # [K] count of each position's n-gram
        stats[n] = (positions, count, counts, first)
        repeated = count > 1
        positions, h = positions[repeated], h[repeated]
    return stats


def repetition_reason(units: list[str], cfg: FilterConfig) -> str | None:
    """The Gopher n-gram rules over ``units`` (words, or characters for CJK); the first that fails, or None."""
    if len(units) < 2:
        return None
    ids = np.fromiter(map(hash, units), dtype=np.int64, count=len(units)).view(np.uint64)  # [W]
    lengths = np.fromiter(map(len, units), dtype=np.int64, count=len(units))  # [W]
    cum = np.concatenate([[0], np.cumsum(lengths)])  # [W + 1] characters before each unit
    total = float(cum[-1])
    stats = _ngram_stats(ids, cfg)
    for n, limit in sorted(cfg.max_top_ngram_chars.items()):
        _, _, count, first = stats[n]
        if len(units) < n or len(count) == 0:
            continue
        most = int(count.max())
        if most > 1:  # the most frequent n-gram; among equally frequent ones, the longest (deterministic)
            top = first[count == most]
            chars = float((cum[top + n] - cum[top]).max()) * most
            if chars / total > limit:
                return f"top_ngram_{n}"
    for n, limit in sorted(cfg.max_dup_ngram_chars.items()):
        positions, count, _, _ = stats[n]
        if len(units) < n:
            continue
        starts = positions[count > 1]  # [K'] starts of n-grams that occur more than once
        chars = 0.0
        if len(starts):
            edges = np.zeros(len(units) + 1, dtype=np.int64)
            edges[starts] += 1
            edges[starts + n] -= 1
            covered = np.cumsum(edges[:-1]) > 0  # [W] units inside a repeated n-gram
            chars = float(lengths[covered].sum())
        if chars / total > limit:
            return f"dup_ngram_{n}"
    return None


def c4_filter_lines(text: str, cfg: FilterConfig, cjk: bool) -> tuple[str, str | None]:
    """C4's line rules: the kept lines joined, or a reject reason for the whole page."""
    if "lorem ipsum" in text.lower():
        return text, "c4_lorem_ipsum"
    kept = []
    for line in text.split("\n"):
        s = line.strip()
        size = len(_SPACE.sub("", s)) if cjk else len(s.split())
        if s.endswith(_TERMINAL) and size >= cfg.c4_min_line_words and not _C4_BAD_LINE.search(s):
            kept.append(s)
    if len(kept) < cfg.c4_min_lines:
        return text, "c4_too_few_lines"
    return "\n".join(kept), None


def quality_check(text: str, cfg: FilterConfig) -> tuple[str, str | None]:
    """``(text, None)`` if ``text`` passes every rule, else ``(text, reason)``; C4 mode may shorten the text."""
    cjk = is_cjk(text)
    if cfg.c4_lines:
        text, reason = c4_filter_lines(text, cfg, cjk)
        if reason:
            return text, reason
    if cjk:
        units = list(_SPACE.sub("", text))
        if not cfg.min_chars_cjk <= len(units) <= cfg.max_chars_cjk:
            return text, "too_short" if len(units) < cfg.min_chars_cjk else "too_long"
        if sum(map(str.isalpha, units)) < cfg.min_alpha_chars_cjk * len(units):
            return text, "alpha_ratio"
    else:
        units = text.split()
        if not cfg.min_words <= len(units) <= cfg.max_words:
            return text, "too_short" if len(units) < cfg.min_words else "too_long"
        mean = (len(text) - sum(map(len, _SPACE.findall(text)))) / len(units)
        if not cfg.min_mean_word_length <= mean <= cfg.max_mean_word_length:
            return text, "mean_word_length"
        if len(_ALPHA_WORD.findall(text)) < cfg.min_alpha_words * len(units):
            return text, "alpha_ratio"
    symbols = text.count("#") + text.count("...") + text.count("…")
    if symbols > cfg.max_symbol_word_ratio * len(units):
        return text, "symbol_ratio"
    lines = [s for s in (line.strip() for line in text.split("\n")) if s]
    if lines:
        if sum(s.startswith(_BULLETS) for s in lines) > cfg.max_bullet_lines * len(lines):
            return text, "bullet_lines"
        if sum(s.endswith(("...", "…")) for s in lines) > cfg.max_ellipsis_lines * len(lines):
            return text, "ellipsis_lines"
    frac, chars = _dup_fraction(lines)
    if frac > cfg.max_dup_lines or chars > cfg.max_dup_line_chars:
        return text, "dup_lines"
    paragraphs = [p.strip() for p in _PARAGRAPHS.split(text) if p.strip()]
    frac, chars = _dup_fraction(paragraphs)
    if frac > cfg.max_dup_paragraphs or chars > cfg.max_dup_paragraph_chars:
        return text, "dup_paragraphs"
    return text, repetition_reason(units, cfg)


def reason_counts(reasons: list[str | None]) -> dict[str, int]:
    """``{reason: count}`` of the rejected documents in ``reasons``."""
    return dict(Counter(r for r in reasons if r))


# --- batched path --------------------------------------------------------------------------------------------

_SPACE_F, _ALPHA_F, _WORD_F, _CJK_F, _BULLET_F, _KNOWN_F = 1, 2, 4, 8, 16, 128  # per-code-point flags
_WORD_CHAR = re.compile(r"[^\W\d_]")  # the letter class of _ALPHA_WORD
_CJK_SAMPLE = 20_000  # is_cjk looks at this many leading characters
_BATCH_CHARS = 1 << 18  # characters per part of a batch (see _parts)
_DOC_SALT = np.uint64(0x9E3779B97F4A7C15)  # odd, so distinct documents shift an n-gram hash differently
_KEY_MUL = np.uint64(0xBF58476D1CE4E5B9)  # an odd 64-bit multiplier (splitmix64's)
_NEWLINE, _DOT, _HELLIP = 0x0A, 0x2E, 0x2026


class _CharTable:
    """Per code point: rule flags and ``hash(chr(cp))``, computed on first sight with the very predicates of
    the per-document rules (``str.isspace``, ``str.isalpha``, the regexes), so the batched rules cannot drift
    from them. A corpus uses a few thousand distinct code points: filling costs milliseconds once per
    process; the arrays (10 MB of address space) are zero pages until touched."""

    def __init__(self) -> None:
        self.flags = np.zeros(0x110000, dtype=np.uint8)  # _KNOWN_F once filled
        self.hashes = np.zeros(0x110000, dtype=np.int64)

    def lookup(self, cps: np.ndarray) -> np.ndarray:
        """Flags [L] uint8 of the code points ``cps`` [L]."""
        flags = self.flags[cps]
        missing = (flags & _KNOWN_F) == 0
        if missing.any():
            new = np.unique(cps[missing])
            chars = "".join(map(chr, new.tolist()))
            self.flags[new] = (
                _KNOWN_F
                | _SPACE_F * np.fromiter(map(str.isspace, chars), dtype=np.uint8, count=len(chars))
                | _ALPHA_F * np.fromiter(map(str.isalpha, chars), dtype=np.uint8, count=len(chars))
                | _WORD_F * _matches(_WORD_CHAR, chars)
                | _CJK_F * _matches(_CJK, chars)
                | _BULLET_F * np.isin(new, [ord(b) for b in _BULLETS])  # every bullet is one character
            )
            # hash() of the 1-character strings: the unit hashes of CJK text in the per-document path
            self.hashes[new] = np.fromiter(map(hash, chars), dtype=np.int64, count=len(chars))
            flags = self.flags[cps]
        return flags


def _utf32(text: str, errors: str = "surrogatepass") -> np.ndarray:
    """[L] uint32 code points of ``text``."""
    # surrogatepass: a lone surrogate (legal in a str) stays the one code point it is in the str
    return np.frombuffer(text.encode("utf-32-le", errors), dtype=np.uint32)


def _matches(pattern: re.Pattern, chars: str) -> np.ndarray:
    """[K] uint8: 1 where the one-character class ``pattern`` matches the character of ``chars``."""
    marked = pattern.sub("\x00", chars)  # NUL is in none of the classes: a character that changed matched
    return (_utf32(marked) != _utf32(chars)).astype(np.uint8)


_TABLE: _CharTable | None = None


def _table() -> _CharTable:
    global _TABLE
    if _TABLE is None:
        _TABLE = _CharTable()
    return _TABLE


def _encode(texts: list[str], errors: str = "surrogatepass") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(code points [L] uint32, their flags [L] uint8, document offsets [N + 1] int64) of the texts, joined.
    ``errors="strict"``: a lone surrogate raises UnicodeEncodeError."""
    cps = _utf32("".join(texts), errors)
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)), out=offsets[1:])
    return cps, _table().lookup(cps), offsets


def _prefix(values: np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """[L + 1] exclusive prefix sums of ``values`` [L] (uint64 sums wrap, which hashing wants)."""
    out = np.zeros(len(values) + 1, dtype=dtype)
    np.cumsum(values, dtype=dtype, out=out[1:])  # dtype too: without it the cast is a slow buffered loop
    return out


def _cjk_of(flags: np.ndarray, offsets: np.ndarray, threshold: float) -> np.ndarray:
    """:func:`is_cjk` [N] of the documents at ``offsets`` from their characters' flags."""
    starts = offsets[:-1]
    ends = np.minimum(offsets[1:], starts + _CJK_SAMPLE)
    nonspace, cjk = _prefix((flags & _SPACE_F) == 0), _prefix((flags & _CJK_F) != 0)
    n = nonspace[ends] - nonspace[starts]
    return (n > 0) & (cjk[ends] - cjk[starts] >= threshold * n)


def _parts(texts: list[str], limit: int | None = None) -> list[tuple[int, int]]:
    """Consecutive ranges [a, b) of ``texts`` holding at most ``limit`` characters (or one longer text).

    The batched code builds several arrays the size of the batch's characters; a few MB each stay in cache
    and are reused by the allocator, while arrays over 32 MB are fresh mmaps whose page faults (2 ms per 8 MB)
    cost more than the work: 256 long documents are split, 256 short ones are one part."""
    limit = _BATCH_CHARS if limit is None else limit
    parts, start, size = [], 0, 0
    for i, t in enumerate(texts):
        if i > start and size + len(t) > limit:
            parts.append((start, i))
            start, size = i, 0
        size += len(t)
    if texts:
        parts.append((start, len(texts)))
    return parts


def cjk_flags(texts: list[str], threshold: float = _CJK_THRESHOLD) -> np.ndarray:
    """``[is_cjk(t, threshold) for t in texts]`` as a bool array [N], with a few passes over all the texts."""
    samples = [t[:_CJK_SAMPLE] for t in texts]
    out = np.zeros(len(texts), dtype=bool)
    for a, b in _parts(samples):
        _, flags, offsets = _encode(samples[a:b])
        out[a:b] = _cjk_of(flags, offsets, threshold)
    return out


def _span_keys(cps: np.ndarray, starts: np.ndarray, ends: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """[K] uint64 key of each non-empty span ``cps[starts:ends]`` of document ``docs``: its length and 9 of
    its characters (first, at each eighth, last), hashed. Equal strings of one document always get equal
    keys; different ones rarely do, and then the document only goes to the exact per-document check. O(K),
    whatever the lengths of the spans."""
    length = ends - starts
    key = length.astype(np.uint64) * _KEY_MUL + docs.astype(np.uint64) * _DOC_SALT
    for k in range(8):
        key = key * _POLY + cps[starts + length * k // 8]
    return key * _POLY + cps[ends - 1]


def _with_repeats(keys: np.ndarray, docs: np.ndarray, n_docs: int) -> np.ndarray:
    """[n_docs] bool: documents holding two spans with equal keys (spans in document order)."""
    out = np.zeros(n_docs, dtype=bool)
    if len(keys) > 1:
        # stable: equal keys stay in document order, so equal (key, document) pairs are adjacent even if
        # keys of different documents collided; a duplicate is never missed
        order = np.argsort(keys, kind="stable")
        k, d = keys[order], docs[order]
        same = (k[1:] == k[:-1]) & (d[1:] == d[:-1])
        out[d[1:][same]] = True
    return out


def _groups(breaks: np.ndarray, n_words: int) -> tuple[np.ndarray, np.ndarray]:
    """(first word [G], last word [G]) of the groups of consecutive words; a group ends where ``breaks``
    [W - 1] is True between word i and word i + 1."""
    new = np.ones(n_words, dtype=bool)
    new[1:] = breaks
    first = np.flatnonzero(new)
    return first, np.append(first[1:], n_words)[: len(first)] - 1


def _repetition_many(
    ids: np.ndarray, lengths: np.ndarray, seg_start: np.ndarray, cfg: FilterConfig
) -> list[str | None]:
    """:func:`repetition_reason` of many documents at once: document g's unit hashes are
    ``ids[seg_start[g]:seg_start[g + 1]]`` (at least 2 each) and ``lengths`` their characters.

    One flat :func:`_ngram_stats`: the document index is added to the first unit of every n-gram hash (times
    an odd constant, times _POLY^(n-1): never zero mod 2^64), so equal n-grams of different documents land in
    different groups; within a document every hash moves by the same constant, so its groups are those of
    the per-document path. Per-document maxima with ``np.maximum.at``, sums with prefix sums."""
    size, n_seg = len(ids), len(seg_start)
    seg_end = np.append(seg_start[1:], size)
    seg_len = seg_end - seg_start
    seg_of = np.repeat(np.arange(n_seg), seg_len)  # [U] document of each unit
    end_of = seg_end[seg_of]  # [U] end of its document
    cum = _prefix(lengths)  # [U + 1]
    total = (cum[seg_end] - cum[seg_start]).astype(np.float64)  # [G]
    top, dup = cfg.max_top_ngram_chars, cfg.max_dup_ngram_chars
    fails = {}
    positions, h, done = np.arange(size), ids + seg_of.astype(np.uint64) * _DOC_SALT, 1
    for n in sorted({*top, *dup}):
        keep = positions + n <= end_of[positions]
        positions, h = positions[keep], h[keep]
        most = np.zeros(n_seg, dtype=np.int64)  # count of the most frequent n-gram
        span = np.zeros(n_seg, dtype=np.int64)  # its characters (the longest among equally frequent ones)
        dup_chars = np.zeros(n_seg, dtype=np.int64)  # characters inside repeated n-grams
        if len(positions):
            for k in range(done, n):  # extend the rolling hash to n-grams
                h = h * _POLY + ids[positions + k]
            done = n
            # only n-grams occurring twice matter: a bucket of the hash holding one position holds a unique
            # n-gram, so one bincount drops most positions before the sort (exact: all copies share a bucket)
            bits = max(int(len(h)).bit_length() + 1, 10)
            bucket = (h >> np.uint64(64 - bits)).astype(np.intp)
            maybe = np.bincount(bucket, minlength=1 << bits)[bucket] > 1
            positions, h = positions[maybe], h[maybe]
        if len(positions):
            order = np.argsort(h)
            sorted_h = h[order]
            new = np.empty(len(h), dtype=bool)
            new[0] = True
            np.not_equal(sorted_h[1:], sorted_h[:-1], out=new[1:])
            starts = new.nonzero()[0]  # [V] group starts
            counts = np.diff(np.append(starts, len(h)))  # [V]
            big = counts > 1
            if n in top and big.any():
                first = np.minimum.reduceat(positions[order], starts)[big]  # [V'] first position
                c, g = counts[big], seg_of[first]
                np.maximum.at(most, g, c)
                sel = c == most[g]
                np.maximum.at(span, g[sel], cum[first[sel] + n] - cum[first[sel]])
            repeated = np.zeros(len(h), dtype=bool)
            repeated[order[np.repeat(big, counts)]] = True  # positions stay in increasing order
            positions, h = positions[repeated], h[repeated]
            if n in dup and len(positions):
                # union of the windows [s, s + n) of the repeated starts s (sorted): window i adds the units
                # before the next start, at most n; windows never leave their document
                ends = np.minimum(positions + n, np.append(positions[1:], size))
                pieces = _prefix(cum[ends] - cum[positions])
                cut = np.searchsorted(positions, np.append(seg_start, size))
                dup_chars = pieces[cut[1:]] - pieces[cut[:-1]]
        if n in top:
            fails[f"top_ngram_{n}"] = (most > 1) & (span.astype(np.float64) * most / total > top[n])
        if n in dup:  # the per-document rule skips documents shorter than n
            fails[f"dup_ngram_{n}"] = (seg_len >= n) & (dup_chars.astype(np.float64) / total > dup[n])
    order_names = [f"top_ngram_{n}" for n in sorted(top)] + [f"dup_ngram_{n}" for n in sorted(dup)]
    reasons: list[str | None] = [None] * n_seg
    for name in reversed(order_names):  # the first failing rule wins: write the last ones first
        for g in np.flatnonzero(fails[name]).tolist():
            reasons[g] = name
    return reasons


def _words(space: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def _check_batch(
    texts: list[str],
    cps: np.ndarray,
    flags: np.ndarray,
    offsets: np.ndarray,
    cjk: np.ndarray,
    cfg: FilterConfig,
) -> list[str | None]:
    """The reasons of :func:`quality_check` after the C4 step, for encoded texts (see :func:`_encode`)."""
    n_docs = len(texts)
    space = (flags & _SPACE_F) != 0
    nonspace_c = ~space
    wstart, wend, wdoc = _words(space, offsets)
    n_words = np.bincount(wdoc, minlength=n_docs)
    pre = _prefix(nonspace_c)
    nonspace = pre[offsets[1:]] - pre[offsets[:-1]]
    pre = _prefix((flags & _WORD_F) != 0)
    alpha_words = np.bincount(wdoc[pre[wend] > pre[wstart]], minlength=n_docs)
    pre = _prefix((flags & _ALPHA_F) != 0)  # letters are never spaces: counting all characters is the same
    alpha_chars = pre[offsets[1:]] - pre[offsets[:-1]]
    units = np.where(cjk, nonspace, n_words)

    reasons: list[str | None] = [None] * n_docs
    pending = np.ones(n_docs, dtype=bool)

    def reject(fail: np.ndarray, reason: str) -> None:
        hit = pending & fail
        for i in np.flatnonzero(hit).tolist():
            reasons[i] = reason
        pending[hit] = False

    reject(units < np.where(cjk, cfg.min_chars_cjk, cfg.min_words), "too_short")
    reject(units > np.where(cjk, cfg.max_chars_cjk, cfg.max_words), "too_long")
    if (pending & ~cjk & (n_words == 0)).any():  # only with min_words <= 0; the per-document path fails too
        raise ZeroDivisionError("quality_check: a document without words passed min_words (mean word length)")
    mean = nonspace / np.maximum(n_words, 1)  # int / int as Python divides: both exact in float64
    reject(
        ~cjk & ~((cfg.min_mean_word_length <= mean) & (mean <= cfg.max_mean_word_length)), "mean_word_length"
    )
    alpha = np.where(
        cjk, alpha_chars < cfg.min_alpha_chars_cjk * nonspace, alpha_words < cfg.min_alpha_words * n_words
    )
    reject(alpha, "alpha_ratio")
    symbols = np.fromiter(
        (t.count("#") + t.count("...") + t.count("…") if p else 0 for t, p in zip(texts, pending.tolist())),
        dtype=np.int64,
        count=n_docs,
    )
    reject(symbols > cfg.max_symbol_word_ratio * units, "symbol_ratio")
    if not pending.any():
        return reasons

    # lines (stripped, non-empty) and paragraphs: groups of words with no newline / fewer than 2 newlines
    # between consecutive words of a document; a group spans its first word's start to its last word's end
    pre_nl = _prefix(cps == _NEWLINE)
    gap_nl = pre_nl[wstart[1:]] - pre_nl[wend[:-1]]  # [W - 1] newlines between word i and i + 1
    other_doc = wdoc[1:] != wdoc[:-1]
    first, last = _groups(other_doc | (gap_nl > 0), len(wstart))
    ls, le, ldoc = wstart[first], wend[last], wdoc[first]
    n_lines = np.bincount(ldoc, minlength=n_docs)
    bullets = np.bincount(ldoc[(flags[ls] & _BULLET_F) != 0], minlength=n_docs)
    dots = (
        (le - ls >= 3) & (cps[le - 1] == _DOT) & (cps[le - 2] == _DOT) & (cps[np.maximum(le - 3, 0)] == _DOT)
    )
    ellipsis = np.bincount(ldoc[dots | (cps[le - 1] == _HELLIP)], minlength=n_docs)
    reject(bullets > cfg.max_bullet_lines * n_lines, "bullet_lines")
    reject(ellipsis > cfg.max_ellipsis_lines * n_lines, "ellipsis_lines")

    keys = _span_keys(cps, ls, le, ldoc)
    fail = np.zeros(n_docs, dtype=bool)
    for i in np.flatnonzero(_with_repeats(keys, ldoc, n_docs) & pending).tolist():
        lines = [s for s in (line.strip() for line in texts[i].split("\n")) if s]
        frac, chars = _dup_fraction(lines)
        fail[i] = frac > cfg.max_dup_lines or chars > cfg.max_dup_line_chars
    reject(fail, "dup_lines")
    first, last = _groups(other_doc | (gap_nl > 1), len(wstart))
    pdoc = wdoc[first]
    keys = _span_keys(cps, wstart[first], wend[last], pdoc)
    fail = np.zeros(n_docs, dtype=bool)
    for i in np.flatnonzero(_with_repeats(keys, pdoc, n_docs) & pending).tolist():
        paragraphs = [p.strip() for p in _PARAGRAPHS.split(texts[i]) if p.strip()]
        frac, chars = _dup_fraction(paragraphs)
        fail[i] = frac > cfg.max_dup_paragraphs or chars > cfg.max_dup_paragraph_chars
    reject(fail, "dup_paragraphs")

    # repetition: units are the non-space characters of CJK documents and the words of the others
    todo = pending & (units >= 2)
    if not todo.any():
        return reasons
    lens = np.diff(offsets)
    char_units = np.repeat(todo & cjk, lens) & nonspace_c  # [L]
    word_units = todo[wdoc] & ~cjk[wdoc]  # [W]
    is_unit = char_units.copy()
    is_unit[wstart[word_units]] = True
    pos = np.flatnonzero(is_unit)  # [U] in document order
    is_char = char_units[pos]
    ids = np.empty(len(pos), dtype=np.uint64)
    ids[is_char] = _table().hashes[cps[pos[is_char]]].view(np.uint64)  # hash() of each character
    words = list(
        itertools.chain.from_iterable(texts[i].split() for i in np.flatnonzero(todo & ~cjk).tolist())
    )
    if len(words) != int(word_units.sum()):
        raise AssertionError("batched word boundaries differ from str.split()")
    ids[~is_char] = np.fromiter(map(hash, words), dtype=np.int64, count=len(words)).view(np.uint64)
    lengths = np.ones(len(pos), dtype=np.int64)
    lengths[~is_char] = (wend - wstart)[word_units]
    docs = np.flatnonzero(todo)
    seg_start = _prefix(units[docs])[:-1]  # units are in document order
    for i, reason in zip(docs.tolist(), _repetition_many(ids, lengths, seg_start, cfg)):
        reasons[i] = reason
    return reasons


def quality_check_many(
    texts: list[str], cfg: FilterConfig, cjk: np.ndarray | None = None
) -> tuple[list[str], list[str | None]]:
    """``[quality_check(t, cfg) for t in texts]`` as (texts, reasons), computed for the whole batch at once.

    ``cjk``: :func:`cjk_flags` of these ``texts`` if the caller has them (other flags give other results). With
    ``cfg.c4_lines`` the returned texts may be shortened; their CJK flags (for :meth:`MinHasher.signatures`)
    are then ``cjk_flags`` of the returned texts, which can differ."""
    texts = list(texts)
    reasons: list[str | None] = [None] * len(texts)
    if cjk is not None:
        cjk = np.asarray(cjk, dtype=bool)
        if cjk.shape != (len(texts),):
            raise ValueError(f"cjk has shape {cjk.shape}; expected ({len(texts)},)")
    active = list(range(len(texts)))
    if cfg.c4_lines:  # per document (off by default); the CJK flag is that of the text before the C4 step
        cjk = cjk_flags(texts) if cjk is None else cjk
        for i, t in enumerate(texts):
            texts[i], reasons[i] = c4_filter_lines(t, cfg, bool(cjk[i]))
        active = [i for i, r in enumerate(reasons) if r is None]
    sub = [texts[i] for i in active]
    for a, b in _parts(sub):
        cps, flags, offsets = _encode(sub[a:b])
        idx = active[a:b]
        part_cjk = _cjk_of(flags, offsets, _CJK_THRESHOLD) if cjk is None else cjk[idx]  # one encoding
        for i, reason in zip(idx, _check_batch(sub[a:b], cps, flags, offsets, part_cjk, cfg)):
            reasons[i] = reason
    return texts, reasons

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

The batched equivalents that ``prepare`` runs are in :mod:`llmtrain.data.prep.filters_batch`; the character
classes and the n-gram hash both use are in :mod:`llmtrain.data.prep.textarrays`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from llmtrain.data.prep.textarrays import BULLETS, CJK, CJK_THRESHOLD, PARAGRAPHS, POLY, SPACE

_ALPHA_WORD = re.compile(r"\S*[^\W\d_]\S*")  # a whitespace-delimited word holding a letter
_TERMINAL = (".", "!", "?", '"', "'", "”", "’", "。", "！", "？", "…")
_C4_BAD_LINE = re.compile(r"javascript|cookie policy|uses cookies|privacy policy|terms of use", re.IGNORECASE)


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


def is_cjk(text: str, threshold: float = CJK_THRESHOLD) -> bool:
    """True when at least ``threshold`` of the non-space characters are CJK or Thai (no spaces between words)."""
    sample = text[:20_000]
    nonspace = len(sample) - sum(map(len, SPACE.findall(sample)))
    return nonspace > 0 and len(CJK.findall(sample)) >= threshold * nonspace


def dup_fraction(parts: list[str]) -> tuple[float, float]:
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


def _ngram_stats(ids: np.ndarray, cfg: FilterConfig) -> dict[int, tuple[np.ndarray, ...]]:
    """Per rule n: (positions [K], count of the n-gram at each [K], and per distinct n-gram in hash order: its
    count [U] and first position [U]).

    Only n-grams that can repeat are hashed: an n-gram that occurs twice has its m-gram prefix (m < n) occurring
    twice too, so each n is evaluated at the positions whose previous-n prefix repeated (all positions for the
    smallest n). Counts > 1 are exact (every occurrence of a repeated n-gram is among the positions); the n-grams
    left out all occur once, which no rule counts."""
    stats: dict[int, tuple[np.ndarray, ...]] = {}
    empty = np.zeros(0, dtype=np.int64)
    positions, h, done = np.arange(len(ids)), ids, 1  # [K] candidates, [K] hash of their done-gram
    for n in sorted({*cfg.max_top_ngram_chars, *cfg.max_dup_ngram_chars}):
        keep = positions <= len(ids) - n
        positions, h = positions[keep], h[keep]
        if len(positions) == 0:  # nothing repeats at a shorter n: nothing repeats from here on
            stats[n] = (empty, empty, empty, empty)
            continue
        for k in range(done, n):  # extend the rolling hash to n-grams
            h = h * POLY + ids[positions + k]
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
        size = len(SPACE.sub("", s)) if cjk else len(s.split())
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
        units = list(SPACE.sub("", text))
        if not cfg.min_chars_cjk <= len(units) <= cfg.max_chars_cjk:
            return text, "too_short" if len(units) < cfg.min_chars_cjk else "too_long"
        if sum(map(str.isalpha, units)) < cfg.min_alpha_chars_cjk * len(units):
            return text, "alpha_ratio"
    else:
        units = text.split()
        if not cfg.min_words <= len(units) <= cfg.max_words:
            return text, "too_short" if len(units) < cfg.min_words else "too_long"
        mean = (len(text) - sum(map(len, SPACE.findall(text)))) / len(units)
        if not cfg.min_mean_word_length <= mean <= cfg.max_mean_word_length:
            return text, "mean_word_length"
        if len(_ALPHA_WORD.findall(text)) < cfg.min_alpha_words * len(units):
            return text, "alpha_ratio"
    symbols = text.count("#") + text.count("...") + text.count("…")
    if symbols > cfg.max_symbol_word_ratio * len(units):
        return text, "symbol_ratio"
    lines = [s for s in (line.strip() for line in text.split("\n")) if s]
    if lines:
        if sum(s.startswith(BULLETS) for s in lines) > cfg.max_bullet_lines * len(lines):
            return text, "bullet_lines"
        if sum(s.endswith(("...", "…")) for s in lines) > cfg.max_ellipsis_lines * len(lines):
            return text, "ellipsis_lines"
    frac, chars = dup_fraction(lines)
    if frac > cfg.max_dup_lines or chars > cfg.max_dup_line_chars:
        return text, "dup_lines"
    paragraphs = [p.strip() for p in PARAGRAPHS.split(text) if p.strip()]
    frac, chars = dup_fraction(paragraphs)
    if frac > cfg.max_dup_paragraphs or chars > cfg.max_dup_paragraph_chars:
        return text, "dup_paragraphs"
    return text, repetition_reason(units, cfg)


def reason_counts(reasons: list[str | None]) -> dict[str, int]:
    """``{reason: count}`` of the rejected documents in ``reasons``."""
    return dict(Counter(r for r in reasons if r))

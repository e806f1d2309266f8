"""Batched quality filters (what ``prepare`` runs on a chunk of documents).

:func:`cjk_flags` and :func:`quality_check_many`
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

The code point array, its flag table, prefix sums and word boundaries are the shared helpers of
:mod:`llmtrain.data.prep.textarrays` (MinHash shingling uses them too).
"""

from __future__ import annotations

import itertools

import numpy as np

from llmtrain.data.prep.filters import FilterConfig, c4_filter_lines, dup_fraction
from llmtrain.data.prep.textarrays import (
    ALPHA_F,
    BULLET_F,
    CJK_F,
    CJK_THRESHOLD,
    PARAGRAPHS,
    POLY,
    SPACE_F,
    WORD_F,
    encode,
    parts,
    prefix,
    table,
    words,
)

_CJK_SAMPLE = 20_000  # is_cjk looks at this many leading characters
_DOC_SALT = np.uint64(0x9E3779B97F4A7C15)  # odd, so distinct documents shift an n-gram hash differently
_KEY_MUL = np.uint64(0xBF58476D1CE4E5B9)  # an odd 64-bit multiplier (splitmix64's)
_NEWLINE, _DOT, _HELLIP = 0x0A, 0x2E, 0x2026


def _cjk_of(flags: np.ndarray, offsets: np.ndarray, threshold: float) -> np.ndarray:
    """:func:`is_cjk` [N] of the documents at ``offsets`` from their characters' flags."""
    starts = offsets[:-1]
    ends = np.minimum(offsets[1:], starts + _CJK_SAMPLE)
    nonspace, cjk = prefix((flags & SPACE_F) == 0), prefix((flags & CJK_F) != 0)
    n = nonspace[ends] - nonspace[starts]
    return (n > 0) & (cjk[ends] - cjk[starts] >= threshold * n)


def cjk_flags(texts: list[str], threshold: float = CJK_THRESHOLD) -> np.ndarray:
    """``[is_cjk(t, threshold) for t in texts]`` as a bool array [N], with a few passes over all the texts."""
    samples = [t[:_CJK_SAMPLE] for t in texts]
    out = np.zeros(len(texts), dtype=bool)
    for a, b in parts(samples):
        _, flags, offsets = encode(samples[a:b])
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
        key = key * POLY + cps[starts + length * k // 8]
    return key * POLY + cps[ends - 1]


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
    an odd constant, times POLY^(n-1): never zero mod 2^64), so equal n-grams of different documents land in
    different groups; within a document every hash moves by the same constant, so its groups are those of
    the per-document path. Per-document maxima with ``np.maximum.at``, sums with prefix sums."""
    size, n_seg = len(ids), len(seg_start)
    seg_end = np.append(seg_start[1:], size)
    seg_len = seg_end - seg_start
    seg_of = np.repeat(np.arange(n_seg), seg_len)  # [U] document of each unit
    end_of = seg_end[seg_of]  # [U] end of its document
    cum = prefix(lengths)  # [U + 1]
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
                h = h * POLY + ids[positions + k]
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
                pieces = prefix(cum[ends] - cum[positions])
                cut = np.searchsorted(positions, np.append(seg_start, size))
                dup_chars = pieces[cut[1:]] - pieces[cut[:-1]]
        if n in top:
            fails[f"top_ngram_{n}"] = (most > 1) & (span.astype(np.float64) * most / total > top[n])
        if n in dup:  # the per-document rule skips documents shorter than n
            fails[f"dup_ngram_{n}"] = (seg_len >= n) & (dup_chars.astype(np.float64) / total > dup[n])
    order_names = [f"top_ngram_{n}" for n in sorted(top)] + [f"dup_ngram_{n}" for n in sorted(dup)]
    reasons: list[str | None] = [None] * n_seg
    for name in reversed(order_names):  # the first failing rule wins: write the last ones first
        for doc in np.flatnonzero(fails[name]).tolist():
            reasons[doc] = name
    return reasons


def _check_batch(
    texts: list[str],
    cps: np.ndarray,
    flags: np.ndarray,
    offsets: np.ndarray,
    cjk: np.ndarray,
    cfg: FilterConfig,
) -> list[str | None]:
    """The reasons of :func:`quality_check` after the C4 step, for texts encoded by
    :func:`~llmtrain.data.prep.textarrays.encode`."""
    n_docs = len(texts)
    space = (flags & SPACE_F) != 0
    nonspace_c = ~space
    wstart, wend, wdoc = words(space, offsets)
    n_words = np.bincount(wdoc, minlength=n_docs)
    pre = prefix(nonspace_c)
    nonspace = pre[offsets[1:]] - pre[offsets[:-1]]
    pre = prefix((flags & WORD_F) != 0)
    alpha_words = np.bincount(wdoc[pre[wend] > pre[wstart]], minlength=n_docs)
    pre = prefix((flags & ALPHA_F) != 0)  # letters are never spaces: counting all characters is the same
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
    pre_nl = prefix(cps == _NEWLINE)
    gap_nl = pre_nl[wstart[1:]] - pre_nl[wend[:-1]]  # [W - 1] newlines between word i and i + 1
    other_doc = wdoc[1:] != wdoc[:-1]
    first, last = _groups(other_doc | (gap_nl > 0), len(wstart))
    ls, le, ldoc = wstart[first], wend[last], wdoc[first]
    n_lines = np.bincount(ldoc, minlength=n_docs)
    bullets = np.bincount(ldoc[(flags[ls] & BULLET_F) != 0], minlength=n_docs)
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
        frac, chars = dup_fraction(lines)
        fail[i] = frac > cfg.max_dup_lines or chars > cfg.max_dup_line_chars
    reject(fail, "dup_lines")
    first, last = _groups(other_doc | (gap_nl > 1), len(wstart))
    pdoc = wdoc[first]
    keys = _span_keys(cps, wstart[first], wend[last], pdoc)
    fail = np.zeros(n_docs, dtype=bool)
    for i in np.flatnonzero(_with_repeats(keys, pdoc, n_docs) & pending).tolist():
        paragraphs = [p.strip() for p in PARAGRAPHS.split(texts[i]) if p.strip()]
        frac, chars = dup_fraction(paragraphs)
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
    ids[is_char] = table().hashes[cps[pos[is_char]]].view(np.uint64)  # hash() of each character
    word_list = list(
        itertools.chain.from_iterable(texts[i].split() for i in np.flatnonzero(todo & ~cjk).tolist())
    )
    if len(word_list) != int(word_units.sum()):
        raise AssertionError("batched word boundaries differ from str.split()")
    ids[~is_char] = np.fromiter(map(hash, word_list), dtype=np.int64, count=len(word_list)).view(np.uint64)
    lengths = np.ones(len(pos), dtype=np.int64)
    lengths[~is_char] = (wend - wstart)[word_units]
    docs = np.flatnonzero(todo)
    seg_start = prefix(units[docs])[:-1]  # units are in document order
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
    for a, b in parts(sub):
        cps, flags, offsets = encode(sub[a:b])
        idx = active[a:b]
        part_cjk = _cjk_of(flags, offsets, CJK_THRESHOLD) if cjk is None else cjk[idx]  # one encoding
        for i, reason in zip(idx, _check_batch(sub[a:b], cps, flags, offsets, part_cjk, cfg)):
            reasons[i] = reason
    return texts, reasons

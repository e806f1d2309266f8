"""The batched quality filters and MinHash against their per-document reference.

``quality_check_many`` / ``cjk_flags`` / ``MinHasher.signatures`` must give exactly what ``quality_check`` /
``is_cjk`` / ``MinHasher.signature`` give one document at a time: on crafted documents that hit every reject
reason (CJK and not, C4 on and off, empty and one-word documents, every Unicode space), on random documents,
and on the shared corpus (skipped when ../shared is absent) plus repetitive variants of it that fire every
repetition rule.
"""

from __future__ import annotations

import gzip
import itertools
import json
import random
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from llmtrain.data.prep import dedup, textarrays
from llmtrain.data.prep.dedup import DedupConfig, MinHasher
from llmtrain.data.prep.filters import FilterConfig, is_cjk, quality_check
from llmtrain.data.prep.filters_batch import cjk_flags, quality_check_many

# every str.isspace() character, and characters that look like spaces but are not
SPACES = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B)))
SPACES += "\u2028\u2029\u202f\u205f\u3000"
NOT_SPACES = "\u200b\u180e\u2060\ufeff\x00\x7f"
REPETITION = {"dup_lines", "dup_paragraphs", "top_ngram_2", "top_ngram_3", "top_ngram_4"}
REPETITION |= {f"dup_ngram_{n}" for n in range(5, 11)}
CONFIGS = {
    "default": FilterConfig(),
    "c4": FilterConfig(c4_lines=True),
    # an n in both rule sets, n = 1, and a negative limit (the rule is skipped for documents shorter than n)
    "odd_ngrams": FilterConfig(max_top_ngram_chars={1: 0.5, 3: 0.1}, max_dup_ngram_chars={3: 0.3, 12: -1.0}),
}


def batched(texts: list[str], cfg: FilterConfig, chunk: int = 256) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for i in range(0, len(texts), chunk):
        part, reasons = quality_check_many(texts[i : i + chunk], cfg)
        out += zip(part, reasons)
    return out


def assert_filters_equal(texts: list[str], cfg: FilterConfig, chunk: int = 256) -> list[str | None]:
    """Batched == per-document (texts and reasons); returns the reasons."""
    ref = [quality_check(t, cfg) for t in texts]
    got = batched(texts, cfg, chunk)
    bad = [(i, r[1], g[1], texts[i][:60]) for i, (r, g) in enumerate(zip(ref, got)) if r != g]
    assert not bad, bad[:5]
    assert len(got) == len(ref)
    return [r for _, r in ref]


def assert_signatures_equal(mh: MinHasher, texts: list[str], chunk: int = 256) -> None:
    """cjk_flags == is_cjk, and signatures (with and without the flags) == signature, bitwise."""
    ref = [mh.signature(t) for t in texts]
    for i in range(0, len(texts), chunk):
        part = texts[i : i + chunk]
        cjk = cjk_flags(part)
        assert cjk.dtype == bool and cjk.tolist() == [is_cjk(t) for t in part]
        for flags in (cjk, None):
            bands, sigs = mh.signatures(part, flags)
            assert bands.dtype == np.uint64 and sigs.dtype == np.uint16
            assert np.array_equal(bands, np.stack([b for b, _ in ref[i : i + chunk]]))
            assert np.array_equal(sigs, np.stack([s for _, s in ref[i : i + chunk]]))


def vocabulary(n: int, seed: int, length: int = 5) -> list[str]:
    """n distinct random lower-case words of ``length`` letters."""
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < n:
        words["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=length))] = None
    return list(words)


def han(n: int, start: int = 0) -> list[str]:
    """n distinct Han characters."""
    return [chr(0x4E00 + 7 * (start + i)) for i in range(n)]


def with_repeat(units: list[str], piece: list[str], copies: int, total: int) -> list[str]:
    """``total`` units: ``copies`` copies of ``piece``, each followed by fresh units, the rest fresh."""
    fresh = iter(units)
    out: list[str] = []
    gap = (total - copies * len(piece)) // copies
    for _ in range(copies):
        out += piece + [next(fresh) for _ in range(gap)]
    return out + [next(fresh) for _ in range(total - len(out))]


def crafted() -> list[tuple[str, FilterConfig, str | None]]:
    """(document, config, the reason quality_check gives) covering every rule, CJK and not."""
    cfg, c4 = FilterConfig(), FilterConfig(c4_lines=True)
    w = vocabulary(2000, 0)
    zh = han(2000)
    prose = " ".join(w[:120])
    lines = ["\n".join(" ".join(w[i : i + 4]) for i in range(k, k + 80, 4)) for k in (0, 100)]
    docs = [
        (prose, cfg, None),
        (" ".join(w[:10]), cfg, "too_short"),
        (" ".join(w[:150]), FilterConfig(max_words=100), "too_long"),
        (" ".join(["ab"] * 80), cfg, "mean_word_length"),
        (" ".join(vocabulary(60, 1, length=12)), cfg, "mean_word_length"),
        (" ".join(w[i] if i % 2 else "12345" for i in range(60)), cfg, "alpha_ratio"),
        (" ".join(f"#{w[i]}" if i % 6 == 0 else w[i] for i in range(66)), cfg, "symbol_ratio"),
        (" ".join(w[i] + ("..." if i % 8 == 0 else "") for i in range(80)), cfg, "symbol_ratio"),
        ("\n".join("- " + " ".join(w[5 * i : 5 * i + 5]) for i in range(20)), cfg, "bullet_lines"),
        ("\n".join("•" + " ".join(w[5 * i : 5 * i + 5]) for i in range(20)), cfg, "bullet_lines"),
        ("\n".join(" ".join(w[6 * i : 6 * i + 6]) + "…" * (i % 2) for i in range(20)), cfg, "ellipsis_lines"),
        (
            "\n".join(" ".join(w[4 * i : 4 * i + 4]) + ("..." if i % 3 == 0 else "") for i in range(30)),
            FilterConfig(max_symbol_word_ratio=1.0),
            "ellipsis_lines",
        ),
        ("\n".join(" ".join(w[4 * (i % 12) : 4 * (i % 12) + 4]) for i in range(20)), cfg, "dup_lines"),
        (lines[0] + "\n\nshort line here\n\nshort line here", cfg, "dup_paragraphs"),
        (lines[0] + "\n \u3000\n" + lines[1] + "\n\t\n" + " ".join(w[300:310]), cfg, None),
        (" ".join(with_repeat(w, ["xaaaa", "xbbbb"], 11, 100)), cfg, "top_ngram_2"),
        (" ".join(with_repeat(w, w[1990:1993], 8, 100)), cfg, "top_ngram_3"),
        (" ".join(with_repeat(w, w[1990:1994], 5, 100)), cfg, "top_ngram_4"),
        # a tie between a short and a long 2-gram: the longer one decides
        (
            " ".join(["a", "b"] * 3 + ["elephant", "giraffes"] * 3 + [f"w{i}" for i in range(40)]),
            FilterConfig(max_top_ngram_chars={2: 0.25}, max_dup_ngram_chars={}),
            "top_ngram_2",
        ),
        (lines[0].replace("\n", ".\n") + "\nClick here\nThis site uses cookies.", c4, None),
        ("Lorem ipsum dolor sit amet.\n" + prose, c4, "c4_lorem_ipsum"),
        (prose + ".", c4, "c4_too_few_lines"),
        # CJK: units are characters
        ("".join(zh[:80]) + "。", cfg, None),
        ("".join(zh[:20]), cfg, "too_short"),
        ("".join(zh[:150]), FilterConfig(max_chars_cjk=100), "too_long"),
        ("".join(c + "１" for c in zh[:30]), cfg, "alpha_ratio"),
        ("".join(c + ("#" if i % 5 == 0 else "") for i, c in enumerate(zh[:60])), cfg, "symbol_ratio"),
        ("\n".join("•" + "".join(zh[6 * i : 6 * i + 6]) for i in range(15)), cfg, "bullet_lines"),
        (
            "\n".join("".join(zh[6 * i : 6 * i + 6]) + "…" * (i % 2) for i in range(15)),
            cfg,
            "ellipsis_lines",
        ),
        ("\n".join("".join(zh[6 * (i % 5) : 6 * (i % 5) + 6]) + "。" for i in range(15)), cfg, "dup_lines"),
        ("".join(with_repeat(zh, ["甲", "乙"], 11, 100)), cfg, "top_ngram_2"),
        ("".join(with_repeat(zh, ["甲", "乙", "丙"], 8, 100)), cfg, "top_ngram_3"),
        ("".join(with_repeat(zh, ["甲", "乙", "丙", "丁"], 5, 100)), cfg, "top_ngram_4"),
        ("".join(random.Random(9).choices([chr(c) for c in range(0x0E01, 0x0E2F)], k=80)), cfg, None),  # Thai
        ("\n".join("".join(zh[10 * i : 10 * i + 10]) + "。" for i in range(8)), c4, None),
    ]
    # one span of 10 units repeated once covers 20 of `total` units: each total lands in one rule's window
    for n, total in {5: 120, 6: 138, 7: 148, 8: 160, 9: 175, 10: 190}.items():
        docs.append((" ".join(with_repeat(w[10:], w[:10], 2, total)), cfg, f"dup_ngram_{n}"))
        docs.append(("".join(with_repeat(zh[10:], zh[:10], 2, total)), cfg, f"dup_ngram_{n}"))
    return docs


def odd_whitespace(rng: random.Random, words: list[str]) -> str:
    """Words joined by random runs of every kind of space, with look-alikes inside words."""
    out = []
    for word in words:
        if rng.random() < 0.1:
            word = word[:2] + rng.choice(NOT_SPACES) + word[2:]
        out.append(word + "".join(rng.choices(SPACES + "  \n", k=rng.randint(1, 3))))
    return rng.choice(["", " ", "\n", "\u3000"]) + "".join(out)


def random_document(rng: random.Random, w: list[str], zh: list[str]) -> str:
    """A document mixing lines, paragraphs, bullets, ellipses, symbols, repeats, CJK and odd spaces."""
    cjk = rng.random() < 0.4
    pool = zh if cjk else w
    n_units = rng.choice([0, 1, 3, 40, 80, 150, 300, 600])
    units = [rng.choice(pool[: rng.choice([1, 20, 200, len(pool)])]) for _ in range(n_units)]
    if units and rng.random() < 0.5:  # repeat a span
        m = rng.randint(2, 12)
        i = rng.randrange(len(units))
        for _ in range(rng.randint(1, 4 if m > 4 else 30)):
            j = rng.randrange(len(units) + 1)
            units[j:j] = units[i : i + m]
    if rng.random() < 0.25:
        return odd_whitespace(rng, units)
    text, sep = [], "" if cjk else " "
    for u in units:
        text.append(u)
        r = rng.random()
        text.append(
            sep
            if r < 0.8
            else rng.choice(["\n", "\n\n", "...\n", "…\n", "\n- ", "\n• ", " # ", "\n \n", "。"])
        )
    lines = "".join(text).split("\n")
    if rng.random() < 0.3:  # duplicate lines
        for _ in range(rng.randint(1, len(lines))):
            lines.insert(rng.randrange(len(lines) + 1), rng.choice(lines))
    return "\n".join(lines)


def test_char_table_matches_python_predicates():
    """The per-code-point table equals the per-character predicates for all of Unicode, and re's \\s is
    exactly str.isspace (what str.split / str.strip use)."""
    cps = np.arange(0x110000, dtype=np.uint32)
    flags = textarrays.table().lookup(cps)
    chars = "".join(map(chr, range(0x110000)))
    space = np.fromiter(map(str.isspace, chars), dtype=bool, count=len(chars))
    alpha = np.fromiter(map(str.isalpha, chars), dtype=bool, count=len(chars))
    regex_space = np.array([bool(re.match(r"\s", c)) for c in chars])
    word = np.array([bool(re.match(r"[^\W\d_]", c)) for c in chars])
    cjk = np.array([bool(textarrays.CJK.match(c)) for c in chars])
    assert np.array_equal(regex_space, space) and space.sum() == len(SPACES)
    assert set(SPACES) == {c for c in chars if c.isspace()} and not any(c.isspace() for c in NOT_SPACES)
    assert not (space & (word | alpha)).any()  # a letter is never a space: counts may ignore spaces
    for bit, expected in [(textarrays.SPACE_F, space), (textarrays.ALPHA_F, alpha), (textarrays.WORD_F, word),
                          (textarrays.CJK_F, cjk)]:  # fmt: skip
        assert np.array_equal((flags & bit) != 0, expected), bit
    bullets = np.isin(cps, [ord(b) for b in textarrays.BULLETS])
    assert np.array_equal((flags & textarrays.BULLET_F) != 0, bullets) and bullets.sum() == len(
        textarrays.BULLETS
    )
    assert np.array_equal(textarrays.table().hashes[cps[:0x3100]], [hash(c) for c in chars[:0x3100]])


def test_words_match_str_split():
    """Word boundaries equal str.split() around every space, look-alike, and document boundary."""
    rng = random.Random(0)
    texts = [f"ab{c}cd{c}{c}e{c}" for c in SPACES + NOT_SPACES] + ["", " ", "x", "\u3000y\u3000", "z"]
    texts += [odd_whitespace(rng, vocabulary(20, i)) for i in range(20)]
    _, flags, offsets = textarrays.encode(texts)
    wstart, wend, wdoc = textarrays.words((flags & textarrays.SPACE_F) != 0, offsets)
    joined = "".join(texts)
    got = [[joined[s:e] for s, e, d in zip(wstart, wend, wdoc) if d == i] for i in range(len(texts))]
    assert got == [t.split() for t in texts]


def test_crafted_documents_every_reason():
    docs = crafted()
    for text, cfg, expected in docs:  # the constructions hit the rule they are meant for
        assert quality_check(text, cfg)[1] == expected, (expected, text[:80])
    reasons = {r for _, _, r in docs} - {None}
    rules = {"too_short", "too_long", "mean_word_length", "alpha_ratio", "symbol_ratio", "bullet_lines",
             "ellipsis_lines", "c4_lorem_ipsum", "c4_too_few_lines"} | REPETITION  # fmt: skip
    assert reasons == rules
    for cfg in {id(c): c for _, c, _ in docs}.values():
        texts = [t for t, c, _ in docs if c is cfg]
        assert_filters_equal(texts, cfg)
        assert_filters_equal(texts, cfg, chunk=1)
    texts = [t for t, _, _ in docs]
    for cfg in CONFIGS.values():  # every document under every configuration, one batch
        assert_filters_equal(texts, cfg)


def test_random_documents_and_small_parts(monkeypatch):
    rng = random.Random(1)
    w, zh = vocabulary(400, 2, length=4) + vocabulary(100, 3, length=9), han(600)
    texts = [random_document(rng, w, zh) for _ in range(500)]
    seen = set()
    for cfg in CONFIGS.values():
        seen |= set(assert_filters_equal(texts, cfg, chunk=97))
    assert {"too_short", "symbol_ratio", "dup_lines", "top_ngram_2", "dup_ngram_5", None} <= seen
    assert {"c4_too_few_lines", "top_ngram_1", "dup_ngram_12"} <= seen
    assert_signatures_equal(MinHasher(DedupConfig()), texts)
    # batches cut into parts of a few documents (long documents alone), MinHash blocks of 100 shingles
    monkeypatch.setattr(textarrays, "BATCH_CHARS", 300)
    monkeypatch.setattr(dedup, "_BATCH_BLOCK", 100)
    assert_filters_equal(texts, CONFIGS["default"])
    assert_signatures_equal(MinHasher(DedupConfig()), texts[:100])


def test_document_boundaries():
    """Adjacent documents share no word, line, ellipsis or n-gram: the batch joins them without separators."""
    w = vocabulary(200, 6)
    body = "\n".join(" ".join(w[i : i + 30]) for i in (0, 30))
    texts = ["abc.", "..\n" + body, body + " xyz", "xyz " + body, "- " + body, body + "..", ".\n" + body]
    texts += ["".join(han(60)) + "。", "".join(han(60, 30)), "".join(han(60)) + "。"]
    for cfg in CONFIGS.values():
        assert_filters_equal(texts, cfg)
    assert_signatures_equal(MinHasher(DedupConfig()), texts)
    # a rule with a negative limit applies only to documents with at least n units
    short = FilterConfig(min_words=5, min_chars_cjk=5, max_top_ngram_chars={}, max_dup_ngram_chars={12: -1.0})
    texts = [" ".join(w[:8]), " ".join(w[:20]), "".join(han(8)), "".join(han(20))]
    assert assert_filters_equal(texts, short) == [None, "dup_ngram_12"] * 2


def test_degenerate_inputs():
    cfg = FilterConfig()
    texts = ["", " ", "\n\n", "word", "中", "\u3000", "\ud800 lone surrogate " * 20, "x\ud800" * 60]
    assert_filters_equal(texts, cfg)
    assert quality_check_many([], cfg) == ([], []) and cjk_flags([]).shape == (0,)
    assert quality_check_many(texts[:2], cfg, np.zeros(2, dtype=bool))[1] == ["too_short"] * 2
    with pytest.raises(ValueError):
        quality_check_many(texts, cfg, np.zeros(3, dtype=bool))
    zero = FilterConfig(min_words=0)  # a document without words reaches the mean word length: both fail
    with pytest.raises(ZeroDivisionError):
        quality_check(" ", zero)
    with pytest.raises(ZeroDivisionError):
        quality_check_many(["a few words here", " "], zero)
    mh = MinHasher(DedupConfig())
    bands, sigs = mh.signatures([])
    assert bands.shape == (0, 20) and sigs.shape == (0, 120)
    assert_signatures_equal(mh, texts[:6])
    for text in texts[6:]:  # the per-document encode fails on a lone surrogate: so does the batch
        with pytest.raises(UnicodeEncodeError):
            mh.signature(text)
        with pytest.raises(UnicodeEncodeError):
            mh.signatures(["fine text", text])


def test_signatures_crafted(monkeypatch):
    w = vocabulary(300, 4)
    texts = [
        "", "one", "two words", " ".join(w[:4]), " ".join(w[:5]), " ".join(w[:200]),  # shorter than ngram too
        "Ünïcödé WORDS with é, 中文 and 😀 emoji " * 5, "İSTANBUL ΣΊΣΥΦΟΣ straße " * 4,  # lower() changes length
        ("x" * 63 + " ") * 3 + "y" * 64 + " " + "z" * 65 + " " + "é" * 40 + " " + "長" * 30,  # around _CRC_MAX
        "".join(han(300)), "".join(han(3)), " 中 文 有 空 格 " * 10, odd_whitespace(random.Random(5), w[:100]),
        "\n".join("".join(han(12, 12 * i)) for i in range(40)),
    ]  # fmt: skip
    for cfg in (DedupConfig(), DedupConfig(ngram=1, bands=4, rows=3), DedupConfig(ngram=9, seed=7)):
        assert_signatures_equal(MinHasher(cfg), texts)
        assert_signatures_equal(MinHasher(cfg), texts, chunk=3)
    monkeypatch.setattr(dedup, "_BATCH_BLOCK", 5)  # documents spanning several blocks
    monkeypatch.setattr(textarrays, "BATCH_CHARS", 50)
    assert_signatures_equal(MinHasher(DedupConfig()), texts)


def test_crc32_many_equals_zlib():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 150, 500)
    data = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    got = dedup._crc32_many(data, starts, ends)
    assert got.tolist() == [zlib.crc32(data[s:e].tobytes()) for s, e in zip(starts, ends)]


# --- the shared corpus --------------------------------------------------------------------------------------


def repetitive(text: str, rng: random.Random) -> str:
    """A copy of ``text`` made repetitive: duplicated lines, a repeated short paragraph, a span of >= 10
    units repeated to cover about the window of one dup_ngram rule, or a 2..4-gram repeated to fire one
    top_ngram rule."""
    cjk = is_cjk(text)
    mode = rng.choice(["lines", "paragraphs", "span", "span", "short"])
    if mode == "lines":
        lines = text.split("\n")
        for _ in range(rng.randint(1, max(1, len(lines) // 2))):
            lines.insert(rng.randrange(len(lines) + 1), rng.choice(lines))
        return "\n".join(lines)
    if mode == "paragraphs":  # one body paragraph, a short one repeated: few duplicate lines, many paragraphs
        lines = [x for x in text.split("\n") if x.strip()]
        return "\n".join(lines) + ("\n\n" + rng.choice(lines)) * rng.randint(1, 2)
    spans = [m.span() for m in re.finditer(r"\S" if cjk else r"\S+", text)]
    total = sum(b - a for a, b in spans)
    if mode == "span":
        f = rng.choice([0.2, 0.145, 0.135, 0.125, 0.115, 0.105, rng.uniform(0.05, 0.3)])
        copies, m = rng.randint(1, 2), 10
        target = f * total / (copies + 1 - f * copies)  # characters of the span to cover about f
        while m < len(spans) // 2 and sum(b - a for a, b in spans[:m]) < target:
            m += 1
    else:
        m = rng.randint(2, 4)
        f = {2: 0.28, 3: 0.24, 4: 0.2}[m] + rng.uniform(-0.02, 0.02)  # the m-gram fires, shorter ones not
        copies = None
    i = rng.randrange(max(1, len(spans) - m))
    piece = text[spans[i][0] : spans[min(i + m, len(spans)) - 1][1]]
    if copies is None:
        copies = max(1, int(f * total / max(sum(b - a for a, b in spans[i : i + m]), 1)))
    for _ in range(copies):
        at = rng.choice(spans)[0]
        text = text[:at] + piece + ("" if cjk else " ") + text[at:]
    return text


@pytest.fixture(scope="module")
def corpus(shared_dir: Path) -> dict[str, list[str]]:
    """The first 3,000 documents of each corpus file (en and code have fewer)."""
    out = {}
    for name in ("en", "zh", "code"):
        with gzip.open(shared_dir / "corpus" / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            out[name] = [json.loads(line)["text"] for line in itertools.islice(f, 3000)]
    return out


def test_corpus_filters_and_signatures(corpus):
    cfg, mh = FilterConfig(), MinHasher(DedupConfig())
    for name, texts in corpus.items():
        reasons = assert_filters_equal(texts, cfg)
        assert None in reasons and len(set(reasons)) >= 2, name  # real decisions, not all one way
        assert_signatures_equal(mh, texts)
    rng = random.Random(0)
    sources = [t for t in corpus["zh"] if len(t) >= 80][:150]
    sources += [t[: rng.randint(2000, 8000)] for t in corpus["en"][:120] + corpus["code"][:100]]
    variants = [repetitive(t, rng) for t in sources]
    reasons = assert_filters_equal(variants, cfg)
    assert REPETITION <= set(reasons), REPETITION - set(reasons)  # every repetition rule fires
    assert_filters_equal(variants, FilterConfig(c4_lines=True))
    assert_signatures_equal(mh, variants)

"""Cleaning, quality filters on crafted documents, near-duplicate recall / false positives, packing."""

from __future__ import annotations

import numpy as np

from llmtrain.data.prep.clean import clean_text, repair_mojibake
from llmtrain.data.prep.dedup import DedupConfig, DedupIndex, MinHasher, jaccard
from llmtrain.data.prep.filters import FilterConfig, is_cjk, quality_check
from llmtrain.data.prep.pack import pack_all

WORDS = ("river stone garden window letter harbor candle meadow silver thunder lantern orchard valley "
         "compass feather marble velvet canyon blossom timber").split()  # fmt: skip


def prose(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), n_words)]
    return " ".join(" ".join(words[i : i + 12]) + "." for i in range(0, n_words, 12))


def test_clean_text():
    assert clean_text("a\r\nb\x00c\u200b  \n\n\n\n\nd  ") == "a\nbc\n\n\nd"
    assert clean_text("ﬁ", "NFKC") == "fi" and clean_text("e\u0301") == "é"
    assert repair_mojibake("cafÃ© â€œokâ€\x9d") == "café “ok”"
    assert repair_mojibake("plain café") == "plain café"


def test_filters_on_crafted_documents():
    cfg = FilterConfig()
    good = prose(300, 0)
    assert quality_check(good, cfg)[1] is None
    assert quality_check("too few words here.", cfg)[1] == "too_short"
    assert quality_check(" ".join(["a"] * 80), cfg)[1] == "mean_word_length"
    assert quality_check(" ".join(["#### ###"] * 60), cfg)[1] in ("alpha_ratio", "symbol_ratio")
    repeated = "\n".join(["the same line over and over again here"] * 30)
    assert quality_check(repeated, cfg)[1] == "dup_lines"
    spam = " ".join(["buy cheap watches now"] * 40)
    assert quality_check(spam, cfg)[1] == "top_ngram_2"
    bullets = "\n".join(f"- {w} item number here" for w in WORDS * 3)
    assert quality_check(bullets, cfg)[1] == "bullet_lines"
    # Chinese is measured in characters: 60 distinct characters pass, 20 fail
    zh = "".join(chr(0x4E00 + 37 * i) for i in range(60)) + "。"
    assert is_cjk(zh) and quality_check(zh, cfg)[1] is None
    assert quality_check(zh[:20], cfg)[1] == "too_short"
    assert quality_check(zh * 6, cfg)[1] is not None  # six copies of the same run: repetition
    c4 = FilterConfig(c4_lines=True)
    page = good.replace(". ", ".\n") + "\nClick here\nThis site uses cookies to track you."
    kept, reason = quality_check(page, c4)
    assert reason is None and "Click here" not in kept and "cookies" not in kept


def planted_pairs(target: float, n: int, rng) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Shingle sets of size 200 and copies with a fraction replaced so Jaccard is about ``target``."""
    base, copies = [], []
    for _ in range(n):
        a = rng.choice(2**32, 200, replace=False).astype(np.uint64)
        keep = int(round(2 * 200 * target / (1 + target)))  # |A & B| / |A | B| = k / (400 - k)
        b = np.concatenate([a[:keep], rng.choice(2**32, 200 - keep).astype(np.uint64)])
        base.append(np.unique(a))
        copies.append(np.unique(b))
    return base, copies


def detection_rate(target: float, n: int, seed: int) -> tuple[float, float]:
    cfg = DedupConfig()
    mh = MinHasher(cfg)
    base, copies = planted_pairs(target, n, np.random.default_rng(seed))
    found, sims = 0, []
    for a, b in zip(base, copies):
        index = DedupIndex(cfg)
        sa, sb = mh.signature_of(a), mh.signature_of(b)
        index.check(1, mh.band_keys(sa), (sa & 0xFFFF).astype(np.uint16))
        found += index.check(2, mh.band_keys(sb), (sb & 0xFFFF).astype(np.uint16)) == "near_duplicate"
        sims.append(jaccard(a, b))
    return found / n, float(np.mean(sims))


def test_near_duplicate_recall_and_false_positives():
    recall, sim = detection_rate(0.8, 400, 0)
    assert sim >= 0.79 and recall >= 0.9, (recall, sim)
    fp, sim = detection_rate(0.45, 400, 1)
    assert sim < 0.5 and fp <= 0.01, (fp, sim)
    fp_low, _ = detection_rate(0.2, 200, 2)
    assert fp_low == 0.0


def test_text_level_dedup():
    mh, cfg = MinHasher(DedupConfig()), DedupConfig()
    index = DedupIndex(cfg)
    doc = prose(400, 3)
    near = doc.replace("river", "ocean", 2)  # a couple of edits: still >0.9 similar
    other = prose(400, 4)
    results = [index.check(d, *mh.signature(t)) for d, t in [(1, doc), (1, doc), (2, near), (3, other)]]
    assert results == [None, "exact_duplicate", "near_duplicate", None]


def test_bestfit_truncates_less_than_concat():
    rng = np.random.default_rng(0)
    docs = [np.arange(int(n)) for n in rng.integers(20, 400, 500)]
    concat_groups, concat = pack_all("concat", docs, 255)
    bins, best = pack_all("bestfit", docs, 255)
    assert best.truncated_documents < concat.truncated_documents
    assert best.tokens == concat.tokens == sum(map(len, docs))
    for group in bins:  # every bin fits, every token is kept exactly once
        assert all(len(s) <= 256 for s in group)
    assert sum(len(s) for g in bins for s in g) == best.tokens
    stats = best.as_dict(256)
    assert best.samples * 256 - best.padding_tokens == best.tokens
    assert 0 <= stats["padding_rate"] < 0.1 and concat.padding_tokens == 0
    long_doc = [np.arange(1000)]
    groups, s = pack_all("bestfit", long_doc, 255)
    assert s.truncated_documents == 1 and [len(x) for x in groups[0]] == [256, 256, 256, 232]

"""Text cleaning: Unicode normalization, control characters, whitespace, optional mojibake repair.

:func:`clean_text` is a pure function of the text and the options, applied to each document before the quality
filters and before hashing for deduplication (so two documents that differ only in whitespace or Unicode
composition are exact duplicates). It is deliberately conservative, in the order applied:

1. mojibake repair (off by default): text that was UTF-8 decoded as cp1252/latin-1 (``"cafÃ©"``, ``"â€™"``) is
   re-encoded and decoded again, kept only when that removes every marker and decodes cleanly;
2. Unicode normalization (``NFC`` by default; ``NFKC`` folds full-width forms and ligatures, ``none`` keeps);
3. control characters: C0/C1 controls other than tab and newline, and zero-width/BOM characters, are removed;
   ``\\r\\n`` and lone ``\\r`` become ``\\n``;
4. whitespace: trailing spaces are stripped from every line, and more than two consecutive blank lines collapse
   to two. Runs of spaces inside a line are kept (they carry meaning in code and tables).

All regexes are compiled once at import; the cost is a few passes over the string in C.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Literal, cast

NORMALIZATION_FORMS = ("NFC", "NFKC", "NFD", "NFKD", "none")
_UnicodeForm = Literal["NFC", "NFD", "NFKC", "NFKD"]
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\u200c\u200e\u200f\u2028\u2029\ufeff]")
_TRAILING = re.compile(r"[ \t\u3000]+(?=\n|\Z)")
_BLANK_RUNS = re.compile(r"\n{4,}")
_MOJIBAKE = re.compile(
    "[ÃÂâ][\x80-\xbf\u0152\u0153\u0160\u0161\u0178\u017d\u017e\u0192\u02c6\u02dc\u2013-\u2122]"
)


_CP1252_ONLY = frozenset(bytes(range(0x80, 0xA0)).decode("cp1252", errors="ignore"))


def repair_mojibake(text: str) -> str:
    """Undo one round of UTF-8-read-as-cp1252/latin-1, if that is clearly what happened; else ``text``."""
    if not _MOJIBAKE.search(text):
        return text
    try:  # cp1252 where it has the character, latin-1 for the 5 bytes cp1252 leaves undefined
        raw = b"".join(
            c.encode("cp1252") if ord(c) > 0xFF or c in _CP1252_ONLY else c.encode("latin-1") for c in text
        )
        fixed = raw.decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return text
    return text if _MOJIBAKE.search(fixed) else fixed


def clean_text(text: str, normalization: str = "NFC", mojibake: bool = False) -> str:
    """The cleaned document (see the module docstring for the steps)."""
    if mojibake:
        text = repair_mojibake(text)
    if normalization != "none":
        # the option is checked against NORMALIZATION_FORMS where it is read
        text = unicodedata.normalize(cast(_UnicodeForm, normalization), text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    text = _TRAILING.sub("", text)
    text = _BLANK_RUNS.sub("\n\n\n", text)
    return text.strip("\n")

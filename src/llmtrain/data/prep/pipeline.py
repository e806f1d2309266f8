"""The per-document stages of ``prepare`` that run in worker processes: clean -> filter -> hash -> tokenize.

:class:`PrepareOptions` is the ``data.prepare`` config section (every stage switchable; the defaults keep the
foundation's behaviour: no cleaning, no filters, no dedup, ``concat`` packing, one shard). :func:`process_chunk`
applies the pure stages to a chunk of documents and returns compact numpy arrays (cheap to pickle back from a
worker): for each document a status (kept, or the filter's reject reason), its token ids, its exact digest and
its MinHash band keys and signature. Its two halves are :func:`screen_chunk` (clean, filter, hash) and
:func:`tokenize_texts`, which the staged deduplication (``stages/``) runs as separate stages. The stateful stages, deduplication decisions, packing and writing, run in
the main process in input order (see ``parts``), so the output never depends on the worker count.

Duplicates are tokenized before the main process drops them: deciding first would need a second round trip
per chunk; the cost is the duplicate fraction of the tokenizer time.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmtrain.data.indexed import optimal_dtype
from llmtrain.data.prep.clean import NORMALIZATION_FORMS, clean_text
from llmtrain.data.prep.dedup import DedupConfig, MinHasher, exact_digest
from llmtrain.data.prep.filters import FilterConfig
from llmtrain.data.prep.filters_batch import cjk_flags, quality_check_many
from llmtrain.data.prep.pack import PACK_MODES
from llmtrain.data.tokenizer import Tokenizer, load_tokenizer
from llmtrain.errors import ConfigError, DataError

DEDUP_MODES = ("none", "exact", "near")
ON_ERROR = ("raise", "skip")
KEPT = ""  # status of a document that passed the filters


@dataclass(frozen=True)
class PrepareOptions:
    """The ``data.prepare`` section: which stages ``llmtrain prepare`` runs and how (immutable: a job's
    settings; derive a variant with ``dataclasses.replace``)."""

    text_key: str = "text"
    """JSON field (or parquet column) holding the document text."""
    clean: bool = False
    """Unicode normalization, control characters and trailing whitespace (see data/prep/clean.py)."""
    normalization: str = "NFC"
    """Unicode normal form of the cleaning stage: NFC, NFKC, NFD, NFKD or none."""
    mojibake: bool = False
    """Repair UTF-8 text that was decoded as cp1252/latin-1 (part of the cleaning stage)."""
    filter: bool = False
    """Apply the Gopher quality and repetition filters (thresholds in `filters`)."""
    filters: FilterConfig = field(default_factory=FilterConfig)
    """Thresholds of the quality filters; defaults from Gopher and C4 (see data/prep/filters.py)."""
    dedup: str = "none"
    """none, exact (hash of the cleaned text) or near (exact + MinHash/LSH near-duplicates)."""
    minhash: DedupConfig = field(default_factory=DedupConfig)
    """MinHash n-gram size, LSH bands and rows, verification threshold (see data/prep/dedup.py)."""
    pack: str = "concat"
    """concat (Megatron: concatenate and cut windows) or bestfit (best-fit-decreasing bins, fewer truncations)."""
    seq_length: int = 2048
    """Sample length the packing is planned for (bestfit bins hold seq_length + 1 tokens); the loader checks it."""
    num_shards: int = 1
    """Number of .bin/.idx shards (1: PREFIX.bin/.idx; N: PREFIX_00000.bin ... listed in PREFIX.manifest.json)."""
    on_error: str = "raise"
    """raise: a malformed input line is an error naming file and line; skip: skip and count it in the report."""
    rejects: str | None = None
    """Write rejected documents (filters and duplicates) with their reason to this jsonl file."""

    def validate(self) -> None:
        """ConfigError naming the first invalid option."""
        checks = [
            ("normalization", self.normalization, NORMALIZATION_FORMS),
            ("dedup", self.dedup, DEDUP_MODES),
            ("pack", self.pack, PACK_MODES),
            ("on_error", self.on_error, ON_ERROR),
        ]
        for name, value, allowed in checks:
            if value not in allowed:
                raise ConfigError(
                    f"data.prepare.{name} = {value!r} is not valid; use one of {list(allowed)}."
                )
        for name in ("seq_length", "num_shards"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"data.prepare.{name} = {getattr(self, name)} must be at least 1.")
        m = self.minhash
        if m.bands < 1 or m.rows < 1 or m.ngram < 1 or not 0 < m.threshold <= 1:
            raise ConfigError(
                f"data.prepare.minhash = {dataclasses.asdict(m)}: bands, rows and ngram must be positive and "
                f"threshold in (0, 1]."
            )

    def identity(self) -> dict:
        """Everything that changes the output (for resume checks and the manifest)."""
        d = dataclasses.asdict(self)
        d["filters"]["max_top_ngram_chars"] = {
            str(k): v for k, v in d["filters"]["max_top_ngram_chars"].items()
        }
        d["filters"]["max_dup_ngram_chars"] = {
            str(k): v for k, v in d["filters"]["max_dup_ngram_chars"].items()
        }
        return d


def options_from(section: Any) -> PrepareOptions:
    """PrepareOptions from a ``data.prepare`` dict / object (unknown keys are a ConfigError)."""
    if section is None:
        return PrepareOptions()
    if isinstance(section, PrepareOptions):
        return section
    raw = dict(section) if isinstance(section, dict) else dataclasses.asdict(section)
    known = {f.name for f in dataclasses.fields(PrepareOptions)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"data.prepare has unknown keys {unknown}; valid keys: {sorted(known)}.")
    if isinstance(raw.get("filters"), dict):
        raw["filters"] = _sub(FilterConfig, raw["filters"], "filters")
    if isinstance(raw.get("minhash"), dict):
        raw["minhash"] = _sub(DedupConfig, raw["minhash"], "minhash")
    opts = PrepareOptions(**raw)
    opts.validate()
    return opts


def _sub(cls: type, raw: dict, name: str) -> Any:
    raw = dict(raw)  # the caller's dict (a manifest's, a config's) stays as it was: int keys only here
    known = {f.name for f in dataclasses.fields(cls)}
    if set(raw) - known:
        raise ConfigError(
            f"data.prepare.{name} has unknown keys {sorted(set(raw) - known)}; valid: {sorted(known)}."
        )
    for key in ("max_top_ngram_chars", "max_dup_ngram_chars"):
        if key in raw:
            raw[key] = {int(k): float(v) for k, v in raw[key].items()}
    return cls(**raw)


@dataclass
class ChunkResult:
    """What a worker returns for a chunk of N documents (arrays, to pickle cheaply)."""

    status: list[str]  # [N] KEPT or the filter's reject reason
    lengths: np.ndarray  # [N] int64 tokens of each kept document including its EOS (0 for rejected)
    tokens: np.ndarray  # [sum(lengths)] token ids in the shard dtype, back to back, each document + EOS
    digests: np.ndarray | None  # [N] uint64 exact digests (None without dedup)
    bands: np.ndarray | None  # [N, B] uint64 LSH band keys (None without near dedup)
    sigs: np.ndarray | None  # [N, P] uint16 signatures


def cached_tokenizer(path: str, eos_token: str | None) -> Tokenizer:
    """The tokenizer at ``path``, loaded once per process (workers keep it between chunks; forked workers
    inherit the main process's copy). Keyed by the file's size and modification time: a replaced file reloads."""
    try:
        st = os.stat(path)
    except OSError:
        return load_tokenizer(path, eos_token)  # raises the clear error
    return _load_cached(path, eos_token, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _load_cached(path: str, eos_token: str | None, size: int, mtime_ns: int) -> Tokenizer:
    return load_tokenizer(path, eos_token)


@functools.lru_cache(maxsize=2)
def _minhasher(cfg: DedupConfig) -> MinHasher:
    return MinHasher(cfg)


@dataclass
class Screened:
    """What the stages before tokenization make of a chunk of N documents (:func:`screen_chunk`)."""

    status: list[str]  # [N] KEPT or the cleaning / filter reject reason
    texts: list[str]  # [K] the kept documents' texts as tokenized and hashed (cleaned, C4 lines removed)
    digests: np.ndarray | None  # [K] uint64 exact digests (None without dedup)
    bands: np.ndarray | None  # [K, B] uint64 LSH band keys (None without near dedup)
    sigs: np.ndarray | None  # [K, P] uint16 signatures


def screen_chunk(texts: list[str], opts: PrepareOptions) -> Screened:
    """Clean, filter and hash one chunk of documents: the pure stages before tokenization (``prepare``'s
    workers run them inside :func:`process_chunk`; the staged dedup's first stage runs them alone)."""
    if opts.clean:
        texts = [clean_text(t, opts.normalization, opts.mojibake) for t in texts]
    status = [KEPT if t else "empty" for t in texts]
    kept_texts = [t for t in texts if t]
    cjk = None  # CJK flags of kept_texts, computed once for the filters and MinHash
    if opts.filter and kept_texts:  # all documents of the chunk at once (filters_batch.quality_check_many)
        if not opts.filters.c4_lines:
            cjk = cjk_flags(kept_texts)
        filtered, reasons = quality_check_many(kept_texts, opts.filters, cjk)
        where = [i for i, st in enumerate(status) if st == KEPT]
        for i, reason in zip(where, reasons):
            if reason:
                status[i] = reason
        keep = [r is None for r in reasons]
        kept_texts = [t for t, k in zip(filtered, keep) if k]
        cjk = None if cjk is None else cjk[np.asarray(keep, dtype=bool)]
    digests = bands = sigs = None
    if opts.dedup != "none":
        digests = np.asarray([exact_digest(t) for t in kept_texts], dtype=np.uint64)
        if opts.dedup == "near":  # one batched MinHash over the chunk
            bands, sigs = _minhasher(opts.minhash).signatures(kept_texts, cjk)
    return Screened(status, kept_texts, digests, bands, sigs)


def tokenize_texts(texts: list[str], tok: Tokenizer, tok_path: str) -> tuple[np.ndarray, np.ndarray]:
    """(lengths [K] int64 including the EOS, token ids back to back in the shard dtype) of ``texts``."""
    ids = tok.encode_batch(texts) if texts else []
    for x in ids:
        x.append(tok.eos_id)  # every document ends with EOS in the shards
    lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
    dtype = optimal_dtype(tok.vocab_size)
    try:  # converting to the shard dtype is also the range check (numpy refuses out-of-range ints)
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    except OverflowError as e:
        raise DataError(
            f"Tokenizer '{tok_path}' produced a token id that does not fit the shard dtype {dtype} chosen for "
            f"its vocabulary of {tok.vocab_size} ({e}); the tokenizer's vocabulary size is wrong."
        ) from e
    return lengths, flat


def process_chunk(
    texts: list[str], opts: PrepareOptions, tok_path: str, eos_token: str | None, tok: Tokenizer | None = None
) -> ChunkResult:
    """Clean, filter, hash and tokenize one chunk of documents (in a worker, or in-process with ``tok``)."""
    tok = tok or cached_tokenizer(tok_path, eos_token)
    s = screen_chunk(texts, opts)
    n = len(texts)
    kept = np.asarray([i for i in range(n) if s.status[i] == KEPT], dtype=np.int64)  # [K]
    kept_lengths, flat = tokenize_texts(s.texts, tok, tok_path)
    lengths = np.zeros(n, dtype=np.int64)
    lengths[kept] = kept_lengths
    digests = bands = sigs = None
    if s.digests is not None:
        digests = np.zeros(n, dtype=np.uint64)
        digests[kept] = s.digests
    if s.bands is not None and s.sigs is not None:
        bands = np.zeros((n, s.bands.shape[1]), dtype=np.uint64)
        sigs = np.zeros((n, s.sigs.shape[1]), dtype=np.uint16)
        bands[kept], sigs[kept] = s.bands, s.sigs
    return ChunkResult(s.status, lengths, flat, digests, bands, sigs)

"""What a dataset prefix is: one description from either our manifest or a plain Megatron ``.bin/.idx``.

Every reader of a run's data (validation, the loader, ``build_run``, ``generate``) asks
:func:`describe_dataset` and gets a :class:`DatasetInfo`: shards, token dtype, tokenizer (vocabulary, EOS,
sha256, file), packing and the fields that identify its tokens. The rule lives here only:

* ``PREFIX.manifest.json`` exists: the manifest says everything (``llmtrain prepare`` / ``merge`` output);
* no manifest, ``PREFIX.bin`` + ``PREFIX.idx`` exist and ``data.tokenizer`` is set: a dataset written by
  Megatron-LM's ``tools/preprocess_data.py`` (``IndexedDatasetBuilder``) or MindFormers' Megatron tool. The
  dtype comes from the ``.idx`` header, vocabulary size, EOS and sha256 from the tokenizer file. Its token ids
  are whole documents back to back (``concat``; a sentence-split document's sequences stay together);
* no manifest and no ``data.tokenizer``: ConfigError naming the prefix (nothing says how to read its ids);
* none of the files: DataError (no dataset there).

Tokenizer facts are memoised per file (path, size, mtime), so describing a dataset repeatedly (``check``,
then the loader, then the run) loads the tokenizer once per process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmtrain.data.indexed import bin_path, idx_path, read_header
from llmtrain.data.manifest import (
    TOKENIZER_SUFFIXES,
    fingerprint_fields,
    manifest_path,
    read_manifest,
    shard_entries,
)
from llmtrain.errors import ConfigError, DataError

MEGATRON = "megatron"  # DatasetInfo.source of a dataset without a manifest
LLMTRAIN = "llmtrain"  # ... of one with our manifest


@dataclass(frozen=True)
class TokenizerFacts:
    """What the data path needs of a tokenizer file (see ``llmtrain.data.tokenizer``)."""

    path: str
    kind: str
    vocab_size: int
    eos_id: int
    bos_id: int | None
    sha256: str


@dataclass
class DatasetInfo:
    """One dataset prefix, described (see the module docstring for where each field comes from)."""

    prefix: str
    source: str
    """``llmtrain`` (our manifest) or ``megatron`` (plain ``.bin/.idx`` + ``data.tokenizer``)."""
    dtype: np.dtype
    vocab_size: int | None
    eos_id: int | None
    tokenizer_sha256: str | None
    tokenizer_file: str | None
    """The tokenizer to decode with: the manifest's copy next to the dataset, else ``data.tokenizer``."""
    shards: list[tuple[str, dict | None]]
    """(shard prefix, the manifest's ``{"files": {"bin": {bytes, sha256}, "idx": ...}}`` or None)."""
    packing: dict = field(default_factory=lambda: {"mode": "concat"})
    manifest: dict | None = None

    def identity(self, checksums: dict[str, str] | None = None) -> dict:
        """The fields that identify the tokens (a run's data fingerprint): the manifest's, or for a Megatron
        dataset the tokenizer, dtype, header counts and the files' sha256 (``checksums``: file name -> sha256,
        from ``llmtrain.data.verify``)."""
        if self.manifest is not None:
            return fingerprint_fields(self.manifest)
        dtype, n_seq, n_doc = read_header(self.prefix)
        return {
            "source": MEGATRON,
            "tokenizer_sha256": self.tokenizer_sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "dtype": dtype.name,
            "sequences": n_seq,
            "documents": max(n_doc - 1, 0),
            "files": dict(sorted((checksums or {}).items())),
        }

    def tokenizer_path(self) -> Path:
        """:attr:`tokenizer_file` as a path; DataError when the dataset has none on this machine."""
        if self.tokenizer_file is None or not Path(self.tokenizer_file).is_file():
            raise DataError(
                f"Dataset prefix '{self.prefix}' has no tokenizer on this machine (no PREFIX.tokenizer.json or "
                f"PREFIX.tokenizer.model copy{'' if self.tokenizer_file is None else f', no {self.tokenizer_file}'}"
                f"); set data.tokenizer to the tokenizer file it was made with, or run `llmtrain prepare` again."
            )
        return Path(self.tokenizer_file)


_TOKENIZERS: dict[tuple[str, int, int], TokenizerFacts] = {}


def tokenizer_facts(path: str) -> TokenizerFacts:
    """Vocabulary, EOS/BOS and sha256 of tokenizer file ``path`` (DataError if unreadable), memoised."""
    from llmtrain.data.tokenizer import load_tokenizer

    p = Path(path)
    if not p.is_file():
        load_tokenizer(path)  # raises the DataError that explains a missing file
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _TOKENIZERS:
        tok = load_tokenizer(path)
        _TOKENIZERS[key] = TokenizerFacts(path, tok.kind, tok.vocab_size, tok.eos_id, tok.bos_id, tok.sha256)
    return _TOKENIZERS[key]


def missing_files(prefix: str) -> list[str]:
    """Files of dataset ``prefix`` that are absent: the manifest's shards, else ``PREFIX.bin`` / ``.idx`` (a
    plain Megatron dataset needs no manifest); empty when the dataset is on this machine."""
    if manifest_path(prefix).is_file():
        try:
            shards = shard_entries(prefix, read_manifest(prefix))
        except DataError:
            return []  # present but invalid: describe_dataset says why
        paths = [p for s, _ in shards for p in (bin_path(s), idx_path(s))]
    else:
        paths = [bin_path(prefix), idx_path(prefix)]
    return [str(p) for p in paths if not p.is_file()]


def describe_dataset(prefix: str, tokenizer: str | None = None, where: str | None = None) -> DatasetInfo:
    """The description of dataset ``prefix`` (``tokenizer``: ``data.tokenizer``; ``where``: the config key that
    names the prefix, for messages). Raises as the module docstring says."""
    where = where or "dataset"
    if manifest_path(prefix).is_file():
        return _from_manifest(prefix, tokenizer)
    if not bin_path(prefix).is_file() or not idx_path(prefix).is_file():
        raise DataError(
            f"{where} = '{prefix}': no dataset at this prefix (no {prefix}.manifest.json, and "
            f"{' and '.join(str(p) for p in (bin_path(prefix), idx_path(prefix)) if not p.is_file())} "
            f"missing). Create it with `llmtrain prepare --output {prefix} ...` or fix the path (relative paths are "
            f"relative to the working directory)."
        )
    if not tokenizer:
        raise ConfigError(
            f"{where} = '{prefix}': {prefix}.bin/.idx has no {prefix}.manifest.json (it was not written by "
            f"`llmtrain prepare`: a Megatron-LM or MindFormers dataset, or an interrupted prepare), so nothing says "
            f"which tokenizer its ids belong to. Set data.tokenizer to the tokenizer file it was made with "
            f"(tokenizer.json or a SentencePiece .model), or run `llmtrain prepare --output {prefix}` again."
        )
    tok = tokenizer_facts(tokenizer)
    dtype, _, _ = read_header(prefix)
    return DatasetInfo(
        prefix=str(prefix),
        source=MEGATRON,
        dtype=dtype,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        tokenizer_sha256=tok.sha256,
        tokenizer_file=tokenizer,
        shards=[(str(prefix), None)],
    )


def try_describe(prefix: str, tokenizer: str | None = None) -> DatasetInfo | None:
    """:func:`describe_dataset`, or None where it would refuse because the dataset or a way to read it (the
    manifest, or ``data.tokenizer``) is missing. An invalid manifest still raises."""
    if not manifest_path(prefix).is_file() and (
        missing_files(prefix) or not tokenizer or not Path(tokenizer).is_file()
    ):
        return None
    return describe_dataset(prefix, tokenizer)


def _from_manifest(prefix: str, tokenizer: str | None) -> DatasetInfo:
    manifest = read_manifest(prefix)
    tok = manifest.get("tokenizer") or {}
    folder = Path(prefix).parent
    copy = folder / tok["file"] if tok.get("file") else None
    if copy is None or not copy.is_file():
        copy = next((c for s in TOKENIZER_SUFFIXES if (c := Path(f"{prefix}{s}")).is_file()), copy)
    file = str(copy) if copy is not None and copy.is_file() else tokenizer
    return DatasetInfo(
        prefix=str(prefix),
        source=LLMTRAIN,
        dtype=np.dtype(manifest["dtype"]),
        vocab_size=tok.get("vocab_size"),
        eos_id=tok.get("eos_id"),
        tokenizer_sha256=tok.get("sha256"),
        tokenizer_file=file,
        shards=[(s, entry) for s, entry in shard_entries(prefix, manifest)],
        packing=manifest.get("packing") or {"mode": "concat"},
        manifest=manifest,
    )

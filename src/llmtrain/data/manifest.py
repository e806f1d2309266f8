"""``PREFIX.manifest.json``: what a token dataset is, so it is self-contained and verifiable.

A dataset prefix names four files: ``PREFIX.bin``, ``PREFIX.idx`` (Megatron format, see ``indexed``),
``PREFIX.tokenizer.json`` or ``PREFIX.tokenizer.model`` (a copy of the tokenizer) and this manifest::

    {"format": "llmtrain.tokens", "version": 1,
     "tokenizer": {"file", "kind": "hf"|"sentencepiece", "sha256", "vocab_size", "eos_id", "bos_id"},
     "dtype": "uint16"|"int32", "documents": n, "tokens": n,
     "files": {"bin": {"name", "bytes", "sha256"}, "idx": {...}},
     "shards": [{"name", "documents", "sequences", "tokens", "files": {"bin", "idx"}}, ...],
     "packing": {"mode": "concat"|"bestfit", "seq_length"}, "prepare": {"key", "options"}, "report": {...},
     "inputs": [...], "created_by": "llmtrain <version>"}

One shard is ``PREFIX.bin/.idx`` (and ``files`` describes it, as in the foundation); N shards are
``PREFIX_00000.bin/.idx`` ... listed in ``shards`` (``files`` is then empty). A manifest without ``shards``
(older, or hand-written) is one shard at the prefix itself.

The manifest is written last and atomically by ``prepare``: its presence means the shard is complete. It
carries the sha256 of its own content (``manifest_sha256``), so a manifest edited or damaged afterwards is refused. Its
checksums feed the loader's fingerprint (a resumed run must read the same tokens). File names inside it are
relative to the manifest's folder, so a dataset folder can be moved or copied as a whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from llmtrain.errors import DataError

FORMAT = "llmtrain.tokens"
VERSION = 1
TOKENIZER_SUFFIXES = (".tokenizer.json", ".tokenizer.model")
REQUIRED_KEYS = ("format", "version", "tokenizer", "dtype", "documents", "tokens", "files")


def manifest_path(prefix: str) -> Path:
    """``PREFIX.manifest.json``."""
    return Path(f"{prefix}.manifest.json")


def read_manifest(prefix: str) -> dict:
    """The manifest of dataset ``prefix``; DataError naming the prefix if it is missing or invalid."""
    path = manifest_path(prefix)
    if not path.is_file():
        raise DataError(
            f"Dataset prefix '{prefix}' has no manifest '{path}'. Create the dataset with `llmtrain prepare "
            f"--output {prefix} ...` (a missing manifest also means an interrupted prepare: run it again)."
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise DataError(
            f"Manifest '{path}' of dataset '{prefix}' is not valid JSON ({str(e)[:200]}); run prepare again."
        ) from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(manifest, dict) or k not in manifest]
    if missing or manifest.get("format") != FORMAT:
        raise DataError(
            f"Manifest '{path}' of dataset '{prefix}' is not an {FORMAT} manifest (missing keys: "
            f"{', '.join(missing) or 'none'}; format: {manifest.get('format') if isinstance(manifest, dict) else None!r})."
        )
    if manifest["version"] != VERSION:
        raise DataError(
            f"Manifest '{path}' has version {manifest['version']}; this llmtrain reads version {VERSION}."
        )
    sealed = manifest.get(SEAL_KEY)
    if sealed is not None and sealed != _seal(manifest):
        raise DataError(
            f"Manifest '{path}' of dataset '{prefix}' was changed after prepare wrote it (its {SEAL_KEY} does not "
            f"match its content); restore it from a copy or run prepare again."
        )
    if not isinstance(manifest["tokenizer"], dict) or not isinstance(manifest["files"], dict):
        raise DataError(
            f"Manifest '{path}' of dataset '{prefix}': 'tokenizer' and 'files' must be JSON objects; run prepare "
            "again."
        )
    problem = tokenizer_claims_problem(manifest)
    if problem is not None:
        raise DataError(
            f"Manifest '{path}' of dataset '{prefix}': {problem}. The manifest was edited or written by another "
            "tool; restore it from a copy or run prepare again."
        )
    return manifest


DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64")  # the integer dtypes of indexed.DTYPE_CODES


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tokenizer_claims_problem(manifest: dict) -> str | None:
    """Why the manifest's token facts cannot be right (None: they can): ``dtype`` an integer type,
    ``tokenizer.vocab_size`` an integer > 0 (or absent), ``eos_id`` an integer within it, ``bos_id`` null or
    within it. Checked for every manifest, sealed or not: a seal proves who wrote it, not that it is sane."""
    if manifest.get("dtype") not in DTYPES:
        return f"dtype {manifest.get('dtype')!r} is not one of {', '.join(DTYPES)}"
    tok = manifest["tokenizer"]
    vocab = tok.get("vocab_size")
    if vocab is not None and (not _int(vocab) or vocab < 1):
        return f"tokenizer.vocab_size {vocab!r} is not an integer >= 1"
    high = vocab if vocab is not None else 2**63
    for key, required in (("eos_id", True), ("bos_id", False)):
        value = tok.get(key)
        if value is None and not required:
            continue
        if not _int(value) or not 0 <= value < high:
            valid = f"0..{vocab - 1}" if vocab is not None else "an integer >= 0"
            return f"tokenizer.{key} {value!r} is outside the vocabulary (valid ids: {valid})"
    return None


def is_sealed(manifest: dict) -> bool:
    """True when the manifest carries its seal (``read_manifest`` has checked it then): written by prepare or
    merge and unchanged since. An unsealed one (older, hand-written, edited with the seal removed) is verified
    like a foreign dataset: its token facts are taken from the tokenizer file, not from the manifest."""
    return manifest.get(SEAL_KEY) is not None


SEAL_KEY = "manifest_sha256"


def _seal(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != SEAL_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def sealed(manifest: dict) -> dict:
    """``manifest`` with the sha256 of its own content (``manifest_sha256``): a manifest edited or damaged after
    prepare wrote it is refused by :func:`read_manifest` (older manifests without the key are read as before)."""
    return {**manifest, SEAL_KEY: _seal(manifest)}


def tokenizer_path(prefix: str) -> Path:
    """The tokenizer copy next to the shard: the manifest's ``tokenizer.file``, else whichever copy exists."""
    folder = Path(f"{prefix}").parent
    if manifest_path(prefix).is_file():
        name = read_manifest(prefix)["tokenizer"].get("file")
        if name:
            return folder / name
    for suffix in TOKENIZER_SUFFIXES:
        candidate = Path(f"{prefix}{suffix}")
        if candidate.is_file():
            return candidate
    raise DataError(
        f"Dataset prefix '{prefix}' has no tokenizer copy ({' or '.join('PREFIX' + s for s in TOKENIZER_SUFFIXES)}); "
        f"run `llmtrain prepare` again or set data.tokenizer."
    )


def tokenizer_copy_name(prefix: str, source: str) -> str:
    """File name of the tokenizer copy for a tokenizer file ``source``: ``<name>.tokenizer.json|.model``."""
    suffix = ".tokenizer.model" if str(source).endswith(".model") else ".tokenizer.json"
    return Path(f"{prefix}{suffix}").name


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write ``obj`` as indented JSON to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:  # a full disk...: no half-written temporary left behind
        tmp.unlink(missing_ok=True)
        raise


def shard_entries(prefix: str, manifest: dict) -> list[tuple[str, dict]]:
    """``(shard prefix, {"files": ...})`` of each shard of a dataset; a manifest without ``shards`` is one shard."""
    folder = Path(prefix).parent
    if manifest.get("shards"):
        return [(str(folder / s["name"]), s) for s in manifest["shards"]]
    return [(str(prefix), {"files": manifest["files"]})]


def fingerprint_fields(manifest: dict) -> dict:
    """The parts of a manifest that identify its tokens (not its location or input paths)."""
    tok = manifest["tokenizer"]
    files = manifest["files"]
    if len(manifest.get("shards") or []) > 1:
        files = {
            "shards": [[s["files"]["bin"]["sha256"], s["files"]["idx"]["sha256"]] for s in manifest["shards"]]
        }
    return {
        "tokenizer_sha256": tok.get("sha256"),
        "vocab_size": tok.get("vocab_size"),
        "eos_id": tok.get("eos_id"),
        "dtype": manifest["dtype"],
        "documents": manifest["documents"],
        "tokens": manifest["tokens"],
        "bin_sha256": files.get("bin", {}).get("sha256"),
        "idx_sha256": files.get("idx", {}).get("sha256"),
        **({"shards": files["shards"]} if "shards" in files else {}),
        **({"packing": manifest["packing"]} if manifest.get("packing", {}).get("mode") == "bestfit" else {}),
    }

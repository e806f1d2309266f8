"""What ``prepare`` and ``merge`` may write at ``--output PREFIX``, and the rule that guards it.

A dataset at PREFIX is ``PREFIX.bin/.idx`` or ``PREFIX_NNNNN.bin/.idx``, ``PREFIX.manifest.json``,
``PREFIX.tokenizer.json|.model`` and ``PREFIX.report.txt`` (plus ``--rejects FILE`` when asked). Those files are
replaced only when llmtrain can prove it wrote them: ``PREFIX.manifest.json`` is one of ours (``format:
llmtrain.tokens``), which is written last, so its presence vouches for the rest. Never replaced, whatever the
flags: an input of this very run (``--input U/bar.report.txt --output U/bar``, ``--rejects`` naming an input),
one of the run's own outputs named as ``--rejects`` (a dataset file or shard of PREFIX, its stamp, anything in
its work or partitions folder), and
files at the prefix with no manifest of ours beside them (a user's own ``foo.bin`` / ``foo.tokenizer.json``). The
check runs before anything is written, so a refusal leaves every file as it was.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from llmtrain.data.manifest import FORMAT, manifest_path
from llmtrain.errors import DataError

SUFFIXES = (".bin", ".idx", ".manifest.json", ".tokenizer.json", ".tokenizer.model", ".report.txt")


def dataset_files(prefix: str) -> list[Path]:
    """The files of a dataset at ``prefix`` that exist now (one shard or ``PREFIX_NNNNN`` shards)."""
    base = Path(prefix)
    found = [Path(f"{prefix}{s}") for s in SUFFIXES if Path(f"{prefix}{s}").is_file()]
    if base.parent.is_dir():
        shard = re.compile(re.escape(base.name) + r"_\d{5}\.(bin|idx)")
        found += sorted(p for p in base.parent.iterdir() if shard.fullmatch(p.name) and p.is_file())
    return found


def _ours(prefix: str) -> dict | None:
    """The manifest at ``prefix`` when llmtrain wrote it, else None."""
    try:
        manifest = json.loads(manifest_path(prefix).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def _own_file(prefix: str, path: Path) -> str | None:
    """What ``path`` is among the files ``prepare``/``merge`` write for ``prefix`` (a dataset file, a shard,
    the verification stamp, something in the work or partitions folder), or None."""
    base, target = Path(prefix).resolve(), path.resolve()
    if target.parent == base.parent:
        name = target.name
        if name in {f"{base.name}{s}" for s in (*SUFFIXES, ".verified.json")}:
            return f"the dataset's own file {name}"
        if re.fullmatch(re.escape(base.name) + r"_\d{5}\.(bin|idx)", name):
            return f"the dataset's shard {name}"
    for folder in (base.parent / f".{base.name}.work", base.parent / f"{base.name}.partitions"):
        if target == folder or folder in target.parents:
            return f"its work folder {folder}"
    return None


def check_outputs(
    prefix: str, inputs: Iterable[str | Path], rejects: str | None, dataset: bool = True
) -> None:
    """DataError, before anything is written, if this run would replace an input or a file llmtrain did not write.

    ``dataset``: the run writes the dataset at ``prefix`` (False for ``--partition``, which writes only into
    ``PREFIX.partitions/``)."""
    sources = {Path(p).resolve(): str(p) for p in inputs}
    if rejects is not None and Path(rejects).resolve() in sources:
        raise DataError(
            f"--rejects {rejects} is one of the inputs: it would be replaced by the rejected documents. Write "
            "the rejects to a new file."
        )
    if rejects is not None and (own := _own_file(prefix, Path(rejects))):
        raise DataError(
            f"--rejects {rejects} names {own} of this very run (--output {prefix}); the rejected documents "
            "would overwrite it, or it them. Write the rejects to a file outside the dataset's names."
        )
    if not dataset:
        return
    planned = [Path(f"{prefix}{s}") for s in SUFFIXES]
    clash = [sources[p.resolve()] for p in [*planned, *dataset_files(prefix)] if p.resolve() in sources]
    if clash:
        raise DataError(
            f"--output {prefix} would overwrite the input {clash[0]} (a dataset writes {prefix}.bin, .idx, "
            ".manifest.json, .tokenizer.*, .report.txt). Choose an --output prefix that names no input."
        )
    manifest = _ours(prefix)
    strangers = [] if manifest is not None else dataset_files(prefix)
    if strangers:
        raise DataError(
            f"--output {prefix}: {', '.join(str(p) for p in strangers)} already exist and were not written by "
            f"llmtrain (no llmtrain manifest {manifest_path(prefix)} beside them); they are left untouched. "
            "Choose another --output prefix, or move those files away."
        )
    if rejects is not None and Path(rejects).exists():
        earlier = ((manifest or {}).get("prepare") or {}).get("options", {}).get("rejects")
        if earlier is None or Path(str(earlier)).resolve() != Path(rejects).resolve():
            raise DataError(
                f"--rejects {rejects} already exists and is not the rejects file of the dataset at {prefix}; "
                "it is left untouched. Name a new file."
            )

"""Shared fixtures: a tiny prepared corpus (stdlib sources, always present) and the optional ../shared folder."""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} (real corpus and tokenizers) is not present on this machine")
    return SHARED


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> str:
    """A prepared dataset prefix: 12 stdlib modules, a 512-token byte-level BPE trained on them."""
    from llmtrain.data.prep.prepare import prepare

    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:12]
    prefix = tmp_path_factory.mktemp("corpus") / "tiny"
    prepare(files, str(prefix), train_tokenizer=512, log=None)
    return str(prefix)

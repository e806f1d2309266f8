"""The torchft build replica groups are pinned to, and the check that the installed build is it.

torchft 0.2.0 (PyPI's release) crashes the *surviving* replica when its peer dies in the middle of an
all-reduce: the DDP comm hook asserts on the dummy future the manager returns after the error. The
nightly build pinned here turns that failed all-reduce into a skipped step (``should_commit`` says no), which is
the behaviour replica groups depend on. pyproject.toml's ``ft`` extra pins the same build;
tests/test_replicas.py runs the dying-peer drill against whatever is installed.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from llmtrain.errors import ConfigError

PINNED = ("torchft-nightly", "2026.10.26")
"""(distribution, version) of the torchft build in the ft extra."""


def installed() -> tuple[str, str] | None:
    """(distribution, version) that provides the importable ``torchft`` package; None when it is absent."""
    try:
        import torchft
    except ImportError:
        return None
    here = Path(torchft.__file__).resolve().parent
    for name in ("torchft-nightly", "torchft"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        init = Path(str(dist.locate_file("torchft/__init__.py"))).resolve()
        if init.parent == here:
            return name, dist.version
    return "torchft (unknown build)", getattr(torchft, "__version__", "?")


def require_pinned() -> None:
    """ConfigError unless the pinned torchft build is the one installed (fault_tolerance.enabled needs it)."""
    found = installed()
    want = f"{PINNED[0]}=={PINNED[1]}"
    if found is None:
        raise ConfigError(
            f"fault_tolerance.enabled: true needs torchft ({want}), which is not installed; "
            "install the ft extra: pip install 'llmtrain[ft]'."
        )
    if found != PINNED:
        raise ConfigError(
            f"fault_tolerance.enabled: true needs {want}; the installed torchft is {found[0]} {found[1]}. "
            "torchft 0.2.0 crashes the surviving replica when a peer dies mid all-reduce; "
            "install the ft extra (pip install 'llmtrain[ft]') instead."
        )

"""What a config means: derived figures (``derived``), the stage plan (``stages``), every check ``train`` would
make before building anything (``validate``) and the frozen resolved run (``run``). Above ``config`` (which it
reads) and below everything that builds or runs (docs/architecture.md)."""

from llmtrain.resolve.derived import Derived, derive
from llmtrain.resolve.run import ResolvedRun, resolve_run
from llmtrain.resolve.validate import check_config, validate

__all__ = ["Derived", "ResolvedRun", "check_config", "derive", "resolve_run", "validate"]

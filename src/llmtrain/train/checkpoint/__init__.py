"""Checkpoints: torch distributed checkpoint (DCP) for tensors, JSON for everything else; atomic and checksummed.

The package splits the concerns; each module's docstring explains its part:

    layout        the on-disk layout: every name (step_N, .tmp, .trash, COMMITTED, checksums.json, sidecars,
                  rng_rank{r}.json, trainer_state.json), parsing/formatting them, atomic writes, retire/delete
    integrity     SHA-256 while writing (ChecksummingWriter), checksums.json, verify_checkpoint
    safe_load     the allow-list unpickler for DCP metadata (storage entries only inside the checkpoint),
                  weights-only values, load_model_weights
    state_schema  what trainer_state.json, rng_rank*.json and the metadata must hold before anything is
                  restored (content_problem: the one check after the checksums)
    rng           RNG states as JSON (rng_state / set_rng_state)
    store         the mechanism: sync/async save, commit protocol, rotation, load, close (CPU staging in staging)
    checkpointer  the component the training loop calls: when to save, what to resume from (ResumeChoice),
                  delegating the rest to its store

Everything the trainer, the tools and the tests use is importable from here.
"""

from llmtrain.train.checkpoint.checkpointer import Checkpointer, ResumeChoice
from llmtrain.train.checkpoint.integrity import (
    ChecksummingWriter,
    sha256_file,
    verify_checkpoint,
    write_checksums,
)
from llmtrain.train.checkpoint.layout import (
    CHECKSUMS,
    MARKER,
    SIDECAR_SUFFIX,
    STEP_DIR,
    TRAINER_STATE,
    committed,
    is_committed,
    rng_file,
    root_of_run,
    run_dir_of,
    step_dir,
    step_of,
    tmp_dir,
    trainer_state_file,
)
from llmtrain.train.checkpoint.rng import rng_state, set_rng_state
from llmtrain.train.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, load_model_weights
from llmtrain.train.checkpoint.state_schema import content_problem
from llmtrain.train.checkpoint.store import CheckpointStore

__all__ = [
    "CHECKSUMS",
    "MARKER",
    "SIDECAR_SUFFIX",
    "STEP_DIR",
    "TRAINER_STATE",
    "CheckpointStore",
    "Checkpointer",
    "ChecksummingWriter",
    "ResumeChoice",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "committed",
    "content_problem",
    "is_committed",
    "load_model_weights",
    "rng_file",
    "root_of_run",
    "run_dir_of",
    "rng_state",
    "set_rng_state",
    "sha256_file",
    "step_dir",
    "step_of",
    "tmp_dir",
    "trainer_state_file",
    "verify_checkpoint",
    "write_checksums",
]

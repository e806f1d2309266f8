"""What a checkpoint's small files must hold before anything of it is restored: one schema, one function.

Checksums prove that the files are the ones the commit recorded; they say nothing about a checkpoint whose files
were edited and whose ``checksums.json`` was recomputed (an editing tool, a careless copy script). So, after the
checksums, :func:`content_problem` checks every field llmtrain will read:

* ``trainer_state.json``: a JSON object; ``step`` an integer equal to the directory's step (and to the marker's);
  for a resume ``tokens_seen``, ``scaler`` and ``data`` present (a model-only use needs only the step), and
  wherever present: ``tokens_seen`` an integer >= 0, ``config_hash`` a string; ``scaler`` ``{scale > 0 finite, good_steps >= 0,
  skipped_steps >= 0}``; ``data`` either a loader state (``consumed_samples >= 0``, ``consumed_tokens`` of
  integers >= 0, ``fingerprint``, ``mixture``) or a staged run's (``stage >= 0``, ``iterator``: a loader state,
  ``before``: integers >= 0); ``guard`` (optional) with integer counters, lists of numbers and a rollback plan
  object or null; ``world_size`` / ``grad_accum`` (optional) integers >= 1. Every integer is a JSON integer (not
  a bool, not a float) within int64. ``tokenizer`` (optional: the tokenizer the run trained with) an object of
  ``sha256``, ``vocab_size``, ``file``. Keys this llmtrain does not read (a newer one's) are accepted as they are;
* every ``rng_rank*.json``: the keys ``python`` ([3, 625 words < 2**32 with the position <= 624, a float or
  null]), ``numpy`` (["MT19937", 624 words, position 0..624, 0 or 1, a float]), ``torch`` (base64 of the
  generator's 5056 bytes), optionally ``cuda`` (base64);
* the DCP metadata: unpickled through the allow-list (``safe_load.safe_reader``), which also refuses storage
  entries naming a file outside the checkpoint directory (``..``, an absolute path, a sub-folder, a symlink).

For a resume (``content_problem(path, stages)``, the trainer's call before it restores anything),
:func:`run_state_problem` adds what only the run knows (a staged run's stage index within its stages, the data
state's kind). A problem is a sentence; the store reports it as the reason a checkpoint is skipped (``resume:
auto`` falls back to the previous one) or refused (a checkpoint named explicitly).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from pathlib import Path
from typing import Any, TypeGuard

from llmtrain.errors import CheckpointError
from llmtrain.train.checkpoint import layout

INT64_MAX = 2**63 - 1
TORCH_RNG_BYTES = 5056  # torch.get_rng_state().numel() of the CPU generator (MT19937 + Philox fields)
REQUIRED = ("step", "tokens_seen", "scaler", "data")


def _is_int(value: Any, low: int = 0, high: int = INT64_MAX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_field(obj: dict, key: str, where: str, low: int = 0, required: bool = True) -> str | None:
    if key not in obj:
        return f"{where} has no {key!r}" if required else None
    if not _is_int(obj[key], low):
        return f"{where}: {key} = {_shown(obj[key])} is not an integer in [{low}, 2**63-1]"
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _loader_problem(sd: Any, where: str) -> str | None:
    if not isinstance(sd, dict):
        return f"{where} is not an object"
    problem = _int_field(sd, "consumed_samples", where)
    if problem:
        return problem
    tokens = sd.get("consumed_tokens")
    if tokens is not None and not (isinstance(tokens, dict) and all(_is_int(v) for v in tokens.values())):
        return f"{where}.consumed_tokens is not an object of integers >= 0"
    mixture = sd.get("mixture")
    if mixture is not None and not isinstance(mixture, (list, dict, str)):
        return f"{where}.mixture = {_shown(mixture)} is not a list or an object"
    fingerprint = sd.get("fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        return f"{where}.fingerprint = {_shown(fingerprint)} is not a string"
    return None


def _data_problem(sd: Any) -> str | None:
    if not isinstance(sd, dict):
        return f"data = {_shown(sd)} is not an object"
    if "stage" in sd or "iterator" in sd:  # a staged run's curriculum
        problem = _int_field(sd, "stage", "data") or _loader_problem(sd.get("iterator"), "data.iterator")
        if problem:
            return problem
        before = sd.get("before")
        if not (isinstance(before, dict) and all(_is_int(v) for v in before.values())):
            return "data.before is not an object of integers >= 0"
        return None
    return _loader_problem(sd, "data")


def _guard_problem(sd: Any) -> str | None:
    if not isinstance(sd, dict):
        return f"guard = {_shown(sd)} is not an object"
    for key in ("bad_run", "nonfinite_run", "skipped_steps", "rollbacks"):
        if problem := _int_field(sd, key, "guard", required=False):
            return problem
    first = sd.get("first_bad_step")
    if first is not None and not _is_int(first):
        return f"guard.first_bad_step = {_shown(first)} is not null or an integer >= 0"
    history = sd.get("history", {})
    if not isinstance(history, dict) or not all(
        isinstance(h, list) and all(_is_number(x) for x in h) for h in history.values()
    ):
        return "guard.history is not an object of lists of finite numbers"
    plan = sd.get("active_plan")
    if plan is not None and not isinstance(plan, dict):
        return f"guard.active_plan = {_shown(plan)} is not null or an object"
    return None


def trainer_state_problem(state: Any, dir_step: int | None, required: tuple[str, ...] = ()) -> str | None:
    """Why ``state`` (trainer_state.json, parsed) cannot be restored, None when it can (``dir_step``: the step
    its directory's name says, None for a directory of another name). Every field present must have its type and
    range; ``required``: the keys that must be present too (what the trainer restores, :data:`REQUIRED`; a
    model-only use, generate or export, needs only the step)."""
    name = layout.TRAINER_STATE
    step = state.get("step") if isinstance(state, dict) else None
    if not _is_int(step):
        return f"{name} is not an object with an integer step (0 to 2**63-1)"
    assert isinstance(state, dict)
    if dir_step is not None and step != dir_step:
        return f"{name} says step {step}, but the directory is step {dir_step}"
    missing = [k for k in required if k not in state]
    if missing:
        return f"{name} has no {', '.join(missing)} (required to resume)"
    if problem := _int_field(state, "tokens_seen", name, required=False):
        return problem
    if "scaler" in state:
        scaler = state["scaler"]
        if not isinstance(scaler, dict):
            return f"{name}: scaler = {_shown(scaler)} is not an object"
        scale = scaler.get("scale")
        if not (_is_number(scale) and scale > 0):
            return f"{name}: scaler.scale = {_shown(scale)} is not a finite number > 0"
        for key in ("good_steps", "skipped_steps"):
            if problem := _int_field(scaler, key, f"{name}: scaler"):
                return problem
    if "data" in state and (problem := _data_problem(state["data"])):
        return f"{name}: {problem}"
    if "guard" in state and (problem := _guard_problem(state["guard"])):
        return f"{name}: {problem}"
    for key in ("world_size", "grad_accum"):
        if state.get(key) is not None and (problem := _int_field(state, key, name, low=1)):
            return problem
    if state.get("config_hash") is not None and not isinstance(state["config_hash"], str):
        return f"{name}: config_hash = {_shown(state['config_hash'])} is not a string"
    tok = state.get("tokenizer")  # the tokenizer the run trained with (generate / export compare it)
    if tok is not None and not (
        isinstance(tok, dict)
        and all(tok.get(k) is None or isinstance(tok[k], str) for k in ("sha256", "file"))
        and (tok.get("vocab_size") is None or _is_int(tok["vocab_size"], 1))
    ):
        return f"{name}: tokenizer = {_shown(tok)} is not an object of sha256, vocab_size, file"
    return None


def run_state_problem(state: dict, stages: int | None) -> str | None:
    """What only the run can check of a state that passed :func:`trainer_state_problem`: a staged run
    (``stages``: its number of stages) needs a staged data state whose stage exists; a one-stage run a loader
    state."""
    data = state["data"]
    staged = "stage" in data or "iterator" in data
    if stages is None:
        if staged:
            return f"{layout.TRAINER_STATE} holds a staged run's data state (data.stage), and this run has no stages"
        return None
    if not staged:
        return f"{layout.TRAINER_STATE} holds a one-stage data state, and this run has {stages} stages"
    if data["stage"] >= stages:
        return (
            f"{layout.TRAINER_STATE}: data.stage = {data['stage']}, but this run has stages 0..{stages - 1}"
        )
    return None


def _words(values: Any, count: int) -> bool:
    return isinstance(values, list) and len(values) == count and all(_is_int(v, 0, 2**32 - 1) for v in values)


def _b64_bytes(text: Any) -> int | None:
    if not isinstance(text, str):
        return None
    try:
        return len(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError):
        return None


def rng_problem(state: Any, name: str) -> str | None:
    """Why ``state`` (an ``rng_rank*.json``, parsed) cannot be restored by ``rng.set_rng_state``, else None."""
    if not isinstance(state, dict):
        return f"{name} is not a JSON object"
    missing = [k for k in ("python", "numpy", "torch") if k not in state]
    if missing:
        return f"{name} has no {', '.join(missing)} state"
    py = state["python"]
    if not (
        isinstance(py, list)
        and len(py) == 3
        and _is_int(py[0])
        and _words(py[1], 625)
        and py[1][-1] <= 624
        and (py[2] is None or _is_number(py[2]))
    ):
        return f"{name}: the python state is not [version, 625 words (position <= 624 last), gauss]"
    npy = state["numpy"]
    if not (
        isinstance(npy, list)
        and len(npy) == 5
        and npy[0] == "MT19937"
        and _words(npy[1], 624)
        and _is_int(npy[2], 0, 624)
        and npy[3] in (0, 1)
        and _is_number(npy[4])
    ):
        return f"{name}: the numpy state is not ['MT19937', 624 words, position 0..624, 0 or 1, gauss]"
    size = _b64_bytes(state["torch"])
    if size != TORCH_RNG_BYTES:
        got = "not base64" if size is None else f"{size} bytes"
        return f"{name}: the torch state is {got}, {TORCH_RNG_BYTES} bytes expected"
    if "cuda" in state and not _b64_bytes(state["cuda"]):
        return f"{name}: the cuda state is not base64 bytes"
    return None


class AnyRun:
    """``content_problem(path)`` without a run to compare with (verification, generate, export)."""


ANY_RUN = AnyRun()


def content_problem(path: Path, stages: int | None | AnyRun = ANY_RUN) -> str | None:
    """Why the small files of a checkpoint that passed its checksums are still unusable, None when they are
    fine: the one check before anything of ``path`` is restored (see the module docstring). ``stages``: for a
    resume, the run's number of stages (None: a one-stage run); then every key the trainer restores must be
    there and fit the run (:func:`run_state_problem`)."""
    from llmtrain.train.checkpoint.safe_load import safe_reader

    state_file = layout.trainer_state_file(path)
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        return f"{state_file.name} is unreadable ({type(e).__name__})"
    resume = not isinstance(stages, AnyRun)
    dir_step = layout.step_of(path) if layout.is_step_dir(path) else None
    problem = trainer_state_problem(state, dir_step, REQUIRED if resume else ())
    if problem is None and not isinstance(stages, AnyRun):
        problem = run_state_problem(state, stages)
    if problem:
        return problem
    if not layout.marker_matches(path, state["step"]):
        return f"the {layout.MARKER} marker does not say step {state['step']} (damaged)"
    for rng in sorted(path.glob("rng_rank*.json")):
        try:
            rng_state = json.loads(rng.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as e:
            return f"{rng.name} is unreadable ({type(e).__name__})"
        if problem := rng_problem(rng_state, rng.name):
            return problem
    try:
        safe_reader(path)
    except CheckpointError as e:
        return str(e).removeprefix(f"{path}: ").rstrip(".")
    return None

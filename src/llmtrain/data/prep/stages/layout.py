"""The staged dedup's plan and work folder: partitions, buckets, document ids, paths, task markers.

Partitions. The expanded input files (in input order) are cut into ``P`` partitions: with at least ``P`` files,
``P`` contiguous runs of files of about equal bytes; with fewer, each file is split into interleaved slices
(slice ``r`` of ``m`` keeps its non-blank records ``r, r + m, ...``), more slices for larger files, ``P`` in all.
A partition is a list of *units* ``(file, r, m)``. Buckets: ``B`` hash buckets of band keys and digests.

Ids. A document's global id is ``file << 40 | line`` (the reader's 1-based line or parquet row; 0 for a
whole-file document): its position in the input order, whatever the partitioning. Its location is
``partition << 40 | row`` (its row among the partition's kept documents), where stage 2 finds its signature.

Work folder (``.PREFIX.work/staged/``)::

    layout.json         the plan; a run with another plan starts over (a scheduled task refuses instead)
    s1/p-PPPPP/         stage 1 of partition P: texts.bin, docs.npz (ids, byte offsets), sigs.bin,
                        band-BBBBB.bin and exact-BBBBB.bin (rows key, id, location), rejects.jsonl(+.ids.npy)
    s2/pairs-BBBBB.npz  stage 2 of bucket B: verified pairs (low id, location, high id, location, exact)
    s3/drops-PPPPP.npz  stage 3: the rows of partition P to drop, and whether each is an exact copy
    s4/part-PPPPP.*     stage 4: the part (``shards.PartWriter``) and the ids of its documents
    stats/S-KKKKK.json  the marker of task K of stage S: its figures; written last, so it means "done"

Every file is written under a temporary name and renamed; the marker comes last. A rerun skips the tasks that
have a marker, on any engine.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmtrain.data.manifest import write_json_atomic
from llmtrain.data.prep.pipeline import PrepareOptions
from llmtrain.errors import ConfigError

STAGES = {1: "screen", 2: "pairs", 3: "components", 4: "tokenize", 5: "write"}
ENGINES = ("local", "ray")
SHIFT = 40  # id = file << SHIFT | line; location = partition << SHIFT | row
LOW = (1 << SHIFT) - 1
MAX_FILES = 1 << 23  # ids stay below 2**63
Unit = tuple[int, int, int]  # (file index, slice r, of m slices)


@dataclass(frozen=True)
class StageSettings:
    """How the staged path runs: engine, task counts, and (for a scheduler) one stage or task only."""

    engine: str = "local"
    """local (``--workers`` processes on this machine) or ray (Ray tasks)."""
    ray_address: str | None = None
    """Address of a running Ray cluster (``ray start --head``); None: a local Ray with ``--workers`` CPUs."""
    partitions: int | None = None
    """Tasks of stages 1 and 4 (None: from the files and workers, see :func:`default_partitions`)."""
    buckets: int | None = None
    """Tasks of stage 2 (None: as many as partitions)."""
    stage: int | None = None
    """Run only this stage (1-5; 5 writes the dataset); None: all."""
    task: int | None = None
    """With ``stage``: run only this task of it (a scheduler's array index)."""

    def validate(self) -> None:
        """ConfigError naming the first invalid setting."""
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine {self.engine!r} is not valid; use one of {list(ENGINES)}.")
        if self.ray_address is not None and self.engine != "ray":
            raise ConfigError(
                f"--ray-address {self.ray_address} needs --engine ray (got --engine {self.engine})."
            )
        for name in ("partitions", "buckets"):
            value = getattr(self, name)
            if value is not None and not 1 <= value < MAX_FILES:
                raise ConfigError(f"--{name} {value} must be between 1 and {MAX_FILES - 1}.")
        if self.stage is not None and self.stage not in STAGES:
            raise ConfigError(
                f"--stage {self.stage} is not a stage; use 1-5 ({', '.join(f'{k} {v}' for k, v in STAGES.items())})."
            )
        if self.task is not None and (self.stage is None or self.task < 0):
            raise ConfigError(f"--task {self.task} needs --stage S and must be >= 0.")


def settings_from(value: StageSettings | dict | None) -> StageSettings | None:
    """StageSettings from a dict of its fields (unknown keys are a ConfigError), validated."""
    if value is None or isinstance(value, StageSettings):
        settings = value
    else:
        known = {f.name for f in dataclasses.fields(StageSettings)}
        if set(value) - known:
            raise ConfigError(
                f"Unknown staged settings {sorted(set(value) - known)}; valid: {sorted(known)}."
            )
        settings = StageSettings(**value)
    if settings is not None:
        settings.validate()
    return settings


def staged_settings(
    value: StageSettings | dict | None, opts: PrepareOptions, partition: object, mindrecord: bool
) -> StageSettings | None:
    """The settings of the staged path for a ``prepare`` call, or None for the one-process path: given ones
    (validated), else the defaults when the run deduplicates (and is neither a ``--partition`` run, joined
    later by ``merge``, nor a MindRecord conversion)."""
    settings = settings_from(value)
    if settings is not None and (partition is not None or mindrecord):
        raise ConfigError(
            "--engine, --partitions, --buckets and --stage select the staged path, which does not combine with "
            + ("a MindRecord input (token rows: there is nothing to deduplicate)." if mindrecord else
               "--partition I/N (the two-phase path that `llmtrain merge` joins): use one or the other.")
        )  # fmt: skip
    if settings is None and opts.dedup != "none" and partition is None and not mindrecord:
        return StageSettings()
    return settings


def default_partitions(files: int, workers: int) -> int:
    """Enough partitions to keep every worker busy (up to 4 per worker, if there are as many files)."""
    return max(workers, min(files, 4 * workers))


@dataclass(frozen=True)
class Plan:
    """Which input units each partition reads, and the bucket count (see the module docstring)."""

    files: tuple[str, ...]
    partitions: tuple[tuple[Unit, ...], ...]
    buckets: int

    def to_json(self) -> dict:
        return {"files": list(self.files), "partitions": [[list(u) for u in p] for p in self.partitions],
                "buckets": self.buckets}  # fmt: skip

    def groups(self) -> list[list[int]]:
        """Runs of consecutive partitions whose documents interleave (the slices of one file), in order."""
        out: list[list[int]] = []
        for k, units in enumerate(self.partitions):
            f, r, m = units[0]
            if m > 1 and r > 0:
                out[-1].append(k)
            else:
                out.append([k])
        return out


def make_plan(files: list[Path], partitions: int, buckets: int) -> Plan:
    """The plan of ``partitions`` partitions over ``files`` (see the module docstring)."""
    if len(files) >= MAX_FILES:
        raise ConfigError(f"{len(files)} input files: the staged path takes at most {MAX_FILES - 1}.")
    sizes = [max(f.stat().st_size, 1) for f in files]
    names = tuple(str(f) for f in files)
    if len(files) >= partitions:  # contiguous runs of about total / P bytes, none empty
        cum = np.cumsum(sizes)
        cuts = [0]
        for i in range(1, partitions):
            cut = int(np.searchsorted(cum, cum[-1] * i / partitions, side="left")) + 1
            cuts.append(min(max(cut, cuts[-1] + 1), len(files) - (partitions - i)))
        cuts.append(len(files))
        parts = tuple(tuple((f, 0, 1) for f in range(a, b)) for a, b in zip(cuts, cuts[1:]))
        return Plan(names, parts, buckets)
    slices = [1] * len(files)  # then one more slice at a time for the file with the most bytes per slice
    heap: list[tuple[float, int]] = [(-float(s), f) for f, s in enumerate(sizes)]
    heapq.heapify(heap)
    for _ in range(partitions - len(files)):
        _, f = heapq.heappop(heap)
        slices[f] += 1
        heapq.heappush(heap, (-sizes[f] / slices[f], f))
    parts = tuple(((f, r, m),) for f, m in enumerate(slices) for r in range(m))
    return Plan(names, parts, buckets)


def bucket_of(keys: np.ndarray, buckets: int) -> np.ndarray:
    """[N] bucket of each uint64 key (band key or digest): a multiplicative hash of its high bits, so keys
    that share low bits (the band index is XORed into them) still spread evenly."""
    mixed = (np.asarray(keys, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)
    return (mixed % np.uint64(buckets)).astype(np.int64)


@dataclass(frozen=True)
class StageContext:
    """Everything a task needs, picklable (sent to worker processes and Ray tasks)."""

    root: str
    plan: Plan
    options: PrepareOptions
    tokenizer: str
    eos_token: str | None
    max_documents: int | None
    cwd: str
    driver_pid: int

    @property
    def near(self) -> bool:
        return self.options.dedup == "near" and self.options.minhash.near

    @property
    def exact(self) -> bool:
        return self.options.dedup != "none" and self.options.minhash.exact

    def s1(self, k: int) -> Path:
        return Path(self.root) / "s1" / f"p-{k:05d}"

    def s2(self) -> Path:
        return Path(self.root) / "s2"

    def s3(self) -> Path:
        return Path(self.root) / "s3"

    def s4(self) -> Path:
        return Path(self.root) / "s4"

    def tasks(self, stage: int) -> int:
        """The number of tasks of ``stage`` (0 for the dedup stages without dedup)."""
        if stage in (1, 4):
            return len(self.plan.partitions)
        if stage == 2:
            return self.plan.buckets if self.options.dedup != "none" else 0
        return 1 if stage == 5 or self.options.dedup != "none" else 0

    def marker(self, stage: int, task: int) -> Path:
        return Path(self.root) / "stats" / f"{stage}-{task:05d}.json"

    def done(self, stage: int, task: int) -> dict | None:
        """The figures of a finished task, or None (also when its marker is damaged: the task is run again)."""
        p = self.marker(stage, task)
        try:
            stats = json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            return None
        return stats if isinstance(stats, dict) else None

    def finish(self, stage: int, task: int, stats: dict) -> None:
        path = self.marker(stage, task)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, stats)

    def require(self, stage: int) -> None:
        """DataError unless every task of ``stage`` is finished (a scheduler ran the stages out of order)."""
        missing = [k for k in range(self.tasks(stage)) if self.done(stage, k) is None]
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise ConfigError(
                f"Stage {stage} ({STAGES[stage]}) is not finished in {self.root}: tasks {shown} of "
                f"{self.tasks(stage)} have no marker. Run `llmtrain prepare ... --stage {stage}` (or those "
                f"--task K) first; finished tasks are skipped."
            )


def tmp_path(path: Path) -> Path:
    """The temporary name ``path`` is written under before :func:`publish` renames it."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def publish(paths: list[Path]) -> int:
    """Rename the temporary files of ``paths`` into place; returns their bytes."""
    total = 0
    for p in paths:
        tmp = tmp_path(p)
        total += tmp.stat().st_size
        os.replace(tmp, p)
    return total


def save_npz(path: Path, **arrays: np.ndarray) -> int:
    """``np.savez`` to ``path`` atomically; returns the bytes written."""
    with open(tmp_path(path), "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]
    return publish([path])


def save_npy(path: Path, array: np.ndarray) -> int:
    """``np.save`` to ``path`` atomically; returns the bytes written."""
    with open(tmp_path(path), "wb") as f:
        np.save(f, array)
    return publish([path])

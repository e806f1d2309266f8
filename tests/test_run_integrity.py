"""Issue 33: run directories and checkpoints that a user, a script or a shared filesystem changed.

One test per class, through the commands (in this process, ``llmtrain.cli.main``): checkpoint content whose
checksums were recomputed (``generate`` falls back, ``train`` falls back or refuses a checkpoint named
explicitly), DCP metadata naming a file outside the checkpoint, damaged ``metrics.jsonl`` / ``events.jsonl`` of
a resumed run, symbolic links among the step directories (rotation and a save onto one), ``resume: none`` over a
finished run (refused without ``--overwrite``), an unsealed manifest's claims and the stamp's inode/ctime binding.
Each asserts the exit code, the message, that nothing outside the run directory changed, and that every committed
checkpoint and every good metrics row is still there. A finished 2-step run (checkpoints at steps 1 and 2) is made
once and copied into each test.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from llmtrain.cli import main as cli

STEP1, STEP2 = "checkpoints/step_00000001", "checkpoints/step_00000002"
SAVE_EVERY_STEP = {"save_steps": 1, "keep_checkpoint_max": 3}


@pytest.fixture(scope="module")
def finished_run(tiny_corpus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("finished")
    cfg = root / "run.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_corpus, root / "run", checkpoint=SAVE_EVERY_STEP)))
    assert cli(["train", str(cfg)]) == 0
    return root / "run"


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    shutil.copytree(finished_run, tmp_path / "run")
    return tmp_path / "run"


def call(capfd, *argv) -> tuple[int, str]:
    code = cli([str(a) for a in argv])
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, (out + err)[-3000:]
    return code, out + err


def snapshot(folder: Path, skip: Path | None = None) -> dict[str, bytes]:
    """Every file under ``folder`` (not following links; not under ``skip``) by path, with its bytes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        if p.is_file() and not p.is_symlink():
            out[str(p)] = p.read_bytes()
    return out


def checkpoints(run: Path) -> dict[str, bytes]:
    """The files of every step directory (the run directory's lock file aside)."""
    return {k: v for k, v in snapshot(run / "checkpoints").items() if "/step_" in k}


def reseal(ckpt: Path, name: str) -> None:
    """checksums.json updated for ``name``: tampering the checksums cannot see (the content checks must)."""
    record = json.loads((ckpt / "checksums.json").read_text())
    data = (ckpt / name).read_bytes()
    record["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "checksums.json").write_text(json.dumps(record))


def train_cfg(run: Path, tmp_path: Path, steps: int = 3, **checkpoint) -> Path:
    dataset = yaml.safe_load((run / "config.yaml").read_text())["data"]["datasets"][0]["path"]
    cfg = tiny_config(dataset, run, train={"max_steps": steps}, checkpoint={**SAVE_EVERY_STEP, **checkpoint})
    path = tmp_path / f"resume{len(list(tmp_path.glob('resume*.yaml')))}.yaml"  # a new file per call
    path.write_text(yaml.safe_dump(cfg))
    return path


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def events(run: Path) -> list[dict]:
    return rows(run / "events.jsonl")


# ---------------------------------------------------------------- 1. checkpoint content behind valid checksums


def _state_edit(kind: str):
    def edit(s: dict) -> dict:
        if kind == "step of a string":
            s["step"] = "x"
        elif kind == "negative sample index":
            s["data"]["consumed_samples"] = -8
        elif kind == "beyond int64":
            s["tokens_seen"] = 2**64
        elif kind == "string for an object":
            s["scaler"] = "fp32"
        return s

    return edit


STATE_CASES = [
    ("trainer_state.json", _state_edit("step of a string"), "not an object with an integer step"),
    ("trainer_state.json", _state_edit("negative sample index"), "consumed_samples = -8 is not an integer"),
    (
        "trainer_state.json",
        _state_edit("beyond int64"),
        "tokens_seen = 18446744073709551616 is not an integer",
    ),
    ("trainer_state.json", _state_edit("string for an object"), 'scaler = "fp32" is not an object'),
    ("rng_rank0.json", lambda s: {k: v for k, v in s.items() if k != "numpy"}, "has no numpy state"),
    ("rng_rank0.json", lambda s: {**s, "python": [3, s["python"][1][:600], None]}, "the python state is not"),
    ("rng_rank0.json", lambda s: {**s, "torch": s["torch"][:100]}, "the torch state is"),
]


@pytest.mark.parametrize("name, edit, needle", STATE_CASES, ids=[c[2][:30] for c in STATE_CASES])
def test_checkpoint_content_with_recomputed_checksums_falls_back(run, tmp_path, capfd, name, edit, needle):
    """``generate`` on the run skips the edited step 2 with the reason and uses step 1; named explicitly, step 2
    is refused (exit 2). Both checkpoints stay committed and byte-identical."""
    path = run / STEP2 / name
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    reseal(run / STEP2, name)
    before = snapshot(tmp_path)
    code, text = call(capfd, "generate", run, "--prompt", "def", "--max-new-tokens", "2")
    assert code == 0 and "step_00000002 skipped" in text and needle in text, text[-2000:]
    code, text = call(capfd, "generate", run / STEP2, "--prompt", "def", "--max-new-tokens", "2")
    assert code == 2 and "fails verification" in text and needle in text
    assert snapshot(tmp_path) == before  # nothing changed anywhere


def test_train_resume_needs_every_field_and_refuses_an_explicit_bad_one(run, tmp_path, capfd):
    """A trainer_state.json without ``tokens_seen`` (checksums recomputed): enough for generate, not for a
    resume: ``train`` (resume: auto) falls back to step 1 and says so; ``resume: PATH`` to it exits 2."""
    state = json.loads((run / STEP2 / "trainer_state.json").read_text())
    del state["tokens_seen"]
    (run / STEP2 / "trainer_state.json").write_text(json.dumps(state))
    reseal(run / STEP2, "trainer_state.json")
    named = train_cfg(run, tmp_path, resume=str(run / STEP2))
    auto = train_cfg(run, tmp_path)
    outside = snapshot(tmp_path, skip=run)
    code, text = call(capfd, "train", named)
    assert code == 2 and "has no tokens_seen (required to resume)" in text
    assert (run / STEP2 / "COMMITTED").exists() and (run / STEP1 / "COMMITTED").exists()
    code, text = call(capfd, "train", auto)
    assert code == 0 and "has no tokens_seen" in text and "falling back" in text
    assert [e["step"] for e in events(run) if e["event"] == "resumed"][-1] == 1
    assert snapshot(tmp_path, skip=run) == outside


def test_dcp_metadata_naming_a_file_outside_the_checkpoint_is_refused(run, tmp_path, capfd):
    """DCP reads ``checkpoint / relative_path``: an entry naming ``../x.distcp`` (a copy of a real data file, so
    the read would succeed) is refused before DCP opens it; generate falls back, export refuses."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    ckpt = run / STEP2
    meta = pickle.loads((ckpt / ".metadata").read_bytes())
    key, info = next(iter(meta.storage_data.items()))
    shutil.copy(ckpt / info.relative_path, run / "checkpoints" / "x.distcp")
    meta.storage_data[key] = _StorageInfo("../x.distcp", info.offset, info.length)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    reseal(ckpt, ".metadata")
    code, text = call(capfd, "generate", run, "--prompt", "def", "--max-new-tokens", "2")
    assert (
        code == 0 and "step_00000002 skipped" in text and "'../x.distcp', which is not a file inside" in text
    )
    code, text = call(capfd, "export", ckpt, "--to", "hf", tmp_path / "hf")
    assert code == 2 and "which is not a file inside" in text and not (tmp_path / "hf").exists()


# ---------------------------------------------------------------- 2. damaged metrics.jsonl / events.jsonl


def test_damaged_metrics_and_events_are_set_aside_and_the_run_goes_on(run, tmp_path, capfd):
    good = rows(run / "metrics.jsonl")
    metrics = (run / "metrics.jsonl").read_bytes()
    lines = metrics.splitlines(keepends=True)
    damaged = lines[0] + b"\xff\xfe garbage \x00\n" + b'{"step": "two", "loss": "x"}\n' + b"".join(lines[1:])
    (run / "metrics.jsonl").write_bytes(damaged)
    old_events = (run / "events.jsonl").read_bytes() + b'{"event": 5}\n{"time": 1, "ev'  # a torn last write
    (run / "events.jsonl").write_bytes(old_events)
    code, text = call(capfd, "train", train_cfg(run, tmp_path))
    assert (
        code == 0 and "metrics.jsonl had 2 damaged line(s)" in text and "events.jsonl had 2 damaged" in text
    )
    assert (run / "metrics.jsonl.damaged-1").read_bytes() == damaged  # set aside whole, never deleted
    assert (run / "events.jsonl.damaged-1").read_bytes() == old_events
    now = rows(run / "metrics.jsonl")
    assert now[: len(good)] == good and [r["step"] for r in now if "loss" in r][-1] == 3
    assert any(e["event"] == "log_damaged" for e in events(run))
    from llmtrain.report.run_data import load_run

    shutil.copy(run / "metrics.jsonl.damaged-1", run / "metrics.jsonl")  # the report reads by the same rule
    data = load_run(run)
    assert data.bad_lines == 2 and [r["step"] for r in data.train] == [r["step"] for r in good if "loss" in r]


# ---------------------------------------------------------------- 3. symbolic links are not llmtrain's


def test_rotation_leaves_a_symlinked_step_directory_alone(run, tmp_path, capfd):
    """A committed checkpoint in a shared folder, linked in as step_00000000: rotation (keep 2) removes steps 1
    and 2 of the run, never follows the link; the shared folder is byte-identical and the link is named."""
    shared = tmp_path / "shared"
    shutil.copytree(run / STEP1, shared / "ckpt")
    (run / "checkpoints" / "step_00000000").symlink_to(shared / "ckpt")
    before = snapshot(shared)
    code, text = call(capfd, "train", train_cfg(run, tmp_path, steps=4, keep_checkpoint_max=2))
    assert code == 0 and "step_00000000 is a symbolic link: left alone" in text
    assert snapshot(shared) == before and (run / "checkpoints" / "step_00000000").is_symlink()
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert names == ["step_00000000", "step_00000003", "step_00000004"]


def test_a_save_onto_a_symlinked_step_directory_is_refused(run, tmp_path, capfd):
    shared = tmp_path / "shared"
    (shared / "ckpt").mkdir(parents=True)
    (shared / "ckpt" / "notes.txt").write_text("mine\n")
    (run / "checkpoints" / "step_00000003").symlink_to(shared / "ckpt")
    before, ckpts = snapshot(shared), checkpoints(run)
    code, text = call(capfd, "train", train_cfg(run, tmp_path))
    assert code == 2 and "step_00000003 is a symbolic link" in text and "does not save over it" in text
    assert snapshot(shared) == before and checkpoints(run) == ckpts


# ---------------------------------------------------------------- 4. a finished run is not scratch


def test_resume_none_over_committed_checkpoints_needs_overwrite(run, tmp_path, capfd):
    ckpts = checkpoints(run)
    metrics = (run / "metrics.jsonl").read_bytes()
    cfg = train_cfg(run, tmp_path, steps=2, resume="none")
    code, text = call(capfd, "train", cfg)
    assert code == 2 and "holds 2 committed checkpoint(s) (steps 1, 2)" in text and "--overwrite" in text
    code, text = call(capfd, "train", train_cfg(run, tmp_path, steps=2), "--auto_resume", "False")
    assert code == 2 and "holds 2 committed checkpoint(s)" in text  # the seed's spelling of resume: none
    assert checkpoints(run) == ckpts and (run / "metrics.jsonl").read_bytes() == metrics
    code, text = call(capfd, "train", cfg, "--overwrite")
    assert code == 0 and "checkpoint.overwrite" in text
    notices = [e["reason"] for e in events(run) if e["event"] == "checkpoint_notice"]
    assert any("replaced by this run's first checkpoint" in n for n in notices)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002"]


# ---------------------------------------------------------------- 5. the dataset: unsealed manifests, the stamp


@pytest.fixture
def dataset(tiny_corpus, tmp_path) -> Path:
    folder = tmp_path / "data"
    shutil.copytree(Path(tiny_corpus).parent, folder)
    for stale in folder.glob("*.verified.json"):
        stale.unlink()
    return folder / Path(tiny_corpus).name


def _train_on(dataset: Path, tmp_path: Path, capfd, *extra: str) -> tuple[int, str]:
    cfg = tmp_path / "d.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(str(dataset), tmp_path / "r", train={"max_steps": 1})))
    return call(capfd, "train", cfg, *extra)


@pytest.mark.parametrize("eos, needle", [(10**6, "tokenizer.eos_id 1000000 is outside the vocabulary"),
                                         (7, "verified like a foreign dataset")])  # fmt: skip
def test_an_unsealed_manifest_is_verified_like_a_foreign_dataset(dataset, tmp_path, capfd, eos, needle):
    path = Path(f"{dataset}.manifest.json")
    manifest = json.loads(path.read_text())
    del manifest["manifest_sha256"]
    manifest["tokenizer"]["eos_id"] = eos
    path.write_text(json.dumps(manifest))
    before = snapshot(dataset.parent)
    code, text = _train_on(dataset, tmp_path, capfd)
    assert code == 2 and needle in text and not (tmp_path / "r" / "checkpoints").exists()
    assert snapshot(dataset.parent) == before


@pytest.mark.parametrize("how", ["same-size copy, old mtime", "in place, old mtime"])
def test_the_stamp_binds_inode_and_ctime(dataset, tmp_path, capfd, how):
    """A stamped .bin changed with one byte flipped and its mtime set back (a copy renamed over it: another
    inode; written in place: a new ctime) is read again and refused."""
    code, _ = call(capfd, "check", _check_cfg(tmp_path, dataset))
    assert code == 0 and Path(f"{dataset}.verified.json").is_file()
    binary = Path(f"{dataset}.bin")
    st = binary.stat()
    data = bytearray(binary.read_bytes())
    data[len(data) // 2] ^= 0x01
    if how.startswith("same-size copy"):
        copy = binary.with_name("copy.bin")
        copy.write_bytes(bytes(data))
        os.replace(copy, binary)
    else:
        with open(binary, "r+b") as f:
            f.write(bytes(data))
    os.utime(binary, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (binary.stat().st_size, binary.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    code, text = _train_on(dataset, tmp_path, capfd)
    assert code == 2 and "does not match its manifest" in text and "tiny.bin" in text


def _check_cfg(tmp_path: Path, dataset: Path) -> Path:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(str(dataset), tmp_path / "c")))
    return cfg

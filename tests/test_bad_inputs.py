"""Issue 14, case by case: every bad file, fault and hostile input a user can hit gets exit 2 with one paragraph
naming the culprit (no traceback), or a safe result that says what it did; the user's files stay byte-identical.

The commands run in this process through ``llmtrain.cli.main`` (what the ``llmtrain`` script calls), so a stray
exception fails the test outright; ``capfd`` sees what threads print too. A finished 2-step run (a checkpoint
at steps 1 and 2) is made once and copied into each test.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from llmtrain.cli import main as cli

STEP1, STEP2 = "checkpoints/step_00000001", "checkpoints/step_00000002"


SAVE_EVERY_STEP = {"checkpoint": {"save_steps": 1, "keep_checkpoint_max": 3}}


def _cfg(prefix: str, out: Path) -> dict:
    return tiny_config(prefix, out, **SAVE_EVERY_STEP)


@pytest.fixture(scope="module")
def finished_run(tiny_corpus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("finished")
    cfg_file = root / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(_cfg(tiny_corpus, root / "run")))
    assert cli(["train", str(cfg_file)]) == 0
    return root / "run"


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    """A private copy of the finished run."""
    shutil.copytree(finished_run, tmp_path / "run")
    return tmp_path / "run"


def call(capfd, *argv: str) -> tuple[int, str, str]:
    code = cli([str(a) for a in argv])
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    return code, out, err


def write_cfg(tmp_path: Path, cfg: dict, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def reseal(ckpt: Path, name: str) -> None:
    """Update checksums.json for ``name`` as if the file had been written that way (tampering that the checksums
    cannot see; the content checks must)."""
    record = json.loads((ckpt / "checksums.json").read_text())
    data = (ckpt / name).read_bytes()
    record["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "checksums.json").write_text(json.dumps(record))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def docs(path: Path, n: int = 200) -> Path:
    path.write_text("".join(json.dumps({"text": f"hello world number {i}"}) + "\n" for i in range(n)))
    return path


# ---------------------------------------------------------------- data loss: prepare never replaces inputs


def test_prepare_rejects_naming_an_input_is_refused(tmp_path, capfd):
    src = docs(tmp_path / "in.jsonl")
    before = src.read_bytes()
    code, _, err = call(capfd, "prepare", "--input", src, "--output", tmp_path / "o/x", "--train-tokenizer",
                        "300", "--rejects", src)  # fmt: skip
    assert code == 2 and "--rejects" in err and "is one of the inputs" in err
    assert src.read_bytes() == before and not (tmp_path / "o").exists()


def test_prepare_never_replaces_a_strangers_dataset_files(tmp_path, capfd):
    src = docs(tmp_path / "in.jsonl")
    mine = tmp_path / "U"
    mine.mkdir()
    for name in ("foo.bin", "foo.idx", "foo.tokenizer.json"):
        (mine / name).write_text(f"my own {name}\n")
    before = snapshot(mine)
    code, _, err = call(
        capfd, "prepare", "--input", src, "--output", mine / "foo", "--train-tokenizer", "300"
    )
    assert code == 2 and "were not written by llmtrain" in err and "foo.tokenizer.json" in err
    assert snapshot(mine) == before


def test_prepare_output_that_would_overwrite_its_input_is_refused(tmp_path, capfd):
    src = docs(tmp_path / "bar.report.txt")
    before = src.read_bytes()
    code, _, err = call(
        capfd, "prepare", "--input", src, "--output", tmp_path / "bar", "--train-tokenizer", "300"
    )
    assert code == 2 and "would overwrite the input" in err and "bar.report.txt" in err
    assert src.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["bar.report.txt"]


def test_prepare_replaces_its_own_dataset(tmp_path, capfd):
    """The guard is not a refusal of everything: a dataset of ours (manifest) is rebuilt in place."""
    src = docs(tmp_path / "in.jsonl")
    assert (
        call(capfd, "prepare", "--input", src, "--output", tmp_path / "o/x", "--train-tokenizer", "300")[0]
        == 0
    )
    docs(src, 150)
    code, _, _ = call(capfd, "prepare", "--input", src, "--output", tmp_path / "o/x", "--train-tokenizer", "300",
                      "--overwrite")  # fmt: skip
    assert code == 0 and json.loads((tmp_path / "o/x.manifest.json").read_text())["documents"] == 150


# ---------------------------------------------------------------- silent wrong results -> errors or fallback


def test_generate_falls_back_from_a_corrupted_checkpoint_and_says_so(run, capfd):
    flip_byte(run / STEP2 / "__0_0.distcp")
    code, out, err = call(capfd, "generate", run, "--prompt", "def", "--max-new-tokens", "2")
    assert code == 0 and "step_00000002 skipped" in err and "SHA-256" in err
    code, _, err = call(capfd, "generate", run / STEP2, "--prompt", "def", "--max-new-tokens", "2")
    assert code == 2 and "fails verification" in err  # the one the user named: refused, not replaced


def test_generate_with_a_deleted_data_file_falls_back(run, capfd):
    (run / STEP2 / "__0_1.distcp").unlink()
    code, _, err = call(capfd, "generate", run, "--prompt", "def", "--max-new-tokens", "2")
    assert code == 0 and "__0_1.distcp is missing" in err


def test_export_verifies_the_checkpoint_first(run, tmp_path, capfd):
    flip_byte(run / STEP2 / "__0_0.distcp")
    code, _, err = call(capfd, "export", run / STEP2, "--to", "hf", tmp_path / "hf")
    assert code == 2 and "fails verification" in err and not (tmp_path / "hf").exists()


def test_trainer_state_of_another_step_is_not_resumed(run, tmp_path, capfd):
    """trainer_state.json saying step 1 inside step_00000002 (checksums updated too): skipped with the reason."""
    state = json.loads((run / STEP2 / "trainer_state.json").read_text())
    state["step"] = 1
    (run / STEP2 / "trainer_state.json").write_text(json.dumps(state))
    reseal(run / STEP2, "trainer_state.json")
    cfg = write_cfg(tmp_path, tiny_config(_dataset(run), run, train={"max_steps": 3}, **SAVE_EVERY_STEP))
    code, out, _ = call(capfd, "train", cfg)
    assert code == 0 and "says step 1, but the directory is step 2" in out
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resumed"][
        -1
    ] == 1  # step 1's weights with step 1's state


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("trainer_state.json", "{not json", "trainer_state.json is unreadable"),
        ("trainer_state.json", "[1, 2]", "not an object with an integer step"),
        ("rng_rank0.json", "garbage", "rng_rank0.json is unreadable"),
        (".metadata", "not a pickle", "cannot read the checkpoint metadata"),
    ],
)
def test_damaged_small_files_fall_back_to_the_previous_checkpoint(
    run, tmp_path, capfd, name, content, needle
):
    (run / STEP2 / name).write_text(content)
    reseal(run / STEP2, name)
    cfg = write_cfg(tmp_path, tiny_config(_dataset(run), run, train={"max_steps": 3}, **SAVE_EVERY_STEP))
    code, out, _ = call(capfd, "train", cfg)
    assert code == 0 and needle in out and "falling back" in out
    assert (run / "checkpoints/step_00000003/COMMITTED").exists()


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {_Payload.target}",))

    target = ""


def test_malicious_data_file_is_refused_without_unpickling(run, tmp_path, capfd):
    """A .distcp replaced by a pickle that would run a command (checksums updated): never executed, never the
    advice to turn weights_only off; train falls back to the previous checkpoint, generate on it refuses."""
    _Payload.target = str(tmp_path / "PWNED")
    data = run / STEP2 / "__0_0.distcp"
    data.write_bytes(pickle.dumps(_Payload()) + b"\0" * max(0, data.stat().st_size - 64))
    reseal(run / STEP2, "__0_0.distcp")
    code, _, err = call(capfd, "generate", run / STEP2, "--prompt", "def", "--max-new-tokens", "2")
    assert code == 2 and "reading its tensors failed" in err and "weights_only" not in err
    cfg = write_cfg(tmp_path, tiny_config(_dataset(run), run, train={"max_steps": 3}, **SAVE_EVERY_STEP))
    code, out, err = call(capfd, "train", cfg)
    assert code == 0 and "step_00000002 skipped" in out and "weights_only" not in out + err
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize(
    "override, needle",
    [
        ("stability.watch=[bogus]", "stability.watch[0]: 'bogus' is not one of loss, grad_norm"),
        ("stability.rule=os.system", "stability.rule: 'os.system' is not one of"),
        ("train.lr=abc", "command-line override 'train.lr=abc'"),
        ("data.mixture=[{start_sample: 8, weights: [0.5, 0.5]}]", "weights: [1 non-negative numbers"),
        ("data.mixture=[{start_sample: -5, weights: [1.0]}]", "start_sample: N >= 1"),
        ("data.mixture=[{start_sample: 8, weights: [abc]}]", "data.mixture[0].weights = ['abc']"),
    ],
)
def test_check_refuses_what_train_refuses(tmp_path, tiny_corpus, capfd, override, needle):
    cfg = write_cfg(tmp_path, _cfg(tiny_corpus, tmp_path / "r"))
    for command in ("check", "train"):
        code, _, err = call(capfd, command, cfg, override)
        assert code == 2 and needle in err, (command, err)
    assert not (tmp_path / "r").exists()


def test_a_prompt_longer_than_the_trained_length_warns(run, capfd):
    code, _, err = call(capfd, "generate", run, "--prompt", "x " * 40, "--max-new-tokens", "2")
    assert code == 0 and "longer than the 32 tokens the model was trained on" in err


# ---------------------------------------------------------------- hangs: the YAML loader is bounded


def _bomb() -> str:
    lines = ['x0: &x0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"x{i}: &x{i} [" + ",".join([f"*x{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return "model:\n  flavor: debug\n  rope_scaling:\n" + "".join(f"    {x}\n" for x in lines)


@pytest.mark.parametrize(
    "text, needle",
    [
        (_bomb(), "aliases (*name) are expanded"),
        ("model: &a {flavor: debug, rope_scaling: *a}\n", "a config cannot be recursive"),
        ("model: " + "[" * 20000 + "]" * 20000 + "\n", "nested too deeply"),
        ("model: " + "{a: " * 100 + "1" + "}" * 100 + "\n", "nested more than 64 levels"),
        ("", "is empty"),
        ("- 1\n- 2\n", "got a list"),
        ("data: !!python/object/apply:os.system ['echo hacked']\n", "could not determine a constructor"),
    ],
)
def test_hostile_yaml_is_a_clean_error(tmp_path, capfd, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    for argv in (["check", path], ["train", path], ["prepare", "--input", path, "--output", tmp_path / "o",
                                                    "--train-tokenizer", "300", "--config", path]):  # fmt: skip
        if argv[0] == "prepare" and needle == "is empty":
            continue  # an empty run config is a valid (empty) data.prepare section
        code, _, err = call(capfd, *argv)
        assert code == 2 and needle in err and str(path) in err, (argv[0], err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_prepare_config_that_does_not_exist(tmp_path, capfd):
    src = docs(tmp_path / "in.jsonl")
    code, _, err = call(capfd, "prepare", "--input", src, "--output", tmp_path / "o/x", "--train-tokenizer", "300",
                        "--config", tmp_path / "missing.yaml")  # fmt: skip
    assert code == 2 and "missing.yaml does not exist" in err


# ---------------------------------------------------------------- OSErrors: the path and what would fix it


@pytest.mark.parametrize(
    "layout, overrides, needle",
    [
        (
            {"afile": "x"},
            ["run.output_dir=afile"],
            "afile: File exists (it is a file where a directory is needed",
        ),
        ({"r/checkpoints": "x"}, ["run.output_dir=r"], "r/checkpoints"),
        ({"r/tb": "x"}, ["run.output_dir=r", "checkpoint.save_dir=r/tb/x"], "Not a directory"),
        ({"r/tensorboard": "x"}, ["run.output_dir=r", "logging.tensorboard=true"], "r/tensorboard"),
        ({"r/metrics.jsonl/": None}, ["run.output_dir=r"], "r/metrics.jsonl: Is a directory"),
        ({"r/config.yaml/": None}, ["run.output_dir=r"], "r/config.yaml is a directory"),
    ],
)
def test_train_paths_the_system_refuses(tmp_path, tiny_corpus, capfd, monkeypatch, layout, overrides, needle):
    monkeypatch.chdir(tmp_path)
    for name, content in layout.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if content is None else path.write_text(content)
    cfg = write_cfg(tmp_path, _cfg(tiny_corpus, tmp_path / "r"), "cfg.yaml")
    before = snapshot(tmp_path)
    code, _, err = call(capfd, "train", cfg, *overrides)
    assert code == 2 and needle in err
    after = snapshot(tmp_path)
    assert all(after.get(k) == v for k, v in before.items())  # nothing of the user's changed
    assert not list(tmp_path.rglob(".config.yaml.tmp*"))


def test_export_and_report_onto_a_users_file_or_directory(run, tmp_path, capfd):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    (tmp_path / "page.html").write_text("<html>my page</html>\n")
    before = snapshot(tmp_path / "mine"), (tmp_path / "page.html").read_bytes()
    code, _, err = call(capfd, "export", run, "--to", "hf", mine / "notes.txt")
    assert code == 2 and "notes.txt" in err
    code, _, err = call(capfd, "report", run, "--out", mine, "--no-plan")
    assert code == 2 and "is a directory" in err
    code, _, err = call(capfd, "report", run, "--out", tmp_path / "page.html", "--no-plan")
    assert code == 2 and "not a report written by llmtrain" in err
    assert (snapshot(tmp_path / "mine"), (tmp_path / "page.html").read_bytes()) == before
    assert call(capfd, "report", run, "--out", tmp_path / "r.html", "--no-plan")[0] == 0
    assert call(capfd, "report", run, "--out", tmp_path / "r.html", "--no-plan")[0] == 0  # ours: replaced


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))


def test_checkpoint_write_refused_by_the_filesystem(tmp_path, tiny_corpus):
    """A save the filesystem refuses part-way (files limited to 200 KB: EFBIG, as a full disk is ENOSPC): exit 2
    naming the checkpoint and the reason, the partial save removed, no traceback from the writer threads."""
    cfg = write_cfg(tmp_path, _cfg(tiny_corpus, tmp_path / "r"))
    p = subprocess.run([sys.executable, "-m", "llmtrain", "train", str(cfg)], capture_output=True, text=True,
                       timeout=300, preexec_fn=_limit_file_size, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "saving the checkpoint of step 1 failed" in p.stderr
    assert os.strerror(errno.EFBIG) in p.stderr
    assert not list((tmp_path / "r/checkpoints").glob("*.tmp"))


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A small tmpfs mounted at ``path`` for the test (skipped where mounting is not allowed)."""
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip(f"cannot mount a tmpfs ({options}) here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_full_disk_is_named(tmp_path, tiny_corpus):
    """The same on a real full filesystem (a 600 KB tmpfs)."""
    with tmpfs(tmp_path / "disk", "size=600k") as disk:
        cfg = write_cfg(tmp_path, tiny_config(tiny_corpus, disk / "r", **SAVE_EVERY_STEP))
        p = subprocess.run([sys.executable, "-m", "llmtrain", "train", str(cfg)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
        assert f"the disk holding {disk}/r/checkpoints is full" in p.stderr
        assert not list((disk / "r/checkpoints").glob("*.tmp"))


def test_read_only_filesystem_is_named(tmp_path, tiny_corpus, capfd):
    """run.output_dir on a read-only filesystem (as root, chmod cannot make a folder read-only: a tmpfs can)."""
    with tmpfs(tmp_path / "ro", "ro,size=1m") as disk:
        cfg = write_cfg(tmp_path, tiny_config(tiny_corpus, disk / "r", **SAVE_EVERY_STEP))
        code, _, err = call(capfd, "train", cfg)
        assert (
            code == 2 and f"{disk}/r" in err and "Read-only file system" in err and "choose a writable" in err
        )


# ---------------------------------------------------------------- messages that name the right culprit


def test_launch_nnodes_range_is_checked_as_such(tmp_path, tiny_corpus, capfd):
    cfg = write_cfg(tmp_path, _cfg(tiny_corpus, tmp_path / "r"))
    with pytest.raises(SystemExit) as e:
        cli(["launch", str(cfg), "--nproc-per-node", "1", "--nnodes", "3:1"])
    assert e.value.code == 2
    err = capfd.readouterr().err
    assert "--nnodes" in err and "MIN:MAX with 1 <= MIN <= MAX" in err and "divisible" not in err


def test_damaged_partition_summary_is_named(tmp_path, capfd):
    src = docs(tmp_path / "in.jsonl")
    call(capfd, "prepare", "--input", src, "--output", tmp_path / "o/x", "--train-tokenizer", "300")
    tok = tmp_path / "o/x.tokenizer.json"
    for i in (0, 1):
        code, _, _ = call(capfd, "prepare", "--input", src, "--output", tmp_path / "p/x", "--tokenizer", tok,
                          "--partition", f"{i}/2")  # fmt: skip
        assert code == 0
    (tmp_path / "p/x.partitions/1-of-2/done.json").write_text("{bad")
    code, _, err = call(capfd, "merge", "--output", tmp_path / "p/x")
    assert code == 2 and "1-of-2/done.json is damaged" in err and "No partitions" not in err
    assert not (tmp_path / "p/x.manifest.json").exists()


def test_empty_config_yaml_under_generate_names_it(run, capfd):
    (run / "config.yaml").write_text("")
    code, _, err = call(capfd, "generate", run, "--prompt", "def", "--max-new-tokens", "2")
    assert code == 2 and f"{run}/config.yaml is empty" in err


def _dataset(run: Path) -> str:
    return yaml.safe_load((run / "config.yaml").read_text())["data"]["datasets"][0]["path"]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda m: {**m, "tokenizer": "x"}, "was changed after prepare wrote it"),
        (
            lambda m: {**{k: v for k, v in m.items() if k != "manifest_sha256"}, "tokenizer": "x"},
            "'tokenizer' and 'files' must be JSON objects",
        ),
    ],
)
def test_a_hand_edited_manifest_is_refused(tmp_path, tiny_corpus, capfd, edit, needle):
    folder = tmp_path / "data"
    shutil.copytree(Path(tiny_corpus).parent, folder)
    manifest = folder / (Path(tiny_corpus).name + ".manifest.json")
    manifest.write_text(json.dumps(edit(json.loads(manifest.read_text()))))
    cfg = write_cfg(tmp_path, _cfg(str(folder / Path(tiny_corpus).name), tmp_path / "r"))
    for command in ("check", "train"):
        code, _, err = call(capfd, command, cfg)
        assert code == 2 and needle in err and str(manifest) in err, (command, err)

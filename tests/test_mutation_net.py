"""The generic net of issue 14: the tiny config, a prepared dataset and a checkpoint mutated many ways, and the
commands run on each. No run may print a traceback or hang, and none may exit 0 on a corrupted input unless it
fell back to an intact copy and said so.

- config: every leaf key of the tiny config dropped, or set to a string, a list, a mapping, null, zero, -1 and
  10**12; ``check`` runs on each (in process, milliseconds each); a seeded sample of the ones ``check`` accepts
  runs one ``train`` step (subprocess, bounded time) and must not fail where ``check`` passed (exit 0 or 2, and
  2 only with a message).
- dataset: every file of a prepared dataset truncated to half, emptied, and with a byte flipped at its start,
  middle and end; ``check`` and one ``train`` step must both refuse (exit 2) — a dataset has no fallback.
- checkpoint: every file of the newest checkpoint truncated to half and with a byte flipped in the middle;
  ``generate`` and a resumed ``train`` must fall back to the older checkpoint and say so (exit 0 with
  "skipped"), or refuse (exit 2); ``export`` of the damaged checkpoint itself must refuse.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from llmtrain.cli import main as cli
from llmtrain.train.checkpoint import verify_checkpoint

SEED = 1234


def _cfg(prefix: str, out: Path) -> dict:
    return tiny_config(prefix, out, checkpoint={"save_steps": 1, "keep_checkpoint_max": 3})


def _leaves(d: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _leaves(v, (*prefix, k))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for i, item in enumerate(v):
                out += _leaves(item, (*prefix, k, i))
        else:
            out.append((*prefix, k))
    return out


BAD_VALUES = ["text", [1, 2], {"a": 1}, None, 0, -1, 10**12]


def _mutations(base: dict) -> list[tuple[str, dict]]:
    out = []
    for path in _leaves(base):
        name = ".".join(map(str, path))
        dropped = copy.deepcopy(base)
        node = dropped
        for p in path[:-1]:
            node = node[p]
        del node[path[-1]]
        out.append((f"drop {name}", dropped))
        for value in BAD_VALUES:
            mutated = copy.deepcopy(base)
            node = mutated
            for p in path[:-1]:
                node = node[p]
            if node[path[-1]] == value:
                continue
            node[path[-1]] = value
            out.append((f"{name}={value!r}", mutated))
    return out


def _subprocess(argv: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "llmtrain", *argv], capture_output=True, text=True, env=env,
                          timeout=timeout)  # fmt: skip  # a hang fails the test here


def test_config_mutations(tiny_corpus, tmp_path, capfd):
    base = _cfg(tiny_corpus, tmp_path / "run")
    accepted = []
    cases = _mutations(base)
    assert len(cases) > 150
    for i, (name, cfg) in enumerate(cases):
        path = tmp_path / f"m{i}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        code = cli(["check", str(path)])
        out, err = capfd.readouterr()
        assert "Traceback" not in err, (name, err[-2000:])
        assert code in (0, 2), (name, code, err[-2000:])
        if code == 2:
            assert "error:" in err and len(err.strip().splitlines()) <= 3, (name, err)  # one paragraph
        elif "max_steps" not in name and "10**12" not in name and "1000000000000" not in name:
            accepted.append((name, path))
    assert len(accepted) >= 10
    for name, path in random.Random(SEED).sample(accepted, 4):
        p = _subprocess(
            ["train", str(path), "train.max_steps=1", f"run.output_dir={tmp_path / ('t' + path.stem)}"]
        )
        assert "Traceback" not in p.stderr, (name, p.stderr[-3000:])
        assert p.returncode == 0, (name, "check accepted it, train refused:", p.stderr[-2000:])


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "half":
        data = data[: len(data) // 2]
    elif how == "empty":
        data = bytearray()
    else:
        at = {"start": 0, "middle": len(data) // 2, "end": len(data) - 1}[how]
        data[at] ^= 0x5A
    path.write_bytes(bytes(data))


DATASET_DAMAGE = ["half", "empty", "start", "middle", "end"]


def test_dataset_mutations(tiny_corpus, tmp_path, capfd):
    src = Path(tiny_corpus)
    names = sorted(p.name for p in src.parent.iterdir() if p.name.startswith(src.name + ".") and p.is_file()
                   and not p.name.endswith((".report.txt", ".verified.json")))  # fmt: skip
    assert {f"{src.name}.bin", f"{src.name}.idx", f"{src.name}.manifest.json"} <= set(names)
    trained = 0
    for name in names:
        for how in DATASET_DAMAGE:
            folder = tmp_path / f"{name}-{how}"
            folder.mkdir()
            for n in names:
                shutil.copy(src.parent / n, folder / n)
            _damage(folder / name, how)
            cfg = folder / "run.yaml"
            cfg.write_text(yaml.safe_dump(_cfg(str(folder / src.name), folder / "run")))
            code = cli(["check", str(cfg)])
            out, err = capfd.readouterr()
            assert "Traceback" not in err, (name, how, err[-2000:])
            if code == 0:  # check may not read every byte: train must then refuse before training
                p = _subprocess(["train", str(cfg), "train.max_steps=1"])
                trained += 1
                assert "Traceback" not in p.stderr, (name, how, p.stderr[-3000:])
                assert p.returncode == 2, (name, how, "a damaged dataset trained:", p.stdout[-1000:])
            else:
                assert code == 2 and "error:" in err, (name, how, err)
    assert trained <= len(names) * len(DATASET_DAMAGE)


@pytest.fixture(scope="module")
def two_checkpoints(tiny_corpus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("net")
    cfg = root / "run.yaml"
    cfg.write_text(yaml.safe_dump(_cfg(tiny_corpus, root / "run")))
    assert cli(["train", str(cfg)]) == 0
    return root / "run"


CHECKPOINT_DAMAGE = ["half", "middle"]


def test_checkpoint_mutations(two_checkpoints, tmp_path, capfd):
    newest = two_checkpoints / "checkpoints/step_00000002"
    names = sorted(p.name for p in newest.iterdir())
    assert {"COMMITTED", "checksums.json", "trainer_state.json", ".metadata", "rng_rank0.json"} <= set(names)
    rng = random.Random(SEED)
    for name in names:
        for how in CHECKPOINT_DAMAGE:
            run = tmp_path / f"{name}-{how}"
            shutil.copytree(two_checkpoints, run)
            ckpt = run / "checkpoints/step_00000002"
            _damage(ckpt / name, how)
            before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
            code = cli(["generate", str(run), "--prompt", "def", "--max-new-tokens", "2"])
            out, err = capfd.readouterr()
            assert "Traceback" not in err, (name, how, err[-2000:])
            assert code == 0 and "step_00000002 skipped" in err, (name, how, code, err[-2000:])
            if rng.random() < 0.5:  # export of the damaged checkpoint itself: refused
                code = cli(["export", str(ckpt), "--to", "hf", str(tmp_path / f"hf-{name}-{how}")])
                out, err = capfd.readouterr()
                assert code == 2 and "Traceback" not in err and "fails verification" in err, (name, how, err)
            cfg = run / "resume.yaml"
            cfg.write_text(yaml.safe_dump(_cfg(yaml.safe_load((run / "config.yaml").read_text())["data"]["datasets"]
                                               [0]["path"], run)))  # fmt: skip
            code = cli(["train", str(cfg), "train.max_steps=3"])
            out, err = capfd.readouterr()
            assert "Traceback" not in err, (name, how, err[-2000:])
            assert code == 0 and "step_00000002 skipped" in out, (name, how, out[-2000:], err[-2000:])
            events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
            assert [e["step"] for e in events if e["event"] == "resumed"][-1] == 1
            resaved = run / "checkpoints/step_00000002"  # step 2 trained again from step 1 and saved anew
            assert (
                verify_checkpoint(resaved) is None
                and {p.name: p.read_bytes() for p in resaved.iterdir()} != before
            )


# ----------------------------------------------------------------------------- issue 34: the commands' other inputs
def _one_paragraph(name: str, code: int, err: str) -> None:
    assert "Traceback" not in err, (name, err[-3000:])
    assert code in (0, 2), (name, code, err[-2000:])
    if code == 2:
        assert err.count("error:") == 1, (name, err)  # one message (argparse prints its usage lines first)


def _cli(argv: list[str], capfd) -> tuple[int, str]:
    try:
        code = cli(argv)
    except SystemExit as e:  # argparse's refusals: exit 2 with the flag
        code = int(e.code or 0)
    return code, capfd.readouterr().err


def test_task_file_mutations(two_checkpoints, tmp_path, capfd):
    """Every key of the shipped multiple-choice task (and of its dataset_kwargs) dropped or set to each bad
    value: reading it for lm-eval (our loader and shape checks, then lm-eval's loader) gives a task config or
    one ConfigError naming the file; a seeded sample of the accepted ones is built by lm-eval (tasks, or the
    same ConfigError), and a seeded sample of all is scored by `llmtrain eval` (exit 0 or 2, one message)."""
    from llmtrain.errors import ConfigError
    from llmtrain.eval.run import build_tasks, import_lm_eval
    from llmtrain.eval.tasks import shipped_dir, task_configs

    import_lm_eval()
    base = yaml.safe_load((shipped_dir() / "stdlib_mc.yaml").read_text())
    base["dataset_kwargs"]["data_files"]["test"] = str(shipped_dir() / "stdlib_mc.jsonl")
    cases = [(n, c) for n, c in _mutations(base) if not n.startswith("metadata")]
    assert len(cases) > 80
    files, accepted = [], []
    for i, (name, cfg) in enumerate(cases):
        path = tmp_path / f"t{i}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        files.append((name, path))
        try:
            task_configs([str(path)])
            accepted.append((name, path))
        except ConfigError as e:
            assert path.name in str(e), (name, str(e))
    rng = random.Random(SEED)
    for name, path in rng.sample(accepted, 10):  # lm-eval's task builder: ~0.2 s a task
        try:
            build_tasks([str(path)])
        except ConfigError as e:
            assert path.name in str(e), (name, str(e))
    for name, path in rng.sample(files, 4):
        code, err = _cli(["eval", str(two_checkpoints), "--tasks", str(path), "--limit", "1"], capfd)
        _one_paragraph(name, code, err)


CATALOG_DEVICE = {"peak_tflops": 100.0, "memory_gib": 80, "memory_bw_gbs": 2000, "intra_node_bw_gbs": 300,
                  "inter_node_bw_gbs": 25, "devices_per_node": 8, "matmul_efficiency": 0.6}  # fmt: skip


def test_device_catalog_mutations(two_checkpoints, tmp_path, capfd):
    """Every figure of a user's catalog device dropped or set to each bad value (and NaN, infinity, a bool, a
    number written as text), and the file's bytes damaged: the catalog loads or is refused with one
    ConfigError naming the file; a seeded sample plans through `llmtrain plan --catalog` (exit 0 or 2)."""
    from llmtrain.errors import ConfigError
    from llmtrain.plan.catalog import load_catalog

    base = {"devices": {"mine": CATALOG_DEVICE}, "aliases": {"m1": "mine"}}
    cases = _mutations(base)
    for key in CATALOG_DEVICE:
        for value in (float("nan"), float("inf"), True, "100"):
            cases.append((f"{key}={value!r}", {**base, "devices": {"mine": {**CATALOG_DEVICE, key: value}}}))
    paths = []
    for i, (name, cfg) in enumerate(cases):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        paths.append((name, path))
    text = tmp_path / "whole.yaml"
    text.write_text(yaml.safe_dump(base))
    for how in DATASET_DAMAGE:
        path = tmp_path / f"damaged-{how}.yaml"
        shutil.copy(text, path)
        _damage(path, how)
        paths.append((f"bytes {how}", path))
    for name, path in paths:
        before = path.read_bytes()
        try:
            load_catalog(path)
        except ConfigError as e:
            assert path.name in str(e), (name, str(e))
        assert path.read_bytes() == before
    cfg = str(two_checkpoints / "config.yaml")
    for name, path in random.Random(SEED).sample(paths, 4):
        code, err = _cli(["plan", cfg, "--cluster", "1xmine", "--catalog", str(path)], capfd)
        _one_paragraph(name, code, err)


FLAG_VALUES = ["-1", "0", "0.5", "1e400", "nan", "inf", "", "x", "99999999999999999999999"]
LAUNCH_FLAGS = ["--nproc-per-node", "--nnodes", "--node-rank", "--master-port", "--max-restarts",
                "--connect-timeout", "--run-id", "--rdzv-conf", "--master-addr"]  # fmt: skip
GENERATE_FLAGS = ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--prompt"]
MERGE_FLAGS = ["--seq-length", "--num-shards", "--pack"]


def test_command_flag_mutations(two_checkpoints, tiny_corpus, tmp_path, capfd):
    """launch (dry run), generate, export and merge with each flag set to each odd value: exit 0 or 2 with one
    message, never a traceback; what the user owns (the run, the partitions) byte-identical."""
    import glob
    import sysconfig

    rng = random.Random(SEED)
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    owned = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    cfg = str(run / "config.yaml")
    for flag in LAUNCH_FLAGS:
        for value in FLAG_VALUES:
            code, err = _cli(["launch", cfg, "--nproc-per-node", "1", flag, value, "--dry-run"], capfd)
            _one_paragraph(f"launch {flag} {value!r}", code, err)
    for flag in GENERATE_FLAGS:
        for value in rng.sample(FLAG_VALUES, 4):
            argv = ["generate", str(run), "--prompt", "def", "--max-new-tokens", "2", flag, value]
            code, err = _cli(argv, capfd)
            _one_paragraph(f"generate {flag} {value!r}", code, err)
    for i, value in enumerate([*FLAG_VALUES, "-inf", "1e-300"]):
        code, err = _cli(["export", str(run), "--to", "hf", str(tmp_path / f"hf{i}"), "--max-shard-gb", value],
                         capfd)  # fmt: skip
        _one_paragraph(f"export --max-shard-gb {value!r}", code, err)
    for target in ("", ".", "..", "/", str(run)):
        code, err = _cli(["export", str(run), "--to", "hf", target], capfd)
        _one_paragraph(f"export to {target!r}", code, err)
        assert code == 2, target
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == owned
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:3]
    prefix = str(tmp_path / "merged" / "ds")
    for i in range(2):
        argv = ["prepare", "--input", *files, "--output", prefix, "--partition", f"{i}/2",
                "--tokenizer", f"{tiny_corpus}.tokenizer.json"]  # fmt: skip
        assert _cli(argv, capfd)[0] == 0
    parts = {p: p.read_bytes() for p in Path(f"{prefix}.partitions").rglob("*") if p.is_file()}
    for flag in MERGE_FLAGS:
        for value in rng.sample(FLAG_VALUES, 4):
            code, err = _cli(["merge", "--output", prefix, "--keep-partitions", flag, value], capfd)
            _one_paragraph(f"merge {flag} {value!r}", code, err)
    assert {p: p.read_bytes() for p in parts} == parts

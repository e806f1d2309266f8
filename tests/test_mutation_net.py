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

"""Issue 27, section 2, the config side: hostile config files and overrides through the commands a user runs.

Each class gets exit code 2 and one paragraph naming the file (or the override), the key and what would be
valid, no traceback, no file written, and the input files byte-identical afterwards:

- control characters in the YAML text (raw, or written as escapes inside a string);
- overrides that nest deeply or expand (alias bombs, recursive aliases) and integers of thousands of digits;
- sizes that used to reach a loop before any bound (1e30 layers hung `check`; 1e9 shards hung `prepare`):
  run in a subprocess with a timeout;
- numbers that mean nothing (negative timeouts, NaN/inf anywhere, 2^63, a 0 where 0 is no value).

The range table itself (``llmtrain.config.ranges``) is checked field by field: every number of the schema has a
range, both ends are accepted and a step past either end is refused, by the loader and by ``validate``.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from llmtrain.cli import main as cli
from llmtrain.config import Config, config_from_dict
from llmtrain.config.ranges import RANGES, range_of
from llmtrain.errors import ConfigError
from llmtrain.resolve import validate

BASE = (
    "model:\n  flavor: debug\n  seq_length: 32\n"
    "train:\n  batch_size: 4\n  micro_batch_size: 2\n  max_steps: 2\n"
    "run:\n  device_target: cpu\n  output_dir: {out}\n"
)
COMMANDS = ("check", "train", "plan")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capfd, tmp_path: Path, text: str, *argv: str, commands=COMMANDS) -> list[str]:
    """Write ``text`` as c.yaml, run each command on it (plus argv); assert exit 2, one paragraph naming the file,
    no traceback, nothing written, the file byte-identical. Returns the messages."""
    path = tmp_path / "c.yaml"
    path.write_bytes(text.replace("{out}", str(tmp_path / "run")).encode("utf-8"))
    before = snapshot(tmp_path)
    messages = []
    for command in commands:
        code = cli([command, str(path), *argv])
        out, err = capfd.readouterr()
        assert code == 2, (command, out, err)
        assert "Traceback" not in err + out, err
        assert err.startswith(f"llmtrain {command}: error: ") and err.count("\n") == 1, err
        assert "c.yaml" in err or "command-line override" in err, err
        messages.append(err)
    assert snapshot(tmp_path) == before
    return messages


# ------------------------------------------------------------------------------------ control characters


@pytest.mark.parametrize(
    "text, needle",
    [
        (BASE + "run2: a\x00b\n", "control character U+0000 (NUL) at line 11, column 8"),
        (BASE.replace("flavor: debug", "flavor: de\x1bbug"), "control character U+001B (ESC) at line 2"),
        (BASE + "# \x07 bell in a comment\n", "control character U+0007 (BEL) at line 11, column 3"),
        (BASE.replace("{out}", '"{out}\\0x"'), "run.output_dir = '"),  # a NUL written as an escape
        (BASE.replace("flavor: debug", 'flavor: "de\\ebug"'), "model.flavor = 'de\\x1bbug' contains"),
        (BASE + '  "na\\x01me": x\n', "the key 'na\\x01me' contains the control character U+0001"),
    ],
)
def test_control_characters_are_refused(tmp_path, capfd, text, needle):
    for err in refused(capfd, tmp_path, text):
        assert needle in err and "control character" in err, err


def test_control_characters_in_a_prepare_config(tmp_path, capfd):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello world"}\n')
    for text, needle in [
        ("data:\n  prepare:\n    text_key: a\x00\n", "U+0000 (NUL) at line 3, column 16"),
        ('data:\n  prepare:\n    text_key: "a\\x1b"\n', "data.prepare.text_key = 'a\\x1b' contains"),
    ]:
        path = tmp_path / "p.yaml"
        path.write_text(text)
        before = snapshot(tmp_path)
        code = cli(["prepare", "--input", str(src), "--output", str(tmp_path / "o/x"), "--train-tokenizer", "300",
                    "--config", str(path)])  # fmt: skip
        out, err = capfd.readouterr()
        assert code == 2 and needle in err and "p.yaml" in err and "Traceback" not in err, err
        assert snapshot(tmp_path) == before


# ------------------------------------------------------- overrides that nest or expand; numbers of 5000 digits


def _bomb() -> str:
    """Nine levels of nine aliases: 9**9 values once expanded, 350 characters written."""
    parts = ["&a0 [l,l,l,l,l,l,l,l,l]"] + [
        f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)
    ]
    return "[" + ",".join(parts) + "]"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.rope_scaling." + ".".join(["a"] * 10_000) + "=1", "the key has 10,002 dotted parts"),
        (".".join(["a"] * 10_000) + "=1", "the key has 10,000 dotted parts"),
        ("model.rope_scaling=" + _bomb(), "expands to more than 200,000 values"),
        ("model.rope_scaling=&a [*a]", "a config cannot be recursive"),
        ("model.rope_scaling=" + "[" * 5000 + "]" * 5000, "nested"),
        ("train.max_steps=" + "9" * 5000, "an integer of 5,000 digits; a config number has at most 100"),
        ("train.lr=" + "9" * 5000, "an integer of 5,000 digits"),
        ("train.lr='" + "9" * 400 + "'", "train.lr: expected a number > 0, got '999"),  # no OverflowError
        (
            "train.max_steps='" + "9" * 5000 + "'",
            "train.max_steps: expected an integer >= 1 and <= 1,000,000,000, got '999",
        ),
    ],
)
def test_overrides_that_nest_expand_or_overflow(tmp_path, capfd, override, needle):
    for err in refused(capfd, tmp_path, BASE, override):
        assert needle in err and "command-line override" in err, err
        assert len(err) < 1000, err  # the 20,000-character override is not echoed whole


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            BASE.replace("max_steps: 2", "max_steps: " + "1" * 5000),
            "line 7, column 14: an integer of 5,000 digits",
        ),
        (BASE + "  rope_scaling: -" + "7" * 4400 + "\n", "an integer of 4,400 digits"),
        (
            BASE.replace("seq_length: 32", "seq_length: 32\n  rope_scaling: " + _bomb()),
            "expands to more than",
        ),
    ],
)
def test_files_with_huge_integers_or_alias_bombs(tmp_path, capfd, text, needle):
    for err in refused(capfd, tmp_path, text):
        assert needle in err, err


# ------------------------------------------------------------------ sizes that reached a loop (hangs before)


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    code = "import sys; from llmtrain.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout
    )


def test_sizes_that_hung_are_refused_quickly(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        BASE.replace("{out}", str(tmp_path / "run")).replace("seq_length: 32", "num_layers: 1.0e30")
    )
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello world"}\n')
    prep = tmp_path / "p.yaml"
    prep.write_text("data:\n  prepare:\n    num_shards: 1000000000\n")
    before = snapshot(tmp_path)
    result = _run(["check", str(cfg)])  # looped over 10**30 layers
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "model.num_layers: expected an integer >= 1 and <= 10,000 or null, got '1.0e30'" in result.stderr
    result = _run(["prepare", "--input", str(src), "--output", str(tmp_path / "o/x"), "--train-tokenizer", "300",
                   "--config", str(prep)])  # fmt: skip  # wrote 10**9 shards
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "data.prepare.num_shards: expected an integer >= 1 and <= 100,000, got 1000000000" in result.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "edit, needle",
    [
        ("model.num_layers=1000000000", "model.num_layers: expected an integer >= 1 and <= 10,000"),
        ("model.hidden_size=1.0e+30", "model.hidden_size: expected an integer >= 1 and <= 1,048,576"),
        ("model.vocab_size=1000000000000", "model.vocab_size: expected an integer >= 1 and <= 16,777,216"),
        (
            "model.seq_length=9223372036854775808",
            "model.seq_length: expected an integer >= 1 and <= 16,777,216",
        ),
        (
            "train.batch_size=1000000000000000000",
            "train.batch_size: expected an integer >= 1 and <= 16,777,216",
        ),
        ("model.moe.num_experts=1000000000", "model.moe.num_experts: expected an integer >= 0 and <= 65,536"),
        ("parallel.micro_batch_num=1000000000000", "parallel.micro_batch_num: expected an integer >= 1"),
        ("eval.eval_iters=1000000000000000", "eval.eval_iters: expected an integer >= 1 and <= 1,000,000"),
    ],
)
def test_sizes_are_bounded_before_anything_is_built(tmp_path, capfd, edit, needle):
    for err in refused(capfd, tmp_path, BASE, edit):
        assert needle in err, err


def test_prepare_config_numbers_are_typed_and_bounded(tmp_path, capfd):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello world"}\n')
    for value, needle in [
        ("seq_length: .nan", "data.prepare.seq_length: expected an integer >= 1 and <= 16,777,216, got nan"),
        ("num_shards: 1.5", "data.prepare.num_shards: expected an integer, got 1.5"),
        (
            "minhash: {bands: 1000000000}",
            "data.prepare.minhash.bands: expected an integer >= 1 and <= 10,000",
        ),
        (
            "filters: {max_top_ngram_chars: {3: .inf}}",
            "data.prepare.filters.max_top_ngram_chars.3: inf is not",
        ),
    ]:
        path = tmp_path / "p.yaml"
        path.write_text(f"data:\n  prepare:\n    {value}\n")
        before = snapshot(tmp_path)
        code = cli(["prepare", "--input", str(src), "--output", str(tmp_path / "o/x"), "--train-tokenizer", "300",
                    "--config", str(path)])  # fmt: skip
        out, err = capfd.readouterr()
        assert code == 2 and needle in err and "--config" in err and "Traceback" not in err, err
        assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------ numbers that mean nothing


@pytest.mark.parametrize(
    "edit, needle",
    [
        (
            "run.hang_timeout_s=-5",
            "run.hang_timeout_s: expected a number >= 0 and <= 10,000,000 (0: off), got -5",
        ),
        (
            "model.rope_scaling={rope_type: linear, factor: .nan}",
            "model.rope_scaling.factor: nan is not a finite",
        ),
        ("model.rope_scaling=.inf", "model.rope_scaling: inf is not a finite number"),
        ("model.rope_theta=.inf", "model.rope_theta: expected a number > 0 or null, got inf"),
        ("stability.k=.nan", "stability.k: expected a number > 0, got nan"),
        ("run.dist_timeout_s=0", "run.dist_timeout_s: expected an integer >= 1 and <= 10,000,000, got 0"),
        ("checkpoint.write_threads=0", "checkpoint.write_threads: expected an integer >= 1"),
        ("stability.window=0", "stability.window: expected an integer >= 1"),
        ("stability.consecutive=0", "stability.consecutive: expected an integer >= 1"),
        ("model.moe.top_k=0", "model.moe.top_k: expected an integer >= 1"),
        ("fault.spike_steps=0", "fault.spike_steps: expected an integer >= 1"),
        ("train.seed=-1", "train.seed: expected an integer >= 0 and <= 4,294,967,295"),
        (
            "stages=[{name: a, fraction: .nan}]",
            "stages[0].fraction: expected a number in (0, 1] or null, got nan",
        ),
        (
            "data.mixture=[{start_sample: 8, weights: [.inf]}]",
            "data.mixture[0].weights[0]: inf is not a finite",
        ),
    ],
)
def test_numbers_that_mean_nothing(tmp_path, capfd, edit, needle):
    for err in refused(capfd, tmp_path, BASE, edit):
        assert needle in err, err


def test_a_meaningless_number_in_the_file_names_the_file_and_key(tmp_path, capfd):
    text = BASE + "  hang_timeout_s: -5\n"
    for err in refused(capfd, tmp_path, text):
        assert "c.yaml: run.hang_timeout_s: expected a number >= 0 and <= 10,000,000 (0: off), got -5." in err


# --------------------------------------------------------------------- the range table, field by field


def _number_fields(cls: type, prefix: str = "") -> list[tuple[str, bool]]:
    """(dotted key with [] for list items, is an int) of every number field below the dataclass cls."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        key = f"{prefix}{name}"
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if typing.get_origin(tp) is list:
            tp, key = typing.get_args(tp)[0], f"{key}[]"
        if tp in (int, float):
            out.append((key, tp is int))
        elif dataclasses.is_dataclass(tp):
            out += _number_fields(tp, f"{key}.")
    return out


FIELDS = _number_fields(Config)


def test_every_number_field_has_a_range():
    missing = [key for key, _ in FIELDS if key not in RANGES]
    assert not missing, f"number fields without an entry in config/ranges.py RANGES: {missing}"
    assert len(FIELDS) > 100


def _nested(key: str, value) -> dict:
    """The config dict that sets dotted ``key`` (``[]``: the first item of a list) to value."""
    required = {"stages": {"name": "s"}, "datasets": {"path": "x"}}  # what a list item needs besides the key
    parts = key.split(".")
    node = value
    for part in reversed(parts):
        name = part.removesuffix("[]")
        if part.endswith("[]"):
            node = [{**required.get(name, {}), **node} if isinstance(node, dict) else node]
        node = {name: node}
    return node


def _edges(key: str, integer: bool) -> tuple[list, list]:
    """(accepted, refused) values at the ends of key's range."""
    rng = range_of(key, integer)
    ok, bad = [], [math.nan, math.inf] if not integer else []
    for end, is_open, sign in ((rng.lo, rng.lo_open, -1), (rng.hi, rng.hi_open, +1)):
        if end is None or math.isinf(end):
            continue
        end = int(end) if integer else float(end)
        step = 1 if integer else max(1e-9, abs(end) * 1e-9)
        inside = end - sign * step if is_open else end
        if not integer or inside == int(inside):
            ok.append(inside)
        outside = end if is_open else end + sign * step
        if outside not in rng.extra:
            bad.append(outside)
    return ok, bad


@pytest.mark.parametrize("key, integer", FIELDS, ids=[k for k, _ in FIELDS])
def test_each_range_is_enforced_by_the_loader_and_validate(key, integer):
    ok, bad = _edges(key, integer)
    for value in ok:
        config_from_dict(_nested(key, value), source="t.yaml")  # the ends are accepted
    where = key.replace("[]", "[0]").replace("[", r"\[").replace("]", r"\]")
    for value in bad:
        with pytest.raises(ConfigError, match=rf"t\.yaml: {where}: expected ") as e:
            config_from_dict(_nested(key, value), source="t.yaml")
        assert "got" in str(e.value) and str(e.value).count("\n") == 0
    if bad and not key.endswith("[]") and not key.startswith(("stages", "data.datasets")):
        cfg = Config()
        section, _, name = key.rpartition(".")
        obj = cfg
        for part in section.split("."):
            obj = getattr(obj, part)
        setattr(obj, name, bad[-1])  # a config built in code: validate applies the same table
        with pytest.raises(ConfigError, match=rf"^{key}: expected "):
            validate(cfg, require_data=False)

"""`llmtrain check`: the two seed files pass and print their derived figures; errors exit 2 without a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmtrain.commands import check
from llmtrain.config import config_from_dict, load_config
from llmtrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
SEEDS = REPO / "configs" / "seed"


def run_check(capsys, config: Path, *overrides: str, world_size: int | None = None) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    argv = [str(config), *overrides] + ([] if world_size is None else ["--world-size", str(world_size)])
    rc = check.main(parser.parse_args(argv))
    return rc, capsys.readouterr().out


def derived_block(out: str) -> dict[str, str]:
    block = out.split("# derived\n", 1)[1].split("\n\n", 1)[0]
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in block.splitlines())}


def test_check_70b_seed(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rc, out = run_check(capsys, SEEDS / "pretrain_llama3_70b_64card.yaml")
    assert rc == 0
    figures = derived_block(out)
    assert figures["parameters"] == "70.6B (70,553,706,496)"
    assert figures["world size"].startswith("64 ")
    assert figures["data parallel"] == "8" and figures["grad accumulation"] == "4"
    assert figures["global batch"].startswith("64 sequences (= micro 2 x DP 8 x accumulation 4)")
    assert figures["tokens per step"] == f"{64 * 8192:,}"
    assert figures["total tokens"].startswith("629B (1,200,000 steps")
    flops = float(figures["FLOPs per token"].split()[0])
    assert 6 * 70.55e9 * 0.95 < flops < 6 * 70.55e9 * 1.2  # ~6N plus the attention term
    # the printed YAML is the resolved native config and loads back to the same Config
    resolved = yaml.safe_load(out.split("\n# derived", 1)[0])
    assert config_from_dict(resolved) == load_config(SEEDS / "pretrain_llama3_70b_64card.yaml")[0]
    assert "- run_mode: 'train' ignored" in out and "# warnings" in out


def test_check_native_seed_and_world_size(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rc, out = run_check(capsys, SEEDS / "llm_pretrain.yaml")
    figures = derived_block(out)
    assert rc == 0 and figures["world size"].startswith("32 ")
    assert figures["grad accumulation"] == "512" and figures["parameters"].endswith("(65,285,660,672)")
    assert "run.graph_kernel_flags" in out and "run.enable_graph_kernel" in out
    monkeypatch.setenv("WORLD_SIZE", "64")
    rc, out = run_check(capsys, SEEDS / "llm_pretrain.yaml", "train.batch_size=256")
    figures = derived_block(out)
    assert figures["world size"] == "64 (from $WORLD_SIZE)"
    assert (figures["data parallel"], figures["grad accumulation"]) == ("2", "128")
    rc, out = run_check(capsys, SEEDS / "llm_pretrain.yaml", world_size=128)  # --world-size beats $WORLD_SIZE
    assert (derived_block(out)["data parallel"], derived_block(out)["grad accumulation"]) == ("4", "128")
    with pytest.raises(ConfigError, match=r"train\.batch_size 512 .* data-parallel size 3 = 3"):
        run_check(capsys, SEEDS / "llm_pretrain.yaml", world_size=96)
    with pytest.raises(ConfigError, match="world size 48 is not divisible"):
        run_check(capsys, SEEDS / "llm_pretrain.yaml", world_size=48)


def test_console_script_exits_2_without_traceback(tmp_path):
    script = Path(sys.executable).parent / "llmtrain"
    if not script.exists():
        pytest.skip(f"console script {script} is not installed (pip install -e .)")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  flavor: debug\ntrain:\n  lr: abc\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    result = subprocess.run(
        [str(script), "check", str(bad)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "train.lr: expected a number, got 'abc'" in result.stderr and str(bad) in result.stderr
    assert result.stdout == ""

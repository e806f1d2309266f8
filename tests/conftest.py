"""Shared fixtures: a tiny prepared corpus (stdlib sources, always present) and the optional ../shared folder."""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} (real corpus and tokenizers) is not present on this machine")
    return SHARED


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> str:
    """A prepared dataset prefix: 12 stdlib modules, a 512-token byte-level BPE trained on them."""
    from llmtrain.data.prep.prepare import prepare

    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:12]
    prefix = tmp_path_factory.mktemp("corpus") / "tiny"
    prepare(files, str(prefix), train_tokenizer=512, log=None)
    return str(prefix)


def tiny_config(prefix: str, out: Path | str, **sections: dict) -> dict:
    """The tiny 2-step run config of the command tests (debug llama, 32 tokens, one save at the end) on dataset
    ``prefix`` into ``out``; ``sections`` update its sections key by key (``checkpoint={"save_steps": 1}``)."""
    cfg = {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32},
        "train": {"batch_size": 4, "micro_batch_size": 2, "max_steps": 2, "lr": 1e-3, "warmup_steps": 0,
                  "log_steps": 1, "eval_steps": 0},
        "data": {"datasets": [{"path": str(prefix), "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 0, "save_at_end": True, "resume": "auto"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": False, "eval_iters": 1},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1},
    }  # fmt: skip
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def read_megatron(prefix: str) -> list[list[int]]:
    """An independent reader of MMIDIDX .idx/.bin (struct + raw bytes, no llmtrain code)."""
    import struct

    import numpy as np

    idx = Path(f"{prefix}.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    _, code, n_seq, _ = struct.unpack("<QBQQ", idx[9:34])
    dtype = {4: np.int32, 8: np.uint16}[code]
    sizes = np.frombuffer(idx, np.int32, n_seq, 34)
    pointers = np.frombuffer(idx, np.int64, n_seq, 34 + 4 * n_seq)
    data = Path(f"{prefix}.bin").read_bytes()
    return [np.frombuffer(data, dtype, int(n), int(p)).tolist() for n, p in zip(sizes, pointers)]


def gen_task(folder: Path, rows: list[dict], max_gen_toks: int) -> Path:
    """An lm-eval ``generate_until`` task file (greedy, stop at a newline, exact match) with its data next to it
    (``data_files`` relative to the YAML): ``rows`` of ``{"prompt", "answer"}``."""
    import json

    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {
        "task": "tiny_gen", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "gen.jsonl"}},
        "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": max_gen_toks, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }  # fmt: skip
    path = folder / "tiny_gen.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def assert_same_adam_update(name: str, got: dict, want: dict, lr_sum: float) -> None:
    """Parameters after the same AdamW steps, computed with the gradient sums in another order.

    The bound comes from the optimizer, not from one machine's run: reordering a float32 sum changes each gradient
    by a few units of roundoff of its terms, and Adam's normalised update ``m / sqrt(v)`` passes that on scaled by
    how much the terms cancel. Almost every element therefore agrees to far below 1e-3 of ``lr_sum`` (the sum of
    the step sizes: how far Adam moves an element at most, weight decay aside); an element whose gradient cancels
    to within roundoff may take a different direction, but never moves further than ``lr_sum`` in either run, so
    no element differs by more than 2 x ``lr_sum``, and such elements are rare (at most 1e-3 of them). A wrong
    reduction (a micro-batch lost or counted twice) changes nearly every element by O(lr) and fails both."""
    assert set(got) == set(want), name
    total = beyond = 0
    for key, value in got.items():
        diff = (value.double() - want[key].double()).abs()
        assert float(diff.max()) <= 2 * lr_sum, (name, key, float(diff.max()))
        total += diff.numel()
        beyond += int((diff > 1e-3 * lr_sum).sum())
    assert beyond <= 1e-3 * total, (name, beyond, total)

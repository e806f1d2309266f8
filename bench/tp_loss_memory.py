"""A TP 2 rank's peak memory for a logits-heavy model against one process, before and after loss parallel.

The model: llama3 debug (hidden 64, 2 layers) with a 32,768-token vocabulary at seq 1024, micro-batch 2 (2,048
tokens per micro-batch, 4 micro-batches per step), fp32 as the parity tests run: the logits (2,048 x 32,768 x 4
bytes = 256 MiB per micro-batch) outweigh everything else. Each run is the real trainer under torchrun (gloo),
measured with torch's MemTracker over one step after two (tests/distributed/worker.py ``memory_peak``, the figure
tests/test_plan_measured.py checks the planner against), beside the planner's figure for the same layout:

- one process, the plain loss; and with the chunked loss (``train.loss_chunk_tokens: 256``);
- TP 2 gathered (``parallel.loss_parallel: false``: whole logits on every TP rank, the trainer before issue 41);
- TP 2 loss parallel (the default now: ``V / 2`` logits per rank, train/vocab_parallel.py);
- TP 2 loss parallel + chunked (256 tokens).

    OMP_NUM_THREADS=1 .venv/bin/python bench/tp_loss_memory.py
"""

from __future__ import annotations

import glob
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
from worker import merge

from llmtrain.config import config_from_dict
from llmtrain.data.prep.prepare import prepare
from llmtrain.plan import estimate_memory
from llmtrain.plan.search import layout_from_config
from test_parallel import base, launch

MODEL = {"vocab_size": 32768, "seq_length": 1024}
CHUNK = {"loss_chunk_tokens": 256}
RUNS = {  # name -> (world, overrides)
    "one process": (1, {}),
    "one process, chunked": (1, {"train": CHUNK}),
    "TP 2 gathered (before)": (2, {"parallel": {"tensor_parallel": 2, "loss_parallel": False}}),
    "TP 2 loss parallel": (2, {"parallel": {"tensor_parallel": 2}}),
    "TP 2 loss parallel + chunked": (2, {"parallel": {"tensor_parallel": 2}, "train": CHUNK}),
}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:24]
        prefix = str(tmp / "tiny")
        prepare(files, prefix, train_tokenizer=512, log=None)
        cfg = base(prefix, "llama3")
        cfg["model"].update(MODEL)
        cfg["train"].update(batch_size=8, micro_batch_size=2)
        measured, planned = {}, {}
        for world in (1, 2):
            variants = {n: {**o, "memory_peak": True} for n, (w, o) in RUNS.items() if w == world}
            out = launch(world, {"base": cfg, "steps": 1, "variants": variants}, tmp, tag=f"_bench{world}")
            for name in variants:
                measured[name] = max(r["Total"] for r in out[name]["memory_peak"])
                run = config_from_dict(merge(cfg, RUNS[name][1]))
                lay, args, _ = layout_from_config(run, world, run.recompute.mode)
                planned[name] = estimate_memory(args, lay).total
    one = measured["one process"]
    print(
        f"{'run':<30} {'measured MiB':>13} {'x one process':>14} {'planned MiB':>12} {'planned/measured':>17}"
    )
    for name in RUNS:
        m, p = measured[name], planned[name]
        print(f"{name:<30} {m / 2**20:>13.1f} {m / one:>14.2f} {p / 2**20:>12.1f} {p / m:>17.3f}")


if __name__ == "__main__":
    main()

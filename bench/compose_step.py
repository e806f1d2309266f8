"""Three axes on 8 ranks against one process, for the same tokens: seconds per step, side by side.

For the record, not a target: on a 2-core machine 8 gloo processes share 2 cores, so the ratio measures the
overhead of the composition (pipeline schedule, TP/CP collectives, FSDP) and the oversubscription, not a
speed-up. The runs are those of tests/test_compose.py (llama3 debug, 4 layers, seq 64, global batch 8 = 512
tokens per step, fp32, one thread per process): one process; DP2 x TP2 x PP2 (ZeRO 3, 1F1B, 4 pipeline
micro-batches) and CP2 x TP2 x PP2 on 8 ranks, in one torchrun launch (tests/distributed/worker.py). The first
step (pipeline shape inference, warm-up) is left out of the median.

    OMP_NUM_THREADS=1 .venv/bin/python bench/compose_step.py --steps 6
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from llmtrain.config import config_from_dict
from llmtrain.data.prep.prepare import prepare
from llmtrain.train.trainer import Trainer
from test_compose import LAYOUTS8, run_base  # the test's own layouts and run
from test_parallel import launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:12]
        prefix = str(tmp / "tiny")
        prepare(files, prefix, train_tokenizer=512, log=None)
        cfg = run_base(prefix)
        cfg["train"]["max_steps"] = args.steps + 1
        cfg["run"]["output_dir"] = str(tmp / "single")
        trainer = Trainer(config_from_dict(cfg))
        single = []
        for _ in range(args.steps):
            start = time.perf_counter()
            trainer.train_step()
            single.append(time.perf_counter() - start)
        trainer.metrics.close()
        spec = {"base": run_base(prefix), "steps": args.steps,
                "variants": {n: {"parallel": p} for n, p in LAYOUTS8.items()}}  # fmt: skip
        spec["base"]["train"]["max_steps"] = args.steps + 1
        results = launch(8, spec, tmp, tag="_bench")
    one = statistics.median(single[1:])
    print(f"{'layout':<22} {'ranks':>5} {'s/step':>8} {'x one process':>14}")
    print(f"{'one process':<22} {1:>5} {one:>8.3f} {1.0:>14.1f}")
    for name in LAYOUTS8:
        t = statistics.median(results[name]["step_s"][1:])
        print(f"{name:<22} {8:>5} {t:>8.3f} {t / one:>14.1f}")


if __name__ == "__main__":
    main()

"""Stable by construction? A deep, narrow model at an aggressive learning rate, three ways, several seeds each.

Ways (``--ways``): ``pre`` (pre-norm, default init: what every family trains by default), ``dssn`` (Pangu
Ultra's depth-scaled sandwich norm + TinyInit: ``model.norm_scheme: dssn``, ``model.init: tinyinit``) and
``zloss_qk`` (pre-norm with ``train.z_loss: 1e-4`` and ``model.qk_norm: true``). Each trains a llama3-shaped
model of ``--depths`` layers (default 48) and width ``--hidden`` (128) on real English text from
``../shared/corpus/en.jsonl.gz`` (State of the Union addresses and Moby-Dick; its first ``--docs`` documents,
a ``--vocab``-token BPE trained on them), AdamW at peak ``--lr`` after ``--warmup`` steps, clipping 1.0, fp32.

Printed side by side, one row per (depth, way, seed) and a summary row per (depth, way):

* spikes     the stability guard's own rule (train/stability.py, ``stability`` defaults: MAD rule, k 6,
             window 50, 20 steps of history, 3 anomalous steps in a row) replayed over the run's per-step loss
             in observe-only mode: every rollback decision is counted, nothing is rolled back (the run itself
             trains with the guard disabled, so every way sees the same batches);
* grad-spikes the same with ``watch: [grad_norm]``;
* max grad norm   the largest global gradient norm (before clipping) of the run;
* max layer gn    the largest per-layer gradient norm (``max_layer_grad_norm``, train/health.py);
* final val loss  validation loss at the end (``--eval-iters`` held-out micro-batches, the same for all);
* non-finite      steps whose gradients were non-finite (skipped).

Default: 48 layers, 3 seeds, 3 ways, 80 steps of 4 x 32 tokens (a few minutes on 2 CPU cores)::

    .venv/bin/python bench/stability.py
    .venv/bin/python bench/stability.py --depths 12,24,48 --steps 150 --seeds 3   # where does DSSN start to help

The figures (and the machine's load) are recorded in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmtrain.config import config_from_dict
from llmtrain.config.schema import StabilityConfig
from llmtrain.data.prep.prepare import prepare
from llmtrain.train.stability import StabilityGuard
from llmtrain.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT.parent / "shared" / "corpus" / "en.jsonl.gz"
WAYS: dict[str, tuple[dict, dict]] = {
    "pre": ({}, {}),
    "dssn": ({"norm_scheme": "dssn", "init": "tinyinit"}, {}),
    "zloss_qk": ({"qk_norm": True}, {"z_loss": 1e-4}),
}


def spikes(values: list[float], watch: str) -> int:
    """Rollback decisions of the guard's default rule over ``values`` (observe only: counted, not executed)."""
    guard = StabilityGuard(StabilityConfig(watch=[watch], max_rollbacks=10**9))
    count = 0
    for step, v in enumerate(values, start=1):
        d = guard.observe(step, v if watch == "loss" else 0.0, v if watch == "grad_norm" else None)
        count += d.action == "rollback"
    return count


def run_one(prefix: str, out: Path, a: argparse.Namespace, depth: int, way: str, seed: int) -> dict:
    model_over, train_over = WAYS[way]
    cfg = {
        "model": {"model_type": "llama3", "hidden_size": a.hidden, "num_layers": depth, "num_heads": a.heads,
                  "num_kv_heads": a.heads, "seq_length": a.seq, **model_over},
        "train": {"batch_size": a.batch, "micro_batch_size": a.batch, "max_steps": a.steps, "lr": a.lr,
                  "warmup_steps": a.warmup, "min_lr": a.lr / 10, "grad_clip_norm": 1.0, "seed": seed,
                  "log_steps": 1, "eval_steps": 0, **train_over},
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.05},
        "checkpoint": {"save_steps": 0, "save_at_end": False, "resume": "none"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": False, "eval_iters": a.eval_iters},
        "stability": {"enabled": False},  # observe only: the guard's rule is replayed below
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": a.threads},
    }  # fmt: skip
    start = time.perf_counter()
    trainer = Trainer(config_from_dict(cfg))
    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # the trainer's per-step lines
    try:
        trainer.fit()
    finally:
        sys.stdout.close()
        sys.stdout = stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    losses = [r["loss"] for r in train]
    grads = [r["grad_norm"] for r in train]
    finite = [g for g in grads if math.isfinite(g)]
    return {
        "depth": depth, "way": way, "seed": seed,
        "spikes": spikes(losses, "loss"), "grad_spikes": spikes(grads, "grad_norm"),
        "max_grad_norm": max(finite, default=float("nan")),
        "max_layer_grad_norm": max((r.get("max_layer_grad_norm", 0.0) for r in train), default=float("nan")),
        "val_loss": val[-1] if val else float("nan"),
        "nonfinite": sum(not math.isfinite(g) for g in grads),
        "seconds": time.perf_counter() - start,
    }  # fmt: skip


def table(results: list[dict]) -> str:
    head = (
        "| depth | way | seed | spikes | grad-spikes | max grad norm | max layer gn | final val loss | non-finite "
        "| s |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in results:
        lines.append(
            f"| {r['depth']} | {r['way']} | {r['seed']} | {r['spikes']} | {r['grad_spikes']} | "
            f"{r['max_grad_norm']:.3g} | {r['max_layer_grad_norm']:.3g} | {r['val_loss']:.4f} | {r['nonfinite']} | "
            f"{r['seconds']:.0f} |"
        )
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["depth"], r["way"]), []).append(r)
    lines += ["", "| depth | way | spikes (all seeds) | grad-spikes | max grad norm (median) | final val loss "
              "(mean ± sd) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for (depth, way), rs in groups.items():
        vals = [r["val_loss"] for r in rs]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        lines.append(
            f"| {depth} | {way} | {sum(r['spikes'] for r in rs)} | {sum(r['grad_spikes'] for r in rs)} | "
            f"{statistics.median(r['max_grad_norm'] for r in rs):.3g} | {statistics.fmean(vals):.4f} ± {sd:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", nargs="+", default=[str(CORPUS)], help="text inputs for `prepare`")
    ap.add_argument("--docs", type=int, default=60, help="documents of the corpus used")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--depths", default="48", help="comma-separated layer counts")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--eval-iters", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    missing = [c for c in a.corpus if not Path(c).exists()]
    if missing:
        sys.exit(f"bench/stability.py: corpus not found: {', '.join(missing)} (pass --corpus FILES)")
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="llmtrain-stability-") as tmp:
        prefix = str(Path(tmp) / "corpus")
        prepare(a.corpus, prefix, train_tokenizer=a.vocab, max_documents=a.docs, log=None)
        results = []
        for depth in (int(d) for d in a.depths.split(",")):
            for way in a.ways.split(","):
                for seed in range(1, a.seeds + 1):
                    out = Path(tmp) / f"run-{depth}-{way}-{seed}"
                    results.append(run_one(prefix, out, a, depth, way, seed))
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(f"hidden {a.hidden}, {a.heads} heads, seq {a.seq} x batch {a.batch}, {a.steps} steps, lr {a.lr} "
          f"(warmup {a.warmup}, cosine to lr/10), clip 1.0, fp32, vocab {a.vocab}, {a.docs} documents")  # fmt: skip
    print(table(results))


if __name__ == "__main__":
    main()

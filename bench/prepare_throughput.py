"""Data pipeline throughput: raw ``tokenizers`` vs llmtrain tokenize-only vs the full pipeline; loader speed.

    .venv/bin/python bench/prepare_throughput.py [--corpus DIR] [--tokenizer FILE] [--max-chars N]

Every figure runs in its own subprocess (clean peak memory, ``ru_maxrss`` of that process and, for workers,
the largest child) on the same text: the first ``--max-chars`` characters of en, zh and code from the shared
corpus, written to one jsonl file. All rows print side by side in one table: characters/s, ratio to the raw
tokenizer, seconds, then CPU seconds (user + system, children included) and characters per CPU second
with its ratio to the raw tokenizer's, the figure that other jobs on a shared machine disturb least, and peak
memory.

Threads. The fair per-worker setting is one tokenizer thread per process: the raw limit and ``--workers 1`` run
with ``TOKENIZERS_PARALLELISM=false`` (``prepare``'s worker processes set it themselves), so ``--workers N``
against ``--workers 1`` measures process scaling alone. The multi-threaded raw tokenizer and tokenize-only at
1 worker with the library's thread pool are printed for reference (their ratio is to the multi-threaded raw).

Loader: tokens/s served by ``BatchIterator.next_step`` from the prepared shards (seq 2048, batch 64, micro 8),
mean over 3 s and the median step (the machine is shared, so the median is the steadier figure).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"


def child(mode: str, src: str, tok: str, workers: int, out: str) -> dict:
    """One measurement, run inside a fresh process."""
    texts = [json.loads(line)["text"] for line in open(src, encoding="utf-8")]
    chars = sum(map(len, texts))
    cpu0 = _cpu()
    t0 = time.perf_counter()
    if mode == "raw":
        from tokenizers import Tokenizer

        t = Tokenizer.from_file(tok)
        for i in range(0, len(texts), 256):
            t.encode_batch(texts[i : i + 256], add_special_tokens=False)
    elif mode == "loader":
        from llmtrain.config.schema import Config, DatasetSpec
        from llmtrain.data.loader import BatchIterator, build_datasets

        cfg = Config()
        cfg.model.seq_length, cfg.data.valid_fraction = 2048, 0.0
        cfg.data.datasets = [DatasetSpec(out, 1.0)]
        it = BatchIterator(build_datasets(cfg)[0], 64, 8)
        it.next_step()
        steps: list[float] = []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 3.0:
            t1 = time.perf_counter()
            it.next_step()
            steps.append(time.perf_counter() - t1)
        steps.sort()
        return {"rate": 64 * 2048 * len(steps) / sum(steps), "median": 64 * 2048 / steps[len(steps) // 2],
                "secs": sum(steps), "peak_mb": 0.0, "cpu": 0.0, "cpu_rate": 0.0}  # fmt: skip
    else:
        from llmtrain.data.prepare import prepare

        opts = (
            {} if mode == "tokenize" else {"clean": True, "filter": True, "dedup": "near", "pack": "bestfit"}
        )
        prepare([src], out, tokenizer=tok, workers=workers, log=None, options=opts)
    secs = time.perf_counter() - t0
    cpu = _cpu() - cpu0
    peak = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    )
    return {"rate": chars / secs, "secs": secs, "peak_mb": peak / 1024, "cpu": cpu, "cpu_rate": chars / cpu}


def _cpu() -> float:
    """CPU seconds (user + system) of this process and its finished children: unlike wall time, barely
    affected by other jobs on a shared machine."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run(mode: str, src: Path, tok: str, workers: int, out: str, threads: bool = False) -> dict:
    """``child`` in a fresh process; ``threads``: the tokenizer may use its own thread pool."""
    code = f"import json,sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import prepare_throughput as b; " \
           f"print(json.dumps(b.child({mode!r}, {str(src)!r}, {tok!r}, {workers}, {out!r})))"  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true" if threads else "false", "OMP_NUM_THREADS": "1"}
    env.pop("RAYON_NUM_THREADS", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])


def write_input(corpus: Path, max_chars: int, path: Path) -> int:
    per_file = max_chars // 3
    total = 0
    with open(path, "w", encoding="utf-8") as out:
        for name in ("en", "zh", "code"):
            n = 0
            with gzip.open(corpus / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
                for line in f:
                    text = json.loads(line)["text"]
                    out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                    n += len(text)
                    if n >= per_file:
                        break
            total += n
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=str(SHARED / "corpus"))
    p.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "deepseek_v3_tokenizer.json"))
    p.add_argument("--max-chars", type=int, default=3_000_000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        big, small = Path(tmp) / "big.jsonl", Path(tmp) / "small.jsonl"
        chars = write_input(Path(a.corpus), a.max_chars, big)
        write_input(Path(a.corpus), a.max_chars // 2, small)
        print(f"input: {chars:,} characters (en, zh, code thirds); cores: {os.cpu_count()}")
        raw_mt = run("raw", big, a.tokenizer, 1, "", threads=True)
        rows = [("raw tokenizers encode_batch, 1 thread", run("raw", big, a.tokenizer, 1, ""))]
        for w in (1, 2):
            rows.append(
                (f"tokenize-only, {w} worker(s)", run("tokenize", big, a.tokenizer, w, f"{tmp}/t{w}"))
            )
        for w in (1, 2):
            rows.append((f"full pipeline, {w} worker(s)", run("full", big, a.tokenizer, w, f"{tmp}/f{w}")))
        rows.append(("full pipeline, 1 worker, half input", run("full", small, a.tokenizer, 1, f"{tmp}/h")))
        mt = [("raw tokenizers encode_batch, threads", raw_mt),
              ("tokenize-only, 1 worker, threads", run("tokenize", big, a.tokenizer, 1, f"{tmp}/m", True))]  # fmt: skip
        raw = rows[0][1]["rate"]
        print(f"{'':38s} {'chars/s':>9s} {'x raw':>6s} {'secs':>6s} {'cpu s':>6s} {'chars/cpu-s':>11s} "
              f"{'x raw':>6s} {'peak MB':>7s}")  # fmt: skip
        bases = [(row, raw, rows[0][1]) for row in rows] + [(row, raw_mt["rate"], raw_mt) for row in mt]
        for (name, r), base, ref in bases:
            print(f"{name:38s} {r['rate']:9,.0f} {r['rate'] / base:6.2f} {r['secs']:6.1f} {r['cpu']:6.1f} "
                  f"{r['cpu_rate']:11,.0f} {r['cpu_rate'] / ref['cpu_rate']:6.2f} {r['peak_mb']:7.0f}")  # fmt: skip
        print(f"2 workers / 1 worker: tokenize-only {rows[2][1]['rate'] / rows[1][1]['rate']:.2f}x, "
              f"full {rows[4][1]['rate'] / rows[3][1]['rate']:.2f}x")  # fmt: skip
        loader = run("loader", big, a.tokenizer, 1, f"{tmp}/t1")
        print(f"loader (seq 2048, batch 64, micro 8, concat windows): {loader['rate'] / 1e6:.1f}M tokens/s "
              f"mean, {loader['median'] / 1e6:.1f}M median step, per process")  # fmt: skip


if __name__ == "__main__":
    main()

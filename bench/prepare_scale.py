"""Staged dedup at scale: peak memory per task as the corpus grows, and throughput per stage, local vs Ray.

    .venv/bin/python bench/prepare_scale.py [--docs 25000] [--sizes 1,2,4] [--workers 1,2] [--engines local,ray]
        [--tokenizer FILE] [--corpus DIR]

Corpora. Size ``k`` has ``k x --docs`` documents, made from the English documents of ../shared/corpus (State of
the Union addresses, Moby-Dick): a *unique* document is a random window of 250-450 words of one of them with 20%
of its words replaced by random words of the corpus (two such documents share almost no 5-gram shingle); then
10% of all documents are *near duplicates* (a unique document of the same corpus with 1.5% of its words replaced:
Jaccard ~0.86) and 5% *exact duplicates* (a copy with trailing spaces, equal after cleaning), shuffled over the
second half of the corpus (so a copy may come before its original: the lowest id survives). Files of ``--docs / 4`` documents: 4 files at 1x, 16 at 4x.

Runs (each in a fresh process, ``prepare --clean --filter --dedup near``): per size, local engine with the
largest worker count, ``--partitions`` = files and ``--buckets`` = 2 x files, so every task of stages 1, 2 and
4 touches the same slice at every size (the point: memory per task stays flat; stage 3 holds the pairs); at
1x also every ``--workers`` x ``--engines`` combination. Printed: per run the wall seconds (Ray's start-up
apart), and per stage the largest peak RSS of its tasks (``VmHWM`` reset per task, tasks.py), its CPU seconds,
and documents (stage 2: band rows; stage 3: pairs) and characters per CPU second; the duplicates removed
against the planted ones. The machine's other jobs disturb wall time more than CPU time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHARED = Path(__file__).resolve().parents[2] / "shared"


def make_corpus(corpus: Path, docs: int, per_file: int, folder: Path, seed: int = 0) -> dict:
    """Write ``docs`` documents (see the module docstring) as jsonl files in ``folder``; returns the counts."""
    with gzip.open(corpus / "en.jsonl.gz", "rt", encoding="utf-8") as f:
        bases = [json.loads(line)["text"].split() for line in f]
    vocab = np.asarray(sorted({w for b in bases for w in b}))
    rng = np.random.default_rng(seed)
    n_near, n_exact = int(docs * 0.10), int(docs * 0.05)
    n_unique = docs - n_near - n_exact
    texts: list[str] = []
    for _ in range(n_unique):
        base = bases[int(rng.integers(len(bases)))]
        length = int(rng.integers(250, 450))
        start = int(rng.integers(0, max(len(base) - length, 1)))
        words = np.asarray(base[start : start + length], dtype=object)
        swap = rng.random(len(words)) < 0.2
        words[swap] = vocab[rng.integers(len(vocab), size=int(swap.sum()))]
        texts.append(" ".join(words))
    kinds = ["unique"] * n_unique
    for kind, n in (("near", n_near), ("exact", n_exact)):
        for _ in range(n):
            src = texts[int(rng.integers(n_unique))]
            if kind == "exact":
                texts.append(src + "  ")
            else:
                words = np.asarray(src.split(" "), dtype=object)
                swap = rng.random(len(words)) < 0.015
                words[swap] = vocab[rng.integers(len(vocab), size=int(swap.sum()))]
                texts.append(" ".join(words))
            kinds.append(kind)
    # the first half of the unique documents in order, then the rest and every copy shuffled together
    order = np.concatenate([np.arange(n_unique // 2), n_unique // 2 + rng.permutation(docs - n_unique // 2)])
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(0, docs, per_file):
        with open(folder / f"part-{k // per_file:04d}.jsonl", "w", encoding="utf-8") as out:
            for i in order[k : k + per_file].tolist():
                out.write(json.dumps({"text": texts[i]}) + "\n")
    return {"documents": docs, "near": n_near, "exact": n_exact, "files": len(range(0, docs, per_file)),
            "chars": sum(map(len, texts))}  # fmt: skip


def child(src: str, out: str, tok: str, workers: int, engine: str, partitions: int, buckets: int) -> dict:
    """One prepare run in this (fresh) process; Ray is started first and timed on its own."""
    ray_start = 0.0
    if engine == "ray":
        import logging

        import ray

        t = time.perf_counter()
        ray.init(num_cpus=workers, include_dashboard=False, logging_level=logging.WARNING)
        ray_start = time.perf_counter() - t
    from llmtrain.data.prep.prepare import prepare

    t = time.perf_counter()
    m = prepare([src], out, tokenizer=tok, workers=workers, log=None,
                options={"clean": True, "filter": True, "dedup": "near"},
                stages={"engine": engine, "partitions": partitions, "buckets": buckets})  # fmt: skip
    wall = time.perf_counter() - t
    return {"wall": wall, "ray_start": ray_start, "report": m["report"], "documents": m["documents"]}


def run(src: Path, out: Path, tok: str, workers: int, engine: str, partitions: int, buckets: int) -> dict:
    code = (f"import json,sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import prepare_scale as b; "
            f"print(json.dumps(b.child({str(src)!r}, {str(out)!r}, {tok!r}, {workers}, {engine!r}, {partitions}, "
            f"{buckets})))")  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(res.stderr[-4000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


UNITS = {"screen": ("docs_in", "chars_in"), "pairs": ("rows_in", None), "components": ("pairs_in", None),
         "tokenize": ("docs_in", "chars_in")}  # fmt: skip


def print_run(label: str, size: dict, r: dict) -> None:
    st = r["report"]["staged"]
    removed = r["report"]["stages"]["dedup"]["removed"]
    print(f"\n{label}: {size['documents']:,} docs, {size['chars'] / 1e6:.1f} M chars, {st['partitions']} partitions x "
          f"{st['buckets']} buckets; wall {r['wall']:.1f} s" + (f" (+ Ray start {r['ray_start']:.1f} s)"
          if r["ray_start"] else "") + f"; kept {r['documents']:,}; removed exact {removed.get('exact_duplicate', 0):,}"
          f" / planted {size['exact']:,}, near {removed.get('near_duplicate', 0):,} / planted {size['near']:,}")  # fmt: skip
    print(
        f"  {'stage':<11} {'tasks':>5} {'peak RSS/task MB':>17} {'CPU s':>8} {'units/CPU s':>14} {'chars/CPU s':>12}"
    )
    for name, s in st["stages"].items():
        unit, chars = UNITS[name]
        cpu = max(s["cpu_seconds"], 1e-9)
        rate = f"{s.get(unit, 0) / cpu:,.0f} {unit.split('_')[0]}"
        crate = f"{s[chars] / cpu / 1e6:.2f} M" if chars else "-"
        print(f"  {name:<11} {s['tasks']:>5} {s['peak_rss_mb_max']:>17.0f} {s['cpu_seconds']:>8.1f} {rate:>14} "
              f"{crate:>12}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=25000, help="documents at size 1x")
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--engines", default="local,ray")
    p.add_argument("--corpus", default=str(SHARED / "corpus"))
    p.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "deepseek_v3_tokenizer.json"))
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    workers = [int(x) for x in a.workers.split(",")]
    engines = a.engines.split(",")
    print(
        f"cores: {os.cpu_count()}; tokenizer {Path(a.tokenizer).name}; prepare --clean --filter --dedup near"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for k in sizes:
            folder = Path(tmp) / f"x{k}"
            t = time.perf_counter()
            size = make_corpus(Path(a.corpus), k * a.docs, max(a.docs // 4, 1), folder)
            print(f"\ncorpus {k}x: {size} (made in {time.perf_counter() - t:.0f} s)")
            combos = (
                [(w, e) for e in engines for w in workers] if k == sizes[0] else [(max(workers), "local")]
            )
            for w, e in combos:
                out = Path(tmp) / f"out-{k}-{w}-{e}"
                r = run(folder, out, a.tokenizer, w, e, size["files"], 2 * size["files"])
                print_run(f"{k}x, {e} engine, {w} worker(s)", size, r)
                for f in Path(tmp).glob(f"out-{k}-{w}-{e}*"):
                    f.unlink()


if __name__ == "__main__":
    main()

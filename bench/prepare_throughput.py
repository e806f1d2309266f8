"""Data pipeline throughput: raw ``tokenizers`` vs llmtrain tokenize-only vs the full pipeline; loader speed.

    .venv/bin/python bench/prepare_throughput.py [--corpus DIR] [--tokenizer FILE] [--max-chars N]

Every figure runs in its own subprocess (clean peak memory, ``ru_maxrss`` of that process and, for workers,
the largest child) on the same text: the first ``--max-chars`` characters of en, zh and code from the shared
corpus, written to one jsonl file. Prints one table: characters/s, ratio to the raw tokenizer, peak memory,
and the same pipeline on half the input (memory should not grow with input size). Then the loader: tokens/s
served by ``BatchIterator`` from the prepared shards.
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
        t0 = time.perf_counter()
        steps = 0
        while time.perf_counter() - t0 < 3.0:
            it.next_step()
            steps += 1
        chars = steps * 64 * 2048  # tokens
    else:
        from llmtrain.data.prepare import prepare

        opts = (
            {} if mode == "tokenize" else {"clean": True, "filter": True, "dedup": "near", "pack": "bestfit"}
        )
        prepare([src], out, tokenizer=tok, workers=workers, log=None, options=opts)
    secs = time.perf_counter() - t0
    peak = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    )
    return {"rate": chars / secs, "secs": secs, "peak_mb": peak / 1024}


def run(mode: str, src: Path, tok: str, workers: int, out: str) -> dict:
    code = f"import json,sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import prepare_throughput as b; " \
           f"print(json.dumps(b.child({mode!r}, {str(src)!r}, {tok!r}, {workers}, {out!r})))"  # fmt: skip
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "true"})  # fmt: skip
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
        rows = [("raw tokenizers encode_batch", run("raw", big, a.tokenizer, 1, ""))]
        for w in (1, 2):
            rows.append(
                (
                    f"llmtrain tokenize-only, {w} worker(s)",
                    run("tokenize", big, a.tokenizer, w, f"{tmp}/t{w}"),
                )
            )
        for w in (1, 2):
            rows.append((f"full pipeline, {w} worker(s)", run("full", big, a.tokenizer, w, f"{tmp}/f{w}")))
        rows.append(("full pipeline, 1 worker, half input", run("full", small, a.tokenizer, 1, f"{tmp}/h")))
        raw = rows[0][1]["rate"]
        print(f"{'':40s} {'chars/s':>12s} {'x raw':>7s} {'secs':>7s} {'peak MB':>8s}")
        for name, r in rows:
            print(
                f"{name:40s} {r['rate']:12,.0f} {r['rate'] / raw:7.2f} {r['secs']:7.1f} {r['peak_mb']:8.0f}"
            )
        print(f"2 workers / 1 worker: tokenize-only {rows[2][1]['rate'] / rows[1][1]['rate']:.2f}x, "
              f"full {rows[4][1]['rate'] / rows[3][1]['rate']:.2f}x")  # fmt: skip
        loader = run("loader", big, a.tokenizer, 1, f"{tmp}/t1")
        print(
            f"loader (seq 2048, batch 64, concat windows): {loader['rate'] / 1e6:.1f}M tokens/s per process"
        )


if __name__ == "__main__":
    main()

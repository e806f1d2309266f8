"""Data pipeline throughput: raw ``tokenizers`` vs llmtrain tokenize-only vs the full pipeline; loader speed.

    .venv/bin/python bench/prepare_throughput.py [--corpus DIR] [--tokenizer FILE] [--max-chars N]

Every figure runs in its own subprocess (clean peak memory, ``ru_maxrss`` of that process and, for workers,
the largest child) on the same text: the whole shared corpus (en, zh and code,
written to one jsonl file; ``--max-chars N`` takes the first N/3 characters of each file instead). All rows print side by side in one table: characters/s, ratio to the raw
tokenizer, seconds, then CPU seconds (user + system, children included) and characters per CPU second
with its ratio to the raw tokenizer's, the figure that other jobs on a shared machine disturb least, and peak
memory.

The raw limit: ``Tokenizer.from_file`` and ``encode_batch_fast`` (same ids as ``encode_batch``, no character
offsets; what ``prepare`` calls) over batches of 256 documents, with the ids read out of the encodings (the step
any use of them needs), on texts already in memory (reading and JSON parsing are not counted for it; they are for
``prepare``).

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
    if mode == "raw":  # the texts are read before the clock starts: the limit is the tokenizer alone
        texts = [json.loads(line)["text"] for line in open(src, encoding="utf-8")]
        if out:  # "K/N@T": every N-th document from the K-th, starting at wall-clock time T (the ceiling row)
            part, start_at = out.split("@")
            k, n = map(int, part.split("/"))
            texts = texts[k::n]
            time.sleep(max(float(start_at) - time.time(), 0.0))
        chars = sum(map(len, texts))
    else:  # prepare reads the file itself (and must not hold it all: peak memory is measured)
        chars = sum(len(json.loads(line)["text"]) for line in open(src, encoding="utf-8"))
    cpu0 = _cpu()
    t0 = time.perf_counter()
    if mode == "raw":
        from tokenizers import Tokenizer

        t = Tokenizer.from_file(tok)
        t.encode_special_tokens = True  # as llmtrain loads it: literal special tokens in text stay text
        fast = getattr(t, "encode_batch_fast", t.encode_batch)  # no offsets: same ids, faster
        for i in range(0, len(texts), 256):
            _ = [e.ids for e in fast(texts[i : i + 256], add_special_tokens=False)]
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


def run_raw_pair(src: Path, tok: str) -> float:
    """Wall seconds of two raw single-threaded tokenizer processes started together, each on every other
    document: how far two cores scale with no framework at all (the hardware's ceiling for 2 workers)."""
    start_at = time.time() + 5.0  # both have loaded their texts by then
    code = "import json,sys; sys.path.insert(0, {!r}); import prepare_throughput as b, time; " \
           "r = b.child('raw', {!r}, {!r}, 1, {!r}); r['end'] = time.time(); print(json.dumps(r))"  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                code.format(str(Path(__file__).parent), str(src), tok, f"{k}/2@{start_at}"),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for k in range(2)
    ]
    ends = [json.loads(p.communicate()[0].strip().splitlines()[-1])["end"] for p in procs]
    return max(ends) - start_at


def write_input(corpus: Path, max_chars: int, path: Path, fraction: float = 1.0) -> int:
    """en, zh and code documents into one jsonl file: each file whole (``max_chars`` 0) or its first
    ``max_chars / 3`` characters; ``fraction`` of that. Returns the characters written."""
    total = 0
    with open(path, "w", encoding="utf-8") as out:
        for name in ("en", "zh", "code"):
            with gzip.open(corpus / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
                texts = [json.loads(line)["text"] for line in f]
            limit = (max_chars // 3 if max_chars else sum(map(len, texts))) * fraction
            n = 0
            for text in texts:
                out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                n += len(text)
                if n >= limit:
                    break
            total += n
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=str(SHARED / "corpus"))
    p.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "deepseek_v3_tokenizer.json"))
    p.add_argument(
        "--max-chars", type=int, default=0, help="first N/3 characters of each file (0: the whole corpus)"
    )
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        big, small = Path(tmp) / "big.jsonl", Path(tmp) / "small.jsonl"
        chars = write_input(Path(a.corpus), a.max_chars, big)
        half = write_input(Path(a.corpus), a.max_chars, small, fraction=0.5)
        what = f"first {a.max_chars // 3:,} of each" if a.max_chars else "whole files"
        print(
            f"input: {chars:,} characters of en, zh, code ({what}; half input {half:,}); cores: {os.cpu_count()}"
        )
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
        pair = run_raw_pair(big, a.tokenizer)
        print(f"2 workers / 1 worker: tokenize-only {rows[2][1]['rate'] / rows[1][1]['rate']:.2f}x, "
              f"full {rows[4][1]['rate'] / rows[3][1]['rate']:.2f}x; ceiling: two raw tokenizer processes "
              f"on halves / one: {rows[0][1]['secs'] / pair:.2f}x ({pair:.1f} s)")  # fmt: skip
        loader = run("loader", big, a.tokenizer, 1, f"{tmp}/t1")
        print(f"loader (seq 2048, batch 64, micro 8, concat windows): {loader['rate'] / 1e6:.1f}M tokens/s "
              f"mean, {loader['median'] / 1e6:.1f}M median step, per process")  # fmt: skip


if __name__ == "__main__":
    main()

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
import statistics
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
        batches = list(_batches(texts))
    else:  # prepare reads the file itself (and must not hold it all: peak memory is measured)
        chars = sum(len(json.loads(line)["text"]) for line in open(src, encoding="utf-8"))
    cpu0 = _cpu()
    t0 = time.perf_counter()
    if mode == "raw":
        from tokenizers import Tokenizer

        t = Tokenizer.from_file(tok)
        t.encode_special_tokens = True  # as llmtrain loads it: literal special tokens in text stay text
        fast = getattr(t, "encode_batch_fast", t.encode_batch)  # no offsets: same ids, faster
        for batch in batches:
            _ = [e.ids for e in fast(batch, add_special_tokens=False)]
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
        from llmtrain.data.prep.prepare import prepare

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


def _batches(texts: list[str]):
    """The texts in the batches ``prepare`` sends to the tokenizer (CHUNK_DOCUMENTS documents or CHUNK_CHARS
    characters), so the raw limit and llmtrain tokenize the same batches."""
    from llmtrain.data.prep.parts import CHUNK_CHARS, CHUNK_DOCUMENTS

    batch: list[str] = []
    chars = 0
    for t in texts:
        batch.append(t)
        chars += len(t)
        if len(batch) >= CHUNK_DOCUMENTS or chars >= CHUNK_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


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


def _median_row(rows: list[dict]) -> dict:
    """Per field the median over the rounds; peak memory the largest."""
    out = {k: statistics.median(r[k] for r in rows) for k in ("rate", "secs", "cpu", "cpu_rate")}
    out["peak_mb"] = max(r["peak_mb"] for r in rows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=str(SHARED / "corpus"))
    p.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "deepseek_v3_tokenizer.json"))
    p.add_argument(
        "--max-chars", type=int, default=0, help="first N/3 characters of each file (0: the whole corpus)"
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds of every row, alternating order (median)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        big, small = Path(tmp) / "big.jsonl", Path(tmp) / "small.jsonl"
        chars = write_input(Path(a.corpus), a.max_chars, big)
        half = write_input(Path(a.corpus), a.max_chars, small, fraction=0.5)
        what = f"first {a.max_chars // 3:,} of each" if a.max_chars else "whole files"
        print(
            f"input: {chars:,} characters of en, zh, code ({what}; half input {half:,}); cores: {os.cpu_count()}"
        )
        specs = [  # (name, mode, input, workers, threads)
            ("raw tokenizers encode_batch, 1 thread", "raw", big, 1, False),
            ("tokenize-only, 1 worker(s)", "tokenize", big, 1, False),
            ("tokenize-only, 2 worker(s)", "tokenize", big, 2, False),
            ("full pipeline, 1 worker(s)", "full", big, 1, False),
            ("full pipeline, 2 worker(s)", "full", big, 2, False),
            ("full pipeline, 1 worker, half input", "full", small, 1, False),
            ("tokenize-only, 1 worker, half input", "tokenize", small, 1, False),
            ("raw tokenizers encode_batch, threads", "raw", big, 1, True),
            ("tokenize-only, 1 worker, threads", "tokenize", big, 1, True),
        ]
        results: dict[str, list[dict]] = {name: [] for name, *_ in specs}
        pairs: list[float] = []
        for r in range(a.repeats):  # rounds in alternating order: slow drifts of the machine hit every row
            order = specs if r % 2 == 0 else specs[::-1]
            for k, (name, mode, src, w, threads) in enumerate(order):
                out = "" if mode == "raw" else f"{tmp}/o{k}"
                results[name].append(run(mode, src, a.tokenizer, w, out, threads))
                for p in Path(tmp).glob(f"o{k}*"):
                    p.unlink()
            pairs.append(run_raw_pair(big, a.tokenizer))
        med = {name: _median_row(rs) for name, rs in results.items()}
        raw, raw_mt = med[specs[0][0]], med[specs[7][0]]
        print(f"median of {a.repeats} rounds; peak memory: the largest")
        print(f"{'':38s} {'chars/s':>9s} {'x raw':>6s} {'secs':>6s} {'cpu s':>6s} {'chars/cpu-s':>11s} "
              f"{'x raw':>6s} {'peak MB':>7s}")  # fmt: skip
        for name, *_ in specs:
            m, ref = med[name], raw_mt if "threads" in name else raw
            print(f"{name:38s} {m['rate']:9,.0f} {m['rate'] / ref['rate']:6.2f} {m['secs']:6.1f} {m['cpu']:6.1f} "
                  f"{m['cpu_rate']:11,.0f} {m['cpu_rate'] / ref['cpu_rate']:6.2f} {m['peak_mb']:7.0f}")  # fmt: skip
        pair = statistics.median(pairs)
        tok = med["tokenize-only, 2 worker(s)"]["rate"] / med["tokenize-only, 1 worker(s)"]["rate"]
        full = med["full pipeline, 2 worker(s)"]["rate"] / med["full pipeline, 1 worker(s)"]["rate"]
        print(f"2 workers / 1 worker: tokenize-only {tok:.2f}x, full {full:.2f}x; ceiling: two raw tokenizer "
              f"processes on halves / one: {raw['secs'] / pair:.2f}x ({pair:.1f} s)")  # fmt: skip
        run("tokenize", big, a.tokenizer, 1, f"{tmp}/t1")  # the loader's shards (not timed)
        loader = run("loader", big, a.tokenizer, 1, f"{tmp}/t1")
        print(f"loader (seq 2048, batch 64, micro 8, concat windows): {loader['rate'] / 1e6:.1f}M tokens/s "
              f"mean, {loader['median'] / 1e6:.1f}M median step, per process")  # fmt: skip


if __name__ == "__main__":
    main()

"""``llmtrain prepare --plan PATHS...``: the time and disk of a staged run, from rates measured here, now.

Nothing is written. The estimate has three parts:

1. the corpus: file sizes (``stat``) times the documents and characters per stored byte, measured on the first
   :data:`SAMPLE_BYTES` of up to :data:`SAMPLE_FILES` files spread over the inputs (parquet: its footer and
   first row group); any other file gets the bytes-weighted rate of the sampled files of its kind;
2. per-core rates: the first :data:`SAMPLE_DOCUMENTS` documents go through the real stage code in this
   process, each stage timed in CPU seconds: reading + ``screen_chunk`` (stage 1), ``near_pairs`` over their
   band keys (stage 2), ``component_minimum`` (stage 3), ``tokenize_texts`` (stage 4; with ``--tokenizer``,
   else the recorded rate of docs/performance.md) and the part write (stage 5);
3. the arithmetic: CPU seconds per stage = rate x corpus; stages 1, 2 and 4 divide by the cores (their tasks
   are independent), stages 3 and 5 are one task each. The scaling is assumed linear: the 2-core machine
   these rates were developed on measured 1.72x for 2 processes; no curve beyond 2 cores has been measured.

Disk: stage 1 keeps the kept texts, 16-bit signatures and 24-byte bucket rows per band and digest; stage 4
the tokens; the final shards as much again. Duplicates within the sample are counted; duplicates between the
sample and the rest of the corpus are not, so stage 3 is a lower bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from llmtrain.data.indexed import IndexedDatasetWriter
from llmtrain.data.prep.pipeline import PrepareOptions, cached_tokenizer, screen_chunk, tokenize_texts
from llmtrain.data.prep.readers import expand_inputs, file_kind, iter_records
from llmtrain.data.prep.stages.components import component_minimum
from llmtrain.data.prep.stages.pairs import near_pairs
from llmtrain.errors import ConfigError

SAMPLE_DOCUMENTS = 2000
SAMPLE_BYTES = 16 << 20
SAMPLE_CHARS = 4_000_000
SAMPLE_FILES = 8
TOKENIZE_CHARS_PER_CPU_S = 1.0e6  # fallback without --tokenizer: docs/performance.md, 128K-vocab BPE
MEMORY_PER_TASK = 2 << 30  # stage 2's budget per task, for the recommended bucket count


def _compression(path: Path) -> str:
    return "gz" if path.name.endswith(".gz") else "zst" if path.name.endswith(".zst") else "plain"


def _decompressed_head(path: Path) -> tuple[bytes, int]:
    """(the decompressed text of up to SAMPLE_BYTES stored bytes, how many stored bytes that was)."""
    with open(path, "rb") as f:
        raw = f.read(SAMPLE_BYTES)
    kind = _compression(path)
    if kind == "plain":
        return raw, len(raw)
    if kind == "gz":
        out, data = [], raw
        while data:
            d = zlib.decompressobj(wbits=31)
            out.append(d.decompress(data))
            data = d.unused_data
        return b"".join(out), len(raw)
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj().decompress(raw), len(raw)


def _per_byte(path: Path, text_key: str) -> tuple[float, float]:
    """(documents, characters) per stored byte of ``path``'s kind, from its head."""
    kind = file_kind(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        rows = max(pf.metadata.num_rows, 1)
        col = pf.read_row_group(0, columns=[text_key]).column(0).to_pylist() if pf.num_row_groups else []
        chars = sum(len(t) for t in col if isinstance(t, str)) / max(len(col), 1)
        size = max(path.stat().st_size, 1)
        return rows / size, rows * chars / size
    head, stored = _decompressed_head(path)
    if kind == "text":  # one document per file (counted by the caller)
        return 0.0, len(head.decode("utf-8", "replace")) / max(stored, 1)
    lines = head.split(b"\n")
    complete = lines[:-1] if len(head) and not head.endswith(b"\n") else lines
    docs = chars = 0
    for line in complete:
        if line.strip():
            try:
                text = json.loads(line).get(text_key, "")
            except (ValueError, AttributeError, RecursionError):
                continue
            docs += 1
            chars += len(text) if isinstance(text, str) else 0
    used = stored * (sum(len(x) + 1 for x in complete) / max(len(head), 1))
    return docs / max(used, 1), chars / max(used, 1)


def _spread(files: list[Path]) -> list[Path]:
    """Up to SAMPLE_FILES files spread evenly over the input list."""
    return [files[int(i)] for i in np.unique(np.linspace(0, len(files) - 1, min(len(files), SAMPLE_FILES)))]


def _sample(files: list[Path], text_key: str) -> list[str]:
    """Up to SAMPLE_DOCUMENTS documents and about SAMPLE_CHARS characters: the first ones of up to SAMPLE_FILES
    files spread over the input list, an equal share from each."""
    picked = _spread(files)
    per_docs, per_chars = max(SAMPLE_DOCUMENTS // len(picked), 1), SAMPLE_CHARS / len(picked)
    out: list[str] = []
    for f in picked:
        chars = 0
        for text, _, _ in itertools.islice(iter_records([f], text_key), per_docs):
            out.append(text)
            chars += len(text)
            if chars >= per_chars:
                break
    return out


def _cpu() -> float:
    return time.process_time()


def estimate(paths: list[str], opts: PrepareOptions, tokenizer: str | None) -> dict:
    """The corpus size, per-stage CPU seconds and disk of a staged run over ``paths`` (module docstring)."""
    files = expand_inputs(paths)
    if not files:
        raise ConfigError(f"--plan {' '.join(paths)}: no input files found.")
    picked = _spread(files)
    own = {f: _per_byte(f, opts.text_key) for f in picked}  # sampled files: their own rates
    kinds: dict[tuple[str, str], list[float]] = {}  # the others: the bytes-weighted rate of their kind
    for f, (d, c) in own.items():
        acc = kinds.setdefault((file_kind(f), _compression(f)), [0.0, 0.0, 0.0])
        size = f.stat().st_size
        acc[0], acc[1], acc[2] = acc[0] + d * size, acc[1] + c * size, acc[2] + size
    docs = chars = 0.0
    for f in files:
        key = (file_kind(f), _compression(f))
        if f in own:
            d, c = own[f]
        elif key in kinds:
            d, c = kinds[key][0] / max(kinds[key][2], 1), kinds[key][1] / max(kinds[key][2], 1)
        else:
            d, c = _per_byte(f, opts.text_key)
            own[f] = (d, c)
        docs += d * f.stat().st_size + (key[0] == "text")
        chars += c * f.stat().st_size
    m = opts.minhash
    staged = opts.dedup != "none"
    near = opts.dedup == "near"
    t0 = _cpu()
    sample = _sample(files, opts.text_key)
    if not sample:
        raise ConfigError(f"--plan {' '.join(paths)}: the inputs hold no documents.")
    s_chars = sum(map(len, sample))
    kept: list[str] = []
    bands, sigs = [], []
    for i in range(0, len(sample), 256):
        s = screen_chunk(sample[i : i + 256], dataclasses.replace(opts, dedup="near"))
        kept += s.texts
        if s.bands is not None and s.sigs is not None:
            bands.append(s.bands)
            sigs.append(s.sigs)
    cpu = {"1 screen": _cpu() - t0}
    keep_share = len(kept) / len(sample)
    band = np.concatenate(bands) if bands else np.zeros((0, m.bands), np.uint64)
    sig = np.concatenate(sigs) if sigs else np.zeros((0, m.bands * m.rows), np.uint16)
    t0 = _cpu()
    ids = np.repeat(np.arange(len(band)), m.bands)
    a, b, _ = near_pairs(band.reshape(-1).view(np.int64), ids, lambda r: sig[ids[r]], m.threshold)
    cpu["2 pairs"] = _cpu() - t0
    t0 = _cpu()
    component_minimum(len(band), ids[a], ids[b])
    cpu["3 components"] = _cpu() - t0
    pair_share = len(set(zip(ids[a].tolist(), ids[b].tolist()))) / max(len(band), 1)
    tokens_per_char, dtype_bytes = 0.25, 4
    if tokenizer is not None:
        tok = cached_tokenizer(tokenizer, None)
        t0 = _cpu()
        lengths, flat = tokenize_texts(kept, tok, tokenizer)
        cpu["4 tokenize"] = _cpu() - t0
        tokens_per_char, dtype_bytes = int(lengths.sum()) / max(sum(map(len, kept)), 1), flat.dtype.itemsize
        t0 = _cpu()
        with tempfile.TemporaryDirectory() as tmp:
            w = IndexedDatasetWriter(str(Path(tmp) / "x"), flat.dtype)
            w.add_documents(flat, lengths)
            w.finalize()
        cpu["5 write"] = _cpu() - t0
    else:
        cpu["4 tokenize"] = sum(map(len, kept)) / TOKENIZE_CHARS_PER_CPU_S
        cpu["5 write"] = 0.0
    scale = chars / max(s_chars, 1)  # corpus / sample, in characters
    total_cpu = {k: v * scale for k, v in cpu.items()}
    if not staged:
        total_cpu["2 pairs"] = total_cpu["3 components"] = 0.0
    kept_docs, kept_chars = docs * keep_share, chars * keep_share
    rows = kept_docs * ((m.bands if near else 0) + (1 if staged else 0))
    tokens = kept_chars * tokens_per_char
    disk = {
        "stage 1 texts": kept_chars * len("".join(kept).encode("utf-8")) / max(sum(map(len, kept)), 1),
        "stage 1 signatures": kept_docs * m.bands * m.rows * 2 if near else 0.0,
        "stage 1 bucket rows": rows * 24,
        "stage 2 pairs": kept_docs * pair_share * 41,
        "stage 4 parts": tokens * dtype_bytes + kept_docs * 10,
        "final shards": tokens * dtype_bytes + kept_docs * 10,
    }
    return {
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
        "documents": docs,
        "characters": chars,
        "sample_documents": len(sample),
        "kept_share": keep_share,
        "cpu_seconds": total_cpu,
        "disk_bytes": disk,
        "buckets": max(1, math.ceil(rows * 64 / MEMORY_PER_TASK)),
        "measured_tokenizer": tokenizer is not None,
    }


PARALLEL = ("1 screen", "2 pairs", "4 tokenize")


def wall_seconds(cpu: dict[str, float], cores: int) -> float:
    """Seconds on ``cores`` cores: the parallel stages' CPU seconds divided by the cores, the others not."""
    return sum(v / cores if k in PARALLEL else v for k, v in cpu.items())


def cores_for(cpu: dict[str, float], seconds: float) -> int | None:
    """Cores to finish within ``seconds`` (None when the single-task stages alone take longer)."""
    serial = sum(v for k, v in cpu.items() if k not in PARALLEL)
    parallel = sum(v for k, v in cpu.items() if k in PARALLEL)
    return None if serial >= seconds else max(1, math.ceil(parallel / (seconds - serial)))


def _dur(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def format_plan(est: dict, cores: list[int], hours: float) -> str:
    """The estimate as the lines ``--plan`` prints."""
    gb = 1e9
    cpu = est["cpu_seconds"]
    lines = [
        f"plan: {est['files']} file(s), {est['bytes'] / gb:.3f} GB stored, ~{est['documents']:,.0f} documents, "
        f"~{est['characters'] / 1e6:,.1f} M characters (rates from {est['sample_documents']} sampled documents; "
        f"{100 * est['kept_share']:.0f}% pass clean + filter)",
        "  CPU time per stage: " + ", ".join(f"{k} {_dur(v)}" for k, v in cpu.items()),
    ]
    if not est["measured_tokenizer"]:
        lines.append("  (tokenize and write not measured: pass --tokenizer FILE; a recorded rate is used)")
    lines.append(
        "  wall time on N cores (stages 1, 2, 4 in parallel; 3 and 5 one task each, assumed linear):"
    )
    lines += [f"    {n:>6} cores  {_dur(wall_seconds(cpu, n))}" for n in cores]
    need = cores_for(cpu, hours * 3600)
    lines.append(f"  cores for {hours:g} h: " + (str(need) if need else "out of reach (single-task stages)"))
    per_tb = {k: v * 1e12 / max(est["bytes"], 1) for k, v in cpu.items()}
    tb_need = cores_for(per_tb, hours * 3600)
    lines.append(
        f"  1 TB stored of the same kind of text: {sum(per_tb.values()) / 3600:,.0f} CPU hours; cores for "
        f"{hours:g} h: {tb_need if tb_need else 'out of reach (single-task stages)'}"
    )
    lines.append("  disk for intermediates (GB): " + ", ".join(f"{k} {v / gb:.3f}" for k, v in est["disk_bytes"].items())
                 + f"; peak {sum(est['disk_bytes'].values()) / gb:.3f}")  # fmt: skip
    lines.append(f"  suggested --buckets {est['buckets']} (stage 2 rows of a bucket within 2 GB per task)")
    return "\n".join(lines)


def print_plan(paths: list[str], args: argparse.Namespace, opts: PrepareOptions) -> None:
    """``prepare --plan``: estimate and print (the flags give the tokenizer, options, cores and hours)."""
    try:
        cores = [int(x) for x in str(args.plan_cores).split(",") if x.strip()]
    except ValueError:
        cores = []
    if not cores or min(cores) < 1:
        raise ConfigError(f"--plan-cores {args.plan_cores!r}: expected core counts such as 1,16,64.")
    if not args.plan_hours > 0:
        raise ConfigError(f"--plan-hours {args.plan_hours}: expected a positive number of hours.")
    est = estimate(paths, opts, args.tokenizer)
    print(format_plan(est, cores, args.plan_hours))

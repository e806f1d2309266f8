"""Checkpoint write speed against the disk's raw sequential speed, and the training time an async save blocks.

One run, same directory, same bytes::

    raw       one file written in 4 MiB chunks, then fsync: the disk's sequential write speed (the target's
              baseline); also once more with write-back started every 32 MiB, a stricter baseline
    sync      Checkpointer.save (DCP write + fsync, SHA-256 of every file, commit protocol); the previous
              checkpoint it rotates out is deleted in the background and waited for before raw is measured
    async     Checkpointer.save_async: the time the caller is blocked (staging to a CPU copy), then wait()

Targets (issue 5): sync throughput >= 0.5x raw; async blocked time <= 10% of a synchronous save. The state is
a stack of square fp32 Linear layers with AdamW moments (3 x the parameter bytes), so the sizes are exact.
Results are appended to docs/performance.md under "## Checkpoints (issue 5)" (``--no-docs``: print only).

    .venv/bin/python bench/checkpoint_speed.py --params-m 40 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from llmtrain.config.schema import CheckpointConfig
from llmtrain.train.checkpoint import Checkpointer

SECTION = "## Checkpoints (issue 5)"


def build_state(params_m: float, width: int = 1024) -> tuple[nn.Module, torch.optim.Optimizer]:
    layers = max(int(params_m * 1e6 // (width * width)), 1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # materialise the moments
    return model, opt


def raw_write(path: Path, nbytes: int, chunk: int = 4 << 20, writeback: bool = False) -> float:
    """Seconds to write ``nbytes`` and fsync (like ``dd conv=fsync``); with ``writeback``, also start the
    disk write every 32 MiB as the checkpoint writer does (the best a single sequential stream can do)."""
    buf = os.urandom(chunk)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left, flushed = nbytes, 0
        while left > 0:
            f.write(buf[: min(chunk, left)])
            left -= chunk
            if writeback and nbytes - left - flushed >= 32 << 20:
                f.flush()
                os.posix_fadvise(f.fileno(), flushed, nbytes - left - flushed, os.POSIX_FADV_DONTNEED)
                flushed = nbytes - left
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def insert_in_section(text: str, block: str) -> str:
    """``text`` with ``block`` added at the end of the SECTION (created at the end of the file if missing)."""
    if SECTION not in text:
        return text + f"\n{SECTION}\n" + block
    start = text.index(SECTION) + len(SECTION)
    nxt = text.find("\n## ", start)
    end = len(text) if nxt < 0 else nxt + 1
    head, tail = text[:end].rstrip("\n") + "\n", text[end:]
    return head + block + ("\n" + tail if tail else "")


def ckpt_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=float, default=40.0, help="model parameters in millions")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under ./)")
    ap.add_argument("--no-docs", action="store_true", help="do not append to docs/performance.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt_bench_", dir="."))
    model, opt = build_state(args.params_m)
    try:
        rows = []
        ck = Checkpointer(CheckpointConfig(keep_checkpoint_max=1, save_dir=str(root / "sync")), root)
        ack = Checkpointer(CheckpointConfig(keep_checkpoint_max=1, save_dir=str(root / "async")), root)
        ck.save(0, model, opt, {"step": 0})  # warm-up: file system, DCP planner caches
        ack.save_async(0, model, opt, {"step": 0})  # warm-up: allocates the reusable staging buffers
        ack.wait()
        for r in range(1, args.repeats + 1):
            t0 = time.perf_counter()
            path = ck.save(r, model, opt, {"step": r})
            sync_s = time.perf_counter() - t0
            ck.wait()  # the rotated-out checkpoint is deleted in the background: not while raw is measured
            nbytes = ckpt_bytes(path)
            raw_s = raw_write(root / "raw.bin", nbytes)
            (root / "raw.bin").unlink()
            rawwb_s = raw_write(root / "raw.bin", nbytes, writeback=hasattr(os, "posix_fadvise"))
            (root / "raw.bin").unlink()
            t0 = time.perf_counter()
            ack.save_async(r, model, opt, {"step": r})
            blocked_s = time.perf_counter() - t0
            ack.wait()
            async_total_s = time.perf_counter() - t0
            rows.append((nbytes, raw_s, sync_s, blocked_s, async_total_s, rawwb_s))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    best = min(rows, key=lambda x: x[2])
    nbytes, raw_s, sync_s, blocked_s, async_total_s, rawwb_s = best
    raw_bw, ck_bw, rawwb_bw = nbytes / raw_s / 1e6, nbytes / sync_s / 1e6, nbytes / rawwb_s / 1e6
    lines = [
        f"checkpoint bytes            {nbytes / 1e6:10.1f} MB (model + AdamW moments, fp32)",
        f"raw sequential write+fsync  {raw_bw:10.1f} MB/s ({raw_s:.2f} s)",
        f"sync checkpoint save        {ck_bw:10.1f} MB/s ({sync_s:.2f} s, incl. SHA-256 + commit)",
        f"  ratio to raw              {ck_bw / raw_bw:10.2f} x   (target >= 0.5)",
        f"raw, early write-back       {rawwb_bw:10.1f} MB/s ({rawwb_s:.2f} s; ratio to it {ck_bw / rawwb_bw:.2f} x)",
        f"async save: blocked         {blocked_s:10.3f} s, total {async_total_s:.2f} s",
        f"  blocked / sync save       {blocked_s / sync_s:10.3f}     (target <= 0.10)",
    ]
    print("\n".join(lines))
    if not args.no_docs:
        cmd = "python bench/checkpoint_speed.py " + " ".join(sys.argv[1:])
        docs = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
        text = docs.read_text() if docs.exists() else ""
        block = (
            f"\n`{cmd.strip()}` ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}, best of {args.repeats}):\n\n```\n" + "\n".join(lines) + "\n```\n"
        )
        docs.write_text(insert_in_section(text, block))
        print(f"added to {docs}, section {SECTION!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

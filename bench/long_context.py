"""Long packed sequences: memory and time of dense-mask SDPA vs FlexAttention, and the chunked loss (issue 17).

For each sequence length (default 2k, 4k, 8k, 16k) one batch of one packed sequence (documents of random
length, mean ``--doc-len``) goes through a tiny Llama (``--dim`` 64, 2 layers, 4 heads, vocab 512, fp32) with
document masks, in a fresh child process per measurement::

    sdpa step   one training step (forward + backward) with the dense boolean [1, 1, T, T] document mask
    sdpa fwd    forward only, same mask (the like-for-like partner of flex on CPU)
    flex        FlexAttention with the block mask: a training step on CUDA; forward only on CPU, where
                torch 2.13 has no flex backward (compiled: eager flex materialises the scores)
    cp2         the sdpa training step under context parallel 2: two gloo processes (torchrun, one thread
                each), the trainer's own path (``parallel.context_parallel: 2`` through
                distributed/parallelize.py: CP + FSDP over dp_shard x cp; ``TrainStep.forward_loss`` shards the
                same packed batch and builds the mask of the local queries vs the gathered keys); the column is
                the max over ranks of peak and time, ``cp2/step`` that peak over the one-process ``sdpa step``

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over the measured run; on CPU the peak resident set
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``) minus the resident set before the run, with
``MALLOC_MMAP_THRESHOLD_`` set so freed tensors return to the OS. Each measurement first runs once to warm up
(and compile). The growth exponent of peak memory with sequence length is the least-squares slope of
log(peak) over log(seq) (dense ~2, block-sparse ~1). Then the chunked cross-entropy (train/loss.py) at vocab
``--vocab`` (128K) against the plain loss over ``--loss-tokens`` tokens: peak of forward + backward.

    OMP_NUM_THREADS=1 .venv/bin/python bench/long_context.py --seqs 2048 4096 8192 16384 --loss-tokens 2048

GPU comparison (issue 17: flex with document masks vs SDPA's flash kernel on a plain causal mask, equal tokens,
bf16; ``causal_step`` is that SDPA training step, no mask tensor; scripts/gpu_checks.sh runs it)::

    python3 bench/long_context.py --seqs 8192 16384 32768 --kinds causal_step flex --bf16 --dim 2048 --heads 16 \
        --layers 4 --no-loss
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

CP = 2  # the context-parallel degree of the cp2 column (one process per CP rank)


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def _measure(fn: Callable[[], None], device, sync: Callable[[], None] | None = None) -> tuple[int, float]:
    """Peak bytes and seconds of the second of two ``fn()`` calls; ``sync`` (a barrier) runs between them."""
    import torch

    fn()  # warm-up (and compile)
    if sync is not None:  # every rank starts the measured run together
        sync()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _status_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _status_kb("VmHWM") - base
    return peak, time.perf_counter() - t0


def _child(kind: str, seq: int, a: argparse.Namespace) -> dict:
    import torch

    from llmtrain.models.common import flex
    from llmtrain.train.loss import chunked_head_loss
    from llmtrain.train.step import TokenLoss

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind.startswith("loss"):
        h = torch.randn(1, a.loss_tokens, a.dim, device=device, requires_grad=True)
        head = torch.nn.Linear(a.dim, a.vocab, bias=False, device=device)
        labels = torch.randint(0, a.vocab, (1, a.loss_tokens), device=device)

        def loss_step() -> None:
            x = h * 1.0
            loss = (
                chunked_head_loss(x, head, labels, a.chunk)
                if kind == "loss_chunked"
                else TokenLoss()(head(x), labels)
            )
            loss.backward()
            h.grad = head.weight.grad = None

        peak, secs = _measure(loss_step, device)
        return {"kind": kind, "tokens": a.loss_tokens, "vocab": a.vocab, "peak": peak, "s": secs}
    flex.COMPILE_ON_CPU = True
    model, ids, pos, doc_ids = _tiny_llama(seq, a, device)
    model.attention_impl = "flex" if kind == "flex" else "sdpa"
    train = kind in ("sdpa_step", "causal_step") or (kind == "flex" and device.type == "cuda")
    causal = kind == "causal_step"  # plain causal, no mask tensor: SDPA may take its flash kernel
    cast = torch.autocast(device.type, dtype=torch.bfloat16) if a.bf16 else contextlib.nullcontext()

    def step() -> None:
        with torch.set_grad_enabled(train), cast:
            logits = model(
                ids, position_ids=None if causal else pos, document_ids=None if causal else doc_ids
            )
            if train:
                TokenLoss()(logits, ids).backward()
                model.zero_grad(set_to_none=True)

    peak, secs = _measure(step, device)
    return {"kind": kind, "seq": seq, "peak": peak, "s": secs, "train": train, "device": device.type}


def _tiny_llama(seq: int, a: argparse.Namespace, device) -> tuple:
    """The tiny Llama (seeded) and one packed sequence: ``(model, input_ids, position_ids, document_ids)``."""
    import dataclasses

    import torch

    from llmtrain.models import FAMILIES, build_model

    torch.manual_seed(0)
    args = dataclasses.replace(
        FAMILIES["llama3"].flavor_args("debug"), hidden_size=a.dim, num_layers=a.layers, num_heads=a.heads,
        num_kv_heads=a.heads, head_dim=a.dim // a.heads, intermediate_size=2 * a.dim, vocab_size=512, seq_length=seq,
        max_position_embeddings=seq,
    )  # fmt: skip
    model = build_model(args, device=device)
    gen = torch.Generator().manual_seed(seq)
    lengths: list[int] = []
    while sum(lengths) < seq:
        lengths.append(
            min(int(torch.randint(a.doc_len // 4, 2 * a.doc_len, (1,), generator=gen)), seq - sum(lengths))
        )
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].to(device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    ids = torch.randint(0, 512, (1, seq), generator=gen).to(device)
    return model, ids, pos, doc_ids


def _cp_child(seq: int, a: argparse.Namespace) -> dict | None:
    """One CP rank (under torchrun): the sdpa training step of ``_child`` through the trainer's CP path; rank 0
    returns the max over ranks of peak bytes and seconds (None on the others)."""
    import torch
    import torch.distributed as dist

    from llmtrain.config import config_from_dict
    from llmtrain.distributed.context_parallel import find
    from llmtrain.distributed.device import init_distributed, shutdown_distributed
    from llmtrain.distributed.parallel_dims import ParallelDims
    from llmtrain.distributed.parallelize import parallelize
    from llmtrain.train.step import TokenLoss, TrainStep

    if torch.cuda.is_available() and torch.cuda.device_count() < CP:  # the other columns ran on one GPU
        return {"kind": "cp2", "seq": seq, "error": f"needs {CP} GPUs"} if os.environ["RANK"] == "0" else None
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = config_from_dict({
        "model": {"model_type": "llama3", "seq_length": seq, "document_mask": True, "attention": "sdpa"},
        "train": {"loss_chunk_tokens": 0},  # the plain loss, as in the one-process column
        "parallel": {"context_parallel": CP},
        "run": {"device_target": device.type},
    })  # fmt: skip
    world = init_distributed(device.type, 600)
    dims = ParallelDims.from_config(cfg.parallel, world)
    meshes = dims.build_meshes(device.type)
    model, ids, pos, doc_ids = _tiny_llama(seq, a, device)  # the same weights and batch on every rank
    parallelize(model, cfg, dims, meshes["world"], device.type)  # CP (apply_cp) + FSDP over dp_shard x cp
    cp = find(model)
    assert cp is not None and cp.size == CP
    step_fn = TrainStep(
        model, None, None, TokenLoss(), device, None, None,  # type: ignore[arg-type]  (forward_loss only)
        dp_group=None, pipeline=None, moe=None, grad_scale=1.0, world_size=world,
    )  # fmt: skip
    mb = {"input_ids": ids, "labels": ids, "position_ids": pos, "document_ids": doc_ids}

    def step() -> None:
        step_fn.forward_loss(cfg, mb).backward()  # shard, local queries vs gathered keys, own tokens' loss
        model.zero_grad(set_to_none=True)
        # drop the batch's masks (the trainer keeps them until the next shard, off its peak), so the measured
        # run's baseline does not hold the warm-up's mask, which its shard would free and hide from the peak
        cp.release()

    peak, secs = _measure(step, device, sync=dist.barrier)
    worst = torch.tensor([float(peak), secs], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    rank = dist.get_rank()
    shutdown_distributed(barrier=True)
    if rank:
        return None
    return {"kind": "cp2", "seq": seq, "peak": int(worst[0]), "s": float(worst[1]), "device": device.type}


def _run_child(kind: str, seq: int, a: argparse.Namespace) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    launch = [sys.executable]
    if kind == "cp2":  # one process per CP rank, one thread each, gloo (nccl with >= 2 GPUs)
        env["OMP_NUM_THREADS"] = "1"
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={CP}"]
    cmd = [*launch, __file__, "--child", kind, "--child-seq", str(seq), *sys.argv[1:]]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"kind": kind, "seq": seq, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(lines[-1])


def _exponent(points: list[tuple[int, int]]) -> float:
    xs = [math.log(s) for s, p in points if p > 0]
    ys = [math.log(p) for s, p in points if p > 0]
    if len(xs) < 2:
        return float("nan")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--doc-len", type=int, default=512)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="the model's forward under bf16 autocast (GPU runs)")
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--loss-tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument(
        "--kinds",
        nargs="+",
        choices=("sdpa_step", "sdpa_fwd", "flex", "cp2", "causal_step"),
        default=["sdpa_step", "sdpa_fwd", "flex", "cp2"],
        help="columns to measure (others: -)",
    )
    p.add_argument("--no-loss", action="store_true", help="skip the chunked-loss measurement")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-seq", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        result = _cp_child(a.child_seq, a) if a.child == "cp2" else _child(a.child, a.child_seq, a)
        if result is not None:  # (CP: rank 0 reports)
            print(json.dumps(result))
        return
    mib = 2**20
    kinds = ("sdpa_step", "sdpa_fwd", "flex", "cp2")
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    print(
        "| seq | sdpa step MiB | sdpa step s | sdpa fwd MiB | flex MiB | flex s | cp2 MiB/rank | cp2 s "
        "| cp2/step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seq in a.seqs:
        row = {k: _run_child(k, seq, a) if k in a.kinds else {"error": "-"} for k in kinds}
        for k in kinds:
            results[k].append(row[k])
        cells = []
        for k, cols in (
            ("sdpa_step", ("peak", "s")), ("sdpa_fwd", ("peak",)), ("flex", ("peak", "s")), ("cp2", ("peak", "s"))
        ):  # fmt: skip
            r = row[k]
            for c in cols:
                cells.append(
                    r["error"] if "error" in r else f"{r[c] / mib:.1f}" if c == "peak" else f"{r[c]:.3f}"
                )
        one, cp = row["sdpa_step"], row["cp2"]
        ok = "peak" in one and "peak" in cp and one.get("device") == cp.get("device")
        cells.append(f"{cp['peak'] / one['peak']:.2f}" if ok else "-")  # cp2 per rank / one process
        print(f"| {seq} | " + " | ".join(cells) + " |", flush=True)
        if "causal_step" in a.kinds:  # the GPU comparison: flex with document masks vs SDPA's plain causal
            c, f = _run_child("causal_step", seq, a), row["flex"]
            speed = f"{c['s'] / f['s']:.2f}x" if "s" in c and "s" in f and f.get("train") else "-"
            print(
                f"  seq {seq}: sdpa plain causal step {c.get('s', 0):.3f} s, peak "
                f"{c['peak'] / mib:.1f} MiB; flex document-mask speed / plain causal (equal tokens): {speed}"
                if "peak" in c else f"  seq {seq}: causal_step {c}", flush=True,
            )  # fmt: skip
    flex_mode = "train step" if any(r.get("train") for r in results["flex"]) else "forward only (CPU)"
    for k in kinds:
        pts = [(r["seq"], r["peak"]) for r in results[k] if "peak" in r]
        mode = f" ({flex_mode})" if k == "flex" else " (train step, per rank)" if k == "cp2" else ""
        print(f"growth exponent of peak memory, {k}{mode}: {_exponent(pts):.2f}")
    if a.no_loss:
        return
    plain, chunked = _run_child("loss_plain", 0, a), _run_child("loss_chunked", 0, a)
    if "error" in plain or "error" in chunked:
        print("loss:", plain, chunked)
        return
    print(
        f"loss at vocab {a.vocab}, {a.loss_tokens} tokens, dim {a.dim}: plain peak {plain['peak'] / mib:.1f} MiB "
        f"({plain['s']:.3f} s), chunked ({a.chunk} tokens) peak {chunked['peak'] / mib:.1f} MiB "
        f"({chunked['s']:.3f} s); fp32 [tokens, vocab] logits = {a.loss_tokens * a.vocab * 4 / mib:.1f} MiB"
    )


if __name__ == "__main__":
    main()

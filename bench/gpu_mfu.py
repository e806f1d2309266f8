"""GPU throughput and MFU of Llama-shaped 1B and 3B models through llmtrain's own Trainer.

Each size is trained for ``--warmup`` + ``--steps`` optimizer steps at ``--seq`` (default 4096) in bf16
autocast, with ``train.compile`` (per-block ``torch.compile``), SDPA restricted to the flash kernel
(``--sdpa flash``; ``auto`` lets torch choose), and FSDP2 over the local GPUs when there are several (the
script then relaunches itself under torchrun, one process per GPU, ``parallel.zero_stage`` ``--zero``).
The data are a small corpus of the Python standard library prepared once (an 8,192-token BPE), enough for
the loader's endless windows; the model's vocabulary stays the real 128,256 so the output layer costs what
it costs in Llama 3.

Shapes (Llama 3.2, tied input/output embeddings, GQA with 8 KV heads, head_dim 64 / 128):

=====  ======  ======  =====  ===  =====  =============
size   hidden  layers  heads  kv   ffn    parameters
=====  ======  ======  =====  ===  =====  =============
1b      2,048      16     32    8  8,192  1,235,814,400
3b      3,072      28     24    8  8,192  3,212,749,824
=====  ======  ======  =====  ===  =====  =============

One row per size: tokens/s (all GPUs), tokens/s per GPU, MFU = ``flops_per_token x tokens/s per GPU /
peak`` with the project's FLOP count (``TransformerArgs.flops_per_token``: 6N, the tied output matrix
included, plus the causal attention term ``6 L T H hd``) over ``--peak-tflops`` (989, H100/H200 dense bf16),
and the peak memory allocated on GPU 0.

    python bench/gpu_mfu.py [--sizes 1b,3b --seq 4096 --steps 10 --warmup 3 --micro-batch 1]
    python bench/gpu_mfu.py --device cpu --tiny --steps 2 --warmup 1     # CPU smoke test (tiny shape)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

_LLAMA32 = {"vocab_size": 128256, "num_kv_heads": 8, "intermediate_size": 8192, "tie_word_embeddings": True}
SIZES: dict[str, dict] = {
    "1b": {**_LLAMA32, "hidden_size": 2048, "num_layers": 16, "num_heads": 32},
    "3b": {**_LLAMA32, "hidden_size": 3072, "num_layers": 28, "num_heads": 24},
    # --tiny: the same code path on a CPU in seconds
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256,
             "vocab_size": 8192, "tie_word_embeddings": True},
}  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1b,3b", help="comma-separated: 1b, 3b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per size")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per step")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to use (0: all visible)")
    ap.add_argument("--zero", type=int, default=3, help="parallel.zero_stage with several GPUs")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--sdpa", choices=("flash", "auto"), default="flash")
    ap.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU")
    ap.add_argument(
        "--cluster-device", default=None, help="planner device name (default: from the GPU's name)"
    )
    ap.add_argument("--tiny", action="store_true", help="tiny shape and seq 64 (CPU smoke test)")
    ap.add_argument("--data", default=None, help="prepared dataset prefix (default: prepare a stdlib corpus)")
    a = ap.parse_args()
    if a.tiny:
        a.sizes, a.seq = "tiny", min(a.seq, 64)
    unknown = [s for s in a.sizes.split(",") if s not in SIZES]
    if unknown:
        ap.error(f"--sizes: unknown {', '.join(unknown)}; choose from 1b, 3b (or --tiny)")
    return a


def prepare_corpus(root: Path) -> str:
    """A prepared dataset prefix from the Python standard library (idempotent: reused when present)."""
    from llmtrain.data.prep.prepare import prepare

    prefix = root / "stdlib"
    if not Path(f"{prefix}.manifest.json").is_file():
        files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:60]
        prepare(files, str(prefix), train_tokenizer=8192, log=None)
    return str(prefix)


def make_config(a: argparse.Namespace, size: str, prefix: str, out: str, world: int) -> dict:
    batch = a.micro_batch * world
    return {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": a.seq, **SIZES[size]},
        "train": {
            "batch_size": batch,
            "micro_batch_size": a.micro_batch,
            "max_steps": 10**6,
            "lr": 1e-4,
            "warmup_steps": 10,
            "log_steps": 10**6,
            "compile": a.compile,
            "precision": "bf16",
            "seed": 0,
        },
        "parallel": {"zero_stage": a.zero if world > 1 else 0},
        "recompute": {"mode": a.recompute},
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.01},
        "checkpoint": {"save_steps": 0, "save_at_end": False, "resume": "none"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False, "peak_tflops": a.peak_tflops},
        "eval": {"at_start": False},
        "run": {"device_target": a.device, "output_dir": out},
    }


def sdpa_context(kind: str, device: str):
    """Restrict SDPA to the flash kernel on CUDA (``auto``, and any CPU run: torch's own choice)."""
    if kind == "flash" and device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    return contextlib.nullcontext()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_size(a: argparse.Namespace, size: str, prefix: str, world: int, sdpa: str) -> dict:
    """Train one size; returns its figures (identical on every rank apart from the memory)."""
    from llmtrain.config import config_from_dict
    from llmtrain.train.trainer import Trainer

    out = tempfile.mkdtemp(prefix=f"gpu-mfu-{size}-")
    gc.collect()  # the previous size's trainer
    if a.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(config_from_dict(make_config(a, size, prefix, out, world)))
    args = trainer.derived.model_args
    tokens_per_step = a.micro_batch * world * a.seq
    step_s: list[float] = []
    losses: list[float] = []
    with sdpa_context(sdpa, a.device):
        for i in range(a.warmup + a.steps):
            sync(a.device)
            t = time.perf_counter()
            losses.append(float(trainer.train_step()["loss"]))
            sync(a.device)
            if i >= a.warmup:
                step_s.append(time.perf_counter() - t)
    trainer.metrics.close()
    peak = torch.cuda.max_memory_allocated() if a.device == "cuda" else 0
    del trainer
    step = statistics.median(step_s)
    tps = tokens_per_step / step
    flops = float(args.flops_per_token(a.seq))
    return {
        "size": size,
        "params": args.num_params(),
        "tokens_per_step": tokens_per_step,
        "step_s": step,
        "tps": tps,
        "tps_gpu": tps / world,
        "mfu": flops * tps / world / (a.peak_tflops * 1e12),
        "peak_gib": peak / 2**30,
        "loss": losses[-1],
        "sdpa": sdpa if a.device == "cuda" else "cpu-default",
    }


def planned_tps_per_gpu(a: argparse.Namespace, size: str, prefix: str, world: int) -> float | None:
    """The planner's tokens/s per GPU for the same config on ``world`` x ``--cluster-device`` (None: no device
    name given and the GPU's name is not H100 / H200)."""
    from llmtrain.config import config_from_dict
    from llmtrain.plan.catalog import load_catalog, parse_cluster
    from llmtrain.plan.search import evaluate, layout_from_config

    device = a.cluster_device
    if device is None and a.device == "cuda":
        name = torch.cuda.get_device_name(0).lower()
        device = "h200" if "h200" in name else "h100" if "h100" in name else None
    if device is None:
        return None
    cfg = config_from_dict(make_config(a, size, prefix, tempfile.gettempdir(), world))
    cluster = parse_cluster(f"{world}x{device}", load_catalog())
    lay, margs, tokens = layout_from_config(cfg, world, a.recompute)
    return evaluate(margs, lay, cluster, tokens, bool(cfg.train.compile)).tokens_per_s_per_device


def run_size(a: argparse.Namespace, size: str, prefix: str, world: int) -> dict:
    """``bench_size``, falling back from the flash-only SDPA to torch's choice if no flash kernel applies."""
    try:
        return bench_size(a, size, prefix, world, a.sdpa)
    except RuntimeError as e:
        if a.sdpa != "flash" or "kernel" not in str(e).lower():
            raise
        print(f"[{size}] flash SDPA refused ({str(e).splitlines()[0][:200]}); rerunning with --sdpa auto")
        return bench_size(a, size, prefix, world, "auto")


def relaunch_under_torchrun(a: argparse.Namespace, gpus: int, prefix: str) -> int:
    """Run this script once per GPU under torchrun (the corpus is prepared once, here)."""
    argv = sys.argv[1:] if a.data else [*sys.argv[1:], "--data", prefix]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           str(Path(__file__).resolve()), *argv]  # fmt: skip
    return subprocess.call(cmd)


def main() -> int:
    a = parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_mfu: --device cuda but torch sees no CUDA device (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}). Run it on a GPU machine with a CUDA build "
            "of torch, or smoke-test the code path with --device cpu --tiny.",
            file=sys.stderr,
        )
        return 2
    if a.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    under_torchrun = "LOCAL_RANK" in os.environ
    visible = torch.cuda.device_count() if a.device == "cuda" else 1
    gpus = min(a.gpus or visible, visible)
    prefix = a.data or prepare_corpus(Path(tempfile.gettempdir()) / "llmtrain-gpu-mfu")
    if gpus > 1 and not under_torchrun:
        return relaunch_under_torchrun(a, gpus, prefix)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        dev = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
        print(
            f"{world} x {dev}, torch {torch.__version__}, seq {a.seq}, micro-batch {a.micro_batch}/GPU, bf16, "
            f"compile {a.compile}, sdpa {a.sdpa}, recompute {a.recompute}, "
            f"{'FSDP2 zero ' + str(a.zero) if world > 1 else 'single device'}, "
            f"{a.warmup} warm-up + {a.steps} timed steps, peak {a.peak_tflops:g} TFLOP/s"
        )
        print(
            f"{'size':>5} {'params':>8} {'tok/step':>9} {'step s':>8} {'tokens/s':>10} {'tok/s/GPU':>10} "
            f"{'MFU':>7} {'peak GiB':>9} {'loss':>7} {'planned':>9} {'error':>7} sdpa"
        )
    for size in a.sizes.split(","):
        r = run_size(a, size, prefix, world)
        if rank == 0:
            plan = planned_tps_per_gpu(a, size, prefix, world)  # tok/s/GPU; error = planned / measured - 1
            planned = f"{plan:>9,.0f} {plan / r['tps_gpu'] - 1:>+7.1%}" if plan else f"{'-':>9} {'-':>7}"
            print(
                f"{r['size']:>5} {r['params'] / 1e9:>7.3f}B {r['tokens_per_step']:>9,} {r['step_s']:>8.3f} "
                f"{r['tps']:>10,.0f} {r['tps_gpu']:>10,.0f} {r['mfu']:>7.2%} {r['peak_gib']:>9.1f} "
                f"{r['loss']:>7.3f} {planned} {r['sdpa']}",
                flush=True,
            )
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FP8 check on a GPU (H100 / H200): the 1B Llama of bench/gpu_mfu.py in bf16, then train.fp8 tensorwise and rowwise.

Same trainer path as ``gpu_mfu.py`` (whose corpus, config and timing it reuses): seq 4096, bf16 autocast,
``train.compile``, flash SDPA, FSDP2 ZeRO ``--zero`` over all visible GPUs (relaunched under torchrun when
there are several; one GPU trains unsharded, as FSDP needs dp > 1). One row per recipe: tokens/s, tokens/s per
GPU, MFU against the dense bf16 peak (the usual convention, so fp8 rows can exceed what bf16 can reach), peak
memory, last loss and the speed-up over bf16. Not run in CI (no GPU); needs torchao (the fp8 extra).

    python bench/gpu_fp8_check.py [--size 1b --seq 4096 --steps 10 --warmup 5 --recipes none,tensorwise,rowwise]
    python bench/gpu_fp8_check.py --json fp8.json     # also write the rows as JSON (rank 0)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_mfu  # noqa: E402  (bench/ is not a package)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1b", choices=sorted(gpu_mfu.SIZES))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps (compilation happens here)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--recipes", default="none,tensorwise,rowwise")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100/H200)")
    ap.add_argument("--data", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_fp8_check: no CUDA device visible; run it on an H100/H200 machine.", file=sys.stderr)
        return 2
    prefix = a.data or gpu_mfu.prepare_corpus(Path(tempfile.gettempdir()) / "llmtrain-gpu-mfu")
    gpus = torch.cuda.device_count()
    if gpus > 1 and "LOCAL_RANK" not in os.environ:
        argv = [*sys.argv[1:], *([] if a.data else ["--data", prefix])]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               str(Path(__file__).resolve()), *argv]  # fmt: skip
        return subprocess.call(cmd)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    # gpu_mfu's own settings (compile, flash SDPA, no recompute), its config plus train.fp8
    mfu_args = argparse.Namespace(
        seq=a.seq, micro_batch=a.micro_batch, zero=a.zero, compile=True, recompute="none", sdpa="flash",
        peak_tflops=a.peak_tflops, device="cuda", steps=a.steps, warmup=a.warmup,
    )  # fmt: skip
    base_config = gpu_mfu.make_config
    rows = []
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}, "
              f"torch {torch.__version__}, {a.size} seq {a.seq}, bf16 + compile, "
              f"{'FSDP2 zero ' + str(a.zero) if world > 1 else 'one GPU (no FSDP)'}")  # fmt: skip
        print(
            f"{'fp8':>10} {'tokens/s':>10} {'tok/s/GPU':>10} {'MFU':>7} {'peak GiB':>9} {'loss':>7} {'vs bf16':>8}"
        )
    for recipe in a.recipes.split(","):

        def with_fp8(*args, _recipe=recipe, **kwargs) -> dict:
            cfg = base_config(*args, **kwargs)
            cfg["train"]["fp8"] = _recipe
            return cfg

        gpu_mfu.make_config = with_fp8
        try:
            r = gpu_mfu.run_size(mfu_args, a.size, prefix, world)
        except Exception as e:  # one recipe failing (e.g. rowwise on a GPU without it) keeps the others
            r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        r["fp8"] = recipe
        rows.append(r)
        if rank == 0 and "error" in r:
            print(f"{recipe:>10} failed: {r['error']}", flush=True)
        elif rank == 0:
            bf16 = next((x["tps"] for x in rows if x["fp8"] == "none" and "tps" in x), None)
            speedup = f"{r['tps'] / bf16:>7.2f}x" if bf16 else f"{'-':>8}"
            print(f"{recipe:>10} {r['tps']:>10,.0f} {r['tps_gpu']:>10,.0f} {r['mfu']:>7.2%} "
                  f"{r['peak_gib']:>9.1f} {r['loss']:>7.3f} {speedup}", flush=True)  # fmt: skip
    if rank == 0 and a.json:
        Path(a.json + ".tmp").write_text(json.dumps(rows, indent=1))
        os.replace(a.json + ".tmp", a.json)
    if world > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training throughput: llmtrain's trainer vs a bare PyTorch loop vs transformers' LlamaForCausalLM.

One model shape (Llama-3 style, ~25M parameters with an 8192 vocabulary, seq 256), fp32 on the CPU (or bf16 on
a GPU with --device cuda), three ways in one process, alternating rounds so machine noise hits all three alike:

- llmtrain: ``Trainer.train_step`` (data loader, schedule, loss normalisation, grad norm + clip, AdamW);
- bare:     the same llmtrain model in a hand-written loop (forward, cross-entropy, backward, clip, AdamW);
- hf:       ``transformers.LlamaForCausalLM`` of the same shape (sdpa attention), a plain AdamW loop.

The bare and hf loops read the same token windows (pre-fetched, so they pay no data cost). Prints tokens/s per
round, the median, and the ratios llmtrain/bare (target >= 0.97) and llmtrain/hf (target >= 1.0).

    .venv/bin/python bench/train_throughput.py [--rounds 12 --steps 2 --threads 2]
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPE = {"hidden_size": 512, "num_layers": 6, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1408}


def make_config(prefix: str, out: str, seq: int, batch: int, device: str, compile_: bool = False):
    from llmtrain.config import config_from_dict

    return config_from_dict(
        {
            "model": {"model_type": "llama3", "flavor": "demo", "seq_length": seq, **SHAPE},
            "train": {
                "batch_size": batch,
                "micro_batch_size": batch,
                "max_steps": 10**6,
                "lr": 1e-3,
                "warmup_steps": 10,
                "log_steps": 10**6,
                "compile": compile_,
                "precision": "bf16" if device == "cuda" else "fp32",
            },
            "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.01},
            "checkpoint": {"save_steps": 0, "save_at_end": False, "resume": "none"},
            "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
            "eval": {"at_start": False},
            "run": {"device_target": device, "output_dir": out},
        }
    )


def hf_model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.models.llama.hf import to_hf_config

    # The same architecture (rope scaling included) through the project's own HF config adapter.
    cfg = LlamaConfig(**to_hf_config(args), attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(device)


def timed(fn, steps: int, tokens_per_step: int, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return steps * tokens_per_step / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--compile", action="store_true", help="llmtrain with train.compile (per-block torch.compile)"
    )
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from llmtrain.data.prep.prepare import prepare
    from llmtrain.models import build_model
    from llmtrain.train.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="llmtrain-bench-"))
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:40]
    prefix = str(tmp / "corpus")
    prepare(files, prefix, train_tokenizer=8192, log=None)
    trainer = Trainer(make_config(prefix, str(tmp / "run"), a.seq, a.batch, a.device, a.compile))
    margs = trainer.derived.model_args
    dev = trainer.device
    print(
        f"model: {margs.num_params() / 1e6:.1f}M params, seq {a.seq}, batch {a.batch}, device {dev}, "
        f"threads {a.threads}, torch {torch.__version__}, llmtrain train.compile {a.compile}"
    )

    # the same windows for the two reference loops
    batches = [trainer.batches.next_step()[0] for _ in range(4)]
    trainer.batches.load_state_dict({**trainer.batches.state_dict(), "consumed_samples": 0})
    amp = (
        torch.autocast(dev.type, dtype=torch.bfloat16)
        if a.device == "cuda"
        else torch.autocast("cpu", enabled=False)
    )

    bare = build_model(margs, device="meta")
    bare.to_empty(device=dev)
    bare.init_weights(seed=0)
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=1e-3, fused=True)
    hf = hf_model(margs, dev)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, fused=True)
    i = [0]

    def bare_step():
        mb = batches[i[0] % len(batches)]
        i[0] += 1
        x, y = mb["input_ids"].to(dev), mb["labels"].to(dev)
        with amp:
            logits = bare(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 1.0)
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)

    def hf_step():
        mb = batches[i[0] % len(batches)]
        i[0] += 1
        x, y = mb["input_ids"].to(dev), mb["labels"].to(dev)
        with amp:
            logits = hf(input_ids=x).logits
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)

    ways = {"llmtrain": trainer.train_step, "bare": bare_step, "hf": hf_step}
    tokens = a.seq * a.batch
    for fn in ways.values():  # warm-up
        fn()
    results: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(a.rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for k in order:
            results[k].append(timed(ways[k], a.steps, tokens, a.device))
        print(f"round {r + 1}: " + "  ".join(f"{k} {results[k][-1]:,.0f}" for k in ways) + "  tokens/s")
    med = {k: statistics.median(v) for k, v in results.items()}
    print("median tokens/s: " + "  ".join(f"{k} {v:,.0f}" for k, v in med.items()))
    # Paired per-round ratios cancel the slow drifts of a shared machine better than a ratio of medians.
    for other, target in (("bare", 0.97), ("hf", 1.00)):
        paired = statistics.median(a / b for a, b in zip(results["llmtrain"], results[other]))
        print(
            f"ratio llmtrain/{other:<4} = {med['llmtrain'] / med[other]:.3f} of medians, "
            f"{paired:.3f} median of per-round ratios (target >= {target:.2f})"
        )


if __name__ == "__main__":
    main()

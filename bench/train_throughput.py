"""Training throughput: llmtrain's trainer against its own model in a bare loop and four peers, and the GEMM limit.

One model shape (Llama-3 style, ~25M parameters with an 8192 vocabulary, seq 256; ``--tiny``: 2 layers of 128
for smoke runs), fp32 on the CPU (or bf16 on a GPU with --device cuda), every way in one process, in alternating
rounds (the order reverses every round) so machine noise hits all alike:

- llmtrain:   ``Trainer.train_step`` (data loader, schedule, loss normalisation, grad norm + clip, AdamW);
- bare:       the same llmtrain model in a hand-written loop (forward, cross-entropy, backward, clip, AdamW);
- hf:         ``transformers.LlamaForCausalLM`` of the same shape (sdpa attention), the same plain loop;
- torchtitan: its ``Llama3Model``;  olmo: OLMo-core's ``Transformer``;  litgpt: its ``GPT``; the plain loop;
- olmo-train: OLMo-core's model through its ``TransformerTrainModule`` (its loss, clip and optimizer step).

How each peer is built (from its own config API) is in bench/peers.py; the script asserts that every way has
llmtrain's parameter count and prints it. The reference loops read the same token windows (pre-fetched, so they
pay no data cost). ``--compile`` adds a second set of rounds with every way under torch.compile (llmtrain:
train.compile; bare: the same per-block compile; each peer its own compile API, see peers.py).

The GEMM limit: the model's own linear layers (forward, input-grad, weight-grad at batch x seq rows, weighted
by count) timed at the bench's thread count, in GFLOP/s. Per way: model FLOPs per step (6 N tokens + causal
attention, ``ModelArgs.flops_per_token``) / step time, and that as a fraction of the GEMM limit. Targets
(issue 18): llmtrain >= 1.0x the fastest peer in eager and compiled mode, >= 80 % of the GEMM limit;
llmtrain/bare >= 0.97.

The peers come from the ``bench`` extra (pyproject.toml says how it is installed beside torch). Smoke run:

    .venv/bin/python bench/train_throughput.py --tiny --rounds 1 --steps 1 [--compile]

The measurement, on a quiet machine:

    .venv/bin/python bench/train_throughput.py --rounds 12 --steps 2 --threads 2 --compile
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402

SHAPE = {"hidden_size": 512, "num_layers": 6, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1408}
TINY = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 352}
WAYS = ("llmtrain", "bare", "hf", "torchtitan", "olmo", "olmo-train", "litgpt")
PEERS = ("hf", "torchtitan", "olmo", "olmo-train", "litgpt")
NOTES: list[str] = []  # what a table's reader must know (a way that did not run as asked)


def make_config(prefix: str, out: str, seq: int, batch: int, device: str, compile_: bool = False, shape=None):
    from llmtrain.config import config_from_dict

    return config_from_dict(
        {
            "model": {"model_type": "llama3", "flavor": "demo", "seq_length": seq, **(shape or SHAPE)},
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


def timed(fn, steps: int, device: str) -> float:
    """Seconds per step of ``steps`` calls of ``fn``."""
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def build_ways(a, names, prefix: str, tmp: Path, compile_: bool, expect: int | None):
    """Each named way as a step function (compiled when ``compile_``), every model's parameter count checked."""
    from llmtrain.models import build_model
    from llmtrain.train.trainer import Trainer

    shape = TINY if a.tiny else SHAPE
    run = tmp / f"run-{'compiled' if compile_ else 'eager'}"
    trainer = Trainer(make_config(prefix, str(run), a.seq, a.batch, a.device, compile_, shape))
    margs, dev = trainer.derived.model_args, trainer.device
    expect = margs.num_params() if expect is None else expect
    batches = [trainer.batches.next_step()[0] for _ in range(4)]  # the same windows for the reference loops
    trainer.batches.load_state_dict({**trainer.batches.state_dict(), "consumed_samples": 0})
    amp = (
        torch.autocast(dev.type, dtype=torch.bfloat16)
        if a.device == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    s = peers.shape_of(margs, a.seq)
    ways: dict[str, Callable[[], object]] = {}
    counts: dict[str, int] = {}
    for name in names:
        if name == "llmtrain":
            ways[name], counts[name] = trainer.train_step, peers.n_params(trainer.model)
            continue
        model: torch.nn.Module
        if name == "bare":
            model = build_model(margs, device="meta")
            model.to_empty(device=dev)
            model.init_weights(seed=0)
        elif name == "hf":
            model = hf_model(margs, dev)
        else:
            model = peers.build("olmo" if name == "olmo-train" else name, s, dev)
        counts[name] = peers.n_params(model)
        if name == "olmo-train":  # its train module applies its own compile (compile_model=True)
            if compile_ and dev.type != "cuda":
                NOTES.append("olmo-train compiled: eager, OLMo-core's train module compiles on CUDA only")
            ways[name] = peers.olmo_trainer_step(model, s, batches, dev, compile_)
            continue
        runner = model
        if compile_ and name == "bare":  # what train.compile does: each block on its own
            blocks = cast(torch.nn.ModuleDict, model.layers)
            for key, block in list(blocks.items()):
                blocks[key] = cast(torch.nn.Module, torch.compile(block))
        elif compile_:
            runner = peers.compile_model(name, model)
        ways[name] = peers.plain_step(
            runner, model, batches, dev, amp, hf=name == "hf", compile_loss=compile_
        )
    for name, n in counts.items():
        assert n == expect, f"{name}: {n:,} parameters, llmtrain {expect:,}: not the same shape"
    print(
        f"parameters ({'compiled' if compile_ else 'eager'}): "
        + "  ".join(f"{k} {v:,}" for k, v in counts.items())
        + f"  (llmtrain ModelArgs.num_params {expect:,})"
    )
    return ways, margs, dev, trainer


def rounds(a, ways, label: str) -> dict[str, list[float]]:
    """Alternating rounds (order reversed every other round); seconds per step of each way in each round."""
    for name, fn in ways.items():  # warm-up (compiles, when compiled)
        t = time.perf_counter()
        fn()
        print(f"warm-up {label} {name}: {time.perf_counter() - t:.1f} s", flush=True)
    res: dict[str, list[float]] = {k: [] for k in ways}
    tokens = a.seq * a.batch
    for r in range(a.rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for k in order:
            res[k].append(timed(ways[k], a.steps, a.device))
        print(
            f"{label} round {r + 1}: "
            + "  ".join(f"{k} {tokens / res[k][-1]:,.0f}" for k in ways)
            + "  tokens/s",
            flush=True,
        )
    return res


def report(a, res: dict[str, list[float]], label: str, step_flops: float, limit: float) -> None:
    tokens = a.seq * a.batch
    print(f"\n{label}: {step_flops / 1e9:.2f} GFLOP per step, GEMM limit {limit / 1e9:.1f} GFLOP/s")
    print(f"{'way':<11} {'tokens/s':>10} {'s/step':>8} {'GFLOP/s':>8} {'of GEMM':>8} {'llmtrain/way':>13}")
    for k, v in res.items():
        sec = statistics.median(v)
        ratio = ""
        if "llmtrain" in res and k != "llmtrain":  # paired per-round ratios cancel a shared machine's drifts
            ratio = f"{statistics.median(b / x for x, b in zip(res['llmtrain'], v)):.3f}"
        print(
            f"{k:<11} {tokens / sec:>10,.0f} {sec:>8.3f} {step_flops / sec / 1e9:>8.1f} "
            f"{step_flops / sec / limit:>8.1%} {ratio:>13}"
        )
    for note in NOTES if label == "compiled" else ():
        print(f"note: {note}")
    peer_names = [k for k in res if k in PEERS]
    if "llmtrain" in res and peer_names:
        best = min(peer_names, key=lambda k: statistics.median(res[k]))
        ll = statistics.median(res["llmtrain"])
        print(
            f"llmtrain / fastest peer ({best}) = {statistics.median(res[best]) / ll:.3f} (target >= 1.00); "
            f"llmtrain at {step_flops / ll / limit:.1%} of the GEMM limit (target >= 80%)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tiny", action="store_true", help="2 layers of 128 (smoke runs)")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated subset of {','.join(WAYS)}")
    ap.add_argument("--compile", action="store_true", help="a second set of rounds, every way compiled")
    a = ap.parse_args()
    names = [w.strip() for w in a.ways.split(",") if w.strip()]
    unknown = sorted(set(names) - set(WAYS))
    if unknown:
        ap.error(f"--ways: unknown {', '.join(unknown)}; valid: {', '.join(WAYS)}")
    torch.set_num_threads(a.threads)
    from llmtrain.data.prep.prepare import prepare

    tmp = Path(tempfile.mkdtemp(prefix="llmtrain-bench-"))
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:40]
    prefix = str(tmp / "corpus")
    prepare(files, prefix, train_tokenizer=8192, log=None)

    ways, margs, dev, trainer = build_ways(a, names, prefix, tmp, False, None)
    expect = margs.num_params()
    tokens = a.seq * a.batch
    step_flops = margs.flops_per_token(a.seq) * tokens
    print(
        f"model: {expect / 1e6:.1f}M params, seq {a.seq}, batch {a.batch}, device {dev}, "
        f"threads {a.threads}, torch {torch.__version__}"
    )
    shapes = peers.linear_shapes(trainer.model)
    limit = peers.gemm_limit(shapes, tokens, dev)
    mix = ", ".join(f"{c}x[{tokens}x{k}]@[{k}x{n}]" for (k, n), c in sorted(shapes.items()))
    print(f"GEMM limit: {limit / 1e9:.1f} GFLOP/s at {a.threads} threads (fwd + 2 bwd GEMMs of {mix})")
    eager = rounds(a, ways, "eager")
    del ways, trainer
    compiled = None
    if a.compile:
        cways, *_ = build_ways(a, names, prefix, tmp, True, expect)
        compiled = rounds(a, cways, "compiled")
    report(a, eager, "eager", step_flops, limit)
    if compiled is not None:
        report(a, compiled, "compiled", step_flops, limit)


if __name__ == "__main__":
    main()

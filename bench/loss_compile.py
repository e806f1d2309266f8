"""The cross-entropy of ``train.compile`` (train/loss.py) against the eager one: forward + backward time per step.

At the shape of bench/train_throughput.py's step (2048 tokens, vocab 8192, fp32 logits on the CPU) it times the
loss alone (``[tokens, vocab]`` logits in, their gradient out) and the loss with the output projection in front
(hidden 512 -> vocab, the head's three GEMMs included), eager and compiled, in alternating rounds; prints the
medians and compiled / eager. ``--dtype bf16`` feeds bf16 logits (the autocast case on a GPU)::

    .venv/bin/python bench/loss_compile.py --rounds 10 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from llmtrain.train.loss import cross_entropy_fn


def timed(fn: Callable[[], torch.Tensor], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn().backward()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(a.tokens, a.vocab, generator=gen).to(dtype).requires_grad_()
    h = torch.randn(a.tokens, a.hidden, generator=gen).to(dtype).requires_grad_()
    head = torch.nn.Linear(a.hidden, a.vocab, bias=False).to(dtype)
    labels = torch.randint(0, a.vocab, (a.tokens,), generator=gen)
    ways: dict[str, Callable[[], torch.Tensor]] = {}
    for compiled in (False, True):
        ce = cross_entropy_fn(compiled)
        tag = "compiled" if compiled else "eager"
        ways[f"loss {tag}"] = lambda ce=ce: ce(logits, labels)
        ways[f"head+loss {tag}"] = lambda ce=ce: ce(head(h), labels)
    for fn in ways.values():  # warm up (and compile)
        timed(fn, 2)
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(a.rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for k in order:
            times[k].append(timed(ways[k], a.reps))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{a.tokens} tokens x vocab {a.vocab}, {a.dtype}, {a.threads} threads, median of {a.rounds} rounds:"
    )
    for part in ("loss", "head+loss"):
        eager, comp = med[f"{part} eager"], med[f"{part} compiled"]
        print(
            f"  {part:<10} eager {eager:7.1f} ms  compiled {comp:7.1f} ms  compiled / eager {comp / eager:.3f}"
        )


if __name__ == "__main__":
    main()

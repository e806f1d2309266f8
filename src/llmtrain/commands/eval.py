"""``llmtrain eval RUN_DIR|CHECKPOINT --tasks T ... [--limit N] [--num-fewshot K] [--batch-size B] [--max-length L]
[--output FILE]``:
downstream scores of a checkpoint with lm-evaluation-harness, offline.

The checkpoint is loaded by :func:`llmtrain.train.sample.load_for_generation` (a run directory: its newest
checkpoint that verifies, saying which newer ones were skipped; a checkpoint directory: verified, or refused),
scored by :func:`llmtrain.eval.run.evaluate` on shipped task names or task YAML paths (local data only:
:mod:`llmtrain.eval.tasks`), printed as a table, and with ``--output`` written as lm-eval's results JSON
(``{"results": {task: {"acc,none": ...}}, ...}`` plus a top-level ``"llmtrain"`` record of what was scored).
"""

from __future__ import annotations

import argparse
import sys

from llmtrain.commands.flags import int_at_least


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", help="run directory (its newest valid checkpoint), or a checkpoint directory"
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        required=True,
        help="task names (shipped: stdlib_mc, stdlib_ppl) or lm-eval task YAML paths with local data; "
        "space- or comma-separated",
    )
    parser.add_argument("--limit", type=int_at_least(1), default=None, help="items per task (default: all)")
    parser.add_argument("--num-fewshot", type=int_at_least(0), default=None, help="few-shot examples")
    parser.add_argument("--batch-size", type=int_at_least(1), default=8, help="sequences per forward")
    parser.add_argument(
        "--max-length",
        type=int_at_least(2),
        default=None,
        help="context in tokens (default: model.seq_length, the context the run trained on)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model runs")
    parser.add_argument("--output", default=None, help="write lm-eval's results JSON here (atomically)")


def main(args: argparse.Namespace) -> int:
    import torch

    from llmtrain.errors import ConfigError
    from llmtrain.eval.run import check_output, evaluate, format_table, write_results
    from llmtrain.eval.tasks import check_specs
    from llmtrain.train.sample import load_for_generation

    specs = [t for item in args.tasks for t in item.split(",") if t.strip()]
    check_specs(specs, "--tasks")
    if args.output is not None:
        check_output(args.output)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("eval --device cuda: no CUDA device is available here; use --device cpu.")
    model, tok, ckpt = load_for_generation(args.source)
    model.to(args.device)
    print(f"llmtrain eval: {ckpt} on {', '.join(specs)}", file=sys.stderr)
    results = evaluate(
        model, tok, specs, args.limit, args.num_fewshot, args.batch_size, max_length=args.max_length,
        key="--tasks",
    )  # fmt: skip
    print(format_table(results))
    if args.output is not None:
        meta = {
            "checkpoint": str(ckpt),
            "tasks": specs,
            "limit": args.limit,
            "num_fewshot": args.num_fewshot,
            "batch_size": args.batch_size,
            "max_length": args.max_length or model.args.seq_length,
        }
        print(f"results: {write_results(results, args.output, meta)}")
    return 0

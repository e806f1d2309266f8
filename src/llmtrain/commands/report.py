"""``llmtrain report RUN_DIR [--out report.html] [--no-plan]``: one self-contained HTML report of a run.

Calls :func:`llmtrain.report.build_report` (what the page shows: see that package) and prints its path.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory (run.output_dir of a training run)")
    parser.add_argument("--out", help="output HTML file (default: RUN_DIR/report.html)")
    parser.add_argument("--no-plan", action="store_true", help="skip the planner's estimate")


def main(args: argparse.Namespace) -> int:
    from llmtrain.report import build_report

    path = build_report(args.run_dir, args.out, with_plan=not args.no_plan)
    print(f"report: {path}")
    return 0

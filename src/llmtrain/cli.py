"""The one entry point: ``llmtrain <command> ...``.

Each command lives in its own module of :mod:`llmtrain.commands` exposing ``add_arguments(parser)`` and
``main(args) -> int``; this file only wires them up and turns user errors
(:class:`llmtrain.errors.LLMTrainError`) into a one-paragraph message on stderr and the error's exit code
(2 for bad input), without a traceback. Command modules are imported lazily so ``llmtrain --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import threading

from llmtrain.errors import LLMTrainError, user_message

# command -> (module, one-line help). An explicit registry: nothing is imported by a user-supplied name.
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("llmtrain.commands.prepare", "tokenize text into Megatron .bin/.idx token shards"),
    "train": ("llmtrain.commands.train", "train from a YAML config (also under torchrun)"),
    "check": ("llmtrain.commands.check", "validate a config and print it with derived figures"),
    "generate": ("llmtrain.commands.generate", "sample text from a run directory or checkpoint"),
    "demo": ("llmtrain.commands.demo", "prepare the stdlib sources, train the demo model on the CPU, sample"),
    "plan": ("llmtrain.commands.plan", "estimate memory, step time, MFU and cost of a run; search layouts"),
    "merge": ("llmtrain.commands.merge", "join the partitions written by `prepare --partition i/N`"),
    "export": ("llmtrain.commands.export", "export a checkpoint to Hugging Face safetensors"),
    "eval": ("llmtrain.commands.eval", "score a checkpoint on downstream tasks (lm-eval, local data only)"),
    "launch": ("llmtrain.commands.launch", "run `train` under torchrun (multi-process, multi-node, elastic)"),
    "report": (
        "llmtrain.commands.report",
        "write a self-contained HTML report of a run directory (live or finished)",
    ),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmtrain", description="Pretrain LLMs from one YAML file.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        # Only the chosen command's module needs importing to build its flags.
        if name == chosen:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def _thread_error(hook: threading.ExceptHookArgs) -> None:
    """A background thread's OSError (a checkpoint writer on a full disk ...) in one line: the thread that waits
    for it reports the failure as an error of its own; anything else keeps Python's traceback."""
    known = user_message(hook.exc_value) if hook.exc_value is not None else None
    if known is None:
        _default_thread_hook(hook)
    else:
        print(f"llmtrain: {hook.thread.name if hook.thread else 'a thread'}: {known[0]}", file=sys.stderr)


_default_thread_hook = threading.excepthook


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    threading.excepthook = _thread_error
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    # Dotted overrides may also follow the options (`launch CFG --nproc-per-node 2 train.lr=1e-3`).
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
    except (
        LLMTrainError,
        OSError,
    ) as e:  # bad input, or a path the system refused: one paragraph, no traceback
        message, code = user_message(e) or (repr(e), 1)
        sys.stderr.write(f"llmtrain {args.command}: error: {message}\n")  # one write: ranks share a pipe
        sys.stderr.flush()
        return code
    except KeyboardInterrupt:
        print(f"llmtrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""``llmtrain generate RUN_DIR --prompt TEXT``: sample from the newest checkpoint of a run (KV-cached decoding).

RUN_DIR is a run directory (holding config.yaml and checkpoints/) or one checkpoint directory inside it; the
model and tokenizer are loaded by :mod:`llmtrain.train.sample`, the tokens drawn by :mod:`llmtrain.generate`.
Prints the prompt followed by its continuation.
"""

from __future__ import annotations

import argparse

from llmtrain.commands.flags import float_in, int_at_least


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory, or a checkpoint directory inside it")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=64)
    parser.add_argument("--temperature", type=float_in(0.0), default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int_at_least(0), default=50, help="0 = no top-k filter")
    parser.add_argument("--top-p", type=float_in(0.0, 1.0, low_open=True), default=None)
    parser.add_argument(
        "--seed", type=int_at_least(-(2**63), 2**64 - 1), default=0, help="fixes the draws (a 64-bit integer)"
    )


def main(args: argparse.Namespace) -> int:
    from llmtrain.errors import ConfigError
    from llmtrain.train.sample import sample_from_run

    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes that are not UTF-8 arrive as lone surrogates (surrogateescape)
        bad = args.prompt[e.start]
        byte = f"0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise ConfigError(
            f"--prompt is not valid UTF-8 text (byte {byte} at character {e.start}); pass the prompt as UTF-8."
        ) from None
    text = sample_from_run(
        args.run_dir,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        seed=args.seed,
    )
    print(text)
    return 0

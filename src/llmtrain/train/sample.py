"""``llmtrain generate RUN_DIR --prompt TEXT``: sample from the newest checkpoint of a run (KV-cached decoding).

RUN_DIR is a run directory (holding config.yaml and checkpoints/) or one checkpoint directory inside it. The
tokenizer is the copy stored next to the run's first dataset.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from llmtrain.errors import CheckpointError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory, or a checkpoint directory inside it")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)


def load_for_generation(run_dir: str | Path):
    """(model, tokenizer, checkpoint path) for the newest checkpoint of ``run_dir``."""
    from llmtrain.config import derive, load_config
    from llmtrain.data.manifest import read_manifest, tokenizer_path
    from llmtrain.data.tokenizer import load_tokenizer
    from llmtrain.models import build_model
    from llmtrain.train.checkpoint import Checkpointer, is_committed, load_model_weights, run_dir_of

    path = Path(run_dir)
    ckpt = None
    if is_committed(path):  # a checkpoint directory: RUN_DIR/checkpoints/step_N
        ckpt, path = path, run_dir_of(path)
    if not (path / "config.yaml").exists():
        raise CheckpointError(
            f"{run_dir}: no config.yaml here; pass a run directory written by `llmtrain train`."
        )
    cfg, _ = load_config(path / "config.yaml")
    cfg.run.output_dir = str(path)
    cfg.checkpoint.resume = "auto"
    if ckpt is None:
        checkpointer = Checkpointer(cfg.checkpoint, path)
        ckpt = checkpointer.latest()
        if ckpt is None:
            raise CheckpointError(f"{path}: no committed checkpoint under {checkpointer.dir}.")
    prefix = cfg.data.datasets[0].path
    manifest = read_manifest(prefix)
    tok = load_tokenizer(str(tokenizer_path(prefix)))
    args = derive(cfg, world_size=1, vocab_size=manifest["tokenizer"]["vocab_size"]).model_args
    model = build_model(args, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    load_model_weights(ckpt, model)
    model.eval()
    return model, tok, ckpt


def main(args: argparse.Namespace) -> int:
    from llmtrain.generate import generate

    model, tok, ckpt = load_for_generation(args.run_dir)
    gen = torch.Generator().manual_seed(args.seed)
    ids = tok.encode(args.prompt)
    out = generate(
        model,
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=tok.eos_id,
        generator=gen,
    )
    print(args.prompt + tok.decode(out))
    return 0

"""``llmtrain check CONFIG.yaml [section.key=value ...] [--world-size N]``: validate a config, print it resolved.

The command runs exactly what ``train`` runs before touching a device (``load_config`` -> ``validate`` ->
``derive``), except that datasets missing on this machine are warnings (seed configs name cluster paths). It
prints three blocks on stdout:

1. the resolved config as native YAML (what ``train`` would use and save into its run directory);
2. derived figures: parameters, world size and data-parallel size, the batch identity
   (global batch = micro batch x data-parallel size x gradient accumulation), tokens per step, FLOPs per token,
   total tokens;
3. notes from the MindSpore/MindFormers adapter (keys renamed, reinterpreted or ignored) and warnings.

The world size is ``--world-size``, else the ``WORLD_SIZE`` environment variable (set by torchrun), else the
product of the configured degrees (tp x pp x cp x max(dp, 1)). Errors raise ConfigError/DataError; the CLI
prints them as one paragraph and exits with code 2. Layout refusals come from ``llmtrain.feasibility`` through
``validate``, so their verdict and message are the ones ``train`` gives for the same config and world size
(MoE with TP / PP, CPU offload without data parallel and the expert-parallel limits included, which
``train`` used to refuse only after its process groups were up).

This module is the check itself (:func:`print_check`); the command's flags are in
:mod:`llmtrain.commands.check`.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import yaml

from llmtrain.config import config_to_dict, load_config
from llmtrain.config.schema import Config
from llmtrain.distributed.parallel_dims import default_world_size
from llmtrain.errors import ConfigError
from llmtrain.resolve.derived import Derived
from llmtrain.resolve.stages import resolve_stages, stage_table
from llmtrain.resolve.validate import check_config


def print_check(config: str, overrides: list[str], world_size: int | None = None) -> None:
    """Load, validate and derive ``config`` (with ``overrides``) for ``world_size`` (None: see the module
    docstring), then print the three blocks on stdout; ConfigError/DataError if the config is refused."""
    cfg, notes = load_config(config, overrides)
    size, origin = resolve_world_size(cfg, world_size)
    stages = resolve_stages(cfg) if cfg.stages else None  # from the config as written, as in train
    if stages is not None:  # the stage plan fixes the run's length (a copy: the config as written is kept)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=stages[1][-1].end_step))
    replica_lines: list[tuple[str, str]] = []
    if cfg.fault_tolerance.enabled:  # the world size is the job's; the layout is checked for one group
        from llmtrain.ft.layout import group_world, layout_lines

        total = size if origin == "--world-size" else size * cfg.fault_tolerance.replicas
        replica_lines, size = layout_lines(cfg, total), group_world(cfg, total)
        origin = (
            f"one of {cfg.fault_tolerance.replicas} replica groups; the job's {total} ranks from {origin}"
        )
    derived, warnings = check_config(cfg, size, require_data=False)
    print(f"# llmtrain check {config}: OK\n# resolved config")
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True), end="")
    print("\n# derived")
    for label, value in derived_lines(cfg, derived, origin):
        print(f"{label + ':':<18} {value}")
    if replica_lines:
        print("\n# replica groups (fault_tolerance)")
        for label, value in replica_lines:
            print(f"{label + ':':<18} {value}")
    if stages is not None:
        print("\n# stages")
        head = ["stage", "steps", "tokens", "LR (start -> end, shape)", "mixture"]
        rows = [head, *stage_table(*stages)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    for title, lines in (("notes", notes), ("warnings", warnings)):
        if lines:
            print(f"\n# {title}")
            for line in lines:
                print(f"- {line}")


def resolve_world_size(cfg: Config, explicit: int | None) -> tuple[int, str]:
    """(world size, where it came from): --world-size, else $WORLD_SIZE, else the product of the degrees."""
    if explicit is not None:  # < 1: refused by the feasibility rule world_size, with train's message
        return explicit, "--world-size"
    env = os.environ.get("WORLD_SIZE")
    if env:
        try:
            return int(env), "$WORLD_SIZE"  # read as `train` reads it (< 1: the same refusal)
        except ValueError:
            raise ConfigError(
                f"the WORLD_SIZE environment variable is {env!r}; expected an integer >= 1."
            ) from None
    p = cfg.parallel
    return default_world_size(p), (
        f"the degrees: tp {p.tensor_parallel} x pp {p.pipeline_parallel} x cp {p.context_parallel} x "
        f"dp {max(p.data_parallel, 1)}{' (dp -1 counts as 1)' if p.data_parallel == -1 else ''}"
    )


def derived_lines(cfg: Config, d: Derived, origin: str) -> list[tuple[str, str]]:
    """(label, value) rows of the derived block."""
    a, dims = d.model_args, d.dims
    assert dims is not None
    name = f"{a.family} {a.flavor}" if a.flavor else a.family
    steps = cfg.train.max_steps
    return [
        (
            "parameters",
            f"{human(d.num_params)} ({d.num_params:,})"
            + (f"; active per token {human(d.active_params)} ({d.active_params:,})" if a.num_experts else ""),
        ),
        (
            "model",
            f"{name}: hidden {a.hidden_size}, {a.num_layers} layers, {a.num_heads} heads ({a.num_kv_heads} KV), "
            f"ffn {a.intermediate_size}, vocab {a.vocab_size}, seq {cfg.model.seq_length}",
        ),
        ("world size", f"{d.world_size} (from {origin})"),
        (
            "parallel",
            f"pp {dims.pp} x dp {dims.dp} (replicate {dims.dp_replicate} x shard {dims.dp_shard}) x cp {dims.cp}"
            f" x tp {dims.tp}; ZeRO stage {cfg.parallel.effective_zero_stage()}",
        ),
        ("data parallel", str(d.data_parallel)),
        ("micro batch", f"{d.micro_batch_size} sequence{'s' if d.micro_batch_size != 1 else ''}"),
        ("grad accumulation", str(d.grad_accum)),
        (
            "global batch",
            f"{d.global_batch} sequences (= micro {d.micro_batch_size} x DP {d.data_parallel} x "
            f"accumulation {d.grad_accum})",
        ),
        ("tokens per step", f"{d.tokens_per_step:,}"),
        ("FLOPs per token", f"{d.flops_per_token:.4g} (training: forward + backward)"),
        ("FLOPs per step", f"{d.flops_per_token * d.tokens_per_step:.4g}"),
        ("total tokens", f"{human(d.total_tokens)} ({steps:,} steps x {d.tokens_per_step:,})"),
        *long_context_lines(cfg, d),
    ]


def long_context_lines(cfg: Config, d: Derived) -> list[tuple[str, str]]:
    """Rows for what long sequences cost in memory, from the planner's model (plan/long_context.py, the same
    functions ``llmtrain plan`` uses): the loss's logits (plain vs chunked, train/loss.py), context parallel's
    gathered K/V, masks and communication, activation offload."""
    from llmtrain.plan.layout import Layout
    from llmtrain.plan.long_context import (
        cp_additive_mask_bytes,
        cp_bool_mask_bytes,
        cp_comm_bytes,
        cp_layer_bytes,
        logits_bytes,
        loss_chunk,
    )
    from llmtrain.plan.memory import layer_bytes

    assert d.dims is not None
    a, dims = d.model_args, d.dims
    lay = Layout(tp=dims.tp, pp=dims.pp, cp=dims.cp, micro_batch_size=d.micro_batch_size,
                 seq_length=cfg.model.seq_length, recompute=cfg.recompute.mode, precision=cfg.train.precision,
                 loss_chunk_tokens=cfg.train.loss_chunk_tokens, document_mask=cfg.model.document_mask)  # fmt: skip
    vocab, tokens = a.vocab_size, d.micro_batch_size * cfg.model.seq_length // dims.cp
    chunk = loss_chunk(a, lay)
    live = min(chunk, tokens) if chunk else tokens
    how = f"chunked, {chunk} tokens per chunk" if chunk else "plain (whole logits)"
    rows = [
        (
            "loss logits",
            f"{how}: {live * vocab * 4 / GIB:.3g} GiB fp32 live per micro-batch (x2 in backward); planned "
            f"logits and loss {logits_bytes(a, lay, tokens) / GIB:.3g} GiB (the loss's peak: logits, fp32 "
            "log-softmax and its gradient)",
        )
    ]
    if dims.cp > 1:
        kv, fwd = cp_layer_bytes(a, lay), cp_comm_bytes(a, lay)[0]
        rows.append((
            "context parallel",
            f"cp {dims.cp}, K/V all-gathered: per layer {fwd / 2**20:.4g} MiB received forward (all-gather) and "
            f"as much backward (reduce-scatter), exposed; saved per layer: gathered K/V "
            f"{kv['gathered_kv'] / GIB:.3g} GiB"
            + (f" + ALiBi bias {kv['mask'] / GIB:.3g} GiB" if kv["mask"] else "")
            + f"; per micro-batch: additive mask {cp_additive_mask_bytes(a, lay) / GIB:.3g} GiB (one tensor "
            f"shared by all layers) + boolean mask {cp_bool_mask_bytes(a, lay) / GIB:.3g} GiB",
        ))  # fmt: skip
    if cfg.recompute.mode == "offload":
        block = layer_bytes(a, lay, moe=bool(a.num_experts))
        per_stage = -(-a.num_layers // dims.pp)
        rows.append((
            "recompute",
            f"offload: every block's saved activations go to host memory (pinned on CUDA): "
            f"~{per_stage * block / GIB:.3g} GiB per micro-batch to host, one block's {block / GIB:.3g} GiB stays "
            "on the device",
        ))  # fmt: skip
    return rows


GIB = 2**30


def human(n: float) -> str:
    """3 significant digits with a K/M/B/T suffix: 70553706496 -> '70.6B'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


if __name__ == "__main__":  # python -m llmtrain.check CONFIG ... (same as `llmtrain check`)
    from llmtrain.cli import main as cli_main

    sys.exit(cli_main(["check", *sys.argv[1:]]))

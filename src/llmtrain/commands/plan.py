"""``llmtrain plan CONFIG [overrides] [--cluster NxDEVICE[@NODES]] [--search] [--json]``.

Estimates memory per device, step time, tokens/s, MFU and the days the configured tokens take, for the layout
the config describes on the cluster; ``--search`` ranks the alternatives, ``--claim`` checks stated figures.
:func:`llmtrain.plan.cli.print_plan` plans and prints (see that module and :mod:`llmtrain.plan`).
"""

from __future__ import annotations

import argparse
from typing import Any

from llmtrain.commands.flags import float_in, int_at_least
from llmtrain.plan.cli import CLAIM_KEYS
from llmtrain.plan.layout import ATTENTION_KERNELS, ENGINES, GRAD_DTYPES, RECOMPUTE_MODES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (native or MindFormers layout)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_parallel=4")
    parser.add_argument(
        "--cluster", help="NxDEVICE[@NODES], e.g. 32x910b@4 or 8xh100 (default: from the config)"
    )
    parser.add_argument(
        "--catalog", help="extra device catalog YAML (same layout as llmtrain/plan/devices.yaml)"
    )
    parser.add_argument("--recompute", default=None, choices=RECOMPUTE_MODES,
                        help="activation recompute (default: the config's recompute.mode)")  # fmt: skip
    parser.add_argument("--offload", action="store_true", help="FSDP2 CPU offload of params, grads, states")
    parser.add_argument("--search", action="store_true", help="rank the valid layouts of the cluster")
    parser.add_argument("--top", type=int_at_least(1), default=5, help="layouts shown by --search")
    parser.add_argument("--claim", action="append", default=[], metavar="KEY=VALUE",
                        help=f"check a stated figure; KEY one of {', '.join(CLAIM_KEYS)}")  # fmt: skip
    parser.add_argument("--engine", default="llmtrain", choices=ENGINES,
                        help="how the layout is executed: llmtrain (this trainer, default), megatron "
                        "(bf16 weights, SP inputs saved sharded, fused kernels), nemo (megatron with NeMo's "
                        "distributed Adam) or torchtitan (FSDP2 with a bf16 policy, loss parallel, per-op "
                        "selective recompute); see docs/planner.md")  # fmt: skip
    parser.add_argument("--tp-overlap", action="store_true",
                        help="TP collectives overlap with the GEMMs (Megatron --tp-comm-overlap; torch async TP: "
                        "the forward's only)")  # fmt: skip
    parser.add_argument("--ep-overlap", action="store_true",
                        help="engines megatron / nemo: each micro-batch's expert all-to-all overlaps another "
                        "micro-batch's compute (DeepSeek's DualPipe; Megatron-LM --overlap-moe-expert-parallel-comm)")  # fmt: skip
    parser.add_argument("--act-fp8-input-store", action="store_true",
                        help="engines megatron / nemo with train.fp8: the MLP activation's input kept in FP8 "
                        "(Megatron --activation-func-fp8-input-store; DeepSeek-V3's SwiGLU inputs); memory only")  # fmt: skip
    parser.add_argument("--compiled-loss", action="store_true",
                        help="engine torchtitan: its cross-entropy compiled (torchtitan from 2025 under "
                        "training.compile; its December 2024 benchmarks ran it eager)")  # fmt: skip
    parser.add_argument("--recompute-modules", default="", metavar="MODULE[,MODULE]",
                        help="Megatron-style module recompute (recompute_modules under selective granularity): "
                        "core_attn, mla_up_proj, mlp, moe, moe_act, layernorm (docs/planner.md)")  # fmt: skip
    parser.add_argument("--mtp-layers", type=int_at_least(0), default=0,
                        help="multi-token-prediction layers the publishing engine trains on the last stage "
                        "(Megatron mtp_num_layers)")  # fmt: skip
    parser.add_argument("--grad-dtype", default="auto", choices=GRAD_DTYPES,
                        help="gradient buffer of the megatron / nemo engines (memory, and the bytes the data-parallel "
                        "reduction moves): auto (Megatron-Core / NeMo / Megatron-Bridge: 16-bit with the distributed "
                        "optimizer, fp32 under ZeRO-0), fp32 (Megatron-LM --bf16, DeepSpeed's bf16 optimizer) or "
                        "bf16; the llmtrain and torchtitan engines keep fp32 gradients whatever it says")  # fmt: skip
    parser.add_argument("--attention", default="flash", choices=ATTENTION_KERNELS,
                        help="attention kernel, every engine (time only): flash (a fused flash-attention kernel, "
                        "default) or unfused (Megatron before flash attention, Narayanan et al. 2021 / BLOOM: "
                        "the s x s scores as batched GEMMs and a fused softmax)")  # fmt: skip
    parser.add_argument("--failures", type=float_in(0, low_open=True), default=None, metavar="MTBF_HOURS_PER_DEVICE",
                        help="goodput under failures: restart-from-checkpoint vs replica groups, for devices that "
                        "each fail every MTBF hours (plan/goodput.py)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def layout_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that say how the layout is executed, as keyword arguments of
    :func:`llmtrain.plan.search.layout_from_config` (and :func:`llmtrain.plan.cli.print_plan`)."""
    return {
        "engine": args.engine,
        "tp_overlap": args.tp_overlap,
        "ep_overlap": args.ep_overlap,
        "act_fp8_input_store": args.act_fp8_input_store,
        "recompute_modules": tuple(m for m in args.recompute_modules.split(",") if m),
        "mtp_layers": args.mtp_layers,
        "grad_dtype": args.grad_dtype,
        "attention": args.attention,
        "loss_compiled": args.compiled_loss,
    }


def main(args: argparse.Namespace) -> int:
    from llmtrain.plan.cli import print_plan

    print_plan(
        args.config,
        args.overrides,
        cluster_spec=args.cluster,
        catalog=args.catalog,
        recompute=args.recompute,
        offload=args.offload,
        search_layouts=args.search,
        top=args.top,
        claims=args.claim,
        as_json=args.json,
        failures=args.failures,
        **layout_options(args),
    )
    return 0

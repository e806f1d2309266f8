"""``llmtrain plan CONFIG [overrides] [--cluster NxDEVICE[@NODES]] [--search] [--json]``.

Reads the run config (``load_config`` + ``derive``), builds the layout it describes on the cluster, and prints
memory per device (itemised), step time, tokens/s per device, MFU and the days the configured tokens take;
``--search`` ranks the alternatives; ``--claim KEY=VALUE`` checks a stated figure against the estimate and the
physical bound (100% of peak FLOP/s; 16 bytes of training state per parameter spread over every device).
Without ``--cluster`` the device comes from ``run.device_target`` (npu -> ascend-910b, cuda -> h100,
cpu -> cpu) and the count from the parallel degrees.

This module is the plan of one run and its printing (:func:`print_plan`, the table, ``--json``, ``--claim``);
the command's flags are in :mod:`llmtrain.commands.plan`.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

from llmtrain.config.loader import load_config
from llmtrain.config.schema import Config
from llmtrain.distributed.parallel_dims import default_world_size
from llmtrain.errors import ConfigError
from llmtrain.models import TransformerArgs
from llmtrain.plan.catalog import Cluster, load_catalog, parse_cluster
from llmtrain.plan.long_context import loss_chunk
from llmtrain.plan.memory import min_state_bytes_per_device
from llmtrain.plan.recipes import ENGINE_SUMMARY, engine_hint
from llmtrain.plan.search import PlanResult, evaluate, layout_from_config, layout_overrides, search

GIB = 2**30
CLAIM_KEYS = ("tokens_per_s_per_device", "memory_per_device_gb", "steps_per_s", "days")
_DEFAULT_DEVICE = {"npu": "ascend-910b", "cuda": "h100", "cpu": "cpu", "auto": "h100"}


def resolve_cluster(cfg: Config, spec: str | None, catalog_path: str | None) -> Cluster:
    catalog = load_catalog(catalog_path)
    if spec:
        return parse_cluster(spec, catalog)
    n = default_world_size(cfg.parallel)
    device = _DEFAULT_DEVICE.get(cfg.run.device_target, "h100")
    return parse_cluster(f"{n}x{device}", catalog)


def check_claims(claims: list[str], result: PlanResult, cluster: Cluster, total_tokens: int) -> list[dict]:
    """One verdict per claim: impossible (beyond physics), implausible (beyond the estimate by > 20%), or ok."""
    args_flops = result.time.model_flops / (result.tokens_per_step / result.layout.world_size)
    bound_tps = cluster.device.peak_flops / args_flops  # tokens/s per device at 100% MFU
    out = []
    for item in claims:
        key, sep, text = item.partition("=")
        key = key.strip()
        try:
            value = float(text.replace(",", "").replace("_", ""))
        except ValueError:
            value = math.nan
        if not sep or key not in CLAIM_KEYS or not 0 < value < math.inf:
            raise ConfigError(
                f"--claim {item!r}: expected KEY=NUMBER (a finite number > 0) with KEY one of "
                f"{', '.join(CLAIM_KEYS)}."
            )
        steps_per_s_bound = bound_tps * result.layout.world_size / result.tokens_per_step
        if key in ("tokens_per_s_per_device", "steps_per_s"):
            tps = (
                value
                if key == "tokens_per_s_per_device"
                else value * result.tokens_per_step / cluster.num_devices
            )
            needed_mfu = tps * args_flops / cluster.device.peak_flops
            est = (
                result.tokens_per_s_per_device if key == "tokens_per_s_per_device" else 1 / result.step_time_s
            )
            bound = bound_tps if key == "tokens_per_s_per_device" else steps_per_s_bound
            verdict = "impossible" if needed_mfu > 1 else "implausible" if value > 1.2 * est else "plausible"
            text = (f"needs {needed_mfu:.0%} of the device's peak FLOP/s (MFU); the physical bound is "
                    f"{bound:,.4g}, the estimate {est:,.4g}")  # fmt: skip
        elif key == "memory_per_device_gb":
            floor = min_state_bytes_per_device(result.memory_args, cluster.num_devices)  # type: ignore[attr-defined]
            est = result.memory.total
            verdict = (
                "impossible"
                if value * 1e9 < floor
                else "implausible"
                if value * 1e9 < 0.8 * est
                else "plausible"
            )
            text = (f"the training state alone (16 B/parameter over all {cluster.num_devices} devices, ZeRO-3) is "
                    f"{floor / 1e9:.1f} GB per device, {floor / (value * 1e9):.1f}x the claim; this layout needs "
                    f"{est / 1e9:.1f} GB")  # fmt: skip
        else:  # days for the configured tokens
            best_days = total_tokens / (bound_tps * cluster.num_devices) / 86400
            est = total_tokens / (result.tokens_per_s_per_device * cluster.num_devices) / 86400
            verdict = (
                "impossible" if value < best_days else "implausible" if value < 0.8 * est else "plausible"
            )
            text = f"at 100% MFU the configured tokens take {best_days:,.1f} days; the estimate is {est:,.1f} days"
        ratio = value / est if est else math.inf
        out.append({"claim": item, "verdict": verdict, "claimed": value, "estimate": est,
                    "claimed_over_estimate": ratio, "explanation": text})  # fmt: skip
    return out


def _replica_groups(result: PlanResult) -> dict | None:
    """The replica groups of the layout (``fault_tolerance.replicas``) and their cross-group all-reduce, or
    None without them."""
    lay = result.layout
    if lay.replicas <= 1:
        return None
    from llmtrain.plan.layout import rank_params, rank_shapes
    from llmtrain.plan.replicas import replica_all_reduce_bytes

    args = getattr(result, "memory_args", None)
    hooked = explicit = 0.0
    if args is not None:
        for shape in rank_shapes(args, lay):
            h, e = replica_all_reduce_bytes(lay, *rank_params(args, lay, shape))
            hooked, explicit = max(hooked, h), max(explicit, e)
    return {"groups": lay.replicas, "ranks_per_group": lay.group_world, "hooked_bytes": hooked,
            "explicit_bytes": explicit, "all_reduce_s": result.time.parts.get("replica_all_reduce", 0.0)}  # fmt: skip


def plan_dict(result: PlanResult, cluster: Cluster, total_tokens: int, warnings: list[str]) -> dict:
    """The --json contract."""
    tps = result.tokens_per_s_per_device
    days = total_tokens / (tps * cluster.num_devices) / 86400 if total_tokens else 0.0
    t = result.time
    return {
        "cluster": cluster.describe(),
        "device": cluster.device.name,
        "layout": result.layout.describe(),
        "engine": result.layout.engine,
        "fits": result.memory.fits,
        "memory_per_device_bytes": result.memory.as_dict(),
        "memory_capacity_bytes": result.memory.capacity,
        "memory_reserved_bytes": result.memory.reserved,
        "memory_detail_bytes": {**result.memory.details, "host_offload": result.memory.host_bytes},
        "memory_worst_stage": result.memory.stage,
        "replica_groups": _replica_groups(result),
        "step_time_s": t.total,
        "step_time_parts_s": {
            "compute": t.compute,
            "tp_comm": t.tp_comm,
            "pp_bubble": t.pp_bubble,
            "pp_p2p": t.pp_p2p,
            "ep_comm": t.ep_comm,
            "dp_exposed": t.dp_exposed,
            "dp_total": t.dp_total,
            "cp_exposed": t.cp_exposed,
            "optimizer": t.optimizer,
            "offload": t.offload,
        },  # fmt: skip
        "stage_microbatch_s": t.stage_microbatch_s,
        "tokens_per_step": result.tokens_per_step,
        "tokens_per_s_per_device": tps,
        "mfu": result.mfu,
        "configured_tokens": total_tokens,
        "days_for_configured_tokens": days,
        "warnings": warnings,
    }


def print_plan(
    config: str,
    overrides: list[str],
    cluster_spec: str | None = None,
    catalog: str | None = None,
    recompute: str | None = None,
    offload: bool = False,
    search_layouts: bool = False,
    top: int = 5,
    claims: list[str] | None = None,
    as_json: bool = False,
    failures: float | None = None,
    **layout_options: Any,
) -> None:
    """Plan ``config`` (with ``overrides``) on ``cluster_spec`` (None: from the config) and print the table, or
    one JSON object with ``as_json``; ``search_layouts`` adds the ``top`` ranked layouts, ``claims`` the verdicts
    on stated figures (``KEY=VALUE``, KEY one of CLAIM_KEYS). ``layout_options`` say how the layout is executed
    (``engine``, ``tp_overlap``, ``ep_overlap``, ...: the keyword arguments of
    :func:`~llmtrain.plan.search.layout_from_config`, as ``commands.plan.layout_options`` reads them)."""
    cfg, _notes = load_config(config, overrides)
    cluster = resolve_cluster(cfg, cluster_spec, catalog)
    layout, margs, tokens_per_step = layout_from_config(
        cfg, cluster.num_devices, recompute or cfg.recompute.mode, offload, **layout_options
    )
    fused = bool(cfg.train.compile)
    result = evaluate(margs, layout, cluster, tokens_per_step, fused)
    result.memory_args = margs  # type: ignore[attr-defined]
    total_tokens = cfg.train.max_steps * tokens_per_step
    if cfg.stages:  # a multi-stage run: its stages' tokens (lengths and batch shapes may differ per stage)
        from llmtrain.resolve.stages import resolve_stages

        total_tokens = sum(p.steps * p.tokens_per_step for p in resolve_stages(cfg)[1])
    warnings = collect_warnings(cfg, result, cluster, margs)
    verdicts = check_claims(claims or [], result, cluster, total_tokens)
    out = plan_dict(result, cluster, total_tokens, warnings)
    out["model"] = {"family": margs.family, "parameters": margs.num_params(), "seq_length": layout.seq_length,
                    "flops_per_token": margs.flops_per_token(layout.seq_length)}  # fmt: skip
    out["claims"] = verdicts
    out["hints"] = []
    if hint := engine_hint(margs, layout, _is_run_file(config)):  # what the publishing engine plans
        alt = evaluate(margs, replace(layout, engine=hint[0]), cluster, tokens_per_step, fused)
        out["hints"].append(f"{hint[1]} (engine {hint[0]}: {alt.memory.total / GIB:.1f} GiB per device, "
                            f"{'fits' if alt.memory.fits else 'does not fit'}, "
                            f"{alt.tokens_per_s_per_device:,.0f} tokens/s per device).")  # fmt: skip
    out["loss_chunk_tokens"] = loss_chunk(margs, layout)
    if failures is not None:  # --failures MTBF_HOURS_PER_DEVICE (plan/goodput.py)
        from llmtrain.plan.goodput import for_plan

        out["goodput"] = for_plan(cfg, result, cluster, failures).as_dict()
    ranked: list[PlanResult] = []
    if search_layouts:
        ranked, tried, fitting = search(margs, layout, cluster, tokens_per_step, fused, top=top)
        out["search"] = {"tried": tried, "fit": fitting,
                         "top": [{**plan_dict(r, cluster, total_tokens, []), "why": r.why(),
                                  "overrides": layout_overrides(r.layout)} for r in ranked]}  # fmt: skip
    if as_json:
        print(json.dumps(out, indent=2))
    else:
        print(render(out, result, ranked))


def _is_run_file(config: str) -> bool:
    """True when ``config`` is a MindFormers run file (another framework's layout: recipes.engine_hint)."""
    from pathlib import Path

    from llmtrain.config.loader import read_yaml
    from llmtrain.config.mindformers import is_structured_layout

    return is_structured_layout(read_yaml(Path(config)))


def collect_warnings(cfg: Config, result: PlanResult, cluster: Cluster, margs: TransformerArgs) -> list[str]:
    w: list[str] = []
    mem, lay = result.memory, result.layout
    if not mem.fits:
        w.append(
            f"does not fit: {mem.total / GIB:.1f} GiB needed per device (stage {mem.stage}) but a "
            f"{cluster.device.name} leaves {mem.capacity / GIB:.1f} GiB; try --recompute full, a higher ZeRO stage, "
            f"more pipeline/tensor parallel, --offload, or --search."
        )
    elif mem.total > 0.9 * mem.capacity:
        w.append(f"tight: {mem.total / mem.capacity:.0%} of the usable device memory; fragmentation may OOM.")
    if lay.zero_stage == 1 and not lay.bf16_weights:
        w.append(
            "ZeRO-1 is run as ZeRO-2 by FSDP2 (same communication, gradients sharded too); planned as such."
        )
    if lay.ep > 1 and not margs.num_moe_layers:
        w.append(
            f"expert_parallel {lay.ep} has no effect: the {cfg.model.model_type} model is dense (no MoE)."
        )
    if margs.num_moe_layers and lay.ep == 1 and lay.dp > 1:
        w.append(
            f"an MoE model with expert_parallel 1: every rank holds all {margs.num_experts} experts (sharded by "
            f"ZeRO only) and runs them on its own tokens; expert_parallel {lay.dp} spreads them over the "
            "data-parallel ranks."
        )
    if lay.pp > 1 and cfg.parallel.micro_batch_num not in (1, lay.grad_accum):
        w.append(
            f"parallel.micro_batch_num {cfg.parallel.micro_batch_num} differs from the {lay.grad_accum} "
            f"micro-batches per step that train.batch_size implies; the planner uses {lay.grad_accum}."
        )
    if cfg.train.precision == "fp32":
        w.append("train.precision fp32: the estimate uses fp32 activations and fp32 FLOP/s are far below the "
                 "bf16 peak on tensor-core devices; planned at the bf16/fp16 peak (optimistic).")  # fmt: skip
    if cfg.train.max_steps * result.tokens_per_step == 0:
        w.append("train.max_steps is 0: no configured tokens.")
    return w


def render(out: dict, result: PlanResult, ranked: list[PlanResult]) -> str:
    m = out["memory_per_device_bytes"]
    det = out["memory_detail_bytes"]
    lines = [
        f"plan: {out['model']['family']} {out['model']['parameters'] / 1e9:.2f}B parameters, seq "
        f"{out['model']['seq_length']}, on {out['cluster']}",
        f"layout: {out['layout']}  ({out['tokens_per_step']:,} tokens per step)",
        f"engine: {out['engine']} ({ENGINE_SUMMARY[out['engine']]}; --engine to change)",
    ]
    if rg := out.get("replica_groups"):
        g = rg["ranks_per_group"]
        lines.append(
            f"replica groups: {rg['groups']} x {g} ranks (ranks {g} x r .. {g} x r + {g - 1} form group r; the "
            f"layout is one group's); cross-group all-reduce per rank per step: "
            f"{rg['hooked_bytes'] / GIB:.2f} GiB in FSDP's reduce path (overlapped like the reduce-scatter), "
            f"{rg['explicit_bytes'] / GIB:.2f} GiB after the backward (exposed): {rg['all_reduce_s']:.3f} s"
        )
    lines += [
        "",
        f"memory per device (worst pipeline stage {out['memory_worst_stage']}):",
    ]
    rows = [("parameters (weights + fp32 master)", m["parameters"]), ("gradients", m["gradients"]),
            ("optimizer states (AdamW m, v)", m["optimizer_states"]), ("activations", m["activations"]),
            ("  gathered weights (FSDP, fp32)", det["gathered_parameters"]),
            ("  autocast weight copies (bf16)", det["autocast_weight_copies"]),
            ("  unsharded gradients (one block)", det["unsharded_gradients"]),
            ("  backward temporaries (one block)", det.get("backward_temporaries", 0.0)),
            ("  replica all-reduce buffer (fp32)", det.get("replica_all_reduce_buffer", 0.0)),
            ("  MoE dispatch buffers", det["moe_dispatch_buffers"]),
            ("  logits and loss" + (f" (chunked, {chunk} tokens)" if (chunk := out.get("loss_chunk_tokens"))
                                    else ""), det["logits_and_loss"]),
            ("  CP boolean mask (per micro-batch)", det.get("cp_mask", 0.0)),
            ("  CP additive mask (one for all layers)", det.get("cp_additive_mask", 0.0)),
            ("other (sum of the nine above)", m["other"]),
            ("not live at once (logits / recompute / grads)", -m["not_concurrent"]),
            ("total (the step's peak)", m["total"]),
            ("reserved by the caching allocator (est.)", out["memory_reserved_bytes"]),
            ("usable on the device", out["memory_capacity_bytes"])]  # fmt: skip
    for name, key in (("      of which CP ALiBi bias, per layer", "cp_alibi_bias_per_layer"),
                      ("      of which CP gathered K/V, per layer", "cp_gathered_kv_per_layer")):  # fmt: skip
        if det.get(key):
            rows.insert(4, (name, det[key]))
    if det.get("activations_offloaded"):
        rows.append(("activations offloaded to host", det["activations_offloaded"]))
    if det["host_offload"]:
        rows.append(("host memory (offloaded, all)", det["host_offload"]))
    lines += [f"  {name:<40} {value / GIB:10.2f} GiB" for name, value in rows]
    lines.append(f"  {'fits':<40} {'yes' if out['fits'] else 'NO'}")
    p = out["step_time_parts_s"]
    lines += [
        "",
        f"time per step: {out['step_time_s']:.3f} s  ("
        + ", ".join(f"{k} {v:.3f}" for k, v in p.items() if v > 0)
        + ")",
        f"where the time goes: {result.why()}",
    ]
    lines += [
        f"tokens/s per device: {out['tokens_per_s_per_device']:,.0f}   MFU: {out['mfu']:.1%}",
        f"configured tokens: {out['configured_tokens']:,} -> {out['days_for_configured_tokens']:,.2f} days",
    ]
    if "goodput" in out:
        from llmtrain.plan.goodput import Goodput
        from llmtrain.plan.goodput import lines as goodput_lines

        lines += ["", *goodput_lines(Goodput(**out["goodput"]))]
    for c in out["claims"]:
        lines.append(f"claim {c['claim']}: {c['verdict'].upper()} - {c['explanation']}")
    for h in out.get("hints", []):
        lines.append(f"hint: {h}")
    for w in out["warnings"]:
        lines.append(f"warning: {w}")
    if "search" in out:
        s = out["search"]
        lines += ["", f"search: {s['tried']} layouts tried, {s['fit']} fit; best by tokens/s per device:"]
        for i, r in enumerate(ranked, 1):
            lines.append(f"  {i}. {r.layout.describe():<48} {r.tokens_per_s_per_device:>9,.0f} tok/s/dev  "
                         f"MFU {r.mfu:5.1%}  step {r.step_time_s:.2f} s")  # fmt: skip
            lines.append(f"     why: {r.why()}")
        if not ranked:
            lines.append("  none fits: more devices, --offload, or a smaller model/sequence are needed.")
    return "\n".join(lines)

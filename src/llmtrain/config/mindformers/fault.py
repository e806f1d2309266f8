"""MindFormers' fault tolerance (MindIO TFT) -> replica groups (``fault_tolerance:``) where it has a counterpart.

MindFormers switches its high-availability features with an **environment variable**, not with a YAML key
(MindFormers r1.7.0 ``mindformers/version_control.py`` ``check_tft_valid`` / ``check_tre_valid`` /
``check_tsp_valid``; its docs ``feature/high_availability.md``: "高可用特性开关由环境变量使能，YAML 配置文件中不单独设置
开关")::

    export MS_ENABLE_TFT="{TTP:1,UCE:1,ARF:1,TRE:1,TSP:1}"   # MindIO TFT's features, each 0 or 1
    export MS_TFT_IP=... MS_TFT_PORT=...                      # MindIO's controller
    export MINDIO_FOR_MINDSPORE=1

so a MindFormers file is read here together with the environment it would run in. What the YAML carries is the
*replica relation* MindIO needs (at least two copies of the weights and the optimizer state: data parallel, and
with the optimizer sharded ``data_parallel / optimizer_weight_shard_size`` copies) and, in some files, a
``callbacks: [{type: TrainFaultTolerance}]`` entry, which MindFormers' trainer skips (``trainer/base_trainer.py``
adds MindSpore's ``TrainFaultTolerance`` callback itself when ``MS_ENABLE_TFT`` is set).

The flags, one by one:

* ``ARF`` (Air Refuelling: the failed node's processes restart and are repaired from a replica, the others
  wait) -> replica groups: ``fault_tolerance.enabled``, ``replicas`` = MindIO's copies of the state, each group
  the layout of one copy (``parallel.data_parallel`` = data parallel / copies: FSDP over the optimizer shard
  size, in place of HSDP's replicate dimension). The survivors keep stepping instead of waiting, and the
  restarted group heals live from a peer (docs/reliability.md "Replica groups").
* ``TRE`` (Training Result Error: a loss / global-norm anomaly recomputes the step) -> the stability guard
  (``stability.enabled``: a spike or a non-finite step is skipped or rolled back to the newest good state).
* ``TTP`` (Try To Persist: a checkpoint written by the survivors at the failure), ``UCE`` (an uncorrectable
  on-chip memory error repaired in place), ``TSP`` (pausing between steps for the operator), ``HCCE`` (HCCL
  error recovery) and any other flag: no counterpart; listed in the notes. With replica groups no committed step
  is lost, so no dying checkpoint is needed; without them torchrun restarts from the newest checkpoint.
* MindIO's in-memory redundant optimizer copies (ZeRO-1 re-sharded over data parallel so that each shard exists
  twice): no counterpart as such; a replica group *is* a full copy (its own weights and optimizer state).
* ``MS_TFT_IP`` / ``MS_TFT_PORT``: MindIO's controller; llmtrain's coordinator is torchft's lighthouse
  (``llmtrain launch`` starts one; ``--lighthouse HOST:PORT`` names one running elsewhere), a different service.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from llmtrain.config.mindformers.common import Ctx

ENV = "MS_ENABLE_TFT"
ENV_CONTROLLER = ("MS_TFT_IP", "MS_TFT_PORT")
SOURCE = "MindFormers r1.7.0 mindformers/version_control.py, trainer/base_trainer.py"
NO_COUNTERPART = {
    "TTP": "Try To Persist, MindIO's checkpoint written at the failure: llmtrain commits whole checkpoints on "
    "schedule; with replica groups no committed step is lost",
    "UCE": "an uncorrectable on-chip memory error repaired in place (Ascend): a device error ends its replica "
    "group, which restarts and heals from a peer",
    "TSP": "pausing between steps for the operator (a network switch-over)",
    "HCCE": "HCCL communication-error recovery (Ascend)",
}
CALLBACK_NOTE = (
    "ignored, as MindFormers' trainer skips this entry: it adds MindSpore's TrainFaultTolerance itself when "
    f"${ENV} is set (r1.7.0 trainer/base_trainer.py), and that variable is what llmtrain reads (replica groups)"
)
CALLBACK_KEY_NOTE = "MindFormers skips the TrainFaultTolerance entry"


def flags(value: str) -> dict[str, bool]:
    """``{TTP:1,UCE:1 ARF:0}`` -> {"TTP": True, "UCE": True, "ARF": False} (commas or spaces, any order)."""
    return {name.upper(): bit != "0" for name, bit in re.findall(r"([A-Za-z]+)\s*:\s*(\d+)", value)}


def map_tft(ctx: Ctx, env: Mapping[str, str]) -> None:
    """``MS_ENABLE_TFT`` (and MindIO's controller address) of ``env`` onto ``fault_tolerance`` / ``stability``
    (the module docstring); runs after the parallel degrees are mapped. ConfigError when ARF asks for copies
    of the state the file's layout does not have."""
    raw = env.get(ENV)
    if raw is None:
        return
    on = [name for name, bit in flags(raw).items() if bit]
    ctx.notes.add(
        f"${ENV}={raw!r} (the environment: MindFormers' switch for MindIO TFT, {SOURCE}): "
        + (f"{', '.join(on)} on, each below." if on else "no feature on; nothing to map.")
    )
    where = f"${ENV}"
    if "ARF" in on:
        _replica_groups(ctx, where, raw)
    if "TRE" in on:
        ctx.put("stability.enabled", True)
        ctx.notes.add(
            f"{where} TRE:1 (a loss / global-norm anomaly recomputes the step) -> stability.enabled true: the "
            "stability guard skips non-finite steps and rolls a spike back to the newest good state."
        )
    for name in on:
        if name not in ("ARF", "TRE"):
            reason = NO_COUNTERPART.get(name, "a MindIO / MindSpore feature llmtrain does not know")
            ctx.notes.add(f"{where} {name}:1 not mapped: no counterpart ({reason}).")
    address = [f"${k}" for k in ENV_CONTROLLER if k in env]
    if address:
        ctx.notes.add(
            f"{', '.join(address)} not mapped: MindIO's controller, not a torchft lighthouse; `llmtrain launch "
            "--replicas R` starts a lighthouse, or `--lighthouse HOST:PORT` names one running elsewhere."
        )


def _replica_groups(ctx: Ctx, where: str, env_value: str) -> None:
    """ARF -> fault_tolerance: one replica group per copy of the state the layout keeps."""
    par = ctx.out.get("parallel", {})
    dp, zero = int(par.get("data_parallel", 1)), int(par.get("zero_stage", 0))
    replicate = par.get("data_parallel_replicate")
    if replicate:
        copies, why = (
            int(replicate),
            f"data_parallel {dp} / optimizer_weight_shard_size {dp // int(replicate)}",
        )
    elif zero:
        copies, why = (
            1,
            f"the optimizer is sharded over all data_parallel {dp} ranks (enable_parallel_optimizer)",
        )
    else:
        copies, why = (
            dp,
            f"data_parallel {dp}, the optimizer not sharded: every data-parallel rank holds a copy",
        )
    if copies < 2:
        raise ctx.error(
            f"${ENV}",
            f"ARF:1 in {env_value!r} (a failed node repaired from a replica; {SOURCE}) needs copies of the state, "
            f"but the file keeps {copies} copy of "
            f"the weights and optimizer state ({why}); MindIO needs at least two, and so do llmtrain's replica "
            "groups. Set parallel.parallel_optimizer_config.optimizer_weight_shard_size to a divisor of "
            f"data_parallel below it (e.g. {max(dp // 2, 1)}: two copies), or data_parallel >= 2 without "
            f"enable_parallel_optimizer, or unset {ENV} (ARF:0).",
        )
    ctx.put("fault_tolerance.enabled", True)
    ctx.put("fault_tolerance.replicas", copies)
    ctx.put("parallel.data_parallel", dp // copies)
    par.pop("data_parallel_replicate", None)
    ctx.out.get("train", {}).pop("gradient_accumulation_steps", None)  # derived: the global batch is the same
    ctx.notes.add(
        f"{where} ARF:1 (a failed node restarted and repaired from a replica) -> fault_tolerance.enabled true, "
        f"fault_tolerance.replicas {copies} (MindIO's copies of the state: {why}), each group "
        f"parallel.data_parallel {dp // copies}{' (in place of the HSDP replicate dimension)' if replicate else ''}: "
        "replica groups, the survivors keep stepping and the restarted "
        f"group heals live from a peer. Start it with `llmtrain launch CONFIG --nproc-per-node N --replicas "
        f"{copies}`; train.batch_size stays the global batch of all groups (the accumulation is derived). "
        "MindIO's redundant optimizer copies inside one job have no counterpart: each group holds a full copy."
    )

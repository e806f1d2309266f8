"""The report's plots: matplotlib figures rendered to inline SVG strings (no JavaScript, no network).

Every plot function takes the :class:`RunData` and an ``Axes`` and draws on it; :func:`render_all` returns
``{plot_id: svg_text}`` for every id in :data:`PLOTS`, always - a run without the data for a plot gets the plot
with a "no data yet" note, so the page's layout (and the DOM test) does not depend on what the run logged.
Stage boundaries are dotted vertical lines on every step-axis plot; the loss plot also marks rollbacks
(the abandoned rows faint, the re-trained window shaded) and skipped NaN steps. ``layer_grad_norm`` is a heat-map
of the per-layer gradient norms (``grad_norm/layer_NN``, train/health.py), layers by steps, so a layer whose
gradients run away stands out before the global norm shows it.

Downstream scores (the ``eval/<task>/<metric>`` fields of in-loop evaluations) get one plot each, after the
fixed ones: :func:`plot_titles` lists them for the run (id ``eval-<task>-<metric>``), with the standard error
as a band when the rows have one.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable

from llmtrain.report.run_data import RunData

PLOTS: dict[str, str] = {
    "loss": "Loss (train and validation)",
    "lr": "Learning rate",
    "grad_norm": "Gradient norm (before clipping)",
    "loss_scale": "Loss scale",
    "tokens_per_s": "Throughput (tokens/s)",
    "mfu": "MFU",
    "memory": "Memory (peak, per rank)",
    "time_split": "Step time split: compute / communication / data / downstream eval / other",
    "rank_step_time": "Per-rank busy time per step (s)",
    "events": "Events timeline",
    "layer_grad_norm": "Per-layer gradient norm (heat-map, log colour scale)",
    "health": "Output logit RMS and attention-logit bound",
}
SPLIT = (("time_compute_frac", "compute"), ("time_comm_frac", "communication"), ("time_data_frac", "data"),
         ("time_eval_frac", "downstream eval"), ("time_other_frac", "other"))  # fmt: skip
OPTIONAL_SPLIT = ("time_eval_frac",)  # absent from runs made before it existed: 0
EVENT_KINDS = ("run_start", "checkpoint", "rollback", "rollback_done", "skip", "resumed", "preempted",
               "straggler", "stage_start", "stage_end", "checkpoint_fallback", "profile",
               "downstream_eval", "replica_lost", "replica_joined", "heal")  # fmt: skip


def _xy(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _stages(run: RunData, ax) -> None:
    for step, name in run.stage_starts():
        ax.axvline(step, color="0.35", ls=":", lw=1)
        ax.annotate(name, (step, 1), xycoords=("data", "axes fraction"), fontsize=7, rotation=90,
                    va="top", ha="right", color="0.3")  # fmt: skip


def _series(key: str, label: str, log: bool = False) -> Callable:
    def draw(run: RunData, ax) -> bool:
        x, y = _xy(run.latest(), key)
        if not x:
            return False
        ax.plot(x, y, lw=1.2, label=label)
        if log and min(y) > 0:
            ax.set_yscale("log")
        return True

    return draw


def _loss(run: RunData, ax) -> bool:
    x, y = _xy(run.latest(), "loss")
    vx, vy = _xy(run.val, "val_loss")
    if not x and not vx:
        return False
    for i, seg in enumerate(run.abandoned()):
        ax.plot(*_xy(seg, "loss"), color="0.7", lw=1, label="rolled back" if i == 0 else None)
    if x:
        ax.plot(x, y, lw=1.2, label="train loss")
    if vx:
        ax.plot(vx, vy, "o-", ms=3, lw=1.2, label="validation loss")
    for i, e in enumerate(run.events_of("rollback_done")):
        lo, hi = int(e.get("step", 0)), int(e.get("detected_step", e.get("step", 0)))
        ax.axvspan(lo, max(hi, lo + 1), color="tab:red", alpha=0.12,
                   label=f"skipped data ({e.get('skipped_batches', '?')} batches)" if i == 0 else None)  # fmt: skip
    for i, e in enumerate(run.events_of("rollback")):
        ax.axvline(int(e.get("step", 0)), color="tab:red", lw=1, label="rollback" if i == 0 else None)
    skips = [int(e.get("step", 0)) for e in run.events_of("skip")]
    if skips and x:
        ax.plot(skips, [min(y)] * len(skips), "v", color="tab:purple", label="NaN step skipped")
    ax.legend(fontsize=7)
    return True


def _memory(run: RunData, ax) -> bool:
    rows = run.latest()
    per_rank = [
        (int(r["step"]), r["rank_memory_peak_bytes"]) for r in rows if r.get("rank_memory_peak_bytes")
    ]
    if per_rank:
        for rank in range(max(len(v) for _, v in per_rank)):
            pts = [(s, v[rank] / 2**30) for s, v in per_rank if rank < len(v)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, label=f"rank {rank} peak")
    else:
        x, y = _xy(rows, "memory_bytes")
        if not x:
            return False
        ax.plot(x, [v / 2**30 for v in y], lw=1.2, label="peak")
    x, y = _xy(rows, "memory_current_bytes")
    if x:
        ax.plot(x, [v / 2**30 for v in y], "--", lw=1, label="rank 0 current")
    ax.set_ylabel("GiB")
    fx, fy = _xy(rows, "memory_frac")
    if fx:
        ax.set_title(f"peak {fy[-1]:.1%} of device capacity (rank 0)", fontsize=8)
    ax.legend(fontsize=7)
    return True


def _time_split(run: RunData, ax) -> bool:
    needed = [k for k, _ in SPLIT if k not in OPTIONAL_SPLIT]
    rows = [r for r in run.latest() if all(isinstance(r.get(k), (int, float)) for k in needed)]
    if not rows:
        return False
    x = [int(r["step"]) for r in rows]
    ax.stackplot(
        x,
        *[[float(r.get(k) or 0.0) for r in rows] for k, _ in SPLIT],
        labels=[n for _, n in SPLIT],
        alpha=0.85,
    )
    ax.set_ylim(0, 1)
    ax.set_ylabel("fraction of the step")
    ax.legend(fontsize=7, loc="lower left")
    return True


def _rank_times(run: RunData, ax) -> bool:
    pts = [(int(r["step"]), r["rank_step_time_s"]) for r in run.latest() if r.get("rank_step_time_s")]
    if not pts:
        return False
    for rank in range(max(len(v) for _, v in pts)):
        sel = [(s, v[rank]) for s, v in pts if rank < len(v)]
        ax.plot([p[0] for p in sel], [p[1] for p in sel], lw=1.2, label=f"rank {rank}")
    for e in run.events_of("straggler"):
        ax.plot([int(e.get("step", 0))], [float(e.get("step_time", 0))], "r*", ms=9)
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    return True


def _events(run: RunData, ax) -> bool:
    kinds = [k for k in EVENT_KINDS if run.events_of(k)]
    if not kinds:
        return False
    for i, kind in enumerate(kinds):
        steps = [int(e.get("step", 0)) for e in run.events_of(kind)]
        ax.plot(steps, [i] * len(steps), "|" if kind == "checkpoint" else "o", ms=8)
    ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
    ax.set_ylim(-0.7, len(kinds) - 0.3)
    return True


def _layer_grad_norms(run: RunData, ax) -> bool:
    """``grad_norm/layer_NN`` of every log row (train/health.py) as a layers x steps heat-map."""
    rows = [r for r in run.latest() if any(k.startswith("grad_norm/layer_") for k in r)]
    keys = sorted({k for r in rows for k in r if k.startswith("grad_norm/layer_")}, key=lambda k: int(k[16:]))
    if not rows or not keys:
        return False
    import numpy as np
    from matplotlib.colors import LogNorm

    grid = np.array([[float(r.get(k) or np.nan) for r in rows] for k in keys])  # [layers, steps]
    grid[~np.isfinite(grid) | (grid <= 0)] = np.nan
    if np.isnan(grid).all():
        return False
    steps = [int(r["step"]) for r in rows]
    mesh = ax.pcolormesh(steps, range(len(keys)), grid, shading="nearest", cmap="viridis",
                         norm=LogNorm(vmin=np.nanmin(grid), vmax=np.nanmax(grid)))  # fmt: skip
    ax.figure.colorbar(mesh, ax=ax, label="grad norm")
    ax.set_ylabel("layer")
    return True


def _health(run: RunData, ax) -> bool:
    x, y = _xy(run.latest(), "logit_rms")
    bx, by = _xy(run.latest(), "attn_logit_bound")
    if not x and not bx:
        return False
    if x:
        ax.plot(x, y, lw=1.2, label="output logit RMS")
    if bx:
        ax.plot(bx, by, lw=1.2, label="max |q| |k| / sqrt(d) (attention-logit bound)")
    ax.legend(fontsize=7)
    return True


DRAW: dict[str, Callable] = {
    "loss": _loss,
    "lr": _series("lr", "lr"),
    "grad_norm": _series("grad_norm", "grad norm", log=True),
    "loss_scale": _series("loss_scale", "loss scale", log=True),
    "tokens_per_s": _series("tokens_per_s", "tokens/s"),
    "mfu": _series("mfu", "MFU"),
    "memory": _memory,
    "time_split": _time_split,
    "rank_step_time": _rank_times,
    "events": _events,
    "layer_grad_norm": _layer_grad_norms,
    "health": _health,
}


def downstream_keys(run: RunData) -> list[str]:
    """The run's downstream metric fields ``eval/<task>/<metric>`` (no ``_stderr``), sorted."""
    keys = {
        k
        for r in run.downstream
        for k, v in r.items()
        if k.count("/") == 2 and not k.endswith("_stderr") and isinstance(v, (int, float))
    }
    return sorted(keys)


def _plot_id(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key.replace("/", "-"))


def plot_titles(run: RunData) -> dict[str, str]:
    """``{plot_id: title}``: the fixed plots of PLOTS, then one per downstream metric of the run."""
    extra = {_plot_id(k): f"Downstream: {k.split('/')[1]} {k.split('/')[2]}" for k in downstream_keys(run)}
    return {**PLOTS, **extra}


def _downstream(key: str) -> Callable:
    def draw(run: RunData, ax) -> bool:
        rows = sorted(
            (r for r in run.downstream if isinstance(r.get(key), (int, float))), key=lambda r: r["step"]
        )
        if not rows:
            return False
        x, y = [int(r["step"]) for r in rows], [float(r[key]) for r in rows]
        err = [r.get(f"{key}_stderr") for r in rows]
        if all(isinstance(e, (int, float)) for e in err):
            lo = [v - float(e) for v, e in zip(y, err)]  # type: ignore[arg-type]
            hi = [v + float(e) for v, e in zip(y, err)]  # type: ignore[arg-type]
            ax.fill_between(x, lo, hi, alpha=0.2, label="± 1 stderr")
        ax.plot(x, y, "o-", ms=3, lw=1.2, label=key[5:])
        ax.legend(fontsize=7)
        return True

    return draw


def render_all(run: RunData) -> dict[str, str]:
    """``{plot_id: inline <svg>}`` for every plot of :func:`plot_titles` (PLOTS and the downstream ones)."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    draw = {**DRAW, **{_plot_id(k): _downstream(k) for k in downstream_keys(run)}}
    for plot_id in plot_titles(run):
        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"llmtrain-{plot_id}"}):
            fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=100)
            drew = draw[plot_id](run, ax)
            if drew:
                _stages(run, ax)
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
            else:
                ax.set_axis_off()
                ax.text(
                    0.5, 0.5, "no data yet", ha="center", va="center", color="0.5", transform=ax.transAxes
                )
            fig.tight_layout()
            buf = io.StringIO()
            fig.savefig(buf, format="svg")
            plt.close(fig)
        svg = buf.getvalue()
        out[plot_id] = svg[svg.index("<svg") :]
    return out

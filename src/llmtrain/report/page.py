"""The report page: one self-contained HTML file (inline CSS, inline SVG plots, one tiny inline script).

Layout: a header table (status, config summary, parameters, layout, tokens seen, elapsed time, measured
figures beside the planner's estimate when there is one), the plots (each a ``<figure id="plot-ID"
data-plot="ID">`` holding its SVG), and the events table. The inline script only checks the page: it counts the
figures whose SVG has a non-empty box and sets ``data-plots``, ``data-rendered`` and ``data-ok`` on ``<body>``,
and a hook in ``<head>`` records uncaught errors in ``data-errors`` on ``<html>`` - so a headless browser's dumped DOM says whether every plot
rendered. Every value from the run is HTML-escaped.
"""

from __future__ import annotations

import html
import json
import time

from llmtrain.report.membership import membership_table
from llmtrain.report.plots import plot_titles
from llmtrain.report.run_data import RunData, summary_value

CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:20px}table{border-collapse:collapse;margin:8px 0 16px}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f3f3f3}.plots{display:flex;flex-wrap:wrap;gap:12px}
figure{margin:0;border:1px solid #ddd;padding:4px;width:640px}figure svg{width:100%;height:auto}
.note{color:#a40}code{font-size:12px}"""

ERROR_HOOK = """window.addEventListener('error',function(e){document.documentElement.dataset.errors=
(document.documentElement.dataset.errors||'')+e.message+';';});"""
SCRIPT = """(function(){var figs=document.querySelectorAll('figure[data-plot]'),n=0;
for(var i=0;i<figs.length;i++){var s=figs[i].querySelector('svg');
if(s){var b=s.getBoundingClientRect();if(b.width>0&&b.height>0){n++;figs[i].dataset.rendered='1';}}}
document.body.dataset.plots=figs.length;document.body.dataset.rendered=n;
document.body.dataset.ok=(n===figs.length&&n>0)?'1':'0';})();"""


def _fmt(value: float | str | None, kind: str = "") -> str:
    """A JSON figure for the page ("-" when missing); ``kind`` bytes / pct / s take a number."""
    if value is None:
        return "-"
    if kind == "bytes":
        return f"{float(value) / 2**30:.2f} GiB"
    if kind == "pct":
        return f"{float(value):.2%}"
    if kind == "s":
        return f"{float(value):.4g} s"
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _rows(pairs: list[tuple[str, str]]) -> str:
    return "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in pairs)


def header(run: RunData, plan: dict | None, plan_note: str) -> str:
    cfg, rows = run.config, run.latest()
    model, train, par = cfg.get("model", {}), cfg.get("train", {}), cfg.get("parallel", {})
    start = (run.events_of("run_start") or [{}])[-1]
    last = rows[-1] if rows else {}
    first_time = min((float(e["time"]) for e in run.events if "time" in e), default=None)
    end_time = run.metrics_mtime or time.time()
    elapsed = f"{(end_time - first_time) / 60:.1f} min" if first_time else "-"
    layout = start.get("layout") or {k: v for k, v in par.items() if k.endswith("parallel")}
    params = start.get("num_params") or (plan or {}).get("num_params")
    info = [
        ("run", str(run.run_dir)),
        ("status", run.status()),
        ("model", f"{model.get('model_type', '?')} {model.get('flavor') or ''} seq {model.get('seq_length', '?')}"),
        ("parameters", _fmt(params)),
        ("layout", f"world {start.get('world_size', '?')}: {json.dumps(layout)}"),
        ("hosts", ", ".join(sorted(set(start.get("hosts") or []))) or "-"),
        ("train", f"batch {train.get('batch_size')} x micro {train.get('micro_batch_size')}, lr "
                  f"{train.get('lr')}, {train.get('decay_style')}, precision {train.get('precision')}, "
                  f"max_steps {train.get('max_steps')}"),
        ("tokens seen", _fmt(last.get("tokens_seen"))),
        ("elapsed (first event to last write)", elapsed),
    ]  # fmt: skip
    stages = run.stage_starts()
    if stages:
        info.append(("stages", ", ".join(f"{n} @ step {s}" for s, n in stages)))
    if run.bad_lines:
        info.append(("note", f"{run.bad_lines} unreadable line(s) skipped (a write cut short)"))
    measured = {
        "step_time_s": summary_value(rows, "step_time_s"),
        "tokens_per_s": summary_value(rows, "tokens_per_s"),
        "mfu": summary_value(rows, "mfu"),
        "memory_bytes": max([float(r.get("memory_peak_bytes") or r.get("memory_bytes") or 0) for r in rows] or [0])
        or None,
    }  # fmt: skip
    kinds = {"step_time_s": "s", "tokens_per_s": "", "mfu": "pct", "memory_bytes": "bytes"}
    names = {"step_time_s": "step time", "tokens_per_s": "tokens/s (all ranks)", "mfu": "MFU",
             "memory_bytes": "memory per device (peak)"}  # fmt: skip
    cmp_rows = "".join(
        f"<tr><th>{names[k]}</th><td>{_fmt(measured[k], kinds[k])}</td>"
        f"<td>{_fmt((plan or {}).get(k), kinds[k]) if plan else '-'}</td></tr>"
        for k in names
    )
    plan_head = (
        f"planned ({html.escape(plan['device'])}, {html.escape(plan['layout'])})" if plan else "planned"
    )
    note = "" if plan else f'<p class="note">plan: {html.escape(plan_note)}</p>'
    return (
        f'<table id="summary">{_rows(info)}</table>'
        f'<table id="planned-vs-measured"><tr><th></th><th>measured (median of the last 10 log rows)</th>'
        f"<th>{plan_head}</th></tr>{cmp_rows}</table>{note}"
    )


def events_table(run: RunData) -> str:
    lines = []
    for e in run.events:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(e.get("time", 0))))
        detail = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("time", "event", "step"))
        lines.append(
            f'<tr class="ev-{html.escape(str(e.get("event")))}"><td>{when}</td><td>{html.escape(str(e.get("step", "")))}'
            f"</td><td>{html.escape(str(e.get('event')))}</td><td><code>{html.escape(detail)}</code></td></tr>"
        )
    body = "".join(lines) or '<tr><td colspan="4">no events recorded</td></tr>'
    return (
        f'<table id="events"><tr><th>time</th><th>step</th><th>event</th><th>details</th></tr>{body}</table>'
    )


def render_page(run: RunData, svgs: dict[str, str], plan: dict | None, plan_note: str) -> str:
    figures = "".join(
        f'<figure id="plot-{pid}" data-plot="{pid}"><figcaption>{html.escape(title)}</figcaption>{svgs[pid]}</figure>'
        for pid, title in plot_titles(run).items()
    )
    title = html.escape(f"llmtrain report: {run.run_dir.name}")
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{CSS}</style><script>{ERROR_HOOK}</script></head><body><h1>{title}</h1>{header(run, plan, plan_note)}"
        f'<h2>Plots</h2><div class="plots">{figures}</div>{membership_table(run)}<h2>Events</h2>{events_table(run)}'
        f"<script>{SCRIPT}</script></body></html>\n"
    )

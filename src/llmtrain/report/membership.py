"""The report's replica-group membership table (runs with ``fault_tolerance``; ft/replicas.py's events).

One row per membership change, in time order: the ``quorum`` rows (members, groups in the step), the
``replica_lost`` / ``replica_joined`` rows that explain them and the ``heal`` rows (seconds, bytes) of the groups
that came back. Empty (no section) for a run without replica groups.
"""

from __future__ import annotations

import html
from typing import Any

KINDS = ("quorum", "replica_lost", "replica_joined", "heal")


def membership_table(run: Any) -> str:
    rows = run.events_of(*KINDS)
    if not rows:
        return ""
    t0 = min(float(e.get("time", 0)) for e in run.events if "time" in e)
    body = []
    for e in rows:
        kind = str(e.get("event"))
        if kind == "quorum":
            what = f"members {e.get('members')} ({e.get('participants')} in the step)"
        elif kind == "replica_lost":
            what = f"group {e.get('lost')} lost; members {e.get('members')}"
        elif kind == "replica_joined":
            what = f"group {e.get('joined')} joined; members {e.get('members')}"
        else:
            what = f"group {e.get('replica')} healed from step {e.get('from_step')}: {e.get('seconds')} s, {e.get('bytes')} bytes"
        when = f"+{float(e.get('time', t0)) - t0:.1f} s"
        body.append(
            f"<tr><td>{when}</td><td>{html.escape(str(e.get('step', '')))}</td><td>{html.escape(kind)}</td>"
            f"<td>{html.escape(what)}</td></tr>"
        )
    return (
        '<h2>Replica groups</h2><table id="membership"><tr><th>time</th><th>step</th><th>event</th>'
        f"<th>membership</th></tr>{''.join(body)}</table>"
    )

"""Stage 3 of the staged dedup (one task): connected components of the duplicate pairs -> what to drop.

Every verified pair of every bucket is an edge; the documents that appear in any pair are the nodes (so
memory grows with the duplicates, never with the corpus: 40 bytes per pair and ~30 per node). Nodes are
numbered in id order (``np.unique``), and :func:`component_minimum` labels each with the smallest node of its
component. The rule: in each component the lowest global id (the first in input order) survives and every
other member is dropped, whatever the partitions, buckets, workers or engine. A dropped document is an
``exact_duplicate`` when a document with a lower id has its digest (it is the high end of an exact pair),
else a ``near_duplicate``.

Against the one-process :class:`~llmtrain.data.prep.dedup.DedupIndex` (which keeps a document unless it
repeats one already *kept*), the closure is transitive: in a chain ``a ~ b ~ c`` with ``a`` and ``c`` not
similar, the index keeps ``a`` and ``c``, the components keep only ``a``. Output ``s3/drops-PPPPP.npz`` per
partition: ``rows`` (sorted rows of its kept documents to drop) and ``exact`` (bool).
"""

from __future__ import annotations

import numpy as np

from llmtrain.data.prep.stages.layout import LOW, SHIFT, StageContext, save_npz


def component_minimum(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[n] the smallest node of each node's component, for edges ``a[i] - b[i]`` over nodes ``0..n-1``.

    Label propagation with hooking and pointer jumping: each round hooks every edge's larger root under the
    smaller one (``np.minimum.at`` on the roots), then jumps every label to its root. Labels only decrease
    and always name a node of the same component, so at the fixed point (both ends of every edge share a
    label) each component's label is its minimum."""
    label = np.arange(n, dtype=np.int64)
    while True:
        la, lb = label[a], label[b]
        if np.array_equal(la, lb):
            return label
        low = np.minimum(la, lb)
        np.minimum.at(label, la, low)
        np.minimum.at(label, lb, low)
        while True:
            jumped = label[label]
            if np.array_equal(jumped, label):
                break
            label = jumped


def components_task(ctx: StageContext, task: int = 0) -> dict:
    """Stage 3 (its single task); returns the task's figures."""
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("lo_id", "lo_loc", "hi_id", "hi_loc", "exact")}
    for bucket in range(ctx.plan.buckets):
        with np.load(ctx.s2() / f"pairs-{bucket:05d}.npz") as z:
            for k in cols:
                cols[k].append(z[k])
    lo_id, lo_loc, hi_id, hi_loc = (np.concatenate(cols[k]) for k in ("lo_id", "lo_loc", "hi_id", "hi_loc"))
    exact = np.concatenate(cols["exact"])
    pairs_in = len(lo_id)
    nodes, inverse = np.unique(np.concatenate([lo_id, hi_id]), return_inverse=True)
    loc = np.zeros(len(nodes), dtype=np.int64)
    loc[inverse] = np.concatenate([lo_loc, hi_loc])
    a, b = inverse[:pairs_in], inverse[pairs_in:]
    label = component_minimum(len(nodes), a, b)
    dropped = label != np.arange(len(nodes))
    exact_copy = np.zeros(len(nodes), dtype=bool)
    exact_copy[b[exact]] = True
    where = np.flatnonzero(dropped)
    part, row = loc[where] >> SHIFT, loc[where] & LOW
    written = 0
    for p in range(len(ctx.plan.partitions)):
        sel = np.flatnonzero(part == p)
        sel = sel[np.argsort(row[sel], kind="stable")]
        written += save_npz(ctx.s3() / f"drops-{p:05d}.npz", rows=row[sel], exact=exact_copy[where[sel]])
    n_exact = int(exact_copy[where].sum())
    return {"pairs_in": pairs_in, "nodes": int(len(nodes)), "components": int((~dropped).sum()),
            "dropped": int(len(where)), "exact_duplicate": n_exact, "near_duplicate": int(len(where)) - n_exact,
            "bytes": written}  # fmt: skip

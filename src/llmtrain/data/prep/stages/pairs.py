"""Stage 2 of the staged dedup, per bucket: equal keys -> candidate pairs -> verified duplicate pairs.

A bucket holds every row ``(key, id, location)`` whose key hashes to it, from all partitions, so two documents
sharing a band key always meet in one bucket. Rows are sorted by (key, id); a run of equal keys is a *group*
of candidates, its members in id order ``m0 < m1 < ...``:

* near (band keys): each member ``mi`` is verified against the group's lowest id ``m0`` and, if that fails,
  against its predecessor ``m(i-1)``: a pair when the estimated Jaccard of the two 16-bit signatures
  (:func:`~llmtrain.data.prep.dedup.estimated_jaccard`, the in-memory index's test) is at least the threshold.
  At most ``2 (g - 1)`` checks for a group of ``g``, never ``g^2``; connected components (stage 3) close the
  rest. Candidate probability and verification are those of the one-process index (docs/data.md), so its
  guarantees (recall >= 0.9 at Jaccard >= 0.8, false positives <= 1% below 0.5) hold; tests/test_staged_dedup.py
  measures them through :func:`near_pairs`;
* exact (digests): every member is an exact copy of ``m0``; no verification.

Signatures are read from the partitions' ``sigs.bin`` by location (a memory map per partition, rows sorted),
only for rows of groups with at least two members. Memory: the bucket's rows (24 bytes per document and band
over B buckets) and the candidates' signatures. Output ``s2/pairs-BBBBB.npz``: ``lo_id, lo_loc, hi_id, hi_loc``
(int64) and ``exact`` (bool), one row per distinct pair, ``lo_id < hi_id``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from llmtrain.data.prep.dedup import estimated_jaccard
from llmtrain.data.prep.stages.layout import LOW, SHIFT, StageContext, save_npz

BLOCK = 1 << 16  # candidate checks per numpy round ([BLOCK, P] signature blocks)


def _groups(keys: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order: rows sorted by key then id, head [R]: sorted position of each sorted row's group head,
    members: sorted positions of the rows that are not a head)."""
    order = np.lexsort((ids, keys))
    k = keys[order]
    start = np.ones(len(k), dtype=bool)
    start[1:] = k[1:] != k[:-1]
    heads = np.flatnonzero(start)
    head = heads[np.cumsum(start) - 1]
    return order, head, np.flatnonzero(~start)


def exact_pairs(digests: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) row indices: each document paired with the lowest id of its digest."""
    order, head, members = _groups(digests, ids)
    return order[head[members]], order[members]


def near_pairs(
    keys: np.ndarray, ids: np.ndarray, signatures: Callable[[np.ndarray], np.ndarray], threshold: float
) -> tuple[np.ndarray, np.ndarray, int]:
    """(a, b, checks): row indices of the verified pairs among rows sharing a band key (see the module
    docstring), and the number of signature comparisons made. ``signatures(rows)`` returns [len(rows), P]."""
    order, head, members = _groups(keys, ids)
    if not len(members):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    need = np.union1d(head[members], members)  # sorted positions in groups of two or more
    sig = signatures(order[need])  # [G, P]
    at = np.full(len(order), -1, dtype=np.int64)
    at[need] = np.arange(len(need))
    found_a: list[np.ndarray] = []
    found_b: list[np.ndarray] = []
    checks = 0
    for i in range(0, len(members), BLOCK):
        m = members[i : i + BLOCK]
        ok = estimated_jaccard(sig[at[head[m]]], sig[at[m]]) >= threshold
        found_a.append(head[m][ok])
        found_b.append(m[ok])
        retry = m[~ok & (m - 1 != head[m])]  # not like the lowest id: try the predecessor
        ok2 = estimated_jaccard(sig[at[retry - 1]], sig[at[retry]]) >= threshold
        found_a.append(retry[ok2] - 1)
        found_b.append(retry[ok2])
        checks += len(m) + len(retry)
    a, b = order[np.concatenate(found_a)], order[np.concatenate(found_b)]
    return a, b, checks


def _rows(ctx: StageContext, name: str, b: int) -> np.ndarray:
    """[R, 3] int64 rows (key, id, location) of bucket ``b`` from every partition, in partition order."""
    blocks = []
    for k in range(len(ctx.plan.partitions)):
        path = ctx.s1(k) / f"{name}-{b:05d}.bin"
        if path.is_file():
            blocks.append(np.fromfile(path, dtype=np.int64).reshape(-1, 3))
    return np.concatenate(blocks) if blocks else np.zeros((0, 3), dtype=np.int64)


def _signatures(ctx: StageContext, all_locs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """[M, P] uint16 signatures of the documents at ``all_locs[rows]`` (partition << SHIFT | row)."""
    locs = all_locs[rows]
    perm = ctx.options.minhash.bands * ctx.options.minhash.rows
    out = np.zeros((len(locs), perm), dtype=np.uint16)
    part, row = locs >> SHIFT, locs & LOW
    for p in np.unique(part).tolist():
        sel = np.flatnonzero(part == p)
        sel = sel[np.argsort(row[sel], kind="stable")]  # ascending rows: a forward pass over the file
        sigs = np.memmap(ctx.s1(p) / "sigs.bin", dtype=np.uint16, mode="r").reshape(-1, perm)
        out[sel] = sigs[row[sel]]
        del sigs
    return out


def pairs_task(ctx: StageContext, b: int) -> dict:
    """Stage 2 of bucket ``b``; returns the task's figures."""
    lo_id, lo_loc, hi_id, hi_loc, exact = [], [], [], [], []
    rows_in = checks = 0
    for name, on in (("exact", ctx.exact), ("band", ctx.near)):
        if not on:
            continue
        rows = _rows(ctx, name, b)
        rows_in += len(rows)
        if name == "exact":
            a, c = exact_pairs(rows[:, 0], rows[:, 1])
            checks += len(a)
        else:
            threshold = ctx.options.minhash.threshold
            lookup = functools.partial(_signatures, ctx, rows[:, 2])
            a, c, n = near_pairs(rows[:, 0], rows[:, 1], lookup, threshold)
            checks += n
        keep = rows[a, 1] != rows[c, 1]
        a, c = a[keep], c[keep]
        lo_id.append(rows[a, 1])
        lo_loc.append(rows[a, 2])
        hi_id.append(rows[c, 1])
        hi_loc.append(rows[c, 2])
        exact.append(np.full(len(a), name == "exact"))
    cols = [np.concatenate(x) if x else np.zeros(0, np.int64) for x in (lo_id, lo_loc, hi_id, hi_loc)]
    ex = np.concatenate(exact) if exact else np.zeros(0, dtype=bool)
    order = np.lexsort((~ex, cols[2], cols[0]))  # by pair; an exact row first among equal pairs
    cols, ex = [c[order] for c in cols], ex[order]
    first = np.ones(len(ex), dtype=bool)
    first[1:] = (cols[0][1:] != cols[0][:-1]) | (cols[2][1:] != cols[2][:-1])
    cols, ex = [c[first] for c in cols], ex[first]
    written = save_npz(ctx.s2() / f"pairs-{b:05d}.npz", lo_id=cols[0], lo_loc=cols[1], hi_id=cols[2],
                       hi_loc=cols[3], exact=ex)  # fmt: skip
    return {"rows_in": rows_in, "candidates": checks, "pairs": int(len(ex)), "bytes": written}

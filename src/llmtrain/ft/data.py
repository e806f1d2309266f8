"""Each replica group's disjoint slice of every global batch, and committed-only accounting.

The global sample order is the one of :class:`~llmtrain.data.loader.BatchIterator`: step ``s`` covers global
samples ``[s*GB, (s+1)*GB)``. With R groups of D data-parallel ranks, the global batch is R *slots* of GB/R
contiguous samples; slot j is cut among a group's D ranks as the loader cuts a batch among ranks (the inner
iterator runs with data-parallel size R x D, rank ``j*D + r``), so a full quorum reads exactly what an
R x D data-parallel job reads.

Which slots a group computes at a step depends on the quorum (P groups present, this one the p-th):

* all present: slot p;
* ``keep``: every slot j with ``j % P == p`` (the survivors compute the missing slots too: same global batch);
* ``shrink``: slot p; slots P .. R-1 are skipped (:meth:`ReplicaBatches.skipped` names their sample indices).

Nothing is accounted until the step commits: ``consumed_tokens`` counts committed samples only, and a step that
did not commit (a group died during it) puts the position back, so the survivors take the same batch again.
"""

from __future__ import annotations

import torch

from llmtrain.data.loader import BatchIterator


class ReplicaBatches:
    """A BatchIterator for one replica group: the loop's ``batches`` (same methods and state)."""

    def __init__(self, inner: BatchIterator, replicas: int, group_dp: int, policy: str):
        self.inner, self.replicas, self.group_dp, self.policy = inner, replicas, group_dp, policy
        self.group_rank = inner.dp_rank  # this rank's data-parallel rank inside its group
        self.slot_size = inner.global_batch_size // replicas
        self.participants, self.position = replicas, 0  # set by the quorum of each step (begin)
        self._start: int | None = None

    # ---- the BatchIterator surface the loop uses
    @property
    def consumed_samples(self) -> int:
        return self.inner.consumed_samples

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        self.inner.consumed_samples = value

    @property
    def consumed_tokens(self) -> dict[str, int]:
        return self.inner.consumed_tokens

    @property
    def global_batch_size(self) -> int:
        return self.inner.global_batch_size

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict, allow_data_change: bool = False) -> None:
        self.inner.load_state_dict(sd, allow_data_change)

    # ---- the quorum's view
    def begin(self, participants: int, position: int) -> None:
        """This step's quorum: ``participants`` groups, this group the ``position``-th of them."""
        self.participants, self.position = max(participants, 1), position

    def slots(self) -> list[int]:
        """The slots this group computes at the next step."""
        p, n = self.position, self.participants
        if self.policy == "keep":
            return [j for j in range(self.replicas) if j % n == p]
        return [p] if p < self.replicas else []

    def committed_slots(self) -> list[int]:
        return (
            list(range(self.replicas))
            if self.policy == "keep"
            else list(range(min(self.participants, self.replicas)))
        )

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of its slots; the position moves on, the accounting waits for the commit."""
        inner, start = self.inner, self.inner.consumed_samples
        self._start = start
        tokens = dict(inner.consumed_tokens)
        out: list[dict[str, torch.Tensor]] = []
        for j in self.slots():
            inner.dp_rank, inner.consumed_samples = j * self.group_dp + self.group_rank, start
            out += inner.next_step()
        inner.consumed_tokens = tokens  # next_step accounted the whole batch: undone until the commit
        inner.dp_rank, inner.consumed_samples = self.group_rank, start + inner.global_batch_size
        return out

    def split_slots(self, items: list) -> list[list]:
        """``items`` (this step's micro-batches, :meth:`next_step`'s order) cut per slot: a pipeline schedule
        takes a fixed number of micro-batches, so under ``keep`` it runs once per slot (train/step.py)."""
        n = max(len(self.slots()), 1)
        per = len(items) // n
        assert per * n == len(items), (len(items), n)
        return [items[i * per : (i + 1) * per] for i in range(n)]

    def slot_range(self, j: int) -> range:
        assert self._start is not None
        lo = self._start + j * self.slot_size
        return range(lo, lo + self.slot_size)

    def end_step(self, committed: bool) -> list[int]:
        """After the commit vote: account the committed slots (True) or go back to the step's start (False).
        Returns the skipped slots (shrink with groups missing), whose samples no group computed."""
        assert self._start is not None
        if not committed:
            self.inner.consumed_samples = self._start
            return []
        for j in self.committed_slots():
            self.inner._account(self.slot_range(j))
        return [j for j in range(self.replicas) if j not in self.committed_slots()]

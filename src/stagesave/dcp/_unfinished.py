"""A writer's saves that ``dcp.save`` may still fail: what to give up, and which failures the
caller already got from ``dcp.save`` (so that no later call raises them a second time)."""

from __future__ import annotations

from ..handle import SaveHandle
from ..stores.base import Store
from ._coordinator import abandon
from ._protocol import MetadataSlot, SavePlanData

__all__ = ["Unfinished"]

#: Recent saves whose handles a writer keeps by save id (a failure surfaces within a few saves).
_IDS_KEPT = 16


class Unfinished:
    """One writer's saves between their set-up and the end of their ``dcp.save``.

    - the lease a coordinator took for a save whose commit job does not exist yet;
    - the coordinator's saves whose metadata DCP has not handed over (``finish()``), each with
      its handle: one still waiting when the next save starts or the writer closes belongs to a
      ``dcp.save`` that raised;
    - this rank's handle of the latest save (from ``write_data`` until the next set-up): a
      non-coordinator cannot tell whether its ``dcp.save`` raised, its caller can;
    - this rank's handles of its recent saves by save id: a later save that raised because some
      rank's background part of one of them failed (DCP hands every rank that error) has told
      this rank's caller that the save failed, so this rank's own failure of it, whenever it
      comes, is not raised again.
    """

    def __init__(self) -> None:
        self._slots: list[tuple[MetadataSlot, SaveHandle]] = []
        self._latest: SaveHandle | None = None
        self._lease: tuple[Store, SavePlanData] | None = None
        self._by_id: dict[str, SaveHandle] = {}

    def starting(self) -> None:
        """A new save is being set up: the latest is no longer the one ``dcp.save`` may fail."""
        self._latest = None

    def took_lease(self, store: Store, spec: SavePlanData) -> None:
        self._lease = (store, spec)

    def staged(self, handle: SaveHandle, slot: MetadataSlot | None, save_id: str) -> None:
        """This rank's part was staged and its job is about to be submitted (which gives the
        coordinator's lease up from now on)."""
        self._latest = handle
        self._by_id[save_id] = handle
        while len(self._by_id) > _IDS_KEPT:
            del self._by_id[next(iter(self._by_id))]
        if slot is not None:
            self._lease = None
            self._slots = [(s, h) for s, h in self._slots if s.pending]
            self._slots.append((slot, handle))

    def give_up(self, reason: str, *, raised: bool) -> None:
        """Fail every coordinator save still waiting for its metadata, give up an unowned lease;
        their failures, and with ``raised`` the latest save's, count as delivered."""
        for slot, handle in self._slots:
            if slot.pending:
                slot.abandon(reason)
                handle._mark_delivered()
        self._slots = []
        if raised and self._latest is not None:
            self._latest._mark_delivered()
        self.drop_lease()

    def told(self, save_ids: set[str]) -> None:
        """The caller was told that these saves failed (on some rank): this rank's failures of
        them are delivered."""
        for save_id in save_ids:
            handle = self._by_id.get(save_id)
            if handle is not None:
                handle._mark_delivered()

    def drop_lease(self) -> None:
        """Give up the lease of a save that failed before its commit job existed."""
        lease, self._lease = self._lease, None
        if lease is not None:
            abandon(*lease)

"""A writer's saves that ``dcp.save`` may still fail: what to give up, and which failures the
caller already got from ``dcp.save`` (so that no later call raises them a second time)."""

from __future__ import annotations

from ..handle import SaveHandle
from ..stores.base import Store
from ._coordinator import abandon
from ._protocol import MetadataSlot, SavePlanData

__all__ = ["Unfinished"]


class Unfinished:
    """One writer's saves between their set-up and the end of their ``dcp.save``.

    - the lease a coordinator took for a save whose commit job does not exist yet;
    - the coordinator's saves whose metadata DCP has not handed over (``finish()``), each with
      its handle: one still waiting when the next save starts or the writer closes belongs to a
      ``dcp.save`` that raised;
    - this rank's handle of the latest save (from ``write_data`` until the next set-up): a
      non-coordinator cannot tell whether its ``dcp.save`` raised, its caller can.
    """

    def __init__(self) -> None:
        self._slots: list[tuple[MetadataSlot, SaveHandle]] = []
        self._latest: SaveHandle | None = None
        self._lease: tuple[Store, SavePlanData] | None = None

    def starting(self) -> None:
        """A new save is being set up: the latest is no longer the one ``dcp.save`` may fail."""
        self._latest = None

    def took_lease(self, store: Store, spec: SavePlanData) -> None:
        self._lease = (store, spec)

    def staged(self, handle: SaveHandle, slot: MetadataSlot | None) -> None:
        """This rank's part was staged and its job is about to be submitted (which gives the
        coordinator's lease up from now on)."""
        self._latest = handle
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

    def drop_lease(self) -> None:
        """Give up the lease of a save that failed before its commit job existed."""
        lease, self._lease = self._lease, None
        if lease is not None:
            abandon(*lease)

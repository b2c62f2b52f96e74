"""A staging buffer taken from a :class:`.buffers.BufferPool`, until it is given back."""

from __future__ import annotations

import torch

from .buffers import BufferPool, HostBuffer

__all__ = ["Lease"]


class Lease:
    """One staging buffer taken from :class:`StagingMemory`, held until :meth:`give_back`."""

    __slots__ = ("buf", "device", "given", "pool", "waited_s")

    def __init__(
        self, pool: BufferPool, buf: HostBuffer, device: torch.device | None, waited_s: float
    ) -> None:
        self.pool, self.buf, self.device, self.waited_s = pool, buf, device, waited_s
        self.given = False

    def give_back(self) -> None:
        """Return the buffer (once: later calls do nothing)."""
        if not self.given:
            self.given = True
            self.pool.release(self.buf)

    def regrow(self, nbytes: int) -> None:
        """Make the buffer again at ``nbytes`` or more, in its place: never waits for another
        (its contents are lost; a lease taken before its size was known)."""
        self.given = True  # (if the allocation fails, the pool has counted it gone)
        self.buf = self.pool.regrow(self.buf, nbytes)
        self.given = False

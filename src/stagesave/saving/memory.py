"""The one owner of a Checkpointer's staging memory, host and device buffers."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

from ..errors import ClosedError
from .buffers import BufferPool, SegmentHooks
from .lease import Lease

__all__ = ["StagingMemory"]


class StagingMemory:
    """Every staging buffer of one Checkpointer, in one owner.

    Host buffers (pinned when asked) and, with ``device_staging``, buffers in each CUDA
    device's memory, at most ``max_buffers`` of each kind in flight. A device without room
    for a save's buffer is an optimization that failed, never a failed save: that save stages
    in host memory, a warning says so once, and saves at least that large stage in host memory
    from then on (a failed CUDA allocation first empties the allocator's cache, which training
    would pay for at every save).
    """

    def __init__(
        self, max_buffers: int, pinned: bool | None, segments: SegmentHooks | None = None
    ) -> None:
        self.host = BufferPool(max_buffers, pinned, segments=segments)
        self.devices: dict[torch.device, BufferPool] = {}
        self._no_room: dict[torch.device, int] = {}  # smallest size that found no room
        self._warned = False
        self._lock = threading.Lock()
        self._closed = False

    @property
    def max_buffers(self) -> int:
        return self.host.max_buffers

    def lease(self, nbytes: int, device: torch.device | None = None) -> Lease:
        """A buffer of at least ``nbytes``: on ``device`` when it has room, else in host memory.

        Waits while ``max_buffers`` of that kind are in flight.

        Raises:
            ClosedError: released by :meth:`close`.
        """
        if device is not None and nbytes >= self._no_room.get(device, nbytes + 1):
            device = None  # this size did not fit on the device before: do not retry every save
        pool = self.host if device is None else self._device_pool(device)
        try:
            buf, waited = pool.acquire(nbytes)
        except torch.OutOfMemoryError as exc:
            if device is None:
                raise
            self._no_room[device] = min(nbytes, self._no_room.get(device, nbytes))
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"device_staging: no room on {device} for a {nbytes / 2**30:.2f} GiB staging "
                    f"buffer ({str(exc).splitlines()[0]}); staging in host memory instead "
                    "(SaveTelemetry.staged_on tells which each save used)",
                    RuntimeWarning,
                    stacklevel=4,
                )
            pool, device = self.host, None
            buf, waited = pool.acquire(nbytes)
        return Lease(pool, buf, device, waited)

    def prepare(self, bounds: Callable[[], tuple[int, int] | None], *,
                only_when_empty: bool = False) -> None:
        """:meth:`BufferPool.prepare` of the host buffers (a plan of a new structure begins)."""
        self.host.prepare(bounds, only_when_empty=only_when_empty)

    def _device_pool(self, device: torch.device) -> BufferPool:
        """The buffers of ``device`` (created on first use)."""
        with self._lock:
            if self._closed:
                raise ClosedError(
                    "this Checkpointer is closed; create a new one to save or remove checkpoints"
                )
            pool = self.devices.get(device)
            if pool is None:
                pool = self.devices[device] = BufferPool(self.max_buffers, device=device)
            return pool

    def close(self) -> None:
        """Free idle buffers now; buffers in flight are freed when given back."""
        with self._lock:
            self._closed = True
            pools = [self.host, *self.devices.values()]
        for pool in pools:
            pool.close()

"""The sharded writer's view of a :class:`~stagesave.Checkpointer`, in one place.

A sharded save shares everything with the checkpointer it runs on: the staging buffer pool (so
``max_pending`` bounds plain and sharded saves together), the ordered job queue (so a
``remove()`` submitted after a sharded save never overtakes it), retention, telemetry, and the
delivery of background errors to the next ``save``/``wait``/``close``. This module is the only
place that reaches into the checkpointer's private side, so a change there is a change here.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any

from ..checkpointer import Checkpointer, _as_checkpoint_error
from ..handle import SaveHandle
from ..saving.buffers import HostBuffer
from ..saving.commit import retain
from ..saving.plan import FileImage
from ..saving.stage import ImageCrcs
from ..stores.base import Store
from ..telemetry import SaveTelemetry

__all__ = ["Engine"]


class Engine:
    """Staging buffers, the background queue and the commit bookkeeping of one checkpointer."""

    def __init__(self, checkpointer: Checkpointer, *, owned: bool) -> None:
        self.ckpt = checkpointer
        self.owned = owned

    # ------------------------------------------------------------ caller thread
    def split(self, path: Any) -> tuple[Store, str]:
        """``(store, name)`` of a checkpoint path (relative paths resolve against the root)."""
        return self.ckpt._targets.split(path)

    def check_usable(self) -> None:
        """Raise if closed, or the undelivered error of an earlier background save."""
        self.ckpt._check_open()
        self.ckpt._raise_failures()

    @property
    def checksum(self) -> str:
        return self.ckpt.checksum

    @property
    def chunk_bytes(self) -> int:
        return self.ckpt.chunk_bytes

    def stage(
        self, image: FileImage, buf: HostBuffer, tel: SaveTelemetry,
    ) -> tuple[Callable[[], None] | None, ImageCrcs | None]:
        """Copy a rank's image on the caller's time (CRC-ing it too per ``checksum_in``).

        Returns the wait for pending device copies and the chunk CRCs (either may be None).
        """
        return self.ckpt._stage(image, buf, 0, tel)

    def acquire(self, nbytes: int) -> tuple[HostBuffer, float]:
        """A reused staging buffer of at least ``nbytes`` and the seconds waited for it."""
        return self.ckpt._pool.acquire(nbytes)

    def release(self, buf: HostBuffer) -> None:
        self.ckpt._pool.release(buf)

    def submit(self, job: Callable[[], None], handle: SaveHandle) -> None:
        """Queue ``job`` behind every earlier save and removal of the checkpointer."""
        self.ckpt._track(handle.path, handle)
        self.ckpt._submit(job, handle, handle.path)

    # ------------------------------------------------------------ background thread
    def io_pool(self) -> cf.Executor:
        """The checkpointer's I/O threads (only called from a submitted job)."""
        return self.ckpt._io_pool()

    def finish(self, handle: SaveHandle, error: BaseException | None) -> None:
        """Complete ``handle``: record a failure for later delivery, emit telemetry."""
        self.ckpt._finish(handle.path, handle, error)

    def retain(self, store: Store, directory: str) -> None:
        """Apply ``keep_last`` to ``directory`` after a commit."""
        if self.ckpt.keep_last is not None:
            retain(store, directory, self.ckpt.keep_last)

    @staticmethod
    def as_error(exc: BaseException, what: str) -> BaseException:
        return _as_checkpoint_error(exc, what)

    # ------------------------------------------------------------ lifecycle
    def wait(self, timeout: float | None = None) -> None:
        self.ckpt.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        if self.owned:
            self.ckpt.close(timeout)

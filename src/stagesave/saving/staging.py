"""Staging, the one step a save blocks on: lease a buffer, copy the state into it, CRC it.

The copy kernels are :mod:`.stage` (host memory) and :mod:`.stage_device` (device-to-device
copies for ``device_staging``). Where each chunk's checksum is computed follows
``checksum_in``: ``"staging"`` hashes in the copy's pass while the bytes are in cache (free
for a state in host memory), ``"background"`` leaves it to the writer threads, ``"auto"``
stages-and-hashes unless a device copy is still in flight or the state is many small tensors
(where hashing costs Python steps per tensor rather than memory bandwidth).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Callable, Sequence

import torch

from ..errors import ClosedError
from ..ondisk.names import ALIGNMENT
from ..stores.base import Store
from ..telemetry import SaveTelemetry
from .buffers import HostBuffer
from .lease import Lease
from .memory import StagingMemory
from .plan import FileImage
from .stage import ImageCrcs, crc_image, many_small_slots, on_host, stage_and_crc, stage_image
from .stage_device import device_of, stage_on_device
from .write import FileToWrite

__all__ = ["CHECKSUM_IN", "Staged", "Stager"]

#: The choices of ``checksum_in``.
CHECKSUM_IN = ("auto", "background", "staging")


def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class Staged:
    """A state copied into a leased buffer: the files the background writes, the device
    copies it waits for first, and the buffer it gives back (once, whatever happens)."""

    def __init__(
        self,
        lease: Lease,
        files: list[FileToWrite],
        waits: list[Callable[[], None]],
        *,
        views_owned: bool,
    ) -> None:
        self.lease, self.files, self.waits = lease, files, waits
        self._views_owned = views_owned
        self._given_back = False

    @property
    def device(self) -> torch.device | None:
        return self.lease.device

    def wait(self) -> None:
        """Wait for device copies still landing in the buffer."""
        for w in self.waits:
            w()

    def give_back(self) -> None:
        """Return the buffer, once no device copy can still land in it (idempotent)."""
        if self._given_back:
            return
        self._given_back = True
        for w in self.waits:
            with contextlib.suppress(Exception):
                w()
        if self._views_owned:
            for f in self.files:
                if f.view is not None:
                    f.view.release()
        self.lease.give_back()


class Stager:
    """Copies states into a Checkpointer's staging memory on the caller's time."""

    def __init__(
        self, memory: StagingMemory, *, checksum_in: str, chunk_bytes: int, device_staging: bool
    ) -> None:
        if checksum_in not in CHECKSUM_IN:
            raise ValueError(
                f"checksum_in must be 'auto', 'background' or 'staging', got {checksum_in!r}"
            )
        if not isinstance(device_staging, bool):
            raise TypeError(f"device_staging must be True or False, got {device_staging!r}")
        self.memory = memory
        self.checksum_in = checksum_in
        self.chunk_bytes = chunk_bytes
        self.device_staging = device_staging
        self.threads: cf.ThreadPoolExecutor | None = None
        self.workers = max(1, torch.get_num_threads())  # copy threads (made on first use)
        self._lock = threading.Lock()
        self._closed = False
        #: a held save staged after close(): its own copy threads, on its thread only
        self._own = threading.local()

    def stage(
        self,
        planned: Sequence[tuple[str, FileImage]],
        store: Store,
        tel: SaveTelemetry,
        *,
        algorithm: str,
        folder: bool,
        lease: Lease | None = None,
    ) -> Staged:
        """Lease one buffer for every file of ``planned`` and copy them into it.

        ``folder``: the files are entries of a folder (each gets its own aligned slice and its
        entry name); otherwise ``planned`` is the one file of a file checkpoint. Fills
        ``tel``'s buffer wait, staging and checksum times, ``staged_on`` and sizes.
        ``lease``: a buffer leased already (a held save's, :mod:`.behind`), grown in place if
        the files need more.
        """
        images = [image for _, image in planned]
        bases, total = [], 0
        for image in images:
            bases.append(total)
            total += _aligned(image.size) if folder else image.size
        device = device_of(images, store) if self.device_staging else None
        if lease is None:
            lease = self.memory.lease(total, device)
        else:
            if lease.buf.capacity < total:
                lease.regrow(total)
            with self._lock:  # staged after close(timeout) gave up waiting: threads of its own
                own = self._closed
            if own:
                self._own.threads = cf.ThreadPoolExecutor(self.workers)
        tel.buffer_wait_s = lease.waited_s
        buf, device = lease.buf, lease.device
        waits: list[Callable[[], None]] = []
        all_crcs: list[ImageCrcs | None] = []
        try:
            for base, image in zip(bases, images):
                if device is None:
                    w, c = self.stage_image(image, buf, base, tel, algorithm=algorithm)
                else:
                    s0 = time.perf_counter()
                    w, c = stage_on_device(image, buf, base), None
                    tel.stage_s += time.perf_counter() - s0
                all_crcs.append(c)
                if w is not None:
                    waits.append(w)
        except BaseException:
            lease.give_back()
            raise
        finally:
            own_threads, self._own.threads = getattr(self._own, "threads", None), None
            if own_threads is not None:
                own_threads.shutdown()
        if device is not None:
            tel.staged_on = str(device)
        tel.bytes = sum(im.covered for im in images)
        tel.tensor_bytes = sum(im.tensor_bytes for im in images)
        files = []
        for base, (fname, image), crcs in zip(bases, planned, all_crcs):
            if not folder:
                files.append(
                    FileToWrite(
                        fname,
                        image,
                        buf.view if device is None else None,
                        crcs,
                        buf.tensor if device is not None else None,
                    )
                )
                continue
            cap = _aligned(image.size)
            on_device = buf.tensor[base : base + cap] if device is not None else None
            view = buf.view[base : base + cap] if device is None else None
            files.append(FileToWrite(fname, image, view, crcs, on_device, fname))
        return Staged(lease, files, waits, views_owned=folder)

    def stage_image(
        self,
        image: FileImage,
        buf: HostBuffer,
        base: int,
        tel: SaveTelemetry,
        *,
        algorithm: str,
    ) -> tuple[Callable[[], None] | None, ImageCrcs | None]:
        """Copy ``image`` into ``buf[base:]``, CRC-ing it too when it should.

        Adds to ``tel.stage_s`` (and ``tel.checksum_s``). Returns a callable that waits for
        pending device copies (``None`` when the bytes are in place) and the CRCs (``None`` when
        the background computes them).
        """
        s0 = time.perf_counter()
        crcs = None
        # CRCs serve the zip records of torch files and the crc32 chunk checksums; other digests
        # are computed after the CRC fields are filled in (in the background)
        wanted = algorithm == "crc32" or image.kind == "torch"
        if on_host(image):
            wait_device = None
            if wanted and self.hash_while_staging(device_copy_pending=False, image=image):
                crcs = stage_and_crc(
                    image, buf, base, chunk_bytes=self.chunk_bytes, pool=self.copy_threads()
                )
                tel.checksum_s += crcs.seconds
            else:
                stage_image(image, buf, base, pool=self.copy_threads, workers=self.workers)
        else:
            wait_device = stage_image(image, buf, base)
            pending = wait_device is not None
            if wanted and self.hash_while_staging(device_copy_pending=pending, image=image):
                if wait_device is not None:
                    wait_device()
                    wait_device = None
                h0 = time.perf_counter()
                crcs = crc_image(
                    image,
                    buf.view[base : base + image.size],
                    chunk_bytes=self.chunk_bytes,
                    pool=self.copy_threads(),
                )
                tel.checksum_s += time.perf_counter() - h0
        tel.stage_s += time.perf_counter() - s0
        return wait_device, crcs

    def hash_while_staging(self, *, device_copy_pending: bool, image: FileImage) -> bool:
        """Whether this save hashes its chunks on the caller's time (see ``checksum_in``)."""
        if self.checksum_in == "auto":
            return not device_copy_pending and not many_small_slots(image)
        return self.checksum_in == "staging"

    def copy_threads(self) -> cf.ThreadPoolExecutor:
        """The threads that copy-and-hash on the caller's time (created on first use)."""
        own = getattr(self._own, "threads", None)
        if own is not None:
            return own  # type: ignore[no-any-return]
        with self._lock:
            if self._closed:  # a save racing close() must not start threads nobody joins
                raise ClosedError(
                    "this Checkpointer is closed; create a new one to save or remove checkpoints"
                )
            if self.threads is None:
                self.threads = cf.ThreadPoolExecutor(
                    self.workers, thread_name_prefix="stagesave-hash"
                )
            return self.threads

    def close(self, *, wait: bool = True) -> None:
        """Join the copy threads (only ever busy inside a save: at once)."""
        with self._lock:
            self._closed = True
            threads, self.threads = self.threads, None
        if threads is not None:
            threads.shutdown(wait=wait)

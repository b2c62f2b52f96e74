"""Device staging: the file image kept in GPU memory, written by GPUDirect Storage where it can be.

With ``Checkpointer(device_staging=True)``, a save whose tensors live on one CUDA device lays the
file image out in a reused buffer *on that device*: device-to-device copies, a side stream, an
event (host tensors of the same state, such as optimizer step counters, are copied in too). The
caller waits for the copies to be queued, not for PCIe. The background then, chunk by chunk:

* copies the chunk to a pinned host bounce buffer on its own stream and hashes it (the manifest's
  checksums are computed from host bytes, as for every save);
* writes it: with kvikio installed, ``kvikio.CuFile.pwrite`` from GPU memory (GPUDirect Storage
  DMA where the driver and filesystem support it, kvikio's POSIX path otherwise); without kvikio,
  the bounce buffer with ``pwrite`` (O_DIRECT where the filesystem allows it).

Commit, fsync and rename are the usual ones. The cost is device memory: one buffer of the
checkpoint's size per save in flight. Only local files qualify (URLs and tiered roots use host
staging).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import errno
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import _fsops as fsops
from ._checksum import digest
from ._commit import WriteStats
from ._crash import crash_point
from ._image import FileImage
from ._local import LocalStore
from ._manifest import FileEntry, StorageRecord
from ._names import ALIGNMENT
from ._pool import HostBuffer
from ._store import Store

__all__ = ["device_of", "kvikio_module", "stage_on_device", "write_device_file"]


def kvikio_module() -> Any | None:
    """The ``kvikio`` module when it is installed and imports, else ``None``."""
    try:
        return importlib.import_module("kvikio")
    except Exception:  # noqa: BLE001 - any import failure means: not usable here
        return None


def device_of(image: FileImage, store: Store) -> torch.device | None:
    """The CUDA device to stage ``image`` on, or ``None`` when device staging does not apply.

    It applies when the image's device bytes are all on one CUDA device (host and meta tensors
    may be mixed in) and the target is a local file.
    """
    if not isinstance(store, LocalStore):
        return None
    kinds = {s.source.device.type for s in image.slots}
    if kinds - {"cuda", "cpu", "meta"}:
        return None
    devices = {s.source.device for s in image.slots if s.source.device.type == "cuda"}
    return devices.pop() if len(devices) == 1 else None


def _scatter_pieces(image: FileImage, out: torch.Tensor) -> None:
    """Write the image's small host pieces (zip headers, the pickle) into ``out`` in one scatter."""
    pieces = [(off, data) for off, data in image.pieces if data]
    if not pieces:
        return
    device = out.device
    packed = torch.frombuffer(bytearray(b"".join(d for _, d in pieces)), dtype=torch.uint8).to(device)
    lengths = torch.tensor([len(d) for _, d in pieces], dtype=torch.int64)
    starts = torch.tensor([off for off, _ in pieces], dtype=torch.int64)
    packed_starts = torch.cumsum(lengths, 0) - lengths
    shift = torch.repeat_interleave((starts - packed_starts).to(device), lengths.to(device),
                                    output_size=packed.numel())
    positions = torch.arange(packed.numel(), dtype=torch.int64, device=device) + shift
    out.index_copy_(0, positions, packed)


def stage_on_device(image: FileImage, buf: HostBuffer) -> Callable[[], None] | None:
    """Lay ``image`` out in ``buf.tensor[:image.size]`` (a device buffer; host works the same).

    Everything is queued on a side stream that first waits for the caller's stream; the caller's
    stream then waits for the side stream, so the next in-place update cannot race the copies.

    Returns:
        A callable that blocks until the copies have landed (``None`` when nothing is pending).
    """
    out = buf.tensor[: image.size]
    side: torch.cuda.Stream | None = None
    if out.device.type == "cuda":
        side = torch.cuda.Stream(device=out.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(out.device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        out.zero_()  # a reused buffer holds an older image: gaps and meta slots must read as zeros
        _scatter_pieces(image, out)
        # Host tensors first, with blocking copies: once save() returns they may change (a
        # non-blocking copy from pinned memory could still be reading them).
        for slot in image.slots:
            if slot.nbytes and slot.source.device.type == "cpu":
                out[slot.offset : slot.offset + slot.nbytes].copy_(slot.source)
        for slot in image.slots:
            src = slot.source
            if slot.nbytes == 0 or src.device.type in ("meta", "cpu"):
                continue
            out[slot.offset : slot.offset + slot.nbytes].copy_(src, non_blocking=True)
            if side is not None:
                src.record_stream(side)
    if side is None:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(side)
    torch.cuda.current_stream(out.device).wait_stream(side)
    return event.synchronize


@dataclass
class DeviceFile:
    """A data file whose bytes are ``buf.tensor[:size]`` in device memory."""

    name: str
    buf: HostBuffer
    size: int
    serialization_id: str | None
    id_offset: int | None
    storages: list[StorageRecord]


class _Bounces:
    """One pinned (or page-aligned) host buffer and one CUDA stream per writer thread."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        self.local = threading.local()
        self.all: list[HostBuffer] = []
        self.lock = threading.Lock()

    def get(self) -> tuple[HostBuffer, torch.cuda.Stream | None]:
        mine = getattr(self.local, "mine", None)
        if mine is None:
            cuda = self.device.type == "cuda"
            buf = HostBuffer.allocate(self.nbytes, pinned=cuda)
            stream = torch.cuda.Stream(device=self.device) if cuda else None  # type: ignore[no-untyped-call]
            mine = self.local.mine = (buf, stream)
            with self.lock:
                self.all.append(buf)
        return mine

    def to_host(self, src: torch.Tensor) -> memoryview:
        """Copy ``src`` (uint8, contiguous) into this thread's bounce buffer; its bytes."""
        buf, stream = self.get()
        n = src.numel()
        if stream is None:  # host memory (tests, or a CPU "device"): no torch op off-thread
            ctypes.memmove(buf.tensor.data_ptr(), src.data_ptr(), n)
        else:
            with torch.cuda.stream(stream):
                buf.tensor[:n].copy_(src, non_blocking=True)
            stream.synchronize()
        return buf.view[:n]

    def close(self) -> None:
        with self.lock:
            bufs, self.all = self.all, []
        for b in bufs:
            b.release_memory()


@contextlib.contextmanager
def _cufile(kvikio: Any, path: str) -> Iterator[Any]:
    f = kvikio.CuFile(path, "r+")
    try:
        yield f
    finally:
        f.close()


def write_device_file(
    store: LocalStore, f: DeviceFile, *, algorithm: str, chunk_bytes: int, pool: cf.Executor,
    stats: WriteStats, kvikio: Any | None,
) -> tuple[FileEntry, Callable[[], None], Callable[[], None]]:
    """Write a device image to an invisible temporary, hashing each chunk from a host copy.

    Returns:
        The manifest entry, and the publish and abort callables of the temporary.
    """
    t0 = time.perf_counter()
    crash_point("before_data")
    pending: Any = store.begin_write(f.name, memoryview(b""), f.size)
    device = f.buf.tensor.device
    span = (chunk_bytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    bounces = _Bounces(span, device)
    try:
        n_chunks = (f.size + chunk_bytes - 1) // chunk_bytes
        hash_time = [0.0] * n_chunks
        with _cufile(kvikio, pending.tmp) if kvikio is not None else contextlib.nullcontext() as cufile:
            # kvikio splits one large write over its own threads (GPUDirect DMA where it can);
            # meanwhile the pool copies each chunk to the host and hashes it.
            future = cufile.pwrite(f.buf.tensor[: f.size], f.size, 0) if cufile is not None else None

            def one(i: int) -> str:
                lo, hi = i * chunk_bytes, min(f.size, (i + 1) * chunk_bytes)
                # O_DIRECT writes whole pages: the bounce path writes the buffer's padding
                # after the image too (the buffer is larger; finish() truncates to the size).
                end = hi if future is not None or not pending.direct else min(
                    f.buf.capacity, (hi + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)
                host = bounces.to_host(f.buf.tensor[lo:end])
                h0 = time.perf_counter()
                d = digest(algorithm, host[: hi - lo])
                hash_time[i] = time.perf_counter() - h0
                if future is None:
                    pos = 0
                    while pos < end - lo:
                        n = fsops.pwrite(pending.fd, host[pos:], lo + pos)
                        if n <= 0:
                            raise OSError(errno.EIO, f"short write at offset {lo + pos}")
                        pos += n
                if i == 0 and n_chunks > 1:
                    crash_point("mid_data")
                return d

            # The file is closed on leaving this block: never with kvikio's writes in flight.
            try:
                digests = list(pool.map(one, range(n_chunks)))
            except BaseException:
                if future is not None:
                    with contextlib.suppress(Exception):  # the first error is the one to report
                        future.get()
                raise
            done = int(future.get()) if future is not None else f.size
            if done != f.size:
                raise OSError(errno.EIO, f"short GPUDirect Storage write: {done} of {f.size} bytes")
        crash_point("after_data")
        f0 = time.perf_counter()
        pending.finish()
        stats.fsync_s += time.perf_counter() - f0
        crash_point("after_data_fsync")
    except BaseException:
        pending.abort()
        raise
    finally:
        bounces.close()
    stats.checksum_s += sum(hash_time)
    stats.write_s += time.perf_counter() - t0
    stats.direct_io = bool(pending.direct) if kvikio is None else None
    entry = FileEntry(
        name=f.name.rsplit("/", 1)[-1],
        size=f.size,
        algorithm=algorithm,
        chunk_bytes=chunk_bytes,
        chunks=tuple(digests),
        kind="torch",
        serialization_id=f.serialization_id,
        id_offset=f.id_offset,
        storages=tuple(f.storages),
    )
    return entry, pending.publish, pending.abort

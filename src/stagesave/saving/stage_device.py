"""Device staging: the file image kept in GPU memory, written by GPUDirect Storage where it can be.

With ``Checkpointer(device_staging=True)``, a save (or a folder's files, ``save_dir``) whose
tensors live on one CUDA device is laid out in a reused buffer *on that device*: device-to-device
copies, a side stream, an event (host tensors of the same state, such as optimizer step counters,
are copied in too, through pinned memory). The caller waits for the copies to be queued, not for
PCIe. The background then:

* copies each chunk to a pinned host bounce buffer on its own stream and CRCs it (the zip
  records' CRCs, which the image holds before the data they cover), then again to fill those in
  and hash it (the proof's checksums are computed from host bytes, as for every save);
* writes the file: with kvikio installed and out of its compatibility mode, one
  ``kvikio.CuFile.pwrite`` of the whole image from GPU memory (GPUDirect Storage), meanwhile;
  otherwise each chunk's bounce buffer with ``pwrite`` (O_DIRECT where the filesystem allows it).

The background's torch work is CUDA copies on per-thread streams: no CPU kernels, so no OpenMP
team is started off the training thread.

Commit, fsync and rename are the usual ones. The cost is device memory: one buffer of the
checkpoint's size per save in flight. Only local files qualify (URLs and tiered roots use host
staging).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import functools
import importlib
import mmap
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .._crash import crash_point
from ..ondisk.checksum import digest
from ..ondisk.names import ALIGNMENT
from ..stores import posix as fsops
from ..stores.base import Store
from ..stores.local import LocalStore
from .bounces import Bounces
from .buffers import HostBuffer
from .plan import FileImage
from .stage import crc_image
from .write import FileToWrite, WriteStats, Written, entry_of, flush_data, late_end, run_all

__all__ = ["device_of", "gpudirect_kvikio", "stage_on_device", "write_device_data"]


@functools.lru_cache(maxsize=1)
def _import_kvikio() -> Any | None:
    try:
        return importlib.import_module("kvikio")
    except Exception:  # noqa: BLE001 - any import failure means: not usable here
        return None


def gpudirect_kvikio() -> Any | None:
    """The ``kvikio`` module when it is installed and would use GPUDirect Storage, else ``None``.

    In its compatibility mode (no ``libcufile``, ``/run/udev`` not readable as in most containers,
    ``KVIKIO_COMPAT_MODE=ON``) kvikio writes with POSIX calls through its own host bounce
    buffers: the device would be read twice (once more for the checksums), so the pinned
    bounce path is used instead.
    """
    kvikio = _import_kvikio()
    if kvikio is None:
        return None
    defaults = getattr(kvikio, "defaults", None)
    try:
        preferred = getattr(defaults, "is_compat_mode_preferred", None)
        if preferred is not None:  # kvikio >= 25.02
            return None if preferred() else kvikio
        mode = defaults.compat_mode()  # type: ignore[union-attr]  # older: a bool or a CompatMode
        off = getattr(getattr(kvikio, "CompatMode", None), "OFF", False)
        return kvikio if mode == off else None
    except Exception:  # noqa: BLE001 - a kvikio that cannot say is not used
        return None


def device_of(images: Sequence[FileImage], store: Store) -> torch.device | None:
    """The CUDA device to stage ``images`` on, or ``None`` when device staging does not apply.

    It applies when the images' device bytes are all on one CUDA device (host and meta tensors
    may be mixed in, and whole files of host tensors) and the target is a local file or folder.
    """
    if not isinstance(store, LocalStore):
        return None
    kinds = {s.device_type for image in images for s in image.slots}
    if kinds - {"cuda", "cpu", "meta"}:
        return None
    devices = {s.source.device for image in images for s in image.slots if s.device_type == "cuda"}
    return devices.pop() if len(devices) == 1 else None


#: Pieces at least this long are uploaded with a copy of their own instead of the scatter.
_SCATTER_MAX = 64 << 10


def _host_tensor(nbytes: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=dtype, pin_memory=pinned)


def _upload_from_host(image: FileImage, out: torch.Tensor) -> list[torch.Tensor]:
    """Queue the image's host bytes into ``out`` on the current stream, without waiting for it.

    The small pieces (zip headers, the pickle) are packed, with the position of every byte, into
    one pinned buffer and scattered by one kernel; host tensors (e.g. optimizer step counters)
    are first copied into pinned memory on this thread, so the caller may change them as soon as
    ``save`` returns, then uploaded without blocking. A blocking upload from pageable memory
    would make the caller wait for every kernel the training loop had queued.

    Returns:
        The pinned buffers, to keep alive until the copies have landed.
    """
    pinned = out.device.type == "cuda"
    keep: list[torch.Tensor] = []
    pieces = [(off, data) for off, data in image.pieces if 0 < len(data) < _SCATTER_MAX]
    large = [(off, data) for off, data in image.pieces if len(data) >= _SCATTER_MAX]
    for off, data in large:  # a big pickle: one copy rather than 8 bytes of index per byte
        part = _host_tensor(len(data), torch.uint8, pinned)
        part.numpy().data.cast("B")[:] = data
        out[off : off + len(data)].copy_(part, non_blocking=True)
        keep.append(part)
    if pieces:
        packed = _host_tensor(sum(len(d) for _, d in pieces), torch.uint8, pinned)
        packed.numpy().data.cast("B")[:] = b"".join(d for _, d in pieces)
        # byte j of the packed stream goes to start[k] + (j - packed_start[k]), k its piece
        lengths = torch.tensor([len(d) for _, d in pieces], dtype=torch.int64)
        starts = torch.tensor([off for off, _ in pieces], dtype=torch.int64)
        shift = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)
        positions = _host_tensor(packed.numel(), torch.int64, pinned)
        torch.add(torch.arange(packed.numel(), dtype=torch.int64), shift, out=positions)
        keep += [packed, positions]
        out.index_copy_(
            0, positions.to(out.device, non_blocking=True), packed.to(out.device, non_blocking=True)
        )
    host_slots = [s for s in image.slots if s.nbytes and s.device_type == "cpu"]
    if host_slots:
        snapshot = _host_tensor(sum(s.nbytes for s in host_slots), torch.uint8, pinned)
        at = 0
        for slot in host_slots:
            part = snapshot[at : at + slot.nbytes]
            part.copy_(slot.source)
            out[slot.offset : slot.offset + slot.nbytes].copy_(part, non_blocking=True)
            at += slot.nbytes
        keep.append(snapshot)
    return keep


def stage_on_device(image: FileImage, buf: HostBuffer, base: int = 0) -> Callable[[], None] | None:
    """Lay ``image`` out in ``buf.tensor[base : base + image.size]`` (a device buffer; host
    memory works the same).

    Everything is queued on a side stream that first waits for the caller's stream; the caller's
    stream then waits for the side stream, so the next in-place update cannot race the copies.
    Nothing here waits for the device.

    Returns:
        A callable that blocks until the copies have landed (``None`` when nothing is pending).
    """
    out = buf.tensor[base : base + image.size]
    side: torch.cuda.Stream | None = None
    if out.device.type == "cuda":
        side = torch.cuda.Stream(device=out.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(out.device))
    try:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            out.zero_()  # a reused buffer holds an older image: gaps must read as zeros
            keep = _upload_from_host(image, out)
            targets, sources = [], []
            for slot in image.slots:
                src = slot.source
                if slot.nbytes == 0 or src.device.type in ("meta", "cpu"):
                    continue
                targets.append(out[slot.offset : slot.offset + slot.nbytes])
                sources.append(src)
            if sources:
                # one call for all of them: torch groups same-dtype device copies into few
                # kernels (one launch per storage was the cost of many small tensors)
                torch._foreach_copy_(targets, sources, non_blocking=True)
                if side is not None:
                    for src in sources:
                        src.record_stream(side)
    except BaseException:
        if side is not None:
            side.synchronize()  # nothing queued may outlive the buffer
        raise
    if side is None:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(side)
    torch.cuda.current_stream(out.device).wait_stream(side)

    def wait() -> None:
        event.synchronize()
        keep.clear()  # the pinned host copies may go now

    return wait


@contextlib.contextmanager
def _cufile(kvikio: Any, path: str) -> Iterator[Any]:
    f = kvikio.CuFile(path, "r+")
    try:
        yield f
    finally:
        f.close()


def write_device_data(
    store: LocalStore, f: FileToWrite, *, algorithm: str, chunk_bytes: int, pool: cf.Executor,
    stats: WriteStats, kvikio: Any | None,
) -> Written:
    """Step 1 of a file staged in device memory: CRCs, every chunk written and durable.

    Two passes over the device buffer: the first copies each chunk to a host bounce buffer and
    CRCs it (the zip records' CRCs, which sit in the image before the data they cover), the
    second copies it again, fills in the CRCs, hashes and writes it (or, with kvikio, hashes it
    while kvikio writes the whole image from device memory, then rewrites the pages whose CRC
    fields it filled in). The proof is written by :meth:`Written.seal` as for host images.
    """
    data = f.device_data
    image = f.image
    covered = image.covered
    if data.numel() < (covered + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT:
        raise ValueError(
            f"device data of {data.numel()} bytes cannot hold {covered} bytes and their page "
            "padding"
        )
    t0 = time.perf_counter()
    span = (chunk_bytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    bounces = Bounces(span, data.device)
    try:
        h0 = time.perf_counter()
        crcs = crc_image(image, chunk_bytes=chunk_bytes, pool=pool,
                         chunk_view=lambda lo, hi: bounces.to_host(data[lo:hi]))
        stats.checksum_s += time.perf_counter() - h0
        fields: dict[int, list[tuple[int, bytes]]] = {}
        for i, at in enumerate(image.crc_fields):
            if at >= 0:
                value = crcs.slots[i].to_bytes(4, "little")
                for b in range(4):  # by byte: a field may straddle two chunks
                    fields.setdefault((at + b) // chunk_bytes, []).append(
                        (at + b, value[b : b + 1])
                    )
        cd = None
        if image.kind == "torch":
            assert image.zip is not None
            cd = image.zip.with_crcs({f"{image.zip.prefix}/data/{s.key}": crcs.slots[i]
                                      for i, s in enumerate(image.slots)})
        late = late_end(image)
        last_lo = covered // ALIGNMENT * ALIGNMENT
        kept: dict[str, bytes] = {}
        patched_pages: dict[int, bytes] = {}
        crash_point("before_data")
        pending: Any = store.begin_write(
            f.name, memoryview(b""), covered, tail=image.kind != "safetensors"
        )
    except BaseException:
        bounces.close()
        raise
    try:
        n_chunks = (covered + chunk_bytes - 1) // chunk_bytes
        hash_time = [0.0] * n_chunks
        with (
            _cufile(kvikio, pending.tmp)
            if kvikio is not None
            else contextlib.nullcontext() as cufile
        ):
            # kvikio splits one large write over its own threads (GPUDirect DMA where it can);
            # meanwhile the pool copies each chunk to the host and hashes it.
            future = cufile.pwrite(data[:covered], covered, 0) if cufile is not None else None

            def one(i: int) -> str:
                lo, hi = i * chunk_bytes, min(covered, (i + 1) * chunk_bytes)
                # O_DIRECT writes whole pages: the bounce path writes the buffer's padding
                # after the image too (the buffer is larger; finish() truncates to the size).
                end = hi if future is not None or not pending.direct else min(
                    data.numel(), (hi + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)
                host = bounces.to_host(data[lo:end])
                for at, value in fields.get(i, ()):
                    host[at - lo : at - lo + 1] = value
                    if future is not None:
                        page = at // ALIGNMENT * ALIGNMENT
                        patched_pages[page] = b""  # filled below, once every field of it is in
                if future is not None:
                    for page in [p for p in patched_pages if lo <= p < hi and not patched_pages[p]]:
                        patched_pages[page] = bytes(
                            host[page - lo : min(hi, page + ALIGNMENT) - lo]
                        )
                if lo < late:
                    kept["head"] = bytes(host[: min(late, hi) - lo])
                if lo <= last_lo < hi or (last_lo == hi and i == n_chunks - 1):
                    kept["last"] = bytes(host[last_lo - lo : hi - lo])
                h0 = time.perf_counter()
                d = digest(algorithm, host[: hi - lo])
                hash_time[i] = time.perf_counter() - h0
                if future is None:
                    start = max(lo, late) - lo
                    # the late pages (a safetensors header) are written with the proof
                    if lo + start < hi:
                        _pwrite_all(pending, host[start : end - lo], lo + start)
                if i == 0 and n_chunks > 1:
                    crash_point("mid_data")
                return d

            # The file is closed on leaving this block: never with kvikio's writes in flight.
            try:
                digests = run_all(pool, one, n_chunks)
            except BaseException:
                if future is not None:
                    with contextlib.suppress(Exception):  # the first error is the one to report
                        future.get()
                raise
            done = int(future.get()) if future is not None else covered
            if done != covered:
                raise OSError(
                    errno.EIO, f"short GPUDirect Storage write: {done} of {covered} bytes"
                )
        for page, content in sorted(patched_pages.items()):  # kvikio wrote the fields as zeros
            if page >= late:
                _pwrite_aligned(pending, content, page)
        flush_data(pending, stats)
    except BaseException:
        pending.abort()
        raise
    finally:
        bounces.close()
    stats.checksum_s += sum(hash_time)
    stats.write_s += time.perf_counter() - t0
    stats.direct_io = bool(pending.direct) if kvikio is None else None
    pending.last_block = kept.get("last", b"")

    def write_late(head: bytes) -> None:
        _pwrite_aligned(pending, head, 0)

    return Written(store, f, pending, entry_of(f, algorithm, chunk_bytes, digests), cd, write_late,
                   lambda: kept.get("head", b""))


def _pwrite_all(pending: Any, data: memoryview, offset: int) -> None:
    pos = 0
    while pos < len(data):
        n = fsops.pwrite(pending.fd, data[pos:], offset + pos)
        if n <= 0:
            raise OSError(errno.EIO, f"short write at offset {offset + pos}")
        if pending.direct and n % ALIGNMENT and pos + n < len(data):
            raise OSError(errno.EIO, "unaligned short write with O_DIRECT")
        pos += n


def _pwrite_aligned(pending: Any, data: bytes, offset: int) -> None:
    """Write ``data`` at the page-aligned ``offset`` from a page-aligned copy (O_DIRECT)."""
    n = (len(data) + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    bounce = mmap.mmap(-1, max(n, ALIGNMENT))  # freed with its last view (a traceback may hold one)
    bounce[: len(data)] = data
    _pwrite_all(pending, memoryview(bounce)[: n if pending.direct else len(data)], offset)

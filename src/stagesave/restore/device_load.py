"""A load onto a GPU: each chunk read into a pinned slot, checked there, and copied to the
device while the next chunks are read.

With ``map_location`` naming one CUDA device, the host image of :mod:`.image_load` would hold
the whole file in pageable memory, and every storage would then be copied to the device one
after another, after the last byte was read. Here a format-2 torch file's chunks pass through a
small ring of pinned host slots (one chunk each, about two per I/O thread): an I/O thread reads
a chunk into a free slot (``O_DIRECT`` where allowed), checks its digest there, and queues
non-blocking copies of the parts of the storages it holds into their device memory on a side
stream; a slot is taken again only once an event says its copies are done. Host memory holds
the pickle and the ring, never the file; the copies overlap the reads; the load waits for the
stream before any tensor is handed out. A damaged chunk is never copied.

The same code runs with the CPU as its "device" (slots unpinned, copies synchronous): that is
how it is tested on machines without a GPU.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import os
import queue
import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from ..ondisk.manifest import Manifest
from ..ondisk.names import ALIGNMENT
from ..saving.buffers import HostBuffer
from ..stores.base import Reader
from .image_load import Image, chunk_reads, direct_for, each_chunk, read_chunk
from .proof import chunk_problems

__all__ = ["RING_BYTES", "read_to_device", "target_device"]

#: The most pinned host memory a load's ring takes (at least two chunks).
RING_BYTES = 512 << 20


def target_device(map_location: Any) -> torch.device | None:
    """The one CUDA device ``map_location`` names (``None``: anything else, or no CUDA here)."""
    if not isinstance(map_location, (str, torch.device)):
        return None
    try:
        device = torch.device(map_location)
    except (RuntimeError, TypeError, ValueError):
        return None
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class _Slot:
    """One chunk's room in host memory, and the event after its last copies (CUDA)."""

    __slots__ = ("buffer", "done", "tensor", "view")

    def __init__(self, nbytes: int, pinned: bool) -> None:
        # page-aligned either way (O_DIRECT reads land in it): pinned memory from CUDA's host
        # allocator, else an anonymous mapping
        self.buffer = HostBuffer.allocate(nbytes, pinned=pinned)
        self.tensor, self.view = self.buffer.tensor, self.buffer.view
        self.done: Any = None


class _Copier:
    """Copies into device memory: non-blocking on a side stream (CUDA), else synchronous."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = (torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                       if device.type == "cuda" else None)
        if self.stream is not None:
            # The device memory was just allocated on the current stream, perhaps from blocks
            # that work queued there before still reads: the copies come after that work.
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def context(self) -> Any:
        if self.stream is None:
            return nullcontext()
        return torch.cuda.stream(self.stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.stream is not None)

    def mark(self) -> Any:
        """An event after every copy queued so far (``None``: copies are synchronous)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def read_to_device(
    reader: Reader, fd: int | None, manifest: Manifest, pool: cf.Executor, where: str,
    device: torch.device, *, check: bool = True, workers: int = 4,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[Image, list[str]]:
    """Read (and ``check``) every chunk of the file into ``device`` memory, storage by storage;
    the image (its pickle in host memory, its storages on the device) and the problems.

    ``fd``: the local file's descriptor (chunks read with ``O_DIRECT`` where allowed); ``None``
    for other stores, whose reader fills each slot. ``meanwhile`` runs on this thread while
    the pool reads."""
    entry = manifest.files[0]
    records = sorted(entry.storages, key=lambda r: r.offset)
    memory = {r.key: torch.empty(r.nbytes, dtype=torch.uint8, device=device) for r in records}
    first = records[0].offset if records else entry.end
    head = bytearray(first)
    ends = [r.offset + r.nbytes for r in records]
    room = (entry.chunk_bytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    pinned = device.type == "cuda"
    free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
    slots = [_Slot(room, pinned) for _ in range(max(2, min(2 * workers, RING_BYTES // room)))]
    for slot in slots:
        free.put(slot)
    copier = _Copier(device)
    direct, cached = chunk_reads(fd, entry.end)
    lock = threading.Lock()  # chunk bytes of the head land from several threads

    def one(i: int) -> str | None:
        lo, hi = entry.chunk_range(i)
        slot = free.get()
        try:
            if slot.done is not None:
                slot.done.synchronize()  # its last chunk's copies are done: the room is free
            got = read_chunk(reader, direct_for(direct, cached, lo, hi - lo), lo, hi - lo,
                             slot.view)
            data = slot.view[: hi - lo]
            if got != hi - lo:
                return f"{where}: truncated at byte {lo + got}"
            if check:
                problems = chunk_problems(None, manifest, indices=[i], where=where,
                                          read=lambda a, n: data[a - lo : a - lo + n])
                if problems:
                    return problems[0]
            if lo < first:
                with lock:
                    head[lo : min(hi, first)] = data[: min(hi, first) - lo]
            with copier.context():
                for k in range(bisect.bisect_right(ends, lo), len(records)):
                    r = records[k]
                    if r.offset >= hi:
                        break
                    a, b = max(lo, r.offset), min(hi, r.offset + r.nbytes)
                    if a < b:
                        copier.copy(memory[r.key][a - r.offset : b - r.offset],
                                    slot.tensor[a - lo : b - lo])
                slot.done = copier.mark()
            return None
        finally:
            free.put(slot)

    try:
        problems = each_chunk(pool, one, len(entry.chunks), meanwhile)
    finally:
        copier.finish()  # no slot or device buffer goes while a copy from or into it may run
        if direct is not None:
            os.close(direct)
    if bytes(head[:4]) != b"PK\x03\x04":
        problems.append(f"{where}: not a zip archive at byte 0")
    name_len = int.from_bytes(head[26:28], "little")
    extra_len = int.from_bytes(head[28:30], "little")
    start = min(30 + name_len + extra_len, len(head))
    image = Image(memoryview(b""), {r.key: r for r in records}, 0, where,
                  bytes(head[start:]), memory=memory)
    return image, problems

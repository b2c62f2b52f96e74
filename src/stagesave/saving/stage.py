"""Staging: copy a planned file image into a host buffer, on the caller's time.

This is the only part of a save that the training loop waits for. The small pieces (zip headers,
the pickled structure) are copied as bytes. Then either

* :func:`stage_image` copies each storage with torch, which splits large copies over its
  intra-op threads; CUDA storages are copied with ``non_blocking=True`` on a side stream of
  their device into pinned memory, all of one device's in one ``_foreach_copy_``; the device's
  current stream is made to wait for that stream (so the next in-place update cannot race the
  copy) and the background writer waits on the events before it touches the bytes; or
* :func:`stage_and_crc`, for state in host memory, copies *and* hashes: each hashing thread
  takes whole checksum chunks, copies them half an L2 cache at a time (``memmove``, GIL released)
  and CRCs each piece right after, while it is still in the core's cache. The CRCs give both the
  chunk checksums and each zip record's CRC (format 2). The hash then costs ~0.1-0.2x of the
  copy instead of a second pass over memory (``benchmarks/bench_sweep.py``).

Neither runs a torch op on a background thread: torch ops off the training thread were reported
to switch libgomp to passive waiting and slow training down for as long as that thread lives
(not reproduced by ``benchmarks/bench_omp.py`` on a 2-vCPU VM; kept as a precaution).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
from collections.abc import Callable
from typing import Any

import torch

from .buffers import HostBuffer
from .crc_pass import SUB_CHUNK, crc_image, crc_pass, many_small_slots
from .files import ImageCrcs
from .host_copy import BIG, HostCopies, copy_in
from .plan import FileImage

__all__ = [
    "SUB_CHUNK", "ImageCrcs", "crc_image", "many_small_slots", "on_host", "stage_and_crc",
    "stage_image",
]


def on_host(image: FileImage) -> bool:
    """Whether every byte of ``image`` is in host memory (so :func:`stage_and_hash` applies)."""
    if image.copies is not None:
        return True  # a reused plan's: host memory only
    return all(s.device_type in ("cpu", "meta") for s in image.slots)


def _fill_skeleton(image: FileImage, buf: HostBuffer, base: int) -> None:
    """Write the small pieces and zero everything no storage covers (reused buffers hold old bytes).

    Meta tensors have no bytes: their slots are zeroed too.
    """
    view = buf.view[base : base + image.size]
    held, buf.holds = buf.holds, None
    if image.gapless:
        pieces = image.pieces
        static = image.static
        if static is not None and held == (base, image.size, static[0]):
            # The buffer still holds this frame's static pieces (the descriptors' CRC fields
            # from the last save are overwritten before the write, see write.fill_crcs).
            _, lo, hi = static
            pieces = [*pieces[:lo], *pieces[hi:]]
        for off, data in pieces:
            view[off : off + len(data)] = data
        if static is not None:
            buf.holds = (base, image.size, static[0])
        return
    dst_all = buf.tensor[base : base + image.size]
    spans = sorted([(off, off + len(data)) for off, data in image.pieces]
                   + [(s.offset, s.offset + s.nbytes) for s in image.slots
                      if s.device_type != "meta"])
    covered = 0
    for lo, hi in spans:
        if lo > covered:
            dst_all[covered:lo].zero_()
        covered = max(covered, hi)
    if covered < image.size:
        dst_all[covered : image.size].zero_()
    for off, data in image.pieces:
        view[off : off + len(data)] = data


def stage_image(image: FileImage, buf: HostBuffer, base: int = 0, *,
                pool: Callable[[], cf.Executor] | None = None,
                workers: int = 0) -> Callable[[], None] | None:
    """Copy ``image`` into ``buf[base : base + image.size]``.

    ``pool`` gives the copy threads (``workers``) that share large host copies with this thread.

    Returns:
        ``None`` when the bytes are in place; otherwise a callable that blocks until pending
        device-to-host copies have landed (the writer calls it before reading the buffer).
    """
    _fill_skeleton(image, buf, base)
    view = buf.view[base : base + image.size]
    dst_address = buf.tensor.data_ptr() + base
    if image.copies is not None:  # a reused plan's, checked by its planner
        copy_in(view, dst_address, image.copies, pool, workers)
        return None
    copies = HostCopies()
    others = []
    move = ctypes.memmove
    for slot in image.slots:
        n = slot.nbytes
        if n == 0 or slot.device_type == "meta":
            continue
        address = slot.host_address()
        if address is None:
            others.append(slot)
        elif n < BIG:  # one memmove now (no object kept per slot: 100,000 would wake the GC)
            move(dst_address + slot.offset, address, n)
        else:
            copies.big.append((slot.offset, address, n))
    copy_in(view, dst_address, copies, pool, workers)
    dst_all = buf.tensor[base : base + image.size]
    on_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for slot in others:
        src = slot.source
        dst = dst_all[slot.offset : slot.offset + slot.nbytes]
        if src.device.type == "cuda":
            targets, sources = on_device.setdefault(src.device, ([], []))
            targets.append(dst)
            sources.append(src)
        elif src.device.type == "cpu":
            dst.copy_(src)
        else:
            dst.copy_(src.cpu())
    events = [_copy_from(device, *pairs) for device, pairs in on_device.items()]
    if not events:
        return None

    def wait_for_device() -> None:
        for event in events:
            event.synchronize()

    return wait_for_device


def _copy_from(device: torch.device, targets: list[torch.Tensor],
               sources: list[torch.Tensor]) -> Any:
    """Queue the copies of ``sources`` (on CUDA ``device``) into ``targets`` (pinned host
    memory) on a side stream of that device, in one call (one Python call per storage was the
    cost of a state of many small tensors); the device's current stream then waits for them.
    The event after the copies."""
    side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        torch._foreach_copy_(targets, sources, non_blocking=True)
    for src in sources:
        src.record_stream(side)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(side)
    torch.cuda.current_stream(device).wait_stream(side)
    return event


def _runs(image: FileImage, buf: HostBuffer, base: int) -> list[tuple[int, int, int]]:
    """``(start, end, source address)`` of every host slot to memmove (others copied here by
    torch)."""
    dst_all = buf.tensor[base : base + image.size]
    runs = []
    for slot in image.slots:
        if slot.nbytes == 0 or slot.device_type == "meta":
            continue
        address = slot.host_address()
        if address is not None:
            runs.append((slot.offset, slot.offset + slot.nbytes, address))
        else:  # not expected from the planners; copied by torch here, hashed in the pass
            dst_all[slot.offset : slot.offset + slot.nbytes].copy_(
                slot.source.reshape(-1).view(torch.uint8)
            )
    runs.sort()
    return runs


def stage_and_crc(
    image: FileImage, buf: HostBuffer, base: int = 0, *, chunk_bytes: int, pool: cf.Executor,
) -> ImageCrcs:
    """Copy a host-memory ``image`` into ``buf[base:]`` and CRC every chunk and slot as it lands.

    Returns when every byte is in place and hashed.

    Raises:
        ValueError: a storage is not in host memory (use :func:`stage_image`).
    """
    if not on_host(image):
        raise ValueError("stage_and_crc needs every storage in host memory")
    _fill_skeleton(image, buf, base)
    runs = _runs(image, buf, base)
    view = buf.view[base : base + image.size]
    return crc_pass(
        image, chunk_bytes, pool, lambda lo, hi: view[lo:hi], (runs, buf.tensor.data_ptr() + base)
    )

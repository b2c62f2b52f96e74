"""Staging: copy a planned file image into a host buffer, on the caller's thread.

This is the only part of a save that the training loop waits for. The small pieces (zip headers,
the pickled structure) are copied as bytes; each storage is copied by torch, which splits large
copies over its intra-op threads. CUDA storages are copied with ``non_blocking=True`` on a side
stream into pinned memory; the caller's stream is made to wait for that stream (so the next
in-place update cannot race the copy) and the background writer waits on an event before it
touches the bytes. Nothing here runs on a background thread: torch ops off the training thread
were reported to switch libgomp to passive waiting and slow training down for as long as that
thread lives (not reproduced by ``benchmarks/bench_omp.py`` on a 2-vCPU VM; kept as a precaution).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._image import FileImage
from ._pool import HostBuffer

__all__ = ["stage_image"]


def stage_image(image: FileImage, buf: HostBuffer, base: int = 0) -> Callable[[], None] | None:
    """Copy ``image`` into ``buf[base : base + image.size]``.

    Returns:
        ``None`` when the bytes are in place; otherwise a callable that blocks until pending
        device-to-host copies have landed (the writer calls it before reading the buffer).
    """
    view = buf.view[base : base + image.size]
    dst_all = buf.tensor[base : base + image.size]
    # Whatever torch does not write is zero in a torch.save file; reused buffers hold old bytes.
    spans = sorted([(off, off + len(data)) for off, data in image.pieces]
                   + [(s.offset, s.offset + s.nbytes) for s in image.slots])
    covered = 0
    for lo, hi in spans:
        if lo > covered:
            dst_all[covered:lo].zero_()
        covered = max(covered, hi)
    if covered < image.size:
        dst_all[covered : image.size].zero_()
    for off, data in image.pieces:
        view[off : off + len(data)] = data
    side: torch.cuda.Stream | None = None
    for slot in image.slots:
        if slot.nbytes == 0:
            continue
        src = slot.source
        dst = dst_all[slot.offset : slot.offset + slot.nbytes]
        if src.device.type == "cuda":
            if side is None:
                side = torch.cuda.Stream(device=src.device)  # type: ignore[no-untyped-call]
                side.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
                src.record_stream(side)
        elif src.device.type == "cpu":
            dst.copy_(src)
        elif src.device.type != "meta":
            dst.copy_(src.cpu())
    if side is None:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(side)
    torch.cuda.current_stream(side.device).wait_stream(side)

    def wait_for_device() -> None:
        event.synchronize()

    return wait_for_device

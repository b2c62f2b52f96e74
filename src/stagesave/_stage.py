"""Staging: copy a planned file image into a host buffer, on the caller's time.

This is the only part of a save that the training loop waits for. The small pieces (zip headers,
the pickled structure) are copied as bytes. Then either

* :func:`stage_image` copies each storage with torch, which splits large copies over its
  intra-op threads; CUDA storages are copied with ``non_blocking=True`` on a side stream into
  pinned memory; the caller's stream is made to wait for that stream (so the next in-place update
  cannot race the copy) and the background writer waits on an event before it touches the bytes;
  or
* :func:`stage_and_hash`, for state in host memory, copies *and* hashes: each hashing thread
  takes whole checksum chunks, copies them half an L2 cache at a time (``memmove``, GIL released)
  and hashes each piece right after, while it is still in the core's cache. The hash then costs
  ~0.1-0.2x of the copy instead of a second pass over memory (``benchmarks/bench_sweep.py``).

Neither runs a torch op on a background thread: torch ops off the training thread were reported
to switch libgomp to passive waiting and slow training down for as long as that thread lives
(not reproduced by ``benchmarks/bench_omp.py`` on a 2-vCPU VM; kept as a precaution).
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import ctypes
import os
import threading
import time
from collections.abc import Callable

import torch

from ._checksum import hasher
from ._image import FileImage
from ._pool import HostBuffer

__all__ = ["on_host", "stage_and_hash", "stage_image"]

def _l2_cache_bytes() -> int | None:
    """The per-core level-2 cache of CPU 0 as Linux reports it (``None`` when it does not)."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(root)
    except OSError:
        return None
    for entry in sorted(entries):
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(root, entry, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(root, entry, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(root, entry, "size")) as f:
                size = f.read().strip()
        except OSError:
            continue
        if level != "2" or kind not in ("Unified", "Data"):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (ValueError, IndexError):
            return None
    return None


def sub_chunk_bytes(l2_bytes: int | None) -> int:
    """Bytes one thread copies before hashing them: half the core's L2 cache, 128 KiB-1 MiB.

    The copy reads the source and writes the destination through the cache, then the hash reads
    the destination again; with both halves in L2 the hash never goes back to memory. Measured on
    a 1 MiB-L2 core (2 GiB state, 2 threads): 1 MiB sub-chunks 1.18-1.41 x a plain copy, 512 KiB
    1.01-1.22 x (``benchmarks/bench_stage_subchunk.py``). Unknown caches get 512 KiB.
    """
    if not l2_bytes:
        return 512 << 10
    return max(128 << 10, min(1 << 20, (l2_bytes // 2) // 4096 * 4096))


#: Bytes one thread copies before hashing them (see :func:`sub_chunk_bytes`).
SUB_CHUNK = sub_chunk_bytes(_l2_cache_bytes())


def on_host(image: FileImage) -> bool:
    """Whether every byte of ``image`` is in host memory (so :func:`stage_and_hash` applies)."""
    return all(s.source.device.type in ("cpu", "meta") for s in image.slots)


def _fill_skeleton(image: FileImage, buf: HostBuffer, base: int) -> None:
    """Write the small pieces and zero everything no storage covers (reused buffers hold old bytes).

    Meta tensors have no bytes: their slots are zeroed too.
    """
    view = buf.view[base : base + image.size]
    dst_all = buf.tensor[base : base + image.size]
    spans = sorted([(off, off + len(data)) for off, data in image.pieces]
                   + [(s.offset, s.offset + s.nbytes) for s in image.slots
                      if s.source.device.type != "meta"])
    covered = 0
    for lo, hi in spans:
        if lo > covered:
            dst_all[covered:lo].zero_()
        covered = max(covered, hi)
    if covered < image.size:
        dst_all[covered : image.size].zero_()
    for off, data in image.pieces:
        view[off : off + len(data)] = data


def stage_image(image: FileImage, buf: HostBuffer, base: int = 0) -> Callable[[], None] | None:
    """Copy ``image`` into ``buf[base : base + image.size]``.

    Returns:
        ``None`` when the bytes are in place; otherwise a callable that blocks until pending
        device-to-host copies have landed (the writer calls it before reading the buffer).
    """
    _fill_skeleton(image, buf, base)
    dst_all = buf.tensor[base : base + image.size]
    side: torch.cuda.Stream | None = None
    for slot in image.slots:
        src = slot.source
        if slot.nbytes == 0 or src.device.type == "meta":
            continue
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
        else:
            dst.copy_(src.cpu())
    if side is None:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(side)
    torch.cuda.current_stream(side.device).wait_stream(side)

    def wait_for_device() -> None:
        event.synchronize()

    return wait_for_device


def stage_and_hash(
    image: FileImage, buf: HostBuffer, base: int = 0, *, algorithm: str, chunk_bytes: int,
    pool: cf.Executor,
) -> tuple[list[str], float]:
    """Copy a host-memory ``image`` into ``buf[base:]`` and hash every chunk as it lands.

    Chunk ``i`` covers ``[i * chunk_bytes, (i + 1) * chunk_bytes)`` of the image, as the writers
    and the manifest count them. Returns when every byte is in place and hashed.

    Returns:
        The chunk digests, and the seconds the hashing added (summed over the threads, divided
        by their number).

    Raises:
        ValueError: a storage is not in host memory (use :func:`stage_image`).
    """
    if not on_host(image):
        raise ValueError("stage_and_hash needs every storage in host memory")
    _fill_skeleton(image, buf, base)
    dst_all = buf.tensor[base : base + image.size]
    runs: list[tuple[int, int, int]] = []  # (start, end, source address), sorted, disjoint
    for slot in image.slots:
        src = slot.source
        if slot.nbytes == 0 or src.device.type == "meta":
            continue
        if src.is_contiguous() and src.numel() * src.element_size() >= slot.nbytes:
            runs.append((slot.offset, slot.offset + slot.nbytes, src.data_ptr()))
        else:  # not expected from the planners; copied by torch here, hashed below
            dst_all[slot.offset : slot.offset + slot.nbytes].copy_(src.reshape(-1).view(torch.uint8))
    runs.sort()
    starts = [r[0] for r in runs]
    dst = buf.tensor.data_ptr() + base
    view = buf.view[base : base + image.size]
    size = image.size

    def one_chunk(i: int) -> tuple[str, float, int]:
        lo, hi = i * chunk_bytes, min(size, (i + 1) * chunk_bytes)
        h = hasher(algorithm)
        k = max(0, bisect.bisect_right(starts, lo) - 1)
        hashing = 0.0
        p = lo
        while p < hi:
            q = min(hi, p + SUB_CHUNK)
            while k < len(runs) and runs[k][0] < q:
                start, end, src = runs[k]
                a, b = max(start, p), min(end, q)
                if a < b:
                    ctypes.memmove(dst + a, src + (a - start), b - a)
                if end > q:
                    break
                k += 1
            t = time.perf_counter()
            h.update(view[p:q])
            hashing += time.perf_counter() - t
            p = q
        return h.hexdigest(), hashing, threading.get_ident()

    n = (size + chunk_bytes - 1) // chunk_bytes
    done = list(pool.map(one_chunk, range(n)))
    threads = len({ident for _, _, ident in done}) or 1
    return [d for d, _, _ in done], sum(t for _, t, _ in done) / threads

"""CRC-32 of a staged image in one pass: every checksum chunk and every storage record's zip
CRC, optionally memmoving the storages in first (:func:`.stage.stage_and_crc`). No torch here:
a writer agent (:mod:`stagesave.agent`) hashes with it without importing torch."""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import ctypes
import os
import threading
import time
from collections.abc import Callable

from ..ondisk.checksum import crc32, crc32_combine
from ..ondisk.checksum import raw_crc32 as _crc32
from .files import ImageCrcs
from .image import FileImage

__all__ = ["SMALL_SLOT", "SUB_CHUNK", "crc_image", "crc_pass", "many_small_slots"]


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

#: Slots up to this size are hashed twice (alone, and with their neighbours for the chunk) while
#: in cache, instead of once plus a CRC combine: fewer Python steps per slot for states of many
#: small tensors; larger slots are hashed once.
SMALL_SLOT = 64 << 10

#: Images whose slots average fewer bytes than this are copied and hashed on the calling thread:
#: their time goes into Python steps per slot, which more threads only serialize on the GIL
#: (0.5 GiB in 8,000 tensors: 154 ms on one thread, 164 ms on two; 0.25 GiB in 100,000: 451 vs
#: 622 ms; ``benchmarks/bench_shapes.py``).
SERIAL_BELOW = 1 << 20


def many_small_slots(image: FileImage) -> bool:
    """Whether ``image``'s slots average fewer than :data:`SERIAL_BELOW` bytes (its staging time
    goes into Python steps per slot rather than into moving bytes)."""
    n = image.nonempty_slots
    return n > 1 and image.covered // n < SERIAL_BELOW


def _bounds(image: FileImage) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Non-empty slots as ``(start, end, slot index)`` sorted, and their starts."""
    bounds = sorted(
        (s.offset, s.offset + s.nbytes, i) for i, s in enumerate(image.slots) if s.nbytes
    )
    return bounds, [b[0] for b in bounds]


def crc_pass(
    image: FileImage,
    chunk_bytes: int,
    pool: cf.Executor,
    chunk_view: Callable[[int, int], memoryview],
    copy: tuple[list[tuple[int, int, int]], int] | None = None,
) -> ImageCrcs:
    """CRC-32 every chunk of ``[0, image.covered)`` and every slot, memmoving ``copy`` runs first.

    ``chunk_view(lo, hi)`` gives the bytes ``[lo, hi)`` of the image (once a chunk's copy is
    done). Each thread takes whole chunks and walks them half an L2 cache at a time: the copy of
    a piece (when copying) and its CRC run while it is in cache. A slot's CRC is built from the
    parts the chunks saw (:func:`crc32_combine`), so the data is read once.
    """
    size = image.covered
    bounds, starts = _bounds(image)
    nb = len(bounds)
    runs = copy[0] if copy is not None else []
    run_starts = [r[0] for r in runs]
    dst = copy[1] if copy is not None else 0

    def one_chunk(i: int) -> tuple[int, list[tuple[int, int, int, int]], float, int]:
        lo, hi = i * chunk_bytes, min(size, (i + 1) * chunk_bytes)
        k = max(0, bisect.bisect_right(starts, lo) - 1)
        r = max(0, bisect.bisect_right(run_starts, lo) - 1)
        running = 0
        parts: list[tuple[int, int, int, int]] = []  # (slot index, start, crc, length)
        cur, cur_start, cur_crc, cur_len = -1, 0, 0, 0
        hashing = 0.0
        view: memoryview | None = None if copy is not None else chunk_view(lo, hi)
        p = lo
        while p < hi:
            q = min(hi, p + SUB_CHUNK)
            while r < len(runs) and runs[r][0] < q:
                start, end, src = runs[r]
                a, b = max(start, p), min(end, q)
                if a < b:
                    ctypes.memmove(dst + a, src + (a - start), b - a)
                if end > q:
                    break
                r += 1
            if view is None:
                view = chunk_view(lo, hi)
            t = time.perf_counter()
            x = p
            while x < q:
                while k < nb and bounds[k][1] <= x:
                    k += 1
                if cur < 0:
                    # Small slots wholly inside this piece, with the bytes between them: one CRC of
                    # the run for the chunk and one per slot (the bytes are in cache; one Python
                    # step per slot instead of a CRC and a combine for each slot and each gap).
                    j, end = k, x
                    while j < nb:
                        s, e, idx = bounds[j]
                        if s < x or e > q or e - s > SMALL_SLOT:
                            break
                        parts.append((idx, s, crc32(view[s - lo : e - lo]), e - s))
                        end = e
                        j += 1
                    if j > k:
                        running = crc32(view[x - lo : end - lo], running)
                        x, k = end, j
                        continue
                if k < nb and bounds[k][0] <= x:
                    y = min(q, bounds[k][1])
                    if cur != bounds[k][2]:
                        if cur >= 0:
                            running = crc32_combine(running, cur_crc, cur_len)
                            parts.append((cur, cur_start, cur_crc, cur_len))
                        cur, cur_start, cur_crc, cur_len = bounds[k][2], x, 0, 0
                    cur_crc = crc32(view[x - lo : y - lo], cur_crc)
                    cur_len += y - x
                else:
                    if cur >= 0:
                        running = crc32_combine(running, cur_crc, cur_len)
                        parts.append((cur, cur_start, cur_crc, cur_len))
                        cur = -1
                    y = min(q, bounds[k][0]) if k < nb else q
                    running = crc32(view[x - lo : y - lo], running)
                x = y
            hashing += time.perf_counter() - t
            p = q
        if cur >= 0:
            running = crc32_combine(running, cur_crc, cur_len)
            parts.append((cur, cur_start, cur_crc, cur_len))
        return running, parts, hashing, threading.get_ident()

    n = (size + chunk_bytes - 1) // chunk_bytes
    if many_small_slots(image):
        # Mostly Python steps per slot: more threads only contend for the GIL.
        done = [one_chunk(i) for i in range(n)]
    else:
        done = list(pool.map(one_chunk, range(n)))
    slot_parts: dict[int, list[tuple[int, int, int]]] = {}
    for _, chunk_parts, _, _ in done:
        for idx, start, crc, length in chunk_parts:
            slot_parts.setdefault(idx, []).append((start, crc, length))
    slots = [0] * len(image.slots)
    for idx, pieces in slot_parts.items():
        if len(pieces) == 1:
            slots[idx] = pieces[0][1]
            continue
        crc = 0
        for _, c, length in sorted(pieces):
            crc = crc32_combine(crc, c, length)
        slots[idx] = crc
    threads = len({ident for _, _, _, ident in done}) or 1
    return ImageCrcs(slots, [d[0] for d in done], chunk_bytes, sum(d[2] for d in done) / threads)


def crc_image(
    image: FileImage, view: memoryview | None = None, *, chunk_bytes: int, pool: cf.Executor,
    chunk_view: Callable[[int, int], memoryview] | None = None,
) -> ImageCrcs:
    """CRC-32 every chunk and slot of an image already staged in ``view`` (host memory), or
    whose chunks ``chunk_view(lo, hi)`` brings to the host (device staging)."""
    if chunk_view is None:
        assert view is not None
        if many_small_slots(image):
            return _slot_by_slot(image, view, chunk_bytes)
        whole = view

        def chunk_view(lo: int, hi: int) -> memoryview:
            return whole[lo:hi]

    return crc_pass(image, chunk_bytes, pool, chunk_view)


def _slot_by_slot(image: FileImage, view: memoryview, chunk_bytes: int) -> ImageCrcs:
    """:func:`crc_pass`'s CRCs of an image of many small slots staged in ``view``: each chunk
    hashed, then each slot alone, in C loops on this thread (as :func:`crc_pass` runs such an
    image: not on the I/O threads, which a folder's writes may be waiting for).

    :func:`crc_pass` reads the bytes once, but takes ~4 µs of Python per slot (0.4 s of the
    writer's time per save at 100,000 tensors); here the slots' bytes are read a second time
    (memory speed) and the steps per slot are made by C (``map``), ~0.5 µs each."""
    t = time.perf_counter()
    size = image.covered
    n = (size + chunk_bytes - 1) // chunk_bytes

    def one_chunk(i: int) -> int:
        return _crc32(view[i * chunk_bytes : min(size, (i + 1) * chunk_bytes)])

    chunks = list(map(one_chunk, range(n)))
    slots = image.slots
    starts = [s.offset for s in slots]
    ends = [s.offset + s.nbytes for s in slots]
    crcs = list(map(_crc32, map(view.__getitem__, map(slice, starts, ends))))
    return ImageCrcs(crcs, chunks, chunk_bytes, time.perf_counter() - t)

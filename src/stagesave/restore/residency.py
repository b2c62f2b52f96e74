"""Which pages of a file the page cache holds (``mincore`` over a mapping that is never touched).

A verified local load reads its chunks with ``O_DIRECT``: from the disk, at its speed, without
filling the page cache with a second copy of what the load keeps in its own buffer. When the
file's pages are in the page cache already (a restart right after a save, a second load of the
same checkpoint, a file just copied in), reading them from the disk again is the slow way: a
chunk whose pages are mostly cached is read through the cache instead (a copy at memory speed).
The residency of each page is asked once per load, before the reads; a page evicted meanwhile is
read by the kernel as any buffered read would.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

__all__ = ["cached_pages", "mostly_cached"]

_PROT_READ = 1
_MAP_SHARED = 1
_MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = mmap.PAGESIZE
#: Each byte of ``mincore``'s vector to its lowest bit (the others are reserved).
_LOW_BIT = bytes(i & 1 for i in range(256))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):  # pragma: no cover - no mincore on this system
        return None


def cached_pages(fd: int, size: int) -> bytes | None:
    """Per page of the file's first ``size`` bytes, ``1`` where the page cache holds it, else
    ``0``; ``None`` when that cannot be told (an empty file, a filesystem that refuses the
    mapping, no ``mincore``)."""
    try:
        size = min(size, os.fstat(fd).st_size)
    except OSError:
        return None
    libc = _libc()
    if size <= 0 or libc is None:
        return None
    address = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        return None
    try:
        vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
        if libc.mincore(address, size, vec) != 0:
            return None
        return vec.raw.translate(_LOW_BIT)
    finally:
        libc.munmap(address, size)


def mostly_cached(pages: bytes, lo: int, n: int) -> bool:
    """Whether at least half of the pages of bytes ``[lo, lo + n)`` are cached."""
    span = pages[lo // PAGE : (lo + n + PAGE - 1) // PAGE]
    return bool(span) and 2 * span.count(1) >= len(span)

"""How much of a range of this process's memory is in RAM (``mincore``), for tests that check
what a buffer holds or gave back."""

from __future__ import annotations

import ctypes
import mmap


def resident_pages(address: int, length: int) -> int:
    """How many of the pages of ``[address, address + length)`` are in memory (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = address // page * page
    n = (address + length - start + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec)

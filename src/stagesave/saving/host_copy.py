"""Copying bytes in host memory into a staging buffer, on the caller's time.

Two costs meet here. A small piece (a few KiB) costs its Python call, which is why a state of
100,000 small tensors spends most of its copy in calls: those are copied on the calling thread
by memoryview slice assignment (100,000 × 2.5 KiB: 72 ms, against 98 ms by ``ctypes.memmove``
and 149 ms by ``copy_`` into warm twins). A large piece costs memory bandwidth, which one
thread does not saturate: pieces of 64 KiB or more are split into runs of equal bytes and copied
by ``ctypes.memmove`` (which releases the GIL) on the copy threads and the calling thread at
once (8,000 × 64 KiB: 52 ms on two threads, 86 ms on one, 104 ms by ``copy_``). Measured on
this 2-vCPU VM by ``benchmarks/bench_host_copy.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["BIG", "HostCopies", "copy_in", "host_view"]

#: Pieces of at least this many bytes are copied by memmove, spread over the copy threads.
BIG = 64 << 10


@dataclass
class HostCopies:
    """What one image copies from host memory, offsets into the image: ``small`` as
    ``(offset, bytes)`` (memoryviews of the source, copied by the calling thread), ``big`` as
    ``(offset, address, nbytes)``."""

    small: list[tuple[int, memoryview]] = field(default_factory=list)
    big: list[tuple[int, int, int]] = field(default_factory=list)



def host_view(address: int, nbytes: int) -> memoryview:
    """A byte view of ``nbytes`` of host memory at ``address`` (no copy, no owner: valid only
    while whoever owns that memory keeps it; the source of a small piece in
    :attr:`HostCopies.small`)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _memmoves(dst: int, moves: Sequence[tuple[int, int, int]]) -> None:
    move = ctypes.memmove
    for offset, address, nbytes in moves:
        move(dst + offset, address, nbytes)


def _runs(moves: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """``moves`` cut into at most ``parts`` consecutive runs of about equal bytes."""
    total = sum(m[2] for m in moves)
    runs: list[list[tuple[int, int, int]]] = [[]]
    share, filled = total / parts, 0
    for m in moves:
        if filled >= share * len(runs) and len(runs) < parts:
            runs.append([])
        runs[-1].append(m)
        filled += m[2]
    return runs


def copy_in(view: memoryview, dst: int, copies: HostCopies,
            pool: Callable[[], cf.Executor] | None, workers: int) -> None:
    """Copy ``copies`` into ``view`` (whose first byte is at address ``dst``).

    ``pool``: gives the copy threads (``workers`` of them) that share the large pieces with the
    calling thread, asked for only when there are large pieces; ``None`` copies everything here.
    """
    runs = [copies.big]
    pending: list[cf.Future[None]] = []
    if pool is not None and len(copies.big) > 1:
        runs = _runs(copies.big, workers + 1)
        if len(runs) > 1:
            threads = pool()
            pending = [threads.submit(_memmoves, dst, run) for run in runs[1:]]
    try:
        _memmoves(dst, runs[0])
        for offset, data in copies.small:
            view[offset : offset + len(data)] = data
    finally:
        for f in pending:
            f.result()

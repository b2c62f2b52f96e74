"""Verifications remembered, so the load that follows ``latest()`` does not hash the file again.

A verification of a local file is remembered (:func:`remember_verified`) by the identity of the
inode it read (device, inode, size, mtime and ctime in nanoseconds) and the proof it matched, so
that the load that follows ``latest()`` does not read and hash the same bytes again; any change
of the file, in place or by a rename over it, changes that identity.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

from ..ondisk.manifest import FileEntry
from ..stores.base import Reader

__all__ = [
    "VERIFIED_TTL_S", "forget_verified", "remember_verified", "stat_identity", "verified_before",
]

#: How long a verification is reused by the load that follows it.
VERIFIED_TTL_S = 600.0
_VERIFIED_MAX = 256
_verified_lock = threading.Lock()
_verified: OrderedDict[str, tuple[tuple[int, ...], FileEntry, float]] = OrderedDict()


def stat_identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells one state of a file from another: inode, size, mtime and ctime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _identity(reader: Reader) -> tuple[int, ...] | None:
    fd = reader.fileno()
    if fd is None:
        return None  # not a local file: nothing stable to recognise it by
    return stat_identity(os.fstat(fd))


def remember_verified(reader: Reader, entry: FileEntry) -> None:
    """Note that every chunk of ``reader``'s file matched ``entry`` (local files only)."""
    ident = _identity(reader)
    if ident is None:
        return
    with _verified_lock:
        _verified[reader.where] = (ident, entry, time.monotonic())
        _verified.move_to_end(reader.where)
        while len(_verified) > _VERIFIED_MAX:
            _verified.popitem(last=False)


def verified_before(reader: Reader, entry: FileEntry) -> bool:
    """Whether this very file (same inode, size, mtime and ctime) was verified against ``entry``
    by this process in the last :data:`VERIFIED_TTL_S` seconds."""
    ident = _identity(reader)
    if ident is None:
        return False
    with _verified_lock:
        got = _verified.get(reader.where)
    return (got is not None and got[0] == ident and got[1] == entry
            and time.monotonic() - got[2] < VERIFIED_TTL_S)


def forget_verified() -> None:
    """Forget every remembered verification (tests, benchmarks)."""
    with _verified_lock:
        _verified.clear()

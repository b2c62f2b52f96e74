"""Every mutating POSIX call the local store makes, in one place.

The commit protocol's safety rests on the order of these calls (write, fsync, rename, directory
fsync). Routing them through this module lets the fault-injection suite wrap the real calls —
record them and replay a simulated power loss after any one of them, or make one fail with
ENOSPC/EIO — without a mock filesystem. In production each function is the ``os`` call itself.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

__all__ = [
    "close", "fsync", "ftruncate", "makedirs", "open", "posix_fadvise", "posix_fallocate",
    "pwrite", "rename", "replace", "rmtree", "unlink", "write",
]


def open(path: str, flags: int, mode: int = 0o777) -> int:  # noqa: A001 - mirrors os.open
    return os.open(path, flags, mode)


def close(fd: int) -> None:
    os.close(fd)


def pwrite(fd: int, data: Any, offset: int) -> int:
    return os.pwrite(fd, data, offset)


def write(fd: int, data: Any) -> int:
    return os.write(fd, data)


def fsync(fd: int) -> None:
    os.fsync(fd)


def ftruncate(fd: int, length: int) -> None:
    os.ftruncate(fd, length)


def posix_fallocate(fd: int, offset: int, length: int) -> None:
    os.posix_fallocate(fd, offset, length)


def posix_fadvise(fd: int, offset: int, length: int, advice: int) -> None:
    os.posix_fadvise(fd, offset, length, advice)


def replace(src: str, dst: str) -> None:
    os.replace(src, dst)


def rename(src: str, dst: str) -> None:
    os.rename(src, dst)


def unlink(path: str) -> None:
    os.unlink(path)


def makedirs(path: str, exist_ok: bool = False) -> None:
    os.makedirs(path, exist_ok=exist_ok)


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)

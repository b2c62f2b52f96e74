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
    "close", "exchange", "fsync", "fsync_dir", "ftruncate", "link", "makedirs", "mkdir", "open",
    "posix_fadvise", "posix_fallocate", "pwrite", "rename", "replace", "rmdir", "rmtree", "symlink",
    "unlink", "write",
]


def open(path: str, flags: int, mode: int = 0o777) -> int:
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


def rmtree(path: str, ignore_errors: bool = True) -> None:
    shutil.rmtree(path, ignore_errors=ignore_errors)


def symlink(target: str, path: str) -> None:
    os.symlink(target, path)


def fsync_dir(path: str) -> None:
    """fsync a directory, so that renames and new entries in it survive a power loss.

    The one error policy of the product: filesystems that cannot fsync a directory at all
    (EINVAL, ENOTSUP, EBADF on some network and FUSE filesystems) are accepted, since they give
    no stronger primitive; every other error (EIO above all) propagates.
    """
    import errno

    fd = open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        close(fd)


def link(src: str, dst: str) -> None:
    os.link(src, dst, follow_symlinks=False)


def mkdir(path: str) -> None:
    os.mkdir(path)


def rmdir(path: str) -> None:
    os.rmdir(path)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = None


def exchange(a: str, b: str) -> None:
    """Swap two paths atomically (``renameat2(RENAME_EXCHANGE)``).

    Raises:
        OSError: ENOSYS/EINVAL/ENOTSUP where the kernel, libc or filesystem cannot do it.
    """
    global _renameat2
    if _renameat2 is None:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, "renameat2", None)
        if fn is None:
            _renameat2 = False
        else:
            fn.argtypes = [
                ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint,
            ]
            fn.restype = ctypes.c_int
            _renameat2 = fn
    if _renameat2 is False:
        import errno

        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), a, None, b)

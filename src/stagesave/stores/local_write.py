"""Writing a data file into a POSIX directory: a temporary sibling, then an atomic rename.

Data goes to a temporary file next to its final name with O_DIRECT in large aligned ranges, so a
checkpoint burst neither floods the page cache nor makes the training process stall in writeback
(measured here: buffered writes + fsync raised the p99 step time 96x, O_DIRECT 1.8x). Where
O_DIRECT is refused (tmpfs, some network filesystems) the same writes go through the page cache
and the written range is dropped from it after the fsync. ``publish`` is ``rename`` + a directory
fsync: atomic replace, also for ``last.ckpt``. Every mutating call goes through ``posix``.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets

from ..ondisk.names import ALIGNMENT, TMP_MARKER
from . import posix as fsops
from .base import PendingWrite

__all__ = ["LocalPendingWrite", "makedirs_durable", "temp_name_for"]

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def makedirs_durable(path: str) -> None:
    """``mkdir -p`` whose new directories survive a power loss (each parent fsynced)."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            fsops.mkdir(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue
        fsops.fsync_dir(os.path.dirname(d))


def temp_name_for(path: str) -> str:
    """A temporary sibling of ``path``; names carry the pid so gc can tell live from dead."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}-{secrets.token_hex(4)}{TMP_MARKER}")


class LocalPendingWrite(PendingWrite):
    """A temporary file next to ``final``, filled from the image, renamed over ``final``."""

    def __init__(
        self, final: str, image: memoryview, size: int, direct: bool, tail: bool = False
    ) -> None:
        self.final = final
        self.tmp = temp_name_for(final)
        self.image = image
        self.size = size
        self.length = size  # grows with the tail
        #: The image's last partial page when ``image`` does not hold it (device staging).
        self.last_block: bytes | None = None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.direct = False
        fd = -1
        if direct and _O_DIRECT and len(image) % ALIGNMENT == 0:
            try:
                fd = fsops.open(self.tmp, flags | _O_DIRECT, 0o644)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        if fd < 0:
            fd = fsops.open(self.tmp, flags, 0o644)
        self.fd = fd
        try:
            if size and hasattr(os, "posix_fallocate"):
                try:
                    fsops.posix_fallocate(fd, 0, size)  # fail fast on a full disk
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
        except BaseException:
            self.abort()
            raise

    def write_range(self, lo: int, hi: int) -> None:
        if self.direct:
            # O_DIRECT needs aligned lengths: write the padding too, truncate in finish().
            hi = min(len(self.image), (hi + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)
        pos = lo
        while pos < hi:
            n = fsops.pwrite(self.fd, self.image[pos:hi], pos)
            if n <= 0:
                raise OSError(errno.EIO, f"short write at offset {pos}")
            if self.direct and n % ALIGNMENT and pos + n < hi:
                raise OSError(errno.EIO, "unaligned short write with O_DIRECT")
            pos += n

    def write_tail(self, data: bytes) -> None:
        """Append ``data`` at ``size``: with O_DIRECT, the last partial block of the image is
        written again together with the tail from an aligned bounce buffer."""
        if self.direct:
            lo = self.size // ALIGNMENT * ALIGNMENT
            n = self.size - lo + len(data)
            # page-aligned; freed when the last view of it goes (an error's traceback may hold one)
            bounce = mmap.mmap(-1, (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)
            bounce[: self.size - lo] = (self.image[lo : self.size] if self.last_block is None
                                        else self.last_block[: self.size - lo])
            bounce[self.size - lo : n] = data
            view = memoryview(bounce)
            pos = 0
            while pos < len(bounce):
                written = fsops.pwrite(self.fd, view[pos:], lo + pos)
                if written <= 0 or (written % ALIGNMENT and pos + written < len(bounce)):
                    raise OSError(errno.EIO, f"short write at offset {lo + pos}")
                pos += written
        else:
            view = memoryview(data)
            pos = 0
            while pos < len(view):
                written = fsops.pwrite(self.fd, view[pos:], self.size + pos)
                if written <= 0:
                    raise OSError(errno.EIO, f"short write at offset {self.size + pos}")
                pos += written
        self.length = self.size + len(data)

    def flush(self) -> None:
        fsops.fsync(self.fd)

    def finish(self) -> None:
        if self.direct and self.length % ALIGNMENT:
            fsops.ftruncate(self.fd, self.length)
        # An fsync error is fatal: the page cache may have dropped the dirty pages, so retrying
        # could report success for bytes that never reached the disk.
        fsops.fsync(self.fd)
        if not self.direct and hasattr(os, "posix_fadvise"):
            fsops.posix_fadvise(self.fd, 0, self.length, os.POSIX_FADV_DONTNEED)
        # Linux releases the descriptor even when close reports an error: never close it twice.
        fd, self.fd = self.fd, -1
        fsops.close(fd)

    def publish(self) -> None:
        # Keep the replaced file reachable until the rename is durable, so that a failing
        # directory fsync can put it back instead of leaving the new bytes under the old manifest.
        backup = None
        if os.path.lexists(self.final):
            backup = temp_name_for(self.final)
            try:
                fsops.link(self.final, backup)
            except OSError:
                backup = None  # no hard links here (some network filesystems): best effort
        try:
            fsops.replace(self.tmp, self.final)
        except BaseException:
            if backup is not None:
                with contextlib.suppress(OSError):
                    fsops.unlink(backup)
            raise
        try:
            fsops.fsync_dir(os.path.dirname(self.final))
        except BaseException:
            with contextlib.suppress(OSError):
                if backup is not None:
                    fsops.replace(backup, self.final)
                    backup = None
                else:
                    fsops.rename(self.final, self.tmp)  # abort() removes it
            raise
        finally:
            if backup is not None:
                with contextlib.suppress(OSError):
                    fsops.unlink(backup)

    def abort(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                fsops.close(self.fd)
            self.fd = -1
        with contextlib.suppress(OSError):
            fsops.unlink(self.tmp)

"""The floors a save is measured against: copying the state's bytes once, writing them once.

- copy floor: every tensor copied once into a preallocated, already-touched buffer (what the
  staging copy cannot beat on this machine);
- disk floor: the same number of bytes written to the target folder with ``O_DIRECT`` in 64 MiB
  requests, then fsync (what the disk does without any page cache or serialization). Where the
  filesystem refuses ``O_DIRECT`` (tmpfs) the floor is measured buffered and says so.
"""

from __future__ import annotations

import errno
import mmap
import os
import statistics
import time
from collections.abc import Iterable

import torch

from ..stores import posix as fsops
from ..stores.local import temp_name_for

__all__ = ["copy_floor_s", "disk_floor_s"]

_BLOCK = 64 << 20


def copy_floor_s(tensors: Iterable[torch.Tensor], repeats: int = 3) -> float:
    """Median seconds to copy every tensor once into a reused, already-touched host buffer."""
    ts = [t.detach() for t in tensors if t.device.type == "cpu"]
    n = sum(t.numel() * t.element_size() for t in ts)
    buf = torch.empty(n, dtype=torch.uint8)
    buf.fill_(0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        off = 0
        for t in ts:
            b = t.numel() * t.element_size()
            buf[off : off + b].copy_(t.reshape(-1).view(torch.uint8))
            off += b
        times.append(time.perf_counter() - t0)
    del buf
    return statistics.median(times)


def disk_floor_s(folder: str, nbytes: int) -> tuple[float, bool]:
    """Seconds to write ``nbytes`` (rounded up to 64 MiB requests) into ``folder`` and fsync.

    Returns the seconds scaled to ``nbytes`` and whether the write really was ``O_DIRECT``.
    """
    buf = mmap.mmap(-1, _BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(4096) * (_BLOCK // 4096))
    count = max(1, -(-nbytes // _BLOCK))
    # named as stagesave names its temporaries: `stagesave gc` removes it if this process dies
    path = temp_name_for(os.path.join(folder, "disk-floor"))
    fsops.close(fsops.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    direct = getattr(os, "O_DIRECT", 0)
    try:
        try:
            dt = _timed_write(path, buf, count, direct)
        except (
            OSError
        ) as exc:  # O_DIRECT refused by this filesystem (at open or at the first write)
            if not direct or exc.errno != errno.EINVAL:
                raise
            direct = 0
            dt = _timed_write(path, buf, count, 0)
    finally:
        fsops.unlink(path)
        buf.close()
    return dt * nbytes / (count * _BLOCK), bool(direct)


def _timed_write(path: str, buf: mmap.mmap, count: int, flags: int) -> float:
    fd = fsops.open(path, os.O_WRONLY | flags)
    view = memoryview(buf)
    try:
        t0 = time.perf_counter()
        for i in range(count):
            done = 0
            while done < _BLOCK:
                n = fsops.pwrite(fd, view[done:], i * _BLOCK + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"short write at offset {i * _BLOCK + done}")
                done += n
        fsops.fsync(fd)
        return time.perf_counter() - t0
    finally:
        view.release()
        fsops.close(fd)

"""Whole files in memory, as the commands that rewrite or copy them need them.

``export`` and ``migrate`` read a file once, through one :class:`~stagesave.stores.base.Reader` (one
version of it), into page-aligned memory, then judge *those bytes*: the proof is read and
checked through a :class:`MemReader` over the same memory, so what is written afterwards is
exactly what was checked, even if the name is replaced meanwhile.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import mmap
from collections.abc import Callable, Iterator

from ..errors import IntegrityError
from ..ondisk.names import ALIGNMENT
from ..saving.buffers import HostBuffer
from ..stores.base import Reader

__all__ = ["Loaded", "MemReader", "load_bytes"]

#: Bytes read per request when a file is read into memory.
READ_STEP = 32 * 1024 * 1024


class MemReader(Reader):
    """A :class:`Reader` over bytes already in memory (they are the version judged)."""

    def __init__(self, data: memoryview, where: str, name: str = "", mtime: float = 0.0) -> None:
        self.data, self.where, self.name, self.mtime = data, where, name, mtime
        self.size = len(data)

    def read(self, offset: int, length: int) -> bytes:
        if offset >= self.size or length <= 0:
            return b""
        return bytes(self.data[offset : offset + length])

    def readinto(self, offset: int, out: memoryview) -> int:
        n = max(0, min(len(out), self.size - offset))
        out[:n] = self.data[offset : offset + n]
        return n


class Loaded:
    """A whole file in memory: ``view`` (exactly its bytes) inside a page-aligned ``buffer``
    (``None`` when the file is memory-mapped instead); close it to give the memory back."""

    def __init__(
        self, view: memoryview, buffer: HostBuffer | None, close: Callable[[], None]
    ) -> None:
        self.view, self.buffer, self._close = view, buffer, close

    def detach(self) -> HostBuffer:
        """Keep the buffer past the ``with`` block: the caller releases it (``release_memory``)."""
        assert self.buffer is not None, "a memory-mapped file has no buffer to keep"
        self._close = lambda: None
        return self.buffer

    def close(self) -> None:
        try:
            self.view.release()
            self._close()
        except BufferError:  # a slice is still referenced somewhere: the GC frees it later
            pass


def _round_up(n: int) -> int:
    return max(ALIGNMENT, (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)


@contextlib.contextmanager
def load_bytes(
    reader: Reader, *, pool: cf.Executor, advance: Callable[[float], None] = lambda n: None,
    mapped: bool = False,
) -> Iterator[Loaded]:
    """Every byte of ``reader``'s file in memory.

    ``mapped``: memory-map a local file read-only instead of copying it (no memory of the file's
    size; the pages come from the very inode ``reader`` opened). Otherwise the bytes are read in
    parallel into a page-aligned host buffer (what O_DIRECT writes and staging need).

    Raises:
        IntegrityError: the file ended early (truncated while being read).
    """
    size = reader.size
    fd = reader.fileno() if mapped else None
    if fd is not None and size > 0:
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        loaded = Loaded(memoryview(mm)[:size], None, mm.close)
        advance(size)
        try:
            yield loaded
        finally:
            loaded.close()
        return
    buf = HostBuffer.allocate(_round_up(size), pinned=False)
    view = buf.view[:size]

    def one(lo: int) -> None:
        hi = min(size, lo + READ_STEP)
        n = reader.readinto(lo, view[lo:hi])
        advance(n)
        if n != hi - lo:
            raise IntegrityError(
                f"{reader.where} is truncated at byte {lo + n} (it changed while being read)"
            )

    loaded = Loaded(view, buf, buf.release_memory)
    try:
        list(pool.map(one, range(0, size, READ_STEP)))
        yield loaded
    finally:
        loaded.close()

"""File-like sinks and readers over a planned image: ``torch.save`` writes into a sink that
keeps only the small pieces at their offsets (tensor data is skipped), and reads back through a
reader that serves those pieces (and zeros between them)."""

from __future__ import annotations

import bisect
import io
from typing import Any

try:  # torch >= 2.7: records can be aligned to pages
    from torch.utils.serialization import config as _torch_save_config
# torch 2.6: records are 64-byte aligned (the whole image is still written in pages)
except ImportError:
    _torch_save_config = None  # type: ignore[assignment]


__all__ = ["SinkFull", "SparseReader", "SparseSink"]


class SinkFull(Exception):
    """More bytes were written into a :class:`SparseSink` than its limit (raised by its user)."""


class SparseSink(io.RawIOBase):
    """A write-only file that keeps written pieces and only remembers the extent of skipped ones."""

    def __init__(self, limit: int | None = None) -> None:
        """``limit``: keep at most this many bytes (past it nothing is kept and ``full`` is
        set: the writer checks it, see :class:`SinkFull`)."""
        super().__init__()
        self.pos = 0
        self.end = 0
        self.pieces: list[tuple[int, bytes]] = []
        self.limit, self.kept, self.full = limit, 0, False

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        if self.limit is not None:
            n = len(memoryview(b).cast("B"))
            self.kept += n
            if self.kept > self.limit:  # nothing more kept (torch's C++ writer calling this
                self.full = True        # turns an exception raised here into its own)
                self.pos += n
                self.end = max(self.end, self.pos)
                return n
        data = bytes(b)
        if data:
            self.pieces.append((self.pos, data))
        self.pos += len(data)
        self.end = max(self.end, self.pos)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self.pos = offset
        elif whence == io.SEEK_CUR:
            self.pos += offset
        else:
            self.pos = self.end + offset
        self.end = max(self.end, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def coalesced(self) -> list[tuple[int, bytes]]:
        """The pieces sorted, with contiguous runs joined (fewer, larger copies when staging)."""
        out: list[tuple[int, bytes]] = []
        run_start, run = -1, []
        end = -1
        for off, data in sorted(self.pieces, key=lambda p: p[0]):
            if off == end:
                run.append(data)
            else:
                if run:
                    out.append((run_start, b"".join(run)))
                run_start, run = off, [data]
            end = off + len(data)
        if run:
            out.append((run_start, b"".join(run)))
        return out


class SparseReader(io.RawIOBase):
    """Reads the sparse skeleton as if it were the file (zeros where tensor bytes will go)."""

    def __init__(self, size: int, pieces: list[tuple[int, bytes]]) -> None:
        super().__init__()
        self.size = size
        self.pieces = pieces  # sorted, non-overlapping
        self.starts = [off for off, _ in pieces]
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self.size - self.pos))
        start, stop = self.pos, self.pos + n
        view[:n] = bytes(n)
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.pieces) and self.pieces[i][0] < stop:
            off, data = self.pieces[i]
            lo, hi = max(off, start), min(off + len(data), stop)
            if lo < hi:
                view[lo - start : hi - start] = data[lo - off : hi - off]
            i += 1
        self.pos = stop
        return n


#: Types whose objects torch's ``persistent_id`` never names (it names storages only): the
#: pickler asks about every object it meets, so these skip torch's check (exact types only;
#: subclasses still go through it).

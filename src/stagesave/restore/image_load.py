"""A load read straight into the memory its tensors keep, verified as it lands.

``torch.load(mmap=True)`` after verification reads the file twice over the page cache: once to
hash it (a copy into a scratch buffer), once more as the tensors are first touched (a fault per
page). Here the proven bytes of a format-2 torch file are read once, with parallel ``O_DIRECT``
reads of whole chunks into one page-aligned buffer (through the page cache for a chunk whose
pages it holds already: :mod:`.residency`), each chunk hashed while it is in cache; the
pickle runs in the safe unpickler with a ``persistent_load`` that hands out storages over that
buffer (no second copy; :mod:`.image_unpickle`). Storage ids are checked against the file's
proof: a known key, a size within its record.

The unpickling need not wait for the storages' bytes: once the chunks that hold the pickle are
read and checked, the C unpickler's first try (:mod:`.fast_unpickle`, which makes tensors over
the buffer without reading them) runs while the other chunks are still being read
(``early``, for files of :data:`EARLY_BYTES_PER_STORAGE` or more per storage); nothing it made
is handed out before every chunk is checked, and where it stops the whole unpickling runs after
the reads, as without it.

An unverified load reads the same way without hashing. Files in other stores (S3, fsspec)
are read the same way through their reader, each chunk hashed as it lands. It applies to every
format-2 torch file, with ``mmap`` left to stagesave. The buffer stays alive as long as any
tensor does, headers and padding included; where tensors fill less than
:data:`MIN_TENSOR_SHARE` of the file (many small tensors, each padded to a page), their bytes
are packed to the buffer's head once every chunk is checked (moved down in place; the tensors
are made where they will be) and the memory behind the rest is given back, so that a load
never keeps more memory than its tensors.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ondisk.manifest import FileEntry, Manifest, StorageRecord
from ..ondisk.names import ALIGNMENT
from ..saving.buffers import HostBuffer
from ..stores.base import Reader
from .proof import chunk_problems, reporting, run_chunks
from .residency import cached_pages, mostly_cached

__all__ = [
    "Image", "applies", "each_chunk", "read_image", "read_proven",
]

#: Tensors must fill at least this share of the file for the load to keep the file's buffer
#: (else they are packed into one of their own).
MIN_TENSOR_SHARE = 0.8
#: From this many storages a file verified moments ago is still loaded through an image (its
#: unpickling costs a fraction of ``torch.load``'s per storage); below, ``torch.load`` maps it.
MANY_STORAGES = 1024
#: Where packed storages start (torch's own alignment of records in a zip).
_PACK_ALIGN = 64
#: A file's pickle is unpickled beside its reads (``early``) only where it has at least this
#: many bytes per storage: the unpickling then takes less than the reads, which it overlaps
#: (~20 us of Python per storage against ~2 GB/s of reads). Below, the unpickling outlasts the
#: reads, and beside them it only slows down (both cores busy): 100,000 storages of 2.5 KiB
#: loaded 10-15% slower that way on this VM's disk, 8,000 of 64 KiB 7-9% faster on a disk
#: limited to 400 MB/s (BENCHMARKS.md).
EARLY_BYTES_PER_STORAGE = 32 << 10


@dataclass
class Image:
    """A torch file's proven bytes in memory: where its pickle starts and its storages."""

    view: memoryview
    storages: dict[str, StorageRecord]
    pickle_at: int
    where: str
    #: the pickle's bytes, when ``view`` holds only the storages (packed) or nothing (``memory``)
    pickle: bytes | None = None
    #: each storage's bytes in a device's memory (:mod:`.device_load`), by key; ``view`` empty
    memory: dict[str, torch.Tensor] | None = None


def applies(entry: FileEntry) -> bool:
    """Whether a verified load of this file reads it into one buffer (see the module)."""
    tensors = sum(s.nbytes for s in entry.storages)
    return (entry.kind == "torch" and entry.chunk_bytes % ALIGNMENT == 0 and tensors > 0
            # under a fake-tensor mode torch.load makes storage-less tensors; so does the load
            and torch._guards.detect_fake_mode(None) is None)


def direct_reader(fd: int) -> int | None:
    """The same file opened again for ``O_DIRECT`` reads (``None``: not supported here)."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except (OSError, AttributeError):
        return None


def chunk_reads(fd: int | None, size: int) -> tuple[int | None, bytes | None]:
    """For a local file's descriptor: the same file opened for ``O_DIRECT`` (``None``: not
    supported, or not a local file) and which pages of its first ``size`` bytes the page cache
    holds (:mod:`.residency`; ``None``: not known). Close the first when done."""
    direct = direct_reader(fd) if fd is not None else None
    return direct, cached_pages(fd, size) if fd is not None and direct is not None else None


def direct_for(direct: int | None, cached: bytes | None, lo: int, n: int) -> int | None:
    """``direct`` for the chunk ``[lo, lo + n)`` unless the page cache holds most of its pages
    (then ``None``: read through the cache, at memory speed rather than the disk's)."""
    if direct is None or (cached is not None and mostly_cached(cached, lo, n)):
        return None
    return direct


def read_chunk(reader: Reader, direct: int | None, lo: int, n: int, room: memoryview) -> int:
    """Read ``n`` bytes of the file from ``lo`` into the start of ``room`` (page-aligned, at
    least ``n`` rounded up to :data:`ALIGNMENT` long where ``direct`` is given); how many came.

    ``direct``: a descriptor of the file opened for ``O_DIRECT`` (:func:`direct_reader`), used
    for whole pages; the rest, or all where a filesystem refuses it, is read through ``reader``."""
    got = 0
    if direct is not None and lo % ALIGNMENT == 0:
        want = (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        try:
            while got < n and got % ALIGNMENT == 0:
                step = os.preadv(direct, [room[got:want]], lo + got)
                if step <= 0:
                    break
                got += step
        except OSError:  # a filesystem that refuses this O_DIRECT read: read it buffered
            got = got // ALIGNMENT * ALIGNMENT
        got = min(got, n)
    if got < n:  # the rest (or all) buffered: a short O_DIRECT read, no O_DIRECT here
        got += reader.readinto(lo + got, room[got:n])
    return got


def each_chunk(pool: cf.Executor, job: Callable[[int], str | None], n: int,
               meanwhile: Callable[[], None] | None = None,
               done: Callable[[int, str | None], None] | None = None) -> list[str]:
    """``job(i)`` for chunks ``0..n-1`` on ``pool``, ``meanwhile`` on this thread while they
    run (every job finished before this returns or raises); the problems the jobs returned, in
    chunk order. ``done``: as :func:`.proof.chunk_problems`'s."""
    return [p for p in run_chunks(pool, job if done is None else reporting(job, done), range(n),
                                  meanwhile) if p]


def read_image(reader: Reader, fd: int | None, manifest: Manifest, pool: cf.Executor,
               where: str, *, check: bool = True,
               meanwhile: Callable[[], None] | None = None,
               early: Callable[[Image], None] | None = None) -> tuple[Image, list[str]]:
    """Read (and ``check``) every chunk of the file into one buffer; the image and the
    problems (unchecked: only a file shorter than its proof says).

    ``fd``: the local file's descriptor (its chunks are read with ``O_DIRECT`` where allowed);
    ``None`` for other stores, whose reader fills each chunk (S3: concurrent ranged GETs of
    the one object version the reader is pinned to). ``meanwhile`` runs on this thread while
    the pool reads; then ``early(image)``, once the chunks that hold the pickle are read (and
    checked) while the others may still be read: the image's storages are where they will be
    once it is packed, their bytes not there yet (``early`` must not read them). Not for a file
    of fewer than :data:`EARLY_BYTES_PER_STORAGE` per storage."""
    entry = manifest.files[0]
    buf = HostBuffer.allocate(_rounded(entry.end), pinned=False)
    planned: list[tuple[Image, list[tuple[int, int, int]] | None]] = []
    beside_reads, done = meanwhile, None
    if (early is not None and entry.storages
            and entry.end >= EARLY_BYTES_PER_STORAGE * len(entry.storages)):
        first = min(s.offset for s in entry.storages)
        pickle_chunks = _PickleChunks(min(len(entry.chunks), -(-first // entry.chunk_bytes)))
        done = pickle_chunks.done

        def beside_reads() -> None:
            if meanwhile is not None:
                meanwhile()
            if pickle_chunks.read_and_checked():
                image, problem = _image(buf, entry, where)
                if problem is None:
                    planned.append(_planned(image, entry))
                    early(planned[0][0])

    buf, problems = read_proven(reader, fd, manifest, pool, where, check=check,
                                meanwhile=beside_reads, buf=buf, done=done)
    image, problem = _image(buf, entry, where)
    if problem is not None:
        problems.append(problem)
    if problems:
        return image, problems
    image, moves = planned[0] if planned else _planned(image, entry)
    if moves is not None:
        _pack(buf, image, moves)
    return image, problems


def _rounded(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class _PickleChunks:
    """The first ``n`` chunks of a file (those that hold its pickle): whether all of them were
    read (and checked) without a problem."""

    def __init__(self, n: int) -> None:
        self.n, self.left, self.ok = n, n, True
        self.lock = threading.Lock()
        self.ready = threading.Event()
        if n <= 0:
            self.ready.set()

    def done(self, i: int, problem: str | None) -> None:
        """Chunk ``i``'s job finished, on its I/O thread (``problem``: ``None``, it is good)."""
        if i >= self.n:
            return
        with self.lock:
            if problem is not None:
                self.ok = False
            self.left -= 1
            if self.left <= 0 or not self.ok:
                self.ready.set()

    def read_and_checked(self) -> bool:
        """Wait until every one finished or one failed; whether all are good."""
        self.ready.wait()
        return self.ok


def _image(buf: HostBuffer, entry: FileEntry, where: str) -> tuple[Image, str | None]:
    """The image of the file's bytes in ``buf`` as read (its pickle's start from the first
    local header); the problem if byte 0 is not a zip's."""
    view = buf.view
    head = bytes(view[:30])
    name_len = int.from_bytes(head[26:28], "little")
    extra_len = int.from_bytes(head[28:30], "little")
    image = Image(view[: entry.end], {s.key: s for s in entry.storages},
                  30 + name_len + extra_len, where)
    return image, (None if head[:4] == b"PK\x03\x04" else f"{where}: not a zip archive at byte 0")


def _planned(image: Image, entry: FileEntry) -> tuple[Image, list[tuple[int, int, int]] | None]:
    """The image a load unpickles, and the moves that pack its storages (``None``: the tensors
    fill enough of the file to keep its buffer as it is, or records too close together to
    pack in place)."""
    if sum(s.nbytes for s in entry.storages) < MIN_TENSOR_SHARE * entry.end:
        packed = _placement(image)
        if packed is not None:
            return packed
    return image, None


def read_proven(reader: Reader, fd: int | None, manifest: Manifest, pool: cf.Executor,
                where: str, *, check: bool = True,
                meanwhile: Callable[[], None] | None = None, buf: HostBuffer | None = None,
                done: Callable[[int, str | None], None] | None = None,
                ) -> tuple[HostBuffer, list[str]]:
    """:func:`read_image`'s reads, of any file kind: the proven bytes in one page-aligned
    buffer (its ``view`` from 0 to the proof's end; ``buf`` if given, large enough) and the
    problems. ``done``: as :func:`.proof.chunk_problems`'s."""
    entry = manifest.files[0]
    end = entry.end
    if buf is None:
        buf = HostBuffer.allocate(_rounded(end), pinned=False)
    view = buf.view
    direct, cached = chunk_reads(fd, end)

    def read(lo: int, n: int) -> memoryview:
        return view[lo : lo + read_chunk(reader, direct_for(direct, cached, lo, n), lo, n,
                                         view[lo:])]

    def read_only(i: int) -> str | None:
        lo, hi = entry.chunk_range(i)
        got = len(read(lo, hi - lo))
        return None if got == hi - lo else f"{where}: truncated at byte {lo + got}"

    try:
        if check:
            problems = chunk_problems(reader, manifest, pool, read=read, meanwhile=meanwhile,
                                      done=done)
        else:
            problems = each_chunk(pool, read_only, len(entry.chunks), meanwhile, done)
    finally:
        if direct is not None:
            os.close(direct)
    return buf, problems


def _placement(image: Image) -> tuple[Image, list[tuple[int, int, int]]] | None:
    """The image with its storages compacted in place, each moved down to the next multiple of
    :data:`_PACK_ALIGN` after the one before, its pickle kept aside; and the moves
    ``(to, from, nbytes)`` that make it (:func:`_pack`). Its pickle's bytes must be read.

    ``None`` where a record would move up (records closer together than that alignment, which
    no writer makes, each padded to a page: a hostile proof's): moved in place, it would
    overwrite records not yet moved and write past the buffer."""
    records = sorted(image.storages.values(), key=_by_offset)
    src = image.view
    first = records[0].offset if records else len(src)
    pickle = bytes(src[image.pickle_at : max(image.pickle_at, first)])
    placed: dict[str, StorageRecord] = {}
    moves: list[tuple[int, int, int]] = []
    at = 0
    record, align = StorageRecord, _PACK_ALIGN - 1
    for key, offset, nbytes in records:
        if offset < at:
            return None
        if offset != at:
            moves.append((at, offset, nbytes))
        placed[key] = record(key, at, nbytes)
        at += (nbytes + align) & ~align
    return Image(src[: max(at, 1)], placed, 0, image.where, pickle), moves


def _pack(buf: HostBuffer, image: Image, moves: list[tuple[int, int, int]]) -> None:
    """Make :func:`_placement`'s moves in ``buf`` (every byte read and checked) and give the
    memory past the last storage back to the system.

    Records are disjoint (the proof's validation refuses overlaps) and moved in the order of
    their offsets, each to a place no later than its own: a move never touches bytes of a
    storage not yet moved. No second buffer: the copy is ~0.6 of the file, without faulting in
    fresh memory for it."""
    base = buf.tensor.data_ptr()
    move = ctypes.memmove
    for to, frm, nbytes in moves:
        move(base + to, base + frm, nbytes)
    keep = len(image.view)
    _give_back(buf, (keep + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE)


def _by_offset(r: StorageRecord) -> int:
    return r.offset


def _give_back(buf: HostBuffer, start: int) -> None:
    """Return the pages of ``buf`` from ``start`` (page-aligned) to the system: the mapping
    stays (tensors view its head), the memory behind its tail goes."""
    mem = buf._mmap
    if mem is None or start >= buf.capacity or not hasattr(mmap, "MADV_DONTNEED"):
        return
    try:
        mem.madvise(mmap.MADV_DONTNEED, start, buf.capacity - start)
    except OSError:  # pragma: no cover - a kernel without it keeps the memory, nothing else
        pass

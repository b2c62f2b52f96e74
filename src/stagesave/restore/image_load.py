"""A load read straight into the memory its tensors keep, verified as it lands.

``torch.load(mmap=True)`` after verification reads the file twice over the page cache: once to
hash it (a copy into a scratch buffer), once more as the tensors are first touched (a fault per
page). Here the proven bytes of a format-2 torch file are read once, with parallel ``O_DIRECT``
reads of whole chunks into one page-aligned buffer (through the page cache for a chunk whose
pages it holds already: :mod:`.residency`), each chunk hashed while it is in cache; the
pickle then runs in the safe unpickler with a ``persistent_load`` that hands out storages over
that buffer (no second copy). Storage ids are checked against the file's proof: a known key, a
size within its record.

An unverified load reads the same way without hashing. Files in other stores (S3, fsspec)
are read the same way through their reader, each chunk hashed as it lands. It applies to every
format-2 torch file, with ``mmap`` left to stagesave. The buffer stays alive as long as any
tensor does, headers and padding included; where tensors fill less than
:data:`MIN_TENSOR_SHARE` of the file (many small tensors, each padded to a page), their bytes
are first packed to the buffer's head (moved down in place, after the checks) and the memory
behind the rest is given back, so that a load never keeps more memory than its tensors. The C
unpickler's first try (:mod:`.fast_unpickle`) takes each storage as a :class:`LeanStorage`.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import io
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..ondisk.manifest import FileEntry, Manifest, StorageRecord
from ..ondisk.names import ALIGNMENT
from ..saving.buffers import HostBuffer
from ..stores.base import Reader
from .proof import chunk_problems
from .refusal import BadPickle
from .residency import cached_pages, mostly_cached

__all__ = [
    "Image", "LeanStorage", "applies", "each_chunk", "read_image", "read_proven", "unpickle_image",
]

#: Tensors must fill at least this share of the file for the load to keep the file's buffer
#: (else they are packed into one of their own).
MIN_TENSOR_SHARE = 0.8
#: From this many storages a file verified moments ago is still loaded through an image (its
#: unpickling costs a fraction of ``torch.load``'s per storage); below, ``torch.load`` maps it.
MANY_STORAGES = 1024
#: Where packed storages start (torch's own alignment of records in a zip).
_PACK_ALIGN = 64


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
               meanwhile: Callable[[], None] | None = None) -> list[str]:
    """``job(i)`` for chunks ``0..n-1`` on ``pool``, ``meanwhile`` on this thread while they
    run; the problems the jobs returned, in chunk order."""
    done = pool.map(job, range(n))
    if meanwhile is not None:
        meanwhile()
    return [p for p in done if p]


def read_image(reader: Reader, fd: int | None, manifest: Manifest, pool: cf.Executor,
               where: str, *, check: bool = True,
               meanwhile: Callable[[], None] | None = None) -> tuple[Image, list[str]]:
    """Read (and ``check``) every chunk of the file into one buffer; the image and the
    problems (unchecked: only a file shorter than its proof says).

    ``fd``: the local file's descriptor (its chunks are read with ``O_DIRECT`` where allowed);
    ``None`` for other stores, whose reader fills each chunk (S3: concurrent ranged GETs of
    the one object version the reader is pinned to). ``meanwhile`` runs on this thread while
    the pool reads."""
    entry = manifest.files[0]
    end = entry.end
    buf, problems = read_proven(reader, fd, manifest, pool, where, check=check,
                                meanwhile=meanwhile)
    view = buf.view
    head = bytes(view[:30])
    if head[:4] != b"PK\x03\x04":
        problems.append(f"{where}: not a zip archive at byte 0")
    name_len, extra_len = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30],
                                                                                  "little")
    image = Image(view[:end], {s.key: s for s in entry.storages}, 30 + name_len + extra_len,
                  where)
    if not problems and sum(s.nbytes for s in entry.storages) < MIN_TENSOR_SHARE * end:
        image = _packed(image, buf)
    return image, problems


def read_proven(reader: Reader, fd: int | None, manifest: Manifest, pool: cf.Executor,
                where: str, *, check: bool = True,
                meanwhile: Callable[[], None] | None = None) -> tuple[HostBuffer, list[str]]:
    """:func:`read_image`'s reads, of any file kind: the proven bytes in one page-aligned
    buffer (its ``view`` from 0 to the proof's end) and the problems."""
    entry = manifest.files[0]
    end = entry.end
    buf = HostBuffer.allocate((end + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT, pinned=False)
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
            problems = chunk_problems(reader, manifest, pool, read=read, meanwhile=meanwhile)
        else:
            problems = each_chunk(pool, read_only, len(entry.chunks), meanwhile)
    finally:
        if direct is not None:
            os.close(direct)
    return buf, problems


def _packed(image: Image, buf: HostBuffer) -> Image:
    """The image with its storages compacted in place (each moved down to the next multiple of
    :data:`_PACK_ALIGN` after the one before), its pickle kept aside and the memory past the
    last storage given back to the system.

    Records are disjoint (the proof's validation refuses overlaps) and moved in the order of
    their offsets, each to a place no later than its own: a move never touches bytes of a
    storage not yet moved. No second buffer: the copy is ~0.6 of the file, without faulting in
    fresh memory for it."""
    records = sorted(image.storages.values(), key=_by_offset)
    src = image.view
    first = records[0].offset if records else len(src)
    pickle = bytes(src[image.pickle_at : max(image.pickle_at, first)])
    base = buf.tensor.data_ptr()
    placed: dict[str, StorageRecord] = {}
    at = 0
    move, record, align = ctypes.memmove, StorageRecord, _PACK_ALIGN - 1
    for key, offset, nbytes in records:
        if offset != at:
            move(base + at, base + offset, nbytes)
        placed[key] = record(key, at, nbytes)
        at += (nbytes + align) & ~align
    keep = max(at, 1)
    _give_back(buf, (keep + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE)
    return Image(src[:keep], placed, 0, image.where, pickle)


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


class LeanStorage:
    """A storage of the image as a tensor over all of it, for the C unpickler's tensor rebuild
    (:mod:`.fast_unpickle`): no ``TypedStorage`` per storage, and the first tensor rebuilt over
    it is that tensor itself, set to its geometry (one call instead of an empty tensor and a
    ``set_``). What comes out equals torch's rebuild: a tensor of the storage's dtype over the
    storage's bytes, not a view of another tensor."""

    __slots__ = ("dtype", "spare", "untyped")

    def __init__(self, untyped: torch.UntypedStorage, dtype: torch.dtype,
                 whole: torch.Tensor | None = None) -> None:
        self.untyped, self.dtype = untyped, dtype
        #: a tensor over all of the storage the first rebuild may take (``None``: none made)
        self.spare = whole

    @classmethod
    def over(cls, data: memoryview, dtype: torch.dtype) -> LeanStorage:
        """The storage of host bytes ``data`` (a whole number of ``dtype`` elements)."""
        whole = torch.frombuffer(data, dtype=dtype)
        return cls(whole.untyped_storage(), dtype, whole)

    def tensor(self, offset: Any, size: Any, stride: Any) -> torch.Tensor:
        """A new tensor over the storage (torch's checks: within the storage's bytes)."""
        whole = self.spare
        if whole is not None:
            self.spare = None
            return whole.as_strided_(size, stride, offset)
        return torch.empty((0,), dtype=self.dtype, device=self.untyped.device).set_(
            self.untyped, offset, size, stride)


def unpickle_image(image: Image, map_location: Any, unpickler: Any) -> Any:
    """Run ``unpickler`` (a class taking the pickle's stream) over the image's pickle, its
    storages views of the image's buffer restored to ``map_location`` as ``torch.load`` does."""
    restore = torch.serialization._get_restore_location(map_location)  # type: ignore[no-untyped-call]
    loaded: dict[str, torch.storage.TypedStorage] = {}
    leans: dict[str, LeanStorage] = {}
    # torch's restore of a CPU storage onto the CPU is the storage itself: not asked per tensor
    on_cpu = map_location is None or str(map_location) == "cpu"
    kinds: dict[Any, tuple[torch.dtype, int]] = {}

    memory = image.memory

    def region(storage_type: Any, key: Any, location: Any, numel: Any) -> tuple[
            torch.dtype, Any]:
        """The storage's dtype and bytes, its id checked: a memoryview of the image's buffer,
        or a device tensor (``memory``); ``None``: it has none."""
        if type(key) is not str or type(location) is not str or type(numel) is not int:
            raise BadPickle("a storage id of the wrong types")
        kind = kinds.get(storage_type)
        if kind is None:
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            kind = kinds[storage_type] = (
                dtype, torch._utils._element_size(dtype))  # type: ignore[no-untyped-call]
        dtype, size = kind
        record = image.storages.get(key)
        nbytes = numel * size
        if record is None or numel < 0 or nbytes > record.nbytes:
            raise BadPickle(f"storage {key!r} is not in {image.where}'s proof, or larger")
        if not nbytes:
            return dtype, None
        if memory is not None:
            held = memory[key]
            return dtype, held if nbytes == record.nbytes else held[:nbytes].clone()
        offset = record.offset
        return dtype, image.view[offset : offset + nbytes]

    def persistent_load(pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise BadPickle(f"unsupported persistent id {pid!r}"[:200])
        _, storage_type, key, location, numel = pid
        if type(key) is str and key in loaded:
            return loaded[key]
        dtype, data = region(storage_type, key, location, numel)
        if data is None:
            storage = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
            there = on_cpu and location == "cpu"
        elif memory is not None:  # already where map_location puts it
            storage, there = data.untyped_storage(), True
        else:
            storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
            there = on_cpu and location == "cpu"
        typed = torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
            wrap_storage=storage if there else restore(storage, location),
            dtype=dtype, _internal=True)
        loaded[key] = typed
        return typed

    def lean(storage_type: Any, key: Any, location: Any, numel: Any) -> LeanStorage | None:
        """The storage as the C unpickler's tensor rebuild takes it (``None``: it needs
        torch's typed storage: restored elsewhere, or no bytes)."""
        if type(key) is str and key in leans:
            return leans[key]
        if memory is None and not (on_cpu and location == "cpu"):
            return None
        dtype, data = region(storage_type, key, location, numel)
        if data is None:
            return None
        made = leans[key] = (LeanStorage(data.untyped_storage(), dtype) if memory is not None
                             else LeanStorage.over(data, dtype))
        return made

    persistent_load.lean = lean  # type: ignore[attr-defined]

    # the pickle ends before the first storage's record (torch writes data.pkl first)
    if image.pickle is not None:
        stream = io.BytesIO(image.pickle)
    else:
        first = min((r.offset for r in image.storages.values()), default=len(image.view))
        stream = io.BytesIO(bytes(image.view[image.pickle_at : max(image.pickle_at, first)]))
    up = unpickler(stream)
    up.persistent_load = persistent_load
    result = up.load()
    torch._utils._validate_loaded_sparse_tensors()  # type: ignore[no-untyped-call]
    return result

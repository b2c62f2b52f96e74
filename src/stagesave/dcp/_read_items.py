"""Reading a rank file's items: windows of whole checksum chunks, each verified before DCP sees it.

The items a rank asks of one file are sorted by offset and grouped into *windows* of whole
checksum chunks (at most ``window_bytes``, at least one item), so that every chunk an item
touches is read and checked once. A window's chunks are read in parallel on the I/O threads and
checked by the core's chunk verifier (:func:`stagesave.restore.proof.chunk_problems`, the one
every load and ``verify()`` uses); only then are its items handed to DCP's planner, on the
caller's thread (unpickling and tensor copies never run on the I/O threads), while the next
window is read (:func:`read_ahead`).
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ..errors import IntegrityError, UnsupportedObjectError
from ..ondisk.manifest import FileEntry, Manifest
from ..ondisk.names import DEFAULT_CHUNK_BYTES
from ..restore.proof import chunk_problems
from ..restore.verify import raise_if_corrupt
from ..safety import safe_torch_load
from ..stores.base import Reader
from ._metadata import StorageInfo
from ._rankfile import SkeletonCache

__all__ = [
    "DEFAULT_WINDOW_BYTES", "Item", "Window", "chunk_of", "deliver", "read_ahead", "read_window",
    "stored_tensor", "windows",
]

#: Bytes read (and verified) at once; a window holds whole chunks, at least one item.
DEFAULT_WINDOW_BYTES = 64 * 1024 * 1024
#: Unverified reads merge items separated by at most this many bytes (alignment padding).
_MERGE_GAP = 64 * 1024

#: One item of a load plan, with where the metadata places it.
Item = tuple[StorageInfo, ReadItem]


@dataclass
class Window:
    """Bytes ``[lo, hi)`` of one file, read (and verified) at once, and the items in them."""

    lo: int
    hi: int
    items: list[Item]


def windows(items: list[Item], entry: FileEntry | None, window_bytes: int) -> Iterator[Window]:
    """Group sorted items into reads of whole chunks (all chunks, when verifying)."""
    step = entry.chunk_bytes if entry is not None else 1
    gap = 0 if entry is not None else _MERGE_GAP
    current: Window | None = None
    for sinfo, req in items:
        end = sinfo.offset + sinfo.length
        lo = sinfo.offset // step * step
        hi = -(-end // step) * step
        if entry is not None:
            hi = min(hi, entry.end)
        if (current is not None and lo <= current.hi + gap
                and max(hi, current.hi) - current.lo <= window_bytes):
            current.hi = max(current.hi, hi)
            current.items.append((sinfo, req))
            continue
        if current is not None:
            yield current
        current = Window(lo, hi, [(sinfo, req)])
    if current is not None:
        yield current


def read_window(
    reader: Reader, lo: int, length: int, entry: FileEntry | None, pool: cf.Executor | None,
    into: memoryview | None = None,
) -> memoryview:
    """Bytes ``[lo, lo + length)`` of ``reader``'s file (in ``into``, at least ``length`` bytes,
    else in new memory); with ``entry``, every chunk checked first.

    Raises:
        IntegrityError: a chunk's digest differs, or the file is shorter than it should be.
    """
    out = memoryview(bytearray(length)) if into is None else into[:length]

    def read(at: int, n: int) -> memoryview:
        got = reader.readinto(at, out[at - lo : at - lo + n])
        return out[at - lo : at - lo + got]

    if entry is None:
        problems = _read_plain(reader, lo, length, read, pool)
    else:  # a window is whole chunks of the file (``lo`` on a chunk's start)
        first = lo // entry.chunk_bytes
        indices = range(first, -(-(lo + length) // entry.chunk_bytes))
        problems = chunk_problems(reader, Manifest([entry], 0), _parallel(pool, indices),
                                  read=read, indices=indices)
    raise_if_corrupt(problems, reader.where.rpartition("/")[0])
    return out


def read_ahead(
    reader: Reader, wins: list[Window], entry: FileEntry | None, pool: cf.Executor | None,
) -> Iterator[tuple[Window, memoryview]]:
    """Each window with its bytes (as :func:`read_window`), the next window read while the
    caller hands the current one's items to DCP.

    Two buffers of the largest window's size take turns, each reused: a window's bytes are
    valid until the caller asks for the window after the next (items are copied out of them
    before that), and no window faults in fresh memory after the first two.
    """
    if not wins:
        return
    size = max(w.hi - w.lo for w in wins)
    buffers = [memoryview(bytearray(size)) for _ in range(min(2, len(wins)))]
    with cf.ThreadPoolExecutor(1, thread_name_prefix="stagesave-dcp-ahead") as ahead:
        pending = ahead.submit(read_window, reader, wins[0].lo, wins[0].hi - wins[0].lo, entry,
                               pool, buffers[0])
        for k, window in enumerate(wins):
            data = pending.result()
            if k + 1 < len(wins):
                nxt = wins[k + 1]
                pending = ahead.submit(read_window, reader, nxt.lo, nxt.hi - nxt.lo, entry, pool,
                                       buffers[(k + 1) % 2])
            yield window, data


def _read_plain(
    reader: Reader, lo: int, length: int, read: Callable[[int, int], memoryview],
    pool: cf.Executor | None,
) -> list[str]:
    """Read ``[lo, lo + length)`` without a proof (``verify=False``), in parallel pieces; the
    problems (a file shorter than its metadata says)."""

    def one(off: int) -> str | None:
        n = min(DEFAULT_CHUNK_BYTES, length - off)
        got = len(read(lo + off, n))
        return f"{reader.where}: truncated at byte {lo + off + got}" if got != n else None

    offsets = range(0, length, DEFAULT_CHUNK_BYTES)
    executor = _parallel(pool, offsets)
    results = executor.map(one, offsets) if executor is not None else map(one, offsets)
    return [p for p in results if p]


def _parallel(pool: cf.Executor | None, work: range) -> cf.Executor | None:
    """``pool`` when there is more than one piece of work for it."""
    return pool if len(work) > 1 else None


def chunk_of(metadata: Metadata, req: ReadItem) -> tuple[torch.dtype, torch.Size] | None:
    """The dtype and size of the stored chunk ``req`` reads (``None``: not a tensor chunk)."""
    index = req.storage_index
    md = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return None
    chunks, hint = md.chunks, index.index
    if hint is not None and 0 <= hint < len(chunks) and chunks[hint].offsets == index.offset:
        return md.properties.dtype, chunks[hint].sizes
    for chunk in chunks:
        if chunk.offsets == index.offset:
            return md.properties.dtype, chunk.sizes
    return None


def stored_tensor(
    window: torch.Tensor, start: int, blob: memoryview,
    chunk: tuple[torch.dtype, torch.Size] | None, skeletons: SkeletonCache,
) -> torch.Tensor | None:
    """The tensor of an item, as a view of its window, when the item's bytes around the data are
    exactly the zip ``StagedStorageWriter`` writes for a contiguous tensor of its chunk's dtype
    and size (``FileSystemWriter``'s carry their data's CRCs, so they differ), so no unpickling
    is needed; ``None``: read it with ``torch.load``.

    ``window``: the window's bytes as a uint8 tensor; ``start``: the item's offset in it. A
    chunk whose data could not fit in the item is not planned at all (the metadata's sizes are
    not trusted to size anything).
    """
    if chunk is None:
        return None
    dtype, sizes = chunk
    if math.prod(sizes) * dtype.itemsize > len(blob):
        return None
    try:
        sk = skeletons.get(dtype, tuple(sizes))
    except (UnsupportedObjectError, RuntimeError, TypeError):
        return None  # a dtype or size torch cannot lay out here: torch.load says what it is
    at, end = sk.data_offset, sk.data_offset + sk.nbytes
    if (len(blob) != sk.size or (start + at) % dtype.itemsize
            or blob[:at] != sk.head or blob[end:] != sk.tail):
        return None
    return window[start + at : start + end].view(dtype).view(sizes)


def deliver(
    req: ReadItem, blob: memoryview, planner: LoadPlanner, where: str, *, trusted: bool,
    safe_globals: list[Any], tensor: torch.Tensor | None = None,
) -> None:
    """Hand one verified item to DCP's planner (on the caller's thread); ``tensor``: the item's
    tensor when :func:`stored_tensor` found it (else it is ``torch.load``-ed from ``blob``)."""
    if req.type == LoadItemType.BYTE_IO:
        raw = bytes(blob)
        if not trusted:
            # DCP's planner unpickles with the full unpickler; the same bytes must first pass
            # the allow-listed one, so nothing off the list is ever constructed.
            safe_torch_load(io.BytesIO(raw), safe_globals=safe_globals,
                            where=f"{where} (item {req.storage_index.fqn})")
        planner.load_bytes(req, io.BytesIO(raw))
        return
    if tensor is None:
        tensor = cast(torch.Tensor,
                      torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True))
    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise IntegrityError(f"{where}: item {req.storage_index.fqn} has shape "
                             f"{tuple(tensor.size())} where the plan expects "
                             f"{tuple(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(req, target)

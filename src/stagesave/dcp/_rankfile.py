"""A rank's data file, laid out on the caller's thread before any byte is copied.

DCP's ``FileSystemWriter`` stores each tensor as a complete ``torch.save`` zip of that tensor and
reads it back with ``torch.load``; keeping exactly that format is what lets torch's own reader
(and ``dcp_to_torch_save``) open a stagesave folder. Pickling every tensor on every save would
cost the training loop a serialization pass, so the zip of a tensor is planned once per
``(dtype, shape)`` with ``torch.serialization.skip_data()`` (structure only, no tensor bytes) and
cached as two runs of bytes, the one before the tensor's data and the one after it. Items are
64-byte aligned (torch's own record alignment): a page-aligned layout would add ~28 KiB per small
tensor and buys nothing here, since the writers write the whole image in large aligned chunks
anyway.

The layout of a plan (:class:`RankLayout`: every byte that is not a tensor's data or a byte
item's blob, where each item goes, its storage info) is kept by the writer and reused by the next
save whose items are the same: the same indexes, each tensor of the same dtype and shape, each
byte item (and each tensor torch serializes whole) of the same length. Such a save resolves its
items, compares them with the layout and names each tensor's bytes; a staging buffer that still
holds the layout's bytes from an earlier save does not receive them again
(:attr:`.FileImage.static`).
"""

from __future__ import annotations

import collections
import io
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.utils.serialization import config as _torch_save_config

from ..errors import UnsupportedObjectError
from ..saving.host_copy import BIG, HostCopies, host_view
from ..saving.image import FileImage, StorageSlot
from ..saving.sparse import SparseReader, SparseSink
from ..saving.tensor_guard import Guard
from . import _rank_guard
from ._format import ITEM_ALIGNMENT, RANK_FILE_KIND
from ._metadata import StorageInfo
from ._recent import Recent

__all__ = [
    "RankImage", "RankLayout", "SkeletonCache", "layout_rank_file",
]

_Tensor = torch.Tensor
_BYTE_IO = WriteItemType.BYTE_IO
_STRIDED = torch.strided


@dataclass(frozen=True)
class Skeleton:
    """The bytes of ``torch.save(torch.empty(shape, dtype=dtype))`` minus the tensor data:
    ``head`` before the data, ``tail`` after it (``padded``: the tail and the zeros up to the
    next item's aligned start)."""

    size: int
    head: bytes
    tail: bytes
    padded: bytes
    data_offset: int
    nbytes: int


def _cut(pieces: Sequence[tuple[int, bytes]], lo: int, hi: int) -> bytes:
    """Bytes ``[lo, hi)`` of a sparse file made of ``pieces`` (zeros where none was written)."""
    out = bytearray(hi - lo)
    for off, data in pieces:
        a, b = max(off, lo), min(off + len(data), hi)
        if a < b:
            out[a - lo : b - lo] = data[a - off : b - off]
    return bytes(out)


def plan_skeleton(dtype: torch.dtype, shape: tuple[int, ...]) -> Skeleton:
    """Lay out the zip of a contiguous CPU tensor of ``dtype`` and ``shape`` (no data copied)."""
    # Never touched: only its structure is pickled, so a large one costs address space only.
    placeholder = torch.empty(shape, dtype=dtype)
    sink = SparseSink()
    alignment = _torch_save_config.patch({"save.storage_alignment": ITEM_ALIGNMENT})  # type: ignore[attr-defined]
    with alignment, torch.serialization.skip_data():
        torch.save(placeholder, cast(IO[bytes], sink))
    reader = torch._C.PyTorchFileReader(cast(IO[bytes], SparseReader(sink.end, sink.pieces)))
    records = [r for r in reader.get_all_records() if r.startswith("data/")]
    if len(records) != 1:
        raise UnsupportedObjectError(
            f"torch.save of one tensor wrote {len(records)} storages; expected one"
        )
    offset = int(reader.get_record_offset(records[0]))  # type: ignore[attr-defined]
    nbytes = placeholder.nbytes
    end = offset + nbytes
    if any(off < end and off + len(data) > offset for off, data in sink.pieces):
        raise UnsupportedObjectError(
            "torch.save under skip_data wrote bytes where the tensor's data goes; this torch "
            "version is not supported by stagesave's sharded writer"
        )
    tail = _cut(sink.pieces, end, sink.end)
    return Skeleton(sink.end, _cut(sink.pieces, 0, offset), tail,
                    tail + bytes(-sink.end % ITEM_ALIGNMENT), offset, nbytes)


class SkeletonCache:
    """Skeletons by ``(dtype, shape)``, least recently used dropped beyond ``max_entries``."""

    def __init__(self, max_entries: int = 65_536) -> None:
        self.max_entries = max_entries
        self._items: collections.OrderedDict[tuple[torch.dtype, tuple[int, ...]], Skeleton] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, dtype: torch.dtype, shape: tuple[int, ...]) -> Skeleton:
        key = (dtype, shape)
        with self._lock:
            sk = self._items.get(key)
            if sk is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return sk
        sk = plan_skeleton(dtype, shape)
        with self._lock:
            self.misses += 1
            self._items[key] = sk
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)
        return sk


@dataclass
class RankLayout:
    """Where everything of one plan goes in a rank file; reused while the plan is the same.

    ``keys`` per item: ``(index, dtype, shape)`` for a tensor whose bytes are copied,
    ``(index, length)`` for a blob (a byte item, or a tensor torch serializes whole).
    """

    file_name: str
    keys: list[tuple[Any, ...]]
    size: int
    #: Every byte that is neither a tensor's data nor a blob: zip headers, pickles, padding.
    static: list[tuple[int, bytes]]
    #: Per item: where its data (a tensor) or its blob starts.
    places: list[int]
    infos: list[StorageInfo]
    lengths: list[int]
    tensor_bytes: int
    nonempty: int
    #: DCP's write results of this layout (the same for every save of the same items).
    results: list[WriteResult] | None = field(default=None, compare=False)
    #: ``(addresses, slots, copies)`` of the last save whose items were all in host memory:
    #: reused by a save whose items are at the same addresses (checked at every save, as a
    #: reused torch-file plan does; the views in ``copies`` are used only then).
    host: tuple[list[int], list[StorageSlot], HostCopies] | None = field(default=None,
                                                                          compare=False)
    #: Where every tensor went into the file as it is: the items in short and torch's compiled
    #: check of the tensors (:mod:`._rank_guard`).
    light: list[tuple[Any, ...]] | None = field(default=None, compare=False)
    guard: Guard | None = field(default=None, compare=False)
    #: The planner's check that vouched for those tensors when ``guard`` was made, and the
    #: items list then (:func:`._rank_guard.reuse`).
    vouch: tuple[Guard, Sequence[WriteItem]] | None = field(default=None, compare=False)


@dataclass
class RankImage:
    """The rank file as a :class:`FileImage` plus DCP's write results (offsets known now)."""

    image: FileImage
    results: list[WriteResult]
    tensor_bytes: int
    layout: RankLayout
    #: The tensors the image's slots name by address (contiguous copies made for the layout
    #: among them): kept alive until the image is staged.
    sources: list[Any]


def _align(n: int) -> int:
    return (n + ITEM_ALIGNMENT - 1) // ITEM_ALIGNMENT * ITEM_ALIGNMENT


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's own elements (not its whole storage)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _serialized(t: torch.Tensor) -> bytes:
    """The slow path, for tensors that are not plain strided ones: what FileSystemWriter writes."""
    cpu = t.detach().cpu()
    if cpu.untyped_storage().size() != cpu.nbytes:
        cpu = cpu.clone()
    out = io.BytesIO()
    torch.save(cpu, out)
    return out.getvalue()


def _refused(t: torch.Tensor) -> str:
    """Why a sharded save refuses ``t`` (DCP's ``FileSystemWriter`` cannot save it either)."""
    if t.is_meta:
        return "it is a tensor on the meta device (no data); materialize it before saving"
    if t.layout != _STRIDED:
        return (f"it is a {t.layout} tensor, which a sharded checkpoint cannot hold; save "
                "t.to_dense() (or save it in a torch file)")
    return ("it is a zero tensor (torch._efficientzerotensor: no data); save "
            "torch.zeros_like(t) instead")


def _resolved(
    items: Sequence[WriteItem], resolved: list[Any],
) -> tuple[list[tuple[Any, ...]], list[Any]]:
    """Each item's layout key and what goes into the file (a contiguous tensor or a blob), from
    its data (``resolved``: the planner's ``resolve_data`` ran on the caller's thread, so
    non-tensor items are serialized now, capturing their value at this instant)."""
    keys: list[tuple[Any, ...]] = []
    found: list[Any] = []
    key, keep = keys.append, found.append
    for item, data in zip(items, resolved):
        if item.type == _BYTE_IO:
            blob = bytes(cast(io.BytesIO, data).getbuffer())
            key((item.index, len(blob)))
            keep(blob)
            continue
        t = cast(torch.Tensor, data)
        if type(t) is _Tensor and t.layout == _STRIDED and not (
                t.is_meta or t.is_quantized or t.is_nested or t.is_conj() or t.is_neg()
                or t._is_zerotensor()):
            # a plain strided tensor: its bytes are copied as they are
            if not t.is_contiguous():
                t = t.detach().contiguous()
            key((item.index, t.dtype, t.shape))
            keep(t)
            continue
        if t.is_meta or t.layout != _STRIDED or t._is_zerotensor():
            raise UnsupportedObjectError(f"cannot save {item.index.fqn}: {_refused(t)}")
        blob = _serialized(t)
        key((item.index, len(blob)))
        keep(blob)
    return keys, found


def _lay_out(
    keys: list[tuple[Any, ...]], found: list[Any], file_name: str, cache: SkeletonCache
) -> RankLayout:
    """Place every item: the first at offset 0 (as in ``FileSystemWriter``'s files), each at
    the next aligned offset, the proof after the last one."""
    static: list[tuple[int, bytes]] = []
    places: list[int] = []
    infos: list[StorageInfo] = []
    lengths: list[int] = []
    tensor_bytes = nonempty = 0
    pos = 0
    last_tail: Skeleton | None = None  # the skeleton of the last item, when it is a tensor
    for obj in found:
        base = _align(pos)
        if base > pos and last_tail is None:  # after a tensor, its padded tail covers this
            static.append((pos, bytes(base - pos)))
        if type(obj) is bytes:
            places.append(base)
            length = len(obj)
            last_tail = None
        else:
            sk = cache.get(obj.dtype, tuple(obj.shape))
            data_at = base + sk.data_offset
            static.append((base, sk.head))
            static.append((data_at + sk.nbytes, sk.padded))
            places.append(data_at)
            length = sk.size
            tensor_bytes += sk.nbytes
            nonempty += sk.nbytes > 0
            last_tail = sk
        infos.append(StorageInfo(file_name, base, length))
        lengths.append(length)
        pos = base + length
    if last_tail is not None:  # the file ends with the last item: no padding after it
        off, _ = static[-1]
        static[-1] = (off, last_tail.tail)
    static = [(off, data) for off, data in static if data]
    return RankLayout(file_name, keys, pos, static, places, infos, lengths, tensor_bytes,
                      nonempty)


def layout_rank_file(
    items: Sequence[WriteItem],
    resolve: Callable[[WriteItem], Any],
    file_name: str,
    cache: SkeletonCache,
    known: Recent[RankLayout] | None = None,
    resolve_items: Callable[[Sequence[WriteItem]], list[Any]] | None = None,
    vouch: Callable[[Sequence[WriteItem]], _rank_guard.Vouched] | None = None,
) -> RankImage:
    """Place every item of a rank's plan in its data file; nothing is copied yet.

    ``known``: the layouts of this writer's recent saves; one whose items are the same is
    reused, else the new layout joins them. ``resolve_items``: ``resolve`` of all items in one
    call (:meth:`.SteadySavePlanner.resolve_items`); ``vouch(items)``: what the planner's own
    checks of this save's state tell about the items' tensors (:meth:`.SteadySavePlanner.vouch`,
    :func:`._rank_guard.reuse`).

    Raises:
        UnsupportedObjectError: an item is a tensor on the meta device (it has no data).
    """
    resolved = resolve_items(items) if resolve_items is not None else list(map(resolve, items))
    vouched = vouch(items) if vouch is not None else (False, None, None)
    layout, short = _rank_guard.reuse(known, file_name, items, resolved, vouched)
    if layout is not None and short is not None:
        found = short.found
    else:
        keys, found = _resolved(items, resolved)
        if known is not None:
            layout = known.find(lambda old: old.file_name == file_name and old.keys == keys)
        if layout is None:
            layout = _lay_out(keys, found, file_name, cache)
            if known is not None:
                known.add(layout)
        _rank_guard.keep(layout, short, found, items, vouched[1])
    pieces: list[tuple[int, bytes]] = list(layout.static)
    for obj, place in zip(found, layout.places):
        if type(obj) is bytes:
            pieces.append((place, obj))
    if layout.results is None:
        layout.results = [
            WriteResult(index=item.index, size_in_bytes=length, storage_data=info)
            for item, info, length in zip(items, layout.infos, layout.lengths)
        ]
    slots, copies = _slots(found, layout)
    image = FileImage(
        size=layout.size, pieces=pieces, slots=slots, serialization_id="", id_offset=0,
        kind=RANK_FILE_KIND, gapless=True, static=(layout, 0, len(layout.static)),
        counts=(layout.tensor_bytes, layout.nonempty), copies=copies,
    )
    return RankImage(image, layout.results, layout.tensor_bytes, layout, found)


def _host_addresses(found: list[Any]) -> list[int] | None:
    """Each item's data address (``0`` for a blob); ``None`` when a tensor is not in host
    memory."""
    out: list[int] = []
    note = out.append
    for obj in found:
        if type(obj) is bytes:
            note(0)
        elif obj.is_cpu:
            note(obj.data_ptr())
        else:
            return None
    return out


def _slots(found: list[Any], layout: RankLayout) -> tuple[list[StorageSlot], HostCopies | None]:
    """The slots of the tensors' bytes, and their host copies when every tensor is in host
    memory (those of the last save when the addresses are the same)."""
    addresses = _host_addresses(found)
    known = layout.host
    if addresses is not None and known is not None and known[0] == addresses:
        return known[1], known[2]
    slots: list[StorageSlot] = []
    copies = HostCopies() if addresses is not None else None
    for n, (obj, place) in enumerate(zip(found, layout.places)):
        if type(obj) is bytes:
            continue
        nbytes = obj.nbytes
        if not nbytes:
            continue
        if copies is None:  # a tensor by its address (the save's ``sources`` keep it alive)
            slots.append(StorageSlot(str(n), place, nbytes, device_type="cpu",
                                     address=obj.data_ptr()) if obj.is_cpu
                         else StorageSlot(str(n), place, nbytes, _flat_bytes(obj)))
            continue
        address = obj.data_ptr()
        slots.append(StorageSlot(str(n), place, nbytes, device_type="cpu", address=address))
        if nbytes >= BIG:
            copies.big.append((place, address, nbytes))
        else:
            copies.small.append((place, host_view(address, nbytes)))
    if addresses is not None and copies is not None:
        layout.host = (addresses, slots, copies)
    return slots, copies

"""A rank's data file, laid out on the caller's thread before any byte is copied.

DCP's ``FileSystemWriter`` stores each tensor as a complete ``torch.save`` zip of that tensor and
reads it back with ``torch.load``; keeping exactly that format is what lets torch's own reader
(and ``dcp_to_torch_save``) open a stagesave folder. Pickling every tensor on every save would
cost the training loop a serialization pass, so the zip of a tensor is planned once per
``(dtype, shape)`` with ``torch.serialization.skip_data()`` (structure only, no tensor bytes) and
cached; a save then only places cached skeletons at their offsets and lets the staging copy put
each tensor's bytes where its record says. Items are 64-byte aligned (torch's own record
alignment): a page-aligned layout would add ~28 KiB per small tensor and buys nothing here,
since the writers write the whole image in large aligned chunks anyway.
"""

from __future__ import annotations

import collections
import io
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.utils.serialization import config as _torch_save_config

from ..errors import UnsupportedObjectError
from ..saving.image import FileImage, StorageSlot
from ..saving.sparse import SparseReader, SparseSink
from ._format import ITEM_ALIGNMENT, RANK_FILE_KIND
from ._metadata import StorageInfo

__all__ = ["RankImage", "SkeletonCache", "layout_rank_file"]


@dataclass(frozen=True)
class Skeleton:
    """The bytes of ``torch.save(torch.empty(shape, dtype=dtype))`` minus the tensor data."""

    size: int
    pieces: tuple[tuple[int, bytes], ...]
    data_offset: int
    nbytes: int


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
    return Skeleton(sink.end, tuple(sink.pieces), offset, placeholder.nbytes)


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
class RankImage:
    """The rank file as a :class:`FileImage` plus DCP's write results (offsets known now)."""

    image: FileImage
    results: list[WriteResult]
    tensor_bytes: int


def _align(n: int) -> int:
    return (n + ITEM_ALIGNMENT - 1) // ITEM_ALIGNMENT * ITEM_ALIGNMENT


def _fast_path(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain strided tensor whose bytes can be copied as they are."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_nested
        and not t.is_conj()
        and not t.is_neg()
    )


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's own elements (not its whole storage)."""
    return t.reshape(-1).view(torch.uint8)


def _serialized(t: torch.Tensor) -> bytes:
    """The slow path, for tensors that are not plain strided ones: what FileSystemWriter writes."""
    cpu = t.cpu()
    if cpu.untyped_storage().size() != cpu.nbytes:
        cpu = cpu.clone()
    out = io.BytesIO()
    torch.save(cpu, out)
    return out.getvalue()


def layout_rank_file(
    items: Sequence[WriteItem],
    resolve: Callable[[WriteItem], Any],
    file_name: str,
    cache: SkeletonCache,
) -> RankImage:
    """Place every item of a rank's plan in its data file; nothing is copied yet.

    ``resolve`` is the planner's ``resolve_data``; it runs here, on the caller's thread, so
    non-tensor items are serialized now (capturing their value at this instant). The first item
    starts at offset 0, as in ``FileSystemWriter``'s files; the proof follows the last one.

    Raises:
        UnsupportedObjectError: an item is a tensor on the meta device (it has no data).
    """
    pieces: list[tuple[int, bytes]] = []
    slots: list[StorageSlot] = []
    results: list[WriteResult] = []
    pos = 0
    tensor_bytes = 0
    for n, item in enumerate(items):
        base = _align(pos)
        data = resolve(item)
        if item.type == WriteItemType.BYTE_IO:
            blob = bytes(cast(io.BytesIO, data).getbuffer())
            pieces.append((base, blob))
            length = len(blob)
        else:
            t = cast(torch.Tensor, data).detach()
            if t.device.type == "meta":
                raise UnsupportedObjectError(
                    f"cannot save {item.index.fqn}: it is a tensor on the meta device (no data); "
                    "materialize it before saving"
                )
            if _fast_path(t):
                if not t.is_contiguous():
                    t = t.contiguous()
                sk = cache.get(t.dtype, tuple(t.shape))
                pieces.extend((base + off, chunk) for off, chunk in sk.pieces)
                if sk.nbytes:
                    slots.append(
                        StorageSlot(str(n), base + sk.data_offset, sk.nbytes, _flat_bytes(t))
                    )
                length = sk.size
                tensor_bytes += sk.nbytes
            else:
                blob = _serialized(t)
                pieces.append((base, blob))
                length = len(blob)
        results.append(
            WriteResult(index=item.index, size_in_bytes=length,
                        storage_data=StorageInfo(file_name, base, length))
        )
        pos = base + length
    image = FileImage(
        size=pos, pieces=pieces, slots=slots, serialization_id="", id_offset=0, kind=RANK_FILE_KIND
    )
    return RankImage(image, results, tensor_bytes)

"""What a plan produces: the image of a file (its bytes that are not tensor data, at their
offsets) and the slots where each storage's bytes go. Staging copies into a buffer by it; the
writer writes that buffer as the file."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ..ondisk.torchzip import TorchZip

if TYPE_CHECKING:  # torch is imported where a tensor is made: a writer agent never imports it
    import torch

    from .host_copy import HostCopies
    from .index_json import IndexJson

__all__ = ["MAX_INDEXED_TENSORS", "FileImage", "StorageSlot", "TensorEntry", "byte_view"]

#: Cap on how many tensors the manifest's index names (beyond it the index is truncated).
MAX_INDEXED_TENSORS = 200_000


class StorageSlot:
    """Bytes of the state (a flat uint8 view of a storage or tensor) and where they go.

    Planners give either ``source`` (the bytes as a flat uint8 tensor) or ``storage`` (a whole
    storage: its byte view is made only if someone asks for :attr:`source`; host staging copies
    from :attr:`address` and never needs it). A reused plan (:mod:`.steady`) gives only the host
    ``address``: its slots outlive the save that checked them and must not keep the state alive.
    """

    __slots__ = ("_address", "_device_type", "_source", "_storage", "key", "nbytes", "offset")

    def __init__(self, key: str, offset: int, nbytes: int, source: torch.Tensor | None = None, *,
                 storage: torch.UntypedStorage | None = None, device_type: str | None = None,
                 address: int | None = None) -> None:
        if source is not None and storage is not None:
            raise TypeError("StorageSlot needs a source or a storage, not both")
        if source is None and storage is None and (address is None or device_type != "cpu"):
            raise TypeError("StorageSlot needs a source, a storage or a host address")
        self.key, self.offset, self.nbytes = key, offset, nbytes
        self._source, self._storage = source, storage
        self._device_type = device_type
        self._address = address  # the storage's host address, when the planner knows it

    @property
    def source(self) -> torch.Tensor:
        if self._source is None:
            if self._storage is None:  # a reused plan's slot: the address was checked this save
                assert self._address is not None
                return _at_address(self._address, self.nbytes)
            self._source = byte_view(self._storage)
        return self._source

    @property
    def device_type(self) -> str:
        kind = self._device_type
        if kind is None:
            if self._source is not None:
                kind = "cpu" if self._source.is_cpu else self._source.device.type
            else:
                assert self._storage is not None
                kind = self._storage.device.type
            self._device_type = kind
        return kind

    def host_address(self) -> int | None:
        """Where the bytes start in host memory, when they are one contiguous run there."""
        if self._source is None:
            if self._address is not None:
                return self._address
            assert self._storage is not None
            return int(self._storage.data_ptr()) if self.device_type == "cpu" else None
        src = self._source
        if src.is_cpu and src.is_contiguous() and src.numel() * src.element_size() >= self.nbytes:
            return int(src.data_ptr())
        return None

    def __repr__(self) -> str:
        return (f"StorageSlot(key={self.key!r}, offset={self.offset}, nbytes={self.nbytes}, "
                f"device={self.device_type})")


class TensorEntry(NamedTuple):
    """A named tensor of the state, for the manifest's index (a named tuple: made once per
    tensor per save, so it is cheap to make)."""

    name: str
    storage_key: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


@dataclass
class FileImage:
    """Everything needed to produce the file bytes without pickling again.

    The staging buffer receives ``[0, size)``; the file keeps ``[0, covered)`` of it (a torch
    file's own central directory is replaced by the format-2 tail) and the proof's chunks cover
    exactly that range.
    """

    size: int
    #: The bytes that are not tensor data, at their offsets (memoryviews where a planner shares
    # them).
    pieces: Sequence[tuple[int, bytes | memoryview]]
    slots: list[StorageSlot]
    serialization_id: str
    id_offset: int
    tensors: list[TensorEntry] = field(default_factory=list)
    #: "torch", "safetensors", "dcp" (a sharded rank file), "dcp-metadata" or "raw".
    kind: str = "torch"
    #: torch files: the archive (records, central directory), for the CRCs and the tail.
    zip: TorchZip | None = None
    #: Per slot: where its zip record's CRC goes (data descriptor), -1 when it has no record.
    crc_fields: list[int] = field(default_factory=list)
    #: safetensors files: the region of the header reserved for the proof (hashed as spaces).
    blank: tuple[int, int] | None = None
    #: The pieces and slots cover ``[0, size)`` without a gap (nothing to zero when staging).
    gapless: bool = False
    #: ``(frame, lo, hi)``: ``pieces[lo:hi]`` are the same bytes at the same offsets in every
    #: image that names the same ``frame`` object, so a buffer still holding them from an earlier
    #: save need not receive them again (:func:`.stage.stage_image`).
    static: tuple[object, int, int] | None = None
    #: The host copies of a reused plan (:mod:`.steady`: addresses checked for this save).
    copies: HostCopies | None = None
    #: ``(tensor bytes, non-empty slots)`` when the planner knows them (a reused plan: not
    #: summed over 100,000 slots again at every save).
    counts: tuple[int, int] | None = None
    #: The encoded tensor index, shared by the images of one plan (:mod:`.index_json`;
    #: ``None``: encoded for this image alone).
    index_json: IndexJson | None = None

    @property
    def tensor_bytes(self) -> int:
        return self.counts[0] if self.counts is not None else sum(s.nbytes for s in self.slots)

    @property
    def nonempty_slots(self) -> int:
        return self.counts[1] if self.counts is not None else sum(1 for s in self.slots
                                                                   if s.nbytes)

    @property
    def covered(self) -> int:
        """End of the bytes the file keeps from the image (and the proof's chunks cover)."""
        return self.zip.cd_start if self.zip is not None else self.size

    def devices(self) -> set[str]:
        return {s.device_type for s in self.slots}


def _at_address(address: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` of host memory at ``address`` (no copy; valid while
    that memory is)."""
    import torch

    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over a whole storage (no copy)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)



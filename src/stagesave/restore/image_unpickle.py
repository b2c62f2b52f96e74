"""An image's pickle unpickled over views of its buffer (:mod:`.image_load` reads the image).

``persistent_load`` hands out storages over the image's bytes, each storage id checked against
the file's proof (a known key, a size within its record), restored to ``map_location`` as
``torch.load`` does; the C unpickler's first try (:mod:`.fast_unpickle`) takes each storage as a
:class:`LeanStorage` instead (no ``TypedStorage`` per storage).
"""

from __future__ import annotations

import io
from typing import Any

import torch

from .image_load import Image
from .rebuild_checks import validate_loaded_sparse
from .refusal import BadPickle

__all__ = ["LeanStorage", "unpickle_image"]


class LeanStorage:
    """A storage of the image as a tensor over all of it, for the C unpickler's tensor rebuild
    (:mod:`.fast_unpickle`): no ``TypedStorage`` per storage, and the first tensor rebuilt over
    it is that tensor itself, set to its geometry (one call instead of an empty tensor and a
    ``set_``). What comes out equals torch's rebuild: a tensor of the storage's dtype over the
    storage's bytes, not a view of another tensor."""

    __slots__ = ("dtype", "itemsize", "nbytes", "spare", "untyped")

    def __init__(self, untyped: torch.UntypedStorage, dtype: torch.dtype, itemsize: int,
                 whole: torch.Tensor | None = None, nbytes: int | None = None) -> None:
        """``untyped``: taken when the storage is made, never later of a tensor over it (a
        ``BUILD`` may re-point that tensor before a second one needs the storage)."""
        self.untyped, self.dtype, self.itemsize = untyped, dtype, itemsize
        #: its bytes as handed out: every tensor over it must fit in them (a storage in device
        #: memory can be grown by ``set_``; the rebuild checks first)
        self.nbytes: int = untyped.nbytes() if nbytes is None else nbytes
        #: a tensor over all of the storage the first rebuild may take (``None``: none made)
        self.spare = whole

    @classmethod
    def over(cls, data: memoryview, dtype: torch.dtype) -> LeanStorage:
        """The storage of host bytes ``data`` (a whole number of ``dtype`` elements)."""
        whole = torch.frombuffer(data, dtype=dtype)
        return cls(whole.untyped_storage(), dtype, whole.element_size(), whole, data.nbytes)

    def tensor(self, offset: Any, size: Any, stride: Any) -> torch.Tensor:
        """A new tensor over the storage (torch's checks: within the storage's bytes)."""
        whole = self.spare
        if whole is not None:
            self.spare = None
            return whole.as_strided_(size, stride, offset)
        return torch.empty((0,), dtype=self.dtype, device=self.untyped.device).set_(
            self.untyped, offset, size, stride)


def unpickle_image(image: Image, map_location: Any, unpickler: Any, *,
                   validate_sparse: bool = True) -> Any:
    """Run ``unpickler`` (a class taking the pickle's stream) over the image's pickle, its
    storages views of the image's buffer restored to ``map_location`` as ``torch.load`` does
    (``validate_sparse``: then torch's check of the sparse tensors the unpickler made, which
    reads them)."""
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

    records, view, frombuffer = image.storages, image.view, torch.frombuffer

    def lean(storage_type: Any, key: Any, location: Any, numel: Any) -> LeanStorage | None:
        """The storage as the C unpickler's tensor rebuild takes it (``None``: it needs
        torch's typed storage: restored elsewhere, or no bytes). Called once per storage:
        :func:`region`'s checks and :meth:`LeanStorage.over` are inline for the image's
        bytes."""
        if type(key) is str:
            made = leans.get(key)
            if made is not None:
                return made
        if memory is not None:
            dtype, data = region(storage_type, key, location, numel)
            if data is None:
                return None
            made = leans[key] = LeanStorage(data.untyped_storage(), dtype, kinds[storage_type][1])
            return made
        if not (on_cpu and location == "cpu"):
            return None
        if type(key) is not str or type(numel) is not int:  # (location: the str "cpu")
            raise BadPickle("a storage id of the wrong types")
        kind = kinds.get(storage_type)
        if kind is None:  # the first storage of its type: region() notes its kind
            region(storage_type, key, location, numel)
            kind = kinds[storage_type]
        dtype, size = kind
        record = records.get(key)
        nbytes = numel * size
        if record is None or numel < 0 or nbytes > record.nbytes:
            raise BadPickle(f"storage {key!r} is not in {image.where}'s proof, or larger")
        if not nbytes:
            return None
        offset = record.offset
        whole = frombuffer(view[offset : offset + nbytes], dtype=dtype)
        made = leans[key] = LeanStorage(whole.untyped_storage(), dtype, size, whole, nbytes)
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
    if validate_sparse:
        validate_loaded_sparse()
    return result

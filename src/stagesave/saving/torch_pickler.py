"""A pickler that reduces plain tensors and parameters as ``torch.save`` does, byte for byte:
``_rebuild_tensor_v2``/``_rebuild_parameter`` with torch's arguments, storages named by
torch's persistent ids (same keys, types, locations and counts, in the same order). Anything
it cannot reduce that way raises :class:`Unsupported` (the caller then uses ``torch.save``)."""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any

import torch

__all__ = ["ELEMENT_SIZE", "STORAGE_CLASS", "Mark", "TorchPickler", "Unsupported"]


#: dtype -> the legacy storage class ``torch.save`` names in its persistent ids.
STORAGE_CLASS: dict[torch.dtype, Any] = {
    dtype: getattr(torch, name)
    for dtype, name in torch.storage._dtype_to_storage_type_map().items()
    if not name.startswith("Q")  # quantized tensors are reduced differently
}
ELEMENT_SIZE = {dtype: torch.empty(0, dtype=dtype).element_size() for dtype in STORAGE_CLASS}
_rebuild_tensor_v2 = torch._utils._rebuild_tensor_v2
_rebuild_parameter = torch._utils._rebuild_parameter
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided
_OrderedDict = collections.OrderedDict
_metadata = torch._C._get_tensor_metadata  # type: ignore[attr-defined]


class Unsupported(Exception):
    """The state holds something only ``torch.save`` lays out (the caller falls back)."""


class _Ref:
    """One storage as the pickle names it (``persistent_id`` turns it into torch's tuple)."""

    __slots__ = ("cls", "key", "location", "numel")

    def __init__(self, key: str, cls: Any, location: str, numel: int) -> None:
        self.key, self.cls, self.location, self.numel = key, cls, location, numel


class Mark:
    """An object pickled as the persistent id ``pid`` (a float: its bytes can be found in the
    pickle; :mod:`.splice` marks the places of leaves with these)."""

    __slots__ = ("pid",)

    def __init__(self, pid: float) -> None:
        self.pid = pid


class _NoHooks:
    """The empty ``OrderedDict`` torch passes as a tensor's hooks: pickled as one (same bytes),
    without building one and running its generic reduction for every tensor."""

    __slots__ = ()


_NO_HOOKS_REDUCED = (_OrderedDict, ())


class TorchPickler(pickle.Pickler):
    """Pickles a state as ``torch.save`` does, recording its storages in key order."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=2)
        self.refs: dict[int, _Ref] = {}  # storage _cdata -> its reference
        self.storages: list[torch.UntypedStorage] = []  # index = key
        self.devices: list[str] = []  # per storage: "cpu" or the device type
        self.addresses: list[int | None] = []  # per storage: its host address (None: on a device)
        self.dtypes: dict[int, torch.dtype] = {}  # data_ptr -> dtype (torch refuses two)
        #: id of every tensor pickled -> (storage key, dtype, shape, stride, storage offset); the
        #: pickler's memo keeps the objects alive, so the ids stay valid while it lives.
        self.info: dict[int, tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...], int]] = {}
        self.param_data: dict[int, torch.Tensor] = {}

    def persistent_id(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is _Ref:
            # A new tuple each time, as torch's; its key string is shared, as torch's.
            return ("storage", obj.cls, obj.key, obj.location, obj.numel)
        if kind is Mark:
            return obj.pid
        return None

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is _Tensor:
            return self._tensor(obj)
        if kind is _NoHooks:
            return _NO_HOOKS_REDUCED
        if kind is _Parameter:
            if obj.__dict__ or obj._backward_hooks:
                raise Unsupported("a parameter with attributes or hooks")
            data = self.param_data[id(obj)] = obj.data
            return (_rebuild_parameter, (data, obj.requires_grad, _NoHooks()))
        if isinstance(obj, (_Tensor, torch.storage.TypedStorage, torch.UntypedStorage)):
            raise Unsupported(f"a {kind.__qualname__}")
        return NotImplemented

    def _tensor(self, t: torch.Tensor) -> Any:
        dtype = t.dtype
        cls = STORAGE_CLASS.get(dtype)
        if (cls is None or t.layout is not _strided or not (t.is_cpu or t.is_cuda) or t.__dict__
                or t._backward_hooks or _metadata(t)):
            raise Unsupported("a tensor torch.save reduces differently")
        storage = t.untyped_storage()
        ref = self.refs.get(storage._cdata)
        if ref is None:
            ptr = storage.data_ptr()
            if ptr and self.dtypes.setdefault(ptr, dtype) is not dtype:
                raise Unsupported("two dtypes over one storage")
            location = "cpu" if t.is_cpu else torch.serialization.location_tag(storage)
            ref = _Ref(str(len(self.refs)), cls, location, storage.nbytes() // ELEMENT_SIZE[dtype])
            self.refs[storage._cdata] = ref
            self.storages.append(storage)
            self.devices.append("cpu" if t.is_cpu else "cuda")
            self.addresses.append(ptr if t.is_cpu else None)
        elif ref.cls is not cls:
            raise Unsupported("two dtypes over one storage")
        elif not t.is_cpu:
            ref = _Ref(ref.key, cls, torch.serialization.location_tag(storage), ref.numel)
        offset, shape, stride = int(t.storage_offset()), tuple(t.size()), t.stride()
        self.info[id(t)] = (ref.key, dtype, shape, stride, offset)
        return (_rebuild_tensor_v2, (ref, offset, shape, stride, t.requires_grad, _NoHooks()))



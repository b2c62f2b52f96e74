"""Tensor indexes: the name, dtype, shape and bytes of every tensor a file holds, read
without its data (a safetensors header, a torch file unpickled with ``map_location="meta"``
through ranged reads), and the index a proof records, every field checked.
"""

from __future__ import annotations

import io
import json
import struct
from typing import Any

import torch

from ..errors import UnsafeCheckpointError
from ..ondisk.manifest import MAX_NUMEL, MAX_RANK, Manifest
from ..safety import safe_torch_load
from ..stores.base import Store

__all__ = [
    "MAX_DIMS", "StoreReader", "manifest_tensors", "needs_unsafe_global", "tensor_index",
    "torch_index",
]

#: Largest safetensors header we agree to parse (the library's own cap is 100 MB).
_MAX_ST_HEADER = 100_000_000


_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
    "U64": "uint64", "C64": "complex64",
}


def _safetensors_index(store: Store, name: str) -> list[dict[str, Any]]:
    head = store.read_range(name, 0, 8)
    if len(head) != 8:
        raise ValueError(f"{store.describe(name)} is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_ST_HEADER:
        raise ValueError(
            f"{store.describe(name)}: safetensors header of {n} bytes is over the limit"
        )
    header = json.loads(store.read_range(name, 8, n))
    if not isinstance(header, dict):
        # a ValueError like every other malformed header: callers name the type in messages
        raise ValueError(  # noqa: TRY004, RUF100
            f"{store.describe(name)}: the safetensors header is not a JSON object"
        )
    out = []
    for key, spec in header.items():
        if key == "__metadata__" or not isinstance(spec, dict):
            continue
        offsets, shape, dtype = spec.get("data_offsets"), spec.get("shape"), spec.get("dtype")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) for d in shape)
            or not isinstance(dtype, str)
        ):
            raise ValueError(f"{store.describe(name)}: malformed safetensors entry {key[:80]!r}")
        out.append({"name": key, "dtype": _ST_DTYPES.get(dtype, dtype), "shape": shape,
                    "bytes": offsets[1] - offsets[0]})
    return out


class StoreReader(io.RawIOBase):
    """A seekable file over ``store.read_range`` (so torch reads only what it needs)."""

    def __init__(self, store: Store, name: str, size: int) -> None:
        super().__init__()
        self.store, self.name, self.size, self.pos = store, name, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        data = self.store.read_range(
            self.name, self.pos, min(len(view), max(0, self.size - self.pos))
        )
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _walk(obj: Any, prefix: str, out: list[dict[str, Any]], depth: int = 0) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(
            {
                "name": prefix,
                "dtype": str(obj.dtype).removeprefix("torch."),
                "shape": list(obj.shape),
                "bytes": obj.numel() * obj.element_size(),
            }
        )
    elif depth < 64 and isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{prefix}.{k}" if prefix else str(k), out, depth + 1)
    elif depth < 64 and isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{prefix}.{i}" if prefix else str(i), out, depth + 1)


def needs_unsafe_global(exc: BaseException) -> bool:
    """Whether a refused load was refused for a class off the allow-list (the file is fine),
    rather than for a pickle that does not parse (the file is damaged)."""
    if not isinstance(exc, UnsafeCheckpointError):
        return False
    return "GLOBAL" in str(exc.__cause__ or "")  # torch: "Unsupported global: GLOBAL mod.Class"


def torch_index(
    store: Store, name: str, size: int, *, trusted: bool = False
) -> list[dict[str, Any]]:
    """Tensors of a torch file, read without their data (``map_location="meta"``).

    Raises:
        UnsafeCheckpointError: the structure needs a global off the allow-list (and not trusted).
    """
    source = io.BufferedReader(StoreReader(store, name, size), 1 << 20)
    state = safe_torch_load(
        source, map_location="meta", trusted=trusted, where=store.describe(name)
    )
    out: list[dict[str, Any]] = []
    _walk(state, "", out)
    return out


def tensor_index(
    store: Store, name: str, kind: str, size: int, *, trusted: bool = False
) -> list[dict[str, Any]]:
    """Name, dtype, shape and bytes of every tensor in one file (safetensors or torch)."""
    if kind == "safetensors" or name.endswith(".safetensors"):
        return _safetensors_index(store, name)
    return torch_index(store, name, size, trusted=trusted)


#: Most dimensions of a shape shown (the core refuses a proof whose index claims more).
MAX_DIMS = MAX_RANK
_MAX_NUMEL = MAX_NUMEL
_ITEMSIZE: dict[str, int] = {}


def _itemsize(dtype: str) -> int | None:
    if dtype not in _ITEMSIZE:
        dt = getattr(torch, dtype, None) if dtype.isidentifier() else None
        _ITEMSIZE[dtype] = dt.itemsize if isinstance(dt, torch.dtype) else 0
    return _ITEMSIZE[dtype] or None


def manifest_tensors(manifest: Manifest) -> tuple[list[dict[str, Any]], int]:
    """The proof's tensor index as ``{name, dtype, shape, bytes}`` rows, every field checked
    (a proof is read from a file that may come from anywhere); and how many entries were not
    well-formed (left out). ``bytes`` is ``None`` when the dtype is unknown to this torch."""
    out = []
    bad = 0
    tensors = manifest.tensors if isinstance(manifest.tensors, list) else []
    for t in tensors:
        name, dtype, shape = (
            (t.get("name"), t.get("dtype"), t.get("shape")) if isinstance(t, dict) else (None,) * 3
        )
        if (
            not isinstance(name, str)
            or not isinstance(dtype, str)
            or len(dtype) > 64
            or not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _MAX_NUMEL
                for d in shape
            )
        ):
            bad += 1
            continue
        numel = 1
        for d in shape:
            numel = min(numel * d, _MAX_NUMEL + 1)
        if numel > _MAX_NUMEL:
            bad += 1
            continue
        size = _itemsize(dtype)
        out.append(
            {
                "name": name,
                "dtype": dtype,
                "shape": list(shape),
                "bytes": None if size is None else numel * size,
            }
        )
    return out, bad

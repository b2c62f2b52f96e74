"""A safetensors file's verified bytes, kept for the load that follows, and its tensors as views.

Accelerate's ``load_state`` loads ``model.safetensors`` with safetensors' own reader, which maps
the file and copies every tensor out of the page cache, after the choice of the checkpoint has
read every byte once to verify it. Inside :func:`.kept_images.keeping` that verification reads
the file into one buffer (parallel ``O_DIRECT`` chunk reads, each chunk hashed as it lands,
:func:`.image_load.read_proven`) and keeps it as a :class:`SafetensorsImage`; the load then takes
the tensors from it (:func:`tensors_of`). The header is checked before any tensor is made: a JSON
object of at most :data:`MAX_HEADER` bytes whose every entry has a known dtype, a shape of
integers from 0 to 2**63 - 1 and data offsets within the data section holding exactly the bytes that
shape needs, aligned to the dtype's size, the tensors tiling the data section (as safetensors
requires). Anything else gives ``None``, and the caller lets safetensors read the file itself,
which judges it in its own words.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

__all__ = ["MAX_HEADER", "SafetensorsImage", "tensors_of"]

#: The largest header read from a kept image (safetensors' own limit is 100 MB).
MAX_HEADER = 100_000_000

#: More dimensions than this: safetensors reads the file (a product of a million sizes is slow).
_MAX_DIMS = 64
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):  # (MX scales; torch 2.7 and later)
    _DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


@dataclass
class SafetensorsImage:
    """A safetensors file's bytes in memory, as its verification read them."""

    view: memoryview
    where: str


def _counts(value: Any, length: int | None = None) -> TypeGuard[list[int]]:
    return (isinstance(value, list) and (length is None or len(value) == length)
            and all(type(v) is int and 0 <= v < 1 << 63 for v in value))


def tensors_of(image: SafetensorsImage) -> dict[str, torch.Tensor] | None:
    """Every tensor of the file, each a view of the image's memory (which it keeps alive), in
    the header's order; ``None`` when the header is not one this reads (see the module)."""
    view = image.view
    if len(view) < 8:
        return None
    n = int.from_bytes(view[:8], "little")
    if n > MAX_HEADER or 8 + n > len(view):
        return None
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
    except (ValueError, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    base, data = 8 + n, len(view) - 8 - n
    out: dict[str, torch.Tensor] = {}
    spans: list[tuple[int, int]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            return None
        dtype = _DTYPES.get(str(info.get("dtype")))
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if (dtype is None or not _counts(shape) or len(shape) > _MAX_DIMS
                or not _counts(offsets, 2)):
            return None
        lo, hi = offsets
        numel, size = math.prod(shape), dtype.itemsize
        if not lo <= hi <= data or hi - lo != numel * size or (base + lo) % size:
            return None
        spans.append((lo, hi))
        try:  # anything else torch refuses
            out[name] = (torch.frombuffer(view, dtype=dtype, count=numel, offset=base + lo)
                         .view(shape) if numel else torch.empty(shape, dtype=dtype))
        except (RuntimeError, ValueError, TypeError, OverflowError):
            return None
    at = 0  # as safetensors: the tensors tile the data section, in the order of their offsets
    for lo, hi in sorted(spans):
        if lo != at:
            return None
        at = hi
    return out if at == data else None

"""What a safe load checks of the tensors a pickle makes, beyond torch's own checks.

Torch's loader trusts the file: a storage it can grow (one of no bytes) is grown by ``set_`` to
whatever geometry the pickle gives (memory never written, handed out), and sparse tensors are
validated only when torch's invariant checks are on. A hostile file with a consistent proof gets
past neither here (:mod:`.unpickle` and :mod:`.fast_unpickle` call these).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from .refusal import BadPickle

__all__ = [
    "EMPTY_OFFSET_LIMIT", "STORAGES", "check_fits", "check_rebuild", "check_set", "fits",
    "validate_loaded_sparse",
]


def fits(nbytes: int, itemsize: int, offset: Any, size: Any, stride: Any) -> bool:
    """Whether a tensor of ``size`` and ``stride`` (tuples of ints) at element ``offset`` (an
    int) lies within a storage of ``nbytes``, computed exactly; ``False`` for anything else
    (:func:`check_fits` then names the problem). The first try of the C unpickler asks this
    of every tensor it rebuilds."""
    if (type(offset) is not int or type(size) is not tuple or type(stride) is not tuple
            or len(size) != len(stride) or offset < 0):
        return False
    last = offset
    empty = False
    for d, st in zip(size, stride):
        if type(d) is not int or type(st) is not int or d < 0 or st < 0:
            return False
        if d == 0:
            empty = True
        last += (d - 1) * st
    if empty:
        return offset * itemsize < EMPTY_OFFSET_LIMIT
    return offset * itemsize <= nbytes and (last + 1) * itemsize <= nbytes


def check_fits(untyped: Any, dtype: Any, offset: Any, size: Any, stride: Any) -> None:
    """Refuse a tensor's geometry that reaches past its storage's bytes, computed exactly in
    Python: ``set_`` would grow a resizable storage (one of no bytes, or one torch read from a
    record) to what the pickle says, memory never written (a bomb, or the heap's old bytes
    handed out), and torch's own bound check of any storage computes the offset's bytes in 64
    bits, which a huge offset wraps (a tensor before its storage, read and written).

    Raises:
        BadPickle: it does not fit.
    """
    try:  # (a 0-d tensor stands for a number too: its verified bytes are read here, as by set_)
        offset = operator.index(offset)
        dims = [(operator.index(d), operator.index(st))
                for d, st in zip(size, stride, strict=True)]
    except (TypeError, ValueError) as exc:
        raise BadPickle(f"a tensor's offset, size and stride are not numbers of one rank: "
                        f"{exc}") from exc
    itemsize = torch._utils._element_size(dtype)  # type: ignore[no-untyped-call]
    per_byte = _PER_BYTE.get(dtype)
    if per_byte is not None:  # torch counts each element a byte; its storage packs them
        return _check_packed(untyped.nbytes(), per_byte, offset, dims, size)
    if any(d == 0 for d, _ in dims) and min(d for d, _ in dims) >= 0:
        if offset < 0 or offset * itemsize >= EMPTY_OFFSET_LIMIT:
            raise BadPickle(f"a tensor of no elements at offset {offset}, which torch's "
                            "64-bit byte arithmetic would wrap")
        return  # no bytes: torch lets its offset lie past the storage (x[1:] of a (2, 0) x)
    if offset < 0 or offset * itemsize > untyped.nbytes():
        raise BadPickle(f"a tensor at offset {offset} starts past its storage of "
                        f"{untyped.nbytes()} bytes")
    last = offset + sum((d - 1) * st for d, st in dims)
    if min((st for _, st in dims), default=0) < 0 or min((d for d, _ in dims), default=0) < 0 or (
            (last + 1) * itemsize > untyped.nbytes()):
        raise BadPickle(f"a tensor of size {tuple(size)} at offset {offset} reaches past its "
                        f"storage of {untyped.nbytes()} bytes")


#: Quantized dtypes of less than a byte: how many elements one byte of their storage holds.
_PER_BYTE = {torch.quint4x2: 2, torch.quint2x4: 4}


def _check_packed(nbytes: int, per_byte: int, offset: int, dims: list[tuple[int, int]],
                  size: Any) -> None:
    """:func:`check_fits` for a storage packing ``per_byte`` elements in each byte."""
    if offset < 0 or min((v for d in dims for v in d), default=0) < 0:
        raise BadPickle(f"a tensor of size {tuple(size)} at offset {offset} has negative numbers")
    if any(d == 0 for d, _ in dims):
        if offset >= EMPTY_OFFSET_LIMIT:
            raise BadPickle(f"a tensor of no elements at offset {offset}, which torch's "
                            "64-bit byte arithmetic would wrap")
        return
    last = offset + sum((d - 1) * st for d, st in dims)
    if -(-(last + 1) // per_byte) > nbytes:
        raise BadPickle(f"a tensor of size {tuple(size)} at offset {offset} reaches past its "
                        f"storage of {nbytes} bytes")


#: A tensor of no elements may sit at any offset, as torch allows (``torch.zeros(2, 0)[1:]``
#: is at offset 1 of a storage of no bytes), below this many bytes (no 64-bit wrap).
EMPTY_OFFSET_LIMIT = 1 << 62

STORAGES = (torch.storage.TypedStorage, torch.UntypedStorage)
_REBUILD_V3 = getattr(torch._utils, "_rebuild_tensor_v3", None)


def check_set(inst: torch.Tensor, state: Any) -> None:
    """A ``BUILD`` of a tensor (torch's legacy ``set_(source, offset, size, stride)``, which
    torch never writes today) held to :func:`check_fits` as a rebuild is: ``set_`` grows a
    resizable storage to whatever geometry it is given.

    Raises:
        BadPickle: not ``(source)`` or ``(source, offset, size, stride)`` of a tensor or a
            storage, or it does not fit.
    """
    if type(state) is not tuple or len(state) not in (1, 4):
        raise BadPickle("it sets a tensor's state with other than (source, offset, size, stride)")
    source = state[0]
    if isinstance(source, torch.Tensor):
        untyped = source.untyped_storage()
    elif isinstance(source, torch.storage.TypedStorage):
        untyped = source._untyped_storage
    elif isinstance(source, torch.UntypedStorage):
        untyped = source
    else:
        raise BadPickle(f"it sets a tensor over a {type(source).__name__}, not a tensor or a "
                        "storage")
    if len(state) == 4:
        check_fits(untyped, inst.dtype, *state[1:])


def check_rebuild(func: Any, args: tuple[Any, ...]) -> None:
    """:func:`check_fits` for a rebuild called with ``(storage, offset, size, stride, ...)``
    (``_rebuild_tensor_v3`` names the dtype of an untyped storage as its seventh argument)."""
    storage = args[0]
    if isinstance(storage, torch.storage.TypedStorage):
        untyped, dtype = storage._untyped_storage, storage.dtype
    else:
        untyped = storage
        dtype = args[6] if (func is _REBUILD_V3 and len(args) > 6
                            and isinstance(args[6], torch.dtype)) else torch.uint8
    check_fits(untyped, dtype, *args[1:4])


def validate_loaded_sparse() -> None:
    """torch's checks of the sparse tensors a load made (indices within their sizes), which
    torch itself skips unless its invariant checks are on: an index out of bounds would write or
    read outside the values' memory when the tensor is used.

    Raises:
        BadPickle: a sparse tensor does not hold.
    """
    if not torch._utils._sparse_tensors_to_validate:
        return
    try:
        with torch.sparse.check_sparse_tensor_invariants(enable=True):  # type: ignore[no-untyped-call]
            torch._utils._validate_loaded_sparse_tensors()  # type: ignore[no-untyped-call]
    except (RuntimeError, ValueError, IndexError, NotImplementedError) as exc:
        raise BadPickle(f"a sparse tensor is not valid: {exc}") from exc

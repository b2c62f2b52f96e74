"""The tensor index's JSON, encoded once per plan.

A format-2 torch file's index record lists every tensor (name, storage, dtype, shape, stride,
storage offset). It changes only when the state's structure does, yet it was rebuilt at every
save: one dict per tensor, then ``json.dumps``, on the writer's CPU (at 100,000 tensors ~0.5 s
of the writer thread's or the writer agent's time per save, beside the training loop). Now the
entries are encoded by msgspec (compiled: ~15 ms at 100,000) into exactly the bytes
``json.dumps(..., separators=(",", ":"))`` writes, and the images of one plan share an
:class:`IndexJson`, so a steady save encodes nothing.

Anything msgspec would write differently is encoded by ``json.dumps`` as before: a name outside
ASCII or holding a DEL (``json.dumps`` escapes both), a float that is not finite (it refuses
one, msgspec writes ``null``; a name holding such a token counts), a type msgspec does not
know.

The index holds only what a loader accepts (:func:`indexable`): a tensor whose name is longer
than a loader reads, or of more dimensions, is not indexed, and the entries past
:data:`MAX_INDEX_BYTES` are left out, as those past
:data:`~stagesave.saving.image.MAX_INDEXED_TENSORS` are. The index describes; the pickle is
the state, and loads whole.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import threading
from collections.abc import Sequence
from typing import Any

import msgspec

from ..errors import UnsupportedObjectError
from ..ondisk.names import MAX_MANIFEST_BYTES
from ..ondisk.validate import MAX_NUMEL, MAX_RANK, MAX_TENSOR_NAME
from .image import TensorEntry

__all__ = ["MAX_INDEX_BYTES", "IndexJson", "encode_tensors", "index_record", "indexable"]

#: The tensors' JSON is at most this many bytes: the index record around it (with the save's
#: telemetry) stays well under the :data:`~stagesave.ondisk.names.MAX_MANIFEST_BYTES` a loader
#: reads.
MAX_INDEX_BYTES = MAX_MANIFEST_BYTES // 2


class _Entry(msgspec.Struct):
    """One entry, its fields in the order the index writes them (that of :class:`TensorEntry`,
    whose ``storage_key`` the index calls ``storage``)."""

    name: str
    storage: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


_encode = msgspec.json.Encoder().encode


class IndexJson:
    """The encoded entries of one plan's tensors, made by the first save that needs them and
    shared by every image of that plan (whose entries are the very same objects)."""

    __slots__ = ("_lock", "data", "entries")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries: Sequence[Any] | None = None  # what ``data`` encodes (compared by identity)
        self.data: bytes | None = None

    def of(self, entries: Sequence[Any]) -> bytes:
        """The JSON of ``entries`` (kept: the next call with the same entries takes it)."""
        with self._lock:
            if self.data is not None and self.entries is not None and _same(self.entries,
                                                                            entries):
                return self.data
            data = encode_tensors(entries)
            self.entries, self.data = list(entries), data
            return data


def _same(old: Sequence[Any], new: Sequence[Any]) -> bool:
    """The same entry objects in the same order (entries are immutable tuples of str and int)."""
    return len(old) == len(new) and all(map(_is, old, new))


def _is(a: object, b: object) -> bool:
    return a is b


def indexable(entries: Sequence[TensorEntry | dict[str, Any]]) -> list[Any]:
    """The entries a loader's check of the index accepts: names of at most
    :data:`~stagesave.ondisk.validate.MAX_TENSOR_NAME` characters, at most
    :data:`~stagesave.ondisk.validate.MAX_RANK` dimensions, sizes, strides, offsets and element
    counts of at most :data:`~stagesave.ondisk.validate.MAX_NUMEL` (torch sets none of these
    limits)."""
    if not entries:
        return []
    if set(map(type, entries)) <= {TensorEntry}:
        try:
            shapes = list(map(operator.itemgetter(3), entries))
            strides = list(map(operator.itemgetter(4), entries))
            if (max(map(len, map(operator.itemgetter(0), entries))) <= MAX_TENSOR_NAME
                    and max(map(len, shapes)) <= MAX_RANK
                    and max(map(operator.itemgetter(5), entries)) <= MAX_NUMEL
                    and max(map(max, filter(None, shapes)), default=0) <= MAX_NUMEL
                    and max(map(max, filter(None, strides)), default=0) <= MAX_NUMEL
                    and max(map(math.prod, shapes)) <= MAX_NUMEL):
                return list(entries)  # (C loops: ~40 ms at 100,000 tensors, once per plan)
        except TypeError:  # a value that is not a number (an adopted file's None): one by one
            pass
        return [e for e in entries if _readable(e)]  # type: ignore[arg-type]
    return [e for e in entries if _readable_dict(e)]  # type: ignore[arg-type]


def check_empty_offsets(entries: Sequence[TensorEntry | dict[str, Any]]) -> None:
    """Refuse a tensor of no elements whose offset in bytes reaches 2**62: ``torch.save`` writes
    it, but a loader refuses it (torch's 64-bit byte arithmetic wraps near there), so it would
    be saved and then unloadable. Only offsets of 2**58 elements and more are looked at (run
    when a state is planned, not at each save of a plan).

    Raises:
        UnsupportedObjectError: which tensor, and the remedy.
    """
    if not entries or not set(map(type, entries)) <= {TensorEntry}:
        return
    try:
        if max(map(operator.itemgetter(5), entries)) < 1 << 58:
            return
    except TypeError:  # (a value that is not a number: left to the encoder)
        return
    import torch  # (here: the writer agent imports this module and never torch)

    from ..restore.rebuild_checks import EMPTY_OFFSET_LIMIT

    for e in entries:
        if not isinstance(e, TensorEntry):
            continue
        if (type(e.storage_offset) is int and e.storage_offset >= 1 << 58
                and 0 in e.shape):
            size = getattr(torch, e.dtype, torch.uint8).itemsize
            if e.storage_offset * size >= EMPTY_OFFSET_LIMIT:
                raise UnsupportedObjectError(
                    f"cannot save the tensor {e.name!r}: it has no elements but lies at storage "
                    f"offset {e.storage_offset}, whose byte offset a loader refuses (torch's "
                    "64-bit byte arithmetic wraps there); save an empty tensor of its shape "
                    "instead (t.new_empty(t.shape))"
                )


def _over(x: Any) -> bool:
    return type(x) is int and not 0 <= x <= MAX_NUMEL


def _readable(e: TensorEntry) -> bool:
    """Whether a loader's check of the entry accepts its numbers and lengths (values that are
    not ints are left to the encoder, which writes or refuses them as ``json.dumps`` does)."""
    try:
        return not (len(e.name) > MAX_TENSOR_NAME or len(e.shape) > MAX_RANK
                    or _over(e.storage_offset) or any(map(_over, e.shape))
                    or any(map(_over, e.stride)) or _over(math.prod(e.shape)))
    except TypeError:
        return True


def _readable_dict(e: dict[str, Any]) -> bool:
    try:
        return len(e.get("name", "")) <= MAX_TENSOR_NAME and len(e.get("shape", ())) <= MAX_RANK
    except TypeError:
        return True


def encode_tensors(entries: Sequence[TensorEntry | dict[str, Any]]) -> bytes:
    """The JSON array of the index's :func:`indexable` entries, as ``json.dumps`` writes it
    compactly, the longest run of them that fits :data:`MAX_INDEX_BYTES`.

    Raises:
        ValueError, TypeError: as ``json.dumps`` does (a value JSON cannot hold).
    """
    entries = indexable(entries)
    data = _encode_all(entries)
    if len(data) <= MAX_INDEX_BYTES:
        return data
    size = 1  # "["
    for k, e in enumerate(entries):
        size += len(_encode_all([e])) - 1  # its bytes and the comma or "]" after it
        if size > MAX_INDEX_BYTES:
            return _encode_all(entries[:k])
    return data  # pragma: no cover - the whole run fit after all


def _encode_all(entries: list[Any]) -> bytes:
    if set(map(type, entries)) <= {TensorEntry}:
        try:
            data = _encode(list(itertools.starmap(_Entry, entries)))
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
            data = None
        if data is not None and data.isascii() and not any(
                token in data for token in (b"\x7f", b":null", b",null", b"[null")):
            return data
        entries = [_as_dict(e) for e in entries]
    return _dumps(list(entries))


def _as_dict(e: TensorEntry) -> dict[str, Any]:
    return {"name": e.name, "storage": e.storage_key, "dtype": e.dtype, "shape": list(e.shape),
            "stride": list(e.stride), "storage_offset": e.storage_offset}


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def index_record(tensors: bytes, telemetry: dict[str, Any]) -> bytes:
    """The index record: ``{"tensors": ..., "telemetry": ...}`` as ``json.dumps`` writes it,
    its tensors already encoded (:func:`encode_tensors`)."""
    return b'{"tensors":' + tensors + b',"telemetry":' + _dumps(telemetry) + b"}"

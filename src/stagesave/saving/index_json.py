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
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Sequence
from typing import Any

import msgspec

from .image import TensorEntry

__all__ = ["IndexJson", "encode_tensors", "index_record"]


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


def encode_tensors(entries: Sequence[TensorEntry | dict[str, Any]]) -> bytes:
    """The JSON array of the index's entries, as ``json.dumps`` writes it compactly.

    Raises:
        ValueError, TypeError: as ``json.dumps`` does (a value JSON cannot hold).
    """
    if set(map(type, entries)) <= {TensorEntry}:
        try:
            data = _encode(list(itertools.starmap(_Entry, entries)))
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
            data = None
        if data is not None and data.isascii() and not any(
                token in data for token in (b"\x7f", b":null", b",null", b"[null")):
            return data
        entries = [_as_dict(e) for e in entries]  # type: ignore[arg-type]
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

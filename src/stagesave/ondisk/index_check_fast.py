"""A tensor index checked in compiled code: msgspec decodes and bounds every common entry.

A load does not use the tensor index, but must refuse a file whose index does not validate
(:mod:`stagesave.restore.index_check`). :func:`.parse.parse_index` builds ~10 Python objects
per entry and checks each in Python: ~2.5 µs per tensor, a quarter of a second at 100,000.
Here msgspec decodes the index against the shape of the common entry (the six fields of plain
types, within the bounds :func:`.validate._plain_tensor` checks) without building a dict per
entry; what is left (a stride as long as its shape, the element count) runs as C loops.

Whatever msgspec does not accept (a field more or less, a ``null``, a float where an int goes,
a string it will not decode, JSON it reads differently) is parsed by :func:`.parse.parse_index`
as before, which accepts what it accepts and names what is wrong in its own words: this module
only ever says yes sooner.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from .names import MAX_MANIFEST_BYTES
from .parse import parse_index
from .validate import MAX_ENTRIES, MAX_NUMEL, MAX_RANK, MAX_TENSOR_NAME, load_json, telemetry

__all__ = ["check_index"]

_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_NUMEL)]
_Short = Annotated[str, msgspec.Meta(max_length=64)]


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    """The common entry, as :func:`.validate._plain_tensor` sees it at a glance."""

    name: Annotated[str, msgspec.Meta(max_length=MAX_TENSOR_NAME)]
    storage: _Short
    dtype: _Short
    shape: Annotated[list[_Count], msgspec.Meta(max_length=MAX_RANK)]
    stride: Annotated[list[_Count], msgspec.Meta(max_length=MAX_RANK)]
    storage_offset: _Count


class _Index(msgspec.Struct, forbid_unknown_fields=True):
    """The index record as stagesave writes it (a member more: :func:`.parse.parse_index`, which
    ignores it, reads it; its JSON nested deeper than Python's recursion limit or not)."""

    tensors: Annotated[list[_Entry], msgspec.Meta(max_length=MAX_ENTRIES)] = []
    telemetry: msgspec.Raw = msgspec.Raw(b"{}")


_decode = msgspec.json.Decoder(_Index).decode


def check_index(data: bytes, where: str) -> None:
    """Check a format-2 torch file's index record as :func:`.parse.parse_index` does.

    Raises:
        ManifestError: not valid (``parse_index``'s error).
    """
    if not _at_a_glance(data, where):
        parse_index(data, where)


def _at_a_glance(data: bytes, where: str) -> bool:
    """Whether ``data`` is an index of common entries and valid telemetry (``False``: not
    known here, which is not a verdict)."""
    if len(data) > MAX_MANIFEST_BYTES:
        return False
    try:
        doc = _decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return False
    entries = doc.tensors
    shapes = [e.shape for e in entries]
    if list(map(len, shapes)) != [len(e.stride) for e in entries]:
        return False
    if shapes and max(map(math.prod, shapes)) > MAX_NUMEL:
        return False
    raw = bytes(doc.telemetry)
    if raw != b"{}":
        if raw.count(b"{") != 1 or b"[" in raw:  # nested values: the parser's own verdict
            return False  # (whether they pass Python's recursion limit depends on the caller)
        try:
            telemetry(load_json(raw, where), where)
        except Exception:  # noqa: BLE001 - parse_index says what is wrong with it
            return False
    return True


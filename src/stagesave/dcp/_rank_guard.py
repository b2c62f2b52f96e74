"""A rank file's items matched with a recent layout without reading each tensor's facts.

A layout (:class:`._rankfile.RankLayout`) is reused by a save whose items have the same keys:
each item's index, and each tensor's dtype and shape, read in Python with the checks of what
kind of tensor it is (~4 µs a tensor: 0.4 s per save of 100,000 tensors). A layout whose every
tensor went into the file as it is (plain, strided, contiguous: no copy, nothing serialized)
keeps a check of those tensors by torch's compiled check (:mod:`stagesave.saving.tensor_guard`:
their Python type, dispatch keys, which tell a strided host tensor from a sparse, quantized,
nested, meta, conjugate or negative one, dtype, shape and strides). A later save compares only
the items' indexes and blob lengths in Python, and asks that check about its tensors: "the
same" reuses the layout with the tensors as they are; anything else takes the full path.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ..saving import tensor_guard
from ._recent import Recent

__all__ = ["Light", "keep", "light", "reuse"]

_Tensor = torch.Tensor
_BYTE_IO = WriteItemType.BYTE_IO


class Light:
    """One save's items in short: per item ``(index,)`` for a tensor, ``(index, length)`` for a
    byte item; the tensors; what goes into the file, if the layout takes them as they are."""

    __slots__ = ("found", "keys", "tensors")

    def __init__(self, keys: list[tuple[Any, ...]], tensors: list[torch.Tensor],
                 found: list[Any]) -> None:
        self.keys, self.tensors, self.found = keys, tensors, found


def light(items: Sequence[WriteItem], resolved: list[Any]) -> Light | None:
    """``items`` (whose data is ``resolved``) in short; ``None`` where an item's data is
    neither a byte item's nor exactly a ``torch.Tensor`` (the full path handles it)."""
    keys: list[tuple[Any, ...]] = []
    tensors: list[torch.Tensor] = []
    found: list[Any] = []
    key, note, keep = keys.append, tensors.append, found.append
    for item, data in zip(items, resolved):
        if item.type is _BYTE_IO:
            blob = bytes(cast(io.BytesIO, data).getbuffer())
            key((item.index, len(blob)))
            keep(blob)
        elif type(data) is _Tensor and tensor_guard.checkable(data):
            key((item.index,))
            note(data)
            keep(data)
        else:
            return None
    return Light(keys, tensors, found)


def reuse(known: Recent[Any] | None, file_name: str, items: Sequence[WriteItem],
          resolved: list[Any]) -> tuple[Any, Light | None]:
    """The recent layout of ``file_name`` whose items in short are these and whose check says
    their tensors are the same (``None``: none), and the items in short (``None``: they need
    the full path, or no layouts are kept)."""
    short = light(items, resolved) if known is not None else None
    if known is None or short is None:
        return None, short
    return known.find(lambda old: old.file_name == file_name and old.guard is not None
                      and old.light == short.keys and old.guard.same(short.tensors)), short


def keep(layout: Any, short: Light | None, found: list[Any]) -> None:
    """Give ``layout`` (made or found by the full path, which put ``found`` into the file) the
    items in short and a check of their tensors as they are now, if every tensor went in as it
    is (a layout found by the full path had no check, or one that said otherwise)."""
    if short is None:
        return
    if len(found) == len(short.found) and all(
            type(mine) is bytes or mine is theirs for mine, theirs in zip(short.found, found)):
        layout.light, layout.guard = short.keys, tensor_guard.build(short.tensors)
    else:
        layout.light, layout.guard = None, None  # a tensor copied or serialized: the full path

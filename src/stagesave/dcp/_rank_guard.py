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
from ..saving.tensor_guard import Guard
from ._recent import Recent

__all__ = ["Light", "Shape", "Vouched", "keep", "light", "reuse"]

_Tensor = torch.Tensor
_BYTE_IO = WriteItemType.BYTE_IO
_EXACT = frozenset({_Tensor})


class Light:
    """One save's items in short: per item ``(index,)`` for a tensor, ``(index, length)`` for a
    byte item; the tensors; what goes into the file, if the layout takes them as they are."""

    __slots__ = ("found", "keys", "tensors")

    def __init__(self, keys: list[tuple[Any, ...]], tensors: list[torch.Tensor],
                 found: list[Any]) -> None:
        self.keys, self.tensors, self.found = keys, tensors, found


class Shape:
    """Which items of one plan's list are byte items, and the tensor items' keys in short:
    made once per list, kept by the steady planner with the list's places."""

    __slots__ = ("byte_at", "items", "keys", "tensor_at")

    def __init__(self, items: Sequence[WriteItem]) -> None:
        self.items = items  # held: the list is compared by identity
        kinds = [item.type is _BYTE_IO for item in items]
        self.byte_at = [i for i, b in enumerate(kinds) if b]
        self.tensor_at = [i for i, b in enumerate(kinds) if not b]
        self.keys: list[tuple[Any, ...]] = [(item.index,) for item in items]


#: What the planner's checks of a save tell about its items' tensors (``SteadySavePlanner.vouch``):
#: every tensor item checkable, the compiled check they passed, the items' :class:`Shape`.
Vouched = tuple[bool, Guard | None, Shape | None]


def light(items: Sequence[WriteItem], resolved: list[Any], shape: Shape | None = None,
          checked: bool = False) -> Light | None:
    """``items`` (whose data is ``resolved``) in short; ``None`` where an item's data is
    neither a byte item's nor exactly a ``torch.Tensor`` (the full path handles it).

    ``shape``: :class:`Shape` of ``items``; ``checked``: every tensor item's data is known to be
    :func:`~stagesave.saving.tensor_guard.checkable` (the planner took it from its own check of
    this save's state)."""
    if shape is not None and shape.items is items:
        tensors = list(map(resolved.__getitem__, shape.tensor_at))
        if not _EXACT.issuperset(map(type, tensors)):
            return None
        if not checked and not all([tensor_guard.checkable(t) for t in tensors]):  # noqa: C419
            return None
        short, found = list(shape.keys), list(resolved)
        for i in shape.byte_at:
            blob = found[i] = bytes(cast(io.BytesIO, resolved[i]).getbuffer())
            short[i] = (items[i].index, len(blob))
        return Light(short, tensors, found)
    keys: list[tuple[Any, ...]] = []
    tensors = []
    found = []
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
          resolved: list[Any],
          vouched: Vouched = (False, None, None)) -> tuple[Any, Light | None]:
    """The recent layout of ``file_name`` whose items in short are these and whose check says
    their tensors are the same (``None``: none), and the items in short (``None``: they need
    the full path, or no layouts are kept).

    ``vouched``: what the planner's own checks of this save's state say
    (:meth:`.SteadySavePlanner.vouch`): every tensor item's data is one of the tensors it
    checked (so each is :func:`~stagesave.saving.tensor_guard.checkable`), the compiled check
    they passed, and the :class:`Shape` of ``items``. A layout whose check held in a save where
    that same check (the same object, for the same items list) vouched for its tensors is not
    asked again: both checks read the same facts, and the planner's found this save's tensors
    to have the facts they had then."""
    checked, planner_guard, shape = vouched
    short = light(items, resolved, shape, checked) if known is not None else None
    if known is None or short is None:
        return None, short

    def same(old: Any) -> bool:
        if old.file_name != file_name or old.guard is None or old.light != short.keys:
            return False
        if planner_guard is not None and old.vouch is not None and (
                old.vouch[0] is planner_guard and old.vouch[1] is items):
            return True
        if not old.guard.same(short.tensors):
            return False
        if planner_guard is not None:  # both checks hold for these tensors now
            old.vouch = (planner_guard, items)
        return True

    return known.find(same), short


def keep(layout: Any, short: Light | None, found: list[Any], items: Sequence[WriteItem],
         planner_guard: Guard | None = None) -> None:
    """Give ``layout`` (made or found by the full path, which put ``found`` into the file) the
    items in short and a check of their tensors as they are now, if every tensor went in as it
    is (a layout found by the full path had no check, or one that said otherwise), with the
    planner's check that vouched for them in this save (:func:`reuse`)."""
    if short is None:
        return
    if len(found) == len(short.found) and all(
            type(mine) is bytes or mine is theirs for mine, theirs in zip(short.found, found)):
        layout.light, layout.guard = short.keys, tensor_guard.build(short.tensors)
        layout.vouch = (planner_guard, items) if planner_guard is not None and (
            layout.guard is not None) else None
    else:  # a tensor copied or serialized: the full path
        layout.light, layout.guard, layout.vouch = None, None, None

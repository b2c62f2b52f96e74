"""What the C unpickler's first try checks of what it was given and what it made
(:mod:`.fast_unpickle`): a rebuild whose geometry is its storage's whole, arguments that hold
nothing that could read a tensor's bytes, tensors a ``BUILD`` set again after their rebuild, and
storages a ``BUILD`` grew (given their size back)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .image_unpickle import LeanStorage

__all__ = ["give_back_growth", "is_whole", "plain", "unchanged", "untyped_of"]


def is_whole(lean: LeanStorage, offset: Any, size: Any, stride: Any) -> bool:
    """Whether a rebuild's geometry is that of its storage's whole tensor (one dimension of every
    element, contiguous, at offset 0: what a flat parameter or optimizer moment has), each
    number an int as torch writes it."""
    return (type(offset) is int and type(size) is tuple and type(stride) is tuple
            and len(size) == 1 and len(stride) == 1 and type(size[0]) is int
            and type(stride[0]) is int and offset == 0 and stride[0] == 1
            and size[0] * lean.itemsize == lean.nbytes)


def plain(values: Any, depth: int = 0) -> bool:
    """Whether ``values`` (tuples, lists and dicts of them, nested) hold no tensor and nothing
    that could stand for one: plain numbers, strings, ``None``, dtypes, sizes."""
    for v in values:
        kind = type(v)
        if kind in (int, float, bool, str, bytes, type(None)) or isinstance(v, torch.dtype):
            continue
        if depth > 20 or not (kind in (tuple, list, torch.Size) or isinstance(v, dict)):
            return False
        if not plain(v.values() if isinstance(v, dict) else v, depth + 1):
            return False
        if isinstance(v, dict) and not plain(v.keys(), depth + 1):
            return False
    return True


def unchanged(rebuilt: list[tuple[Any, ...]]) -> bool:
    """Whether every tensor the rebuild made still has the version (``set_`` and every
    in-place change count one), hooks and ``requires_grad`` it had then."""
    for t, version, hooks, requires_grad in rebuilt:
        if (t._version != version or t._backward_hooks is not hooks
                or t.requires_grad is not requires_grad):
            return False
    return True


def untyped_of(storage: Any) -> Any:
    """A typed storage's untyped one (an untyped storage itself)."""
    return getattr(storage, "_untyped_storage", storage)


def give_back_growth(made: Sequence[Any]) -> bool:
    """Resize every typed storage handed out back to its size then; whether any had grown."""
    grown = False
    for stored in made:
        if stored.typed is not None:
            untyped = untyped_of(stored.typed)
            if untyped.nbytes() != stored.nbytes:
                untyped.resize_(stored.nbytes)
                grown = True
    return grown

"""The walk of a state that a reused plan (:mod:`.steady`) compares with its template.

One pass over the state records its **structure**: the type and keys of every container, every
tensor's type, shape, stride, storage offset, dtype and ``requires_grad``, every other object
by its pickle; and every tensor's data address, the tensors, the *volatile leaves* (exact
``int``, ``float``, ``bool``, ``None`` and ``str`` values: what a template splices in,
:mod:`.splice`; a training loop changes the step, a learning rate, a checkpoint's path) and the
ids of the containers.

Keys compare by value, and by type too where a dict's first key is not a ``str`` (``1``,
``1.0`` and ``True`` are equal but pickle differently); a dict whose first key is a ``str`` and
whose later keys change only between equal values of other types (``1`` to ``True``) is not
told apart.
"""

from __future__ import annotations

import collections
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MAX_OPAQUE_BYTES", "VOLATILE", "Different", "Walked", "walk"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_OrderedDict = collections.OrderedDict
VOLATILE = frozenset({int, float, bool, type(None)})
_LEAF = object()  # where a volatile number sits in a structure
_TEXT = object()  # where a volatile string sits


class Different(Exception):
    """The state holds something a template cannot stand for."""


@dataclass
class Walked:
    """One save's view of its state, in walk order: its structure (a tensor stands in it by its
    type, shape, stride, storage offset, dtype and ``requires_grad``), the tensors' data
    addresses, the tensors, the volatile leaves, the ids of the containers."""

    structure: list[Any]
    addresses: list[int]
    tensors: list[torch.Tensor]
    leaves: list[Any]
    containers: list[int]  # ids of the dicts, lists, non-empty tuples


#: An object the walk does not look into is compared by its own pickle up to this size; a larger
#: one (a big numpy array) would cost a second pickling at every save: no template then.
MAX_OPAQUE_BYTES = 64 << 10


def _standalone(obj: Any) -> bytes:
    """``obj`` pickled on its own (an object the walk does not look into), refusing tensors and
    anything pickling to more than :data:`MAX_OPAQUE_BYTES`.

    Its pickle says whether it changed, not which objects it shares with the rest of the state:
    the template keeps the sharing it was planned with (values are what they pickle to).
    """
    if getattr(obj, "nbytes", 0) > MAX_OPAQUE_BYTES and type(obj).__module__ == "numpy":
        raise Different("a large numpy array (compared by value at every save: no template)")
    buf = io.BytesIO()
    _Refusing(buf, protocol=2).dump(obj)
    if buf.tell() > MAX_OPAQUE_BYTES:
        raise Different("a large object the walk does not look into")
    return buf.getvalue()


class _Refusing(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (_Tensor, torch.UntypedStorage, torch.storage.TypedStorage)):
            raise Different("a tensor inside an object the walk does not look into")
        return NotImplemented


def walk(state: Any) -> Walked:
    """The structure of ``state`` as a template compares it.

    One pass, each tensor's attributes read together while its object is in cache (reading
    them attribute by attribute over all tensors cost ~25% more for 100,000 tensors), the
    tensors of a container handled inline (no call per tensor).

    Raises:
        Different: a tensor with Python attributes or hooks, or an object the walk does not
            look into holds a tensor.
        RecursionError: it is too deep (or holds itself).
    """
    structure: list[Any] = []
    addresses: list[int] = []
    tensors: list[torch.Tensor] = []
    leaves: list[Any] = []
    containers: list[int] = []
    note, note_address, note_tensor = structure.append, addresses.append, tensors.append
    note_leaf, note_container = leaves.append, containers.append
    plain, volatile, leaf, text = _Tensor, VOLATILE, _LEAF, _TEXT

    def each(values: Any) -> None:
        for value in values:
            kind = type(value)
            if kind is plain:
                if value.__dict__ or value._backward_hooks:
                    raise Different("a tensor with attributes or hooks")
                note((value.shape, value.stride(), value.storage_offset(), value.dtype,
                      value.requires_grad))
                note_address(value.data_ptr())
                note_tensor(value)
            elif kind in volatile:
                note(leaf)
                note_leaf(value)
            elif kind is str:  # pickled whole and memoised, unlike a number: its own mark
                note(text)
                note_leaf(value)
            else:
                visit(value, kind)

    def visit(obj: Any, kind: type) -> None:
        if kind is dict:
            note_container(id(obj))
            keys = tuple(obj)
            # keys compare by value; 1, 1.0 and True are equal but pickle differently
            note((dict, keys) if not keys or type(keys[0]) is str
                 else (dict, keys, tuple(map(type, keys))))
            each(obj.values())
        elif kind is list:
            note_container(id(obj))
            note((list, len(obj)))
            each(obj)
        elif kind is tuple:
            if obj:
                note_container(id(obj))
            note((tuple, len(obj)))
            each(obj)
        elif kind is _OrderedDict:
            note_container(id(obj))
            keys = tuple(obj)
            extra = obj.__dict__
            note((_OrderedDict, keys, tuple(map(type, keys)), bool(extra)))
            each(obj.values())
            if extra:
                visit(extra, dict)
        elif kind is _Parameter:
            if obj.__dict__ or obj._backward_hooks:
                raise Different("a parameter with attributes or hooks")
            note((_Parameter, obj.shape, obj.stride(), obj.storage_offset(), obj.dtype,
                  obj.requires_grad))
            note_address(obj.data_ptr())
            note_tensor(obj)
        elif kind is plain or kind in volatile or kind is str:
            each((obj,))
        else:
            note((kind, _standalone(obj)))

    visit(state, type(state))
    return Walked(structure, addresses, tensors, leaves, containers)

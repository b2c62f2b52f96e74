"""The walk of a state that a reused plan (:mod:`.steady`) compares with its template.

One pass over the state records its **structure**: the type and keys of every container, every
tensor's type, every other object by its pickle; the tensors, the *volatile leaves* (exact
``int``, ``float``, ``bool``, ``None`` and ``str`` values: what a template splices in,
:mod:`.splice`; a training loop changes the step, a learning rate, a checkpoint's path) and the
ids of the containers. The tensors' own facts (shape, stride, storage offset, dtype,
``requires_grad``) and data addresses are read after the walk, only when asked for
(:attr:`Walked.facts`, :attr:`Walked.addresses`): a steady save checks most of them in compiled
code instead (:mod:`.tensor_guard`).

Keys compare by value and by type (``1``, ``1.0`` and ``True``, or a ``str`` and an equal
instance of a ``str`` subclass, are equal but pickle differently); keys of other types than
``str``, ``int``, ``bool`` and ``None`` (a float, whose ``-0.0`` equals ``0.0``; a tuple, whose
members may be equal values of other types) also by their own pickle.
"""

from __future__ import annotations

import collections
import functools
import io
import itertools
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "LEAF", "MAX_DEPTH", "MAX_OPAQUE_BYTES", "TEXT", "VOLATILE", "Different", "Walked",
    "file_bounds", "walk",
]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_OrderedDict = collections.OrderedDict
_untyped_storage = torch.Tensor.untyped_storage
_data_ptr = torch.Tensor.data_ptr
_storage_offset = torch.Tensor.storage_offset
_storage_address = torch._C._storage_address  # type: ignore[attr-defined]
_metadata = torch._C._get_tensor_metadata  # type: ignore[attr-defined]
VOLATILE = frozenset({int, float, bool, type(None)})
LEAF = object()  # where a volatile number sits in a structure
TEXT = object()  # where a volatile string sits


class Different(Exception):
    """The state holds something a template cannot stand for."""


#: A tensor's facts as its pickle records them: shape, stride, storage offset, dtype,
#: ``requires_grad`` and torch's metadata (its conjugate and negative bits: ``{}`` for most).
Fact = tuple[torch.Size, tuple[int, ...], Any, torch.dtype, bool, dict[str, Any]]


@dataclass
class Walked:
    """One save's view of its state, in walk order: its structure (a tensor stands in it by its
    type), the tensors, the volatile leaves, the ids of the containers; the tensors' facts and
    data addresses when asked for."""

    structure: list[Any]
    tensors: list[torch.Tensor]
    leaves: list[Any]
    containers: list[int]  # ids of the dicts, lists, non-empty tuples

    @functools.cached_property
    def facts(self) -> list[Fact]:
        """Per tensor: its shape, stride, storage offset, dtype, ``requires_grad`` and
        metadata."""
        return [(t.shape, t.stride(), t.storage_offset(), t.dtype, t.requires_grad, _metadata(t))
                for t in self.tensors]

    @functools.cached_property
    def offsets(self) -> list[Any]:
        """Per tensor: its storage offset (elements)."""
        return list(map(_storage_offset, self.tensors))

    @functools.cached_property
    def addresses(self) -> list[int]:
        """Per tensor: the address of its first element (for a tensor of no elements, whose
        ``data_ptr()`` is 0 whatever storage it views: where it would be in its storage)."""
        out = list(map(_data_ptr, self.tensors))
        if 0 in out:
            tensors = self.tensors
            for i in [i for i, a in enumerate(out) if not a]:
                t = tensors[i]
                out[i] = (_untyped_storage(t).data_ptr()
                          + int(t.storage_offset()) * t.element_size()
                          if t.device.type == "cpu" else 0)
        return out

    @functools.cached_property
    def storage_ids(self) -> list[int]:
        """Per tensor: the address of its storage's own object (``StorageImpl``): which tensors
        share a storage, and whether a tensor's storage was replaced at the same data
        address."""
        return list(map(_storage_address, self.tensors))

    def image_bounds(self) -> tuple[int, int]:
        """Bounds of the size of a torch file of this state, before it is planned: its storages'
        bytes, and those with each record padded to pages plus room for its headers, its
        pickle and its proof (a generous allowance; a staging buffer is made to it)."""
        sizes = {s._cdata: s.nbytes() for s in map(_untyped_storage, self.tensors)}
        return file_bounds(list(sizes.values()), len(self.leaves))


def file_bounds(sizes: list[int], leaves: int) -> tuple[int, int]:
    """:meth:`Walked.image_bounds` of storages of ``sizes`` and ``leaves`` volatile leaves."""
    most = sum((n + 4223) // 4096 * 4096 for n in sizes)  # + 128 of headers, paged
    return sum(sizes), most + 384 * len(sizes) + 128 * leaves + (1 << 20)


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


#: Key types whose equal values of the same type pickle the same.
_EXACT_KEY_TYPES = frozenset({str, int, bool, type(None)})
_KEYS = object()  # the structure's last entry: the types of every key


def _key_types(all_keys: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    """The types of every key of every dict, in walk order (the structure compares keys by
    value: ``1`` and ``True``, a ``str`` and an equal ``str`` subclass, are equal but pickle
    differently), and the own pickle of each key of another type than ``str``, ``int``,
    ``bool`` and ``None`` (``-0.0`` and ``0.0``, ``(0, "a")`` and ``(False, "a")`` are equal
    keys). One pass in C over all keys: per dict, it cost ~0.45 µs (50,000 dicts: 23 ms)."""
    types = tuple(map(type, itertools.chain.from_iterable(all_keys)))
    if set(types) <= _EXACT_KEY_TYPES:
        return (_KEYS, types)
    try:
        prints = tuple(pickle.dumps(k, 2) for k in itertools.chain.from_iterable(all_keys)
                       if type(k) not in _EXACT_KEY_TYPES)
    except Exception as exc:
        raise Different(f"a key that does not pickle ({exc!r})") from exc
    return (_KEYS, types, prints)


#: How deep a state may nest for a template (a deeper one, or one that holds itself, is planned
#: from scratch, which names the problem).
MAX_DEPTH = 400


def walk(state: Any) -> Walked:
    """The structure of ``state`` as a template compares it.

    One pass, depth first with a stack of iterators (no call per container, and no nested
    functions naming each other: such a reference cycle would keep this walk's ~4 objects per
    tensor alive until the cyclic collector ran, 0.2 s inside the next save at 100,000
    tensors). A tensor is checked for Python attributes and hooks here; its facts are read
    later, all of one tensor's together while its object is in cache (:attr:`Walked.facts`;
    reading them attribute by attribute over all tensors cost ~25% more for 100,000 tensors).

    Raises:
        Different: a tensor with Python attributes or hooks, a tensor that is not strided or is
            nested (it has no strides: torch's compiled check, :mod:`.tensor_guard`, would
            abort the process on one; such a state never had a template), an
            object the walk does not look into holds a tensor, or the state nests deeper than
            :data:`MAX_DEPTH` (or holds itself).
    """
    structure: list[Any] = []
    tensors: list[torch.Tensor] = []
    leaves: list[Any] = []
    containers: list[int] = []
    note, note_tensor = structure.append, tensors.append
    note_leaf, note_container = leaves.append, containers.append
    plain, volatile, leaf, text, strided = _Tensor, VOLATILE, LEAF, TEXT, torch.strided
    all_keys: list[tuple[Any, ...]] = []
    note_keys = all_keys.append
    stack: list[Iterator[Any]] = [iter((state,))]
    push, pop = stack.append, stack.pop
    while stack:
        for value in stack[-1]:  # resumes where it stopped when a container was pushed
            kind = type(value)
            if kind is plain:
                if (value.__dict__ or value._backward_hooks or value.is_nested
                        or value.layout is not strided):
                    raise Different("a tensor with attributes or hooks, or not strided")
                note(plain)
                note_tensor(value)
            elif kind in volatile:
                note(leaf)
                note_leaf(value)
            elif kind is str:  # pickled whole and memoised, unlike a number: its own mark
                note(text)
                note_leaf(value)
            elif kind is dict:
                note_container(id(value))
                keys = tuple(value)
                note((dict, keys))
                note_keys(keys)
                push(iter(value.values()))
                break
            elif kind is list:
                note_container(id(value))
                note((list, len(value)))
                push(iter(value))
                break
            elif kind is tuple:
                note((tuple, len(value)))
                if value:
                    note_container(id(value))
                    push(iter(value))
                    break
            elif kind is _OrderedDict:
                note_container(id(value))
                keys = tuple(value)
                extra = value.__dict__
                note((_OrderedDict, keys, bool(extra)))
                note_keys(keys)
                # the attributes after the values, walked as the dict they are
                push(itertools.chain(value.values(), (extra,)) if extra else iter(value.values()))
                break
            elif kind is _Parameter:
                if (value.__dict__ or value._backward_hooks or value.is_nested
                        or value.layout is not strided):
                    raise Different("a parameter with attributes or hooks, or not strided")
                note(_Parameter)
                note_tensor(value)
            else:
                note((kind, _standalone(value)))
        else:
            pop()
            continue
        if len(stack) > MAX_DEPTH:
            raise Different(f"a state nested deeper than {MAX_DEPTH} containers")
    note(_key_types(all_keys))
    return Walked(structure, tensors, leaves, containers)

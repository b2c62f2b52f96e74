"""The first pickle of a structure, written from its walk: the bytes :class:`.TorchPickler` writes
for the marked copy of a state (:func:`.splice.marked`), already cut at its leaves.

A template's first save used to pickle a marked copy of the state and then cut the pickle where
the markers were. At 100,000 tensors that cost ~1.6 s: the C pickler asks ``persistent_id`` about
every object (~20 per tensor), and each tensor's reduction runs ~10 µs of Python. This module
writes the same protocol-2 bytes itself for the states a template can stand for (dicts,
``OrderedDict`` s, lists, tuples, strings, numbers, ``None``, plain tensors and parameters), in
one pass that takes each tensor's shape, stride, offset, dtype and ``requires_grad`` from the
walk: a tensor's reduction is mostly bytes shared by every tensor of its dtype. It follows the C
pickler's rules exactly: memo numbers in order of first sight (objects by identity), ``BINPUT``
below 256 and ``LONG_BINPUT`` above, batches of 1,000 (with the empty trailing batch an exact
dict of 1,000·n items gets, and the single ``SETITEM`` an ``OrderedDict`` 's iterator gets), the
tuple opcodes by length. Anything else (an object the walk does not look into, a key of another
type, a tensor torch reduces differently) returns ``None`` and the caller pickles as before.

The tests compare every byte and every recorded fact with the pickler's on generated states.
"""

from __future__ import annotations

import collections
import pickle
import struct
import sys
from typing import Any

import torch

from .splice import encode
from .torch_pickler import ELEMENT_SIZE, STORAGE_CLASS
from .walk import VOLATILE, Fact, Walked

__all__ = ["Facts", "first_pickle"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_OrderedDict = collections.OrderedDict
_TENSORS = (_Tensor, _Parameter)
_BATCH = 1000  # pickle's batch size for SETITEMS and APPENDS
_U32 = struct.Struct("<I")
_NUMBER_KEYS = frozenset({int, float, bool, type(None)})


def _global(obj: Any) -> bytes:
    """``obj`` (a class or function) as protocol 2 names it: its ``GLOBAL`` opcode alone."""
    data = pickle.dumps(obj, 2)
    assert data[2:3] == b"c" and data[-3:-2] == b"q", data
    return data[2:-3]


_REBUILD_TENSOR = _global(torch._utils._rebuild_tensor_v2)
_REBUILD_PARAMETER = _global(torch._utils._rebuild_parameter)
_ORDERED_DICT = _global(_OrderedDict)
_CLASS = {dtype: _global(cls) for dtype, cls in STORAGE_CLASS.items()}
_rebuild_tensor_v2 = torch._utils._rebuild_tensor_v2
_rebuild_parameter = torch._utils._rebuild_parameter
#: The strings torch's persistent ids hold: interned, so a key of the state may be the very
#: object (pickle then refers to one from the other).
_STORAGE_TEXT, _CPU_TEXT = sys.intern("storage"), sys.intern("cpu")
_STORAGE, _CPU = encode(_STORAGE_TEXT), encode(_CPU_TEXT)
_TUPLE_N = (b"", b"\x85", b"\x86", b"\x87")


class Facts:
    """What :class:`.TorchPickler` records about the storages and tensors it pickled, as the
    template reads it (a parameter stands for its ``.data`` in :attr:`param_data`)."""

    __slots__ = ("addresses", "info", "param_data", "storages")

    def __init__(self) -> None:
        self.storages: list[torch.UntypedStorage] = []
        self.addresses: list[int | None] = []
        self.info: dict[int, tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...], int]] = {}
        self.param_data: dict[int, Any] = {}


class _Unfit(Exception):
    """Something only the pickler writes."""


_put = struct.Struct("<cI").pack  # (b"r", n): LONG_BINPUT n
_NUMBERS: dict[int, bytes] = {}


def _number(value: int) -> bytes:
    """An int as pickle writes it (cached: shapes, offsets and sizes repeat)."""
    data = _NUMBERS.get(value)
    if data is None:
        data = encode(value)
        if len(_NUMBERS) < 1 << 16:
            _NUMBERS[value] = data
    return data


def _get(n: int) -> bytes:
    """A reference to memo entry ``n``."""
    return b"h" + n.to_bytes(1, "little") if n < 256 else b"j" + _U32.pack(n)


class _Writer:
    """One pickle being written: its bytes, the memo (ids of objects by their memo numbers), the
    storages seen, and the cuts where leaves go."""

    def __init__(self, walked: Walked) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[int, int] = {}  # id -> memo number, as the pickler's memo
        self.n = 0  # the next memo number
        self.structure = walked.structure
        self.at = 0  # position in the walk's structure
        self.tensors, self.tensor_facts = walked.tensors, walked.facts
        self.seen = 0  # tensors met so far (each time one is named)
        self.cuts: list[int] = []
        self.facts = Facts()
        #: storage _cdata -> [its key, numel, dtype, a reference to its key's memo entry once
        #: written, numel's opcodes]
        self.keys: dict[int, list[Any]] = {}
        self.dtypes: dict[int, torch.dtype] = {}  # storage address -> dtype
        self.shapes: dict[tuple[int, ...], bytes] = {}  # a tuple of ints -> its opcodes
        #: per dtype, once its globals are memoised: the bytes every tensor's reduction shares
        self.common: dict[torch.dtype, tuple[bytes, bytes, bytes]] = {}

    def put(self) -> bytes:
        n = self.n
        self.n = n + 1
        return b"q" + n.to_bytes(1, "little") if n < 256 else b"r" + _U32.pack(n)

    def memoised(self, obj: Any, data: bytes) -> bytes:
        """An object pickle memoises (a string, a global): written the first time, referred to
        after (``obj`` must outlive the writer: the state's, or a module's)."""
        n = self.memo.get(id(obj))
        if n is None:
            self.memo[id(obj)] = self.n
            return data + self.put()
        return _get(n)

    def key(self, k: Any) -> None:
        kind = type(k)
        if kind is str:
            n = self.memo.get(id(k))
            self.out += self.memoised(k, encode(k)) if n is None else _get(n)
        elif kind in _NUMBER_KEYS:
            self.out += encode(k)
        elif kind is tuple:
            if id(k) in self.memo:
                self.out += self.memoised(k, b"")
            else:
                self.tuple_of(k, self.key)
        else:
            raise _Unfit(kind)

    def ints(self, values: tuple[int, ...]) -> None:
        """A shape or a stride: a new tuple of ints, memoised unless empty."""
        data = self.shapes.get(values) or self.tuple_bytes(values)
        self.out += data + self.put() if values else data

    def tuple_of(self, value: tuple[Any, ...], item: Any) -> None:
        size = len(value)
        if not size:
            self.out += b")"
            return
        if size > 3:
            self.out += b"("
        leaves = len(self.cuts)
        for v in value:
            item(v)
        self.out += _TUPLE_N[size] if size <= 3 else b"t"
        if len(self.cuts) == leaves:
            self.memo[id(value)] = self.n
        # else: a tuple holding a leaf is a new tuple in the marked copy the pickler pickles,
        # never the object a key may name again (its memo number is used up all the same)
        self.out += self.put()

    def fact(self, t: Any) -> Fact:
        """The walk's facts of tensor ``t``, the next tensor it met (strided: the walk's rule)."""
        i, self.seen = self.seen, self.seen + 1
        if self.tensors[i] is not t or self.tensor_facts[i][5]:  # changed by another thread
            raise _Unfit("not the walk's state, or a conjugate or negative view")
        return self.tensor_facts[i]

    def value(self, obj: Any) -> None:
        kind = type(obj)
        if self.structure[self.at] is not kind and kind in _TENSORS:
            raise _Unfit("not the walk's state")
        self.at += 1
        if kind is _Tensor:
            self.tensor(obj, self.fact(obj))
        elif kind in VOLATILE:
            self.cuts.append(len(self.out))
        elif kind is str:  # a leaf: its marker was a new string, memoised where it stood
            self.cuts.append(len(self.out))
            self.out += self.put()
        elif kind is dict:
            self.out += b"}"
            self.memo[id(obj)] = self.n
            self.out += self.put()
            self.items(obj, exact=True)
        elif kind is list:
            self.out += b"]"
            self.memo[id(obj)] = self.n
            self.out += self.put()
            self.elements(obj)
        elif kind is tuple:
            if id(obj) in self.memo:
                raise _Unfit("a tuple that is a key too")  # its walk would be skipped
            self.tuple_of(obj, self.value)
        elif kind is _OrderedDict:
            self.out += self.memoised(_OrderedDict, _ORDERED_DICT) + b")R"
            self.memo[id(obj)] = self.n
            self.out += self.put()
            self.items(obj, exact=False)
            if obj.__dict__:
                self.value(obj.__dict__)
                self.out += b"b"
        elif kind is _Parameter:
            self.parameter(obj, self.fact(obj))
        else:
            raise _Unfit(kind)

    def items(self, obj: dict[Any, Any], exact: bool) -> None:
        """A dict's items as pickle's ``batch_dict_exact`` (a dict) or ``batch_dict`` (the
        iterator an ``OrderedDict`` reduces to) writes them."""
        pairs = list(obj.items())
        size = len(pairs)
        if size == 1:
            self.pairs(pairs)
            self.out += b"s"
            return
        done = 0
        while done < size or (exact and size and done % _BATCH == 0):
            if not exact and size - done == 1:  # the iterator's last single item
                self.pairs(pairs[done:])
                self.out += b"s"
                return
            batch = pairs[done:done + _BATCH]
            self.out += b"("
            self.pairs(batch)
            self.out += b"u"
            done += len(batch)
            if len(batch) < _BATCH:
                return

    def pairs(self, pairs: list[tuple[Any, Any]]) -> None:
        memo, value = self.memo, self.value
        for k, v in pairs:
            if type(k) is str:
                n = memo.get(id(k))
                if n is None:
                    memo[id(k)] = self.n
                    self.out += encode(k) + self.put()
                else:
                    self.out += _get(n)
            else:
                self.key(k)
            value(v)

    def elements(self, obj: list[Any]) -> None:
        size = len(obj)
        if size == 1:
            self.value(obj[0])
            self.out += b"a"
            return
        for start in range(0, size, _BATCH):
            self.out += b"("
            for v in obj[start:start + _BATCH]:
                self.value(v)
            self.out += b"e"

    def tensor(self, t: torch.Tensor, fact: Fact) -> None:
        n = self.memo.get(id(t))
        if n is not None:
            self.out += _get(n)
            return
        shape, stride, offset, dtype, requires_grad, _ = fact
        self.memo[id(t)] = self.reduction(t, shape, stride, offset, dtype, requires_grad, id(t))

    def reduction(self, t: torch.Tensor, shape: Any, stride: tuple[int, ...], offset: int,
                  dtype: torch.dtype, requires_grad: bool, ident: int) -> int:
        """``_rebuild_tensor_v2`` and its arguments, ``REDUCE`` and the memo number of the
        tensor it makes."""
        cls = _CLASS.get(dtype)
        if cls is None:
            raise _Unfit("a tensor torch.save reduces differently")
        storage = t.untyped_storage()
        known = self.keys.get(storage._cdata)
        if known is None:
            ptr = storage.data_ptr()
            if ptr and self.dtypes.setdefault(ptr, dtype) is not dtype:
                raise _Unfit("two dtypes over one storage")
            numel = storage.nbytes() // ELEMENT_SIZE[dtype]
            known = self.keys[storage._cdata] = [str(len(self.keys)), numel, dtype, None,
                                                 encode(numel)]
            self.facts.storages.append(storage)
            self.facts.addresses.append(ptr)
        elif known[2] is not dtype:
            raise _Unfit("two dtypes over one storage")
        shape = tuple(shape)
        self.facts.info[ident] = (known[0], dtype, shape, stride, offset)
        common = self.common.get(dtype) if self.n >= 256 else None
        if common is None:  # the first tensors: their globals and strings get memo numbers
            out = self.out
            out += self.memoised(_rebuild_tensor_v2, _REBUILD_TENSOR) + b"(("
            out += self.memoised(_STORAGE_TEXT, _STORAGE)
            out += self.memoised(STORAGE_CLASS[dtype], cls) + self.key_reference(known)
            out += self.memoised(_CPU_TEXT, _CPU) + known[4] + b"t"
            out += self.put() + b"Q" + encode(offset)
            self.ints(shape)
            self.ints(stride)
            out += (b"\x88" if requires_grad else b"\x89") + self.hooks() + b"t"
            out += self.put() + b"R" + self.put()
            memo = self.memo
            self.common[dtype] = (
                _get(memo[id(_rebuild_tensor_v2)]) + b"((" + _get(memo[id(_STORAGE_TEXT)])
                + _get(memo[id(STORAGE_CLASS[dtype])]),
                _get(memo[id(_CPU_TEXT)]),
                _get(memo[id(_OrderedDict)]) + b")R",
            )
            return self.n - 1
        # Every memo number from here on is 256 or more: each put is LONG_BINPUT.
        head, cpu, hooks = common
        key_part = known[3] or self.key_reference(known)
        n = self.n
        shapes, numbers = self.shapes, _NUMBERS
        parts = [head, key_part, cpu, known[4], b"t", _put(b"r", n), b"Q",
                 numbers.get(offset) or _number(offset),
                 shapes.get(shape) or self.tuple_bytes(shape)]
        n += 1
        if shape:
            parts.append(_put(b"r", n))
            n += 1
        parts.append(shapes.get(stride) or self.tuple_bytes(stride))
        if stride:
            parts.append(_put(b"r", n))
            n += 1
        parts += (b"\x88" if requires_grad else b"\x89", hooks, _put(b"r", n), b"t",
                  _put(b"r", n + 1), b"R", _put(b"r", n + 2))
        self.n = n + 3
        self.out += b"".join(parts)
        return n + 2

    def key_reference(self, known: list[Any]) -> bytes:
        """A storage's key in its persistent id: written and memoised the first time."""
        if known[3] is None:
            key = known[0]  # '0' to '9' are shared objects, perhaps keys of the state
            data = self.memoised(key, b"X" + _U32.pack(len(key)) + key.encode())  # ASCII digits
            known[3] = _get(self.memo[id(key)])
            return data
        reference: bytes = known[3]
        return reference

    def tuple_bytes(self, values: tuple[int, ...]) -> bytes:
        """A shape's or a stride's opcodes, its ``BINPUT`` aside (cached)."""
        size = len(values)
        body = b"".join(map(encode, values))
        data = b")" if not size else body + _TUPLE_N[size] if size <= 3 else b"(" + body + b"t"
        self.shapes[values] = data
        return data

    def hooks(self) -> bytes:
        """The empty ``OrderedDict`` torch passes as hooks: a new object each time."""
        return self.memoised(_OrderedDict, _ORDERED_DICT) + b")R" + self.put()

    def parameter(self, p: Any, fact: Fact) -> None:
        n = self.memo.get(id(p))
        if n is not None:
            self.out += _get(n)
            return
        shape, stride, offset, dtype, requires_grad, _ = fact
        self.out += self.memoised(_rebuild_parameter, _REBUILD_PARAMETER)
        # its .data: a tensor object never seen before, requires_grad False
        self.reduction(p, shape, stride, offset, dtype, False, id(p))
        self.facts.param_data[id(p)] = p
        self.out += (b"\x88" if requires_grad else b"\x89") + self.hooks() + b"\x87"
        self.out += self.put() + b"R"
        self.memo[id(p)] = self.n
        self.out += self.put()


def first_pickle(state: Any, walked: Walked) -> tuple[list[bytes], list[int], Facts] | None:
    """The pickle of ``state`` (which ``walked`` walked) as :func:`.splice.cut` cuts a
    :class:`.TorchPickler` pickle of its marked copy: the pieces between leaves, the leaf each
    cut stands for, and what the pickler would have recorded; ``None`` where only the pickler
    writes it. For states a template stands for (:meth:`.PlanCache._new_template` checks it
    first): every tensor in host memory, every container in one place only."""
    writer = _Writer(walked)
    try:
        writer.value(state)
    except (_Unfit, ValueError, TypeError, IndexError):  # also a state that changed under it
        return None
    except RecursionError:  # ~3 frames per level: a state nested deeper than ~330 dicts
        return None
    if (writer.at != len(walked.structure) - 1  # (its last entry: the keys' types)
            or len(writer.cuts) != len(walked.leaves) or writer.seen != len(walked.tensors)):
        return None  # not the walk's state (changed by another thread): the pickler decides
    out = writer.out
    out += b"."
    cuts = writer.cuts
    data = bytes(out)
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    return pieces, list(range(len(cuts))), writer.facts

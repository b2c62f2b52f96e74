"""A planned pickle cut where its volatile leaves sit, and the leaves of each save spliced in.

Pickle writes an exact ``int``, ``float``, ``bool`` or ``None`` self-contained and never
memoised, so the bytes around such a leaf do not depend on its value; a ``str`` is written whole
then memoised once (``BINPUT``), whatever its text. The template of a state is the pickle of a
copy of it in which each number is a marker that pickles to a unique persistent id (a float
whose first bytes are a per-process magic, then the leaf's number) and each string a marker
string of its own; cutting at the markers gives the pieces, and each save splices its own values
in, encoded as pickle encodes them (:func:`encode`, checked against ``pickle`` by the tests).

A string value that is the very object of another string of the state (a path used as a key
and as a value) is written by ``torch.save`` once and referred to; a template writes it again
(the file loads to equal strings, but is then not byte for byte ``torch.save``'s).
"""

from __future__ import annotations

import collections
import os
import pickle
import struct
from operator import is_
from typing import Any

from .torch_pickler import Mark
from .walk import VOLATILE

__all__ = ["MAX_LEAVES", "Spliced", "cut", "encode", "marked"]

_OrderedDict = collections.OrderedDict
_MAGIC = b"\x41" + os.urandom(4)  # a finite double's first bytes: markers are plain floats
MAX_LEAVES = 1 << 24  # three bytes of index after the magic


def _mark(index: int) -> Mark:
    return Mark(struct.unpack(">d", _MAGIC + index.to_bytes(3, "big"))[0])


#: A string leaf's marker: a string of its own (memoised as the string it stands for is, so
#: the memo numbers of everything after it are the same), found by its magic.
_STR_PREFIX = "\x00" + _MAGIC.hex()
_STR_MARK_LEN = len(_STR_PREFIX) + 8
_STR_NEEDLE = b"X" + _STR_MARK_LEN.to_bytes(4, "little") + _STR_PREFIX.encode()


def _str_mark(index: int) -> str:
    return f"{_STR_PREFIX}{index:08x}"


def marked(state: Any) -> Any:
    """A copy of ``state``'s containers with every volatile leaf replaced by a marker numbered in
    walk order (tensors, strings, other objects and containers without a leaf inside are the
    same objects)."""
    return _marked(state, [0])


def _marked(obj: Any, count: list[int]) -> Any:
    # A module function, not a closure naming itself: such a closure is a reference cycle that
    # keeps everything it touched alive until the cyclic collector runs (inside a later save).
    kind = type(obj)
    if kind in VOLATILE:
        count[0] += 1
        return _mark(count[0] - 1)
    if kind is str:
        count[0] += 1
        return _str_mark(count[0] - 1)
    if kind is dict or kind is _OrderedDict:
        values = [_marked(v, count) for v in obj.values()]
        extra = _marked(obj.__dict__, count) if kind is _OrderedDict and obj.__dict__ else None
        if extra is None and all(map(is_, values, obj.values())):
            return obj  # nothing marked inside: the very object (pickled the same)
        out = kind(zip(obj.keys(), values))
        if extra is not None:
            out.__dict__.update(extra)
        return out
    if kind is list or kind is tuple:
        values = [_marked(v, count) for v in obj]
        return obj if all(map(is_, values, obj)) else kind(values)
    return obj


def cut(pkl: bytes, n_leaves: int) -> tuple[list[bytes], list[int]] | None:
    """The pickle's pieces between markers and the leaf each marker stands for (byte order);
    ``None`` if the markers are not each found exactly once. A number's marker is its whole
    persistent id (``G`` + 8 bytes + ``Q``); a string's is its ``BINUNICODE`` opcode, length
    and text (its ``BINPUT`` stays in the template)."""
    found = []
    needle = b"G" + _MAGIC
    at = pkl.find(needle)
    while at >= 0:
        if pkl[at + 9 : at + 10] != b"Q":
            return None
        found.append((at, at + 10, int.from_bytes(pkl[at + 6 : at + 9], "big")))
        at = pkl.find(needle, at + 10)
    at = pkl.find(_STR_NEEDLE)
    while at >= 0:
        end = at + 5 + _STR_MARK_LEN
        found.append((at, end, int(pkl[end - 8 : end], 16)))
        at = pkl.find(_STR_NEEDLE, end)
    found.sort()
    pieces, order = [], []
    pos = 0
    for start, end, index in found:
        if start < pos:
            return None
        pieces.append(pkl[pos:start])
        order.append(index)
        pos = end
    pieces.append(pkl[pos:])
    if sorted(order) != list(range(n_leaves)):
        return None
    return pieces, order


_INT1, _INT2, _INT4 = struct.Struct("<B"), struct.Struct("<H"), struct.Struct("<i")
_FLOAT = struct.Struct(">d")


def encode(value: Any) -> bytes:
    """``value`` (an int, float, bool, None or str) as pickle protocol 2 writes it (a string
    without the ``BINPUT`` that memoises it: the template holds that)."""
    kind = type(value)
    if kind is str:
        data: bytes = value.encode("utf-8", "surrogatepass")
        return b"X" + len(data).to_bytes(4, "little") + data
    if kind is int:
        if 0 <= value < 0x100:
            return b"K" + _INT1.pack(value)
        if 0 <= value < 0x10000:
            return b"M" + _INT2.pack(value)
        if -0x80000000 <= value < 0x80000000:
            return b"J" + _INT4.pack(value)
        big: bytes = pickle.dumps(value, 2)
        return big[2:-1]
    if kind is float:
        return b"G" + _FLOAT.pack(value)
    if value is None:
        return b"N"
    return b"\x88" if value else b"\x89"


class Spliced:
    """A template's pickle with its leaves spliced in, kept between saves: a save whose leaves
    are the last save's (same types, equal values) reuses its bytes; otherwise only the leaves
    that changed are encoded again (a state may hold tens of thousands, e.g. the parameter
    numbers of an optimizer's groups). Floats are encoded again unless they are the very same
    objects (``0.0 == -0.0``, but pickle tells them apart)."""

    _STEP = 512  # leaves compared per slice before looking at single ones

    def __init__(self, pieces: list[bytes], order: list[int]) -> None:
        self.parts: list[bytes] = [pieces[0]]
        for i in range(len(order)):
            self.parts += (b"", pieces[i + 1])
        self.at = [0] * len(order)  # leaf -> its encoding's index in parts
        for j, leaf in enumerate(order):
            self.at[leaf] = 2 * j + 1
        self.leaves: list[Any] | None = None
        self.types: list[type] = []
        self.floats: list[int] = []  # where the float leaves are
        self.pkl = b""

    def pickle(self, leaves: list[Any]) -> bytes:
        types = list(map(type, leaves))
        old = self.leaves
        changed: Any
        if old is None or types != self.types:
            changed = range(len(leaves))
            self.floats = [i for i, kind in enumerate(types) if kind is float]
        else:
            changed = [i for i in self.floats if leaves[i] is not old[i]]
            if leaves != old:
                changed = sorted(set(changed).union(self._unequal(leaves, old)))
            if not changed:
                self.leaves = leaves
                return self.pkl
        parts, at = list(self.parts), self.at  # the last save's image keeps its pickle
        for i in changed:
            parts[at[i]] = encode(leaves[i])
        self.parts, self.leaves, self.types = parts, leaves, types
        self.pkl = b"".join(parts)
        return self.pkl

    def _unequal(self, leaves: list[Any], old: list[Any]) -> list[int]:
        step = self._STEP
        out = []
        for a in range(0, len(leaves), step):
            b = min(a + step, len(leaves))
            if leaves[a:b] != old[a:b]:
                out += [i for i in range(a, b) if leaves[i] != old[i]]
        return out

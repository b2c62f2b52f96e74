"""A safe load's pickle run first by Python's C unpickler, which is handed nothing but proxies.

The opcode loop of :class:`~.unpickle.Unpickler` is Python: ~1 µs per opcode, a few dozen
opcodes per tensor, most of a load of 100,000 tensors. :class:`Unpickler` here runs the pickle
first through ``_pickle.Unpickler`` (C) with a ``find_class`` that answers only a closed set of
the allow-list's names, and with nothing callable, buildable or mutable from outside this module
ever on its stack:

* every global it answers is a **proxy**: calling one (``REDUCE``) runs the same checks and
  routes as the Python loop (:meth:`.unpickle.Unpickler.call`); building one (``BUILD``) stops
  the try; a proxy is no class, so ``NEWOBJ`` stops it too;
* a storage class named in a persistent id is a marker, and each storage the file's
  ``persistent_load`` hands out is wrapped (:class:`_Stored`): only the tensor rebuild takes
  one, and a wrapper still referenced after the pickle ends (a storage the state holds bare, or
  a hostile pickle reusing one) stops the try;
* inert values (dtypes: no attributes, no state, not callable) are themselves.

Everything else the C unpickler can do with such a stack is data: tuples, lists, dicts,
strings, numbers, items set on the dicts and ``OrderedDict`` s it made, the state of a tensor
set by torch's checked ``__setstate__`` (as ``_rebuild_tensor_v2`` sets it). Any global outside
the set (numpy, tensor subclasses, the user's classes), any failure or refusal, stops the try
and the pickle runs again, from its start, in the Python loop, which admits or refuses it with
its own words: the C unpickler never decides that a file is refused or damaged. One difference
remains, on data only: the C unpickler also reads the opcodes of pickle protocols 3 to 5 and
the text opcodes (bytes, sets, frames, ``DUP``...) and ``OBJ``/``INST`` (a call, through a
proxy, as ``REDUCE`` makes it), which torch never writes and the Python loop refuses as damage.
A process where an extension code was registered with ``copyreg`` (answered from a cache,
without ``find_class``) never tries it. ``STAGESAVE_FAST_UNPICKLE=0`` turns the first try off.
"""

from __future__ import annotations

import collections
import copyreg
import io
import os
import pickle
import sys
from typing import Any

import torch
from torch._utils import IMPORT_MAPPING, NAME_MAPPING

from .allowlist import Policy
from .first_try_checks import give_back_growth, is_whole, plain, unchanged, untyped_of
from .image_unpickle import LeanStorage
from .rebuild_checks import fits, validate_loaded_sparse
from .unpickle import _BLOCKED_MODULES, _MISSING, _REBUILD_V2, _rebuild_v2
from .unpickle import Unpickler as LoopUnpickler

__all__ = ["FAST_NAMES", "PICKLE_MODULE", "FirstTryStopped", "Unpickler", "fast_enabled"]

_REBUILD_PARAMETER, _OrderedDict = torch._utils._rebuild_parameter, collections.OrderedDict

#: The callables the C unpickler may reach (through proxies); any other global stops the try.
FAST_NAMES = frozenset({
    "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter",
    "collections.OrderedDict", "torch.device", "torch.Size", "_codecs.encode",
})


def fast_enabled() -> bool:
    """Whether loads try the C unpickler first (``STAGESAVE_FAST_UNPICKLE``, default on)."""
    return os.environ.get("STAGESAVE_FAST_UNPICKLE", "1").strip().lower() not in (
        "0", "false", "no", "off")


class _Stop(Exception):
    """The C unpickler meets something only the Python loop may judge."""


class _Inert:
    """A base without attributes or state: ``BUILD`` of any of these stops the try."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise _Stop("BUILD of a proxy")


def _no_storage(args: tuple[Any, ...]) -> None:
    """Only the tensor rebuild takes a storage, as its first argument."""
    if _Stored in map(type, args):  # types compare by identity; the loop runs in C
        raise _Stop("a storage passed to something other than the tensor rebuild")


class _Call(_Inert):
    """An allow-listed callable, called only through the Python loop's checks."""

    __slots__ = ("func", "loop")

    def __init__(self, func: Any, loop: LoopUnpickler) -> None:
        self.func, self.loop = func, loop

    def __call__(self, *args: Any) -> Any:
        _no_storage(args)
        return self.loop.call(self.func, args)


class _Direct(_Call):
    """An allow-listed callable without a route: what the Python loop's call comes to when it
    succeeds (a failure stops the try, and the loop says it in its words)."""

    __slots__ = ()

    def __call__(self, *args: Any) -> Any:
        if _Stored in map(type, args):  # _no_storage, inline: called once per tensor
            raise _Stop("a storage passed to something other than the tensor rebuild")
        return self.func(*args)


class _Rebuild(_Call):
    """``torch._utils._rebuild_tensor_v2``, the one callable that takes a storage. Every tensor
    it makes is recorded with its version, hooks and ``requires_grad`` (:func:`.unchanged`): a
    ``BUILD`` of a tensor (torch's legacy ``__setstate__``, which the C unpickler runs without
    asking) changes one of them, and stops the try once the pickle ends."""

    __slots__ = ("rebuilt",)

    def __init__(self, func: Any, loop: LoopUnpickler, rebuilt: list[tuple[Any, ...]]) -> None:
        super().__init__(func, loop)
        self.rebuilt = rebuilt

    def __call__(self, *args: Any) -> Any:
        t = self._make(*args)
        self.rebuilt.append((t, t._version, t._backward_hooks, t.requires_grad))
        return t

    def _make(self, *args: Any) -> Any:
        if not args or type(args[0]) is not _Stored:
            raise _Stop("a tensor rebuilt from something other than a storage")
        rest = args[1:]
        if _Stored in map(type, rest):  # _no_storage, inline: called once per tensor
            raise _Stop("a storage passed to something other than the tensor rebuild")
        if self.loop.plain_rebuild:  # what the loop's call runs, without its wrapping
            lean = args[0].lean
            if lean is not None and len(args) == 6 and lean.spare is not None and is_whole(
                    lean, *rest[:3]):
                # (the whole storage, as frombuffer made it: no geometry to set, nothing past it)
                t, lean.spare = lean.spare, None
                requires_grad, hooks = rest[3:]
                if requires_grad is not False:
                    t.requires_grad = requires_grad
                t._backward_hooks = hooks
                return t
            if lean is not None and (len(args) < 4 or not fits(
                    lean.nbytes, lean.itemsize, args[1], args[2], args[3])):
                # torch's own bound check wraps a huge offset; set_ grows a resizable storage
                raise _Stop("a tensor that does not fit its storage")
            if lean is not None and len(args) == 6:  # _rebuild_lean, inline
                offset, size, stride, requires_grad, hooks = rest
                whole = lean.spare
                if whole is not None:
                    lean.spare = None
                    t = whole.as_strided_(size, stride, offset)
                else:
                    t = lean.tensor(offset, size, stride)
                if requires_grad is not False:
                    t.requires_grad = requires_grad
                t._backward_hooks = hooks
                return t
            if lean is not None and len(args) == 7:
                return _rebuild_lean(lean, *rest)
            return _rebuild_v2(args[0].typed, *rest)
        if args[0].lean is not None:
            raise _Stop("a storage made for the plain rebuild")
        return self.loop.call(self.func, (args[0].typed, *args[1:]))


class _Unread(_Inert):
    """A proxy of the first try over an image whose storages are still being read: calls that
    could read a tensor's values stop the try. Tensors are made over bytes not yet in memory
    (:func:`.image_load.read_image`'s ``early``); ``torch.Size(t)``, a 0-d tensor as a storage
    offset or a tensor in the rebuild's metadata would read them (``__index__``, ``__bool__``).
    Only the tensor rebuild's storage, and the tensor a parameter is made of, are tensors here;
    every other argument must be plain data."""

    __slots__ = ("proxy",)

    def __init__(self, proxy: _Call) -> None:
        self.proxy = proxy

    def __call__(self, *args: Any) -> Any:
        func = self.proxy.func
        if func is _REBUILD_V2:
            # torch's own arguments need no look: the rebuild's fits() takes an int offset and
            # tuples of ints, and stops the try at anything else (the storage is lean here)
            own = (len(args) == 6 and type(args[4]) is bool and type(args[5]) is _OrderedDict
                   and not args[5] and self.proxy.loop.plain_rebuild)
            if not own and (len(args) < 6 or type(args[1]) is not int or not plain(args[2:])):
                raise _Stop("a tensor rebuilt with more than plain numbers")
            return self.proxy(*args)  # (a tensor set again later stops the try: _run_fast)
        elif func is _REBUILD_PARAMETER:
            if not args or not plain(args[1:]):
                raise _Stop("a parameter made with more than plain values")
        elif not plain(args):
            raise _Stop("a tensor passed to a call before its bytes are read")
        return self.proxy(*args)


class _Kind(_Inert):
    """A storage class, as a persistent id names it (not callable)."""

    __slots__ = ("cls",)

    def __init__(self, cls: Any) -> None:
        self.cls = cls


class _Stored(_Inert):
    """A storage ``persistent_load`` made, until the tensor rebuild takes it: torch's typed
    storage, or an image's :class:`~.image_unpickle.LeanStorage`."""

    __slots__ = ("lean", "nbytes", "typed")

    def __init__(self, typed: Any, lean: LeanStorage | None = None) -> None:
        self.typed, self.lean = typed, lean
        #: a typed storage's bytes when handed out (one of no bytes can be grown by ``set_``)
        self.nbytes = untyped_of(typed).nbytes() if typed is not None else 0


def _rebuild_lean(lean: LeanStorage, storage_offset: Any, size: Any, stride: Any,
                  requires_grad: Any, backward_hooks: Any, metadata: Any = None) -> Any:
    """:func:`~.unpickle._rebuild_v2` over an image's storage: the same tensor and attributes."""
    t = lean.tensor(storage_offset, size, stride)
    if requires_grad is not False:
        t.requires_grad = requires_grad
    if metadata:
        torch._utils.set_tensor_metadata(t, metadata)  # type: ignore[no-untyped-call]
    t._backward_hooks = backward_hooks
    return t


def _sparse(func: Any) -> bool:
    """A callable whose results the loop records for torch's check of sparse tensors."""
    return func in torch._tensor_classes and "sparse" in func.__module__


def _storage_class(obj: Any) -> bool:
    """A storage class, or what torch's allow-list names one by (its ``StorageType``)."""
    return type(obj) is torch.serialization.StorageType or isinstance(obj, type) and (
        obj is torch.UntypedStorage or issubclass(obj, torch.storage.TypedStorage))


def _inert(obj: Any) -> bool:
    return (isinstance(obj, torch.dtype) and not callable(obj)
            and not hasattr(obj, "__dict__") and not hasattr(obj, "__setstate__"))


class _CUnpickler(pickle.Unpickler):  # _pickle.Unpickler: the opcode loop in C
    def __init__(self, data: bytes, loop: LoopUnpickler, persistent: Any,
                 only_lean: bool) -> None:
        super().__init__(io.BytesIO(data), encoding=loop.encoding, fix_imports=False)
        self.loop, self.persistent, self.only_lean = loop, persistent, only_lean
        #: an image's maker of lean storages (:func:`.image_unpickle.unpickle_image`), if any
        self.lean = getattr(persistent, "lean", None)
        self.answers: dict[str, Any] = {}
        self.made: list[_Stored] = []
        self.rebuilt: list[tuple[Any, ...]] = []  # every tensor _Rebuild made

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        found = self.answers.get(key, _MISSING)
        if found is not _MISSING:
            return found
        if (module, name) in NAME_MAPPING:
            module, name = NAME_MAPPING[(module, name)]
        elif module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        obj = self.loop.policy.table.get(full, _MISSING)
        if obj is _MISSING or module in _BLOCKED_MODULES:
            raise _Stop(full)
        if full in FAST_NAMES:
            policy = self.loop.policy
            found = (_Rebuild(obj, self.loop, self.rebuilt) if obj is _REBUILD_V2
                     else _Direct(obj, self.loop) if id(obj) in policy.callable_ids
                     and id(obj) not in policy.routes and not _sparse(obj)
                     else _Call(obj, self.loop))
            if self.only_lean:  # the storages' bytes are not read yet: nothing may read them
                found = _Unread(found)
        elif _storage_class(obj):
            found = _Kind(obj)
        elif _inert(obj):
            found = obj
        else:
            raise _Stop(full)
        self.answers[key] = found
        return found

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage" or type(
                pid[1]) is not _Kind:
            raise _Stop("a persistent id torch does not write")
        if self.lean is not None:
            lean = self.lean(pid[1].cls, pid[2], pid[3], pid[4])
            if lean is not None:
                stored = _Stored(None, lean)
                self.made.append(stored)
                return stored
        if self.only_lean:  # torch's storage may copy the bytes (to a device): not read yet
            raise _Stop("a storage that is not an image's lean one")
        stored = _Stored(self.persistent(("storage", pid[1].cls, *pid[2:])))
        self.made.append(stored)
        return stored


def _run_fast(data: bytes, loop: LoopUnpickler, persistent: Any, only_lean: bool = False) -> Any:
    up = _CUnpickler(data, loop, persistent, only_lean)
    try:
        result = up.load()
    finally:
        # A BUILD of a tensor runs torch's unchecked legacy set_ (the C unpickler cannot be
        # asked first): a storage it grew is given its size back (the loop gets the same storage
        # objects from the file's persistent_load) and stops the try, stopped or not; the loop
        # refuses that BUILD in its words. (An image's lean storages cannot grow: torch's own
        # bound check stops such a set_.)
        grown = give_back_growth(up.made)
    if grown:
        raise _Stop("a storage grown after it was handed out")
    if not unchanged(up.rebuilt):
        # a BUILD set a tensor's state after its rebuild (torch's legacy __setstate__: set_,
        # or 3- and 5-tuples the loop and torch refuse), perhaps from tensors whose bytes were
        # not read yet (a 0-d offset, beside the reads): the loop judges it in its words
        raise _Stop("a tensor's state set again after its rebuild")
    made, answers = up.made, up.answers
    up.memo.clear()
    del up
    # The state holds no wrapped storage and no proxy (a pickle that names a global and keeps
    # it): each is referenced as often as a probe that nothing else holds, counted the same way
    # (what a loop's name adds to a count differs between Python versions).
    made.append(_Stored(None))
    answers["\0probe"] = _Kind(None)
    counts = [sys.getrefcount(x) for x in made]
    if max(counts) > counts[-1]:
        raise _Stop("a storage the state holds other than inside a tensor")
    counts = [sys.getrefcount(x) for x in answers.values() if isinstance(x, _Inert)]
    if max(counts) > counts[-1]:
        raise _Stop("a global the state holds")
    return result


class Unpickler:
    """The safe unpickler: the C unpickler over proxies first, the Python loop where it stops.

    The interface of ``pickle.Unpickler`` that ``torch.load`` uses (``persistent_load`` set,
    then ``load()``). ``first_try_only``: the C unpickler's try alone, over an image's lean
    storages only (:func:`.image_unpickle.unpickle_image`), whose bytes it never reads; where it
    stops, ``load()`` raises (:class:`FirstTryStopped`) instead of running the Python loop."""

    def __init__(self, file: Any, *, encoding: str = "bytes", stagesave_policy: Policy,
                 first_try_only: bool = False) -> None:
        self.file = file
        self.encoding = encoding
        self.policy = stagesave_policy
        self.first_try_only = first_try_only
        self.persistent_load: Any = None

    def load(self) -> Any:
        loop = LoopUnpickler(self.file, encoding=self.encoding, stagesave_policy=self.policy)
        if self.persistent_load is not None:
            loop.persistent_load = self.persistent_load  # type: ignore[method-assign]
        getvalue = getattr(self.file, "getvalue", None)
        # an extension code registered with copyreg is answered from its cache without
        # find_class once any unpickling used it: no first try in such a process
        if (getvalue is not None and self.persistent_load is not None and fast_enabled()
                and not copyreg._extension_registry):  # type: ignore[attr-defined]
            start = self.file.tell()
            loop.plain_rebuild = torch._guards.detect_fake_mode(None) is None
            try:
                return _run_fast(getvalue()[start:], loop, self.persistent_load,
                                 self.first_try_only)
            except Exception as exc:  # the Python loop judges it, in its own words
                if self.first_try_only:
                    raise FirstTryStopped(str(exc)) from exc
                self.file.seek(start)
        if self.first_try_only:
            raise FirstTryStopped("the C unpickler is not tried here")
        result = loop.load()
        validate_loaded_sparse()  # (the C unpickler's names make no sparse tensor)
        return result


class FirstTryStopped(Exception):
    """A ``first_try_only`` unpickling stopped: the whole load runs once every byte is read."""


def _pickle_load(file: Any, *, encoding: str = "bytes", stagesave_policy: Policy) -> Any:
    return Unpickler(file, encoding=encoding, stagesave_policy=stagesave_policy).load()


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` uses: our unpickler, torch's reading of the zip."""

    Unpickler = Unpickler
    load = staticmethod(_pickle_load)
    __name__ = "stagesave.safety"


PICKLE_MODULE = _PickleModule()

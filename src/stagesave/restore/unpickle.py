"""The opcode loop of the safe unpickler: torch's weights-only protocol, stagesave's checks.

The same opcodes as torch's weights-only unpickler, the same torch rebuild functions, torch's
reading of storages (``torch.load`` supplies ``persistent_load``); what a file may name, call
and build is the load's :class:`~stagesave.restore.allowlist.Policy`, numpy only through its
routes (:mod:`.numpy_pickles`). A numpy placeholder (:class:`~.numpy_pickles.Pending`) may not
be used by anything before its ``BUILD``.
"""

from __future__ import annotations

import pickle
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from struct import unpack
from typing import Any, cast

import numpy as np
import torch

from ..errors import CheckpointError
from .allowlist import Policy
from .numpy_pickles import Pending, build_array, build_dtype
from .rebuild_checks import STORAGES, check_fits, check_rebuild, check_set
from .refusal import BadPickle, refuse

__all__ = ["Unpickler"]

_OP = {name: getattr(pickle, name)[0] for name in (
    "APPEND", "APPENDS", "BINFLOAT", "BINGET", "BININT", "BININT1", "BININT2", "BINPERSID",
    "BINPUT", "BINUNICODE", "BUILD", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET", "EMPTY_TUPLE",
    "GLOBAL", "LONG1", "LONG_BINGET", "LONG_BINPUT", "MARK", "NEWFALSE", "NEWOBJ", "NEWTRUE",
    "NONE", "PROTO", "REDUCE", "SETITEM", "SETITEMS", "SHORT_BINSTRING", "STOP", "TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3")}
#: The opcodes in the order the loop tests them (most frequent in torch states first).
_BY_FREQUENCY = tuple(_OP[name] for name in (
    "BINPUT", "BINGET", "LONG_BINPUT", "LONG_BINGET", "BININT1", "BININT2", "BININT", "MARK",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINUNICODE", "REDUCE", "EMPTY_TUPLE", "NEWFALSE",
    "NEWTRUE", "NONE", "BINPERSID", "GLOBAL", "SETITEMS", "SETITEM", "EMPTY_DICT", "EMPTY_LIST",
    "APPENDS", "APPEND", "BUILD", "NEWOBJ", "BINFLOAT", "SHORT_BINSTRING", "LONG1", "EMPTY_SET",
    "PROTO", "STOP"))
_BLOCKED_MODULES = frozenset({"sys", "os", "posix", "nt"})


_REBUILD_V2 = torch._utils._rebuild_tensor_v2


def _rebuild_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                backward_hooks: Any, metadata: Any = None) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` when no fake-tensor mode is active: the same tensor
    and attributes, without the fake-mode lookups torch makes for every tensor (a third of a
    many-tensor load's time)."""
    check_fits(storage._untyped_storage, storage.dtype, storage_offset, size, stride)
    t = torch.empty((0,), dtype=storage.dtype, device=storage._untyped_storage.device)
    t.set_(storage._untyped_storage, storage_offset, size, stride)
    t.requires_grad = requires_grad
    if metadata:
        torch._utils.set_tensor_metadata(t, metadata)  # type: ignore[no-untyped-call]
    t._backward_hooks = backward_hooks
    return t


def _free(items: Iterable[Any]) -> None:
    for x in items:
        if type(x) is Pending:
            raise BadPickle(f"a numpy {x.what} is used before its state is set")


class Unpickler:
    """The opcodes of torch's weights-only unpickler, with stagesave's allow-list and routes."""

    def __init__(self, file: Any, *, encoding: str = "bytes", stagesave_policy: Policy) -> None:
        self.read: Callable[[int], bytes] = file.read
        self.readline: Callable[[], bytes] = file.readline
        self.encoding = encoding
        self.policy = stagesave_policy
        self.vetted: dict[int, np.dtype[Any]] = {}
        self.memo: dict[int, Any] = {}
        #: a numpy placeholder was made (then what is used is checked against it)
        self.pending = False
        #: torch's tensor rebuild without its fake-mode lookups (no fake mode: checked per load)
        self.plain_rebuild = False

    def persistent_load(self, pid: Any) -> Any:  # replaced by torch with its storage reader
        raise BadPickle("unsupported persistent id encountered")

    def call(self, func: Any, args: Any) -> Any:
        """``func(*args)`` for an allow-listed ``func``, through its route if it has one."""
        if type(args) is not tuple:
            raise BadPickle(f"call arguments must be a tuple, not {type(args).__name__}")
        route = self.policy.routes.get(id(func))
        try:
            if route is not None:
                made = route(self, args)
                if type(made) is Pending:
                    self.pending = True
                return made
            if id(func) not in self.policy.callable_ids:
                raise BadPickle(f"Trying to call reduce for unrecognized function {func!r}")
            if func is _REBUILD_V2 and self.plain_rebuild:
                return _rebuild_v2(*args)
            if len(args) >= 4 and isinstance(args[0], STORAGES):
                check_rebuild(func, args)  # torch's rebuilds: v1, v2, v3, quantized
            result = func(*args)
        except (CheckpointError, pickle.UnpicklingError):
            raise
        except Exception as exc:
            name = getattr(func, "__name__", func)
            raise BadPickle(f"{name} failed: {type(exc).__name__}: {exc}") from exc
        if func in torch._tensor_classes and "sparse" in func.__module__:
            torch._utils._sparse_tensors_to_validate.append(result)
        return result

    def global_(self) -> Any:
        from torch._utils import IMPORT_MAPPING, NAME_MAPPING

        module = self.readline()[:-1].decode("utf-8")
        name = self.readline()[:-1].decode("utf-8")
        if (module, name) in NAME_MAPPING:
            module, name = NAME_MAPPING[(module, name)]
        elif module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        obj = self.policy.table.get(full, _MISSING)
        if obj is _MISSING or module in _BLOCKED_MODULES:
            raise pickle.UnpicklingError(
                f"Unsupported global: GLOBAL {full} was not an allowed global"
            )
        return obj

    def build(self, inst: Any, state: Any) -> Any:
        """``BUILD``: numpy placeholders become checked objects; otherwise torch's rules."""
        if type(inst) is Pending:
            _free([state] if type(state) is not tuple else state)
            try:
                made = (build_dtype(self, inst, state) if inst.what == "dtype"
                        else build_array(self, state))
            except (CheckpointError, pickle.UnpicklingError):
                raise
            except Exception as exc:  # numpy's own refusal of a description
                raise BadPickle(f"numpy {inst.what} state refused: "
                                f"{type(exc).__name__}: {exc}") from exc
            for slot in inst.memo_slots:
                if self.memo.get(slot) is inst:
                    self.memo[slot] = made
            return made
        _free([state])
        if isinstance(inst, (np.ndarray, np.dtype, np.generic)):
            refuse(self, f"it sets the state of a numpy {type(inst).__name__} that already has one "
                          f"(that frees memory a tensor may still point into, or changes the item "
                          f"size under an array)")
        try:
            if type(inst) is torch.Tensor:
                check_set(inst, state)
                inst.set_(*state)
            elif type(inst) is torch.nn.Parameter:
                if type(state) is tuple and len(state) == 4:  # Tensor.__setstate__: set_
                    check_set(inst, state)
                cast(Any, inst).__setstate__(state)
            elif type(inst) is OrderedDict:
                inst.__dict__.update(state)
            elif id(type(inst)) in self.policy.build_ids:
                if hasattr(inst, "__setstate__"):
                    inst.__setstate__(state)
                else:
                    slotstate = None
                    if isinstance(state, tuple) and len(state) == 2:
                        state, slotstate = state
                    if state:
                        inst.__dict__.update(state)
                    for k, v in (slotstate or {}).items():
                        setattr(inst, k, v)
            else:
                raise BadPickle(f"Can only build Tensor, Parameter, OrderedDict or allow-listed "
                                 f"types, but got {type(inst).__name__}")
        except (CheckpointError, pickle.UnpicklingError):
            raise
        except Exception as exc:
            raise BadPickle(f"BUILD of {type(inst).__name__} failed: "
                            f"{type(exc).__name__}: {exc}") from exc
        return inst

    def load(self) -> Any:  # one branch per opcode, as pickle's own loop
        # The opcodes as locals, most frequent first (a torch state is mostly memo puts and
        # gets, marks, tuples, small ints and strings): a tensor costs a few dozen opcodes, and
        # a state may hold 100,000 tensors. ``self.pending``: a numpy placeholder exists, so
        # what is used must be checked against it (``_free``); none exists in most states.
        self.metastack: list[list[Any]] = []
        stack: list[Any] = []
        self.stack = stack
        read = self.read
        memo = self.memo
        self.plain_rebuild = torch._guards.detect_fake_mode(None) is None
        (BINPUT, BINGET, LONG_BINPUT, LONG_BINGET, BININT1, BININT2, BININT, MARK, TUPLE,
         TUPLE1, TUPLE2, TUPLE3, BINUNICODE, REDUCE, EMPTY_TUPLE, NEWFALSE, NEWTRUE, NONE,
         BINPERSID, GLOBAL, SETITEMS, SETITEM, EMPTY_DICT, EMPTY_LIST, APPENDS, APPEND, BUILD,
         NEWOBJ, BINFLOAT, SHORT_BINSTRING, LONG1, EMPTY_SET, PROTO, STOP) = _BY_FREQUENCY
        while True:
            key = read(1)
            if not key:
                raise EOFError
            k = key[0]
            if k == BINPUT or k == LONG_BINPUT:
                i = read(1)[0] if k == BINPUT else unpack("<I", read(4))[0]
                memo[i] = top = stack[-1]
                if type(top) is Pending:
                    top.memo_slots.append(i)
            elif k == BINGET or k == LONG_BINGET:
                i = read(1)[0] if k == BINGET else unpack("<I", read(4))[0]
                stack.append(memo[i])
            elif k == BININT1:
                stack.append(read(1)[0])
            elif k == MARK:
                self.metastack.append(stack)
                stack = self.stack = []
            elif k == TUPLE:
                items = self._pop_mark()
                stack = self.stack
                if self.pending:
                    _free(items)
                stack.append(tuple(items))
            elif k == TUPLE1 or k == TUPLE2 or k == TUPLE3:
                n = 1 + k - TUPLE1
                if len(stack) < n:
                    raise BadPickle("stack underflow")
                items = stack[-n:]
                if self.pending:
                    _free(items)
                stack[-n:] = [tuple(items)]
            elif k == BINUNICODE:
                (n,) = unpack("<I", read(4))
                data = read(n)
                if len(data) != n:
                    raise EOFError
                stack.append(str(data, "utf-8", "surrogatepass"))
            elif k == REDUCE:
                args = stack.pop()
                if self.pending:
                    _free([stack[-1]])
                stack[-1] = self.call(stack[-1], args)
            elif k == EMPTY_TUPLE:
                stack.append(())
            elif k == NEWFALSE:
                stack.append(False)
            elif k == NEWTRUE:
                stack.append(True)
            elif k == NONE:
                stack.append(None)
            elif k == BININT2:
                stack.append(unpack("<H", read(2))[0])
            elif k == BININT:
                stack.append(unpack("<i", read(4))[0])
            elif k == BINPERSID:
                pid = stack.pop()
                if type(pid) is not tuple or not pid or pid[0] not in ("storage", b"storage"):
                    raise BadPickle("a persistent id must be a tuple naming a storage")
                if self.pending:
                    _free(pid)
                try:
                    stack.append(self.persistent_load(pid))
                except (CheckpointError, pickle.UnpicklingError, RuntimeError):
                    raise  # torch's own words on the zip, the storage, the device
                except Exception as exc:
                    raise BadPickle(f"persistent id {pid!r:.200} is malformed: "
                                    f"{type(exc).__name__}: {exc}") from exc
            elif k == GLOBAL:
                stack.append(self.global_())
            elif k == SETITEMS:
                items = self._pop_mark()
                stack = self.stack
                if self.pending:
                    _free(items)
                target = stack[-1]
                self._check_mapping(target)
                for i in range(0, len(items) - 1, 2):
                    target[items[i]] = items[i + 1]
            elif k == SETITEM:
                v, key_ = stack.pop(), stack.pop()
                if self.pending:
                    _free((key_, v))
                self._check_mapping(stack[-1])
                stack[-1][key_] = v
            elif k == EMPTY_DICT:
                stack.append({})
            elif k == EMPTY_LIST:
                stack.append([])
            elif k == APPENDS:
                items = self._pop_mark()
                stack = self.stack
                if self.pending:
                    _free(items)
                if type(stack[-1]) is not list:
                    raise BadPickle(f"Can only extend lists, but got {type(stack[-1]).__name__}")
                stack[-1].extend(items)
            elif k == APPEND:
                item = stack.pop()
                if self.pending:
                    _free([item])
                if type(stack[-1]) is not list:
                    raise BadPickle(f"Can only append to lists, but got {type(stack[-1]).__name__}")
                stack[-1].append(item)
            elif k == BUILD:
                state = stack.pop()
                stack[-1] = self.build(stack[-1], state)
            elif k == NEWOBJ:
                args, cls = stack.pop(), stack.pop()
                if self.pending:
                    _free([cls])
                if type(args) is not tuple:
                    raise BadPickle("NEWOBJ arguments must be a tuple")
                if cls is torch.nn.Parameter:
                    stack.append(torch.nn.Parameter(*args))
                elif id(cls) in self.policy.routes:
                    stack.append(self.call(cls, args))
                elif id(cls) in self.policy.build_ids:
                    stack.append(self._new(cls, args))
                else:
                    raise BadPickle(f"Can only create new objects of allow-listed classes, "
                                    f"not {cls!r}")
            elif k == BINFLOAT:
                stack.append(unpack(">d", read(8))[0])
            elif k == SHORT_BINSTRING:
                raw = read(read(1)[0])
                stack.append(raw if self.encoding == "bytes"
                             else raw.decode(self.encoding, "strict"))
            elif k == LONG1:
                stack.append(pickle.decode_long(read(read(1)[0])))
            elif k == EMPTY_SET:
                stack.append(set())
            elif k == PROTO:
                read(1)
            elif k == STOP:
                result = stack.pop()
                _free([result])
                return result
            else:
                raise BadPickle(f"Unsupported operand {k}")

    def _new(self, cls: Any, args: tuple[Any, ...]) -> Any:
        _free(args)
        try:
            return cls.__new__(cls, *args)
        except Exception as exc:
            raise BadPickle(f"creating {cls.__name__} failed: {type(exc).__name__}: {exc}") from exc

    def _pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise BadPickle("MARK missing")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    @staticmethod
    def _check_mapping(target: Any) -> None:
        if type(target) not in (dict, OrderedDict, Counter):
            raise BadPickle(f"Can only set items of dicts, but got {type(target).__name__}")


_MISSING = object()


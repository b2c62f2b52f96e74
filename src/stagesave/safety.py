"""Safe loading: a restricted unpickler with an allow-list fit for training state.

Loading a pickle can run arbitrary code, so stagesave never unpickles with the full pickle
machinery unless the caller says ``trusted=True``. The allow-list covers what real training
checkpoints hold besides tensors: numpy arrays and scalars of plain dtypes (RNG states from
``np.random.get_state()`` are tuples of those), Python containers and scalars. Users add their
own classes (a dataclass, a namedtuple of hyper-parameters) with :func:`allow_globals` or the
``safe_globals=`` argument of ``load``.

Why not just ``torch.load(weights_only=True)`` with numpy added to its allow-list: that
unpickler calls every allow-listed global with whatever arguments the file gives and applies
``__setstate__`` to any allow-listed instance, as often as the file likes. For numpy that builds
pointers: a dtype of objects (``np.dtype('O8')``, a structured or sub-array dtype with an object
field) given raw bytes turns the file's bytes into ``PyObject*`` addresses; a second
``__setstate__`` frees an array a tensor still points into; a dtype's ``__setstate__`` changes
its item size under an array already made. So stagesave runs torch's unpickling protocol (the
same opcodes, the same torch rebuild functions, torch's reading of storages) with its own
opcode loop, in which numpy is reachable only through checks: dtypes are rebuilt through
numpy's validating constructor from a description and must be of a plain kind (bool, numbers,
bytes, str, void, datetime; never object or ``StringDType``, at any depth); an array is made
once, fresh, from a checked description whose byte count matches its data; nothing numpy is
ever called directly by the file. The allow-list is per load (not process-wide), so one
thread's ``safe_globals=`` never widens another thread's load.
"""

from __future__ import annotations

import _codecs
import importlib
import math
import os
import pickle
import re
import struct
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from struct import unpack
from typing import Any, NoReturn, cast

import numpy as np
import torch

from .errors import CheckpointError, IntegrityError, UnsafeCheckpointError

__all__ = ["allow_globals", "allowed_globals", "safe_torch_load"]

_extra: list[Any] = []
_lock = threading.Lock()

_multiarray: Any = importlib.import_module("numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray")
#: numpy pickles arrays, scalars and dtypes through these; both spellings of the module occur.
_MULTIARRAY_NAMES = ("numpy._core.multiarray", "numpy.core.multiarray")
#: dtype kinds whose items are plain bytes: bool, signed, unsigned, float, complex, bytes, str,
#: void, datetime, timedelta. Not ``O`` (object pointers), not ``T`` (StringDType, pointers).
_PLAIN_KINDS = frozenset("biufcSUVMm")
#: NPY_ITEM_REFCOUNT/NPY_ITEM_HASOBJECT (0x1) and NPY_ITEM_IS_POINTER (0x4) in a dtype's state
_POINTER_FLAGS = 0x1 | 0x4
_MAX_DIMS = 64
_MAX_DTYPE_DEPTH = 16
_TEXT_CODECS = frozenset({"latin1", "latin-1", "iso-8859-1", "ascii", "utf-8", "utf8"})

#: What a file may name, admitted only through the checks of this module.
_DEFAULT: list[Any] = [bytes, np.ndarray, np.dtype, _multiarray._reconstruct, _multiarray.scalar]


def allow_globals(*objs: Any) -> None:
    """Allow-list classes or functions for every later safe load in this process.

    Example: ``stagesave.allow_globals(MyConfig, MyNamedTuple)``. numpy arrays, dtypes and
    dtype classes need no allowing and cannot be widened this way: they are always admitted
    through stagesave's checks (plain dtypes only).
    """
    with _lock:
        for o in objs:
            if o not in _extra:
                _extra.append(o)


def allowed_globals() -> list[Any]:
    """The current allow-list (defaults plus what :func:`allow_globals` added)."""
    with _lock:
        return [*_DEFAULT, *_extra]


_UNSUPPORTED = re.compile(r"(?:unsupported GLOBAL|Unsupported global: GLOBAL) ([\w.]+)")


def safe_torch_load(
    source: Any,
    *,
    map_location: Any = None,
    mmap: bool = False,
    trusted: bool = False,
    safe_globals: Iterable[Any] = (),
    where: str = "checkpoint",
) -> Any:
    """``torch.load`` with the allow-list, or the full unpickler when ``trusted``.

    Raises:
        UnsafeCheckpointError: the file needs a global that is not allow-listed, or builds a
            numpy object that could hold pointers; the message names it and says how to allow
            it (classes of your own) or opt out.
        IntegrityError: the file is damaged (unreadable zip or pickle).
    """
    try:
        return _load(source, map_location, mmap, trusted, [*allowed_globals(), *safe_globals], where)
    except CheckpointError:
        raise
    except (EOFError, UnicodeDecodeError, MemoryError, RecursionError) as exc:
        raise _damaged(where, f"{type(exc).__name__}: {exc}") from exc
    except RuntimeError as exc:
        if "PytorchStreamReader" in str(exc) or "zip archive" in str(exc):
            raise _damaged(where, str(exc)) from exc
        raise
    except (KeyError, IndexError, ValueError, TypeError, AttributeError, OverflowError, struct.error) as exc:
        # what the unpickler raises on bytes that are not a pickle (another format, garbage)
        raise _damaged(where, f"not a torch checkpoint: {type(exc).__name__}: {exc}") from exc


def _damaged(where: str, text: str) -> IntegrityError:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    detail = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "unreadable")
    return IntegrityError(
        f"cannot load {where}: the file is damaged ({detail}). "
        "Use another checkpoint (stagesave.latest skips corrupt ones)."
    )


def _refused_global(where: str, name: str | None) -> UnsafeCheckpointError:
    needs = f"the global {name}" if name else "an object"
    allow = name.rsplit(".", 1)[-1] if name else "TheClass"
    return UnsafeCheckpointError(
        f"refusing to load {where}: it needs {needs}, which is not on stagesave's safe "
        f"allow-list, and unpickling it could run code. If the class is yours and plain "
        f"data, allow it with stagesave.allow_globals({allow}) or "
        f"load(..., safe_globals=[{allow}]); if you trust the file's source completely, "
        f"pass trusted=True."
    )


def _load(source: Any, map_location: Any, mmap: bool, trusted: bool, globs: list[Any], where: str) -> Any:
    if trusted:
        return torch.load(source, map_location=map_location, mmap=mmap, weights_only=False)
    try:
        if _torch_forces_weights_only():
            # torch refuses any pickle_module then: its own weights_only unpickler (which admits
            # no numpy of its own accord) with the caller's non-numpy globals.
            user = [g for g in globs if not _is_numpy_object(g[0] if isinstance(g, tuple) else g)]
            with torch.serialization.safe_globals(user):
                return torch.load(source, map_location=map_location, mmap=mmap, weights_only=True)
        policy = _Policy(globs, where)
        # torch reads the zip and the storages; every opcode of the pickle runs in _Unpickler.
        return torch.load(source, map_location=map_location, mmap=mmap, weights_only=False,
                          pickle_module=_PICKLE_MODULE, stagesave_policy=policy)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        text = str(exc)
        m = _UNSUPPORTED.search(text)
        if m is None and "GLOBAL" not in text:
            # Not a refused class: the pickle itself is damaged.
            raise _damaged(where, text) from exc
        raise _refused_global(where, m.group(1) if m else None) from exc


def _torch_forces_weights_only() -> bool:
    """Whether ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` makes torch refuse a ``pickle_module``."""
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")


# ------------------------------------------------------------------------------ the allow-list
class _Policy:
    """What one load may name (``table``), call directly, and ``BUILD``; plus the numpy routes."""

    def __init__(self, globs: list[Any], where: str) -> None:
        from torch._weights_only_unpickler import _get_allowed_globals, _get_safe_globals

        self.where = where
        builtin: dict[str, Any] = dict(_get_allowed_globals())
        user: dict[str, Any] = {}
        for g in [*_get_safe_globals(), *globs]:  # torch.serialization.add_safe_globals, then ours
            obj, name = g if isinstance(g, tuple) else (g, f"{g.__module__}.{g.__qualname__}")
            if not _is_numpy_object(obj):  # numpy is admitted only through the routes below
                user[name] = obj
        self.routes: dict[int, Callable[[Any, tuple[Any, ...]], Any]] = {}
        routed: dict[str, Any] = {
            "builtins.bytes": bytes,
            "builtins.bytearray": bytearray,
            "_codecs.encode": _codecs.encode,
            "numpy.ndarray": np.ndarray,
            "numpy.dtype": np.dtype,
            "torch._tensor._rebuild_from_type_v2": torch._tensor._rebuild_from_type_v2,
        }
        for mod in _MULTIARRAY_NAMES:
            routed[f"{mod}._reconstruct"] = _multiarray._reconstruct
            routed[f"{mod}.scalar"] = _multiarray.scalar
        dtypes = getattr(np, "dtypes", None)
        for attr in dir(dtypes) if dtypes is not None else ():
            cls = getattr(dtypes, attr)
            if isinstance(cls, type) and issubclass(cls, np.dtype):
                routed[f"numpy.dtypes.{attr}"] = cls
                self.routes[id(cls)] = _DtypeClassRoute(cls)
        self.table: dict[str, Any] = {**user, **builtin, **routed}
        self.routes.update({
            id(bytes): _bytes_route(bytes), id(bytearray): _bytes_route(bytearray),
            id(_codecs.encode): _codecs_encode_route,
            id(np.ndarray): _refuse_ndarray_call, id(np.dtype): _dtype_route,
            id(_multiarray._reconstruct): _reconstruct_route, id(_multiarray.scalar): _scalar_route,
            id(torch._tensor._rebuild_from_type_v2): _rebuild_from_type_route,
        })
        direct = [v for v in (*user.values(), *builtin.values()) if id(v) not in self.routes]
        self.callable_ids = {id(v) for v in direct}
        self.build_ids = {id(v) for v in direct if isinstance(v, type)}
        self.keep = direct  # the ids above stay valid while the policy lives


def _is_numpy_object(obj: Any) -> bool:
    if isinstance(obj, type) and issubclass(obj, (np.ndarray, np.dtype, np.generic)):
        return True
    return any(obj is x for x in (np.dtype, np.ndarray, _multiarray._reconstruct, _multiarray.scalar))


# ------------------------------------------------------------------------------ numpy routes
class _Pending:
    """A numpy object named by a ``REDUCE`` whose ``BUILD`` has not come yet.

    It is an inert placeholder: nothing may use it (put it in a container, pass it to a call)
    before its ``BUILD`` replaces it with the real, checked object.
    """

    __slots__ = ("args", "memo_slots", "what")

    def __init__(self, what: str, args: tuple[Any, ...]) -> None:
        self.what = what
        self.args = args
        self.memo_slots: list[int] = []


def _refuse(u: _Unpickler, text: str, *, numpy: bool = True) -> NoReturn:
    admits = ("stagesave admits numpy arrays, scalars and dtypes of plain kinds only (bool, "
              "integers, floats, complex, bytes, str, void, datetime) as numpy pickles them, never "
              "object dtypes or anything that holds pointers" if numpy else
              "unpickling it could exhaust memory or run code")
    raise UnsafeCheckpointError(
        f"refusing to load {u.policy.where}: {text}. {admits}; if you trust the file's source "
        f"completely, pass trusted=True."
    )


def _vet(u: _Unpickler, d: Any, depth: int = 0) -> np.dtype[Any]:
    """``d`` if it is a dtype of plain kind at every depth, else refuse."""
    if depth == 0 and (not isinstance(d, np.dtype) or id(d) not in u.vetted):
        _refuse(u, f"it uses {type(d).__name__} where a checked numpy dtype belongs")
    if d.hasobject or d.kind not in _PLAIN_KINDS or depth > _MAX_DTYPE_DEPTH:
        _refuse(u, f"it builds the numpy dtype {d!r}, which holds Python object pointers")
    if d.subdtype is not None:
        _vet(u, d.subdtype[0], depth + 1)
    for name in d.names or ():
        _vet(u, d.fields[name][0], depth + 1)
    return cast("np.dtype[Any]", d)


def _vetted(u: _Unpickler, d: np.dtype[Any]) -> np.dtype[Any]:
    u.vetted[id(d)] = d
    try:
        return _vet(u, d)
    except UnsafeCheckpointError:
        del u.vetted[id(d)]
        raise


def _refuse_ndarray_call(u: _Unpickler, args: tuple[Any, ...]) -> NoReturn:
    _refuse(u, "it calls numpy.ndarray directly (arrays are admitted only as numpy pickles them)")


def _dtype_route(u: _Unpickler, args: tuple[Any, ...]) -> _Pending:
    """``numpy.dtype(spec, align, copy)``: numpy pickles a dtype as that plus a ``BUILD``."""
    spec = args[0] if args else None
    if not 1 <= len(args) <= 3 or type(spec) is not str or len(spec) > 64:
        _refuse(u, f"it calls numpy.dtype with {len(args)} arguments of types "
                   f"{[type(a).__name__ for a in args]} (numpy pickles a short dtype string)")
    base = np.dtype(spec)
    if base.names is not None or base.subdtype is not None:
        _refuse(u, f"it builds the numpy dtype {spec!r} from a string (numpy pickles compound "
                   f"dtypes through their state)")
    u.vetted[id(base)] = base
    _vet(u, base)
    return _Pending("dtype", (base,))


def _build_dtype(u: _Unpickler, p: _Pending, state: Any) -> np.dtype[Any]:
    """The dtype that ``state`` describes, made by numpy's validating constructor."""
    base: np.dtype[Any] = p.args[0]
    if type(state) is not tuple or len(state) not in (8, 9) or state[0] not in (3, 4):
        _refuse(u, "it gives a numpy dtype a state numpy does not write")
    _, endian, sub, names, fields, elsize, _align, flags = state[:8]
    extra = state[8] if len(state) == 9 else None
    if endian not in ("<", ">", "|", "=") or type(elsize) is not int or type(flags) is not int:
        _refuse(u, "it gives a numpy dtype a malformed state")
    if flags & _POINTER_FLAGS:
        _refuse(u, f"it gives a numpy dtype the flags {flags:#x}, which say its items hold object "
                   f"references or pointers")
    out: np.dtype[Any]
    if sub is not None:
        if base.kind != "V" or type(sub) is not tuple or len(sub) != 2:
            _refuse(u, "it gives a numpy dtype a malformed sub-array")
        shape = sub[1] if type(sub[1]) is tuple else (sub[1],)
        if len(shape) > _MAX_DIMS or any(type(n) is not int or n < 0 for n in shape):
            _refuse(u, "it gives a numpy sub-array dtype a malformed shape")
        out = np.dtype((_vet(u, sub[0]), shape))
    elif names is not None:
        if base.kind != "V" or type(names) is not tuple or type(fields) is not dict:
            _refuse(u, "it gives a numpy dtype malformed fields")
        formats, offsets, titles = [], [], []
        for name in names:
            f = fields.get(name) if type(name) is str else None
            if type(f) is not tuple or len(f) not in (2, 3) or type(f[1]) is not int:
                _refuse(u, f"it gives a numpy dtype a malformed field {name!r}")
            formats.append(_vet(u, f[0]))
            offsets.append(f[1])
            titles.append(f[2] if len(f) == 3 else None)
        spec: dict[str, Any] = {"names": list(names), "formats": formats, "offsets": offsets,
                                "itemsize": elsize}
        if any(t is not None for t in titles):
            spec["titles"] = titles
        out = np.dtype(cast(Any, spec), align=bool(flags & 0x80))  # NPY_ALIGNED_STRUCT
    else:
        out = base
        if base.kind in "Mm" and type(extra) is tuple and len(extra) == 2:
            unit, num = (extra[1] + (None, None))[:2] if type(extra[1]) is tuple else (None, None)
            if type(unit) is not bytes or not unit.isalpha() or type(num) is not int or not 0 < num < 2**31:
                _refuse(u, "it gives a numpy datetime dtype a malformed unit")
            out = np.dtype(f"{base.kind}8[{num}{unit.decode()}]" if unit != b"generic" else base.kind + "8")
        if endian in "<>":
            out = out.newbyteorder(endian)
    if elsize >= 0 and out.itemsize != elsize:
        _refuse(u, f"it gives the numpy dtype {out!r} an item size of {elsize}")
    return _vetted(u, out)


def _reconstruct_route(u: _Unpickler, args: tuple[Any, ...]) -> _Pending:
    """``_reconstruct(ndarray, (0,), b'b')``: numpy pickles an array as that plus a ``BUILD``."""
    if len(args) != 3 or args[0] is not np.ndarray or args[1] != (0,) or args[2] not in (b"b", "b"):
        _refuse(u, "it calls numpy's _reconstruct with arguments numpy does not write "
                   "(only a plain numpy.ndarray of shape (0,) and type code 'b' is admitted)")
    return _Pending("array", ())


def _build_array(u: _Unpickler, state: Any) -> np.ndarray[Any, Any]:
    """A fresh array from ``(version, shape, dtype, fortran, data)``; data must fit exactly."""
    if type(state) is not tuple or len(state) not in (4, 5):
        _refuse(u, "it gives a numpy array a state numpy does not write")
    shape, dtype, fortran, data = state[-4:]
    if (type(shape) is not tuple or len(shape) > _MAX_DIMS
            or any(type(n) is not int or n < 0 for n in shape) or type(fortran) not in (bool, int)):
        _refuse(u, "it gives a numpy array a malformed shape")
    dtype = _vet(u, dtype)
    if type(data) not in (bytes, bytearray):
        _refuse(u, f"it gives a numpy array {type(data).__name__} as its data (numpy writes bytes)")
    if math.prod(shape) * dtype.itemsize != len(data):
        raise _BadPickle(f"numpy array of shape {shape} and dtype {dtype} has {len(data)} bytes of data")
    arr: np.ndarray[Any, Any] = np.empty(0, np.int8)  # fresh: nothing else can point into it
    cast(Any, arr).__setstate__((1, shape, dtype, bool(fortran), bytes(data)))
    _check_text(arr)
    return arr


def _check_text(arr: np.ndarray[Any, Any]) -> None:
    """str items must be Unicode code points (reading one above U+10FFFF is a SystemError)."""
    d = arr.dtype
    for name in d.names or ():
        _check_text(arr[name])
    if d.kind != "U" or arr.nbytes == 0:
        return
    order = d.byteorder if d.byteorder in "<>" else "="
    codes = np.frombuffer(np.ascontiguousarray(arr).tobytes(), np.dtype(order + "u4"))
    if int(codes.max()) > 0x10FFFF:
        raise _BadPickle(f"a numpy {d} array holds {int(codes.max()):#x}, which is not a code point")


def _scalar_route(u: _Unpickler, args: tuple[Any, ...]) -> Any:
    """``scalar(dtype, data)``: a numpy scalar of a checked dtype from exactly its bytes."""
    if len(args) != 2:
        _refuse(u, "it calls numpy's scalar with arguments numpy does not write")
    dtype, data = _vet(u, args[0]), args[1]
    if type(data) not in (bytes, bytearray) or len(data) != dtype.itemsize:
        raise _BadPickle(f"numpy scalar of dtype {dtype} needs {dtype.itemsize} bytes of data")
    if dtype.itemsize:
        _check_text(np.frombuffer(bytes(data), dtype))
    return _multiarray.scalar(dtype, bytes(data))


class _DtypeClassRoute:
    """``numpy.dtypes.Float64DType()``: a dtype class called without arguments, if plain."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, u: _Unpickler, args: tuple[Any, ...]) -> np.dtype[Any]:
        if args:
            _refuse(u, f"it calls numpy.dtypes.{self.cls.__name__} with arguments")
        if self.cls.__name__ in ("ObjectDType", "StringDType"):
            _refuse(u, f"it builds numpy.dtypes.{self.cls.__name__}, which holds pointers")
        return _vetted(u, self.cls())


def _bytes_route(kind: type) -> Callable[[Any, tuple[Any, ...]], Any]:
    """``bytes()``/``bytearray(text, codec)`` as pickle writes them; never ``bytes(10**12)``."""

    def route(u: _Unpickler, args: tuple[Any, ...]) -> Any:
        if not args:
            return kind()
        if len(args) == 1 and type(args[0]) in (bytes, bytearray, list):
            return kind(args[0])
        if len(args) == 2 and type(args[0]) is str and args[1] in _TEXT_CODECS:
            return kind(args[0], args[1])
        _refuse(u, f"it calls builtins.{kind.__name__} with {[type(a).__name__ for a in args]} (only "
                   f"bytes, a list, or text and a text codec are admitted; an int would allocate "
                   f"as much memory as the file says)", numpy=False)

    return route


def _codecs_encode_route(u: _Unpickler, args: tuple[Any, ...]) -> bytes:
    """``_codecs.encode(text, 'latin1')``, how protocol 2 pickles ``bytes``; text codecs only."""
    text, codec, errors = (*args, *("", "utf-8", "strict")[len(args):])[:3]
    if len(args) > 3 or type(text) is not str or codec not in _TEXT_CODECS or errors != "strict":
        _refuse(u, f"it calls _codecs.encode with the codec {codec!r} (only text codecs are admitted)",
                numpy=False)
    return text.encode(codec)


def _rebuild_from_type_route(u: _Unpickler, args: tuple[Any, ...]) -> Any:
    """torch's tensor-subclass rebuild, which calls its first argument: route that call too."""
    if len(args) != 4 or not (isinstance(args[1], type) and issubclass(args[1], torch.Tensor)):
        what = repr(args[1]) if len(args) == 4 else f"{len(args)} arguments"
        _refuse(u, f"it makes torch._tensor._rebuild_from_type_v2 build {what}, not a tensor class",
                numpy=False)
    func, new_type, fargs, state = args
    if type(fargs) is not tuple:
        raise _BadPickle("torch._tensor._rebuild_from_type_v2 needs a tuple of arguments")
    rebuild: Any = torch._tensor._rebuild_from_type_v2
    return rebuild(lambda *a: u.call(func, a), new_type, fargs, state)


# ------------------------------------------------------------------------------ the opcode loop
class _BadPickle(pickle.UnpicklingError):
    """The pickle is not one torch or numpy writes (reported as a damaged file)."""


_OP = {name: getattr(pickle, name)[0] for name in (
    "APPEND", "APPENDS", "BINFLOAT", "BINGET", "BININT", "BININT1", "BININT2", "BINPERSID",
    "BINPUT", "BINUNICODE", "BUILD", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET", "EMPTY_TUPLE",
    "GLOBAL", "LONG1", "LONG_BINGET", "LONG_BINPUT", "MARK", "NEWFALSE", "NEWOBJ", "NEWTRUE",
    "NONE", "PROTO", "REDUCE", "SETITEM", "SETITEMS", "SHORT_BINSTRING", "STOP", "TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3")}
_BLOCKED_MODULES = frozenset({"sys", "os", "posix", "nt"})


def _free(items: Iterable[Any]) -> None:
    for x in items:
        if type(x) is _Pending:
            raise _BadPickle(f"a numpy {x.what} is used before its state is set")


class _Unpickler:
    """The opcodes of torch's weights-only unpickler, with stagesave's allow-list and routes."""

    def __init__(self, file: Any, *, encoding: str = "bytes", stagesave_policy: _Policy) -> None:
        self.read: Callable[[int], bytes] = file.read
        self.readline: Callable[[], bytes] = file.readline
        self.encoding = encoding
        self.policy = stagesave_policy
        self.vetted: dict[int, np.dtype[Any]] = {}
        self.memo: dict[int, Any] = {}

    def persistent_load(self, pid: Any) -> Any:  # replaced by torch with its storage reader
        raise _BadPickle("unsupported persistent id encountered")

    def call(self, func: Any, args: Any) -> Any:
        """``func(*args)`` for an allow-listed ``func``, through its route if it has one."""
        if type(args) is not tuple:
            raise _BadPickle(f"call arguments must be a tuple, not {type(args).__name__}")
        route = self.policy.routes.get(id(func))
        try:
            if route is not None:
                return route(self, args)
            if id(func) not in self.policy.callable_ids:
                raise _BadPickle(f"Trying to call reduce for unrecognized function {func!r}")
            result = func(*args)
        except (CheckpointError, pickle.UnpicklingError):
            raise
        except Exception as exc:
            raise _BadPickle(f"{getattr(func, '__name__', func)} failed: {type(exc).__name__}: {exc}") from exc
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
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {full} was not an allowed global")
        return obj

    def build(self, inst: Any, state: Any) -> Any:
        """``BUILD``: numpy placeholders become checked objects; otherwise torch's rules."""
        if type(inst) is _Pending:
            _free([state] if type(state) is not tuple else state)
            try:
                made = _build_dtype(self, inst, state) if inst.what == "dtype" else _build_array(self, state)
            except (CheckpointError, pickle.UnpicklingError):
                raise
            except Exception as exc:  # numpy's own refusal of a description
                raise _BadPickle(f"numpy {inst.what} state refused: {type(exc).__name__}: {exc}") from exc
            for slot in inst.memo_slots:
                if self.memo.get(slot) is inst:
                    self.memo[slot] = made
            return made
        _free([state])
        if isinstance(inst, (np.ndarray, np.dtype, np.generic)):
            _refuse(self, f"it sets the state of a numpy {type(inst).__name__} that already has one "
                          f"(that frees memory a tensor may still point into, or changes the item "
                          f"size under an array)")
        try:
            if type(inst) is torch.Tensor:
                inst.set_(*state)
            elif type(inst) is torch.nn.Parameter:
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
                raise _BadPickle(f"Can only build Tensor, Parameter, OrderedDict or allow-listed "
                                 f"types, but got {type(inst).__name__}")
        except (CheckpointError, pickle.UnpicklingError):
            raise
        except Exception as exc:
            raise _BadPickle(f"BUILD of {type(inst).__name__} failed: {type(exc).__name__}: {exc}") from exc
        return inst

    def load(self) -> Any:  # one branch per opcode, as pickle's own loop
        self.metastack: list[list[Any]] = []
        stack: list[Any] = []
        self.stack = stack
        read = self.read
        op = _OP
        while True:
            key = read(1)
            if not key:
                raise EOFError
            k = key[0]
            if k == op["GLOBAL"]:
                stack.append(self.global_())
            elif k == op["NEWOBJ"]:
                args, cls = stack.pop(), stack.pop()
                _free([cls])
                if type(args) is not tuple:
                    raise _BadPickle("NEWOBJ arguments must be a tuple")
                if cls is torch.nn.Parameter:
                    stack.append(torch.nn.Parameter(*args))
                elif id(cls) in self.policy.routes:
                    stack.append(self.call(cls, args))
                elif id(cls) in self.policy.build_ids:
                    stack.append(self._new(cls, args))
                else:
                    raise _BadPickle(f"Can only create new objects of allow-listed classes, not {cls!r}")
            elif k == op["REDUCE"]:
                args = stack.pop()
                _free([stack[-1]])
                stack[-1] = self.call(stack[-1], args)
            elif k == op["BUILD"]:
                state = stack.pop()
                stack[-1] = self.build(stack[-1], state)
            elif k == op["APPEND"]:
                item = stack.pop()
                _free([item])
                if type(stack[-1]) is not list:
                    raise _BadPickle(f"Can only append to lists, but got {type(stack[-1]).__name__}")
                stack[-1].append(item)
            elif k == op["APPENDS"]:
                items = self._pop_mark()
                stack = self.stack
                _free(items)
                if type(stack[-1]) is not list:
                    raise _BadPickle(f"Can only extend lists, but got {type(stack[-1]).__name__}")
                stack[-1].extend(items)
            elif k == op["SETITEM"]:
                v, key_ = stack.pop(), stack.pop()
                _free((key_, v))
                self._check_mapping(stack[-1])
                stack[-1][key_] = v
            elif k == op["SETITEMS"]:
                items = self._pop_mark()
                stack = self.stack
                _free(items)
                self._check_mapping(stack[-1])
                for i in range(0, len(items) - 1, 2):
                    stack[-1][items[i]] = items[i + 1]
            elif k == op["MARK"]:
                self.metastack.append(stack)
                stack = self.stack = []
            elif k == op["TUPLE"]:
                items = self._pop_mark()
                stack = self.stack
                _free(items)
                stack.append(tuple(items))
            elif k in (op["TUPLE1"], op["TUPLE2"], op["TUPLE3"]):
                n = 1 + k - op["TUPLE1"]
                if len(stack) < n:
                    raise _BadPickle("stack underflow")
                items = stack[-n:]
                _free(items)
                stack[-n:] = [tuple(items)]
            elif k == op["NONE"]:
                stack.append(None)
            elif k == op["NEWFALSE"]:
                stack.append(False)
            elif k == op["NEWTRUE"]:
                stack.append(True)
            elif k == op["EMPTY_TUPLE"]:
                stack.append(())
            elif k == op["EMPTY_LIST"]:
                stack.append([])
            elif k == op["EMPTY_DICT"]:
                stack.append({})
            elif k == op["EMPTY_SET"]:
                stack.append(set())
            elif k == op["BININT"]:
                stack.append(unpack("<i", read(4))[0])
            elif k == op["BININT1"]:
                stack.append(read(1)[0])
            elif k == op["BININT2"]:
                stack.append(unpack("<H", read(2))[0])
            elif k == op["BINFLOAT"]:
                stack.append(unpack(">d", read(8))[0])
            elif k == op["BINUNICODE"]:
                (n,) = unpack("<I", read(4))
                data = read(n)
                if len(data) != n:
                    raise EOFError
                stack.append(str(data, "utf-8", "surrogatepass"))
            elif k == op["SHORT_BINSTRING"]:
                raw = read(read(1)[0])
                stack.append(raw if self.encoding == "bytes" else raw.decode(self.encoding, "strict"))
            elif k == op["LONG1"]:
                stack.append(pickle.decode_long(read(read(1)[0])))
            elif k == op["BINPERSID"]:
                pid = stack.pop()
                if type(pid) is not tuple or not pid or pid[0] not in ("storage", b"storage"):
                    raise _BadPickle("a persistent id must be a tuple naming a storage")
                _free(pid)
                try:
                    stack.append(self.persistent_load(pid))
                except (CheckpointError, pickle.UnpicklingError, RuntimeError):
                    raise  # torch's own words on the zip, the storage, the device
                except Exception as exc:
                    raise _BadPickle(f"persistent id {pid!r:.200} is malformed: {type(exc).__name__}: {exc}") from exc
            elif k in (op["BINGET"], op["LONG_BINGET"]):
                i = read(1)[0] if k == op["BINGET"] else unpack("<I", read(4))[0]
                stack.append(self.memo[i])
            elif k in (op["BINPUT"], op["LONG_BINPUT"]):
                i = read(1)[0] if k == op["BINPUT"] else unpack("<I", read(4))[0]
                self.memo[i] = stack[-1]
                if type(stack[-1]) is _Pending:
                    stack[-1].memo_slots.append(i)
            elif k == op["PROTO"]:
                read(1)
            elif k == op["STOP"]:
                result = stack.pop()
                _free([result])
                return result
            else:
                raise _BadPickle(f"Unsupported operand {k}")

    def _new(self, cls: Any, args: tuple[Any, ...]) -> Any:
        _free(args)
        try:
            return cls.__new__(cls, *args)
        except Exception as exc:
            raise _BadPickle(f"creating {cls.__name__} failed: {type(exc).__name__}: {exc}") from exc

    def _pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise _BadPickle("MARK missing")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    @staticmethod
    def _check_mapping(target: Any) -> None:
        if type(target) not in (dict, OrderedDict, Counter):
            raise _BadPickle(f"Can only set items of dicts, but got {type(target).__name__}")


_MISSING = object()


def _pickle_load(file: Any, *, encoding: str = "bytes", stagesave_policy: _Policy) -> Any:
    return _Unpickler(file, encoding=encoding, stagesave_policy=stagesave_policy).load()


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` uses: our unpickler, torch's reading of the zip."""

    Unpickler = _Unpickler
    load = staticmethod(_pickle_load)
    __name__ = "stagesave.safety"


_PICKLE_MODULE = _PickleModule()

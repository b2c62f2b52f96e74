"""numpy inside a checkpoint: admitted only as numpy pickles it, and only of plain dtypes.

torch's weights-only unpickler would call numpy's globals with whatever arguments the file gives
and apply ``__setstate__`` as often as the file likes, which builds pointers out of the file's
bytes (see :mod:`stagesave.safety`). Here every numpy object is made through a *route*: dtypes
are rebuilt through numpy's validating constructor from a description and must be of a plain
kind (bool, numbers, bytes, str, void, datetime; never object or ``StringDType``, at any depth);
an array is made once, fresh, from a checked description whose byte count matches its data;
nothing numpy is ever called directly by the file. A ``REDUCE`` that names a numpy object yields
an inert :class:`Pending` until its ``BUILD`` gives the state it is checked against.
"""

from __future__ import annotations

import importlib
import math
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np

from ..errors import UnsafeCheckpointError
from .refusal import BadPickle, refuse

if TYPE_CHECKING:
    from .unpickle import Unpickler

__all__ = [
    "MULTIARRAY_NAMES", "DtypeClassRoute", "Pending", "build_array", "build_dtype", "dtype_route",
    "is_numpy_object", "multiarray", "reconstruct_route", "refuse_ndarray_call", "scalar_route",
]

multiarray: Any = importlib.import_module(
    "numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray"
)
#: numpy pickles arrays, scalars and dtypes through these; both spellings of the module occur.
MULTIARRAY_NAMES = ("numpy._core.multiarray", "numpy.core.multiarray")
#: dtype kinds whose items are plain bytes: bool, signed, unsigned, float, complex, bytes, str,
#: void, datetime, timedelta. Not ``O`` (object pointers), not ``T`` (StringDType, pointers).
_PLAIN_KINDS = frozenset("biufcSUVMm")
#: NPY_ITEM_REFCOUNT/NPY_ITEM_HASOBJECT (0x1) and NPY_ITEM_IS_POINTER (0x4) in a dtype's state
_POINTER_FLAGS = 0x1 | 0x4
_MAX_DIMS = 64
_MAX_DTYPE_DEPTH = 16


def is_numpy_object(obj: Any) -> bool:
    if isinstance(obj, type) and issubclass(obj, (np.ndarray, np.dtype, np.generic)):
        return True
    return any(obj is x for x in (np.dtype, np.ndarray, multiarray._reconstruct, multiarray.scalar))


# ------------------------------------------------------------------------------ numpy routes
class Pending:
    """A numpy object named by a ``REDUCE`` whose ``BUILD`` has not come yet.

    It is an inert placeholder: nothing may use it (put it in a container, pass it to a call)
    before its ``BUILD`` replaces it with the real, checked object.
    """

    __slots__ = ("args", "memo_slots", "what")

    def __init__(self, what: str, args: tuple[Any, ...]) -> None:
        self.what = what
        self.args = args
        self.memo_slots: list[int] = []



def _vet(u: Unpickler, d: Any, depth: int = 0) -> np.dtype[Any]:
    """``d`` if it is a dtype of plain kind at every depth, else refuse."""
    if depth == 0 and (not isinstance(d, np.dtype) or id(d) not in u.vetted):
        refuse(u, f"it uses {type(d).__name__} where a checked numpy dtype belongs")
    if d.hasobject or d.kind not in _PLAIN_KINDS or depth > _MAX_DTYPE_DEPTH:
        refuse(u, f"it builds the numpy dtype {d!r}, which holds Python object pointers")
    if d.subdtype is not None:
        _vet(u, d.subdtype[0], depth + 1)
    for name in d.names or ():
        _vet(u, d.fields[name][0], depth + 1)
    return cast("np.dtype[Any]", d)


def _vetted(u: Unpickler, d: np.dtype[Any]) -> np.dtype[Any]:
    u.vetted[id(d)] = d
    try:
        return _vet(u, d)
    except UnsafeCheckpointError:
        del u.vetted[id(d)]
        raise


def refuse_ndarray_call(u: Unpickler, args: tuple[Any, ...]) -> NoReturn:
    refuse(u, "it calls numpy.ndarray directly (arrays are admitted only as numpy pickles them)")


def dtype_route(u: Unpickler, args: tuple[Any, ...]) -> Pending:
    """``numpy.dtype(spec, align, copy)``: numpy pickles a dtype as that plus a ``BUILD``."""
    spec = args[0] if args else None
    if not 1 <= len(args) <= 3 or type(spec) is not str or len(spec) > 64:
        refuse(u, f"it calls numpy.dtype with {len(args)} arguments of types "
                   f"{[type(a).__name__ for a in args]} (numpy pickles a short dtype string)")
    base = np.dtype(spec)
    if base.names is not None or base.subdtype is not None:
        refuse(u, f"it builds the numpy dtype {spec!r} from a string (numpy pickles compound "
                   f"dtypes through their state)")
    u.vetted[id(base)] = base
    _vet(u, base)
    return Pending("dtype", (base,))


def build_dtype(u: Unpickler, p: Pending, state: Any) -> np.dtype[Any]:
    """The dtype that ``state`` describes, made by numpy's validating constructor."""
    base: np.dtype[Any] = p.args[0]
    if type(state) is not tuple or len(state) not in (8, 9) or state[0] not in (3, 4):
        refuse(u, "it gives a numpy dtype a state numpy does not write")
    _, endian, sub, names, fields, elsize, _align, flags = state[:8]
    extra = state[8] if len(state) == 9 else None
    if endian not in ("<", ">", "|", "=") or type(elsize) is not int or type(flags) is not int:
        refuse(u, "it gives a numpy dtype a malformed state")
    if flags & _POINTER_FLAGS:
        refuse(u, f"it gives a numpy dtype the flags {flags:#x}, which say its items hold object "
                   f"references or pointers")
    out: np.dtype[Any]
    if sub is not None:
        if base.kind != "V" or type(sub) is not tuple or len(sub) != 2:
            refuse(u, "it gives a numpy dtype a malformed sub-array")
        shape = sub[1] if type(sub[1]) is tuple else (sub[1],)
        if len(shape) > _MAX_DIMS or any(type(n) is not int or n < 0 for n in shape):
            refuse(u, "it gives a numpy sub-array dtype a malformed shape")
        out = np.dtype((_vet(u, sub[0]), shape))
    elif names is not None:
        if base.kind != "V" or type(names) is not tuple or type(fields) is not dict:
            refuse(u, "it gives a numpy dtype malformed fields")
        formats, offsets, titles = [], [], []
        for name in names:
            f = fields.get(name) if type(name) is str else None
            if type(f) is not tuple or len(f) not in (2, 3) or type(f[1]) is not int:
                refuse(u, f"it gives a numpy dtype a malformed field {name!r}")
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
            if (type(unit) is not bytes or not unit.isalpha() or type(num) is not int
                    or not 0 < num < 2**31):
                refuse(u, "it gives a numpy datetime dtype a malformed unit")
            out = np.dtype(f"{base.kind}8[{num}{unit.decode()}]" if unit != b"generic"
                           else base.kind + "8")
        if endian in "<>":
            out = out.newbyteorder(endian)
    if elsize >= 0 and out.itemsize != elsize:
        refuse(u, f"it gives the numpy dtype {out!r} an item size of {elsize}")
    return _vetted(u, out)


def reconstruct_route(u: Unpickler, args: tuple[Any, ...]) -> Pending:
    """``_reconstruct(ndarray, (0,), b'b')``: numpy pickles an array as that plus a ``BUILD``."""
    if len(args) != 3 or args[0] is not np.ndarray or args[1] != (0,) or args[2] not in (b"b", "b"):
        refuse(u, "it calls numpy's _reconstruct with arguments numpy does not write "
                   "(only a plain numpy.ndarray of shape (0,) and type code 'b' is admitted)")
    return Pending("array", ())


def build_array(u: Unpickler, state: Any) -> np.ndarray[Any, Any]:
    """A fresh array from ``(version, shape, dtype, fortran, data)``; data must fit exactly."""
    if type(state) is not tuple or len(state) not in (4, 5):
        refuse(u, "it gives a numpy array a state numpy does not write")
    shape, dtype, fortran, data = state[-4:]
    if (type(shape) is not tuple or len(shape) > _MAX_DIMS
            or any(type(n) is not int or n < 0 for n in shape) or type(fortran) not in (bool, int)):
        refuse(u, "it gives a numpy array a malformed shape")
    dtype = _vet(u, dtype)
    if type(data) not in (bytes, bytearray):
        refuse(u, f"it gives a numpy array {type(data).__name__} as its data (numpy writes bytes)")
    if math.prod(shape) * dtype.itemsize != len(data):
        raise BadPickle(f"numpy array of shape {shape} and dtype {dtype} has {len(data)} bytes "
                        f"of data")
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
        raise BadPickle(f"a numpy {d} array holds {int(codes.max()):#x}, which is not a code point")


def scalar_route(u: Unpickler, args: tuple[Any, ...]) -> Any:
    """``scalar(dtype, data)``: a numpy scalar of a checked dtype from exactly its bytes."""
    if len(args) != 2:
        refuse(u, "it calls numpy's scalar with arguments numpy does not write")
    dtype, data = _vet(u, args[0]), args[1]
    if type(data) not in (bytes, bytearray) or len(data) != dtype.itemsize:
        raise BadPickle(f"numpy scalar of dtype {dtype} needs {dtype.itemsize} bytes of data")
    if dtype.itemsize:
        _check_text(np.frombuffer(bytes(data), dtype))
    return multiarray.scalar(dtype, bytes(data))


class DtypeClassRoute:
    """``numpy.dtypes.Float64DType()``: a dtype class called without arguments, if plain."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, u: Unpickler, args: tuple[Any, ...]) -> np.dtype[Any]:
        if args:
            refuse(u, f"it calls numpy.dtypes.{self.cls.__name__} with arguments")
        if self.cls.__name__ in ("ObjectDType", "StringDType"):
            refuse(u, f"it builds numpy.dtypes.{self.cls.__name__}, which holds pointers")
        return _vetted(u, self.cls())



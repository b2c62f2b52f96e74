"""What one safe load may name, call and build: torch's allow-list, the user's, and the routes.

A :class:`Policy` is made per load (never process-wide, so one thread's ``safe_globals=`` never
widens another thread's load): the globals a file may name (``table``), those it may call
directly or ``BUILD``, and the *routes*: the callables admitted only through checks (numpy's
in :mod:`.numpy_pickles`; ``bytes``, ``_codecs.encode`` and torch's tensor-subclass rebuild
here), which see the call's arguments before anything is made.
"""

from __future__ import annotations

import _codecs
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .numpy_pickles import (
    MULTIARRAY_NAMES,
    DtypeClassRoute,
    dtype_route,
    is_numpy_object,
    multiarray,
    reconstruct_route,
    refuse_ndarray_call,
    scalar_route,
)
from .refusal import BadPickle, refuse

if TYPE_CHECKING:
    from .unpickle import Unpickler

__all__ = ["TEXT_CODECS", "Policy"]

TEXT_CODECS = frozenset({"latin1", "latin-1", "iso-8859-1", "ascii", "utf-8", "utf8"})


class Policy:
    """What one load may name (``table``), call directly, and ``BUILD``; plus the numpy routes."""

    def __init__(self, globs: list[Any], where: str) -> None:
        from torch._weights_only_unpickler import _get_allowed_globals, _get_safe_globals

        self.where = where
        builtin: dict[str, Any] = dict(_get_allowed_globals())
        user: dict[str, Any] = {}
        for g in [*_get_safe_globals(), *globs]:  # torch.serialization.add_safe_globals, then ours
            obj, name = g if isinstance(g, tuple) else (g, f"{g.__module__}.{g.__qualname__}")
            if not is_numpy_object(obj):  # numpy is admitted only through the routes below
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
        for mod in MULTIARRAY_NAMES:
            routed[f"{mod}._reconstruct"] = multiarray._reconstruct
            routed[f"{mod}.scalar"] = multiarray.scalar
        dtypes = getattr(np, "dtypes", None)
        for attr in dir(dtypes) if dtypes is not None else ():
            cls = getattr(dtypes, attr)
            if isinstance(cls, type) and issubclass(cls, np.dtype):
                routed[f"numpy.dtypes.{attr}"] = cls
                self.routes[id(cls)] = DtypeClassRoute(cls)
        self.table: dict[str, Any] = {**user, **builtin, **routed}
        self.routes.update({
            id(bytes): _bytes_route(bytes), id(bytearray): _bytes_route(bytearray),
            id(_codecs.encode): _codecs_encode_route,
            id(np.ndarray): refuse_ndarray_call, id(np.dtype): dtype_route,
            id(multiarray._reconstruct): reconstruct_route, id(multiarray.scalar): scalar_route,
            id(torch._tensor._rebuild_from_type_v2): _rebuild_from_type_route,
        })
        for cls in torch._tensor_classes:  # torch.FloatTensor(n): n elements never written
            self.routes.setdefault(id(cls), _legacy_tensor_route(cls))
        direct = [v for v in (*user.values(), *builtin.values()) if id(v) not in self.routes]
        self.callable_ids = {id(v) for v in direct}
        self.build_ids = {id(v) for v in direct if isinstance(v, type)}
        self.keep = direct  # the ids above stay valid while the policy lives



def _bytes_route(kind: type) -> Callable[[Any, tuple[Any, ...]], Any]:
    """``bytes()``/``bytearray(text, codec)`` as pickle writes them; never ``bytes(10**12)``."""

    def route(u: Unpickler, args: tuple[Any, ...]) -> Any:
        if not args:
            return kind()
        if len(args) == 1 and type(args[0]) in (bytes, bytearray, list):
            return kind(args[0])
        if len(args) == 2 and type(args[0]) is str and args[1] in TEXT_CODECS:
            return kind(args[0], args[1])
        types = [type(a).__name__ for a in args]
        refuse(u, f"it calls builtins.{kind.__name__} with {types} (only "
                   f"bytes, a list, or text and a text codec are admitted; an int would allocate "
                   f"as much memory as the file says)", numpy=False)

    return route


_TENSOR_DATA = (torch.Tensor, torch.storage.TypedStorage, torch.UntypedStorage)


def _legacy_tensor_route(cls: Any) -> Callable[[Any, tuple[Any, ...]], Any]:
    """A legacy tensor type (``torch.FloatTensor``, ``torch.sparse.FloatTensor``...) called
    with data, a storage or a tensor; never with a size, which makes a tensor of that many
    elements whose memory was never written (as much as the file says, and the heap's old
    bytes in it)."""
    name = f"{cls.__module__}.{cls.__name__}"

    def route(u: Unpickler, args: tuple[Any, ...]) -> Any:
        if not all(type(a) in (list, tuple) or isinstance(a, _TENSOR_DATA) for a in args):
            types = [type(a).__name__ for a in args]
            refuse(u, f"it calls {name} with {types} (only data, a tensor or a storage are "
                      f"admitted; a size makes a tensor of memory never written, as large as the "
                      f"file says)", numpy=False)
        made = cls(*args)
        if "sparse" in cls.__module__:  # checked once the load is done (validate_loaded_sparse)
            torch._utils._sparse_tensors_to_validate.append(made)
        return made

    return route


def _codecs_encode_route(u: Unpickler, args: tuple[Any, ...]) -> bytes:
    """``_codecs.encode(text, 'latin1')``, how protocol 2 pickles ``bytes``; text codecs only."""
    text, codec, errors = (*args, *("", "utf-8", "strict")[len(args):])[:3]
    if len(args) > 3 or type(text) is not str or codec not in TEXT_CODECS or errors != "strict":
        refuse(u, f"it calls _codecs.encode with the codec {codec!r} (only text codecs are "
                   f"admitted)", numpy=False)
    return text.encode(codec)


def _rebuild_from_type_route(u: Unpickler, args: tuple[Any, ...]) -> Any:
    """torch's tensor-subclass rebuild, which calls its first argument: route that call too."""
    if len(args) != 4 or not (isinstance(args[1], type) and issubclass(args[1], torch.Tensor)):
        what = repr(args[1]) if len(args) == 4 else f"{len(args)} arguments"
        refuse(u, f"it makes torch._tensor._rebuild_from_type_v2 build {what}, not a tensor class",
                numpy=False)
    func, new_type, fargs, state = args
    if type(fargs) is not tuple:
        raise BadPickle("torch._tensor._rebuild_from_type_v2 needs a tuple of arguments")
    rebuild: Any = torch._tensor._rebuild_from_type_v2
    return rebuild(lambda *a: u.call(func, a), new_type, fargs, state)


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

The machinery lives in :mod:`stagesave.restore`: ``torch_load`` (which unpickler runs),
``allowlist`` (what one load may name), ``numpy_pickles`` (the numpy routes), ``unpickle`` (the
opcode loop) and ``refusal`` (what a refused or damaged file raises).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from .restore.numpy_pickles import multiarray
from .restore.torch_load import first_try, torch_load

__all__ = ["allow_globals", "allowed_globals", "safe_first_try", "safe_torch_load"]

_extra: list[Any] = []
_lock = threading.Lock()

#: What a file may name, admitted only through the checks of :mod:`stagesave.restore`.
_DEFAULT: list[Any] = [bytes, np.ndarray, np.dtype, multiarray._reconstruct, multiarray.scalar]


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
    return torch_load(source, map_location=map_location, mmap=mmap, trusted=trusted,
                      globs=[*allowed_globals(), *safe_globals], where=where)


def safe_first_try(image: Any, *, map_location: Any, safe_globals: Iterable[Any], where: str,
                   ) -> Any:
    """The allow-listed C unpickler alone over a load's image whose bytes are still being read
    (see :func:`stagesave.restore.torch_load.first_try`; raises wherever it stops)."""
    return first_try(image, map_location=map_location,
                     globs=[*allowed_globals(), *safe_globals], where=where)

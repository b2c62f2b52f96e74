"""Safe loading: torch's ``weights_only`` unpickler with an allow-list fit for training state.

Loading a pickle can run arbitrary code, so stagesave never unpickles with the full pickle
machinery unless the caller says ``trusted=True``. The allow-list covers what real training
checkpoints hold besides tensors: numpy arrays and scalars of plain dtypes (RNG states from
``np.random.get_state()`` are tuples of those), Python containers and scalars. Users add their
own classes (a dataclass, a namedtuple of hyper-parameters) with :func:`allow_globals` or the
``safe_globals=`` argument of ``load``.
"""

from __future__ import annotations

import pickle
import re
import struct
import threading
from collections.abc import Iterable
from typing import Any

import torch

from .errors import CheckpointError, IntegrityError, UnsafeCheckpointError

__all__ = ["allow_globals", "allowed_globals", "safe_torch_load"]

_extra: list[Any] = []
_lock = threading.Lock()


def _numpy_globals() -> list[Any]:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return []
    out: list[Any] = [np.ndarray, np.dtype]
    for modname in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            mod = __import__(modname, fromlist=["_reconstruct", "scalar"])
        except ImportError:
            continue
        out += [mod._reconstruct, mod.scalar]
        break
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        for name in dir(dtypes):
            obj = getattr(dtypes, name)
            if isinstance(obj, type) and issubclass(obj, np.dtype):
                out.append(obj)
    else:  # numpy < 1.25: dtype classes are only reachable through instances
        for code in "?bhilqBHILQefdgFDGSUVMm":
            try:
                out.append(type(np.dtype(code)))
            except TypeError:
                pass
    return out


#: ``bytes`` is needed for empty byte strings (protocol 2 pickles ``b""`` as ``bytes()``),
#: which every empty numpy array contains.
_DEFAULT: list[Any] = [bytes, *_numpy_globals()]


def allow_globals(*objs: Any) -> None:
    """Allow-list classes or functions for every later safe load in this process.

    Example: ``stagesave.allow_globals(MyConfig, MyNamedTuple)``.
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
        UnsafeCheckpointError: the file needs a global that is not allow-listed; the message
            names it and says how to allow it or opt out.
        IntegrityError: the file is damaged (unreadable zip or pickle).
    """
    try:
        return _load(source, map_location, mmap, trusted, [*allowed_globals(), *safe_globals], where)
    except CheckpointError:
        raise
    except (EOFError, UnicodeDecodeError) as exc:
        raise _damaged(where, str(exc)) from exc
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


def _load(source: Any, map_location: Any, mmap: bool, trusted: bool, globs: list[Any], where: str) -> Any:
    if trusted:
        return torch.load(source, map_location=map_location, mmap=mmap, weights_only=False)
    try:
        with torch.serialization.safe_globals(globs):
            return torch.load(source, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        m = _UNSUPPORTED.search(text)
        if m is None and "GLOBAL" not in text:
            # Not a refused class: the pickle itself is damaged.
            raise _damaged(where, text) from exc
        refused = m.group(1) if m else None
        needs = f"the global {refused}" if refused else "an object"
        allow = refused.rsplit(".", 1)[-1] if refused else "TheClass"
        raise UnsafeCheckpointError(
            f"refusing to load {where}: it needs {needs}, which is not on stagesave's safe "
            f"allow-list, and unpickling it could run code. If the class is yours and plain "
            f"data, allow it with stagesave.allow_globals({allow}) or "
            f"load(..., safe_globals=[{allow}]); if you trust the file's source completely, "
            f"pass trusted=True."
        ) from exc

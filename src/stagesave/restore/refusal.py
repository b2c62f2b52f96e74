"""How a safe load says no: a refused file, or a damaged one.

A file that needs a global outside the allow-list, or builds a numpy object that could hold
pointers, is *refused* (:class:`~stagesave.errors.UnsafeCheckpointError`, with how to allow it
or opt out); a pickle that is not one torch or numpy writes is *damaged*
(:class:`~stagesave.errors.IntegrityError`).
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, NoReturn

from ..errors import IntegrityError, UnsafeCheckpointError

if TYPE_CHECKING:
    from .unpickle import Unpickler

__all__ = ["BadPickle", "damaged", "refuse", "refused_global"]


class BadPickle(pickle.UnpicklingError):
    """The pickle is not one torch or numpy writes (reported as a damaged file)."""


def refuse(u: Unpickler, text: str, *, numpy: bool = True) -> NoReturn:
    """Refuse the load ``u`` runs: the file does ``text``, which the allow-list does not admit.

    Raises:
        UnsafeCheckpointError: always.
    """
    admits = ("stagesave admits numpy arrays, scalars and dtypes of plain kinds only (bool, "
              "integers, floats, complex, bytes, str, void, datetime) as numpy pickles them, never "
              "object dtypes or anything that holds pointers" if numpy else
              "unpickling it could exhaust memory or run code")
    raise UnsafeCheckpointError(
        f"refusing to load {u.policy.where}: {text}. {admits}; if you trust the file's source "
        f"completely, pass trusted=True."
    )



def damaged(where: str, text: str) -> IntegrityError:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else "unreadable"
    detail = next((ln for ln in lines if "error" in ln.lower()), first)
    return IntegrityError(
        f"cannot load {where}: the file is damaged ({detail}). "
        "Use another checkpoint (stagesave.latest skips corrupt ones)."
    )


def refused_global(where: str, name: str | None) -> UnsafeCheckpointError:
    needs = f"the global {name}" if name else "an object"
    allow = name.rsplit(".", 1)[-1] if name else "TheClass"
    return UnsafeCheckpointError(
        f"refusing to load {where}: it needs {needs}, which is not on stagesave's safe "
        f"allow-list, and unpickling it could run code. If the class is yours and plain "
        f"data, allow it with stagesave.allow_globals({allow}) or "
        f"load(..., safe_globals=[{allow}]); if you trust the file's source completely, "
        f"pass trusted=True."
    )


"""``torch.load`` behind the allow-list: which unpickler runs, and what its failures mean.

Three ways to load, one choice per call: ``trusted`` runs torch's full unpickler; when
``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` makes torch refuse any ``pickle_module``, torch's own
weights-only unpickler runs with the caller's non-numpy globals; otherwise torch reads the zip
and the storages and every opcode of the pickle runs in stagesave's
:class:`~stagesave.restore.fast_unpickle.Unpickler` (the C unpickler over proxies first, the
Python loop of :mod:`.unpickle` wherever that stops). Whatever fails is reported as a refused file
(:class:`~stagesave.errors.UnsafeCheckpointError`) or a damaged one
(:class:`~stagesave.errors.IntegrityError`), never as the unpickler's own exception.
"""

from __future__ import annotations

import os
import pickle
import re
import struct
from typing import Any

import torch

from ..errors import CheckpointError, IntegrityError
from ..saving.plan import gc_paused
from .allowlist import Policy
from .fast_unpickle import PICKLE_MODULE, FirstTryStopped, Unpickler
from .image_load import Image
from .image_unpickle import unpickle_image
from .numpy_pickles import is_numpy_object
from .refusal import damaged, refused_global

__all__ = ["first_try", "torch_forces_weights_only", "torch_load"]

#: What torch's loader says of a file that names what is not in it (other runtime errors, such
#: as a CUDA storage where CUDA is missing, are the caller's to see in torch's words).
_DAMAGE_WORDS = ("PytorchStreamReader", "zip archive", "does not match expected size",
                 "record size")
_NO_LOCATION = "don't know how to restore data location"
_UNSUPPORTED = re.compile(r"(?:unsupported GLOBAL|Unsupported global: GLOBAL) ([\w.]+)")


def torch_load(
    source: Any, *, map_location: Any, mmap: bool, trusted: bool, globs: list[Any], where: str,
) -> Any:
    """``torch.load`` of ``source`` with the allow-list ``globs`` (see
    :func:`stagesave.safety.safe_torch_load`, whose errors it raises)."""
    try:
        with gc_paused():  # objects by the hundred thousand; see load.load_checkpoint
            return _load(source, map_location, mmap, trusted, globs, where)
    except CheckpointError:
        raise
    except (EOFError, UnicodeDecodeError, MemoryError, RecursionError) as exc:
        raise damaged(where, f"{type(exc).__name__}: {exc}") from exc
    except RuntimeError as exc:
        if _NO_LOCATION in str(exc):
            raise IntegrityError(
                f"cannot load {where}: its storages name a location this torch cannot restore "
                f"({exc}): a device type missing here (load it with map_location='cpu'), or a "
                "damaged file") from exc
        if any(words in str(exc) for words in _DAMAGE_WORDS):
            raise damaged(where, str(exc)) from exc
        raise
    except (KeyError, IndexError, ValueError, TypeError, AttributeError, OverflowError,
            struct.error) as exc:
        # what the unpickler raises on bytes that are not a pickle (another format, garbage)
        raise damaged(where, f"not a torch checkpoint: {type(exc).__name__}: {exc}") from exc


def _load(
    source: Any, map_location: Any, mmap: bool, trusted: bool, globs: list[Any], where: str,
) -> Any:
    if trusted:
        return torch.load(source, map_location=map_location, mmap=mmap, weights_only=False)
    try:
        if torch_forces_weights_only():
            # torch refuses any pickle_module then: its own weights_only unpickler (which admits
            # no numpy of its own accord) with the caller's non-numpy globals.
            user = [g for g in globs if not is_numpy_object(g[0] if isinstance(g, tuple) else g)]
            with torch.serialization.safe_globals(user):
                return torch.load(source, map_location=map_location, mmap=mmap, weights_only=True)
        policy = Policy(globs, where)
        if isinstance(source, Image):  # read and checked already: storages over its buffer
            return unpickle_image(source, map_location, lambda f: Unpickler(
                f, encoding="utf-8", stagesave_policy=policy))
        # torch reads the zip and the storages; every opcode of the pickle runs in Unpickler.
        return torch.load(source, map_location=map_location, mmap=mmap, weights_only=False,
                          pickle_module=PICKLE_MODULE, stagesave_policy=policy)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        text = str(exc)
        m = _UNSUPPORTED.search(text)
        if m is None and "GLOBAL" not in text:
            # Not a refused class: the pickle itself is damaged.
            raise damaged(where, text) from exc
        raise refused_global(where, m.group(1) if m else None) from exc


def first_try(image: Image, *, map_location: Any, globs: list[Any], where: str) -> Any:
    """The image's pickle run by the C unpickler alone over lean storages, which never reads
    their bytes (a load runs it while they are still being read,
    :func:`.image_load.read_image`'s ``early``).

    Raises:
        Exception: whatever made it stop (a global outside its set, a storage torch must
            restore, a damaged pickle...): the caller runs the whole load once every byte is in,
            which judges the file in its own words.
    """
    if torch_forces_weights_only():
        raise FirstTryStopped("torch's own unpickler is forced")
    policy = Policy(globs, where)
    with gc_paused():
        return unpickle_image(image, map_location, lambda f: Unpickler(
            f, encoding="utf-8", stagesave_policy=policy, first_try_only=True),
            validate_sparse=False)


def torch_forces_weights_only() -> bool:
    """Whether ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` makes torch refuse a ``pickle_module``."""
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")

"""What Accelerate's ``load_state`` may read, and how it unpickles, while stagesave restores.

Accelerate reads every file of a checkpoint folder through two functions of
``accelerate.checkpointing``: ``load`` (``torch.load``: optimizer, scheduler, sampler,
dataloader, scaler and RNG states, and custom objects, these with ``weights_only=False``, so a
``custom_checkpoint_<i>.pkl`` can run code) and ``load_model`` (safetensors model weights,
through ``safetensors.torch.load_file``, replaced too).
Rather than re-implement ``load_accelerator_state`` and ``load_custom_state``, stagesave
replaces these module attributes, once, with dispatchers. On a thread inside
:func:`guarded` they read only files the checkpoint's proof lists (a file it does not list
is refused with :class:`~stagesave.IntegrityError`), and they unpickle with
:func:`stagesave.safety.safe_torch_load`: stagesave's safe unpickler with its allow-list
(extended by :func:`stagesave.allow_globals`), or the full unpickler when the user said
``trusted=True``; a file the choice of the checkpoint verified moments ago, unchanged, is
unpickled (a safetensors file: its tensors made) from the bytes that verification read
(:mod:`stagesave.restore.kept_images`), not read again. On every other thread, and outside
:func:`guarded`, they are Accelerate's (and safetensors') own functions, unchanged
(``disable()`` has nothing to undo).

Accelerate catches every error while it restores RNG states (and only logs "Could not load
random states"); a refusal is therefore also recorded, and :func:`guarded` raises it when
Accelerate's method returns.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from stagesave.errors import CheckpointError, IntegrityError, UnsafeCheckpointError
from stagesave.restore import kept_images
from stagesave.restore.safetensors_image import tensors_of
from stagesave.safety import safe_torch_load

__all__ = ["Guard", "guarded", "refuse_unlisted_reads", "unlisted_problem", "unlisted_reads"]

#: Where the dispatchers look for the load in progress on this thread.
_active = threading.local()
_install_lock = threading.Lock()
#: Accelerate's own functions, keyed by attribute name (filled when first installed).
_originals: dict[str, Callable[..., Any]] = {}
#: ``torch.load`` keywords the safe loader honours; ``weights_only`` is decided by ``trusted``.
_KNOWN_KWARGS = {"mmap", "weights_only"}
_TRUST_HINT = (
    " With stagesave.accelerate, allow the class with stagesave.allow_globals(...) before "
    "load_state(), or, if you trust the checkpoint's source completely, pass trusted=True to "
    "stagesave.accelerate.enable() (or set STAGESAVE_ACCELERATE_TRUSTED=1)."
)


@dataclass
class Guard:
    """One ``load_state`` in progress: its folder, what its proof lists, how to unpickle.

    ``names`` are the folder's files as its proof names them (relative, ``/``-separated);
    ``None`` for a plain Accelerate folder, which has no proof to check files against.
    """

    folder: str
    names: frozenset[str] | None
    trusted: bool
    refused: CheckpointError | None = None

    def admit(self, file: Any) -> str:
        """The path to name in messages, once ``file`` may be read.

        Raises:
            IntegrityError: an existing file the proof does not list.
        """
        if not isinstance(file, (str, os.PathLike)):
            return "an in-memory file"
        path = os.fspath(file)
        if self.names is None or not os.path.lexists(path):
            return path  # nothing to check against; a missing file fails as Accelerate's would
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(self.folder))
        rel = rel.replace(os.sep, "/")
        if rel not in self.names:
            raise IntegrityError(
                f"refusing to load {path}: the proof of checkpoint {self.folder} does not list it, "
                "so it is not part of what was saved (someone else put it there). Remove it, or "
                "load another checkpoint."
            )
        return path

    def note(self, exc: CheckpointError) -> CheckpointError:
        if self.refused is None:
            self.refused = exc
        return exc


def _ending(i: int) -> str:
    return f"_{i}" if i else ""


def would_read(accelerator: Any, folder: str, fsdp: bool) -> list[str]:
    """The files Accelerate's ``load_state`` may read from ``folder`` for ``accelerator``, on
    any of its processes, under the conditions ``load_accelerator_state`` reads them
    (Accelerate 1.x's names; under FSDP the models and optimizers are DCP part folders)."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    from ._fsdp import part_names

    acc = accelerator
    out: list[str] = []
    if fsdp:
        out += part_names(acc)
    else:
        for i in range(len(acc._models)):  # Accelerate prefers the safetensors file
            st = f"model{_ending(i)}.safetensors"
            exists = os.path.lexists(os.path.join(folder, st))
            out.append(st if exists else f"pytorch_model{_ending(i)}.bin")
        out += [f"optimizer{_ending(i)}.bin" for i in range(len(acc._optimizers))]
    out += [f"scheduler{_ending(i)}.bin" for i in range(len(acc._schedulers))]
    for i, dl in enumerate(acc._dataloaders):
        if isinstance(getattr(dl, "dataset", None), IterableDatasetShard) and isinstance(
            dl.get_sampler(), SeedableRandomSampler
        ):
            out.append(f"sampler{_ending(i)}.bin")
        if getattr(dl, "use_stateful_dataloader", False):
            out.append(f"dl_state_dict{_ending(i)}.bin")
    if getattr(acc, "scaler", None) is not None:
        out.append("scaler.pt")
    out += [f"random_states_{r}.pkl" for r in range(int(acc.num_processes))]
    # Accelerate counts every custom_checkpoint_<n>.pkl in the folder (and raises, after it
    # restored the rest, when they are more than the registered objects)
    out += [f"custom_checkpoint_{i}.pkl" for i in range(len(acc._custom_objects))]
    with contextlib.suppress(OSError):
        out += sorted(n for n in os.listdir(folder) if _CUSTOM.match(n) and n not in out)
    return out


_CUSTOM = re.compile(r"^custom_checkpoint_\d+\.pkl$")


def unlisted_reads(
    accelerator: Any, folder: str, names: frozenset[str] | None, fsdp: bool,
) -> list[str]:
    """Files in ``folder`` that Accelerate's ``load_state`` would read but the folder's proof
    does not list (files the user keeps beside a checkpoint are fine as long as Accelerate does
    not read them: a ``model.safetensors`` saved beside a checkpoint of ``pytorch_model.bin``
    is, since Accelerate prefers it). The same answer on every process (every rank's RNG file
    is looked at)."""
    if names is None:
        return []
    return [
        rel for rel in would_read(accelerator, folder, fsdp)
        if rel not in names and os.path.lexists(os.path.join(folder, rel))
    ]


def unlisted_problem(rel: str) -> str:
    return (f"cannot be loaded by Accelerate's load_state: it would read {rel}, which the "
            "checkpoint's proof does not list, so it is not part of what was saved (remove it "
            "or move it away)")


def refuse_unlisted_reads(
    accelerator: Any, folder: str, names: frozenset[str] | None, fsdp: bool, shown: str,
) -> None:
    """Before Accelerate restores anything: :func:`unlisted_reads` refused (the choice of the
    checkpoint checked it already on rank 0; this is every process's own look).

    Raises:
        IntegrityError: naming the file; nothing was loaded.
    """
    found = unlisted_reads(accelerator, folder, names, fsdp)
    if found:
        raise IntegrityError(
            f"checkpoint {shown} {unlisted_problem(found[0])}. It was not loaded."
        )


@contextmanager
def guarded(folder: str, names: frozenset[str] | None, trusted: bool) -> Iterator[Guard]:
    """Within the block, Accelerate's loads on this thread go through ``Guard``'s rules.

    Raises:
        CheckpointError: a file was refused, even where Accelerate swallowed the error.
    """
    _install()
    guard = Guard(folder, names, trusted)
    outer = getattr(_active, "guard", None)
    _active.guard = guard
    try:
        yield guard
    finally:
        _active.guard = outer
    if guard.refused is not None:
        raise guard.refused


def _install() -> None:
    # the module Accelerate's load_accelerator_state and load_custom_state look both names up in
    checkpointing = importlib.import_module("accelerate.checkpointing")
    st_torch = importlib.import_module("safetensors.torch")  # where load_model finds load_file
    with _install_lock:
        if _originals:
            return
        for module, name, dispatcher in ((checkpointing, "load", _load),
                                         (checkpointing, "load_model", _load_model),
                                         (st_torch, "load_file", _load_file)):
            _originals[name] = getattr(module, name)
            setattr(module, name, dispatcher)


def _load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``accelerate.checkpointing.load``, through the safe loader inside :func:`guarded`."""
    guard: Guard | None = getattr(_active, "guard", None)
    if guard is None:
        return _originals["load"](f, map_location=map_location, **kwargs)
    unknown = sorted(set(kwargs) - _KNOWN_KWARGS)
    if unknown:
        raise TypeError(
            f"stagesave.accelerate loads checkpoints with its safe loader, which does not take "
            f"load_kwargs {unknown} (it takes mmap; weights_only follows the trusted option)"
        )
    try:
        where = guard.admit(f)
        mmap = bool(kwargs.get("mmap", False))
        # the bytes the choice of this checkpoint verified moments ago, kept in memory
        kept = (kept_images.take(f) if isinstance(f, (str, os.PathLike)) and not mmap
                and not guard.trusted else None)
        return safe_torch_load(kept if kept is not None else f, map_location=map_location,
                               mmap=mmap, trusted=guard.trusted, where=where)
    except UnsafeCheckpointError as exc:
        raise guard.note(UnsafeCheckpointError(f"{exc}{_TRUST_HINT}")) from exc
    except CheckpointError as exc:
        guard.note(exc)
        raise


def _load_model(model: Any, filename: Any, *args: Any, **kwargs: Any) -> Any:
    """``accelerate.checkpointing.load_model`` (safetensors: no code runs), for listed files
    only; a file the choice of this checkpoint verified moments ago, unchanged, is loaded from
    the bytes that verification read (safetensors' ``load_model`` as it is, its ``load_file``
    answered from them by :func:`_load_file`)."""
    guard: Guard | None = getattr(_active, "guard", None)
    if guard is None:
        return _originals["load_model"](model, filename, *args, **kwargs)
    try:
        guard.admit(filename)
    except CheckpointError as exc:
        guard.note(exc)
        raise
    kept = (kept_images.take_safetensors(filename)
            if isinstance(filename, (str, os.PathLike)) else None)
    tensors = tensors_of(kept) if kept is not None else None
    if tensors is None:
        return _originals["load_model"](model, filename, *args, **kwargs)
    _active.tensors = (os.path.realpath(filename), tensors)
    try:
        return _originals["load_model"](model, filename, *args, **kwargs)
    finally:
        _active.tensors = None


def _load_file(filename: Any, device: Any = "cpu", **kwargs: Any) -> Any:
    """``safetensors.torch.load_file``: inside :func:`_load_model` on this thread, for the file
    it loads, the tensors of the bytes verified (moved to ``device``); else safetensors' own."""
    kept = getattr(_active, "tensors", None)
    if (kept is None or not isinstance(filename, (str, os.PathLike))
            or os.path.realpath(filename) != kept[0]):
        return _originals["load_file"](filename, device=device, **kwargs)
    _active.tensors = None  # once
    if str(device) == "cpu":
        return kept[1]
    return {k: v.to(device) for k, v in kept[1].items()}

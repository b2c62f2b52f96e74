"""``load()`` of a safetensors file: its tensors, as ``safetensors.torch.load_file`` gives them.

A folder checkpoint's ``model.safetensors`` (Accelerate's) is a checkpoint file as much as its
torch files, and ``Checkpointer.load`` of it returns what ``safetensors.torch.load_file`` would
(a dict of tensors, the ``__metadata__`` left out), after the file's bytes are checked against
its proof when it has one. No pickle runs: nothing in a safetensors file is code. The tensors
are views of one buffer the file was read into (no second copy), made by
:func:`.safetensors_image.tensors_of` where the header is one it reads; safetensors' own
parser judges the rest.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UsageError
from ..ondisk.manifest import Manifest
from ..stores.base import Reader
from .refusal import damaged
from .safetensors_image import MAX_HEADER, SafetensorsImage, tensors_of

__all__ = ["is_safetensors", "tensors"]


def is_safetensors(reader: Reader, manifest: Manifest | None) -> bool:
    """Whether the file is a safetensors file: its proof says so, or (no proof) its first bytes
    are a header length of at most :data:`MAX_HEADER` followed by a JSON object (the header may
    be cut short: :func:`tensors` says so)."""
    if manifest is not None:
        return bool(manifest.files) and manifest.files[0].kind == "safetensors"
    head = reader.read(0, 9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return 2 <= int.from_bytes(head[:8], "little") <= MAX_HEADER


def tensors(view: memoryview, where: str, map_location: Any) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file whose bytes are ``view`` (read, and checked where it
    has a proof), placed by ``map_location``.

    Raises:
        IntegrityError: the file is not one safetensors reads (or is cut short).
        UsageError: ``map_location`` is not a device, a dict or a function.
        RuntimeError: the device cannot take the tensors (e.g. no CUDA here).
    """
    n = int.from_bytes(view[:8], "little") if len(view) >= 8 else 0
    if 8 + n > len(view):
        raise damaged(where, f"a safetensors file cut short: its header says {n:,} bytes, "
                             f"{max(0, len(view) - 8):,} follow")
    out = tensors_of(SafetensorsImage(view, where))
    if out is None:
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            out = load(bytes(view))
        except (SafetensorError, ValueError, TypeError, KeyError, OverflowError,
                RuntimeError) as exc:
            raise damaged(where, f"not a safetensors file: {type(exc).__name__}: {exc}") from exc
    return _placed(out, map_location, where)


def _placed(out: dict[str, torch.Tensor], map_location: Any,
            where: str) -> dict[str, torch.Tensor]:
    """The tensors where ``map_location`` puts what is read on the CPU: as ``torch.load`` puts
    a storage saved from the CPU (a device or its name; a dict's entry for ``"cpu"``; a
    function given each tensor's storage and ``"cpu"``)."""
    if map_location is None:
        return out
    if callable(map_location) and not isinstance(map_location, (str, torch.device, dict)):
        placed = {}
        for name, t in out.items():
            # each tensor's own storage (its view's spans the whole file)
            own = t.clone() if t.untyped_storage().nbytes() != t.nbytes else t
            mine = own.untyped_storage()
            storage = map_location(mine, "cpu")
            if storage is None or (storage.device == mine.device
                                   and storage.data_ptr() == mine.data_ptr()):
                placed[name] = t  # left where it is
                continue
            if storage.nbytes() < mine.nbytes():
                raise UsageError(f"cannot load {where}: map_location gave tensor {name!r} a "
                                 f"storage of {storage.nbytes()} bytes for its {mine.nbytes()}")
            placed[name] = torch.empty(0, dtype=t.dtype, device=storage.device).set_(
                storage, own.storage_offset(), own.size(), own.stride())
        return placed
    target = map_location
    if isinstance(map_location, dict):
        target = map_location.get("cpu", map_location.get(torch.device("cpu")))
        if target is None:
            return out
    try:
        device = torch.device(target)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"cannot load {where}: map_location={map_location!r} is not a "
                         f"device ({exc})") from exc
    if device == torch.device("cpu"):
        return out
    try:
        return {name: t.to(device) for name, t in out.items()}
    except (AssertionError, RuntimeError) as exc:  # (torch built without CUDA: an assertion)
        raise RuntimeError(f"cannot load {where} onto {device}: {exc}") from exc

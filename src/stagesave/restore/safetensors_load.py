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
    are a header length within the file followed by a JSON object."""
    if manifest is not None:
        return bool(manifest.files) and manifest.files[0].kind == "safetensors"
    head = reader.read(0, 9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= MAX_HEADER and 8 + n <= reader.size


def tensors(view: memoryview, where: str, map_location: Any) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file whose bytes are ``view`` (read, and checked where it
    has a proof), placed by ``map_location``.

    Raises:
        IntegrityError: the file is not one safetensors reads.
        UsageError: ``map_location`` is a function (it maps torch storages' saved locations,
            which a safetensors file has none of).
    """
    device = _device(map_location, where)
    out = tensors_of(SafetensorsImage(view, where))
    if out is None:
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            out = load(bytes(view))
        except (SafetensorError, ValueError, TypeError, OverflowError, RuntimeError) as exc:
            raise damaged(where, f"not a safetensors file: {exc}") from exc
    if device is not None and device != torch.device("cpu"):
        out = {name: t.to(device) for name, t in out.items()}
    return out


def _device(map_location: Any, where: str) -> torch.device | None:
    """Where the tensors go: a device, a device's name, or a dict's entry for ``cpu`` (where a
    safetensors file's tensors are read)."""
    if map_location is None:
        return None
    if isinstance(map_location, dict):
        target = map_location.get("cpu", map_location.get(torch.device("cpu"), None))
        return None if target is None else torch.device(target)
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise UsageError(
        f"cannot load {where} with map_location={map_location!r}: a safetensors file's "
        "tensors are read on the CPU; give a device (or its name), or move them with .to()"
    )

"""What a file of a directory checkpoint holds: a torch state (default) or safetensors."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .saving.fastplan import plan as plan_torch_file
from .saving.plan import FileImage
from .saving.plan_safetensors import ProofRoom, plan_safetensors_file

__all__ = ["Raw", "Safetensors", "plan_file"]


def _not_pickled(kind: str) -> TypeError:
    return TypeError(
        f"{kind}(...) is a file of a folder checkpoint: give it to save_dir "
        f"({{'name': {kind}(...), ...}}, folder), not inside a torch state (pickled, it would "
        "load only as a stagesave class)"
    )


@dataclass(frozen=True)
class Safetensors:
    """Save these tensors as a safetensors file (``safetensors.torch.load_file`` reads it)."""

    tensors: Mapping[str, torch.Tensor]
    metadata: Mapping[str, str] | None = None

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _not_pickled("Safetensors")

    def __copy__(self) -> Safetensors:
        return Safetensors(self.tensors, self.metadata)

    def __deepcopy__(self, memo: dict[int, Any]) -> Safetensors:
        return Safetensors(copy.deepcopy(self.tensors, memo), copy.deepcopy(self.metadata, memo))


@dataclass(frozen=True)
class Raw:
    """Write these bytes verbatim (a ``config.json``, a tokenizer file, ...)."""

    data: bytes

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _not_pickled("Raw")

    def __copy__(self) -> Raw:
        return Raw(self.data)

    def __deepcopy__(self, memo: dict[int, Any]) -> Raw:
        return Raw(copy.deepcopy(self.data, memo))


def plan_file(obj: Any, *, proof_room: ProofRoom | None = None,
              plan_torch: Callable[[Any], FileImage] = plan_torch_file) -> tuple[str, FileImage]:
    """``(kind, image)`` for one file's content (``proof_room``: for safetensors files;
    ``plan_torch``: what plans a torch state, e.g. a reused plan's cache)."""
    if isinstance(obj, Raw):
        data = bytes(obj.data)
        return "raw", FileImage(size=len(data), pieces=[(0, data)] if data else [], slots=[],
                                serialization_id="", id_offset=0, kind="raw")
    if isinstance(obj, Safetensors):
        return "safetensors", plan_safetensors_file(
            obj.tensors, obj.metadata, proof_room=proof_room
        )
    return "torch", plan_torch(obj)

"""What a local plan's items are made from: the steady planner's signature of a flat state.

``create_default_local_save_plan`` makes one item per value from its key and, for a tensor, its
dtype, size, layout, ``requires_grad`` and pinning (a ``DTensor``: its spec and local shard,
:mod:`._dtensor_items`). :func:`signature` lists what of that a plan depends on besides the
plain tensors' own facts (:func:`facts`, which torch's compiled check compares apart,
:mod:`stagesave.saving.tensor_guard`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..saving import tensor_guard
from ._dtensor_items import dtensor_key, local_shard

__all__ = ["facts", "signature"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def signature(state_dict: dict[str, Any],
              is_coordinator: bool) -> tuple[list[Any], list[torch.Tensor]] | None:
    """What ``create_default_local_save_plan`` makes its items from, per key in order, but the
    strided plain tensors' own facts (:func:`facts`, compared apart), and those tensors;
    ``None`` when the state holds a tensor other than a plain one (its items depend on more)
    or a nested one."""
    out: list[Any] = [is_coordinator]
    tensors: list[torch.Tensor] = []
    note, note_tensor = out.append, tensors.append
    # Without an accelerator no memory can be pinned (torch refuses to pin): is_pinned() is
    # False for every tensor then, and costs ~0.6 µs a tensor to ask.
    pinnable = torch.accelerator.is_available()
    grad = torch.is_grad_enabled()
    for fqn, obj in state_dict.items():
        kind = type(obj)
        if kind in _PLAIN and tensor_guard.checkable(obj):
            note((fqn, pinnable and obj.is_pinned()))
            note_tensor(obj)
        elif (local := local_shard(obj)) is not None:
            note(dtensor_key(fqn, obj, local, pinnable, grad))
            note_tensor(local)
        elif kind in _PLAIN and not obj.is_nested:  # sparse: its facts read here
            note((fqn, pinnable and obj.is_pinned(), obj.dtype, obj.shape, obj.layout,
                  obj.requires_grad))
        elif isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
            return None
        else:
            note(fqn)
    return out, tensors


def facts(tensors: list[torch.Tensor]) -> list[Any]:
    """The rest of what a plain tensor's write item is made from: dtype, size, layout,
    ``requires_grad`` (~2 µs a tensor read in Python; a reused plan's tensors are checked by
    torch's compiled check, :mod:`stagesave.saving.tensor_guard`, where it can tell)."""
    return [(t.dtype, t.shape, t.layout, t.requires_grad) for t in tensors]



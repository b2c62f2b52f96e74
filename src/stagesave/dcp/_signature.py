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
from torch.distributed.tensor import DTensor

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
    strided, plain, dtensor = torch.strided, _PLAIN, DTensor
    for fqn, obj in state_dict.items():
        kind = type(obj)
        if kind in plain:
            if obj.layout is strided and not obj.is_nested:  # tensor_guard.checkable
                note((fqn, pinnable and obj.is_pinned()))
                note_tensor(obj)
            elif not obj.is_nested:  # sparse: its facts read here
                note((fqn, pinnable and obj.is_pinned(), obj.dtype, obj.shape, obj.layout,
                      obj.requires_grad))
            else:
                return None
        elif kind is dtensor:  # _dtensor_items.local_shard, inline; its key
            local = obj._local_tensor
            if type(local) not in plain or local.layout is not strided or local.is_nested:
                return None
            note((fqn, pinnable and local.is_pinned(), (obj._spec, grad and obj.requires_grad)))
            note_tensor(local)
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

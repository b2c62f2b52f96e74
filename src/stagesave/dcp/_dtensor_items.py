"""What a ``DTensor``'s write item is made from, for the steady planner (FSDP2, tensor
parallel: every value of a sharded state is one).

DCP makes a ``DTensor``'s item (``_create_write_items_for_dtensor``) from its key, its spec
(device mesh, placements, global shape: where this rank's shard sits) and its local shard's
properties as ``to_local()`` gives them (dtype, layout, pinning, and ``requires_grad`` where
grad mode is on): ~60 µs per tensor, at every save. A ``DTensor`` whose spec is the same object
or equal, and whose local shard has the same facts (checked with the state's plain tensors),
gets the same item. Only a plain ``DTensor`` over a plain strided local tensor, without
``Partial`` placements, is handled here; anything else leaves the local plan to DCP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial

from ..saving import tensor_guard

__all__ = ["dtensor_key", "local_shard"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def local_shard(obj: Any) -> torch.Tensor | None:
    """The plain strided local tensor of a plain ``DTensor`` without ``Partial`` placements
    (the data of its write item: ``to_local()`` is a view of it), else ``None``."""
    if type(obj) is not DTensor:
        return None
    local = obj._local_tensor
    if type(local) not in _PLAIN or not tensor_guard.checkable(local):
        return None
    if any(isinstance(p, Partial) for p in obj._spec.placements):
        return None
    return local


def dtensor_key(fqn: str, obj: Any, local: torch.Tensor, pinnable: bool) -> tuple[Any, ...]:
    """The key of a ``DTensor`` (its :func:`local_shard` is ``local``) in the planner's
    signature: what its item is made from besides the local shard's own facts (compared with
    the plain tensors')."""
    requires_grad = obj.requires_grad and torch.is_grad_enabled()  # to_local()'s, as DCP sees it
    return fqn, pinnable and local.is_pinned(), (obj._spec, requires_grad)

"""What a ``DTensor``'s write item is made from, for the steady planner (FSDP2, tensor
parallel: every value of a sharded state is one).

DCP makes a ``DTensor``'s item (``_create_write_items_for_dtensor``) from its key, its spec
(device mesh, placements, global shape: where this rank's shard sits) and its local shard's
properties as ``to_local()`` gives them (dtype, layout, pinning, and ``requires_grad`` where
grad mode is on): ~60 µs per tensor, at every save. A ``DTensor`` whose spec is the same object
or equal, and whose local shard has the same facts (checked with the state's plain tensors),
gets the same item (its key in the planner's signature, :func:`._signature.signature`: the
key, the pinning, the spec and ``requires_grad`` where grad mode is on). Only a plain
``DTensor`` over a plain strided local tensor is handled; anything else leaves the local plan
to DCP. A ``DTensor`` with ``Partial`` placements is not told apart: its spec matches no kept
plan (DCP refused to plan it: its first local plan is DCP's, which raises), and only a kept
plan's items are resolved to local shards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..saving import tensor_guard

__all__ = ["local_shard"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def local_shard(obj: Any) -> torch.Tensor | None:
    """The plain strided local tensor of a plain ``DTensor`` (the data of its write item:
    ``to_local()`` is a view of it), else ``None``."""
    if type(obj) is not DTensor:
        return None
    local = obj._local_tensor
    if type(local) not in _PLAIN or not tensor_guard.checkable(local):
        return None
    return local

"""Bounds of a rank file's size before DCP plans it (the staging buffer made ahead of a sharded
save, :class:`.StagedStorageWriter`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["rank_bounds", "world_size"]

_Tensor = torch.Tensor
_STRIDED = torch.strided


#: Bytes around one tensor item's data in a rank file, at most (its zip's headers, pickle and
#: central directory, ~1.6 KB, and the padding to the next aligned item); a byte item's guess.
_ITEM_ROOM = 2048
_BLOB_ROOM = 4096


def rank_bounds(state: dict[str, Any], world: int) -> tuple[int, int]:
    """Bounds of a rank file's size from the rank's flattened state, before DCP plans it: the
    bytes of each tensor this rank holds a part of (a ``DTensor``'s local shard), the bytes of
    whole tensors divided among ``world`` ranks (DCP gives a tensor every rank holds, as
    data-parallel replicas do, to one of them), and room for each item's zip. A rank that writes
    more regrows its buffer when it leases it."""
    own = whole = tensors = blobs = 0
    for value in state.values():
        kind = type(value)
        if kind is _Tensor or kind is torch.nn.Parameter:
            # (a sparse tensor has no nbytes: its sharded save is refused when it is laid out)
            whole += value.nbytes if value.layout is _STRIDED else 0
            tensors += 1
        elif isinstance(value, _Tensor):
            local = getattr(value, "_local_tensor", None)  # a DTensor's shard on this rank
            own += local.nbytes if isinstance(local, _Tensor) else 0
            tensors += 1
        else:
            blobs += 1
    least = own + whole // max(1, world) + _ITEM_ROOM * tensors + _BLOB_ROOM * blobs
    return least, least + least // 8 + (1 << 20)


def world_size() -> int:
    """The default process group's size (1 without one): :func:`rank_bounds`'s ``world``."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

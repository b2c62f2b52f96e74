"""About how large a checkpoint of some tensors will be: the size of the staging buffer a
training run can make before its first save (:meth:`stagesave.Checkpointer.prepare_buffer`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..ondisk.names import ALIGNMENT

__all__ = ["checkpoint_bytes"]

#: Room per tensor for its pickle and its entry in the file's proof.
PER_TENSOR = 512
#: Room for what is not a tensor (the rest of the pickle, the proof's header, small files).
FIXED = 1 << 20


def checkpoint_bytes(values: Iterable[Any]) -> int:
    """About the size of the checkpoint of ``values`` (the tensors among them count; anything
    else is left to :data:`FIXED`): each storage once, with room for its record's header,
    padded to :data:`~stagesave.ondisk.names.ALIGNMENT`, plus :data:`PER_TENSOR` per tensor
    and :data:`FIXED`. An over-estimate of a few per cent is meant: a buffer too small is made
    again by the save (the buffer grows in 64 MiB steps anyway).

    Raises:
        NotImplementedError: a tensor without storage (sparse) cannot be measured.
    """
    storages: dict[int, int] = {}
    tensors = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            s = value.untyped_storage()
            storages[s._cdata] = s.nbytes()
            tensors += 1
    pad = ALIGNMENT - 1 + 128  # up to a page of padding before a record, and its zip header
    return (sum((n + pad) // ALIGNMENT * ALIGNMENT for n in storages.values())
            + PER_TENSOR * tensors + FIXED)

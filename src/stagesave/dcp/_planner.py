"""Replicated state written once, by every rank in parallel.

DCP's default planner already writes each replicated item once: every rank proposes every plain
tensor and non-tensor value, and the coordinator's ``dedup_save_plans`` keeps each item on the
rank whose plan is smallest so far, which spreads whole items across ranks. A single large
replicated tensor (an embedding table under DDP) still lands on one rank, which then writes it
alone while the others idle. :class:`SplitReplicatedPlanner` cuts such tensors into row blocks
before planning; the blocks are ordinary chunks of one tensor in DCP's metadata (exactly like a
row-sharded tensor), so the same dedup spreads them over the ranks and any reader, torch's own
included, reassembles them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

__all__ = ["SplitReplicatedPlanner"]

#: Replicated tensors at least this large are split by default.
DEFAULT_SPLIT_BYTES = 16 * 1024 * 1024


class SplitReplicatedPlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that splits large replicated tensors so every rank writes a part.

    Args:
        split_bytes: Plain (non-DTensor) tensors of at least this many bytes are cut into row
            blocks along their first dimension.
        pieces: Blocks per tensor; default: the world size of the default process group.
        **kwargs: ``DefaultSavePlanner`` arguments (plan caching is refused: each save's plan
            must be fresh for the staged writer anyway).

    Raises:
        ValueError: ``split_bytes`` or ``pieces`` is not positive, or plan caching was requested.
    """

    def __init__(
        self, split_bytes: int = DEFAULT_SPLIT_BYTES, pieces: int | None = None, **kwargs: Any,
    ) -> None:
        if kwargs.get("enable_plan_caching"):
            raise ValueError("SplitReplicatedPlanner does not support enable_plan_caching=True")
        if split_bytes < 1:
            raise ValueError(f"split_bytes must be >= 1, got {split_bytes}")
        if pieces is not None and pieces < 1:
            raise ValueError(f"pieces must be >= 1, got {pieces}")
        super().__init__(**kwargs)
        self.split_bytes = split_bytes
        self.pieces = pieces
        self._blocks: dict[MetadataIndex, tuple[int, int]] = {}

    def _piece_count(self) -> int:
        if self.pieces is not None:
            return self.pieces
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return 1

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        pieces = self._piece_count()
        self._blocks = {}
        if pieces <= 1:
            return plan
        items: list[WriteItem] = []
        for item in plan.items:
            td = item.tensor_data
            if (
                item.type == WriteItemType.TENSOR
                and td is not None
                and len(td.size) >= 1
                and td.size[0] >= 2
                and (item.tensor_storage_size() or 0) >= self.split_bytes
            ):
                items.extend(self._split(item, td, pieces))
            else:
                items.append(item)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _split(self, item: WriteItem, td: TensorWriteData, pieces: int) -> list[WriteItem]:
        rows = td.size[0]
        count = min(pieces, rows)
        per, extra = divmod(rows, count)
        out = []
        start = 0
        for j in range(count):
            n = per + (1 if j < extra else 0)
            offsets = torch.Size([start, *([0] * (len(td.size) - 1))])
            sizes = torch.Size([n, *td.size[1:]])
            index = MetadataIndex(item.index.fqn, offsets)
            self._blocks[index] = (start, n)
            out.append(WriteItem(
                index=index,
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=td.properties, size=td.size,
                ),
            ))
            start += n
        return out

    def lookup_object(self, index: MetadataIndex) -> Any:
        block = self._blocks.get(index)
        if block is not None:
            start, n = block
            return self.state_dict[index.fqn].narrow(0, start, n)
        return super().lookup_object(index)

"""Coordination between processes, on the training thread only.

A stagesave folder is committed whole by one writer, so the small per-process pieces (RNG
states) travel to the writer and the choice of checkpoint to resume from travels from rank 0 to
everyone. Both are object collectives on the calling (training) thread, inside ``save_state`` and
``load_state`` where Accelerate itself synchronises processes. The background writer never runs
a collective or a torch op: either would switch libgomp's workers to passive waiting and slow
training for as long as the thread lives (see DESIGN.md).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["barrier", "broadcast_from_main", "distributed", "gather_to_writers"]


def distributed() -> bool:
    """Whether a default process group with more than one process is up."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def gather_to_writers(obj: Any, rank: int, everywhere: bool) -> dict[int, Any]:
    """Every process's ``obj`` keyed by rank: on rank 0 only, or on all when ``everywhere``.

    Processes that receive nothing get ``{}``.
    """
    if not distributed():
        return {rank: obj}
    world = torch.distributed.get_world_size()
    if everywhere:
        out: list[Any] = [None] * world
        torch.distributed.all_gather_object(out, (rank, obj))
        return dict(out)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    torch.distributed.gather_object((rank, obj), gathered, dst=0)
    return dict(gathered) if gathered is not None else {}


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's ``obj`` on every process."""
    if not distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait for every process (no-op in a single process)."""
    if distributed():
        torch.distributed.barrier()

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


def distributed(num_processes: int) -> bool:
    """Whether Accelerate runs ``num_processes`` > 1 over an initialized default process group.

    Accelerate's own view decides: a process it treats as alone (``num_processes == 1``) is
    alone for stagesave too, whatever torch.distributed holds.
    """
    return (
        num_processes > 1
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    )


def gather_to_writers(obj: Any, rank: int, num_processes: int, everywhere: bool) -> dict[int, Any]:
    """Every process's ``obj`` keyed by rank: on rank 0 only, or on all when ``everywhere``.

    Processes that receive nothing get ``{}``.
    """
    if not distributed(num_processes):
        return {rank: obj}
    if everywhere:
        out: list[Any] = [None] * num_processes
        torch.distributed.all_gather_object(out, (rank, obj))
        return dict(out)
    gathered: list[Any] | None = [None] * num_processes if rank == 0 else None
    torch.distributed.gather_object((rank, obj), gathered, dst=0)
    return dict(gathered) if gathered is not None else {}


def broadcast_from_main(obj: Any, num_processes: int) -> Any:
    """Rank 0's ``obj`` on every process."""
    if not distributed(num_processes):
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def barrier(num_processes: int) -> None:
    """Wait for every process (no-op in a single process)."""
    if distributed(num_processes):
        torch.distributed.barrier()
